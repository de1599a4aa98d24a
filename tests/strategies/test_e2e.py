"""The strategies through the real round loop on tiny models: resume, rank growth, lr = 0, equivalences."""

import json

import pytest
import torch
from safetensors.torch import load_file
from strategy_helpers import effective_weights, make_raw, record_updates, tiny

from fedllm.engine.server import run
from fedllm.models.lowrank import numerical_rank
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.fedloru import FedLoRU
from fedllm.strategies.mfedloru import MFedLoRU
from tests.conftest import cut_and_resume

CASES = {
    "frlora": ("frlora", {}, {"train": {"optimizer_state": "per_client"}}),
    "frlora_randomized": ("frlora", {"svd": "randomized", "niter": 2}, {}),
    "frlora_v1": ("frlora_v1", {}, {}),
    "frlora_v2": ("frlora_v2", {}, {}),
    "frlora_v3": ("frlora_v3", {}, {}),
    "fedloru": ("fedloru", {"tau": 1, "reinit": "momentum"}, {"train": {"optimizer_state": "per_client"}}),
    "fedloru_keep": ("fedloru", {"tau": 1, "accumulate": "keep"}, {}),
    "pfedloru": ("pfedloru", {"tau": 1, "personal_r": 2, "personal_steps": 1, "global_steps": 2},
                 {"train": {"optimizer_state": "per_client"}}),
    "mfedloru": ("mfedloru", {"tau": 1, "client_ranks": [4, 2, 1]}, {}),
    "local": ("local", {}, {"train": {"optimizer_state": "per_client"}}),
    "fedlora_pfl": ("fedlora_pfl", {"e_lora": 1, "e_global": 2}, {"train": {"optimizer_state": "per_client"}}),
    "fedlora_pfl_lora_sim": ("fedlora_pfl", {"shared": "lora", "schedule": "simultaneous", "rank_ratio": 0.1}, {}),
    "pflmf": ("pflmf", {"rank": 3, "eta_u": 0.5}, {"train": {"optimizer": "sgd"}}),
    "fedprox": ("fedprox", {"mu": 0.5}, {}),
    "scaffold": ("scaffold", {}, {"train": {"optimizer_state": "per_client"}}),
    "fedavgm": ("fedavgm", {"server_momentum": 0.9, "server_learning_rate": 0.5}, {}),
    "fedadagrad": ("fedadagrad", {"eta": 1e-2}, {}),
    "fedyogi": ("fedyogi", {}, {}),
    "fedadam": ("fedadam", {"eta": 1e-2}, {}),
    "ffa_lora": ("ffa_lora", {}, {}),
    "flexlora": ("flexlora", {"client_ranks": [4, 2, 1]}, {"train": {"optimizer_state": "per_client"}}),
    "flora": ("flora", {"client_ranks": [2, 4, 1]}, {"train": {"optimizer_state": "per_client"}}),
    "fedex_lora": ("fedex_lora", {}, {}),
    "fedsa_lora": ("fedsa_lora", {}, {"train": {"optimizer_state": "per_client"}}),
    # heterogeneous ranks with self-pruning (strong λ so some client prunes) and per-client moments
    "hetlora": ("hetlora", {"client_ranks": [4, 2, 3], "gamma": 0.5, "prune_lambda": 5.0},
                {"train": {"optimizer_state": "per_client"}}),
    "rolora": ("rolora", {}, {"train": {"optimizer_state": "per_client"}}),
    "lora_fair": ("lora_fair", {}, {}),
    "fedsvd": ("fedsvd", {}, {"train": {"optimizer_state": "per_client"}}),
    "fed_sb": ("fed_sb", {}, {"train": {"optimizer_state": "per_client"}}),
    # DoRA: a private magnitude in the client store, a merge in aggregate, a merge after it with private factors
    "fedsa_lora_dora": ("fedsa_lora", {}, {"lora": {"use_dora": True}, "train": {"optimizer_state": "per_client"}}),
    "flora_dora": ("flora", {"client_ranks": [2, 4, 1]}, {"lora": {"use_dora": True}}),
    "flexlora_dora": ("flexlora", {"client_ranks": [4, 2, 1]}, {"lora": {"use_dora": True}}),
    "pfedloru_dora": ("pfedloru", {"tau": 1, "personal_r": 2, "personal_steps": 1, "global_steps": 2},
                      {"lora": {"use_dora": True}, "train": {"optimizer_state": "per_client"}}),
    "pflmf_dora": ("pflmf", {"rank": 3, "eta_u": 0.5}, {"lora": {"use_dora": True}, "train": {"optimizer": "sgd"}}),
    # DoRA with a client's rank pruned under the magnitude's norm weights; Fed-SB's m re-set from B·R·A at init
    "hetlora_dora": ("hetlora", {"client_ranks": [4, 2, 3], "gamma": 0.5, "prune_lambda": 5.0},
                     {"lora": {"use_dora": True}, "train": {"optimizer_state": "per_client"}}),
    "fed_sb_dora": ("fed_sb", {"init_samples": 8}, {"lora": {"use_dora": True}}),
}
FULL: dict = {}


def full_run(case, data_files, tmp_path_factory):
    """The uninterrupted 2-round run of ``case`` (checkpoint every round), run once per session."""
    if case not in FULL:
        strategy, args, sections = CASES[case]
        raw = make_raw(data_files, tmp_path_factory.mktemp(f"full-{case}"), strategy, args,
                       checkpoint={"every": 1}, **sections)
        FULL[case] = run(parse_recipe(raw))
    return FULL[case]


def checkpoint_tensors(run_dir):
    return {part: load_file(str(p)) for part in ("adapter", "base", "strategy", "clients")
            if (p := run_dir / "final" / f"{part}.safetensors").is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_exact(case, data_files, tmp_path_factory, tmp_path, crash_at_round):
    full = full_run(case, data_files, tmp_path_factory)
    strategy, args, sections = CASES[case]
    recipe = parse_recipe(make_raw(data_files, tmp_path / "cut", strategy, args, checkpoint={"every": 1}, **sections))
    resumed = cut_and_resume(recipe, crash_at_round)
    a, b = checkpoint_tensors(full.run_dir), checkpoint_tensors(resumed.run_dir)
    assert a.keys() == b.keys() and "adapter" in a
    for part in a:
        assert a[part].keys() == b[part].keys(), part
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    # the models in memory agree as well (base, residuals, kept factors, hooks)
    wa, wb = effective_weights(full.model), effective_weights(resumed.model)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    full_lines = [json.loads(x) for x in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["client_loss"] for x in lines] == [x["client_loss"] for x in full_lines]
    assert [x["bytes_down"] for x in lines] == [x["bytes_down"] for x in full_lines]


def update_ranks(result):
    """Numerical rank of W̃ − W0 per layer (W0: the same tiny model before any strategy touched it)."""
    w0 = effective_weights(tiny().model)
    final = effective_weights(result.model)
    return {n: numerical_rank(final[n] - w0[n], rtol=1e-3) for n in w0}


def test_the_rank_of_the_learned_update_exceeds_r_only_with_residuals(data_files, tmp_path_factory):
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path_factory.mktemp("fedavg"), "fedavg")))
    assert max(update_ranks(fedavg).values()) <= 4  # FedAvg: W0 + s·BA, rank <= r (seed 001 App. D)
    for case in ("frlora", "fedloru", "fedloru_keep"):
        ranks = update_ranks(full_run(case, data_files, tmp_path_factory))
        assert min(ranks.values()) > 4, (case, ranks)


def test_fedloru_with_tau_beyond_the_rounds_is_fedavg_with_lora(data_files, tmp_path):
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path / "a", "fedavg")))
    fedloru = run(parse_recipe(make_raw(data_files, tmp_path / "b", "fedloru", {"tau": 3})))
    assert fedavg.global_state.keys() == fedloru.global_state.keys()
    assert all(torch.equal(fedavg.global_state[k], fedloru.global_state[k]) for k in fedavg.global_state)
    assert [h["bytes_down"] for h in fedavg.history] == [h["bytes_down"] for h in fedloru.history]


@pytest.mark.parametrize("strategy", ["frlora", "frlora_v3"])
def test_lr_zero_leaves_the_merged_weights_at_w0(strategy, data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", strategy, train={"lr": 0.0, "local_steps": 1},
                   federation={"clients_per_round": 3})
    result = run(parse_recipe(raw))
    w0 = effective_weights(tiny().model)
    final = effective_weights(result.model)
    for name in w0:
        assert torch.allclose(final[name], w0[name], atol=1e-5)


def test_frlora_bytes_include_the_sync_of_non_participants(data_files, tmp_path_factory):
    result = full_run("frlora", data_files, tmp_path_factory)
    lora = sum(v.numel() * 4 for v in result.global_state.values())
    for h in result.history:  # Table 14: participants send and receive, the rest receive (B̄, Ā)
        assert set(h["bytes_up"].values()) == {lora} and len(h["bytes_up"]) == 2
        assert h["bytes_down"] == {str(c): lora for c in range(3)}
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["bytes_down_total"] == 2 * 3 * lora and summary["bytes_up_total"] == 2 * 2 * lora


def test_pfedloru_uploads_only_the_global_adapter_through_the_loop(data_files, tmp_path, monkeypatch):
    seen = record_updates(monkeypatch, FedLoRU)
    raw = make_raw(data_files, tmp_path / "run", "pfedloru", {"personal_r": 2, "personal_steps": 1, "global_steps": 2})
    result = run(parse_recipe(raw))
    global_keys = set(result.global_state)
    assert seen and all(set(u.state) == global_keys for u in seen)
    assert all(not any("pfedloru" in k for k in u.state) for u in seen)
    assert all(u.steps == 3 for u in seen)  # E_per + E_global
    trained = {c for h in result.history for c in h["clients"]}
    assert set(result.clients.clients()) == trained
    assert all(set(result.clients.get(c)) == set(result.strategy.private_keys) for c in trained)
    lora = sum(v.numel() * 4 for v in result.global_state.values())
    assert all(set(h["bytes_up"].values()) == {lora} for h in result.history)


def test_mfedloru_training_keeps_the_nested_padding_at_zero(data_files, tmp_path, monkeypatch):
    checked = []
    original = MFedLoRU.client_upload

    def spy(self, plan, trained, steps):
        rank = self.ranks[plan.client_id]
        if self.nested(plan.client_id):
            for key in self.nested_keys:
                value = trained[key]
                pad = value[:, rank:] if key.endswith("down") else value[rank:]
                active = value[:, :rank] if key.endswith("down") else value[:rank]
                assert torch.count_nonzero(pad) == 0 and torch.count_nonzero(active) > 0
            checked.append(plan.client_id)
        return original(self, plan, trained, steps)

    monkeypatch.setattr(MFedLoRU, "client_upload", spy)
    raw = make_raw(data_files, tmp_path / "run", "mfedloru", {"client_ranks": [2, 1, 4]},
                   federation={"clients_per_round": 3, "rounds": 1})
    result = run(parse_recipe(raw))
    assert sorted(checked) == [0, 1]
    h = result.history[0]
    assert h["bytes_up"]["0"] < h["bytes_up"]["2"] and h["bytes_up"]["1"] < h["bytes_up"]["0"]


@pytest.mark.parametrize("case", ["frlora", "frlora_v3", "fedloru", "fedloru_keep", "pfedloru", "mfedloru",
                                  "fedlora_pfl", "fedlora_pfl_lora_sim", "pflmf", "local", "scaffold", "fedadam",
                                  "ffa_lora", "flexlora", "flora", "fedex_lora", "fedsa_lora",
                                  "hetlora", "rolora", "lora_fair"])
def test_a_checkpoint_rebuilds_the_trained_model_for_inference(case, data_files, tmp_path_factory):
    from fedllm.export.inference import model_from_checkpoint
    from fedllm.models.loading import read_state, write_state

    full = full_run(case, data_files, tmp_path_factory)
    model, _, _, _ = model_from_checkpoint(full.run_dir)
    trained, rebuilt = effective_weights(full.model), effective_weights(model)
    assert all(torch.equal(trained[n], rebuilt[n]) for n in trained)
    if full.strategy.personalized:  # a client's personal model: the global model plus its private part
        client = min(full.clients.clients())
        personal_model, _, _, _ = model_from_checkpoint(full.run_dir, client=client)
        private = full.strategy.personal_state(client, full.clients.get(client))
        saved = read_state(full.model, private.keys())
        write_state(full.model, private)
        try:
            expected = effective_weights(full.model)
        finally:
            write_state(full.model, saved)
        got = effective_weights(personal_model)
        assert all(torch.equal(expected[n], got[n]) for n in expected)
        assert any(not torch.equal(expected[n], trained[n]) for n in expected)


def test_private_factors_reach_the_client_unrounded_under_a_bf16_wire(data_files, tmp_path, monkeypatch):
    from fedllm.engine import client as client_module

    loaded, stores = [], []
    original = client_module.train_client
    original_run = client_module.run_client

    def run_spy(model, plan, strategy, store, *args, **kwargs):
        stores.append(store)
        return original_run(model, plan, strategy, store, *args, **kwargs)

    def spy(model, plan, strategy, *args, **kwargs):
        stored_now = stores[-1].get(plan.client_id)
        if stored_now:  # trained before: it must get back exactly what it kept
            loaded.append(all(torch.equal(plan.local[k], stored_now[k]) for k in stored_now))
        return original(model, plan, strategy, *args, **kwargs)

    monkeypatch.setattr(client_module, "train_client", spy)
    monkeypatch.setattr("fedllm.engine.server.run_client", run_spy)
    raw = make_raw(data_files, tmp_path / "run", "pfedloru", {"personal_r": 2, "personal_steps": 1},
                   federation={"comm_dtype": "bf16", "clients_per_round": 3})
    result = run(parse_recipe(raw))
    assert loaded and all(loaded)
    private = result.clients.get(0)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in private.values())
