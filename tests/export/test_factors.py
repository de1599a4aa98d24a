"""The export's low-rank maths and layer read-out, on small matrices and one tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from fedllm.export.factors import LowRank, layer_factors, stack, svd_factors


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _piece(out, inp, r, scale, seed):
    g = _gen(seed)
    return LowRank(torch.randn(out, r, generator=g), torch.randn(r, inp, generator=g), scale)


def test_stack_reproduces_the_sum_of_pieces_at_one_scale():
    pieces = [_piece(6, 5, 2, 0.5, 1), _piece(6, 5, 3, 2.0, 2)]
    B, A = stack(pieces, scale=4.0)
    assert B.shape == (6, 5) and A.shape == (5, 5)
    assert torch.allclose(4.0 * B @ A, pieces[0].product() + pieces[1].product(), atol=1e-12)


def test_unchanged_base_stacks_the_nonzero_pieces_exactly():
    w0 = torch.randn(8, 6, generator=_gen())
    zero = LowRank(torch.zeros(8, 2), torch.randn(2, 6, generator=_gen(3)), 2.0)  # a freshly re-initialised LoRA
    pieces = [zero, _piece(8, 6, 2, 2.0, 1), _piece(8, 6, 2, 2.0, 2)]
    effective = w0.double() + sum(p.product() for p in pieces)
    f = layer_factors(w0, effective, w0.double(), pieces, scale=2.0)
    assert (f.method, f.rank, f.exact_rank, f.truncated) == ("stack", 4, 4, False)
    assert f.rel_error < 1e-12 and f.alpha == 8.0
    # more pieces than the layer has room for: the SVD finds the change's true rank instead
    many = [_piece(8, 6, 2, 2.0, s) for s in range(4)]
    f = layer_factors(w0, w0.double() + sum(p.product() for p in many), w0.double(), many, scale=2.0)
    assert f.method == "svd" and f.rank == 6 and f.rel_error < 1e-12


def test_changed_base_is_factored_by_svd_at_its_numerical_rank():
    """FRLoRA-v1: base W0 − s·B0A0 (stored in fp32) plus the trained s·BA: a rank-2r change."""
    s, r = 2.0, 3
    w0 = torch.randn(32, 24, generator=_gen()) * 0.05
    u, sv, vh = torch.linalg.svd(w0)
    b0, a0 = u[:, :r] * (sv[:r] / s).sqrt(), (sv[:r] / s).sqrt()[:, None] * vh[:r]
    base = (w0 - s * b0 @ a0).float()  # rounded to fp32, as a checkpoint holds it
    trained = LowRank(b0 + 0.01 * torch.randn(32, r, generator=_gen(1)),
                      a0 + 0.01 * torch.randn(r, 24, generator=_gen(2)), s)
    effective = base.double() + trained.product()
    f = layer_factors(w0, effective, None, [trained], scale=s)
    assert (f.method, f.rank, f.exact_rank) == ("svd", 2 * r, 2 * r)  # rank and alpha doubled
    assert f.alpha == pytest.approx(2 * r * s) and f.rel_error < 1e-5
    truncated = layer_factors(w0, effective, None, [trained], scale=s, max_rank=r)
    singular = torch.linalg.svdvals(effective - w0.double())
    tail = math.sqrt(float((singular[r:] ** 2).sum()) / float((singular ** 2).sum()))
    assert truncated.truncated and truncated.rank == r and truncated.rel_error == pytest.approx(tail, rel=1e-6)


def test_a_base_that_drifted_beyond_rounding_is_not_stacked():
    w0 = torch.randn(8, 6, generator=_gen())
    piece = _piece(8, 6, 2, 1.0, 1)
    moved = w0.double() + 1e-3 * torch.randn(8, 6, generator=_gen(5), dtype=torch.float64)
    f = layer_factors(w0, moved + piece.product(), moved, [piece], scale=1.0)
    assert f.method == "svd" and f.rank > 2 and f.rel_error < 1e-6


def test_zero_change_exports_a_zero_rank_one_lora():
    w0 = torch.randn(4, 3, generator=_gen())
    f = svd_factors(torch.zeros(4, 3, dtype=torch.float64), 2.0, None, float(w0.abs().max()))
    assert f.rank == 1 and f.exact_rank == 0 and f.rel_error == 0.0 and not torch.any(f.B @ f.A)


def test_read_out_catches_what_a_hook_adds_beside_the_known_pieces():
    from fedllm.export.weights import read_layers
    from fedllm.models.loading import load_model
    from fedllm.recipe.schema import LoraConfig, ModelConfig
    from fedllm.strategies import get_strategy

    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=2, alpha=4)).model.eval()
    layers = dict(model.named_modules())
    name = "base_model.model.model.layers.1.self_attn.v_proj"
    extra = torch.randn(32, 1, generator=_gen(1)) @ torch.randn(1, 64, generator=_gen(2))
    layers[name].register_forward_hook(lambda m, args, out: out + args[0] @ extra.T)
    with torch.no_grad():
        for layer_name, module in layers.items():
            if layer_name.endswith("lora_B.default"):
                module.weight.normal_(generator=_gen(3))
    states = read_layers(model, get_strategy("fedavg"))
    assert [n for n, st in states.items() if not st.explained] == [name]
    hooked = states[name]
    assert torch.allclose(hooked.effective() - hooked.base.double() - hooked.known_addition(), extra.double(),
                          atol=1e-6)
    other = states["base_model.model.model.layers.0.self_attn.q_proj"]
    assert torch.allclose(other.effective(), other.base.double() + other.adapter[0].product(), atol=1e-12)
