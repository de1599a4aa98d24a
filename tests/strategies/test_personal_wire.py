"""Every personalized strategy: what a client sends (on the wire, after the cast) never holds its private state;
local-only training sends nothing; personal evaluation is reported per client and as mean/min/max."""

import json

import pytest
import torch
from strategy_helpers import make_raw

from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe

# strategy, args, classification, what the upload must consist of (a predicate on its keys)
PERSONALIZED = {
    "local": ("local", {}, False, lambda keys, model_keys: keys == set()),
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1}, False,
                 lambda keys, model_keys: keys == {k for k in model_keys if "lora_" in k}),
    "fedlora_pfl-full": ("fedlora_pfl", {"e_lora": 1, "e_global": 1}, False,
                         lambda keys, model_keys: keys == {k for k in model_keys if k.endswith("base_layer.weight")}),
    "fedlora_pfl-lora-head": ("fedlora_pfl", {"shared": "lora", "schedule": "simultaneous"}, True,
                              lambda keys, model_keys: keys == {k for k in model_keys if "lora_" in k
                                                                or "modules_to_save" in k}),
    "pflmf": ("pflmf", {"rank": 2}, False, lambda keys, model_keys: keys == {"pflmf.U"}),
    "fedsa_lora": ("fedsa_lora", {}, False, lambda keys, model_keys: keys == {k for k in model_keys if "lora_A" in k}),
}


@pytest.mark.parametrize("case", sorted(PERSONALIZED))
def test_uploads_never_carry_private_state(case, data_files, tmp_path, monkeypatch):
    from fedllm.engine import server

    strategy, args, classification, expected = PERSONALIZED[case]
    wire = []
    original = server.cast

    def spy(state, dtype):  # the server casts each upload right after run_client: what goes on the wire
        out = original(state, dtype)
        wire.append(out)
        return out

    monkeypatch.setattr(server, "cast", spy)
    raw = make_raw(data_files, tmp_path / "run", strategy, args, classification=classification,
                   federation={"clients_per_round": 3})
    result = run(parse_recipe(raw))
    model_keys = {n for n, _ in result.model.named_parameters()}
    uploads = wire[1::2]  # cast(plan.state) then cast(update.state), per client
    assert len(uploads) == 6
    private = {k: v for c in result.clients.clients() for k, v in result.clients.get(c).items()}
    assert private, "a personalized strategy keeps per-client state"
    for up in uploads:
        assert expected(set(up), model_keys), sorted(up)[:4]
        assert set(up).isdisjoint(private)
        for v in up.values():  # not even under another name
            assert not any(v.shape == p.shape and torch.equal(v, p) for p in private.values())
    up_bytes = sum(v.numel() * 4 for v in uploads[0].values())
    assert all(set(h["bytes_up"].values()) == {up_bytes} for h in result.history)


def test_local_training_sends_nothing_and_keeps_each_clients_adapter(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "local", {}, federation={"rounds": 3})
    result = run(parse_recipe(raw))
    assert all(h["bytes_up_total"] == 0 and h["bytes_down_total"] == 0 for h in result.history)
    strategy = result.strategy
    assert all(torch.equal(result.global_state[k], strategy.initial[k]) for k in strategy.keys)  # nothing aggregated
    trained = sorted({c for h in result.history for c in h["clients"]})
    states = {c: strategy.personal_state(c, result.clients.get(c)) for c in range(3)}
    for c in trained:
        assert any(not torch.equal(states[c][k], strategy.initial[k]) for k in strategy.keys)
    for a in trained:
        for b in trained:
            if a < b:
                assert any(not torch.equal(states[a][k], states[b][k]) for k in strategy.keys)


def test_personal_eval_per_client_and_mean_min_max(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", {"shared": "lora"}, classification=True,
                   data={"client_eval_fraction": 0.25, "eval_fraction": 0.2}, eval={"tasks": ["rte"], "personal": True},
                   federation={"clients_per_round": 3})
    result = run(parse_recipe(raw))
    last = result.history[-1]
    per_client = last["personal_eval"]
    assert sorted(per_client) == ["0", "1", "2"]
    accs = [per_client[c]["rte/accuracy"] for c in sorted(per_client)]
    stats = last["personal_eval_stats"]["rte/accuracy"]
    assert stats["mean"] == pytest.approx(sum(accs) / 3) and stats["min"] == min(accs) and stats["max"] == max(accs)
    assert stats["clients"] == 3 and per_client[stats["argmin"]]["rte/accuracy"] == min(accs)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["final_personal_eval"] == per_client
    assert summary["final_personal_eval_stats"]["rte/accuracy"] == stats
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["personal_eval_stats"] == last["personal_eval_stats"]
