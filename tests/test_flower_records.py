"""A message's tensors travel as ONE Flower ``Array`` (fedllm.flower.records): few objects, exact values, strict reads.

Expectations are independent of the code under test: object counts from Flower's own walk of a message
(``get_all_nested_objects``) against the count of chunks the buffer's length implies (5 MiB each); values against
:func:`fedllm.models.state.cast` (what the simulation holds); payload bytes by hand; malformed buffers written byte by
byte after the safetensors format's specification (8-byte little-endian header size, JSON header, data).
"""

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedllm.flower import records
from fedllm.models.state import cast

CHUNK = 5 * 2**20  # Flower's FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE default


@pytest.fixture
def task_identity(monkeypatch):
    """What pulling a task sets in a worker (a Message needs it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 5)


def smollm2_adapter() -> dict[str, torch.Tensor]:
    """A SmolLM2-135M LoRA adapter's shapes: r 16 on q/k/v/o of 30 layers (hidden 576, 3 kv heads of 64): 240
    tensors."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(30):
        for proj, width in (("q", 576), ("k", 192), ("v", 192), ("o", 576)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj"
            out[f"{stem}.lora_A.weight"] = torch.randn(16, 576, generator=gen)
            out[f"{stem}.lora_B.weight"] = torch.randn(width, 16, generator=gen)
    return out


@pytest.mark.parametrize("comm", ["fp32", "bf16"])
def test_a_240_tensor_adapter_is_one_array_and_decodes_exactly(comm, task_identity):
    state = smollm2_adapter()
    assert len(state) == 240
    record = records.encode(state, comm)
    assert list(record) == [records.ENTRY]
    size = sum(t.numel() for t in state.values()) * {"fp32": 4, "bf16": 2}[comm]
    assert records.record_bytes(record) == size  # the tensors' payload, as counted before
    blob = len(record[records.ENTRY].data)
    assert size < blob < size + 250 * len(state)  # the layout (names of ~60 characters): under 250 bytes a tensor
    message = Message(RecordDict({"plan": record, "fedllm": ConfigRecord({"round": 1})}), dst_node_id=1,
                      message_type="train")
    objects = get_all_nested_objects(message)
    # Message, RecordDict, ConfigRecord, ArrayRecord, Array and its 5 MiB chunks (was 1 Array + 1 chunk per tensor)
    assert len(objects) == 5 + math.ceil(blob / CHUNK)
    back = records.decode(record)
    want = cast(state, comm)
    assert list(back) == list(state)
    for k, t in back.items():
        assert t.dtype == torch.float32 and torch.equal(t, want[k]), k


def test_every_dtype_and_odd_shapes_come_back_bit_for_bit():
    nan = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])  # a NaN payload, a signed zero, a subnormal
    state = {"bf": torch.randn(3, 1, 5).to(torch.bfloat16), "half": torch.randn(7).half(), "f64": torch.randn(2).double(),
             "i64": torch.tensor([-(2**62), 5]), "i8": torch.tensor([-3], dtype=torch.int8), "b": torch.tensor([True]),
             "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
             "special": nan, "view": torch.arange(12.0).reshape(3, 4).t()}  # non-contiguous
    state["alias"] = state["half"]  # two names, one tensor (safetensors alone refuses shared memory)
    for comm in ("fp32", "fp16", "bf16"):
        back = records.decode(records.encode(state, comm))
        want = cast(state, comm)
        assert list(back) == list(state)  # the order they were given in (safetensors sorts them on the wire)
        for k, sent in state.items():
            assert back[k].dtype == sent.dtype and back[k].shape == sent.shape, k
            assert torch.equal(back[k].view(-1).view(torch.uint8), want[k].contiguous().view(-1).view(torch.uint8)), k
    assert records.decode(records.encode({})) == {} and records.record_bytes(records.encode({})) == 0


def test_compressed_tensors_travel_in_one_array():
    from fedllm.models.compression import Packed

    packed = {f"w{i}": Packed(torch.randint(0, 255, (64,), dtype=torch.uint8), torch.rand(2), (8, 16), "nf4", 64)
              for i in range(50)}
    record, layout = records.encode_packed(packed)
    assert list(record) == [records.ENTRY] and records.record_bytes(record) == 50 * (64 + 2 * 4)
    back = records.decode_packed(record, layout)
    for k, p in packed.items():
        assert torch.equal(back[k].codes, p.codes) and torch.equal(back[k].absmax, p.absmax)
        assert (back[k].shape, back[k].kind, back[k].block_size) == (p.shape, p.kind, p.block_size)


def test_a_record_of_an_older_fedllm_is_refused_with_a_message():
    old = ArrayRecord({"a.weight|float32|bfloat16": Array(np.zeros(3, dtype=np.int16)),
                       "n|int64|int64": Array(np.arange(2))})
    with pytest.raises(records.RecordError, match=r"one Array per tensor \(2, e.g. 'a.weight\|float32\|bfloat16'\).*same "
                                                  "fedllm on the ServerApp and the nodes"):
        records.decode(old)
    with pytest.raises(records.RecordError, match="not a fedllm record"):
        records.decode(ArrayRecord([np.zeros(3)]))


def blob(header: dict, data: bytes) -> ArrayRecord:
    head = json.dumps(header).encode()
    raw = len(head).to_bytes(8, "little") + head + data
    return ArrayRecord({records.ENTRY: Array(dtype="uint8", shape=(len(raw),), stype=records.STYPE, data=raw)})


META = {"format": records.FORMAT, "dtypes": json.dumps({"x": "float32"}), "order": "[0]"}


@pytest.mark.parametrize(("header", "data", "why"), [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": META}, b"\0" * 8, None),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": META}, b"\0" * 8, "malformed"),
    ({"x": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": META}, b"\0" * 8, "malformed"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "__metadata__": META}, b"\0" * 8, "malformed"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": META}, b"\0" * 8, "malformed"),
    ({"x": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": META}, b"\0" * 8, "travelled as"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "__metadata__": {**META, "dtypes": json.dumps({"x": "complex64"})}}, b"\0" * 8, "travelled as"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "__metadata__": {**META, "dtypes": json.dumps({"y": "float32"})}}, b"\0" * 8, "not names of tensors"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "__metadata__": {**META, "dtypes": json.dumps({"x": ["float32"]})}}, b"\0" * 8, "not names of tensors"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {**META, "order": "[0.0]"}},
     b"\0" * 8, "not a permutation"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "y": {"dtype": "F32", "shape": [1],
      "data_offsets": [2, 6]}, "__metadata__": {**META, "order": "[0, 1]"}}, b"\0" * 8, "malformed"),  # overlapping
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {**META, "order": "[1]"}},
     b"\0" * 8, "not a permutation"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "format None"),
])
def test_a_malformed_layout_is_refused_never_misread(header, data, why):
    record = blob(header, data)
    if why is None:  # the well-formed control: the same bytes are read
        assert torch.equal(records.decode(record)["x"], torch.zeros(2))
        return
    with pytest.raises(records.RecordError, match=why):
        records.decode(record)


def test_a_journal_keeps_a_one_array_message_and_replays_it_exactly(tmp_path, task_identity):
    from fedllm.flower.runtime import read_journal, write_journal

    state = smollm2_adapter()
    message = Message(RecordDict({"plan": records.encode(state, "bf16")}), dst_node_id=1, message_type="train")
    message.metadata.__dict__["_message_id"] = "m" * 64
    write_journal(tmp_path / "j", "token", message, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                            run_config={}))
    _, (replayed, _) = read_journal(tmp_path / "j")
    back, want = records.decode(replayed.content.array_records["plan"]), cast(state, "bf16")
    assert all(torch.equal(back[k], want[k]) for k in state)


def test_an_upload_of_an_older_fedllm_drops_its_client_saying_why(task_identity):
    from flwr.app import MetricRecord

    from fedllm.flower.adapter import FedllmStrategy

    class Strategy:
        def uploads_seen(self, rnd, seen):
            self.seen = seen

    adapter = FedllmStrategy.__new__(FedllmStrategy)
    adapter.strategy, adapter.sent, adapter.origin, adapter.expected = Strategy(), {7: 2}, {}, {2: None}
    adapter.synced, adapter.steps, adapter.received = {}, {}, {}
    sent = Message(RecordDict(), dst_node_id=7, message_type="train")
    old = ArrayRecord({"a.weight|float32|float32": Array(np.zeros(3, dtype=np.float32))})
    reply = Message(RecordDict({"update": old, "metrics": MetricRecord({"synced": 0, "num_examples": 4, "steps": 1})}),
                    reply_to=sent)
    reply.metadata.__dict__["_src_node_id"] = 7
    updates, dropped = adapter.decode_updates(1, [reply])
    assert updates == [] and list(dropped) == [2]
    assert dropped[2].startswith("its upload cannot be read: a record with one Array per tensor (1, e.g. ")
