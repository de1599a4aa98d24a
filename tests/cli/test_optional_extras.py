"""A recipe feature whose optional extra is missing is refused at recipe load, with the line that installs it; a run
that fails before its first round leaves nothing that blocks the same command."""

import configparser
import json
import re
import subprocess
import sys

from tests.cli.conftest import ROOT, clean_env

# Makes the modules named in argv[2] (comma-separated) unimportable, as on a machine without the extra, then runs
# ``main(argv)`` for every case of argv[1]: exit code, stderr, CPU and wall seconds, and whether the engine loaded.
BATCH = """
import contextlib, io, json, sys, time

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in sys.argv[2].split(","):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
from fedllm.commands.cli import main
report = []
for name, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    cpu, wall = time.process_time(), time.monotonic()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    report.append({"name": name, "code": code, "stderr": err.getvalue(), "cpu": time.process_time() - cpu,
                   "wall": time.monotonic() - wall, "engine": "fedllm.engine.server" in sys.modules})
print("@@BATCH@@" + json.dumps(report))
"""

MISSING = ("dp_accounting", "opacus", "bitsandbytes", "lm_eval", "fastchat", "tensorboard", "wandb", "mlflow", "trackio")

CASES = [  # (name, overrides, the key reported, the extra named)
    ("central-dp", ["privacy.mechanism=central", "privacy.noise_multiplier=1.0"], "privacy.mechanism", "privacy"),
    ("dp-sgd", ["privacy.mechanism=dp_sgd", "privacy.noise_multiplier=1.0"], "privacy.mechanism", "privacy"),
    ("upload-int8", ["federation.compression.upload=int8"], "federation.compression.upload", "quant"),
    ("download-nf4", ["federation.compression.download=nf4"], "federation.compression.download", "quant"),
    ("qlora", ["model.quantization=4bit"], "model.quantization", "quant"),
    ("lm-eval-task", ["eval.tasks=[lm_eval:arc_easy]"], "eval.tasks", "eval"),
    ("fastchat-eval", ["eval.tasks=[held_out]", "data.eval_fraction=0.25", "eval.chat_template=vicuna_v1.1"],
     "eval.chat_template", "fastchat"),
    ("tensorboard", ["logging.report_to=[tensorboard]"], "logging.report_to[0]", "tracking"),
    ("wandb", ["logging.report_to=[wandb]"], "logging.report_to[0]", "tracking"),
    ("mlflow", ["logging.report_to=[mlflow]"], "logging.report_to[0]", "tracking"),
    ("trackio", ["logging.report_to=[trackio]"], "logging.report_to[0]", "tracking"),
]


def run_batch(cases, cwd, missing=MISSING):
    out = subprocess.run([sys.executable, "-c", BATCH, json.dumps(cases), ",".join(missing)], capture_output=True,
                         text=True, env=clean_env(), cwd=cwd, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("@@BATCH@@")]
    assert lines, out.stderr[-3000:]
    return {r["name"]: r for r in json.loads(lines[-1][len("@@BATCH@@"):])}


def test_every_feature_of_an_optional_extra_is_refused_at_once_with_its_install_line(tmp_path, arith_file):
    (tmp_path / "recipe.yaml").write_text(
        f"output_dir: {tmp_path / 'run'}\nmodel: {{name: tiny-llama}}\nlora: {{r: 4}}\n"
        f"data: {{path: {arith_file}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3, clients_per_round: 2, rounds: 1}\ntrain: {local_steps: 1}\n")
    for dry in (False, True):
        cases = [(name, ["train", "recipe.yaml", *overrides, *(["--dry-run"] if dry else [])])
                 for name, overrides, _, _ in CASES]
        got = run_batch(cases, tmp_path)
        for name, overrides, key, extra in CASES:
            said = " ".join(got[name]["stderr"].split())
            assert got[name]["code"] == 2, (name, said)
            assert not got[name]["engine"], (name, said)  # refused before the round loop (and the model) loaded
            assert got[name]["cpu"] < 10, (name, got[name]["cpu"])
            assert f'- {key}: got' in said and f"fedllm's [{extra}] extra" in said, (name, said)
            assert f'pip install -e ".[{extra}]"' in said, (name, said)
            if key == "privacy.mechanism":  # central DP's accountant is dp-accounting's; DP-SGD's is opacus's
                module = "opacus" if name == "dp-sgd" else "dp_accounting"
                assert f"the {module!r} module is not installed" in said and said.count("extra") == 1, said
        assert not (tmp_path / "run").exists()  # nothing written


def test_the_same_recipes_pass_their_extra_check_when_the_packages_are_there():
    """The check asks the import system's finders: a blocked module (fedllm blocks bitsandbytes until a recipe
    quantises) still counts as installed; a module no finder has does not."""
    from fedllm.common import logs
    from fedllm.recipe.extras_checks import installed

    assert installed("json") and not installed("no_such_module_fedllm_tests")
    blocked = logs.block_bitsandbytes()
    try:
        assert sys.modules.get("bitsandbytes") is None or not blocked
        assert installed("bitsandbytes")
    finally:
        if blocked:
            logs.unblock_bitsandbytes()


def test_every_optional_extra_that_a_recipe_can_need_is_checked():
    """The extras of setup.cfg against the checks: each is checked at recipe load, or is no recipe feature (gemma:
    weights found by find_spec; flower: ``fedllm flower`` names it; dev: the tests' tools; docs: the site's build), or is not
    imported by fedllm at all (trl)."""
    from fedllm.recipe.extras_checks import NEEDS

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    assert {extra for extra, *_ in NEEDS} == extras - {"gemma", "flower", "dev", "trl", "docs"}
    sources = "\n".join(p.read_text() for p in (ROOT / "fedllm").rglob("*.py"))
    assert not re.search(r"^\s*(import trl|from trl\b)", sources, re.MULTILINE)
    for extra, module, _, _ in NEEDS:  # each module is one of the extra's packages
        packages = cfg["options.extras_require"][extra]
        assert module.replace("_", "-").split(".")[0][:5] in packages.replace("_", "-").replace("fschat", "fastchat")


def test_a_run_that_fails_before_its_first_round_leaves_nothing_that_blocks_the_same_command(
        tmp_path, arith_file, monkeypatch, capsys):
    """Round 1 fails: the run directory this attempt created (and its parents) are gone and the same command then
    runs; a failure after a finished round keeps the run (it resumes)."""
    from fedllm.commands.cli import main
    from fedllm.engine.server import RoundLoop
    from tests.conftest import crashing_round

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "runs" / "deep" / "run"
    recipe.write_text(
        f"output_dir: {out}\nmodel: {{name: tiny-llama}}\nlora: {{r: 4}}\n"
        f"data: {{path: {arith_file}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3, clients_per_round: 2, rounds: 2}\n"
        "train: {local_steps: 1, batch_size: 2, max_length: 32, dtype: fp32}\nlogging: {progress: false}\n")
    original = RoundLoop.run_round
    monkeypatch.setattr(RoundLoop, "run_round", crashing_round(original, 1))
    assert main(["train", str(recipe)]) == 1
    assert "power cut" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # the run directory and the parents this attempt made
    assert (tmp_path / "mine" / "keep.txt").read_text() == "mine"
    monkeypatch.setattr(RoundLoop, "run_round", crashing_round(original, 2))
    assert main(["train", str(recipe)]) == 1  # the same command runs; round 1 finishes, round 2 fails
    assert (out / "metrics.jsonl").read_text().strip()  # kept: it resumes
    capsys.readouterr()
    monkeypatch.setattr(RoundLoop, "run_round", original)
    assert main(["train", str(recipe), "--resume"]) == 0
    assert capsys.readouterr().out.strip() == str(out)


def test_a_run_into_a_directory_the_user_made_is_never_removed(tmp_path, arith_file, monkeypatch, capsys):
    """An output_dir that existed before (empty) is the user's: a failed first round leaves it (and fedllm's
    files, so the message's resume hint holds)."""
    from fedllm.commands.cli import main
    from fedllm.engine.server import RoundLoop
    from tests.conftest import crashing_round

    out = tmp_path / "made"
    out.mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {out}\nmodel: {{name: tiny-llama}}\nlora: {{r: 4}}\n"
        f"data: {{path: {arith_file}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3, clients_per_round: 2, rounds: 1}\n"
        "train: {local_steps: 1, batch_size: 2, max_length: 32, dtype: fp32}\nlogging: {progress: false}\n")
    monkeypatch.setattr(RoundLoop, "run_round", crashing_round(RoundLoop.run_round, 1))
    assert main(["train", str(recipe)]) == 1
    assert out.is_dir()
