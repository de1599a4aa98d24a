"""Refusals that need no model come back before torch (or transformers, peft, datasets) is imported.

One fresh interpreter runs every case through fedllm's entry point in turn and reports, after each,
which heavy modules are loaded: a case that loaded the model first shows up by name, whatever the
machine's speed. The messages are checked too (what, where, the did-you-mean).

The newcomer's mistakes that come after torch is imported run in this process (they are about the model loader,
not imports: :func:`run_in_process`).
"""

import json
import os
import socket
import subprocess
import sys

from tests.cli.conftest import HEAVY, clean_env

# Runs ``main(case)`` for every case of argv[1] (a JSON list), capturing stderr and the CPU seconds per case.
BATCH = """
import contextlib, io, json, os, sys, time
from fedllm.commands.cli import main
heavy = %r
report = []
for name, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    cpu = time.process_time()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    report.append({"name": name, "code": code, "stderr": err.getvalue(), "cpu": time.process_time() - cpu,
                   "heavy": [m for m in heavy if m in sys.modules], "loader": "fedllm.engine.server" in sys.modules})
print("@@BATCH@@" + json.dumps(report))
""" % (HEAVY,)


def run_batch(cases, cwd, **env):
    out = subprocess.run([sys.executable, "-c", BATCH, json.dumps(cases)], capture_output=True, text=True,
                         env=clean_env(**env), cwd=cwd, timeout=600, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("@@BATCH@@")]
    assert lines, out.stderr[-3000:]
    return {r["name"]: r for r in json.loads(lines[-1][len("@@BATCH@@"):])}


def run_in_process(cases, cwd, monkeypatch, hf_home) -> dict[str, dict]:
    """``{name: {"code", "stderr", "cpu"}}`` of fedllm's entry point on each case, in this process, in ``cwd``, with
    a Hugging Face home ``hf_home`` (offline), and a model loader that fails (a refusal that came after it would
    exit 1 naming it); the environment and torch's threads the entry point sets are restored after."""
    import contextlib
    import io
    import time

    import torch
    from huggingface_hub import constants

    import fedllm.engine.server
    from fedllm.commands.cli import main

    def never(*args, **kwargs):
        raise RuntimeError("the model loader was reached")

    monkeypatch.setattr(fedllm.engine.server, "load_model", never)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    env, threads, report = dict(os.environ), torch.get_num_threads(), {}
    try:
        for name, argv in cases:
            err = io.StringIO()
            cpu = time.process_time()
            with contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            report[name] = {"code": code, "stderr": err.getvalue(), "cpu": time.process_time() - cpu}
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return report


def test_refusals_that_need_no_model_come_before_torch(tmp_path, arith_file):
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "keep.txt").write_text("mine")
    work = tmp_path / "work"
    (work / "runs" / "quickstart").mkdir(parents=True)
    (work / "runs" / "quickstart" / "recipe.yaml").write_text("seed: 0\n")
    (work / "mine").mkdir()
    (work / "mine" / "canary.txt").write_text("precious")
    (work / "empty.jsonl").write_text("\n  \n")
    data = str(arith_file)
    (work / "recipe.yaml").write_text(
        "output_dir: runs/new\nmodel: {name: tiny-llama}\nlora: {r: 4}\n"
        f"data: {{path: {data}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3}\ntrain: {local_steps: 1}\n")
    (work / "runs" / "notasks").mkdir()  # a run whose recipe evaluates nothing
    (work / "runs" / "notasks" / "recipe.yaml").write_text((work / "recipe.yaml").read_text())
    (work / "split").mkdir()  # a directory's train.json: 5 records
    (work / "split" / "train.json").write_text(json.dumps({"data": [{"question": "q", "answer": "a"}] * 5}))
    (work / "bad.yaml").write_text("seed: 0\nmodel:\n  name: tiny-llama\n lora: {r: 4}\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    cases = [
        ("overwrite-home", ["train", "recipe.yaml", "--overwrite", f"output_dir={home}"]),
        ("overwrite-cwd", ["train", "recipe.yaml", "--overwrite", "output_dir=."]),   # override after an option
        ("overwrite-not-a-run", ["train", "recipe.yaml", "output_dir=mine", "--overwrite"]),
        ("resume-nothing", ["train", "recipe.yaml", "--resume", "output_dir=runs/typo"]),
        ("empty-data", ["train", "recipe.yaml", "data.path=empty.jsonl"]),
        ("split-too-many", ["train", "recipe.yaml", "federation.num_clients=5000", "data.eval_fraction=0.25"]),
        ("split-json-dir", ["train", "recipe.yaml", "data.path=./split", "federation.num_clients=6"]),
        ("rank-tiny", ["train", "recipe.yaml", "lora.r=64"]),
        ("rank-gguf", ["train", "recipe.yaml", "model.name=smollm2-135m-instruct", "lora.r=1024"]),
        # no weights here (chunk packages / the hub cache): the shipped config's shapes
        ("rank-shipped-preset", ["train", "recipe.yaml", "model.name=gemma3-270m", "lora.r=1024"]),
        ("rank-shipped-hub-id", ["train", "recipe.yaml", "model.name=Qwen/Qwen2-0.5B", "lora.r=1024"]),
        ("all-at-once", ["train", "recipe.yaml", "model.name=smollm2-135m-instuct", "federation.strategy=fedavgg",
                         "data.path=data/missing.jsonl"]),
        ("gguf-missing", ["train", "recipe.yaml", "model.name=models/nope.gguf"]),
        ("yaml", ["train", "bad.yaml"]),
        ("export-non-empty", ["export", "runs/quickstart", "--format", "merged", "--out", "mine"]),
        ("serve-busy-port", ["serve", "runs/quickstart", "--port", str(port)]),
        ("eval-typo", ["eval", "runs/quickstartt", "--tasks", "gsm8k"]),
        ("eval-task-typo", ["eval", "tiny-llama", "--tasks", "gsm8"]),
        ("eval-no-tasks", ["eval", "runs/notasks"]),
        ("dry-run-data", ["train", "recipe.yaml", "--dry-run", "data.fields.output=answr",
                          "federation.partition.method=dirichlet", "federation.partition.column=topic"]),
        ("train-data", ["train", "recipe.yaml", "data.fields.output=answr", "federation.partition.method=natural",
                        "federation.partition.column=topic"]),
        ("override-space", ["train", "recipe.yaml", "federation.rounds", "2", "lora.r=4"]),
        ("recipe-typo", ["train", "recipe.yml"]),
    ]
    try:
        got = run_batch(cases, cwd=work, HOME=str(home))
    finally:
        busy.close()
    for name, _ in cases:
        assert got[name]["code"] == 2, (name, got[name]["stderr"])
        assert not got[name]["loader"], (name, got[name]["stderr"])  # never reached the model loader
        assert got[name]["heavy"] == [], (name, got[name]["heavy"], got[name]["stderr"])
    said = {name: " ".join(r["stderr"].split()) for name, r in got.items()}
    assert "it is the home directory" in said["overwrite-home"]
    assert "it is the current directory" in said["overwrite-cwd"]
    assert "not a fedllm run directory" in said["overwrite-not-a-run"]
    assert f"nothing to resume at output_dir='runs/typo' (resolved: {work / 'runs' / 'typo'})" in said["resume-nothing"]
    assert "data.path: got 'empty.jsonl'; expected a data file with at least one record" in said["empty-data"]
    # 48 records, round(0.25 * 48) = 12 held out: 36 to split
    assert f"federation.num_clients: got 5000; expected at most 36, the training records to split " \
           f"(federation.partition.method='iid' gives every client at least one): data.path={data!r} holds 48 " \
           f"records (data.eval_fraction=0.25 holds out 12)" in said["split-too-many"]
    assert "federation.num_clients: got 6; expected at most 5," in said["split-json-dir"]
    assert "data.path='./split' holds 5 records" in said["split-json-dir"]
    # tiny-llama: k/v project 64 -> 2 kv heads x 16 = 32; SmolLM2-135M: 576 -> 3 kv heads x 64 = 192
    assert "lora.r: got 64; expected <= min(out, in) of every target layer; the self_attn.k_proj layers are " \
           "(32, 64)" in said["rank-tiny"]
    assert "the self_attn.k_proj layers are (192, 576)" in said["rank-gguf"]
    # gemma3-270m (shipped config): 1 kv head x 256 = 256 from 640; Qwen2-0.5B: 2 kv heads x 64 = 128 from 896
    assert "lora.r: got 1024; expected <= min(out, in) of every target layer; the self_attn.k_proj layers are " \
           "(256, 640)" in said["rank-shipped-preset"]
    assert "model.name: got 'Qwen/Qwen2-0.5B'" in said["rank-shipped-hub-id"]  # both problems at once
    assert "the self_attn.k_proj layers are (128, 896)" in said["rank-shipped-hub-id"]
    assert "3 problem(s)" in said["all-at-once"]
    assert "model.name: got 'smollm2-135m-instuct'" in said["all-at-once"]
    assert "(did you mean 'smollm2-135m-instruct'?)" in said["all-at-once"]
    assert "(did you mean 'fedavg'" in said["all-at-once"]
    assert f"looked for {work / 'data' / 'missing.jsonl'} (relative to the working directory {work})" \
        in said["all-at-once"]
    assert f"model.name: got 'models/nope.gguf'; expected an existing local model directory or .gguf file " \
           f"(looked for {work / 'models' / 'nope.gguf'})" in said["gguf-missing"]
    assert "<yaml> line 4, column 2" in said["yaml"]
    assert "--out mine: already exists and is not empty" in said["export-non-empty"]
    assert f"--port {port}: cannot listen there" in said["serve-busy-port"]
    assert "checkpoint 'runs/quickstartt': no such file or directory" in said["eval-typo"]
    assert "(did you mean 'runs/quickstart'?)" in said["eval-typo"]
    assert "unknown task(s) gsm8 (did you mean 'gsm8k'?)" in said["eval-task-typo"]
    assert "no tasks to evaluate: pass --tasks" in said["eval-no-tasks"]
    for case in ("dry-run-data", "train-data"):  # the data's columns against the recipe: every problem at once
        assert "2 problem(s)" in said[case]
        assert f"data.fields.output: got 'answr'; expected a column of data.path={data!r} (its records have " \
               "answer, category, question)" in said[case]
        assert "federation.partition.column: got 'topic'; expected a column of" in said[case]
    assert "1 problem(s)" in said["override-space"]  # one mistake, one problem, and how to write it
    assert "federation.rounds: got 'federation.rounds 2'; expected an override of the form dotted.key=value " \
           "(write federation.rounds=2)" in said["override-space"]
    assert "expected an existing recipe YAML file (did you mean 'recipe.yaml'?)" in said["recipe-typo"]
    # nothing was written or deleted
    assert (work / "mine" / "canary.txt").read_text() == "precious"
    assert (home / "notes" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["notasks", "quickstart"]
    assert [p.name for p in (work / "runs" / "notasks").iterdir()] == ["recipe.yaml"]
    assert not os.path.exists(work / "runs" / "new")


def test_recipe_mistakes_are_refused_before_the_model_loads_each_in_seconds(tmp_path, arith_file, monkeypatch):
    """The mistakes of a newcomer's trial (issue 52), each against a model whose loading fails: a strategy switched on
    the command line under the recipe's strategy_args, Krum under SecAgg+ (train and --dry-run), AdvBench offline
    without its data, an override out of range, a mistyped data file and column, an export of a directory that holds
    no run. Every one exits 2 naming where the mistake came from, in under 10 CPU-seconds."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "arith.jsonl").write_text(arith_file.read_text())
    (work / "runs" / "old" / "final").mkdir(parents=True)
    (work / "runs" / "old" / ".fedllm-run").write_text("{}")
    (work / "recipe.yaml").write_text(
        "output_dir: runs/new\nmodel: {name: tiny-llama}\nlora: {r: 4}\n"
        "data: {path: data/arith.jsonl, fields: {instruction: question, output: answer}}\n"
        "federation: {num_clients: 8, clients_per_round: 6, rounds: 2, strategy: frlora,\n"
        "             strategy_args: {svd: randomized, niter: 2}}\ntrain: {local_steps: 1}\n")
    cases = [
        ("strategy-switch", ["train", "recipe.yaml", "federation.strategy=fedavg"]),
        ("krum-secagg", ["train", "recipe.yaml", "federation.strategy=krum", "federation.strategy_args={}",
                         "privacy.secure_aggregation=secagg_plus"]),
        ("krum-secagg-dry", ["train", "recipe.yaml", "--dry-run", "federation.strategy=krum",
                             "federation.strategy_args={}", "privacy.secure_aggregation=secagg_plus"]),
        ("advbench-offline", ["train", "recipe.yaml", "eval.tasks=[advbench]"]),
        ("rounds", ["train", "recipe.yaml", "federation.rounds=0"]),
        ("data-typo", ["train", "recipe.yaml", "data.path=data/arth.jsonl"]),
        ("column-typo", ["train", "recipe.yaml", "federation.partition.method=natural",
                         "federation.partition.column=categry"]),
        ("export-not-a-run", ["export", "data", "--format", "adapter", "--out", "exported"]),
    ]
    empty_cache = tmp_path / "hf"  # no hub data set is cached here
    got = run_in_process(cases, work, monkeypatch, empty_cache)
    said = {name: " ".join(r["stderr"].split()) for name, r in got.items()}
    for name, _ in cases:
        assert got[name]["code"] == 2, (name, said[name])
        assert got[name]["cpu"] < 10, (name, got[name]["cpu"])
    assert "federation.strategy_args.svd: got 'randomized'; expected an argument of fedavg" in said["strategy-switch"]
    assert "the strategy was changed on the command line: federation.strategy=fedavg" in said["strategy-switch"]
    for case in ("krum-secagg", "krum-secagg-dry"):
        assert "privacy.secure_aggregation: got 'secagg_plus'; expected none with federation.strategy 'krum'" \
            in said[case]
        assert "[set on the command line: privacy.secure_aggregation=secagg_plus, not in the recipe file]" in said[case]
    assert "eval.data.advbench: got None; expected data that loads from here (a local file of the data): the hub " \
           "data set 'walledai/AdvBench' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" \
        in said["advbench-offline"]
    assert "federation.rounds: got 0; expected a positive integer [set on the command line: federation.rounds=0, " \
           "not in the recipe file]" in said["rounds"]
    assert "(did you mean 'data/arith.jsonl'?)" in said["data-typo"]
    assert "federation.partition.column: got 'categry'; expected a column of" in said["column-typo"]
    assert "(did you mean 'category'?)" in said["column-typo"]
    assert "RUN_DIR_OR_CHECKPOINT 'data': neither a run directory with checkpoints nor a fedllm checkpoint; run " \
           f"directories and checkpoints nearby: {os.path.join('runs', 'old')}" in said["export-not-a-run"]
    assert sorted(p.name for p in work.iterdir()) == ["data", "recipe.yaml", "runs"]  # nothing written
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["old"]


def test_the_export_checks_know_a_checkpoint_by_the_files_the_checkpoints_write():
    """``fedllm export``'s torch-free check and the checkpoint module name the same files."""
    from fedllm.commands.export import CHECKPOINT_FILES
    from fedllm.runs import checkpoint

    assert CHECKPOINT_FILES == checkpoint._CHECKPOINT_FILES


def test_the_default_hub_data_of_each_task_is_the_tasks_own():
    """The table the recipe checks read (no task imported) against the tasks' ``hub`` sources."""
    from fedllm.common.registry import tasks
    from fedllm.evaluation.tasks import advbench
    from fedllm.recipe.hub_data_checks import TASK_HUB_DATA

    for name in tasks.names():
        cls = tasks.get(name)
        hub = advbench.HUB if name == "advbench" else getattr(cls, "hub", None)
        if name.startswith("flowertune"):
            continue
        assert (TASK_HUB_DATA.get(name) or (None,))[0] == (hub.path if hub else None), name
        if hub:
            assert TASK_HUB_DATA[name][1] == bool(getattr(cls, "uses_records", False)), name
