"""The round loop end to end on tiny models: training, outputs, checkpoints, resume, errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedllm.commands.cli import main
from fedllm.engine.server import round_lr, run, sample_clients
from fedllm.recipe.checks import parse_recipe
from fedllm.runs import checkpoint as ckpt_io
from tests.conftest import cut_and_resume


def test_one_round_changes_the_weights_and_writes_the_run_dir(tiny_recipe):
    recipe = parse_recipe(tiny_recipe(federation={"rounds": 1}))
    result = run(recipe)
    before = parse_recipe(tiny_recipe())
    from fedllm.models.loading import load_model, read_state

    init = read_state(load_model(before.model, before.lora, seed=0).model, result.global_state.keys())
    lora_b = [k for k in result.global_state if "lora_B" in k]
    lora_a = [k for k in result.global_state if "lora_A" in k]
    assert all(torch.count_nonzero(init[k]) == 0 for k in lora_b)  # LoRA B starts at zero ...
    assert all(torch.count_nonzero(result.global_state[k]) > 0 for k in lora_b)  # ... and trained away from it
    assert any(not torch.equal(init[k], result.global_state[k]) for k in lora_a)
    run_dir = result.run_dir
    for name in ("recipe.yaml", "metrics.jsonl", "partition.json", "summary.json", "final/adapter.safetensors"):
        assert (run_dir / name).exists(), name
    (line,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["round"] == 1 and len(line["clients"]) == 2
    assert set(line["client_loss"]) == {str(c) for c in line["clients"]}
    lora_bytes = sum(v.numel() * 4 for v in result.global_state.values())
    assert line["bytes_up"] == {str(c): lora_bytes for c in line["clients"]}
    assert line["bytes_down_total"] == 2 * lora_bytes
    saved = load_file(str(run_dir / "final" / "adapter.safetensors"))
    assert all(torch.equal(saved[k], result.global_state[k]) for k in saved)


def test_comm_dtype_halves_the_bytes(tiny_recipe):
    fp32 = run(parse_recipe(tiny_recipe(federation={"rounds": 1}), overrides=["output_dir=" + tiny_recipe()["output_dir"] + "32"]))
    bf16 = run(parse_recipe(tiny_recipe(federation={"rounds": 1, "comm_dtype": "bf16"})))
    assert bf16.history[0]["bytes_up_total"] * 2 == fp32.history[0]["bytes_up_total"]


def test_sampling_and_schedule():
    assert sample_clients(0, 1, 10, 3) == sample_clients(0, 1, 10, 3)
    draws = {tuple(sample_clients(0, r, 10, 3)) for r in range(1, 20)}
    assert len(draws) > 5 and all(len(d) == 3 and len(set(d)) == 3 for d in draws)
    recipe = parse_recipe({"data": {"path": "x"}, "train": {"local_steps": 1, "lr": 1.0, "min_lr": 0.0,
                                                            "lr_schedule": "cosine"}, "federation": {"rounds": 5}})
    assert [round(round_lr(recipe, r), 6) for r in range(1, 6)] == [1.0, 0.853553, 0.5, 0.146447, 0.0]


def _final_state(run_dir):
    return load_file(str(run_dir / "final" / "adapter.safetensors"))


def test_resume_is_bit_exact(tiny_recipe, tmp_path, crash_at_round):
    full = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "full"), federation={"rounds": 3},
                                        checkpoint={"every": 1})))
    recipe = parse_recipe(tiny_recipe(output_dir=str(tmp_path / "cut"), federation={"rounds": 3},
                                      checkpoint={"every": 1}))
    resumed = cut_and_resume(recipe, crash_at_round)
    a, b = _final_state(full.run_dir), _final_state(resumed.run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3]
    full_lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [x["client_loss"] for x in lines] == [x["client_loss"] for x in full_lines]


def test_a_crash_while_writing_leaves_no_torn_checkpoint(tiny_recipe, tmp_path, monkeypatch):
    recipe = parse_recipe(tiny_recipe(federation={"rounds": 3}, checkpoint={"every": 1}))
    real_save = ckpt_io.save_file
    calls = {"n": 0}

    def failing_save(tensors, path):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint dies half-way
            real_save(tensors, path)
            raise OSError("disk full")
        return real_save(tensors, path)

    monkeypatch.setattr(ckpt_io, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        run(recipe)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["round-0001"]  # no temp leftovers, no round-0002
    assert ckpt_io.is_checkpoint(root / "round-0001")


def test_refuses_to_overwrite_a_run_without_flags(tiny_recipe):
    recipe = parse_recipe(tiny_recipe(federation={"rounds": 1}))
    run(recipe)
    from fedllm.engine.server import RunDirError

    with pytest.raises(RunDirError, match="--resume"):
        run(recipe)
    with pytest.raises(RunDirError, match="already finished"):
        run(recipe, resume=True)
    run(recipe, overwrite=True)


def test_per_client_optimizer_state_resumes(tiny_recipe, tmp_path):
    raw = tiny_recipe(federation={"rounds": 2, "clients_per_round": 3},
                      train={"optimizer_state": "per_client"}, checkpoint={"every": 1})
    result = run(parse_recipe(raw))
    ck = ckpt_io.load_checkpoint(ckpt_io.round_dir(result.run_dir, 1))
    assert any(k.startswith("client2/optimizer/") and k.endswith("::exp_avg") for k in ck.clients)


def test_classifier_head_is_trained_and_aggregated(tmp_path):
    rows = [{"text": f"good movie {i}" if i % 2 else f"bad film {i}", "label": i % 2} for i in range(24)]
    path = tmp_path / "cls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = parse_recipe({
        "output_dir": str(tmp_path / "run"), "model": {"name": "tiny-roberta"}, "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(path), "format": "classification"},
        "federation": {"num_clients": 2, "rounds": 1, "partition": {"method": "iid"}},
        "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 32},
        "logging": {"quiet": True}})
    result = run(recipe)
    head = [k for k in result.global_state if "classifier" in k and "modules_to_save" in k]
    assert head, "the classifier head is part of the global state"
    from fedllm.models.loading import load_model, read_state

    init = read_state(load_model(recipe.model, recipe.lora, num_labels=2, seed=0).model, head)
    assert any(not torch.equal(init[k], result.global_state[k]) for k in head)


def test_cli_reports_every_problem_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    out = tmp_path / "out"
    bad.write_text(f"output_dir: {out}\nlora: {{r: 0}}\nfederation: {{num_clients: 2, clients_per_round: 3}}\n"
                   "data: {path: x.jsonl}\ntrain: {local_steps: 1, batch_sise: 2}\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "train.batch_sise" in err
    assert main(["train", str(bad), "train.batch_sise=", "lora.r=0"]) == 2
    assert not out.exists()


def test_cli_errors_on_input_are_exit_2(tiny_recipe, tmp_path, capsys):
    import yaml

    raw = tiny_recipe(federation={"num_clients": 100, "clients_per_round": 2})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 2
    assert "100" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["train", str(path), "federation.num_clients=3", "data.path=/nonexistent/data.jsonl"]) == 2
    assert "/nonexistent/data.jsonl" in capsys.readouterr().err
    assert main(["train", str(path), "federation.num_clients=3", "lora.r=100"]) == 2
    assert "lora.r" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["train", str(path), "federation.num_clients=3", "federation.rounds=1"]) == 0
    assert (tmp_path / "run" / "final").is_dir()
