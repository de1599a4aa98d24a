"""Helpers of the CLI tests: run ``fedllm`` in a fresh interpreter and see what it imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "peft", "datasets")

# Runs fedllm's entry point, then reports which heavy modules were imported and the
# threading variables the entry point left in the environment. ``before`` / ``after``: code run around
# the entry point in the same process (a test sharing the launch), recording what it found in ``extra``.
PROBE = """
import json, os, sys
extra = {}
exec(os.environ.pop("FEDLLM_PROBE_BEFORE", ""))
from fedllm.commands.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
exec(os.environ.pop("FEDLLM_PROBE_AFTER", ""))
report = {"code": code, "heavy": [m for m in %r if m in sys.modules], "extra": extra,
          "bitsandbytes": sys.modules.get("bitsandbytes") is not None,
          "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
                                                  "GOMP_SPINCOUNT", "FEDLLM_THREADS", "RAYON_NUM_THREADS")}}
print("@@PROBE@@" + json.dumps(report), file=sys.stderr)
""" % (HEAVY,)


def clean_env(**extra) -> dict:
    """The test's environment without threading variables (so the entry point's choice shows)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
                        "FEDLLM_THREADS", "RAYON_NUM_THREADS")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def run_probe(*args, cwd=None, before="", after="", **env):
    """``(report, stdout, stderr)`` of ``fedllm args`` in a fresh process; ``before`` / ``after``: Python code run
    in that process before / after the entry point (they fill ``report["extra"]``)."""
    env = clean_env(**env, FEDLLM_PROBE_BEFORE=before, FEDLLM_PROBE_AFTER=after)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=cwd,
                         timeout=600)
    lines = [x for x in out.stderr.splitlines() if x.startswith("@@PROBE@@")]
    assert lines, out.stderr[-3000:]
    stderr = "\n".join(x for x in out.stderr.splitlines() if not x.startswith("@@PROBE@@"))
    return json.loads(lines[-1][len("@@PROBE@@"):]), out.stdout, stderr


@pytest.fixture
def probe():
    """``probe(*args, **env) -> (report, stdout, stderr)`` for ``fedllm args`` in a fresh process."""
    return run_probe
