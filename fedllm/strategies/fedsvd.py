"""FedSVD (Lee et al., NeurIPS 2025, arXiv 2505.12805): FFA-LoRA's frozen ``A``, re-orthogonalised by the server.

Clients train only ``B`` with ``A`` frozen (FFA-LoRA's client side, so DP-SGD's per-example clipping and noise act on
``B``'s gradients alone and are never multiplied by a noisy ``A``) and upload ``B``. The server averages them,
``B̄ = Σ_k p_k B_k``, and refactorises the product with the round's ``A`` by SVD (the authors' ``reinit_lora``,
``fed-svd/misc/utils.py``): ``B̄·A = U·diag(S)·Vh``, ``A ← Vh[:r]`` (orthonormal rows, the principal directions of the
aggregate update) and ``B ← U[:, :r]·diag(S[:r])``. The product, hence the model, is unchanged by the refactorisation;
``A`` changes, so both factors are sent to every sampled client (the upload is ``B`` only).

Choices the paper leaves open, taken from the authors' code: ``A`` starts at PEFT's default init (Kaiming-uniform, not
orthonormal) and ``B`` at zero; the refactorisation runs every ``period`` rounds after ``warmup_rounds``
(``--recalculate-svd-period``, default 1, and ``--svd-warmup-steps``, default 0); the classifier head, when the model
has one, is averaged as FedAvg (the authors freeze it). The SVD is computed from QR factors of ``B̄`` and ``Aᵀ``
(:func:`fedllm.models.lowrank.orthogonal_refactor`), which gives the same triplets as the authors' dense SVD up to
signs without forming the ``out × in`` product.

Privacy: ``B``'s upload is the sent ``B`` plus the client's change and the SVD is post-processing of their (noised)
mean, so client-level DP applies as for FFA-LoRA, and DP-SGD (the paper's setting) clips and noises ``B`` only.

Compressed download (``federation.compression.download``): the clients receive ``Q(A + e_s)`` and train ``B``
against it, so the server keeps that dequantised ``A`` (:meth:`fedllm.strategies.base.Strategy.received`) and
refactorises ``svd(B̄·A_s)``: the product is exactly the mean of the clients' products, as without compression.
The residuals of ``A`` (adopted, then refactorised) and, in a refactorising round, of ``B`` (a new basis) are dropped.

DoRA (``lora.use_dora``, Liu et al. 2024, Eq. 5): a layer computes ``m ⊙ V / ‖V‖_c``, ``V = W + s·B·A``. The clients
train ``B`` and the magnitude ``m`` (A frozen), the server averages both (``m`` as any trainable tensor). The
refactorisation replaces ``(B̄, A)`` by factors of the same product ``B̄·A`` (to the rounding of ``comm_dtype``), so
``V``, its column norm and the layer ``m̄ ⊙ V / ‖V‖_c`` are the same before and after it: ``m`` is well defined
through the SVD and keeps its meaning (the norm of each output row's direction, not of a factor). DoRA under DP-SGD
is refused at recipe load (opacus has no per-example gradient of PEFT's magnitude module); client-level DP applies.
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.lowrank import orthogonal_refactor
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase
from fedllm.strategies.ffa_lora import FFALoRA, is_lora_a
from fedllm.strategies.residual import adapter_layers, drop_moments, to_wire


@register_strategy("fedsvd")
class FedSVD(FFALoRA):
    """FedSVD: ``B̄ = Σ_k p_k B_k``; ``U,S,Vh = svd(B̄·A)``; ``A ← Vh[:r]``, ``B ← U[:, :r]·diag(S[:r])``.

    Args:
        weighting: ``examples`` or ``uniform``, as FedAvg.
        period: refactorise every ``period`` rounds (the authors' default 1: every round).
        warmup_rounds: no refactorisation in rounds ``1..warmup_rounds`` (plain FFA-LoRA there; default 0).
    """

    name = "fedsvd"
    client_batching = False  # the plan names the keys that train (A is loaded but frozen)
    aggregates_by_sum = True  # the SVD is a function of the weighted mean of B

    def __init__(self, weighting: str = "examples", period: int = 1, warmup_rounds: int = 0, **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.period, self.warmup_rounds = period, warmup_rounds

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        if isinstance(args.get("period", 1), int) and args.get("period", 1) < 1:
            problems.append(("period", args["period"], "an integer >= 1 (refactorise every `period` rounds)"))
        if isinstance(args.get("warmup_rounds", 0), int) and args.get("warmup_rounds", 0) < 0:
            problems.append(("warmup_rounds", args["warmup_rounds"], "an integer >= 0"))
        for key in ("period", "warmup_rounds"):
            if isinstance(args.get(key), float):
                problems.append((key, args[key], "an integer"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)

    def refactorises(self, rnd: int) -> bool:
        """Whether the server refactorises ``B̄·A`` after round ``rnd``."""
        return rnd > self.warmup_rounds and rnd % self.period == 0

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        trained = [k for k in global_state if not is_lora_a(k)]
        return ClientPlan(client_id=client_id, rnd=rnd, state=global_state, phases=[Phase(keys=trained)])

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        return {k: trained[k] for k in plan.state if not is_lora_a(k)}

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """``B``'s kept moments refer to the basis of an ``A`` that the server has replaced since: dropped."""
        return drop_moments(state, [layer.b_key for layer in self.layers.values()])

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        out = super().aggregate(rnd, global_state, updates)
        if self.downloaded:  # compressed download: the clients trained B against the dequantised A (module docstring)
            received = self.received(global_state)
            out.update({layer.a_key: received[layer.a_key] for layer in self.layers.values()})
        if self.refactorises(rnd):
            for layer in self.layers.values():
                b, a = orthogonal_refactor(out[layer.b_key], out[layer.a_key])
                # kept as every client receives them (rounded through federation.comm_dtype)
                out[layer.b_key] = to_wire(b, self.comm_dtype, out[layer.b_key])
                out[layer.a_key] = to_wire(a, self.comm_dtype, out[layer.a_key])
        return out

    def reinitialised_at(self, rnd: int) -> list[str]:
        """``A`` (the clients' own, or refactorised) and, when refactorised, ``B`` (a new basis): their download
        residuals refer to values the server no longer holds."""
        keys = [layer.a_key for layer in self.layers.values()]
        return keys + ([layer.b_key for layer in self.layers.values()] if self.refactorises(rnd) else [])
