"""Batched generation with left padding for evaluation and serving.

Prompts are tokenised once, sorted by length (so a batch holds prompts of
similar length and little padding), generated in batches with left padding and
returned in the caller's order. Only the new tokens are decoded; a sequence
stops at an end-of-sequence token, at ``max_new_tokens`` or at one of the
``stop`` strings (cut off from the text).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from tqdm.auto import tqdm


@dataclass
class Completion:
    """One generated continuation.

    Attributes:
        text: decoded new tokens, cut at the first stop string.
        prompt_tokens: tokens in the prompt.
        completion_tokens: new tokens generated (up to and excluding eos).
        finish_reason: ``"stop"`` (eos or a stop string) or ``"length"``.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class _StopOnStrings:
    """Stopping criterion: a row is done once its new text contains a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_len: int):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_len:]
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        done = [any(s in t for s in self.stop) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _inference_mode(model, tokenizer) -> Iterator[None]:
    """model.eval(), left padding and a pad token for the duration; restore afterwards."""
    from fedllm.models.lm_head_input import keep_lm_head_input_contiguous

    was_training = model.training
    side = tokenizer.padding_side
    pad = tokenizer.pad_token
    keep_lm_head_input_contiguous(model)  # a model not loaded by fedllm too (its prompt pass: 3-5x faster)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        with torch.no_grad():
            yield
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = None
        model.train(was_training)


@contextlib.contextmanager
def seeded_rng(seed: Optional[int], device: torch.device) -> Iterator[None]:
    """Seed torch's RNGs for the duration (None: leave them alone); restore their state afterwards.

    Generations inside draw from one stream in call order (``seed=None`` calls of
    :func:`generate_completions` do not reseed it).
    """
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids of the tokenizer and of the model's generation config."""
    ids: list[int] = []
    candidates = [tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def _encode(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt``; no second BOS when the prompt (a chat template) already has one."""
    bos = tokenizer.bos_token
    add_special = not (bos and prompt.startswith(bos))
    return tokenizer(prompt, add_special_tokens=add_special)["input_ids"]


def _cut(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((text.index(s) for s in stop if s in text), default=None)
    return (text, False) if cut is None else (text[:cut], True)


def model_device(model) -> torch.device:
    """The device of the model's (first) parameters."""
    return next(model.parameters()).device


def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
    stop: Optional[Sequence[str]] = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_batch: Optional[Callable[[list[int], list[Completion]], None]] = None,
    desc: str = "generate",
    top_k: Optional[int] = 0,
    seed: Optional[int] = None,
) -> list[Completion]:
    """Generate a continuation of every prompt (greedy unless ``temperature`` > 0).

    Args:
        model: a causal LM (plain or PEFT); its train/eval state is restored afterwards.
        tokenizer: its tokenizer; padding side and pad token are restored afterwards.
        prompts: fully formatted prompt strings.
        max_new_tokens: generation limit per prompt.
        batch_size: prompts per forward batch.
        progress: show a progress bar over prompts.
        stop: strings that end a generation (removed with what follows).
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus sampling mass when sampling (None: the model's generation config, as a plain
            ``model.generate(do_sample=True)`` call in FastChat uses).
        on_batch: called after each batch with the prompt indices and their completions
            (lets callers save partial results).
        desc: progress bar label.
        top_k: top-k filter when sampling (0: none; None: the model's generation config, as
            a plain ``model.generate(do_sample=True)`` call in FastChat or OpenFedLLM uses).
        seed: when sampling, each batch draws from ``torch.manual_seed(seed + index of its
            first prompt in length order)`` (the global RNG state is restored afterwards), so
            the same prompts, batch size and seed give the same texts. None: draw from torch's
            current random stream (e.g. one the caller seeded with :func:`seeded_rng`).

    Returns:
        One :class:`Completion` per prompt, in the order of ``prompts``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stop = [s for s in (stop or []) if s]
    encoded = [_encode(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
    results: list[Optional[Completion]] = [None] * len(prompts)
    eos = eos_token_ids(model, tokenizer)
    device = model_device(model)
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, leave=False)
    with _inference_mode(model, tokenizer):
        pad_id = tokenizer.pad_token_id
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
            input_ids = batch["input_ids"].to(device)
            prompt_len = input_ids.shape[1]
            kwargs = dict(
                attention_mask=batch["attention_mask"].to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos or None,
            )
            if temperature > 0:
                kwargs.update(do_sample=True, temperature=temperature)
                if top_p is not None:
                    kwargs["top_p"] = top_p
                if top_k is not None:
                    kwargs["top_k"] = top_k
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            if stop:
                kwargs["stopping_criteria"] = [_StopOnStrings(tokenizer, stop, prompt_len)]
            with seeded_rng(seed + start if seed is not None and temperature > 0 else None, device):
                out = model.generate(input_ids=input_ids, **kwargs)
            done = []
            for row, i in enumerate(idx):
                new = out[row, prompt_len:].tolist()
                hit_eos = False
                for pos, tok in enumerate(new):
                    if tok in eos:
                        new, hit_eos = new[:pos], True
                        break
                text, hit_stop = _cut(tokenizer.decode(new, skip_special_tokens=True), stop)
                reason = "stop" if hit_eos or hit_stop or len(new) < max_new_tokens else "length"
                results[i] = Completion(text.strip(), len(encoded[i]), len(new), reason)
                done.append(results[i])
            if on_batch is not None:
                on_batch(list(idx), done)
            bar.update(len(idx))
    bar.close()
    return results  # type: ignore[return-value]


def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int,
             progress: bool = True, stop: Optional[Sequence[str]] = None,
             on_batch: Optional[Callable[[list[int], list[str]], None]] = None,
             desc: str = "generate", temperature: float = 0.0, seed: Optional[int] = None,
             top_p: Optional[float] = 1.0) -> list[str]:
    """Batched generation (greedy unless ``temperature`` > 0); returns the decoded new text of every prompt.

    Args:
        model: a causal LM (plain or PEFT).
        tokenizer: its tokenizer.
        prompts: fully formatted prompt strings.
        max_new_tokens: generation limit per prompt.
        batch_size: prompts per forward batch.
        progress: show a progress bar.
        stop: strings that end a generation (removed with what follows).
        on_batch: called after each batch with the prompt indices and their texts.
        desc: progress bar label.
        temperature: 0 for greedy decoding, else sample at this temperature (top-k from the
            model's generation config, as the reference evaluation scripts do).
        seed: seed of the sampled draws (see :func:`generate_completions`).
        top_p: nucleus mass when sampling (None: the model's generation config).

    Returns:
        The generated texts, in the order of ``prompts``.
    """
    hook = None
    if on_batch is not None:
        def hook(indices: list[int], comps: list[Completion]) -> None:
            on_batch(indices, [c.text for c in comps])
    comps = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size, progress=progress,
                                 stop=stop, on_batch=hook, desc=desc, temperature=temperature, top_p=top_p,
                                 top_k=None, seed=seed)
    return [c.text for c in comps]
