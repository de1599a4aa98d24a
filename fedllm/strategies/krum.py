"""Krum (Blanchard et al., 2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent")."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.strategies.multikrum import MultiKrum


@register_strategy("krum")
class Krum(MultiKrum):
    """Krum: the one update with the lowest Krum score becomes the global state (Multi-Krum with ``m = 1``).

    Equal to Flower's ``Krum``.

    Args:
        num_malicious_clients: ``f``, the malicious clients assumed per round (Flower: ``num_malicious_nodes``).
    """

    name = "krum"

    def __init__(self, num_malicious_clients: int = 0, **kwargs):
        super().__init__(num_malicious_clients=num_malicious_clients, num_clients_to_select=1, **kwargs)
