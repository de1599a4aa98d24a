"""HetLoRA: heterogeneous ranks, rank self-pruning and sparsity-weighted aggregation (Cho et al., EMNLP 2024).

"Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models" (arXiv 2401.06432), §3 and Fig. 2.
The server holds one adapter of the largest rank ``r_max = lora.r``; client ``k`` has rank ``r_k``
(:mod:`fedllm.strategies.client_ranks`: a list or a named resource distribution).

- **Distribution by truncation** (Fig. 2c): client ``k`` receives the first ``r_k`` columns of ``B`` and rows of
  ``A`` of the global adapter (no SVD).
- **Local rank self-pruning** (§3, Eq. 1): the client adds ``λ·Σ_layers ||B_{k,[γr_k:r_k]}||_F·||A_{k,[γr_k:r_k]}||``
  to its loss, the norms of the last ``r_k − ⌊γ r_k⌋`` ranks (``γ < 1`` the decay factor), pushing them to zero.
  After local training it compares that product (summed over the layers) with its value on the factors it
  received: if it shrank, the client prunes those ranks, ``r_k ← max(1, ⌊γ r_k⌋)``, uploads only the first
  ``r_k`` ranks and keeps that rank from then on (the server, which learns it from the upload's shapes, truncates
  the next download to it). ``γ = 1`` (or ``λ = 0`` with nothing to shrink) turns pruning off. Reading: the paper
  prunes "if the norm of the pruned ranks decreased during local training"; comparing with the received
  factors and summing over the layers (one rank per client, as the paper's ``r_k``) is this toolkit's reading.
- **Zero-padding, sparsity-weighted aggregation** (Fig. 2a–b): every upload is zero-padded to ``r_max`` and
  ``(B̄, Ā) = Σ_k p_k (B_k, A_k)`` with ``p_k = ||ΔW_k||_F / Σ_j ||ΔW_j||_F``, ``ΔW_k = B_k A_k`` — per layer
  (each LoRA module is aggregated on its own norms; the paper writes one module). A layer whose uploads all
  have ``ΔW_k = 0`` (e.g. ``B`` still zero) is averaged uniformly. Other trainable keys (a classifier head) are
  averaged with the ``weighting`` example weights, as FedAvg.

**Ranks lost for good** (faithful to the paper's zero-padding, Fig. 2a): in a round where every sampled client
uploads rank ``m < r_max``, the padded mean zeroes rows ``m…r_max`` of every ``Ā`` and columns ``m…r_max`` of
every ``B̄``. A rank whose row of ``A`` and column of ``B`` are both zero gets zero gradients (each factor's
gradient goes through the other), so no client of a higher rank can relearn it: from then on the global adapter
has rank ``m`` at most. The round it happens while some client still holds a rank above ``m``, a warning names
the round, the ranks lost and those clients. The paper gives no remedy; later work replaces zero-padded
aggregation altogether (FlexLoRA, Bai et al. 2024: the mean of the full products, SVD-truncated to each
client's rank; FLoRA, Wang et al. 2024: stacking), registered here as ``flexlora`` and ``flora``; proposals
that keep zero-padding's structure (replicating higher ranks instead of zeros, averaging each rank only over
the clients that hold it) are not established, and HetLoRA here offers none. Sampling more clients per round
makes such a round rarer.

DoRA (``lora.use_dora``, Liu et al. 2024, Eq. 5): a layer computes ``m ⊙ (W + s·B·A) / ‖W + s·B·A‖_c``. The magnitude
``m`` has one entry per output row, whatever the rank, so it is neither truncated nor padded: every client receives
and trains all of it, and the server averages it with the same per-layer weights ``p_k`` as that layer's factors (the
paper weights each LoRA module's upload by the norm of its update, Fig. 2b; ``m`` belongs to that module), uniform
where all ``ΔW_k = 0``. PEFT computes the column norm from the current factors, so a client of rank ``r_k`` computes
DoRA of its truncated ``W + s·B_k A_k`` and the global model DoRA of the padded mean ``W + s·B̄Ā`` with ``m̄``.

Scaling as :mod:`fedllm.strategies.client_ranks`: every client computes ``s·B_k A_k`` with the shared
``s = alpha / r_max``. The client's current rank travels in its plan (``extra["rank"]``), so the client side needs
no stored state; the server keeps every client's current rank (checkpointed).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict, weighted_mean
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate
from fedllm.strategies.client_ranks import RankedClients, check_rank_args
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import adapter_layers

RANK = "rank"  # plan.extra entry: the client's current rank

log = logging.getLogger("fedllm")


def pruned_rank(rank: int, gamma: float) -> int:
    """``max(1, ⌊γ·rank⌋)``: the rank after one self-pruning step (``rank`` when ``γ = 1``)."""
    return max(1, math.floor(gamma * rank + 1e-9))


def tail_norm(b: torch.Tensor, a: torch.Tensor, keep: int, rank: int) -> torch.Tensor:
    """``||B[:, keep:rank]||_F · ||A[keep:rank]||_F`` (the self-pruning regulariser of one layer, Eq. 1)."""
    return torch.linalg.vector_norm(b[:, keep:rank]) * torch.linalg.vector_norm(a[keep:rank])


def product_norm(b: torch.Tensor, a: torch.Tensor) -> float:
    """``||B A||_F`` in float64 without forming ``B A``: ``sqrt(tr((BᵀB)(AAᵀ)))``."""
    b, a = b.double(), a.double()
    return math.sqrt(max(float(torch.trace((b.mT @ b) @ (a @ a.mT))), 0.0))


@register_strategy("hetlora")
class HetLoRA(RankedClients, FedAvg):
    """HetLoRA (Cho et al., EMNLP 2024): zero-pad, ``(B̄, Ā) = Σ_k (||B_kA_k||_F / Σ_j ||B_jA_j||_F)·(B_k, A_k)``; truncate to ``r_k``; clients self-prune ``r_k ← ⌊γ r_k⌋``.

    Args:
        client_ranks: rank of every client: a list (each at most ``lora.r``) or a resource distribution name
            (see :mod:`fedllm.strategies.client_ranks`). Default: every client at ``lora.r``.
        rank_levels: the four levels' ranks for a named distribution (default ``lora.r`` /8, /4, /2, /1).
        gamma: the pruning decay factor ``γ`` in (0, 1]; 1 turns self-pruning off.
        prune_lambda: ``λ``, the weight of the self-pruning regulariser (>= 0).
        weighting: ``examples`` or ``uniform``: the weights of the keys other than the LoRA factors.
    """

    name = "hetlora"
    client_batching = False  # a per-client rank, regulariser and upload
    aggregates_by_sum = False
    needs_individual_updates = "weights each client's upload by its own norm ||B_k·A_k||_F"

    def __init__(self, client_ranks: Any = None, rank_levels: list | None = None, gamma: float = 0.99,
                 prune_lambda: float = 0.01, weighting: str = "examples", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.client_ranks, self.rank_levels = client_ranks, rank_levels
        self.gamma, self.prune_lambda = float(gamma), float(prune_lambda)

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args) + check_rank_args(args)
        gamma, lam = args.get("gamma", 0.99), args.get("prune_lambda", 0.01)
        if isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and not 0 < gamma <= 1:
            problems.append(("gamma", gamma, "a number in (0, 1] (1: no self-pruning)"))
        if isinstance(lam, (int, float)) and not isinstance(lam, bool) and lam < 0:
            problems.append(("prune_lambda", lam, "a number >= 0"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.setup_ranks(len(clients))
        self.current = list(self.ranks)  # server side: every client's rank after its last upload

    # ----- server side
    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        rank = self.current[client_id]
        return ClientPlan(client_id, rnd, self.truncate(global_state, rank), extra={RANK: rank})

    def upload_rank(self, update: ClientUpdate) -> int:
        """The rank of ``update`` (its own, or one pruning step below); ValueError for any other shape."""
        rank = self.current[update.client_id]
        allowed = {rank, pruned_rank(rank, self.gamma)}
        shapes = {(update.state[layer.a_key].shape[0], update.state[layer.b_key].shape[1])
                  for layer in self.layers.values()}
        (got_a, got_b), *others = shapes
        if others or got_a != got_b or got_a not in allowed:
            raise ValueError(f"hetlora: client {update.client_id} uploaded factors of ranks {sorted(shapes)}; expected "
                             f"one rank in {sorted(allowed)} for every layer (its rank {rank} or one pruning step)")
        return got_a

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        ranks = [self.upload_rank(u) for u in updates]
        out = dict(global_state)
        for layer in self.layers.values():
            norms = [product_norm(u.state[layer.b_key], u.state[layer.a_key]) for u in updates]
            total = sum(norms)
            p = [n / total for n in norms] if total > 0 else [1.0 / len(updates)] * len(updates)
            keys = [layer.b_key, layer.a_key] + ([layer.magnitude_key] if layer.magnitude_key else [])
            out.update(weighted_mean([self.pad({k: u.state[k] for k in keys}) for u in updates], p))
        layer_keys = self.factor_keys | {layer.magnitude_key for layer in self.layers.values()}
        heads = [{k: v for k, v in u.state.items() if k not in layer_keys} for u in updates]
        if heads[0]:
            out.update(weighted_mean(heads, self.weights(updates)))
        for u, rank in zip(updates, ranks, strict=True):
            self.current[u.client_id] = rank
        self._warn_lost_ranks(rnd, global_state, out)
        return out

    def live_ranks(self, state: StateDict) -> int:
        """One past the highest rank whose row of ``A`` or column of ``B`` is non-zero in some layer (the ranks
        above it are zero in both factors: zero gradients, lost for good)."""
        live = 0
        for layer in self.layers.values():
            used = (state[layer.a_key].detach() != 0).any(1) | (state[layer.b_key].detach() != 0).any(0)
            nonzero = used.nonzero()
            if len(nonzero):
                live = max(live, int(nonzero[-1]) + 1)
        return live

    def _warn_lost_ranks(self, rnd: int, before: StateDict, after: StateDict) -> None:
        """Warn when this round's zero-padded mean zeroed ranks some client still holds (see the module docstring)."""
        was, now = self.live_ranks(before), self.live_ranks(after)
        holders = [c for c, rank in enumerate(self.current) if rank > now]
        if now < was and holders:
            log.warning("hetlora: round %d: every sampled client uploaded rank <= %d, so the zero-padded mean zeroed "
                        "ranks %d-%d of the global adapter (both factors): no client can relearn them, and client(s) "
                        "%s of rank > %d train them in vain from now on (HetLoRA's zero-padding; flexlora or flora "
                        "aggregate without it)", rnd, now, now + 1, was, _listed(holders), now)


    def state_dict(self) -> StateDict:
        return {"ranks": torch.tensor(self.current, dtype=torch.int64)}

    def load_state_dict(self, state: StateDict) -> None:
        if "ranks" in state:
            self.current = [int(r) for r in state["ranks"].tolist()]

    # ----- client side
    def open_client(self, plan: ClientPlan) -> None:
        """Zero-pad the received rank-``r_k`` factors; keep the tail norms they start from (Eq. 1's reference)."""
        rank = int(plan.extra[RANK])
        keep = pruned_rank(rank, self.gamma)
        plan.extra["start_tail"] = sum(float(tail_norm(plan.state[layer.b_key].float(), plan.state[layer.a_key].float(),
                                                       keep, rank)) for layer in self.layers.values())
        super().open_client(plan)
        self.client_rank = rank

    def client_loss(self, model: torch.nn.Module, plan: ClientPlan) -> torch.Tensor | None:
        """``λ·Σ_layers ||B_tail||_F·||A_tail||_F`` over the ranks ``⌊γ r_k⌋ … r_k`` (Eq. 1)."""
        rank = int(plan.extra[RANK])
        keep = pruned_rank(rank, self.gamma)
        if self.prune_lambda == 0 or keep == rank:
            return None
        params = dict(model.named_parameters())
        return self.prune_lambda * sum(tail_norm(params[layer.b_key], params[layer.a_key], keep, rank)
                                       for layer in self.layers.values())

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """Zero the stored moments beyond the client's current rank (ranks it pruned), so they stay at zero."""
        rank = getattr(self, "client_rank", None)
        if not state or rank is None:
            return state
        rank_dim = {**{layer.a_key: 0 for layer in self.layers.values()},
                    **{layer.b_key: 1 for layer in self.layers.values()}}
        out = dict(state)
        for key, moment in state.items():
            dim = rank_dim.get(key.split("::", 1)[0])
            if dim is not None and moment.dim() == 2:
                out[key] = moment.clone()
                out[key].narrow(dim, rank, moment.shape[dim] - rank).zero_()
        return out

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """The first ``r_k`` ranks, or the first ``⌊γ r_k⌋`` when the tail's norm shrank during training (pruned)."""
        rank = int(plan.extra[RANK])
        keep = pruned_rank(rank, self.gamma)
        if any(v.is_meta for v in trained.values()):
            raise ValueError("hetlora: the upload's rank depends on the trained values")  # no layout probe
        if keep < rank:
            end = sum(float(tail_norm(trained[layer.b_key].float(), trained[layer.a_key].float(), keep, rank))
                      for layer in self.layers.values())
            if end < float(plan.extra["start_tail"]):
                rank = keep
        return self.truncate({k: trained[k] for k in plan.state}, rank)


def _listed(ids: list[int], shown: int = 10) -> str:
    return ", ".join(map(str, ids[:shown])) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")
