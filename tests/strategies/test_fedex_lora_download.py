"""FedEx-LoRA (Singhal et al., ACL 2025, §3) with a compressed download (``federation.compression.download``).

The clients of round t+1 continue from the dequantised download ``(B̃, Ã)``; the residual folded into the base is
taken against it, ``W_t = W_{t−1} + Σ_k p_k·s·B_k·A_k − s·B̃·Ã``, so the model they continue from, ``W_t + s·B̃·Ã``,
is the exact mean of the clients' updated models. Replayed here in float64 from the recorded uploads, every
download recomputed with bitsandbytes' own nf4 quantize -> dequantize (``nf4_round_trip``, called directly)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from strategy_helpers import make_raw

from fedllm.commands.dry_run import dry_run
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.fedex_lora import FedExLoRA
from tests.conftest import cut_and_resume
from tests.strategies.test_download_compression_2025 import record
from tests.test_flower_apps import parts
from tests.training.test_download_compression import nf4_bytes, nf4_round_trip

NF4 = {"compression": {"download": "nf4"}}


def record_bases(monkeypatch) -> list:
    """Every ``aggregate``'s base weights ``(before, after)`` (copies; beside the 2025 tests' ``record``)."""
    bases = []
    aggregate = FedExLoRA.aggregate

    def spy(self, rnd, global_state, updates):
        before = {n: layer.base.weight.detach().clone() for n, layer in self.layers.items()}
        out = aggregate(self, rnd, global_state, updates)
        bases.append((before, {n: layer.base.weight.detach().clone() for n, layer in self.layers.items()}))
        return out

    monkeypatch.setattr(FedExLoRA, "aggregate", spy)
    return bases


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("dora", [False, True])
def test_fedex_lora_compression_nf4_download_clients_continue_from_the_exact_mean(dora, data_files, tmp_path,
                                                                                  monkeypatch):
    """Three rounds with an nf4 download (and under DoRA, whose direction is this ``W + s·B·A``; its magnitude travels
    as FedAvg's, with error feedback): every client of round t+1 starts from ``W_t + s·B̃·Ã`` equal (float64,
    ≤ 1e-6) to ``W_{t−1} + Σ_k p_k·s·B_k·A_k`` from the uploads; ``(B̃, Ã)`` is bitsandbytes' nf4 round trip of the
    averaged factors, what the server keeps and what every plan holds bit for bit; with FedEx-LoRA's uncompressed
    rule (residual against ``(B̄, Ā)``) the start would be off by more than 1e-5; no download residual of the factors
    is kept; the bytes are the nf4 factors plus the fp32 residual factors, and the dry run counts round 1 alike."""
    raw = make_raw(data_files, tmp_path / "run", "fedex_lora", federation={**NF4, "rounds": 3},
                   lora={"use_dora": dora})
    forecast = dry_run(parse_recipe({**raw, "output_dir": str(tmp_path / "dry")}))
    recorded, plans = record(monkeypatch, FedExLoRA)
    bases = record_bases(monkeypatch)
    result = run(parse_recipe(raw))
    layers = result.strategy.layers
    rounds = [(rnd, updates, out, *base) for (rnd, _, updates, out, _), base in zip(recorded, bases, strict=True)]
    assert [r[0] for r in rounds] == [1, 2, 3]
    first = [state for r, _, state in plans if r == 1]  # B = 0 arrives as 0: round 1 starts from W_0 exactly
    assert len(first) == 2 and all(not state[layer.b_key].any() for state in first for layer in layers.values())
    final = result.global_state
    for i, (rnd, updates, out, before, after) in enumerate(rounds):
        weights = torch.tensor([u.num_examples for u in updates], dtype=torch.float64)
        p = weights / weights.sum()
        # what the clients of the next round hold (the final model for the last round: what a next round would get)
        starts = [state for r, _, state in plans if r == rnd + 1] or [final]
        assert len(starts) == (2 if rnd < 3 else 1)
        for name, layer in layers.items():
            s = layer.scale
            mean = sum(p[j] * s * u.state[layer.b_key].double() @ u.state[layer.a_key].double()
                       for j, u in enumerate(updates))
            exact = before[name].double() + mean  # §3: the clients' exact mean model
            b_bar = sum(p[j] * u.state[layer.b_key].double() for j, u in enumerate(updates))
            a_bar = sum(p[j] * u.state[layer.a_key].double() for j, u in enumerate(updates))
            b_sent, a_sent = nf4_round_trip(out[layer.b_key]), nf4_round_trip(out[layer.a_key])
            assert torch.equal(b_sent, out[layer.b_key]) and torch.equal(a_sent, out[layer.a_key])  # sent unchanged
            assert max_diff(out[layer.b_key], nf4_round_trip(b_bar.float())) <= 1e-6
            assert max_diff(out[layer.a_key], nf4_round_trip(a_bar.float())) <= 1e-6
            for state in starts:
                assert torch.equal(state[layer.b_key], out[layer.b_key]), (rnd, name)
                assert torch.equal(state[layer.a_key], out[layer.a_key]), (rnd, name)
                start = after[name].double() + s * state[layer.b_key].double() @ state[layer.a_key].double()
                assert max_diff(start, exact) <= 1e-6, (rnd, name)
            uncompressed_rule = before[name].double() + mean - s * b_bar @ a_bar + s * b_sent.double() @ a_sent.double()
            assert max_diff(uncompressed_rule, exact) > 1e-5, (rnd, name)
    path = result.run_dir / "final" / "strategy.safetensors"  # none where nothing is kept
    kept = load_file(str(path)) if path.is_file() else {}
    kept = [k for k in kept if k.startswith("compression/")]  # the factors' error is in the base, not resent
    assert not any(".lora_A." in k or ".lora_B." in k for k in kept) and bool(kept) == dora  # (DoRA: m's residual)
    lora = sum(nf4_bytes(v.numel()) for v in final.values())  # every global tensor travels as nf4
    residual = sum(4 * min(layer.shape[0] * layer.shape[1], 3 * layer.rank * (layer.shape[0] + layer.shape[1]))
                   for layer in layers.values())
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for h in lines:
        assert h["bytes_down"] == {str(c): residual + (lora if c in h["clients"] else 0) for c in range(3)}
    assert forecast.bytes_down == lines[0]["bytes_down_total"]


@pytest.mark.parametrize("kind,refused", [("int8", True), ("fp4", False)])
def test_fedex_lora_compression_download_formats(kind, refused, data_files, tmp_path):
    """int8 is refused at recipe load with its reason (its dynamic code runs from −0.993 to 1, so a dequantised block
    would not be sent unchanged); fp4 is accepted, as nf4."""
    from fedllm.recipe.schema import RecipeError

    raw = make_raw(data_files, tmp_path / "run", "fedex_lora", federation={"compression": {"download": kind}})
    if refused:
        with pytest.raises(RecipeError, match="federation.compression.download") as e:
            parse_recipe(raw)
        assert "−0.993" in str(e.value) and "nf4 or fp4" in str(e.value)
    else:
        parse_recipe(raw)


def test_fedex_lora_compression_nf4_download_resume_is_bit_exact(data_files, tmp_path, crash_at_round):
    """Cut in round 2 and resumed: the checkpoint (adapter, base, strategy) and the bytes equal an uncut run's."""
    raw = make_raw(data_files, tmp_path / "full", "fedex_lora", checkpoint={"every": 1}, federation=NF4)
    full = run(parse_recipe(raw))
    recipe = parse_recipe({**raw, "output_dir": str(tmp_path / "cut")})
    resumed = cut_and_resume(recipe, crash_at_round)
    a, b = parts(full.run_dir), parts(resumed.run_dir)
    assert a.keys() == b.keys() and {"adapter", "base"} <= a.keys()
    for part in a:
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert [h["bytes_down"] for h in resumed.history] == [h["bytes_down"] for h in full.history]


def test_fedex_lora_compression_nf4_download_on_flower_matches_the_simulation(data_files, tmp_path, monkeypatch):
    """Over the Flower apps (loopback grid, real ClientApp): the plans carry codes and absmax, and the server's model,
    base and bytes, and every node's base rebuilt from the merges it replayed, equal the simulation's (tol 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower import records
    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    raw = make_raw(data_files, tmp_path / "sim", "fedex_lora", federation=NF4)
    sim = run(parse_recipe(raw))
    grid = LoopbackGrid(nodes(tmp_path, 3))
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    for part in ("adapter", "base", "strategy"):
        assert_close(expected.get(part, {}), got.get(part, {}), part, tol=0)
    for cid in range(3):
        assert_close(expected["base"], node_state(tmp_path, cid)["base"], f"base on node {cid}", tol=0)
    # (the residual is counted in the merging round in simulation, in the next round's catch-up on Flower)
    assert [h["bytes_up"] for h in flower.history] == [h["bytes_up"] for h in sim.history]
    nf4_plan = sum(nf4_bytes(layer.rank * n) for layer in sim.strategy.layers.values() for n in layer.shape)
    assert flower.history[0]["bytes_down"] == {str(c): nf4_plan for c in sim.history[0]["clients"]}
    sent = [m.content.array_records["plan.packed"] for m in grid.messages if m.metadata.message_type == "train"]
    assert len(sent) == 4 and all({n.rsplit("|", 1)[1]: str(t.dtype).removeprefix("torch.") for n, t in records.decode(r).items()} ==
                                  {"codes": "uint8", "absmax": "float32"} for r in sent)
