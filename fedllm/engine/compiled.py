"""``train.compile``: a client's training through compiled decoder layers.

On a GPU fedllm's client step is host-bound: about 4,000 kernel launches per micro-batch, the GPU busy ~15 ms of
136 (docs/gpu.md). ``torch.compile`` of each decoder layer (inductor) fuses them: one bf16 step 1.7–2.3× faster on
an H100, 2.5–6× with CUDA graphs (``mode="reduce-overhead"``; ``bench/gpu_step.py``). On a CPU it fuses the
elementwise work around the matmuls: a quickstart-shaped bf16 step takes 1.2× less CPU, 65–67 % of the bf16
matmul peak per CPU-second against 55 % eager (docs/performance.md).
This module holds the pieces a federated run needs:

- :func:`compiled_training`: a context that compiles every repeated block of the model (its decoder layers) in
  place while a client trains, and restores the eager call on exit, so evaluation, generation and export never
  run a compiled graph. As ``nn.Module.compile`` does, it sets each layer's ``_compiled_call_impl`` and wraps
  nothing: parameter names, state dicts and saved adapters keep their keys (no ``_orig_mod.`` prefix). One
  compiled function serves every layer (one graph for all), is kept with the layers and set again by the next
  client, so one process compiles once per run, not once per client; a run whose layers carry other hooks (another
  strategy) compiles its own, isolated from the graphs before (:func:`_compile_layers`). On a CPU the head's
  cross-entropy chunk is compiled too (:func:`fedllm.models.fused_head_loss.compiled_rows`) and every batch takes
  the fused head; the client also takes fedllm's grouped-query attention
  (:func:`fedllm.engine.client.training_attention_choice`) and fused AdamW (:func:`fedllm.engine.client.adamw_kernel`).
- Widths: on a CPU one graph takes every micro-batch width (``dynamic=True``: compiled once, batches unpadded,
  packed rows allowed). On a GPU ``dynamic=False`` compiles one graph per width, as timed there (CUDA graphs need
  fixed shapes), and :func:`padded_to_multiple` right-pads each batch's width up to a multiple of
  ``train.pad_to_multiple_of`` (64 by default), so a run sees at most ``max_length / 64 + 1`` widths. The padding is
  right padding as collate's own (``attention_mask`` 0, ``labels`` -100): no position attends to it and no loss
  reads it.
- with ``cudagraphs``, :func:`torch.compiler.cudagraph_mark_step_begin` before each forward pass (a pre-hook on the
  decoder that runs the layers, outside every compiled graph): a replay overwrites the previous step's outputs, and
  fedllm's client reads the logged loss (computed outside the layers) before the next micro-batch. One micro-batch
  per optimizer step only (``train.grad_accum: 1``): a replay's parameter gradients may live in the graph's
  memory, which the next micro-batch's replay reuses.

What cannot hold is refused at recipe load (:mod:`fedllm.recipe.compile_checks`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
import types
import weakref
from collections.abc import Callable, Iterator

import torch

from fedllm.data.tokens import IGNORE_INDEX
from fedllm.models.fused_head_loss import compiled_rows
from fedllm.recipe.schema import TrainConfig

log = logging.getLogger("fedllm")

#: Width multiple of ``train.pad_to_multiple_of: null`` under ``train.compile``.
DEFAULT_MULTIPLE = 64
#: ``torch.compile`` backend; tests set "eager" (dynamo's tracing and guards, no inductor code generation).
BACKEND = "inductor"
#: ``train.compile`` -> inductor's mode.
MODES: dict[object, str | None] = {True: None, "cudagraphs": "reduce-overhead"}
#: Graphs dynamo may compile per micro-batch width (room above the 2 of a LLaMA and the 4 of a Gemma 3).
VARIANTS_PER_WIDTH = 8
#: Fill value of each per-position key of a padded batch (collate's right padding; any id is masked out).
PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}


def one_graph_for_all_widths(cfg: TrainConfig, device_type: str) -> bool:
    """Whether the compiled layers take every micro-batch width in one graph (``dynamic=True``): on a CPU, where
    one compilation serves the whole run and unpadded batches keep their FLOPs (docs/performance.md). A GPU keeps a
    graph per width (``dynamic=False``, as timed there; CUDA graphs need fixed shapes)."""
    return bool(cfg.compile) and device_type != "cuda"


def pad_multiple(cfg: TrainConfig, device_type: str) -> int:
    """The width multiple a micro-batch is padded to on ``device_type``: ``train.pad_to_multiple_of``; by default
    64 under ``train.compile`` on a GPU (a graph per width), 1 elsewhere (no padding: today's batches, bit for
    bit)."""
    if cfg.pad_to_multiple_of is not None:
        return cfg.pad_to_multiple_of
    return DEFAULT_MULTIPLE if cfg.compile and not one_graph_for_all_widths(cfg, device_type) else 1


def padded_width(width: int, multiple: int, max_length: int) -> int:
    """``width`` rounded up to ``multiple``, never past ``max(width, max_length)``."""
    return min(math.ceil(width / multiple) * multiple, max(width, max_length))


def padded_to_multiple(batch: dict[str, torch.Tensor], cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """``batch`` with its per-position tensors right-padded to :func:`padded_width` of ``cfg.pad_to_multiple_of``
    (resolved for the device: :func:`fedllm.engine.client.resolved`; the same dict when no padding is due). Rows
    are right-padded as collate pads them: masked, never attended to, never in the loss."""
    width = batch["input_ids"].shape[-1]
    target = padded_width(width, cfg.pad_to_multiple_of or 1, cfg.max_length)
    if target == width:
        return batch
    out = dict(batch)
    for key, value in PAD_VALUES.items():
        if key in batch and batch[key].dim() == 2 and batch[key].shape[1] == width:
            out[key] = torch.nn.functional.pad(batch[key], (0, target - width), value=value)
    return out


def widths(cfg: TrainConfig, device_type: str) -> int:
    """How many micro-batch widths a run compiles a graph for: one on a CPU (:func:`one_graph_for_all_widths`),
    else the multiples up to ``max_length`` and ``max_length`` itself."""
    if one_graph_for_all_widths(cfg, device_type):
        return 1
    return math.ceil(cfg.max_length / pad_multiple(cfg, device_type)) + 1


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the members of a ``ModuleList`` whose class the model names in
    ``_no_split_modules`` (transformers' decoder or encoder layers, e.g. ``LlamaDecoderLayer``)."""
    from fedllm.models.supervised_loss import base_of

    base = base_of(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for lst in base.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
            if type(m).__name__ in names]


KEPT = "_fedllm_compiled"
"""Attribute of a layer holding ``(key, hooks, weak reference to the layer, compiled call)`` between clients (a deep
copy of the layer carries the reference to the original, so it compiles its own)."""


def hooks_of(layers: list[torch.nn.Module]) -> tuple[int, ...]:
    """The hooks on ``layers`` and their submodules, by their handles' ids (torch numbers every registration anew):
    strategies hook the LoRA layers (residuals, nested or latent factors, private adapters), and dynamo does not
    guard hooks (``skip_nnmodule_hook_guards``; guarding them cost 2–3 % of a compiled CPU step)."""
    return tuple(handle for layer in layers for module in layer.modules()
                 for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                               module._backward_hooks) for handle in hooks)


def _layer_call(layer: torch.nn.Module, *args, **kwargs):
    """One layer's call (its hooks and forward): what :func:`_compile_layers` compiles once for every layer."""
    return layer._call_impl(*args, **kwargs)


def _isolated_compile(**options) -> Callable:
    """``torch.compile`` of :func:`_layer_call` with a graph cache of its own: ``isolate_recompiles`` where torch
    has it (2.13); before it, a fresh copy of the function's code object, on which dynamo keeps a cache apart from
    every other copy's (torch 2.11, as on the lent GPU image, refused the keyword and dropped every client)."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(_layer_call, isolate_recompiles=True, **options)
    fresh = types.FunctionType(_layer_call.__code__.replace(), _layer_call.__globals__, _layer_call.__name__)
    return torch.compile(fresh, **options)


def _compile_layers(layers: list[torch.nn.Module], key: tuple) -> int:
    """Set each layer's compiled call for ``key`` (``(train.compile, backend, dynamic)``): the one compiled before
    for this same layer with the same hooks, or else a new compiled :func:`_layer_call` that every such layer
    shares (one graph for all). Each new one is its own region (``isolate_recompiles``): a later run in the same
    process, whose layers carry other hooks, never replays its graphs. Returns how many layers were compiled anew."""
    hooks = hooks_of(layers)
    stale = [layer for layer in layers if not (
        (kept := layer.__dict__.get(KEPT)) is not None and kept[:2] == (key, hooks) and kept[2]() is layer)]
    if stale:
        mode = MODES[key[0]]
        compiled = _isolated_compile(dynamic=key[2], backend=key[1], **({"mode": mode} if key[1] == "inductor" else {}))
        for layer in stale:
            layer.__dict__[KEPT] = (key, hooks, weakref.ref(layer), functools.partial(compiled, layer))
    for layer in layers:
        layer._compiled_call_impl = layer.__dict__[KEPT][3]
    return len(stale)


def on_gpu(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU (what ``cudagraphs`` needs)."""
    return device.type == "cuda"


@contextlib.contextmanager
def compiled_training(model: torch.nn.Module, cfg: TrainConfig) -> Iterator[None]:
    """Context: ``model``'s repeated blocks compiled under ``train.compile`` while a client trains; eager again on
    exit (nothing happens when ``train.compile`` is false).

    Raises:
        ValueError: the model has no repeated blocks to compile, or ``cudagraphs`` on a model not on a GPU.
    """
    if not cfg.compile:
        yield
        return
    layers = repeated_blocks(model)
    if not layers:
        raise ValueError("train.compile: the model has no repeated decoder layers to compile; set train.compile: "
                         "false")
    device = next(model.parameters()).device
    if cfg.compile == "cudagraphs" and not on_gpu(device):
        raise ValueError(f"train.compile: cudagraphs needs the model on a GPU (it is on {device}); use true or false")
    dynamic = one_graph_for_all_widths(cfg, device.type)
    key = (cfg.compile, BACKEND, dynamic)
    before = [layer._compiled_call_impl for layer in layers]  # None, unless a caller compiled them itself
    import torch._dynamo

    # a graph per width and per variant of the layer (the first layer's input needs no gradient, the others' do;
    # Gemma 3's sliding and global layers differ): past dynamo's default limit of 8 a layer would run eagerly
    config = torch._dynamo.config
    # (dynamic: one graph for every width, and room for one that dynamo specializes: 1, or equal to a fixed size)
    graphs = VARIANTS_PER_WIDTH * (2 if dynamic else widths(cfg, device.type))
    limits = {"recompile_limit": max(config.recompile_limit, graphs),
              "accumulated_recompile_limit": max(config.accumulated_recompile_limit, 2 * graphs)}
    hook = None
    try:
        new = _compile_layers(layers, key)
        if new:
            shapes = ("one graph for every width" if dynamic else
                      f"micro-batches padded to multiples of {pad_multiple(cfg, device.type)}: at most "
                      f"{widths(cfg, device.type)} widths")
            log.info("train.compile: %s: %d %s layers compiled (%s backend%s, dynamic=%s); %s", cfg.compile, new,
                     type(layers[0]).__name__, BACKEND, f", mode {MODES[cfg.compile]}" if MODES[cfg.compile] else "",
                     dynamic, shapes)
        if cfg.compile == "cudagraphs":  # on the (eager) module that runs the layers: outside every compiled graph
            hook = stack_owner(model, layers[0]).register_forward_pre_hook(
                lambda *_: torch.compiler.cudagraph_mark_step_begin())
        with config.patch(**limits), (compiled_rows(BACKEND) if dynamic else contextlib.nullcontext()), \
                compile_progress():
            yield  # on a CPU the head's cross-entropy chunk compiled too (fedllm.models.fused_head_loss)
    finally:
        if hook is not None:
            hook.remove()
        for layer, call in zip(layers, before, strict=True):
            layer._compiled_call_impl = call


progress = logging.getLogger("fedllm.compile")
"""Where compiling says what it does (shown at the default log level: a cold compile can take minutes)."""


@contextlib.contextmanager
def compile_progress() -> Iterator[None]:
    """Context: a line when dynamo starts compiling a graph and one when it is done, with the seconds it took and
    the seconds spent compiling so far (dynamo's compile callbacks; a graph found in inductor's cache is quick).
    Compiling runs on the first steps of the first client, and took from ~35 CPU-s (the quickstart; idle 2-core
    machine, cold cache) to 22 minutes (the tiny recipe on a busy one): without these lines that looked like a hung
    round."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    if progress.getEffectiveLevel() == logging.WARNING:  # fedllm's default: these lines show; FEDLLM_LOG=error not
        progress.setLevel(logging.INFO)
    started: dict[str, float] = {}
    spent = [0.0]

    def start(args) -> None:
        started[args.compile_id] = time.perf_counter()
        what = " (its backward, deferred)" if args.callback_trigger == CallbackTrigger.LAZY_BACKWARD else ""
        progress.info("train.compile: compiling graph %s%s ...", args.compile_id, what)

    def end(args) -> None:
        took = time.perf_counter() - started.pop(args.compile_id, time.perf_counter())
        spent[0] += took
        progress.info("train.compile: graph %s compiled in %.1f s (%.1f s compiling so far)", args.compile_id, took,
                      spent[0])

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)


def stack_owner(model: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``ModuleList`` holds ``layer`` (a decoder, e.g. ``LlamaModel``): it runs every layer once per
    forward pass, and is not compiled itself."""
    for module in model.modules():
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList) and any(m is layer for m in child):
                return module
    raise ValueError(f"no module holds {type(layer).__name__} in a ModuleList")


def compile_choice(cfg: TrainConfig, device_type: str) -> dict[str, object]:
    """What ``train.compile`` ran with on ``device_type``, for ``summary.json``."""
    return {"compile": cfg.compile, "backend": BACKEND if cfg.compile else None,
            "mode": MODES.get(cfg.compile) if cfg.compile else None,
            "dynamic": one_graph_for_all_widths(cfg, device_type) if cfg.compile else None,
            "pad_to_multiple_of": pad_multiple(cfg, device_type)}
