"""FLoRA: stacking-based aggregation of heterogeneous LoRA adapters (Wang et al., NeurIPS 2024).

Client ``k`` trains a LoRA of its own rank ``r_k`` (:mod:`fedllm.strategies.client_ranks`). The server
stacks the clients' adapters with the aggregation weights folded in, ``B_stack = [B_1 … B_K]`` and
``A_stack = [p_1·A_1; …; p_K·A_K]`` (rank ``Σ r_k``), whose product is exactly ``Σ_k p_k B_k A_k``; every
client (participating or not) receives the stack and merges ``s·B_stack A_stack`` into its base weight, and
each round every client starts from a fresh LoRA init (``A`` random, seeded so all agree; ``B = 0``).

The merge goes through :class:`fedllm.strategies.residual.BaseUpdates`: in place in fp32 for an fp32 base,
kept as an fp32 dense residual beside a 4/8-bit or half-precision base (``residual: auto``).
"""

from __future__ import annotations

from typing import Any

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import DTYPES, StateDict, weighted_mean
from fedllm.runs.base_history import LowRankMerge
from fedllm.strategies.base import ClientInfo, ClientUpdate
from fedllm.strategies.client_ranks import RankedClients, check_rank_args
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import (
    RESIDUAL_MODES,
    BaseUpdates,
    MergesIntoBase,
    adapter_layers,
    drop_moments,
    layer_seed,
    recipe_value,
    resolve_residual_mode,
    standard_factors,
    to_wire,
)


@register_strategy("flora")
class FLoRA(MergesIntoBase, RankedClients, FedAvg):
    """FLoRA (Wang et al., NeurIPS 2024): ``W ← W + s·[B_1 … B_K]·[p_1 A_1; …; p_K A_K]`` on every client, then a fresh LoRA init.

    Args:
        client_ranks: rank of every client: a list (each at most ``lora.r``) or a resource distribution
            name (see :mod:`fedllm.strategies.client_ranks`). Default: every client at ``lora.r``.
        rank_levels: the four levels' ranks for a named distribution (default ``lora.r`` /8, /4, /2, /1).
        weighting: ``examples`` (``p_k = n_k / n``, the paper) or ``uniform``.
        residual: how the stack reaches the base: ``auto``, ``merge`` (in place) or ``dense`` (fp32 residual).
    """

    name = "flora"
    aggregates_by_sum = False
    needs_individual_updates = "stacks the clients' adapters side by side instead of summing them"

    def __init__(self, client_ranks: Any = None, rank_levels: list | None = None, weighting: str = "examples",
                 residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.client_ranks, self.rank_levels, self.residual = client_ranks, rank_levels, residual

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args) + check_rank_args(args)
        if args.get("residual", "auto") not in RESIDUAL_MODES:
            problems.append(("residual", args["residual"], f"one of {', '.join(RESIDUAL_MODES)}"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.setup_ranks(len(clients))
        self.base = BaseUpdates(self.layers, resolve_residual_mode(self.residual, self.layers))
        self.modifies_base = self.base.modifies_base
        self.stacked_rank = 0  # rank of this round's stack (counted by extra_download_bytes right after)

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict):
        plan = super().configure_client(rnd, client_id, global_state)
        plan.state = self.truncate(plan.state, self.ranks[client_id])
        return plan

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        """Merge the weighted stack into the base, average the other keys, and re-draw the adapter."""
        weights = self.weights(updates)
        total = sum(weights)
        init = recipe_value(self.recipe, "lora.init", "default")
        out = dict(global_state)
        for name, layer in self.layers.items():
            b_stack = torch.cat([u.state[layer.b_key].float() for u in updates], 1)
            a_stack = torch.cat([u.state[layer.a_key].float() * (w / total)
                                 for u, w in zip(updates, weights, strict=True)], 0)
            self.base.add(name, LowRankMerge([(b_stack.to(DTYPES[self.comm_dtype]), a_stack.to(DTYPES[self.comm_dtype]),
                                               layer.scale)]), rnd)
            _, a_new = standard_factors(layer, init, layer_seed(self.seed, name, 0xF10, rnd))
            out[layer.a_key] = to_wire(a_new, self.comm_dtype, global_state[layer.a_key])
            out[layer.b_key] = torch.zeros_like(global_state[layer.b_key])
        self.stacked_rank = sum(self.ranks[u.client_id] for u in updates)
        heads = [{k: v for k, v in u.state.items() if k not in self.factor_keys} for u in updates]
        if heads[0]:
            out.update(weighted_mean(heads, weights))
        return out

    def extra_download_bytes(self, rnd: int, sampled: list[int], num_clients: int, comm_dtype: str) -> dict[int, int]:
        """Every client receives the round's stack ``(B_stack, A_stack)`` to merge it into its base."""
        numel = sum(self.stacked_rank * (layer.shape[0] + layer.shape[1]) for layer in self.layers.values())
        return {c: numel * DTYPES[comm_dtype].itemsize for c in range(num_clients)}

    def reinitialised_at(self, rnd: int) -> list[str]:
        """The adapter is re-drawn every round: its download residual restarts (``B = 0`` arrives exactly 0)."""
        return sorted(self.factor_keys)

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """The adapter is re-drawn every round: its moments never carry over (other keys' do)."""
        return drop_moments(state, self.factor_keys)
