"""The chunked fused LM head + cross-entropy equals ``F.cross_entropy`` on the head's full logits.

References are torch's own: ``F.cross_entropy(F.linear(h, W).float(), t, reduction="none")`` and its autograd
gradient (fp32 to 1e-6 relative; bf16 within bf16 rounding, and no farther from an fp64 computation than the
unfused bf16 path is), fedllm's unfused path (``FUSE_HEAD_LOSS = False``) on tiny LLaMA / Qwen2 / Gemma models,
and one client's training with either path.
"""

import contextlib
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fedllm.data.collate import collate
from fedllm.engine.client import train_client
from fedllm.engine.server import build_federation
from fedllm.models import supervised_loss
from fedllm.models.fused_head_loss import (FusedHeadCrossEntropy, chunk_rows, compiled_rows,
                                          fused_head_cross_entropy, rows_compiled)
from fedllm.models.loading import attach_lora, load_model
from fedllm.models.preference_loss import sequence_logps
from fedllm.models.supervised_loss import fused_head_weight, supervised_hidden, token_losses
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import LoraConfig, ModelConfig
from fedllm.strategies.base import Phase

N, H, V = 37, 64, 1000
BF16_EPS = 2.0**-8  # bf16's unit roundoff (8 significant bits)


@pytest.fixture(autouse=True)
def fuse_every_batch(monkeypatch):
    """These tests exercise the fused path on tiny batches, which fedllm leaves unfused (one chunk or less)."""
    monkeypatch.setattr(supervised_loss, "FUSE_FROM_BYTES", 0)


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.rand(N, generator=gen, dtype=torch.float64)  # a non-uniform gradient into each row's loss
    return hidden, weight, targets, upstream


def _losses_and_grad(fn, hidden, weight, targets, upstream, autocast=False):
    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = fn(h, weight, targets)
    (losses * upstream.to(losses.dtype)).sum().backward()
    return losses.detach(), h.grad


def _unfused(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="none")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rows", [1, 10, N])
def test_fp32_losses_and_gradient_equal_cross_entropy(rows):
    hidden, weight, targets, upstream = _inputs(torch.float32)
    ref_loss, ref_grad = _losses_and_grad(_unfused, hidden, weight, targets, upstream)
    fused = partial(fused_head_cross_entropy, chunk_bytes=rows * 4 * V)
    loss, grad = _losses_and_grad(fused, hidden, weight, targets, upstream)
    assert chunk_rows(V, rows * 4 * V) == rows
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    assert float(((loss - ref_loss).abs() / ref_loss.abs()).max()) <= 1e-6
    assert _rel(grad, ref_grad) <= 1e-6
    assert float(grad.abs().sum()) > 0


def test_fp64_matches_a_hand_written_softmax_gradient():
    """In fp64: loss = logsumexp(z) − z_t and ∂/∂h = Σ_i u_i (softmax(z_i) − onehot(t_i)) W, written out here."""
    hidden, weight, targets, upstream = _inputs(torch.float64)
    loss, grad = _losses_and_grad(partial(fused_head_cross_entropy, loss_dtype=torch.float64, chunk_bytes=4 * V * 8),
                                  hidden, weight, targets, upstream)
    z = hidden @ weight.T
    expected = torch.logsumexp(z, -1) - z[torch.arange(N), targets]
    g = torch.softmax(z, -1)
    g[torch.arange(N), targets] -= 1
    assert loss.dtype == torch.float64
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    assert torch.allclose(grad, (upstream[:, None] * g) @ weight, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("case", ["bf16-weights", "fp32-weights-autocast", "fp16-loss-scaled"])
def test_half_precision_within_rounding_of_the_unfused_path(case):
    """bf16 (and fp16 under a loss scale of 2^16, where the fused gradient is formed before the scale reaches it)."""
    half = torch.float16 if case.startswith("fp16") else torch.bfloat16
    autocast = case == "fp32-weights-autocast"
    hidden, weight, targets, upstream = _inputs(torch.float32 if autocast else half)
    if half == torch.float16:
        upstream = upstream * 2.0**16
    ref_loss, ref_grad = _losses_and_grad(_unfused, hidden, weight, targets, upstream, autocast)
    loss, grad = _losses_and_grad(partial(fused_head_cross_entropy, chunk_bytes=10 * 4 * V), hidden, weight,
                                  targets, upstream, autocast)
    eps = torch.finfo(half).eps / 2  # unit roundoff
    assert loss.dtype == torch.float32 and grad.dtype == hidden.dtype
    assert torch.equal(loss, ref_loss)  # the same half-precision logits, the same fp32 log-softmax
    # the gradient: each element within a few roundings of the unfused one (measured: about one of the largest)
    assert float((grad.float() - ref_grad.float()).abs().max()) <= 4 * eps * float(ref_grad.float().abs().max())
    # and no farther from the exact (fp64) gradient than the unfused path is
    _, exact = _losses_and_grad(partial(fused_head_cross_entropy, loss_dtype=torch.float64), hidden.double(),
                                weight.double(), targets, upstream)
    assert _rel(grad, exact) <= 1.25 * _rel(ref_grad, exact)


def test_a_second_backward_rescales_the_same_gradient():
    """opacus's ghost clipping backpropagates the per-example losses twice with different weights (retain_graph)."""
    hidden, weight, targets, upstream = _inputs(torch.float32)
    h = hidden.clone().requires_grad_()
    losses = fused_head_cross_entropy(h, weight, targets, chunk_bytes=4 * 4 * V)
    first = torch.autograd.grad(losses.sum(), h, retain_graph=True)[0]
    second = torch.autograd.grad((losses * upstream.float()).sum(), h)[0]
    _, ref = _losses_and_grad(_unfused, hidden, weight, targets, upstream)
    assert _rel(second, ref) <= 1e-6
    assert _rel(first, _losses_and_grad(_unfused, hidden, weight, targets, torch.ones(N, dtype=torch.float64))[1]) <= 1e-6


class _Ops(TorchDispatchMode):
    """Every operator run, with the number of elements of its largest newly allocated output (views of an input and
    writes into one are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        new = [t.numel() for t in torch.utils._pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        self.ops.append((func.overloadpacket.__name__, max(new, default=0)))
        return out

    def largest(self) -> int:
        return max(n for _, n in self.ops)

    def count(self, name: str) -> int:
        return sum(op == name for op, _ in self.ops)


def test_no_tensor_holds_more_than_a_chunk_of_logits():
    hidden, weight, targets, upstream = _inputs(torch.float32)
    for fn, bound in ((partial(fused_head_cross_entropy, chunk_bytes=8 * 4 * V), 8 * V), (_unfused, N * V)):
        with _Ops() as seen:
            _losses_and_grad(fn, hidden, weight, targets, upstream)
        assert seen.largest() == bound, (fn, seen.largest())


def test_without_grad_mode_no_gradient_is_formed():
    hidden, weight, targets, _ = _inputs(torch.float32)
    chunked = partial(fused_head_cross_entropy, chunk_bytes=10 * 4 * V)  # 10 + 10 + 10 + 7 rows
    with torch.no_grad(), _Ops() as seen:
        losses = chunked(hidden.clone().requires_grad_(), weight, targets)
    assert losses.grad_fn is None and seen.count("mm") == 4  # the logits' matmuls only
    with _Ops() as seen:
        assert chunked(hidden, weight, targets).grad_fn is None  # nothing requires a gradient
    assert seen.count("mm") == 4
    with _Ops() as seen:
        assert chunked(hidden.clone().requires_grad_(), weight, targets).grad_fn is not None
    assert seen.count("mm") == 8  # and the gradient's
    assert float(((losses - _unfused(hidden, weight, targets)).abs() / losses).max()) <= 1e-6


def test_a_trainable_head_is_refused():
    hidden, weight, targets, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="frozen head"):
        fused_head_cross_entropy(hidden, weight.requires_grad_(), targets)


# --------------------------------------------------------------------------- fedllm's models


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """Three right-padded rows, a prompt (-100) then a response; lengths 11, 7, 4."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 11), generator=gen)
    mask, labels = torch.zeros(3, 11, dtype=torch.long), torch.full((3, 11), -100)
    for i, (n, p) in enumerate([(11, 5), (7, 3), (4, 1)]):
        mask[i, :n], labels[i, p:n], ids[i, n:] = 1, ids[i, p:n], 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _tiny(family: str):
    model = load_model(ModelConfig(name=f"tiny-{family}"), LoraConfig(r=4, alpha=8, init="gaussian")).model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B too, so that every factor has a gradient
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _loss_and_grads(model, batch, fused: bool, monkeypatch, autocast=False):
    """The mean supervised loss (as :func:`supervised_positions_loss` computes it), the gradient with respect to the
    gathered hidden states and every LoRA gradient; asserts which path ran."""
    monkeypatch.setattr(supervised_loss, "FUSE_HEAD_LOSS", fused)
    calls = []
    real = FusedHeadCrossEntropy.apply
    monkeypatch.setattr(FusedHeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden, targets, _ = supervised_hidden(model, batch)
        hidden.retain_grad()
        loss = token_losses(model, hidden, targets).sum() / targets.numel()
    loss.backward()
    assert len(calls) == int(fused)
    return loss.detach(), hidden.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_models_fused_loss_and_gradients_equal_the_unfused_path(family, monkeypatch):
    model = _tiny(family)
    model.train()
    base = model.get_base_model()
    assert fused_head_weight(base) is base.get_output_embeddings().weight
    batch = _batch(base.config.vocab_size)
    plain, h_plain, g_plain = _loss_and_grads(model, batch, False, monkeypatch)
    fused, h_fused, g_fused = _loss_and_grads(model, batch, True, monkeypatch)
    assert abs(float(fused - plain)) <= 1e-6 * float(plain)
    assert _rel(h_fused, h_plain) <= 1e-6
    # two layers of backward carry the 1e-7 differences into LoRA's gradients (measured: up to 1.1e-6): the
    # tolerance tests/test_supervised_loss.py allows between the supervised and the all-positions path
    assert all(_rel(g_fused[k], g_plain[k]) <= 1e-5 for k in g_plain) and len(g_plain) > 0
    # bf16 weights, fp32 LoRA factors, autocast: what train.dtype auto trains with on a bf16 CPU
    model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    plain16, h_plain16, g_plain16 = _loss_and_grads(model, batch, False, monkeypatch, autocast=True)
    fused16, h_fused16, g_fused16 = _loss_and_grads(model, batch, True, monkeypatch, autocast=True)
    assert torch.equal(fused16, plain16)
    assert _rel(h_fused16, h_plain16) <= 2 * BF16_EPS  # measured 4.3e-3 to 4.7e-3
    assert _rel_all(g_fused16, g_plain16) <= 4 * BF16_EPS  # all LoRA gradients together; measured 6.4e-3 to 8.6e-3
    # about one bf16 rounding more than the unfused path (the scaling after the product), no more: the distance
    # of all LoRA gradients from fp32's (measured: LLaMA 9.4e-3 vs 8.3e-3, Qwen2 9.7e-3 vs 7.2e-3, Gemma 8.7e-3
    # vs 9.5e-3)
    assert _rel_all(g_fused16, g_plain) <= 1.5 * _rel_all(g_plain16, g_plain)


def _rel_all(got: dict, ref: dict) -> float:
    """Relative distance of all tensors of ``got`` from ``ref``'s together."""
    return float(sum(((got[k].double() - ref[k].double()) ** 2).sum() for k in ref).sqrt()
                 / sum((ref[k].double() ** 2).sum() for k in ref).sqrt())


def test_heads_that_do_not_fuse_take_the_unfused_path(monkeypatch):
    import transformers

    llama = _tiny("llama")
    base = llama.get_base_model()
    base.get_output_embeddings().weight.requires_grad_(True)  # a trained head
    assert fused_head_weight(base) is None
    monkeypatch.setattr(supervised_loss, "FUSE_HEAD_LOSS", False)
    assert fused_head_weight(_tiny("qwen2").get_base_model()) is None  # the A/B switch
    monkeypatch.undo()
    lora_head = attach_lora(transformers.AutoModelForCausalLM.from_config(base.config),
                            LoraConfig(r=4, alpha=8, target_modules=["q_proj", "lm_head"]), "causal_lm")
    assert fused_head_weight(lora_head.get_base_model()) is None  # LoRA on the head
    capped = transformers.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert capped.final_logit_softcapping is not None
    assert fused_head_weight(transformers.AutoModelForCausalLM.from_config(capped)) is None  # Gemma 2's soft-capping


def test_preference_log_probs_fused_equal_unfused(monkeypatch):
    model = _tiny("qwen2")
    batch = _batch(model.get_base_model().config.vocab_size)
    batch = {k: torch.cat([v, v.flip(0)]) for k, v in batch.items()}  # 3 pairs
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(supervised_loss, "FUSE_HEAD_LOSS", fused)
        model.zero_grad(set_to_none=True)
        logps = sequence_logps(model, batch).logps
        logps.pow(2).sum().backward()  # a non-uniform gradient into each token
        got[fused] = logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert float(((got[True][0] - got[False][0]).abs() / got[False][0].abs()).max()) <= 1e-6
    assert all(_rel(got[True][1][k], got[False][1][k]) <= 1e-6 for k in got[False][1])


def test_a_client_round_trains_the_same_adapter_fused_and_unfused(tiny_recipe, monkeypatch):
    recipe = parse_recipe(tiny_recipe(train={"local_steps": 3}))
    fed = build_federation(recipe)
    model, strategy = fed.loaded.model, fed.strategy
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    keys = list(fed.global_keys)
    start = {k: v.detach().clone() for k, v in model.named_parameters() if k in keys}
    params = dict(model.named_parameters())
    adapters, losses, calls = {}, {}, []
    real = FusedHeadCrossEntropy.apply
    monkeypatch.setattr(FusedHeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    for fused in (False, True):
        monkeypatch.setattr(supervised_loss, "FUSE_HEAD_LOSS", fused)
        with torch.no_grad():
            for k, v in start.items():
                params[k].copy_(v)
        plan = strategy.configure_client(1, 0, start)
        plan.lr, plan.phases = recipe.train.lr, [Phase(steps=3)]
        result = train_client(model, plan, strategy, fed.data.examples, fed.data.clients[0], recipe.train, coll, 7)
        adapters[fused], losses[fused] = result.state, result.loss
        assert len(calls) == 3 * fused  # one fused loss per micro-batch, only when asked
    assert abs(losses[True] - losses[False]) <= 1e-6 * losses[False]
    # the whole adapter within 1e-6 (measured 1.8e-7); tensor by tensor within 1e-5, updates too (measured: worst
    # tensor 8.3e-7, worst update 2.1e-6 — AdamW's m/√v magnifies the 1e-7 gradient differences where |g| is small)
    assert _rel_all(adapters[True], adapters[False]) <= 1e-6
    assert all(_rel(adapters[True][k], adapters[False][k]) <= 1e-5 for k in keys)
    assert all(_rel(adapters[True][k] - start[k], adapters[False][k] - start[k]) <= 1e-5 for k in keys)
    assert any(not torch.equal(adapters[True][k], start[k]) for k in keys)


def test_a_batch_within_one_chunk_keeps_the_unfused_path_bit_for_bit(monkeypatch):
    """fedllm fuses only a batch whose fp32 logits exceed one chunk (``FUSE_FROM_BYTES``): smaller ones (the
    quickstart's ~84 positions) compute exactly what they did before the fused path existed, bf16 included."""
    monkeypatch.undo()  # fedllm's threshold, not the module's fuse-everything fixture
    model = load_model(ModelConfig(name="tiny-llama", dtype="bf16"), LoraConfig(r=4)).model
    weight = fused_head_weight(supervised_loss.base_of(model))
    assert weight is not None
    vocab = weight.shape[0]
    calls = []
    real = FusedHeadCrossEntropy.apply
    monkeypatch.setattr(FusedHeadCrossEntropy, "apply", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(0)
    within = supervised_loss.FUSE_FROM_BYTES // (4 * vocab)  # the most rows one chunk's fp32 logits hold
    for rows, fused in ((within, False), (within + 1, True)):
        hidden = torch.randn(rows, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (rows,), generator=gen)
        losses = token_losses(model, hidden, targets)
        losses.sum().backward()
        if not fused:
            h = hidden.detach().clone().requires_grad_()
            plain = F.cross_entropy(F.linear(h, weight).float(), targets, reduction="none")
            plain.sum().backward()
            assert torch.equal(losses.detach(), plain.detach()) and torch.equal(hidden.grad, h.grad)
        assert (calls[-1:] == [rows]) == fused


def test_under_compiled_rows_every_batch_fuses(monkeypatch):
    """``train.compile`` on a CPU (``compiled_rows``): a batch within one chunk fuses too, and its loss and gradient
    equal the unfused path's (fp32, 1e-6); outside, the same batch keeps the unfused path."""
    monkeypatch.undo()  # fedllm's threshold
    model = load_model(ModelConfig(name="tiny-llama", dtype="fp32"), LoraConfig(r=4)).model
    weight = fused_head_weight(supervised_loss.base_of(model))
    calls = []
    real = FusedHeadCrossEntropy.apply
    monkeypatch.setattr(FusedHeadCrossEntropy, "apply", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, weight.shape[1], generator=gen)
    targets = torch.randint(0, weight.shape[0], (5,), generator=gen)
    results = []
    for compiled in (False, True):
        h = hidden.clone().requires_grad_()
        with compiled_rows("eager") if compiled else contextlib.nullcontext():
            assert rows_compiled() == compiled
            losses = token_losses(model, h, targets)
        losses.sum().backward()
        results.append((losses.detach(), h.grad))
        assert calls == ([5] if compiled else [])
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, rtol=1e-6, atol=0) and _rel(gb, ga) <= 1e-6
    assert not rows_compiled()


def test_compiled_rows_equal_the_eager_chunk_in_one_graph(monkeypatch):
    """The chunk as inductor compiles it (what a compiled CPU run executes): bf16 losses within 1e-6 and gradients
    within one bf16 rounding of the eager chunk's, chunks of 37, 10 and 7 rows through one graph."""
    from torch._dynamo.utils import counters

    from fedllm.models import fused_head_loss

    torch._dynamo.reset()  # compiled here, whatever ran before in this process
    monkeypatch.setattr(fused_head_loss, "_COMPILED", {})

    hidden, weight, targets, upstream = _inputs(torch.bfloat16, seed=3)
    eager = _losses_and_grad(partial(fused_head_cross_entropy, chunk_bytes=10 * 4 * V), hidden, weight, targets,
                             upstream)
    counters.clear()
    with compiled_rows("inductor"):
        for chunk in (N, 10):  # 37 rows; then 10, 10, 10 and 7
            loss, grad = _losses_and_grad(partial(fused_head_cross_entropy, chunk_bytes=chunk * 4 * V), hidden,
                                          weight, targets, upstream)
            assert float(((loss - eager[0]).abs() / eager[0].abs()).max()) <= 1e-6
            assert float((grad.float() - eager[1].float()).abs().max()) <= BF16_EPS * float(eager[1].float().abs().max())
    assert counters["stats"]["unique_graphs"] == 1
