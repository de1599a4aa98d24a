"""FedAvgM / FedAdagrad / FedYogi / FedAdam against Flower's strategies of the same names, and their
server moments across a checkpoint."""

import numpy as np
import pytest
import torch
from flower_reference import ROUNDS, SIZES, client_arrays, fedllm_rounds, flower_rounds
from flwr.serverapp import strategy as flower

from fedllm.common.errors import InputError
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientUpdate, get_strategy

CASES = [
    ("fedavgm", flower.FedAvgM, {}),
    ("fedavgm", flower.FedAvgM, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    ("fedadagrad", flower.FedAdagrad, {}),
    ("fedadagrad", flower.FedAdagrad, {"eta": 0.05, "tau": 1e-2}),
    ("fedyogi", flower.FedYogi, {}),
    ("fedyogi", flower.FedYogi, {"eta": 0.03, "beta_1": 0.8, "beta_2": 0.9, "tau": 1e-4}),
    ("fedadam", flower.FedAdam, {}),
    ("fedadam", flower.FedAdam, {"eta": 0.02, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2}),
]


@pytest.mark.parametrize("name,cls,args", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_server_optimiser_equals_flower_over_rounds(name, cls, args, monkeypatch):
    expected = flower_rounds(cls(**args), monkeypatch)
    got, _ = fedllm_rounds(name, args)
    for rnd, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        assert want.keys() == have.keys()
        for k in want:
            assert have[k].dtype == torch.float32
            np.testing.assert_allclose(have[k].double().numpy(), want[k], rtol=0, atol=1e-6,
                                       err_msg=f"{name} round {rnd} {k}")
    if name != "fedavgm" or args:  # the server step moved the state away from the plain mean
        mean = sum(n * torch.from_numpy(up["classifier.weight"]) for up, n in zip(client_arrays(ROUNDS), SIZES))
        assert not torch.allclose(got[-1]["classifier.weight"], mean / sum(SIZES), atol=1e-4)


def test_fedavgm_with_flower_defaults_is_fedavg_bit_for_bit():
    got, _ = fedllm_rounds("fedavgm", {})
    plain, _ = fedllm_rounds("fedavg", {})
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, plain) for k in a)


@pytest.mark.parametrize("name,args", [("fedavgm", {"server_momentum": 0.9, "server_learning_rate": 0.5}),
                                       ("fedadagrad", {}), ("fedyogi", {}), ("fedadam", {})])
def test_moments_survive_a_checkpoint(name, args):
    full, _ = fedllm_rounds(name, args)
    first, strategy = fedllm_rounds(name, args, rounds=range(1, 3))
    saved = {k: v.clone() for k, v in strategy.state_dict().items()}
    assert saved and all("/" in k for k in saved)
    restored = get_strategy(name, **args)
    restored.load_state_dict(saved)
    rest, _ = fedllm_rounds(name, args, rounds=range(3, ROUNDS + 1), strategy=restored, state=first[-1])
    for a, b in zip(full, first + rest, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    fresh, _ = fedllm_rounds(name, args, rounds=range(3, ROUNDS + 1), state=first[-1])  # moments matter
    assert any(not torch.equal(fresh[-1][k], full[-1][k]) for k in fresh[-1])


@pytest.mark.parametrize("strategy,args,key", [
    ("fedadam", {"beta_1": 1.0}, "beta_1"), ("fedyogi", {"tau": 0.0}, "tau"), ("fedadagrad", {"eta": -1.0}, "eta"),
    ("fedavgm", {"server_momentum": 1.5}, "server_momentum"), ("fedadam", {"beta_2": "high"}, "beta_2"),
    ("fedprox", {"mu": -0.1}, "mu")])
def test_bad_strategy_arguments_name_the_key(strategy, args, key):
    raw = {"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
           "federation": {"num_clients": 3, "strategy": strategy, "strategy_args": args}}
    with pytest.raises(InputError, match=f"strategy_args.{key}"):
        parse_recipe(raw)


@pytest.mark.parametrize("name, args", [
    ("fedavgm", {"server_momentum": 0.9}),
    ("fedadagrad", {"eta": 1e-2, "tau": 1e-6}),
    ("fedyogi", {"eta": 1e-2, "tau": 1e-6}),
    ("fedadam", {"eta": 1e-2, "tau": 1e-6}),
])
def test_compressed_transport_is_not_progress(name, args, data_files, tmp_path):
    """With bf16 transport and lr = 0 no client learns anything, so the server optimiser must not move θ:
    Δ is measured against θ as the clients received it (rounded), not the unrounded θ (issue #23.1;
    before the fix FedAdam with τ = 1e-6 moved θ by 0.032 over 4 rounds and kept growing)."""
    from strategy_helpers import make_raw

    from fedllm.engine.server import build_federation, run
    from fedllm.models.loading import read_state

    raw = make_raw(data_files, tmp_path / "run", name, args, federation={"comm_dtype": "bf16", "rounds": 4},
                   train={"lr": 0.0})
    fed = build_federation(parse_recipe(raw))
    initial = read_state(fed.loaded.model, fed.global_keys)
    final = run(parse_recipe(raw)).global_state
    assert set(final) == set(initial)
    for k, v in initial.items():
        # every client uploads exactly the bf16-rounded θ, so the mean is that value up to fp32 rounding of
        # the weighted mean; the server adds a zero step to its own θ
        assert torch.allclose(final[k], v, rtol=0, atol=1e-6), (k, (final[k] - v).abs().max().item())


def test_pseudo_gradient_is_taken_against_the_broadcast():
    """Unit check with hand-made uploads: Δ = θ̄ − bf16(θ) exactly (FedAvgM in its first round returns θ + η·Δ, η = 1)."""
    theta = {"w": torch.tensor([1.0001, -2.0003, 0.33333])}
    strategy = get_strategy("fedavgm", server_momentum=0.5)  # round 1: v = Δ, step = η·Δ = Δ
    strategy.recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                                    "federation": {"num_clients": 2, "comm_dtype": "bf16"}})
    sent = theta["w"].to(torch.bfloat16).float()
    ups = [ClientUpdate(client_id=0, state={"w": sent + 0.5}, num_examples=1, loss=0.0, steps=1),
           ClientUpdate(client_id=1, state={"w": sent + 1.5}, num_examples=1, loss=0.0, steps=1)]
    out = strategy.aggregate(1, theta, ups)
    assert (sent - theta["w"]).abs().max() > 1e-4  # the rounding is visible at this tolerance
    assert torch.allclose(out["w"], theta["w"] + 1.0, rtol=0, atol=1e-6)  # θ + Δ, Δ = mean progress = 1
