"""Local training of one client: a plain, lean PyTorch loop.

The client loads the plan's state into the one shared model, trains the
parameters each phase names, and reads the trained values back out (cloned).
It knows the strategy only through its client-side hooks. :func:`run_client` is the one
client-side entry point every runtime calls (in-process simulation, each process of a
multi-process run, a Flower ClientApp): per-client state in, upload out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedllm.data.collate import is_pair_batch
from fedllm.data.length_grouping import LengthGroupedStream, padded_positions
from fedllm.data.packing import PACKING_MODEL_TYPES, pack_batch
from fedllm.engine.checkpointed import checkpointed_training, opacus_recording_paused
from fedllm.engine.compiled import compiled_training, pad_multiple, padded_to_multiple
from fedllm.engine.compressed_rounds import compress_upload
from fedllm.engine.reference import client_reference, uses_precomputed, with_reference
from fedllm.models.cpu_half_matmul import for_model as half_matmuls_for
from fedllm.models.flops import TrainedWork
from fedllm.models.loading import read_state, write_state
from fedllm.models.preference_loss import pair_loss
from fedllm.models.state import DTYPES, StateDict
from fedllm.models.supervised_loss import loss_path
from fedllm.recipe.schedule import steps_per_round
from fedllm.recipe.schema import TrainConfig
from fedllm.runs.client_store import ClientStore, join_optimizer, join_residual, residual_part, split_optimizer
from fedllm.strategies.base import ClientPlan, ClientUpdate, Strategy

log = logging.getLogger("fedllm")

def adamw_kernel(params: list, cfg: TrainConfig) -> dict[str, bool]:
    """AdamW's implementation: ``foreach`` (one multi-tensor update per step instead of a Python loop over the
    parameters; torch's default on a GPU, not on a CPU), bit-identical to the loop (``tests/training/
    test_step_overhead.py``; 240 LoRA factors of a 30-layer model: 6.5 -> 4.2 ms per step on one CPU thread). Under
    ``train.compile`` on a CPU, whose result differs from the eager run's by rounding anyway, ``fused`` (one kernel,
    7x faster still on a CPU, 2e-7 from foreach)."""
    on_cpu = all(p.device.type == "cpu" for p in params)
    return {"fused": True} if cfg.compile and on_cpu else {"foreach": True}


#: ``train.optimizer`` -> the local optimizer (SGD: ``foreach``, as AdamW's :func:`adamw_kernel`).
OPTIMIZERS: dict[str, Callable[[list, TrainConfig, float], torch.optim.Optimizer]] = {
    "adamw": lambda params, cfg, lr: torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay,
                                                       **adamw_kernel(params, cfg)),
    "sgd": lambda params, cfg, lr: torch.optim.SGD(params, lr=lr, momentum=cfg.momentum,
                                                   weight_decay=cfg.weight_decay, foreach=True),
}


@dataclass
class ClientResult:
    """Trained values of every key the client loaded or trained, and how training went."""

    state: StateDict
    loss: float
    steps: int
    optimizer_state: StateDict | None = None
    padding: tuple[int, int] = (0, 0)  # (padded positions, all positions) of the micro-batches trained on
    work: TrainedWork = field(default_factory=TrainedWork)  # tokens, FLOP counts and seconds (throughput, MFU)


class BatchStream:
    """Endless seeded shuffled micro-batches over a client's examples (reshuffled each pass)."""

    def __init__(self, indices: Sequence[int], batch_size: int, seed: int):
        self.indices = list(indices)
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = [self.indices[i] for i in torch.randperm(len(self.indices), generator=self.gen)]
            take = min(self.batch_size - len(batch), len(self.order))
            batch += self.order[:take]
            del self.order[:take]
            if len(self.indices) < self.batch_size and not self.order:
                break  # a client smaller than one batch trains on all it has
        return batch


def batch_stream(cfg: TrainConfig, examples: Sequence[dict], indices: Sequence[int],
                 seed: int) -> BatchStream | LengthGroupedStream:
    """The client's micro-batch stream: plain shuffled, or grouped by length (``train.group_by_length``)."""
    if cfg.group_by_length:
        return LengthGroupedStream(indices, [len(examples[i]["input_ids"]) for i in indices], cfg.batch_size, seed)
    return BatchStream(indices, cfg.batch_size, seed)


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: TrainConfig) -> torch.Tensor:
    """Next-token loss of one micro-batch: ``train.loss_positions`` for a causal LM, the model's own otherwise."""
    task = "causal_lm" if batch["labels"].dim() == 2 else "classification"
    return loss_path(model, cfg.loss_positions, task)(model, batch)


def dpo_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: TrainConfig) -> torch.Tensor:
    """The pairwise loss of ``train.preference`` on a batch of preference pairs (:mod:`fedllm.models.preference_loss`)."""
    if not is_pair_batch(batch):
        raise ValueError("train.objective: dpo needs preference pairs (data.format: preference)")
    return pair_loss(model, batch, cfg.preference, cfg.loss_positions).loss


#: ``train.objective`` -> loss of one micro-batch.
OBJECTIVES: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor], TrainConfig], torch.Tensor]] = {
    "sft": sft_loss,
    "dpo": dpo_loss,
}


def micro_batch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: TrainConfig) -> torch.Tensor:
    """Loss of one micro-batch under ``train.objective`` (:data:`OBJECTIVES`)."""
    return OBJECTIVES[cfg.objective](model, batch, cfg)


def _named_optimizer_state(opt: torch.optim.Optimizer, names: dict[int, str]) -> StateDict:
    out: StateDict = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                out[f"{names[id(p)]}::{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone()
    return out


def _load_optimizer_state(opt: torch.optim.Optimizer, names: dict[int, str], state: StateDict) -> None:
    """Per-client moments into ``opt``; floating moments in their parameter's dtype, as torch's own
    ``Optimizer.load_state_dict`` does (bf16 head moments kept before the head became fp32 continue upcast)."""
    for group in opt.param_groups:
        for p in group["params"]:
            prefix = f"{names[id(p)]}::"
            entries = {k[len(prefix):]: v.to(p.device, p.dtype if v.is_floating_point() else v.dtype, copy=True)
                       if v.dim() else v.clone()
                       for k, v in state.items() if k.startswith(prefix)}
            if entries:
                opt.state[p] = entries


def resolved(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """``cfg`` with what depends on ``device`` resolved: ``dtype: auto`` and ``pad_to_multiple_of: null`` (a run
    resolves the dtype at start; a caller of the client functions with a fresh :class:`TrainConfig` may not have)."""
    changes: dict[str, object] = {}
    if cfg.dtype == "auto":
        from fedllm.models.hardware import auto_dtype

        changes["dtype"] = auto_dtype(device)[0]
    if cfg.pad_to_multiple_of is None:
        changes["pad_to_multiple_of"] = pad_multiple(cfg, device.type)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def train_autocast(device: torch.device, dtype: str):
    """``torch.autocast`` on ``device`` for ``train.dtype`` bf16/fp16 (CPU or GPU); nothing for fp32."""
    if dtype == "auto":
        from fedllm.models.hardware import auto_dtype

        dtype = auto_dtype(device)[0]
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


#: Under bf16/fp16 autocast, PEFT's LoRA layers keep the input in its own dtype instead of casting it to their
#: fp32 factors' (autocast casts it back for the matmul: two casts of every LoRA input, forward and backward,
#: for the same bits). False restores PEFT's casts (``bench/bf16_step.py`` measures both).
SKIP_LORA_INPUT_CASTS = True


def lora_input_casts_skipped(model: torch.nn.Module, cfg: TrainConfig):
    """Context: PEFT's input casts of the LoRA layers off under autocast (:data:`SKIP_LORA_INPUT_CASTS`)."""
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model, active=SKIP_LORA_INPUT_CASTS and cfg.dtype in ("bf16", "fp16"))


#: Micro-batches up to this many positions train on a CPU under bf16/fp16 autocast with eager attention (matmuls
#: and an fp32 softmax) instead of SDPA's flash kernel, whose CPU bf16 backward is slow at short lengths: one
#: SmolLM2-shaped layer (4 x 9 heads x 64) forward + backward, 1 thread, CPU-ms: S=96 flash 9.0 / eager 2.7,
#: S=160 16.4 / 5.9, S=256 25.6 / 14.7, S=512 85 / 117 (docs/performance.md). fp32 gains nothing (4.5 / 4.8 at 96).
EAGER_ATTENTION_MAX_LENGTH = 256

#: The same for the rows of a packed micro-batch (``train.packing``: block-diagonal masks), whose sequences share
#: a row: one SmolLM2-shaped layer (1 row x 9 heads x 64, bf16, four sequences), forward + backward, 1 thread,
#: CPU-ms eager / SDPA with the mask: S=256 3.2 / 7.3, S=512 10.8 / 23.9, S=768 45.1 / 45.0, S=1024 96.3 / 79.2
#: (``python bench/packing.py --attention``, docs/performance.md). A 512-position row's eager weights take the
#: memory of 4 rows of 256.
EAGER_PACKED_ROW_MAX_LENGTH = 512


def training_attention_choice(current: str | None, device: torch.device, dtype: str, positions: int,
                              packed: bool = False, compiled: bool = False) -> str | None:
    """The attention implementation a training micro-batch of ``positions`` per row takes instead of the model's
    SDPA, or None to keep it: flash-attention 2's variable-length kernel for a packed batch on a GPU in bf16/fp16
    where flash-attn is installed; eager on a CPU in bf16/fp16 up to :data:`EAGER_ATTENTION_MAX_LENGTH` positions
    (a packed row: :data:`EAGER_PACKED_ROW_MAX_LENGTH`) — under ``train.compile`` (``compiled``) fedllm's grouped
    eager attention (:mod:`fedllm.models.grouped_attention`), which the eager default leaves for its exact bits — and
    past that length (unpacked, eager) fedllm's blocked causal attention, which kept the bf16 step's MFU per CPU-second
    at 512 and 1024 positions within 1 % and 12 % of 256's, where SDPA lost 16 % and 21 % (docs/performance.md)."""
    if current != "sdpa" or dtype not in ("bf16", "fp16"):
        return None
    if packed and device.type == "cuda":
        from transformers.utils import is_flash_attn_2_available

        return "flash_attention_2" if is_flash_attn_2_available() else None
    limit = EAGER_PACKED_ROW_MAX_LENGTH if packed else EAGER_ATTENTION_MAX_LENGTH
    if device.type != "cpu":
        return None
    if positions > limit:  # past eager's length: blocked causal attention (half the work of eager, no S x S at once)
        if packed or compiled:
            return None
        from fedllm.models.grouped_attention import register_blocked

        return register_blocked()
    if compiled:
        from fedllm.models.grouped_attention import register

        return register()
    return "eager"


@contextlib.contextmanager
def training_attention(model: torch.nn.Module, cfg: TrainConfig, positions: int | None = None, packed: bool = False):
    """Context: the attention of :func:`training_attention_choice` for rows of ``positions`` (default
    ``train.max_length``) while training; the model's own choice otherwise, and always outside training
    (evaluation and generation keep SDPA)."""
    from fedllm.models.supervised_loss import base_of

    config = getattr(base_of(model), "config", None)
    device = next(model.parameters()).device
    choice = None if config is None else training_attention_choice(
        getattr(config, "_attn_implementation", None), device, cfg.dtype,
        cfg.max_length if positions is None else positions, packed, compiled=bool(cfg.compile))
    if choice is None:
        yield
        return
    config._attn_implementation = choice
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def check_packable(model: torch.nn.Module) -> None:
    """Raise ValueError unless ``train.packing`` holds for this model (the recipe checks a model whose config they
    can read: :mod:`fedllm.recipe.packing_checks`)."""
    from fedllm.models.supervised_loss import base_of

    model_type = getattr(getattr(base_of(model), "config", None), "model_type", None)
    if model_type not in PACKING_MODEL_TYPES:
        raise ValueError(f"train.packing: model type {model_type!r} is not one whose attention takes packed "
                         f"position ids ({', '.join(sorted(PACKING_MODEL_TYPES))}); set train.packing: false")


def packed_row_length(model: torch.nn.Module, cfg: TrainConfig) -> int | None:
    """Positions per packed row: one row (None) for flash-attention's variable-length kernel, which needs one and
    computes each sequence's own square; ``train.max_length`` for a dense kernel, which computes each row's square."""
    from fedllm.models.supervised_loss import base_of

    current = getattr(getattr(base_of(model), "config", None), "_attn_implementation", None)
    device = next(model.parameters()).device
    flash = training_attention_choice(current, device, cfg.dtype, 0, packed=True) == "flash_attention_2"
    if device.type == "cuda" and not flash:
        _warn_dense_packing_on_gpu()
    return None if flash else cfg.max_length


@functools.cache
def _warn_dense_packing_on_gpu() -> None:
    """Once per process: packing on a GPU without flash-attention's variable-length kernel was measured slower."""
    log.warning("train.packing on a GPU without flash-attention 2 (flash-attn not installed, or train.dtype fp32) "
                "packs into dense rows: measured 0.48-0.83x the padded batches' tokens/s on an H100 "
                "(docs/gpu.md, Packing on the GPU); set train.packing: false, or install flash-attn")


def micro_batch(collate: Callable[[list[dict]], dict], items: list[dict], cfg: TrainConfig,
                row_length: int | None = None) -> tuple[dict, int]:
    """One training micro-batch and its real tokens: ``collate``'s padded batch, packed under ``train.packing``
    (rows of ``row_length``: :func:`packed_row_length`)."""
    batch = padded_to_multiple(collate(items), cfg)  # train.pad_to_multiple_of (few widths to compile)
    tokens = batch["input_ids"].numel()
    if "attention_mask" in batch:  # right-padded (every collate fedllm hands a client)
        padded, _ = padded_positions(batch["attention_mask"])
        tokens -= padded
    return (pack_batch(batch, row_length) if cfg.packing else batch), tokens


def micro_batch_attention(model: torch.nn.Module, cfg: TrainConfig, batch: dict[str, torch.Tensor]):
    """Context of one micro-batch's forward: a packed row picks its attention by its own length (unpacked
    batches keep the client-wide :func:`training_attention`)."""
    if not cfg.packing:
        return contextlib.nullcontext()
    return training_attention(model, cfg, int(batch["input_ids"].shape[1]), packed=True)


def train_client(model: torch.nn.Module, plan: ClientPlan, strategy: Strategy, examples: Sequence[dict],
                 indices: Sequence[int], cfg: TrainConfig, collate: Callable[[list[dict]], dict],
                 seed: int, optimizer_state: StateDict | None = None, progress: Any = None) -> ClientResult:
    """Train one client for every phase of ``plan`` and return its trained state.

    Args:
        model: the shared PEFT model (its state is overwritten by ``plan.state``).
        plan: what to load and which parameters train for how many steps.
        strategy: supplies ``client_loss`` and ``after_step``.
        examples: tokenized examples of the whole federation; ``indices`` are this client's.
        cfg: local-training options; the learning rate is ``plan.lr``.
        collate: turns a list of examples into model inputs.
        seed: seeds data order and dropout, so a round is reproducible (and resumable).
        optimizer_state: per-client optimizer moments to continue from (``optimizer_state: per_client``).
        progress: a tqdm bar advanced once per optimizer step.
    """
    if not indices:
        raise ValueError(f"client {plan.client_id} has no training examples")
    torch.manual_seed(seed)
    params = dict(model.named_parameters())
    write_state(model, {**plan.state, **plan.local}, params)
    device = next(iter(params.values())).device
    cfg = resolved(cfg, device)
    private = strategy.sample_level_privacy(plan, len(indices))  # DP-SGD (fedllm.privacy.dp_sgd) or None
    stream = private.stream(indices) if private else batch_stream(cfg, examples, indices, seed)
    default_steps = steps_per_round(cfg, len(indices))
    touched = list(plan.state) + [k for k in plan.local if k not in plan.state]
    losses: list[torch.Tensor] = []  # read once at the end: no device sync per micro-batch
    total_steps = 0
    padded = positions = 0
    work = TrainedWork()
    head_everywhere = head_at_every_position(model, cfg)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    new_opt_state: StateDict = {}
    scaler = torch.amp.GradScaler(device.type) if cfg.dtype == "fp16" else None
    was_training = model.training
    original_flags = {name: p.requires_grad for name, p in params.items()}
    model.train()
    restore = contextlib.ExitStack()
    restore.enter_context(checkpointed_training(model, cfg))  # train.gradient_checkpointing
    restore.enter_context(compiled_training(model, cfg))  # train.compile: the decoder layers compiled
    restore.enter_context(lora_input_casts_skipped(model, cfg))
    restore.enter_context(half_matmuls_for(model, cfg.dtype))  # a CPU without a bf16 GEMM
    row_length = None
    if cfg.packing:
        check_packable(model)
        row_length = packed_row_length(model, cfg)
    else:
        restore.enter_context(training_attention(model, cfg))
    try:
        for phase in plan.phases:
            keys = list(phase.keys) if phase.keys is not None else list(plan.state)
            touched += [k for k in keys if k not in plan.state]
            for name, p in params.items():
                p.requires_grad_(name in keys)
            trainable = [params[k] for k in keys]
            names = {id(params[k]): k for k in keys}
            opt = OPTIMIZERS[cfg.optimizer](trainable, cfg, plan.lr)
            if optimizer_state:
                _load_optimizer_state(opt, names, optimizer_state)
            dp_phase = private.phase(model, opt) if private else contextlib.nullcontext(opt)
            with dp_phase as stepper, (opacus_recording_paused(private.wrapped) if private
                                       else contextlib.nullcontext()):  # stepper: DP-SGD's DPOptimizer
                for _ in range(phase.steps if phase.steps is not None else default_steps):
                    stepper.zero_grad(set_to_none=True)
                    for _ in range(cfg.grad_accum):
                        drawn = stream.next()
                        if not drawn:  # an empty Poisson batch (DP-SGD): the step adds noise only
                            private.empty_batch(trainable)
                            continue
                        batch, tokens = micro_batch(collate, [examples[i] for i in drawn], cfg, row_length)
                        pos = batch["input_ids"].numel()
                        pad = pos - tokens  # on the CPU: no device sync
                        work.add_batch(batch, head_everywhere, tokens)
                        batch = {k: v.to(device) for k, v in batch.items()}
                        padded, positions = padded + pad, positions + pos
                        with train_autocast(device, cfg.dtype), micro_batch_attention(model, cfg, batch):
                            if private:
                                total, loss = private.loss(model, batch)
                            else:
                                loss = micro_batch_loss(model, batch, cfg)
                                extra = strategy.client_loss(model, plan)
                                total = loss if extra is None else loss + extra
                        losses.append(loss.detach())
                        total = total / cfg.grad_accum
                        (scaler.scale(total) if scaler else total).backward()
                    if scaler:
                        scaler.unscale_(stepper)
                    if cfg.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
                    if scaler:
                        scaler.step(stepper)
                        scaler.update()
                    else:
                        stepper.step()
                    strategy.after_step(model, plan)
                    total_steps += 1
                    if progress is not None:
                        progress.update(1)
            if cfg.optimizer_state == "per_client":
                new_opt_state.update(_named_optimizer_state(opt, names))
        work.seconds, work.cpu_seconds = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        restore.close()
        for name, p in params.items():
            p.requires_grad_(original_flags[name])
        model.train(was_training)
    # the values float() of each would read (fp64 holds any loss dtype exactly), in one device sync
    losses_read = torch.stack([x.double() for x in losses]).tolist() if losses else []
    loss = sum(losses_read) / len(losses_read) if losses_read else 0.0  # none: DP-SGD drew only empty batches
    return ClientResult(state=read_state(model, touched), loss=loss, steps=total_steps,
                        optimizer_state=new_opt_state if cfg.optimizer_state == "per_client" else None,
                        padding=(padded, positions), work=work)


def head_at_every_position(model: torch.nn.Module, cfg: TrainConfig) -> bool:
    """Whether the LM head runs at every position (``train.loss_positions: all``, or a model type whose head
    :mod:`fedllm.models.supervised_loss` does not know) rather than at the supervised ones only."""
    from fedllm.models.supervised_loss import supports_supervised_positions

    return cfg.loss_positions == "all" or not supports_supervised_positions(model)


def open_client_state(plan: ClientPlan, strategy: Strategy, store: ClientStore) -> StateDict | None:
    """Hand client ``plan.client_id``'s stored entry to the strategy; return the moments it continues from."""
    plan.client_state, moments = split_optimizer(store.get(plan.client_id))
    strategy.open_client(plan)
    return strategy.client_optimizer_state(plan.rnd, plan.client_id, moments)


def close_client_state(plan: ClientPlan, strategy: Strategy, store: ClientStore, result: ClientResult,
                       moments: StateDict | None, num_examples: int) -> ClientUpdate:
    """Store client ``plan.client_id``'s new entry and return what it uploads (compressed, with its residual kept
    in the entry, under ``federation.compression.upload``: :mod:`fedllm.engine.compressed_rounds`)."""
    residual = residual_part(store.get(plan.client_id))
    kept = strategy.close_client(plan, result.state, result.steps)
    upload = strategy.client_upload(plan, result.state, result.steps)
    compressed = compress_upload(strategy.recipe, plan.state, upload, residual)
    wire_bytes, packed = None, None
    if compressed is not None:
        upload, residual, packed, wire_bytes = compressed
    store.put(plan.client_id, join_residual(join_optimizer(kept, result.optimizer_state
                                                           if result.optimizer_state is not None else moments),
                                            residual))
    update = ClientUpdate(plan.client_id, upload, num_examples, strategy.released_loss(result.loss), result.steps,
                          padding=result.padding, wire_bytes=wire_bytes, packed=packed,
                          work=result.work.as_dict())
    return update


def run_client(model: torch.nn.Module, plan: ClientPlan, strategy: Strategy, store: ClientStore,
               examples: Sequence[dict], indices: Sequence[int], cfg: TrainConfig,
               collate: Callable[[list[dict]], dict], seed: int, progress: Any = None) -> ClientUpdate:
    """Train client ``plan.client_id`` from its stored state and return what it uploads.

    The client's entry in ``store`` is handed to the strategy through ``plan.client_state``
    (``open_client``), its optimizer moments continue when ``train.optimizer_state: per_client``,
    and the new entry (``close_client`` plus the moments) replaces the old one in ``store``. Under DPO with
    precomputed references, the client's reference log-probabilities come from ``store`` (computed now, from
    the model as it stands, if it has none: :mod:`fedllm.engine.reference`).
    """
    if uses_precomputed(cfg):
        part = client_reference(model, store, plan.client_id, examples, indices, cfg, collate)
        examples = with_reference(examples, indices, part)
    moments = open_client_state(plan, strategy, store)
    result = train_client(model, plan, strategy, examples, indices, cfg, collate, seed, moments, progress)
    return close_client_state(plan, strategy, store, result, moments, len(indices))
