"""pFedLoRU (seed 003, Alg. 2): private adapters that never leave the client."""

import torch
from strategy_helpers import effective_weights, fake_round, make_strategy, tiny

from fedllm.models.loading import read_state, write_state
from fedllm.models.state import num_bytes
from fedllm.runs.client_store import ClientStore

S, SP = 8 / 4, 4 / 2


def test_phases_upload_and_private_state():
    model = tiny().model
    strategy = make_strategy("pfedloru", model, personal_r=2, personal_alpha=4.0, personal_steps=3, global_steps=5)
    global_keys = strategy.global_keys(model)
    assert not any("pfedloru" in k for k in global_keys)
    state = read_state(model, global_keys)
    plan = strategy.configure_client(1, 1, state)
    assert [(p.name, p.steps) for p in plan.phases] == [("personal", 3), ("global", 5)]
    assert set(plan.phases[0].keys) == set(strategy.private_keys) and set(plan.phases[1].keys) == set(global_keys)
    assert set(plan.state) == set(global_keys) and not plan.local
    strategy.open_client(plan)  # client side: its private factors come from its stored entry
    assert set(plan.local) == set(strategy.private_keys)
    assert strategy.download_bytes(plan, "fp32") == num_bytes(state, "fp32")
    store = ClientStore()
    initial = strategy.personal_state(1, store.get(1))
    assert all(torch.count_nonzero(v) == 0 for k, v in initial.items() if k.endswith(".L"))
    new, uploads = fake_round(strategy, model, state, 1, [0, 1], store=store)
    for upload in uploads.values():  # the private factors never leave the client
        assert set(upload) == set(global_keys)
    assert store.clients() == [0, 1] and set(store.get(1)) == set(strategy.private_keys)
    assert strategy.state_dict().keys().isdisjoint(strategy.private_keys)  # not server state
    trained = strategy.personal_state(1, store.get(1))
    assert all(not torch.equal(trained[k], initial[k]) for k in trained)
    untrained = strategy.personal_state(2, store.get(2))  # client 2 sat out: its seeded initial factors
    assert all(torch.equal(strategy.personal_state(2, {})[k], v) for k, v in untrained.items())
    # the global model holds no client's private part; a personal model adds s_p·L U
    glob = effective_weights(model)
    for name, layer in strategy.layers.items():
        assert torch.allclose(glob[name] - layer.base.weight, S * new[layer.b_key] @ new[layer.a_key], atol=1e-6)
    write_state(model, trained)
    personal = effective_weights(model)
    for name, layer in strategy.layers.items():
        l, u = trained[f"{name}.pfedloru.L"], trained[f"{name}.pfedloru.U"]
        assert torch.allclose(personal[name] - glob[name], SP * l @ u, atol=1e-6)


def test_private_states_are_checkpointed_and_restored():
    model = tiny().model
    strategy = make_strategy("pfedloru", model, personal_r=2, tau=1)
    state = read_state(model, strategy.global_keys(model))
    store = ClientStore()
    state, _ = fake_round(strategy, model, state, 1, [0, 2], store=store)
    flat = store.flat()
    assert {k.split("/")[0] for k in flat} == {"client0", "client2"}
    other = make_strategy("pfedloru", tiny().model, personal_r=2, tau=1)
    other.load_state_dict(strategy.state_dict())
    restored = ClientStore.from_flat(flat)
    for cid in (0, 1, 2):
        a, b = strategy.personal_state(cid, store.get(cid)), other.personal_state(cid, restored.get(cid))
        assert all(torch.equal(a[k], b[k]) for k in a)
