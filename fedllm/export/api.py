"""``export()``: validate the request, write every export into a temporary directory, rename at the end."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from fedllm.common.redact import redact, redact_text
from fedllm.export.adapter import write_adapter
from fedllm.export.card import model_card
from fedllm.export.errors import ExportInputError
from fedllm.export.formats import DTYPE_CHOICES, FORMATS
from fedllm.export.merged import write_merged
from fedllm.export.out_dir import REPORT, check_out_dir
from fedllm.export.source import Source, load_run_model, open_source

ClientChoice = Union[None, int, str]


@dataclass
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        out: The export directory.
        format: ``merged`` or ``adapter``.
        exports: One entry per exported model (the global one, or one per client): its
            directory, client id (None for the global model) and facts (ranks, errors ...).
        command: The ``fedllm export`` command line that reproduces it.
    """

    out: Path
    format: str
    exports: list[dict[str, Any]] = field(default_factory=list)
    command: str = ""


def export_command(source: str | Path, fmt: str, out: str | Path, dtype: str = "auto", rank: Optional[int] = None,
                   client: ClientChoice = None, with_base: bool = False, overwrite: bool = False) -> str:
    """The canonical ``fedllm export`` command line of these options."""
    argv = ["fedllm", "export", str(source), "--format", fmt, "--out", str(out)]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    if rank is not None:
        argv += ["--rank", str(rank)]
    if client is not None:
        argv += ["--client", str(client)]
    if with_base:
        argv.append("--with-base")
    if overwrite:
        argv.append("--overwrite")
    return shlex.join(argv)


def _clients(source: Source, client: ClientChoice) -> list[Optional[int]]:
    """Which models to export: ``[None]`` for the global model, else client ids."""
    from fedllm.common.registry import strategies

    personalized = getattr(strategies.get(source.recipe.federation.strategy), "personalized", False)
    n = source.recipe.federation.num_clients
    if isinstance(client, str) and client not in ("all", "global"):
        if not client.isdigit():
            raise ExportInputError(f"--client {client!r}: expected a client id, 'all' or 'global'")
        client = int(client)
    if client is None:
        client = "all" if personalized else "global"
    if client == "global":
        return [None]
    if not personalized:
        raise ExportInputError(f"--client {client}: strategy {source.recipe.federation.strategy!r} is not "
                               "personalized; it has only the global model")
    if client == "all":
        return list(range(n))
    if not 0 <= client < n:
        raise ExportInputError(f"--client {client}: the run has clients 0..{n - 1}")
    return [client]


def _check_options(fmt: str, dtype: str, rank: Optional[int], with_base: bool) -> None:
    if fmt not in FORMATS:
        raise ExportInputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPE_CHOICES:
        raise ExportInputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if fmt == "merged" and rank is not None:
        raise ExportInputError("--rank applies to --format adapter (a merged model has no rank)")
    if fmt == "merged" and with_base:
        raise ExportInputError("--with-base applies to --format adapter (a merged model contains its base)")
    if rank is not None and rank < 1:
        raise ExportInputError(f"--rank {rank}: expected a positive integer")


def _check_out(out: Path, source: Source, overwrite: bool) -> None:
    resolved, checkpoint = out.resolve(), source.checkpoint.resolve()
    for protected in (source.given.resolve(), checkpoint):
        if resolved == protected or resolved in protected.parents:
            raise ExportInputError(f"--out {out}: would replace the run being exported ({protected})")
    if checkpoint in resolved.parents:
        raise ExportInputError(f"--out {out}: inside the checkpoint being exported ({checkpoint}); write it elsewhere")
    check_out_dir(out, overwrite)


def _write_one(fmt: str, source: Source, client: Optional[int], directory: Path, dtype: str, rank: Optional[int],
               with_base: bool, command: str, final: Optional[Path] = None) -> dict[str, Any]:
    from fedllm.common import logs

    directory.mkdir(parents=True, exist_ok=True)
    model, tokenizer, strategy = load_run_model(source, client, for_merge=fmt == "merged")
    logs.quiet_loading_bars()  # no "Writing model shards" bar (unless --verbose)
    if fmt == "merged":
        info = write_merged(model, tokenizer, strategy, source, directory, dtype)
    else:
        info = write_adapter(model, tokenizer, strategy, source, directory, dtype, rank, with_base)
    from fedllm.evaluation.runner import prompt_style_for_data

    info.update(dtype=dtype, client=client, with_base=with_base,
                prompt_style=prompt_style_for_data(source.recipe.data,  # fedllm serve reads it
                                                   source.recipe.eval) or "chat")
    (directory / "README.md").write_text(redact_text(model_card(fmt, source, info, command,
                                                                final.resolve() if final is not None else None)))
    facts = {"format": fmt, "source": str(source.checkpoint), "round": source.round,
             "strategy": source.recipe.federation.strategy, "command": command, **info,
             "base_model": {**dataclasses.asdict(source.recipe.model), "seed": source.recipe.seed,
                            "num_labels": len(source.label_names) or 2}}  # rebuilds a preset base offline
    (directory / REPORT).write_text(json.dumps(redact(facts), indent=2, sort_keys=True))
    return facts


def _index_card(fmt: str, source: Source, exports: list[dict[str, Any]], command: str) -> str:
    what = "merged model" if fmt == "merged" else "LoRA adapter"
    rows = "\n".join(f"- `client-{e['client']:04d}/`: client {e['client']}'s personal {what}" for e in exports)
    return (f"# fedllm {fmt} exports of {source.recipe.federation.strategy} on {source.recipe.model.name}\n\n"
            f"One personalized model per client, each with its own README.md, from `{source.checkpoint}` "
            f"(round {source.round}).\n\n{rows}\n\n## Command\n\n```bash\n{command}\n```\n")


def _publish_modes(tmp: Path) -> None:
    """Give the export ordinary permissions (mkdtemp and safetensors create private files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp, *tmp.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _replace(tmp: Path, out: Path) -> None:
    _publish_modes(tmp)
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(source: str | Path, fmt: str, out: str | Path, dtype: str = "auto", rank: Optional[int] = None,
           client: ClientChoice = None, with_base: bool = False, overwrite: bool = False) -> ExportResult:
    """Export a run directory or checkpoint as a merged model or a PEFT adapter.

    Args:
        source: Run directory (its ``final/`` or newest checkpoint) or checkpoint directory.
        fmt: ``merged`` (plain transformers model) or ``adapter`` (PEFT LoRA on the original base).
        out: Export directory; written under a temporary name beside it and renamed at the end.
        dtype: Saved weight dtype; ``auto`` is the recipe's ``model.dtype``. Merges happen in fp32.
        rank: Adapter only: largest rank per layer (truncated SVD above it, error reported).
        client: Personalized strategies: a client id, ``all`` (default: one sub-directory per
            client) or ``global``; other strategies export their global model.
        with_base: Adapter only: also save the original base model under ``out/base``.
        overwrite: Replace a non-empty ``out``.

    Returns:
        The :class:`ExportResult`.

    Raises:
        ExportInputError: a torn or foreign source, a bad option, a rank above a layer's size, an existing out.
        ExportCheckError: an exact export does not reproduce the run's model (nothing is written).
    """
    from fedllm.runs import runlock

    _check_options(fmt, dtype, rank, with_base)
    src = open_source(source)
    out = Path(out)
    with runlock.hold(out, what="--out"):  # one writer: a run or another export of the same directory is refused
        return _export_locked(src, source, fmt, out, dtype, rank, client, with_base, overwrite)


def _export_locked(src: Source, source: str | Path, fmt: str, out: Path, dtype: str, rank: Optional[int],
                   client: ClientChoice, with_base: bool, overwrite: bool) -> ExportResult:
    _check_out(out, src, overwrite)
    clients = _clients(src, client)
    command = export_command(source, fmt, out, dtype, rank, client, with_base, overwrite)
    dtype = src.recipe.model.dtype if dtype == "auto" else dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        result = ExportResult(out, fmt, command=command)
        per_client = clients != [None] and len(clients) > 1
        for c in clients:
            sub = f"client-{c:04d}" if per_client else ""
            facts = _write_one(fmt, src, c, tmp / sub if sub else tmp, dtype, rank, with_base, command,
                               out / sub if sub else out)
            result.exports.append({**facts, "path": str(out / sub) if sub else str(out)})
        if per_client:
            (tmp / "README.md").write_text(redact_text(_index_card(fmt, src, result.exports, command)))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
