"""federation.round_deadline in simulation: a late client is dropped from its round, the round equals one without it,
its state is not overwritten by its late training, and SecAgg+ unmasks the sum of the clients that arrived.

A client is made late by fault injection at the client's upload (as tests/reliability/test_client_faults.py poisons
one): its update's ``arrival_s`` is set to 1000 s, what a client on a slow link reports on Flower.
"""

import json
import math

import pytest
import torch

from fedllm.commands.cli import main
from fedllm.engine import server
from fedllm.engine.round_deadline import RoundDeadline
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError

ALL_THREE = {"num_clients": 3, "clients_per_round": 3, "rounds": 2}


@pytest.fixture
def faults(monkeypatch):
    """``faults[(round, client)] = fn(update)`` rewrites that client's upload in that round; ``seen`` keeps each
    upload (its state and example count) before the round loop's checks. Every other upload arrives 1 s into its
    round: a client's measured training seconds would let a deadline of "2x" the median drop a punctual client
    whose training a loaded machine slowed (CI: 0.097 s against a median under 0.05 s)."""
    faults, seen = {}, {}
    original = server.run_client

    def wrapped(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        seen[(plan.rnd, plan.client_id)] = ({k: v.clone() for k, v in update.state.items()}, update.num_examples)
        update.arrival_s = 1.0
        if (plan.rnd, plan.client_id) in faults:
            faults[(plan.rnd, plan.client_id)](update)
        return update

    monkeypatch.setattr(server, "run_client", wrapped)
    return faults, seen


def late(update):
    update.arrival_s = 1000.0


def nan(update):
    next(iter(update.state.values())).view(-1)[0] = float("nan")


def _rounds(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _equal_states(a, b):
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("deadline", ["2x", 100])
def test_a_late_client_is_dropped_and_the_run_equals_one_without_it(tiny_recipe, tmp_path, faults, deadline):
    """SCAFFOLD (per-client c_i and a server c): client 1 late in round 1. Round 1's x is the example-weighted mean
    of clients 0 and 2, and the whole run equals a run in which client 1 failed in round 1 (its c_i not updated,
    so its round 2 starts from the new x and c with the c_i it had before round 1)."""
    inject, _ = faults
    fed = {**ALL_THREE, "strategy": "scaffold"}
    inject[(1, 1)] = late
    timed = server.run(parse_recipe({**tiny_recipe(federation={**fed, "round_deadline": deadline}),
                                     "output_dir": str(tmp_path / "deadline")}))
    inject[(1, 1)] = nan  # the same round without client 1: it fails instead
    without = server.run(parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "without")}))

    records = _rounds(timed.run_dir)
    assert records[0]["late"] == {"1": 1000.0} and records[1]["late"] == {}
    assert records[0]["dropped"]["1"].startswith("late: its upload arrived 1000.000 s into the round, after the "
                                                 "deadline")
    assert records[0]["round_deadline_s"] < 1000
    assert set(records[0]["client_loss"]) == {"0", "2"} and set(records[1]["client_loss"]) == {"0", "1", "2"}
    assert json.loads((timed.run_dir / "summary.json").read_text())["late"] == {"1": [1]}
    # the whole run equals the run without client 1 in round 1, bit for bit: x, SCAFFOLD's c and every c_i
    assert _equal_states(timed.global_state, without.global_state)
    assert _equal_states(timed.strategy.state_dict(), without.strategy.state_dict())
    for cid in range(3):
        assert _equal_states(timed.clients.get(cid), without.clients.get(cid))
    assert any(v.abs().max() > 0 for v in timed.clients.get(1).values())  # its c_i trained in round 2


def test_round_one_is_the_weighted_mean_of_the_clients_in_time(tiny_recipe, tmp_path, faults):
    inject, seen = faults
    inject[(1, 2)] = late
    result = server.run(parse_recipe({**tiny_recipe(federation={**ALL_THREE, "rounds": 1, "round_deadline": "1.5x"}),
                                      "output_dir": str(tmp_path / "r")}))
    (record,) = _rounds(result.run_dir)
    assert record["late"] == {"2": 1000.0}
    (a, n_a), (b, n_b) = seen[(1, 0)], seen[(1, 1)]
    for k, v in result.global_state.items():
        expected = (a[k].double() * n_a + b[k].double() * n_b) / (n_a + n_b)
        torch.testing.assert_close(v.double(), expected, rtol=1e-6, atol=1e-7)


def test_secagg_unmasks_the_sum_of_the_clients_in_time(tiny_recipe, tmp_path, faults):
    """4 clients, SecAgg+ (max_dropouts 1): client 2 late. The aggregate equals the run in which client 2 sent
    nothing (a dropout after the share exchange), bit for bit: the survivors' sum was unmasked."""
    inject, _ = faults
    fed = {"num_clients": 4, "clients_per_round": 4, "rounds": 1}
    privacy = {"secure_aggregation": "secagg_plus"}
    inject[(1, 2)] = late
    timed = server.run(parse_recipe({**tiny_recipe(federation={**fed, "round_deadline": 60}, privacy=privacy),
                                     "output_dir": str(tmp_path / "deadline")}))
    inject[(1, 2)] = nan
    without = server.run(parse_recipe({**tiny_recipe(federation=fed, privacy=privacy),
                                       "output_dir": str(tmp_path / "without")}))
    (record,) = _rounds(timed.run_dir)
    assert record["late"] == {"2": 1000.0} and record["round_deadline_s"] == 60
    assert record["secure_aggregation"]["dropped_after_sharing"] == [2] and record["dropped"]["2"].startswith("late")
    assert _equal_states(timed.global_state, without.global_state)


def test_the_deadline_waits_for_min_clients_per_round():
    d = RoundDeadline.of(0.5, min_clients=2)
    late, limit = d.late({0: 0.1, 1: 2.0, 2: 3.0}, sampled=3)
    assert limit == 2.0 and late == {2: 3.0}  # 0.5 s would leave one upload: the round waits for a second
    d = RoundDeadline.of("2x", min_clients=1)
    late, limit = d.late({0: 1.0, 1: 2.0, 2: 9.0}, sampled=3)
    assert limit == 4.0 and late == {2: 9.0}  # twice the median client's arrival (2.0 s)
    late, limit = d.late({0: 1.0}, sampled=3)  # two of three never arrived: the median is one of them
    assert limit == math.inf and late == {}


def test_a_simulated_upload_arrives_when_its_training_ends():
    from types import SimpleNamespace

    from fedllm.engine.round_deadline import arrival_seconds

    assert arrival_seconds(SimpleNamespace(arrival_s=None, work={"seconds": 2.5})) == 2.5
    assert arrival_seconds(SimpleNamespace(arrival_s=7.0, work={"seconds": 2.5})) == 7.0  # Flower's reply time


def test_recipe_load_refuses_what_cannot_use_a_deadline(tiny_recipe, tmp_path, capsys):
    with pytest.raises(RecipeError, match=r"federation.round_deadline.*'local': it aggregates nothing"):
        parse_recipe(tiny_recipe(federation={"strategy": "local", "round_deadline": 60}))
    with pytest.raises(RecipeError, match=r"federation.round_deadline.*multiple of the median client time \('2x'\)"):
        parse_recipe(tiny_recipe(federation={"round_deadline": "soon"}))
    with pytest.raises(RecipeError, match=r"under client-level DP one client's time must not decide"):
        parse_recipe(tiny_recipe(federation={"round_deadline": "2x"},
                                 privacy={"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 1.0}))
    parse_recipe(tiny_recipe(federation={"round_deadline": 60},
                             privacy={"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 1.0}))

    import yaml

    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(federation={"strategy": "local", "round_deadline": "3x"})))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "federation.round_deadline" in err and "aggregates nothing" in err


def test_the_dry_run_says_how_long_a_round_waits_and_what_late_means(tiny_recipe):
    from fedllm.commands.dry_run import deadline_lines

    assert deadline_lines(parse_recipe(tiny_recipe())) == []
    (line,) = deadline_lines(parse_recipe(tiny_recipe(federation={"strategy": "scaffold", "round_deadline": "2x"})))
    assert line.startswith("  round deadline: 2x the median client time, and at least until 1 upload(s) arrived; "
                           "a late client is dropped: its c_i stays the one from before the round")
    (line,) = deadline_lines(parse_recipe(tiny_recipe(
        federation={"num_clients": 4, "clients_per_round": 4, "round_deadline": 600},
        privacy={"secure_aggregation": "secagg_plus"})))
    assert "600 s" in line and "under SecAgg+ a late client is a dropout" in line
