"""bench/suite_processes.py: a command's CPU by process, a process killed with SIGKILL included."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]

# spends 0.6 CPU-seconds, says so in a file, then waits to be killed (a node worker's command line: the words after
# the program are its arguments)
BURN = """import pathlib, sys, time
t = time.process_time()
while time.process_time() - t < 0.6:
    pass
pathlib.Path(sys.argv[1]).write_text("burnt")
time.sleep(600)
"""


def test_a_process_killed_with_sigkill_counts_with_its_kind_and_test(tmp_path, capsys):
    bench = load_script(ROOT / "bench" / "suite_processes.py")
    readings = bench.Readings(skip={os.getpid()})
    marker = tmp_path / "burnt"
    env = dict(os.environ, PYTEST_CURRENT_TEST="tests/test_x.py::test_y (call)")
    child = subprocess.Popen([sys.executable, "-c", BURN, str(marker), "-m", "fedllm.flower.runtime", "clientapps"],
                             env=env)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # its CPU is spent
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        readings.read()
    finally:
        child.kill()
        child.wait()
    readings.read()  # gone: its last reading stays
    mine = [seen for seen in readings.seen.values() if seen.pid == child.pid]  # (the suite's other processes left out)
    got = bench.report(mine, wall=1.0, tree_cpu=0.0, machine=10.0)
    workers = got["by_kind"]["node workers"]
    assert workers["processes"] == 1 and 0.55 <= workers["cpu_s"] < 2.0, got["by_kind"]  # (/proc counts in ticks)
    assert got["by_test"] == {"tests/test_x.py::test_y": workers["cpu_s"]}
    assert "node workers" in capsys.readouterr().out


def test_the_command_runs_and_its_exit_code_and_table_come_back(tmp_path):
    bench = load_script(ROOT / "bench" / "suite_processes.py")
    out = tmp_path / "out.json"
    command = [sys.executable, "-c", "import sys; raise SystemExit(len(sys.argv))", "--", "x"]  # its "--" is its own
    assert bench.main(["--interval", "0.05", "--json", str(out), "--", *command]) == 3
    got = json.loads(out.read_text())
    assert got["returncode"] == 3 and got["command"] == command
    assert 0 <= got["tree_cpu_s"] < 5  # this command's process tree, not what this process started before
    assert got["machine_cpu_s"] >= 0 and set(got) >= {"by_kind", "by_test", "processes", "wall_s"}


def test_command_lines_are_named_by_kind():
    bench = load_script(ROOT / "bench" / "suite_processes.py")
    py = "/venv/bin/python"
    assert bench.kind([py, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]).startswith("pytest-xdist")
    assert bench.kind([py, "-m", "fedllm.flower.superlink", "--host", "127.0.0.1"]) == "SuperLinks"
    assert bench.kind([py, "-m", "fedllm.flower.supernode", "--superlink", "127.0.0.1:9092"]) == "SuperNodes"
    assert bench.kind([py, "/venv/bin/flwr", "ls", "fedllm"]) == "flwr CLI calls"
    assert bench.kind([py, "-m", "fedllm", "train", "r.yaml"]) == "fedllm CLI calls"
    assert bench.kind([py, "-c", "print(1)"]) == "other Python processes (probes, scripts)"
    assert bench.kind(["/usr/bin/cc1plus", "-quiet"]) == "compilers (torch.compile)"
