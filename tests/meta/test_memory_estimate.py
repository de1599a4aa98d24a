"""The dry run's activation memory (fedllm.engine.activation_memory) against what a real step saves, and its fits line.

The trace runs one decoder layer on fake tensors; the reference is the same layer of a real model run forward on
real tensors, counting the distinct storages autograd saves (``saved_tensors_hooks``, parameters left out) — the
bytes backward will read. bench/memory_bound.py holds the whole estimate against measured peaks (docs/memory.md).
"""

import pytest
import torch

from fedllm.engine.activation_memory import activation_peak, checkpointed_layers, layer_activations
from fedllm.engine.client import lora_input_casts_skipped, train_autocast, training_attention
from fedllm.models.grouped_attention import BLOCKED_NAME
from fedllm.models.loading import load_model
from fedllm.models.supervised_loss import base_of
from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig


def _saved_by_layer_one(model, cfg, ids):
    """Bytes of the distinct non-parameter storages layer 1 (whose input requires a gradient, as every layer's but the first) saves for backward in a real forward under ``cfg``."""
    layer = base_of(model).model.layers[1]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, shared, on = {}, set(), [False]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if on[0] and ptr not in params | shared:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def enter(module, args, kwargs):  # the mask and the rotary cos/sin every layer shares: counted apart
        on[0] = True
        assert args  # the hidden states come first, the rest by name
        for v in kwargs.values():
            for t in v if isinstance(v, tuple) else (v,):
                if isinstance(t, torch.Tensor):
                    shared.add(t.untyped_storage().data_ptr())

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(lambda *_: on.__setitem__(0, False))
    model.train()
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0  # a padded row: the attention takes a mask, as a padded batch's does
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), train_autocast(torch.device("cpu"), cfg.dtype), \
            lora_input_casts_skipped(model, cfg), training_attention(model, cfg):
        model(input_ids=ids, attention_mask=mask)
    return sum(saved.values())


@pytest.mark.parametrize("family", ["llama", "gemma"])
@pytest.mark.parametrize("dtype,length", [("bf16", 40), ("fp32", 40), ("bf16", 300)])  # eager; SDPA; blocked past 256
def test_traced_layer_saves_the_bytes_a_real_forward_saves(family, dtype, length):
    model = load_model(ModelConfig(name=f"tiny-{family}", dtype=dtype), LoraConfig(r=4, dropout=0.1)).model
    cfg = TrainConfig(dtype=dtype, max_length=length)
    ids = torch.randint(3, 100, (3, length), generator=torch.Generator().manual_seed(0))
    traced = layer_activations(model, cfg, 3, length, "cpu")
    assert traced.attention == ("sdpa" if dtype == "fp32" else "eager" if length <= 256 else BLOCKED_NAME)
    real = _saved_by_layer_one(model, cfg, ids)
    if traced.attention == BLOCKED_NAME:  # the trace cannot read a fake mask: it takes every block as causal, and
        # keeps the padded batch's mask-add out of its count; it may only err upwards, and by little
        assert real <= traced.saved <= 1.03 * real, (traced.saved, real)
    else:
        assert traced.saved == real
    assert traced.boundary == 3 * length * 64 * (2 if dtype == "bf16" else 4)  # b x s x hidden, the stream's dtype


def test_checkpointing_keeps_each_layers_input_and_recomputes_one_layer():
    traced = layer_activations(load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4)).model, TrainConfig(), 2,
                               32, "cpu")
    plain, every, third = (activation_peak(traced, 30, k) for k in (None, 1, 3))
    shared = traced.shared  # the mask and the rotary cos/sin, once for every layer
    # what the forward holds until backward starts, and what backward adds: one layer's gradients, and checkpointed
    # the one layer recomputed at a time (not held during the forward nor the head)
    assert plain == {"activations": 30 * traced.saved + shared, "backward": traced.saved}
    assert every == {"activations": 30 * traced.boundary + shared, "backward": 2 * traced.saved}
    assert checkpointed_layers(30, 3) == 10
    assert third == {"activations": 10 * traced.boundary + 20 * traced.saved + shared, "backward": 2 * traced.saved}


@pytest.mark.parametrize("dtype,compiled,per_logit", [(torch.bfloat16, False, 14), (torch.float32, False, 16),
                                                       (torch.bfloat16, True, 4)])
def test_fused_head_chunk_peak_is_what_the_allocator_holds(dtype, compiled, per_logit):
    """One chunk of the fused head + loss at its peak, as torch's CPU allocator reports it to the profiler (every
    allocation and free, the kernels' own temporaries included): the logits, log_softmax's fp32 output (and fp32 copy
    of a bf16 input), the exponent's cast and the scatter's new tensor, which on a CPU in bf16 allocates an fp32
    temporary of the whole chunk: 14 bytes a logit in bf16, 16 in fp32. Compiled by inductor (``train.compile`` on a
    CPU) the chunk keeps only the logits and the gradient it writes: 4 bytes a logit in bf16. The estimate's per-logit
    figure is the same."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from fedllm.models.fused_head_loss import chunk_peak_bytes_per_logit, compiled_rows, fused_head_cross_entropy

    vocab, hidden, rows = 4096, 8, 64
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    h = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    with compiled_rows("inductor") if compiled else contextlib.nullcontext():
        if compiled:
            fused_head_cross_entropy(h, weight, targets, chunk_bytes=rows * vocab * 4)  # compiles, outside the profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fused_head_cross_entropy(h, weight, targets, chunk_bytes=rows * vocab * 4)  # one chunk of every row
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    # above the chunk: the kept rows x hidden gradient, the losses, a chunk's targets (under 1 % here)
    assert rows * vocab * per_logit <= peak <= rows * vocab * per_logit * 1.01
    assert chunk_peak_bytes_per_logit(dtype.itemsize, "cpu", compiled) == per_logit


def test_fits_line_of_the_llama2_7b_metamathqa_recipe(meta_costs):
    """Issue #48's acceptance: the paper's batch and length (16 x 512, 8-bit base, FRLoRA's fp32 residuals) fit a
    24 GB GPU once gradient checkpointing is on; without it the line says no and names the options that fit."""
    from fedllm.commands.memory_fit import fits_lines, gpu_bytes

    recipe = "recipes/frlora/llama2-7b-metamathqa-frlora.yaml"
    on = meta_costs(recipe, "train.gradient_checkpointing=true")
    assert sum(on.memory().values()) <= 24e9 and gpu_bytes(on) <= 24 * 2**30
    assert fits_lines(on)[0].startswith("  fits: 24 GB / 40 GB / 80 GB GPU: yes / yes / yes")
    off = meta_costs(recipe, "train.gradient_checkpointing=false")
    lines = fits_lines(off)
    assert lines[0].startswith("  fits: 24 GB / 40 GB / 80 GB GPU: no / no / yes")
    assert "train.gradient_checkpointing: true" in lines[1] and "train.batch_size: 2 with grad_accum: 8" in lines[1]
    # checkpointing keeps 32 layers' inputs (bf16: the 8-bit base keeps its stream in model.dtype) instead of 32
    # layers' activations
    layer = off.layer(off.device)
    assert off.memory()["activations"] - on.memory()["activations"] == 32 * layer.saved - 32 * layer.boundary
    assert layer.boundary == 16 * 512 * 4096 * 2


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_without_a_half_gemm_adds_the_fp32_blocks(meta_costs, monkeypatch, native):
    """A bf16 step on a CPU without oneDNN's bf16 GEMM computes its products in fp32 blocks
    (fedllm.models.cpu_half_matmul): the estimate adds their bytes there, and only there."""
    from fedllm.models import cpu_half_matmul

    monkeypatch.setattr(cpu_half_matmul, "native_half_gemm", lambda dtype: native)
    costs = meta_costs("recipes/frlora/llama2-7b-metamathqa-frlora.yaml", "train.dtype=bf16")
    blocks = 0 if native else 3 * 4 * cpu_half_matmul.BLOCK_FLOATS
    assert costs.memory("cpu")["fp32 blocks"] == blocks
    assert costs.memory("cuda")["fp32 blocks"] == 0
    fp32 = meta_costs("recipes/frlora/llama2-7b-metamathqa-frlora.yaml", "train.dtype=fp32", "model.dtype=fp32",
                      "model.quantization=none")
    assert fp32.memory("cpu")["fp32 blocks"] == 0


@pytest.mark.parametrize("family,dtype", [("llama", "bf16"), ("gemma", "fp32")])  # grouped eager; SDPA
def test_traced_compiled_layer_saves_the_bytes_a_compiled_forward_saves(family, dtype, monkeypatch):
    """``train.compile``: the trace (inductor's decompositions and min-cut partition, on fake tensors) against what
    layer 1 saves when fedllm's client compiles it (:func:`fedllm.engine.compiled.compiled_training`) with torch's
    ``aot_eager_decomp_partition`` backend: inductor's decompositions and partition, run without code generation, so
    the same saved tensors in a second instead of a C++ build. The compiled layer keeps less than eager's: elementwise
    products are recomputed in its backward. The graph is compiled for the batch's width, as on a GPU: a CPU's one
    graph for every width (dynamic shapes) saves the same tensors and a few 0-dimensional fp32 scalars besides (20
    bytes a layer here), which the trace's static shapes keep as constants, and takes 6x as long to compile."""
    length = 40
    from fedllm.engine import compiled

    model = load_model(ModelConfig(name=f"tiny-{family}", dtype=dtype), LoraConfig(r=4, dropout=0.1)).model
    cfg = TrainConfig(dtype=dtype, max_length=length, compile=True)
    traced = layer_activations(model, cfg, 3, length, "cpu")
    eager = layer_activations(model, TrainConfig(dtype=dtype, max_length=length), 3, length, "cpu")
    assert traced.compiled and not eager.compiled
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager_decomp_partition")
    monkeypatch.setattr(compiled, "one_graph_for_all_widths", lambda cfg, device_type: False)
    ids = torch.randint(3, 100, (3, length), generator=torch.Generator().manual_seed(0))
    with compiled.compiled_training(model, cfg):
        real = _saved_by_layer_one(model, cfg, ids)
    assert traced.saved == real
    assert traced.saved < 0.8 * eager.saved


def test_a_compiled_recipe_is_estimated_from_the_partition_and_else_from_eager(meta_costs, monkeypatch):
    """The LLaMA-2-7B FRLoRA recipe with ``train.compile: true``: the layer recomputed under checkpointing (and the
    backward's one layer) is the compiled layer's saved tensors, less than eager's; a layer AOTAutograd cannot trace
    is estimated from eager's saved tensors (an upper bound) instead of the formula."""
    import dataclasses

    from fedllm.engine import compiled_activations

    recipe = "recipes/frlora/llama2-7b-metamathqa-frlora.yaml"
    report, eager_report = meta_costs(recipe, "train.compile=true"), meta_costs(recipe)
    layer, eager = report.layer("cuda"), eager_report.layer("cuda")  # SDPA in both (on a CPU eager's is blocked)
    assert layer.compiled and not eager.compiled and layer.attention == eager.attention == "sdpa"
    assert layer.boundary == eager.boundary and layer.saved < 0.8 * eager.saved
    compiled_mem, eager_mem = report.memory("cuda"), eager_report.memory("cuda")
    # checkpointed: the layers keep their inputs either way; the recomputed layer and the backward's one differ
    assert compiled_mem["activations"] == eager_mem["activations"]
    assert eager_mem["backward"] - compiled_mem["backward"] == 2 * (eager.saved - layer.saved)
    assert "what inductor's partition saves (train.compile)" in report.activation_lines()[0]

    def untraceable(*args, **kwargs):
        raise RuntimeError("an operator AOTAutograd cannot trace")

    monkeypatch.setattr(compiled_activations, "compiled_saved", untraceable)
    fallback = dataclasses.replace(report).layer("cuda")  # a fresh report: nothing traced yet
    assert fallback == eager
