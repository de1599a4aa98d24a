"""Bulyan (El Mhamdi et al., 2018, "The Hidden Vulnerability of Distributed Learning in Byzantium"), with the
paper's recursive Krum selection."""

from __future__ import annotations

import logging

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.fedmedian import checked, coordinate_median, stacked
from fedllm.strategies.multikrum import MultiKrum, scores_of, squared_distances

log = logging.getLogger("fedllm")


def recursive_krum(updates: list[ClientUpdate], num_malicious: int, count: int) -> list[ClientUpdate]:
    """El Mhamdi et al.'s selection: ``count`` times, run Krum on the updates not chosen yet (its ``n' − f − 2``
    neighbours counted among those ``n'``) and move the winner to the selection (ties: the lower index)."""
    dist = squared_distances(updates)
    remaining, chosen = list(range(len(updates))), []
    for _ in range(count):
        idx = torch.tensor(remaining)
        scores = scores_of(dist[idx][:, idx], num_malicious)
        best = min(range(len(remaining)), key=lambda i: (scores[i], i))
        chosen.append(remaining.pop(best))
    return [updates[i] for i in chosen]


def trimmed_around_median(chosen: list[ClientUpdate], beta: int) -> StateDict:
    """Per coordinate, the mean of the ``beta`` selected values closest to their median (Bulyan's second step)."""
    out = {}
    for k, ref in chosen[0].state.items():
        stack = stacked(chosen, k)
        nearest = (stack - coordinate_median(stack)).abs().argsort(dim=0, stable=True)[:beta]
        out[k] = torch.gather(stack, 0, nearest).mean(dim=0).to(ref.dtype)
    return out


@register_strategy("bulyan")
class Bulyan(MultiKrum):
    """Bulyan as in the paper: recursive Krum selects ``θ = n − 2f`` updates (Krum on what remains, ``θ``
    times); per coordinate, average the ``β = θ − 2f`` selected values closest to their median.

    Needs ``n ≥ 4f + 3`` updates; with fewer the round keeps the global state (and warns). Unweighted; equal to
    Flower's legacy ``flwr.server.strategy.aggregate.aggregate_bulyan`` with Krum. ``bulyan_multikrum`` is the
    one-shot selection of Flower's Message-API ``Bulyan`` class.

    Args:
        num_malicious_clients: ``f``, the malicious clients assumed per round (Flower: ``num_malicious_nodes``).
    """

    name = "bulyan"

    def __init__(self, num_malicious_clients: int = 0, **kwargs):  # the count m is derived from n and f
        super().__init__(num_malicious_clients=num_malicious_clients, **kwargs)

    def selection(self, updates: list[ClientUpdate], count: int) -> list[ClientUpdate]:
        """The ``count`` updates Bulyan's trimmed mean runs over."""
        return recursive_krum(updates, self.num_malicious_clients, count)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        checked(updates)
        f, n = self.num_malicious_clients, len(updates)
        if n < 4 * f + 3:
            log.warning(
                "round %d: Bulyan needs at least 4f+3 = %d updates, got %d: the global state is kept", rnd, 4 * f + 3, n
            )
            return global_state
        theta = n - 2 * f
        return trimmed_around_median(self.selection(updates, theta), theta - 2 * f)
