"""Where a command's CPU goes, process by process: README's test command by default.

    python bench/suite_processes.py [--interval 0.5] [--json OUT] [-- COMMAND ...]

Runs COMMAND (default: ``python -m pytest -q -n 2``, README's test command) and, while it runs, reads every
process's CPU time (user + system, ``/proc/PID/stat``) every ``--interval`` seconds, keeping each process's last
reading, its command line and the test it was started in (``PYTEST_CURRENT_TEST`` in its environment, inherited
from the test that started it). A process killed with a signal is counted up to its last reading (it writes no
record of its own: Flower's SuperLinks and SuperNodes, node workers after ``kill -9``); a process that lives less
than an interval may be missed, and each is read up to an interval before its end (the printed sum of the command's
process tree as the kernel counts it, which leaves out orphans, bounds the difference). Processes that ran before
the command started are left out; run it on an otherwise idle machine, since any process started meanwhile counts.

It prints the CPU-seconds by kind of process (the pytest-xdist workers, where in-process tests run; node workers;
SuperLinks; SuperNodes; ServerApp runners; ``flwr`` and ``fedllm`` CLI calls; ...), and the tests whose processes
cost most. The figures in docs/measurements/test-suite.md come from it.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
README_TESTS = [sys.executable, "-m", "pytest", "-q", "-n", "2"]


@dataclass
class Seen:
    """One process: its command line, the test it was started in, its CPU-seconds at the last reading."""

    pid: int
    cmd: list[str]
    test: str
    cpu: float


def _stat(pid: str) -> tuple[float, int] | None:
    """CPU-seconds (user + system) and start time (clock ticks after boot) of process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19])


def _read(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def machine_cpu() -> float:
    """CPU-seconds every process of the machine has spent since boot (user, nice and system; ``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / TICKS


def _children_cpu() -> float:
    """CPU-seconds of this process's ended descendants, as the kernel sums them (those each parent waited for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def _boot_ticks_now() -> int:
    """Clock ticks since boot (the unit of a process's start time)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * TICKS)


class Readings:
    """The last reading of every process started after this object was made (``skip``: pids left out)."""

    def __init__(self, skip: set[int]):
        self.started_after = _boot_ticks_now() - 1
        self.skip = skip
        self.seen: dict[tuple[int, int], Seen] = {}

    def read(self) -> None:
        """Read each such process once: its CPU, and its command line (again each time: a process that execs
        changes it)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in self.skip:
                continue
            got = _stat(pid)
            if got is None or got[1] < self.started_after:
                continue
            cpu, start = got
            key = (int(pid), start)
            cmd = _read(f"/proc/{pid}/cmdline")
            if key not in self.seen:
                env = _read(f"/proc/{pid}/environ")
                test = next((e.split("=", 1)[1] for e in env if e.startswith("PYTEST_CURRENT_TEST=")), "")
                self.seen[key] = Seen(int(pid), cmd, test, cpu)
            else:
                self.seen[key].cpu = cpu
                self.seen[key].cmd = cmd or self.seen[key].cmd


KINDS = (  # (kind, words of the command line that mark it), first match wins
    ("pytest-xdist workers (in-process tests)", ("import sys;exec(eval(sys.stdin.readline()))",)),
    ("node workers", ("fedllm.flower.runtime clientapps",)),
    ("ServerApp runners", ("fedllm.flower.runtime serverapps",)),
    ("SuperLinks", ("fedllm.flower.superlink", "flower-superlink", "flower-superexec")),
    ("SuperNodes", ("fedllm.flower.supernode", "flower-supernode")),
    ("Flower's own ClientApp processes", ("flwr-clientapp", "flwr-serverapp")),
    ("flwr CLI calls", ("bin/flwr ",)),
    ("fedllm CLI calls", ("-m fedllm ", "bin/fedllm ", "fedllm/__main__.py")),
    ("two-process jobs (torchrun)", ("torchrun", "distributed_jobs.py")),
    ("sandboxed programs (code evaluation)", ("sandbox_launcher.py", "How a Python program of the Code")),
    ("compilers (torch.compile)", ("cc1plus", "/cc ", "g++", "gcc")),
    ("Chromium (status page)", ("chromium", "headless")),
    ("pytest controller", ("-m pytest",)),
)


def kind(cmd: list[str]) -> str:
    line = " ".join(cmd) + " "
    for name, words in KINDS:
        if any(word in line for word in words):
            return name
    if cmd and Path(cmd[0]).name.startswith("python"):
        return "other Python processes (probes, scripts)"
    return "other processes"


def report(seen: list[Seen], wall: float, tree_cpu: float, machine: float, top: int = 15) -> dict:
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_test: dict[str, float] = defaultdict(float)
    for s in seen:
        k = kind(s.cmd)
        by_kind[k][0] += 1
        by_kind[k][1] += s.cpu
        if s.test and k != "pytest-xdist workers (in-process tests)":
            by_test[s.test.rsplit(" ", 1)[0]] += s.cpu
    total = sum(s.cpu for s in seen)
    print(f"{wall:.0f} s wall, {total:.0f} CPU-s in {len(seen)} processes read every interval (the command's "
          f"process tree as the kernel summed it: {tree_cpu:.0f} CPU-s, without orphans; the whole machine: "
          f"{machine:.0f} CPU-s)")
    print(f"{'CPU-s':>8} {'share':>6} {'processes':>9}  kind")
    for name, (count, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{cpu:8.1f} {100 * cpu / max(total, 1e-9):5.1f}% {int(count):9d}  {name}")
    print(f"\nthe {top} tests whose processes (not their worker's own CPU) cost most:")
    for test, cpu in sorted(by_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8.1f}  {test}")
    kinds = {k: {"processes": int(v[0]), "cpu_s": v[1]} for k, v in by_kind.items()}
    return {"wall_s": wall, "cpu_s": total, "tree_cpu_s": tree_cpu, "machine_cpu_s": machine, "by_kind": kinds,
            "by_test": dict(by_test), "processes": [asdict(s) for s in seen]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between readings")
    parser.add_argument("--json", help="write the table and every process's record here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND (default: README's test command)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = command or README_TESTS
    readings = Readings(skip={os.getpid()})
    t0, machine0, tree0 = time.monotonic(), machine_cpu(), _children_cpu()
    child = subprocess.Popen(command, cwd=ROOT)
    try:
        while child.poll() is None:
            readings.read()
            time.sleep(args.interval)
        readings.read()  # the last readings of what is still there
    except KeyboardInterrupt:
        child.wait()
    wall, machine, tree = time.monotonic() - t0, machine_cpu() - machine0, _children_cpu() - tree0
    out = report(list(readings.seen.values()), wall, tree, machine)
    out.update(command=command, returncode=child.returncode)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
