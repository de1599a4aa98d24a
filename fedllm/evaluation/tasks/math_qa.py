"""MATH (Hendrycks et al., 2021): competition mathematics, scored on the stated final answer.

Two tasks:

- ``math``: the full 5,000-problem MATH test set, as MetaMath and the FRLoRA paper
  report. Data: ``eval.data.math`` (a file or hub id of records with ``problem`` and
  ``solution``, optionally ``answer``; or a directory in the original release's layout,
  ``<subject>/<n>.json`` for the seven subjects, i.e. ``MATH/test``), else the hub's
  ``EleutherAI/hendrycks_math`` (the seven subject configs, test split, concatenated
  in subject order: 5,000 problems).
- ``math500``: the 500-problem subset of Lightman et al. (2023), ``HuggingFaceH4/MATH-500``
  (test split), or ``eval.data.math500``.

The reference answer is the record's ``answer``, else the last ``\\boxed{}`` of its
solution; a generation's answer is its last ``\\boxed{}``, else the text after its last
"The answer is" (MetaMathQA style), else none (wrong). Answers are compared with
HF math-verify behind a numeric fast path (:mod:`fedllm.evaluation.math_answer`).
That is the ``fedllm`` answer protocol; ``metamath`` (``eval.answer_protocol``) runs MetaMath's
``eval_math.py`` rules (the reference is the solution's last box; the answer the text after
"The answer is: "; Hendrycks' ``is_equiv``; 2,048 new tokens), ``lm_eval`` the harness's
``hendrycks_math`` (``math``) or ``hendrycks_math500`` (``math500``) tasks
(``lm_eval:minerva_math`` runs the harness's Minerva variant).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

from fedllm.common.errors import InputError
from fedllm.common.registry import register_task
from fedllm.evaluation import metamath_rules
from fedllm.evaluation.answer_task import AnswerRules, AnswerTask
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.hendrycks_equiv import is_equiv
from fedllm.evaluation.math_answer import extract_math_answer, math_equal
from fedllm.evaluation.records import answer_of
from fedllm.evaluation.sources import DataSourceError, HubSource, read_hub

SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus")
"""The seven MATH subjects (hub configs of ``EleutherAI/hendrycks_math``, directories of the release)."""


def read_release_dir(root: Path) -> list[dict]:
    """Problems of a directory in the original MATH layout (``<subject>/<n>.json``), by subject then number.

    Raises:
        DataSourceError: a problem file is not valid JSON.
    """
    rows = []
    subjects = sorted(p for p in root.iterdir() if p.is_dir())
    for subject in subjects:
        files = sorted(subject.glob("*.json"), key=lambda p: (len(p.stem), p.stem))
        for f in files:
            try:
                rows.append(json.loads(f.read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise DataSourceError(f"{f}: not a MATH problem file ({e})") from e
    return rows


class _MathAnswers(AnswerTask):
    """Scoring shared by ``math`` and ``math500``."""

    lm_eval_config_of: str = ""
    """With ``eval.data``, the harness task whose config runs a group :attr:`lm_eval_task` on the whole file."""

    def gold(self, record: dict) -> Optional[str]:
        answer = record.get("answer")
        if isinstance(answer, str) and answer.strip() and "\\boxed" not in answer:
            return answer.strip()
        return extract_math_answer(answer_of(record))

    def extract(self, text: str) -> Optional[str]:
        return extract_math_answer(text)

    def equal(self, predicted: Optional[str], gold: Optional[str]) -> bool:
        return math_equal(predicted, gold)

    def run_lm_eval(self, ctx: EvalContext) -> dict[str, float]:
        """The harness's task on ``eval.data.<name>`` (any form :meth:`raw_records` reads), else on its hub data.

        The harness reads a record's ``problem`` and ``solution`` (lm-eval ``tasks/hendrycks_math/utils.py``,
        ``process_docs``: the reference is ``remove_boxed(last_boxed_only_string(solution))``), so every
        record must have both and a solution ending in a box; they go to the harness as one JSONL test file.
        ``hendrycks_math`` is a group of seven subject tasks with one config (``hendrycks_math_algebra.yaml``,
        which the others include, changing only the hub subset ``dataset_name``) whose ``exact_match`` is
        their mean weighted by size (``aggregate_metric_list: weight_by_size``), i.e. the mean over all
        problems: that config runs once over the file, under the group's name, and gives the group's number
        on those problems (``eval.limit`` takes the file's first N, not N per subject).
        """
        spec = ctx.data_spec(self.name)
        if not spec:
            return super().run_lm_eval(ctx)
        from fedllm.evaluation.harness import hendrycks_math_reference, run_harness_task

        rows = self.raw_records(ctx)
        bad = [i for i, row in enumerate(rows) if not isinstance(row.get("problem"), str)
               or hendrycks_math_reference(row.get("solution")) is None]
        if bad:
            raise InputError(f"eval.data.{self.name}={spec}: the lm_eval answer protocol runs the harness's "
                             f"{self.lm_eval_task}, which reads each record's 'problem' and 'solution' and takes the "
                             f"reference from the solution's last \\boxed{{}}; record {bad[0] + 1}"
                             f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} has no such pair")
        with tempfile.TemporaryDirectory(prefix="fedllm-math-") as tmp:
            path = Path(tmp) / "test.jsonl"
            path.write_text("".join(json.dumps({"problem": r["problem"], "solution": r["solution"]}) + "\n"
                                    for r in rows), encoding="utf-8")
            return run_harness_task(ctx, self.name, self.lm_eval_task, data_spec=str(path),
                                    home=self.lm_eval_folder or None, config_of=self.lm_eval_config_of or None,
                                    data_label=spec)

    def metamath(self) -> AnswerRules:
        return AnswerRules(gold=lambda record: metamath_rules.last_boxed(record.get("solution") or answer_of(record)),
                           extract=metamath_rules.math_answer,
                           equal=lambda predicted, gold: predicted is not None and is_equiv(predicted, gold),
                           max_new_tokens=metamath_rules.MATH_MAX_NEW_TOKENS, prompt=metamath_rules.render,
                           stop=metamath_rules.STOP, name="metamath")


@register_task("math")
class MATH(_MathAnswers):
    """MATH accuracy on the full 5,000-problem test set."""

    name = "math"
    lm_eval_task = "hendrycks_math"
    lm_eval_folder = "hendrycks_math"
    lm_eval_config_of = "hendrycks_math_algebra"
    hub = HubSource("EleutherAI/hendrycks_math", None, "test")

    def raw_records(self, ctx: EvalContext) -> list[dict]:
        spec = ctx.data_spec(self.name)
        if spec and Path(spec).expanduser().is_dir():
            root = Path(spec).expanduser()
            if any(p.is_dir() for p in root.iterdir()):
                return read_release_dir(root)
        if spec:
            return super().raw_records(ctx)
        rows: list[dict] = []
        for subject in SUBJECTS:
            rows += read_hub(HubSource(self.hub.path, subject, self.hub.split))
        return rows


@register_task("math500")
class MATH500(_MathAnswers):
    """MATH-500 accuracy (Lightman et al.'s subset)."""

    name = "math500"
    lm_eval_task = "hendrycks_math500"
    lm_eval_folder = "hendrycks_math"
    hub = HubSource("HuggingFaceH4/MATH-500", None, "test")
