"""Freed heap memory handed back to the system after a phase that allocates and frees a lot at once."""

from __future__ import annotations

import ctypes


def give_back_freed_heap() -> None:
    """Return the heap pages that freed blocks left to the system (glibc's ``malloc_trim``; nothing off glibc).

    glibc keeps freed blocks below its mmap threshold, which rises to 32 MiB after the first large free, so what a
    phase freed stays in the process's memory: a Gemma 3 270M GGUF load left up to 500 MiB there beside its 511 MiB
    of bf16 weights, and a 7B merge's 16-64 MiB blocks stayed through the export's check and save (docs/memory.md).
    The trim took 3 ms after the Gemma load; a ``gc.collect()`` before it took 540 ms and gave back nothing more."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to open this way (Windows)
        return
    if trim is not None:
        trim(0)
