"""What the device computes natively and how fast: ``train.dtype: auto`` and the peak behind MFU.

- :func:`bf16_native`: bf16 matmuls run in hardware on a CPU with ``avx512_bf16`` or AMX (``amx_bf16``) in its
  flags, on a GPU of compute capability 8.0 or newer (Ampere: A100, A10, RTX 30xx, and later); elsewhere bf16
  is emulated (converted to fp32 and back) and slower than fp32, so ``auto`` means fp32 there.
- :func:`device_peak`: the dense peak FLOP/s of the compute dtype. A known GPU: its vendor's spec sheet
  (:data:`SPEC_PEAKS`). A CPU: a short probe of the model's own matmul shapes (:func:`probe`), cached per machine
  in fedllm's cache directory (``$FEDLLM_CACHE_DIR``, ``$XDG_CACHE_HOME/fedllm``, ``~/.cache/fedllm``), so a run
  measures it once. The probe also records FLOP per CPU-second: on a shared machine the wall-clock rate depends on
  the load, the rate per CPU-second much less; the peak is the larger of the wall rate and the rate per CPU-second
  times the threads (a probe taken on a busy machine would otherwise make later runs' MFU exceed 100 %).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("fedllm")

#: Dense (no sparsity) peak FLOP/s from the vendors' spec sheets: (name fragment, bf16/fp16 tensor, fp32 non-tensor).
#: The first match wins, so the more specific names come first.
SPEC_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 989e12, 67e12),  # H200 SXM
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
]
#: CPU flags of native bf16 matmuls (AVX-512 BF16 dot products; AMX tiles).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: Seconds one probe trial aims for (three trials, the best kept).
PROBE_SECONDS = 0.08
#: Rows of the probe's matmuls at most (a micro-batch's ``batch x max_length`` tokens, capped).
PROBE_MAX_TOKENS = 2048
CACHE_FILE = "device_peak.json"


def spec_peak(name: str, dtype: str) -> float | None:
    """The spec sheet's dense peak of GPU ``name`` in ``dtype`` (bf16/fp16: tensor cores; fp32), or None."""
    for fragment, half, single in SPEC_PEAKS:
        if fragment in name:
            return single if dtype == "fp32" else half
    return None


def cpu_info() -> tuple[str, set[str]]:
    """``(model name, flags)`` of this machine's CPU (``/proc/cpuinfo`` on Linux; the platform's name elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            name = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, flags


def bf16_native(device: Any) -> tuple[bool, str]:
    """Whether ``device`` (a ``torch.device``) runs bf16 matmuls natively, and why (for the log and summary)."""
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        ok = major >= 8
        return ok, f"{name}: compute capability {major}.{minor} ({'>=' if ok else '<'} 8.0)"
    if device.type == "cpu":
        name, flags = cpu_info()
        found = [f for f in BF16_CPU_FLAGS if f in flags]
        return bool(found), f"{name}: " + (f"CPU flags {', '.join(found)}" if found else
                                           f"none of the CPU flags {', '.join(BF16_CPU_FLAGS)}")
    return False, f"{device.type}: bf16 support unknown"


def auto_dtype(device: Any) -> tuple[str, str]:
    """``train.dtype: auto`` on ``device``: ``("bf16" or "fp32", why)``."""
    native, why = bf16_native(device)
    return ("bf16" if native else "fp32"), why


@dataclass
class Peak:
    """A device's peak in one compute dtype."""

    flops_per_s: float
    dtype: str
    source: str  # "spec sheet: <GPU>" or "probe: <CPU>, <threads> threads"
    flops_per_cpu_s: float | None = None  # the CPU probe's FLOP per CPU-second (every thread's time)


def probe(weights: list[tuple[int, int]], tokens: int, dtype: str, seconds: float = PROBE_SECONDS) -> tuple[float, float]:
    """``(FLOP/s, FLOP per CPU-second)`` of ``F.linear`` at ``tokens`` rows over the ``(out, in)`` weights of one
    layer, in ``dtype``: the best of three trials of about ``seconds`` each, after a warm-up."""
    import torch
    import torch.nn.functional as F

    from fedllm.models.state import DTYPES

    gen = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    pairs = [(torch.randn(tokens, i, generator=gen).to(dt), torch.randn(o, i, generator=gen).to(dt)) for o, i in weights]
    per_pass = sum(2.0 * tokens * o * i for o, i in weights)

    def one_pass() -> None:
        for x, w in pairs:
            F.linear(x, w)

    from fedllm.models.cpu_half_matmul import fp32_half_matmuls, wanted

    # a CPU without a half GEMM: the probe times the products as a training step computes them (fp32 blocks)
    with torch.no_grad(), fp32_half_matmuls(wanted(torch.device("cpu"), {dt})):
        one_pass()  # warm-up (kernel selection, first-touch of the buffers)
        t0 = time.perf_counter()
        one_pass()
        reps = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
        best_wall = best_cpu = float("inf")
        for _ in range(3):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                one_pass()
            best_wall = min(best_wall, time.perf_counter() - w0)
            best_cpu = min(best_cpu, time.process_time() - c0)
    flops = per_pass * reps
    return flops / best_wall, flops / max(best_cpu, 1e-9)


def cache_path() -> Path:
    from fedllm.data.token_cache import default_cache_dir

    return default_cache_dir() / CACHE_FILE


def device_peak(device: Any, dtype: str, weights: list[tuple[int, int]], tokens: int) -> Peak | None:
    """The peak of ``device`` in ``dtype``: a known GPU's spec sheet; the CPU probe of ``weights`` at ``tokens`` rows
    (cached per machine, CPU, thread count, torch version, dtype and shapes); None for an unknown GPU."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = spec_peak(name, dtype)
        return Peak(peak, dtype, f"spec sheet: {name}, dense {dtype}") if peak else None
    if device.type != "cpu" or not weights:
        return None
    tokens = max(1, min(tokens, PROBE_MAX_TOKENS))
    name, _ = cpu_info()
    threads = torch.get_num_threads()
    from fedllm.models.cpu_half_matmul import wanted
    from fedllm.models.state import DTYPES

    blocks = " fp32-blocks" if wanted(device, {DTYPES.get(dtype, torch.float32)}) else ""
    key = (f"cpu {name} x{os.cpu_count()} threads={threads} torch={torch.__version__} {dtype}{blocks} tokens={tokens} "
           + ",".join(f"{o}x{i}" for o, i in sorted(weights)))
    path = cache_path()
    cached = _read_cache(path)
    if key not in cached:
        rate, per_cpu = probe(sorted(weights), tokens, dtype)
        cached[key] = {"flops_per_s": rate, "flops_per_cpu_s": per_cpu, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write_cache(path, cached)
        log.info("measured the %s matmul peak of %s: %.3g FLOP/s (%.3g per CPU-second); cached in %s",
                 dtype, name, rate, per_cpu, path)
    entry = cached[key]
    # the wall-clock rate of a probe taken while other jobs held the cores understates the hardware; the rate per
    # CPU-second times the threads does not (each thread on a core of its own): the larger of the two is the peak
    rate = max(entry["flops_per_s"], entry["flops_per_cpu_s"] * threads)
    return Peak(rate, dtype, f"probe: {name}, {threads} thread(s), {tokens}-row {dtype} matmuls of the model's shapes, "
                f"max(wall rate, rate per CPU-second x threads) (cached in {path})", entry["flops_per_cpu_s"])


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Write the cache atomically (a temporary file renamed); a read-only cache directory only costs a re-probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not cache the device peak in %s: %s", path, e)


def as_dict(peak: Peak | None) -> dict[str, Any] | None:
    return asdict(peak) if peak is not None else None


def recipe_device(model_cfg: Any) -> Any:
    """The device a run's model computes on: ``model.device_map`` (a GPU when it names one, or spreads the model
    with a GPU visible), the CPU otherwise."""
    import torch

    where = model_cfg.device_map
    if where is None or str(where).startswith("cpu"):
        return torch.device("cpu")
    on_gpu = where in ("auto", "balanced", "sequential") or str(where).startswith("cuda")
    if on_gpu and torch.cuda.is_available():
        return torch.device(where if ":" in str(where) else f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return torch.device("cpu")


def base_dtype(recipe: Any) -> tuple[str, str]:
    """What ``model.dtype: auto`` means for ``recipe`` (``train.dtype`` resolved): bf16 weights when training in bf16,
    except under DoRA with a strategy that merges into the base in place, whose merges need an fp32 base
    (:data:`fedllm.recipe.schema.DORA_MERGE_STRATEGIES`); fp32 otherwise."""
    from fedllm.recipe.schema import DORA_MERGE_STRATEGIES

    if recipe.lora.use_dora and recipe.federation.strategy in DORA_MERGE_STRATEGIES:
        return "fp32", f"lora.use_dora with {recipe.federation.strategy}: its merges need an fp32 base"
    if recipe.train.dtype == "bf16":
        return "bf16", "train.dtype bf16"
    return "fp32", f"train.dtype {recipe.train.dtype}"


def resolve_auto_dtypes(recipe: Any) -> dict[str, Any]:
    """Replace ``auto`` in ``train.dtype`` (bf16 where the device computes it natively, else fp32: :func:`auto_dtype`)
    and ``model.dtype`` (bf16 when ``train.dtype`` is bf16, else fp32) by what they mean here, in place; the choice,
    logged, for ``summary.json``. Idempotent: a resolved recipe is left as it is."""
    why = None
    if recipe.train.dtype == "auto":
        recipe.train.dtype, why = auto_dtype(recipe_device(recipe.model))
        log.info("train.dtype: auto -> %s (%s)", recipe.train.dtype, why)
    if recipe.model.dtype == "auto":
        recipe.model.dtype, reason = base_dtype(recipe)
        log.info("model.dtype: auto -> %s (%s)", recipe.model.dtype, reason)
    return {"train": recipe.train.dtype, "model": recipe.model.dtype, "auto": why}
