"""FedSA-LoRA: A is averaged, every client's B stays with it (never uploaded, never downloaded)."""

import torch
from strategy_helpers import effective_weights, fake_round, make_raw, make_strategy, tiny

from fedllm.engine.server import run
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.runs.client_store import ClientStore
from fedllm.strategies.fedavg import FedAvg

SIZES = {0: 10, 1: 20, 2: 30}


def test_b_never_travels_and_a_is_the_weighted_mean():
    model = tiny().model
    strategy = make_strategy("fedsa_lora", model)
    state = read_state(model, strategy.global_keys(model))
    store = ClientStore()
    b_keys = {layer.b_key for layer in strategy.layers.values()}
    kept = {}
    for rnd, sampled in ((1, [0, 1]), (2, [1, 2])):
        plans = {c: strategy.configure_client(rnd, c, state) for c in sampled}
        assert all(not (set(p.state) & b_keys) for p in plans.values())  # nothing of B is downloaded
        for c, plan in plans.items():  # each client trains from the B it kept (zero the first time)
            plan.client_state = store.get(c)
            strategy.open_client(plan)
            assert set(plan.local) == b_keys
            assert all(torch.equal(plan.local[k], kept[c][k]) if c in kept else torch.count_nonzero(v) == 0
                       for k, v in plan.local.items())
        state, uploads = fake_round(strategy, model, state, rnd, sampled, sizes=SIZES, store=store)
        for c in sampled:
            assert set(uploads[c]) == set(plans[c].state) and not (set(uploads[c]) & b_keys)
            kept[c] = store.get(c)
            assert set(kept[c]) == b_keys and all(torch.count_nonzero(v) for v in kept[c].values())
        total = sum(SIZES[c] for c in sampled)
        for layer in strategy.layers.values():
            mean = sum(SIZES[c] / total * uploads[c][layer.a_key] for c in sampled)
            assert torch.allclose(state[layer.a_key], mean, atol=1e-7)
            assert torch.count_nonzero(state[layer.b_key]) == 0  # the global model has no client's B
    # personal model of client 2: W + s·B_2·Ā
    personal = strategy.personal_state(2, store.get(2))
    write_state(model, {**state, **personal})
    got = effective_weights(model)
    write_state(model, state)
    base = effective_weights(model)
    for name, layer in strategy.layers.items():
        expected = layer.scale * store.get(2)[layer.b_key] @ state[layer.a_key]
        assert torch.allclose(got[name] - base[name], expected, atol=1e-6)


def test_through_the_loop_uploads_and_downloads_hold_no_b(data_files, tmp_path, monkeypatch):
    seen = []
    original = FedAvg.aggregate

    def spy(self, rnd, global_state, updates):
        seen.extend(updates)
        return original(self, rnd, global_state, updates)

    monkeypatch.setattr(FedAvg, "aggregate", spy)
    raw = make_raw(data_files, tmp_path / "run", "fedsa_lora")
    result = run(parse_recipe(raw))
    assert seen and all(not any("lora_B" in k for k in u.state) for u in seen)
    a_bytes = sum(v.numel() * 4 for k, v in result.global_state.items() if "lora_A" in k)
    assert all(set(h["bytes_up"].values()) == {a_bytes} and set(h["bytes_down"].values()) == {a_bytes}
               for h in result.history)
    trained = {c for h in result.history for c in h["clients"]}
    assert set(result.clients.clients()) == trained
