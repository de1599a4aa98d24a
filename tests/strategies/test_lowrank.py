"""fedllm.models.lowrank against independent computations."""

import math

import pytest
import torch

from fedllm.models.lowrank import (
    add_to_weight_,
    lora_init_,
    numerical_rank,
    principal_factors,
    relative_error,
    truncated_svd,
)


def decaying(out=48, inn=40, decay=0.7, seed=0):
    """A matrix with singular values decay**i (well-separated top subspace)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out, out, generator=g))
    v, _ = torch.linalg.qr(torch.randn(inn, inn, generator=g))
    k = min(out, inn)
    s = decay ** torch.arange(k, dtype=torch.float32)
    return (u[:, :k] * s) @ v[:, :k].T, s


def test_principal_factors_split_the_rank_r_approximation_by_the_scale():
    w, s = decaying()
    r, scale = 5, 2.0
    b0, a0 = principal_factors(w, r, scale)
    best = truncated_svd(w, r)
    # scale * B0 A0 is the best rank-r approximation (Eckart-Young error = tail of the spectrum)
    approx = scale * b0 @ a0
    assert torch.linalg.norm(w - approx) == pytest.approx(float(torch.sqrt((s[r:] ** 2).sum())), rel=1e-4)
    assert torch.allclose(approx, (best[0] * best[1]) @ best[2], atol=1e-6)
    # B0 = U sqrt(S/s), A0 = sqrt(S/s) Vh: both Gram matrices are diag(S_r / s)
    expect = torch.diag(s[:r] / scale)
    assert torch.allclose(b0.T @ b0, expect, atol=1e-5)
    assert torch.allclose(a0 @ a0.T, expect, atol=1e-5)


def test_randomized_svd_matches_exact_on_the_top_subspace_and_is_seeded():
    w, _ = decaying()
    r = 6
    u, _, vh = truncated_svd(w, r, "exact")
    ur, sr, vhr = truncated_svd(w, r, "randomized", niter=4, oversample=8, seed=3)
    # stated tolerance: projectors onto the top-r left/right subspaces agree to 1e-4 (spectral norm)
    assert torch.linalg.matrix_norm(u @ u.T - ur @ ur.T, ord=2) < 1e-4
    assert torch.linalg.matrix_norm(vh.T @ vh - vhr.T @ vhr, ord=2) < 1e-4
    again = truncated_svd(w, r, "randomized", niter=4, oversample=8, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(again, (ur, sr, vhr), strict=True))
    state = torch.random.get_rng_state()
    truncated_svd(w, r, "randomized", seed=99)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched


def test_randomized_reconstruction_of_a_flat_spectrum_is_close_to_exact():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8  # tiny models' random weights
    r = 8
    exact = relative_error(2.0 * torch.matmul(*principal_factors(w, r, 2.0)), w)
    rand = relative_error(2.0 * torch.matmul(*principal_factors(w, r, 2.0, "randomized", niter=4, seed=1)), w)
    assert exact <= rand < exact * 1.02


def test_add_to_weight_sums_in_fp32_and_keeps_the_dtype():
    layer = torch.nn.Linear(4, 3, bias=False)
    layer.weight.data = torch.full((3, 4), 1.0, dtype=torch.bfloat16)
    add_to_weight_(layer, torch.full((3, 4), 0.5))
    assert layer.weight.dtype == torch.bfloat16 and torch.all(layer.weight == 1.5)
    with pytest.raises(ValueError):
        add_to_weight_(layer, torch.zeros(4, 3))


def test_lora_init_is_standard_and_reproducible():
    g = torch.Generator().manual_seed(0)
    a, b = torch.empty(8, 100), torch.ones(30, 8)
    lora_init_(a, b, "default", g)
    assert torch.count_nonzero(b) == 0 and a.abs().max() <= 1 / math.sqrt(100) and a.std() > 0.03
    a2 = torch.empty(8, 100)
    lora_init_(a2, torch.ones(30, 8), "default", torch.Generator().manual_seed(0))
    assert torch.equal(a, a2)
    lora_init_(a2, torch.ones(30, 8), "gaussian", torch.Generator().manual_seed(0))
    assert a2.std() == pytest.approx(1 / 8, rel=0.15)


def test_numerical_rank():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(20, 3, generator=g) @ torch.randn(3, 30, generator=g)
    assert numerical_rank(m) == 3
    assert numerical_rank(m + 1e-9 * torch.randn(20, 30, generator=g), rtol=1e-6) == 3
    assert numerical_rank(torch.zeros(4, 4)) == 0
