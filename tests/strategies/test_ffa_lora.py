"""FFA-LoRA: A stays at its seeded init on every client; only B is sent and averaged."""

import torch
from strategy_helpers import make_raw, record_updates, tiny

from fedllm.engine import server
from fedllm.engine.server import run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.ffa_lora import FFALoRA, is_lora_a


def test_a_is_bit_identical_after_every_client_and_only_b_travels(data_files, tmp_path, monkeypatch):
    checked = []
    original_run = server.run_client

    def run_spy(model, plan, *args, **kwargs):
        update = original_run(model, plan, *args, **kwargs)
        a_keys = [n for n, _ in model.named_parameters() if is_lora_a(n)]
        checked.append(all(torch.equal(v, initial[k]) for k, v in read_state(model, a_keys).items()))
        return update

    monkeypatch.setattr(server, "run_client", run_spy)
    uploads = record_updates(monkeypatch, FFALoRA)
    fresh = tiny().model
    initial = read_state(fresh, [n for n, _ in fresh.named_parameters() if is_lora_a(n)])
    assert initial
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "ffa_lora", federation={"clients_per_round": 3})))
    assert len(checked) == 6 and all(checked)
    assert all(torch.equal(result.global_state[k], v) for k, v in initial.items())
    b_keys = {k for k in result.global_state if ".lora_B." in k}
    assert uploads and all(set(u.state) == b_keys for u in uploads)
    b_bytes = sum(result.global_state[k].numel() * 4 for k in b_keys)
    for h in result.history:
        assert set(h["bytes_up"].values()) == {b_bytes} and set(h["bytes_down"].values()) == {b_bytes}
    start = read_state(fresh, b_keys)
    assert all(not torch.equal(result.global_state[k], start[k]) for k in b_keys)  # B trained
