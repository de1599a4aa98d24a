"""Grouped-query eager attention: each key/value head's whole query group in one matmul, no ``repeat_kv``.

transformers' eager attention (``eager_attention_forward`` of LLaMA, Qwen2, Gemma, ...) first repeats every
key/value head over the query heads that share it (``repeat_kv``: a copy forward, a sum over the copies backward)
and then multiplies per query head: SmolLM2's 9 query heads on 3 key/value heads make 36 small ``S x 64`` products
per batch of 4. Here the query heads of a group are stacked along the positions instead (``b x kv x (g·S) x d``),
so each key/value head takes one ``g·S``-row matmul with its own keys and values, and no copy or sum is formed.
The scores, mask, fp32 softmax, dropout and weighted sum are eager's, element for element (the same head order:
query head ``h`` reads key/value head ``h // g``); the outputs equal eager's, and the key/value gradients, summed
over the group inside one matmul rather than after it, agree to rounding (``tests/models/
test_grouped_attention.py``).

fedllm trains with it on a CPU in bf16/fp16 under ``train.compile`` (:func:`fedllm.engine.client.
training_attention`; the eager default keeps transformers' function and its exact bits). In a compiled
quickstart-shaped step it saved 0–3 % of the CPU time, within the trials' spread (``bench/bf16_step.py --variants
bf16-compiled,bf16-compiled-repeat-kv``, docs/performance.md). Attention this function does not cover (Gemma 2's
soft-capping, attention sinks, a module without key/value groups) runs the model's own eager function.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

#: The name fedllm registers with transformers' attention and mask interfaces (the mask is eager's).
NAME = "fedllm_grouped_eager"


def _model_eager(module: torch.nn.Module):
    """The eager attention function of the model that defines ``module``."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _grouped_applies(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the grouped computation covers this call: no logit soft-capping or attention sinks, and a module
    that says how many query heads share a key/value head (else the model's own eager function runs)."""
    return kwargs.get("softcap") is None and kwargs.get("s_aux") is None and hasattr(module, "num_key_value_groups")


def grouped_eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-interface signature: ``query`` ``b x H x S x d``, ``key``/``value`` ``b x kv x S_k x
    d`` (``H = g·kv``), an additive mask ``b x 1 x S x S_k`` (or one per head); returns ``(b x S x H x d output,
    b x H x S x S_k weights)``."""
    if not _grouped_applies(module, kwargs):
        return _model_eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    batch, heads, length, dim = query.shape
    kv_heads, groups = key.shape[1], module.num_key_value_groups
    stacked = query.reshape(batch, kv_heads, groups * length, dim)
    weights = (torch.matmul(stacked, key.transpose(2, 3)) * scaling).view(batch, kv_heads, groups, length, -1)
    if attention_mask is not None:
        mask = attention_mask[:, None] if attention_mask.shape[1] == 1 else attention_mask.view(
            batch, kv_heads, groups, length, -1)
        weights = weights + mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(batch, kv_heads, groups * length, -1), value)
    return out.view(batch, heads, length, dim).transpose(1, 2).contiguous(), weights.view(batch, heads, length, -1)


#: The name of :func:`blocked_causal_attention` in transformers' attention interface.
BLOCKED_NAME = "fedllm_blocked_causal"
#: Queries per block of :func:`blocked_causal_attention`.
QUERY_BLOCK = 128


def blocked_causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`grouped_eager_attention` one block of :data:`QUERY_BLOCK` queries at a time, each against the keys up to
    the block's last position only: the keys after it are masked for every query of the block (checked on the mask:
    a block whose queries see a later key takes every key), so their scores, exponentials (exactly 0) and products
    are never formed — about half of eager's work at long lengths, in ``S x block`` pieces that stay in cache. Same
    signature as eager; returns no weights (as SDPA)."""
    if not _grouped_applies(module, kwargs):
        return _model_eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    batch, heads, length, dim = query.shape
    kv_heads, groups = key.shape[1], module.num_key_value_groups
    outs = []
    for start in range(0, length, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, length)
        rows = stop - start
        mask = None if attention_mask is None else attention_mask[:, :, start:stop]
        keys = stop if mask is None or _masked_after(mask, stop) else key.shape[2]
        stacked = query[:, :, start:stop].reshape(batch, kv_heads, groups * rows, dim)
        weights = (torch.matmul(stacked, key[:, :, :keys].transpose(2, 3)) * scaling).view(
            batch, kv_heads, groups, rows, keys)
        if mask is not None:
            mask = mask[..., :keys]
            weights = weights + (mask[:, None] if mask.shape[1] == 1 else mask.view(batch, kv_heads, groups, rows, keys))
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = F.dropout(weights, p=dropout, training=module.training)
        outs.append(torch.matmul(weights.view(batch, kv_heads, groups * rows, keys), value[:, :, :keys]).view(
            batch, heads, rows, dim))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _masked_after(mask: torch.Tensor, stop: int) -> bool:
    """Whether every key from position ``stop`` on is masked (additive mask at its dtype's minimum) for these rows.

    A fake tensor (the dry run's memory trace, :mod:`fedllm.engine.activation_memory`) has no values to look at: it is
    taken as a training batch's causal mask, whose later keys are masked."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(mask, FakeTensor):
        return True
    later = mask[..., stop:]
    return later.numel() == 0 or bool((later <= torch.finfo(mask.dtype).min / 2).all()) if mask.is_floating_point() \
        else not bool(later.any())


@functools.cache
def register() -> str:
    """Register :func:`grouped_eager_attention` (with eager's mask) under :data:`NAME`, once per process (a packed
    run asks per micro-batch); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


@functools.cache
def register_blocked() -> str:
    """Register :func:`blocked_causal_attention` (with eager's mask) under :data:`BLOCKED_NAME`, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(BLOCKED_NAME, blocked_causal_attention)
    AttentionMaskInterface.register(BLOCKED_NAME, eager_mask)
    return BLOCKED_NAME
