"""Adapter export: a standard PEFT LoRA on the *original* base model.

Loads with ``PeftModel.from_pretrained(original_base, DIR)``. Each layer's learned change
(current base − original base + adapters + kept factors) is written as one LoRA at scale
``alpha / r`` of the run: FedAvg-family adapters as they are; FedLoRU's kept factors stacked
(rank r × number of pieces, exact); a changed base (FRLoRA-v1's SVD init, FRLoRA's merged
residuals) factored by SVD — exact at its numerical rank (FRLoRA-v1: 2r, alpha doubled, as
PEFT's PiSSA-to-LoRA conversion), or truncated to ``--rank`` with the error reported.
Layers of different rank are described by ``rank_pattern`` / ``alpha_pattern``.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

from fedllm.export.dora import is_dora, write_dora_adapter
from fedllm.export.errors import ExportInputError
from fedllm.export.factors import LayerFactors, layer_factors
from fedllm.export.merged import check_probe
from fedllm.export.source import Source, load_original_base, probe_inputs, probe_logits, to_fp32
from fedllm.export.weights import PEFT_PREFIX, oriented, read_layers, relative_name, wrapped_layers
from fedllm.models.lowrank import dense_weight
from fedllm.models.state import DTYPES


def check_rank(model: Any, rank: Optional[int]) -> None:
    """:class:`ExportInputError` unless ``1 <= rank <= min(out, in)`` of every LoRA layer."""
    if rank is None:
        return
    if rank < 1:
        raise ExportInputError(f"--rank {rank}: expected a positive integer")
    for name, layer in wrapped_layers(model).items():
        size = min(layer.out_features, layer.in_features)
        if rank > size:
            raise ExportInputError(f"--rank {rank} is above the size of layer {relative_name(name)} "
                                   f"({layer.out_features} x {layer.in_features}); use at most {size}")


def compute_factors(model: Any, strategy: Any, original: Any, rank: Optional[int]) -> dict[str, LayerFactors]:
    """The exported LoRA of every layer, keyed by module name in the base model."""
    layers = wrapped_layers(model)
    out = {}
    for name, state in read_layers(model, strategy).items():
        rel = relative_name(name)
        before = oriented(layers[name], dense_weight(original.get_submodule(rel)))
        out[rel] = layer_factors(before, state.effective(), state.base_without_pieces(), state.pieces(), state.scale,
                                 rank)
    return out


def adapter_config(model: Any, factors: dict[str, LayerFactors]) -> Any:
    """A ``LoraConfig`` like the run's (targets, head, task) with the exported ranks and alphas."""
    from peft import LoraConfig

    run_cfg = model.peft_config[model.active_adapter]
    r = Counter(f.rank for f in factors.values()).most_common(1)[0][0]
    scale = Counter(f.scale for f in factors.values()).most_common(1)[0][0]
    alpha = scale * r
    return LoraConfig(
        r=r, lora_alpha=alpha, target_modules=run_cfg.target_modules, modules_to_save=run_cfg.modules_to_save,
        task_type=run_cfg.task_type, fan_in_fan_out=run_cfg.fan_in_fan_out, lora_dropout=run_cfg.lora_dropout,
        rank_pattern={n: f.rank for n, f in factors.items() if f.rank != r},
        alpha_pattern={n: f.alpha for n, f in factors.items() if not math.isclose(f.alpha, alpha)}, bias="none")


@torch.no_grad()
def fill_adapter(exported: Any, model: Any, factors: dict[str, LayerFactors]) -> None:
    """Write the factors and the run's trained ``modules_to_save`` copies into the exported PEFT model."""
    for name, layer in wrapped_layers(exported).items():
        f = factors[relative_name(name)]
        layer.lora_A["default"].weight.copy_(f.A.float())
        layer.lora_B["default"].weight.copy_(f.B.float())
        if not math.isclose(layer.scaling["default"], f.scale, rel_tol=1e-9):
            raise RuntimeError(f"{name}: exported scaling {layer.scaling['default']} != {f.scale}")
    marker = f".modules_to_save.{model.active_adapter}."
    params = dict(exported.named_parameters())
    for name, value in model.named_parameters():
        if marker in name:
            params[name.replace(marker, ".modules_to_save.default.")].copy_(value)


def summarize(factors: dict[str, LayerFactors]) -> dict[str, Any]:
    """Ranks and errors of the export, for the model card and the result."""
    ranks = [f.rank for f in factors.values()]
    truncated = sorted(n for n, f in factors.items() if f.truncated)
    return {
        "layers": len(factors), "rank_min": min(ranks), "rank_max": max(ranks),
        "exact_rank_max": max(f.exact_rank for f in factors.values()),
        "methods": dict(Counter(f.method for f in factors.values())),
        "truncated_layers": truncated, "exact": not truncated,
        "rel_error_max": max(f.rel_error for f in factors.values()),
        "per_layer": {n: {"rank": f.rank, "exact_rank": f.exact_rank, "rel_error": f.rel_error, "method": f.method}
                      for n, f in factors.items()},
    }


@torch.no_grad()
def write_adapter(model: Any, tokenizer: Any, strategy: Any, source: Source, out: Path, dtype: str,
                  rank: Optional[int] = None, with_base: bool = False) -> dict[str, Any]:
    """Write the run's learned change as a PEFT LoRA adapter on the original base to ``out``.

    Args:
        model: The run's PEFT model (from :func:`fedllm.export.source.load_run_model`).
        tokenizer: Its tokenizer (saved beside the adapter).
        strategy: The run's strategy (for kept factors).
        source: The export source.
        out: Directory to write into (exists, empty).
        dtype: ``fp32``, ``bf16`` or ``fp16`` of the saved adapter tensors.
        rank: Largest rank per layer (truncated SVD above it); None: exact.
        with_base: Also save the original base model under ``out/base``.

    Returns:
        Facts for the model card: ranks, truncation, relative errors, probe logit difference.

    Raises:
        ExportInputError: ``rank`` above a layer's size.
        ExportCheckError: an exact export does not reproduce the run's model on the probe input.
    """
    from peft import get_peft_model

    if is_dora(model):  # the run's DoRA adapter as it is (fedllm.export.dora)
        return write_dora_adapter(model, tokenizer, strategy, source, out, dtype, rank, check_probe, with_base)
    check_rank(model, rank)
    original = load_original_base(source, tokenizer)
    if with_base:
        original.save_pretrained(str(out / "base"))
        tokenizer.save_pretrained(str(out / "base"))
    if source.recipe.model.quantization == "none":
        to_fp32(original)
    factors = compute_factors(model, strategy, original, rank)
    exported = get_peft_model(original, adapter_config(model, factors)).eval()
    exported.peft_config["default"].base_model_name_or_path = source.recipe.model.name
    fill_adapter(exported, model, factors)
    info = summarize(factors)
    inputs = probe_inputs(tokenizer)
    reference, got = probe_logits(model, inputs), probe_logits(exported, inputs)
    checked = info["exact"] and source.recipe.model.quantization == "none"
    info["max_logit_diff"] = (check_probe(reference, got, str(source.checkpoint)) if checked
                              else float((got - reference).abs().max()))
    info["checked"] = checked
    for name, param in exported.named_parameters():
        if name.startswith(PEFT_PREFIX) and (".lora_" in name or ".modules_to_save." in name):
            param.data = param.data.to(DTYPES[dtype])
    exported.save_pretrained(str(out), save_embedding_layers=False)  # no hub look-up of the base config
    tokenizer.save_pretrained(str(out))
    info["r"], info["alpha"] = exported.peft_config["default"].r, exported.peft_config["default"].lora_alpha
    return info
