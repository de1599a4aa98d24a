"""fedllm's grouped-query eager attention (fedllm.models.grouped_attention) against transformers' eager attention.

References: transformers' own ``eager_attention_forward`` (``repeat_kv``, then per-head matmuls) on the same
inputs, in fp32 and fp64 (outputs and every gradient to rounding), tiny LLaMA / Qwen2 / Gemma models run through
transformers' attention interface under either name, and Gemma 2's soft-capped attention, which falls back to the
model's own eager function bit for bit.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from fedllm.engine.client import training_attention_choice
from fedllm.models.grouped_attention import (
    BLOCKED_NAME,
    NAME,
    blocked_causal_attention,
    grouped_eager_attention,
    register,
    register_blocked,
)
from fedllm.models.loading import load_model
from fedllm.recipe.schema import LoraConfig, ModelConfig


class Heads(torch.nn.Module):
    """What the attention functions read from their module: the group size and the head width."""

    def __init__(self, groups: int, head_dim: int):
        super().__init__()
        self.num_key_value_groups, self.head_dim = groups, head_dim


def _inputs(dtype, per_head_mask=False, seed=0):
    b, kv, g, s, d = 2, 3, 3, 11, 8
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv * g, s, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, kv, s, d, generator=gen).to(dtype) for _ in range(2))
    causal = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype).triu(1)
    mask = causal.expand(b, kv * g if per_head_mask else 1, s, s).clone()
    mask[1, :, :, 7:] = torch.finfo(dtype).min  # the second row's last 4 positions are padding
    mask[1, :, 7:, :] = 0  # (padded queries attend everywhere, as transformers' masks let them)
    return Heads(g, d), q, k, v, mask, torch.randn(b, s, kv * g, d, generator=gen).to(dtype)


def _run(fn, module, q, k, v, mask, upstream):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, weights = fn(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    (out * upstream).sum().backward()
    return out.detach(), weights.detach(), q.grad, k.grad, v.grad


def logits_and_grads(model, ids, mask, attention: str):
    """The model's logits and its parameters' gradients of a masked squared-logit loss under ``attention``."""
    config = model.get_base_model().config
    config._attn_implementation = attention
    model.zero_grad(set_to_none=True)
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
    finally:
        config._attn_implementation = "sdpa"
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("per_head_mask", [False, True])
def test_outputs_and_gradients_equal_transformers_eager_attention(per_head_mask):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        inputs = _inputs(dtype, per_head_mask)
        ours = _run(grouped_eager_attention, *inputs)
        theirs = _run(eager_attention_forward, *inputs)
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert float((a - b).abs().max()) <= tol * float(b.abs().max())
        assert float(ours[3].abs().sum()) > 0  # the keys' gradient is there


def test_bf16_outputs_equal_eager_and_gradients_are_no_farther_from_fp64():
    inputs = _inputs(torch.bfloat16)
    ours, theirs = _run(grouped_eager_attention, *inputs), _run(eager_attention_forward, *inputs)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])  # output; the queries' gradient
    exact = _run(eager_attention_forward, inputs[0], *(t.double() for t in inputs[1:]))
    for i in (3, 4):  # keys and values: summed over the group in one matmul here, after per-head rounding there
        ours_err = (ours[i].double() - exact[i]).norm()
        theirs_err = (theirs[i].double() - exact[i]).norm()
        assert ours_err <= 1.05 * theirs_err


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_tiny_models_through_the_attention_interface_equal_eager(family, monkeypatch):
    from fedllm.models import grouped_attention

    monkeypatch.setattr(grouped_attention, "_model_eager", lambda module: pytest.fail("fell back to eager"))
    model = load_model(ModelConfig(name=f"tiny-{family}"), LoraConfig(r=4, init="gaussian")).model
    config = model.get_base_model().config
    assert config.num_attention_heads != config.num_key_value_heads  # grouped-query attention
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    (a, ga), (b, gb) = (logits_and_grads(model, ids, mask, name) for name in ("eager", register()))
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max()))
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert float((ga[n] - gb[n]).norm()) <= 1e-5 * float(ga[n].norm()), n


def test_soft_capped_attention_runs_the_models_own_eager_function():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           attn_logit_softcapping=50.0, attn_implementation="eager"))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids).logits
    model.config._attn_implementation = register()
    assert torch.equal(model(input_ids=ids).logits, eager)


def test_compiled_bf16_training_on_a_cpu_takes_it_and_the_eager_default_keeps_transformers():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert training_attention_choice("sdpa", cpu, "bf16", 96, compiled=True) == NAME
    assert training_attention_choice("sdpa", cpu, "bf16", 96) == "eager"
    assert training_attention_choice("sdpa", cpu, "fp32", 96, compiled=True) is None
    assert training_attention_choice("sdpa", cpu, "bf16", 300, compiled=True) is None  # past eager's length
    assert training_attention_choice("sdpa", cpu, "bf16", 300) == BLOCKED_NAME  # the eager default: blocked
    assert training_attention_choice("sdpa", gpu, "bf16", 96, compiled=True) is None


def _run_blocked(module, q, k, v, mask, upstream):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, weights = blocked_causal_attention(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    assert weights is None  # (as SDPA: no S x S weights kept for the caller)
    (out * upstream).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("per_head_mask", [False, True])
@pytest.mark.parametrize("block", [4, 5, 64])  # blocks of 4 and 5 queries over 11 positions; one block of all
def test_blocked_causal_attention_equals_transformers_eager(per_head_mask, block, monkeypatch):
    from fedllm.models import grouped_attention

    monkeypatch.setattr(grouped_attention, "QUERY_BLOCK", block)
    # Both take the softmax in fp32 (transformers' eager does, in every dtype), ours over a block's keys only: the
    # masked keys' exponentials are exactly 0, but fp32 sums of a different length round differently by CPU vector
    # width (an AVX2 host differs from eager by 5e-8 relative in fp64, an avx512 one not at all): fp32's rounding.
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-6)):
        inputs = _inputs(dtype, per_head_mask)
        ours = _run_blocked(*inputs)
        out, _, *grads = _run(eager_attention_forward, *inputs)
        for a, b in zip(ours, (out, *grads), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert float((a - b).abs().max()) <= tol * float(b.abs().max())


def test_blocked_attention_skips_only_keys_the_mask_hides(monkeypatch):
    """A block whose queries see a later key (here: the padded queries of row 1, which the mask lets attend
    everywhere) takes every key; a causal block takes the keys up to its last query."""
    from fedllm.models import grouped_attention

    monkeypatch.setattr(grouped_attention, "QUERY_BLOCK", 4)
    module, q, k, v, mask, _ = _inputs(torch.float64)
    widths = []
    softmax = grouped_attention.F.softmax

    def recording(weights, **kwargs):  # once per block: its scores against the keys it takes
        widths.append(weights.shape[-1])
        return softmax(weights, **kwargs)

    monkeypatch.setattr(grouped_attention.F, "softmax", recording)
    blocked_causal_attention(module, q, k, v, mask)
    assert widths == [4, 11, 11]  # row 1's padded queries (7-10) see every key: their blocks take every key
    widths.clear()
    blocked_causal_attention(module, q, k, v, mask[:1].expand(2, -1, -1, -1).clone())  # causal only
    assert widths == [4, 8, 11]
    widths.clear()
    blocked_causal_attention(module, q[..., :8, :], k[..., :8, :], v[..., :8, :], mask[:1, :, :8, :8])
    assert widths == [4, 8]


def test_blocked_causal_attention_through_a_tiny_model_equals_eager():
    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, init="gaussian")).model
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(0))  # two blocks of 128
    mask = torch.ones_like(ids)
    mask[1, 140:] = 0
    (a, ga), (b, gb) = (logits_and_grads(model, ids, mask, name) for name in ("eager", register_blocked()))
    assert torch.allclose(a[mask.bool()], b[mask.bool()], rtol=0, atol=1e-5 * float(a.abs().max()))
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert float((ga[n] - gb[n]).norm()) <= 1e-5 * float(ga[n].norm()), n
