"""Multi-Krum (Blanchard et al., 2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
Descent"; El Mhamdi et al., 2018 name the multi variant)."""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.fedmedian import checked


def squared_distances(updates: list[ClientUpdate]) -> torch.Tensor:
    """``n × n`` squared L2 distances between the updates (over every uploaded tensor, in fp64)."""
    flat = torch.stack([torch.cat([u.state[k].double().flatten() for k in sorted(u.state)]) for u in updates])
    return torch.cdist(flat, flat).square()


def scores_of(dist: torch.Tensor, num_malicious: int) -> list[float]:
    """Krum score of each row of a squared-distance matrix: the sum of its ``n − f − 2`` smallest distances to the
    others (at least 1), as Flower's ``select_multikrum`` / legacy ``aggregate_krum`` compute it."""
    closest = max(1, dist.shape[0] - num_malicious - 2)
    return [float(row.sort().values[1:closest + 1].sum()) for row in dist]  # [0] is the update itself


def krum_scores(updates: list[ClientUpdate], num_malicious: int) -> list[float]:
    """Krum score of each update: the sum of squared L2 distances (over every uploaded tensor) to its
    ``n − f − 2`` nearest other updates (at least 1), as Flower's ``select_multikrum`` computes it."""
    return scores_of(squared_distances(updates), num_malicious)


def select(updates: list[ClientUpdate], num_malicious: int, count: int) -> list[ClientUpdate]:
    """The ``count`` updates with the lowest Krum scores, best first (one-shot Multi-Krum)."""
    scores = krum_scores(updates, num_malicious)
    order = sorted(range(len(updates)), key=lambda i: (scores[i], i))
    return [updates[i] for i in order[:count]]


@register_strategy("multikrum")
class MultiKrum(FedAvg):
    """Multi-Krum: keep the ``m`` updates with the lowest Krum scores and average them (FedAvg's weights).

    Score of update ``i``: ``Σ_{j ∈ nearest(i, n−f−2)} ||θ_i − θ_j||²``. Equal to Flower's ``MultiKrum``.

    Args:
        num_malicious_clients: ``f``, the malicious clients assumed per round (Flower: ``num_malicious_nodes``).
        num_clients_to_select: ``m``, updates averaged (Flower: ``num_nodes_to_select``; 1 is Krum).
        weighting: ``examples`` or ``uniform`` weights of the average (Flower weights by examples).
    """

    name = "multikrum"
    aggregates_by_sum = False
    needs_individual_updates = "selects individual uploads by their Krum scores (distances between clients' updates)"

    def __init__(self, num_malicious_clients: int = 0, num_clients_to_select: int = 1,
                 weighting: str = "examples", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.num_malicious_clients = int(num_malicious_clients)
        self.num_clients_to_select = int(num_clients_to_select)

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        for key, low in (("num_malicious_clients", 0), ("num_clients_to_select", 1)):
            v = args.get(key, low)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                problems.append((key, v, f"an integer >= {low}"))
        return problems

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        checked(updates)
        return super().aggregate(rnd, global_state,
                                 select(updates, self.num_malicious_clients, self.num_clients_to_select))
