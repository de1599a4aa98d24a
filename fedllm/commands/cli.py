"""``fedllm train|eval|export|partition|serve|plot`` — thin: parse, call into the library, map errors to exit codes.

Exit codes: 0 success, 2 usage / recipe / input error (the message names the file
and key), 1 runtime failure, 130 interrupted.

Start-up is instant: this module imports only the standard library; a sub-command's
module is imported only when that command runs (or prints its ``--help``), and torch
only when a command needs a model. The CPU threading policy (:mod:`fedllm.common.threads`)
is applied before anything imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import sys
from typing import Optional

from fedllm import __version__
from fedllm.common.errors import InputError

#: name -> (help, module, function adding the arguments, function running the command)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "train": ("run a federated fine-tuning recipe", "fedllm.commands.train", "add_train_arguments",
              "run_train_command"),
    "eval": ("evaluate a run, checkpoint, exported model or hub model", "fedllm.commands.evaluate",
             "add_eval_arguments", "run_eval_command"),
    "export": ("export a merged model or a PEFT adapter", "fedllm.commands.export", "add_export_arguments",
               "run_export_command"),
    "partition": ("split a data set into client files + a manifest", "fedllm.commands.partition",
                  "add_partition_arguments", "run_partition_command"),
    "serve": ("OpenAI-compatible chat server on 127.0.0.1", "fedllm.commands.serve", "add_serve_arguments",
              "run_serve_command"),
    "plot": ("overlay runs: train loss, eval metrics, cumulative bytes per round", "fedllm.commands.plot",
             "add_plot_arguments", "run_plot_command"),
    "flower": ("run a recipe on Flower's deployment engine (superlink, supernode, run)", "fedllm.commands.flower",
               "add_flower_arguments", "run_flower_command"),
}


#: Commands that load torch (the CPU threading policy is applied before they start).
TORCH_COMMANDS = ("train", "eval", "export", "serve")


def _chosen_command(argv: list[str]) -> Optional[str]:
    """The sub-command named in ``argv`` (the first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: Optional[list[str]] = None) -> argparse.ArgumentParser:
    """The parser; only the sub-command named in ``argv`` gets its arguments (and its module imported).

    With ``argv=None`` every sub-command is filled in (for documentation and tests).
    """
    parser = argparse.ArgumentParser(prog="fedllm", description="Federated fine-tuning of LLMs with LoRA")
    parser.add_argument("--version", action="version", version=f"fedllm {__version__}")
    parser.add_argument("--verbose", dest="verbose_top", action="store_true",
                        help="show debug logs and every third-party warning (also: FEDLLM_LOG=debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen_command(argv) if argv is not None else None
    parser.set_defaults(subparsers={})
    for name, (help_text, module, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        parser.get_default("subparsers")[name] = p
        p.add_argument("--verbose", action="store_true",
                       help="show debug logs and every third-party warning (also: FEDLLM_LOG=debug)")
        if argv is None or name == chosen:
            mod = importlib.import_module(module)
            getattr(mod, add)(p)
            p.set_defaults(func=getattr(mod, run))
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``dotted.key=value`` overrides may come after options too (``train RECIPE --overwrite k=v``).

    argparse takes a command's positional words in one run, so overrides after an option would be
    "unrecognized"; they are appended to the command's overrides instead. Any other unknown word is
    an error reported with the command's own usage.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        command_parser = parser.get_default("subparsers").get(args.command, parser)
        stray = [w for w in extra if w.startswith("-") or "=" not in w or not hasattr(args, "overrides")]
        if stray:
            hint = " (an override is dotted.key=value)" if hasattr(args, "overrides") else ""
            command_parser.error(f"unrecognized arguments: {' '.join(stray)}{hint}")
        args.overrides = [*args.overrides, *extra]
    return args


def _close_progress_bars() -> None:
    """End open tqdm bars (an interrupted run's) so that the next message starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 — a bar that cannot close leaves the line as it is
            pass


def interrupt_hint(argv: list[str], args: argparse.Namespace) -> str:
    """How to continue an interrupted ``fedllm train``: ``--resume`` if the run directory holds anything."""
    if args.command != "train" or getattr(args, "dry_run", False):
        return ""
    out = getattr(args, "output_dir", None)
    if out is not None and not (os.path.isdir(out) and os.listdir(out)):
        return f"; nothing was written to {out} yet: run the same command again"
    return f"; resume with: {resume_command(argv)}"


def resume_command(argv: list[str]) -> str:
    """The exact command that resumes an interrupted ``fedllm train`` (``--overwrite`` dropped)."""
    words = [w for w in argv if w not in ("--resume", "--overwrite", "--dry-run")]
    return shlex.join(["fedllm", *words, "--resume"])


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``fedllm`` console script and of ``python -m fedllm``."""
    from fedllm.common import logs, threads
    from fedllm.common.redact import RedactingFilter, redact_text

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_arguments(build_parser(argv), argv)
    logs.configure(verbose=args.verbose or args.verbose_top)
    for handler in logging.getLogger().handlers:  # no credential reaches a log line
        handler.addFilter(RedactingFilter())
    if args.command in TORCH_COMMANDS:  # before anything imports torch; train re-applies with train.threads
        threads.apply()
    try:
        return int(args.func(args) or 0)
    except InputError as e:
        print(f"fedllm {args.command}: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _close_progress_bars()
        hint = interrupt_hint(argv, args)
        masked = redact_text(hint)
        if masked != hint:
            masked += " (credentials masked: give them again)"
        print(f"fedllm {args.command}: interrupted{masked}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 — a runtime failure, reported with its type
        print(f"fedllm {args.command}: failed: {type(e).__name__}: {redact_text(str(e))}", file=sys.stderr)
        if os.environ.get("FEDLLM_DEBUG"):
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())
