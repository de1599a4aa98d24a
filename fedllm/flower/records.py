"""Keyed tensor dicts <-> Flower records, in the wire dtype (``federation.comm_dtype``).

A tensor travels as ``comm_dtype`` (half the bytes for bf16/fp16) and comes back in the dtype it had,
holding exactly the values :func:`fedllm.models.state.cast` gives in the in-process simulation. NumPy has no
bfloat16, so bf16 tensors travel as their int16 bit pattern. The entry name carries the original and the
wire dtype (``<name>|<orig>|<wire>``); Flower slices large arrays into chunks on the way (its large-message
support), so an adapter of any size fits in one record.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fedllm.models.state import DTYPES, StateDict

SEP = "|"
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(state: StateDict, comm_dtype: str = "fp32") -> ArrayRecord:
    """``state`` as an :class:`ArrayRecord`; floating tensors travel as ``comm_dtype``."""
    record = ArrayRecord()
    for key, tensor in state.items():
        if SEP in key:
            raise ValueError(f"tensor name {key!r} contains {SEP!r}")
        wire = tensor.detach().cpu()
        if wire.is_floating_point():
            wire = wire.to(DTYPES[comm_dtype])
        bits = wire.view(torch.int16) if wire.dtype == torch.bfloat16 else wire
        record[f"{key}{SEP}{_name(tensor.dtype)}{SEP}{_name(wire.dtype)}"] = Array(bits.contiguous().numpy())
    return record


def decode(record: ArrayRecord) -> StateDict:
    """Inverse of :func:`encode`: every tensor back in its original dtype (on the CPU)."""
    out: StateDict = {}
    for entry, array in record.items():
        key, orig, wire = entry.rsplit(SEP, 2)
        tensor = torch.from_numpy(array.numpy().copy())
        if wire == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        out[key] = tensor.to(TORCH_DTYPES[orig])
    return out


def encode_packed(packed: dict[str, Any]) -> tuple[ArrayRecord, str]:
    """Compressed tensors (:class:`fedllm.models.compression.Packed`) as an :class:`ArrayRecord` of their codes
    (uint8) and block absmax (fp32), exactly what is counted as sent, and the JSON of how to read them back (kind,
    block size and shape of each: what the receiver knows from the recipe and the tensor's name)."""
    record, layout = ArrayRecord(), {}
    for key, p in packed.items():
        if SEP in key:
            raise ValueError(f"tensor name {key!r} contains {SEP!r}")
        record[f"{key}{SEP}codes"] = Array(p.codes.contiguous().numpy())
        record[f"{key}{SEP}absmax"] = Array(p.absmax.contiguous().numpy())
        layout[key] = [p.kind, p.block_size, list(p.shape)]
    return record, json.dumps(layout)


def decode_packed(record: ArrayRecord, layout_json: str) -> dict[str, Any]:
    """Inverse of :func:`encode_packed`."""
    from fedllm.models.compression import Packed

    arrays = {entry: torch.from_numpy(array.numpy().copy()) for entry, array in record.items()}
    return {key: Packed(arrays[f"{key}{SEP}codes"], arrays[f"{key}{SEP}absmax"], tuple(shape), kind, block)
            for key, (kind, block, shape) in json.loads(layout_json).items()}


def record_bytes(record: ArrayRecord) -> int:
    """Payload bytes of a record's tensors (what the wire carries, without headers and framing)."""
    import math

    import numpy as np

    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in record.values())


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
