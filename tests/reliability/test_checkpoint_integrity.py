"""Damaged checkpoints: named on every load; resume falls back to the newest intact one; eval/export exit 2."""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fedllm.commands.cli import main
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from fedllm.runs import checkpoint as ckpt_io


def flip_byte(path, offset_from_end=16):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01  # inside the tensor payload (the header is at the start)
    path.write_bytes(bytes(data))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {"flipped byte": flip_byte, "truncated file": truncate}


def test_manifest_holds_the_sha256_of_every_file(finished_run):
    run_dir, _ = finished_run
    for ck in (run_dir / "final", ckpt_io.round_dir(run_dir, 1)):
        manifest = json.loads((ck / ckpt_io.MANIFEST).read_text())
        on_disk = sorted(p.name for p in ck.iterdir() if p.name != ckpt_io.MANIFEST)
        assert sorted(manifest["files"]) == on_disk
        assert {"adapter.safetensors", "meta.json", "recipe.yaml"} <= set(on_disk)
        for name, entry in manifest["files"].items():
            raw = (ck / name).read_bytes()
            assert entry == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_load_names_the_damaged_file(run_copy, kind):
    run_dir, _ = run_copy
    target = ckpt_io.round_dir(run_dir, 2) / "adapter.safetensors"
    DAMAGE[kind](target)
    with pytest.raises(ckpt_io.CheckpointError, match=str(target)):
        ckpt_io.load_checkpoint(target.parent)
    assert ckpt_io.latest_checkpoint(run_dir) == ckpt_io.round_dir(run_dir, 1)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint(run_copy, finished_run, kind, caplog):
    run_dir, raw = run_copy
    # the run died in round 3, after round-0002 was written: no final/, no summary
    shutil.rmtree(run_dir / "final")
    (run_dir / "summary.json").unlink()
    damaged = ckpt_io.round_dir(run_dir, 2) / "adapter.safetensors"
    DAMAGE[kind](damaged)
    with caplog.at_level("WARNING", logger="fedllm"):
        resumed = run(parse_recipe(raw), resume=True)
    assert f"skipping damaged checkpoint {damaged.parent}" in caplog.text and str(damaged) in caplog.text
    assert f"resuming from {ckpt_io.round_dir(run_dir, 1)}, the newest intact checkpoint" in caplog.text
    expected = load_file(str(finished_run[0] / "final" / "adapter.safetensors"))
    got = load_file(str(resumed.run_dir / "final" / "adapter.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    rounds = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    ckpt_io.verify_checkpoint(ckpt_io.round_dir(run_dir, 2))  # round 2 was written again, intact


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_eval_and_export_of_a_damaged_checkpoint_exit_2_naming_the_file(run_copy, tmp_path, kind, capsys):
    run_dir, _ = run_copy
    damaged = run_dir / "final" / "adapter.safetensors"
    DAMAGE[kind](damaged)
    for argv in (["eval", str(run_dir), "--tasks", "gsm8k", "--out", str(tmp_path / "ev")],
                 ["export", str(run_dir), "--format", "adapter", "--out", str(tmp_path / "ex")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert str(damaged) in err, err
    assert not (tmp_path / "ex").exists()


def test_final_without_meta_is_named_not_replaced_by_an_older_round(run_copy, tmp_path, capsys):
    run_dir, _ = run_copy
    (run_dir / "final" / "meta.json").unlink()
    for argv in (["eval", str(run_dir), "--tasks", "gsm8k", "--out", str(tmp_path / "ev")],
                 ["export", str(run_dir), "--format", "merged", "--out", str(tmp_path / "ex")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert str(run_dir / "final" / "meta.json") in err, err


def test_serve_loader_refuses_a_damaged_checkpoint(run_copy):
    from fedllm.export.inference import load_for_inference

    run_dir, _ = run_copy
    flip_byte(run_dir / "final" / "recipe.yaml", 3)
    with pytest.raises(ckpt_io.CheckpointError, match="recipe.yaml: sha256 does not match"):
        load_for_inference(str(run_dir))


def test_a_first_release_checkpoint_loads_unverified_but_a_missing_manifest_is_damage(run_copy, caplog):
    run_dir, _ = run_copy
    ck = ckpt_io.round_dir(run_dir, 1)
    (ck / ckpt_io.MANIFEST).unlink()
    with pytest.raises(ckpt_io.CheckpointError, match=f"{ck / ckpt_io.MANIFEST}: missing"):
        ckpt_io.load_checkpoint(ck)
    meta = json.loads((ck / "meta.json").read_text())
    (ck / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))  # as the first release wrote it
    with caplog.at_level("WARNING", logger="fedllm"):
        assert ckpt_io.load_checkpoint(ck).round == 1
    assert "cannot be verified" in caplog.text
