"""FedProx: the proximal term, its gradient, and mu = 0 as FedAvg."""

import torch
from strategy_helpers import make_raw, make_strategy, tiny

from fedllm.engine.server import run
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe


def test_the_proximal_term_and_its_gradient_against_hand_computed_values():
    model = tiny().model
    strategy = make_strategy("fedprox", model, mu=0.3)
    keys = strategy.global_keys(model)
    anchor = read_state(model, keys)
    gen = torch.Generator().manual_seed(7)
    moved = {k: v + torch.randn(v.shape, generator=gen) for k, v in anchor.items()}
    write_state(model, moved)
    plan = strategy.configure_client(1, 0, anchor)
    term = strategy.client_loss(model, plan)
    expected = 0.5 * 0.3 * sum(float(((moved[k].double() - anchor[k].double()) ** 2).sum()) for k in keys)
    assert abs(float(term.detach()) - expected) <= 1e-5 * expected
    term.backward()
    params = dict(model.named_parameters())
    for k in keys:  # d/dθ (mu/2)·||θ − θ_g||² = mu·(θ − θ_g)
        torch.testing.assert_close(params[k].grad, 0.3 * (moved[k] - anchor[k]), rtol=1e-6, atol=1e-6)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(params[n].grad is None for n in frozen)


def test_mu_zero_is_fedavg_bit_for_bit(data_files, tmp_path):
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path / "a", "fedavg")))
    prox = run(parse_recipe(make_raw(data_files, tmp_path / "b", "fedprox", {"mu": 0.0})))
    assert fedavg.global_state.keys() == prox.global_state.keys()
    assert all(torch.equal(fedavg.global_state[k], prox.global_state[k]) for k in fedavg.global_state)
    assert [h["client_loss"] for h in fedavg.history] == [h["client_loss"] for h in prox.history]


def test_a_large_mu_keeps_clients_near_the_global_model(data_files, tmp_path):
    """Plain SGD, one round: the pull ``mu·(θ − θ_g)`` shrinks the move of the global state."""
    sgd = {"optimizer": "sgd", "lr": 0.5, "local_steps": 4}
    moved = {}
    for name, args in (("fedavg", {}), ("fedprox", {"mu": 1.0})):
        result = run(parse_recipe(make_raw(data_files, tmp_path / name, name, args, train=sgd,
                                           federation={"rounds": 1})))
        start = read_state(tiny().model, result.global_state.keys())
        moved[name] = sum(float((result.global_state[k] - start[k]).norm()) for k in start)
    assert 0 < moved["fedprox"] < moved["fedavg"]
