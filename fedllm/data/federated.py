"""Records -> tokenized per-client training data and held-out splits.

Pipeline of :func:`build_federated_data`:

1. load ``data.path`` (file order);
2. without a manifest: shuffle with the seed, keep ``max_examples``, hold out
   ``eval_fraction`` of those (only when no ``eval_path``/``eval_split`` is given)
   and partition the rest with ``federation.partition``; with
   ``federation.partition.path``: take the manifest's client lists (and its
   held-out ``eval`` ids) as they are;
3. hold out ``client_eval_fraction`` of every client as its personal test split;
4. tokenize with ``data.format``.

Record ids in manifests always index the data file as loaded, so a manifest
written by :func:`partition_to_disk` (``fedllm partition``) reproduces the split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedllm.data.errors import DataError, PartitionError
from fedllm.data.formats import FORMAT_TASKS, Encoder, make_encoder, resolve_label_names
from fedllm.data.loading import USER_COLUMN, load_records
from fedllm.data.manifest import load_manifest, manifest_clients, partition_manifest, save_manifest
from fedllm.data.partition import partition_records, user_values
from fedllm.data.templates import field_name
from fedllm.data.token_cache import open_token_cache
from fedllm.data.validation import bad_kinds, bad_record_kind, check_records
from fedllm.recipe.schema import DataConfig, PartitionConfig

log = logging.getLogger(__name__)

# Independent random streams derived from the recipe seed.
_SHUFFLE_STREAM, _CLIENT_EVAL_STREAM = 1, 2


@dataclass
class FederatedData:
    """Tokenized training data split into clients, and the held-out data.

    Attributes:
        examples: Tokenized training examples of all clients.
        clients: ``clients[c]`` = indices into ``examples`` of client ``c``.
        client_eval: ``client_eval[c]`` = client ``c``'s personal held-out
            examples, tokenized (empty lists when ``client_eval_fraction`` is 0).
        client_eval_records: The same held-out records, raw (for generation).
        eval_records: Global held-out records, raw (for generation-based eval).
        eval_examples: ``eval_records`` tokenized (classification accuracy, eval loss).
        label_names: Class names (classification), else None.
        manifest: The partition manifest (record ids into the loaded data file).
    """

    examples: list[dict]
    clients: list[list[int]]
    client_eval: list[list[dict]]
    client_eval_records: list[list[dict]]
    eval_records: list[dict]
    eval_examples: list[dict]
    label_names: Optional[list[str]]
    manifest: dict
    cache_info: dict = dataclasses.field(default_factory=dict)  # what the tokenized-data cache did

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self.clients)

    def num_examples(self, client_id: int) -> int:
        """Number of training examples of ``client_id`` (the FedAvg weight)."""
        return len(self.clients[client_id])

    def client_examples(self, client_id: int) -> list[dict]:
        """The training examples of ``client_id``."""
        return [self.examples[i] for i in self.clients[client_id]]


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([stream, seed])


def _has_eval_source(data_cfg: DataConfig) -> bool:
    return bool(data_cfg.eval_path or data_cfg.eval_split)


def select_records(records: list[dict], data_cfg: DataConfig, seed: int) -> tuple[list[int], list[int]]:
    """Pick the training and held-out records.

    The records are shuffled with ``seed`` and capped at ``max_examples``; when
    no ``eval_path``/``eval_split`` is given, ``eval_fraction`` of them (at least
    one when the fraction is positive) is held out.

    Args:
        records: All records, in file order.
        data_cfg: ``max_examples``, ``eval_fraction`` and the eval source.
        seed: Seed of the shuffle.

    Returns:
        ``(train_ids, eval_ids)``: sorted indices into ``records``.

    Raises:
        DataError: The hold-out would leave no training record.
    """
    order = _rng(seed, _SHUFFLE_STREAM).permutation(len(records)).tolist()
    kept, n_eval = selected_counts(len(records), data_cfg)
    order = order[:kept]
    if n_eval >= len(order):
        raise DataError(
            f"data.eval_fraction={data_cfg.eval_fraction} of {len(order)} records leaves no training record"
        )
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def selected_counts(num_records: int, data_cfg: DataConfig) -> tuple[int, int]:
    """``(kept, held_out)``: of ``num_records``, how many :func:`select_records` keeps (``max_examples``) and how
    many of those it holds out (``eval_fraction``, at least one when positive, none with an eval source)."""
    kept = len(range(num_records)[: data_cfg.max_examples])
    held = max(1, round(data_cfg.eval_fraction * kept)) if data_cfg.eval_fraction > 0 and \
        not _has_eval_source(data_cfg) else 0
    return kept, held


#: Partitioners that give every client at least one record (they raise when there are more clients than records).
_ONE_PER_CLIENT = ("iid", "dirichlet", "natural")


def split_problems(data_cfg: DataConfig, partition_cfg: PartitionConfig,
                   num_clients: int) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` when a local ``data.path`` cannot give every client a training record, found by
    counting the file's records (no model, no tokenizer); [] when it can or cannot be told before loading."""
    if partition_cfg.path or partition_cfg.method not in _ONE_PER_CLIENT or num_clients < 1 or not data_cfg.path \
            or not 0 <= data_cfg.eval_fraction < 1:  # (a bad fraction is reported on its own)
        return []
    from fedllm.data.loading import count_local_records

    total = count_local_records(data_cfg.path, data_cfg.split)
    if not total:
        return []
    kept, held = selected_counts(total, data_cfg)
    left = []
    if data_cfg.max_examples is not None and kept < total:
        left.append(f"data.max_examples={data_cfg.max_examples} keeps {kept}")
    if held and kept:
        left.append(f"data.eval_fraction={data_cfg.eval_fraction} holds out {held}")
    where = f"data.path={data_cfg.path!r} holds {total} records" + (f" ({', '.join(left)})" if left else "")
    if kept == 0:
        return [("data.max_examples", data_cfg.max_examples, f"a number that keeps a training record: {where}")]
    if held >= kept:
        return [("data.eval_fraction", data_cfg.eval_fraction, f"a fraction that leaves a training record: {where}")]
    users = partition_cfg.method == "natural" and partition_cfg.column == USER_COLUMN  # (user-keyed JSON: users
    if num_clients > kept - held and not users:                                       # without records are clients)
        return [("federation.num_clients", num_clients,
                 f"at most {kept - held}, the training records to split (federation.partition.method="
                 f"{partition_cfg.method!r} gives every client at least one): {where}")]
    return []


def _partition_cfg(data_cfg: DataConfig, partition_cfg: PartitionConfig) -> PartitionConfig:
    """Default the partition column to the classification label column (after renames)."""
    if partition_cfg.column is None and data_cfg.format == "classification":
        return dataclasses.replace(partition_cfg, column=field_name(data_cfg, "label"))
    return partition_cfg


def partition_ids(
    records: list[dict], ids: list[int], num_clients: int, seed: int, partition_cfg: PartitionConfig
) -> list[list[int]]:
    """Partition the records ``ids`` into clients.

    Args:
        records: All records.
        ids: The training records to split.
        num_clients: Number of clients.
        seed: Seed of the partitioner.
        partition_cfg: Method and its options.

    Returns:
        Sorted indices into ``records`` per client (empty for the users of a user-keyed JSON without training
        records under ``natural`` on ``user``: :func:`~fedllm.data.partition.user_values`).
    """
    parts = partition_records([records[i] for i in ids], num_clients, seed, partition_cfg,
                              user_values(records, partition_cfg))
    return [sorted(ids[j] for j in part) for part in parts]


def split_client_eval(parts: list[list[int]], fraction: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Hold out ``fraction`` of every client's records as its personal test split.

    Args:
        parts: Record ids per client.
        fraction: Share held out per client (0: none); at least one record and
            at most all but one record are held out when positive (none of a client with no records).
        seed: Seed of the choice.

    Returns:
        ``(train_parts, eval_parts)``, sorted ids per client.

    Raises:
        DataError: A client has too few records to hold one out.
    """
    if fraction <= 0:
        return [list(p) for p in parts], [[] for _ in parts]
    rng = _rng(seed, _CLIENT_EVAL_STREAM)
    train, held = [], []
    for client, ids in enumerate(parts):
        if not ids:  # a user-keyed JSON's user without records (natural on user): nothing to hold out
            train.append([])
            held.append([])
            continue
        if len(ids) < 2:
            raise DataError(
                f"client {client} has {len(ids)} record(s): too few to hold out a personal test split "
                f"(data.client_eval_fraction={fraction})"
            )
        n = min(max(1, round(fraction * len(ids))), len(ids) - 1)
        order = rng.permutation(ids).tolist()
        held.append(sorted(order[:n]))
        train.append(sorted(order[n:]))
    return train, held


def _encode_all(encode: Encoder, records: list[dict], what: str, max_length: int, data_cfg: DataConfig,
                source: str, ids: list[int], counts: dict[str, dict[str, int]]) -> list[dict]:
    """Tokenize ``records`` (``ids``: their record numbers in ``source``), handling bad records per
    ``data.on_bad_record`` and counting them under ``counts[what]``, with the kept records that reach
    ``max_length`` tokens (truncated, or exactly that long) as ``truncated``."""
    examples, bad, truncated = [], dict.fromkeys(bad_kinds(data_cfg.format), 0), 0
    for rid, record in zip(ids, records, strict=True):
        kind = bad_record_kind(record, data_cfg)
        example = None if kind else encode(record)
        if kind is None and example is None:
            kind = "too_long"
        if kind is not None:
            if data_cfg.on_bad_record == "error":
                raise DataError(f"{source}: record {rid + 1} ({what}): "
                                f"{_BAD_TEXT[kind].format(max_length=max_length, chars=data_cfg.max_record_chars)} "
                                "(data.on_bad_record: error; set it to drop to drop and count such records)")
            bad[kind] += 1
            continue
        examples.append(example)
        truncated += max(len(example["input_ids"]), len(example.get("rejected_input_ids", ()))) >= max_length
    if records and not examples:
        raise DataError(f"{source}: {what}: none of its {len(records)} records is usable "
                        f"({bad['empty']} empty, {bad['too_long']} with no trainable token within "
                        f"max_length={max_length}, {bad['too_large']} larger than data.max_record_chars"
                        f"{_identical(bad)})")
    if any(bad.values()):
        log.warning("%s: %s: dropped %d empty record(s), %d with no trainable token within max_length=%d and %d "
                    "larger than data.max_record_chars=%s%s, of %d (data.on_bad_record: drop)", source, what,
                    bad["empty"], bad["too_long"], max_length, bad["too_large"], data_cfg.max_record_chars,
                    _identical(bad), len(records))
    if truncated:
        log.info("%s: %s: %d kept record(s) reach max_length=%d tokens and are truncated", source, what, truncated,
                 max_length)
    counts[what] = {**bad, "kept": len(examples), "truncated": truncated}
    return examples


def _identical(bad: dict[str, int]) -> str:
    """``, N with identical answers`` for the preference format's count (nothing for other formats)."""
    return f", {bad['identical']} with identical answers" if "identical" in bad else ""


_BAD_TEXT = {"empty": "a required text is empty", "identical": "the chosen and the rejected answer are the same",
             "too_long": "no trainable token is left within max_length={max_length}",
             "too_large": "more than data.max_record_chars={chars} characters of text (not tokenized)"}


def _load_eval_records(data_cfg: DataConfig, source_path: str) -> list[dict]:
    path = data_cfg.eval_path or source_path
    name = data_cfg.name if path == source_path else None
    return load_records(path, name, data_cfg.eval_split or "test")


def _manifest_parts(manifest: dict, num_clients: int, num_records: int, where: str) -> list[list[int]]:
    parts = manifest_clients(manifest)
    if len(parts) != num_clients:
        raise PartitionError(f"{where}: the manifest has {len(parts)} clients but num_clients is {num_clients}")
    largest = max((max(p) for p in parts if p), default=-1)
    if largest >= num_records:
        raise PartitionError(
            f"{where}: the manifest refers to record {largest} but the data has {num_records} records "
            "(was it written for another data file?)"
        )
    return parts


def build_federated_data(
    data_cfg: DataConfig,
    partition_cfg: PartitionConfig,
    num_clients: int,
    tokenizer: Any,
    max_length: int,
    seed: int,
    task: str = "causal_lm",
) -> FederatedData:
    """Load, split and tokenize the training data of a federation.

    Args:
        data_cfg: The ``data`` section of the recipe.
        partition_cfg: ``federation.partition``.
        num_clients: ``federation.num_clients``.
        tokenizer: The model's tokenizer.
        max_length: ``train.max_length``.
        seed: The recipe seed (shuffle, partition, personal splits).
        task: ``causal_lm`` or ``classification``; must match ``data.format``.

    Returns:
        The :class:`FederatedData`.

    Raises:
        DataError: Loading/formatting problems, or a client left without examples.
        PartitionError: The partition is impossible or the manifest does not fit.
    """
    if FORMAT_TASKS.get(data_cfg.format) != task:
        raise DataError(
            f"data.format {data_cfg.format!r} trains a {FORMAT_TASKS.get(data_cfg.format)} model, "
            f"but the model task is {task!r}"
        )
    partition_cfg = _partition_cfg(data_cfg, partition_cfg)
    manifest = load_manifest(partition_cfg.path) if partition_cfg.path else None
    source_path = data_cfg.path or (manifest or {}).get("source", {}).get("path", "")
    records = load_records(source_path, data_cfg.name, data_cfg.split)
    check_records(records, data_cfg, source_path)
    if manifest is not None:
        parts = _manifest_parts(manifest, num_clients, len(records), str(partition_cfg.path))
        eval_ids = [] if _has_eval_source(data_cfg) else list(manifest.get("eval", []))
    else:
        train_ids, eval_ids = select_records(records, data_cfg, seed)
        try:
            parts = partition_ids(records, train_ids, num_clients, seed, partition_cfg)
        except PartitionError as e:  # name the file and the keys behind the numbers
            held = f", {len(records) - len(train_ids)} held out or left out by data.eval_fraction / " \
                   f"data.max_examples" if len(train_ids) < len(records) else ""
            raise PartitionError(f"data.path={source_path!r} ({len(records)} records{held}), "
                                 f"federation.num_clients={num_clients}, federation.partition.method="
                                 f"{partition_cfg.method!r}: {e}") from None
        manifest = partition_manifest(
            parts, records, partition_cfg.column, partition_cfg.method, seed=seed, beta=partition_cfg.beta,
            source={"path": source_path, "name": data_cfg.name, "split": data_cfg.split}, eval=eval_ids,
        )
    if _has_eval_source(data_cfg):
        eval_records = _load_eval_records(data_cfg, source_path)
        eval_source, eval_record_ids = data_cfg.eval_path or source_path, list(range(len(eval_records)))
        check_records(eval_records, data_cfg, eval_source)
    else:
        eval_records, eval_source, eval_record_ids = [records[i] for i in eval_ids], source_path, list(eval_ids)
    train_parts, personal_parts = split_client_eval(parts, data_cfg.client_eval_fraction, seed)

    label_names = None
    if task == "classification":
        used = [records[i] for part in parts for i in part] + eval_records
        label_names = resolve_label_names(used, data_cfg)
    cache = open_token_cache(data_cfg, tokenizer, max_length, label_names, source_path)
    encode = cache.wrap(make_encoder(tokenizer, data_cfg, max_length, label_names))

    examples: list[dict] = []
    clients: list[list[int]] = []
    counts: dict[str, dict[str, int]] = {}
    for client, ids in enumerate(train_parts):
        start = len(examples)
        examples.extend(_encode_all(encode, [records[i] for i in ids], f"client {client}", max_length, data_cfg,
                                    source_path, ids, counts))
        clients.append(list(range(start, len(examples))))
    client_eval_records = [[records[i] for i in ids] for ids in personal_parts]
    client_eval = [
        _encode_all(encode, recs, f"client {c} personal test split", max_length, data_cfg, source_path,
                    personal_parts[c], counts)
        for c, recs in enumerate(client_eval_records)
    ]
    eval_examples = _encode_all(encode, eval_records, "held-out data", max_length, data_cfg, eval_source,
                                eval_record_ids, counts)
    manifest = {**manifest, "bad_records": {"policy": data_cfg.on_bad_record, "counts": counts}}
    data = FederatedData(
        examples=examples,
        clients=clients,
        client_eval=client_eval,
        client_eval_records=client_eval_records,
        eval_records=eval_records,
        eval_examples=eval_examples,
        label_names=label_names,
        manifest=manifest,
    )
    cache.save()
    data.cache_info = cache.info()
    return data


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def partition_to_disk(
    data_cfg: DataConfig, partition_cfg: PartitionConfig, num_clients: int, seed: int, out_dir: str | os.PathLike
) -> dict:
    """Partition a data set and write it out (what ``fedllm partition`` runs).

    Writes ``client_000.jsonl`` ... (each client's raw records), ``eval.jsonl``
    when records are held out, and ``manifest.json`` last. Pass the directory as
    ``federation.partition.path`` to train on exactly this split.

    Args:
        data_cfg: Data source, ``max_examples`` and ``eval_fraction``.
        partition_cfg: Method and its options.
        num_clients: Number of clients.
        seed: Seed of shuffle and partition (use the recipe's seed).
        out_dir: Output directory (created).

    Returns:
        The manifest written.
    """
    partition_cfg = _partition_cfg(data_cfg, partition_cfg)
    records = load_records(data_cfg.path, data_cfg.name, data_cfg.split)
    train_ids, eval_ids = select_records(records, data_cfg, seed)
    parts = partition_ids(records, train_ids, num_clients, seed, partition_cfg)
    manifest = partition_manifest(
        parts, records, partition_cfg.column, partition_cfg.method, seed=seed, beta=partition_cfg.beta,
        source={"path": data_cfg.path, "name": data_cfg.name, "split": data_cfg.split}, eval=eval_ids,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for client, ids in enumerate(parts):
        _write_jsonl(out / f"client_{client:03d}.jsonl", [records[i] for i in ids])
    if eval_ids:
        _write_jsonl(out / "eval.jsonl", [records[i] for i in eval_ids])
    save_manifest(out / "manifest.json", manifest)
    return manifest
