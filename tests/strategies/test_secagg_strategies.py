"""Which strategies run under secure aggregation (``Strategy.aggregates_by_sum``), checked for every registered
strategy: a strategy that declares it aggregates from the sum gives the same new global state and server state
from the round's mean upload (``aggregate_mean``) as from the individual uploads; every other one is refused at
recipe load with its reason (``pytest -k secagg``)."""

import copy

import pytest
import torch
from strategy_helpers import make_strategy, tiny

from fedllm.common.errors import InputError
from fedllm.common.registry import strategies
from fedllm.models.loading import read_state, write_state
from fedllm.privacy import with_privacy
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientUpdate

ALL = strategies.names()
BY_SUM = [n for n in ALL if strategies.get(n).sum_aggregation_problem() is None]
REFUSED = [n for n in ALL if n not in BY_SUM]
SIZES = {0: 7, 1: 12, 2: 20, 3: 5}


def test_secagg_classification_of_the_built_in_strategies():
    assert set(BY_SUM) == {
        "fedavg",
        "fedprox",
        "scaffold",
        "fedavgm",
        "fedadagrad",
        "fedyogi",
        "fedadam",
        "ffa_lora",
        "frlora",
        "frlora_v1",
        "frlora_v2",
        "frlora_v3",
        "fedloru",
        "pfedloru",
        "fedsa_lora",
        "fedlora_pfl",
        "rolora",
        "fedsvd",
        "fed_sb",
    }
    assert set(REFUSED) == {
        "fedmedian",
        "fedtrimmedavg",
        "krum",
        "multikrum",
        "bulyan",
        "bulyan_multikrum",
        "flexlora",
        "flora",
        "fedex_lora",
        "mfedloru",
        "pflmf",
        "local",
        "hetlora",
        "lora_fair",
    }


def client_uploads(strategy, model, global_state, rnd=1):
    """Each client loads its plan, moves what it trains and what it was sent by seeded noise (local training's
    stand-in), uploads."""
    updates = []
    for cid, size in SIZES.items():
        plan = strategy.configure_client(rnd, cid, global_state)
        plan.lr = 0.1
        strategy.open_client(plan)
        write_state(model, {**plan.state, **plan.local})
        keys = [k for phase in plan.phases for k in (phase.keys if phase.keys is not None else plan.state)]
        keys += list(plan.state)  # every sent key moves (fedlora_pfl trains only its private part in round 1)
        gen = torch.Generator().manual_seed(100 + cid)
        params = dict(model.named_parameters())
        trained = {k: v.clone() for k, v in {**plan.state, **plan.local}.items()}
        for k in dict.fromkeys(keys):
            trained[k] = params[k].detach() + 0.05 * torch.randn(params[k].shape, generator=gen)
        strategy.close_client(plan, trained, 3)
        updates.append(ClientUpdate(cid, strategy.client_upload(plan, trained, 3), size, 1.0, 3))
    write_state(model, global_state)
    return updates


def mean_upload(strategy, updates):
    """What the server decodes from the secure sum: weighted mean on weighted keys, plain mean on the others."""
    weights = [strategy.sum_weight(u) for u in updates]
    assert all(isinstance(w, int) and w > 0 for w in weights)
    out = {}
    for k in updates[0].state:
        if strategy.summed_unweighted(k):
            out[k] = sum(u.state[k].double() for u in updates) / len(updates)
        else:
            out[k] = sum(w * u.state[k].double() for w, u in zip(weights, updates, strict=True)) / sum(weights)
        out[k] = out[k].to(updates[0].state[k].dtype)
    return out


def assert_same_aggregate(strategy, model, rnd=1):
    global_state = read_state(model, strategy.global_keys(model))
    updates = client_uploads(strategy, model, global_state, rnd)
    plain, secure = copy.deepcopy(strategy), copy.deepcopy(strategy)
    want = plain.aggregate(rnd, global_state, updates)
    metas = [ClientUpdate(u.client_id, {}, u.num_examples, u.loss, u.steps) for u in updates]
    got = secure.aggregate_mean(rnd, global_state, mean_upload(strategy, updates), metas)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=2e-6, rtol=1e-5, msg=k)
    server_want, server_got = plain.state_dict(), secure.state_dict()
    assert sorted(server_got) == sorted(server_want)
    for k in server_want:
        torch.testing.assert_close(server_got[k].float(), server_want[k].float(), atol=2e-6, rtol=1e-5, msg=k)
    moved = max((want[k].float() - global_state[k].float()).abs().max().item() for k in want if k in global_state)
    assert moved > 1e-3  # the round changed something: the comparison is not of two no-ops


@pytest.mark.parametrize("name", BY_SUM)
def test_secagg_a_sum_strategy_aggregates_the_same_from_the_mean_upload(name):
    args = {"weighting": "examples"} if "weighting" in str(strategies.get(name).__init__.__code__.co_varnames) else {}
    model = tiny().model
    assert_same_aggregate(make_strategy(name, model, num_clients=4, **args), model)


def test_secagg_client_clipping_dp_aggregates_the_same_from_the_mean_upload():
    """central_client_clipping with adaptive clipping around FedAdam: the unclipped bits are summed unweighted, the
    noise is added to the sum (a fixed noise seed makes both paths draw the same noise)."""
    privacy = {
        "mechanism": "central_client_clipping",
        "noise_multiplier": 0.8,
        "noise_seed": 7,
        "clipping_norm": 0.5,
        "adaptive_clipping": {"enabled": True, "count_stddev": 1.0},
    }
    recipe = parse_recipe(
        {
            "data": {"path": "unused.jsonl"},
            "train": {"local_steps": 1},
            "privacy": privacy,
            "federation": {"num_clients": 4, "clients_per_round": 4, "strategy": "fedadam"},
        }
    )
    model = tiny().model
    strategy = with_privacy(make_strategy("fedadam", model, num_clients=4, recipe=recipe), recipe)
    assert strategy.sum_weight(ClientUpdate(0, {}, 9, 0.0, 1)) == 1  # DP's mean is uniform
    assert_same_aggregate(strategy, model)


@pytest.mark.parametrize("name", REFUSED)
def test_secagg_refuses_a_strategy_that_needs_individual_uploads(name):
    raw = {
        "data": {"path": "unused.jsonl"},
        "train": {"local_steps": 1},
        "federation": {"num_clients": 4, "strategy": name},
        "privacy": {"secure_aggregation": "secagg_plus"},
    }
    with pytest.raises(InputError) as err:
        parse_recipe(raw)
    message = str(err.value)
    assert (
        f"- privacy.secure_aggregation: got 'secagg_plus'; expected none with federation.strategy '{name}'" in message
    )
    assert strategies.get(name).needs_individual_updates in message


def test_secagg_a_subclass_that_changes_aggregate_must_declare_it():
    from fedllm.strategies.fedavg import FedAvg

    class Reweighted(FedAvg):
        name = "reweighted"

        def aggregate(self, rnd, global_state, updates):
            return super().aggregate(rnd, global_state, updates[:1])

    assert (
        "changes aggregate (Reweighted) without declaring aggregates_by_sum = True"
        in Reweighted.sum_aggregation_problem()
    )
