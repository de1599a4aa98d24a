"""Evaluation: task registry, batched generation, scoring and the LLM judge.

Tasks are registered in ``fedllm.common.registry.tasks`` (``gsm8k``, ``math``, ``math500``, ``mt_bench``,
``vicuna``, ``ref_gpt4``, ``rte``, ``cola``, ``qnli``, ``20ng``), and ``lm_eval:<task>`` runs any
lm-evaluation-harness task (:mod:`~fedllm.evaluation.harness`); their modules, and torch, load on
first use, so that listing tasks and checking a recipe stay light.
"""

from fedllm.common.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {
    "evaluate": "fedllm.evaluation.runner", "eval_due": "fedllm.evaluation.runner",
    "prompt_style_for_data": "fedllm.evaluation.runner", "generate": "fedllm.evaluation.generation"})

__all__ = ["evaluate", "generate", "eval_due", "prompt_style_for_data"]
