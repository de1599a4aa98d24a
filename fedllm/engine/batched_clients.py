"""Client-batched local training (``train.clients_per_pass: K``): K clients in one forward/backward.

Small per-client micro-batches leave the hardware idle. Here the K clients of a pass are trained
together: every optimizer step concatenates each client's own micro-batch (drawn from its own
seeded stream, exactly as :func:`fedllm.engine.client.train_client` would), runs ONE forward/backward
over the shared frozen base, and routes each batch row through its own client's LoRA factors.

- **Factors**: for every LoRA factor the K clients' values are stacked over a leading client axis
  (``K × out × r`` / ``K × r × in``); the PEFT layers' forward is swapped, for the pass, for
  ``base(x) + s · (dropout(x) @ A_kᵀ) @ B_kᵀ`` as a batched matmul over the client axis.
- **Loss**: each client's loss is the mean over its own supervised tokens (its normalisation, not
  the pass's), plus the strategy's ``client_loss`` on that client's slice of the factors; the pass
  backpropagates the sum, and rows never mix, so each client's gradient is its own loss's gradient.
- **Optimizer**: one AdamW (or SGD) over the stacked tensors: every update is element-wise, so it
  equals K separate optimizers with the same step count and learning rate.
- **Clipping**: ``max_grad_norm`` clips each client's gradient by its own norm.

With LoRA dropout 0 this equals sequential training to fp32 round-off (``tests/training``). A
strategy opts in with ``Strategy.client_batching = True``: one default phase per plan, no
``after_step``, and a ``client_loss`` that uses only ``model.named_parameters()`` (it is handed a
:class:`ClientView`). Recipe validation rejects the rest.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedllm.data.tokens import IGNORE_INDEX
from fedllm.engine.checkpointed import checkpointed_training
from fedllm.engine.client import (
    OPTIMIZERS,
    ClientResult,
    batch_stream,
    close_client_state,
    head_at_every_position,
    lora_input_casts_skipped,
    open_client_state,
    resolved,
    train_autocast,
    training_attention,
)
from fedllm.models.cpu_half_matmul import for_model as half_matmuls_for
from fedllm.models.flops import TrainedWork
from fedllm.models.loading import write_state
from fedllm.models.state import StateDict
from fedllm.models.supervised_loss import supervised_hidden, supports_supervised_positions, token_losses
from fedllm.recipe.schedule import steps_per_round
from fedllm.recipe.schema import TrainConfig
from fedllm.runs.client_store import ClientStore
from fedllm.strategies.base import ClientPlan, ClientUpdate, Strategy


def client_passes(client_ids: Sequence[int], cfg: TrainConfig, sizes: Sequence[int]) -> list[list[int]]:
    """Split a process's sampled clients into passes of at most ``clients_per_pass`` with equal step counts."""
    k = max(1, cfg.clients_per_pass)
    passes: list[list[int]] = []
    for start in range(0, len(client_ids), k):
        chunk = client_ids[start:start + k]
        by_steps: dict[int, list[int]] = {}
        for cid in chunk:
            by_steps.setdefault(steps_per_round(cfg, sizes[cid]), []).append(cid)
        passes.extend(by_steps.values())
    return passes


@dataclass
class _Layer:
    module: Any  # the PEFT LoRA Linear
    a: str  # parameter name of lora_A
    b: str  # parameter name of lora_B
    scaling: float
    dropout: Any


def _lora_linears(model: torch.nn.Module) -> list[_Layer]:
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if not isinstance(module, LoraLinear) or len(adapters) != 1 or module.lora_variant or module.merged:
            raise ValueError(f"train.clients_per_pass > 1 needs plain LoRA on Linear layers; {name} is not")
        (ad,) = adapters
        out.append(_Layer(module, f"{name}.lora_A.{ad}.weight", f"{name}.lora_B.{ad}.weight",
                          float(module.scaling[ad]), module.lora_dropout[ad]))
    return out


class StackedFactors:
    """The K clients' LoRA factors stacked over a client axis, and the swapped layer forward that uses them.

    Args:
        model: The shared PEFT model (its LoRA layers are patched inside :meth:`patched`).
        states: Each client's values of the factors (missing names: the model's current value).
        trainable: Names that train (leaf tensors with gradients); the other factors stay fixed.
    """

    def __init__(self, model: torch.nn.Module, states: list[StateDict], trainable: Sequence[str]):
        self.layers = _lora_linears(model)
        params = dict(model.named_parameters())
        names = [n for layer in self.layers for n in (layer.a, layer.b)]
        unknown = sorted(set(trainable) - set(names))
        if unknown:
            raise ValueError(f"train.clients_per_pass > 1 trains only LoRA factors; {unknown[0]} is not one")
        self.tensors: dict[str, torch.Tensor] = {}
        for n in names:
            stacked = torch.stack([s.get(n, params[n]).detach().to(params[n]) for s in states])
            self.tensors[n] = stacked.requires_grad_(n in trainable)
        self.trainable = [n for n in names if n in trainable]
        self.rows: torch.Tensor | None = None  # client index of each batch row
        self.equal_rows = 0  # rows per client when every client has as many, contiguous

    def set_rows(self, counts: Sequence[int], device: torch.device) -> None:
        """The batch holds ``counts[k]`` rows of client k, client after client."""
        self.rows = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                            torch.tensor(counts, device=device))
        self.equal_rows = counts[0] if len(set(counts)) == 1 else 0

    def _delta(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        a, b = self.tensors[layer.a], self.tensors[layer.b]  # K x r x in, K x out x r
        x = layer.dropout(x.to(a.dtype))
        n, k = x.shape[0], a.shape[0]
        if self.equal_rows:
            flat = x.reshape(k, -1, x.shape[-1])  # clients' rows are contiguous and equally many
            out = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2))
        else:
            flat = x.reshape(n, -1, x.shape[-1])
            out = torch.bmm(torch.bmm(flat, a[self.rows].transpose(1, 2)), b[self.rows].transpose(1, 2))
        return out.reshape(*x.shape[:-1], b.shape[1]) * layer.scaling

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Inside: every LoRA layer computes ``base(x) + s·B_k A_k x`` with row r's client k."""

        def forward_of(layer: _Layer) -> Callable[..., torch.Tensor]:
            def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                result = layer.module.base_layer(x, *args, **kwargs)
                return (result + self._delta(layer, x)).to(result.dtype)

            return forward

        for layer in self.layers:
            layer.module.forward = forward_of(layer)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.module.forward  # back to the class's forward

    def client(self, k: int) -> dict[str, torch.Tensor]:
        """Client k's slice of every factor (views: gradients flow to the stacked tensors)."""
        return {n: t[k] for n, t in self.tensors.items()}


class ClientView:
    """What ``Strategy.client_loss`` sees of client k in a batched pass: its trainable factors by name."""

    def __init__(self, factors: StackedFactors, k: int):
        self._params = {n: factors.tensors[n][k] for n in factors.trainable}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, client k's value)`` of each trainable factor (``requires_grad`` is True)."""
        return iter(self._params.items())


def per_client_losses(model: Any, batch: dict[str, torch.Tensor], rows: torch.Tensor, k: int,
                      positions: str) -> torch.Tensor:
    """Each client's mean next-token cross-entropy over its own supervised positions (K values)."""
    if positions == "supervised" and supports_supervised_positions(model):
        hidden, targets, tok_rows = supervised_hidden(model, batch)
        losses = token_losses(model, hidden, targets)
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        keep = labels != IGNORE_INDEX
        losses = F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")
        tok_rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels)[keep]
    owner = rows[tok_rows]
    sums = torch.zeros(k, device=losses.device, dtype=losses.dtype).index_add(0, owner, losses)
    counts = torch.bincount(owner, minlength=k).to(losses.dtype)
    return sums / counts


def _clip_per_client(factors: StackedFactors, max_norm: float) -> None:
    grads = [factors.tensors[n].grad for n in factors.trainable if factors.tensors[n].grad is not None]
    if not grads:
        return
    sq = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0)  # K
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def train_clients(model: torch.nn.Module, plans: list[ClientPlan], strategy: Strategy, examples: Sequence[dict],
                  indices: list[Sequence[int]], cfg: TrainConfig, collate: Callable[[list[dict]], dict],
                  seeds: list[int], progress: Any = None) -> list[ClientResult]:
    """Train the clients of ``plans`` together (one default phase each, equal step counts)."""
    k = len(plans)
    if any(len(p.phases) != 1 or p.phases[0].keys is not None for p in plans):
        raise ValueError(f"{strategy.name}: client-batched training needs one default phase per client")
    steps = {plans[i].phases[0].steps or steps_per_round(cfg, len(indices[i])) for i in range(k)}
    if len(steps) != 1:
        raise ValueError(f"client-batched training needs equal step counts, got {sorted(steps)}")
    (num_steps,) = steps
    torch.manual_seed(seeds[0])
    device = next(model.parameters()).device
    cfg = resolved(cfg, device)
    keys = list(plans[0].state)
    factors = StackedFactors(model, [{**p.state, **p.local} for p in plans], keys)
    streams = [batch_stream(cfg, examples, ix, s) for ix, s in zip(indices, seeds, strict=True)]
    opt = OPTIMIZERS[cfg.optimizer]([factors.tensors[n] for n in factors.trainable], cfg, plans[0].lr)
    losses: list[list[float]] = [[] for _ in range(k)]
    padded = [[0, 0] for _ in range(k)]
    work = [TrainedWork() for _ in range(k)]
    head_everywhere = head_at_every_position(model, cfg)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    was_training = model.training
    model.train()
    try:
        with factors.patched(), lora_input_casts_skipped(model, cfg), training_attention(model, cfg), \
                checkpointed_training(model, cfg), half_matmuls_for(model, cfg.dtype):
            for _ in range(num_steps):
                opt.zero_grad(set_to_none=True)
                for _ in range(cfg.grad_accum):
                    parts = [[examples[i] for i in s.next()] for s in streams]
                    batch = collate([ex for p in parts for ex in p])
                    width = batch["input_ids"].shape[1]
                    row = 0
                    for c, part in enumerate(parts):  # the positions the pass computed for client c
                        padded[c][0] += sum(width - len(ex["input_ids"]) for ex in part)
                        padded[c][1] += width * len(part)
                        work[c].add_batch({n: v[row:row + len(part)] for n, v in batch.items()}, head_everywhere)
                        row += len(part)
                    batch = {n: v.to(device) for n, v in batch.items()}
                    factors.set_rows([len(p) for p in parts], device)
                    with train_autocast(device, cfg.dtype):
                        per_client = per_client_losses(model, batch, factors.rows, k, cfg.loss_positions)
                        extras = [strategy.client_loss(ClientView(factors, c), plans[c]) for c in range(k)]
                    total = per_client.sum() + sum(e for e in extras if e is not None)
                    for c in range(k):
                        losses[c].append(float(per_client[c].detach()))
                    (total / cfg.grad_accum).backward()
                if cfg.max_grad_norm:
                    _clip_per_client(factors, cfg.max_grad_norm)
                opt.step()
                if progress is not None:
                    progress.update(k)
    finally:
        model.train(was_training)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    for w in work:  # one pass trained them all: each client is charged its share of the time
        w.seconds, w.cpu_seconds = wall / k, cpu / k
    results = []
    for c, plan in enumerate(plans):
        touched = list(plan.state) + [n for n in plan.local if n not in plan.state]
        mine = factors.client(c)
        state = {n: mine[n].detach().clone() for n in touched}
        results.append(ClientResult(state=state, loss=sum(losses[c]) / len(losses[c]), steps=num_steps,
                                    padding=(padded[c][0], padded[c][1]), work=work[c]))
    write_state(model, results[-1].state)  # the model ends as after sequential training: the last client's values
    return results


def run_clients(model: torch.nn.Module, plans: list[ClientPlan], strategy: Strategy, store: ClientStore,
                examples: Sequence[dict], indices: list[Sequence[int]], cfg: TrainConfig,
                collate: Callable[[list[dict]], dict], seeds: list[int], progress: Any = None) -> list[ClientUpdate]:
    """:func:`fedllm.engine.client.run_client` for a pass of clients: stored state in, uploads out, in plan order."""
    moments = [open_client_state(plan, strategy, store) for plan in plans]
    if any(m for m in moments):
        raise ValueError("client-batched training starts every client's optimizer afresh "
                         "(train.optimizer_state: reset)")
    results = train_clients(model, plans, strategy, examples, indices, cfg, collate, seeds, progress)
    return [close_client_state(plan, strategy, store, result, m, len(ix))
            for plan, result, m, ix in zip(plans, results, moments, indices, strict=True)]
