"""HetLoRA: each client receives the global adapter truncated to its rank, self-prunes its last ranks when their
norm shrank during training, and the server zero-pads the uploads and averages them with weights ∝ ||B_k A_k||_F.
Replayed by hand from what the clients received, trained and uploaded (recorded through the real round loop)."""

import math

import pytest
import torch
from strategy_helpers import assert_recipe_refuses, make_raw, make_strategy, record_rounds, tiny

from fedllm.engine.server import run
from fedllm.models.loading import write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientUpdate
from fedllm.strategies.hetlora import HetLoRA

R, GAMMA, LAM = 4, 0.5, 5.0
RANKS = [4, 2, 3]


def tail(b, a, keep, rank):
    return float(b[:, keep:rank].norm() * a[keep:rank].norm())


@pytest.fixture(scope="module")
def recorded(data_files, tmp_path_factory):
    plans, uploads = [], []
    with pytest.MonkeyPatch.context() as patch:
        original_configure, original_upload = HetLoRA.configure_client, HetLoRA.client_upload

        def configure_spy(self, rnd, client_id, global_state):
            plan = original_configure(self, rnd, client_id, global_state)
            plans.append((rnd, client_id, {k: v.clone() for k, v in global_state.items()}, dict(plan.extra),
                          {k: v.clone() for k, v in plan.state.items()}))
            return plan

        def upload_spy(self, plan, trained, steps):
            up = original_upload(self, plan, trained, steps)
            if not any(v.is_meta for v in trained.values()):
                uploads.append((plan.rnd, plan.client_id, int(plan.extra["rank"]),
                                {k: v.clone() for k, v in plan.state.items()},
                                {k: v.clone() for k, v in trained.items()}, up))
            return up

        patch.setattr(HetLoRA, "configure_client", configure_spy)
        patch.setattr(HetLoRA, "client_upload", upload_spy)
        rounds = record_rounds(patch, HetLoRA)
        raw = make_raw(data_files, tmp_path_factory.mktemp("hetlora"), "hetlora",
                       {"client_ranks": RANKS, "gamma": GAMMA, "prune_lambda": LAM},
                       federation={"clients_per_round": 3, "rounds": 3})
        result = run(parse_recipe(raw))
    return result, plans, uploads, rounds


def test_hetlora_replay_of_the_sparsity_weighted_zero_padded_aggregation(recorded):
    result, _, _, rounds = recorded
    assert len(rounds) == 3
    for rnd, before, updates, after in rounds:
        for layer in result.strategy.layers.values():
            products = [u.state[layer.b_key].double() @ u.state[layer.a_key].double() for u in updates]
            norms = [float(torch.linalg.matrix_norm(p)) for p in products]  # ||ΔW_k||_F of the dense product
            p = [n / sum(norms) for n in norms]
            b_bar = torch.zeros(layer.shape[0], R, dtype=torch.float64)
            a_bar = torch.zeros(R, layer.shape[1], dtype=torch.float64)
            for pk, u in zip(p, updates, strict=True):
                rank = u.state[layer.a_key].shape[0]
                b_bar[:, :rank] += pk * u.state[layer.b_key].double()
                a_bar[:rank] += pk * u.state[layer.a_key].double()
            assert (after[layer.b_key].double() - b_bar).abs().max() <= 1e-6, (rnd, layer.name)
            assert (after[layer.a_key].double() - a_bar).abs().max() <= 1e-6, (rnd, layer.name)
        assert len({round(n, 6) for n in norms}) == 3  # the weights are not uniform: the replay tells them apart


def test_hetlora_clients_receive_the_truncation_and_self_prune_by_the_tail_norm_rule(recorded):
    result, plans, uploads, rounds = recorded
    rank_now = dict(enumerate(RANKS))
    aggregated = {rnd: after for rnd, _, _, after in rounds}
    for rnd, cid, global_state, extra, sent in plans:
        assert extra["rank"] == rank_now[cid]
        if rnd > 1:  # what the server hands out is the last round's aggregate
            assert all(torch.equal(global_state[k], aggregated[rnd - 1][k]) for k in global_state)
        for layer in result.strategy.layers.values():  # the first r_k columns of B and rows of A, nothing else
            assert torch.equal(sent[layer.b_key], global_state[layer.b_key][:, :rank_now[cid]])
            assert torch.equal(sent[layer.a_key], global_state[layer.a_key][:rank_now[cid]])
        upload = next(u for u in uploads if u[:2] == (rnd, cid))
        _, _, rank, start, trained, up = upload
        keep = max(1, math.floor(GAMMA * rank))
        layers = result.strategy.layers.values()
        before = sum(tail(start[x.b_key], start[x.a_key], keep, rank) for x in layers)
        after = sum(tail(trained[x.b_key], trained[x.a_key], keep, rank) for x in layers)
        expected = keep if keep < rank and after < before else rank
        for layer in layers:
            assert torch.equal(up[layer.b_key], trained[layer.b_key][:, :expected])
            assert torch.equal(up[layer.a_key], trained[layer.a_key][:expected])
            assert torch.count_nonzero(trained[layer.a_key][rank:]) == 0  # the padding never trained
        rank_now[cid] = expected
    assert rank_now != dict(enumerate(RANKS))  # some client pruned: the rule was exercised both ways
    assert result.strategy.current == [rank_now[c] for c in range(3)]
    for h in result.history:  # bytes follow each client's rank of that round
        per_rank = 4 * sum(x.shape[0] + x.shape[1] for x in result.strategy.layers.values())
        assert all(v % per_rank == 0 for v in h["bytes_up"].values())


def test_hetlora_regulariser_is_lambda_times_the_tail_norms():
    model = tiny(r=R, alpha=8).model
    strategy = make_strategy("hetlora", model, client_ranks=[4, 3, 2], gamma=0.5, prune_lambda=0.3)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in model.named_parameters() if v.requires_grad}
    write_state(model, state)
    plan = strategy.configure_client(1, 1, state)  # rank 3: tail = rank 1..3 (⌊0.5·3⌋ = 1)
    expected = 0.3 * sum(tail(state[x.b_key], state[x.a_key], 1, 3) for x in strategy.layers.values())
    assert float(strategy.client_loss(model, plan).detach()) == pytest.approx(expected, rel=1e-6)
    off = make_strategy("hetlora", model, client_ranks=[4, 3, 2], gamma=1.0)
    assert off.client_loss(model, off.configure_client(1, 1, state)) is None  # γ = 1: no tail, no pruning


def test_hetlora_rejects_an_upload_of_another_rank():
    model = tiny(r=R, alpha=8).model
    strategy = make_strategy("hetlora", model, client_ranks=[4, 4, 4], gamma=0.5)
    state = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    plan = strategy.configure_client(1, 0, state)
    bad = strategy.truncate(plan.state, 3)  # neither 4 nor ⌊0.5·4⌋ = 2
    with pytest.raises(ValueError, match="client 0 uploaded factors of ranks"):
        strategy.aggregate(1, state, [ClientUpdate(0, bad, 10, 0.0, 1)])


def test_hetlora_bad_arguments_and_dp_are_recipe_errors(data_files, tmp_path):
    assert_recipe_refuses(data_files, tmp_path, "hetlora", {"gamma": 1.5, "prune_lambda": -1, "client_ranks": "x"},
                          "own norm")


def test_hetlora_resume_after_a_pruning_round_is_bit_exact(data_files, tmp_path, crash_at_round):
    from safetensors.torch import load_file

    args = {"client_ranks": RANKS, "gamma": GAMMA, "prune_lambda": LAM}
    sections = {"federation": {"clients_per_round": 3, "rounds": 3}, "checkpoint": {"every": 1}}
    full = run(parse_recipe(make_raw(data_files, tmp_path / "full", "hetlora", args, **sections)))
    ranks_after_2 = load_file(str(tmp_path / "full" / "checkpoints" / "round-0002" / "strategy.safetensors"))
    assert ranks_after_2["ranks"].tolist() != RANKS  # the checkpoint the resume starts from holds pruned ranks
    recipe = parse_recipe(make_raw(data_files, tmp_path / "cut", "hetlora", args, **sections))
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    resumed = run(recipe, resume=True)
    assert resumed.strategy.current == full.strategy.current
    assert all(torch.equal(full.global_state[k], resumed.global_state[k]) for k in full.global_state)


def test_hetlora_kept_moments_of_pruned_ranks_are_zeroed():
    """Per-client AdamW moments of ranks a client pruned would move its zero padding: they restart at zero."""
    model = tiny(r=R, alpha=8).model
    strategy = make_strategy("hetlora", model, client_ranks=[4, 2, 3])
    layer = next(iter(strategy.layers.values()))
    plan = strategy.configure_client(1, 1, {k: v.detach() for k, v in model.named_parameters() if v.requires_grad})
    strategy.open_client(plan)  # client 1 now trains at rank 2
    a_moment, b_moment = torch.ones(R, layer.shape[1]), torch.ones(layer.shape[0], R)
    kept = strategy.client_optimizer_state(1, 1, {f"{layer.a_key}::exp_avg": a_moment,
                                                  f"{layer.b_key}::exp_avg_sq": b_moment,
                                                  f"{layer.a_key}::step": torch.tensor(3.0)})
    assert kept[f"{layer.a_key}::exp_avg"].sum(1).tolist() == [layer.shape[1]] * 2 + [0.0] * 2
    assert kept[f"{layer.b_key}::exp_avg_sq"].sum(0).tolist() == [layer.shape[0]] * 2 + [0.0] * 2
    assert float(kept[f"{layer.a_key}::step"]) == 3.0 and float(a_moment.sum()) == a_moment.numel()  # input kept


def test_hetlora_warns_the_round_every_sampled_client_has_rank_1(caplog):
    """Clients 1 and 2 (rank 1) alone in a round: the zero-padded mean zeroes ranks 2-4 of every A and B, which then
    get zero gradients (client 0, of rank 4, cannot relearn them); the round is named in a warning, once."""
    model = tiny(r=R, alpha=8).model
    strategy = make_strategy("hetlora", model, client_ranks=[4, 1, 1], gamma=1.0)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in model.named_parameters() if v.requires_grad}

    def upload(client):
        rank = strategy.current[client]
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        return ClientUpdate(client, strategy.truncate(trained, rank), 10, 0.0, 1)

    with caplog.at_level("WARNING", logger="fedllm"):
        kept = strategy.aggregate(1, state, [upload(0), upload(1)])
        assert not caplog.records and strategy.live_ranks(kept) == R   # client 0 uploaded all four ranks
        lost = strategy.aggregate(2, kept, [upload(1), upload(2)])
    assert [r.getMessage() for r in caplog.records] == [
        "hetlora: round 2: every sampled client uploaded rank <= 1, so the zero-padded mean zeroed ranks 2-4 of the "
        "global adapter (both factors): no client can relearn them, and client(s) 0 of rank > 1 train them in vain "
        "from now on (HetLoRA's zero-padding; flexlora or flora aggregate without it)"]
    layer = next(iter(strategy.layers.values()))
    assert not lost[layer.a_key][1:].any() and not lost[layer.b_key][:, 1:].any()
    # client 0 trains on them: both factors' gradients of ranks 2-4 are zero, so they stay lost
    write_state(model, strategy.configure_client(3, 0, lost).state)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    params = dict(model.named_parameters())
    assert not params[layer.a_key].grad[1:].any() and not params[layer.b_key].grad[:, 1:].any()
    assert params[layer.a_key].grad[0].any()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedllm"):
        strategy.aggregate(3, lost, [upload(1), upload(2)])
    assert not caplog.records   # nothing more lost: warned once
