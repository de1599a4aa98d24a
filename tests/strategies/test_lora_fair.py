"""LoRA-FAIR: the server averages both factors, then refines B̄ by gradient descent on Eq. 8,
1 − cos(Σ_k p_k B_k A_k, (B̄ + ΔB)Ā) + λ||ΔB||_F; clients continue from (B̄ + ΔB, Ā). Replayed by hand with the
objective's gradient written out (no autograd) from the uploads the server recorded."""

import pytest
import torch
from strategy_helpers import assert_recipe_refuses, make_raw, record_rounds

from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.lora_fair import LoRAFAIR


def hand_refined_b(ideal, b_bar, a_bar, lam, steps, lr):
    """Plain gradient descent (step ``lr·||B̄Ā||²/||Ā||²``) on 1 − <W, X>/(|W||X|) + λ|Δ| with X = (B̄ + Δ)Ā, the gradient by hand:
    ∂/∂X = −W/(|W||X|) + <W,X>·X/(|W||X|³), times Āᵀ; ∂λ|Δ|/∂Δ = λΔ/|Δ| (0 at Δ = 0)."""
    w = ideal.double()
    delta = torch.zeros_like(b_bar, dtype=torch.float64)
    lr = lr * (b_bar @ a_bar).norm() ** 2 / a_bar.norm() ** 2  # the step in the cosine's natural scale
    for _ in range(steps):
        x = (b_bar + delta) @ a_bar
        nw, nx, inner = w.norm(), x.norm(), (w * x).sum()
        grad_x = -w / (nw * nx) + inner * x / (nw * nx ** 3)
        grad = grad_x @ a_bar.T + (lam * delta / delta.norm() if delta.norm() > 0 else 0.0)
        delta = delta - lr * grad
    return delta


def cosine(x, y):
    return float((x * y).sum() / (x.norm() * y.norm()))


@pytest.fixture(scope="module")
def recorded(data_files, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        rounds = record_rounds(patch, LoRAFAIR)
        raw = make_raw(data_files, tmp_path_factory.mktemp("lora-fair"), "lora_fair",
                       {"refine_steps": 20, "refine_lr": 0.3}, federation={"clients_per_round": 3})
        result = run(parse_recipe(raw))
    return result, rounds


def test_lora_fair_replay_of_a_round_from_the_recorded_uploads(recorded):
    result, rounds = recorded
    layers = result.strategy.layers.values()
    assert len(rounds) == 2
    for rnd, _, updates, after in rounds:
        total = sum(u.num_examples for u in updates)
        p = [u.num_examples / total for u in updates]
        for layer in layers:
            bs = [u.state[layer.b_key].double() for u in updates]
            as_ = [u.state[layer.a_key].double() for u in updates]
            b_bar = sum(pk * b for pk, b in zip(p, bs, strict=True))
            a_bar = sum(pk * a for pk, a in zip(p, as_, strict=True))
            ideal = sum(pk * b @ a for pk, b, a in zip(p, bs, as_, strict=True))
            delta = hand_refined_b(ideal, b_bar, a_bar, 0.01, 20, 0.3)
            assert (after[layer.a_key].double() - a_bar).abs().max() <= 1e-6, (rnd, layer.name)
            assert (after[layer.b_key].double() - (b_bar + delta)).abs().max() <= 1e-6, (rnd, layer.name)
            assert delta.abs().max() > 1e-5  # ten times the tolerance: the refinement is checked, not lost in it
            # Eq. 8 did its job: the refined product is closer in direction to the ideal update than FedAvg's
            assert cosine((b_bar + delta) @ a_bar, ideal) > cosine(b_bar @ a_bar, ideal)


def test_lora_fair_clients_start_the_next_round_from_the_refined_factors(recorded):
    _, rounds = recorded
    (_, _, _, first), (_, second_start, _, _) = rounds
    assert all(torch.equal(first[k], second_start[k]) for k in first)


def test_lora_fair_without_refinement_steps_is_fedavg(data_files, tmp_path):
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path / "a", "fedavg")))
    fair = run(parse_recipe(make_raw(data_files, tmp_path / "b", "lora_fair", {"refine_steps": 0})))
    assert all(torch.equal(fedavg.global_state[k], fair.global_state[k]) for k in fedavg.global_state)


def test_lora_fair_bad_arguments_and_dp_are_recipe_errors(data_files, tmp_path):
    assert_recipe_refuses(data_files, tmp_path, "lora_fair", {"lam": -1, "refine_steps": 2.5, "refine_lr": 0},
                          "mean of each client's own product")
