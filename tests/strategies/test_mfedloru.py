"""mFedLoRU (seed 003, Alg. 3): nested per-client ranks rebuilt into rank-r factors on the server."""

import pytest
import torch
from strategy_helpers import effective_weights, make_strategy, tiny

from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError
from fedllm.strategies import ClientUpdate

S, NESTED = 8 / 4, 0.5
RANKS = [4, 2, 1]  # client 0 trains the rank-4 adapter itself, clients 1 and 2 nest at ranks 2 and 1


def parts(strategy, trained, name):
    return {p: trained[f"{name}.mfedloru.{p}"] for p in ("a_down", "a_up", "b_down", "b_up")}


def test_nested_products_start_at_zero_and_compute_the_rebuilt_factors():
    model = tiny().model
    strategy = make_strategy("mfedloru", model, client_ranks=RANKS, nested_scale=NESTED)
    state = read_state(model, strategy.global_keys(model))
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}  # a nonzero global adapter
    write_state(model, state)
    global_weights = effective_weights(model)
    plan = strategy.configure_client(3, 1, state)
    assert set(plan.state) == set(state) and set(plan.local) == set(strategy.nested_keys)  # drawn by the client
    write_state(model, {**plan.state, **plan.local})
    assert all(torch.allclose(effective_weights(model)[n], w, atol=1e-7) for n, w in global_weights.items())
    assert set(plan.phases[0].keys) == set(strategy.nested_keys)
    # "train": move the nested factors; the model then computes s·(B + α·Bd Bu)(A + α·Ad Au)
    trained = {**plan.state, **plan.local}
    for k in strategy.nested_keys:  # within rank r_k = 2 (training leaves the zero padding at zero)
        block = (slice(None), slice(0, 2)) if k.endswith("down") else (slice(0, 2),)
        trained[k] = plan.local[k].clone()
        trained[k][block] += 0.05 * torch.randn_like(trained[k][block])
    write_state(model, trained)
    upload = strategy.client_upload(plan, trained, 1)
    weights = effective_weights(model)
    rebuilt = strategy.rebuild(state, ClientUpdate(1, upload, 10, 0.0, 1)).state
    for name, layer in strategy.layers.items():
        p = parts(strategy, upload, name)
        out, inn = layer.shape
        assert [tuple(p[x].shape) for x in p] == [(4, 2), (2, inn), (out, 2), (2, 4)]
        a = state[layer.a_key] + NESTED * p["a_down"] @ p["a_up"]
        b = state[layer.b_key] + NESTED * p["b_down"] @ p["b_up"]
        assert torch.allclose(rebuilt[layer.a_key], a, atol=1e-7) and torch.allclose(rebuilt[layer.b_key], b, atol=1e-7)
        # padding beyond r_k = 2 is zero on both sides, so the forward pass used exactly rank-2 nesting
        assert torch.allclose(weights[name], layer.base.weight + S * b @ a, atol=1e-6)


def test_uploads_and_aggregate():
    model = tiny().model
    strategy = make_strategy("mfedloru", model, client_ranks=RANKS)
    state = read_state(model, strategy.global_keys(model))
    updates, expected = [], {}
    for cid, n in zip((0, 2), (30, 10), strict=True):
        plan = strategy.configure_client(1, cid, state)
        assert strategy.download_bytes(plan, "fp32") == sum(v.numel() * 4 for v in state.values())
        trained = {k: v + 0.01 * torch.randn_like(v) for k, v in {**plan.state, **plan.local}.items()}
        upload = strategy.client_upload(plan, trained, 1)
        lora_numel = {name: (layer.rank * (layer.shape[1] + layer.shape[0])) for name, layer in strategy.layers.items()}
        if cid == 0:  # full-rank client: sends (A, B)
            assert set(upload) == set(state)
        else:  # rank-1 client: r_k·(r + in) + r_k·(out + r) per layer instead of r·(in + out)
            numel = sum(v.numel() for v in upload.values())
            assert numel == sum(1 * (layer.rank + layer.shape[1]) + 1 * (layer.shape[0] + layer.rank)
                                for layer in strategy.layers.values())
            assert numel < sum(lora_numel.values())
        updates.append(ClientUpdate(cid, upload, n, 0.0, 1))
        expected[cid] = strategy.rebuild(state, updates[-1]).state
    new = strategy.aggregate(1, state, updates)
    for k in state:
        assert torch.allclose(new[k], 0.75 * expected[0][k] + 0.25 * expected[2][k], atol=1e-7)
    strategy.after_aggregate(1, model, new)
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "mfedloru" in n)


def test_client_ranks_are_validated():
    raw = {"data": {"path": "x"}, "train": {"local_steps": 1},
           "federation": {"strategy": "mfedloru", "strategy_args": {"client_ranks": [4, 0, "x"]}}}
    with pytest.raises(RecipeError, match="client_ranks"):
        parse_recipe(raw)
    with pytest.raises(Exception, match="one per client"):
        make_strategy("mfedloru", tiny().model, client_ranks=[4, 2])
