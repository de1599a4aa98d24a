"""Objects of Flower's object store per ``train`` message, and the record's encode/decode time (issue 35, item 3).

    python bench/record_objects.py [--rank 8] [--comm fp32]

Builds the message ``FedllmStrategy.configure_train`` sends for a SmolLM2-135M LoRA adapter (30 layers, hidden 576,
3 key/value heads of 64; rank ``--rank`` on q/k/v/o: 240 tensors) with whatever ``fedllm.flower.records`` is first on
``PYTHONPATH`` (run it from two trees to compare), and prints how many objects Flower pushes for it (its own
``get_all_nested_objects`` walk: each is one request through each hop), the payload, and the record's encode and
decode time in this process. The values are random:
Flower stores identical objects once, and a real adapter's zero-initialised B factors would make a one-per-tensor
record look smaller than it is after round 1.
"""

from __future__ import annotations

import argparse
import time


def adapter(rank: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(30):
        for proj, width in (("q", 576), ("k", 192), ("v", 192), ("o", 576)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj"
            out[f"{stem}.lora_A.weight"] = torch.randn(rank, 576, generator=gen)
            out[f"{stem}.lora_B.weight"] = torch.randn(width, rank, generator=gen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--comm", default="fp32")
    args = parser.parse_args()
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower import records

    for name in ("_task_id", "_run_id", "_node_id"):  # what a running ServerApp has set
        setattr(TaskIdentity, name, 1)
    state = adapter(args.rank)
    records.decode(records.encode(state, args.comm))  # imports and first-touch allocations out of the timing
    encoded, decoded = [], []
    for _ in range(5):
        started = time.perf_counter()
        record = records.encode(state, args.comm)
        encoded.append(time.perf_counter() - started)
        started = time.perf_counter()
        records.decode(record)
        decoded.append(time.perf_counter() - started)
    message = Message(RecordDict({"plan": record, "fedllm": ConfigRecord({"round": 1})}), dst_node_id=1,
                      message_type="train")
    objects = get_all_nested_objects(message)
    print(f"{records.__file__}: {len(state)} tensors, {records.record_bytes(record) / 1e6:.2f} MB payload "
          f"({args.comm}): {len(record)} Array(s), {len(objects)} objects per train message "
          f"({sum(len(o.deflate()) for o in objects.values()) / 1e6:.2f} MB deflated); encode {min(encoded) * 1e3:.0f} ms, "
          f"decode {min(decoded) * 1e3:.0f} ms (best of 5)")


if __name__ == "__main__":
    main()
