"""`fedllm eval CHECKPOINT_OR_RUN_DIR --tasks ...`: evaluate a run, checkpoint, exported model or hub model.

The eval section of the run's recipe (when the path belongs to a run) is the
starting point; flags override it. Results go to ``--out`` (default:
``<path>/eval``, or ``eval_results/<name>`` for a hub model); re-running with
the same directory resumes. The judge's API key is only ever read from the
environment variable named by ``--judge-api-key-env``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Optional

from fedllm.common.errors import InputError, check_local_path, did_you_mean
from fedllm.common.registry import tasks
from fedllm.evaluation.prompt_styles import prompt_styles
from fedllm.evaluation.report import markdown_table
from fedllm.recipe.schema import EvalConfig, Recipe

log = logging.getLogger("fedllm")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedllm eval``."""
    parser.add_argument("checkpoint", help="run directory, round checkpoint, exported model, preset or hub id")
    parser.add_argument("--tasks", default=None, help=f"comma-separated tasks (default: the run's eval.tasks); "
                                                      f"known: {', '.join(tasks.names())}")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate N examples of each task (the first N; for judged tasks a seeded sample "
                             "stratified across categories)")
    parser.add_argument("--data", action="append", default=[], metavar="TASK=SPEC",
                        help="data of a task: local file/dir or hub id[:config][@split] (repeatable); "
                             "also judge_prompts=PATH")
    parser.add_argument("--out", default=None, help="results directory (re-running with it resumes)")
    parser.add_argument("--batch-size", type=int, default=None, help="generation batch size")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="generation limit (default: each task protocol's, see eval/README.md)")
    parser.add_argument("--decoding", choices=["protocol", "greedy"], default=None,
                        help="judged tasks: sample answers as the benchmark's protocol does (default), or greedy")
    parser.add_argument("--seed", type=int, default=None, help="seed of sampled answers and of a --limit sample")
    parser.add_argument("--seeding", choices=["question", "batch"], default=None,
                        help="judged tasks' sampled answers: seeded once per question, its turns from one stream, "
                             "as FastChat (default), or once per generation batch (batched, faster)")
    parser.add_argument("--shots", type=int, default=None, help="few-shot exemplars (gsm8k, 0-8)")
    parser.add_argument("--answer-protocol", choices=["fedllm", "metamath", "lm_eval"], default=None,
                        help="gsm8k/math/math500: fedllm's lenient scorer, MetaMath's eval scripts, or "
                             "lm-evaluation-harness (default: the run's eval.answer_protocol, else fedllm)")
    parser.add_argument("--judged-prompts", choices=["reference", "training"], default=None,
                        help="judged tasks of Alpaca-style runs: the reference scripts' prompts (default) or "
                             "the run's training prompt for every turn")
    parser.add_argument("--prompt-style", choices=prompt_styles.names(), default=None,
                        help="alpaca, chat or plain (default: the run's eval.prompt_style, else as it was trained, "
                             "else chat if the tokenizer has a chat template, else plain)")
    parser.add_argument("--chat-template", default=None, help="FastChat conversation template name (needs fschat)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                        help="weights dtype (default: a run or checkpoint in its recipe's model.dtype, as its own "
                             "evaluations ran; fp32 for anything else and under --quantization)")
    parser.add_argument("--quantization", choices=["none", "4bit", "4bit-flowertune", "4bit-qlora", "8bit"],
                        default=None,
                        help="load the model through bitsandbytes: 4bit-flowertune as FlowerTune's eval.py (FP4), "
                             "4bit-qlora as QLoRA (NF4), 4bit the first when every task is flowertune_general_nlp/"
                             "medical/finance (the board evaluates them in 4-bit), else the second (default: the "
                             "run's eval.quantization, else none)")
    parser.add_argument("--allow-code-execution", action="store_true", default=None,
                        help="run model-written programs (flowertune_code) in fedllm's sandbox")
    parser.add_argument("--client", type=client_choice, default=None,
                        help="personalized runs: evaluate this client's personal model, or 'all' of them, each on "
                             "its own held-out split (per client and mean/min/max)")
    parser.add_argument("--judge-base-url", default=None, help="OpenAI-compatible endpoint of the judge")
    parser.add_argument("--judge-model", default=None, help="judge model name")
    parser.add_argument("--judge-api-key-env", default=None,
                        help="environment variable holding the judge's API key (default: OPENAI_API_KEY)")
    parser.add_argument("--judge-concurrency", type=int, default=None, help="parallel judge requests")
    parser.add_argument("--judge-protocol", choices=["openfedllm", "fastchat"], default=None,
                        help="Vicuna grading protocol (default openfedllm, as the FRLoRA paper)")
    parser.add_argument("--judge-ratings", choices=["reference", "minus_one", "in_range"], default=None,
                        help="rating means as the references keep them (default), unparsed counted as -1 "
                             "(OpenFedLLM's Vicuna), or ratings outside 1-10 counted as unparsed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse_task_list(text: Optional[str]) -> list[str]:
    """``"gsm8k, mt_bench"`` -> ``["gsm8k", "mt_bench"]``; InputError naming unknown tasks."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    from fedllm.evaluation.task_names import known_task

    unknown = [t for t in names if not known_task(t)]
    if unknown:
        hints = "".join(did_you_mean(t, tasks.names()) for t in unknown)
        raise InputError(f"--tasks: unknown task(s) {', '.join(unknown)}{hints}; known: {', '.join(tasks.names())} "
                         f"and lm_eval:<lm-evaluation-harness task>")
    return names


def parse_data_specs(items: list[str]) -> dict[str, str]:
    """``["gsm8k=path", ...]`` -> ``{"gsm8k": "path"}``; InputError for an item without ``=``."""
    specs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InputError(f"--data {item!r}: expected TASK=PATH_OR_HUB_ID")
        specs[key.strip()] = value.strip()
    return specs


def find_run_recipe(path: str) -> Optional[Path]:
    """The ``recipe.yaml`` of the run that ``path`` (run dir, checkpoint, ``final/``) belongs to, if any."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    for candidate in (p, p.parent, p.parent.parent):
        if (candidate / "recipe.yaml").is_file():
            return candidate / "recipe.yaml"
    return None


HELD_OUT_TASKS = ("held_out", "pref_accuracy")
"""Tasks that score the run's tokenized held-out records."""


def heldout_records(recipe: Recipe) -> Optional[list[dict]]:
    """The run's held-out raw records (its eval source, or the ``eval_fraction`` split), or None."""
    from fedllm.data import load_records
    from fedllm.data.federated import select_records

    d = recipe.data
    if d.eval_path or d.eval_split:
        return load_records(d.eval_path or d.path, None if d.eval_path else d.name, d.eval_split or "test")
    if d.eval_fraction > 0 and d.path:
        records = load_records(d.path, d.name, d.split)
        _, eval_ids = select_records(records, d, recipe.seed)
        return [records[i] for i in eval_ids]
    return None


def heldout_examples(recipe: Recipe, tokenizer: Any, checkpoint: str,
                     records: Optional[list[dict]]) -> Optional[list[dict]]:
    """The run's held-out ``records`` tokenized as in training (bad records left out); a preference run's pairs
    each with the reference log-probabilities the run computed for it before round 1 when the checkpoint keeps
    them (else none: the adapter-disabled base is the reference)."""
    from fedllm.data.formats import make_encoder
    from fedllm.data.validation import bad_record_kind
    from fedllm.engine.reference import HELD_OUT, REFERENCE_KEY
    from fedllm.runs import checkpoint as ckpt_io

    if not records:
        return None
    encode = make_encoder(tokenizer, recipe.data, recipe.train.max_length)
    examples = [ex for r in records if bad_record_kind(r, recipe.data) is None and (ex := encode(r)) is not None]
    if recipe.data.format != "preference":
        return examples
    store = ckpt_io.client_store(ckpt_io.load_checkpoint(ckpt_io.resolve_checkpoint(Path(checkpoint))))
    return list(kept_reference(recipe, examples, store.reference(HELD_OUT), REFERENCE_KEY, "the held-out pairs"))


def kept_reference(recipe: Recipe, examples: list[dict], part: Any, key: str, what: str) -> Any:
    """``examples`` with the reference log-probabilities the run kept for them (``part[key]``, one row per pair),
    as the run's own evaluation scores them. Without a usable table — none kept, or one of another length (the
    data changed since) — the examples as they are: ``pref_accuracy`` then takes the adapter-disabled base as the
    reference (exact only for a strategy that never changes the base), and a run that should have kept one says
    why in the log."""
    from fedllm.engine.reference import uses_precomputed, with_reference

    table = part.get(key)
    if not examples:
        return examples
    if table is not None and len(table) == len(examples):
        return with_reference(examples, range(len(examples)), part, key)
    if uses_precomputed(recipe.train):
        why = ("the checkpoint keeps none for them" if table is None else
               f"the checkpoint's table has {len(table)} rows for {len(examples)} pairs")
        log.warning("pref_accuracy of %s: the adapter-disabled base is the reference, not the run's reference "
                    "log-probabilities (%s)", what, why)
    return examples


def default_out_dir(checkpoint: str) -> Path:
    """``<checkpoint>/eval`` for a local directory, else ``eval_results/<sanitised name>``."""
    p = Path(checkpoint).expanduser()
    if p.is_dir():
        return p / "eval"
    return Path("eval_results") / re.sub(r"[^\w.-]+", "__", checkpoint).strip("_")


def build_eval_config(args: argparse.Namespace, base: EvalConfig) -> EvalConfig:
    """The eval config of a command: ``base`` (the run's) overridden by the flags."""
    names = parse_task_list(args.tasks) or list(base.tasks)
    if not names:
        raise InputError(f"no tasks to evaluate: pass --tasks (known: {', '.join(tasks.names())})")
    judge = base.judge
    judge_flags = {"base_url": args.judge_base_url, "model": args.judge_model, "api_key_env": args.judge_api_key_env,
                   "concurrency": args.judge_concurrency, "protocol": args.judge_protocol,
                   "ratings": args.judge_ratings}
    judge = dataclasses.replace(judge, **{k: v for k, v in judge_flags.items() if v is not None})
    flags = {"limit": args.limit, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
             "shots": args.shots, "chat_template": args.chat_template, "decoding": args.decoding, "seed": args.seed,
             "seeding": args.seeding, "answer_protocol": args.answer_protocol, "judged_prompts": args.judged_prompts,
             "quantization": getattr(args, "quantization", None),
             "allow_code_execution": getattr(args, "allow_code_execution", None)}
    for key in ("limit", "batch_size", "max_new_tokens"):
        if flags[key] is not None and flags[key] < 1:
            raise InputError(f"--{key.replace('_', '-')}: expected a positive integer, got {flags[key]}")
    cfg = dataclasses.replace(base, tasks=names, data={**base.data, **parse_data_specs(args.data)}, judge=judge,
                              **{k: v for k, v in flags.items() if v is not None})
    from fedllm.evaluation.task_names import code_execution_problems

    for key, given, expected in code_execution_problems(cfg):
        raise InputError(f"{key}: got {given}, expected {expected}")
    return cfg


def run_eval_command(args: argparse.Namespace) -> int:
    """``fedllm eval``: load, evaluate, print a markdown table; returns the exit code.

    Raises:
        InputError: bad flags, unknown tasks, missing data or judge settings (exit code 2).
    """
    check_local_path(args.checkpoint, "checkpoint")  # before torch: a mistyped run directory is not a hub id
    parse_task_list(args.tasks)
    from fedllm.recipe.checks import load_recipe

    recipe_path = find_run_recipe(args.checkpoint)
    # the run's strategy checked its arguments when it trained (and the model's loader checks them again)
    recipe = load_recipe(recipe_path, ask_strategy=False) if recipe_path else None
    build_eval_config(args, recipe.eval if recipe else EvalConfig())  # bad flags, no task: refused before torch
    from fedllm.evaluation.runner import eval_config_for_data, evaluate, prompt_style_for_data
    from fedllm.export.inference import load_for_inference

    cfg = build_eval_config(args, eval_config_for_data(recipe.eval, recipe.data) if recipe else EvalConfig())
    prompt_style = args.prompt_style or (prompt_style_for_data(recipe.data, recipe.eval) if recipe else None)
    out_dir = Path(args.out) if args.out else default_out_dir(args.checkpoint)
    if args.client is not None:
        return _eval_clients(args, cfg, out_dir, prompt_style)
    records = None
    if recipe is not None and any(t in tasks and tasks.get(t).uses_records and t not in cfg.data
                                for t in cfg.tasks):
        records = heldout_records(recipe)
    from fedllm.evaluation.flowertune_quantization import load_quantization

    quantization = load_quantization(cfg.quantization, cfg.tasks)
    quantized = {"quantization": quantization} if quantization != "none" else {}
    dtype = args.dtype or ("fp32" if quantized else None)  # None: the run's own dtypes
    model, tokenizer = load_for_inference(args.checkpoint, dtype=dtype, **quantized)
    examples, preference = None, None
    if recipe is not None and any(t in HELD_OUT_TASKS for t in cfg.tasks):  # the run's held-out records, tokenized
        examples = heldout_examples(recipe, tokenizer, args.checkpoint, records or heldout_records(recipe))
        preference = recipe.train.preference if recipe.data.format == "preference" else None
    metrics = evaluate(model, tokenizer, cfg, out_dir, records=records, eval_examples=examples,
                       prompt_style=prompt_style, progress=not args.no_progress, preference=preference)
    print(markdown_table(metrics, title=args.checkpoint))
    print(f"\nper-example results: {out_dir}")
    return 0


def _eval_clients(args: argparse.Namespace, cfg: EvalConfig, out_dir: Path, prompt_style: Optional[str]) -> int:
    """``fedllm eval --client ID|all``: personal models on their own splits; per-client table and mean/min/max."""
    import json

    from fedllm.evaluation.personal import personal_stats

    per_client = evaluate_clients(args.checkpoint, args.client, cfg, out_dir, dtype=args.dtype,
                                  prompt_style=prompt_style, progress=not args.no_progress)
    stats = personal_stats(per_client)
    for cid, metrics in per_client.items():
        print(markdown_table(metrics, title=f"{args.checkpoint} client {cid}"))
    if len(per_client) > 1:
        print(markdown_table({f"{k}/{s}": v[s] for k, v in stats.items() for s in ("mean", "min", "max")},
                             title=f"{args.checkpoint}: {len(per_client)} clients"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "personal_summary.json").write_text(json.dumps({"clients": per_client, "stats": stats}, indent=2))
    print(f"\nper-example results: {out_dir}")
    return 0


def client_choice(text: str) -> "int | str":
    """``--client`` of ``fedllm eval``: a client id or ``all``."""
    import argparse

    if text == "all":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a client id or 'all', got {text!r}")


def evaluate_clients(checkpoint: str, client: "int | str", eval_cfg: Any, out_dir: Any, dtype: Optional[str] = "fp32",
                     prompt_style: Optional[str] = None, progress: bool = True) -> dict[str, dict[str, float]]:
    """Each requested client's personal model on its own held-out split (``fedllm eval --client ID|all``).

    The split is the one the run held out for that client (``data.client_eval_fraction``), rebuilt from
    the checkpoint's recipe; a run without personal splits evaluates every client on the run's
    held-out data (or the tasks' own data).

    Raises:
        InputError: the run's strategy is not personalized, or the client id is out of range.
    """
    from pathlib import Path

    from fedllm.common.errors import InputError
    from fedllm.evaluation.runner import evaluate
    from fedllm.export.inference import model_from_checkpoint
    from fedllm.models.loading import read_state, write_state
    from fedllm.runs import checkpoint as ckpt_io

    model, tokenizer, strategy, recipe = model_from_checkpoint(checkpoint, dtype)
    name, n = recipe.federation.strategy, recipe.federation.num_clients
    if not strategy.personalized:
        raise InputError(f"--client {client}: strategy {name!r} of {checkpoint} is not personalized; "
                         "it has only the global model")
    if client != "all" and not 0 <= int(client) < n:
        raise InputError(f"--client {client}: the run has clients 0..{n - 1}")
    ids = list(range(n)) if client == "all" else [int(client)]
    store = ckpt_io.client_store(ckpt_io.load_checkpoint(ckpt_io.resolve_checkpoint(Path(checkpoint))))
    records, examples = _client_splits(recipe, tokenizer, checkpoint, store)
    dpo = recipe.train.preference if recipe.train.objective == "dpo" else None
    out: dict[str, dict[str, float]] = {}
    for cid in ids:
        personal = strategy.personal_state(cid, store.get(cid))
        saved = read_state(model, personal.keys())
        write_state(model, personal)
        try:
            out[str(cid)] = evaluate(model, tokenizer, eval_cfg, out_dir, records=records(cid),
                                     eval_examples=examples(cid), tag=f"client-{cid}", prompt_style=prompt_style,
                                     progress=progress, preference=dpo)
        finally:
            write_state(model, saved)
    return out


def _client_splits(recipe: Any, tokenizer: Any, checkpoint: str, store: Any):
    """``(records(cid), examples(cid))``: a client's held-out raw records and tokenized examples; a preference
    run's pairs carry the reference log-probabilities the run stored for that client's split (its
    ``pref_accuracy`` then equals the run's own evaluation of the personal model)."""
    if recipe.data.client_eval_fraction > 0:
        from fedllm.data import build_federated_data
        from fedllm.engine.reference import EVAL_REFERENCE_KEY
        from fedllm.models.loading import resolve_task

        data = build_federated_data(recipe.data, recipe.federation.partition, recipe.federation.num_clients,
                                    tokenizer, recipe.train.max_length, recipe.seed, resolve_task(recipe.model))
        return (lambda c: data.client_eval_records[c]), (
            lambda c: kept_reference(recipe, data.client_eval[c], store.reference(c), EVAL_REFERENCE_KEY,
                                     f"client {c}'s held-out pairs"))

    held = heldout_records(recipe)
    examples = heldout_examples(recipe, tokenizer, checkpoint, held)
    return (lambda c: held), (lambda c: examples)
