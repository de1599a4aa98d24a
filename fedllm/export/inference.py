"""Rebuild a model for inference from a run directory, a checkpoint, an exported model or a hub model.

For a fedllm checkpoint this is the in-memory global model of the run: the base
(with any weights the strategy changed), the strategy's state and the global
adapter, or a client's personal model for personalized strategies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import transformers

from fedllm.common.errors import InputError
from fedllm.models import gguf_cache
from fedllm.models.hardware import resolve_auto_dtypes
from fedllm.models.loading import load_model, load_tokenizer
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import ModelConfig, Recipe, read_written_yaml
from fedllm.runs import checkpoint as ckpt_io
from fedllm.strategies import ClientInfo, Strategy, get_strategy
from fedllm.strategies.residual import BaseUpdates

log = logging.getLogger("fedllm")


def recipe_of(ck: ckpt_io.Checkpoint, where: Path) -> Recipe:
    """The resolved recipe stored in a checkpoint."""
    if not ck.recipe_yaml:
        raise ckpt_io.CheckpointError(f"{where}: checkpoint has no recipe.yaml")
    return parse_recipe(read_written_yaml(ck.recipe_yaml), str(where / "recipe.yaml"))


def model_from_checkpoint(path: str | Path, dtype: Optional[str] = None,
                          client: Optional[int] = None,
                          quantization: str | None = None,
                          read_once: bool = False) -> tuple[Any, Any, Strategy, Recipe]:
    """``(peft_model, tokenizer, strategy, recipe)`` holding a checkpoint's global (or personal) model
    (``quantization``: load the base in 4/8 bit whatever the run used; None: as the run did).

    ``read_once`` (a merged export, which reads each layer once, in order): a checkpoint with a base history skips
    the strategy's set-up work that the restore replaces (FRLoRA's SVD init: :attr:`FRLoRA.restoring`), and its
    dense residuals are read from the checkpoint one layer at a time when used (:class:`StoredResiduals`) instead
    of all held beside the base. The model computes the same, bit for bit."""
    where = ckpt_io.resolve_checkpoint(Path(path))
    ck = ckpt_io.load_checkpoint(where)
    recipe = recipe_of(ck, where)
    if dtype is not None:
        recipe.model.dtype = dtype
    resolve_auto_dtypes(recipe)  # a run stores its resolved dtypes; a recipe written by hand may say auto
    if quantization is not None:
        recipe.model.quantization = quantization
    with gguf_cache.one_parse_per_file():  # a GGUF read for the tokenizer, the config and the weights: parsed once
        tok = load_tokenizer(recipe.model)
        labels = ck.meta.get("label_names") or []
        loaded = load_model(recipe.model, recipe.lora, num_labels=len(labels) or 2, seed=recipe.seed,
                            source=recipe.source, tokenizer=tok)
    strategy = get_strategy(recipe.federation.strategy, **recipe.federation.strategy_args)
    strategy.recipe = recipe
    read_once = read_once and ck.base_history is not None
    if read_once and hasattr(strategy, "restoring"):
        strategy.restoring = True
    torch.manual_seed(0)
    sizes = ck.meta.get("client_sizes") or [1] * recipe.federation.num_clients
    strategy.setup(loaded.model, [ClientInfo(c, n) for c, n in enumerate(sizes)])
    if read_once and isinstance(getattr(strategy, "base", None), BaseUpdates):
        strategy.base.read_once = True
    ckpt_io.restore_into(loaded.model, strategy, ck)
    if client is not None:
        personal = strategy.personal_state(client, ckpt_io.client_store(ck).get(client))
        if personal is None:
            raise InputError(f"{where}: strategy {recipe.federation.strategy!r} has no personal model "
                             f"for client {client}")
        from fedllm.models.loading import write_state

        write_state(loaded.model, personal)
    loaded.model.eval()
    return loaded.model, tok, strategy, recipe


def load_for_inference(path: str, dtype: Optional[str] = "fp32", client: Optional[int] = None,
                       quantization: str = "none") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a run dir / checkpoint, a PEFT adapter dir, a model dir, a preset or hub id.

    ``dtype`` None: a run or checkpoint in the dtypes its recipe resolved (``model.dtype``, ``train.dtype``: as the
    run's own evaluations held it, so ``fedllm eval RUN`` repeats them), anything else in fp32.
    ``quantization`` (``none``, ``4bit``, ``8bit``): load the base model through bitsandbytes (``fedllm eval
    --quantization``; ``none`` keeps a checkpoint's own setting). Not for exported adapter directories.
    """
    p = Path(path)
    if p.is_dir() and (ckpt_io.looks_like_checkpoint(p) or (p / "final").is_dir() or (p / "checkpoints").is_dir()):
        model, tok, _, _ = model_from_checkpoint(p, dtype, client, None if quantization == "none" else quantization)
        return model, tok
    dtype = dtype or "fp32"
    if p.is_dir() and (p / "adapter_config.json").is_file():
        if quantization != "none":
            raise InputError(f"--quantization {quantization}: {p} is an exported adapter; evaluate its run directory "
                             f"or checkpoint (or a model exported --merged) to load the base in {quantization}")
        return load_adapter(p, dtype)
    cfg = ModelConfig(name=str(path), dtype=dtype, quantization=quantization)
    from fedllm.models.loading import load_base_model

    with gguf_cache.one_parse_per_file():
        tok = load_tokenizer(cfg)
        return load_base_model(cfg, tok).eval(), tok


def _exported_base(p: Path, base_name: str, tok: Any, dtype: str) -> Optional[Any]:
    """The base model of an exported adapter without the hub: its ``base/`` copy (``--with-base``),
    or a fedllm preset rebuilt as the run built it (from ``export.json``); None for a hub id."""
    from fedllm.common.registry import model_presets
    from fedllm.models.loading import load_base_model

    facts_path = p / "export.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    base = facts.get("base_model") or {}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in base.items() if k in known}
    if (p / "base" / "config.json").is_file():
        fields.update(name=str(p / "base"), gguf_file=None, quantization=fields.get("quantization", "none"))
    elif base_name not in model_presets:
        return None
    else:
        fields["name"] = base_name
        if not base:
            log.warning("%s: no export.json; rebuilding preset %r with seed 0", p, base_name)
    cfg = ModelConfig(**{**fields, "dtype": dtype})
    return load_base_model(cfg, tok, num_labels=int(base.get("num_labels", 2)), seed=int(base.get("seed", 0)))


def load_adapter(p: Path, dtype: str = "fp32") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of an exported PEFT adapter directory; offline for preset bases."""
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification, PeftConfig, PeftModel

    cfg = PeftConfig.from_pretrained(str(p))
    tok_dir = p if (p / "tokenizer_config.json").is_file() else cfg.base_model_name_or_path
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    base = _exported_base(p, str(cfg.base_model_name_or_path), tok, dtype)
    if base is not None:
        return PeftModel.from_pretrained(base, str(p)).eval(), tok
    auto = (AutoPeftModelForSequenceClassification if cfg.task_type == "SEQ_CLS" else AutoPeftModelForCausalLM)
    return auto.from_pretrained(str(p)).eval(), tok
