"""``fedllm export RUN_DIR_OR_CHECKPOINT --format merged|adapter --out DIR``: the command-line front end."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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
    check_exportable(Path(args.source))
    from fedllm.export.api import export

    result = export(args.source, args.format, args.out, dtype=args.dtype, rank=args.rank,
                    client=int(args.client) if args.client and args.client.isdigit() else args.client,
                    with_base=args.with_base, overwrite=args.overwrite)
    for item in result.exports:
        note = "" if item.get("format") == "merged" or item.get("exact", True) else (
            f"  (truncated: max relative error {item['rel_error_max']:.3g})")
        print(f"{item['path']}{note}")
    return 0


#: Files of a checkpoint directory, any of which marks one (a damaged one too: the export names the damage);
#: ``fedllm.runs.checkpoint._CHECKPOINT_FILES``, which imports torch (tests/cli hold the two equal).
CHECKPOINT_FILES = ("meta.json", "manifest.json", "adapter.safetensors")


def exportable(path: Path) -> bool:
    """Whether ``path`` is a checkpoint or a run directory with one (``final/`` or ``checkpoints/round-*``)."""
    if any((path / name).exists() for name in CHECKPOINT_FILES) or (path / "final").is_dir():
        return True
    return (path / "checkpoints").is_dir() and any(p.is_dir() for p in (path / "checkpoints").glob("round-*"))


def nearby_exportables(path: Path, limit: int = 5, depth: int = 3, budget: int = 5000) -> list[Path]:
    """Up to ``limit`` run directories or checkpoints under ``path`` or beside it, ``depth`` levels down at most,
    looking at ``budget`` directories at most (a home directory is not walked whole)."""
    found: list[Path] = []
    seen = 0
    for top in (path, path.parent if path.parent != path else None):
        if top is None or not top.is_dir():
            continue
        for root, dirs, _ in os.walk(top):
            seen += 1
            here = Path(root)
            if here != path and exportable(here) and here not in found:
                found.append(here)
                dirs[:] = []  # a run's own checkpoints/final are not listed beside it
            else:
                dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if \
                    len(here.relative_to(top).parts) < depth else []
            if len(found) >= limit or seen >= budget:
                return found
    return found


def check_exportable(path: Path) -> None:
    """Refuse a directory that is neither a run with a checkpoint nor a checkpoint, at once (before torch), naming
    the run directories and checkpoints found nearby.

    Raises:
        InputError: ``path`` holds no checkpoint.
    """
    from fedllm.common.errors import InputError

    if not path.is_dir() or exportable(path):
        return  # a file, or a checkpoint (damaged ones too): the export itself names what is wrong
    from fedllm.runs.rundir import is_run_dir

    why = ("a fedllm run directory without a checkpoint yet (no final/ and no checkpoints/round-*)"
           if is_run_dir(path) else "neither a run directory with checkpoints nor a fedllm checkpoint")
    near = nearby_exportables(path)
    hint = ("; run directories and checkpoints nearby: " + ", ".join(str(p) for p in near)) if near else \
        "; give a run's output_dir (its final/ or newest checkpoints/round-*) or a checkpoint directory"
    raise InputError(f"RUN_DIR_OR_CHECKPOINT {str(path)!r}: {why}{hint}")
