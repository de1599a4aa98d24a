"""Client-parallel simulation over torch.distributed processes (``accelerate launch`` / torchrun).

Each process holds the same base model; the round's sampled clients are dealt
out round-robin, every process trains its share, the updates are all-gathered,
and every process aggregates identically (so the global state never diverges).
Only rank 0 writes files. With one process this is the identity.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist


def _init_from_env() -> None:
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU") != "true" else "gloo"
        dist.init_process_group(backend=backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


class Dispatch:
    """Deals sampled clients to processes and gathers their updates."""

    def __init__(self) -> None:
        _init_from_env()
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_share(self, sampled: list[int]) -> list[int]:
        """The sampled clients this process trains."""
        return sampled[self.rank::self.world]

    def exchange(self, items: list[Any]) -> list[Any]:
        """Every process's ``items`` (small picklable messages), concatenated in rank order; the identity on one
        process (secure aggregation's key, share and unmasking messages)."""
        if self.world == 1:
            return list(items)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]

    def gather(self, updates: list[Any], down: dict[int, int],
               client_states: dict[int, dict]) -> tuple[list[Any], dict[int, int], dict[int, dict]]:
        """All processes' updates (ordered by client id), download byte counts and changed per-client states.

        Every process receives every client's new per-client state, so each holds the whole client
        store: any process can train any client next round, and a checkpoint (or a resume with a
        different number of processes) sees all of it.
        """
        if self.world == 1:
            return updates, down, client_states
        # metadata (small) as objects, every tensor as bytes in one buffer per process (a tensor collective:
        # no pickling of multi-GB adapters)
        shells, index, tensors = [], [], []
        for i, update in enumerate(updates):
            for key, value in update.state.items():
                index.append(("update", i, key))
                tensors.append(value)
            shell = copy.copy(update)
            shell.state = {}
            shells.append(shell)
        for cid, state in client_states.items():
            index.append(("client", cid, None))  # an entry may be empty: keep the client
            for key, value in state.items():
                index.append(("client", cid, key))
                tensors.append(value)
        buffer, layout = pack(tensors)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (shells, down, index, layout))
        buffers = all_gather_bytes(buffer, [sum(n for _, _, n in part[3]) for part in parts])
        merged, bytes_down, all_states = [], {}, {}
        for (ups, d, idx, lay), raw in zip(parts, buffers, strict=True):
            values = iter(unpack(raw, lay))
            for kind, owner, key in idx:
                if kind == "client":
                    entry = all_states.setdefault(owner, {})
                    if key is not None:
                        entry[key] = next(values)
                else:
                    ups[owner].state[key] = next(values)
            merged.extend(ups)
            bytes_down.update(d)
        merged.sort(key=lambda u: u.client_id)
        return merged, bytes_down, all_states


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...], int]]]:
    """Tensors as one flat uint8 CPU buffer and their ``(dtype, shape, bytes)`` layout."""
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    layout = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), f.numel()) for t, f in zip(tensors, flat,
                                                                                                  strict=True)]
    return (torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)), layout


def unpack(buffer: torch.Tensor, layout: list[tuple[str, tuple[int, ...], int]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack` (CPU tensors, each its own storage)."""
    out, offset = [], 0
    for dtype, shape, nbytes in layout:
        chunk = buffer[offset:offset + nbytes].clone()
        out.append(chunk.view(getattr(torch, dtype)).reshape(shape))
        offset += nbytes
    return out


def all_gather_bytes(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every process's uint8 ``buffer`` (``sizes[r]`` bytes on rank r): one padded ``all_gather``.

    On NCCL the transfer goes through this process's GPU; the results are CPU tensors.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:buffer.numel()] = buffer.to(device)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(out, padded)
    return [o[:n].cpu() for o, n in zip(out, sizes, strict=True)]
