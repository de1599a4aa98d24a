"""FedEx-LoRA: exact aggregation of LoRA by a residual in the frozen weight (Singhal et al., ACL 2025).

FedAvg of ``A`` and ``B`` gives ``s·B̄Ā``, not the mean of the clients' updates ``Σ_k p_k·s·B_k A_k``. FedEx-LoRA
adds the difference to the frozen base weight of every client every round,
``W ← W + Σ_k p_k·s·B_k A_k − s·B̄Ā``, and all clients continue from ``(B̄, Ā)``, so the effective weight
``W + s·B̄Ā`` is exactly the mean of the clients' effective weights.

The residual is computed with the factors as every client receives them (rounded through
``federation.comm_dtype``) and reaches the base through :class:`fedllm.strategies.residual.BaseUpdates`:
in place in fp32 for an fp32 base, or kept as an fp32 dense residual beside a 4/8-bit or half-precision base.
Bytes: every client receives the residual each round, as the cheaper of the dense ``out × in`` matrix and
its factors ``[p_1 B_1 … p_K B_K, −B̄]·[A_1; …; A_K; Ā]`` (rank ``(K+1)·r``).

Compressed download (``federation.compression.download: nf4 | fp4``): the clients of the next round continue from
the dequantised download ``(B̃, Ã) = (deq(q(B̄)), deq(q(Ā)))``, not from ``(B̄, Ā)``. §3's exactness (the model the
clients continue from is the mean of their updated models) then needs the residual taken against what they
receive: ``W ← W + Σ_k p_k·s·B_k A_k − s·B̃Ã``, so ``W + s·B̃Ã = W_prev + Σ_k p_k·s·B_k A_k``. bitsandbytes'
quantisation is deterministic, so the server computes ``(B̃, Ã)`` when it aggregates and keeps them as the global
factors: its own model is the one its clients continue from. The next download quantises them again with no
residual (:meth:`FedExLoRA.reinitialised_at`: the quantisation error is already in the base, nothing is left to
send later), and nf4 and fp4 send a dequantised tensor unchanged (each block's absmax is a code of ±1), so the
clients receive exactly ``(B̃, Ã)``. The classifier head and DoRA's magnitude travel as with FedAvg (error
feedback). ``int8`` is refused (:data:`fedllm.recipe.compression_checks.DOWNLOAD_KIND_REFUSED`): its dynamic code
runs from −0.993 to 1, so a dequantised block is not sent unchanged.
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import DTYPES, StateDict
from fedllm.runs.base_history import LowRankMerge
from fedllm.strategies.base import ClientInfo, ClientUpdate
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import (
    RESIDUAL_MODES,
    BaseUpdates,
    MergesIntoBase,
    adapter_layers,
    recipe_value,
    resolve_residual_mode,
    to_wire,
)


@register_strategy("fedex_lora")
class FedExLoRA(MergesIntoBase, FedAvg):
    """FedEx-LoRA (Singhal et al., ACL 2025): ``(B̄, Ā) = Σ_k p_k (B_k, A_k)``; ``W ← W + Σ_k p_k·s·B_k A_k − s·B̄Ā``.

    Args:
        weighting: ``examples`` (``p_k = n_k / n``) or ``uniform`` (the paper's equal-size clients).
        residual: how the residual reaches the base: ``auto``, ``merge`` (in place) or ``dense`` (fp32 beside it).
    """

    name = "fedex_lora"
    aggregates_by_sum = False
    needs_individual_updates = "adds Σ_k p_k·s·B_k·A_k to the base: the products of each client's own factors, not a sum of uploads"

    def __init__(self, weighting: str = "examples", residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.residual = residual

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        if args.get("residual", "auto") not in RESIDUAL_MODES:
            problems.append(("residual", args["residual"], f"one of {', '.join(RESIDUAL_MODES)}"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.base = BaseUpdates(self.layers, resolve_residual_mode(self.residual, self.layers))
        self.modifies_base = self.base.modifies_base
        self.clients_last_round = 0

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        out = super().aggregate(rnd, global_state, updates)
        weights = self.weights(updates)
        total = sum(weights)
        wire = DTYPES[self.comm_dtype]
        received = self._next_download(out)
        for name, layer in self.layers.items():
            if received is not None:  # what the next round's clients receive under a compressed download
                b_bar, a_bar = received[layer.b_key], received[layer.a_key]
            else:  # what every client receives
                b_bar = to_wire(out[layer.b_key], self.comm_dtype, out[layer.b_key])
                a_bar = to_wire(out[layer.a_key], self.comm_dtype, out[layer.a_key])
            terms = [(u.state[layer.b_key].to(wire), u.state[layer.a_key].to(wire), layer.scale * w / total)
                     for u, w in zip(updates, weights, strict=True)]
            self.base.add(name, LowRankMerge(terms + [(b_bar, a_bar, -layer.scale)]), rnd)
            out[layer.b_key], out[layer.a_key] = b_bar, a_bar
        self.clients_last_round = len(updates)
        return out

    def _compressed_download(self):
        """``federation.compression`` when the download is compressed, else None."""
        c = recipe_value(self.recipe, "federation.compression", None)
        return c if c is not None and c.download != "none" else None

    def _next_download(self, averaged: StateDict) -> StateDict | None:
        """``{key: deq(q(x))}`` of the averaged factors, the next round's download of them (bitsandbytes, no residual:
        :meth:`reinitialised_at`), or None when the download is not compressed."""
        c = self._compressed_download()
        if c is None:
            return None
        from fedllm.models.compression import compress_state

        factors = {k: averaged[k] for layer in self.layers.values() for k in (layer.b_key, layer.a_key)}
        return compress_state(factors, {}, {}, c.download, c.block_size, False)[0]

    def reinitialised_at(self, rnd: int) -> list[str]:
        """Under a compressed download the factors are replaced by their dequantised download, whose quantisation
        error the residual already put into the base: their download residual is dropped (carried, it would make the
        next download differ from the ``(B̃, Ã)`` the base was corrected for, and send that error a second time)."""
        if self._compressed_download() is None:
            return []
        return [k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)]

    def extra_download_bytes(self, rnd: int, sampled: list[int], num_clients: int, comm_dtype: str) -> dict[int, int]:
        """Every client receives the round's residual (dense or as factors, whichever is smaller): the factors of the
        clients aggregated, or, before any round (the dry run's forecast), of every sampled client."""
        k = self.clients_last_round or len(sampled)
        numel = sum(min(layer.shape[0] * layer.shape[1], (k + 1) * layer.rank * (layer.shape[0] + layer.shape[1]))
                    for layer in self.layers.values())
        return {c: numel * DTYPES[comm_dtype].itemsize for c in range(num_clients)}
