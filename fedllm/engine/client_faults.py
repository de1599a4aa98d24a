"""Client faults: every update is checked before aggregation; a faulty client is dropped, not averaged in.

A client is dropped from its round when its training raises, when its loss is not finite, or
when its update does not have exactly the keys, shapes and dtypes the strategy's
``client_upload`` gives for its plan, or holds a nan/inf. What happens then is the recipe's:
``federation.on_client_error: skip`` (drop it with a warning and a ``dropped`` record in
``metrics.jsonl``) or ``fail`` (stop the run), and ``federation.min_clients_per_round`` (a
round with fewer valid updates is tried again with a fresh sample, ``federation.round_retries``
times, and the run then stops with a checkpoint of the last completed round).

Beyond finiteness, an update's norm ``||u_i - g||`` (over the tensors it shares with the global state
``g``; the tensor itself for the others) is bounded: above ``federation.max_update_norm``, or more than
``federation.update_outlier_factor`` times the median norm of the round's other updates (and of the
previous round's accepted ones), the client is dropped like a faulty one. Under client-level DP the relative
bound is ``update_outlier_factor`` times the clipping norm instead, and a round is not retried (the strategy's
``outlier_scale`` and ``resample_on_drops``): one client's data must not decide whether another is summed. A round whose aggregate is
not finite stops the run without a checkpoint of it (the newest checkpoint stays the previous one).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fedllm.models.state import StateDict
from fedllm.strategies import ClientPlan, ClientUpdate, Strategy

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class RoundStopped(RuntimeError):
    """A round could not be completed with valid updates; the run stopped after a checkpoint (exit 1)."""


@dataclass
class DroppedUpdate(ClientUpdate):
    """Stands in for the update of a dropped client (carries why, so every process learns it)."""

    reason: str = ""


def layout(state: StateDict) -> Layout:
    """``key -> (shape, dtype)`` of a state dict."""
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def expected_upload(strategy: Strategy, plan: ClientPlan, model: torch.nn.Module) -> Optional[Layout]:
    """The layout ``strategy.client_upload`` gives for ``plan``, computed on meta tensors (no memory).

    Returns None when the strategy's upload cannot be derived from the model's parameters alone
    (then the update is still checked for non-finite values).
    """
    probe = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in model.named_parameters()}
    try:
        return layout(strategy.client_upload(plan, probe, 0))
    except Exception:  # noqa: BLE001 — a strategy whose upload needs real values: checked by values only
        return None


def update_problem(update: ClientUpdate, expected: Optional[Layout]) -> Optional[str]:
    """Why ``update`` must not be aggregated, or None when it is valid."""
    if update.loss is not None and (not isinstance(update.loss, (int, float)) or not math.isfinite(update.loss)):
        return f"non-finite training loss ({update.loss})"
    if expected is not None:
        got = layout(update.state)
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        if missing or extra:
            return f"update keys differ from the expected ones (missing {missing[:3]}, unexpected {extra[:3]})"
        for key, (shape, dtype) in expected.items():
            if got[key] != (shape, dtype):
                return (f"{key}: shape {list(got[key][0])} {got[key][1]}, expected {list(shape)} {dtype}")
    key = non_finite_key(update.state)
    return f"non-finite values in {key}" if key is not None else None


def non_finite_key(state: StateDict) -> Optional[str]:
    """The first floating-point tensor of ``state`` holding a nan/inf, or None. The per-tensor flags are read
    together, one device sync per device: a sync per tensor cost 50 ms per client for SmolLM2's 240 LoRA factors
    on an H100 (issue #39's GPU profile)."""
    keys = [k for k, v in state.items() if v.is_floating_point()]
    by_device: dict[torch.device, list[str]] = {}
    for key in keys:
        by_device.setdefault(state[key].device, []).append(key)
    finite: dict[str, bool] = {}
    for group in by_device.values():
        finite.update(zip(group, torch.stack([torch.isfinite(state[k]).all() for k in group]).tolist()))
    return next((k for k in keys if not finite[k]), None)


def update_norm(update: StateDict, global_state: StateDict) -> float:
    """``||u - g||`` over the tensors ``update`` shares (same key and shape) with ``global_state``, plus ``||u||``
    of the others (gradients, private factors), in float64."""
    total = 0.0
    for key, value in update.items():
        if not value.is_floating_point():
            continue
        ref = global_state.get(key)
        delta = value.double() - ref.to(value.device).double() if ref is not None and ref.shape == value.shape \
            else value.double()
        total += float(delta.pow(2).sum())
    return math.sqrt(total)


def norm_outliers(norms: dict[int, float], max_norm: Optional[float], factor: Optional[float],
                  reference: list[float], scale: Optional[float] = None) -> dict[int, str]:
    """``{client: why}`` of the updates whose norm is above ``max_norm``, or above ``factor`` x the median of
    the other clients' norms and the ``reference`` norms (a median of 0 or no others: not judged).

    With a data-independent ``scale`` (client-level DP: the clipping norm) the relative bound is ``factor`` x
    ``scale`` instead, so each verdict depends on that client's norm alone (``reference`` is not used)."""
    out = {}
    for cid, norm in norms.items():
        if max_norm is not None and norm > max_norm:
            out[cid] = f"update norm {norm:.4g} above federation.max_update_norm={max_norm:g}"
            continue
        if scale is not None:
            if factor is not None and norm > factor * scale:
                out[cid] = (f"update norm {norm:.4g} is more than federation.update_outlier_factor={factor:g} times "
                            f"the clipping norm ({scale:.4g}; under client-level DP the bound ignores other clients)")
            continue
        others = [n for c, n in norms.items() if c != cid] + list(reference)
        median = statistics.median(others) if others and factor is not None else 0.0
        if median > 0 and norm > factor * median:
            out[cid] = (f"update norm {norm:.4g} is more than federation.update_outlier_factor={factor:g} times the "
                        f"median of the others ({median:.4g})")
    return out


def describe(exc: BaseException) -> str:
    """One line naming an exception a client raised."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}" + (f": {text}" if text else "")


def steps_seen(updates: list[Any]) -> dict[int, int]:
    """``{client: local steps}`` of every upload that reached the server, valid or dropped (a dropped one that
    raised before uploading has none)."""
    return {u.client_id: int(u.steps) for u in updates if u.steps}


def split_dropped(updates: list[Any]) -> tuple[list[ClientUpdate], dict[int, str]]:
    """``(valid updates, {client: reason})`` of a gathered round."""
    valid = [u for u in updates if not isinstance(u, DroppedUpdate)]
    return valid, {u.client_id: u.reason for u in updates if isinstance(u, DroppedUpdate)}
