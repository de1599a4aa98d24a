"""Per-client state (DESIGN.md §3): a keyed tensor dict per client, owned by whoever trains it.

What a client keeps between its rounds — SCAFFOLD's control variate ``c_i``, a personalized
strategy's private factors, its optimizer moments — lives here, never in the server's strategy
object. The in-process simulation holds one store for every client; each process of a
multi-process run holds the entries of all clients, kept identical by gathering the entries a
round changed (:meth:`fedllm.engine.distributed.Dispatch.gather`); a Flower SuperNode holds its own
client's entry on disk. The strategy sees an entry only through ``ClientPlan.client_state``
(client side: :meth:`Strategy.open_client` / :meth:`Strategy.close_client`).

Keys of one client's entry: the strategy's own names, plus the optimizer moments under
``optimizer/<param>::<moment>`` (``train.optimizer_state: per_client``), and the residuals of its compressed
uploads under ``compression/<name>`` (``federation.compression``; the strategy never sees them). A client's reference
log-probabilities (DPO: ``reference/logps``, :mod:`fedllm.engine.reference`) are kept beside its entry:
:meth:`ClientStore.get` / :meth:`ClientStore.put` leave them alone (a strategy never sees them), and
:meth:`ClientStore.flat` writes them into the checkpoint under the same client.
"""

from __future__ import annotations

from typing import Iterable, Optional

from fedllm.models.state import StateDict

OPTIMIZER = "optimizer/"
REFERENCE = "reference/"
RESIDUAL = "compression/"
"""Prefix of a client's upload-compression residuals (error feedback, :mod:`fedllm.models.compression`)."""


def split_optimizer(entry: StateDict) -> tuple[StateDict, Optional[StateDict]]:
    """``(strategy part, optimizer moments or None)`` of one client's entry (its compression residuals left out:
    :func:`residual_part`)."""
    moments = {k[len(OPTIMIZER):]: v for k, v in entry.items() if k.startswith(OPTIMIZER)}
    return {k: v for k, v in entry.items() if not k.startswith((OPTIMIZER, RESIDUAL))}, (moments or None)


def residual_part(entry: StateDict) -> StateDict:
    """The upload-compression residuals of one client's entry, keyed by the uploaded tensor's name."""
    return {k[len(RESIDUAL):]: v for k, v in entry.items() if k.startswith(RESIDUAL)}


def join_residual(entry: StateDict, residual: StateDict) -> StateDict:
    """``entry`` with ``residual`` as its compression residuals."""
    return {**entry, **{RESIDUAL + k: v for k, v in residual.items()}}


def join_optimizer(strategy_part: StateDict, moments: Optional[StateDict]) -> StateDict:
    """One client's entry from its strategy part and optimizer moments."""
    return {**strategy_part, **{OPTIMIZER + k: v for k, v in (moments or {}).items()}}


class ClientStore:
    """Every known client's keyed state (empty for a client that never trained), and its reference part."""

    def __init__(self, entries: Optional[dict[int, StateDict]] = None):
        self._entries: dict[int, StateDict] = {}
        self._reference: dict[int, StateDict] = {}
        for c, s in (entries or {}).items():
            self._set(int(c), dict(s), keep_empty=not any(k.startswith(REFERENCE) for k in s))

    def _set(self, client_id: int, state: StateDict, keep_empty: bool = True) -> None:
        own = {k: v for k, v in state.items() if not k.startswith(REFERENCE)}
        reference = {k: v for k, v in state.items() if k.startswith(REFERENCE)}
        if own or keep_empty:
            self._entries[client_id] = own
        if reference:
            self._reference[client_id] = reference

    def get(self, client_id: int) -> StateDict:
        """Client ``client_id``'s entry (a new dict; the tensors are shared, never modified in place)."""
        return dict(self._entries.get(client_id, {}))

    def put(self, client_id: int, state: StateDict) -> None:
        """Replace client ``client_id``'s entry (tensors are detached copies); its reference part is kept."""
        self._set(int(client_id), {k: v.detach().clone() for k, v in state.items()})

    def update(self, entries: dict[int, StateDict]) -> None:
        """Replace the entries of the clients in ``entries`` (gathered from other processes)."""
        for cid, state in entries.items():
            self._set(int(cid), dict(state))

    def reference(self, client_id: int) -> StateDict:
        """Client ``client_id``'s reference part (``reference/...`` keys; empty when none was computed)."""
        return dict(self._reference.get(client_id, {}))

    def put_reference(self, client_id: int, state: StateDict) -> None:
        """Set client ``client_id``'s reference part (keys under ``reference/``; detached copies)."""
        if not all(k.startswith(REFERENCE) for k in state):
            raise ValueError(f"reference keys must start with {REFERENCE!r}; got {sorted(state)}")
        self._reference[int(client_id)] = {k: v.detach().clone() for k, v in state.items()}

    def references(self) -> dict[int, StateDict]:
        """Every client's reference part."""
        return {c: dict(s) for c, s in self._reference.items()}

    def clients(self) -> list[int]:
        """Clients with an entry (sorted)."""
        return sorted(self._entries)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._entries

    def flat(self) -> StateDict:
        """One flat dict ``client<k>/<name> -> tensor`` (what a checkpoint stores; reference parts included)."""
        out = {f"client{c}/{k}": v for c, st in sorted(self._entries.items()) for k, v in st.items()}
        out.update({f"client{c}/{k}": v for c, st in sorted(self._reference.items()) for k, v in st.items()})
        return out

    @classmethod
    def from_flat(cls, flat: StateDict, prefixes: Iterable[str] = ()) -> "ClientStore":
        """Inverse of :meth:`flat`; ``prefixes`` are prepended to the names (old checkpoint layouts)."""
        prefix = "".join(prefixes)
        entries: dict[int, StateDict] = {}
        for key, value in flat.items():
            client, name = key.split("/", 1)
            entries.setdefault(int(client[len("client"):]), {})[name if name.startswith(REFERENCE)
                                                                else prefix + name] = value
        return cls(entries)
