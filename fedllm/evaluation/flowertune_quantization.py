"""The 4-bit load FlowerTune's board evaluates with, and what a result file records of the evaluated model's.

FlowerTune's ``benchmarks/flowertune-llm/evaluation/{general-nlp,medical,finance}/eval.py`` (flower ``77068b84``)
load the evaluated model with ``BitsAndBytesConfig(load_in_4bit=True)`` and ``torch_dtype=torch.float32``:
bitsandbytes' defaults, FP4 codes, no double (nested) quantization of the absmax constants, fp32 compute, and
the weights bitsandbytes does not quantize (embeddings, norms, head) in fp32. That is ``4bit-flowertune`` here;
fedllm's training ``4bit`` is QLoRA's (Dettmers et al. 2023, §3: NF4, double quantization, bf16 compute), which
``eval.quantization: 4bit-qlora`` asks for by name.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("fedllm")

FLOWERTUNE_4BIT = "4bit-flowertune"
QLORA_4BIT = "4bit-qlora"

#: The challenges FlowerTune's board evaluates in 4-bit (its Code command loads the model unquantized).
BOARD_4BIT_TASKS = frozenset({"flowertune_general_nlp", "flowertune_medical", "flowertune_finance"})

#: What the Linear4bit layers of a model loaded as FlowerTune's ``eval.py`` loads it carry.
FLOWERTUNE_LAYERS = {"quant_type": "fp4", "double_quant": False, "compute_dtype": "float32",
                     "other_weights": "float32", "load_dtype": "float32"}


def load_quantization(quantization: str, tasks: list[str]) -> str:
    """The ``model.quantization`` ``fedllm eval`` loads the model with for ``eval.quantization``.

    ``4bit`` for tasks that are all challenges FlowerTune's board evaluates in 4-bit loads FlowerTune's config
    (the one their numbers are comparable with; a warning says so, fedllm's ``4bit`` being QLoRA's elsewhere).
    QLoRA's config for such a task (``4bit`` beside other tasks, or ``4bit-qlora``) is warned of too.
    """
    board = sorted(BOARD_4BIT_TASKS.intersection(tasks))
    if quantization == "4bit" and board and len(board) == len(tasks):
        log.warning("--quantization 4bit for %s: loading FlowerTune's 4-bit config, as its board evaluates "
                    "(bitsandbytes' defaults: FP4, no double quantization, fp32 compute); "
                    "--quantization 4bit-qlora loads QLoRA's (NF4) instead", ", ".join(board))
        return FLOWERTUNE_4BIT
    if quantization in ("4bit", QLORA_4BIT) and board:
        log.warning("%s: evaluated on QLoRA's 4-bit config (NF4, double quantization), not the one FlowerTune's "
                    "board uses (--quantization %s)", ", ".join(board), FLOWERTUNE_4BIT)
    return "4bit" if quantization == QLORA_4BIT else quantization


def _layer_facts(module: Any) -> dict:
    state = module.weight.quant_state
    return {"quant_type": state.quant_type, "double_quant": bool(state.nested),
            "compute_dtype": str(module.compute_dtype).removeprefix("torch.")}  # None: the input's


def quantization_settings(model: Any, asked: str = "none") -> dict:
    """What a result file records of how the evaluated model is held: ``quantization`` (``none``, ``8bit``,
    ``4bit-flowertune`` when every Linear4bit layer carries FlowerTune's FP4 / no nested / fp32-compute
    quantization and the model was loaded in fp32 with its other weights fp32, else ``4bit``), with ``bnb_4bit`` (those facts, read from the
    layers) for a 4-bit model and a ``quantization_note`` when ``asked`` (``eval.quantization``) was ``4bit``
    and FlowerTune's config was loaded for it."""
    base = getattr(model, "get_base_model", lambda: model)()
    if not getattr(base, "is_loaded_in_4bit", False):
        return {"quantization": "8bit" if getattr(base, "is_loaded_in_8bit", False) else "none"}
    import bitsandbytes as bnb

    layers = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit) and m.weight.quant_state is not None]
    kinds = [dict(k) for k in sorted({tuple(_layer_facts(m).items()) for m in layers})]
    others = sorted({str(p.dtype).removeprefix("torch.") for p in base.parameters()
                     if p.dtype.is_floating_point and not isinstance(p, bnb.nn.Params4bit)})
    facts = dict(kinds[0]) if len(kinds) == 1 else {"layers": kinds}
    facts["other_weights"] = others[0] if len(others) == 1 else others
    # the dtype the weights were loaded in (FlowerTune's torch_dtype): a 4-bit load's preparation casts the other
    # weights to fp32 afterwards, so only the config still tells a bf16 load from an fp32 one
    facts["load_dtype"] = str(getattr(base.config, "dtype", None)).removeprefix("torch.")
    out = {"quantization": FLOWERTUNE_4BIT if facts == FLOWERTUNE_LAYERS else "4bit", "bnb_4bit": facts}
    if asked == "4bit" and out["quantization"] == FLOWERTUNE_4BIT:
        out["quantization_note"] = ("eval.quantization 4bit loaded FlowerTune's 4-bit config for its challenges "
                                    "(bitsandbytes' defaults, as its eval.py); 4bit-qlora loads QLoRA's")
    return out
