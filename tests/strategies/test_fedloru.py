"""FedLoRU (seed 003, Alg. 1, C.1, D.2) against independent computations."""

import pytest
import torch
from strategy_helpers import base_weight_keys, effective_weights, fake_round, make_strategy, tiny

from fedllm.models.loading import read_state
from fedllm.models.state import num_bytes

S = 8 / 4


def factor_keys(strategy):
    return {n: (layer.b_key, layer.a_key) for n, layer in strategy.layers.items()}


@pytest.mark.parametrize("accumulate", ["merge", "keep"])
def test_accumulation_counts_every_update_once(accumulate):
    model = tiny().model
    w0 = effective_weights(model)
    base0 = read_state(model, base_weight_keys(model).values())
    strategy = make_strategy("fedloru", model, tau=2, accumulate=accumulate)
    state = read_state(model, strategy.global_keys(model))
    kept = {n: torch.zeros_like(w) for n, w in w0.items()}
    expected_pieces = {n: [] for n in w0}
    for rnd in (1, 2, 3, 4, 5):
        state, uploads = fake_round(strategy, model, state, rnd, [0, 1], noise=2e-2)
        for name, (b_key, a_key) in factor_keys(strategy).items():
            b_bar = (uploads[0][b_key] + uploads[1][b_key]) / 2  # equal example counts: p_k = 1/2
            a_bar = (uploads[0][a_key] + uploads[1][a_key]) / 2
            if rnd % 2 == 0:  # W ← W + s·B_t A_t, then the adapter's product is zero again
                kept[name] += S * b_bar @ a_bar
                expected_pieces[name].append((b_bar, a_bar))
                assert torch.count_nonzero(state[b_key]) == 0
            current = S * state[b_key] @ state[a_key]
            assert torch.allclose(effective_weights(model)[name], w0[name] + kept[name] + current, atol=2e-6)
    pieces = strategy.kept_factors()
    for name, expected in expected_pieces.items():
        assert len(pieces[name]) == 2
        for (b, a, s), (eb, ea) in zip(pieces[name], expected, strict=True):
            assert s == S and torch.allclose(b, eb, atol=1e-7) and torch.allclose(a, ea, atol=1e-7)
    now = read_state(model, base_weight_keys(model).values())
    params_moved = any(not torch.equal(now[k], base0[k]) for k in base0)
    assert strategy.kept_in_base is (accumulate == "merge") and params_moved is (accumulate == "merge")
    assert strategy.modifies_base is (accumulate == "merge")


@pytest.mark.parametrize("reinit", ["random", "momentum"])
def test_reinit_modes_and_stale_optimizer_moments(reinit):
    model = tiny().model
    strategy = make_strategy("fedloru", model, tau=1, reinit=reinit)
    state = read_state(model, strategy.global_keys(model))
    aggregated, uploads = fake_round(strategy, model, state, 1, [0, 1], noise=2e-2)
    b_keys = [b for b, _ in factor_keys(strategy).values()]
    a_keys = [a for _, a in factor_keys(strategy).values()]
    assert all(torch.count_nonzero(aggregated[k]) == 0 for k in b_keys)
    for k in a_keys:  # momentum keeps the learned A (the average); random draws a new one
        learned = (uploads[0][k] + uploads[1][k]) / 2
        assert torch.allclose(aggregated[k], learned, atol=1e-7) is (reinit == "momentum")
        assert torch.count_nonzero(aggregated[k]) == aggregated[k].numel()
    moments = {f"{k}::exp_avg": torch.ones(1) for k in a_keys + b_keys}
    moments["classifier::exp_avg"] = torch.ones(1)
    filtered = strategy.client_optimizer_state(2, 0, moments)  # client 0 trained in round 1, before the reinit
    dropped = {k.split("::")[0] for k in moments} - {k.split("::")[0] for k in filtered}
    assert dropped == set(b_keys) | (set(a_keys) if reinit == "random" else set())
    assert strategy.client_optimizer_state(2, 2, None) is None
    strategy2 = make_strategy("fedloru", tiny().model, tau=3, reinit=reinit)
    strategy2.last_round[0] = 1  # no accumulation between round 1 and round 2: nothing is stale
    assert strategy2.client_optimizer_state(2, 0, moments) == moments


def test_momentum_literal_keeps_both_factors_and_counts_the_product_twice():
    """Seed 003 D.2 as written: the momentum variant keeps the previous matrices, while Alg. 1 still adds
    s·B_t A_t to W, so right after the accumulation the model computes W + 2·s·B_t A_t."""
    model = tiny().model
    w0 = effective_weights(model)
    strategy = make_strategy("fedloru", model, tau=1, reinit="momentum_literal")
    state = read_state(model, strategy.global_keys(model))
    aggregated, uploads = fake_round(strategy, model, state, 1, [0, 1], noise=2e-2)
    after = effective_weights(model)
    for name, (b_key, a_key) in factor_keys(strategy).items():
        b_bar = (uploads[0][b_key] + uploads[1][b_key]) / 2
        a_bar = (uploads[0][a_key] + uploads[1][a_key]) / 2
        assert torch.allclose(aggregated[b_key], b_bar, atol=1e-7) and torch.allclose(aggregated[a_key], a_bar, atol=1e-7)
        assert torch.count_nonzero(b_bar) > 0
        assert torch.allclose(after[name], w0[name] + 2 * S * b_bar @ a_bar, atol=2e-6)
    assert strategy.reinitialised_keys() == []
    moments = {f"{k}::exp_avg": torch.ones(1) for k in aggregated}
    assert strategy.client_optimizer_state(2, 0, moments) == moments       # nothing re-initialised, nothing dropped


def test_random_reinit_is_seeded_alike_on_every_client():
    states = []
    for _ in range(2):
        model = tiny().model
        strategy = make_strategy("fedloru", model, tau=1)
        state = read_state(model, strategy.global_keys(model))
        states.append(fake_round(strategy, model, state, 1, [0, 2])[0])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_every_client_receives_the_factors_at_an_accumulation():
    model = tiny().model
    strategy = make_strategy("fedloru", model, tau=3, num_clients=5)
    lora = num_bytes(read_state(model, strategy.global_keys(model)), "fp32")
    assert strategy.extra_download_bytes(2, [0, 1], 5, "fp32") == {}
    assert strategy.extra_download_bytes(3, [0, 1], 5, "fp32") == {c: lora for c in range(5)}
    assert strategy.extra_download_bytes(6, [4], 5, "bf16") == {c: lora // 2 for c in range(5)}


def test_plug_and_play_state_round_trips_and_computes_after_a_reload():
    model = tiny().model
    strategy = make_strategy("fedloru", model, tau=1, accumulate="keep")
    state = read_state(model, strategy.global_keys(model))
    for rnd in (1, 2):
        state, _ = fake_round(strategy, model, state, rnd, [0, 1], noise=2e-2)
    weights = effective_weights(model)
    saved = strategy.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    fresh_model = tiny().model
    fresh = make_strategy("fedloru", fresh_model, tau=1, accumulate="keep")
    fresh.load_state_dict(saved)
    from fedllm.models.loading import write_state

    write_state(fresh_model, state)
    again = effective_weights(fresh_model)
    assert all(torch.equal(weights[n], again[n]) for n in weights)


def test_when_each_client_last_trained_survives_a_checkpoint():
    model = tiny().model
    strategy = make_strategy("fedloru", model, tau=2)
    state = read_state(model, strategy.global_keys(model))
    for rnd, sampled in ((1, [0, 1]), (2, [0, 1]), (3, [2, 1])):
        state, _ = fake_round(strategy, model, state, rnd, sampled)
    fresh = make_strategy("fedloru", tiny().model, tau=2)
    fresh.load_state_dict(strategy.state_dict())
    moments = {f"{k}::exp_avg": torch.ones(1) for k in state}
    for cid, stale in ((0, True), (1, False), (2, False)):  # client 0 last trained before round 2's reinit
        kept = strategy.client_optimizer_state(4, cid, moments)
        assert (kept != moments) is stale
        assert fresh.client_optimizer_state(4, cid, moments) == kept
