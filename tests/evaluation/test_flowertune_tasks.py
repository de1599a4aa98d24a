"""The FlowerTune challenge tasks end to end on a scripted model: metrics, averages, resume, data and
code-execution refusals (exit code 2 naming what to set)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from flowertunekit import MEDICAL, ScriptedGenerator, write_data

import fedllm.export.inference
from fedllm.commands.cli import main
from fedllm.common.errors import InputError
from fedllm.evaluation.runner import evaluate
from fedllm.evaluation.sources import DataSourceError
from fedllm.recipe.schema import EvalConfig


def test_flowertune_medical_accuracy_average_and_resume(tiny_lm, tokenizer, tmp_path):
    # PubMedQA: yes (right), no (right), maybe -> "no" (wrong); MedMCQA 2/2; MedQA 1/2; CareQA 0/2
    script = {"regular exercise": "yes", "vitamin C supplementation": "no", "smartphone app": "no",
              "anaphylaxis": "A", "diaphragm": "B", "crushing chest pain": "B", "scurvy": "A",
              "community-acquired": "A", "beta cells": "D"}
    model = ScriptedGenerator(tiny_lm, tokenizer, script)
    cfg = EvalConfig(tasks=["flowertune_medical"], data=write_data(tmp_path, "flowertune_medical", MEDICAL))
    metrics = evaluate(model, tokenizer, cfg, tmp_path / "out", progress=False)
    expected = {"pubmedqa": 2 / 3, "medmcqa": 1.0, "medqa": 0.5, "careqa": 0.5}
    # CareQA: cop 2 -> B (answered A: wrong), cop 3 -> C (answered D: wrong)
    expected["careqa"] = 0.0
    assert metrics == pytest.approx({f"flowertune_medical/{k}": v for k, v in
                                     {**expected, "average": sum(expected.values()) / 4}.items()})
    assert model.prompts[0].endswith("The answer is:\n<|im_end|>\n<|im_start|>answer\n")
    stored = json.loads((tmp_path / "out" / "flowertune_medical.json").read_text())
    assert stored["settings"]["quantization"] == "none" and len(stored["examples"]) == 9
    model.prompts.clear()
    assert evaluate(model, tokenizer, cfg, tmp_path / "out", progress=False) == metrics
    assert model.prompts == []  # resumed: nothing generated again


def test_flowertune_finance_reads_the_answer_after_the_prompt(tiny_lm, tokenizer, tmp_path):
    script = {"Shares of the bank": "negative", "The new factory": "The outlook is Negative",
              "$MSFT breaking out": "positive", "Oil major": "negative news",
              "$BYND": "Negative.", "Stocks rally": "positive", "investor conference": "bullish"}
    model = ScriptedGenerator(tiny_lm, tokenizer, script, default="x")
    keys = {"fpb": "fpb", "fiqa": "fiqa", "tfns": "tfns"}
    cfg = EvalConfig(tasks=["flowertune_finance"], data=write_data(tmp_path, "flowertune_finance", keys))
    metrics = evaluate(model, tokenizer, cfg, None, progress=False)
    # FPB test rows (25 %, seed 42, as reference.json): "Shares ..." (negative: right), "The new factory ..."
    # (neutral, answered Negative: wrong); FiQA test rows: "$MSFT ..." (positive: right), "Oil major ..." (right);
    # TFNS: negative right, "Stocks rally" gold positive right, "investor conference" neutral ("bullish"
    # has no keyword: neutral, right), empty text gold neutral ("x": neutral, right)
    assert metrics == pytest.approx({"flowertune_finance/fpb": 0.5, "flowertune_finance/fiqa": 1.0,
                                     "flowertune_finance/tfns": 1.0, "flowertune_finance/average": 2.5 / 3})


def test_flowertune_code_pass_at_1_in_the_sandbox(tiny_lm, tokenizer, tmp_path):
    from fedllm.evaluation.code_sandbox import sandbox_problem

    if sandbox_problem():
        pytest.skip(f"no code sandbox here: {sandbox_problem()}")
    missing = [tool for tool in ("node", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: MultiPL-E programs cannot run")
    eos = tokenizer.eos_token
    script = {"def add(": "\n    return a + b\n\ndef unused():\n", "maximum of three": "def max_of_three(a, b, c):\n"
              "    return a\n", "function add(": "  return a + b;\n}\n// more", "long add(": "    return a + b;" + eos}
    model = ScriptedGenerator(tiny_lm, tokenizer, script)
    keys = {"humaneval": "humaneval", "mbpp": "mbpp", "multiple_js": "multiple-js", "multiple_cpp": "multiple-cpp"}
    cfg = EvalConfig(tasks=["flowertune_code"], data=write_data(tmp_path, "flowertune_code", keys), limit=1,
                     allow_code_execution=True)
    metrics = evaluate(model, tokenizer, cfg, tmp_path / "out", progress=False)
    assert metrics == pytest.approx({"flowertune_code/mbpp": 0.0, "flowertune_code/humaneval": 1.0,
                                     "flowertune_code/multiple_js": 1.0, "flowertune_code/multiple_cpp": 1.0,
                                     "flowertune_code/average": 0.75})
    stored = json.loads((tmp_path / "out" / "flowertune_code.json").read_text())
    human = next(e for e in stored["examples"] if e["id"] == "humaneval/0")
    assert len(human["solutions"]) == 4 and human["solutions"][0].endswith("    return a + b\n")
    assert human["passed"] == [True] * 4


def test_flowertune_code_refused_without_allow_code_execution(tiny_lm, tokenizer):
    cfg = EvalConfig(tasks=["flowertune_code"])
    with pytest.raises(InputError, match="--allow-code-execution"):
        evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}), tokenizer, cfg, None, progress=False)


@pytest.fixture
def no_model_load(monkeypatch):
    calls = []

    def load_for_inference(path, dtype="fp32", client=None, **kwargs):
        calls.append(path)
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(fedllm.export.inference, "load_for_inference", load_for_inference)
    return calls


def test_flowertune_code_cli_exits_2_before_loading(no_model_load, tmp_path, capsys):
    assert main(["eval", "some/model", "--tasks", "flowertune_code", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "eval.allow_code_execution" in err and "--allow-code-execution" in err and "sandbox" in err
    assert no_model_load == []


def test_flowertune_offline_data_error_names_task_hub_id_and_key(tiny_lm, tokenizer, monkeypatch):
    import fedllm.evaluation.flowertune_data as data

    def offline(source):
        from fedllm.data.errors import DataError

        raise DataError(f"{source.path}: not in the local cache and HF_HUB_OFFLINE=1")

    monkeypatch.setattr(data, "read_hub", offline)
    cfg = EvalConfig(tasks=["flowertune_medical"])
    with pytest.raises(DataSourceError) as raised:
        evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}), tokenizer, cfg, None, progress=False)
    message = str(raised.value)
    assert "flowertune_medical" in message and "bigbio/pubmed_qa:pubmed_qa_labeled_fold0_source@test" in message
    assert "eval.data.flowertune_medical.pubmedqa" in message and "--data flowertune_medical.pubmedqa=PATH" in message


def test_flowertune_mmlu_file_without_subjects_is_refused(tiny_lm, tokenizer, tmp_path):
    path = tmp_path / "mmlu.jsonl"
    path.write_text(json.dumps({"input": "q", "A": "1", "B": "2", "C": "3", "D": "4", "target": "A"}) + "\n")
    cfg = EvalConfig(tasks=["flowertune_general_nlp"], data={"flowertune_general_nlp.stem": str(path)})
    with pytest.raises(DataSourceError, match="'subset'"):
        evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}), tokenizer, cfg, None, progress=False)


def test_flowertune_code_recipe_without_allow_code_execution_is_refused_at_load():
    from fedllm.evaluation.task_names import task_data_problems
    from fedllm.recipe.schema import DataConfig

    problems = task_data_problems(EvalConfig(tasks=["flowertune_code"]), DataConfig())
    assert [(key, given) for key, given, _ in problems] == [("eval.allow_code_execution", False)]
    assert "--allow-code-execution" in problems[0][2]
    assert task_data_problems(EvalConfig(tasks=["flowertune_code"], allow_code_execution=True), DataConfig()) == []


def test_flowertune_generation_calls_run_on_a_real_model_and_repeat(tiny_lm, tokenizer):
    """The three ways FlowerTune calls ``generate`` run on a real (tiny) model; the seeded ones repeat exactly."""
    from fedllm.evaluation import flowertune_generation as gen

    samples = gen.code_samples(tiny_lm, tokenizer, ["def add(a, b):", "The answer is"], ["\ndef"], max_length=24)
    assert [len(s) for s in samples] == [gen.CODE_SAMPLES] * 2
    assert gen.code_samples(tiny_lm, tokenizer, ["def add(a, b):", "The answer is"], ["\ndef"], max_length=24) \
        == samples
    prompts = ["Instruction: What is it?\nAnswer: ", "Instruction: x\nInput: Tom has 3 apples\nAnswer: "]
    rows = list(gen.finance_decoded(tiny_lm, tokenizer, prompts).values())
    assert all(r.startswith(p) for r, p in zip(rows, prompts, strict=True))  # whole rows, padding dropped
    one = gen.greedy_each(tiny_lm, tokenizer, "Question: Tom has 3 apples", 2)
    assert len(tokenizer(one, add_special_tokens=False)["input_ids"]) <= 2


def _pubmedqa_rows(golds: list[str]) -> list[dict]:
    return [{"QUESTION": f"Question {i}?", "CONTEXTS": [f"Context {i}."], "LONG_ANSWER": "", "final_decision": g}
            for i, g in enumerate(golds)]


def test_flowertune_medical_resumed_after_a_limit_answers_as_an_uninterrupted_run(tiny_lm, tokenizer, tmp_path):
    """40 PubMedQA rows: every answer's max_new_tokens is the token count of the first reference of its batch of 16
    in the full row order (rows 0, 16, 32), whether the run is whole or resumed after --limit 5 (before: the
    remaining rows were re-batched from row 5, so rows 21-36 took row 21's limit)."""
    golds = ["yes"] * 40
    golds[16], golds[21] = "maybe maybe maybe maybe maybe", "no no no"
    data = write_data(tmp_path, "flowertune_medical", MEDICAL)
    path = tmp_path / "pubmedqa40.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _pubmedqa_rows(golds)))
    data["flowertune_medical.pubmedqa"] = str(path)
    answer = "the cat sat on the mat the dog is good the movie was bad"
    cfg = EvalConfig(tasks=["flowertune_medical"], data=data)

    def outputs(out, limits):
        for limit in limits:
            evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}, default=answer), tokenizer,
                     dataclasses.replace(cfg, limit=limit), out, progress=False)
        rows = json.loads((out / "flowertune_medical.json").read_text())["examples"]
        return [r["output"] for r in rows if r["set"] == "pubmedqa"]

    whole = outputs(tmp_path / "whole", [None])
    assert outputs(tmp_path / "resumed", [5, None]) == whole
    n = [len(tokenizer(g, add_special_tokens=False)["input_ids"]) for g in golds]
    assert n[16] != n[21] != n[0]
    assert [len(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in whole] == \
        [n[0]] * 16 + [n[16]] * 16 + [n[32]] * 8


class _BatchDependent(ScriptedGenerator):
    """Answers every row of a batch by the batch's size (as a padded batch's answers depend on its rows)."""

    def generate(self, input_ids=None, attention_mask=None, max_length=None, **kwargs):
        self.default = {32: "positive", 8: "neutral"}.get(len(input_ids), "negative")
        self.batches.append(len(input_ids))
        return super().generate(input_ids=input_ids, attention_mask=attention_mask, max_length=max_length)


def test_flowertune_finance_resumed_after_a_limit_answers_as_an_uninterrupted_run(tiny_lm, tokenizer, tmp_path):
    """40 TFNS rows are generated in the full order's batches of 32 (rows 0-31, 32-39) whether the run is whole or
    resumed after --limit 5 (whose rows sat in a batch of 5: generated again in their full batch)."""
    rows = [{"text": f"Tweet number {i} about stocks", "label": i % 3} for i in range(40)]
    data = write_data(tmp_path, "flowertune_finance", {"fpb": "fpb", "fiqa": "fiqa"})
    path = tmp_path / "tfns40.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data["flowertune_finance.tfns"] = str(path)
    cfg = EvalConfig(tasks=["flowertune_finance"], data=data)

    def outputs(out, limits):
        model = _BatchDependent(tiny_lm, tokenizer, {})
        for limit in limits:
            model.batches = []
            evaluate(model, tokenizer, dataclasses.replace(cfg, limit=limit), out, progress=False)
        stored = json.loads((out / "flowertune_finance.json").read_text())["examples"]
        return [r["output"] for r in stored if r["set"] == "tfns"], model.batches

    whole, _ = outputs(tmp_path / "whole", [None])
    assert whole == ["positive"] * 32 + ["neutral"] * 8
    resumed, batches = outputs(tmp_path / "resumed", [5, None])
    assert resumed == whole
    assert batches[-2:] == [32, 8]   # the resumed run's tfns batches: the full order's
