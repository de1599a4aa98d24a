"""Merged export: a plain transformers model directory with everything the run learned folded in.

Each LoRA-wrapped weight becomes ``W + Σ s_i B_i A_i`` (current base, active adapters and the
strategy's kept factors), computed in float64 from fp32 (or dequantized 4/8-bit) weights; the
trained classifier head (PEFT ``modules_to_save``) replaces the original one. The result loads
with ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification.from_pretrained(DIR)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedllm.export.dora import is_dora, merge_dora
from fedllm.export.errors import ExportCheckError
from fedllm.export.source import Source, fp32_copy_fits, kept_dtype_of, probe_inputs, probe_logits, to_fp32
from fedllm.export.weights import dequantize_linears, iter_layers, read_layers, relative_name, wrapped_layers
from fedllm.models.lowrank import is_quantized
from fedllm.models.state import DTYPES

EXACT_TOLERANCE = 1e-4
"""Largest probe-logit difference (relative to the largest logit, at least 1) accepted for an fp32 export."""


def check_probe(reference: torch.Tensor, got: torch.Tensor, what: str) -> float:
    """The largest absolute logit difference; :class:`ExportCheckError` above :data:`EXACT_TOLERANCE`."""
    diff = float((got - reference).abs().max())
    bound = EXACT_TOLERANCE * max(1.0, float(reference.abs().max()))
    if not diff <= bound:
        raise ExportCheckError(f"{what}: the export does not reproduce the run's model on the probe input "
                               f"(largest logit difference {diff:.3g} > {bound:.3g})")
    return diff


@torch.no_grad()
def write_merged(model: Any, tokenizer: Any, strategy: Any, source: Source, out: Path, dtype: str) -> dict[str, Any]:
    """Fold the run's learned change into its base model and save it (with the tokenizer) to ``out``.

    Args:
        model: The run's PEFT model (from :func:`fedllm.export.source.load_run_model`); consumed.
        tokenizer: Its tokenizer.
        strategy: The run's strategy (for kept factors).
        source: The export source.
        out: Directory to write into (exists, empty).
        dtype: ``fp32``, ``bf16`` or ``fp16`` of the saved weights.

    Returns:
        Facts for the model card: merged layer count, probe logit difference, whether checked.

    Raises:
        ExportCheckError: the merged fp32 model does not reproduce the run's model.
    """
    if is_dora(model):  # PEFT's own merge of DoRA's magnitude and direction (fedllm.export.dora)
        if source.recipe.model.quantization == "none" and fp32_copy_fits(model):
            to_fp32(model)  # as load_run_model casts it for the other formats
        inputs = probe_inputs(tokenizer)
        reference = probe_logits(model, inputs)
        layers_merged = len(wrapped_layers(model))
        base = merge_dora(model, strategy)
        diff = check_probe(reference, probe_logits(base, inputs), str(source.checkpoint))
        return save_merged(base, tokenizer, source, out, dtype, {
            "layers": layers_merged, "observed_layers": 0, "max_logit_diff": diff, "checked": True,
            "dequantized_from": None, "use_dora": True})
    inputs = probe_inputs(tokenizer)
    wrapped = wrapped_layers(model)
    quantized = any(is_quantized(module) for module in model.modules())
    # a half-precision base is computed in fp32 one module at a time (exact: as model.float()) and its merged layers
    # are stored in fp32, when their fp32 copies fit; else they are stored in its dtype and the probe is reported
    kept_dtype = None if quantized or _merged_fp32_fits(model, wrapped) else kept_dtype_of(model)
    exact = not quantized and kept_dtype is None
    merged: dict[str, torch.Tensor] = {}
    if quantized:  # every layer read before any probe forward: bitsandbytes repacks weights on CPU
        states = read_layers(model, strategy)
        merged = {name: state.effective().float() for name, state in states.items()}
        explained = [state.explained for state in states.values()]
        del states
        reference = probe_logits(model, inputs)
    else:  # one layer at a time, written into its base layer (unload keeps the base layers, drops the adapters)
        reference = probe_logits(model, inputs, in_fp32=exact)
        explained = []
        for name, state in iter_layers(model, strategy):
            explained.append(state.explained)
            _store(wrapped[name].get_base_layer(), wrapped[name], state.effective(), kept_dtype)
            del state
    base = model.unload()  # drops the LoRA wrappers; the active classifier copy (modules_to_save) stays
    dequantize_linears(base)
    if quantized:
        to_fp32(base)
    for name, weight in merged.items():
        _store(base.get_submodule(relative_name(name)), wrapped[name], weight, None)
    merged.clear()
    got = probe_logits(base, inputs, in_fp32=exact)
    if quantized or kept_dtype:  # the run's own compute dtype, not fp32: report, do not hold to fp32 tolerance
        diff = float((got - reference).abs().max())
    else:
        diff = check_probe(reference, got, str(source.checkpoint))
    return save_merged(base, tokenizer, source, out, dtype, {
        "layers": len(explained), "observed_layers": sum(not e for e in explained),
        "max_logit_diff": diff, "checked": not (quantized or kept_dtype),
        "dequantized_from": source.recipe.model.quantization if quantized else None, "merged_in": kept_dtype})


def _merged_fp32_fits(model: Any, wrapped: dict[str, Any]) -> bool:
    """Whether the merged layers' fp32 weights fit beside the model (:func:`fp32_copy_fits`)."""
    weights = [layer.get_base_layer().weight for layer in wrapped.values()]
    return fp32_copy_fits(model, weights, f"its {len(weights)} merged layers")


def _store(target: Any, wrapper: Any, weight: torch.Tensor, kept_dtype: Any) -> None:
    """The effective ``out × in`` weight into ``target``'s weight, in fp32 or the kept base dtype."""
    weight = (weight.T if getattr(wrapper, "fan_in_fan_out", False) else weight).contiguous()
    target.weight.data = weight.float() if kept_dtype is None else weight.to(target.weight.dtype)


def save_merged(base: Any, tokenizer: Any, source: Source, out: Path, dtype: str,
                info: dict[str, Any]) -> dict[str, Any]:
    """Save a merged plain model (label names, ``dtype``) and its tokenizer to ``out``; returns ``info``."""
    if source.label_names:
        base.config.id2label = dict(enumerate(source.label_names))
        base.config.label2id = {name: i for i, name in enumerate(source.label_names)}
    base.to(DTYPES[dtype])
    base.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return info
