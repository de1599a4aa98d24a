"""Throughput of a run's local training: tokens/s, FLOPs, achieved FLOP/s and MFU.

Every client counts what its micro-batches held and how long its training loop took
(:class:`fedllm.models.flops.TrainedWork`, carried in its update). Per round this module sums them into
``metrics.jsonl``'s ``throughput`` record and the round line; per run into ``summary.json``:

- ``tokens_per_s`` (real, non-padding tokens) and ``supervised_tokens_per_s`` (tokens whose next token carries a
  loss) over the clients' training seconds (summed over clients: a device's rate, however many trained at once);
- ``flops``: model FLOPs from the model's shapes (:class:`fedllm.models.flops.FlopShapes`), ``flops_per_step``
  their mean per optimizer step, ``flops_per_s`` the achieved rate;
- ``mfu``: achieved FLOP/s over the device's peak in the compute dtype (:func:`fedllm.models.hardware.device_peak`:
  a GPU's spec sheet, a CPU's measured matmul peak); ``mfu_cpu``: the same per CPU-second (CPU only), which a
  shared machine's load moves far less.

The peak is that of the device of the process that writes the files; the figures of clients trained elsewhere
(other ranks, Flower nodes) count with their own seconds.
"""

from __future__ import annotations

from typing import Any

from fedllm.models.flops import FlopShapes, TrainedWork
from fedllm.models.hardware import Peak, as_dict, device_peak


def compute_dtype(recipe: Any) -> str:
    """The dtype the matmuls run in: ``train.dtype`` under autocast, else the weights' (4-bit: bf16 compute)."""
    if recipe.train.dtype in ("bf16", "fp16"):
        return recipe.train.dtype
    if recipe.model.quantization != "none":
        return "bf16" if recipe.model.dtype == "fp32" else recipe.model.dtype
    return recipe.model.dtype if recipe.model.dtype in ("bf16", "fp16") else "fp32"


def model_shapes(model: Any, recipe: Any, task: str) -> FlopShapes | None:
    """The FLOP shapes of a (PEFT-wrapped) model under the recipe's LoRA (None: a model type fedllm cannot count)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        return None
    config = config.to_dict()
    config = config.get("text_config") or config
    try:
        return FlopShapes.of(config, recipe.lora.r, recipe.lora.target_modules, causal_lm=task == "causal_lm")
    except (KeyError, TypeError, ZeroDivisionError):
        return None


class Throughput:
    """The run's FLOP shapes and device peak, and the figures of its rounds.

    Args:
        recipe: the run's recipe.
        model: the loaded (PEFT-wrapped) model.
        task: ``causal_lm`` or ``classification``.
        residual: True when the strategy adds a dense residual per target layer (FRLoRA on a bf16/4-bit base).
        measure_peak: probe (or read the cached) device peak now; False on processes that write nothing.
    """

    def __init__(self, recipe: Any, model: Any, task: str, residual: bool = False, measure_peak: bool = True):
        self.shapes = model_shapes(model, recipe, task)
        self.residual = residual
        self.dtype = compute_dtype(recipe)
        self.peak: Peak | None = None
        if measure_peak and self.shapes is not None:
            device = next(model.parameters()).device
            tokens = recipe.train.batch_size * recipe.train.max_length
            self.peak = device_peak(device, self.dtype, list(self.shapes.weights), tokens)

    def figures(self, work: TrainedWork, steps: int, flops: float | None = None) -> dict[str, Any]:
        """Rates and MFU of ``work`` done in ``steps`` optimizer steps (``flops``: known already, else counted)."""
        out: dict[str, Any] = {"tokens": work.tokens, "supervised_tokens": work.supervised,
                               "positions": work.positions, "micro_batches": work.micro_batches,
                               "train_seconds": work.seconds, "train_cpu_seconds": work.cpu_seconds}
        seconds, cpu = work.seconds, work.cpu_seconds
        out["tokens_per_s"] = work.tokens / seconds if seconds > 0 else None
        out["supervised_tokens_per_s"] = work.supervised / seconds if seconds > 0 else None
        if self.shapes is None:
            return {**out, "flops": None, "flops_per_step": None, "flops_per_s": None, "mfu": None, "mfu_cpu": None}
        flops = work.flops(self.shapes, self.residual) if flops is None else flops
        out["flops"] = flops
        out["flops_per_step"] = flops / steps if steps else None
        out["flops_per_s"] = flops / seconds if seconds > 0 else None
        out["flops_per_cpu_s"] = flops / cpu if cpu > 0 else None
        peak = self.peak
        out["mfu"] = out["flops_per_s"] / peak.flops_per_s if peak and out["flops_per_s"] else None
        out["mfu_cpu"] = (out["flops_per_cpu_s"] / peak.flops_per_cpu_s
                          if peak and peak.flops_per_cpu_s and out["flops_per_cpu_s"] else None)
        return out

    def round_record(self, updates: list[Any]) -> dict[str, Any]:
        """The ``throughput`` entry of a round's metrics record (from its updates' work counts)."""
        work = TrainedWork()
        for u in updates:
            work = work.merge(TrainedWork.from_dict(getattr(u, "work", None)))
        return self.figures(work, sum(u.steps for u in updates))

    def run_summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``summary.json``'s ``throughput``: every round's work together, the peak and what it was measured on."""
        keys = {"tokens": "tokens", "supervised_tokens": "supervised", "positions": "positions",
                "micro_batches": "micro_batches", "train_seconds": "seconds", "train_cpu_seconds": "cpu_seconds"}
        work, steps, flops = TrainedWork(), 0, 0.0
        for rec in records:
            t = rec.get("throughput")
            if not t:
                continue
            work = work.merge(TrainedWork(**{v: t.get(k, 0) for k, v in keys.items()}))
            steps += sum(rec.get("client_steps", {}).values())
            flops += t.get("flops") or 0.0
        out = self.figures(work, steps, flops)  # the rounds' own FLOPs (Σ b·S² is not kept per round)
        out["compute_dtype"] = self.dtype
        out["peak"] = as_dict(self.peak)
        return out


def round_text(t: dict[str, Any] | None) -> str:
    """``tok/s=... MFU=...%`` for the round line (empty when nothing was measured)."""
    if not t or not t.get("tokens_per_s"):
        return ""
    text = f"tok/s={t['tokens_per_s']:,.0f}"
    if t.get("flops_per_s"):
        text += f" {t['flops_per_s'] / 1e9:,.1f}GFLOP/s"
    if t.get("mfu"):
        text += f" MFU={100 * t['mfu']:.0f}%"
    return text


def describe(t: dict[str, Any], peak: Peak | None) -> str:
    """One line of figures (``--dry-run``): tokens/s, FLOPs per step, achieved FLOP/s and MFU against ``peak``."""
    parts = []
    if t.get("tokens_per_s"):
        parts.append(f"{t['tokens_per_s']:,.0f} tokens/s ({t['supervised_tokens_per_s']:,.0f} supervised)")
    if t.get("flops_per_step"):
        parts.append(f"{t['flops_per_step'] / 1e9:,.3f} GFLOP per step")
    if t.get("flops_per_s"):
        parts.append(f"{t['flops_per_s'] / 1e9:,.2f} GFLOP/s achieved")
    if peak is not None:
        mfu = f"MFU {100 * t['mfu']:.1f}%" if t.get("mfu") else "MFU n/a"
        cpu = f", {100 * t['mfu_cpu']:.1f}% per CPU-second" if t.get("mfu_cpu") else ""
        parts.append(f"{mfu}{cpu} of the {peak.dtype} peak {peak.flops_per_s / 1e9:,.1f} GFLOP/s ({peak.source})")
    else:
        parts.append("no peak known for this device (MFU n/a)")
    return "; ".join(parts)
