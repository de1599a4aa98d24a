"""``fedllm export RUN_DIR_OR_CHECKPOINT --format merged|adapter --out DIR``: the command-line front end."""

from __future__ import annotations

import argparse

from fedllm.export.formats import DTYPE_CHOICES, FORMATS


def _client(text: str) -> str:
    if text in ("all", "global") or (text.isascii() and text.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected a client id, 'all' or 'global', got {text!r}")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fedllm export`` arguments to ``parser``."""
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its final/ or newest checkpoint) or a checkpoint directory")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="merged: a transformers model with everything learned folded in; "
                             "adapter: a PEFT LoRA adapter on the original base model")
    parser.add_argument("--out", required=True, help="export directory (written under a temporary name, "
                                                     "renamed when complete)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype of the saved weights (auto: the recipe's model.dtype); merges run in fp32")
    parser.add_argument("--rank", type=int, default=None,
                        help="adapter: largest LoRA rank per layer; a change of higher rank is truncated by SVD "
                             "and the relative error reported (default: exact)")
    parser.add_argument("--client", type=_client, default=None,
                        help="personalized strategies: a client id, 'all' (default: one sub-directory per client) "
                             "or 'global'")
    parser.add_argument("--with-base", action="store_true",
                        help="adapter: also save the original base model under OUT/base (needed for presets "
                             "without a hub id)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")


def run_export_command(args: argparse.Namespace) -> int:
    """Run ``fedllm export`` from parsed arguments; prints the export directory (or directories)."""
    from pathlib import Path

    from fedllm.common.errors import check_local_path
    from fedllm.export.out_dir import check_out_dir

    check_local_path(args.source, "RUN_DIR_OR_CHECKPOINT", hub_ok=False)  # before torch loads
    check_out_dir(Path(args.out), args.overwrite, Path(args.source))
    from fedllm.export.api import export

    result = export(args.source, args.format, args.out, dtype=args.dtype, rank=args.rank,
                    client=int(args.client) if args.client and args.client.isdigit() else args.client,
                    with_base=args.with_base, overwrite=args.overwrite)
    for item in result.exports:
        note = "" if item.get("format") == "merged" or item.get("exact", True) else (
            f"  (truncated: max relative error {item['rel_error_max']:.3g})")
        print(f"{item['path']}{note}")
    return 0
