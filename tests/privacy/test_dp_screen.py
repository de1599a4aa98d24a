"""Issue 34: under client-level DP the outlier screen bounds each update by data-independent numbers only (so one
client's data cannot decide whether another client is summed), and a round with too few valid updates is not
retried with a second sample (which clients failed would pick it)."""

import json
import random

import pytest

from fedllm.common.errors import InputError
from fedllm.engine import server
from fedllm.engine.client_faults import RoundStopped, norm_outliers
from fedllm.recipe.checks import parse_recipe

DP = {"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-3}
ALL_THREE = {"num_clients": 3, "clients_per_round": 3, "rounds": 1}


def test_under_dp_each_verdict_depends_on_that_clients_norm_alone():
    rng = random.Random(0)
    for _ in range(200):
        factor, scale = rng.choice([2.0, 10.0, 1000.0]), rng.uniform(0.01, 2.0)
        norms = {c: 10 ** rng.uniform(-6, 4) for c in range(rng.randint(1, 9))}
        reference = [10 ** rng.uniform(-6, 4) for _ in range(rng.randint(0, 5))]
        verdict = norm_outliers(norms, None, factor, reference, scale=scale)
        assert set(verdict) == {c for c, n in norms.items() if n > factor * scale}  # the bound factor·C, no other
    # the median rule would drop client 0 (5 > 1000 × 0.001); the DP bound 1000 × 0.5 keeps it
    assert set(norm_outliers({0: 5.0, 1: 1e-3, 2: 1e-3}, None, 1000.0, [])) == {0}
    assert norm_outliers({0: 5.0, 1: 1e-3, 2: 1e-3}, None, 1000.0, [], scale=0.5) == {}
    assert set(norm_outliers({0: 600.0, 1: 1e-3}, None, 1000.0, [], scale=0.5)) == {0}
    assert set(norm_outliers({0: 0.4, 1: 1e-3}, 0.3, 1000.0, [], scale=0.5)) == {0}  # max_update_norm: absolute


@pytest.fixture
def shrink_others(monkeypatch):
    """Clients 0 and 2 upload a change 1e-6 times what they trained (client 1 is as trained)."""
    original = server.run_client

    def wrapped(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        if plan.client_id != 1:
            update.state = {
                k: (plan.state[k].float() + 1e-6 * (v.float() - plan.state[k].float())).to(v.dtype)
                for k, v in update.state.items()
            }
        return update

    monkeypatch.setattr(server, "run_client", wrapped)


@pytest.mark.parametrize("privacy,dropped", [({}, True), (DP, False)], ids=["no-dp", "central-dp"])
def test_other_clients_norms_decide_a_drop_only_without_dp(tiny_recipe, shrink_others, privacy, dropped):
    result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE, privacy=privacy)))
    (record,) = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ("1" in record.get("dropped", {})) == dropped


def test_under_dp_an_update_beyond_factor_times_the_clipping_norm_is_dropped(tiny_recipe, monkeypatch):
    original = server.run_client

    def huge(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        if plan.client_id == 1:
            update.state = {k: v * 1e6 for k, v in update.state.items()}
        return update

    monkeypatch.setattr(server, "run_client", huge)
    result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE, privacy=DP)))
    (record,) = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "times the clipping norm (0.5; under client-level DP" in record["dropped"]["1"]


def test_under_dp_a_round_with_too_few_valid_updates_is_not_retried(tiny_recipe, monkeypatch):
    drawn = []
    original = server.sample_clients

    def counted(*args, **kwargs):
        drawn.append(original(*args, **kwargs))
        return drawn[-1]

    def broken(model, plan, *args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(server, "sample_clients", counted)
    monkeypatch.setattr(server, "run_client", broken)
    fed = {"num_clients": 4, "clients_per_round": 2, "rounds": 1, "round_retries": 3}
    with pytest.raises(RoundStopped, match="not retried under client-level DP"):
        server.run(parse_recipe(tiny_recipe(federation=fed, privacy=DP)))
    assert len(drawn) == 1  # one sample: no second, data-dependent draw
    drawn.clear()
    with pytest.raises(RoundStopped, match="in each of 4 samples"):  # without DP: the retries as before
        server.run(parse_recipe(tiny_recipe(federation=fed, output_dir=str(tiny_recipe()["output_dir"]) + "-plain")))
    assert len(drawn) == 4


@pytest.mark.parametrize("mechanism", ["central", "central_client_clipping"])
def test_a_minimum_of_valid_updates_is_refused_under_client_level_dp(mechanism):
    raw = {
        "data": {"path": "unused.jsonl"},
        "train": {"local_steps": 1},
        "federation": {"num_clients": 4, "clients_per_round": 2, "min_clients_per_round": 2},
        "privacy": {**DP, "mechanism": mechanism},
    }
    with pytest.raises(InputError, match="federation.min_clients_per_round: got 2; expected 1 with privacy.mechanism"):
        parse_recipe(raw)
