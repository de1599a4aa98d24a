"""The registered evaluation tasks; importing this package fills ``fedllm.common.registry.tasks``."""

from fedllm.evaluation.tasks import advbench, glue, gsm8k, math_qa, mt_bench, newsgroups, ref_gpt4, vicuna  # noqa: F401
