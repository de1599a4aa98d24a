"""fedllm: federated fine-tuning of LLMs with LoRA."""

from fedllm.common.moved import serve_moved_modules

__version__ = "0.2.0"

serve_moved_modules()  # the flat layout's module paths (fedllm.config, fedllm.server, ...), for one release
