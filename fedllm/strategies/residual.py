"""Merge-and-reinit machinery shared by FRLoRA (and its ablations) and the FedLoRU family.

- :func:`adapter_layers`: every LoRA-wrapped layer with the state keys of its ``default``
  adapter factors and its scaling ``s``.
- :class:`BaseUpdates`: the learned changes of the frozen base weights. ``merge`` adds them to
  the base weights in place (the sum is taken in fp32); ``dense`` keeps them as an fp32 residual
  matrix beside the base and adds ``x @ Rᵀ`` to the layer's output through a forward hook. Dense
  is what a 4/8-bit base needs (re-quantising the merged weight would lose the update) and what
  a bf16/fp16 base needs (small updates vanish when rounded into half precision). Every change is
  a low-rank :class:`~fedllm.runs.base_history.LowRankMerge`, logged in a
  :class:`~fedllm.runs.base_history.BaseHistory` so that checkpoints carry factors, not dense copies.
- :class:`KeptFactors`: low-rank pieces ``(B, A, s)`` kept per layer instead of merged (FedLoRU's
  accumulated updates); optionally live, i.e. added to the layer's output through a forward hook
  so the in-memory model computes with them (FedLoRU's plug-and-play fine-tuning variant).

- :func:`drop_moments`: the one optimizer-moment policy of every merge-and-reinit strategy
  (FRLoRA and its ablations, FedLoRU and its variants, FLoRA), for ``train.optimizer_state:
  per_client``:

  *A client keeps the moments of every tensor whose training continues, and drops, before it
  next trains, the moments of every tensor a merge-and-reinit step has re-initialised since it
  last trained, i.e. set to a newly drawn or newly derived value (a random or Gaussian draw, a
  zeroed factor, a re-run SVD).* FRLoRA's restart at its fixed ``(B0, A0)`` is not a new value:
  each round every client trains from the same point again, so its moments stay (as in the
  official FRLoRA code, which keeps a per-client AdamW state). Hence: FRLoRA keeps all moments;
  v1 keeps all (nothing is re-initialised); v2 and v3 drop the adapter's every round; FedLoRU
  drops both factors' after an accumulation with ``reinit: random``, ``B``'s with ``momentum``
  and none with ``momentum_literal``; FLoRA drops the adapter's every round, and so does FlexLoRA
  (each round's factors are a newly derived SVD hand-back). Tensors that are
  never re-initialised (a classifier head) always keep theirs.

Forward hooks are used rather than extra PEFT adapters so that nothing is added to the model's
parameters or state dict; the tensors live here and are checkpointed by the owning strategy.
Hooks add to the output of the PEFT LoRA layer (base + adapter), so they act whether or not the
adapter is enabled, exactly like a change of the base weight would.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from fedllm.models.lowrank import dense_weight, is_quantized, lora_init_
from fedllm.models.state import DTYPES, StateDict
from fedllm.runs.base_history import BaseHistory, LowRankMerge, StoredHistory, apply_

RESIDUAL_MODES = ("auto", "merge", "dense")


@dataclass
class AdapterLayer:
    """One LoRA-wrapped layer: its module, the state keys of its factors, and ``s = alpha / r``."""

    name: str
    module: Any
    a_key: str
    b_key: str
    scale: float
    base_key: str = ""  # state key of the wrapped base weight
    magnitude_key: str = ""  # state key of DoRA's magnitude vector m (``lora.use_dora``), "" without DoRA

    @property
    def base(self) -> torch.nn.Module:
        """The wrapped (frozen) base layer."""
        return self.module.get_base_layer()

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of the base weight."""
        return self.module.out_features, self.module.in_features

    @property
    def rank(self) -> int:
        return self.module.lora_A["default"].weight.shape[0]

    @property
    def numel(self) -> int:
        """Entries of the adapter's two factors (what one transfer of ``(B, A)`` carries)."""
        return self.module.lora_A["default"].weight.numel() + self.module.lora_B["default"].weight.numel()


def adapter_layers(model: torch.nn.Module, adapter: str = "default") -> dict[str, AdapterLayer]:
    """The LoRA-wrapped layers of ``model`` (keyed like :func:`fedllm.models.loading.lora_layers`)."""
    from fedllm.models.loading import lora_layers

    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, AdapterLayer] = {}
    for name in lora_layers(model):
        module = model.get_submodule(name)
        if getattr(module, "fan_in_fan_out", False):
            raise ValueError(f"{name}: fan_in_fan_out (Conv1D) layers are not supported by merge-and-reinit strategies")
        magnitude = getattr(module, "lora_magnitude_vector", {})
        out[name] = AdapterLayer(name, module, names[id(module.lora_A[adapter].weight)],
                                 names[id(module.lora_B[adapter].weight)], float(module.scaling[adapter]),
                                 names.get(id(module.get_base_layer().weight), ""),
                                 names[id(magnitude[adapter].weight)] if adapter in magnitude else "")
    return out


def recipe_value(recipe: Any, dotted: str, default: Any) -> Any:
    """``recipe.<dotted>``, or ``default`` when the strategy runs without a recipe (unit use)."""
    node = recipe
    for part in dotted.split("."):
        if node is None:
            return default
        node = getattr(node, part, None)
    return default if node is None else node


def layer_seed(seed: int, name: str, *parts: int) -> int:
    """A seed every process derives alike for layer ``name`` (and a round, a purpose ...)."""
    from fedllm.recipe.schedule import derived_seed

    return derived_seed(seed, zlib.crc32(name.encode()), *parts)


def to_wire(t: torch.Tensor, comm_dtype: str, like: torch.Tensor) -> torch.Tensor:
    """``t`` as clients receive it: rounded through ``comm_dtype``, stored in ``like``'s dtype and device."""
    return t.detach().to(DTYPES[comm_dtype]).to(like.device, like.dtype)


def standard_factors(layer: AdapterLayer, init: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh standard LoRA init ``(B = 0, A random)`` for ``layer`` from ``seed`` (fp32, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.empty(layer.rank, layer.shape[1])
    b = torch.empty(layer.shape[0], layer.rank)
    lora_init_(a, b, init, gen)
    return b, a


def drop_moments(state: Optional[StateDict], reinitialised: Any) -> Optional[StateDict]:
    """Per-client optimizer moments without those of re-initialised tensors (see the module docstring).

    Args:
        state: moments keyed ``<parameter key>::<moment name>``, or None (moments reset each round).
        reinitialised: the parameter keys re-initialised since the client last trained.

    Returns:
        ``state`` without the moments of ``reinitialised`` (None stays None).
    """
    if not state:
        return state
    stale = set(reinitialised)
    return {k: v for k, v in state.items() if k.split("::", 1)[0] not in stale}


def resolve_residual_mode(mode: str, layers: dict[str, AdapterLayer]) -> str:
    """``merge`` or ``dense`` for ``mode`` (``auto``: dense unless every base weight is plain fp32).

    Raises:
        ValueError: ``merge`` was asked for a quantized base.
    """
    if mode not in RESIDUAL_MODES:
        raise ValueError(f"residual mode {mode!r}; expected one of {RESIDUAL_MODES}")
    quantized = any(is_quantized(layer.base) for layer in layers.values())
    if mode == "merge" and quantized:
        raise ValueError("residual: merge cannot add an update to a 4/8-bit base without re-quantising it; "
                         "use 'dense' (or 'auto')")
    if mode != "auto":
        return mode
    half = any(layer.base.weight.dtype != torch.float32 for layer in layers.values())
    return "dense" if quantized or half else "merge"


class StoredResiduals(Mapping):
    """A checkpoint's dense residuals, rebuilt from its base history one layer at a time (read-only).

    What an export reads (:attr:`BaseUpdates.read_once`): it uses each layer's residual for the probe forward, then
    for that layer's merge, in layer order, so only the newest one is kept; a 7B FRLoRA run's 64 residuals of
    4096 x 4096 (4 GB in fp32) are never all in memory. Each is :meth:`StoredHistory.rebuild`'s value, the one
    :meth:`BaseUpdates.restore` would hold, bit for bit.

    Args:
        stored: the checkpoint's history (``dense`` mode).
        names: ``{history key: layer name}`` of the layers it holds.
        layers: from :func:`adapter_layers` (devices and shapes).
    """

    def __init__(self, stored: StoredHistory, names: dict[str, str], layers: dict[str, AdapterLayer]):
        self.stored, self.layers = stored, layers
        self.keys_by_name = {name: key for key, name in names.items()}
        self.newest: Optional[tuple[str, torch.Tensor]] = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.newest is not None and self.newest[0] == name:
            return self.newest[1]
        key = self.keys_by_name[name]  # KeyError: no residual for this layer
        layer = self.layers[name]
        self.newest = None  # let the previous one go before reading the next
        like = torch.empty(layer.shape, device="meta")  # its shape, without memory
        value = self.stored.rebuild(key, layer.module.lora_A["default"].weight.device, like)
        self.newest = (name, value)
        return value

    def forget(self) -> None:
        """Drop the newest residual read (the export's merge is done with it; a later read rebuilds it)."""
        self.newest = None

    def __contains__(self, name: object) -> bool:  # without reading it
        return name in self.keys_by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_by_name)

    def __len__(self) -> int:
        return len(self.keys_by_name)


class BaseUpdates:
    """Changes of the frozen base weights, merged in place (``merge``) or kept in fp32 beside them (``dense``).

    Every change is a :class:`~fedllm.runs.base_history.LowRankMerge` applied by :func:`~fedllm.runs.base_history.apply_`
    and logged in :attr:`history`, from which a checkpoint's snapshot and log rebuild the targets bit for bit.

    Args:
        layers: from :func:`adapter_layers`.
        mode: ``merge`` or ``dense`` (see :func:`resolve_residual_mode`).
    """

    def __init__(self, layers: dict[str, AdapterLayer], mode: str):
        if mode not in ("merge", "dense"):
            raise ValueError(f"mode {mode!r}; expected 'merge' or 'dense'")
        self.layers = layers
        self.mode = mode
        self.residual: dict[str, torch.Tensor] | StoredResiduals = {}
        self.read_once = False  # set by an export: restore dense residuals as StoredResiduals (never all in memory)
        self.restore_needs: set[str] = set()  # layers whose target a restore must supply (their set-up was skipped)
        self.handles = []
        if mode == "dense":
            for name, layer in layers.items():
                self.handles.append(layer.module.register_forward_hook(self._hook(name)))
            size = sum(4 * layer.shape[0] * layer.shape[1] for layer in layers.values())
        else:
            size = sum(layer.base.weight.numel() * layer.base.weight.element_size() for layer in layers.values())
        self.history = BaseHistory(mode, self.targets, size)

    def _hook(self, name: str):
        def add_residual(module: Any, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
            r = self.residual.get(name)
            if r is None:
                return None
            return output + F.linear(args[0].to(r.dtype), r).to(output.dtype)

        return add_residual

    @property
    def modifies_base(self) -> bool:
        """True when the base weights themselves change (``merge``)."""
        return self.mode == "merge"

    def key(self, name: str) -> str:
        """The history's key of layer ``name``: its base weight's state key (``merge``) or ``residual/<name>``."""
        return self.layers[name].base_key if self.mode == "merge" else f"residual/{name}"

    def targets(self) -> dict[str, torch.Tensor]:
        """What a snapshot holds: the base weights (``merge``) or the residuals made so far (``dense``)."""
        if self.mode == "merge":
            return {self.key(name): layer.base.weight for name, layer in self.layers.items()}
        return {self.key(name): r for name, r in self.residual.items()}

    def _target(self, name: str) -> torch.Tensor:
        layer = self.layers[name]
        if self.mode == "merge":
            if is_quantized(layer.base):
                raise TypeError(f"{type(layer.base).__name__}: cannot merge into a quantized weight")
            return layer.base.weight
        if name not in self.residual:
            device = layer.module.lora_A["default"].weight.device
            self.residual[name] = torch.zeros(layer.shape, dtype=torch.float32, device=device)
        return self.residual[name]

    @torch.no_grad()
    def add(self, name: str, merge: LowRankMerge | torch.Tensor, rnd: int = 0) -> None:
        """Base weight of layer ``name`` ← base + the merge's change (a dense fp32 ``out × in`` tensor is logged
        as a dense entry); logged as made in round ``rnd`` (0: at setup)."""
        if torch.is_tensor(merge):
            merge = LowRankMerge(dense=merge)
        layer = self.layers[name]
        shape = (merge.dense.shape if merge.dense is not None
                 else (merge.terms[0][0].shape[0], merge.terms[0][1].shape[1]))
        if tuple(shape) != layer.shape:
            raise ValueError(f"{name}: update shape {tuple(shape)} vs weight {layer.shape}")
        apply_(self._target(name), merge)
        self.history.record(rnd, self.key(name), merge)

    def apply(self, rnd: int, merges: list[tuple[str, LowRankMerge]]) -> None:
        """Replay merges logged elsewhere (keyed as :meth:`key` keys them; a Flower node's catch-up)."""
        names = {self.key(name): name for name in self.layers}
        for key, merge in merges:
            if key not in names:
                raise KeyError(f"a merge of {key!r}, which is not a {self.mode} target of this model")
            self.add(names[key], merge, rnd)

    def weight(self, name: str) -> torch.Tensor:
        """The current base weight of layer ``name`` (dequantised, plus the residual) in fp32."""
        w = dense_weight(self.layers[name].base)
        r = self.residual.get(name)
        return w if r is None else w + r.to(w.device)

    def residuals(self) -> Mapping[str, torch.Tensor]:
        """The dense residuals by layer name: a copy of the dict, or the :class:`StoredResiduals` an export reads."""
        return self.residual if isinstance(self.residual, StoredResiduals) else dict(self.residual)

    def state_dict(self, prefix: str = "residual/") -> StateDict:
        """Nothing: the residuals (``dense``) and base weights (``merge``) are checkpointed by :attr:`history`."""
        return {}

    def load_state_dict(self, state: StateDict, prefix: str = "residual/") -> None:
        """Dense residuals of a checkpoint written before the base history (``residual/<name>`` keys)."""
        loaded = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        unknown = sorted(set(loaded) - set(self.layers))
        if unknown:
            raise KeyError(f"residuals of unknown layers: {unknown[:3]}")
        if loaded and self.mode != "dense":
            raise ValueError("checkpoint holds dense residuals but this run merges into the base (residual mode)")
        if not loaded:
            return
        self.residual = {}
        for name, value in loaded.items():
            device = self.layers[name].module.lora_A["default"].weight.device
            self.residual[name] = value.to(device, torch.float32).clone()
        self.history.resumed(None)

    @torch.no_grad()
    def restore(self, stored: StoredHistory) -> None:
        """Rebuild the targets from a checkpoint's snapshot and log, on their devices (bit for bit the live ones).

        A history of base weights restores into a model whose base is kept dense (e.g. evaluated in another
        dtype) by writing the rebuilt fp32 weights into it, as a dense ``base.safetensors`` would. With
        :attr:`read_once` dense residuals are not rebuilt here but when read (:class:`StoredResiduals`).

        Raises:
            KeyError: the history holds an unknown layer, or lacks one of :attr:`restore_needs`.
        """
        if stored.mode == "dense" and self.mode != "dense":
            raise ValueError("checkpoint holds dense residuals but this run merges into the base (residual mode)")
        by_key = {layer.base_key if stored.mode == "merge" else f"residual/{name}": name
                  for name, layer in self.layers.items()}
        keys = stored.keys()
        held = set(keys)
        unknown = sorted(held - set(by_key))
        if unknown:
            raise KeyError(f"base history of unknown layers: {unknown[:3]}")
        missing = sorted(name for key, name in by_key.items() if name in self.restore_needs and key not in held)
        if missing:
            raise KeyError(f"{stored.directory}: the base history has no {stored.mode} target of layers {missing[:3]}, "
                           "whose set-up was left to the checkpoint")
        if stored.mode == "dense" and self.read_once:
            self.residual = StoredResiduals(stored, {key: by_key[key] for key in keys}, self.layers)
            self.history.resumed(stored)
            return
        if stored.mode == "dense":
            self.residual = {}
        for key in keys:
            layer = self.layers[by_key[key]]
            if stored.mode == "merge":
                weight = layer.base.weight
                weight.copy_(stored.rebuild(key, weight.device))
            else:
                device = layer.module.lora_A["default"].weight.device
                self.residual[by_key[key]] = stored.rebuild(key, device, torch.empty(layer.shape))
        self.history.resumed(stored if stored.mode == self.mode else None)


class KeptFactors:
    """Low-rank pieces ``(B, A, s)`` per layer, kept beside the base instead of merged into it.

    Args:
        layers: from :func:`adapter_layers`.
        live: add ``Σ_j s_j·B_j A_j x`` to each layer's output (forward hook), so the model in
            memory computes with the kept pieces; False when they are also merged into the base.
    """

    def __init__(self, layers: dict[str, AdapterLayer], live: bool):
        self.layers = layers
        self.live = live
        self.factors: dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.active = True  # live hooks add the pieces only while active (FlexLoRA: off while a client trains)
        self.handles = []
        if live:
            for name, layer in layers.items():
                self.handles.append(layer.module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def add_kept(module: Any, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
            stacked = self._stacked.get(name)
            if stacked is None or not self.active:
                return None
            a_cat, b_cat = stacked
            x = args[0].to(a_cat.dtype)
            return output + F.linear(F.linear(x, a_cat), b_cat).to(output.dtype)

        return add_kept

    def _restack(self, name: str) -> None:
        pieces = self.factors.get(name, [])
        if not pieces:
            self._stacked.pop(name, None)
            return
        self._stacked[name] = (torch.cat([a for _, a, _ in pieces], 0),
                               torch.cat([b * s for b, _, s in pieces], 1))

    def append(self, name: str, b: torch.Tensor, a: torch.Tensor, scale: float) -> None:
        """Keep ``scale · b @ a`` as one more piece of layer ``name`` (copied, fp32)."""
        layer = self.layers[name]
        if b.shape[0] != layer.shape[0] or a.shape[1] != layer.shape[1] or b.shape[1] != a.shape[0]:
            raise ValueError(f"{name}: factors {tuple(b.shape)} @ {tuple(a.shape)} do not make {layer.shape}")
        device = layer.module.lora_A["default"].weight.device
        self.factors.setdefault(name, []).append(
            (b.detach().to(device, torch.float32).clone(), a.detach().to(device, torch.float32).clone(), float(scale)))
        self._restack(name)

    def clear(self) -> None:
        """Forget every kept piece."""
        self.factors, self._stacked = {}, {}

    def as_dict(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """``{layer: [(B, A, scale), ...]}`` in the order they were kept (copies)."""
        return {n: [(b.clone(), a.clone(), s) for b, a, s in pieces] for n, pieces in self.factors.items()}

    def delta(self, name: str) -> torch.Tensor:
        """``Σ_j s_j·B_j A_j`` of layer ``name`` (fp32; zeros when nothing is kept)."""
        out = torch.zeros(self.layers[name].shape, dtype=torch.float32)
        for b, a, s in self.factors.get(name, []):
            out += (b.cpu() @ a.cpu()) * s
        return out

    def state_dict(self, prefix: str = "kept/") -> StateDict:
        state: StateDict = {}
        for name, pieces in self.factors.items():
            for j, (b, a, s) in enumerate(pieces):
                state[f"{prefix}{name}/{j}/B"] = b
                state[f"{prefix}{name}/{j}/A"] = a
                state[f"{prefix}{name}/{j}/scale"] = torch.tensor(s, dtype=torch.float64)
        return state

    def load_state_dict(self, state: StateDict, prefix: str = "kept/") -> None:
        grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for key, value in state.items():
            if not key.startswith(prefix):
                continue
            name, j, part = key[len(prefix):].rsplit("/", 2)
            grouped.setdefault(name, {}).setdefault(int(j), {})[part] = value
        unknown = sorted(set(grouped) - set(self.layers))
        if unknown:
            raise KeyError(f"kept factors of unknown layers: {unknown[:3]}")
        self.clear()
        for name, pieces in grouped.items():
            for j in sorted(pieces):
                p = pieces[j]
                self.append(name, p["B"], p["A"], float(p["scale"]))


class MergesIntoBase:
    """Mixin for a strategy whose only server state is a :class:`BaseUpdates` in ``self.base``:
    exports its dense residuals and checkpoints it."""

    base: BaseUpdates
    merges_in_aggregate = True  # the base changes in ``aggregate``: a Flower node replays the logged merges

    def base_residuals(self) -> Mapping[str, torch.Tensor]:
        return self.base.residuals()

    def state_dict(self) -> StateDict:
        return self.base.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.base.load_state_dict(state)
