"""FlowerTune prompt identity and scoring identity against FlowerTune's own code.

tests/assets/eval/flowertune/reference.json holds what flower's ``benchmarks/flowertune-llm/evaluation`` and
the bigcode-evaluation-harness fork rendered and scored for the records of records.json (its ``header`` says
how it was produced: commits, functions); fedllm must render the same bytes and give the same verdicts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sandboxkit

from fedllm.evaluation.flowertune_code_prompts import CODE_SETS, checked_program, program_of
from fedllm.evaluation.flowertune_data import question_rows
from fedllm.evaluation.flowertune_generation import choice_token_limits
from fedllm.evaluation.flowertune_prompts import FINANCE_SETS, MEDICAL_SETS, mmlu_set
from fedllm.evaluation.flowertune_scoring import (
    choice_correct,
    choice_prediction,
    finance_answer,
    mean_pass_at_k,
    pass_at_k,
    sentiment_label,
)

ASSETS = Path(__file__).parent.parent / "assets" / "eval" / "flowertune"
RECORDS = json.loads((ASSETS / "records.json").read_text())
REFERENCE = json.loads((ASSETS / "reference.json").read_text())
EOS = "<|im_end|>"  # the tokenizer the reference run used (SmolLM2-135M-Instruct)
code_sandbox = sandboxkit.code_sandbox
CODE_KEYS = {"humaneval": "humaneval", "mbpp": "mbpp", "multiple_js": "multiple-js", "multiple_cpp": "multiple-cpp"}


class _Ctx:
    """What :func:`question_rows` reads of an EvalContext: the data specs and the limit."""

    def __init__(self, data: dict[str, str]):
        self.data = data

    def data_spec(self, key):
        return self.data.get(key)

    def limited(self, rows):
        return rows


def _write(tmp_path: Path, name: str, rows: list[dict]) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_flowertune_reference_fixture_records_how_it_was_made():
    header = REFERENCE["header"]
    assert len(header["flower_commit"]) == 40 and len(header["bigcode_commit"]) == 40
    assert "infer_mmlu" in header["functions"]["general_nlp"] and "compute_code_eval" in header["functions"]["code"]


@pytest.mark.parametrize("category", ["stem", "social_sciences", "humanities"])
def test_flowertune_general_nlp_prompts_equal_flowertunes(tmp_path, category):
    ctx = _Ctx({"flowertune_general_nlp.mmlu": _write(tmp_path, "mmlu", RECORDS["mmlu"])})  # all categories
    qs = mmlu_set(category)
    rows = question_rows(ctx, "flowertune_general_nlp", qs)
    expected = REFERENCE["general_nlp"]["prompts"][category]
    assert len(rows) == len(expected) >= 2
    assert [qs.prompt(r) for r in rows] == [e["prompt"] for e in expected]
    assert [qs.gold(r) for r in rows] == [e["gold"] for e in expected]


@pytest.mark.parametrize("challenge,qs", [("medical", q) for q in MEDICAL_SETS] + [("finance", q) for q in FINANCE_SETS],
                         ids=lambda v: v if isinstance(v, str) else v.key)
def test_flowertune_medical_and_finance_rows_and_prompts_equal_flowertunes(tmp_path, challenge, qs):
    """Finance's FPB and FiQA: the same 25 % test rows (seed 42) of the loaded rows, in the same order."""
    task = f"flowertune_{challenge}"
    rows = question_rows(_Ctx({f"{task}.{qs.key}": _write(tmp_path, qs.key, RECORDS[qs.key])}), task, qs)
    expected = REFERENCE[challenge]["prompts"][qs.key]
    assert [qs.prompt(r) for r in rows] == [e["prompt"] for e in expected]
    assert [qs.gold(r) for r in rows] == [e["gold"] for e in expected]
    if challenge == "finance":
        assert {e["max_length"] for e in expected} == {512}


def test_flowertune_prompt_fixture_covers_five_records_per_challenge():
    for challenge in ("general_nlp", "medical", "finance", "code"):
        assert sum(len(v) for v in REFERENCE[challenge]["prompts"].values()) >= 5, challenge


@pytest.mark.parametrize("cs", CODE_SETS, ids=lambda c: c.key)
def test_flowertune_code_prompts_tests_and_programs_equal_the_harness(cs):
    ref = REFERENCE["code"]
    name = CODE_KEYS[cs.key]
    records = RECORDS[name]
    expected = ref["prompts"][name]
    assert [cs.prompt(r) for r in records] == [e["prompt"] for e in expected]
    assert [cs.test(r) for r in records] == [e["reference"] for e in expected]
    assert [cs.stop(r) + [EOS] for r in records] == [e["stop_words"] for e in expected]
    completions = ref["scores"][name]["completions"]
    eos_variant = completions[0].replace(";\n", ";" + EOS + "\n", 1).replace("b\n", "b" + EOS + "\n", 1)
    for r, programs in zip(records, ref["scores"][name]["programs"], strict=True):
        mine = [program_of(cs.prompt(r), c, cs.stop(r) + [EOS]) for c in [*completions[:-1], eos_variant]]
        assert mine == programs


def test_flowertune_choice_token_limit_is_the_first_reference_of_each_batch_of_16(tokenizer):
    golds = ["maybe"] + ["no"] * 15 + ["yes", "maybe"]
    first = len(tokenizer("maybe", add_special_tokens=False)["input_ids"])
    second = len(tokenizer("yes", add_special_tokens=False)["input_ids"])
    assert choice_token_limits(tokenizer, golds) == [first] * 16 + [second] * 2
    assert {e["max_new_tokens"] for e in REFERENCE["medical"]["prompts"]["medqa"]} == {1}


@pytest.mark.parametrize("challenge,key", [("general_nlp", "stem"), ("general_nlp", "social_sciences"),
                                           ("general_nlp", "humanities"), ("medical", "pubmedqa"),
                                           ("medical", "medqa"), ("medical", "medmcqa"), ("medical", "careqa")])
def test_flowertune_choice_verdicts_equal_flowertunes(challenge, key):
    scores = REFERENCE[challenge]["scores"][key]
    rows = scores["rows"]
    assert {"", "##"} & {r["output"] for r in rows}  # empty and malformed outputs are among the scripted ones
    for r in rows:
        assert list(choice_prediction(r["output"], r["gold"], scores["answer_type"])) == [r["pred"], r["gold"].lower()]
        assert choice_correct(r["output"], r["gold"], scores["answer_type"]) == r["correct"], r
    assert sum(r["correct"] for r in rows) / len(rows) == pytest.approx(scores["accuracy"])


@pytest.mark.parametrize("key", ["fpb", "fiqa", "tfns"])
def test_flowertune_finance_verdicts_equal_flowertunes(key):
    prompts = {e["gold"]: e["prompt"] for e in REFERENCE["finance"]["prompts"][key]}
    rows = REFERENCE["finance"]["scores"][key]["rows"]
    for r in rows:
        answer = finance_answer(prompts[r["gold"]] + r["output"])
        assert answer == r["out_text"], r
        assert sentiment_label(answer) == r["pred"]
        assert (sentiment_label(answer) == sentiment_label(r["gold"])) == r["correct"]


def test_flowertune_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - (7 * 6 * 5 * 4 * 3) / (10 * 9 * 8 * 7 * 6))
    assert pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 0, 1) == 0.0
    for name, scores in REFERENCE["code"]["scores"].items():
        assert mean_pass_at_k(scores["passed"], 1) == pytest.approx(scores["pass@1"]), name


@pytest.mark.parametrize("cs", [c for c in CODE_SETS if c.language != "cpp"], ids=lambda c: c.key)
def test_flowertune_code_verdicts_equal_the_harness(code_sandbox, cs):
    name = CODE_KEYS[cs.key]
    if cs.language == "javascript" and shutil.which("node") is None:
        pytest.skip("node is not installed: MultiPL-E JavaScript programs cannot run")
    scores = REFERENCE["code"]["scores"][name]
    for r, programs, passed in zip(RECORDS[name], scores["programs"], scores["passed"], strict=True):
        verdicts = {}
        for program in dict.fromkeys(programs):
            verdicts[program] = code_sandbox.run(cs.language, checked_program(program, cs.test(r))).passed
        assert [verdicts[p] for p in programs] == passed


def test_flowertune_cpp_verdicts_equal_the_harness(code_sandbox):
    """Three C++ programs (compiling takes seconds): one passing, one failing its asserts, one not compiling."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: MultiPL-E C++ programs cannot run")
    cs = next(c for c in CODE_SETS if c.key == "multiple_cpp")
    scores = REFERENCE["code"]["scores"]["multiple-cpp"]
    record, programs, passed = RECORDS["multiple-cpp"][0], scores["programs"][0], scores["passed"][0]
    outcomes = [code_sandbox.run("cpp", checked_program(programs[i], cs.test(record))) for i in (0, 1, 2)]
    assert [o.passed for o in outcomes] == [passed[0], passed[1], passed[2]] == [True, False, False]
    assert outcomes[2].status == "CompileError"
