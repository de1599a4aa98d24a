"""The CLI answers without importing torch/transformers/peft/datasets; --version; helpful errors."""

import pytest

from fedllm import __version__

HELPS = ["train", "eval", "export", "partition", "plot", "serve"]
# Run in the ``fedllm --help`` process after the entry point: each subcommand's --help through the same entry point,
# its exit code and output recorded (one launch for all: nothing heavy in sys.modules after all of them).
SUBCOMMAND_HELPS = ("import contextlib, io\n"
                    "extra['helps'] = {}\n"
                    f"for name in {HELPS!r}:\n"
                    "    buf = io.StringIO()\n"
                    "    with contextlib.redirect_stdout(buf):\n"
                    "        try:\n"
                    "            got = main([name, '--help'])\n"
                    "        except SystemExit as e:\n"
                    "            got = e.code\n"
                    "    extra['helps'][name] = [got, buf.getvalue()]\n")


def test_help_imports_no_heavy_library(probe):
    report, out, _ = probe("--help", after=SUBCOMMAND_HELPS)
    assert report["code"] == 0
    assert "usage: fedllm" in out
    assert list(report["extra"]["helps"]) == HELPS
    for name, (code, text) in report["extra"]["helps"].items():
        assert code == 0 and f"usage: fedllm {name}" in text, name
    assert report["heavy"] == []  # after the top-level help and every subcommand's


def test_version(probe):
    report, out, _ = probe("--version")
    assert report["code"] == 0 and out.strip() == f"fedllm {__version__}"
    assert report["heavy"] == []


def test_recipe_errors_come_back_without_torch_and_suggest(probe, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: {name: tiny-llama}\n"
                      "data: {path: data/missing.jsonl}\n"
                      "federation: {strategy: fedavgg, partition: {method: dirichle}}\n"
                      "train: {local_steps: 2}\n"
                      "eval: {tasks: [gsm8]}\n"
                      "logging: {report_to: [tensorbord]}\n")
    report, _, err = probe("train", str(recipe))
    assert report["code"] == 2 and report["heavy"] == []
    assert f"{recipe}: 5 problem(s)" in err
    assert "federation.strategy: got 'fedavgg'" in err and "(did you mean 'fedavg'" in err
    assert "(did you mean 'dirichlet'?)" in err and "(did you mean 'gsm8k'?)" in err
    assert "logging.report_to[0]: got 'tensorbord'" in err and "(did you mean 'tensorboard'?)" in err


def test_unknown_key_suggests_the_known_one_without_torch(probe, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("data: {path: x.jsonl}\ntrain: {local_step: 2}\n")
    report, _, err = probe("train", str(recipe))
    assert report["code"] == 2 and report["heavy"] == []
    assert "train.local_step: got 2" in err and "(did you mean 'local_steps'" in err


def test_missing_data_file_names_recipe_file_and_key(probe, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: tiny-llama}\ndata: {path: ./nowhere/train.jsonl, eval_path: gone.jsonl}\n"
                      "train: {local_steps: 2}\n")
    report, _, err = probe("train", str(recipe), cwd=tmp_path)
    assert report["code"] == 2 and report["heavy"] == []
    assert f"{recipe}: 2 problem(s)" in err
    assert "data.path: got './nowhere/train.jsonl'" in err and "data.eval_path: got 'gone.jsonl'" in err


def test_missing_recipe_file_is_exit_2(probe, tmp_path):
    report, _, err = probe("train", str(tmp_path / "nope.yaml"))
    assert report["code"] == 2 and "nope.yaml" in err and report["heavy"] == []


# Run in the quiet dry run's process around the entry point (one launch for both tests).
REGISTRIES_BEFORE = ("from fedllm.common.registry import strategies, tasks, partitioners\n"
                     "extra['listed'] = ['fedavg' in strategies, 'gsm8k' in tasks, 'dirichlet' in partitioners]\n"
                     "extra['torch_after_listing'] = 'torch' in sys.modules\n")
REGISTRIES_AFTER = ("extra['fedavg_class'] = strategies.get('fedavg').__name__\n"
                    "extra['torch_after_get'] = 'torch' in sys.modules\n")


@pytest.fixture(scope="module")
def quiet_dry_run(tmp_path_factory):
    """``(recipe, report, stdout, stderr)``: ``fedllm train RECIPE --dry-run`` of a tiny recipe in a fresh process,
    the registries listed before the entry point and one strategy got after it."""
    from tests.cli.conftest import run_probe
    from tests.conftest import arith_records, write_jsonl

    tmp_path = tmp_path_factory.mktemp("quiet")
    data = write_jsonl(tmp_path / "a.jsonl", arith_records(24))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: tiny-llama}}\noutput_dir: {tmp_path / 'run'}\n"
                      f"data: {{path: {data}, fields: {{instruction: question, output: answer}}}}\n"
                      "train: {local_steps: 2, max_length: 48}\n")
    return (recipe, *run_probe("train", str(recipe), "--dry-run", before=REGISTRIES_BEFORE, after=REGISTRIES_AFTER))


def test_registries_list_names_without_importing_and_import_on_get(quiet_dry_run):
    _, report, _, err = quiet_dry_run
    assert report["code"] == 0, err
    assert report["extra"]["listed"] == [True, True, True]
    assert report["extra"]["torch_after_listing"] is False  # listing imported nothing heavy
    assert report["extra"]["fedavg_class"] == "FedAvg" and report["extra"]["torch_after_get"] is True


def test_registry_reads_new_files_and_suggests(tmp_path, monkeypatch):
    from fedllm.common import registry

    pkg = tmp_path / "algos"
    pkg.mkdir()
    (pkg / "mine.py").write_text('@register_strategy("fed_mine")\nclass Mine: ...\n')
    monkeypatch.setattr(registry, "PACKAGE_DIR", tmp_path)
    reg = registry.Registry("strategy", scan=("algos", "register_strategy"))
    assert reg.lazy_names() == {"fed_mine": "fedllm.algos.mine"}
    assert reg.names() == ["fed_mine"]
    with pytest.raises(KeyError, match=r"unknown strategy 'fed_mne' \(did you mean 'fed_mine'\?\)"):
        reg.get("fed_mne")


def test_every_builtin_scanned_name_registers_when_imported():
    """The static (scanned) tables agree with what the modules register."""
    from fedllm.common.registry import partitioners, strategies, tasks

    for reg in (strategies, tasks, partitioners):
        for name in reg.lazy_names():
            assert reg.get(name) is not None


def test_resume_command_is_the_exact_command():
    from fedllm.commands.cli import resume_command

    assert resume_command(["train", "my recipe.yaml", "federation.rounds=3", "--overwrite"]) == \
        "fedllm train 'my recipe.yaml' federation.rounds=3 --resume"


def test_interrupt_prints_the_resume_command(monkeypatch, capsys, tmp_path):
    from fedllm.commands import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("fedllm.commands.train.run_train_command", interrupted)
    code = cli.main(["train", str(tmp_path / "r.yaml"), "train.lr=0.1"])
    assert code == 130
    assert capsys.readouterr().err.strip().endswith(
        f"interrupted; resume with: fedllm train {tmp_path / 'r.yaml'} train.lr=0.1 --resume")


def test_quiet_by_default_and_everything_with_verbose(probe, quiet_dry_run):
    """A dry run of a tiny recipe: no third-party warnings, bitsandbytes never imported; --verbose shows them."""
    recipe, report, out, err = quiet_dry_run
    assert report["code"] == 0, err
    assert "per round:" in out
    assert not report["bitsandbytes"]
    assert "Warning" not in err and "gemm_4bit" not in err and err.strip() == ""
    report, _, err = probe("train", str(recipe), "--dry-run", "--verbose")
    assert report["code"] == 0
    assert "DEBUG fedllm.common.threads: CPU threads:" in err and "is_gradient_checkpointing" in err
