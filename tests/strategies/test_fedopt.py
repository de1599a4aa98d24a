"""FedAvgM / FedAdagrad / FedYogi / FedAdam against Flower's strategies of the same names, and their
server moments across a checkpoint."""

import numpy as np
import pytest
import torch
from flwr.serverapp import strategy as flower

from fedllm.config import parse_recipe
from fedllm.errors import InputError
from fedllm.strategies import get_strategy
from flower_reference import ROUNDS, SIZES, client_arrays, fedllm_rounds, flower_rounds

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
