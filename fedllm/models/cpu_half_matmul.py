"""bf16/fp16 matmuls on a CPU without a half-precision GEMM, computed in fp32 blocks.

On a CPU where oneDNN has no bf16 (fp16) GEMM — an x86 without AVX-512, such as the AVX2 EPYCs this project's CI
often gets (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False) — torch computes a bf16 matmul in its reference
GEMM: 17-22 GFLOP/s on two AVX2 cores where the second operand is a linear layer's weight as stored (the forward),
0.3-2.5 GFLOP/s where it is not (``grad @ W``, every linear layer's input gradient in backward), against 39-165 for
the same product in the fp32 blocks below (pytorch/pytorch#146508; ``python bench/cpu_half_matmul.py``). A bf16 or
4-bit (bf16 compute) step on such a CPU spent nearly all of its time there.

Inside :func:`fp32_half_matmuls` a dispatch mode computes every CPU bf16/fp16 ``mm``, ``addmm``, ``bmm`` and
``baddbmm`` as fp32 products of blocks converted on the fly — at most :data:`BLOCK_FLOATS` fp32 values per operand
block and for the accumulator, so the copies stay small beside a model's weights — accumulated in fp32 and rounded to
the half dtype once, as a native half GEMM does (fp32 accumulation, one rounding): results equal the native ones up
to the order of the fp32 sums. Everything else passes through unchanged. Under ``train.compile`` dynamo still
compiles (:meth:`Fp32HalfMatmuls.ignore_compile_internals`), and the graphs' products pass through the mode as they
run. Where the CPU has the GEMM, or the run computes in fp32, nothing is entered.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HALF = (torch.bfloat16, torch.float16)
#: fp32 values in one converted block of an operand, and in the accumulator (8 MiB each: 24 MiB at most at a time).
BLOCK_FLOATS = 2**21
#: Inner-dimension chunk: a longer inner dimension (the LM head's input gradient, ``V`` wide) is summed in chunks.
INNER_CHUNK = 4096
#: False leaves every product to torch's own kernels (``bench/bf16_step.py``'s ``bf16-reference-gemm`` variant).
ENABLED = True
aten = torch.ops.aten


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` (bf16/fp16) matmuls in oneDNN rather than torch's reference GEMM."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def transient_bytes() -> int:
    """The fp32 blocks a matmul holds at most beside its inputs and output (the dry run's memory term)."""
    return 3 * 4 * BLOCK_FLOATS


def blocked_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = bias + a @ b`` (2-D; ``bias`` expanded to ``out``'s shape, ``out`` in the half dtype) from fp32
    blocks: rows of ``a`` by columns of ``b``, summed over chunks of the inner dimension in an fp32 accumulator,
    rounded into ``out`` once."""
    m, k = a.shape
    n = b.shape[1]
    kc = min(k, INNER_CHUNK)
    mc = max(1, min(m, BLOCK_FLOATS // kc))
    nc = max(1, min(n, BLOCK_FLOATS // kc, BLOCK_FLOATS // mc))
    for i in range(0, m, mc):
        rows = slice(i, min(i + mc, m))
        a_whole = a[rows].float() if kc == k else None  # one inner chunk: the row block converted once
        for j in range(0, n, nc):
            cols = slice(j, min(j + nc, n))
            acc = None
            for p in range(0, k, kc):
                inner = slice(p, min(p + kc, k))
                a_blk = a_whole if a_whole is not None else a[rows, inner].float()
                b_blk = b[inner, cols].float()
                acc = torch.mm(a_blk, b_blk) if acc is None else acc.addmm_(a_blk, b_blk)
            if bias is not None:
                acc += bias[rows, cols].float()
            out[rows, cols] = acc
    return out


def _half_operands(args: tuple, *operands: int) -> torch.dtype | None:
    """The half dtype when every operand at ``operands`` is a CPU tensor of the same half dtype, else None."""
    dtypes = {args[i].dtype for i in operands}
    devices = {args[i].device.type for i in operands}
    (dtype,) = dtypes if len(dtypes) == 1 else (None,)
    return dtype if dtype in HALF and devices == {"cpu"} and not native_half_gemm(dtype) else None


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype) if out is None else out
    return blocked_mm(a, b, out, None if bias is None else bias.expand_as(out))


def _bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype) if out is None else out
    if a.numel() + b.numel() + out.numel() <= BLOCK_FLOATS:  # small (attention's per-head products): at once
        acc = torch.bmm(a.float(), b.float())
        if bias is not None:
            acc += bias.float()
        return out.copy_(acc)
    for i in range(a.shape[0]):
        blocked_mm(a[i], b[i], out[i], None if bias is None else bias.expand_as(out)[i])
    return out


#: The products computed in blocks: op -> (positions of its half operands, whether its first argument is a bias).
PRODUCTS = {aten.mm.default: ((0, 1), False), aten.mm.out: ((0, 1), False), aten.bmm.default: ((0, 1), False),
            aten.bmm.out: ((0, 1), False), aten.addmm.default: ((0, 1, 2), True), aten.addmm.out: ((0, 1, 2), True),
            aten.baddbmm.default: ((0, 1, 2), True)}


class Fp32HalfMatmuls(TorchDispatchMode):
    """The dispatch mode of :func:`fp32_half_matmuls`: CPU bf16/fp16 products in fp32 blocks."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # train.compile still compiles; its graphs' products pass through here as they run

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        known = PRODUCTS.get(func)
        out = kwargs.get("out")
        # alpha/beta given, an output of another dtype, other dtypes, devices and ops: torch's own kernels
        if known is None or set(kwargs) - {"out"} or not _half_operands(args, *known[0]) or \
                (out is not None and out.dtype != args[known[0][0]].dtype):
            return func(*args, **kwargs)
        bias, (a, b) = (args[0], args[1:3]) if known[1] else (None, args[:2])
        return (_bmm if a.dim() == 3 else _mm)(a, b, bias, out)


def wanted(device: torch.device, dtypes: set[torch.dtype]) -> bool:
    """Whether a step on ``device`` whose matmuls may run in ``dtypes`` gains from :func:`fp32_half_matmuls`: a CPU
    without the GEMM of one of them (``train.compile`` too: its graphs' products run through the mode)."""
    return ENABLED and device.type == "cpu" and any(d in HALF and not native_half_gemm(d) for d in dtypes)


def model_dtypes(model: torch.nn.Module, dtype: str) -> set[torch.dtype]:
    """The dtypes ``model``'s matmuls may run in under ``train.dtype`` ``dtype``: autocast's, its parameters', and
    the compute dtype of its quantised layers (bitsandbytes' ``compute_dtype``)."""
    from fedllm.models.state import DTYPES

    found = {p.dtype for p in model.parameters()} | {DTYPES.get(dtype, torch.float32)}
    computes = (getattr(m, "compute_dtype", None) for m in model.modules())
    return found | {d for d in computes if isinstance(d, torch.dtype)}


def for_model(model: torch.nn.Module, dtype: str):
    """Context: :func:`fp32_half_matmuls` for a training or reference pass of ``model`` under ``train.dtype``
    ``dtype`` where it gains (:func:`wanted`), nothing otherwise."""
    device = next(model.parameters()).device
    return fp32_half_matmuls(wanted(device, model_dtypes(model, dtype)))


@contextlib.contextmanager
def fp32_half_matmuls(active: bool = True) -> Iterator[None]:
    """Context: CPU bf16/fp16 matmuls computed in fp32 blocks (:class:`Fp32HalfMatmuls`) when ``active``."""
    if not active:
        yield
        return
    with Fp32HalfMatmuls():
        yield
