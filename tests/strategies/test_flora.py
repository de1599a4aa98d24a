"""FLoRA: the merged weight is W + Σ_k p_k s·B_k A_k for clients of any rank, and every round restarts
from a fresh LoRA init."""

import pytest
import torch
from strategy_helpers import base_weight_keys, effective_weights, fake_round, make_raw, make_strategy, tiny

from fedllm.engine.server import run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe

R, ALPHA = 4, 8
SIZES = {0: 10, 1: 20, 2: 30}
RANKS = [4, 2, 1]


def test_merged_weight_is_the_weighted_sum_of_every_clients_product():
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy("flora", model, client_ranks=RANKS)
    state = read_state(model, strategy.global_keys(model))
    bases = base_weight_keys(model)
    w_prev = {n: v.clone() for n, v in read_state(model, bases.values()).items()}
    for rnd in (1, 2):
        state, uploads = fake_round(strategy, model, state, rnd, [0, 1, 2], sizes=SIZES)
        total = sum(SIZES.values())
        now = read_state(model, bases.values())
        for name, layer in strategy.layers.items():
            for cid, rank in enumerate(RANKS):  # a client of another rank works: it sends its own rank
                assert uploads[cid][layer.a_key].shape == (rank, layer.shape[1])
            stacked = sum(SIZES[c] / total * (ALPHA / R) * uploads[c][layer.b_key] @ uploads[c][layer.a_key]
                          for c in range(3))
            assert torch.allclose(now[bases[name]], w_prev[bases[name]] + stacked, atol=1e-6)
            # fresh init: B = 0 (the model computes its merged base) and A re-drawn each round
            assert torch.count_nonzero(state[layer.b_key]) == 0
            assert torch.count_nonzero(state[layer.a_key]) == state[layer.a_key].numel()
        w_prev = {k: v.clone() for k, v in now.items()}
    assert all(torch.equal(effective_weights(model)[n], read_state(model, [bases[n]])[bases[n]])
               for n in bases)


def test_the_adapter_is_redrawn_differently_each_round():
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy("flora", model, client_ranks=RANKS)
    state = read_state(model, strategy.global_keys(model))
    after1, _ = fake_round(strategy, model, state, 1, [0, 1])
    after2, _ = fake_round(strategy, model, after1, 2, [0, 1])
    a_keys = [layer.a_key for layer in strategy.layers.values()]
    assert all(not torch.equal(after1[k], after2[k]) and not torch.equal(state[k], after1[k]) for k in a_keys)


def test_dense_residual_gives_the_same_model_as_merging():
    models, strategies = [], []
    for mode in ("merge", "dense"):
        model = tiny(r=R, alpha=ALPHA).model
        strategy = make_strategy("flora", model, client_ranks=RANKS, residual=mode)
        state = read_state(model, strategy.global_keys(model))
        fake_round(strategy, model, state, 1, [0, 2], sizes=SIZES)
        models.append(effective_weights(model))
        strategies.append(strategy)
    assert strategies[0].modifies_base and not strategies[1].modifies_base and strategies[1].base_residuals()
    assert all(torch.allclose(models[0][n], models[1][n], atol=1e-6) for n in models[0])


def test_every_client_receives_the_stack_and_participants_their_rank(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "flora", {"client_ranks": [2, 4, 1]}, lora={"r": 4, "alpha": 8})
    result = run(parse_recipe(raw))
    layers = result.strategy.layers.values()
    per_rank = sum(4 * (layer.shape[0] + layer.shape[1]) for layer in layers)  # fp32 bytes of one rank
    for h in result.history:
        stack = sum([2, 4, 1][c] for c in h["clients"])
        assert h["bytes_up"] == {str(c): [2, 4, 1][c] * per_rank for c in h["clients"]}
        assert h["bytes_down"] == {str(c): stack * per_rank + ([2, 4, 1][c] * per_rank if c in h["clients"] else 0)
                                   for c in range(3)}


@pytest.mark.parametrize("name", ["flora", "flexlora"])
def test_per_client_moments_of_the_handed_out_factors_are_dropped(name):
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy(name, model, client_ranks=RANKS)
    layer = next(iter(strategy.layers.values()))
    kept_key = "some.head.weight"  # any key the strategy never re-initialises
    moments = {f"{layer.a_key}::exp_avg": torch.ones(1), f"{layer.b_key}::exp_avg_sq": torch.ones(1),
               f"{kept_key}::exp_avg": torch.ones(1)}
    assert set(strategy.client_optimizer_state(2, 0, moments)) == {f"{kept_key}::exp_avg"}
    assert strategy.client_optimizer_state(2, 0, None) is None
