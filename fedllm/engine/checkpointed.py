"""``train.gradient_checkpointing``: a client's training with activation checkpointing of the decoder layers.

Without it a step keeps every activation each decoder layer's backward reads (the attention's and the MLP's inputs,
their products, the softmax, the LoRA inputs ...: tens of ``batch x length x hidden`` tensors per layer; the dry run's
estimate of the FRLoRA LLaMA-2-7B recipe, 16 x 512, held 42.6 of its 54.2 GB in them). With it a checkpointed layer
keeps only its input hidden state and runs its forward again, one layer at a time, when the backward reaches it:
about one more forward pass of compute (docs/performance.md). OpenFedLLM turns it on by default; fedllm's paper
recipes do too.

How: transformers' own ``activation_checkpointing_enable`` (``use_reentrant=False``; ``every_n_layers`` for the
selective form, an integer ``k``: layers 0, k, 2k, ...), set on the base model while a client trains and undone on
exit, so evaluation, generation and export never see it (transformers checkpoints a layer only in training mode
with gradients on anyway). transformers checkpoints each layer's ``forward``, so what runs inside the layer is
recomputed with it: the strategies' forward hooks on the LoRA layers (FRLoRA's residual, pFedLoRU's private
adapter, mFedLoRU's nested factors, Fed-SB's latent matrix, pFL^MF's factorised pieces, DoRA's magnitude) run
again in the recompute, on the same inputs and parameters, so the gradients are those of the run without it (fp32:
bit for bit on a CPU; ``tests/training/test_gradient_checkpointing.py``). Non-reentrant checkpointing needs no
input that requires a gradient; transformers still makes the embedding's output require one for a PEFT model
(``enable_input_require_grads``, as PEFT's ``prepare_model_for_kbit_training`` does): that hook is removed on exit.

opacus (``privacy.mechanism: dp_sgd``) records each trainable layer's input in a forward hook and pairs it with
the gradient of its output in a backward hook, counting calls: the recompute would record every input twice. While
a layer is recomputed :func:`opacus_recording_paused` turns opacus's recording off (checkpoint's ``context_fn``), so
each input is recorded once, in the forward pass, as without checkpointing.

``train.compile`` compiles each decoder layer's call (:mod:`fedllm.engine.compiled`), which runs its checkpointed
``forward``: dynamo traces ``torch.utils.checkpoint`` as one region and AOTAutograd recomputes it in the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fedllm.recipe.schema import TrainConfig


def every_n_layers(cfg: TrainConfig) -> int | None:
    """Every how many decoder layers one is checkpointed under ``train.gradient_checkpointing`` (1: every layer),
    or None when it is off."""
    value = cfg.gradient_checkpointing
    if value is False or value is None:
        return None
    return 1 if value is True else int(value)


def checkpointable(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train with ``train.gradient_checkpointing`` (None: it can): transformers must know
    how to checkpoint its layers (``supports_gradient_checkpointing``)."""
    from fedllm.models.supervised_loss import base_of

    base = base_of(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        return (f"{type(base).__name__} does not support activation checkpointing in transformers; "
                "set train.gradient_checkpointing: false")
    return None


#: opacus grad-sample modules of the phases under way (:func:`opacus_recording_paused`).
_RECORDERS: list = []


class _Recompute:
    """Around a layer's recompute: no opacus module records inputs (each recorded them in the forward pass). A class,
    not a generator: a graph kept for a second backward pass (opacus's ghost clipping) recomputes the layer again
    with the same context."""

    def __enter__(self) -> None:
        self.before = [(m, m.hooks_enabled) for m in _RECORDERS]
        for m, _ in self.before:
            m.hooks_enabled = False

    def __exit__(self, *exc) -> None:
        for m, enabled in self.before:
            m.hooks_enabled = enabled


def _contexts() -> tuple:
    """checkpoint's ``context_fn``: nothing around the forward pass; :class:`_Recompute` around the recompute."""
    return contextlib.nullcontext(), _Recompute()


@contextlib.contextmanager
def opacus_recording_paused(grad_sample_module) -> Iterator[None]:
    """Context: while a checkpointed layer is recomputed, ``grad_sample_module`` (opacus's) records no input."""
    _RECORDERS.append(grad_sample_module)
    try:
        yield
    finally:
        _RECORDERS.remove(grad_sample_module)


def _transformers_api(base: torch.nn.Module) -> tuple:
    """``(enable, disable, active)`` of ``base``'s activation checkpointing under this transformers: the
    ``activation_checkpointing_*`` names of recent releases, the ``gradient_checkpointing_*`` ones before them (5.17,
    say, which a GPU image ships), where they are not deprecated aliases yet."""
    if hasattr(base, "activation_checkpointing_enable"):
        return base.activation_checkpointing_enable, base.activation_checkpointing_disable, \
            base.is_activation_checkpointing
    return base.gradient_checkpointing_enable, base.gradient_checkpointing_disable, base.is_gradient_checkpointing


@contextlib.contextmanager
def checkpointed_training(model: torch.nn.Module, cfg: TrainConfig) -> Iterator[None]:
    """Context: ``model``'s decoder layers checkpointed under ``train.gradient_checkpointing`` while a client trains;
    as before on exit (nothing happens when the key is false).

    Raises:
        ValueError: the model's layers cannot be checkpointed (:func:`checkpointable`).
    """
    every = every_n_layers(cfg)
    if every is None:
        yield
        return
    why = checkpointable(model)
    if why:
        raise ValueError(f"train.gradient_checkpointing: {why}")
    from fedllm.models.supervised_loss import base_of

    base = base_of(model)
    enable, disable, active = _transformers_api(base)
    if active:  # the caller checkpoints the model itself: left as it is
        yield
        return
    had_input_hook = getattr(base, "_require_grads_hook", None) is not None
    kwargs: dict = {"use_reentrant": False}
    if not cfg.compile:  # opacus's pause (DP-SGD, refused with train.compile); inductor takes only dispatch modes here
        kwargs["context_fn"] = _contexts
    enable(kwargs, **({"every_n_layers": every} if every != 1 else {}))
    try:
        yield
    finally:
        disable()
        if not had_input_hook and getattr(base, "_require_grads_hook", None) is not None:
            base.disable_input_require_grads()
