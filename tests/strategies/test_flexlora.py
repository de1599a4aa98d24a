"""FlexLoRA: the global update is the example-weighted mean of the clients' products, and each client
receives the best rank-r_k approximation of that same mean (checked against a dense SVD)."""

import pytest
import torch
from strategy_helpers import effective_weights, fake_round, make_raw, make_strategy, tiny

from fedllm.common.errors import InputError
from fedllm.engine.server import run
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError
from fedllm.strategies import ClientUpdate
from fedllm.strategies.client_ranks import assign_ranks
from fedllm.strategies.flexlora import FlexLoRA

R, ALPHA = 8, 16
SIZES = {0: 10, 1: 20, 2: 30}


def best_rank_k(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """Eckart–Young: the best rank-k approximation of ``matrix`` (dense float64 SVD)."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


def setup_round(ranks, sizes=SIZES):
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy("flexlora", model, client_ranks=ranks)
    w0 = effective_weights(model)
    state = read_state(model, strategy.global_keys(model))
    state, uploads = fake_round(strategy, model, state, 1, [0, 1, 2], sizes=sizes)
    return model, strategy, w0, state, uploads


def test_uploads_hold_each_clients_rank_and_the_global_model_is_the_weighted_mean_of_products():
    ranks = [2, 4, 8]
    model, strategy, w0, _, uploads = setup_round(ranks)
    total = sum(SIZES.values())
    now = effective_weights(model)
    s = ALPHA / R
    for name, layer in strategy.layers.items():
        for cid, rank in enumerate(ranks):
            assert uploads[cid][layer.a_key].shape == (rank, layer.shape[1])
            assert uploads[cid][layer.b_key].shape == (layer.shape[0], rank)
        mean = sum(SIZES[c] / total * s * (uploads[c][layer.b_key] @ uploads[c][layer.a_key]) for c in range(3))
        assert torch.allclose(now[name] - w0[name], mean, atol=1e-6)
        assert torch.linalg.matrix_rank(mean.double(), rtol=1e-6) > R  # more than any one client could hold


def test_each_client_receives_the_rank_k_truncation_of_the_same_average():
    ranks = [2, 4, 8]
    model, strategy, w0, state, _ = setup_round(ranks)
    average = {n: effective_weights(model)[n] - w0[n] for n in w0}
    s = ALPHA / R
    for cid, rank in enumerate(ranks):
        plan = strategy.configure_client(2, cid, state)
        for name, layer in strategy.layers.items():
            b, a = plan.state[layer.b_key], plan.state[layer.a_key]
            assert b.shape == (layer.shape[0], rank) and a.shape == (rank, layer.shape[1])  # what travels
            expected = best_rank_k(average[name], rank)
            assert torch.allclose(s * (b.double() @ a.double()), expected, atol=1e-5), (cid, name)


def test_equal_ranks_and_identical_clients_equal_fedavg_of_the_products():
    model = tiny(r=R, alpha=ALPHA).model
    twin = tiny(r=R, alpha=ALPHA).model
    flex = make_strategy("flexlora", model, client_ranks=[R, R, R])
    fedavg = make_strategy("fedavg", twin)
    state = read_state(model, flex.global_keys(model))
    gen = torch.Generator().manual_seed(7)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    updates = [ClientUpdate(c, dict(trained), 10 + 5 * c, 0.0, 1) for c in range(3)]
    write_state(model, flex.aggregate(1, state, updates))
    write_state(twin, fedavg.aggregate(1, state, updates))
    got, expected = effective_weights(model), effective_weights(twin)
    assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in got)
    # a full-rank client gets back factors whose product is that same update
    plan = flex.configure_client(2, 0, read_state(model, flex.global_keys(model)))
    for layer in flex.layers.values():
        handed = plan.state[layer.b_key] @ plan.state[layer.a_key]
        assert torch.allclose(handed, trained[layer.b_key] @ trained[layer.a_key], atol=1e-5)


def test_a_training_client_sees_only_its_own_factors():
    model, strategy, w0, state, _ = setup_round([2, 4, 8])
    plan = strategy.configure_client(2, 0, state)
    strategy.open_client(plan)  # client side: pads to R (into plan.local) and switches the global update off
    loaded = {**plan.state, **plan.local}  # what the engine writes (client.run_client)
    write_state(model, loaded)
    assert loaded[next(iter(strategy.layers.values())).a_key].shape[0] == R
    assert plan.state[next(iter(strategy.layers.values())).a_key].shape[0] == 2  # as it arrived
    now = effective_weights(model)
    s = ALPHA / R
    for name, layer in strategy.layers.items():
        expected = s * loaded[layer.b_key] @ loaded[layer.a_key]
        assert torch.allclose(now[name] - w0[name], expected, atol=1e-6)


def test_a_client_ranked_above_the_update_gets_fresh_trainable_rows():
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy("flexlora", model, client_ranks=[1, 8, 8])
    state = read_state(model, strategy.global_keys(model))
    state, _ = fake_round(strategy, model, state, 1, [0])  # ΔW has rank 1
    plan = strategy.configure_client(2, 1, state)
    for layer in strategy.layers.values():
        a, b = plan.state[layer.a_key], plan.state[layer.b_key]
        assert torch.count_nonzero(b[:, 1:]) == 0 and torch.count_nonzero(a[1:]) == a[1:].numel()


def test_named_distributions_assign_the_levels_in_their_proportions():
    ranks = assign_ranks("heavy_tail_strong", 10, 16, seed=3)
    assert sorted(ranks) == [2, 4, 8] + [16] * 7
    assert ranks == assign_ranks("heavy_tail_strong", 10, 16, seed=3)  # seeded: every process agrees
    assert sorted(assign_ranks("uniform", 5, 16)) == [2, 2, 4, 8, 16]
    assert sorted(assign_ranks("normal", 10, 16, levels=[1, 2, 3, 4])) == [1] + [2] * 4 + [3] * 4 + [4]
    with pytest.raises(InputError, match="client_ranks: got 2 ranks for 3 clients"):
        assign_ranks([4, 4], 3, 8)
    with pytest.raises(InputError, match="above lora.r=8"):
        assign_ranks([4, 16, 4], 3, 8)


def test_bad_rank_arguments_are_recipe_errors(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "flexlora", {"client_ranks": "heavy", "rank_levels": [1, 2]})
    with pytest.raises(RecipeError) as err:
        parse_recipe(raw)
    assert "federation.strategy_args.client_ranks" in str(err.value) and "heavy_tail_light" in str(err.value)
    assert "federation.strategy_args.rank_levels" in str(err.value)


def test_training_through_the_loop_keeps_the_padding_at_zero_and_counts_rank_bytes(data_files, tmp_path,
                                                                                    monkeypatch):
    checked = []
    original = FlexLoRA.client_upload

    def spy(self, plan, trained, steps):
        rank = self.ranks[plan.client_id]
        for layer in self.layers.values():
            assert torch.count_nonzero(trained[layer.a_key][rank:]) == 0
            assert torch.count_nonzero(trained[layer.b_key][:, rank:]) == 0
        checked.append(plan.client_id)
        return original(self, plan, trained, steps)

    monkeypatch.setattr(FlexLoRA, "client_upload", spy)
    raw = make_raw(data_files, tmp_path / "run", "flexlora", {"client_ranks": [4, 2, 1]},
                   federation={"clients_per_round": 3})
    result = run(parse_recipe(raw))
    assert sorted(checked) == [0, 0, 1, 1, 2, 2]
    for h in result.history:
        up, down = h["bytes_up"], h["bytes_down"]
        assert up == down and up["0"] == 2 * up["1"] == 4 * up["2"]
