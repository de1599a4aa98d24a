"""``python -m fedllm`` / ``accelerate launch -m fedllm``."""

import sys

from fedllm.cli import main

sys.exit(main())
