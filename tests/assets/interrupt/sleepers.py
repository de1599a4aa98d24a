"""Tests that start child processes and wait on them (tests/cli/test_interrupt.py interrupts a pytest run of them)."""

import os
import subprocess
import sys
from pathlib import Path

SLEEP = "import time; time.sleep(600)"


def waits_on_a_child(session: bool) -> None:
    """Start a sleeping child (in this process group, or in a session of its own as Flower's processes are), say
    so with a marker file named after this worker and the child, and wait on it."""
    child = subprocess.Popen([sys.executable, "-c", SLEEP], start_new_session=session)
    marker = Path(os.environ["FEDLLM_INTERRUPT_MARKERS"]) / f"{os.getpid()}-{child.pid}"
    marker.write_text(str(child.pid))
    child.wait()
