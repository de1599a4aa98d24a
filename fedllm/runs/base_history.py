"""The changes a strategy makes to the frozen base, kept as a snapshot plus an append-only log of low-rank merges.

FRLoRA (and v2/v3), the FedLoRU family, FedEx-LoRA and FLoRA change the LoRA-wrapped base weights (or, on a
4/8-bit or half-precision base, an fp32 residual beside them) every round by a low-rank product: FRLoRA's
``s·B̄Ā − s·B_next A_next``, FedLoRU's ``s·BA``, FLoRA's stacked ``s·B_stack A_stack``, FedEx-LoRA's
``Σ_k p_k·s·B_k A_k − s·B̄Ā``. A checkpoint (server or Flower node) does not carry the dense result but

- ``base.safetensors`` (or ``base-residual.safetensors`` for residuals): a dense snapshot of the targets,
  keyed as before (``<module>.base_layer.weight``; ``residual/<module>``), shared between checkpoints by a
  hard link (it is written again only when the log since it would outgrow it, or at ``final/``);
- ``base-log-NNNN.safetensors``: segments of the log since the snapshot, one per save, each holding the
  factors of the merges made since the previous save (a factor repeated across merges, e.g. FRLoRA's
  ``(B0, A0)``, is stored once), the older segments hard-linked from the previous checkpoint;
- ``base-history.json``: which snapshot and segments, and the mode (``merge``: the base weights; ``dense``:
  the fp32 residuals).

Every file is listed in the checkpoint's sha256 manifest; a hard-linked file keeps the hash it was written
with, so damage to a shared file is named in every checkpoint that holds it.

Exactness: a merge is a :class:`LowRankMerge` (terms ``(B, A, c)``); its dense change is computed by one
function, :meth:`LowRankMerge.delta` (``Σ_j (B_j.float() @ A_j.float()) · c_j`` in fp32, left to right, on
the target's device), and applied by one function, :func:`apply_` (``W ← (W.float() + Δ).to(W.dtype)``), both
live and on replay, so the rebuilt base is bit for bit the live one. A change that is not low-rank can be
logged as a dense entry (:attr:`LowRankMerge.dense`); no strategy here needs one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

INDEX = "base-history.json"
SNAPSHOTS = {"merge": "base.safetensors", "dense": "base-residual.safetensors"}
SEGMENT = "base-log-{:04d}.safetensors"


@dataclass
class LowRankMerge:
    """One layer's change ``Σ_j c_j · B_j A_j`` (or a dense ``out × in`` matrix when ``dense`` is given)."""

    terms: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)
    dense: Optional[torch.Tensor] = None

    def delta(self, device: Any) -> torch.Tensor:
        """The dense change in fp32 on ``device``: each ``(B.float() @ A.float()) · c``, summed left to right."""
        if self.dense is not None:
            return self.dense.detach().to(device, torch.float32)
        out = None
        for b, a, coef in self.terms:
            p = (b.detach().to(device).float() @ a.detach().to(device).float()) * coef
            out = p if out is None else out + p
        if out is None:
            raise ValueError("a merge without terms")
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.dense] if self.dense is not None else [t for b, a, _ in self.terms for t in (b, a)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def detached(self) -> LowRankMerge:
        """A CPU copy (what the log keeps; a meta-device merge of a dry run stays on the meta device)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if t.is_meta else t.detach().cpu().clone()

        if self.dense is not None:
            return LowRankMerge(dense=copy(self.dense))
        return LowRankMerge([(copy(b), copy(a), float(c)) for b, a, c in self.terms])


@torch.no_grad()
def apply_(target: torch.Tensor, merge: LowRankMerge) -> None:
    """``target ← target + Δ``: the sum taken in fp32 (on the target's device), stored in the target's dtype."""
    delta = merge.delta(target.device)
    if delta.shape != target.shape:
        raise ValueError(f"update shape {tuple(delta.shape)} vs target {tuple(target.shape)}")
    target.copy_((target.float() + delta).to(target.dtype))


def _tensor_id(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(raw.numpy().tobytes())
    return digest.hexdigest()[:32]


# ----- merges as a flat tensor dict (what a Flower catch-up carries)
def merges_to_state(merges: list[tuple[str, LowRankMerge]], prefix: str = "merge/") -> dict[str, torch.Tensor]:
    """``[(target key, merge), ...]`` as tensors ``<prefix><i>/<key>/<j>/{B,A,coef}`` (coefficients as the int64
    bits of a float64, so that no cast to a wire dtype can round them)."""
    state = {}
    for i, (key, merge) in enumerate(merges):
        if merge.dense is not None:
            state[f"{prefix}{i:05d}/{key}/dense"] = merge.dense
            continue
        for j, (b, a, coef) in enumerate(merge.terms):
            state[f"{prefix}{i:05d}/{key}/{j:03d}/B"] = b
            state[f"{prefix}{i:05d}/{key}/{j:03d}/A"] = a
            state[f"{prefix}{i:05d}/{key}/{j:03d}/coef"] = torch.tensor([coef], dtype=torch.float64).view(torch.int64)
    return state


def merges_from_state(state: dict[str, torch.Tensor], prefix: str = "merge/") -> list[tuple[str, LowRankMerge]]:
    """Inverse of :func:`merges_to_state` (keys without ``prefix`` are ignored)."""
    grouped: dict[int, tuple[str, dict]] = {}
    for name, value in state.items():
        if not name.startswith(prefix):
            continue
        i, rest = name[len(prefix):].split("/", 1)
        if rest.endswith("/dense"):
            grouped.setdefault(int(i), (rest[:-len("/dense")], {}))[1]["dense"] = value
            continue
        key, j, part = rest.rsplit("/", 2)
        grouped.setdefault(int(i), (key, {}))[1].setdefault(int(j), {})[part] = value
    out = []
    for i in sorted(grouped):
        key, parts = grouped[i]
        if "dense" in parts:
            out.append((key, LowRankMerge(dense=parts["dense"])))
            continue
        out.append((key, LowRankMerge([(parts[j]["B"], parts[j]["A"], float(parts[j]["coef"].view(torch.float64)[0]))
                                       for j in sorted(parts)])))
    return out


# ----- a stored history (read side)
class StoredHistory:
    """The base history of one checkpoint directory (read lazily; the manifest was checked by the caller)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        try:
            index = json.loads((self.directory / INDEX).read_text())
            self.mode: str = index["mode"]
            self.snapshot: str = index["snapshot"]
            self.segments: list[str] = list(index["segments"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.directory / INDEX}: unreadable base history ({e})") from None
        if self.mode not in SNAPSHOTS:
            raise ValueError(f"{self.directory / INDEX}: mode {self.mode!r}; expected one of {sorted(SNAPSHOTS)}")
        self.entries: list[tuple[int, str, list, Optional[str]]] = []
        self.where: dict[str, str] = {}  # tensor id -> segment file
        for name in self.segments:
            with safe_open(str(self.directory / name), "pt") as f:
                for entry in json.loads((f.metadata() or {}).get("entries", "[]")):
                    self.entries.append(tuple(entry))
                self.where.update({k: name for k in f.keys()})
        self.log_bytes = sum((self.directory / name).stat().st_size for name in self.segments)
        self.snapshot_bytes = (self.directory / self.snapshot).stat().st_size

    def keys(self) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(self.directory / self.snapshot), "pt") as f:
            snap = list(f.keys())
        return snap + sorted({key for _, key, _, _ in self.entries} - set(snap))

    def _tensor(self, tid: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.directory / self.where[tid]), "pt") as f:
            return f.get_tensor(tid)

    def merges(self, key: str) -> list[LowRankMerge]:
        """The logged merges of target ``key``, in the order they were made."""
        out = []
        for _, k, terms, dense in self.entries:
            if k != key:
                continue
            out.append(LowRankMerge(dense=self._tensor(dense)) if dense is not None else
                       LowRankMerge([(self._tensor(b), self._tensor(a), float(c)) for b, a, c in terms]))
        return out

    def rebuild(self, key: str, device: Any = "cpu", like: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Target ``key`` now: the snapshot's value (zeros of ``like``'s shape in fp32 when the snapshot has none,
        a residual not yet made) on ``device``, with every logged merge replayed on it."""
        from safetensors import safe_open

        with safe_open(str(self.directory / self.snapshot), "pt") as f:
            value = f.get_tensor(key).to(device) if key in f.keys() else None
        merges = self.merges(key)
        if value is None:
            if like is None and not merges:
                raise KeyError(key)
            shape = like.shape if like is not None else merges[0].delta("cpu").shape
            value = torch.zeros(shape, dtype=torch.float32, device=device)
        for merge in merges:
            apply_(value, merge)
        return value

    def manifest_entries(self) -> dict[str, Any]:
        """This checkpoint's manifest entries of the history's files (None when they cannot be read)."""
        try:
            files = json.loads((self.directory / "manifest.json").read_text())["files"]
            return {name: files[name] for name in [self.snapshot, *self.segments]}
        except (OSError, ValueError, KeyError, TypeError):
            return {}


def load_base(directory: Path) -> dict[str, torch.Tensor]:
    """The dense targets (base weights or residuals) a checkpoint holds, rebuilt on the CPU: its
    ``base.safetensors`` as it is for a checkpoint without a base history (older format)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / INDEX).is_file():
        path = directory / "base.safetensors"
        return load_file(str(path)) if path.is_file() else {}
    stored = StoredHistory(directory)
    return {key: stored.rebuild(key) for key in stored.keys()}


# ----- the live history (write side)
class BaseHistory:
    """The log of merges made since the snapshot on disk, and where that snapshot and log are.

    Args:
        mode: ``merge`` (targets are base weights) or ``dense`` (fp32 residuals).
        targets: returns the current targets ``{key: tensor}`` (what a fresh snapshot holds).
        snapshot_bytes: the size of a dense snapshot (bounds the log kept in memory and on disk).
    """

    def __init__(self, mode: str, targets: Callable[[], dict[str, torch.Tensor]], snapshot_bytes: int):
        if mode not in SNAPSHOTS:
            raise ValueError(f"mode {mode!r}; expected one of {sorted(SNAPSHOTS)}")
        self.mode = mode
        self.targets = targets
        self.snapshot_bytes = snapshot_bytes
        self.pending: list[tuple[int, str, LowRankMerge]] = []  # merges not yet in a checkpoint
        self.last: tuple[int, list[tuple[str, LowRankMerge]]] = (-1, [])  # the newest round's merges
        self.stale = False  # pending merges were dropped: the next save writes a snapshot
        self.snapshot_next = False  # the next save writes a snapshot (``final/``)
        self.on_disk: Optional[StoredHistory] = None  # the newest checkpoint holding this history

    # ----- recording
    def record(self, rnd: int, key: str, merge: LowRankMerge) -> None:
        """Log that ``merge`` was applied to target ``key`` in round ``rnd`` (0: at setup)."""
        merge = merge.detached()
        if self.last[0] != rnd:
            self.last = (rnd, [])
        self.last[1].append((key, merge))
        if self.stale:
            return
        self.pending.append((rnd, key, merge))
        held = self.on_disk.log_bytes if self.on_disk is not None else 0
        if held + sum(m.nbytes for _, _, m in self.pending) > self.snapshot_bytes:
            self.pending, self.stale = [], True  # a snapshot is smaller than the log: write one next

    def round_merges(self, rnd: int) -> list[tuple[str, LowRankMerge]]:
        """The merges of round ``rnd`` (only the newest round's are kept)."""
        if self.last[0] != rnd:
            return []
        return list(self.last[1])

    # ----- saving into a checkpoint
    def write(self, directory: Path) -> dict[str, Any]:
        """Write the history into the (temporary) checkpoint ``directory``: link the snapshot and segments of the
        previous checkpoint and append a segment of the pending merges, or write a fresh snapshot.

        Returns:
            The manifest entries of the linked files (they keep the hashes they were written with).
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        snapshot = SNAPSHOTS[self.mode]
        linked = self._link(directory) if not (self.stale or self.snapshot_next) else None
        if linked is None:
            save_file({k: v.detach().contiguous().cpu() for k, v in self.targets().items()}, str(directory / snapshot))
            segments, linked = [], {}
        else:
            segments = list(self.on_disk.segments)
            if self.pending:
                name = SEGMENT.format(len(segments) + 1)
                self._write_segment(directory / name, set(self.on_disk.where))
                segments.append(name)
        index = {"version": 1, "mode": self.mode, "snapshot": snapshot, "segments": segments}
        (directory / INDEX).write_text(json.dumps(index, indent=1))
        return linked

    def _link(self, directory: Path) -> Optional[dict[str, Any]]:
        """Hard-link the previous checkpoint's snapshot and segments (None: write a fresh snapshot instead)."""
        old = self.on_disk
        if old is None or old.mode != self.mode:
            return None
        pending = sum(m.nbytes for _, _, m in self.pending)
        if old.log_bytes + pending > old.snapshot_bytes:
            return None  # the log would outgrow the snapshot
        entries = old.manifest_entries()
        if set(entries) != {old.snapshot, *old.segments}:
            return None
        try:
            for name in entries:
                os.link(old.directory / name, directory / name)
        except OSError:  # the previous checkpoint is gone, or another file system: start afresh
            for name in entries:
                (directory / name).unlink(missing_ok=True)
            return None
        return entries

    def _write_segment(self, path: Path, known: set[str]) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        entries = []

        def keep(t: torch.Tensor) -> str:
            tid = _tensor_id(t)
            if tid not in known and tid not in tensors:
                tensors[tid] = t.detach().contiguous().cpu()
            return tid

        for rnd, key, merge in self.pending:
            if merge.dense is not None:
                entries.append([rnd, key, [], keep(merge.dense)])
            else:
                entries.append([rnd, key, [[keep(b), keep(a), c] for b, a, c in merge.terms], None])
        save_file(tensors, str(path), metadata={"entries": json.dumps(entries)})

    def committed(self, directory: Path) -> None:
        """The checkpoint written by :meth:`write` is now in place at ``directory``."""
        self.on_disk = StoredHistory(directory)
        self.pending, self.stale, self.snapshot_next = [], False, False

    def resumed(self, stored: Optional[StoredHistory]) -> None:
        """The live targets were just restored from ``stored`` (None: from a checkpoint without a history)."""
        self.on_disk = stored
        self.pending, self.stale, self.snapshot_next = [], False, False


def history_of(strategy: Any) -> Optional[BaseHistory]:
    """The base history of a strategy's :class:`~fedllm.strategies.residual.BaseUpdates` (``strategy.base``), if any."""
    history = getattr(getattr(strategy, "base", None), "history", None)
    return history if isinstance(history, BaseHistory) else None

