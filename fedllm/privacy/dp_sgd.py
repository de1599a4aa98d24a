"""Sample-level DP-SGD on each client with opacus (Abadi et al. 2016), ``privacy.mechanism: dp_sgd``.

Each local step draws a Poisson batch (every example of the client independently with probability
``q = batch_size / n_i``), computes per-example gradients of the trainable (LoRA) tensors with opacus's
``GradSampleModule``, clips each to ``privacy.clipping_norm`` and adds ``N(0, (z·C)²)`` with opacus's
``DPOptimizer`` before the usual optimizer step (empty batches still take a noise-only step). The loss is a sum
of per-example losses (per-token mean within an example), so one example's presence cannot rescale another's
gradient. Everything the client uploads is post-processing of these steps: client ``i``'s examples are
``(ε_i, δ)``-DP with ε_i from opacus's RDP accountant over the steps behind every upload the server received —
aggregated or dropped by the norm screen, in a retried sample too (``client_epsilon`` in ``metrics.jsonl``;
``epsilon`` is the largest). The client's training loss is not uploaded (no noise protects it). ``privacy.target_epsilon`` picks ``z`` so that a client that
trains every planned round stays within it. The noise and the Poisson draws are ChaCha20 streams
(:mod:`fedllm.privacy.secret_streams`) keyed by a fresh 256-bit secret per client and round, drawn from the operating
system on the node that trains it and never sent; ``privacy.noise_seed`` derives them from the seed, the round and
the client instead (experiments). opacus's optimizer computes the clipping and the step; its noise draw (a seeded
``torch.Generator``, or torchcsprng under opacus's ``secure_mode``, which fedllm does not use) is replaced by the
ChaCha20 Gaussians (:func:`chacha_noise`).

``privacy.grad_sample_mode`` picks how opacus clips (its ``grad_sample_mode``): ``hooks`` (the default) builds every
example's gradient of every trainable tensor (``GradSampleModule``) and ``DPOptimizer`` clips them; ``ghost``
(Li et al. 2022, "Large Language Models Can Be Strong Differentially Private Learners"; Lee & Kifer 2021) computes
only each example's gradient *norm* (``GradSampleModuleFastGradientClipping``: ghost norms for ``nn.Linear`` and
``nn.Embedding``, per-example gradients for other trainable layers — :func:`ghost_fallback_layers`), then a
second backward pass of ``Σ_i c_i·loss_i`` with the clipping factors ``c_i`` gives the clipped sum
(``DPTensorFastGradientClipping``), and ``DPOptimizerFastGradientClipping`` adds the same noise. Both give the same
step (up to float rounding) and the same ε.

Under ``train.objective: dpo`` an example is a preference *pair* (:mod:`fedllm.models.preference_loss`): its loss
couples its chosen and rejected sequences, which a collated batch holds as two rows (``2B``: the chosen rows, then
the rejected). opacus builds one gradient per row of the batch's summed per-pair losses; a row's forward touches
no other row, so pair ``i``'s gradient is exactly the sum of rows ``i`` and ``B + i`` (:class:`PerPairSum` folds
them after the backward pass), and :class:`DPOptimizer` then clips each *pair's* gradient to ``C``, sums, adds
``N(0, (z·C)²)`` and divides by the expected number of pairs. The Poisson draws and the accountant count pairs
(``q = batch_size / pairs of the client``). Ghost clipping takes per-row norms without the gradients, and a pair's
norm needs the inner product of its two rows' gradients: it is refused with DPO at recipe load.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fedllm.common.errors import InputError
from fedllm.data.collate import is_pair_batch
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.models.state import StateDict
from fedllm.privacy import accounting, secret_streams
from fedllm.recipe.schedule import steps_per_round
from fedllm.strategies.base import ClientInfo, ClientPlan

STEPS_KEY = "privacy/dp_sgd_steps"

log = logging.getLogger("fedllm")


class PoissonStream:
    """Each call: every one of the client's examples independently with probability ``rate`` (may be empty), the
    coins of draw ``j`` from the stream keyed by ``key(j)``."""

    def __init__(self, indices, rate: float, key: Callable[[int], bytes]):
        self.indices, self.rate, self.key = list(indices), rate, key
        self.draws = itertools.count()

    def next(self) -> list[int]:
        keep = secret_streams.bernoulli(self.key(next(self.draws)), len(self.indices), self.rate)
        return [i for i, k in zip(self.indices, keep.tolist(), strict=True) if k]


def chacha_noise(optimizer_class: type) -> type:
    """opacus's DP optimizer ``optimizer_class`` whose ``add_noise`` draws each step's Gaussian noise (std
    ``noise_multiplier × max_grad_norm``, opacus's, or its ``_adjusted_noise_multiplier``) from the ChaCha20 stream
    of ``noise_key(step, parameter index)`` (set on the instance) instead of a ``torch.Generator``; the rest (the
    processed-flag checks, ``p.grad = summed_grad + noise``) as opacus 1.6's ``DPOptimizer.add_noise``."""
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class ChaChaNoise(optimizer_class):
        noise_key: Callable[[int, int], bytes]

        def add_noise(self) -> None:
            std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
            step = self.noise_steps = getattr(self, "noise_steps", -1) + 1
            for i, p in enumerate(self.params):
                _check_processed_flag(p.summed_grad)
                noise = secret_streams.gaussian(self.noise_key(step, i), p.summed_grad.shape, std)
                p.grad = (p.summed_grad + noise.to(p.summed_grad)).view_as(p)
                _mark_as_processed(p.summed_grad)

    ChaChaNoise.__name__ = ChaChaNoise.__qualname__ = f"ChaChaNoise{optimizer_class.__name__}"
    return ChaChaNoise


def per_example_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One loss per example: cross-entropy of a classifier, or a causal LM's mean over the example's supervised
    tokens (0 for an example with none)."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    if labels.dim() == 1:
        return F.cross_entropy(logits, labels, reduction="none")
    shifted, targets = logits[:, :-1], labels[:, 1:]
    token = F.cross_entropy(shifted.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    counts = (targets != IGNORE_INDEX).sum(dim=1)
    return token.sum(dim=1) / counts.clamp(min=1)


def fold_pair_rows(params: list[torch.nn.Parameter], pairs: int) -> None:
    """Turn the per-row gradients opacus left from the last backward pass (``2B`` rows: chosen, then rejected) into
    per-pair ones: row ``i`` + row ``B + i``, the gradient of pair ``i``'s loss."""
    for p in params:
        samples = getattr(p, "grad_sample", None)
        if samples is None:
            continue
        last = samples[-1] if isinstance(samples, list) else samples
        if last.shape[0] != 2 * pairs:
            raise ValueError(f"per-example gradients of {last.shape[0]} rows for {pairs} preference pairs")
        folded = last[:pairs] + last[pairs:]
        if isinstance(samples, list):
            samples[-1] = folded
        else:
            p.grad_sample = folded


class PerPairSum:
    """The sum of a batch's per-pair preference losses, whose ``backward()`` leaves one per-example gradient per
    pair (:func:`fold_pair_rows`) for opacus's DP optimizer to clip; divisible like a tensor (``loss / grad_accum``),
    as opacus's ``DPTensorFastGradientClipping``."""

    def __init__(self, total: torch.Tensor, params: list[torch.nn.Parameter], pairs: int):
        self.total, self.params, self.pairs = total, params, pairs

    def __truediv__(self, other: float) -> PerPairSum:
        return PerPairSum(self.total / other, self.params, self.pairs)

    def detach(self) -> torch.Tensor:
        return self.total.detach()

    def backward(self) -> None:
        self.total.backward()
        fold_pair_rows(self.params, self.pairs)


class LocalDPSGD:
    """The client side of DP-SGD for one client and round (see the module docstring)."""

    def __init__(self, noise_multiplier: float, clipping_norm: float, batch_size: int, num_examples: int,
                 secret: bytes, grad_sample_mode: str = "hooks", preference: Any = None,
                 loss_positions: str = "supervised"):
        self.noise_multiplier, self.clipping_norm = noise_multiplier, clipping_norm
        self.preference, self.loss_positions = preference, loss_positions  # train.preference under DPO
        self.batch_size, self.rate = batch_size, min(1.0, batch_size / num_examples)
        self.secret = secret  # the client's and round's: every Poisson draw and noise draw is keyed by it
        self.phases = itertools.count()
        self.mode = grad_sample_mode
        self.wrapped: Any = None  # during a phase: opacus's grad-sample module and DP optimizer
        self.optimizer: Any = None

    def stream(self, indices) -> PoissonStream:
        return PoissonStream(indices, self.rate, lambda j: secret_streams.stream_key(self.secret, "dp-sgd-poisson", j))

    @contextlib.contextmanager
    def phase(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """opacus's hooks on ``model`` (per-example gradients, or their norms with ghost clipping) and its DP
        optimizer around ``optimizer`` for one training phase: the classes opacus's ``PrivacyEngine`` picks for
        ``grad_sample_mode``."""
        from opacus.grad_sample.utils import get_gsm_class
        from opacus.optimizers import get_optimizer_class

        ghost = {"max_grad_norm": self.clipping_norm} if self.mode == "ghost" else {}
        wrapped = get_gsm_class(self.mode)(model, batch_first=True, loss_reduction="sum", **ghost)
        phase = next(self.phases)
        dp_optimizer = chacha_noise(get_optimizer_class(clipping="flat", distributed=False,
                                                        grad_sample_mode=self.mode))
        try:
            self.wrapped = wrapped
            self.optimizer = dp_optimizer(optimizer, noise_multiplier=self.noise_multiplier,
                                          max_grad_norm=self.clipping_norm, expected_batch_size=self.batch_size,
                                          loss_reduction="mean")
            self.optimizer.noise_key = lambda step, i: secret_streams.stream_key(self.secret, "dp-sgd-noise", phase,
                                                                                 step, i)
            yield self.optimizer
        finally:
            self.wrapped = self.optimizer = None
            wrapped._close()

    def empty_batch(self, trainable: list[torch.nn.Parameter]) -> None:
        """No example drawn: per-example gradients of a batch of zero (hooks), or a clipped sum of zero (ghost):
        the step adds noise only."""
        for p in trainable:
            if self.mode == "ghost":
                p.grad = torch.zeros_like(p)
            else:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of per-example losses to backpropagate, their mean to report)``; with ghost clipping the sum is
        opacus's ``DPTensorFastGradientClipping``, whose ``backward()`` takes the norms' pass and the clipped one;
        with preference pairs (``train.objective: dpo``) the sum of per-pair losses, whose ``backward()`` leaves
        per-pair gradients (:class:`PerPairSum`)."""
        if is_pair_batch(batch):
            return self.pair_loss(model, batch)
        if self.mode != "ghost":
            losses = per_example_losses(model, batch)
            return losses.sum(), losses.detach().mean()
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        try:
            losses = per_example_losses(model, batch)
        except NotImplementedError as e:  # opacus: a ghost-clipped layer called twice in one pass (tied parameters)
            raise InputError(f"privacy.grad_sample_mode: got 'ghost'; expected hooks for this model: {e}") from e
        return (DPTensorFastGradientClipping(self.wrapped, self.optimizer, losses, loss_reduction="sum"),
                losses.detach().mean())

    def pair_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[PerPairSum, torch.Tensor]:
        """:meth:`loss` of a batch of preference pairs: each pair's loss of ``train.preference``."""
        from fedllm.models.preference_loss import pair_losses

        if self.preference is None:
            raise ValueError("preference pairs need train.objective: dpo (data.format: preference)")
        if self.mode == "ghost":  # refused at recipe load (fedllm.recipe.preference_checks)
            raise InputError("privacy.grad_sample_mode: got 'ghost'; expected hooks with train.objective: dpo (ghost "
                             "clipping takes each sequence's gradient norm, a pair's needs its two sequences' gradients)")
        losses, _, _ = pair_losses(model, batch, self.preference, self.loss_positions)
        return PerPairSum(losses.sum(), self.optimizer.params, losses.shape[0]), losses.detach().mean()


def unsupported_layers(model: torch.nn.Module) -> list[str]:
    """Trainable layers opacus cannot compute per-example gradients for (with buffers, e.g. batch norm)."""
    from opacus import GradSampleModule

    return [str(e) for e in GradSampleModule.validate(model, strict=False)]


def ghost_fallback_layers(model: torch.nn.Module) -> list[str]:
    """Trainable layers ghost clipping has no norm formula for (``name (type)``): opacus computes their per-example
    gradients to take the norms (its "fast gradient clipping"), as ``hooks`` does. A layer opacus has no
    per-example rule for at all is handled whole by functorch, its sub-layers with it."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as Ghost

    found: list[str] = []

    def visit(name: str, module: torch.nn.Module) -> None:
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            if type(module) not in Ghost.NORM_SAMPLERS:
                found.append(f"{name or '<model>'} ({type(module).__name__})")
            if type(module) not in Ghost.GRAD_SAMPLERS:
                return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return found


class SampleLevelDP:
    """Mixin before a strategy class: DP-SGD on every client, per-client ε on the server."""

    def bind_privacy(self, recipe: Any) -> None:
        self.pv = recipe.privacy
        self.noise_multiplier: float | None = self.pv.noise_multiplier
        self.client_steps: dict[int, int] = {}
        self.sizes: list[int] = []
        self.noise_secret: bytes | None = None if self.pv.noise_seed is None else \
            secret_streams.secret_of_seed(self.pv.noise_seed)

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        super().setup(model, clients)
        bad = unsupported_layers(model)
        if bad:
            raise InputError(f"{self.recipe.source}: privacy.mechanism: got 'dp_sgd'; expected a model whose "
                             f"trainable layers opacus can compute per-example gradients for: {'; '.join(bad)}")
        fallback = ghost_fallback_layers(model) if self.pv.grad_sample_mode == "ghost" else []
        if fallback:
            log.warning("privacy.grad_sample_mode ghost: opacus has no ghost norm for %d trainable layer(s), which "
                        "build per-example gradients instead: %s", len(fallback), ", ".join(fallback))
        self.sizes = [c.num_examples for c in clients]
        if self.noise_multiplier is None:  # a client that trains every planned round stays within the target
            tr, rounds = self.recipe.train, self.recipe.federation.rounds
            self.noise_multiplier = max(accounting.dp_sgd_noise_multiplier(
                self.pv.target_epsilon, self.pv.delta, tr.batch_size / n, rounds * steps_per_round(tr, n))
                for n in set(self.sizes))

    def sample_level_privacy(self, plan: ClientPlan, num_examples: int) -> LocalDPSGD:
        secret = secret_streams.stream_key(self.noise_secret, "dp-sgd", plan.rnd, plan.client_id) \
            if self.noise_secret is not None else os.urandom(secret_streams.SECRET_BYTES)  # nobody can replay it
        tr = self.recipe.train
        return LocalDPSGD(self.noise_multiplier, self.pv.clipping_norm, tr.batch_size, num_examples, secret,
                          self.pv.grad_sample_mode, tr.preference if tr.objective == "dpo" else None,
                          tr.loss_positions)

    # ----- server side: accounting per client
    def client_epsilon(self, cid: int, steps: int) -> float:
        rate = self.recipe.train.batch_size / self.sizes[cid]
        return accounting.dp_sgd_epsilon(self.noise_multiplier, rate, steps, self.pv.delta)

    def uploads_seen(self, rnd: int, steps: dict[int, int]) -> None:
        """Every upload that reached the server spends its client's budget: aggregated, dropped by the checks or
        the norm screen, or discarded with a retried sample (each is a release of the steps that trained it)."""
        super().uploads_seen(rnd, steps)
        for cid, n in steps.items():
            self.client_steps[cid] = self.client_steps.get(cid, 0) + int(n)

    def released_loss(self, loss: float) -> float | None:
        """Nothing: the client's training loss is a function of its examples that no noise protects. A non-finite
        loss is a fault of the client, which uploads nothing then."""
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss ({loss})")
        return None

    def round_problem(self, rnd: int) -> str | None:
        if self.pv.target_epsilon is None:
            return None
        tr = self.recipe.train
        worst = max((self.client_epsilon(c, self.client_steps.get(c, 0) + steps_per_round(tr, n)), c)
                    for c, n in enumerate(self.sizes))
        if worst[0] > self.pv.target_epsilon * (1 + 1e-9):
            return (f"the privacy budget is spent: if client {worst[1]} trained in round {rnd} its epsilon would be "
                    f"{worst[0]:.4g} > privacy.target_epsilon = {self.pv.target_epsilon:g} (delta {self.pv.delta:g})")
        return None

    def round_record(self, rnd: int) -> dict[str, Any]:
        per_client = {str(c): self.client_epsilon(c, s) for c, s in sorted(self.client_steps.items())}
        return {"epsilon": max(per_client.values(), default=0.0), "client_epsilon": per_client,
                "privacy": {"mechanism": "dp_sgd", "delta": self.pv.delta, "noise_multiplier": self.noise_multiplier,
                            "clipping_norm": self.pv.clipping_norm, "grad_sample_mode": self.pv.grad_sample_mode}}

    def state_dict(self) -> StateDict:
        steps = torch.tensor([self.client_steps.get(c, 0) for c in range(len(self.sizes))], dtype=torch.int64)
        return {**super().state_dict(), STEPS_KEY: steps}

    def load_state_dict(self, state: StateDict) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != STEPS_KEY})
        if STEPS_KEY in state:
            self.client_steps = {c: int(s) for c, s in enumerate(state[STEPS_KEY].tolist()) if s}
