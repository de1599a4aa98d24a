"""The models of the shipped recipes at their real shapes, without their weights.

fedllm ships the ``config.json`` (and only that, a few KB) of every model a shipped recipe
names, under ``fedllm/assets/configs/<org>--<name>/`` (hub ids) or ``.../<preset>/``
(packaged presets). The layers, LoRA targets, ranks and bytes of a recipe are functions of
the config, not of the weights, so they can be computed anywhere: a model built here lives
on torch's ``meta`` device (shapes and dtypes, no storage), costs no memory and builds in
well under a second.

- :func:`weights_unavailable`: why a recipe's real weights cannot be loaded here (or None);
- :func:`model_config`: the model's config (the local/cached one when loadable, else the shipped copy);
- :func:`meta_model`: the base model built from that config on the meta device, with the recipe's LoRA;
- :func:`target_shapes`: ``module name -> (out, in)`` of every LoRA-wrapped layer of a recipe's model
  (what a check that needs no model run, e.g. "r beyond a layer's size", reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from fedllm.config import LoraConfig, ModelConfig

from fedllm.model_info import CONFIGS_DIR, shipped_config_dir, shipped_names  # noqa: F401 (re-exported)

META = "meta"


def weights_unavailable(cfg: ModelConfig) -> Optional[str]:
    """Why the real weights of ``cfg.name`` cannot be loaded on this machine, or None when they may be."""
    from fedllm import hub
    from fedllm.models import ModelError
    from fedllm.registry import model_presets

    name = cfg.name
    if name in model_presets:
        preset = model_presets.get(name)
        if preset.present is not None:
            return preset.present()
        return None
    if name.endswith(".gguf"):
        return None if Path(name).expanduser().is_file() else "GGUF file not found"
    if Path(name).expanduser().exists():
        return None
    if name.startswith((".", "/", "~")):
        return "directory not found"
    try:
        return hub.unavailable(name, cfg.gguf_file or "config.json", cfg.revision)
    except ModelError as e:  # pragma: no cover - defensive
        return str(e)


def model_config(cfg: ModelConfig, num_labels: int = 2) -> Any:
    """The ``transformers`` config of the recipe's model, needing no weights: a preset built in code builds its
    own, a model fedllm ships a config for reads that copy, anything else its local or cached config.

    Raises:
        ModelError: fedllm ships no config for ``cfg.name`` and none can be read from here.
    """
    import transformers

    from fedllm.models import ModelError
    from fedllm.registry import model_presets

    where = shipped_config_dir(cfg.name)
    built_in_code = model_presets.get(cfg.name).config if cfg.name in model_presets else None
    if built_in_code is not None:
        config = built_in_code(cfg.num_labels or num_labels)
    elif where is None:
        if weights_unavailable(cfg) is not None:
            raise ModelError(f"model.name={cfg.name!r}: its weights are not on this machine and fedllm ships no "
                             f"config for it (shipped: {', '.join(shipped_names())}); put its config.json in a "
                             "local directory and give that directory as model.name")
        name, gguf = cfg.name, cfg.gguf_file
        if name.endswith(".gguf"):
            name, gguf = str(Path(name).parent), Path(name).name
        try:
            config = transformers.AutoConfig.from_pretrained(name, gguf_file=gguf, revision=cfg.revision,
                                                             trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelError(f"model.name={cfg.name!r}: could not read its config ({e})") from None
    else:
        config = transformers.AutoConfig.from_pretrained(str(where))
    if _task(cfg, config) == "classification":
        config.num_labels = cfg.num_labels or num_labels
    return config


def _task(cfg: ModelConfig, config: Any) -> str:
    from fedllm.models import CLASSIFIER_HEADS

    if cfg.task != "auto":
        return cfg.task
    return "classification" if config.model_type in CLASSIFIER_HEADS else "causal_lm"


def meta_base_model(cfg: ModelConfig, num_labels: int = 2) -> tuple[Any, str]:
    """``(model, task)``: the recipe's base model built from its config on the meta device, in ``cfg.dtype``."""
    import torch
    import transformers

    from fedllm.state import DTYPES

    config = model_config(cfg, num_labels)
    task = _task(cfg, config)
    auto = (transformers.AutoModelForSequenceClassification if task == "classification"
            else transformers.AutoModelForCausalLM)
    with torch.device(META):
        model = auto.from_config(config, dtype=DTYPES[cfg.dtype])
    return model, task


def meta_model(cfg: ModelConfig, lora: LoraConfig, num_labels: int = 2, source: str = "<recipe>") -> tuple[Any, str]:
    """``(peft_model, task)``: :func:`meta_base_model` with the recipe's LoRA attached (on the meta device).

    Raises:
        RecipeError: a LoRA target matches no module, or the rank exceeds a target layer's size.
    """
    import torch

    from fedllm.models import attach_lora

    model, task = meta_base_model(cfg, num_labels)
    with torch.device(META):
        peft_model = attach_lora(model, lora, task, source)
    check_targets(peft_model, lora, cfg.name, source)
    return peft_model, task


def target_counts(model: Any, lora: LoraConfig) -> dict[str, int]:
    """How many wrapped layers each entry of ``lora.target_modules`` matched (a regex: its one entry)."""
    import re

    from fedllm.models import lora_layers, lora_targets

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
    from fedllm.config import RecipeError

    counts = target_counts(model, lora)
    missing = [t for t, n in counts.items() if n == 0]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if type(m).__name__ == "Linear" and "lora_" not in n})
        raise RecipeError(source, [("lora.target_modules", t, f"a module of {model_name} (linear layers: "
                                    f"{', '.join(linear)})") for t in missing])
    return counts


def target_shapes(cfg: ModelConfig, lora: LoraConfig, num_labels: int = 2) -> dict[str, tuple[int, int]]:
    """``module name -> (out_features, in_features)`` of every layer the recipe's LoRA wraps, from the config.

    Builds the model on the meta device only (no weights, no memory); usable before any model load.
    """
    import warnings

    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from fedllm.models import lora_targets

    model, _ = meta_base_model(cfg, num_labels)
    probe = PeftLoraConfig(r=1, target_modules=lora_targets(model, lora))  # rank 1: shapes only, never rejected
    with torch.device(META), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fan_in_fan_out", UserWarning)  # PEFT's note on GPT-2's Conv1D (a probe)
        peft_model = get_peft_model(model, probe)
    # PEFT's wrapper knows (out, in) of every base kind (nn.Linear, GPT-2's transposed Conv1D, ...)
    return {name: (layer.out_features, layer.in_features) for name, layer in peft_model.named_modules()
            if isinstance(layer, LoraLayer)}
