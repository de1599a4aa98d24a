"""Split records into clients: ``iid``, ``dirichlet`` (label skew) and ``natural``.

Every partitioner is registered with :func:`fedllm.common.registry.register_partitioner`
and has the signature ``fn(records, num_clients, seed, cfg) -> parts`` where
``parts[c]`` is the sorted list of record indices of client ``c``. Partitioners
never skip a client silently: an impossible request raises
:class:`~fedllm.data.errors.PartitionError`.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any, Optional

import numpy as np

from fedllm.common.registry import partitioners, register_partitioner
from fedllm.data.errors import DataError, PartitionError
from fedllm.data.manifest import load_manifest, manifest_clients, partition_manifest, save_manifest
from fedllm.recipe.schema import DataConfig, PartitionConfig

__all__ = [
    "DEFAULT_COLUMNS",
    "DIRICHLET_MAX_TRIES",
    "add_partition_arguments",
    "dirichlet",
    "iid",
    "load_manifest",
    "manifest_clients",
    "natural",
    "partition_manifest",
    "partition_records",
    "resolve_column",
    "run_partition_command",
    "save_manifest",
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


def _groups(records: list[dict], column: str) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        try:
            groups[r[column]].append(i)
        except TypeError:
            raise PartitionError(f"record {i + 1}: value of {column!r} is not a label ({r[column]!r})") from None
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
def natural(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig) -> list[list[int]]:
    """One client per distinct value of ``cfg.column`` (a user, writer or category id), in sorted order.

    Args:
        records: The records.
        num_clients: Must equal the number of distinct values.
        seed: Unused.
        cfg: ``column``.

    Returns:
        Sorted record indices per client.

    Raises:
        PartitionError: Missing column, or ``num_clients`` differs from the number of values.
    """
    _check_counts(records, num_clients)
    column = resolve_column(records, cfg.column)
    groups = _groups(records, column)
    if len(groups) != num_clients:
        raise PartitionError(
            f"natural partition on {column!r} gives {len(groups)} clients (one per distinct value) "
            f"but num_clients is {num_clients}; set federation.num_clients: {len(groups)}"
        )
    return [sorted(members) for members in groups.values()]


def partition_records(records: list[dict], num_clients: int, seed: int, cfg: PartitionConfig) -> list[list[int]]:
    """Run the partitioner ``cfg.method`` and check its result.

    Args:
        records: The records.
        num_clients: Number of clients.
        seed: Seed of the partitioner.
        cfg: The partition section of the recipe.

    Returns:
        Sorted record indices per client: disjoint, in range, none empty.

    Raises:
        PartitionError: Unknown method, or an impossible or invalid partition.
    """
    if cfg.method not in partitioners:
        raise PartitionError(f"unknown partition method {cfg.method!r}; known: {', '.join(partitioners.names())}")
    _check_counts(records, num_clients)
    parts = partitioners.get(cfg.method)(records, num_clients, seed, cfg)
    if len(parts) != num_clients:
        raise PartitionError(f"partitioner {cfg.method!r} returned {len(parts)} clients, expected {num_clients}")
    seen: set[int] = set()
    for client, part in enumerate(parts):
        if not part:
            raise PartitionError(f"partitioner {cfg.method!r} left client {client} with no examples")
        if seen.intersection(part) or not all(0 <= i < len(records) for i in part):
            raise PartitionError(f"partitioner {cfg.method!r} gave client {client} repeated or out-of-range indices")
        seen.update(part)
    return [sorted(int(i) for i in part) for part in parts]


# --------------------------------------------------------------------------- `fedllm partition`


def add_partition_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``fedllm partition`` (also used by ``data_prep/partition.py``).

    Args:
        parser: The (sub)command parser to fill.
    """
    parser.add_argument("--recipe", help="take data, partition, num_clients and seed from this recipe (flags override)")
    parser.add_argument("--data", help="local file/directory or hub id (data.path)")
    parser.add_argument("--name", help="hub config name (data.name)")
    parser.add_argument("--split", help="split to partition (data.split, default train)")
    parser.add_argument("--format", choices=["instruction", "chat", "classification"],
                        help="data format; classification makes the label column the default partition column")
    parser.add_argument("--num-clients", type=int, help="number of clients (federation.num_clients)")
    parser.add_argument("--method", help="partitioner: " + ", ".join(partitioners.names()))
    parser.add_argument("--beta", type=float, help="Dirichlet concentration (smaller = more skew)")
    parser.add_argument("--column", help="label/category column (dirichlet) or user column (natural)")
    parser.add_argument("--min-size", type=int, help="smallest client (dirichlet)")
    parser.add_argument("--max-examples", type=int, help="keep this many records, chosen with the seed")
    parser.add_argument("--eval-fraction", type=float, help="records held out to eval.jsonl")
    parser.add_argument("--seed", type=int, help="seed of shuffle and partition (default: the recipe's, else 0)")
    parser.add_argument("--out", required=True, help="output directory (manifest.json + client_XXX.jsonl)")


_DATA_FLAGS = {"data": "path", "name": "name", "split": "split", "format": "format",
               "max_examples": "max_examples", "eval_fraction": "eval_fraction"}
_PARTITION_FLAGS = {"method": "method", "beta": "beta", "column": "column", "min_size": "min_size"}


def run_partition_command(args: argparse.Namespace) -> int:
    """Run ``fedllm partition``: write the split and print one line per client.

    Args:
        args: Parsed arguments of :func:`add_partition_arguments`.

    Returns:
        0 on success.

    Raises:
        DataError: No data source given, or it cannot be loaded.
        PartitionError: The partition is impossible.
    """
    import dataclasses

    from fedllm.data.federated import partition_to_disk

    data_cfg, partition_cfg, num_clients, seed = DataConfig(), PartitionConfig(), args.num_clients, args.seed
    if args.recipe:
        from fedllm.recipe.checks import load_recipe

        recipe = load_recipe(args.recipe, ask_strategy=False)  # the strategy plays no part in a split (and needs torch)
        data_cfg, partition_cfg = recipe.data, dataclasses.replace(recipe.federation.partition, path=None)
        num_clients = num_clients if num_clients is not None else recipe.federation.num_clients
        seed = seed if seed is not None else recipe.seed
    data_cfg = dataclasses.replace(data_cfg, **{f: getattr(args, a) for a, f in _DATA_FLAGS.items() if getattr(args, a) is not None})
    partition_cfg = dataclasses.replace(
        partition_cfg, **{f: getattr(args, a) for a, f in _PARTITION_FLAGS.items() if getattr(args, a) is not None}
    )
    if not data_cfg.path:
        raise DataError("give --data PATH (or --recipe RECIPE.yaml)")
    if num_clients is None:
        raise PartitionError("give --num-clients N (or --recipe RECIPE.yaml)")
    manifest = partition_to_disk(data_cfg, partition_cfg, num_clients, 0 if seed is None else seed, args.out)
    for cid, client in manifest["clients"].items():
        print(f"client {cid}: {client['size']} examples {client['label_histogram']}")
    print(args.out)
    return 0
