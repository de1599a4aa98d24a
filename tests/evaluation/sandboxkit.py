"""The code sandbox fixture of the FlowerTune tests (skips where this machine cannot isolate a program), and a way
to run programs in a sandbox started by an ordinary user (``nobody``) when the tests run as root."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import pytest

from fedllm.evaluation import code_sandbox as code_sandbox_module
from fedllm.evaluation.code_sandbox import CodeSandbox, sandbox_problem

NOBODY = 65534
_AS_NOBODY = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("code_sandbox", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["code_sandbox"] = module
spec.loader.exec_module(module)
sandbox = module.CodeSandbox()
programs = json.loads(sys.stdin.read())
print(json.dumps({name: vars(sandbox.run(language, source)) for name, (language, source) in programs.items()}))
"""
"""Run by ``python3`` as ``nobody``: code_sandbox.py needs only the standard library, so it is loaded by path."""


@pytest.fixture(scope="module")
def code_sandbox() -> CodeSandbox:
    problem = sandbox_problem()
    if problem:
        pytest.skip(f"no code sandbox here: {problem}")
    return CodeSandbox()


SHORT_TIMER_S = 1.0
"""The Python timer of programs that run into it (the harness's is 3 s, checked by
test_flowertune_python_time_limits_are_the_harness): what the timer and the kill ``grace_seconds`` after it do
does not depend on its length, and every second of it is a second of CPU burnt by the looping program."""


@pytest.fixture
def short_python_timer(monkeypatch) -> float:
    """Python programs run under a :data:`SHORT_TIMER_S` timer (the kill still ``grace_seconds`` after it)."""
    python = code_sandbox_module.LANGUAGES["python"]
    monkeypatch.setitem(code_sandbox_module.LANGUAGES, "python", dataclasses.replace(python, seconds=SHORT_TIMER_S))
    return SHORT_TIMER_S


SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_SET_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def nobody_python() -> tuple[str, str]:
    """``(python3 that nobody can run on code_sandbox.py, "")``, or ``("", why none)`` (not root, no setpriv...)."""
    if os.geteuid() != 0:
        return "", "the tests do not run as root (the ordinary-user path is the in-process sandbox then)"
    if shutil.which("setpriv") is None:
        return "", "setpriv is not on PATH"
    python = shutil.which("python3", path=SYSTEM_PATH)
    if python is None:
        return "", f"no python3 on {SYSTEM_PATH}"
    probe = subprocess.run([*_SET_NOBODY, python, "-c", "open(__import__('sys').argv[1]).close()",
                            code_sandbox_module.__file__], capture_output=True, text=True, timeout=60, check=False,
                           cwd="/", env={"PATH": SYSTEM_PATH})
    if probe.returncode != 0:
        return "", f"nobody cannot run {python} on {code_sandbox_module.__file__}: {probe.stderr.strip()[-200:]}"
    return python, ""


def run_as_nobody(programs: dict[str, tuple[str, str]], env: dict[str, str]) -> dict[str, dict]:
    """``{name: ProgramResult fields}`` of each ``(language, source)``, run by a CodeSandbox that ``nobody`` starts
    (``setpriv``) with ``env`` as its environment."""
    python, problem = nobody_python()
    assert python, problem
    done = subprocess.run([*_SET_NOBODY, python, "-c", _AS_NOBODY, code_sandbox_module.__file__],
                          input=json.dumps(programs), capture_output=True, text=True,
                          env={"PATH": SYSTEM_PATH, **env}, timeout=300, check=False, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
