"""FlowerTune Code challenge: prompts, stop words, program assembly (bigcode-evaluation-harness, the
``yan-gao-GY`` fork FlowerTune's ``evaluation/code/README.md`` installs: ``bigcode_eval/tasks/{humaneval,mbpp,
multiple}.py``, ``custom_metrics/code_eval.py``, ``multiple_metrics/evaluation.py``).

- HumanEval: the prompt stripped; the test is ``\\n<test>\\ncheck(<entry_point>)``.
- MBPP (InCoder's format): ``\"\"\"\\n<text>\\n<first test>\\n\"\"\"\\n``; the test is the three asserts.
- MultiPL-E JavaScript / C++ (``nuprl/MultiPL-E`` ``humaneval-js``/``humaneval-cpp`` at the harness's pinned
  revision :data:`MULTIPLE_REVISION`): the prompt stripped,
  the record's stop tokens plus ``<file_sep>``; the test is the record's ``tests``.

The generated continuation is cut at the first stop word (the tokenizer's end-of-text token is one), put after
the prompt, and followed by ``\\n`` and the test: that program passes as the harness judges it (:mod:`fedllm.evaluation.code_sandbox`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedllm.evaluation.sources import HubSource

MULTIPLE_REVISION = "ff5c146da05f10bc69b9ce393b77f381b3825d1b"
"""The ``nuprl/MultiPL-E`` revision the harness loads (``GeneralMultiPLE.DATASET_REVISION`` in ``bigcode_eval/tasks/
multiple.py`` of the fork FlowerTune installs, yan-gao-GY/bigcode-evaluation-harness at 3ff8ee00: "MultiPL-E 3.1";
upstream bigcode-project moved to 28441b60 at 8fc5bae6, July 2025, after the fork)."""
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```", "<file_sep>"]
MBPP_STOP = ["\nclass", "\nassert", '\n"""', "\nprint", "\nif", "\n<|/", "\n```"]


@dataclass(frozen=True)
class CodeSet:
    """One data set of the Code challenge.

    Attributes:
        key: its metric name and ``eval.data.flowertune_code.<key>`` key.
        hub: the data set FlowerTune's harness loads.
        language: ``python``, ``javascript`` or ``cpp`` (:data:`fedllm.evaluation.code_sandbox.LANGUAGES`).
        max_length: prompt + generation tokens (FlowerTune's ``--max_length_generation``).
        prompt: record -> prompt.
        test: record -> the test code put after the program.
        stop: record -> stop words (the tokenizer's end-of-text token is added).
        expected_rows: how many rows the harness evaluates (MBPP asserts 500), or 0.
        revision: the hub revision the harness pins (``""``: the default branch, as the harness loads it).
    """

    key: str
    hub: HubSource
    language: str
    max_length: int
    prompt: Callable[[dict], str]
    test: Callable[[dict], str]
    stop: Callable[[dict], list[str]]
    expected_rows: int = 0
    revision: str = ""


CODE_SETS = (
    CodeSet("mbpp", HubSource("mbpp", None, "test"), "python", 2048,
            lambda r: f'"""\n{r["text"]}\n{r["test_list"][0]}\n"""\n', lambda r: "\n".join(r["test_list"]),
            lambda r: list(MBPP_STOP), expected_rows=500),
    CodeSet("humaneval", HubSource("openai_humaneval", None, "test"), "python", 1024,
            lambda r: r["prompt"].strip(), lambda r: f"\n{r['test']}\ncheck({r['entry_point']})",
            lambda r: list(HUMANEVAL_STOP)),
    CodeSet("multiple_js", HubSource("nuprl/MultiPL-E", "humaneval-js", "test"), "javascript", 1024,
            lambda r: r["prompt"].strip(), lambda r: r["tests"], lambda r: [*r["stop_tokens"], "<file_sep>"],
            revision=MULTIPLE_REVISION),
    CodeSet("multiple_cpp", HubSource("nuprl/MultiPL-E", "humaneval-cpp", "test"), "cpp", 1024,
            lambda r: r["prompt"].strip(), lambda r: r["tests"], lambda r: [*r["stop_tokens"], "<file_sep>"],
            revision=MULTIPLE_REVISION),
)
"""The Code challenge's data sets, in the board's column order (MBPP, HumanEval, MultiPL-E JS, C++)."""


def cut_at_stop(text: str, stop_words: list[str]) -> str:
    """``text`` up to the first occurrence of any stop word."""
    return text[:min((i for i in (text.find(s) for s in stop_words) if i != -1), default=len(text))]


def program_of(prompt: str, continuation: str, stop_words: list[str]) -> str:
    """The solution the harness keeps: the prompt and the continuation cut at its first stop word."""
    return prompt + cut_at_stop(continuation, stop_words)


def checked_program(solution: str, test: str) -> str:
    """What runs: the solution, a newline, the test."""
    return f"{solution}\n{test}"
