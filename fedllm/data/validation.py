"""Per-file validation of raw records before anything trains on them.

Three kinds of problems, each named by file, record number (1-based, in file order) and field:

* bytes that are not UTF-8 (:func:`decode_utf8`, used by the loaders): exit 2 with the line;
* a missing required field, or a value of the wrong type where text (or a label) is expected
  (:func:`check_records`): always exit 2, since the recipe's ``data.fields`` or the data is wrong;
* *bad records* (:func:`bad_record_kind` and the encoders): ``empty`` (a required text is empty
  or whitespace), ``too_large`` (more than ``data.max_record_chars`` characters of text, found before
  tokenizing) and ``too_long`` (nothing trainable is left within ``train.max_length``).
  ``data.on_bad_record: error`` stops with exit 2 naming the first one; ``drop`` drops them and
  counts them per client in ``partition.json`` (``bad_records``) and in the log.
  Records longer than ``max_length`` that keep a trainable token are truncated (see
  :mod:`fedllm.data.formats`), not dropped.
"""

from __future__ import annotations

from typing import Any, Optional

from fedllm.common.errors import did_you_mean
from fedllm.data.errors import DataError
from fedllm.data.templates import field_name
from fedllm.recipe.schema import DataConfig, PartitionConfig

BAD_KINDS = ("empty", "too_long", "too_large")
"""Kinds of bad records counted in ``partition.json``."""
#: Kinds counted only for some formats (preference: a chosen answer equal to the rejected one).
FORMAT_BAD_KINDS: dict[str, tuple[str, ...]] = {"preference": ("identical",)}


def bad_kinds(fmt: str) -> tuple[str, ...]:
    """The kinds of bad records counted for data.format ``fmt``."""
    return BAD_KINDS + FORMAT_BAD_KINDS.get(fmt, ())

#: Text fields of each format: ``(canonical name, required)``.
TEXT_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "instruction": (("instruction", True), ("input", False), ("output", True)),
    "classification": (("text", True), ("text_pair", False)),
    "chat": (),
    "preference": (),
}


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` as text; :class:`DataError` naming the line and column of the first non-UTF-8 byte."""
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is allowed (and dropped)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{source}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); "
                        "re-encode the file as UTF-8") from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _field_problem(record: dict, data_cfg: DataConfig, key: str, required: bool) -> Optional[str]:
    column = field_name(data_cfg, key)
    renamed = f" (data.fields maps {key!r} to it)" if column != key else ""
    if column not in record:
        if required:
            return f"field {column!r}{renamed} is missing; the record has {sorted(record)}"
        return None
    value = record[column]
    if isinstance(value, str) or (value is None and not required):
        return None
    return f"field {column!r}{renamed} is {_kind(value)} {value!r:.60}; expected a string"


def _label_problem(record: dict, data_cfg: DataConfig) -> Optional[str]:
    column = field_name(data_cfg, "label")
    if column not in record:
        return f"field {column!r} (the label) is missing; the record has {sorted(record)}"
    value = record[column]
    if isinstance(value, (str, int)) or (isinstance(value, float) and value.is_integer()):
        return None
    return f"field {column!r} (the label) is {_kind(value)} {value!r:.60}; expected an integer or a string"


def _chat_problem(record: dict, data_cfg: DataConfig) -> Optional[str]:
    from fedllm.data.chat import record_messages

    for key in ("messages", "conversations"):
        column = field_name(data_cfg, key)
        if column in record and not isinstance(record[column], list):
            return f"field {column!r} is {_kind(record[column])}; expected a list of turns"
    try:
        turns = record_messages(record, data_cfg)
    except DataError as e:
        return str(e)
    for column in ("messages", "conversations"):
        raw = record.get(field_name(data_cfg, column))
        for i, turn in enumerate(raw or []):
            content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
            if not isinstance(content, str):
                return f"field {field_name(data_cfg, column)!r}: turn {i} has content of type {_kind(content)}; " \
                       "expected a string"
    return None if turns is not None else "no conversation"


def _preference_problem(record: dict, data_cfg: DataConfig) -> Optional[str]:
    from fedllm.data.preference import preference_parts

    try:
        preference_parts(record, data_cfg)
    except DataError as e:
        return str(e)
    return None


def record_problem(record: dict, data_cfg: DataConfig) -> Optional[str]:
    """Why ``record`` cannot be used at all (missing or mistyped field), or None."""
    if data_cfg.format == "chat":
        return _chat_problem(record, data_cfg)
    if data_cfg.format == "preference":
        return _preference_problem(record, data_cfg)
    for key, required in TEXT_FIELDS.get(data_cfg.format, ()):
        problem = _field_problem(record, data_cfg, key, required)
        if problem:
            return problem
    if data_cfg.format == "classification":
        return _label_problem(record, data_cfg)
    return None


def column_problems(data_cfg: DataConfig, partition_cfg: PartitionConfig, records: list[dict],
                    source: str) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` for every recipe key that names a column no record of ``records`` (a sample of
    ``source``) has: a required field of ``data.format`` (after ``data.fields``), the partition column of
    ``dirichlet``/``natural``; and class names in ``data.labels`` that miss a label value of the records."""
    if not records:
        return []
    columns = sorted(set().union(*records))
    have = f"a column of {source} (its records have {', '.join(columns)})"
    problems = []
    fields = [key for key, required in TEXT_FIELDS.get(data_cfg.format, ()) if required]
    fields += ["label"] if data_cfg.format == "classification" else []
    fields += ["chosen", "rejected"] if data_cfg.format == "preference" else []
    for key in fields:
        column = field_name(data_cfg, key)
        if not any(column in r for r in records):
            problems.append((f"data.fields.{key}", column, have + did_you_mean(column, columns)))
    if partition_cfg.method in ("dirichlet", "natural") and not partition_cfg.path:
        column = partition_cfg.column or (field_name(data_cfg, "label") if data_cfg.format == "classification"
                                          else None)
        named = {given for _, given, _ in problems}  # a label column already reported is not reported twice
        if column is not None and column not in named and not any(column in r for r in records):
            problems.append(("federation.partition.column", column, have + did_you_mean(column, columns)))
    label = field_name(data_cfg, "label")
    if data_cfg.format == "classification" and data_cfg.labels and any(label in r for r in records):
        values = {r[label] for r in records if isinstance(r.get(label), (str, int))}
        unnamed = sorted(v for v in values if isinstance(v, str) and v not in data_cfg.labels)
        unnamed += sorted(v for v in values if isinstance(v, int) and not 0 <= v < len(data_cfg.labels))
        if unnamed:
            problems.append(("data.labels", data_cfg.labels, f"class names covering every label of {source} (not "
                                                              f"named: {', '.join(map(repr, unnamed[:10]))})"))
    return problems


def check_records(records: list[dict], data_cfg: DataConfig, source: str) -> None:
    """Check every record's fields and types for ``data.format``.

    Raises:
        DataError: names the file, the first bad record (1-based) and its field, and how many others.
    """
    bad = [(i, p) for i, r in enumerate(records) if (p := record_problem(r, data_cfg))]
    if bad:
        i, problem = bad[0]
        more = f" ({len(bad) - 1} more record(s) with such problems)" if len(bad) > 1 else ""
        raise DataError(f"{source}: record {i + 1}: {problem}{more}")


def text_size(value: Any) -> int:
    """Characters of every string inside ``value`` (dicts and lists walked)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0


def bad_record_kind(record: dict, data_cfg: DataConfig) -> Optional[str]:
    """``"too_large"`` when ``record`` holds more than ``data.max_record_chars`` characters of text (checked
    before anything tokenizes it), ``"empty"`` when a required text is empty or whitespace (preference: either
    answer), ``"identical"`` when a preference record's answers are the same, else None."""
    if data_cfg.max_record_chars is not None and text_size(record) > data_cfg.max_record_chars:
        return "too_large"
    if data_cfg.format == "chat":
        from fedllm.data.chat import record_messages

        replies = [m["content"] for m in record_messages(record, data_cfg) if m["role"] == "assistant"]
        return "empty" if not any(r.strip() for r in replies) else None
    if data_cfg.format == "preference":
        from fedllm.data.preference import answer_texts, preference_parts

        chosen, rejected = answer_texts(preference_parts(record, data_cfg))
        return "empty" if not (chosen.strip() and rejected.strip()) else "identical" if chosen == rejected else None
    for key, required in TEXT_FIELDS.get(data_cfg.format, ()):
        if required and not str(record.get(field_name(data_cfg, key)) or "").strip():
            return "empty"
    return None
