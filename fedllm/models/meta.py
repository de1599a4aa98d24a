"""The recipe's model with its LoRA, built on the meta device: the layers LoRA wraps and their shapes, no weights.

- :func:`meta_model`: the base model built from its config (:mod:`fedllm.models.info`) with the recipe's LoRA
  (``--dry-run``), every target checked (:func:`check_targets`, :func:`target_counts`);
- :func:`meta_target_shapes`, :func:`meta_rank_problems`: the shapes of every family, before the load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedllm.models.info import META, layer_shapes, meta_base_model, model_config, rank_problems

if TYPE_CHECKING:
    from fedllm.recipe.schema import LoraConfig, ModelConfig


def meta_rank_problems(recipe: Any) -> list[tuple[str, Any, str]]:
    """``lora.r`` against the layers of a model whose shapes :func:`model_problems` could not tell without torch (a
    family outside :data:`ATTENTION_TARGETS` and BERT/RoBERTa), read from its config by building the model on the
    meta device (torch, no weights); [] when the config cannot be read here (the loader checks after loading)."""
    config = model_config(recipe.model)
    if config is not None and layer_shapes(config) or recipe.model.trust_remote_code:
        return []  # checked before torch / not built from remote code before the load asks for it
    try:
        shapes = meta_target_shapes(recipe.model, recipe.lora, recipe.model.num_labels or 2)
    except Exception:  # noqa: BLE001 — no config here, an unknown architecture, bad targets: the loader reports it
        return []
    return rank_problems(recipe.lora.r, shapes)


def meta_model(cfg: ModelConfig, lora: LoraConfig, num_labels: int = 2, source: str = "<recipe>") -> tuple[Any, str]:
    """``(peft_model, task)``: :func:`meta_base_model` with the recipe's LoRA attached (on the meta device).

    Raises:
        RecipeError: a LoRA target matches no module, or the rank exceeds a target layer's size.
    """
    import torch

    from fedllm.models.loading import attach_lora

    model, task = meta_base_model(cfg, num_labels)
    with torch.device(META):
        peft_model = attach_lora(model, lora, task, source)
    check_targets(peft_model, lora, cfg.name, source)
    return peft_model, task


def target_counts(model: Any, lora: LoraConfig) -> dict[str, int]:
    """How many wrapped layers each entry of ``lora.target_modules`` matched (a regex: its one entry)."""
    import re

    from fedllm.models.loading import lora_layers, lora_targets

    names = list(lora_layers(model))
    targets = lora_targets(model, lora)
    if isinstance(targets, str):
        return {targets: sum(1 for n in names if re.fullmatch(targets, n))}
    return {t: sum(1 for n in names if n == t or n.endswith("." + t)) for t in targets}


def check_targets(model: Any, lora: LoraConfig, model_name: str, source: str = "<recipe>") -> dict[str, int]:
    """:func:`target_counts`, raising when a target matches no module.

    Raises:
        RecipeError: naming every entry of ``lora.target_modules`` that wraps nothing.
    """
    from fedllm.recipe.schema import RecipeError

    counts = target_counts(model, lora)
    missing = [t for t, n in counts.items() if n == 0]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if type(m).__name__ == "Linear" and "lora_" not in n})
        raise RecipeError(source, [("lora.target_modules", t, f"a module of {model_name} (linear layers: "
                                    f"{', '.join(linear)})") for t in missing])
    return counts


def meta_target_shapes(cfg: ModelConfig, lora: LoraConfig, num_labels: int = 2) -> dict[str, tuple[int, int]]:
    """``module name -> (out_features, in_features)`` of every layer the recipe's LoRA wraps, from the config.

    Builds the model on the meta device only (no weights, no memory); usable before any model load.
    """
    import warnings

    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from fedllm.models.loading import lora_targets

    model, _ = meta_base_model(cfg, num_labels)
    probe = PeftLoraConfig(r=1, target_modules=lora_targets(model, lora))  # rank 1: shapes only, never rejected
    with torch.device(META), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fan_in_fan_out", UserWarning)  # PEFT's note on GPT-2's Conv1D (a probe)
        peft_model = get_peft_model(model, probe)
    # PEFT's wrapper knows (out, in) of every base kind (nn.Linear, GPT-2's transposed Conv1D, ...)
    return {name: (layer.out_features, layer.in_features) for name, layer in peft_model.named_modules()
            if isinstance(layer, LoraLayer)}
