"""How FlowerTune's evaluation code calls ``generate`` (each challenge its own way), on fedllm's model in memory.

- General NLP / Medical (``benchmarks.inference``): one prompt at a time (no padding),
  ``tokenizer.encode(prompt)`` (the tokenizer's special tokens included), greedy, ``max_new_tokens`` = the
  token count of the first reference answer of each batch of 16, decoded without special tokens.
- Finance (``benchmarks.inference``): batches of 32, padded, ``max_length=512`` (prompt included), the
  model's own generation config (greedy unless it says otherwise), ``torch.manual_seed(2024)`` first; each
  row decoded whole (prompt included) without special tokens.

Batches are cut from a data set's full row order, whatever a resumed evaluation still has to do: a row's
``max_new_tokens`` (General NLP / Medical) is its full-order batch's, and a finance row is generated in its
full-order padded batch (a batch holding a row still to do is generated whole; every batch when the model
samples, since each batch draws from the stream the earlier ones left), so a resumed evaluation's answers are
an uninterrupted one's. Each answer is stored with its ``max_new_tokens`` or finance ``batch`` and reused only
where the run's full row order gives the same (a ``--limit`` run's last finance batch is smaller than a full
run's: its rows are generated again in the full batch).
- Code (bigcode-evaluation-harness ``parallel_generations``/``complete_code`` with FlowerTune's command):
  ``set_seed(0)`` per data set, each prompt (truncated from the left to ``max_length``) sampled
  ``num_return_sequences=4`` times (``--batch_size=4``, ``n_samples=1``) at temperature 0.2, top-p 0.95,
  top-k 0, ``max_length`` 1024 (MBPP 2048) tokens, stopping when every sample contains a stop word.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from fedllm.evaluation.generation import _inference_mode, model_device, seeded_rng

CHOICE_TOKEN_BATCH = 16
"""FlowerTune's ``--batch-size`` of General NLP and Medical: the first reference of each batch sets the limit."""
FINANCE_BATCH = 32
FINANCE_MAX_LENGTH = 512
FINANCE_SEED = 2024
CODE_SAMPLES = 4
CODE_SEED = 0


def choice_token_limits(tokenizer, golds: Sequence[str]) -> list[int]:
    """``max_new_tokens`` of each answer: the token count of the first reference of its batch of 16."""
    limits = []
    for start in range(0, len(golds), CHOICE_TOKEN_BATCH):
        n = len(tokenizer(golds[start], add_special_tokens=False)["input_ids"])
        limits += [n] * len(golds[start:start + CHOICE_TOKEN_BATCH])
    return limits


def greedy_each(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """One prompt, unpadded, greedy; the continuation without special tokens."""
    with _inference_mode(model, tokenizer):
        ids = tokenizer.encode(prompt, return_tensors="pt").to(model_device(model))
        out = model.generate(inputs=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0][ids.shape[1]:], skip_special_tokens=True)


def finance_batch(index: int, total: int) -> tuple[int, int]:
    """``(start, end)`` of the finance batch row ``index`` of ``total`` rows is generated in."""
    start = index - index % FINANCE_BATCH
    return start, min(start + FINANCE_BATCH, total)


def finance_decoded(model, tokenizer, prompts: Sequence[str],
                    on_batch: Callable[[int, list[str]], None] | None = None,
                    todo: Collection[int] | None = None) -> dict[int, str]:
    """Each prompt's whole decoded row (prompt + continuation), as FlowerTune's finance ``inference``, by index.

    Args:
        prompts: every prompt of the data set, in its row order (the batches of :data:`FINANCE_BATCH` are cut
            from it).
        on_batch: called with each generated batch's first index and its decoded rows.
        todo: indices still to answer (None: all); only their batches are generated, unless the model's
            generation config samples (then every batch, so that each draws from the stream it draws from in a
            full run).

    Returns:
        ``{index: decoded row}`` of every generated batch's rows (all of ``todo``'s at least).
    """
    rows: dict[int, str] = {}
    needed = set(range(len(prompts)) if todo is None else todo)
    every = bool(getattr(getattr(model, "generation_config", None), "do_sample", False))
    device = model_device(model)
    with _inference_mode(model, tokenizer), seeded_rng(FINANCE_SEED, device):
        for start in range(0, len(prompts), FINANCE_BATCH):
            span = range(*finance_batch(start, len(prompts)))
            if not every and needed.isdisjoint(span):
                continue
            batch = [prompts[i] for i in span]
            tokens = tokenizer(batch, return_tensors="pt", padding=True, return_token_type_ids=False).to(device)
            out = model.generate(**tokens, max_length=FINANCE_MAX_LENGTH, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            decoded = [tokenizer.decode(row, skip_special_tokens=True) for row in out]
            rows.update(zip(span, decoded, strict=True))
            if on_batch is not None:
                on_batch(start, decoded)
    return rows


def code_samples(model, tokenizer, prompts: Sequence[str], stop_words: Sequence[str], max_length: int,
                 on_problem: Callable[[int, list[str]], None] | None = None) -> list[list[str]]:
    """:data:`CODE_SAMPLES` continuations per prompt (special tokens kept, so an end-of-text token shows as text
    and ends the program at the stop-word cut), sampled from one seeded stream over the data set."""
    from transformers import set_seed

    device = model_device(model)
    side = tokenizer.truncation_side
    out: list[list[str]] = []
    with _inference_mode(model, tokenizer):
        tokenizer.truncation_side = "left"
        try:
            set_seed(CODE_SEED)
            for i, prompt in enumerate(prompts):
                ids = tokenizer(prompt, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
                ids = ids.to(device)
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=0.2, top_p=0.95, top_k=0, max_length=max_length,
                                     num_return_sequences=CODE_SAMPLES, stop_strings=list(stop_words),
                                     tokenizer=tokenizer, pad_token_id=tokenizer.eos_token_id)
                texts = [tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False) for row in gen]
                out.append(texts)
                if on_problem is not None:
                    on_problem(i, texts)
        finally:
            tokenizer.truncation_side = side
    return out
