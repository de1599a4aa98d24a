"""Keyed tensor-dict maths. A state is a ``dict[str, Tensor]``; keys and shapes are
checked before any arithmetic so a mismatch fails loudly instead of broadcasting."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

StateDict = dict[str, torch.Tensor]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StateMismatch(ValueError):
    """Two states do not have the same keys or shapes."""


def check_same_keys(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], what: str = "states") -> None:
    """Raise :class:`StateMismatch` unless ``a`` and ``b`` have equal keys and shapes."""
    if a.keys() != b.keys():
        only_a = sorted(set(a) - set(b))[:5]
        only_b = sorted(set(b) - set(a))[:5]
        raise StateMismatch(f"{what} have different keys: only in first {only_a}, only in second {only_b}")
    for k in a:
        if a[k].shape != b[k].shape:
            raise StateMismatch(f"{what}: {k} has shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")


def clone(a: Mapping[str, torch.Tensor]) -> StateDict:
    """Detached copies (PEFT state dicts share storage with live parameters)."""
    return {k: v.detach().clone() for k, v in a.items()}


def zeros_like(a: Mapping[str, torch.Tensor]) -> StateDict:
    return {k: torch.zeros_like(v) for k, v in a.items()}


def add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> StateDict:
    """a + b, key by key."""
    check_same_keys(a, b)
    return {k: a[k] + b[k] for k in a}


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> StateDict:
    """a - b, key by key."""
    check_same_keys(a, b)
    return {k: a[k] - b[k] for k in a}


def scale(a: Mapping[str, torch.Tensor], c: float) -> StateDict:
    """c * a."""
    return {k: v * c for k, v in a.items()}


def weighted_mean(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i * s_i / sum_i w_i, accumulated in fp32 and cast back to each tensor's dtype."""
    if not states:
        raise ValueError("weighted_mean of no states")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    for s in states[1:]:
        check_same_keys(states[0], s, "client updates")
    out: StateDict = {}
    for k, ref in states[0].items():
        acc = torch.zeros_like(ref, dtype=torch.float32)
        for s, w in zip(states, weights, strict=True):
            acc += s[k].float() * (float(w) / total)
        out[k] = acc.to(ref.dtype)
    return out


def num_bytes(a: Mapping[str, torch.Tensor], dtype: str | None = None) -> int:
    """Bytes to send ``a`` (as ``dtype`` when given, else as stored)."""
    if dtype is None:
        return sum(v.numel() * v.element_size() for v in a.values())
    size = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return sum(v.numel() * size for v in a.values())


def cast(a: Mapping[str, torch.Tensor], dtype: str) -> StateDict:
    """Round-trip floating tensors through ``dtype`` (what the wire carries), keeping their dtype."""
    tgt = DTYPES[dtype]
    return {k: v.to(tgt).to(v.dtype) if v.is_floating_point() else v for k, v in a.items()}


def subset(a: Mapping[str, torch.Tensor], keys) -> StateDict:
    """The entries of ``a`` named in ``keys`` (all must exist)."""
    missing = [k for k in keys if k not in a]
    if missing:
        raise StateMismatch(f"keys not in state: {missing[:5]}")
    return {k: a[k] for k in keys}
