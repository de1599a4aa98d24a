"""fedllm: federated fine-tuning of LLMs with LoRA."""
__version__ = "0.1.0"
