"""Split records into clients: ``iid``, ``dirichlet`` (label skew) and ``natural``.

Every partitioner is registered with :func:`fedllm.common.registry.register_partitioner`
and has the signature ``fn(records, num_clients, seed, cfg) -> parts`` where
``parts[c]`` is the sorted list of record indices of client ``c``. Partitioners
never skip a client silently: an impossible request raises
:class:`~fedllm.data.errors.PartitionError`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Optional

import numpy as np

from fedllm.common.registry import partitioners, register_partitioner
from fedllm.data.errors import PartitionError
from fedllm.data.loading import USER_COLUMN
from fedllm.data.manifest import load_manifest, manifest_clients, partition_manifest, save_manifest
from fedllm.recipe.schema import PartitionConfig

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_COLUMNS",
    "DIRICHLET_MAX_TRIES",
    "dirichlet",
    "iid",
    "load_manifest",
    "manifest_clients",
    "natural",
    "partition_manifest",
    "partition_records",
    "resolve_column",
    "save_manifest",
    "user_values",
]

#: Columns tried, in order, when ``PartitionConfig.column`` is not given.
DEFAULT_COLUMNS = ("label", "category")

#: Dirichlet draws tried before giving up on ``min_size``.
DIRICHLET_MAX_TRIES = 1000


def _check_counts(records: list[dict], num_clients: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1; got {num_clients}")
    if num_clients > len(records):
        raise PartitionError(
            f"cannot split {len(records)} examples into {num_clients} clients: more clients than examples"
        )


def resolve_column(records: list[dict], column: Optional[str]) -> str:
    """The column to partition on: ``column``, else the first of ``label``, ``category`` present.

    Args:
        records: The records.
        column: ``PartitionConfig.column``.

    Returns:
        A column every record has.

    Raises:
        PartitionError: The column is missing from some record (or no default column exists).
    """
    if column is None:
        column = next((c for c in DEFAULT_COLUMNS if all(c in r for r in records)), None)
        if column is None:
            raise PartitionError(
                f"no label column to partition on: set federation.partition.column "
                f"(records have columns {sorted(records[0]) if records else []})"
            )
    for i, r in enumerate(records):
        if column not in r:
            raise PartitionError(
                f"partition column {column!r} is missing from record {i + 1} (its columns are {sorted(r)}); "
                "set federation.partition.column"
            )
    return column


def _value_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


def _groups(records: list[dict], column: str, order: str = "sorted") -> dict[Any, list[int]]:
    """Record indices per value of ``column``: values sorted, or in the order they first appear (``first_seen``)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        try:
            groups[r[column]].append(i)
        except TypeError:
            raise PartitionError(f"record {i + 1}: value of {column!r} is not a label ({r[column]!r})") from None
    if order == "first_seen":
        return dict(groups)
    return dict(sorted(groups.items(), key=lambda kv: _value_key(kv[0])))


@register_partitioner("iid")
def iid(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig) -> list[list[int]]:
    """IID split: a seeded shuffle cut into near-equal parts (sizes differ by at most one).

    Args:
        records: The records.
        num_clients: Number of clients.
        seed: Seed of the shuffle.
        cfg: Unused.

    Returns:
        Sorted record indices per client.
    """
    _check_counts(records, num_clients)
    order = np.random.default_rng(seed).permutation(len(records))
    return [sorted(int(i) for i in part) for part in np.array_split(order, num_clients)]


@register_partitioner("dirichlet")
def dirichlet(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig) -> list[list[int]]:
    """Label-skewed split of Hsu et al. (2019), "Measuring the effects of non-identical data distribution".

    For each class ``k``: ``p_k ~ Dir(beta * 1_num_clients)`` and the class's
    (shuffled) records are cut in proportions ``p_k``. The whole draw is repeated
    until every client holds at least ``cfg.min_size`` records.

    Args:
        records: The records.
        num_clients: Number of clients.
        seed: Seed of the numpy generator.
        cfg: ``beta`` (smaller = more skew), ``column`` and ``min_size``.

    Returns:
        Sorted record indices per client.

    Raises:
        PartitionError: Missing column, more clients than records, or no draw
            with every client at ``min_size`` within :data:`DIRICHLET_MAX_TRIES`.
    """
    _check_counts(records, num_clients)
    groups = _groups(records, resolve_column(records, cfg.column))
    if num_clients * cfg.min_size > len(records):
        raise PartitionError(
            f"{len(records)} records cannot give {num_clients} clients min_size={cfg.min_size} records each"
        )
    rng = np.random.default_rng(seed)
    for _ in range(DIRICHLET_MAX_TRIES):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for members in groups.values():
            members = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, cfg.beta))
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].extend(int(i) for i in chunk)
        if min(len(p) for p in parts) >= cfg.min_size:
            return [sorted(p) for p in parts]
    raise PartitionError(
        f"no Dirichlet(beta={cfg.beta}) draw in {DIRICHLET_MAX_TRIES} tries gave each of {num_clients} clients "
        f">= {cfg.min_size} records ({len(records)} records, {len(groups)} classes); "
        "raise beta, lower min_size or use fewer clients"
    )


@register_partitioner("natural")
def natural(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig,
            values: Optional[list] = None) -> list[list[int]]:
    """One client per distinct value of ``cfg.column`` (a user, writer or category id), numbered in the order the
    values first appear in the records (file order), as FedLLM-Bench numbers its users (``get_fed_datasets``: one
    client per key of its user-keyed JSON, in file order, so that client ``k`` is its ``local<k>`` baseline's
    user). With fewer clients than values, the first ``num_clients`` values are the clients and the records of
    the others are left out (FedLLM-Bench's ``dataset[:num_clients]``; a warning says how many).

    Args:
        records: The records.
        num_clients: At most the number of distinct values.
        seed: Unused.
        cfg: ``column``.
        values: The column's values in client order, values no record holds included (a user-keyed JSON's keys,
            :func:`user_values`): each of those is a client with no records, as in FedLLM-Bench.

    Returns:
        Sorted record indices per client.

    Raises:
        PartitionError: Missing column, or more clients than values.
    """
    if values is None:
        _check_counts(records, num_clients)
    elif num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1; got {num_clients}")
    column = resolve_column(records, cfg.column)
    groups = _groups(records, column, order="first_seen")
    if values is not None:
        stray = [v for v in groups if v not in set(values)]
        if stray:
            raise PartitionError(f"natural partition on {column!r}: value {stray[0]!r} is not one of the file's keys")
        groups = {v: groups.get(v, []) for v in values}
    if len(groups) < num_clients:
        raise PartitionError(
            f"natural partition on {column!r} gives {len(groups)} clients (one per distinct value) "
            f"but num_clients is {num_clients}; set federation.num_clients: {len(groups)}"
        )
    parts = [sorted(members) for members in groups.values()]
    if len(parts) > num_clients:
        left = sum(len(p) for p in parts[num_clients:])
        log.warning("natural partition on %r: %d distinct values, num_clients %d: the first %d (in file order) are "
                    "the clients, the other %d values' %d record(s) are left out (as FedLLM-Bench takes its first "
                    "num_clients users); set federation.num_clients: %d to keep them all", column, len(parts),
                    num_clients, num_clients, len(parts) - num_clients, left, len(parts))
    empty = [(c, v) for c, (v, members) in enumerate(list(groups.items())[:num_clients]) if not members]
    if len(empty) == num_clients:
        raise PartitionError(f"natural partition on {column!r}: none of the first {num_clients} values holds a "
                             "training record")
    if empty:
        log.warning("natural partition on %r: %d client(s) without training records (%s%s), kept as FedLLM-Bench "
                    "keeps them: a round that samples one aggregates the other sampled clients (its weight is its "
                    "record count, 0)", column, len(empty), ", ".join(f"client {c} = {v!r}" for c, v in empty[:5]),
                    " ..." if len(empty) > 5 else "")
    return parts[:num_clients]


def user_values(records: list[dict], cfg: PartitionConfig) -> Optional[list[str]]:
    """The clients' values when ``cfg`` is ``natural`` on :data:`~fedllm.data.loading.USER_COLUMN` and ``records``
    are a user-keyed JSON's (:class:`~fedllm.data.loading.UserKeyedRecords`): every key of the file, in file order,
    those without records included; else None (a partition then gives no client without records)."""
    if cfg.method != "natural" or cfg.column != USER_COLUMN:
        return None
    return getattr(records, "users", None)


def partition_records(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig,
                      values: Optional[list] = None) -> list[list[int]]:
    """Run the partitioner ``cfg.method`` and check its result.

    Args:
        records: The records.
        num_clients: Number of clients.
        seed: Seed of the partitioner.
        cfg: The partition section of the recipe.
        values: ``natural`` only: the clients' values, values no record holds included (:func:`user_values`);
            their clients are the only ones allowed to be empty.

    Returns:
        Sorted record indices per client: disjoint, in range, none empty (but the clients of ``values`` no
        record holds).

    Raises:
        PartitionError: Unknown method, or an impossible or invalid partition.
    """
    if cfg.method not in partitioners:
        raise PartitionError(f"unknown partition method {cfg.method!r}; known: {', '.join(partitioners.names())}")
    if values is not None and cfg.method != "natural":
        raise PartitionError(f"partition method {cfg.method!r} has no client values (only natural has)")
    if values is None:
        _check_counts(records, num_clients)
        parts = partitioners.get(cfg.method)(records, num_clients, seed, cfg)
    else:
        parts = natural(records, num_clients, seed, cfg, values=values)
    if len(parts) != num_clients:
        raise PartitionError(f"partitioner {cfg.method!r} returned {len(parts)} clients, expected {num_clients}")
    seen: set[int] = set()
    for client, part in enumerate(parts):
        if not part and values is None:
            raise PartitionError(f"partitioner {cfg.method!r} left client {client} with no examples")
        if seen.intersection(part) or not all(0 <= i < len(records) for i in part):
            raise PartitionError(f"partitioner {cfg.method!r} gave client {client} repeated or out-of-range indices")
        seen.update(part)
    return [sorted(int(i) for i in part) for part in parts]
