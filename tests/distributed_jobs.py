"""Several ``fedllm`` commands run one after another by the processes of ONE torchrun launch.

tests/test_distributed.py checks many strategies on two gloo processes; a launch per strategy would
start the processes, import torch and build the tokenizer again each time. Here the same two processes
run every command through ``fedllm.commands.cli.main`` (what ``python -m fedllm`` runs), in one process group.

Usage: ``torchrun --nproc_per_node 2 tests/distributed_jobs.py JOBS.json OUT_DIR`` where JOBS.json maps a
job name to its ``fedllm`` arguments; each process writes ``OUT_DIR/NAME.rank<R>.rc`` (the exit code).
The jobs skip plot.png, as the suite's in-process runs do (tests/conftest.py's ``_no_plot_png``): no test of
a launch reads it, and rank 0 drew it in every job: ~1 CPU-s the first (matplotlib's import), ~0.23 each after.
"""

import json
import os
import sys
from pathlib import Path

import fedllm.engine.server
from fedllm.commands.cli import main

if __name__ == "__main__":
    fedllm.engine.server.write_run_plot = lambda run_dir: None
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for name, argv in jobs.items():
        print(f"@@JOB@@ {name}: fedllm {' '.join(argv)}", file=sys.stderr, flush=True)
        code = main(argv)
        done = out / f"{name}.rank{os.environ['RANK']}.rc"
        done.with_suffix(".tmp").write_text(str(code))
        done.with_suffix(".tmp").rename(done)  # whole or absent: the test polls for it
