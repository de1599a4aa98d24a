"""FedMedian, FedTrimmedAvg, Krum, Multi-Krum and Bulyan's one-shot variant (``bulyan_multikrum``) against Flower's
Message-API strategies of the same names, on the same uploads, with and without an attacking client (the paper's
``bulyan``: tests/strategies/test_bulyan.py)."""

import pytest
import torch
from flower_reference import SHAPES, assert_equal_rounds, client_arrays, fedllm_rounds, flower_rounds, initial_state
from flwr.serverapp import strategy as flower

from fedllm.common.errors import InputError
from fedllm.recipe.checks import parse_recipe

FIVE = [10, 25, 40, 15, 30]
SEVEN = FIVE + [20, 35]

CASES = [  # (fedllm name, fedllm args, Flower class, Flower args, clients' sizes)
    ("fedmedian", {}, flower.FedMedian, {}, FIVE),
    ("fedmedian", {}, flower.FedMedian, {}, FIVE[:4]),  # even count: mean of the two middle values
    ("fedtrimmedavg", {}, flower.FedTrimmedAvg, {}, FIVE),
    ("fedtrimmedavg", {"beta": 0.3}, flower.FedTrimmedAvg, {"beta": 0.3}, SEVEN),
    ("krum", {"num_malicious_clients": 1}, flower.Krum, {"num_malicious_nodes": 1}, FIVE),
    ("multikrum", {"num_malicious_clients": 1, "num_clients_to_select": 3}, flower.MultiKrum,
     {"num_malicious_nodes": 1, "num_nodes_to_select": 3}, FIVE),
    ("bulyan_multikrum", {"num_malicious_clients": 1}, flower.Bulyan, {"num_malicious_nodes": 1}, SEVEN),
    ("bulyan_multikrum", {"num_malicious_clients": 0}, flower.Bulyan, {"num_malicious_nodes": 0}, FIVE),
]


@pytest.mark.parametrize("attacker_scale", [1.0, -4.0, 20.0], ids=["honest", "sign-flip", "scaled"])
@pytest.mark.parametrize("name,args,cls,flower_args,sizes", CASES,
                         ids=[f"{c[0]}-{len(c[4])}-{i}" for i, c in enumerate(CASES)])
def test_robust_aggregator_equals_flower(name, args, cls, flower_args, sizes, attacker_scale, monkeypatch):
    n = len(sizes)
    strategy = cls(min_train_nodes=n, min_available_nodes=n, **flower_args)
    expected = flower_rounds(strategy, monkeypatch, sizes, attacker_scale, rounds=2)
    got, _ = fedllm_rounds(name, args, rounds=range(1, 3), sizes=sizes, attacker_scale=attacker_scale)
    assert_equal_rounds(expected, got, name)
    assert all(v.dtype == torch.float32 for v in got[-1].values())


@pytest.mark.parametrize("name,args", [("fedmedian", {}), ("fedtrimmedavg", {}), ("krum", {"num_malicious_clients": 1}),
                                       ("multikrum", {"num_malicious_clients": 1, "num_clients_to_select": 3}),
                                       ("bulyan", {"num_malicious_clients": 1}),
                                       ("bulyan_multikrum", {"num_malicious_clients": 1})])
def test_a_scaled_attacker_moves_the_robust_aggregate_far_less_than_the_mean(name, args):
    sizes = SEVEN
    honest = [torch.cat([torch.from_numpy(a[k]).flatten() for k in SHAPES]).double()
              for a in client_arrays(1, sizes)[:-1]]
    honest_mean = torch.stack(honest).mean(0)

    def distance(strategy, scale):
        (state,), _ = fedllm_rounds(strategy, args if strategy == name else {"weighting": "uniform"},
                                    rounds=[1], sizes=sizes, attacker_scale=scale)
        return float((torch.cat([state[k].flatten() for k in SHAPES]).double() - honest_mean).norm())

    assert distance("fedavg", 50.0) > 10 * distance(name, 50.0)


@pytest.mark.parametrize("name", ["bulyan", "bulyan_multikrum"])
def test_bulyan_with_too_few_updates_keeps_the_global_state(name):
    start = {k: torch.from_numpy(v) for k, v in initial_state().items()}
    (state,), _ = fedllm_rounds(name, {"num_malicious_clients": 1}, rounds=[1], sizes=FIVE, state=start)
    assert all(torch.equal(state[k], start[k]) for k in start)  # 5 < 4f + 3 = 7


@pytest.mark.parametrize("strategy,args,key", [
    ("fedtrimmedavg", {"beta": 0.5}, "beta"), ("krum", {"num_malicious_clients": -1}, "num_malicious_clients"),
    ("multikrum", {"num_clients_to_select": 0}, "num_clients_to_select"),
    ("bulyan", {"num_malicious_clients": 1.5}, "num_malicious_clients")])
def test_bad_robust_arguments_name_the_key(strategy, args, key):
    raw = {"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
           "federation": {"num_clients": 3, "strategy": strategy, "strategy_args": args}}
    with pytest.raises(InputError, match=f"strategy_args.{key}"):
        parse_recipe(raw)
