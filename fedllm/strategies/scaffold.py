"""SCAFFOLD (Karimireddy et al., 2020, Alg. 1, option II): control variates correct each client's drift."""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict, cast, num_bytes, weighted_mean
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate
from fedllm.strategies.fedavg import FedAvg

DELTA_C = "scaffold.delta_c/"  # upload keys of a client's Δc_i


@register_strategy("scaffold")
class Scaffold(FedAvg):
    """SCAFFOLD: local step ``y ← y − lr·(g − c_i + c)``; ``c_i⁺ = c_i − c + (x − y)/(K·lr)``; ``c ← c + (1/N)·Σ_S Δc_i``.

    The server keeps ``x`` (the global trainable tensors) and ``c`` (:meth:`state_dict`, checkpointed)
    and sends both (both count in ``bytes_down``). Client ``i`` keeps ``c_i`` in the client store
    (zero before its first round), applies the correction after every optimizer step, computes the
    option-II ``c_i⁺`` from its progress over its ``K`` steps at the round's lr, keeps it and uploads
    ``y_i`` plus ``Δc_i = c_i⁺ − c_i`` (both count in ``bytes_up``). The server sets ``x`` to the
    clients' weighted mean (global step size 1) and adds ``(1/N)·Σ Δc_i`` over the round's clients to ``c``.

    Correction form: after each optimizer step the parameters move by ``−lr·(c − c_i)``. With plain SGD
    (no momentum, no weight decay) that is the paper's ``y ← y − lr·(g − c_i + c)`` (the same sum, rounded
    in another order: equal to fp32 rounding; ``tests/strategies/test_scaffold.py`` checks the paper's
    formulas by hand under SGD). With AdamW it is the form of OpenFedLLM (Ye et al., 2024a), whose settings
    the FRLoRA paper uses for its baselines, and the consistent one: option II measures the variates from
    the parameter movement per unit lr, i.e. in units of the optimizer's update direction, so the
    correction is applied in that same space; adding ``c − c_i`` to the gradient instead would pass it
    through Adam's normalisation and mix units (variates in update units, corrections against gradients).
    ``Δc_i`` depends only on what the client received and its trained values, so the upload's layout is
    known before training (the round loop's update check). A round with lr 0 leaves ``c_i`` unchanged.

    Args:
        weighting: ``examples`` or ``uniform`` weights of the model mean, as FedAvg.
    """

    name = "scaffold"
    async_refusal = ("corrects each client with control variates c and c_i of the same round, and a stale upload's "
                     "Δc_i belongs to a c the server no longer holds (FedBuff is defined for FedAvg and FedOpt)")
    late_update = ("dropped: its c_i stays the one from before the round and c moves by (1/N)·Σ Δc_i over the clients "
                   "that arrived, as for a client not sampled; its next round starts from the new x and c")
    aggregates_by_sum = True  # a weighted mean of models and the unweighted sum of the Δc_i (summed_unweighted)

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.num_clients = len(clients)
        self.c = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in model.named_parameters()
                  if p.requires_grad}

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        return ClientPlan(client_id=client_id, rnd=rnd, state=global_state, extra={"c": cast(self.c, self.comm_dtype)})

    def download_bytes(self, plan: ClientPlan, comm_dtype: str) -> int:
        return num_bytes(plan.state, comm_dtype) + num_bytes(plan.extra["c"], comm_dtype)

    def open_client(self, plan: ClientPlan) -> None:
        """Read ``c_i`` (zero the first time) and the round's correction ``c − c_i``."""
        c_i = {k: plan.client_state[k].to(x.device, torch.float32) if k in plan.client_state
               else torch.zeros_like(x, dtype=torch.float32) for k, x in plan.state.items()}
        plan.extra["c_i"] = c_i
        plan.extra["correction"] = {k: plan.extra["c"][k].to(v.device) - v for k, v in c_i.items()}

    @torch.no_grad()
    def after_step(self, model: torch.nn.Module, plan: ClientPlan) -> None:
        params = dict(model.named_parameters())
        for k, correction in plan.extra["correction"].items():
            params[k].sub_((plan.lr * correction).to(params[k].dtype))

    def delta_c(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Option II's ``Δc_i = c_i⁺ − c_i = (x − y_i)/(K·lr) − c`` (zero when no step moved: K = 0 or lr = 0)."""
        if steps == 0 or plan.lr == 0:
            return {k: torch.zeros_like(trained[k], dtype=torch.float32) for k in plan.state}
        return {k: (x.float() - trained[k].float()) / (steps * plan.lr) - plan.extra["c"][k].to(x.device)
                for k, x in plan.state.items()}

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Keep ``c_i⁺ = c_i + Δc_i`` on the client."""
        delta = self.delta_c(plan, trained, steps)
        return {k: v + delta[k] for k, v in plan.extra["c_i"].items()}

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        delta = self.delta_c(plan, trained, steps)
        return {**{k: trained[k] for k in plan.state}, **{DELTA_C + k: v for k, v in delta.items()}}

    def summed_unweighted(self, key: str) -> bool:
        """``Δc_i`` is summed over the clients without their weight (``c ← c + Σ Δc_i / N``)."""
        return key.startswith(DELTA_C)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        models = [{k: v for k, v in u.state.items() if not k.startswith(DELTA_C)} for u in updates]
        for u in updates:
            self.c = {k: c + u.state[DELTA_C + k].to(c.device, torch.float32) / self.num_clients
                      for k, c in self.c.items()}
        return weighted_mean(models, self.weights(updates))

    def state_dict(self) -> StateDict:
        return {f"c/{k}": v for k, v in self.c.items()}

    def load_state_dict(self, state: StateDict) -> None:
        self.c = {k[len("c/"):]: v.clone() for k, v in state.items()}
