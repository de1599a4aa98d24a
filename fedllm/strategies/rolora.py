"""RoLoRA: federated LoRA by alternating optimization of the two factors (Chen et al., NeurIPS 2025).

"Robust Federated Finetuning of LLMs via Alternating Optimization of LoRA" (arXiv 2502.01755), §3 and
Alg. 1: the rounds alternate which factor trains. In a ``B`` round every sampled client trains ``B`` with ``A``
frozen at the global ``A`` and the server averages only the ``B_k``; in an ``A`` round the clients train ``A``
with ``B`` frozen and the server averages only the ``A_k``. Since every client shares the frozen factor, the
average of one factor is the exact average of the clients' products: ``mean_k s·B_k A = s·B̄A`` (and likewise
for ``A``), so there is no aggregation interference, and both factors still learn (unlike FFA-LoRA, whose
``A`` never trains).

Order and initialisation: the standard LoRA init (``A`` random from the run's seed, the same on every
client; ``B = 0``) and ``B`` first — rounds 1, 3, 5 … train ``B``, rounds 2, 4, 6 … train ``A``. With
``B = 0`` an ``A`` round first would learn nothing (``∂L/∂A = s·Bᵀ·∂L/∂W = 0``), which is why the paper's
alternation starts from ``B``.

Bytes: a client receives both factors (it may have missed the last rounds) and sends only the factor it
trained, so the upload is half of FedAvg's. Other trainable keys (RoBERTa's classifier head) train and are
averaged every round. Client-level DP applies as to FedAvg: the upload is the sent factor plus its change.

Compressed download (``federation.compression.download``): a client receives the dequantised factors
``Q(A + e_s)``, ``Q(B + e_s)`` (the server's error feedback) and trains one against the other it holds. So that
``s·B̄·A`` stays the exact mean of the clients' products, the server keeps as the frozen factor the dequantised one
its clients received (:meth:`fedllm.strategies.base.Strategy.received`) and drops that factor's download residual
(its value is now exactly what the clients hold); the trained factor is averaged from the uploads as before.

DoRA (``lora.use_dora``, Liu et al. 2024, Eq. 5): a layer computes ``m ⊙ V / ‖V‖_c``, ``V = W + s·B·A``. The magnitude
``m`` is neither factor: it trains every round beside the round's factor and is averaged with the example weights
as any trainable tensor. The shared frozen factor keeps the directions exact (``mean_k V_k = W + s·B̄·A``) and PEFT
takes the column norm of the ``V`` the averaged factors give, so the global layer is ``m̄ ⊙ V̄ / ‖V̄‖_c``; the
magnitude is averaged as a tensor (the mean of the clients' DoRA weights is no DoRA layer of one adapter).
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import adapter_layers


def trains_b(rnd: int) -> bool:
    """True when round ``rnd`` (1-based) trains ``B`` (odd rounds), False when it trains ``A``."""
    return rnd % 2 == 1


@register_strategy("rolora")
class RoLoRA(FedAvg):
    """RoLoRA (Chen et al., NeurIPS 2025): odd rounds ``B̄ = Σ_k p_k B_k`` with ``A`` frozen, even rounds ``Ā = Σ_k p_k A_k`` with ``B`` frozen.

    Args:
        weighting: ``examples`` (``p_k = n_k / n``) or ``uniform``.
    """

    name = "rolora"
    client_batching = False  # each round trains a subset of the plan's keys (one phase with keys)
    aggregates_by_sum = True  # a weighted mean of the round's factor

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        layers = adapter_layers(model)
        self.a_keys = [layer.a_key for layer in layers.values()]
        self.b_keys = [layer.b_key for layer in layers.values()]

    def frozen_keys(self, rnd: int) -> list[str]:
        """The factor every client keeps fixed in round ``rnd``."""
        return self.a_keys if trains_b(rnd) else self.b_keys

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        frozen = set(self.frozen_keys(rnd))
        return ClientPlan(client_id, rnd, global_state, [Phase(keys=[k for k in global_state if k not in frozen])])

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Send only what trained this round: one factor of every layer (and the head)."""
        return {k: trained[k] for k in plan.phases[0].keys}

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        out = {**global_state, **super().aggregate(rnd, global_state, updates)}
        if self.downloaded:  # compressed download: keep the frozen factor the clients trained against
            received = self.received(global_state)
            out.update({k: received[k] for k in self.frozen_keys(rnd)})
        return out

    def reinitialised_at(self, rnd: int) -> list[str]:
        """The frozen factor: the server now holds what its clients received, nothing of it is owed to them."""
        return list(self.frozen_keys(rnd))
