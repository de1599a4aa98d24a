"""Pairwise preference losses (DPO and its family) on a batch of chosen/rejected sequences.

A preference batch (:func:`fedllm.data.collate.collate` of preference examples) holds ``2B`` rows, the ``B``
chosen sequences first, with ``-100`` labels on the prompt. :func:`sequence_logps` sums each row's log-
probabilities of its answer tokens (the LM head only at those positions, as :mod:`fedllm.models.supervised_loss`);
the losses of :data:`PREFERENCE_LOSSES` turn the policy's and the reference's sums into a loss per pair and the
implicit rewards, each as trl 1.16 computes it (``trl/trainer/dpo_trainer.py`` ``_compute_loss``: sigmoid,
hinge, ipo, robust; ``trl/experimental/cpo/cpo_trainer.py`` ``cpo_loss`` with ``cpo_alpha=0``: simpo), which
``tests/training/test_preference_losses.py`` checks loss, rewards and gradients against.

Notation: ``Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))``, ``β`` = ``train.preference.beta``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedllm.data.tokens import IGNORE_INDEX
from fedllm.models.supervised_loss import supervised_hidden, supports_supervised_positions, token_losses


@dataclass
class PairLogps:
    """Sums of answer-token log-probabilities (``2B``: chosen rows, then rejected) and answer lengths."""

    logps: torch.Tensor
    lengths: torch.Tensor

    def halves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(chosen, rejected, chosen lengths, rejected lengths)``."""
        c, r = self.logps.chunk(2)
        lc, lr = self.lengths.chunk(2)
        return c, r, lc, lr


@dataclass
class PairLoss:
    """The batch's loss (mean over pairs) and each pair's implicit rewards (detached)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _gathered_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden, targets, rows = supervised_hidden(model, batch)
    per_token = -token_losses(model, hidden, targets, widen=True)  # log_softmax[target], fused where the head is
    out = torch.zeros(batch["labels"].shape[0], dtype=per_token.dtype, device=per_token.device)
    return out.index_add(0, rows, per_token)


def _all_position_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    logp = torch.log_softmax(_at_least_fp32(logits[:, :-1]), dim=-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (logp * keep).sum(-1)


def sequence_logps(model: Any, batch: dict[str, torch.Tensor], positions: str = "supervised") -> PairLogps:
    """Each row's summed log-probability of its supervised tokens (fp32, or the model's dtype if wider) and their
    number.

    Args:
        model: A (PEFT-wrapped) causal LM.
        batch: ``input_ids``, ``attention_mask``, ``labels`` (``-100``: no loss).
        positions: ``supervised`` runs the LM head only at the answer positions (where the model type is
            registered), ``all`` at every position (``train.loss_positions``).
    """
    if positions == "supervised" and supports_supervised_positions(model):
        logps = _gathered_logps(model, batch)
    else:
        logps = _all_position_logps(model, batch)
    return PairLogps(logps, answer_lengths(batch))


def answer_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's number of supervised (answer) tokens."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1)


@contextlib.contextmanager
def adapter_disabled(model: Any):
    """The base model without its adapter (PEFT's ``disable_adapter``), no gradient."""
    with torch.no_grad(), model.disable_adapter():
        yield


def reference_logps(model: Any, batch: dict[str, torch.Tensor], positions: str = "supervised") -> torch.Tensor:
    """The reference's ``2B`` sums: ``ref_logps`` when the batch carries them (precomputed), else the base with the
    adapter disabled."""
    if "ref_logps" in batch:
        return batch["ref_logps"]
    with adapter_disabled(model):
        return sequence_logps(model, batch, positions).logps


# --------------------------------------------------------------------------- losses

LossFn = Callable[[PairLogps, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _ratios(policy: PairLogps, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, r, _, _ = policy.halves()
    rc, rr = ref.to(c.dtype).chunk(2)
    return c - rc, r - rr


def sigmoid_loss(policy: PairLogps, ref: torch.Tensor, cfg: Any):
    """DPO (Rafailov et al. 2023): ``−log σ(β Δ)``."""
    chosen, rejected = _ratios(policy, ref)
    return -F.logsigmoid(cfg.beta * (chosen - rejected)), cfg.beta * chosen, cfg.beta * rejected


def hinge_loss(policy: PairLogps, ref: torch.Tensor, cfg: Any):
    """SLiC-style hinge (Zhao et al. 2023): ``relu(1 − β Δ)``."""
    chosen, rejected = _ratios(policy, ref)
    return torch.relu(1 - cfg.beta * (chosen - rejected)), cfg.beta * chosen, cfg.beta * rejected


def ipo_loss(policy: PairLogps, ref: torch.Tensor, cfg: Any):
    """IPO (Azar et al. 2023) on length-normalised log-ratios: ``(Δ_c/|y_w| − Δ_r/|y_l| − 1/(2β))²``."""
    chosen, rejected = _ratios(policy, ref)
    _, _, lc, lr = policy.halves()
    delta = chosen / lc.clamp(min=1) - rejected / lr.clamp(min=1)
    return (delta - 1 / (2 * cfg.beta)) ** 2, cfg.beta * chosen, cfg.beta * rejected


def robust_loss(policy: PairLogps, ref: torch.Tensor, cfg: Any):
    """Robust DPO (Chowdhury et al. 2024), labels flipped with probability ε = ``label_smoothing``:
    ``(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)``."""
    chosen, rejected = _ratios(policy, ref)
    z, eps = cfg.beta * (chosen - rejected), cfg.label_smoothing
    loss = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    return loss, cfg.beta * chosen, cfg.beta * rejected


def simpo_loss(policy: PairLogps, ref: torch.Tensor, cfg: Any):
    """SimPO (Meng et al. 2024), reference-free: ``−log σ(β (log π(y_w)/|y_w| − log π(y_l)/|y_l|) − γ)``, smoothed
    by ε = ``label_smoothing`` (trl's CPO form)."""
    c, r, lc, lr = policy.halves()
    c, r = c / lc.clamp(min=1), r / lr.clamp(min=1)
    z = cfg.beta * (c - r - cfg.gamma / cfg.beta)
    eps = cfg.label_smoothing
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps, cfg.beta * c, cfg.beta * r


#: ``train.preference.loss`` -> ``(loss per pair, chosen rewards, rejected rewards)``.
PREFERENCE_LOSSES: dict[str, LossFn] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "robust": robust_loss,
    "simpo": simpo_loss,
}
#: Losses that use no reference model.
REFERENCE_FREE = frozenset({"simpo"})


def needs_reference(cfg: Any) -> bool:
    """Whether ``train.preference`` needs reference log-probabilities."""
    return cfg.loss not in REFERENCE_FREE


def pair_losses(model: Any, batch: dict[str, torch.Tensor], cfg: Any,
                positions: str = "supervised") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss of each pair, chosen rewards, rejected rewards)`` of ``train.preference`` (``cfg``) on a collated
    preference batch (``B`` each): :func:`pair_loss`'s terms, one per pair (DP-SGD clips each pair's gradient)."""
    policy = sequence_logps(model, batch, positions)
    ref = reference_logps(model, batch, positions) if needs_reference(cfg) else torch.zeros_like(policy.logps)
    return PREFERENCE_LOSSES[cfg.loss](policy, ref.detach(), cfg)


def pair_loss(model: Any, batch: dict[str, torch.Tensor], cfg: Any, positions: str = "supervised") -> PairLoss:
    """The preference loss of ``train.preference`` (``cfg``) on a collated preference batch.

    Args:
        model: The PEFT-wrapped policy.
        batch: ``2B`` rows (chosen first), optionally ``ref_logps``.
        cfg: ``loss``, ``beta``, ``label_smoothing``, ``gamma``.
        positions: ``train.loss_positions``.
    """
    losses, chosen, rejected = pair_losses(model, batch, cfg, positions)
    return PairLoss(losses.mean(), chosen.detach(), rejected.detach())
