"""GSM8K end to end on a tiny model whose generations the test scripts: accuracy, prompts, resume."""

import json

import pytest
from evalkit import ASSETS

from fedllm.data.errors import DataError
from fedllm.evaluation import evaluate
from fedllm.evaluation.sources import read_records
from fedllm.evaluation.tasks.gsm8k_exemplars import GSM8K_COT_EXEMPLARS
from fedllm.recipe.schema import EvalConfig

DATA = ASSETS / "gsm8k_tiny.jsonl"

SCRIPT = {
    "Tom has 3 apples": "Tom has 3 + 4 = 7 apples.\n#### 7",                      # right, after ####
    "1,200 pens": "1,200 * 2 = 2,400. The answer is 2,400.",                     # right, commas
    "Mia earns": "12.50 * 4 = 50.00 dollars",                                    # right, last number 50.00
    "A rope of 10": "10 / 2 = 4",                                                # wrong
    "The temperature was 5": "5 - 8 = -3. The answer is -3.",                    # right, negative
    # "Sam read" is not scripted: "I do not know." has no number -> wrong
}


def cfg(**kw):
    base = dict(tasks=["gsm8k"], data={"gsm8k": str(DATA)}, batch_size=4, max_new_tokens=64)
    return EvalConfig(**{**base, **kw})


def test_scripted_accuracy_and_result_file(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    metrics = evaluate(model, tokenizer, cfg(), tmp_path, prompt_style="plain", progress=False)
    assert metrics == {"gsm8k/accuracy": pytest.approx(4 / 6)}
    data = json.loads((tmp_path / "gsm8k.json").read_text())
    assert data["metrics"] == {"accuracy": pytest.approx(4 / 6)}
    rows = data["examples"]
    assert [r["gold"] for r in rows] == ["7", "2400", "50", "5", "-3", "35"]
    assert [r["prediction"] for r in rows] == ["7", "2400", "50.00", "4", "-3", None]
    assert [r["correct"] for r in rows] == [True, True, True, False, True, False]
    assert rows[0]["prompt"] == "Question: " + read_records(str(DATA))[0]["question"] + "\nAnswer:"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"metrics": metrics, "protocols": {"gsm8k": "fedllm"}}
    assert data["settings"]["answer_protocol"] == "fedllm"


def test_resume_regenerates_only_what_is_missing(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    first = evaluate(model, tokenizer, cfg(), tmp_path, prompt_style="plain", progress=False)
    n_prompts = len(model.prompts)
    assert n_prompts == 6
    again = evaluate(model, tokenizer, cfg(), tmp_path, prompt_style="plain", progress=False)
    assert again == first and len(model.prompts) == n_prompts          # nothing generated again

    path = tmp_path / "gsm8k.json"                                     # simulate an interrupted run
    data = json.loads(path.read_text())
    data["examples"] = data["examples"][:4]
    path.write_text(json.dumps(data))
    assert evaluate(model, tokenizer, cfg(), tmp_path, prompt_style="plain", progress=False) == first
    assert len(model.prompts) == n_prompts + 2

    evaluate(model, tokenizer, cfg(max_new_tokens=32), tmp_path, prompt_style="plain", progress=False)
    assert len(model.prompts) == n_prompts + 2 + 6                     # other settings: start afresh


def test_k_shot_puts_exemplars_first(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    metrics = evaluate(model, tokenizer, cfg(shots=2, limit=2), tmp_path, prompt_style="plain", progress=False)
    assert metrics["gsm8k/accuracy"] == 1.0
    prompt = model.prompts[0]
    (q1, a1), (q2, a2) = GSM8K_COT_EXEMPLARS[:2]
    assert prompt.startswith(f"Question: {q1}\nAnswer: {a1}\n\nQuestion: {q2}\nAnswer: {a2}\n\nQuestion: ")
    assert prompt.endswith("\nAnswer:")


def test_chat_style_uses_the_chat_template(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    evaluate(model, tokenizer, cfg(limit=1), tmp_path, progress=False)     # default: the chat template
    q = read_records(str(DATA))[0]["question"]
    assert model.prompts == [f"<|user|>{q}<|end|><|assistant|>"]


def test_alpaca_style_on_held_out_training_records(scripted_lm, tokenizer, tmp_path, alpaca_prompt):
    model = scripted_lm(SCRIPT)
    records = [{**r, "category": "arith"} for r in read_records(str(DATA))]
    metrics = evaluate(model, tokenizer, cfg(data={}), tmp_path, records=records, prompt_style="alpaca",
                       progress=False)
    assert metrics["gsm8k/accuracy"] == pytest.approx(4 / 6)
    assert sorted(model.prompts) == sorted(alpaca_prompt(r["question"]) for r in records)


def test_tag_names_the_files_and_nothing_is_written_without_out_dir(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm(SCRIPT)
    evaluate(model, tokenizer, cfg(limit=2), tmp_path, tag="round 3", prompt_style="plain", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gsm8k.round-3.json", "summary.round-3.json"]
    assert evaluate(model, tokenizer, cfg(limit=2), None, prompt_style="plain", progress=False)


def test_missing_data_file_is_an_input_error(scripted_lm, tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        evaluate(scripted_lm(SCRIPT), tokenizer, cfg(data={"gsm8k": str(tmp_path / "nope.jsonl")}), None,
                 progress=False)
