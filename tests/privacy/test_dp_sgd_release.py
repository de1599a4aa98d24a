"""Issue 34, DP-SGD: every upload the server received spends its client's budget (dropped by the checks or the
norm screen, or discarded with a retried sample: trained and seen), the client's un-noised training loss is not
uploaded, and ``--resume`` refuses a changed update-norm screen under DP. ε expectations come from opacus's RDP
accountant and Google's dp-accounting, stepped here."""

import json
import math

import pytest
import yaml

from fedllm.commands.cli import main
from fedllm.engine import server
from fedllm.recipe.checks import parse_recipe

DELTA = 1e-3
DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": DELTA, "noise_seed": 0}


INTEGER_ORDERS = list(range(2, 64))  # dp-accounting's Poisson bound does not converge at opacus's orders 1.1-1.8


def opacus_epsilon(z: float, q: float, steps: int, orders=None) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=z, sample_rate=q)
    return acc.get_epsilon(DELTA) if orders is None else acc.get_privacy_spent(delta=DELTA, alphas=orders)[0]


def dp_accounting_epsilon(z: float, q: float, steps: int) -> float:
    """The same Poisson-subsampled Gaussian composed ``steps`` times in Google's dp-accounting."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant(orders=INTEGER_ORDERS)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(DELTA)


@pytest.fixture
def uploads(monkeypatch):
    """Every update a client returned (round, client, steps, loss); client 1's always holds a nan (dropped by the
    checks), client 2's is x1e8 in its first round (dropped by the norm screen)."""
    log, first = [], set()
    original = server.run_client

    def wrapped(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        log.append((plan.rnd, plan.client_id, update.steps, update.loss))
        if plan.client_id == 1:
            next(iter(update.state.values())).view(-1)[0] = math.nan
        if plan.client_id == 2 and 2 not in first:
            first.add(2)
            update.state = {k: v * 1e8 for k, v in update.state.items()}
        return update

    monkeypatch.setattr(server, "run_client", wrapped)
    return log


def test_every_received_upload_counts_its_steps_and_no_loss_is_uploaded(tiny_recipe, uploads):
    fed = {"num_clients": 4, "clients_per_round": 2, "rounds": 3, "min_clients_per_round": 2, "round_retries": 3}
    result = server.run(parse_recipe(tiny_recipe(federation=fed, privacy=DP_SGD, train={"batch_size": 4})))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    why = [w for line in lines for r in line.get("retries", []) for w in r["dropped"].values()]
    assert any("non-finite" in w for w in why) and any("update norm" in w for w in why)  # both drops, retried
    trained: dict[int, int] = {}
    for _, cid, steps, loss in uploads:
        trained[cid] = trained.get(cid, 0) + steps
        assert loss is None  # nothing but the update leaves a DP-SGD client
    assert trained[1] > 0 and all(str(1) not in line.get("client_steps", {}) for line in lines)  # never aggregated
    sizes = result.strategy.sizes
    got = lines[-1]["client_epsilon"]
    assert set(got) == {str(c) for c in trained}
    for cid, steps in trained.items():
        q = 4 / sizes[cid]
        assert got[str(cid)] == pytest.approx(opacus_epsilon(1.1, q, steps), rel=1e-9)
        google = dp_accounting_epsilon(1.1, q, steps)  # integer orders: the two libraries agree there ...
        assert google == pytest.approx(opacus_epsilon(1.1, q, steps, INTEGER_ORDERS), rel=1e-6)
        assert got[str(cid)] <= google * (1 + 1e-9)  # ... and opacus's finer orders only tighten it
    for line in lines:
        assert "train_loss" not in line and "client_loss" not in line
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["final_train_loss"] is None


def test_a_non_finite_loss_is_a_fault_of_the_client_that_uploads_nothing(tiny_recipe, monkeypatch):
    from fedllm.engine import client

    original = client.train_client

    def diverged(*args, **kwargs):
        result = original(*args, **kwargs)
        result.loss = math.inf
        return result

    monkeypatch.setattr(client, "train_client", diverged)
    fed = {"num_clients": 3, "clients_per_round": 3, "rounds": 1}
    with pytest.raises(server.client_faults.RoundStopped):
        server.run(parse_recipe(tiny_recipe(federation=fed, privacy=DP_SGD)))


@pytest.mark.parametrize("key,old,new", [("max_update_norm", None, 5.0), ("update_outlier_factor", 1000.0, 10.0)])
def test_resume_under_dp_refuses_a_changed_update_norm_screen(tiny_recipe, tmp_path, capsys, key, old, new):
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(federation={"rounds": 1}, privacy=DP_SGD)
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe)]) == 0
    (tmp_path / "run" / "summary.json").unlink()  # as if stopped after final/: resumable to more rounds
    capsys.readouterr()
    assert main(["train", str(recipe), "federation.rounds=2", f"federation.{key}={new}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"federation.{key}: the run has {old!r}, the recipe gives {new!r}" in err
    assert "part of the mechanism" in err
    plain = tmp_path / "plain.yaml"  # without DP the screen is a fault policy and may change
    plain.write_text(yaml.safe_dump({**raw, "privacy": {}, "output_dir": str(tmp_path / "plain")}))
    assert main(["train", str(plain)]) == 0
    (tmp_path / "plain" / "summary.json").unlink()
    assert main(["train", str(plain), "federation.rounds=2", f"federation.{key}={new}", "--resume"]) == 0


def test_a_retry_that_would_exceed_the_budget_stops_the_run(tiny_recipe, uploads):
    """The discarded sample's uploads were charged, so the budget is checked again before a retry trains anyone."""
    from fedllm.engine.client_faults import RoundStopped
    from fedllm.privacy import accounting
    from fedllm.recipe.schedule import steps_per_round

    recipe = parse_recipe(
        tiny_recipe(
            federation={"num_clients": 4, "clients_per_round": 2, "rounds": 1, "min_clients_per_round": 2},
            privacy=DP_SGD,
            train={"batch_size": 4},
        )
    )
    steps = steps_per_round(recipe.train, 12)  # 48 examples, 4 clients of 12
    budget = accounting.dp_sgd_epsilon(1.1, 4 / 12, steps, DELTA) * 1.01  # room for one round, not two
    recipe = parse_recipe(
        tiny_recipe(
            federation={"num_clients": 4, "clients_per_round": 2, "rounds": 1, "min_clients_per_round": 2},
            privacy={**DP_SGD, "target_epsilon": budget},
            train={"batch_size": 4},
        )
    )
    assert 1 in server.sample_clients(recipe.seed, 1, 4, 2)  # round 1's sample holds the failing client: a retry
    with pytest.raises(RoundStopped, match="privacy budget is spent"):
        server.run(recipe)
    assert len({cid for _, cid, _, _ in uploads}) == 2  # the first sample only: nobody trained for the retry
