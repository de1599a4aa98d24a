"""Bulyan (El Mhamdi et al., 2018, "The Hidden Vulnerability of Distributed Learning in Byzantium")."""

from __future__ import annotations

import logging

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.fedmedian import checked, coordinate_median, stacked
from fedllm.strategies.multikrum import MultiKrum, select

log = logging.getLogger("fedllm")


@register_strategy("bulyan")
class Bulyan(MultiKrum):
    """Bulyan: Multi-Krum keeps ``θ = n − 2f`` updates; per coordinate, average the ``β = θ − 2f`` of them
    closest to their median (Multi-Krum's selection with a coordinate-wise trimmed mean instead of its average).

    Needs ``n ≥ 4f + 3`` updates; with fewer the round keeps the global state (and warns), as Flower's
    ``Bulyan`` skips the aggregation. Unweighted; equal to Flower's ``Bulyan``.

    Args:
        num_malicious_clients: ``f``, the malicious clients assumed per round (Flower: ``num_malicious_nodes``).
    """

    name = "bulyan"

    def __init__(self, num_malicious_clients: int = 0, **kwargs):  # the count m is derived from n and f
        super().__init__(num_malicious_clients=num_malicious_clients, **kwargs)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        checked(updates)
        f, n = self.num_malicious_clients, len(updates)
        if n < 4 * f + 3:
            log.warning("round %d: Bulyan needs at least 4f+3 = %d updates, got %d: the global state is kept",
                        rnd, 4 * f + 3, n)
            return global_state
        theta = n - 2 * f
        beta = theta - 2 * f
        chosen = select(updates, f, theta)
        out = {}
        for k, ref in chosen[0].state.items():
            stack = stacked(chosen, k)
            nearest = (stack - coordinate_median(stack)).abs().argsort(dim=0, stable=True)[:beta]
            out[k] = torch.gather(stack, 0, nearest).mean(dim=0).to(ref.dtype)
        return out
