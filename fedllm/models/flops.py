"""Model FLOPs of LoRA training, from the model's shapes: the numerator of MFU.

A training micro-batch of ``b`` rows padded to ``S`` positions costs, counting each matmul multiply-add as 2
FLOPs (the convention of Kaplan et al. 2020 §2.1 and of PaLM's MFU, Chowdhery et al. 2022 App. B):

- frozen linear layers: forward ``2·P·T`` and input gradient ``2·P·T`` (no weight gradient), ``T = b·S``, except
  that layer 0's q/k/v projections read the frozen embeddings and need no input gradient;
- LoRA factors (rank ``r``): forward, input gradient and weight gradient, ``6·r·(in + out)·T`` (layer 0's q/k/v
  A factors: no input gradient);
- attention scores and values: ``4·b·S²·d_q`` forward and twice that backward per layer (the full square, as a
  dense kernel computes it: no causal halving, no recomputation); in layer 0 only the gradients that reach a LoRA
  factor are computed, ``2·b·S²·d_q`` each: of the scores (when q or k is wrapped), of q, of k and of v;
- the LM head: forward and input gradient, ``4·V·h`` per position where it runs (the supervised positions under
  ``train.loss_positions: supervised``, every position otherwise);
- ``residual``: FRLoRA on a bf16 or 4-bit base adds a dense fp32 residual per target layer
  (``fedllm/strategies/residual.py``): one more frozen ``out x in`` product per target layer.

Padded positions are computed like real ones, so they are counted: MFU measures the hardware's use. The formula
is linear in the micro-batch's ``b·S``, ``b·S²`` and head positions, so a run's FLOPs follow from those three
sums (:class:`TrainedWork`). ``tests/training/test_throughput.py`` checks it against hand-computed values and
against ``torch.utils.flop_counter`` on a real model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

#: q/k/v projections: in layer 0 they read the frozen embeddings (no input gradient).
FIRST_INPUTS = ("q_proj", "k_proj", "v_proj", "query", "key", "value")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class FlopShapes:
    """What the FLOP formula reads from a model config and the LoRA targets (sums over one decoder layer)."""

    layers: int
    hidden: int
    vocab: int  # 0 for a classifier (its head is negligible)
    q_dim: int
    linear: int  # weights of one layer's linear layers
    lora: int  # r·(in + out) summed over one layer's LoRA-wrapped linear layers
    first_in: int  # layer 0's q/k/v weights (no input gradient there)
    first_lora_in: int  # r·in of layer 0's wrapped q/k/v (their A factors' input gradient is not needed)
    target: int  # weights of one layer's wrapped linear layers (FRLoRA's dense residual)
    first_target_in: int
    first_attention_grads: int = 4  # of dScores, dQ, dK, dV, those layer 0 computes (each 2·b·S²·d_q)
    weights: tuple[tuple[int, int], ...] = ()  # (out, in) of one layer's linear layers (the probe's shapes)

    @classmethod
    def of(cls, config: dict[str, Any], r: int, targets: list[str] | None,
           causal_lm: bool = True) -> FlopShapes | None:
        """The shapes of ``config`` (a transformers config as a dict) with LoRA rank ``r`` on ``targets`` (None:
        the family's attention projections); None for a model type whose layers fedllm does not know."""
        from fedllm.models.info import layer_shapes, target_shapes

        shapes = layer_shapes(config)  # layer 0's linear layers: name -> (out, in)
        if not shapes:
            return None
        wrapped = target_shapes(config, targets)
        first = {n for n in shapes if n.rsplit(".", 1)[-1] in FIRST_INPUTS}
        q, k, v = (any(n.rsplit(".", 1)[-1] in names for n in wrapped) for names in
                   (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")))
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"], hidden=hidden, vocab=config["vocab_size"] if causal_lm else 0,
            q_dim=heads * (config.get("head_dim") or hidden // heads),
            linear=sum(o * i for o, i in shapes.values()),
            lora=sum(r * (o + i) for o, i in wrapped.values()),
            first_in=sum(o * i for n, (o, i) in shapes.items() if n in first),
            first_lora_in=sum(r * i for n, (o, i) in wrapped.items() if n in first),
            target=sum(o * i for o, i in wrapped.values()),
            first_target_in=sum(o * i for n, (o, i) in wrapped.items() if n in first),
            first_attention_grads=int(q or k) + int(q) + int(k) + int(v),
            weights=tuple(sorted(set(shapes.values()))))

    def flops(self, positions: float, square: float, head: float, residual: bool = False) -> float:
        """FLOPs of micro-batches holding ``positions`` = Σ b·S, ``square`` = Σ b·S² and ``head`` LM-head positions."""
        dense = self.layers * (4 * self.linear + 6 * self.lora) - 2 * self.first_in - 2 * self.first_lora_in
        if residual:
            dense += self.layers * 4 * self.target - 2 * self.first_target_in
        attention = (self.layers * 12 - 2 * (4 - self.first_attention_grads)) * self.q_dim
        return float(dense * positions + attention * square + 4 * self.vocab * self.hidden * head)


def step_flops(s: FlopShapes, batch: int, length: int, supervised: int, residual: bool = False) -> float:
    """FLOPs of one ``batch x length`` micro-batch whose LM head runs at ``supervised`` positions."""
    return s.flops(batch * length, batch * length * length, supervised, residual)


@dataclass
class TrainedWork:
    """What a client's micro-batches held and how long training them took (sums; a plain dict on the wire)."""

    micro_batches: int = 0
    positions: int = 0  # Σ b·S: every computed position, padding included
    square: int = 0  # Σ b·S² (attention)
    tokens: int = 0  # real (non-padding) positions
    supervised: int = 0  # positions whose next token carries a loss
    head: int = 0  # positions where the LM head runs
    seconds: float = 0.0  # wall seconds of the client's training loop
    cpu_seconds: float = 0.0  # CPU seconds of this process over the same time (every thread)

    def add_batch(self, batch: dict[str, Any], head_everywhere: bool, tokens: int | None = None) -> None:
        """Count one collated micro-batch (``input_ids``, ``attention_mask``, ``labels``; on the CPU); ``tokens``: its
        real positions where it has no ``attention_mask`` to count them by (a packed batch's padded row ends)."""
        ids = batch["input_ids"]
        b, s = int(ids.shape[0]), int(ids.shape[1])
        labels = batch.get("labels")
        self.micro_batches += 1
        self.positions += b * s
        self.square += b * s * s
        mask = batch.get("attention_mask")
        self.tokens += tokens if tokens is not None else int(mask.sum()) if mask is not None else b * s
        if labels is not None and labels.dim() == 2:
            supervised = int((labels[:, 1:] != IGNORE_INDEX).sum())
            self.supervised += supervised
            self.head += b * s if head_everywhere else supervised
        else:  # a classifier: one label per row
            self.supervised += b

    def merge(self, other: TrainedWork) -> TrainedWork:
        return TrainedWork(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TrainedWork:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})

    def flops(self, shapes: FlopShapes, residual: bool = False) -> float:
        return shapes.flops(self.positions, self.square, self.head, residual)
