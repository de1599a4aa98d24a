"""bench/real_shape.py's export measurement: the peak a fresh ``fedllm`` process records for itself, not the bench's.
(A first 7B run read ``wait4``'s ``ru_maxrss``, into which Linux folds the parent's RSS at the fork: it printed the
training process's 17.76 GiB as the export's, which measured 13.16 GiB on its own.)"""

import subprocess
import sys
from pathlib import Path

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_launched_command_records_its_own_peak_not_the_parents(tmp_path):
    bench = load_script(ROOT / "bench" / "real_shape.py")
    held = bytearray(768 * 2**20)  # this process: 768 MiB more resident than a fresh interpreter
    held[::4096] = b"\x01" * len(held[::4096])
    peak = tmp_path / "peak-kib"
    done = subprocess.run([sys.executable, "-c", bench.FEDLLM_RECORDING_PEAK, str(peak), "--version"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    recorded_mib = int(peak.read_text()) / 1024
    assert 5 < recorded_mib < 400, recorded_mib  # a Python running `fedllm --version`, not 768 MiB + this process
    del held
