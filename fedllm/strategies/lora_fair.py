"""LoRA-FAIR: server-side refinement of the averaged ``B`` (Bian et al., ICCV 2025).

"LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation and Initialization Refinement" (arXiv 2411.14961),
§4. FedAvg of the factors gives ``B̄Ā``, not the ideal update ``ΔW = Σ_k p_k B_k A_k`` (aggregation bias); a
fresh re-init each round (FLoRA) throws the averaged factors away (initialization lag). LoRA-FAIR keeps ``Ā``
and adds a residual ``ΔB`` to ``B̄`` found on the server per layer by (Eq. 8)

    ΔB = argmin_ΔB  S(ΔW, (B̄ + ΔB)Ā) + λ·||ΔB||_F,

with ``S`` the cosine dissimilarity ``1 − cos`` of the two matrices flattened (the paper names the cosine
similarity as its metric: it is maximised, i.e. ``1 − cos`` minimised) and ``λ`` small (0.01, the paper's value):
the first term aligns the product with the ideal update, the second keeps ``B̄ + ΔB`` close to ``B̄`` so the next
round starts from the averaged factors ("Avg-Initial"). Every client starts the next round from
``(B̄ + ΔB, Ā)``; the base weights are never changed.

Solver: the paper solves Eq. 8 with SGD on the server without giving steps or a step size. Here:
``refine_steps`` plain gradient steps (``torch.optim.SGD``, no momentum) from ``ΔB = 0``, in float64, per layer.
The cosine term is scale-free, so its gradient in ``ΔB`` scales as ``||Ā||/||(B̄+ΔB)Ā||`` and a fixed step would
overshoot small adapters and stall on large ones; the step is therefore ``refine_lr · ||B̄Ā||²_F / ||Ā||²_F``
(``refine_lr`` dimensionless; 0.3 with 50 steps converges on this toolkit's tiny and small tasks). The
``s = alpha / r`` scaling cancels in the cosine. Bytes are FedAvg's: the refined factors travel in place of the averaged ones.

DoRA (``lora.use_dora``, Liu et al. 2024, Eq. 5): a layer computes ``m ⊙ V / ‖V‖_c`` with ``V = W + s·B·A``. Client
``k``'s direction is ``W + s·B_k A_k``, so the ideal direction is ``W + ΔW`` with Eq. 8's ``ΔW`` unchanged, and ``ΔB``
is solved as without DoRA; the magnitude ``m`` is averaged with the example weights as any trainable tensor. PEFT
takes the column norm of the current factors, i.e. of the *refined* ``V = W + s·(B̄ + ΔB)·Ā``: the global layer is
``m̄ ⊙ V / ‖V‖_c`` of the direction the clients continue from.
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientUpdate
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import adapter_layers


def refine_b(bs: list[torch.Tensor], as_: list[torch.Tensor], p: list[float], b_bar: torch.Tensor,
             a_bar: torch.Tensor, lam: float, steps: int, lr: float) -> torch.Tensor:
    """``ΔB`` after ``steps`` SGD steps on ``1 − cos(W, (B̄ + ΔB)Ā) + lam·||ΔB||_F`` from ``ΔB = 0``, with
    ``W = Σ_k p_k B_k A_k`` (LoRA-FAIR Eq. 8), each step of size ``lr · ||B̄Ā||²_F / ||Ā||²_F`` (see the module).

    Float64, and no ``out × in`` matrix is formed: with ``B' = B̄ + ΔB``, ``<W, B'Ā> = <B', M>`` for
    ``M = Σ_k p_k B_k (A_k Āᵀ)``, ``||B'Ā||² = <B'ᵀB', ĀĀᵀ>`` and ``||W||² = Σ_kl p_k p_l <B_kᵀB_l, A_k A_lᵀ>``, so a
    step costs ``O((out + in)·r²)``. Returns zeros when ``W`` or ``B̄Ā`` is zero (no direction to align).
    """
    bs, as_ = [b.double() for b in bs], [a.double() for a in as_]
    b_bar, a_bar = b_bar.double(), a_bar.double()
    gram_a = a_bar @ a_bar.mT
    m = sum(pk * b @ (a @ a_bar.mT) for pk, b, a in zip(p, bs, as_, strict=True))
    w_sq = sum(pk * pl * ((bk.mT @ bl) * (ak @ al.mT)).sum()
               for pk, bk, ak in zip(p, bs, as_, strict=True) for pl, bl, al in zip(p, bs, as_, strict=True))
    x_sq = ((b_bar.mT @ b_bar) * gram_a).sum()
    delta = torch.zeros_like(b_bar)
    if steps == 0 or w_sq <= 0 or x_sq <= 0:
        return delta
    w_norm = torch.sqrt(w_sq)
    delta.requires_grad_(True)
    opt = torch.optim.SGD([delta], lr=lr * float(x_sq / torch.trace(gram_a)))
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            b = b_bar + delta
            cosine = (b * m).sum() / (w_norm * torch.sqrt(((b.mT @ b) * gram_a).sum()))
            loss = 1.0 - cosine + lam * torch.linalg.vector_norm(delta)
            loss.backward()
            opt.step()
    return delta.detach()


@register_strategy("lora_fair")
class LoRAFAIR(FedAvg):
    """LoRA-FAIR (Bian et al., ICCV 2025): ``(B̄, Ā) = Σ_k p_k (B_k, A_k)``; clients continue from ``(B̄ + ΔB, Ā)`` with ``ΔB`` of Eq. 8.

    Args:
        weighting: ``examples`` (``p_k = n_k / n``) or ``uniform``.
        lam: ``λ``, the weight of ``||ΔB||_F`` (the paper's 0.01).
        refine_steps: gradient steps of the server's solve of Eq. 8 (0: FedAvg).
        refine_lr: their step size, in units of ``||B̄Ā||²_F / ||Ā||²_F``.
    """

    name = "lora_fair"
    aggregates_by_sum = False
    needs_individual_updates = "refines B̄ toward Σ_k p_k·B_k·A_k, the mean of each client's own product"

    def __init__(self, weighting: str = "examples", lam: float = 0.01, refine_steps: int = 50,
                 refine_lr: float = 0.3, **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.lam, self.refine_steps, self.refine_lr = float(lam), int(refine_steps), float(refine_lr)

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        for key, ok, expected in (("lam", lambda v: v >= 0, "a number >= 0"),
                                  ("refine_steps", lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0"),
                                  ("refine_lr", lambda v: v > 0, "a number > 0")):
            value = args.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
                problems.append((key, value, expected))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        out = super().aggregate(rnd, global_state, updates)
        weights = self.weights(updates)
        total = sum(weights)
        p = [w / total for w in weights]
        for layer in self.layers.values():
            b_bar = out[layer.b_key]
            delta = refine_b([u.state[layer.b_key] for u in updates], [u.state[layer.a_key] for u in updates], p,
                             b_bar, out[layer.a_key], self.lam, self.refine_steps, self.refine_lr)
            out[layer.b_key] = (b_bar.double() + delta).to(b_bar.dtype)
        return out
