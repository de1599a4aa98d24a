"""Issue 34: under differential privacy an export's card releases only what is protected or public — ε and the
privacy settings, evaluations of the released model — never statistics computed from the clients' data without
noise (losses, dropped clients, bytes of accepted uploads, seconds, per-client ε, personal evaluations)."""

import json
import math
import re

import pytest

from fedllm.engine import server
from fedllm.export import export
from fedllm.export.card import RELEASED_UNDER_DP
from fedllm.recipe.checks import parse_recipe

CENTRAL = {
    "mechanism": "central",
    "noise_multiplier": 1.0,
    "clipping_norm": 0.5,
    "delta": 1e-3,
    "adaptive_clipping": {"enabled": True, "count_stddev": 1.0},
}
DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": 1e-3}


def card_summary(card: str) -> dict:
    (text,) = re.findall(r"^- summary\.json[^`]*`(\{.*\})`$", card, flags=re.MULTILINE)
    return json.loads(text)


@pytest.mark.parametrize("privacy", [CENTRAL, DP_SGD], ids=["central", "dp-sgd"])
def test_a_dp_card_releases_only_the_guarantee_and_evaluations(tiny_recipe, tmp_path, monkeypatch, privacy):
    original = server.run_client

    def one_nan(model, plan, *args, **kwargs):  # client 1 is dropped in round 1: "dropped" in summary.json
        update = original(model, plan, *args, **kwargs)
        if plan.client_id == 1 and plan.rnd == 1:
            next(iter(update.state.values())).view(-1)[0] = math.nan
        return update

    monkeypatch.setattr(server, "run_client", one_nan)
    raw = tiny_recipe(
        federation={"rounds": 2, "num_clients": 3, "clients_per_round": 3},
        privacy=privacy,
        data={"eval_fraction": 0.25},
        eval={"every": 1, "limit": 2, "max_new_tokens": 4},
    )
    run_dir = server.run(parse_recipe(raw)).run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped"] and summary["bytes_up_total"] > 0  # the server's own record keeps them
    card = (export(run_dir, "adapter", tmp_path / "adapter").out / "README.md").read_text()
    released = card_summary(card)
    assert set(released) <= set(RELEASED_UNDER_DP) and {"epsilon", "privacy", "final_eval"} <= set(released)
    assert "unclipped" not in released["privacy"] and released["epsilon"] == summary["epsilon"]
    assert "communication: not released" in card and "bytes up" not in card
    for unprotected in (
        '"final_train_loss"',
        '"dropped"',
        '"client_epsilon"',
        '"seconds"',
        '"bytes_up_total"',
        "train loss (round",
    ):
        assert unprotected not in card
    assert "noise_seed is set" not in card


def test_a_dp_card_warns_when_the_noise_seed_is_in_the_recipe(tiny_recipe, tmp_path):
    raw = tiny_recipe(federation={"rounds": 1}, privacy={**DP_SGD, "noise_seed": 5})
    run_dir = server.run(parse_recipe(raw)).run_dir
    card = (export(run_dir, "adapter", tmp_path / "adapter").out / "README.md").read_text()
    assert "privacy.noise_seed is set (5)" in card and "guarantee does not hold" in card
