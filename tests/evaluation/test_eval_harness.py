"""lm-evaluation-harness as a back-end: ``lm_eval:<task>`` on the in-memory model (base + adapter) scores what
the harness itself scores on the exported merged model, for tasks written in the harness's YAML format over
fixture files this test writes."""

import copy
import json
import sys
import textwrap

import pytest
import torch
from evalkit import ASSETS, ScriptedLM, tiny_llama_config

from fedllm.common.errors import InputError
from fedllm.evaluation import evaluate
from fedllm.recipe.schema import EvalConfig

pytest.importorskip("lm_eval")

ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many?", "choices": [str(a + b), str(a * b), str(a - b)],
         "label": 0, "answer": str(a + b)} for a, b in [(3, 4), (1, 2), (5, 5), (2, 7), (6, 1), (8, 3)]]
OTHER = [{"question": f"Other question {i}?", "choices": ["1", "2", "3"], "label": i % 3, "answer": "1"} for i in range(4)]

TASKS = {
    "fedllm_tiny_mc": """
        output_type: multiple_choice
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - metric: acc
          - metric: acc_norm""",
    "fedllm_tiny_gen": """
        output_type: generate_until
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          do_sample: false
          max_gen_toks: 6
        metric_list:
          - metric: exact_match""",
}


@pytest.fixture(scope="module")
def harness_dir(tmp_path_factory):
    """A directory of harness task YAMLs (``--include_path``) over a JSONL fixture, and another data file."""
    root = tmp_path_factory.mktemp("harness")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OTHER))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():
        head = f"""
            task: {name}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {root / 'data.jsonl'}
            test_split: test
            doc_to_text: "Question: {{{{question}}}}\\nAnswer:\""""
        (tasks / f"{name}.yaml").write_text(textwrap.dedent(head) + textwrap.dedent(body).format() + "\n")
    return root


def adapted_model(tokenizer):
    """A tiny LLaMA with a LoRA adapter whose B is not zero (so the adapter changes every score)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(tokenizer))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def logliks(samples: list[dict]) -> list[float]:
    return [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0])
            for s in samples for r in s["resps"]]


NAMES = ["lm_eval:fedllm_tiny_mc", "lm_eval:fedllm_tiny_gen"]


def harness_table(results: dict) -> dict[str, float]:
    """``{"lm_eval:<task>/<metric>": value}`` of a harness results table (what fedllm reports)."""
    return {f"lm_eval:{task}/{key.split(',')[0]}": value for task, table in results.items()
            for key, value in table.items() if "," in key and "_stderr" not in key}


@pytest.fixture(scope="module")
def scored_export(tokenizer_state, harness_dir, tmp_path_factory):
    """Both fixture tasks scored through fedllm on base + adapter, and the merged model exported once (the
    harness's API and its CLI both score that export)."""
    tokenizer = copy.deepcopy(tokenizer_state)
    model = adapted_model(tokenizer)
    root = tmp_path_factory.mktemp("scored")
    cfg = EvalConfig(tasks=NAMES, data={"lm_eval": str(harness_dir / "tasks")}, batch_size=4)
    ours = evaluate(model, tokenizer, cfg, root / "out", progress=False)
    export = root / "merged"
    copy.deepcopy(model).merge_and_unload().save_pretrained(export)
    tokenizer.save_pretrained(export)
    return model, tokenizer, cfg, ours, root / "out", export


@pytest.fixture
def no_env_report(monkeypatch):
    """The harness's own runs in these tests without its environment report (``pip list`` and ten other programs:
    ~0.8 CPU-s a run), which fedllm's runs skip too and no score depends on."""
    from lm_eval import evaluator

    monkeypatch.setattr(evaluator, "add_env_info", lambda storage: None)


def test_lm_eval_tasks_through_fedllm_equal_the_harness_on_the_merged_export(scored_export, harness_dir,
                                                                                no_env_report):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tokenizer, cfg, ours, out, export = scored_export
    stored = json.loads((out / "lm_eval:fedllm_tiny_mc.json").read_text())
    assert stored["settings"]["answer_protocol"] == "lm_eval" and len(stored["examples"]["fedllm_tiny_mc"]) == 6
    assert json.loads((out / "summary.json").read_text())["protocols"] == dict.fromkeys(NAMES, "lm_eval")

    manager = TaskManager(include_path=str(harness_dir / "tasks"), include_defaults=False)
    res = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", device="cpu", batch_size=4,
                          tasks=[n.split(":")[1] for n in NAMES], task_manager=manager, bootstrap_iters=0)
    assert ours == harness_table(res["results"])
    assert logliks(stored["examples"]["fedllm_tiny_mc"]) == pytest.approx(logliks(res["samples"]["fedllm_tiny_mc"]),
                                                                           rel=1e-4, abs=1e-4)

    with model.disable_adapter():                                              # the adapter was evaluated
        evaluate(model, tokenizer, EvalConfig(tasks=NAMES[:1], data=cfg.data), out.parent / "base", progress=False)
    base = json.loads((out.parent / "base" / "lm_eval:fedllm_tiny_mc.json").read_text())
    assert logliks(base["examples"]["fedllm_tiny_mc"]) != pytest.approx(logliks(stored["examples"]["fedllm_tiny_mc"]),
                                                                        rel=1e-3)


def test_local_data_replace_a_tasks_dataset(tokenizer, tiny_lm, tmp_path, harness_dir, monkeypatch):
    """... and fedllm's run of the harness asks for no environment report (``pip list`` and ten other programs)."""
    from torch.utils import collect_env

    reports = []
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: reports.append(1) or "")
    name = "lm_eval:fedllm_tiny_mc"
    cfg = EvalConfig(tasks=[name], data={"lm_eval": str(harness_dir / "tasks"), name: str(harness_dir / "other.jsonl")})
    evaluate(tiny_lm, tokenizer, cfg, tmp_path, progress=False)
    assert reports == []
    docs = [s["doc"]["question"] for s in json.loads((tmp_path / f"{name}.json").read_text())["examples"][name[8:]]]
    assert docs == [r["question"] for r in OTHER]


def run_harness_cli(monkeypatch, argv: list[str], scanned: dict | None = None) -> list:
    """The harness's command line: ``lm_eval.__main__.cli_evaluate``, the function its ``lm_eval`` console script
    runs, with ``argv`` (in this process: the interpreter start and the imports are shared with the test; the
    lm_eval logger is restored afterwards).

    Args:
        scanned: ``{tuple of folders: TaskManager}`` built before: where the CLI's own ``TaskManager`` scans
            those folders (the harness's thousands of task YAML files: ~11 CPU-s), it is given a copy of that
            manager's index instead, built from the same files; its manager is otherwise the CLI's own.

    Returns:
        The folder lists the CLI's managers scanned, each with whether its index was reused.
    """
    import logging

    import lm_eval.utils
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.tasks._index import TaskIndex

    scans = []
    build = TaskIndex.build

    def reuse(paths, **kwargs):
        paths = tuple(str(p) for p in paths)
        manager = (scanned or {}).get(paths)
        scans.append((paths, manager is not None))
        return dict(manager._index) if manager is not None else build(paths, **kwargs)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(reuse))
    logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", True)           # no handler added to the logger
    monkeypatch.setattr(sys, "argv", ["lm_eval", *argv])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    level = logger.level
    try:
        cli_evaluate()
    finally:
        logger.setLevel(level)
    return scans


@pytest.mark.slow
def test_the_harness_cli_scores_the_export_as_fedllm_does(scored_export, harness_dir, tmp_path, monkeypatch,
                                                         no_env_report):
    """The harness's own command line (``lm_eval``, which indexes every task the harness ships) on
    the exported merged model, both fixture tasks in one call; and gsm8k under the ``lm_eval`` protocol, whose
    harness folder alone is indexed, run as with the whole index (built once here for the unknown task, and
    given to the CLI's own manager, which would scan the same files again: ~11 CPU-s)."""
    from fedllm.evaluation.harness import _harness_tasks_dir, task_manager_for
    from fedllm.evaluation.tasks.gsm8k import GSM8K

    model, tokenizer, _, ours, _, export = scored_export
    include = {"lm_eval": str(harness_dir / "tasks")}
    with pytest.raises(InputError, match="not a task of lm-evaluation-harness"):
        evaluate(model, tokenizer, EvalConfig(tasks=["lm_eval:no_such_task_here"], data=include), None,
                 progress=False)
    # gsm8k under the lm_eval answer protocol: the harness's own task over a local file, 5 shots from it
    gsm8k = ASSETS / "gsm8k_tiny.jsonl"
    cfg = EvalConfig(tasks=["gsm8k"], data={"gsm8k": str(gsm8k), **include}, answer_protocol="lm_eval", limit=2)
    metrics = evaluate(model, tokenizer, cfg, tmp_path / "gsm8k", progress=False)
    assert set(metrics) == {"gsm8k/exact_match.strict-match", "gsm8k/exact_match.flexible-extract"}
    samples = json.loads((tmp_path / "gsm8k" / "gsm8k.json").read_text())["examples"]["gsm8k"]
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"] if isinstance(sample["arguments"], dict) \
            else sample["arguments"][0][0]
        assert prompt.count("Question: ") == 6 and prompt.endswith(f"Question: {sample['doc']['question']}\nAnswer:")
        assert prompt.count(sample["doc"]["question"]) == 1                   # never its own exemplar
    monkeypatch.setattr(GSM8K, "lm_eval_folder", "")                         # the harness's whole index
    assert evaluate(model, tokenizer, cfg, tmp_path / "gsm8k_all", progress=False) == metrics
    assert json.loads((tmp_path / "gsm8k_all" / "gsm8k.json").read_text())["examples"]["gsm8k"] == samples

    out = tmp_path / "cli"
    whole = task_manager_for("gsm8k", include["lm_eval"])                    # the index built above, every task
    assert "gsm8k" in whole.task_index and "fedllm_tiny_mc" in whole.task_index
    folders = (str(_harness_tasks_dir()), include["lm_eval"])                # what the CLI's manager scans
    scans = run_harness_cli(monkeypatch, ["--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
                                          "--tasks", ",".join(n.split(":")[1] for n in NAMES),
                                          "--include_path", str(harness_dir / "tasks"), "--device", "cpu",
                                          "--batch_size", "4", "--output_path", str(out)], {folders: whole})
    assert scans == [(folders, True)]                                       # its one scan: that index, reused
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert ours == harness_table(results)
    assert {"lm_eval:fedllm_tiny_mc/acc", "lm_eval:fedllm_tiny_mc/acc_norm", "lm_eval:fedllm_tiny_gen/exact_match"} \
        <= set(ours)


class HarnessScriptedLM(ScriptedLM):
    """:class:`ScriptedLM` as the harness's ``HFLM`` calls ``generate`` (``max_length``: prompt + new tokens); the
    wrapped model answers what else ``HFLM`` asks of a model (``device``, ``tie_weights``, ...)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base, name)

    def generate(self, input_ids, attention_mask, max_length, **kwargs):
        kwargs.pop("max_new_tokens", None)
        return super().generate(input_ids, attention_mask, max_length - input_ids.shape[1], **kwargs)


# problem, solution, scripted output: the harness reads the answer between the output's first and last "$"
MATH_ROWS = [("What is $1/2$ as a fraction?", "It is $\\boxed{\\frac{1}{2}}$.", "$\\frac12$"),
             ("Solve $x+1=3$.", "So $x=\\boxed{2}$.", "We get $x = 2$."),
             ("What is $2^3$?", "$2^3=\\boxed{8}$", "The answer is 8."),          # no "$": the whole text
             ("Roots of $x^2+x-6$?", "They are $\\boxed{-3, 2}$.", "$2, -3$")]      # is_equiv: order matters


def test_math_under_the_lm_eval_protocol_runs_the_harness_config_on_a_local_file(tokenizer, tiny_lm, tmp_path):
    """``hendrycks_math`` is a group of seven subject tasks that share one config (only the hub subset differs)
    and average by size; with local data fedllm runs that config once over the file, under the group's name.
    The verdicts are the harness's own ``process_results`` on the scripted outputs; the premise (one config)
    is checked against the installed harness; a record the harness cannot read is named before generating."""
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.tasks.hendrycks_math.utils import process_results

    from fedllm.evaluation.harness import task_manager_for

    manager = task_manager_for("hendrycks_math", None, "hendrycks_math")
    group = load_yaml(manager.task_index["hendrycks_math"].yaml_path)
    assert group["aggregate_metric_list"] == [{"metric": "exact_match", "aggregation": "mean", "weight_by_size": True}]
    configs = [load_yaml(manager.task_index[t].yaml_path, resolve_func=False) for t in group["task"]]
    shared = [{k: v for k, v in c.items() if k not in ("task", "dataset_name", "tag")} for c in configs]
    assert all(c == shared[0] for c in shared) and len({c["dataset_name"] for c in configs}) == 7

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "solution": s, "level": "Level 1"}) + "\n"
                            for p, s, _ in MATH_ROWS))
    tokenizer.padding_side = "left"
    model = HarnessScriptedLM(tiny_lm, tokenizer, {p: out for p, _, out in MATH_ROWS})
    expected = [process_results({"solution": s}, [out])["exact_match"] for _, s, out in MATH_ROWS]
    assert expected == [1, 1, 0, 0]
    for task in ("math", "math500"):
        cfg = EvalConfig(tasks=[task], data={task: str(data)}, answer_protocol="lm_eval", batch_size=2)
        assert evaluate(model, tokenizer, cfg, tmp_path / task, progress=False) == {f"{task}/exact_match": 0.5}
        stored = json.loads((tmp_path / task / f"{task}.json").read_text())
        assert stored["settings"]["data"] == str(data) and stored["settings"]["answer_protocol"] == "lm_eval"
        (samples,) = stored["examples"].values()
        assert [s["arguments"]["gen_args_0"]["arg_0"] if isinstance(s["arguments"], dict) else s["arguments"][0][0]
                for s in samples] == [f"Problem: {p}\nAnswer:" for p, _, _ in MATH_ROWS]
        assert [s["exact_match"] for s in samples] == expected
    assert list(json.loads((tmp_path / "math" / "math.json").read_text())["examples"]) == ["hendrycks_math"]

    calls = model.calls
    data.write_text(data.read_text() + json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(InputError, match=r"record 5 has no such pair"):  # 1-based, as fedllm's data errors
        evaluate(model, tokenizer, EvalConfig(tasks=["math"], data={"math": str(data)}, answer_protocol="lm_eval"),
                 None, progress=False)
    assert model.calls == calls
