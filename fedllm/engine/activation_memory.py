"""What one training step keeps for backward, read from the model's own code rather than from a formula.

The activations of a step are the tensors autograd saves for backward. Which ones depends on code a formula
cannot follow: the attention a client step picks (eager's ``S x S`` weights in fp32 and the compute dtype, or
SDPA's output and log-sum-exp: :func:`fedllm.engine.client.training_attention_choice`), an RMSNorm's fp32 copy of
its input, Gemma's extra norms, LoRA's dropout (a dropped copy of each wrapped layer's input and its mask), autocast's
casts, a ``prepare_model_for_kbit_training`` base (``4bit-flowertune``) whose norms and embedding are fp32 (then the
residual stream is fp32 too).

:func:`layer_activations` therefore runs one decoder layer of the recipe's model forward on *fake* tensors
(``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no storage, no arithmetic) at the step's batch
and length, under the step's autocast and attention, and adds up the bytes of every distinct storage autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), leaving out the parameters' own storages (the weights are counted
once, as weights). The layer is built from the model's config with one layer and a vocabulary of 8, on
uninitialised storage (``to_empty``: nothing is written), its parameters in the dtypes of the model's first layer,
with the model's LoRA. A quantised linear layer is traced as a plain one in the compute dtype: like a frozen plain
layer it keeps no input for backward (bitsandbytes' 4-bit matmul keeps its packed weight only; its 8-bit one kept
its input until :mod:`fedllm.models.kbit_memory`), and it dequantises its weight one layer at a time (the cost
report adds the largest: :func:`fedllm.commands.cost_report.dequantised_bytes`).

Under ``train.compile`` a layer keeps what inductor's partition of its forward and backward saves, not what eager's
autograd saves: the trace then runs AOTAutograd with inductor's decompositions and partitioner on the same fake
tensors (:mod:`fedllm.engine.compiled_activations`), and falls back to eager's count (an upper bound) for a layer it
cannot trace.

With ``train.gradient_checkpointing`` (non-reentrant, per decoder layer: :mod:`fedllm.engine.checkpointed`) a
checkpointed layer keeps only its input hidden state until backward recomputes it, one layer at a time
(:func:`activation_peak`, which also keeps the forward's holdings apart from the backward's transients).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Optional

#: The quantisations whose base goes through ``peft.prepare_model_for_kbit_training``
#: (:func:`fedllm.models.loading.prepare_kbit_base`), which casts every parameter bitsandbytes leaves unquantised —
#: norms, the embedding, an untied head — to fp32 (and so the residual stream); ``4bit`` and ``8bit`` keep them in
#: ``model.dtype``.
KBIT_FP32_QUANTIZATIONS = ("4bit-flowertune",)


def unquantised_fp32(quantization: str) -> bool:
    """Whether a base loaded with ``quantization`` holds its unquantised parameters in fp32."""
    return quantization in KBIT_FP32_QUANTIZATIONS


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer holds for backward, for the whole micro-batch."""

    saved: int  # every tensor autograd keeps from its forward (parameters excluded)
    boundary: int  # its input hidden state (what a checkpointed layer keeps)
    attention: str  # the attention implementation traced
    stream_dtype: str  # dtype of the residual stream between layers
    shared: int = 0  # inputs every layer saves and shares (the attention mask, the rotary cos/sin): counted once
    compiled: bool = False  # traced as ``train.compile`` runs it: inductor's partition (compiled_activations)


def decoder_layers(model: Any) -> Optional[Any]:
    """The model's ``ModuleList`` of decoder (or encoder) layers: the longest one, or None."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _one_layer_config(config: Any, attention: str) -> Any:
    cfg = copy.deepcopy(config)
    text = _text_config(cfg)
    text.num_hidden_layers = 1
    text.vocab_size = 8
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    for c in {id(cfg): cfg, id(text): text}.values():
        c._attn_implementation = attention
        if getattr(c, "pad_token_id", None) is not None:
            c.pad_token_id = 0
    return cfg


def _dtype_like(model: Any, quantized: str, compute: Any) -> dict[str, Any]:
    """``{name in layer 0: dtype}`` of the parameters of the model's first decoder layer as a run trains them."""
    import torch

    layers = decoder_layers(model)
    out = {}
    for name, p in layers[0].named_parameters():
        dtype = p.dtype
        if not dtype.is_floating_point:  # a bitsandbytes-packed weight: traced as a plain one in the compute dtype
            dtype = compute
        elif quantized and p.device.type == "meta" and "lora_" not in name:
            dtype = compute if name.endswith("weight") and p.dim() == 2 else (
                torch.float32 if unquantised_fp32(quantized) else dtype)
        out[name] = dtype
    return out


def _stream_dtype(model: Any, quantized: str, compute: Any) -> Any:
    """dtype of the hidden states entering the first layer: the input embedding's."""
    import torch

    emb = model.get_input_embeddings().weight
    if quantized and emb.device.type == "meta":
        return torch.float32 if unquantised_fp32(quantized) else compute
    return emb.dtype if emb.dtype.is_floating_point else compute


def layer_activations(model: Any, train: Any, rows: int, length: int, device_type: str,
                      quantized: str = "", attention: Optional[str] = None) -> LayerActivations:
    """Trace one decoder layer of ``model`` (PEFT-wrapped, real or on the meta device) at ``rows x length``.

    Args:
        model: The recipe's model with its LoRA.
        train: The recipe's ``train`` section (``dtype``; ``compile``: the saved tensors of inductor's partition,
            :mod:`fedllm.engine.compiled_activations`, and on a CPU the grouped eager attention).
        rows: Sequences in the micro-batch (twice ``batch_size`` for preference pairs).
        length: Positions per sequence.
        device_type: ``cpu`` or ``cuda``: where the step runs (it picks the attention).
        quantized: ``model.quantization`` when the base is bitsandbytes-quantised, else "".
            Only ``4bit-flowertune`` (PEFT's k-bit preparation) holds the unquantised parameters in fp32.
        attention: Force an attention implementation (default: the one a client step picks).

    Raises:
        Exception: the layer could not be traced (an architecture whose forward fake tensors cannot run);
            callers fall back to the formula.
    """
    import torch

    from fedllm.engine.client import training_attention_choice
    from fedllm.models.state import DTYPES
    from fedllm.models.supervised_loss import base_of

    base = base_of(model)
    config = base.config
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    compiled = bool(getattr(train, "compile", False))
    if attention is None:
        attention = training_attention_choice(current, torch.device(device_type), train.dtype, length,
                                              compiled=compiled) or current
    if attention.startswith("flash_attention"):
        attention = "sdpa"  # the same saved tensors (output and log-sum-exp) for a dense batch
    compute = DTYPES[train.dtype] if train.dtype in ("bf16", "fp16") else torch.float32
    dtypes = _dtype_like(model, quantized, compute)
    stream = _stream_dtype(model, quantized, compute)
    trace = functools.partial(_trace, type(base), _one_layer_config(config, attention),
                              model.peft_config.get("default"), tuple(sorted((n, str(d)) for n, d in dtypes.items())),
                              str(stream), rows, length, train.dtype, device_type)
    try:
        traced, shared = trace(compiled)
    except Exception:  # noqa: BLE001 — a layer AOTAutograd cannot trace: eager's saved tensors, an upper bound
        if not compiled:
            raise
        compiled = False
        traced, shared = trace(False)
    return LayerActivations(traced, rows * length * _text_config(config).hidden_size * stream.itemsize, attention,
                            str(stream).removeprefix("torch."), shared, compiled)


def _trace(cls: Any, config: Any, lora: Any, dtypes: tuple, stream: str, rows: int, length: int, dtype: str,
           device_type: str, compiled: bool = False) -> tuple[int, int]:
    import contextlib

    import torch
    from peft import get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fedllm.engine.client import lora_input_casts_skipped, train_autocast
    from fedllm.models.supervised_loss import base_of

    with torch.device("meta"):
        one = cls(config)
    one.to_empty(device="cpu")
    if lora is not None:
        lora = copy.copy(lora)
        lora.modules_to_save = None
        one = get_peft_model(one, lora)
    layer = decoder_layers(one)[0]
    wanted = dict(dtypes)
    for name, p in layer.named_parameters():
        target = wanted.get(name)
        if target is not None and str(p.dtype) != target:
            p.data = torch.empty(p.shape, dtype=getattr(torch, target.removeprefix("torch.")))
    one.train()
    saved: dict[int, tuple[Any, int]] = {}  # id of the tensor owning the storage -> (it, its bytes)
    shared: dict[int, tuple[Any, int]] = {}  # the same for the layer's inputs every layer shares (mask, rotary)
    inputs: set[int] = set()
    counting = [False]
    partitioned: list[tuple[int, int]] = []
    partitioned_call = [False]

    def pack(t: Any) -> Any:
        if counting[0]:
            owner = t._base if t._base is not None else t  # (a fake tensor's storage handle is not stable: its base is)
            if owner.untyped_storage()._cdata not in params and id(owner) not in params_ids:
                (shared if id(owner) in inputs else saved)[id(owner)] = (owner, owner.untyped_storage().nbytes())
        return t

    def enter(module: Any, args: tuple, kwargs: dict) -> None:
        if partitioned_call[0]:  # the compiled trace's own call of the layer
            return
        counting[0] = not compiled
        rest = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states" or not args]
        for v in rest:
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor):
                    inputs.update({id(t), id(t._base if t._base is not None else t)})
        if compiled:  # inductor's partition of this layer's forward and backward, instead of eager's saved tensors
            from fedllm.engine.compiled_activations import compiled_saved

            partitioned_call[0] = True
            partitioned.append(compiled_saved(module, args, kwargs, inputs))
            raise _LayerTraced

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(lambda *_: counting.__setitem__(0, False))
    stream_dtype = getattr(torch, stream.removeprefix("torch."))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        named = [*base_of(one).named_parameters(), *base_of(one).named_buffers()]
        fakes = {n: mode.from_tensor(t) for n, t in named}
        for t, (n, real) in zip(fakes.values(), named):
            t.requires_grad_(real.requires_grad)
        params = {t.untyped_storage()._cdata for t in fakes.values()}
        params_ids = {id(t) for t in fakes.values()} | {id(t._base) for t in fakes.values() if t._base is not None}
        mask = torch.ones(rows, length, dtype=torch.long)
        embeds = torch.empty(rows, length, _text_config(config).hidden_size, dtype=stream_dtype, requires_grad=True)
        embeds = embeds * 1  # a non-leaf, as the hidden states between layers are
        hooks = contextlib.nullcontext() if compiled else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, train_autocast(torch.device("cpu"), dtype), lora_input_casts_skipped(one, _Dtype(dtype)), \
                contextlib.suppress(_LayerTraced):
            torch.func.functional_call(base_of(one), fakes, (), {"inputs_embeds": embeds, "attention_mask": mask,
                                                                 "use_cache": False}, strict=False, tie_weights=False)
    if compiled:
        return partitioned[0]
    return sum(n for _, n in saved.values()), sum(n for _, n in shared.values())


class _LayerTraced(Exception):
    """Raised in the layer's pre-hook once the compiled trace has its count: the rest of the model need not run."""


@dataclass
class _Dtype:
    dtype: str


def checkpointed_layers(layers: int, every: int | None) -> int:
    """How many of ``layers`` decoder layers ``train.gradient_checkpointing`` checkpoints: layers 0, k, 2k, ... for
    every ``k``-th (:func:`fedllm.engine.checkpointed.every_n_layers`; None: none)."""
    return 0 if not every else -(-layers // every)


def activation_peak(layer: LayerActivations, layers: int, every: int | None) -> dict[str, int]:
    """The trunk's share of the peak, in two phases that do not overlap (``every``: every how many layers one is
    checkpointed, None: none).

    ``activations``: what the forward holds until backward starts: every layer's saved tensors, a checkpointed
    layer's input only. ``backward``: what the backward adds while it runs: one layer's gradients (taken as its
    saved tensors again) and, checkpointed, the one layer recomputed at a time. The head's chunk buffers are freed
    before backward begins, so the cost report adds the larger of the head's chunk and this term, not both."""
    kept = checkpointed_layers(layers, every)
    recomputed = layer.saved if kept else 0
    return {"activations": kept * layer.boundary + (layers - kept) * layer.saved + layer.shared,
            "backward": recomputed + layer.saved}
