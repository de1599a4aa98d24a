"""Read a PEFT model's LoRA-wrapped layers: base weight, low-rank pieces, and what the layer really adds.

Everything the export computes about a layer comes from here. A layer of the run's model
computes ``x ↦ W x + (additions) x``: ``W`` is its current base weight (dequantized when the
run was 4/8-bit), the additions are the active LoRA adapters, a dense residual the strategy
keeps beside the base (:meth:`Strategy.base_residuals`), kept factors computed by forward
hooks (:meth:`Strategy.kept_factors` when not ``kept_in_base``) and whatever else a strategy
adds through hooks (pFedLoRU's private adapter, mFedLoRU's nested factors). The additions are
also *observed* by passing the identity matrix through the layer; when the known pieces do not
account for them the observed matrix is used, so the export never silently drops a term.
Weights are in the ``out × in`` orientation (GPT-2's ``Conv1D`` layers store the transpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from fedllm.export.errors import ExportInputError
from fedllm.export.factors import FP32_EPS, LowRank
from fedllm.models.lowrank import dense_weight, is_quantized

PEFT_PREFIX = "base_model.model."
READOUT_BLOCK = 1024  # identity columns pushed through a layer at once
COLUMN_BLOCK = 512  # a layer's columns summed at once in float64 by the merged export (4096 rows: 16 MiB)


def relative_name(name: str) -> str:
    """A module name inside the PEFT model (``base_model.model.X``) as named in the base model (``X``)."""
    return name.removeprefix(PEFT_PREFIX)


def wrapped_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The PEFT model's LoRA layers (the wrappers, not their base layers), keyed by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def oriented(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in ``out × in`` orientation (transposed for ``fan_in_fan_out`` layers)."""
    return weight.T if getattr(layer, "fan_in_fan_out", False) else weight


def _sum(pieces: list[LowRank], shape: tuple[int, int]) -> torch.Tensor:
    total = torch.zeros(shape, dtype=torch.float64)
    for piece in pieces:
        total = total + piece.product()
    return total


def column_blocks(columns: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of :data:`COLUMN_BLOCK` columns each, covering ``range(columns)``."""
    return [(start, min(start + COLUMN_BLOCK, columns)) for start in range(0, columns, COLUMN_BLOCK)]


@dataclass
class LayerState:
    """One LoRA-wrapped layer of the run's model.

    Attributes:
        name: Module name in the PEFT model (``base_model.model....q_proj``).
        base: Current base weight ``out × in``: the layer's own weight in its dtype, not a copy (an fp32 copy,
            dequantized, for 4/8-bit layers). Every sum below reads it as float64, which holds any of them exactly.
        residual: Dense fp32 change kept beside the base (added by a hook), or None.
        adapter: Products of the active LoRA adapters.
        kept: The strategy's kept factors.
        kept_in_base: The kept factors are inside ``base`` (and ``residual``) already.
        observed: What the layer adds to its base layer's output, read out with the identity (fp32: the difference of
            two fp32 outputs, held exactly).
        scale: Scaling ``alpha / r`` of the layer's adapter.
        explained: The known pieces account for ``observed`` (up to fp32 rounding).
    """

    name: str
    base: torch.Tensor
    residual: Optional[torch.Tensor]
    adapter: list[LowRank]
    kept: list[LowRank]
    kept_in_base: bool
    observed: torch.Tensor
    scale: float
    explained: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``."""
        return tuple(self.base.shape)

    def known_addition(self) -> torch.Tensor:
        """Residual + adapters + kept factors computed beside the base (float64)."""
        return self.known_columns(0, self.shape[1])

    def known_columns(self, start: int, stop: int) -> torch.Tensor:
        """``known_addition()[:, start:stop]``, summed from those columns alone in the same order (float64)."""
        total = torch.zeros((self.shape[0], stop - start), dtype=torch.float64)
        for piece in self.adapter + ([] if self.kept_in_base else self.kept):
            total = total + piece.columns(start, stop)
        return total if self.residual is None else total + self.residual[:, start:stop].double()

    def check_explained(self) -> bool:
        """Set :attr:`explained`: do the known pieces account for what the layer adds (up to fp32 rounding)?

        Compared :data:`COLUMN_BLOCK` columns at a time (the largest difference is the same)."""
        # fp32 rounding of the read-out: one term per base/residual entry, r-term sums per low-rank piece
        bound = float(self.base.abs().max()) + float(self.observed.abs().max())
        bound += 0.0 if self.residual is None else float(self.residual.abs().max())
        bound += sum(abs(p.scale) * p.rank * float(p.B.abs().max()) * float(p.A.abs().max())
                     for p in self.adapter + self.kept if p.B.numel() and p.A.numel())
        worst = max((float((self.observed[:, start:stop].double() - self.known_columns(start, stop)).abs().max())
                     for start, stop in column_blocks(self.shape[1])), default=0.0)
        self.explained = worst <= 16 * FP32_EPS * bound
        return self.explained

    def effective(self) -> torch.Tensor:
        """The layer's effective weight ``W + additions`` (float64): known pieces when they explain it."""
        return self.base.double() + (self.known_addition() if self.explained else self.observed.double())

    def merged_weight(self) -> torch.Tensor:
        """``effective()`` rounded to fp32, summed :data:`COLUMN_BLOCK` columns at a time: the same float64 sums, so
        the same fp32 weight, with 16 MiB of float64 at once for a 4096 x 4096 layer instead of several 128 MiB."""
        out = torch.empty(self.shape, dtype=torch.float32)
        for start, stop in column_blocks(self.shape[1]):
            added = self.known_columns(start, stop) if self.explained else self.observed[:, start:stop].double()
            out[:, start:stop] = self.base[:, start:stop].double() + added
        return out

    def base_without_pieces(self) -> Optional[torch.Tensor]:
        """``effective − Σ pieces``: base + residual, minus kept factors merged into it (float64).

        None when the pieces do not account for the layer (:attr:`explained` is False).
        """
        if not self.explained:
            return None
        current = self.base.double() if self.residual is None else self.base.double() + self.residual.double()
        return current - _sum(self.kept, self.shape) if self.kept_in_base else current

    def pieces(self) -> list[LowRank]:
        """The learned low-rank pieces: adapters, then kept factors."""
        return self.adapter + self.kept


def adapter_pieces(name: str, layer: Any) -> list[LowRank]:
    """The products of the layer's active LoRA adapters.

    Raises:
        ExportInputError: the layer uses a LoRA variant this export cannot express (DoRA, LoRA bias,
            embedding LoRA) or is already merged.
    """
    if layer.merged:
        raise ExportInputError(f"{name}: the adapter is merged into the base already; export needs it unmerged")
    if getattr(layer, "disable_adapters", False):
        return []
    pieces = []
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            if adapter in getattr(layer, "lora_embedding_A", {}):
                raise ExportInputError(f"{name}: embedding LoRA layers are not supported by export")
            continue
        if layer.use_dora.get(adapter) or adapter in layer.lora_magnitude_vector or layer.lora_bias.get(adapter):
            raise ExportInputError(f"{name}: adapter {adapter!r} uses DoRA or a LoRA bias; export supports plain LoRA")
        pieces.append(LowRank(layer.lora_B[adapter].weight.detach().float().cpu(),
                              layer.lora_A[adapter].weight.detach().float().cpu(), float(layer.scaling[adapter])))
    return pieces


def current_weight(base: torch.nn.Module) -> torch.Tensor:
    """A base layer's weight as stored: the parameter itself, detached (not copied: a 7B layer's fp32 copy is 64 MiB
    per 4096 x 4096), or an fp32 dequantized copy of a 4/8-bit layer's."""
    return dense_weight(base) if is_quantized(base) else base.weight.detach()


def _checked(found: dict[str, Any], names: list[str], what: str, strategy: Any) -> dict[str, Any]:
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise ValueError(f"strategy {strategy.name!r} keeps {what} for modules that are not LoRA layers: {unknown[:3]}")
    return found


@torch.no_grad()
def observed_addition(layer: Any) -> torch.Tensor:
    """``(layer(I) − base_layer(I))ᵀ``: the ``out × in`` matrix the layer adds to its base (fp32).

    The model must be in eval mode (no dropout); every term is linear in the input, so this is
    exactly what the adapters and the strategy's hooks add, up to fp32 rounding.
    """
    base = layer.get_base_layer()
    ref = layer.lora_A[next(iter(layer.lora_A))].weight if len(layer.lora_A) else next(base.parameters())
    half = [p for p in base.parameters(recurse=False) if p.dtype in (torch.bfloat16, torch.float16)]
    kept = [p.data for p in half]
    for p in half:  # a bf16/fp16 base left so by the export (no memory for an fp32 copy): this layer alone in fp32
        p.data = p.data.float()
    observed = None
    try:
        for start in range(0, layer.in_features, READOUT_BLOCK):
            stop = min(start + READOUT_BLOCK, layer.in_features)
            eye = torch.zeros(stop - start, layer.in_features, device=ref.device, dtype=torch.float32)
            eye[:, start:stop] = torch.eye(stop - start, device=ref.device)
            block = (layer(eye).float() - base(eye).float()).cpu()
            if observed is None:
                observed = torch.empty(block.shape[1], layer.in_features, dtype=torch.float32)
            observed[:, start:stop] = block.T
            del eye, block
    finally:
        for p, data in zip(half, kept, strict=True):
            p.data = data
    return observed


def read_layers(model: torch.nn.Module, strategy: Any) -> dict[str, LayerState]:
    """Every LoRA-wrapped layer of the run's model as a :class:`LayerState` (model in eval mode).

    Call it before any forward pass of a 4/8-bit model (bitsandbytes repacks weights for CPU kernels).
    """
    return dict(iter_layers(model, strategy))


def iter_layers(model: torch.nn.Module, strategy: Any) -> Iterator[tuple[str, LayerState]]:
    """:func:`read_layers` one layer at a time: a 7B model's states together (fp32 base, float64 read-out) would
    take 13 GB beside the model; the merged export uses each and lets it go (and each dense residual, when the
    strategy reads them from the checkpoint as they are asked for)."""
    layers = wrapped_layers(model)
    names = list(layers)
    kept = _checked(strategy.kept_factors() or {}, names, "factors", strategy)
    residuals = _checked(strategy.base_residuals() or {}, names, "residuals", strategy)
    kept_in_base = bool(getattr(strategy, "kept_in_base", False))
    for name, layer in layers.items():
        adapter = adapter_pieces(name, layer)
        scale = adapter[0].scale if adapter else float(next(iter(layer.scaling.values()), 1.0))
        base = oriented(layer, current_weight(layer.get_base_layer())).cpu()
        residual = residuals.get(name)
        state = LayerState(
            name=name, base=base, residual=None if residual is None else residual.detach().float().cpu(),
            adapter=adapter, kept=[LowRank(B.detach().float().cpu(), A.detach().float().cpu(), float(s))
                                   for B, A, s in kept.get(name, [])],
            kept_in_base=kept_in_base, observed=observed_addition(layer), scale=scale)
        state.check_explained()
        yield name, state
        del state, residual, base  # a residual read one layer at a time (StoredResiduals) goes before the next
    forget = getattr(residuals, "forget", None)  # StoredResiduals keeps the newest it read: not needed any more
    if forget is not None:
        forget()


@torch.no_grad()
def dequantize_linears(model: torch.nn.Module) -> int:
    """Replace every bitsandbytes linear layer of ``model`` by a float32 ``nn.Linear``; returns how many.

    Also drops the model's quantization config, so ``save_pretrained`` writes plain weights.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if not is_quantized(module):
            continue
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight.copy_(dense_weight(module))
        if module.bias is not None:
            linear.bias.copy_(module.bias.detach().float())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
        replaced += 1
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return replaced
