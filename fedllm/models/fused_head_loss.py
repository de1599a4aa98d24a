"""The LM head and its cross-entropy fused, a chunk of rows at a time, with the gradient taken in the forward pass.

``F.cross_entropy(head(hidden).float(), targets)`` on ``N`` gathered positions and a vocabulary of ``V`` keeps an
``N x V`` logits tensor in the compute dtype, its fp32 copy and the fp32 log-softmax saved for backward, and its
backward allocates an ``N x V`` gradient (zero-filled, scattered, then cast) — gigabytes for a batch of 16 x 512
positions over Qwen2's 152k vocabulary. :class:`FusedHeadCrossEntropy` instead runs, per chunk of rows (the chunk's
fp32 logits about :data:`CHUNK_BYTES`), what the unfused path runs: ``logits = h Wᵀ`` in the compute dtype,
upcast, ``log_softmax``, ``loss = −log_softmax[target]``; and, as liger-kernel's fused linear cross-entropy does
on GPUs (Triton; ``liger_kernel/ops/fused_linear_cross_entropy.py``), the gradient right there:

    ∂loss_i / ∂h_i = (softmax(h_i Wᵀ) − onehot(t_i)) W        (the softmax cross-entropy gradient)

cast to the compute dtype before the product with ``W`` as the unfused backward casts it. Only that ``N x H``
gradient survives a chunk; backward scales it by each row's incoming gradient. The head must be frozen (no
gradient with respect to ``W`` is formed): :func:`fused_head_cross_entropy` raises otherwise.

Losses are the unfused path's bit for bit where the chunk's matmul rows equal the whole matmul's (the same
``log_softmax`` on the same logits); the gradient differs by rounding only: the unfused backward scales the
``N x V`` softmax gradient by the incoming gradient before its cast and product, this one scales the ``N x H``
result after (``tests/training/test_fused_head_loss.py`` bounds both in fp32 and bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Target size of one chunk's fp32 logits (bytes): the rows of a chunk are ``CHUNK_BYTES // (4 V)``.
CHUNK_BYTES = 32 * 2**20


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that a chunk's fp32 logits take about ``chunk_bytes`` (at least one row)."""
    return max(1, chunk_bytes // (4 * vocab))


def chunk_peak_bytes_per_logit(compute_bytes: int, device_type: str, compiled: bool = False) -> int:
    """Bytes per logit of one chunk at its peak inside :func:`rows_loss_and_grad` (for the memory estimate): the
    ``R x V`` logits in the compute dtype (``p`` bytes) stay alive through the chunk while, in turn,

    - ``log_softmax(..., dtype=float32)`` holds an fp32 copy of a 16-bit input beside its fp32 output: ``p + 4 + 4``
      (``p + 4`` in fp32: no copy);
    - ``logp.exp().to(p)``: the fp32 exponent and its cast, ``p + 4 + 4 + p`` (fp32: ``.to`` returns the exponent);
    - ``probs.scatter(...)`` writes a new tensor beside ``probs`` (fp32: the exponent itself): ``p + 4 + p + p``, plus,
      on a CPU and in a 16-bit dtype, an fp32 temporary of the whole tensor (measured with
      ``MALLOC_MMAP_THRESHOLD_`` fixed: 6.0 bytes per element for a bf16 scatter, 4.0 for an fp32 one).

    On a CPU that is ``p + 12`` in bf16 and fp32 alike (measured: 14.05 bytes a logit for SmolLM2's head at 256 bf16
    rows, 16.4 in fp32; docs/memory.md); on a GPU (not measured) 12 in 16-bit, 16 in fp32.

    ``compiled`` (:func:`compiled_rows`: ``train.compile`` on a CPU): inductor computes the log-softmax, the exponent
    and the one-hot in one pass, keeping no ``R x V`` temporary: the logits and the gradient it writes, ``2p``
    (torch's allocator, read through the profiler: 4.01 bytes a logit in bf16, 8.01 in fp32)."""
    p = compute_bytes
    if compiled:
        return 2 * p
    sixteen_bit = p != 4
    log_softmax = p + (4 if sixteen_bit else 0) + 4
    exp_cast = p + 4 + 4 + (p if sixteen_bit else 0)
    scatter = p + 4 + 2 * p + (4 if device_type == "cpu" and sixteen_bit else 0)
    return max(log_softmax, exp_cast, scatter)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in: autocast's where it is on (it casts every floating
    input but fp64), else the inputs' common dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def rows_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, loss_dtype: torch.dtype,
                       grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row cross-entropy of a chunk's logits (``R x V``) against ``targets`` (``R x 1``) in ``loss_dtype``, and
    (``grad_dtype`` not None) its gradient with respect to the logits, ``softmax − onehot(target)``, in
    ``grad_dtype``: ``F.cross_entropy``'s own steps (``log_softmax`` upcasts first, as ``.float()``). A pure
    function, so that :func:`compiled_rows` can compile it: the same operations eager and compiled."""
    logp = torch.log_softmax(logits, dim=-1, dtype=loss_dtype)
    target_logp = logp.gather(1, targets)
    if grad_dtype is None:
        return -target_logp[:, 0], None
    # the softmax written in the gradient's dtype, minus the one-hot of the target
    probs = logp.exp().to(grad_dtype).scatter(1, targets, (target_logp.exp() - 1).to(grad_dtype))
    return -target_logp[:, 0], probs


#: What :class:`FusedHeadCrossEntropy` runs per chunk: :func:`rows_loss_and_grad`, or its compiled form inside
#: :func:`compiled_rows`.
_ROWS: list = [rows_loss_and_grad]
_COMPILED: dict[str, object] = {}


@contextlib.contextmanager
def compiled_rows(backend: str = "inductor") -> Iterator[None]:
    """Context: :class:`FusedHeadCrossEntropy` runs :func:`rows_loss_and_grad` compiled (``torch.compile``, one
    graph for every row count): its log-softmax, exponent and one-hot in one pass over the logits instead of
    four (``train.compile`` on a CPU, :mod:`fedllm.engine.compiled`). Compiled once per backend and process."""
    if backend not in _COMPILED:
        compiled = torch.compile(rows_loss_and_grad, dynamic=True, backend=backend)
        # a chunk's targets as a tensor of their own: as a view of the batch's targets, dynamo would tie the row
        # count to the batch's where they are equal (duck sizing), a second graph when they differ
        _COMPILED[backend] = lambda logits, targets, *rest: compiled(logits, targets.clone(), *rest)
    _ROWS.append(_COMPILED[backend])
    try:
        yield
    finally:
        _ROWS.pop()


def rows_compiled() -> bool:
    """Whether :func:`compiled_rows` is in effect."""
    return len(_ROWS) > 1


class FusedHeadCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of ``hidden @ weight.T`` (``N`` values in ``loss_dtype``), chunked over the rows, with
    the gradient with respect to ``hidden`` computed in the forward pass (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                loss_dtype: torch.dtype, with_grad: bool) -> torch.Tensor:
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=loss_dtype, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if with_grad else None
        chunk_rows_loss = _ROWS[-1]
        for start in range(0, n, rows):
            h, t = hidden[start:start + rows], targets[start:start + rows, None]
            loss, probs = chunk_rows_loss(torch.mm(h, weight.t()), t, loss_dtype, hidden.dtype if with_grad else None)
            losses[start:start + rows] = loss
            if with_grad:
                torch.mm(probs, weight, out=grad[start:start + rows])
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_losses: torch.Tensor):
        (grad,) = ctx.saved_tensors
        scaled = (grad.to(grad_losses.dtype) * grad_losses[:, None]).to(grad.dtype)
        return scaled, None, None, None, None, None


def fused_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             loss_dtype: torch.dtype = torch.float32, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).to(loss_dtype), targets, reduction="none")`` without its ``N x V``
    buffers.

    Args:
        hidden: ``N x H`` hidden states (the gathered supervised positions).
        weight: The frozen head's ``V x H`` weight (no bias; ``requires_grad`` must be False).
        targets: ``N`` token ids, each in ``[0, V)`` (no ignore index).
        loss_dtype: The dtype the logits are upcast to and the losses come in (``float32``, as ``.float()``).
        chunk_bytes: About the size of one chunk's upcast logits.

    Returns:
        ``N`` losses; differentiable with respect to ``hidden`` when it requires a gradient under grad mode (else
        the gradient is not formed at all: an evaluation or reference pass costs one matmul, not two).
    """
    if weight.requires_grad:
        raise ValueError("fused_head_cross_entropy: the head's weight requires a gradient; only a frozen head fuses")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"fused_head_cross_entropy: expected N x H hidden states and N targets; got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    dtype = compute_dtype(hidden, weight)
    h, w = hidden.to(dtype), weight.to(dtype)  # autocast's casts (autograd casts h's gradient back)
    with_grad = torch.is_grad_enabled() and h.requires_grad
    rows = chunk_rows(weight.shape[0], chunk_bytes)
    with torch.autocast(hidden.device.type, enabled=False):
        return FusedHeadCrossEntropy.apply(h, w, targets, rows, loss_dtype, with_grad)
