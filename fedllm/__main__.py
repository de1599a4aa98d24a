"""``python -m fedllm`` / ``accelerate launch -m fedllm`` / ``torchrun -m fedllm``: the same entry point as ``fedllm``."""

import sys

from fedllm.commands.cli import main

sys.exit(main())
