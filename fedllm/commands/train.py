"""``fedllm train RECIPE.yaml [dotted.key=value ...] [--resume] [--dry-run]``: the command-line front end.

The recipe is read and validated, and the run directory checked (``--overwrite`` /
``--resume`` refusals), before torch is imported (an error comes back at once); the CLI has applied the CPU threading policy before that, and a recipe's
``train.threads`` then sets the thread count.
"""

from __future__ import annotations

import argparse
import os
import sys


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

        result = run(recipe, resume=args.resume, overwrite=args.overwrite)
    finally:
        if blocked:
            logs.unblock_bitsandbytes()
    if int(os.environ.get("RANK", "0")) == 0:
        print(result.run_dir)
    return 0
