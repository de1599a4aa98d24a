"""fp32 merged weights of a half-precision base kept on disk, not in memory, until the merged export saves them.

The merged export checks its merge in fp32: the merged layers' fp32 weights against the run's model
(:func:`fedllm.export.merged.check_probe`). Held beside a bf16 base they take 2 bytes more per weight than the layers
they replace (a LLaMA-2-7B with q and v wrapped: 2 GiB; at 2 of its 32 layers, 128 MiB, more than the run's own
headroom there). Here each is written to a safetensors file as it is made, read back for that layer's forward in
the check (:func:`fedllm.export.upcast.computed_in_fp32`'s ``weights``) and once more, cast to the saved dtype, for
the save. The files live in a temporary directory that :meth:`SpilledWeights.close` removes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


class SpilledWeights:
    """``{module name: fp32 weight}`` on disk under ``directory`` (a temporary directory made there)."""

    def __init__(self, directory: Path):
        self.directory = Path(tempfile.mkdtemp(dir=directory, prefix=".merged-fp32-"))
        self.files: dict[str, Path] = {}

    def put(self, name: str, weight: torch.Tensor) -> None:
        """Write ``weight`` (fp32, contiguous) as module ``name``'s."""
        path = self.directory / f"{len(self.files):05d}.safetensors"
        save_file({"weight": weight.contiguous()}, str(path))
        self.files[name] = path

    def read(self, name: str) -> torch.Tensor:
        """Module ``name``'s weight, read into memory."""
        return load_file(str(self.files[name]))["weight"]

    def reader(self, name: str) -> Callable[[], torch.Tensor]:
        """A function that reads module ``name``'s weight."""
        return lambda: self.read(name)

    def close(self) -> None:
        """Remove the files."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.files = {}


def fits_on_disk(directory: Path, nbytes: int) -> bool:
    """Whether ``nbytes`` more fit on ``directory``'s file system, with a tenth to spare."""
    return nbytes <= 0.9 * shutil.disk_usage(directory).free
