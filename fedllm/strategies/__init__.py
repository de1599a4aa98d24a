"""Federated strategies, one per file, picked by registry name."""

from fedllm.common.registry import strategies
from fedllm.strategies import (  # noqa: F401
    fedadagrad,
    fedadam,
    fedavg,  # noqa: F401
    fed_sb,
    fedavgm,
    fedex_lora,
    fedlora_pfl,
    fedloru,
    fedprox,
    fedsa_lora,
    fedsvd,
    fedyogi,
    ffa_lora,
    flexlora,
    flora,
    frlora,
    hetlora,
    local,
    lora_fair,
    mfedloru,
    pfedloru,
    pflmf,
    rolora,
    scaffold,
)
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase, Strategy


def get_strategy(name: str, **args) -> Strategy:
    """Instantiate the strategy registered as ``name`` with ``args``."""
    return strategies.get(name)(**args)


__all__ = ["ClientInfo", "ClientPlan", "ClientUpdate", "Phase", "Strategy", "get_strategy"]
