"""The public parameters of a SecAgg+ round and the protocol's error."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class SecAggError(RuntimeError):
    """A round of secure aggregation cannot complete (too many dropouts, too few shares, a bad message)."""


@dataclass(frozen=True)
class SecAggParams:
    """What every party of a round agrees on (sent by the server with the round's configuration).

    Attributes:
        threshold: shares needed to rebuild a client's secrets (Shamir's ``t``); ``t > neighbours / 2`` so that
            a server cannot obtain both the self-mask seed and the masking key of one client.
        neighbours: ``k``, the clients each client shares secrets and pairwise masks with (rounded up to even,
            capped at the round's clients − 1; ``k ≥ n − 1`` is the original SecAgg of Bonawitz et al.).
        quantization_range: ``r``: each uploaded value is clipped to ``[−r, r]`` before it is quantised.
        quantization_bits: ``b``: ``[−r, r]`` is cut into ``2^b − 1`` steps of ``Δ = 2r / (2^b − 1)``.
        mod_bits: the masks and the sum live modulo ``2^mod_bits`` (32 or 64: one uint32/uint64 word per value);
            it must exceed the largest possible sum (:meth:`fits`).
        max_dropouts: clients that may be lost after the share exchange with the round still completing.
    """

    threshold: int
    neighbours: int
    quantization_range: float = 1.0
    quantization_bits: int = 20
    mod_bits: int = 32
    max_dropouts: int = 1

    def problems(self, num_clients: int) -> list[tuple[str, str]]:
        """Why these parameters cannot run a round of ``num_clients`` clients, as ``(parameter, what it must be)``
        (empty when they can)."""
        out = []
        k = self.effective_neighbours(num_clients)
        if num_clients < 2:
            out.append(("clients", f"at least 2 per round for secure aggregation, got {num_clients}"))
        if self.mod_bits not in (32, 64):
            out.append(("mod_bits", f"32 or 64, got {self.mod_bits}"))
        if not 1 <= self.quantization_bits < self.mod_bits:
            out.append(("quantization_bits", f"in [1, {self.mod_bits - 1}], got {self.quantization_bits}"))
        if not self.quantization_range > 0:
            out.append(("quantization_range", f"a positive number, got {self.quantization_range}"))
        if self.max_dropouts < 0:
            out.append(("max_dropouts", f">= 0, got {self.max_dropouts}"))
        elif not (k / 2 < self.threshold <= k - self.max_dropouts):
            out.append(
                (
                    "threshold",
                    (
                        f"more than half the {k} neighbours of each client and at most neighbours - "
                        f"max_dropouts = {k - self.max_dropouts} (so every secret can still be rebuilt "
                        f"when max_dropouts clients are lost), got {self.threshold}"
                    ),
                )
            )
        return out

    def quorum(self, num_clients: int) -> int:
        """``q``: valid signatures over one survivor list a client needs before it reveals any share (the
        consistency check, :meth:`fedllm.privacy.secagg.SecAggClient.unmask`; also the fewest survivors a round
        completes with).

        Each honest client signs one list per round, and clients colluding with the server sign any; two different
        lists can both gather ``q`` signatures only if at least ``2q − n`` of the round's ``n`` clients collude.
        ``q = max(t, min(n − max_dropouts, ⌊(n + t − 1)/2⌋ + 1))``: at least the threshold (Bonawitz et al., CCS
        2017, §4, checks ``t``; in SecAgg+'s sparse graph ``t`` counts *neighbours*, and two disjoint groups of
        ``t`` could each reach it), large enough that the ``t − 1`` colluders of the threat model cannot make two
        quorums, but never more than an honest round with ``max_dropouts`` lost still has (then fewer colluders are
        tolerated: ``2q − n − 1``). Always a strict majority of ``n``.
        """
        n, t = num_clients, self.threshold
        return max(t, min(n - self.max_dropouts, (n + t - 1) // 2 + 1))

    def quorum_text(self, num_clients: int) -> str:
        """The quorum of a round of ``num_clients`` and how it is made, for messages."""
        return (f"the consistency quorum {self.quorum(num_clients)} (max(threshold {self.threshold}, min(clients "
                f"{num_clients} - max_dropouts {self.max_dropouts}, a majority large enough against threshold - 1 "
                "colluders)))")

    def effective_neighbours(self, num_clients: int) -> int:
        """Neighbours per client in a round of ``num_clients``: ``k`` rounded up to even, capped at ``n − 1``
        (:func:`fedllm.privacy.secagg.graph.neighbour_graph`)."""
        return max(0, min(self.neighbours + self.neighbours % 2, num_clients - 1))

    @property
    def levels(self) -> int:
        """``L = 2^b − 1``: the largest quantised value."""
        return (1 << self.quantization_bits) - 1

    @property
    def step(self) -> float:
        """``Δ = 2r / L``: the quantisation step, also the bound on the error of a (weighted) mean."""
        return 2 * self.quantization_range / self.levels

    def fits(self, total_weight: int) -> bool:
        """True when a sum of values up to ``L`` with integer weights summing to ``total_weight`` stays below the
        modulus (no wrap-around: the unmasked sum is exact)."""
        return self.levels * total_weight < (1 << self.mod_bits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the configuration a server sends)."""
        return asdict(self)
