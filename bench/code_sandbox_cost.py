"""Wall time of one sandboxed Python program: this checkout's code sandbox beside an earlier revision's.

    python bench/code_sandbox_cost.py [--baseline 37194a1] [--trials 15]

Both ``code_sandbox.py`` files (and their launchers) are loaded by path (the earlier revision's extracted with
``git show`` into a temporary directory, deleted afterwards); each trial runs ``CodeSandbox().run("python", ...)`` of
a 6-line passing program once with each, alternating which goes first, so the machine's load moves them alike.
Prints the median seconds of each and the median of the per-trial ratios (this / baseline). Run as the user fedllm
runs as (root and an ordinary user take different paths).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("code_sandbox.py", "sandbox_launcher.py", "python_harness.py")
PROGRAM = "def add(a, b):\n    return a + b\n\ndef check(c):\n    assert c(2, 3) == 5\ncheck(add)\n"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.CodeSandbox()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="37194a1", help="git revision to compare with")
    parser.add_argument("--trials", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as old_dir:
        Path(old_dir).chmod(0o755)  # the sandbox's unprivileged uid reads the old launcher when fedllm is root
        for name in FILES:
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.baseline}:fedllm/evaluation/{name}"],
                                   capture_output=True, text=True, check=False)
            if shown.returncode == 0:
                (Path(old_dir) / name).write_text(shown.stdout)
        sandboxes = {"baseline": load("baseline_sandbox", Path(old_dir) / "code_sandbox.py"),
                     "this": load("this_sandbox", ROOT / "fedllm" / "evaluation" / "code_sandbox.py")}
        seconds = {k: [] for k in sandboxes}
        for trial in range(args.trials):
            for k in (list(sandboxes) if trial % 2 else list(sandboxes)[::-1]):
                start = time.perf_counter()
                result = sandboxes[k].run("python", PROGRAM)
                seconds[k].append(time.perf_counter() - start)
                assert result.passed, (k, result)
    ratios = [t / b for t, b in zip(seconds["this"], seconds["baseline"], strict=True)]
    print({k: round(statistics.median(v), 3) for k, v in seconds.items()},
          f"median ratio this/baseline {statistics.median(ratios):.2f} over {args.trials} trials")


if __name__ == "__main__":
    main()
