"""What a task needs to run: the model, its tokenizer, the eval config, outputs and the judge."""

from __future__ import annotations

import contextlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from fedllm.evaluation import generation
from fedllm.evaluation.judge_cache import JudgmentCache
from fedllm.evaluation.judge_client import Complete, JudgeClient
from fedllm.evaluation.prompt_styles import PromptStyle, default_prompt_style, make_prompt_style
from fedllm.evaluation.results import ResultFile, model_fingerprint
from fedllm.recipe.schema import EvalConfig

JUDGE_CACHE_FILE = "judge_cache.jsonl"


def file_suffix(tag: str) -> str:
    """``.<tag>`` made safe for a file name (``"round 5"`` -> ``".round-5"``), or ``""``."""
    safe = re.sub(r"[^\w.-]+", "-", tag).strip("-.")
    return f".{safe}" if safe else ""


@dataclass
class EvalContext:
    """Shared state of one :func:`~fedllm.evaluation.runner.evaluate` call.

    Attributes:
        model: the (PEFT or plain) model under evaluation.
        tokenizer: its tokenizer.
        cfg: the eval section of the recipe.
        out_dir: where result files and the judge cache go; None keeps everything in memory.
        tag: suffix of result file names (e.g. a client id for personal models).
        records: held-out raw records of the training data (gsm8k, ref_gpt4).
        eval_examples: held-out tokenized classification examples (input_ids, label).
        prompt_style_name: registry name of the prompt style; None picks the default.
        judge: a :class:`JudgeClient`, or a completion function to build one around; None
            builds one from ``cfg.judge`` on first use.
        progress: show progress bars.
        preference: ``train.preference`` of a DPO run (the rewards ``pref_accuracy`` reports), or None.
        reference_policy: the model under evaluation is the one the examples' reference log-probabilities were
            computed from (a run's evaluation before round 1): ``pref_accuracy`` reads its policy's
            log-probabilities from them rather than computing them again.
    """

    model: Any
    tokenizer: Any
    cfg: EvalConfig
    out_dir: Optional[Path] = None
    tag: str = ""
    records: Optional[list[dict]] = None
    eval_examples: Optional[Sequence[dict]] = None
    prompt_style_name: Optional[str] = None
    judge: Union[JudgeClient, Complete, None] = None
    progress: bool = True
    preference: Any = None
    reference_policy: bool = False
    _fingerprint: Optional[str] = field(default=None, repr=False)
    _style: Optional[PromptStyle] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_style_name is None:
            self.prompt_style_name = default_prompt_style(self.tokenizer, self.cfg.chat_template)

    @property
    def style(self) -> PromptStyle:
        """The prompt style of generative tasks."""
        if self._style is None:
            self._style = make_prompt_style(self.prompt_style_name, self.tokenizer, self.cfg.chat_template)
        return self._style

    @property
    def fingerprint(self) -> str:
        """Hash of the model weights (result files of another model are not resumed)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def data_spec(self, task: str) -> Optional[str]:
        """The user's data spec for ``task`` (``eval.data[task]``), or None."""
        return self.cfg.data.get(task)

    def limited(self, items: list) -> list:
        """The first ``eval.limit`` items (all when no limit is set)."""
        return items if self.cfg.limit is None else items[: self.cfg.limit]

    def stratified(self, items: list, category: Callable[[Any], str]) -> list:
        """``eval.limit`` items drawn across categories (all items when no limit is set).

        The categories are visited in a seeded random order, round robin, each giving its
        next item in a seeded shuffle, until ``eval.limit`` items are taken; they are
        returned in their original order. A limit of at least the number of categories
        therefore covers every category (every judge prompt of MT-Bench); the same seed
        takes the same items.
        """
        if self.cfg.limit is None or self.cfg.limit >= len(items):
            return list(items)
        rng = random.Random(self.cfg.seed)
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(category(item), []).append(i)
        order = list(groups)
        rng.shuffle(order)
        for name in order:
            rng.shuffle(groups[name])
        picked: list[int] = []
        while len(picked) < self.cfg.limit:
            for name in order:
                if groups[name] and len(picked) < self.cfg.limit:
                    picked.append(groups[name].pop())
        return [items[i] for i in sorted(picked)]

    def max_new_tokens(self, default: int) -> int:
        """``eval.max_new_tokens`` if set, else the task protocol's ``default``."""
        return self.cfg.max_new_tokens if self.cfg.max_new_tokens is not None else default

    def result_file(self, task: str, settings: dict) -> ResultFile:
        """The result file of ``task`` under ``out_dir`` (``<task>[.<tag>].json``)."""
        path = None
        if self.out_dir is not None:
            path = Path(self.out_dir) / f"{task}{file_suffix(self.tag)}.json"
        return ResultFile(path, task, settings)

    def generation_settings(self, max_new_tokens: int) -> dict:
        """The settings generated outputs depend on (``max_new_tokens``: the limit in force)."""
        return {"model": self.fingerprint, "max_new_tokens": max_new_tokens,
                "prompt_style": self.prompt_style_name, "chat_template": self.cfg.chat_template}

    def generate(self, prompts: list[str], max_new_tokens: int,
                 on_batch: Optional[Callable[[list[int], list[str]], None]] = None,
                 desc: str = "generate", temperature: float = 0.0, top_p: Optional[float] = 1.0,
                 stop: Optional[list[str]] = None, reseed: bool = True) -> list[str]:
        """Batched generation of ``prompts`` with ``stop`` (None: the prompt style's stop strings).

        Greedy at ``temperature`` 0, else sampled: each batch seeded with ``eval.seed`` (reruns are
        identical), or with ``reseed`` False from the stream of an enclosing :meth:`seeded_stream`.
        ``top_p`` None takes the model's generation config.
        """
        return generation.generate(self.model, self.tokenizer, prompts, max_new_tokens, self.cfg.batch_size,
                                   progress=self.progress, stop=self.style.stop if stop is None else stop,
                                   on_batch=on_batch, desc=desc, temperature=temperature, top_p=top_p,
                                   seed=self.cfg.seed if temperature > 0 and reseed else None)

    def seeded_stream(self) -> contextlib.AbstractContextManager:
        """``torch.manual_seed(eval.seed)`` for the duration (the global RNG state is restored afterwards):
        :meth:`generate` calls with ``reseed=False`` inside draw from that one stream, in call order."""
        return generation.seeded_rng(self.cfg.seed, generation.model_device(self.model))

    def judge_client(self) -> JudgeClient:
        """The judge, built on first use (its cache lives in ``out_dir``)."""
        if not isinstance(self.judge, JudgeClient):
            cache = JudgmentCache(Path(self.out_dir) / JUDGE_CACHE_FILE if self.out_dir is not None else None)
            if self.judge is None:
                self.judge = JudgeClient(self.cfg.judge, cache, progress=self.progress)
            else:
                name = getattr(self.judge, "model", None) or getattr(self.judge, "__name__", "custom")
                self.judge = JudgeClient(self.cfg.judge, cache, complete=self.judge, model=str(name),
                                         progress=self.progress)
        return self.judge
