"""Compressed uploads and downloads of a round (``federation.compression``, :mod:`fedllm.models.compression`).

Upload (client side, in :func:`fedllm.engine.client.close_client_state`, so every runtime does it the same way):
the client quantises ``upload − received + e_i`` (``received``: the plan's state as it arrived), keeps the new
residual ``e_i`` in its own entry of the client store (``compression/<name>``: per-client state, checkpointed,
gathered across processes, on a Flower SuperNode's disk) and sends the codes and absmax; the server reads back
``received + dequantised`` (:func:`fedllm.models.compression.read_packed`; in simulation the client hands over the
same values it computed, bit for bit).

Download (server side, :class:`Downlink`): once a round the server quantises its global state plus its residual
``e_s`` and keeps ``e_s ← x + e_s − Q(x + e_s)`` (checkpointed with the strategy's state under ``compression/``);
every sampled client whose plan carries a global tensor unchanged receives the read-back value. A plan's tensor
that differs from the global state (a per-client one) travels uncompressed and is counted so, as do the keys the
strategy names in :meth:`fedllm.strategies.base.Strategy.exact_download_keys` (never quantised, no residual).

The round's read-back global state is handed to the strategy for its aggregation
(:attr:`fedllm.strategies.base.Strategy.downloaded`): server maths that measures the clients' progress against
what they started from (FedOpt's pseudo-gradient, FRLoRA's merge) reads the dequantised download, so the server's
and the clients' views agree bit for bit. A factor the strategy re-initialises after aggregating drops its
residual (:meth:`Downlink.forget`).
"""

from __future__ import annotations

from typing import Any

import torch

from fedllm.models.compression import Packed, compress_state
from fedllm.models.state import StateDict, num_bytes
from fedllm.runs.checkpoint import DOWNLOAD_RESIDUAL

SERVER_RESIDUAL = DOWNLOAD_RESIDUAL


def compress_upload(recipe: Any, received: StateDict, upload: StateDict,
                    residual: StateDict) -> tuple[StateDict, StateDict, dict[str, Packed], int] | None:
    """``(read back, new residual, packed, bytes)`` of a client's upload, or None when uploads travel uncompressed
    (see :func:`fedllm.models.compression.compress_state`)."""
    c = recipe.federation.compression if recipe is not None else None
    if c is None or c.upload == "none":
        return None
    return compress_state(upload, received, residual, c.upload, c.block_size, c.error_feedback)


class Downlink:
    """The server's compressed download: one quantisation of the global state per round, with its residual."""

    def __init__(self, recipe: Any, exact: frozenset[str] = frozenset()):
        c = recipe.federation.compression
        self.exact = exact  # keys that travel uncompressed (Strategy.exact_download_keys)
        self.kind, self.block_size, self.error_feedback = c.download, c.block_size, c.error_feedback
        self.residual: StateDict = {}
        self.start: StateDict = {}  # the residual at the start of round ``self.round``
        self.round: int | None = None
        self.sent: StateDict = {}  # the round's read-back global state
        self.packed: dict[str, Packed] = {}

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def prepare(self, rnd: int, global_state: StateDict) -> None:
        """Quantise the global state of round ``rnd`` (once; later calls in the round reuse it, so a retried
        sample receives the same values and the residual moves once)."""
        if self.round == rnd:
            return
        self.start = self.residual
        compressed = {k: v for k, v in global_state.items() if k not in self.exact}
        self.sent, self.residual, self.packed, _ = compress_state(
            compressed, {}, self.residual, self.kind, self.block_size, self.error_feedback)
        self.round = rnd

    def received(self, rnd: int) -> StateDict | None:
        """The dequantised global state the clients of round ``rnd`` received (what a strategy's server maths
        reads as their starting point, :attr:`fedllm.strategies.base.Strategy.downloaded`), or None when the
        download is not compressed (or round ``rnd`` sent nothing)."""
        return self.sent if self.enabled and self.round == rnd else None

    def forget(self, keys: list[str]) -> None:
        """Drop the residual of ``keys``: tensors the strategy re-initialised after aggregating
        (:meth:`fedllm.strategies.base.Strategy.reinitialised_at`), whose next download starts without the error
        of the value they replaced."""
        dropped = set(keys)
        self.residual = {k: v for k, v in self.residual.items() if k not in dropped}

    def plan_state(self, state: StateDict, global_state: StateDict) -> tuple[StateDict, int, dict[str, Packed]]:
        """``(what the client receives, bytes of plan.state on the wire, packed tensors)``: each of the plan's
        tensors that is the global tensor of its name travels compressed, any other as it is (fp32)."""
        out, total, packed = {}, 0, {}
        for key, value in state.items():
            glob = global_state.get(key)
            if key in self.packed and glob is not None and (value is glob or (
                    value.shape == glob.shape and value.dtype == glob.dtype and torch.equal(value, glob))):
                out[key] = self.sent[key].to(value.device, value.dtype)
                packed[key] = self.packed[key]
                total += self.packed[key].num_bytes
            else:
                out[key] = value
                total += num_bytes({key: value})
        return out, total, packed

    def state_dict(self, after_round: int | None = None) -> StateDict:
        """The residual after round ``after_round`` (default: the newest), for its checkpoint (keys under
        :data:`SERVER_RESIDUAL`): a round that stops before aggregating checkpoints the round before it, whose
        residual is the one this round started from."""
        kept = self.start if after_round is not None and self.round is not None and after_round < self.round \
            else self.residual
        return {SERVER_RESIDUAL + k: v for k, v in kept.items()}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore :meth:`state_dict`'s residual (and nothing else of ``state``)."""
        self.residual = {k[len(SERVER_RESIDUAL):]: v for k, v in state.items() if k.startswith(SERVER_RESIDUAL)}
        self.round = None
