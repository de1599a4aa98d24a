"""The records a FlowerTune challenge evaluates: ``eval.data.<task>.<set>`` (a local file or hub spec), else the
hub data set FlowerTune's code loads; the same selection of rows as FlowerTune.

A local file holds the rows FlowerTune loads *before* its own selection: MMLU rows with their ``subset`` (the
subject; FlowerTune's ``lukaemon/mmlu`` per-subject configs), FPB's ``train`` split and FiQA's
``train``+``validation``+``test`` splits concatenated in that order (both then split 75/25 with seed 42 as
FlowerTune's ``train_test_split(0.25, seed=42)``), the evaluated split of the others.

The Code harness pins ``nuprl/MultiPL-E`` to one revision
(:data:`~fedllm.evaluation.flowertune_code_prompts.MULTIPLE_REVISION`), which is loaded as pinned.

FlowerTune's code loads some hub sets through their loading scripts (``lukaemon/mmlu``, ``bigbio/pubmed_qa``,
``bigbio/med_qa``: ``trust_remote_code=True``), which ``datasets`` >= 4 no longer runs; when a set FlowerTune
(or the code harness: ``nuprl/MultiPL-E``) names by config cannot be loaded from the hub's main branch, the Hub's automatic Parquet conversion of it is
tried: the revision ``refs/convert/parquet``, whose files lie under ``<config>/<split>/`` (``data_dir`` = the
config FlowerTune names, split as FlowerTune's).
"""

from __future__ import annotations

import logging
from typing import Any

from fedllm.data.errors import DataError
from fedllm.evaluation.flowertune_prompts import MMLU_CATEGORIES, QuestionSet
from fedllm.evaluation.sources import DataSourceError, HubSource, read_hub, read_records

log = logging.getLogger("fedllm")
MMLU_HUB = "lukaemon/mmlu"
PARQUET_EXPORT = "refs/convert/parquet"


def data_key(task: str, key: str) -> str:
    """``eval.data`` key of one data set of a challenge: ``flowertune_medical.pubmedqa``."""
    return f"{task}.{key}"


def read_parquet_export(source: HubSource) -> list[dict]:
    """The rows of ``source``'s config and split in the Hub's Parquet conversion of the data set.

    Raises:
        DataError: the conversion cannot be read (offline and not cached, no such branch or config).
    """
    import datasets

    try:
        ds = datasets.load_dataset(source.path, data_dir=source.name, split=source.split, revision=PARQUET_EXPORT)
    except Exception as e:  # noqa: BLE001  (the hub client raises many types)
        raise DataError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    rows = ds.to_list()
    if not rows:
        raise DataError(f"{source.path}@{PARQUET_EXPORT}/{source.name}/{source.split}: holds no rows")
    return rows


def read_pinned(source: HubSource, revision: str) -> list[dict]:
    """The rows of ``source`` at the hub revision ``revision`` (a commit the reference harness pins).

    Raises:
        DataError: it cannot be loaded (offline and not cached, a loading script ``datasets`` no longer runs).
    """
    import datasets

    try:
        ds = datasets.load_dataset(source.path, source.name, split=source.split, revision=revision)
    except Exception as e:  # noqa: BLE001  (the hub client raises many types)
        raise DataError(f"{source.spec()} at revision {revision}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return ds.to_list()


def read_hub_set(source: HubSource, revision: str = "") -> list[dict]:
    """``source`` from the hub (at ``revision`` when given); for a config FlowerTune or the harness names, the
    Parquet conversion when that fails (a conversion of the default branch: a warning says so for a pinned set).

    Raises:
        DataError: neither loads (the message gives both reasons).
    """
    try:
        return read_pinned(source, revision) if revision else read_hub(source)
    except DataError as e:
        if not source.name:
            raise
        try:
            rows = read_parquet_export(source)
        except DataError as export_error:
            raise DataError(f"{e}; nor from its Parquet conversion ({PARQUET_EXPORT}, data_dir {source.name!r}): "
                            f"{export_error}") from None
        if revision:
            log.warning("%s: the revision the harness pins (%s) could not be read (%s); read the Hub's Parquet "
                        "conversion (%s), which is of the default branch: the rows may differ from the harness's",
                        source.spec(), revision, e, PARQUET_EXPORT)
        return rows


def _hub_rows(qs: QuestionSet) -> list[dict]:
    if qs.hub.path == MMLU_HUB:
        return [{**row, "subset": subject} for subject in MMLU_CATEGORIES[qs.key]
                for row in read_hub_set(HubSource(qs.hub.path, subject, "test"))]
    splits = qs.hub_splits or (qs.hub.split,)
    return [row for split in splits for row in read_hub_set(HubSource(qs.hub.path, qs.hub.name, split))]


def test_part(rows: list[dict], fraction: float, seed: int = 42) -> list[dict]:
    """``datasets``' ``train_test_split(fraction, seed=seed)["test"]`` of ``rows``, in its order."""
    from datasets import Dataset

    return Dataset.from_list(rows).train_test_split(fraction, seed=seed)["test"].to_list()


def question_rows(ctx: Any, task: str, qs: QuestionSet) -> list[dict]:
    """The rows of ``qs`` that FlowerTune evaluates (all of them: FlowerTune takes no sample; ``eval.limit``
    keeps the first N).

    Raises:
        DataSourceError: the data are neither given nor loadable (offline, or a hub data set that needs a
            loading script, which ``datasets`` >= 4 no longer runs, and has no readable Parquet conversion);
            the message names the task, the hub id and the key to set.
    """
    key = data_key(task, qs.key)
    spec = ctx.data_spec(key)
    if not spec and qs.hub.path == MMLU_HUB:  # one MMLU file may serve the three categories
        spec = ctx.data_spec(data_key(task, "mmlu"))
        key = data_key(task, "mmlu") if spec else key
    try:
        rows = read_records(spec, qs.hub.split) if spec else _hub_rows(qs)
    except DataError as e:
        source = f"--data {key}={spec}" if spec else f"the hub data set {qs.hub.spec()}"
        raise DataSourceError(
            f"{task}: {qs.key} could not be read from {source} ({e}); give a local copy of {qs.hub.spec()} with "
            f"eval.data.{key} (--data {key}=PATH; eval/README.md says which rows)") from e
    if qs.hub.path == MMLU_HUB:
        subjects = MMLU_CATEGORIES[qs.key]
        if rows and "subset" not in rows[0]:
            raise DataSourceError(f"eval.data.{key}: MMLU rows need a 'subset' field (the subject), got keys "
                                  f"{sorted(rows[0])}")
        rows = [row for subject in subjects for row in rows if row["subset"] == subject]
    if qs.test_fraction:
        rows = test_part(rows, qs.test_fraction)
    return ctx.limited(rows)
