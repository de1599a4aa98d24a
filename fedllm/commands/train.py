"""``fedllm train RECIPE.yaml [dotted.key=value ...] [--resume] [--dry-run]``: the command-line front end.

The recipe is read and validated, and the run directory checked (``--overwrite`` /
``--resume`` refusals), before torch is imported (an error comes back at once); the CLI has applied the CPU threading policy before that, and a recipe's
``train.threads`` then sets the thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fedllm train`` arguments to ``parser``."""
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. federation.rounds=3")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run in output_dir")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or per-round lines")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, load the model, time a few local steps and print the estimated time per "
                             "round and for the run, and the cost report (parameters, LoRA targets, bytes, state, "
                             "memory); without the weights, from the model built on the meta device from its "
                             "config; writes nothing to output_dir")


def run_train_command(args: argparse.Namespace) -> int:
    """Run ``fedllm train`` from parsed arguments; prints the run directory (rank 0)."""
    from fedllm.common import logs, threads
    from fedllm.recipe.checks import check_strategy, load_recipe

    overrides = list(args.overrides)
    if args.quiet:
        overrides.append("logging.quiet=true")
    blocked = logs.block_bitsandbytes()  # bitsandbytes only when the recipe quantises
    try:
        # a dry run needs neither the weights nor the data files: it builds the model from its shipped config
        recipe = load_recipe(args.recipe, overrides, check_files=not args.dry_run, ask_strategy=False)
        args.output_dir = recipe.output_dir  # for the interrupt message's resume hint
        if args.dry_run:  # it needs no data file, but one that is here must fit the recipe (all problems at once)
            from fedllm.recipe.checks import data_problems
            from fedllm.recipe.schema import RecipeError

            problems = data_problems(recipe)
            if problems:
                raise RecipeError(recipe.source, problems)
        # --overwrite / --resume refusals, before torch loads; rank 0 alone, under the run lock (server.run locks
        # again): the other ranks of a launch may look only after rank 0 started writing the run
        taken = None  # a dry run only tells what the real command would refuse
        if int(os.environ.get("RANK", "0")) == 0:
            from fedllm.common.errors import InputError
            from fedllm.runs import runlock
            from fedllm.runs.rundir import check_run_dir

            try:
                if args.dry_run:
                    check_run_dir(recipe, args.resume, args.overwrite)
                else:
                    with runlock.hold(recipe.output_dir):
                        check_run_dir(recipe, args.resume, args.overwrite)
            except InputError as e:
                if not args.dry_run:
                    raise
                taken = str(e)
        check_strategy(recipe)  # the strategy's own checks import torch
        if not args.dry_run:  # lora.r of a family whose layers need torch to tell: the meta model, before the load
            from fedllm.models.meta import meta_rank_problems
            from fedllm.recipe.schema import RecipeError

            problems = meta_rank_problems(recipe)
            if problems:
                raise RecipeError(recipe.source, problems)
        compression = recipe.federation.compression
        if recipe.model.quantization != "none" or "none" != compression.upload or "none" != compression.download:
            logs.unblock_bitsandbytes()  # a quantised base, or compressed updates (bitsandbytes' quantisers)
        from fedllm.recipe.compile_cost import compile_warning

        costly = compile_warning(recipe)  # before the dry run or the run compiles (minutes on a busy machine)
        if costly and int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: {costly}", file=sys.stderr)
        if recipe.train.threads is not None:  # the CLI applied the policy before torch loaded; now the count
            threads.apply(recipe.train.threads)
        if args.dry_run:
            from fedllm.commands.dry_run import dry_run

            print(dry_run(recipe).report())
            if taken is not None:
                print(f"warning: fedllm train without --dry-run would stop before training: {taken}",
                      file=sys.stderr)
            return 0
        from fedllm.engine.server import run

        created = _absent_paths(recipe.output_dir) if int(os.environ.get("RANK", "0")) == 0 else None
        try:
            result = run(recipe, resume=args.resume, overwrite=args.overwrite)
        except BaseException:
            if created:  # this attempt made output_dir: unless a round finished, take it away again
                _remove_unstarted_run(created)
            raise
    finally:
        if blocked:
            logs.unblock_bitsandbytes()
    if int(os.environ.get("RANK", "0")) == 0:
        print(result.run_dir)
    return 0


def _absent_paths(output_dir: str) -> Optional[list[Path]]:
    """``output_dir`` and the parents above it that do not exist yet (what this attempt will create), deepest first;
    None when ``output_dir`` exists (a run to resume or overwrite, or a directory the user made)."""
    path = Path(output_dir).expanduser().absolute()
    if path.exists():
        return None
    absent = [path]
    for parent in path.parents:
        if parent.exists():
            break
        absent.append(parent)
    return absent


def _remove_unstarted_run(created: list[Path]) -> None:
    """Remove the run directory (and the empty parents) this attempt created, when it holds no finished round: a run
    that failed before its first round would otherwise block the same command ("already holds a run")."""
    from fedllm.common.errors import InputError
    from fedllm.runs import runlock
    from fedllm.runs.rundir import is_run_dir

    run_dir = created[0]
    if not is_run_dir(run_dir):
        return
    if _rounds_done(run_dir / "metrics.jsonl") or any((run_dir / "checkpoints").glob("round-*")) or \
            (run_dir / "final").exists():
        return  # a round finished: the run resumes from there
    try:
        with runlock.hold(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
    except InputError:  # another process holds it now: it is theirs
        return
    for parent in created[1:]:
        try:
            parent.rmdir()
        except OSError:
            break


def _rounds_done(metrics: Path) -> bool:
    """Whether ``metrics.jsonl`` records a finished round (round >= 1; a round-0 evaluation is no training)."""
    if not metrics.is_file():
        return False
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("round"), int) and record["round"] >= 1:
            return True
    return False
