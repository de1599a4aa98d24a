"""Compressed downloads (``federation.compression.download: nf4``) with HetLoRA, LoRA-FAIR, Fed-SB, FedLoRA-PFL, pFL^MF,
RoLoRA and FedSVD. Each round's download is recomputed with bitsandbytes' own nf4 quantize -> dequantize of the
global state plus the server's residual (error feedback, Seide et al. 2014), the residual dropped where the strategy
says so; every client must have received exactly that (or, for HetLoRA's truncated factors and Fed-SB's fixed A and
B, the exact fp32 values), the server's maths is replayed from the uploads (and, for RoLoRA and FedSVD, from the
dequantised frozen factor the clients trained against), the final residual equals the replay's and the bytes are
codes plus absmax of what travelled compressed and 4 bytes a value of the rest. On the Flower apps: Fed-SB under DoRA
(A and B sent exact once) and the ranked clients of HetLoRA and FLoRA under upload and download compression equal
the simulation; Fed-SB's dry run counts its bytes."""

import json

import pytest
import torch
from safetensors.torch import load_file
from strategy_helpers import example_weights, make_raw, norm_weights, padded_mean, uniform_weights

from fedllm.common.registry import strategies
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.lora_fair import refine_b
from fedllm.strategies.residual import adapter_layers
from tests.training.test_download_compression import nf4_bytes, nf4_round_trip


def record(monkeypatch, cls) -> tuple[list, list]:
    """``(rounds, plans)``: every ``aggregate`` call as ``(rnd, state in, updates, state out, downloaded)`` and every
    plan as a client opened it ``(rnd, client, state)`` (copies)."""
    rounds, plans = [], []
    aggregate, open_client = cls.aggregate, cls.open_client

    def spy_aggregate(self, rnd, global_state, updates):
        before = {k: v.clone() for k, v in global_state.items()}
        down = {k: v.clone() for k, v in (self.downloaded or {}).items()}
        out = aggregate(self, rnd, global_state, updates)
        rounds.append((rnd, before, list(updates), {k: v.clone() for k, v in out.items()}, down))
        return out

    def spy_open(self, plan):
        plans.append((plan.rnd, plan.client_id, {k: v.clone() for k, v in plan.state.items()}))
        return open_client(self, plan)

    monkeypatch.setattr(cls, "aggregate", spy_aggregate)
    monkeypatch.setattr(cls, "open_client", spy_open)
    return rounds, plans


def replay_downloads(thetas, exact, dropped):
    """Each round's dequantised download ``Q(θ + e)`` (``e ← θ + e − Q(θ + e)``; the keys in ``exact`` never
    quantised, those of ``dropped[i]`` losing their residual after round ``i``) and the last residual."""
    e, sent = {}, []
    for theta, drop in zip(thetas, dropped, strict=True):
        x = {k: v.float() + e.get(k, 0) for k, v in theta.items() if k not in exact}
        sent.append({k: nf4_round_trip(v) for k, v in x.items()})
        e = {k: x[k] - sent[-1][k] for k in x if k not in drop}
    return sent, e


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def lora_fair_server(strategy, layers, rnd, theta, down, updates, out):
    for layer in layers.values():
        p = example_weights(layer, updates)
        b_bar, a_bar = padded_mean(layer.b_key, updates, p), padded_mean(layer.a_key, updates, p)
        delta = refine_b([u.state[layer.b_key] for u in updates], [u.state[layer.a_key] for u in updates], p, b_bar,
                         a_bar, 0.01, 50, 0.3)
        assert max_diff(out[layer.b_key], b_bar + delta) <= 1e-6 and max_diff(out[layer.a_key], a_bar) <= 1e-6


def hetlora_server(strategy, layers, rnd, theta, down, updates, out):
    for layer in layers.values():
        p = norm_weights(layer, updates)
        for key in (layer.a_key, layer.b_key):
            assert max_diff(out[key], padded_mean(key, updates, p, layer.rank)) <= 1e-6


def fed_sb_server(strategy, layers, rnd, theta, down, updates, out):
    for key in strategy.latent_keys:
        assert max_diff(out[key], padded_mean(key, updates, uniform_weights(None, updates))) <= 1e-6
    assert all(torch.equal(out[k], theta[k]) for k in strategy.factor_keys)  # A, B fixed


def fedlora_pfl_server(strategy, layers, rnd, theta, down, updates, out):
    for key in updates[0].state:  # eq. 8: the plain mean of σ
        assert max_diff(out[key], padded_mean(key, updates, uniform_weights(None, updates))) <= 1e-6


def pflmf_server(strategy, layers, rnd, theta, down, updates, out):
    from fedllm.strategies.pflmf import U_KEY

    g = padded_mean(U_KEY, updates, uniform_weights(None, updates))  # Alg. 1: U ← U − η_U·mean_i G_i, the exact U
    assert max_diff(out[U_KEY], theta[U_KEY].double() - strategy.eta_u * g) <= 1e-6


def rolora_server(strategy, layers, rnd, theta, down, updates, out):
    trained, frozen = ("b_key", "a_key") if rnd % 2 else ("a_key", "b_key")
    for layer in layers.values():
        key, kept = getattr(layer, trained), getattr(layer, frozen)
        assert max_diff(out[key], padded_mean(key, updates, example_weights(layer, updates))) <= 1e-6
        assert torch.equal(out[kept], down[kept])  # the frozen factor the clients trained against
        assert not torch.equal(out[kept], theta[kept])


def fedsvd_server(strategy, layers, rnd, theta, down, updates, out):
    for layer in layers.values():
        b_bar = padded_mean(layer.b_key, updates, example_weights(layer, updates))
        product = out[layer.b_key].double() @ out[layer.a_key].double()
        assert max_diff(product, b_bar @ down[layer.a_key].double()) <= 1e-5  # svd(B̄·A_s): the clients' product
        assert max_diff(product, b_bar @ theta[layer.a_key].double()) > 1e-5  # not the server's unsent A


def factor_keys(layers, kinds):
    return [getattr(layer, kind) for layer in layers.values() for kind in kinds]


CASES = {
    "lora_fair": ({}, {}, lora_fair_server, lambda layers, rnd: []),
    "hetlora": ({"client_ranks": [4, 2, 1], "gamma": 1.0}, {}, hetlora_server, lambda layers, rnd: []),
    "fed_sb": ({"init_samples": 8}, {}, fed_sb_server, lambda layers, rnd: []),
    "fedlora_pfl": ({"e_lora": 1, "e_global": 1}, {}, fedlora_pfl_server, lambda layers, rnd: []),
    "pflmf": ({"rank": 3, "eta_u": 0.5}, {"train": {"optimizer": "sgd"}}, pflmf_server, lambda layers, rnd: []),
    "rolora": ({}, {}, rolora_server, lambda layers, rnd: factor_keys(layers, ["a_key"] if rnd % 2 else ["b_key"])),
    "fedsvd": ({}, {}, fedsvd_server, lambda layers, rnd: factor_keys(layers, ["a_key", "b_key"])),
}


@pytest.mark.parametrize("strategy", sorted(CASES))
def test_download_compression_2025_replays_downloads_server_maths_residual_and_bytes(strategy, data_files, tmp_path,
                                                                                     monkeypatch):
    args, sections, server, dropped = CASES[strategy]
    rounds, plans = record(monkeypatch, strategies.get(strategy))
    raw = make_raw(data_files, tmp_path / "run", strategy, args, federation={"compression": {"download": "nf4"}},
                   **sections)
    result = run(parse_recipe(raw))
    s = result.strategy
    assert [r[0] for r in rounds] == [1, 2]
    exact = s.exact_download_keys()
    assert (strategy == "fed_sb") == bool(exact)
    layers = adapter_layers(result.model)
    sent, residual = replay_downloads([r[1] for r in rounds], exact, [dropped(layers, r[0]) for r in rounds])
    fp32_keys = set()
    for (rnd, theta, updates, out, down), want in zip(rounds, sent, strict=True):
        assert down.keys() == want.keys() and all(torch.equal(down[k], want[k]) for k in want), rnd
        server(s, layers, rnd, theta, down, updates, out)
        lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        for prnd, cid, state in (p for p in plans if p[0] == rnd):
            expected_bytes = 0
            for key, value in state.items():
                if key in want and value.shape == want[key].shape:  # a global tensor: its nf4 download
                    assert torch.equal(value, want[key]), (rnd, cid, key)
                    expected_bytes += nf4_bytes(value.numel())
                else:  # HetLoRA's truncated factors, Fed-SB's A and B: exact fp32
                    glob = theta[key]
                    part = glob[:value.shape[0]] if ".lora_A." in key else glob[:, :value.shape[1]] \
                        if ".lora_B." in key else glob
                    assert torch.equal(value, part), (rnd, cid, key)
                    expected_bytes += 4 * value.numel()
                    fp32_keys.add(key)
            assert lines[rnd - 1]["bytes_down"][str(cid)] == expected_bytes, (rnd, cid)
    assert bool(fp32_keys) == (strategy in ("hetlora", "fed_sb")), fp32_keys
    path = result.run_dir / "final" / "strategy.safetensors"  # none where nothing is kept (FedSVD drops A and B)
    final = load_file(str(path)) if path.is_file() else {}
    kept = {k.removeprefix("compression/"): v for k, v in final.items() if k.startswith("compression/")}
    assert kept.keys() == residual.keys() and all(torch.equal(kept[k], residual[k]) for k in residual)


def test_download_compression_fed_sb_dora_on_flower_sends_a_and_b_exact_and_matches_the_simulation(
        data_files, tmp_path, monkeypatch):
    """Fed-SB under DoRA with an nf4 download over the Flower apps (loopback grid, real ClientApp): the first plans
    carry A and B as plain fp32 arrays beside the packed R and m, later plans only packed tensors; the model, the
    server residual, every node's stored A and B and the bytes equal the simulation's (tol 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower import records
    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes, parts

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    raw = make_raw(data_files, tmp_path / "sim", "fed_sb", {"init_samples": 8}, lora={"use_dora": True},
                   federation={"compression": {"download": "nf4"}})
    sim = run(parse_recipe(raw))
    grid = LoopbackGrid(nodes(tmp_path, 3))
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    for part in ("adapter", "strategy"):
        assert expected[part].keys() == got[part].keys()
        assert all(torch.equal(expected[part][k], got[part][k]) for k in expected[part]), part
    assert any(k.startswith("compression/") and ".fed_sb." in k for k in expected["strategy"])
    assert not any(k.startswith("compression/") and ".lora_A." in k for k in expected["strategy"])
    for cid in sorted({c for h in sim.history for c in h["clients"]}):
        sim_entry = {k.split("/", 1)[1]: v for k, v in expected["clients"].items() if k.startswith(f"client{cid}/")}
        on_node = {k.split("/", 1)[1]: v for k, v in node_state(tmp_path, cid).get("clients", {}).items()}
        assert_close(sim_entry, on_node, f"client {cid}", tol=0)
        assert any(".lora_A." in k for k in on_node)
    assert [h["bytes_down"] for h in flower.history] == [h["bytes_down"] for h in sim.history]
    train = [m.content.array_records for m in grid.messages if m.metadata.message_type == "train"]
    factors = [any(".lora_A." in name for name in records.decode(r["plan"])) for r in train]
    assert factors[:2] == [True, True] and any(not f for f in factors[2:])  # A, B once per client, fp32
    assert all(not any(".lora_" in name.rsplit("|", 1)[0] and "magnitude" not in name
                       for name in records.decode(r["plan.packed"])) for r in train)


def test_download_compression_fed_sb_dry_run_counts_a_and_b_at_fp32(data_files, tmp_path):
    """The dry run counts Fed-SB's first download as the run does: A and B at 4 bytes a value, R and m as nf4."""
    from fedllm.commands.dry_run import dry_run

    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"init_samples": 8}, lora={"use_dora": True},
                   federation={"compression": {"download": "nf4"}, "rounds": 1})
    report = dry_run(parse_recipe(raw))
    result = run(parse_recipe(raw))
    s = result.strategy
    per_client = sum(4 * result.global_state[k].numel() for k in s.factor_keys) + sum(
        nf4_bytes(result.global_state[k].numel()) for k in s.shared_keys())
    assert set(result.history[0]["bytes_down"].values()) == {per_client}
    assert report.bytes_down == result.history[0]["bytes_down_total"] == 2 * per_client


@pytest.mark.parametrize("strategy", ["hetlora", "flora"])
def test_compression_ranked_clients_on_flower_match_the_simulation(strategy, data_files, tmp_path, monkeypatch):
    """Clients of rank ``r_k < r`` (HetLoRA, FLoRA) with an int8 upload and an nf4 download over the Flower apps: the
    client quantises its upload against the truncated plan as it arrived (its zero-padding goes to ``plan.local``),
    the server reads it back against the same plan, so the model, the server residual, the per-client residuals and
    the bytes equal the simulation's (tol 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes, parts

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    raw = make_raw(data_files, tmp_path / "sim", strategy, {"client_ranks": [4, 2, 1]},
                   federation={"compression": {"upload": "int8", "download": "nf4"}})
    sim = run(parse_recipe(raw))
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}),
                 executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    for part in ("adapter", "base", "strategy"):
        assert expected.get(part, {}).keys() == got.get(part, {}).keys(), part
        assert all(torch.equal(expected[part][k], got[part][k]) for k in expected.get(part, {})), part
    for cid in sorted({c for h in sim.history for c in h["clients"]}):
        sim_entry = {k.split("/", 1)[1]: v for k, v in expected["clients"].items() if k.startswith(f"client{cid}/")}
        on_node = {k.split("/", 1)[1]: v for k, v in node_state(tmp_path, cid).get("clients", {}).items()}
        assert_close(sim_entry, on_node, f"client {cid}", tol=0)
    # (FLoRA's merge sync is counted in the merging round in simulation, in the next round's catch-up on Flower)
    for key in ("bytes_up", "bytes_down") if strategy == "hetlora" else ("bytes_up",):
        assert [h[key] for h in flower.history] == [h[key] for h in sim.history], key
