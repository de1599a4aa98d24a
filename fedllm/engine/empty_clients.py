"""Clients without training records: a FedLLM-Bench user whose list is empty (``{"u": []}``), kept as a client by
``federation.partition: {method: natural, column: user}`` of a user-keyed JSON so that client ``k`` is the file's
``k``-th key, as FedLLM-Bench's ``get_fed_datasets`` numbers them (:func:`fedllm.data.partition.user_values`).

FedLLM-Bench samples such a client like any other; its trainer runs no step, so its local state is the global one,
and its FedAvg weighs it by its sample count, 0. The round loop does the same without training it: a sampled
empty client is not trained and is sent nothing, under every strategy (it is like a client that sent no update),
so the round aggregates the other sampled clients; a round whose sampled clients are all empty aggregates nothing
and the global state stays as it was (the strategy's ``after_aggregate`` still runs on it, as on Flower's nodes).
Where each sampled client must answer, clients without records are refused (:func:`refuse_empty_clients`).
"""

from __future__ import annotations

from fedllm.common.errors import InputError
from fedllm.data import FederatedData
from fedllm.privacy.secagg.settings import enabled as secure_aggregation
from fedllm.recipe.schema import Recipe

EMPTY_CLIENT = "holds no training records (weight 0: the round aggregates the other sampled clients' updates)"
"""The ``dropped`` reason of a sampled client without records (a user-keyed JSON's user, :func:`empty_clients`)."""


def empty_clients(data: FederatedData, sampled: list[int]) -> dict[int, str]:
    """``{client: why}`` of the ``sampled`` clients that hold no training record. The round loop trains none of them
    (their per-client state stays as it was) and records them under ``dropped`` in ``metrics.jsonl``, but they are
    no fault: it is not retried, ``on_client_error: fail`` does not stop the run for it, and a sample holding
    one needs at most as many valid updates (``min_clients_per_round``) as it has clients with records (none when
    all its clients are empty: the round then leaves the model as it was)."""
    return {cid: EMPTY_CLIENT for cid in sampled if not data.clients[cid]}


def refuse_empty_clients(recipe: Recipe, data: FederatedData) -> None:
    """Refuse clients without records (:func:`empty_clients`) where a round must hear from each sampled client:
    client-level DP (a round of empty clients would release no noised aggregate), SecAgg+ (its masks pair the
    sampled clients) and ``federation.mode: async`` (FedBuff trains every client it starts)."""
    empty = [c for c, ix in enumerate(data.clients) if not ix]
    pv, fed = recipe.privacy, recipe.federation
    needs = [(key, value) for key, value, on in (
        ("privacy.mechanism", pv.mechanism, pv.mechanism in ("central", "central_client_clipping")),
        ("privacy.secure_aggregation", pv.secure_aggregation, secure_aggregation(pv)),
        ("federation.mode", fed.mode, fed.mode == "async")) if on]
    if empty and needs:
        key, value = needs[0]
        raise InputError(f"{recipe.source}: {key}: {value!r} needs every client to hold training records; "
                         f"data.path={recipe.data.path!r} leaves {len(empty)} client(s) without any (client(s) "
                         f"{empty[:5]}{' ...' if len(empty) > 5 else ''}: users of the user-keyed JSON without "
                         f"records, kept by federation.partition natural on 'user'); remove those users from the "
                         f"file, or set federation.num_clients: {empty[0]} or less (the first users)")
