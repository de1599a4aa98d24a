"""Bulyan with a one-shot Multi-Krum selection, as Flower's Message-API ``flwr.serverapp.strategy.Bulyan``."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.bulyan import Bulyan
from fedllm.strategies.multikrum import select


@register_strategy("bulyan_multikrum")
class BulyanMultiKrum(Bulyan):
    """Bulyan's trimmed mean over the ``θ = n − 2f`` updates with the lowest Krum scores computed once over all
    ``n`` (one-shot Multi-Krum), not El Mhamdi et al.'s recursive Krum (``bulyan``): the two selections differ
    when removing a chosen update changes the others' ranking. Equal to Flower 1.42's Message-API ``Bulyan``.

    Args:
        num_malicious_clients: ``f``, the malicious clients assumed per round (Flower: ``num_malicious_nodes``).
    """

    name = "bulyan_multikrum"

    def selection(self, updates: list[ClientUpdate], count: int) -> list[ClientUpdate]:
        return select(updates, self.num_malicious_clients, count)
