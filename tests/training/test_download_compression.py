"""Compressed downloads (``federation.compression.download``) with strategies whose server maths measures the clients'
progress from what they received: FedOpt's pseudo-gradient and FRLoRA's merge read the dequantised download, FedLoRU
and FLoRA drop the server residual of the factors they re-initialise. Rounds are replayed by hand from the recorded
uploads and downloads recomputed with bitsandbytes' own quantize -> dequantize (called here directly)."""

import json
import math

import bitsandbytes.functional as bnbf
import pytest
import torch
from safetensors.torch import load_file

from fedllm.engine.server import RoundLoop, run
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import get_strategy
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.fedadam import FedAdam
from fedllm.strategies.frlora import FRLoRA
from tests.conftest import crashing_round, tiny_raw

BLOCK = 64


def nf4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What a client reads back from an nf4 download of ``x`` (bitsandbytes, blocks of 64, fp32)."""
    flat = x.detach().float().reshape(-1).contiguous()
    codes, state = bnbf.quantize_4bit(flat, blocksize=BLOCK, quant_type="nf4")
    return bnbf.dequantize_4bit(codes, state).reshape(x.shape)


def downloads(thetas: list[dict]) -> tuple[list[dict], dict]:
    """The dequantised download of each round's global state with the server's error feedback
    (``x = θ + e; sent = Q(x); e ← x − sent``), and the residual after the last round."""
    e = {k: torch.zeros_like(v) for k, v in thetas[0].items()}
    sent = []
    for theta in thetas:
        x = {k: theta[k].float() + e[k] for k in theta}
        sent.append({k: nf4_round_trip(v) for k, v in x.items()})
        e = {k: x[k] - sent[-1][k] for k in x}
    return sent, e


def nf4_bytes(numel: int) -> int:
    return (numel + 1) // 2 + 4 * math.ceil(numel / BLOCK)


def record(monkeypatch, cls, hook):
    """Record ``(rnd, state in, state out, base weights before, after)`` of every call of ``cls.<hook>``."""
    seen = []
    original = getattr(cls, hook)

    def spy(self, rnd, *args):
        state = args[-2] if hook == "aggregate" else args[-1]
        layers = getattr(self, "layers", {})
        before = {n: layer.base.weight.detach().clone() for n, layer in layers.items()}
        kept = {k: v.clone() for k, v in state.items()}
        out = original(self, rnd, *args)
        after = {n: layer.base.weight.detach().clone() for n, layer in layers.items()}
        seen.append((rnd, kept, {k: v.clone() for k, v in out.items()}, before, after, args[-1]))
        return out

    monkeypatch.setattr(cls, hook, spy)
    return seen


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def test_download_compression_fedadam_replay_pseudo_gradient_from_the_dequantised_download(tmp_path, arith_file,
                                                                                           monkeypatch):
    """FedAdam (Reddi et al. 2021, Alg. 2) by hand: ``Δ = Σ_k n_k θ_k / n − θ_sent`` with ``θ_sent`` the nf4 download
    the clients started from (with the server's residual), the moments and bias-corrected step in float64."""
    rounds = record(monkeypatch, FedAdam, "aggregate")
    raw = tiny_raw(tmp_path / "run", arith_file, federation={
        "strategy": "fedadam", "rounds": 2, "compression": {"download": "nf4"}})
    result = run(parse_recipe(raw))
    assert [r[0] for r in rounds] == [1, 2]
    sent, residual = downloads([r[1] for r in rounds])
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    m = {k: 0.0 for k in rounds[0][1]}
    v, off = dict(m), 0.0
    for (rnd, theta, after, _, _, updates), down in zip(rounds, sent, strict=True):
        n = sum(u.num_examples for u in updates)
        eta_t = eta * math.sqrt(1 - b2 ** (rnd + 1)) / (1 - b1 ** (rnd + 1))
        for key in theta:
            mean = sum(u.num_examples * u.state[key].double() for u in updates) / n
            delta = mean - down[key].double()
            m[key] = b1 * m[key] + (1 - b1) * delta
            v[key] = b2 * v[key] + (1 - b2) * delta ** 2
            assert max_diff(after[key], theta[key].double() + eta_t * m[key] / (v[key].sqrt() + tau)) <= 1e-6, (rnd, key)
            if rnd == 1:  # the pseudo-gradient against the server's own θ: a visibly different step (A; B starts 0)
                unsent = mean - theta[key].double()
                off = max(off, max_diff(after[key] - theta[key], eta_t * unsent / (unsent.abs() + tau / 0.1)))
    assert off > 1e-4
    strategy = load_file(str(result.run_dir / "final" / "strategy.safetensors"))
    for key, e in residual.items():  # the server's residual after round 2, as the replay's (same fp32 maths)
        assert torch.equal(strategy[f"compression/{key}"], e), key
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    down = sum(nf4_bytes(t.numel()) for t in rounds[0][1].values())
    assert all(set(line["bytes_down"].values()) == {down} for line in lines)
    assert all(set(line["bytes_up"].values()) == {4 * sum(t.numel() for t in rounds[0][1].values())} for line in lines)


def test_download_compression_frlora_replay_merge_from_the_factors_the_clients_started_from(
        tmp_path, arith_file, monkeypatch):
    """FRLoRA (seed 001, Alg. 1) with an nf4 download: each round's merge is ``Ŵ^t − Ŵ^{t−1} = s·(B̄Ā − B_s·A_s)``,
    ``(B̄, Ā)`` the uniform mean of the uploads, ``(B_s, A_s)`` the dequantised download of ``(B0, A0)`` the clients
    started from; every round restarts from ``(B0, A0)``."""
    rounds = record(monkeypatch, FRLoRA, "after_aggregate")
    starts = record(monkeypatch, FRLoRA, "aggregate")
    raw = tiny_raw(tmp_path / "run", arith_file, federation={
        "strategy": "frlora", "rounds": 2, "compression": {"download": "nf4"}})
    result = run(parse_recipe(raw))
    layers = result.strategy.layers
    sent, _ = downloads([s[1] for s in starts])
    for (rnd, bar, out, before, after, _), (_, theta, _, _, _, updates), down in zip(rounds, starts, sent, strict=True):
        for name, layer in layers.items():
            b_bar = sum(u.state[layer.b_key].double() for u in updates) / len(updates)
            a_bar = sum(u.state[layer.a_key].double() for u in updates) / len(updates)
            assert max_diff(bar[layer.b_key], b_bar) <= 1e-6 and max_diff(bar[layer.a_key], a_bar) <= 1e-6
            b_s, a_s = down[layer.b_key].double(), down[layer.a_key].double()
            want = layer.scale * (b_bar @ a_bar - b_s @ a_s)
            assert max_diff(after[name] - before[name], want) <= 1e-6, (rnd, name)
            # against the unquantised start (B0, A0) the merge is visibly different: the download's error is not in Ŵ
            b0, a0 = theta[layer.b_key].double(), theta[layer.a_key].double()
            assert max_diff(after[name] - before[name], layer.scale * (b_bar @ a_bar - b0 @ a0)) > 1e-5
            assert torch.equal(out[layer.b_key], theta[layer.b_key]) and torch.equal(out[layer.a_key], theta[layer.a_key])
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = sum(nf4_bytes(t.numel()) for t in starts[0][1].values())
    sync = 4 * sum(t.numel() for t in starts[0][1].values()) + plan  # the third client: (B̄, Ā) in fp32, (B_s, A_s)
    for line in lines:
        assert {int(c): b for c, b in line["bytes_down"].items()} == {c: plan if c in line["clients"] else sync
                                                                      for c in range(3)}


@pytest.mark.parametrize("name,args", [("fedavgm", {"server_momentum": 0.9}), ("fedadagrad", {}), ("fedyogi", {}),
                                       ("fedadam", {})])
def test_download_compression_fedopt_steps_from_what_the_clients_received(name, args):
    """Every server optimiser measures Δ from the received state: with the download ``θ_s`` handed over, the step
    and moments equal those of a server whose θ is ``θ_s`` itself, over two rounds."""
    gen = torch.Generator().manual_seed(0)
    theta = {"a": torch.randn(6, 70, generator=gen), "b": torch.randn(70, generator=gen)}
    compressed, reference = get_strategy(name, **args), get_strategy(name, **args)
    for rnd in (1, 2):
        received = {k: nf4_round_trip(v) for k, v in theta.items()}
        ups = [ClientUpdate(c, {k: r + 0.01 * torch.randn(r.shape, generator=gen) for k, r in received.items()},
                            10 + c, 0.0, 1) for c in range(3)]
        compressed.downloaded = received
        got = compressed.aggregate(rnd, theta, ups)
        want = reference.aggregate(rnd, received, ups)
        for k, before in theta.items():
            assert max_diff(got[k] - before, want[k] - received[k]) <= 1e-6, (rnd, k)
        theta = got
    assert compressed.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(compressed.state_dict()[k], reference.state_dict()[k]) for k in reference.state_dict())


def test_download_compression_fedloru_resume_is_bit_exact_and_an_accumulation_drops_the_residual(tmp_path, arith_file):
    """FedLoRU (τ = 2, ``reinit: random``) with both directions compressed: the accumulation after round 2 re-draws A
    and zeroes B, so the server's download residual of both restarts (none in round 2's checkpoint, all in round
    1's); the merge reaches every client as fp32 factors; a run cut in round 3 and resumed ends bit for bit as one
    that was not."""
    raw = tiny_raw(tmp_path / "whole", arith_file, federation={
        "strategy": "fedloru", "strategy_args": {"tau": 2}, "rounds": 3,
        "compression": {"upload": "int8", "download": "nf4"}}, checkpoint={"every": 1})
    whole = run(parse_recipe(raw))
    ckpt = whole.run_dir / "checkpoints"
    first, second = (load_file(str(ckpt / f"round-000{r}" / "strategy.safetensors")) for r in (1, 2))
    assert sorted(k for k in first if k.startswith("compression/")) == sorted(f"compression/{k}"
                                                                            for k in whole.global_state)
    assert not [k for k in second if k.startswith("compression/")]
    numel = [t.numel() for t in whole.global_state.values()]
    plan, merge = sum(nf4_bytes(n) for n in numel), 4 * sum(numel)
    for line in whole.history:
        extra = merge if line["round"] == 2 else 0
        assert {int(c): b for c, b in line["bytes_down"].items()} == {
            c: (plan if c in line["clients"] else 0) + extra for c in range(3) if c in line["clients"] or extra}
        assert set(line["bytes_up"].values()) == {sum(n + 4 * math.ceil(n / BLOCK) for n in numel)}
    cut = {**raw, "output_dir": str(tmp_path / "cut")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RoundLoop, "run_round", crashing_round(RoundLoop.run_round, 3))
        with pytest.raises(RuntimeError, match="power cut"):
            run(parse_recipe(cut))
    resumed = run(parse_recipe(cut), resume=True)
    for part in ("adapter", "clients", "strategy", "base"):
        a = load_file(str(whole.run_dir / "final" / f"{part}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{part}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_download_compression_frlora_on_flower_matches_the_simulation(tiny_recipe, tmp_path, monkeypatch):
    """Over the Flower apps (loopback grid, real ClientApp): FRLoRA with an nf4 download carries codes and absmax in
    its plans, and the server's model, base, download residual and bytes, and every node's base rebuilt from the
    merges it replayed (with each round's compressed download), equal the simulation's bit for bit."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower import records
    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes, parts

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 2, "strategy": "frlora",
                                  "compression": {"download": "nf4"}})
    sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")}))
    grid = LoopbackGrid(nodes(tmp_path, 3))
    flower = run(parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}), executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    for part in ("adapter", "base", "strategy"):
        assert_close(expected[part], got[part], part, tol=0)
    assert any(k.startswith("compression/") for k in got["strategy"])
    for cid in range(3):  # every node, participating or not, ends with the server's base
        assert_close(expected["base"], node_state(tmp_path, cid)["base"], f"base on node {cid}", tol=0)
    assert [h["bytes_up"] for h in flower.history] == [h["bytes_up"] for h in sim.history]
    catch_up = [n for m in grid.messages for n in m.content.array_records if n.startswith("sync.")]
    assert catch_up  # a node replaying a round's merge was sent that round's compressed download (codes, absmax)
    assert all(any(k.startswith("download/") and k.endswith("/codes") for k in
                   records.decode(m.content.array_records[n])) for m in grid.messages for n in m.content.array_records
               if n.startswith("sync."))
    sent = [m.content.array_records["plan.packed"] for m in grid.messages if m.metadata.message_type == "train"]
    assert len(sent) == 4 and all({n.rsplit("|", 1)[1]: str(t.dtype).removeprefix("torch.")
                                   for n, t in records.decode(r).items()} ==
                                  {"codes": "uint8", "absmax": "float32"} for r in sent)


@pytest.mark.parametrize("name", ["frlora", "frlora_v2", "frlora_v3"])
def test_download_compression_frlora_variants_move_the_model_by_the_progress_from_the_received_factors(name):
    """FRLoRA and its re-initialising ablations with the round's download handed over: the model after the merge,
    ``Ŵ^t + s·B_next·A_next``, is the model before the round plus the clients' progress from what they received,
    ``Ŵ^{t−1} + s·B·A + s·(B̄Ā − B_s·A_s)`` (v3's re-SVD and v2's draw only choose ``B_next, A_next``); v2 and v3 drop
    the download residual of the adapter they replace, FRLoRA keeps that of its fixed start."""
    from fedllm.models.loading import read_state
    from tests.strategies.strategy_helpers import make_strategy, tiny

    model = tiny().model
    strategy = make_strategy(name, model)
    keys = [k for layer in strategy.layers.values() for k in (layer.a_key, layer.b_key)]
    theta = read_state(model, keys)
    gen = torch.Generator().manual_seed(1)
    bar = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in theta.items()}
    before = {n: layer.base.weight.detach().double().clone() for n, layer in strategy.layers.items()}
    strategy.downloaded = {k: nf4_round_trip(v) for k, v in theta.items()}
    out = strategy.after_aggregate(1, model, bar)
    for n, layer in strategy.layers.items():
        s = layer.scale
        b, a, b_s, a_s = (d[k].double() for d, k in ((theta, layer.b_key), (theta, layer.a_key),
                                                     (strategy.downloaded, layer.b_key),
                                                     (strategy.downloaded, layer.a_key)))
        want = before[n] + s * b @ a + s * (bar[layer.b_key].double() @ bar[layer.a_key].double() - b_s @ a_s)
        got = layer.base.weight.double() + s * out[layer.b_key].double() @ out[layer.a_key].double()
        assert max_diff(got, want) <= 1e-5, n
    assert strategy.reinitialised_at(1) == ([] if name == "frlora" else keys)


def test_download_compression_mfedloru_rebuilds_nested_clients_on_the_received_factors():
    """mFedLoRU (seed 003, App. C.3, Eq. 82): a nested client's ``A_k = A_s + α·A_d·A_u`` and ``B_k = B_s + α·B_d·B_u``
    on the ``(A_s, B_s)`` it received (the dequantised download), not the server's own copy."""
    from fedllm.models.loading import read_state
    from tests.strategies.strategy_helpers import make_strategy, tiny

    model = tiny().model
    strategy = make_strategy("mfedloru", model, client_ranks=[2, 4, 4], nested_scale=0.5)
    keys = [k for layer in strategy.layers.values() for k in (layer.a_key, layer.b_key)]
    theta = read_state(model, keys)
    gen = torch.Generator().manual_seed(2)
    received = {k: nf4_round_trip(v + 0.01 * torch.randn(v.shape, generator=gen)) for k, v in theta.items()}
    parts = {}
    for name, layer in strategy.layers.items():
        (out, inp), r = layer.shape, layer.rank
        for part, shape in (("a_down", (r, 2)), ("a_up", (2, inp)), ("b_down", (out, 2)), ("b_up", (2, r))):
            parts[f"{name}.mfedloru.{part}"] = torch.randn(shape, generator=gen)
    strategy.downloaded = received
    rebuilt = strategy.rebuild(theta, ClientUpdate(0, parts, 10, 0.0, 1)).state
    for name, layer in strategy.layers.items():
        p = {part: parts[f"{name}.mfedloru.{part}"].double() for part in ("a_down", "a_up", "b_down", "b_up")}
        assert max_diff(rebuilt[layer.a_key], received[layer.a_key].double() + 0.5 * p["a_down"] @ p["a_up"]) <= 1e-6
        assert max_diff(rebuilt[layer.b_key], received[layer.b_key].double() + 0.5 * p["b_down"] @ p["b_up"]) <= 1e-6
        assert max_diff(rebuilt[layer.a_key], theta[layer.a_key]) > 1e-4  # the server's A is not what it started from


@pytest.mark.parametrize("name,args", [("flora", {}), ("pfedloru", {"tau": 1, "personal_r": 2, "personal_steps": 1})])
def test_download_compression_redrawn_adapter_keeps_no_download_residual(name, args, tmp_path, arith_file):
    """FLoRA re-draws the adapter every round, pFedLoRU (τ = 1) accumulates and re-initialises it every round
    (``B = 0``): the download residual restarts each round, so no checkpoint holds one, and each round's plan still
    travels as nf4 codes beside the fp32 factors every client merges (FLoRA's stack of two clients' rank-r factors,
    pFedLoRU's ``(B, A)``)."""
    raw = tiny_raw(tmp_path / "run", arith_file, federation={
        "strategy": name, "strategy_args": args, "rounds": 2, "compression": {"download": "nf4"}},
        checkpoint={"every": 1})
    result = run(parse_recipe(raw))
    for kept in (result.run_dir / "checkpoints" / "round-0001", result.run_dir / "final"):  # (written when not empty)
        state = load_file(str(kept / "strategy.safetensors")) if (kept / "strategy.safetensors").exists() else {}
        assert not [k for k in state if k.startswith("compression/")]  # FedAvg's run keeps one per tensor
    numel = [t.numel() for t in result.global_state.values()]
    plan, stack = sum(nf4_bytes(n) for n in numel), 4 * (2 if name == "flora" else 1) * sum(numel)
    for line in result.history:
        assert {int(c): b for c, b in line["bytes_down"].items()} == {
            c: (plan if c in line["clients"] else 0) + stack for c in range(3)}
