"""Open-ended tasks graded 1-10 by an LLM judge, each as its benchmark's reference code ran it.

Each example is a conversation of one or more user turns; turn ``t`` is
generated after the model's own answers to the earlier turns. Answers are
sampled as the task's protocol says (:mod:`~fedllm.evaluation.judge_protocols`:
per-category temperatures, token limit), or greedily with ``eval.decoding: greedy``.
Sampled answers follow ``eval.seeding``: ``question`` (default) seeds each question
once with ``eval.seed`` and draws all its turns from that stream, one question at a
time, as FastChat's ``gen_model_answer.py`` does; ``batch`` generates them batched,
turn by turn, each batch seeded alone (fedllm's earlier scheme: faster, but an answer
depends on its batch). Greedy answers are always batched, turn by turn.

Grading is either FastChat's (the default here: turn 1 with ``single-v1``, or
``single-math-v1`` against a reference answer; turn 2 with the multi-turn prompts,
which show the judge the whole conversation; judge temperature 0) or a task's own
single-answer prompt without references (:meth:`JudgedTask.judge_prompt`: OpenFedLLM,
FedLLM-Bench). A reply without a rating counts -1 and is left out of the means (as
FastChat's ``show_result.py`` and FedLLM-Bench's ``show_results_bench.py`` do).
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Optional

from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judge_prompts import (
    NEED_REF_CATEGORIES,
    grading_messages,
    load_judge_prompts,
    parse_rating,
    prompt_name,
)
from fedllm.evaluation.judge_protocols import (
    FASTCHAT_JUDGE_TEMPERATURE,
    FASTCHAT_SAMPLING,
    AnswerSampling,
    SingleAnswerPrompt,
)
from fedllm.evaluation.metrics import mean_rating
from fedllm.evaluation.mtbench_assets import find_judge_prompts
from fedllm.evaluation.prompt_styles import PromptStyle
from fedllm.evaluation.results import ResultFile
from fedllm.evaluation.task import Task


class JudgedTask(Task):
    """Generate answers turn by turn, then ask the judge for a rating per turn.

    Subclasses give the examples and may override the protocol: :meth:`sampling` (how answers
    are generated) and :meth:`judge_prompt` (FastChat's grading, or a single-answer prompt).
    """

    def sampling(self, ctx: EvalContext) -> AnswerSampling:
        """How the protocol generates answers (default: FastChat's)."""
        return FASTCHAT_SAMPLING

    def judge_prompt(self, ctx: EvalContext) -> Optional[SingleAnswerPrompt]:
        """The protocol's own single-answer prompt, or None for FastChat's prompts (the default)."""
        return None

    reference: str = "fastchat"
    """Whose protocol the task follows (recorded in ``summary.json``)."""

    def protocol(self, ctx: EvalContext) -> Optional[str]:
        return self.reference

    def reference_style(self, ctx: EvalContext) -> Optional[PromptStyle]:
        """The answer prompt the reference scripts used for a run trained in ``ctx``'s prompt style, or
        None to prompt in the run's style (default: None)."""
        return None

    def answer_style(self, ctx: EvalContext) -> tuple[str, PromptStyle]:
        """``(name, style)`` answers are prompted in: :meth:`reference_style` under ``eval.judged_prompts:
        reference`` when the task has one for this run, else the run's own prompt style."""
        if ctx.cfg.judged_prompts == "reference":
            style = self.reference_style(ctx)
            if style is not None:
                return getattr(style, "name", None) or f"chat:{style.chat_template}", style
        return ctx.prompt_style_name, ctx.style

    def mean(self, ctx: EvalContext, ratings: list[float]) -> float:
        """Mean rating under ``eval.judge.ratings`` (``minus_one`` averages unparsed ones in as -1)."""
        return mean_rating(ratings, unparsed_as_minus_one=ctx.cfg.judge.ratings == "minus_one")

    def temperature(self, ctx: EvalContext, category: str) -> float:
        """The answer temperature of a question (0 under ``eval.decoding: greedy``)."""
        return 0.0 if ctx.cfg.decoding == "greedy" else self.sampling(ctx).temperature(category)

    @abc.abstractmethod
    def examples(self, ctx: EvalContext) -> list[dict]:
        """``{"id", "category", "turns": [...], "references": [...] or None}`` per example.

        An example may also hold ``instruction`` and ``input`` (its first turn split the
        Alpaca way, used by the ``alpaca`` prompt style).
        """

    def summarize(self, ctx: EvalContext, ratings: list[list[float]]) -> dict[str, float]:
        """Metrics from the ratings of every example (one list of per-turn ratings each)."""
        flat = [r for per_example in ratings for r in per_example]
        return {"rating": self.mean(ctx, flat), "unparsed": float(sum(r < 0 for r in flat))}

    # ----------------------------------------------------------------- generation

    @staticmethod
    def _turn_prompt(style: PromptStyle, ex: dict, outputs: list[str], turn: int) -> str:
        """The prompt of ``ex``'s turn ``turn``, after the model's own ``outputs`` to the earlier turns."""
        messages = []
        for q, a in zip(ex["turns"][:turn], outputs[:turn], strict=True):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        user = {"role": "user", "content": ex["turns"][turn]}
        if turn == 0 and "instruction" in ex:
            user.update(instruction=ex["instruction"], input=ex.get("input", ""))
        messages.append(user)
        return style.render(messages)

    @staticmethod
    def _stored_output(results: ResultFile, ex: dict, temperature: float, turn: int, prompt: str) -> Optional[str]:
        """The stored answer to ``ex``'s turn ``turn`` if it was generated from ``prompt`` at ``temperature``."""
        stored = results.get(ex["id"])
        if (stored and len(stored.get("prompts", [])) > turn and stored["prompts"][turn] == prompt
                and stored.get("turns") == ex["turns"] and stored.get("temperature") == temperature):
            return stored["outputs"][turn]
        return None

    def _generate_turns(self, ctx: EvalContext, examples: list[dict], results: ResultFile,
                        max_new_tokens: int, style: PromptStyle) -> None:
        """Answer every turn of every example: sampled examples one question at a time under ``eval.seeding:
        question``, everything else batched turn by turn (each sampled batch seeded alone)."""
        ids = [ex["id"] for ex in examples]
        entries = {ex["id"]: {"id": ex["id"], "category": ex["category"], "turns": ex["turns"],
                              "temperature": self.temperature(ctx, ex["category"]), "prompts": [], "outputs": []}
                   for ex in examples}

        def save(*done: dict) -> None:
            for entry in done:
                results.put(dict(entry))
            results.save(ids)

        def one_stream(ex: dict) -> bool:
            return ctx.cfg.seeding == "question" and entries[ex["id"]]["temperature"] > 0

        generate = dict(ctx=ctx, max_new_tokens=max_new_tokens, style=style, results=results, save=save)
        self._generate_in_batches(examples=[ex for ex in examples if not one_stream(ex)], entries=entries, **generate)
        for ex in examples:
            if one_stream(ex):
                self._generate_question(ex=ex, entry=entries[ex["id"]], **generate)
        for entry in entries.values():
            stored = results.get(entry["id"])
            results.put({**(stored or {}), **entry})

    def _generate_question(self, ctx: EvalContext, ex: dict, entry: dict, max_new_tokens: int, style: PromptStyle,
                           results: ResultFile, save) -> None:
        """Sample every turn of one question from one random stream seeded once, as FastChat does.

        FastChat ``fastchat/llm_judge/gen_model_answer.py``, ``get_model_answers``: for each question
        (and each choice ``i``) it calls ``torch.manual_seed(i)`` once, then generates turn 1 and, after
        the model's own first answer, turn 2, without reseeding, so turn 2 continues the stream turn 1
        drew from (OpenFedLLM's ``gen_model_answer_mt.py`` does the same). Here the seed is
        ``eval.seed`` (0 by default, FastChat's single choice) and the global RNG state is restored
        afterwards. Stored answers are reused only when every turn of the question is stored, since a
        later turn's draw depends on the earlier ones.
        """
        outputs: list[str] = []
        prompts: list[str] = []
        for turn in range(len(ex["turns"])):
            prompt = self._turn_prompt(style, ex, outputs, turn)
            text = self._stored_output(results, ex, entry["temperature"], turn, prompt)
            if text is None:
                break
            prompts.append(prompt)
            outputs.append(text)
        else:
            entry.update(prompts=prompts, outputs=outputs)
            return
        entry.update(prompts=[], outputs=[])
        top_p = self.sampling(ctx).top_p
        with ctx.seeded_stream():
            for turn in range(len(ex["turns"])):
                prompt = self._turn_prompt(style, ex, entry["outputs"], turn)
                text = ctx.generate([prompt], max_new_tokens, desc=f"{self.name} {ex['id']} turn {turn + 1}",
                                    temperature=entry["temperature"], top_p=top_p, stop=style.stop, reseed=False)[0]
                entry["prompts"].append(prompt)
                entry["outputs"].append(text)
        save(entry)

    def _generate_in_batches(self, ctx: EvalContext, examples: list[dict], entries: dict, max_new_tokens: int,
                             style: PromptStyle, results: ResultFile, save) -> None:
        """Turn 1 of every example, then turn 2, ...: batched, grouped by answer temperature; a sampled
        batch draws from ``torch.manual_seed(eval.seed + its offset)`` (:func:`~fedllm.evaluation.generation.
        generate_completions`), so its answers depend on the batch they were generated in."""
        top_p = self.sampling(ctx).top_p
        for turn in range(max((len(ex["turns"]) for ex in examples), default=0)):
            todo, prompts = [], []
            for ex in examples:
                if turn >= len(ex["turns"]):
                    continue
                entry = entries[ex["id"]]
                prompt = self._turn_prompt(style, ex, entry["outputs"], turn)
                text = self._stored_output(results, ex, entry["temperature"], turn, prompt)
                if text is not None:
                    entry["prompts"].append(prompt)
                    entry["outputs"].append(text)
                    continue
                todo.append(ex["id"])
                prompts.append(prompt)

            groups: dict[float, list[int]] = {}
            for j, ex_id in enumerate(todo):
                groups.setdefault(entries[ex_id]["temperature"], []).append(j)
            for temperature, members in sorted(groups.items()):
                def store(batch: list[int], outputs: list[str], members=members) -> None:
                    done = [entries[todo[members[b]]] for b in batch]
                    for b, entry, text in zip(batch, done, outputs, strict=True):
                        entry["prompts"].append(prompts[members[b]])
                        entry["outputs"].append(text)
                    save(*done)

                ctx.generate([prompts[j] for j in members], max_new_tokens, on_batch=store,
                             desc=f"{self.name} turn {turn + 1}", temperature=temperature, top_p=top_p,
                             stop=style.stop)

    # ----------------------------------------------------------------- judging

    def _fastchat_requests(self, prompts: dict[str, dict], ex: dict,
                           outputs: list[str]) -> list[tuple[str, list[dict]]]:
        """FastChat's grading requests of one example, one per turn: ``(prompt name, messages)``."""
        refs: Optional[list[str]] = ex.get("references")
        use_ref = bool(refs) and ex["category"] in NEED_REF_CATEGORIES
        out = []
        for turn in range(len(ex["turns"])):
            name = prompt_name(use_ref, multi_turn=turn > 0)
            out.append((name, grading_messages(prompts[name], ex["turns"][: turn + 1], outputs[: turn + 1],
                                               refs[: turn + 1] if use_ref else None)))
        return out

    def _judge(self, ctx: EvalContext, examples: list[dict], results: ResultFile) -> list[list[float]]:
        single = self.judge_prompt(ctx)
        temperature = single.temperature if single is not None else FASTCHAT_JUDGE_TEMPERATURE
        fastchat = load_judge_prompts(find_judge_prompts(ctx.data_spec("judge_prompts"))) if single is None else {}
        requests, where = [], []
        for ex in examples:
            entry = results.get(ex["id"])
            if single is None:
                asked = self._fastchat_requests(fastchat, ex, entry["outputs"])
            else:
                asked = [(single.name, single.messages(q, a))
                         for q, a in zip(ex["turns"], entry["outputs"], strict=True)]
            for turn, (name, msgs) in enumerate(asked):
                requests.append(msgs)
                where.append((entry, turn, name))
        judge = ctx.judge_client()
        replies = judge.judge_many(requests, desc=f"{self.name} judge", temperature=temperature)
        ratings: dict = {}
        for (entry, turn, name), msgs, reply in zip(where, requests, replies, strict=True):
            rating = parse_rating(reply, f"{self.name} example {entry['id']} turn {turn + 1}",
                                  in_range=ctx.cfg.judge.ratings == "in_range")
            judgments = entry.setdefault("judgments", [])
            del judgments[turn:]
            judgments.append({"judge_model": judge.model, "prompt_name": name, "judge_temperature": temperature,
                              "judge_prompt": msgs[-1]["content"], "judgment": reply, "rating": rating})
            ratings.setdefault(entry["id"], []).append(rating)
        return [ratings[ex["id"]] for ex in examples]

    def run(self, ctx: EvalContext) -> dict[str, float]:
        examples = self.examples(ctx)
        sampling = self.sampling(ctx)
        max_new_tokens = ctx.max_new_tokens(sampling.max_new_tokens)
        style_name, style = self.answer_style(ctx)
        settings = {**ctx.generation_settings(max_new_tokens), "prompt_style": style_name,
                    "judged_prompts": ctx.cfg.judged_prompts, "stop": style.stop, "decoding": ctx.cfg.decoding,
                    "seed": ctx.cfg.seed, "seeding": ctx.cfg.seeding,
                    "temperatures": {"default": sampling.default_temperature, **sampling.temperatures},
                    "top_p": sampling.top_p if sampling.top_p is not None else "generation_config"}
        results = ctx.result_file(self.name, settings)
        ids = [ex["id"] for ex in examples]
        self._generate_turns(ctx, examples, results, max_new_tokens, style)
        results.save(ids)
        ratings = self._judge(ctx, examples, results)
        results.metrics = self.summarize(ctx, ratings)
        results.save(ids)
        return dict(results.metrics)


def read_reference_answers(path: Optional[Path]) -> dict:
    """FastChat reference answers (``question_id -> [turn answers]``) of a ``gpt-4.jsonl`` file."""
    if path is None:
        return {}
    refs = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            refs[item["question_id"]] = item["choices"][0]["turns"]
    return refs
