"""Keyed tensor dicts <-> Flower records, in the wire dtype (``federation.comm_dtype``), as ONE Flower ``Array``.

A tensor travels as ``comm_dtype`` (half the bytes for bf16/fp16) and comes back in the dtype it had, holding exactly
the values :func:`fedllm.models.state.cast` gives in the in-process simulation.

All tensors of a record travel end to end in one contiguous buffer in the safetensors format (an 8-byte header size,
a JSON header naming each tensor's wire dtype, shape and byte offsets, then the bytes; bf16 natively), written and
checked by the ``safetensors`` library; the header's metadata names the format (:data:`FORMAT`), the original
dtype of each tensor that travels in another (a float cast to ``comm_dtype``) and the tensors' order (safetensors
sorts them; fedllm's keyed states keep theirs). The record holds that buffer as its only ``Array`` (entry
:data:`ENTRY`, ``stype`` :data:`STYPE`).
Why one: every ``Array`` of a Flower message is an object of Flower's object store, and so is each of its 5 MiB
chunks; each object is its own request through each hop (ServerApp → SuperLink → SuperNode → worker and back), so an
adapter sent one Array per tensor (240 for SmolLM2's r 8 q/k/v/o) was ~480 requests per hop, and is now its size
in 5 MiB chunks plus two (docs/flower.md, "Moving tensors").

A record of an older fedllm (one Array per tensor, entries ``<name>|<orig>|<wire>``) is refused with a message saying
so, and so is a buffer whose header is malformed (offsets past its end or overlapping, an unknown dtype, a shape that
does not match its bytes, a dtype the metadata does not allow): never mis-read.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fedllm.models.state import DTYPES, StateDict

SEP = "|"
ENTRY = "fedllm.tensors"
"""The name of a record's one ``Array``."""
STYPE = "safetensors"
"""Its serialisation type (Flower's ``Array.stype``; Flower's own ``Array.numpy`` refuses it)."""
FORMAT = "fedllm.records/2"
"""The format named in the buffer's metadata; ``1`` was one numpy ``Array`` per tensor (fedllm before one-array)."""
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class RecordError(ValueError):
    """A record fedllm cannot read: another format, or a malformed buffer."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(state: StateDict, comm_dtype: str = "fp32") -> ArrayRecord:
    """``state`` as an :class:`ArrayRecord` of one ``Array``; floating tensors travel as ``comm_dtype``."""
    from safetensors.torch import save

    if not state:
        return ArrayRecord()
    wire, seen = {}, set()
    for key, tensor in state.items():
        if key == "__metadata__":
            raise ValueError(f"tensor name {key!r} is reserved by the safetensors format")
        t = tensor.detach().cpu()
        if t.is_floating_point():
            t = t.to(DTYPES[comm_dtype])
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors sharing memory
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        wire[key] = t
    changed = {k: _name(v.dtype) for k, v in state.items() if v.dtype != wire[k].dtype}  # cast to comm_dtype
    rank = {k: i for i, k in enumerate(sorted(wire))}  # safetensors sorts its tensors: the order they came in
    metadata = {"format": FORMAT, "dtypes": json.dumps(changed), "order": json.dumps([rank[k] for k in wire])}
    blob = save(wire, metadata=metadata)
    return ArrayRecord({ENTRY: Array(dtype="uint8", shape=(len(blob),), stype=STYPE, data=blob)})


def _blob(record: ArrayRecord) -> bytes | None:
    """The record's safetensors buffer (``None`` for an empty record); a record of another format is refused."""
    entries = list(record.keys())
    if not entries:
        return None
    if entries != [ENTRY] or record[ENTRY].stype != STYPE:
        old = [e for e in entries if e.count(SEP) >= 2]
        if old:
            raise RecordError(
                f"a record with one Array per tensor ({len(entries)}, e.g. {old[0]!r}): the format of a fedllm before "
                f"{FORMAT} (one Array per record); run the same fedllm on the ServerApp and the nodes")
        raise RecordError(f"not a fedllm record: entries {entries[:3]} (expected one {ENTRY!r} of stype {STYPE!r})")
    return record[ENTRY].data


def _header(blob: bytes) -> dict[str, Any]:
    """The JSON header of a buffer that :func:`safetensors.deserialize` has already validated."""
    return json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])


def decode(record: ArrayRecord) -> StateDict:
    """Inverse of :func:`encode`: every tensor back in its original dtype (on the CPU)."""
    from safetensors.torch import load

    blob = _blob(record)
    if blob is None:
        return {}
    try:
        wire = load(blob)
    except Exception as e:  # safetensors raises its own error types (offsets, dtypes, shapes)
        raise RecordError(f"malformed {ENTRY} buffer ({len(blob)} bytes): {e}") from e
    meta = _header(blob).get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise RecordError(f"{ENTRY}: format {meta.get('format')!r}, expected {FORMAT!r}; run the same fedllm on the "
                          "ServerApp and the nodes")
    try:
        dtypes, order = json.loads(meta["dtypes"]), json.loads(meta["order"])
    except (KeyError, ValueError) as e:
        raise RecordError(f"{ENTRY}: no readable original dtypes and order in its metadata ({e!r})") from e
    if not isinstance(order, list) or not all(type(i) is int for i in order) or sorted(order) != list(range(len(wire))):
        raise RecordError(f"{ENTRY}: its order {str(order)[:40]} is not a permutation of its {len(wire)} tensors")
    if not isinstance(dtypes, dict) or not all(isinstance(d, str) for d in dtypes.values()) \
            or not set(dtypes) <= set(wire):
        raise RecordError(f"{ENTRY}: its metadata's dtypes {str(dtypes)[:60]} are not names of tensors it carries "
                          "and their dtypes")
    out: StateDict = {}
    names = sorted(wire)
    for key in (names[i] for i in order):
        tensor = wire[key]
        orig = TORCH_DTYPES.get(dtypes.get(key, _name(tensor.dtype)))
        if orig is None or orig.is_floating_point != tensor.is_floating_point() or (
                not orig.is_floating_point and orig != tensor.dtype):
            raise RecordError(f"{ENTRY}: tensor {key!r} travelled as {_name(tensor.dtype)} but names "
                              f"{dtypes.get(key)!r} as its dtype (expected one of {sorted(TORCH_DTYPES)}, floating "
                              "only for a floating tensor, the same for the others)")
        out[key] = tensor.to(orig, copy=True)  # its own memory, not the message's buffer
    return out


def encode_packed(packed: dict[str, Any]) -> tuple[ArrayRecord, str]:
    """Compressed tensors (:class:`fedllm.models.compression.Packed`) as an :class:`ArrayRecord` of their codes
    (uint8) and block absmax (fp32), exactly what is counted as sent, and the JSON of how to read them back (kind,
    block size and shape of each: what the receiver knows from the recipe and the tensor's name)."""
    tensors, layout = {}, {}
    for key, p in packed.items():
        if SEP in key:
            raise ValueError(f"tensor name {key!r} contains {SEP!r}")
        tensors[f"{key}{SEP}codes"], tensors[f"{key}{SEP}absmax"] = p.codes, p.absmax
        layout[key] = [p.kind, p.block_size, list(p.shape)]
    return encode(tensors, "fp32"), json.dumps(layout)


def decode_packed(record: ArrayRecord, layout_json: str) -> dict[str, Any]:
    """Inverse of :func:`encode_packed`."""
    from fedllm.models.compression import Packed

    arrays = decode(record)
    return {key: Packed(arrays[f"{key}{SEP}codes"], arrays[f"{key}{SEP}absmax"], tuple(shape), kind, block)
            for key, (kind, block, shape) in json.loads(layout_json).items()}


def record_bytes(record: ArrayRecord) -> int:
    """Payload bytes of a record's tensors (what the wire carries, without the safetensors header, Flower's object
    headers and framing: the same count as when each tensor was its own Array)."""
    blob = _blob(record)
    return 0 if blob is None else len(blob) - 8 - int.from_bytes(blob[:8], "little")


def split_extra(extra: dict[str, Any]) -> tuple[StateDict, str]:
    """A plan's ``extra`` as (tensors keyed ``<entry>/<name>`` or ``<entry>``, JSON of the rest)."""
    tensors: StateDict = {}
    rest: dict[str, Any] = {}
    for key, value in extra.items():
        if torch.is_tensor(value):
            tensors[key] = value
        elif isinstance(value, dict) and value and all(torch.is_tensor(v) for v in value.values()):
            tensors.update({f"{key}/{k}": v for k, v in value.items()})
            rest.setdefault("__dicts__", []).append(key)
        else:
            rest[key] = value
    return tensors, json.dumps(rest)


def join_extra(tensors: StateDict, rest_json: str) -> dict[str, Any]:
    """Inverse of :func:`split_extra`."""
    rest = json.loads(rest_json)
    dicts = rest.pop("__dicts__", [])
    extra: dict[str, Any] = dict(rest)
    for key, value in tensors.items():
        head, _, tail = key.partition("/")
        if head in dicts:
            extra.setdefault(head, {})[tail] = value
        else:
            extra[key] = value
    return extra
