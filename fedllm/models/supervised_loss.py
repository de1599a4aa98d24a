"""Causal-LM loss computed only where it is needed: the LM head at supervised positions.

With response-only loss most positions carry the label ``-100``, yet a plain ``model(**batch).loss``
runs the LM head (for SmolLM2-135M 28M of its 135M parameters) and a softmax over the whole
vocabulary at every position. :func:`causal_lm_loss` instead runs the decoder trunk, gathers the
hidden states at the positions whose next token is supervised, and applies the head, the model's
logit post-processing (Gemma 2's final soft-capping) and the cross-entropy there only. The loss and
every gradient equal the plain computation's (``tests/test_supervised_loss.py``).

``train.loss_positions: supervised`` (default) takes this path for the model types registered in
:data:`LOGIT_HEADS`; ``all``, a classification model or an unregistered model type takes the plain
path. Both paths are in :data:`LOSS_PATHS`.

Where the head is a plain frozen bias-free linear layer (or the tied embedding) without soft-capping
(:data:`FUSED_HEADS`), :func:`token_losses` runs head and cross-entropy fused and chunked
(:mod:`fedllm.models.fused_head_loss`), never holding the ``N x V`` logits, for a batch whose logits would take more
than one chunk (:data:`FUSE_FROM_BYTES`); elsewhere the head of :data:`LOGIT_HEADS` and ``F.cross_entropy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fedllm.data.tokens import IGNORE_INDEX
from fedllm.models.fused_head_loss import CHUNK_BYTES, compute_dtype, fused_head_cross_entropy, rows_compiled

log = logging.getLogger(__name__)


def _plain_head(base: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head(hidden)``, soft-capped when the config asks (``final_logit_softcapping``, Gemma 2/3)."""
    logits = base.get_output_embeddings()(hidden)
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


#: model_type -> logits from the trunk's last hidden states, exactly as the model's own forward does it.
#: Scaled embeddings (Gemma) live in the trunk, so they need nothing here.
LOGIT_HEADS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    t: _plain_head for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2")
}


def _frozen_linear_head(base: Any) -> torch.Tensor | None:
    """The head's weight when ``lm_head(hidden)`` is exactly ``hidden @ weight.T``: a plain ``nn.Linear`` (not PEFT's
    LoRA or ``modules_to_save`` wrapper, not a quantized subclass), no bias, frozen, no final soft-capping; else None."""
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.requires_grad:
        return None
    if getattr(base.config, "final_logit_softcapping", None) is not None:
        return None
    return head.weight


#: model_type -> the weight of a head that :func:`fedllm.models.fused_head_loss.fused_head_cross_entropy` computes
#: as :data:`LOGIT_HEADS` does (None where this model's head does not fuse: it takes the unfused path).
FUSED_HEADS: dict[str, Callable[[Any], torch.Tensor | None]] = {t: _frozen_linear_head for t in LOGIT_HEADS}

#: Whether :func:`token_losses` fuses the heads of :data:`FUSED_HEADS` (False: always the unfused path; bench A/B).
FUSE_HEAD_LOSS = True

#: :func:`token_losses` fuses only a batch whose ``N x V`` fp32 logits would take more than this many bytes: more than
#: one chunk (:data:`fedllm.models.fused_head_loss.CHUNK_BYTES`), where fusing saves memory and time
#: (docs/performance.md: neutral at the quickstart's ~84 positions, faster from a few hundred). Smaller batches keep
#: the unfused path's exact numerics (the fused bf16 gradient is rounded once more), so runs of such shapes give
#: what they gave before the fused path existed (README's quickstart output). 0: fuse every batch (tests, bench).
#: Under ``train.compile`` on a CPU every batch fuses: the compiled chunk (:func:`fedllm.models.fused_head_loss.
#: compiled_rows`) is faster than the unfused path at every size (bf16, 84 positions: 30 against 46 CPU-ms).
FUSE_FROM_BYTES = CHUNK_BYTES


def fused_head_weight(base: Any) -> torch.Tensor | None:
    """The weight :func:`token_losses` fuses for this (unwrapped) model, or None for the unfused path."""
    fused = FUSED_HEADS.get(base.config.model_type)
    return fused(base) if FUSE_HEAD_LOSS and fused is not None else None


def base_of(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports_supervised_positions(model: Any) -> bool:
    """Whether :func:`supervised_positions_loss` knows this model's head."""
    return getattr(base_of(model).config, "model_type", None) in LOGIT_HEADS


def supervised_hidden(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trunk's hidden states at the positions whose next token is supervised.

    Args:
        model: A (PEFT-wrapped) causal LM whose model type is in :data:`LOGIT_HEADS`.
        batch: ``input_ids``, ``attention_mask``, ``labels`` (batch x length, ``-100`` = no loss); a packed
            batch (:mod:`fedllm.data.packing`) has ``position_ids`` instead of ``attention_mask``.

    Returns:
        ``(hidden, targets, rows)``: hidden states (N x H) at the supervised positions, the
        next-token ids they predict (N), and the batch row of each (N).
    """
    base = base_of(model)
    hidden = base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch.get("position_ids"), use_cache=False).last_hidden_state
    targets = batch["labels"][:, 1:]
    # the supervised positions found once (boolean-mask indexing finds them per tensor, each a device sync on a GPU)
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    return hidden[:, :-1][rows, cols], targets[rows, cols], rows


def _loss_dtype(logits_dtype: torch.dtype, widen: bool) -> torch.dtype:
    return torch.promote_types(logits_dtype, torch.float32) if widen else torch.float32


def token_losses(model: Any, hidden: torch.Tensor, targets: torch.Tensor, widen: bool = False) -> torch.Tensor:
    """Cross-entropy (one per row of ``hidden``) of the model's head on gathered hidden states: fused and chunked
    where :func:`fused_head_weight` finds the head (the same values), else on the head's full logits.

    The logits are upcast to fp32 (``widen``: to the wider of fp32 and their own dtype, e.g. fp64) and the losses
    come in that dtype.
    """
    base = base_of(model)
    weight = fused_head_weight(base)
    if weight is not None and weight.device == hidden.device and (  # (else accelerate's hooks place the head)
            rows_compiled() or hidden.shape[0] * weight.shape[0] * 4 > FUSE_FROM_BYTES):
        dtype = _loss_dtype(compute_dtype(hidden, weight), widen)
        return fused_head_cross_entropy(hidden, weight, targets, loss_dtype=dtype)
    logits = LOGIT_HEADS[base.config.model_type](base, hidden)
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype, widen)), targets, reduction="none")


def supervised_positions_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over supervised positions, with the head run only there.

    Equals ``model(**batch).loss`` (transformers' causal-LM loss: labels shifted by one, mean over
    the positions that are not ``-100``).
    """
    hidden, targets, _ = supervised_hidden(model, batch)
    return token_losses(model, hidden, targets).sum() / targets.numel()


def all_positions_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The plain path: the model's own forward with labels (logits at every position). A packed batch
    (``position_ids``, :mod:`fedllm.data.packing`) runs without a cache, which would turn off transformers'
    detection of its sequences."""
    if "position_ids" in batch:
        return model(**batch, use_cache=False).loss
    return model(**batch).loss


#: ``train.loss_positions`` -> loss of one micro-batch.
LOSS_PATHS: dict[str, Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]] = {
    "supervised": supervised_positions_loss,
    "all": all_positions_loss,
}

_warned: set[str | None] = set()


def loss_path(model: Any, positions: str, task: str = "causal_lm") -> Callable[[Any, dict], torch.Tensor]:
    """The loss function for ``train.loss_positions`` (the plain path where the other does not apply)."""
    if positions == "all" or task != "causal_lm":
        return all_positions_loss
    if not supports_supervised_positions(model):
        model_type = getattr(base_of(model).config, "model_type", None)
        if model_type not in _warned:
            _warned.add(model_type)
            log.info("train.loss_positions=supervised: model type %r has no registered head; "
                     "computing logits at every position", model_type)
        return all_positions_loss
    return LOSS_PATHS[positions]
