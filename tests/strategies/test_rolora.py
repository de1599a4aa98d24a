"""RoLoRA: odd rounds train and average B (A frozen on every client), even rounds A (B frozen); only the trained
factor travels up. Replayed by hand from the uploads the server recorded."""

import torch
from strategy_helpers import make_raw, record_rounds

from fedllm.engine import server
from fedllm.engine.server import run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.rolora import RoLoRA


def test_rolora_replay_of_each_round_from_the_recorded_uploads(data_files, tmp_path, monkeypatch):
    frozen_ok = []
    original_run = server.run_client

    def run_spy(model, plan, *args, **kwargs):
        update = original_run(model, plan, *args, **kwargs)
        trained = set(plan.phases[0].keys)
        after = read_state(model, [k for k in plan.state if k not in trained])
        frozen_ok.append(all(torch.equal(v, plan.state[k].to(v.dtype)) for k, v in after.items()))
        return update

    monkeypatch.setattr(server, "run_client", run_spy)
    rounds = record_rounds(monkeypatch, RoLoRA)
    raw = make_raw(data_files, tmp_path / "run", "rolora", federation={"clients_per_round": 3, "rounds": 3})
    result = run(parse_recipe(raw))
    assert len(frozen_ok) == 9 and all(frozen_ok)  # the frozen factor is bit-identical after local training
    assert [r[0] for r in rounds] == [1, 2, 3]
    for rnd, before, updates, after in rounds:
        trained = ".lora_B." if rnd % 2 == 1 else ".lora_A."  # B first: the paper's order (A's gradient is 0 at B = 0)
        keys = {k for k in before if trained in k}
        assert all(set(u.state) == keys for u in updates)
        total = sum(u.num_examples for u in updates)
        for k, v in before.items():
            if k in keys:  # the example-weighted mean, by hand in float64
                expected = sum(u.state[k].double() * u.num_examples for u in updates) / total
                assert (after[k].double() - expected).abs().max() <= 1e-6, (rnd, k)
                assert not torch.equal(after[k], v)
            else:
                assert torch.equal(after[k], v), (rnd, k)  # the other factor is untouched
    lora = sum(v.numel() * 4 for v in result.global_state.values())
    b_bytes = sum(v.numel() * 4 for k, v in result.global_state.items() if ".lora_B." in k)
    for h in result.history:  # both factors go down (a client may have missed rounds), one factor comes up
        assert set(h["bytes_down"].values()) == {lora}
        up = b_bytes if h["round"] % 2 == 1 else lora - b_bytes
        assert set(h["bytes_up"].values()) == {up}


def test_rolora_runs_under_client_level_dp_with_noise_on_the_trained_factor_only(data_files, tmp_path, monkeypatch):
    rounds = record_rounds(monkeypatch, RoLoRA)
    privacy = {"mechanism": "central", "noise_multiplier": 0.5, "clipping_norm": 0.05, "noise_seed": 3}
    raw = make_raw(data_files, tmp_path / "run", "rolora", privacy=privacy, federation={"rounds": 1})
    result = run(parse_recipe(raw))
    (_, before, _, after), = rounds
    for k, v in before.items():
        assert torch.equal(after[k], v) == (".lora_A." in k), k
    assert result.history[-1]["epsilon"] > 0
