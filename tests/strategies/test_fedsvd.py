"""FedSVD: clients train and send B only (A frozen); the server refactorises B̄·A by SVD into an orthonormal A."""


import pytest
import torch
from strategy_helpers import assert_dp_sgd_epsilon_per_client, make_raw, record_rounds, tiny

from fedllm.common.errors import InputError
from fedllm.engine import server
from fedllm.engine.server import run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.fedsvd import FedSVD

R, ALPHA = 4, 8


def recorded(monkeypatch) -> list:
    """Every ``(rnd, global_state before, updates, global_state after)`` FedSVD's aggregate sees."""
    return record_rounds(monkeypatch, FedSVD)


def replay(before, updates, b_key, a_key):
    """One round by hand, as the authors' code does it: B̄ = Σ n_k B_k / n; dense SVD (fp64) of B̄·A;
    A' = Vh[:r], B' = U[:, :r]·diag(S[:r])."""
    total = sum(u.num_examples for u in updates)
    b_bar = sum(u.num_examples / total * u.state[b_key].double() for u in updates)
    u_, s, vh = torch.linalg.svd(b_bar @ before[a_key].double(), full_matrices=False)
    return b_bar, u_[:, :R] * s[:R], vh[:R]


def test_fedsvd_replay_of_a_round_from_the_recorded_uploads(data_files, tmp_path, monkeypatch):
    rounds = recorded(monkeypatch)
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "fedsvd", federation={"rounds": 2})))
    assert [r[0] for r in rounds] == [1, 2]
    a_keys = [k for k in result.global_state if ".lora_A." in k]
    initial_a = read_state(tiny().model, a_keys)
    for rnd, before, updates, out in rounds:
        assert len(updates) == 2 and {u.num_examples for u in updates} != {0}
        for a_key in a_keys:
            b_key = a_key.replace(".lora_A.", ".lora_B.")
            if rnd == 1:  # round 1 starts from PEFT's default A, never refactorised yet
                assert torch.equal(before[a_key], initial_a[a_key])
            b_bar, b_new, a_new = replay(before, updates, b_key, a_key)
            # the product is unchanged by the refactorisation: s·B'A' = s·B̄·A
            assert (out[b_key].double() @ out[a_key].double() - b_bar @ before[a_key].double()).abs().max() <= 1e-6
            # A' = Vh[:r] and B' = U_r·diag(S_r), each singular pair up to its sign
            signs = torch.sign((out[a_key].double() * a_new).sum(1))
            assert torch.all(signs != 0)
            assert (out[a_key].double() - signs[:, None] * a_new).abs().max() <= 1e-6, (rnd, a_key)
            assert (out[b_key].double() - b_new * signs).abs().max() <= 1e-6, (rnd, b_key)
            eye = out[a_key].double() @ out[a_key].double().T
            assert (eye - torch.eye(R, dtype=torch.float64)).abs().max() <= 1e-6  # orthonormal rows
    assert result.global_state.keys() == rounds[-1][3].keys()


def test_fedsvd_clients_train_and_send_b_only(data_files, tmp_path, monkeypatch):
    rounds = recorded(monkeypatch)
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "fedsvd")))
    b_keys = {k for k in result.global_state if ".lora_B." in k}
    a_keys = {k for k in result.global_state if ".lora_A." in k}
    assert b_keys and a_keys and set(result.global_state) == a_keys | b_keys
    assert all(set(u.state) == b_keys for _, _, updates, _ in rounds for u in updates)
    b_bytes = sum(result.global_state[k].numel() * 4 for k in b_keys)
    ab_bytes = b_bytes + sum(result.global_state[k].numel() * 4 for k in a_keys)
    for h in result.history:  # A changes every round on the server: it goes down with B, never up
        assert set(h["bytes_up"].values()) == {b_bytes} and set(h["bytes_down"].values()) == {ab_bytes}
    # a client that trained B did not move A: B's gradient alone, with A held at what the server sent
    _, before, updates, _ = rounds[1]
    assert all(not torch.equal(u.state[k], before[k]) for u in updates for k in b_keys)


def test_fedsvd_warmup_and_period_skip_the_refactorisation(data_files, tmp_path, monkeypatch):
    rounds = recorded(monkeypatch)
    run(parse_recipe(make_raw(data_files, tmp_path / "run", "fedsvd", {"warmup_rounds": 1, "period": 1},
                              federation={"rounds": 2})))
    (_, before1, _, out1), (_, before2, _, out2) = rounds
    a_keys = [k for k in out1 if ".lora_A." in k]
    assert all(torch.equal(out1[k], before1[k]) for k in a_keys)  # round 1: plain FFA-LoRA
    assert all(not torch.equal(out2[k], before2[k]) for k in a_keys)  # round 2: refactorised
    assert [FedSVD(period=3).refactorises(r) for r in range(1, 7)] == [False, False, True, False, False, True]


@pytest.mark.parametrize("args,message", [
    ({"period": 0}, "strategy_args.period: got 0"),
    ({"warmup_rounds": -1}, "strategy_args.warmup_rounds: got -1"),
    ({"period": 1.5}, "strategy_args.period: got 1.5"),
    ({"rank": 2}, "strategy_args.rank"),
])
def test_fedsvd_bad_arguments_are_refused_at_load(args, message, data_files, tmp_path):
    with pytest.raises(InputError, match=message):
        parse_recipe(make_raw(data_files, tmp_path / "run", "fedsvd", args))


def test_fedsvd_under_dp_sgd_noises_b_only_and_accounts_epsilon(data_files, tmp_path, monkeypatch):
    """DP-SGD (the paper's setting): A is bit-identical after every client's noisy steps (the noise and clipping
    touch B's gradients only) and each client's ε is the accountant's for the steps it took."""
    rounds = recorded(monkeypatch)
    a_unchanged = []
    original_run = server.run_client

    def run_spy(model, plan, *args, **kwargs):
        update = original_run(model, plan, *args, **kwargs)
        a_keys = [k for k in plan.state if ".lora_A." in k]
        a_unchanged.append(all(torch.equal(v, plan.state[k]) for k, v in read_state(model, a_keys).items()))
        return update

    monkeypatch.setattr(server, "run_client", run_spy)
    privacy = {"mechanism": "dp_sgd", "noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 2}
    raw = make_raw(data_files, tmp_path / "run", "fedsvd", privacy=privacy, federation={"rounds": 2})
    result = run(parse_recipe(raw))
    lines = assert_dp_sgd_epsilon_per_client(result, noise_multiplier=1.0, batch_size=4, delta=1e-3)
    assert lines[-1]["epsilon"] > 0
    assert len(a_unchanged) == 4 and all(a_unchanged)
    for _, before, updates, _ in rounds:
        assert all(set(u.state) == {k for k in before if ".lora_B." in k} for u in updates)
        assert all(u.loss is None for u in updates)  # DP-SGD: the unnoised loss stays on the client
