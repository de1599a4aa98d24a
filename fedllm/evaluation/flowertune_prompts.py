"""FlowerTune LLM leaderboard prompts: General NLP (MMLU), Medical and Finance challenges.

What ``flwrlabs/flower`` ``benchmarks/flowertune-llm/evaluation/{general-nlp,medical,finance}/benchmarks.py``
and ``utils.py`` render for each record (tests/assets/eval/flowertune holds their strings for fixture records):

- General NLP and Medical: ``<instruction>\\n<body>\\nThe answer is:\\n`` inside the wrapper
  ``<|im_start|>question\\n...<|im_end|>\\n<|im_start|>answer\\n`` (ChatML-like; not the tokenizer's chat
  template), where a multiple-choice body is ``Question: <q>[?]\\n\\nOptions:\\nA. ...`` (a ``?`` is
  appended unless the question ends with ``?`` or ``.``); the instructions are Meditron's.
- Finance: ``Instruction: <instruction>\\n[Input: <text>\\n]Answer: `` (FinGPT's format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedllm.evaluation.sources import HubSource

MMLU_CATEGORIES = {
    "stem": ["abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
             "college_computer_science", "college_mathematics", "college_physics", "computer_security",
             "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
             "high_school_chemistry", "high_school_computer_science", "high_school_mathematics",
             "high_school_physics", "high_school_statistics", "machine_learning"],
    "social_sciences": ["econometrics", "high_school_geography", "high_school_government_and_politics",
                        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
                        "human_sexuality", "professional_psychology", "public_relations", "security_studies",
                        "sociology", "us_foreign_policy"],
    "humanities": ["formal_logic", "high_school_european_history", "high_school_us_history",
                   "high_school_world_history", "international_law", "jurisprudence", "logical_fallacies",
                   "moral_disputes", "moral_scenarios", "philosophy", "prehistory", "professional_law",
                   "world_religions"],
}
"""The MMLU subjects of each General NLP category (``MMLU_CATEGORY``; ``other`` is not on the board)."""

MMLU_INSTRUCTION = "Answer the following multiple choice question."
_DOCTOR = ("You are a medical doctor answering realworld medical entrance exam questions. Based on your "
           "understanding of basic and clinical science, medical knowledge, and mechanisms underlying health, "
           "disease, patient care, and modes of therapy, answer the following multiple-choice question. Select one "
           "correct answer from A to D. Base your answer on the current and standard practices referenced in "
           "medical guidelines.")
MEDICAL_INSTRUCTIONS = {
    "pubmedqa": "As an expert doctor in clinical science and medical knowledge, can you tell me if the following "
                "statement is correct? Answer yes, no, or maybe.",
    "medqa": "You are a medical doctor taking the US Medical Licensing Examination. You need to demonstrate your "
             "understanding of basic and clinical science, medical knowledge, and mechanisms underlying health, "
             "disease, patient care, and modes of therapy. Show your ability to apply the knowledge essential for "
             "medical practice. For the following multiple-choice question, select one correct answer from A to E. "
             "Base your answer on the current and standard practices referenced in medical guidelines.",
    "medmcqa": _DOCTOR,
    "careqa": _DOCTOR,
}
"""Meditron's instructions, as FlowerTune's medical ``INSTRUCTIONS`` (MedQA's says A to E over 4 options)."""

NEWS = "What is the sentiment of this news? Please choose an answer from {negative/neutral/positive}."
TWEET = "What is the sentiment of this tweet? Please choose an answer from {negative/neutral/positive}."


def multiple_choice(question: str, choices: list[str]) -> str:
    """``Question: ...\\n\\nOptions:\\nA. ...`` (``format_example`` of general-nlp and medical ``utils.py``)."""
    if not question.endswith(("?", ".")):
        question += "?"
    options = "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(choices))
    return f"Question: {question}\n\nOptions:\n{options}"


def question_answer_prompt(instruction: str, body: str) -> str:
    """The full prompt of a General NLP or Medical question (instruction, body, answer cue, ChatML wrapper)."""
    return f"<|im_start|>question\n{instruction}\n{body}\nThe answer is:\n<|im_end|>\n<|im_start|>answer\n"


def finance_prompt(instruction: str, text: str | None) -> str:
    """``Instruction: ...\\nInput: ...\\nAnswer: `` (finance ``utils.format_example``; no Input line for empty text)."""
    return f"Instruction: {instruction}\n" + (f"Input: {text}\n" if text else "") + "Answer: "


def _letter(index: int | None) -> str | None:
    return chr(ord("A") + index) if index in (0, 1, 2, 3) else None


def _medqa_gold(record: dict) -> str | None:
    return next((opt["key"] for opt in record["options"] if opt["value"] == record["answer"]), None)


def _sentiment_of_score(score: float) -> str:
    """FiQA's label from its sentiment score (``generate_label``)."""
    return "negative" if score < -0.1 else "neutral" if score < 0.1 else "positive"


@dataclass(frozen=True)
class QuestionSet:
    """One evaluation data set of a challenge.

    Attributes:
        key: its name in the challenge's metrics and in ``eval.data.<task>.<key>``.
        hub: the data set FlowerTune's code loads (MMLU: one config per subject).
        answer_type: ``mcq``, ``boolean`` (General NLP, Medical) or ``sentiment`` (Finance).
        prompt: raw record -> prompt text.
        gold: raw record -> reference answer (None: the record has none).
        hub_splits: splits concatenated in this order (FiQA: train, validation, test); default ``hub.split``.
        test_fraction: FlowerTune's ``train_test_split(test_fraction, seed=42)["test"]`` of the loaded rows, or 0.
    """

    key: str
    hub: HubSource
    answer_type: str
    prompt: Callable[[dict], str]
    gold: Callable[[dict], str | None]
    hub_splits: tuple[str, ...] = ()
    test_fraction: float = 0.0


def mmlu_set(category: str) -> QuestionSet:
    """The MMLU subjects of ``category`` (``lukaemon/mmlu``; records carry their ``subset``)."""
    return QuestionSet(category, HubSource("lukaemon/mmlu", None, "test"), "mcq",
                       lambda r: question_answer_prompt(MMLU_INSTRUCTION, multiple_choice(
                           r["input"], [r["A"], r["B"], r["C"], r["D"]])),
                       lambda r: r["target"])


def _medical(key: str, question: Callable[[dict], str]) -> Callable[[dict], str]:
    return lambda r: question_answer_prompt(MEDICAL_INSTRUCTIONS[key], question(r))


MEDICAL_SETS = (
    QuestionSet("pubmedqa", HubSource("bigbio/pubmed_qa", "pubmed_qa_labeled_fold0_source", "test"), "boolean",
                _medical("pubmedqa", lambda r: "\n".join(r["CONTEXTS"]) + "\n" + r["QUESTION"]),
                lambda r: r["final_decision"]),
    QuestionSet("medmcqa", HubSource("medmcqa", None, "validation"), "mcq",
                _medical("medmcqa", lambda r: multiple_choice(r["question"], [r["opa"], r["opb"], r["opc"], r["opd"]])),
                lambda r: _letter(int(r["cop"]))),
    QuestionSet("medqa", HubSource("bigbio/med_qa", "med_qa_en_4options_source", "test"), "mcq",
                _medical("medqa", lambda r: multiple_choice(r["question"], [o["value"] for o in r["options"]])),
                _medqa_gold),
    QuestionSet("careqa", HubSource("HPAI-BSC/CareQA", "CareQA_en", "test"), "mcq",
                _medical("careqa", lambda r: multiple_choice(r["question"], [r["op1"], r["op2"], r["op3"], r["op4"]])),
                lambda r: _letter(int(r["cop"]) - 1)),
)
"""The Medical challenge's data sets, in the board's column order."""

FINANCE_SETS = (
    QuestionSet("fpb", HubSource("takala/financial_phrasebank", "sentences_50agree", "train"), "sentiment",
                lambda r: finance_prompt(NEWS, r["sentence"]),
                lambda r: {0: "negative", 1: "neutral", 2: "positive"}[int(r["label"])], test_fraction=0.25),
    QuestionSet("fiqa", HubSource("pauri32/fiqa-2018", None, "train"), "sentiment",
                lambda r: finance_prompt(TWEET if r["format"] == "post" else NEWS, r["sentence"]),
                lambda r: _sentiment_of_score(r["sentiment_score"]),
                hub_splits=("train", "validation", "test"), test_fraction=0.25),
    QuestionSet("tfns", HubSource("zeroshot/twitter-financial-news-sentiment", None, "validation"), "sentiment",
                lambda r: finance_prompt(TWEET, r["text"]),
                lambda r: {0: "negative", 1: "positive", 2: "neutral"}[int(r["label"])]),
)
"""The Finance challenge's data sets, in the board's column order."""
