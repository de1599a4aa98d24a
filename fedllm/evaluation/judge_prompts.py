"""FastChat's single-answer grading prompts and the parsing of their ``[[rating]]`` verdicts.

Prompt names (from FastChat's ``judge_prompts.jsonl``): ``single-v1`` (general
question), ``single-math-v1`` (graded against a reference answer),
``single-v1-multi-turn`` and ``single-math-v1-multi-turn`` (the second turn of a
two-turn conversation). MT-Bench uses reference answers for the ``math``,
``reasoning`` and ``coding`` categories.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

NEED_REF_CATEGORIES = ("math", "reasoning", "coding")
"""MT-Bench categories graded against a reference answer (FastChat's NEED_REF_CATS)."""

_PATTERNS = (
    re.compile(r"\[\[(\d+\.?\d*)\]\]"),
    re.compile(r"\[(\d+\.?\d*)\]"),
)


def load_judge_prompts(path: Path) -> dict[str, dict]:
    """Judge prompts of a FastChat ``judge_prompts.jsonl`` by name."""
    prompts = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            p = json.loads(line)
            prompts[p["name"]] = p
    return prompts


def prompt_name(needs_reference: bool, multi_turn: bool) -> str:
    """The FastChat single-grading prompt for a (reference, turn) combination."""
    return ("single-math-v1" if needs_reference else "single-v1") + ("-multi-turn" if multi_turn else "")


def grading_messages(prompt: dict, questions: list[str], answers: list[str],
                     references: Optional[list[str]] = None) -> list[dict]:
    """Chat messages asking a judge to grade an answer (one turn) or a second turn (two turns).

    Args:
        prompt: a FastChat single-grading prompt (``system_prompt``, ``prompt_template``).
        questions: the user turns (one or two).
        answers: the model's answers, one per turn.
        references: reference answers per turn, for reference-based prompts.

    Returns:
        ``[{"role": "system", ...}, {"role": "user", ...}]`` as FastChat sends them.
    """
    if len(questions) != len(answers) or len(questions) not in (1, 2):
        raise ValueError("grading needs one or two questions with one answer each")
    kwargs: dict[str, str] = {}
    for i, ref in enumerate(references or [], start=1):
        kwargs[f"ref_answer_{i}"] = ref
    if len(questions) == 1:
        kwargs.update(question=questions[0], answer=answers[0])
    else:
        kwargs.update(question_1=questions[0], question_2=questions[1], answer_1=answers[0], answer_2=answers[1])
    user = prompt["prompt_template"].format(**kwargs)
    return [{"role": "system", "content": prompt["system_prompt"]}, {"role": "user", "content": user}]


def parse_rating(judgment: str, context: str = "", in_range: bool = False) -> float:
    """The rating of a judgment: ``[[x]]``, else ``[x]``; -1 with a warning if none.

    The two patterns are FastChat's (``one_score_pattern`` and its backup in
    ``common.py``/``show_result.py``), which OpenFedLLM's ``show_results_vicuna.py`` and
    FedLLM-Bench's ``show_results_bench.py`` use too; like them, any number found is kept, even
    outside the 1-10 the prompts ask for (``[[0]]``, ``[[11]]``).

    Args:
        judgment: the judge's reply.
        context: what was judged, for the warning.
        in_range: count a rating outside 1-10 as unparsed (``eval.judge.ratings: in_range``).
    """
    for pattern in _PATTERNS:
        match = pattern.search(judgment)
        if match:
            rating = float(match.group(1))
            if not in_range or 1 <= rating <= 10:
                return rating
            break
    log.warning("unparseable judge rating%s: %r", f" ({context})" if context else "", judgment[:200])
    return -1.0
