"""federation.mode: async (FedBuff, Nguyen et al. 2022): the server's steps recomputed by hand from the recorded
uploads, the staleness weights, the virtual clock's arrival order, refusals at recipe load, and resume bit-exactly
mid-run (in-flight clients checkpointed).

The uploads are recorded at the client (``run_client``'s returned state, the model it trained) together with the
global state it started from, so the oracle below knows nothing of fedllm's buffer: it replays Algorithm 1 from the
metrics' arrival order.
"""

import json
import math

import pytest
import torch

from fedllm.engine import server
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError

# 4 clients, all training at once; a server step every 2 uploads; client 3 five times slower (a slow site)
ASYNC = {"num_clients": 4, "clients_per_round": 2, "rounds": 4, "mode": "async", "async_buffer_size": 2,
         "async_concurrency": 3, "async_step_seconds": [1.0, 1.5, 1.2, 5.0]}


@pytest.fixture
def uploads(monkeypatch):
    """Every client training in order: ``(client, global state it started from, trained state)``."""
    seen = []
    original = server.run_client

    def wrapped(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        seen.append((plan.client_id, {k: v.clone() for k, v in plan.state.items()},
                     {k: v.clone() for k, v in update.state.items()}))
        return update

    monkeypatch.setattr(server, "run_client", wrapped)
    return seen


def _records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("round", 0) > 0]


def _replay(records, uploads, step):
    """Algorithm 1 by hand: the global state after each server step, from the initial state and the uploads; the
    n-th dispatch in the metrics is the n-th client trained. ``step(theta, mean_change)`` is the server's step."""
    dispatches = [d for r in records for d in r["async"]["dispatched"]]
    assert [d["client"] for d in dispatches] == [c for c, _, _ in uploads]
    by_start = {}  # (client, start) -> the change it uploaded and the global state it pulled
    for d, (_, pulled, trained) in zip(dispatches, uploads, strict=True):
        by_start[(d["client"], d["start_s"])] = (pulled, {k: trained[k] - pulled[k] for k in pulled})
    theta = dict(uploads[0][1])
    versions = [dict(theta)]
    for version, r in enumerate(records):
        total = {k: torch.zeros_like(v) for k, v in theta.items()}
        for a in r["async"]["aggregated"]:
            pulled, delta = by_start[(a["client"], a["start_s"])]
            gaps = [max((v[k] - pulled[k]).abs().max().item() for k in v) for v in versions]
            tau = min(range(len(versions)), key=gaps.__getitem__)  # the version it pulled: the one it equals
            assert gaps[tau] < 1e-6 and all(g > 1e-4 for i, g in enumerate(gaps) if i != tau)
            assert version - tau == a["staleness"]
            for k in total:
                total[k] += delta[k] / math.sqrt(1 + (version - tau))  # s(τ) = 1/sqrt(1+τ), the paper's
        theta = step(theta, {k: v / len(r["async"]["aggregated"]) for k, v in total.items()})
        versions.append(dict(theta))
    return theta


def _close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=tol, atol=tol), k


def test_fedavg_async_equals_algorithm_1_by_hand(tiny_recipe, tmp_path, uploads):
    """FedAvg under async: θ ← θ + Δ̄/K, Δ̄ = Σ s(τ_i)Δ_i, replayed from the uploads; arrivals in virtual time."""
    result = server.run(parse_recipe({**tiny_recipe(federation=ASYNC), "output_dir": str(tmp_path / "a")}))
    records = _records(result.run_dir)
    assert len(records) == 4 and all(len(r["async"]["aggregated"]) == 2 for r in records)
    # the virtual clock: uploads arrive in order of start + steps x seconds per step, each server step later
    arrivals = [a["arrival_s"] for r in records for a in r["async"]["aggregated"]]
    assert arrivals == sorted(arrivals)
    for r in records:
        for a in r["async"]["aggregated"]:
            assert a["arrival_s"] == pytest.approx(a["start_s"] + 2 * ASYNC["async_step_seconds"][a["client"]])
            assert a["weight"] == pytest.approx(1 / math.sqrt(1 + a["staleness"]))
        assert r["async"]["virtual_time_s"] == r["async"]["aggregated"][-1]["arrival_s"]
    assert any(a["staleness"] > 0 for r in records for a in r["async"]["aggregated"])  # stale uploads were weighted
    expected = _replay(records, uploads, lambda theta, mean: {k: theta[k] + mean[k] for k in theta})
    _close(result.global_state, expected)


def test_fedadam_async_steps_on_the_buffered_mean_change(tiny_recipe, tmp_path, uploads):
    """FedAdam under async: Δ̄/K is the pseudo-gradient of Reddi et al.'s Adam step (m, v moments, by hand; Flower's
    bias correction η_t = η·√(1 − β2^(t+1)) / (1 − β1^(t+1)) in server step t)."""
    args = {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
    fed = {**ASYNC, "rounds": 3, "strategy": "fedadam", "strategy_args": args}
    result = server.run(parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "a")}))
    moments = {}

    def adam(theta, delta):
        m = moments.setdefault("m", {k: torch.zeros_like(v) for k, v in delta.items()})
        v = moments.setdefault("v", {k: torch.zeros_like(x) for k, x in delta.items()})
        for k in delta:
            m[k] = args["beta_1"] * m[k] + (1 - args["beta_1"]) * delta[k]
            v[k] = args["beta_2"] * v[k] + (1 - args["beta_2"]) * delta[k] ** 2
        t = moments["t"] = moments.get("t", 0) + 1
        eta = args["eta"] * math.sqrt(1 - args["beta_2"] ** (t + 1)) / (1 - args["beta_1"] ** (t + 1))
        return {k: theta[k] + eta * m[k] / (v[k].sqrt() + args["tau"]) for k in theta}

    _close(result.global_state, _replay(_records(result.run_dir), uploads, adam), tol=1e-5)


@pytest.mark.parametrize("kind, exponent, expected", [
    ("sqrt", 0.5, [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]),
    ("constant", 0.5, [1.0, 1.0, 1.0, 1.0]),
    ("polynomial", 2.0, [1.0, 1 / 4, 1 / 9, 1 / 16]),
])
def test_staleness_weights(tiny_recipe, kind, exponent, expected):
    from fedllm.engine.fedbuff import FedBuff

    fed = {**ASYNC, "async_staleness": kind, "async_staleness_exponent": exponent}
    buff = FedBuff(parse_recipe(tiny_recipe(federation=fed)))
    assert [buff.weight(t) for t in range(4)] == pytest.approx(expected, rel=1e-12)


def test_resume_mid_run_is_bit_exact(tiny_recipe, tmp_path, monkeypatch):
    """A power cut in server step 3, after it dispatched a client (its in-flight list changed), resumed from step 2's
    checkpoint (clients in flight, trained from older versions): equal to a run that never stopped, global state and
    every metrics record but the timings."""
    from fedllm.engine.fedbuff import FedBuff

    whole = server.run(parse_recipe({**tiny_recipe(federation=ASYNC), "output_dir": str(tmp_path / "whole")}))
    cut = parse_recipe({**tiny_recipe(federation=ASYNC), "output_dir": str(tmp_path / "cut"),
                        "checkpoint": {"every": 1}})
    original, calls = FedBuff.dispatch, []

    def dispatch(self, loop, rnd, *args):
        calls.append(rnd)
        if calls.count(3) == 2:
            raise RuntimeError("power cut")
        return original(self, loop, rnd, *args)

    with monkeypatch.context() as patch:
        patch.setattr(FedBuff, "dispatch", dispatch)
        with pytest.raises(RuntimeError, match="power cut"):
            server.run(cut)
    meta = json.loads((tmp_path / "cut" / "checkpoints" / "round-0002" / "meta.json").read_text())
    assert meta["async"]["in_flight"]  # the checkpoint holds clients still training
    resumed = server.run(cut, resume=True)
    for k in whole.global_state:
        assert torch.equal(whole.global_state[k], resumed.global_state[k]), k

    def strip(r):
        return {k: v for k, v in r.items() if k not in ("seconds", "throughput")}

    assert [strip(r) for r in _records(resumed.run_dir)] == [strip(r) for r in _records(whole.run_dir)]


@pytest.mark.parametrize("section, value, key, says", [
    ("federation", {"strategy": "scaffold"}, "federation.mode", "control variates"),
    ("federation", {"strategy": "frlora"}, "federation.mode", "merges"),
    ("federation", {"strategy": "fedprox"}, "federation.mode", "FedBuff (Nguyen et al. 2022) is defined for"),
    ("federation", {"round_deadline": "2x"}, "federation.round_deadline", "no server step waits"),
    ("privacy", {"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 1.0}, "privacy.mechanism",
     "DP-FedBuff"),
    ("federation", {"async_concurrency": 9}, "federation.async_concurrency", "1..federation.num_clients (4)"),
    ("federation", {"async_step_seconds": [1, 2]}, "federation.async_step_seconds", "a list of 4 positive"),
    ("federation", {"async_buffer_size": 0}, "federation.async_buffer_size", "an integer >= 1"),
    ("federation", {"async_staleness_exponent": 2.0}, "federation.async_staleness_exponent",
     "applies only with federation.async_staleness: polynomial, not sqrt"),
])
def test_refused_at_recipe_load(tiny_recipe, section, value, key, says):
    raw = tiny_recipe(federation=ASYNC)
    raw[section] = {**raw.get(section, {}), **value}
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw)
    assert key in str(e.value) and says in str(e.value)


def test_async_keys_refused_under_sync(tiny_recipe):
    with pytest.raises(RecipeError, match=r"federation.async_buffer_size.*only with federation.mode: async"):
        parse_recipe(tiny_recipe(federation={"async_buffer_size": 3}))


def test_the_dry_run_says_what_async_does(tiny_recipe):
    from fedllm.commands.dry_run import async_lines

    assert async_lines(parse_recipe(tiny_recipe())) == []
    (line,) = async_lines(parse_recipe(tiny_recipe(federation=ASYNC)))
    assert line == ("  async (FedBuff): 3 client(s) train at once; a server step (a round) every 2 upload(s), each "
                    "weighted by its staleness s(tau) = 1/sqrt(1+tau); virtual seconds per local step "
                    "[1.0, 1.2, 1.5, 5.0]; federation.rounds = 4 server steps")


def test_flower_run_refuses_async(tiny_recipe, tmp_path, capsys):
    """Flower's ServerApp drives synchronous rounds: `fedllm flower run` refuses the recipe (exit 2) before it
    asks for a SuperLink."""
    import yaml

    from fedllm.commands.cli import main

    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(federation=ASYNC)))
    assert main(["flower", "run", str(path), "--superlink", "127.0.0.1:1", "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "federation.mode: async (FedBuff) runs in simulation only" in err and str(path) in err


def test_a_failed_client_under_on_client_error_fail_stops_at_the_step_start(tiny_recipe, tmp_path, monkeypatch):
    """federation.on_client_error: fail, a client's upload non-finite in server step 3 (after the step dispatched and
    received others): the run stops with step 2's checkpoint holding the buffer as step 3 found it, and --resume
    without the fault equals a run that never failed, bit for bit."""
    from fedllm.engine import client_faults

    fed = {**ASYNC, "on_client_error": "fail"}
    whole = server.run(parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "whole")}))
    cut = parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "cut")})
    original, calls = server.run_client, []

    def poisoned(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        calls.append(plan.rnd)
        if calls.count(3) == 2:
            next(iter(update.state.values())).view(-1)[0] = float("nan")
        return update

    with monkeypatch.context() as patch:
        patch.setattr(server, "run_client", poisoned)
        with pytest.raises(client_faults.RoundStopped, match=r"round 3: client \d non-finite .*on_client_error=fail"):
            server.run(cut)
    resumed = server.run(cut, resume=True)
    for k in whole.global_state:
        assert torch.equal(whole.global_state[k], resumed.global_state[k]), k
    assert [r["async"] for r in _records(resumed.run_dir)] == [r["async"] for r in _records(whole.run_dir)]


def test_fedavgm_server_learning_rate_is_fedbuffs_eta_g(tiny_recipe, tmp_path, uploads):
    """fedavgm with server_momentum 0: θ ← θ + η_g·Δ̄/K, η_g = server_learning_rate (here 0.5), replayed by hand."""
    fed = {**ASYNC, "rounds": 3, "strategy": "fedavgm", "strategy_args": {"server_learning_rate": 0.5}}
    result = server.run(parse_recipe({**tiny_recipe(federation=fed), "output_dir": str(tmp_path / "a")}))
    expected = _replay(_records(result.run_dir), uploads, lambda theta, mean: {k: theta[k] + 0.5 * mean[k]
                                                                                for k in theta})
    _close(result.global_state, expected)
