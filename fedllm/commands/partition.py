"""``fedllm partition``: split a data set into client files + a manifest (the partitioners: fedllm.data.partition)."""

from __future__ import annotations

import argparse

from fedllm.common.registry import partitioners
from fedllm.data.errors import DataError, PartitionError
from fedllm.recipe.schema import DataConfig, PartitionConfig


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
