"""The code sandbox fixture of the FlowerTune tests (skips where this machine cannot isolate a program)."""

from __future__ import annotations

import pytest

from fedllm.evaluation.code_sandbox import CodeSandbox, sandbox_problem


@pytest.fixture(scope="module")
def code_sandbox() -> CodeSandbox:
    problem = sandbox_problem()
    if problem:
        pytest.skip(f"no code sandbox here: {problem}")
    return CodeSandbox()
