"""Merged export: a plain transformers model directory with everything the run learned folded in.

Each LoRA-wrapped weight becomes ``W + Σ s_i B_i A_i`` (current base, active adapters and the
strategy's kept factors), computed in float64 from fp32 (or dequantized 4/8-bit) weights; the
trained classifier head (PEFT ``modules_to_save``) replaces the original one. The result loads
with ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification.from_pretrained(DIR)``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fedllm.common.heap import give_back_freed_heap
from fedllm.export.dora import is_dora, merge_dora
from fedllm.export.errors import ExportCheckError
from fedllm.export.source import Source, fp32_copy_fits, kept_dtype_of, probe_inputs, probe_logits, to_fp32
from fedllm.export.spill import SpilledWeights, fits_on_disk
from fedllm.export.weights import dequantize_linears, iter_layers, read_layers, relative_name, wrapped_layers
from fedllm.export.widen import save_widened, widens
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
    if quantized:
        return _write_dequantized(model, tokenizer, strategy, source, out, dtype, inputs, wrapped)
    # a half-precision base is computed in fp32 one module at a time (exact: as model.float()), its merged layers'
    # fp32 weights kept on disk until the save (fedllm.export.spill) when they fit there; else they are stored in
    # its dtype and the probe is reported
    half = kept_dtype_of(model)
    spilled = SpilledWeights(out) if half and _spill_fits(out, wrapped) else None
    kept_dtype = half if spilled is None else None
    try:
        reference = probe_logits(model, inputs, in_fp32=kept_dtype is None)
        explained = []
        for name, state in iter_layers(model, strategy):  # one layer at a time, each into its base layer or to disk
            explained.append(state.explained)
            weight = _oriented(wrapped[name], state.merged_weight())
            del state
            if spilled is None:
                _store(wrapped[name].get_base_layer(), weight, kept_dtype)
            else:
                spilled.put(name, weight)
            del weight
        give_back_freed_heap()
        base = model.unload()  # drops the LoRA wrappers; the active classifier copy (modules_to_save) stays
        dequantize_linears(base)  # nothing packed here: it drops a GGUF preset's quantization config, which
        # transformers' save_pretrained refuses ("quantized with gguf and is not serializable")
        targets = {relative_name(name): base.get_submodule(relative_name(name)) for name in wrapped}
        readers = {} if spilled is None else {targets[relative_name(n)]: spilled.reader(n) for n in spilled.files}
        got = probe_logits(base, inputs, in_fp32=kept_dtype is None, weights=readers)
        if kept_dtype:  # the run's own compute dtype, not fp32: report, do not hold to fp32 tolerance
            diff = float((got - reference).abs().max())
        else:
            diff = check_probe(reference, got, str(source.checkpoint))
        for name in list(spilled.files if spilled is not None else []):  # cast to the saved dtype one at a time
            _put(targets[relative_name(name)].weight, spilled.read(name).to(DTYPES[dtype]))
    finally:
        if spilled is not None:
            spilled.close()
    return save_merged(base, tokenizer, source, out, dtype, {
        "layers": len(explained), "observed_layers": sum(not e for e in explained),
        "max_logit_diff": diff, "checked": not kept_dtype, "dequantized_from": None, "merged_in": kept_dtype})


def _write_dequantized(model: Any, tokenizer: Any, strategy: Any, source: Source, out: Path, dtype: str,
                       inputs: dict[str, torch.Tensor], wrapped: dict[str, Any]) -> dict[str, Any]:
    """:func:`write_merged` of a 4/8-bit base: every layer read before any probe forward (bitsandbytes repacks
    weights on CPU), merged into the dequantized fp32 base; the probe is reported, not held to fp32 tolerance."""
    states = read_layers(model, strategy)
    merged = {name: state.merged_weight() for name, state in states.items()}
    explained = [state.explained for state in states.values()]
    del states
    reference = probe_logits(model, inputs)
    base = model.unload()
    dequantize_linears(base)
    to_fp32(base)
    for name, weight in merged.items():
        _store(base.get_submodule(relative_name(name)), _oriented(wrapped[name], weight), None)
    merged.clear()
    diff = float((probe_logits(base, inputs) - reference).abs().max())
    return save_merged(base, tokenizer, source, out, dtype, {
        "layers": len(explained), "observed_layers": sum(not e for e in explained), "max_logit_diff": diff,
        "checked": False, "dequantized_from": source.recipe.model.quantization, "merged_in": None})


def _spill_fits(out: Path, wrapped: dict[str, Any]) -> bool:
    """Whether the merged layers' fp32 weights fit on ``out``'s disk (:func:`fits_on_disk`); a warning if not."""
    nbytes = sum(4 * layer.get_base_layer().weight.numel() for layer in wrapped.values())
    if fits_on_disk(out, nbytes):
        return True
    logging.getLogger("fedllm").warning(
        "export: the fp32 merged layers need %.2f GB on disk beside %s and do not fit (GB = 1024**3 bytes): merging "
        "each layer in fp32 and keeping it in the base's dtype; the probe check is reported, not held to fp32 "
        "tolerance", nbytes / 2**30, out)
    return False


def _oriented(wrapper: Any, weight: torch.Tensor) -> torch.Tensor:
    """An ``out × in`` weight as ``wrapper``'s base layer stores it (transposed for ``fan_in_fan_out``)."""
    return (weight.T if getattr(wrapper, "fan_in_fan_out", False) else weight).contiguous()


def _put(weight: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``value`` into ``weight``: in place when the dtypes agree (a memory-mapped base's pages become the merged
    layer's instead of staying beside a second copy), else as its new data."""
    if weight.dtype == value.dtype and weight.shape == value.shape:
        weight.data.copy_(value)
    else:
        weight.data = value


def _store(target: Any, weight: torch.Tensor, kept_dtype: Any) -> None:
    """A merged weight (oriented as ``target`` stores it) into ``target``'s weight, in fp32 or the kept base dtype."""
    target.weight.data = weight.float() if kept_dtype is None else weight.to(target.weight.dtype)


def save_merged(base: Any, tokenizer: Any, source: Source, out: Path, dtype: str,
                info: dict[str, Any]) -> dict[str, Any]:
    """Save a merged plain model (label names, ``dtype``) and its tokenizer to ``out``; returns ``info``."""
    if source.label_names:
        base.config.id2label = dict(enumerate(source.label_names))
        base.config.label2id = {name: i for i, name in enumerate(source.label_names)}
    if widens(base, DTYPES[dtype]):  # e.g. a bf16 base saved in fp32: one shard at a time, not the whole model cast
        save_widened(base, out, DTYPES[dtype])
    else:
        base.to(DTYPES[dtype])
        base.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return info
