"""``held_out``: the default evaluation of a recipe that holds records out — loss, and answer accuracy where the
held-out answers have a final-answer line — checked against the model's own loss one example at a time."""

import json
import math

import pytest
import torch
from evalkit import tiny_llama_config

from fedllm.evaluation import evaluate
from fedllm.evaluation.sources import DataSourceError
from fedllm.evaluation.tasks.held_out import has_final_answer
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import EvalConfig


def causal_examples(tokenizer):
    """Three examples with different lengths and answer spans (-100 outside the answer)."""
    out = []
    for prompt, answer in [("What is 3 + 4?", " The answer is 7."), ("Hi", " 1 2 3 4 5 6 7 8 9 10"),
                           ("Compose an engaging travel blog post.", " Hawaii.")]:
        p, a = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
        out.append({"input_ids": p + a, "labels": [-100] * len(p) + a})
    return out


def test_held_out_loss_pools_supervised_tokens_as_the_models_own_loss(tiny_lm, tokenizer):
    examples = causal_examples(tokenizer)
    tiny_lm.eval()
    total, count = 0.0, 0
    with torch.no_grad():  # the model's own (mean) loss, one unpadded example at a time, pooled over tokens
        for ex in examples:
            n = sum(t != -100 for t in ex["labels"][1:])
            loss = tiny_lm(input_ids=torch.tensor([ex["input_ids"]]), labels=torch.tensor([ex["labels"]])).loss
            total += loss.item() * n
            count += n
    got = evaluate(tiny_lm, tokenizer, EvalConfig(tasks=["held_out"], batch_size=2), None, eval_examples=examples,
                   progress=False)
    assert got["held_out/loss"] == pytest.approx(total / count, abs=1e-5)
    assert got["held_out/perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert "held_out/answer_accuracy" not in got  # no raw records: nothing to answer


def test_held_out_classification_loss_and_accuracy(tokenizer):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    model = LlamaForSequenceClassification(tiny_llama_config(tokenizer, num_labels=2)).eval()
    texts = ["The cat sat.", "Cat the sat on.", "Tom has 3 apples.", "Hi", "The answer is 7."]
    examples = [{"input_ids": tokenizer(t)["input_ids"], "label": i % 2} for i, t in enumerate(texts)]
    losses, right = [], []
    with torch.no_grad():
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(ex["label"])).item())
            right.append(int(logits.argmax()) == ex["label"])
    got = evaluate(model, tokenizer, EvalConfig(tasks=["held_out"], batch_size=3), None, eval_examples=examples,
                   progress=False)
    assert got["held_out/loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert got["held_out/accuracy"] == sum(right) / len(right)


def test_held_out_without_held_out_records_says_what_to_set(tiny_lm, tokenizer):
    with pytest.raises(DataSourceError, match="data.eval_fraction > 0, data.eval_path or data.eval_split"):
        evaluate(tiny_lm, tokenizer, EvalConfig(tasks=["held_out"]), None, eval_examples=[], progress=False)


@pytest.mark.parametrize(("answer", "scored"), [("3 + 4 = 7\n#### 7", True), ("#### -1,200.5", True),
                                                 ("It is 7.", False), ("#### seven", False), ("", False)])
def test_held_out_answers_are_scored_only_with_a_final_answer_line(answer, scored):
    assert has_final_answer({"question": "q", "answer": answer}) is scored


@pytest.mark.parametrize(("data", "eval_section", "tasks", "train"), [
    ({"eval_fraction": 0.1}, {}, ["held_out"], {}),
    ({"eval_path": "held.jsonl"}, {"limit": 5}, ["held_out"], {}),
    ({"eval_fraction": 0.1, "format": "preference", "fields": {"prompt": "question", "chosen": "answer"}}, {},
     ["pref_accuracy"], {"objective": "dpo"}),
    ({"eval_fraction": 0.1}, {"tasks": []}, [], {}),          # named as none: none
    ({"eval_fraction": 0.1}, {"tasks": ["gsm8k"]}, ["gsm8k"], {}),
    ({}, {}, [], {}),                                        # nothing held out: nothing to evaluate
])
def test_held_out_is_the_default_task_of_a_recipe_that_holds_records_out(tiny_recipe, data, eval_section, tasks,
                                                                          train):
    raw = tiny_recipe(data=data, train=train, **({"eval": eval_section} if eval_section else {}))
    assert parse_recipe(raw).eval.tasks == tasks


def test_held_out_default_run_then_fedllm_eval_of_the_run_gives_the_same_numbers(tmp_path, tiny_recipe):
    """README's "your own data": a recipe with eval_fraction and no eval section evaluates its held-out records
    after training, and ``fedllm eval RUN`` (no --tasks, no --dtype) reproduces them from the checkpoint — in bf16,
    as ``train.dtype: auto`` trains on a CPU with avx512_bf16, the same numbers (fp32 weights would differ)."""
    import yaml

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(data={"eval_fraction": 0.125}, federation={"rounds": 1},
                                                 train={"dtype": "bf16"}, eval={"limit": 4, "max_new_tokens": 8})))
    from fedllm.commands.cli import main  # in this process: the eval reads the run's checkpoint from disk

    assert main(["train", str(recipe)]) == 0
    run_dir = tmp_path / "run"
    final = json.loads((run_dir / "summary.json").read_text())["final_eval"]
    assert set(final) == {"held_out/loss", "held_out/perplexity", "held_out/answer_accuracy"}, final
    assert main(["eval", str(run_dir), "--no-progress"]) == 0
    scored = json.loads((run_dir / "eval" / "held_out.json").read_text())["metrics"]
    assert (scored["loss"], scored["answer_accuracy"]) == (final["held_out/loss"], final["held_out/answer_accuracy"])
