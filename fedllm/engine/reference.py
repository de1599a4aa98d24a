"""DPO's reference log-probabilities without a second copy of the model.

DPO compares the policy with the policy training started from. Strategies that merge into the base (FRLoRA,
FedLoRU, FedEx-LoRA, FLoRA ...) move the base, so "the base with the adapter disabled" is not that reference
after round 1. With ``train.preference.reference: precomputed`` (the default) every client's reference
log-probabilities are computed once, from the model as training starts (after the strategy's ``setup``, before
any client's first update; one forward pass per pair, no gradient, eval mode), and kept in the client's state
(:class:`fedllm.runs.client_store.ClientStore`'s reference part, checkpointed with it): two numbers per pair,
``reference/logps`` (pairs x 2: chosen, rejected) in the order of the client's examples. Whoever trains the client
holds them: the in-process store, every process of a multi-process run (each computes its share, then they are
gathered), a Flower SuperNode (computed when it first builds its client, before any catch-up).

``reference: adapter_disabled`` computes them at every step with the adapter disabled instead (trl's and
OpenFedLLM's way), for strategies that never change the base.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedllm.models.cpu_half_matmul import for_model as half_matmuls_for
from fedllm.models.hardware import auto_dtype
from fedllm.models.preference_loss import needs_reference, sequence_logps
from fedllm.models.state import DTYPES, StateDict
from fedllm.recipe.schema import TrainConfig
from fedllm.runs.client_store import REFERENCE, ClientStore
from fedllm.runs.reference_cache import ReferenceCache

REFERENCE_KEY = REFERENCE + "logps"
"""Key of a client's reference table: float32, one row per example (chosen, rejected)."""
EVAL_REFERENCE_KEY = REFERENCE + "eval_logps"
"""Key of the reference table of a client's personal held-out pairs (``pref_accuracy`` of personal models)."""
HELD_OUT = -1
"""Store id under which the run's global held-out pairs keep their reference table (``pref_accuracy``)."""


def uses_precomputed(cfg: TrainConfig) -> bool:
    """Whether ``train`` trains DPO on reference log-probabilities computed once per client."""
    return cfg.objective == "dpo" and needs_reference(cfg.preference) and cfg.preference.reference == "precomputed"


class ReferencedExamples(Sequence):
    """The federation's examples, those of one client carrying their reference log-probabilities
    (``ref_chosen_logp`` / ``ref_rejected_logp``, which :func:`fedllm.data.collate.collate` batches)."""

    def __init__(self, examples: Sequence[dict], indices: Sequence[int], table: torch.Tensor):
        if table.shape != (len(indices), 2):
            raise ValueError(f"reference table of shape {tuple(table.shape)} for {len(indices)} examples")
        self.examples = examples
        self.rows = {int(i): row for i, row in zip(indices, table.tolist(), strict=True)}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        row = self.rows.get(int(i))
        example = self.examples[i]
        return example if row is None else {**example, "ref_chosen_logp": row[0], "ref_rejected_logp": row[1]}


def _batch_rows(model: torch.nn.Module, items: list[dict], cfg: TrainConfig,
                collate: Callable[[list[dict]], dict], device: torch.device) -> torch.Tensor:
    """``len(items) x 2`` float32 CPU log-probabilities (chosen, rejected) of one batch of pairs (eval mode, no
    gradient: the caller's)."""
    batch = {k: v.to(device) for k, v in collate(items).items()}
    dtype = cfg.dtype if cfg.dtype != "auto" else auto_dtype(device)[0]
    autocast = torch.autocast(device.type, DTYPES[dtype]) if dtype != "fp32" else contextlib.nullcontext()
    with autocast, half_matmuls_for(model, dtype):  # a CPU without a bf16 GEMM: fp32 blocks
        logps = sequence_logps(model, batch, cfg.loss_positions).logps
    chosen, rejected = logps.float().cpu().chunk(2)
    return torch.stack([chosen, rejected], dim=1)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def compute_reference(
    model: torch.nn.Module,
    examples: Sequence[dict],
    indices: Sequence[int],
    cfg: TrainConfig,
    collate: Callable[[list[dict]], dict],
    batch_size: int | None = None,
) -> torch.Tensor:
    """The reference table of the examples ``indices``: the model as it is now, eval mode, no gradient, in
    batches of ``batch_size`` (default ``train.batch_size``) taken in order.

    Returns:
        float32 CPU tensor (len(indices) x 2): each pair's summed answer log-probability, chosen then rejected.
    """
    device = next(model.parameters()).device
    size = batch_size or cfg.batch_size
    with _evaluating(model):
        rows = [_batch_rows(model, [examples[i] for i in indices[start : start + size]], cfg, collate, device)
                for start in range(0, len(indices), size)]
    return torch.cat(rows) if rows else torch.zeros(0, 2)


def pair_length(example: dict) -> int:
    """The width a pair pads its batch to: its longer answer sequence."""
    return max(len(example["input_ids"]), len(example.get("rejected_input_ids", ())))


def compute_references(
    model: torch.nn.Module,
    examples: Sequence[dict],
    clients: dict[int, Sequence[int]],
    cfg: TrainConfig,
    collate: Callable[[list[dict]], dict],
    progress: bool = False,
    on_client: Callable[[int, torch.Tensor], None] | None = None,
) -> dict[int, torch.Tensor]:
    """The reference tables of several clients in one pass: all their pairs sorted by length (longest first),
    cut into batches of ``train.batch_size`` pairs, so that a batch pads little and small clients share batches
    (a pair's log-probabilities do not depend on its batch beyond rounding: fp32 within 1e-6 of one pair alone).

    Args:
        clients: client id -> its example indices (each client's table follows this order).
        progress: a progress bar over the pairs.
        on_client: called with each client's table as soon as all its pairs are done (the cache's writer).

    Returns:
        client id -> float32 CPU table (pairs x 2: chosen, rejected).
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    order = sorted(((c, row, i) for c, ix in clients.items() for row, i in enumerate(ix)),
                   key=lambda item: -pair_length(examples[item[2]]))
    tables = {c: torch.zeros(len(ix), 2) for c, ix in clients.items()}
    left = {c: len(ix) for c, ix in clients.items()}
    for c in [c for c, n in left.items() if n == 0]:
        if on_client is not None:
            on_client(c, tables[c])
    size = cfg.batch_size
    with _evaluating(model), tqdm(total=len(order), desc="reference log-probs", unit="pair",
                                  disable=not progress, leave=False) as bar:
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            rows = _batch_rows(model, [examples[i] for _, _, i in chunk], cfg, collate, device)
            for (c, row, _), values in zip(chunk, rows, strict=True):
                tables[c][row] = values
                left[c] -= 1
                if left[c] == 0 and on_client is not None:
                    on_client(c, tables[c])
            bar.update(len(chunk))
    return tables


def client_reference(
    model: torch.nn.Module,
    store: ClientStore,
    client_id: int,
    examples: Sequence[dict],
    indices: Sequence[int],
    cfg: TrainConfig,
    collate: Callable[[list[dict]], dict],
) -> StateDict:
    """Client ``client_id``'s reference part, computed now (and kept in ``store``) when it has none yet."""
    kept = store.reference(client_id)
    if REFERENCE_KEY not in kept:
        kept = {REFERENCE_KEY: compute_reference(model, examples, indices, cfg, collate)}
        store.put_reference(client_id, kept)
    return kept


def precompute_references(
    model: torch.nn.Module,
    store: ClientStore,
    examples: Sequence[dict],
    clients: dict[int, Sequence[int]],
    cfg: TrainConfig,
    collate: Callable[[list[dict]], dict],
    dispatch: Any = None,
    cache: ReferenceCache | None = None,
    progress: bool = False,
) -> None:
    """Compute the reference part of every client in ``clients`` (id -> example indices) that has none, before
    training starts, in one length-sorted pass over their pairs (:func:`compute_references`). With a
    multi-process ``dispatch`` each process computes its share and all are gathered. ``cache`` (the run
    directory's, :mod:`fedllm.runs.reference_cache`) gives back what an interrupted start computed and keeps
    each client's table as it is done."""
    if not uses_precomputed(cfg):
        return
    todo = [c for c in sorted(clients) if REFERENCE_KEY not in store.reference(c)]
    cached = cache.load() if cache is not None and todo else {}
    for c in todo:
        if c in cached and cached[c].shape == (len(clients[c]), 2):
            store.put_reference(c, {REFERENCE_KEY: cached[c]})
    todo = [c for c in todo if REFERENCE_KEY not in store.reference(c)]
    mine = dispatch.local_share(todo) if dispatch is not None else todo
    tables = compute_references(model, examples, {c: clients[c] for c in mine}, cfg, collate, progress,
                                cache.put if cache is not None else None)
    computed = {c: {REFERENCE_KEY: t} for c, t in tables.items()}
    if dispatch is not None:
        _, _, computed = dispatch.gather([], {}, computed)
    for c, part in computed.items():
        store.put_reference(c, part)
        if cache is not None:
            cache.put(c, part[REFERENCE_KEY])
    if cache is not None:
        cache.flush()


def precompute_eval_references(
    model: torch.nn.Module,
    store: ClientStore,
    held_out: Sequence[dict],
    personal: Sequence[Sequence[dict]],
    recipe: Any,
    collate: Callable[[list[dict]], dict],
) -> None:
    """Before round 1, when ``pref_accuracy`` is evaluated: the reference tables of the global held-out pairs
    (under :data:`HELD_OUT`) and of each client's personal held-out pairs (:data:`EVAL_REFERENCE_KEY`), in the
    batches ``pref_accuracy`` takes (``eval.batch_size``, in order). The evaluation before round 1, of this same
    model, reads its policy's log-probabilities from the global table instead of a second pass (its rewards are
    exactly 0)."""
    cfg, size = recipe.train, recipe.eval.batch_size
    if not uses_precomputed(cfg) or "pref_accuracy" not in recipe.eval.tasks:
        return
    if held_out and REFERENCE_KEY not in store.reference(HELD_OUT):
        table = compute_reference(model, held_out, range(len(held_out)), cfg, collate, size)
        store.put_reference(HELD_OUT, {REFERENCE_KEY: table})
    for cid, examples in enumerate(personal):
        kept = store.reference(cid)
        if examples and EVAL_REFERENCE_KEY not in kept:
            table = compute_reference(model, examples, range(len(examples)), cfg, collate, size)
            store.put_reference(cid, {**kept, EVAL_REFERENCE_KEY: table})


def with_reference(
    examples: Sequence[dict], indices: Sequence[int], part: StateDict, key: str = REFERENCE_KEY
) -> Sequence[dict]:
    """``examples`` with the reference table ``part[key]`` attached to the examples ``indices`` (unchanged
    without one)."""
    table = part.get(key)
    return examples if table is None else ReferencedExamples(examples, indices, table)
