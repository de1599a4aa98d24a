"""Python programs of the Code challenge are judged as the bigcode-evaluation-harness judges them (issue #49).

Each case is a solution (HumanEval-style fixture record ``add``, or MBPP 601 ``max_of_three``) followed by its
tests, as :func:`checked_program` assembles them. HARNESS holds ``(passed, result)`` that the harness's own
``check_correctness(program, timeout=3.0, ...)`` returned for each: ``bigcode_eval/tasks/custom_metrics/execute.py``
of yan-gao-GY/bigcode-evaluation-harness at 3ff8ee00 (the fork FlowerTune installs; identical to upstream
bigcode-project's at 8fc5bae6), run outside this repository on this machine with /usr/bin/python3 (3.11.2) on
2026-12-02. Before this fix fedllm passed every program that exited with status 0, so the ``exit``/``quit``/
``sys.exit``/``os._exit`` cases, the guarded calls and ``sys.stdin.read()`` passed, and the ``__main__`` block and
the caught timer failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sandboxkit

from fedllm.evaluation.code_sandbox import LANGUAGES, NO_VERDICT_STATUS, VERDICT_RULES
from fedllm.evaluation.flowertune_code_prompts import CODE_SETS, checked_program

code_sandbox = sandboxkit.code_sandbox
short_python_timer = sandboxkit.short_python_timer
RECORDS = json.loads((Path(__file__).parent.parent / "assets" / "eval" / "flowertune" / "records.json").read_text())
HUMANEVAL = next(cs for cs in CODE_SETS if cs.key == "humaneval")
MBPP = next(cs for cs in CODE_SETS if cs.key == "mbpp")
ADD, MAX3 = RECORDS["humaneval"][0], RECORDS["mbpp"][0]
HEAD, MAX3_DEF = ADD["prompt"].strip() + "\n", "def max_of_three(a, b, c):\n"
NOT_CALLABLE = "failed: 'NoneType' object is not callable"

CASES = {  # name: (code set, record, solution)
    "correct": (HUMANEVAL, ADD, HEAD + "    return a + b\n"),
    "correct_prints": (HUMANEVAL, ADD, HEAD + "    print('working')\n    return a + b\n"),
    "wrong_then_exit": (HUMANEVAL, ADD, HEAD + "    return a - b\nexit(0)\n"),
    "mbpp_wrong_then_quit": (MBPP, MAX3, MAX3_DEF + "    return a\nquit()\n"),
    "wrong_then_sys_exit": (HUMANEVAL, ADD, HEAD + "    return a - b\nimport sys\nsys.exit(0)\n"),
    "wrong_then_os_exit": (HUMANEVAL, ADD, HEAD + "    return a - b\nimport os\nos._exit(0)\n"),
    "wrong_then_raise_systemexit": (HUMANEVAL, ADD, HEAD + "    return a - b\nraise SystemExit(0)\n"),
    "correct_calls_getcwd": (HUMANEVAL, ADD, HEAD + "    import os\n    os.getcwd()\n    return a + b\n"),
    "correct_imports_resource": (HUMANEVAL, ADD, HEAD + "    import resource\n    return a + b\n"),
    "correct_runs_subprocess": (HUMANEVAL, ADD,
                                HEAD + "    import subprocess\n    subprocess.run(['true'])\n    return a + b\n"),
    "correct_reads_stdin": (HUMANEVAL, ADD, HEAD + "    import sys\n    sys.stdin.read()\n    return a + b\n"),
    "correct_then_main_block_exits": (HUMANEVAL, ADD,
                                      HEAD + "    return a + b\nif __name__ == '__main__':\n    raise SystemExit(1)\n"),
    "loops_forever": (HUMANEVAL, ADD, HEAD + "    while True:\n        pass\n"),
    "mbpp_correct_catches_the_timer": (MBPP, MAX3, MAX3_DEF + "    return max(a, b, c)\n"
                                       "try:\n    while True:\n        pass\nexcept Exception:\n    pass\n"),
}
HARNESS = {
    "correct": (True, "passed"),
    "correct_prints": (True, "passed"),
    "wrong_then_exit": (False, NOT_CALLABLE),
    "mbpp_wrong_then_quit": (False, NOT_CALLABLE),
    "wrong_then_sys_exit": (False, "failed: 0"),
    "wrong_then_os_exit": (False, "timed out"),
    "wrong_then_raise_systemexit": (False, "failed: 0"),
    "correct_calls_getcwd": (False, NOT_CALLABLE),
    "correct_imports_resource": (False, "failed: import of resource halted; None in sys.modules"),
    "correct_runs_subprocess": (False, NOT_CALLABLE),
    "correct_reads_stdin": (False, "failed: "),
    "correct_then_main_block_exits": (True, "passed"),
    "loops_forever": (False, "timed out"),
    "mbpp_correct_catches_the_timer": (True, "passed"),
}


def _harness_result(result) -> str:
    """The harness's result string of a fedllm verdict: ``passed``, ``timed out`` (the timer, or no verdict at
    all, as the harness's empty result list reads) or the ``failed: ...`` line."""
    if result.passed:
        return "passed"
    if result.status == "Timeout" or result.exit_code == NO_VERDICT_STATUS:
        return "timed out"
    return next(line for line in result.stderr.splitlines() if line.startswith("failed: "))


TIMED = {"loops_forever", "mbpp_correct_catches_the_timer"}
"""Programs that run into the timer: run under a 1 s one (:func:`sandboxkit.short_python_timer`), same verdicts."""


@pytest.mark.parametrize("name", list(CASES))
def test_flowertune_python_verdict_equals_the_harness(code_sandbox, name, request):
    if name in TIMED:
        request.getfixturevalue("short_python_timer")
    cs, record, solution = CASES[name]
    result = code_sandbox.run("python", checked_program(solution, cs.test(record)))
    assert (result.passed, _harness_result(result)) == HARNESS[name]


def test_flowertune_python_time_limits_are_the_harness():
    """The timer is 3 s (compute_code_eval's timeout=3.0); the worker is killed 1 s later (join(timeout + 1))."""
    python = LANGUAGES["python"]
    assert (python.seconds, python.seconds + python.grace_seconds) == (3.0, 4.0)


def test_flowertune_code_judges_again_verdicts_stored_by_exit_status(code_sandbox):
    """A result file written before the harness's rules (``exit(0)`` scored a pass) is judged again on resume."""
    from fedllm.evaluation.tasks.flowertune_code import FlowerTuneCode

    cs, record, solution = CASES["wrong_then_exit"]
    entry = {"id": "humaneval/0", "solutions": [solution], "passed": [True], "status": ["OK"]}
    saved = []
    results = SimpleNamespace(save=lambda order: saved.append(list(order)))
    assert FlowerTuneCode._score(code_sandbox, cs, entry, record, ["humaneval/0"], results) == [False]
    assert entry["status"] == ["Failed"] and entry["verdict_rules"] == VERDICT_RULES and saved
    entry["passed"] = ["kept"]  # judged under these rules: not run again
    assert FlowerTuneCode._score(code_sandbox, cs, entry, record, ["humaneval/0"], results) == ["kept"]
