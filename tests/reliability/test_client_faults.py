"""Client faults: a client that raises or sends a nan/malformed update is dropped, never averaged in."""

import json
import math

import pytest
import torch

from fedllm.commands.cli import main
from fedllm.engine import server
from fedllm.engine.client_faults import RoundStopped
from fedllm.recipe.checks import parse_recipe
from fedllm.runs import checkpoint as ckpt_io
from fedllm.strategies.fedavg import FedAvg

ALL_THREE = {"num_clients": 3, "clients_per_round": 3, "rounds": 1}


@pytest.fixture
def capture(monkeypatch):
    """Records every update ``run_client`` returns; ``poison[cid]`` may rewrite a client's update."""
    seen, poison = {}, {}
    original = server.run_client

    def wrapped(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        if plan.client_id in poison:
            poison[plan.client_id](update)
        seen[plan.client_id] = update
        return update

    monkeypatch.setattr(server, "run_client", wrapped)
    return seen, poison


def _weighted_mean(updates):
    total = sum(u.num_examples for u in updates)
    return {k: sum(u.state[k].double() * u.num_examples for u in updates) / total for k in updates[0].state}


def _rounds(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_update_is_dropped_and_the_global_state_is_the_mean_of_the_others(tiny_recipe, capture, caplog):
    seen, poison = capture
    poison[1] = lambda u: next(iter(u.state.values())).view(-1).__setitem__(0, float("nan"))
    with caplog.at_level("WARNING", logger="fedllm"):
        result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE)))
    key = next(iter(seen[1].state))
    assert f"round 1: client 1 dropped: non-finite values in {key}" in caplog.text
    expected = _weighted_mean([seen[0], seen[2]])
    for k, v in result.global_state.items():
        assert torch.isfinite(v).all()
        torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-7)
    (record,) = _rounds(result.run_dir)
    assert record["dropped"] == {"1": f"non-finite values in {key}"}
    assert set(record["client_loss"]) == {"0", "2"} and set(record["bytes_up"]) == {"0", "2"}
    json.loads((result.run_dir / "summary.json").read_text(), parse_constant=pytest.fail)  # strict JSON


def test_a_nan_loss_is_dropped(tiny_recipe, capture):
    seen, poison = capture
    poison[0] = lambda u: setattr(u, "loss", math.inf)
    result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE)))
    assert _rounds(result.run_dir)[0]["dropped"] == {"0": "non-finite training loss (inf)"}


def test_a_malformed_update_is_dropped(tiny_recipe, capture):
    seen, poison = capture
    poison[2] = lambda u: u.state.__setitem__(next(iter(u.state)), torch.zeros(3))
    result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE)))
    (why,) = _rounds(result.run_dir)[0]["dropped"].values()
    assert "shape [3] torch.float32, expected" in why
    expected = _weighted_mean([seen[0], seen[1]])
    assert all(torch.allclose(v.double(), expected[k]) for k, v in result.global_state.items())


def raise_on_second_step(monkeypatch, client):
    """Client ``client`` raises inside its second optimizer step (every time it trains)."""

    def after_step(self, model, plan):
        plan.extra["steps"] = plan.extra.get("steps", 0) + 1
        if plan.client_id == client and plan.extra["steps"] == 2:
            raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(FedAvg, "after_step", after_step, raising=False)


def test_a_client_that_raises_on_its_second_step_is_dropped(tiny_recipe, capture, monkeypatch):
    seen, _ = capture
    raise_on_second_step(monkeypatch, 1)
    result = server.run(parse_recipe(tiny_recipe(federation=ALL_THREE, train={"optimizer_state": "per_client"})))
    (record,) = _rounds(result.run_dir)
    assert record["dropped"] == {"1": "raised RuntimeError: CUDA error: device lost"}
    assert 1 not in seen and result.clients.get(1) == {}  # no half-trained moments are kept for it
    assert any(k.startswith("optimizer/") for k in result.clients.get(0))
    expected = _weighted_mean([seen[0], seen[2]])
    assert all(torch.allclose(v.double(), expected[k]) for k, v in result.global_state.items())


def test_on_client_error_fail_stops_with_a_checkpoint(tiny_recipe, tmp_path, monkeypatch, capsys):
    import yaml

    raise_on_second_step(monkeypatch, 1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(federation={**ALL_THREE, "on_client_error": "fail"})))
    assert main(["train", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "round 1: client 1 raised RuntimeError: CUDA error: device lost (federation.on_client_error=fail)" in err
    run_dir = tmp_path / "run"
    assert ckpt_io.load_checkpoint(ckpt_io.round_dir(run_dir, 0)).round == 0
    assert not (run_dir / "final").exists() and not (run_dir / "metrics.jsonl").exists()


def test_too_few_valid_updates_retries_with_a_fresh_sample(tiny_recipe, monkeypatch):
    raise_on_second_step(monkeypatch, 1)
    fed = {"num_clients": 4, "clients_per_round": 2, "min_clients_per_round": 2, "rounds": 3, "round_retries": 5}
    result = server.run(parse_recipe(tiny_recipe(federation=fed)))
    for record in _rounds(result.run_dir):
        assert 1 not in record["clients"] and len(record["client_loss"]) == 2
        for retry in record.get("retries", []):
            assert 1 in retry["clients"] and retry["dropped"] == {"1": "raised RuntimeError: CUDA error: device lost"}
    assert any(r.get("retries") for r in _rounds(result.run_dir))  # client 1 was drawn at least once


def test_a_round_that_never_gets_enough_updates_stops_cleanly_and_resumes(tiny_recipe, monkeypatch, caplog):
    raise_on_second_step(monkeypatch, 1)
    raw = tiny_recipe(federation={**ALL_THREE, "rounds": 2, "min_clients_per_round": 3, "round_retries": 1},
                      checkpoint={"every": 1})
    with pytest.raises(RoundStopped, match="round 1: fewer than federation.min_clients_per_round=3 valid updates "
                                           "in each of 2 samples"):
        server.run(parse_recipe(raw))
    run_dir = parse_recipe(raw).output_dir
    ck = ckpt_io.round_dir(run_dir, 0)
    ckpt_io.verify_checkpoint(ck)
    monkeypatch.undo()  # the fault is fixed
    resumed = server.run(parse_recipe(raw), resume=True)
    assert [r["round"] for r in _rounds(resumed.run_dir)] == [1, 2]
    clean = server.run(parse_recipe({**raw, "output_dir": str(resumed.run_dir) + "-clean"}))
    assert all(torch.equal(clean.global_state[k], resumed.global_state[k]) for k in clean.global_state)


def test_a_finite_but_huge_update_is_dropped_and_the_global_state_is_the_mean_of_the_others(tiny_recipe, capture,
                                                                                             caplog):
    from safetensors.torch import load_file

    seen, poison = capture
    first = {}  # round 1's updates (the capture keeps the last round's)

    def keep(update):
        if update.client_id not in first:
            first[update.client_id] = update
            if update.client_id == 1:  # a finite update x 1e30, in round 1 only
                for v in update.state.values():
                    v.mul_(1e30)

    poison.update({0: keep, 1: keep, 2: keep})
    with caplog.at_level("WARNING", logger="fedllm"):
        result = server.run(parse_recipe(tiny_recipe(federation={**ALL_THREE, "rounds": 2}, checkpoint={"every": 1})))
    assert "round 1: client 1 dropped: update norm" in caplog.text
    assert "federation.update_outlier_factor=1000 times the median of the others" in caplog.text
    one, two = _rounds(result.run_dir)
    assert set(one["dropped"]) == {"1"} and set(one["client_loss"]) == {"0", "2"}
    assert "dropped" not in two and all(math.isfinite(x) for x in two["client_loss"].values())  # a sane round 2
    expected = _weighted_mean([first[0], first[2]])
    state = load_file(str(result.run_dir / "checkpoints" / "round-0001" / "adapter.safetensors"))
    for k, v in state.items():
        torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-7)


def test_norm_outliers_by_hand():
    from fedllm.engine.client_faults import norm_outliers, update_norm

    g = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([3.0])}
    assert update_norm({"a": torch.tensor([4.0, 5.0]), "c": torch.tensor([12.0])}, g) == pytest.approx(13.0)
    norms = {0: 1.0, 1: 2.0, 2: 5000.0}
    assert set(norm_outliers(norms, None, 1000.0, [])) == {2}  # 5000 > 1000 x median(1, 2)
    assert norm_outliers({0: 1.0, 1: 900.0}, None, 1000.0, []) == {}  # two clients: each judged by the other
    assert set(norm_outliers({0: 1.0, 1: 1e30}, None, 1000.0, [])) == {1}
    assert set(norm_outliers({0: 1e30, 1: 1e30}, None, 1000.0, [0.5, 0.7])) == {0, 1}  # last round's norms count
    assert set(norm_outliers(norms, 3.0, None, [])) == {2}
    assert "above federation.max_update_norm=3" in norm_outliers(norms, 3.0, None, [])[2]
    assert norm_outliers({0: 0.0, 1: 0.0, 2: 1.0}, None, 10.0, []) == {}  # a median of 0 judges nothing


def test_a_non_finite_aggregate_is_never_checkpointed(tiny_recipe, monkeypatch):
    original = FedAvg.aggregate

    def broken(self, rnd, global_state, updates):
        out = original(self, rnd, global_state, updates)
        if rnd == 2:
            next(iter(out.values())).view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(FedAvg, "aggregate", broken)
    recipe = parse_recipe(tiny_recipe(federation={"rounds": 3}, checkpoint={"every": 1}))
    with pytest.raises(RoundStopped, match="round 2: the aggregate is not finite"):
        server.run(recipe)
    run_dir = recipe.output_dir
    assert [p.name for p in ckpt_io.round_checkpoints(run_dir)] == ["round-0001"]
    assert not (ckpt_io.Path(run_dir) / "final").exists()
    assert ckpt_io.newest_intact(run_dir)[0].name == "round-0001"
