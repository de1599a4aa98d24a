"""The LM head reads a contiguous input: generation's prompt pass was 3-6x slower on a CPU without it.

``generate`` asks the model for the last position's logits only (``logits_to_keep=1``), so the LM head gets
``hidden_states[:, -1:, :]``: a 3-D slice that is not contiguous. On a CPU, torch 2.13's matmul does not fold such
an input into one matrix product when the weight requires no grad (a frozen head: every LoRA model); it expands the
weight to one copy per row of the batch and multiplies batch by batch: for SmolLM2-135M's tied 49,152 x 576 bf16
head and 20 prompts, 1.1 GB copied and 4.3-6.5 CPU-s where the contiguous input takes 0.015-0.019 (fp32: 0.26
against 0.05). Every prompt pass of an evaluation paid it: SmolLM2's prompt pass over 20 prompts took 5.99 CPU-s
instead of 1.02 on one thread (``python bench/lm_head_input.py``), the quickstart's GSM8K evaluation (60 prompts,
twice a run) 4.7-8.7 CPU-s a batch instead of 1.4. A forward pre-hook on the output embedding hands the head a
contiguous copy of its input (a few KB; already contiguous inputs, as in training and each generated token's pass,
are passed through untouched). The logits are the same bit for bit.
"""

from __future__ import annotations

from typing import Any

MARK = "_fedllm_contiguous_input"
"""Set on a head that has the hook (so it is added once)."""


def _contiguous(module: Any, args: tuple) -> tuple:
    if args and hasattr(args[0], "is_contiguous") and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return args


def keep_lm_head_input_contiguous(model: Any) -> None:
    """Give ``model``'s output embedding (its LM head) a contiguous input; nothing for a model without one (a
    classifier) or whose head has it already."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or getattr(head, MARK, False):
        return
    head.register_forward_pre_hook(_contiguous)
    setattr(head, MARK, True)
