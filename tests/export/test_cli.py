"""`fedllm export` on the command line: the model card, dtype, sources, and every bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedllm.commands.cli import main
from fedllm.engine.server import run
from fedllm.export import ExportCheckError, ExportInputError, export
from fedllm.recipe.checks import parse_recipe
from fedllm.runs import checkpoint as ckpt_io


def _no_leftovers(parent, name):
    return not [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_cli_writes_a_model_card_with_the_run_and_the_exact_command(tiny_recipe, tmp_path, capsys):
    result = run(parse_recipe(tiny_recipe(checkpoint={"every": 1})))
    out = tmp_path / "exports" / "merged"
    assert main(["export", str(result.run_dir), "--format", "merged", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out)
    assert "Writing model shards" not in printed.err
    card = (out / "README.md").read_text()
    # the prompt the model was trained on (Alpaca instruction data), which fedllm serve uses by default
    assert "## Prompt format" in card and "### Instruction:\n{instruction}\n\n### Response:" in card
    assert json.loads((out / "export.json").read_text())["prompt_style"] == "alpaca"
    from fedllm.commands.serve import run_prompt_style

    assert run_prompt_style(str(out)) == run_prompt_style(str(result.run_dir)) == "alpaca"
    command = f"fedllm export {result.run_dir} --format merged --out {out}"
    assert f"```bash\n{command}\n```" in card
    assert json.loads((out / "export.json").read_text())["command"] == command
    history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for text in ("library_name: transformers", "`fedavg`", "2 of 2", "3, 2 per round", tiny_recipe()["data"]["path"],
                 f"train loss (round 2): {history[-1]['train_loss']:.6g}", "summary.json", "output_dir:",
                 "AutoModelForCausalLM.from_pretrained"):
        assert text in card, text
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "README.md", "chat_template.jinja", "config.json", "export.json", "generation_config.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    assert _no_leftovers(out.parent, out.name)
    # a round checkpoint exports that round, with that round's metrics
    first = tmp_path / "exports" / "round1"
    assert main(["export", str(result.run_dir / "checkpoints" / "round-0001"), "--format", "adapter",
                 "--out", str(first), "--dtype", "bf16", "--with-base"]) == 0
    card = (first / "README.md").read_text()
    assert "(round 1)" in card and f"train loss (round 1): {history[0]['train_loss']:.6g}" in card
    assert "summary.json" not in card and f"from_pretrained({str(first.resolve() / 'base')!r})" in card
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(first / "adapter_model.safetensors")).values())
    assert (first / "base" / "model.safetensors").is_file()


def test_dtype_option_saves_half_precision_weights(cases, tmp_path):
    out = tmp_path / "bf16"
    export(cases["fedavg"].run_dir, "merged", out, dtype="bf16")
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_overwrite_replaces_and_refuses_without_the_flag(cases, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    args = ["export", str(cases["fedavg"].run_dir), "--format", "adapter", "--out", str(out)]
    assert main(args) == 2  # not an export: --overwrite would be refused too, so it is not what the error offers
    said = capsys.readouterr().err
    assert "already exists and is not empty, and it is not a fedllm export" in said and "pick another --out" in said
    assert "pass --overwrite" not in said and (out / "old.txt").read_text() == "keep me"
    assert main(args + ["--overwrite"]) == 2  # fedllm deletes only what it created
    assert "not a fedllm export" in capsys.readouterr().err and (out / "old.txt").read_text() == "keep me"
    (out / "old.txt").unlink()
    assert main(args) == 0
    assert main(args) == 2  # an earlier export: --overwrite is the way
    assert "already exists and is not empty; pass --overwrite to replace it" in capsys.readouterr().err
    (out / "stale.txt").write_text("from an earlier export")
    assert main(args + ["--overwrite"]) == 0  # an earlier export is replaced
    assert not (out / "stale.txt").exists() and (out / "adapter_model.safetensors").is_file()
    assert _no_leftovers(tmp_path, "out")


def _torn_copies(run_dir, tmp_path):
    final = run_dir / "final"
    made = {}
    for name in ("truncated", "bad_meta", "no_recipe", "foreign_keys", "no_adapter"):
        made[name] = tmp_path / name
        shutil.copytree(final, made[name])
    data = (final / "adapter.safetensors").read_bytes()
    (made["truncated"] / "adapter.safetensors").write_bytes(data[: len(data) // 2])
    (made["bad_meta"] / "meta.json").write_text("{not json")
    (made["no_recipe"] / "recipe.yaml").unlink()
    state = load_file(str(final / "adapter.safetensors"))
    save_file({k.replace("q_proj", "w_proj"): v for k, v in state.items()},
              str(made["foreign_keys"] / "adapter.safetensors"))
    ckpt_io.write_manifest(made["foreign_keys"])  # consistent files that do not fit the recipe's model
    (made["no_adapter"] / "adapter.safetensors").unlink()
    return made


def test_torn_or_foreign_sources_fail_clearly_and_write_nothing(cases, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.bin").write_bytes(b"\0" * 16)
    sources = {"missing": tmp_path / "nope", "foreign": foreign, **_torn_copies(cases["fedavg"].run_dir, tmp_path)}
    expected = {"missing": "no such", "foreign": "neither a run directory",
                "truncated": "truncated/adapter.safetensors: ", "bad_meta": "meta.json: 9 bytes, the manifest says",
                "no_recipe": "recipe.yaml: missing", "foreign_keys": "does not fit",
                "no_adapter": "torn checkpoint"}
    for name, source in sources.items():
        out = tmp_path / "exports" / name
        assert main(["export", str(source), "--format", "merged", "--out", str(out)]) == 2, name
        assert expected[name] in capsys.readouterr().err, name
        assert not out.exists(), name
    assert not (tmp_path / "exports").exists() or not list((tmp_path / "exports").iterdir())


def test_bad_options_fail_before_anything_is_written(cases, tmp_path, capsys):
    fedavg, personal = str(cases["fedavg"].run_dir), str(cases["pfedloru"].run_dir)
    out = str(tmp_path / "out")
    bad = {
        "above the size of layer model.layers.0.self_attn.k_proj (32 x 64)":
            [fedavg, "--format", "adapter", "--rank", "33"],
        "--rank 0": [fedavg, "--format", "adapter", "--rank", "0"],
        "applies to --format adapter": [fedavg, "--format", "merged", "--rank", "2"],
        "--with-base applies": [fedavg, "--format", "merged", "--with-base"],
        "is not personalized": [fedavg, "--format", "adapter", "--client", "1"],
        "clients 0..2": [personal, "--format", "adapter", "--client", "7"],
        "would replace the run": [fedavg, "--format", "merged", "--out", fedavg],
        "inside the checkpoint": [fedavg, "--format", "merged", "--out", fedavg + "/final/x"],
    }
    for message, args in bad.items():
        argv = ["export", *args] + ([] if "--out" in args else ["--out", out])
        assert main(argv) == 2, message
        assert message in capsys.readouterr().err, message
        assert not (tmp_path / "out").exists() and _no_leftovers(tmp_path, "out")
    with pytest.raises(SystemExit) as exit_:
        main(["export", fedavg, "--format", "onnx", "--out", out])
    assert exit_.value.code == 2 and "invalid choice: 'onnx'" in capsys.readouterr().err
    with pytest.raises(ExportInputError, match="--format 'onnx'"):
        export(fedavg, "onnx", out)


def test_a_failure_half_way_leaves_nothing_and_keeps_the_old_export(cases, tmp_path, monkeypatch):
    from fedllm.export import api

    out = tmp_path / "out"
    export(cases["fedavg"].run_dir, "merged", out)
    before = sorted(p.name for p in out.iterdir())

    def dies_half_way(model, tokenizer, strategy, source, where, *args):
        (where / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(api, "write_adapter", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        export(cases["fedavg"].run_dir, "adapter", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before and _no_leftovers(tmp_path, "out")


def test_an_export_that_misses_part_of_the_model_is_refused(cases, tmp_path, monkeypatch, capsys):
    from fedllm.export.weights import LayerState

    monkeypatch.setattr(LayerState, "merged_weight", lambda self: self.base.float())  # drop the learned change
    out = tmp_path / "out"
    with pytest.raises(ExportCheckError, match="does not reproduce"):
        export(cases["fedavg"].run_dir, "merged", out)
    assert main(["export", str(cases["fedavg"].run_dir), "--format", "merged", "--out", str(out)]) == 1
    assert "ExportCheckError" in capsys.readouterr().err
    assert not out.exists() and _no_leftovers(tmp_path, "out")


def test_model_card_lists_the_runs_final_evaluation(cases, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cases["pfedloru"].run_dir, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["eval"] = {"gsm8k/accuracy": 0.25}
    rows[-1]["personal_eval"] = {"1": {"gsm8k/accuracy": 0.75}}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    export(run_dir, "adapter", tmp_path / "out", client=1)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "global model after round 2:\n  - gsm8k/accuracy: 0.25" in card
    assert "client 1's model on its own data after round 2:\n  - gsm8k/accuracy: 0.75" in card
    assert "LoRA adapter: pfedloru on tiny-llama — client 1" in card
