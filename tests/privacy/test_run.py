"""Client-level DP in a real (tiny) run: ε per round in metrics.jsonl and summary.json, the budget stop with a
checkpoint, and recipe validation of the privacy section."""

import json
from pathlib import Path

import pytest

from fedllm.common.errors import InputError
from fedllm.engine.client_faults import RoundStopped
from fedllm.engine.server import run
from fedllm.privacy import accounting
from fedllm.recipe.checks import parse_recipe

DP = {"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-3}


def test_epsilon_is_written_every_round_and_in_the_summary(tiny_recipe):
    raw = tiny_recipe(federation={"rounds": 3, "num_clients": 4, "clients_per_round": 2}, privacy=DP)
    result = run(parse_recipe(raw))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    eps = [line["epsilon"] for line in lines]
    want = [accounting.central_epsilon("without_replacement", 1.0, 4, 2, r, 1e-3) for r in (1, 2, 3)]
    assert eps == pytest.approx(want, rel=1e-12) and eps[0] < eps[1] < eps[2]
    assert lines[-1]["privacy"]["accounting"] == "without_replacement"
    assert lines[0]["privacy"]["noise_std"] == pytest.approx(1.0 * 0.5 / 2)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["epsilon"] == eps[-1] and summary["privacy"]["releases"] == 3
    for line in lines:  # issue 49 item 5: totals only, no client's loss beside the noised release
        assert not {"client_loss", "train_loss", "client_steps", "bytes_up", "bytes_down", "throughput"} & set(line)
        assert line["steps_total"] > 0 and line["bytes_up_total"] > 0
    assert summary["final_train_loss"] is None


def test_per_client_statistics_come_back_when_the_recipe_opts_in(tiny_recipe):
    raw = tiny_recipe(federation={"rounds": 1, "num_clients": 4, "clients_per_round": 2},
                      privacy={**DP, "mechanism": "central_client_clipping", "per_client_stats": True})
    line = run(parse_recipe(raw)).history[0]
    assert sorted(line["client_loss"]) == sorted(line["bytes_up"]) == sorted(str(c) for c in line["clients"])
    assert line["train_loss"] > 0 and all(v > 0 for v in line["client_loss"].values())


def test_the_run_stops_with_a_checkpoint_before_the_budget_is_exceeded(tiny_recipe):
    budget = accounting.central_epsilon("no_amplification", 1.0, 3, 3, 2, 1e-3) * 1.01  # room for 2 rounds
    raw = tiny_recipe(federation={"rounds": 4, "clients_per_round": 3},
                      privacy={**DP, "target_epsilon": budget}, checkpoint={"every": 1})
    with pytest.raises(RoundStopped, match="privacy budget is spent: aggregating round 3"):
        run(parse_recipe(raw))
    out = parse_recipe(raw).output_dir
    lines = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2] and lines[-1]["epsilon"] <= budget
    assert Path(out, "checkpoints", "round-0002").is_dir()


@pytest.mark.parametrize("privacy,federation,key,expected", [
    ({"mechanism": "central", "noise_multiplier": 1.0}, {"strategy": "krum"}, "privacy.mechanism", "Krum scores"),
    ({"mechanism": "central", "noise_multiplier": 1.0}, {"strategy": "scaffold"}, "privacy.mechanism",
     "control-variate"),
    ({"mechanism": "dp_sgd", "noise_multiplier": 1.0}, {"strategy": "fedprox"}, "privacy.mechanism", "proximal"),
    ({"mechanism": "central"}, {}, "privacy.noise_multiplier", "or give privacy.target_epsilon"),
    ({"mechanism": "central", "noise_multiplier": -1.0}, {}, "privacy.noise_multiplier", "positive"),
    ({"mechanism": "central", "target_epsilon": 1.0, "delta": 1.5}, {}, "privacy.delta", "in \\(0, 1\\)"),
    ({"mechanism": "central", "noise_multiplier": 1.0, "accounting": "no_amplification"}, {"clients_per_round": 2},
     "privacy.accounting", "not every client trains every round"),
    ({"noise_multiplier": 1.0}, {}, "privacy.noise_multiplier", "mechanism is none"),
    ({"secure_aggregation": True}, {}, "privacy.secure_aggregation", "one of 'none', 'secagg_plus'"),
    ({"mechanism": "central", "noise_multiplier": 1.0, "adaptive_clipping": {"enabled": True}}, {},
     "privacy.adaptive_clipping.count_stddev", "noise_multiplier / 2"),
    ({"mechanism": "centrall"}, {}, "privacy.mechanism", "one of"),
    ({"mechanism": "dp_sgd", "noise_multiplier": 1.0, "grad_sample_mode": "ghosts"}, {}, "privacy.grad_sample_mode",
     "got 'ghosts'; expected one of 'hooks', 'ghost'"),
    ({"mechanism": "central", "noise_multiplier": 1.0, "grad_sample_mode": "ghost"}, {}, "privacy.grad_sample_mode",
     "got 'ghost'; expected hooks unless privacy.mechanism is dp_sgd"),
])
def test_bad_privacy_settings_name_the_key(privacy, federation, key, expected):
    raw = {"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
           "federation": {"num_clients": 3, **federation}, "privacy": privacy}
    with pytest.raises(InputError, match=expected) as err:
        parse_recipe(raw)
    assert f"- {key}:" in str(err.value)


def test_dp_sgd_refuses_gradient_accumulation_and_loss_scaling():
    raw = {"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1, "grad_accum": 2, "dtype": "fp16"},
           "federation": {"num_clients": 3}, "privacy": {"mechanism": "dp_sgd", "target_epsilon": 3.0}}
    with pytest.raises(InputError) as err:
        parse_recipe(raw)
    assert "train.grad_accum" in str(err.value) and "train.dtype" in str(err.value)


def test_an_export_under_dp_releases_no_unprotected_statistic(tiny_recipe, tmp_path):
    """Issue 34: the model card carried the final training loss and the exact unclipped count, which no noise
    protects; under DP it leaves them out (and the dropped clients) and keeps epsilon."""
    from fedllm.export import export

    raw = tiny_recipe(federation={"rounds": 2, "num_clients": 3, "clients_per_round": 3},
                      privacy={**DP, "adaptive_clipping": {"enabled": True, "count_stddev": 1.0}})
    run_dir = run(parse_recipe(raw)).run_dir
    assert "unclipped" in json.loads((run_dir / "summary.json").read_text())["privacy"]  # the server's own record
    card = (export(run_dir, "adapter", tmp_path / "adapter").out / "README.md").read_text()
    assert "train loss (round" not in card  # none is recorded under client-level DP (issue 49 item 5) to print
    for unprotected in ('"final_train_loss"', '"unclipped"', '"dropped"'):  # their JSON keys
        assert unprotected not in card
    assert '"epsilon": ' in card and '"noise_multiplier": 1.0' in card
