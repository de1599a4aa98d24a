"""What an export reads: a run directory or checkpoint, its recipe and metrics, its models.

:func:`open_source` validates everything cheap before any model is built, so a torn or
foreign directory fails with a clear :class:`ExportInputError` and nothing is written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from fedllm.common.errors import InputError
from fedllm.export.errors import ExportInputError
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import Recipe, read_written_yaml
from fedllm.runs import checkpoint as ckpt_io

TENSOR_FILES = ("adapter", "base", "strategy", "clients", "optimizer")
PROBE_TEXT = "Federated fine-tuning: what every client learned, in one model."
"""Input on which an export is checked against the run's model (its logits are compared)."""


@dataclass
class Source:
    """A validated export source.

    Attributes:
        given: The path the user gave (run directory or checkpoint).
        checkpoint: The checkpoint directory it resolves to.
        run_dir: The run directory holding metrics, when there is one.
        meta: The checkpoint's ``meta.json``.
        recipe: The resolved recipe stored in the checkpoint.
        recipe_yaml: Its text.
    """

    given: Path
    checkpoint: Path
    run_dir: Optional[Path]
    meta: dict[str, Any]
    recipe: Recipe
    recipe_yaml: str
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def round(self) -> int:
        """The round the checkpoint was written after."""
        return int(self.meta["round"])

    @property
    def label_names(self) -> list[str]:
        """Class names of a classification run (empty for causal LMs)."""
        return list(self.meta.get("label_names") or [])


def _check_tensor_files(where: Path) -> None:
    from safetensors import SafetensorError, safe_open

    for name in TENSOR_FILES:
        path = where / f"{name}.safetensors"
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise ExportInputError(f"{path}: torn or unreadable checkpoint file ({e})") from None


def _run_dir_of(given: Path, checkpoint: Path) -> Optional[Path]:
    candidates = [given] if given != checkpoint else []
    candidates += [checkpoint.parent, checkpoint.parent.parent]
    for candidate in candidates:
        if (candidate / "metrics.jsonl").is_file() or (candidate / "summary.json").is_file():
            return candidate
    return None


def open_source(path: str | Path) -> Source:
    """Resolve and validate a run directory or checkpoint.

    Raises:
        ExportInputError: missing, torn or foreign directory; unreadable meta, tensors or recipe.
    """
    given = Path(path)
    if not given.is_dir():
        raise ExportInputError(f"{given}: no such run directory or checkpoint")
    for candidate in (given, given / "final"):  # never fall back silently from a damaged checkpoint
        if candidate.is_dir() and (candidate / ckpt_io.META).exists() and not ckpt_io.is_checkpoint(candidate):
            raise ExportInputError(f"{candidate}: torn checkpoint ({ckpt_io.META} without adapter.safetensors)")
    try:
        where = ckpt_io.resolve_checkpoint(given)
        ckpt_io.verify_checkpoint(where)  # a damaged checkpoint is named, never exported
    except ckpt_io.CheckpointError as e:
        raise ExportInputError(str(e)) from None
    try:
        meta = json.loads((where / ckpt_io.META).read_text())
    except (OSError, ValueError) as e:
        raise ExportInputError(f"{where / ckpt_io.META}: unreadable ({e})") from None
    version = meta.get("format_version") if isinstance(meta, dict) else meta
    if not isinstance(meta, dict) or version not in ckpt_io.READABLE_VERSIONS or "round" not in meta:
        raise ExportInputError(f"{where}: not a fedllm checkpoint of format {ckpt_io.FORMAT_VERSION} "
                               f"(meta.json has format {version!r})")
    _check_tensor_files(where)
    recipe_path = where / "recipe.yaml"
    if not recipe_path.is_file() or not recipe_path.read_text().strip():
        raise ExportInputError(f"{where}: the checkpoint has no recipe.yaml")
    recipe_yaml = recipe_path.read_text()
    try:
        raw = read_written_yaml(recipe_yaml)
    except Exception as e:  # noqa: BLE001 — any YAML failure means a torn file
        raise ExportInputError(f"{recipe_path}: unreadable ({str(e).splitlines()[0]})") from None
    recipe = parse_recipe(raw, str(recipe_path))
    source = Source(given, where, _run_dir_of(given, where), meta, recipe, recipe_yaml)
    source.metrics = run_metrics(source)
    return source


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def run_metrics(source: Source) -> dict[str, Any]:
    """What the run reported up to the checkpoint's round: train loss, eval metrics, bytes, summary."""
    out: dict[str, Any] = {}
    if source.run_dir is None:
        return out
    metrics = source.run_dir / "metrics.jsonl"
    rows = [r for r in _read_jsonl(metrics) if r.get("round", 0) <= source.round] if metrics.is_file() else []
    trained = [r for r in rows if r.get("round", 0) > 0]
    if trained:
        last = trained[-1]
        out["round"] = last.get("round")
        out["train_loss"] = last.get("train_loss")
        out["bytes_up_total"] = sum(r.get("bytes_up_total", 0) for r in trained)
        out["bytes_down_total"] = sum(r.get("bytes_down_total", 0) for r in trained)
    evals = [r for r in rows if isinstance(r.get("eval"), dict) and r["eval"]]
    if evals:
        out["eval_round"] = evals[-1]["round"]
        out["eval"] = evals[-1]["eval"]
    personal = [r for r in rows if isinstance(r.get("personal_eval"), dict) and r["personal_eval"]]
    if personal:  # personalized strategies: each client's model on its own held-out split
        out["personal_eval_round"] = personal[-1]["round"]
        out["personal_eval"] = personal[-1]["personal_eval"]
    summary = source.run_dir / "summary.json"
    if source.checkpoint.name == "final" and summary.is_file():
        try:
            out["summary"] = json.loads(summary.read_text())
        except ValueError as e:  # a damaged summary does not stop an export; the card says less
            logging.getLogger("fedllm").warning("%s: unreadable (%s); model card without the run summary", summary, e)
    return out


def load_run_model(source: Source, client: Optional[int], for_merge: bool = False) -> tuple[Any, Any, Any]:
    """``(peft_model, tokenizer, strategy)``: the run's global model, or ``client``'s personal one.

    Non-quantized models are upcast to float32 so that every merge happens in fp32, except ``for_merge`` (the
    merged export, which computes in fp32 one module at a time and reads each layer once, in order): its model stays
    as the run held it, with dense residuals read from the checkpoint when used
    (``read_once`` of :func:`fedllm.export.inference.model_from_checkpoint`).

    Raises:
        ExportInputError: the checkpoint's tensors do not fit its recipe's model (foreign or torn).
    """
    from safetensors import SafetensorError

    from fedllm.export.inference import model_from_checkpoint
    from fedllm.models.state import StateMismatch

    try:
        model, tok, strategy, _ = model_from_checkpoint(source.checkpoint, client=client, read_once=for_merge)
    except InputError:
        raise
    except (KeyError, StateMismatch, SafetensorError) as e:
        raise ExportInputError(f"{source.checkpoint}: does not fit its recipe's model ({e})") from None
    except ValueError as e:
        if "shape" not in str(e):
            raise
        raise ExportInputError(f"{source.checkpoint}: does not fit its recipe's model ({e})") from None
    if not for_merge and source.recipe.model.quantization == "none" and fp32_copy_fits(model):
        to_fp32(model)
    return model, tok, strategy


def available_bytes() -> int:
    """Memory the system can give this process now (``psutil``'s ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def fp32_copy_fits(model: Any) -> bool:
    """Whether casting ``model`` to fp32 for the merge maths fits in the memory available now, with a tenth to spare.

    A 7B bf16 base needs 13.5 GB more as fp32 (27 GB in all), which a 24 GB machine that trained it does not have:
    then the model stays in its dtype, each merged weight is computed in fp32 one layer at a time and stored in the
    model's dtype, and the probe check is reported rather than held to fp32 tolerance (a warning says so). The merged
    export of a plain LoRA model casts no whole model (:func:`fedllm.export.merged.write_merged`)."""
    extra = sum(p.numel() * (4 - p.element_size()) for p in model.parameters()
                if p.is_floating_point() and p.element_size() < 4)
    free = available_bytes()
    if extra <= 0.9 * free:
        return True
    logging.getLogger("fedllm").warning(
        "export: the fp32 copy of the model needs %.2f GB more and %.2f GB are available (GB = 1024**3 bytes): "
        "merging each layer in fp32 and keeping the model in %s; the probe check is reported, not held to fp32 "
        "tolerance", extra / 2**30, free / 2**30, kept_dtype_of(model))
    return False


def kept_dtype_of(model: Any) -> Optional[str]:
    """The name of the model's floating dtype when it is not fp32 (``bfloat16``, ``float16``), else ``None``."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return None if dtypes <= {torch.float32} else str(max(dtypes, key=lambda d: d != torch.float32)).removeprefix(
        "torch.")


def to_fp32(model: Any) -> Any:
    """Cast floating parameters to fp32 for the merge maths.

    Models read from GGUF files count as quantized to transformers, whose ``.float()``
    then refuses, although their weights are already dequantized to plain tensors: with every
    parameter a plain floating tensor (a bf16 run of a GGUF preset) torch's own ``Module.float``
    casts them; a model already in fp32 is left as it is.
    """
    if all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point()):
        return model
    if getattr(model, "is_quantized", False) and all(p.is_floating_point() for p in model.parameters()):
        return torch.nn.Module.float(model)  # dequantized GGUF weights: nothing bitsandbytes-packed to keep
    return model.float()


def load_original_base(source: Source, tokenizer: Any) -> Any:
    """The base model before any training, as ``fedllm.models.loading.load_base_model`` builds it for the run."""
    from fedllm.models.loading import load_base_model

    return load_base_model(source.recipe.model, tokenizer, num_labels=len(source.label_names) or 2,
                           seed=source.recipe.seed).eval()


def probe_inputs(tokenizer: Any) -> dict[str, torch.Tensor]:
    """The tokenized :data:`PROBE_TEXT` (batch of one)."""
    enc = tokenizer(PROBE_TEXT, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def probe_logits(model: Any, inputs: dict[str, torch.Tensor], in_fp32: bool = False,
                 weights: Optional[dict[Any, Any]] = None) -> torch.Tensor:
    """Float32 logits of ``model`` on the probe input (under autocast to its dtype when :func:`load_run_model` left a
    bf16/fp16 base beside fp32 adapters, as the run computed). ``in_fp32``: computed as ``model.float()`` would
    compute them, one module's fp32 copy at a time, with ``weights`` (``{module: read}``) read for the modules named
    (:func:`fedllm.export.upcast.computed_in_fp32`)."""
    if in_fp32:
        from fedllm.export.upcast import computed_in_fp32

        with computed_in_fp32(model, weights):
            return model(**inputs).logits.float()
    kept = kept_dtype_of(model)
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=getattr(torch, kept or "bfloat16"), enabled=kept is not None):
        return model(**inputs).logits.float()
