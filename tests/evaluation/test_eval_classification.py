"""Classifier tasks (GLUE RTE/CoLA/QNLI, 20NG): accuracy, and Matthews correlation against scikit-learn."""

import json
import random

import pytest
import torch
from evalkit import tiny_llama_config
from sklearn.metrics import matthews_corrcoef as sk_mcc

from fedllm.evaluation import evaluate
from fedllm.evaluation.metrics import accuracy, matthews_corrcoef, mean_rating
from fedllm.evaluation.sources import DataSourceError
from fedllm.recipe.schema import EvalConfig


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mcc_is_scikit_learns(seed):
    rng = random.Random(seed)
    labels = [rng.randint(0, 1) for _ in range(50)]
    preds = [rng.randint(0, 1) for _ in range(50)]
    assert matthews_corrcoef(labels, preds) == pytest.approx(sk_mcc(labels, preds))
    assert matthews_corrcoef(labels, labels) == 1.0
    assert matthews_corrcoef([0, 1, 0, 1], [1, 0, 1, 0]) == -1.0


def test_accuracy_and_mean_rating():
    assert accuracy([True, False, True, True]) == 0.75 and accuracy([]) == 0.0
    assert mean_rating([8, -1, 6]) == 7.0
    assert mean_rating([-1]) != mean_rating([-1])            # NaN when nothing is valid


@pytest.fixture
def classifier(tokenizer):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    model = LlamaForSequenceClassification(tiny_llama_config(tokenizer, num_labels=2))
    model.config.label2id = {"unacceptable": 0, "acceptable": 1}
    return model


SENTENCES = ["The cat sat.", "Cat the sat on.", "Tom has 3 apples.", "Apples has Tom 3 more and", "Hi",
             "Compose an engaging travel blog post about a recent trip to Hawaii.", "The answer is 7.",
             "is answer The", "Rating: helpful and accurate.", "1 2 3 4"]


def reference_predictions(model, tokenizer, texts):
    """One text at a time, no padding: what the batched path must reproduce."""
    model.eval()
    with torch.no_grad():
        return [int(model(**tokenizer(t, return_tensors="pt")).logits.argmax(-1)) for t in texts]


def test_cola_matches_unbatched_predictions_and_sklearn(classifier, tokenizer, tmp_path):
    labels = [i % 2 for i in range(len(SENTENCES))]
    data = tmp_path / "cola.jsonl"
    data.write_text("".join(json.dumps({"sentence": s, "label": ["unacceptable", "acceptable"][y]}) + "\n"
                            for s, y in zip(SENTENCES, labels)))
    classifier.train()
    cfg = EvalConfig(tasks=["cola"], data={"cola": str(data)}, batch_size=4)
    metrics = evaluate(classifier, tokenizer, cfg, tmp_path / "out", progress=False)
    assert classifier.training                                    # state restored
    preds = reference_predictions(classifier, tokenizer, SENTENCES)
    assert metrics["cola/mcc"] == pytest.approx(sk_mcc(labels, preds))
    assert metrics["cola/accuracy"] == pytest.approx(sum(a == b for a, b in zip(labels, preds)) / len(labels))
    rows = json.loads((tmp_path / "out" / "cola.json").read_text())["examples"]
    assert [r["prediction"] for r in rows] == preds and [r["label"] for r in rows] == labels


def test_held_out_tokenized_examples_and_sentence_pairs(classifier, tokenizer, tmp_path):
    examples = [{"input_ids": tokenizer(s)["input_ids"], "label": i % 2} for i, s in enumerate(SENTENCES)]
    preds = reference_predictions(classifier, tokenizer, SENTENCES)
    metrics = evaluate(classifier, tokenizer, EvalConfig(tasks=["20ng"], batch_size=3), None,
                       eval_examples=examples, progress=False)
    assert metrics == {"20ng/accuracy": pytest.approx(sum(p == i % 2 for i, p in enumerate(preds)) / len(preds))}

    pairs = tmp_path / "rte.csv"
    pairs.write_text("sentence1,sentence2,label\n" + "".join(f"{a},{b},{i % 2}\n" for i, (a, b) in
                                                              enumerate(zip(SENTENCES[:5], SENTENCES[5:]))))
    metrics = evaluate(classifier, tokenizer, EvalConfig(tasks=["rte", "qnli"], data={"rte": str(pairs)}, limit=4),
                       None, eval_examples=examples, progress=False)
    assert set(metrics) == {"rte/accuracy", "qnli/accuracy"}


def test_missing_text_column_is_named(classifier, tokenizer, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "x", "label": 0}) + "\n")
    with pytest.raises(DataSourceError, match="sentence1"):
        evaluate(classifier, tokenizer, EvalConfig(tasks=["rte"], data={"rte": str(data)}), None, progress=False)
