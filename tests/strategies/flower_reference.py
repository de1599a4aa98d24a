"""The same client uploads fed to a Flower message strategy and to a fedllm strategy, round by round
(Flower's classes are the reference the FedOpt family, the robust aggregators and DP are checked against)."""

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message import arrayrecord
from flwr.supercore.task_identity import TaskIdentity

from fedllm.strategies import ClientUpdate, get_strategy

SHAPES = {"layer.lora_A.default.weight": (4, 6), "layer.lora_B.default.weight": (6, 4), "classifier.weight": (3,)}
SIZES = [10, 25, 40]  # examples per client
ROUNDS = 4


class Grid:
    """The connected nodes Flower's sampling sees (one per client)."""

    def __init__(self, n: int = len(SIZES)):
        self.n = n

    def get_node_ids(self):
        return list(range(11, 11 + self.n))


def initial_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def client_arrays(rnd: int, sizes=SIZES, attacker_scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    """What each client uploads in round ``rnd``: fixed arrays (the same inputs for both libraries); the last
    client's deviation from the common drift is multiplied by ``attacker_scale`` (−1: sign flip)."""
    rng = np.random.default_rng(100 + rnd)
    base = initial_state()
    out = [{k: (v + 0.3 * rng.normal(size=v.shape) + 0.1 * rnd).astype(np.float32) for k, v in base.items()}
           for _ in sizes]
    out[-1] = {k: (base[k] + attacker_scale * (v - base[k])).astype(np.float32) for k, v in out[-1].items()}
    return out


def flower_rounds(strategy, monkeypatch, sizes=SIZES, attacker_scale=1.0, rounds=ROUNDS):
    """``rounds`` rounds of a Flower message strategy; the global arrays after each (fp64 numpy)."""
    for attr in ("_run_id", "_node_id", "_task_id"):  # Messages need an identity outside a Flower run
        monkeypatch.setattr(TaskIdentity, attr, 1)
    # ArrayRecord.to_numpy_ndarrays(keep_input=False) runs a full gc.collect() per record (~0.8 s each here)
    monkeypatch.setattr(arrayrecord.gc, "collect", lambda *a: 0)
    arrays = ArrayRecord({k: Array(v) for k, v in initial_state().items()})
    out = []
    for rnd in range(1, rounds + 1):
        sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(len(sizes))))
        assert len(sent) == len(sizes)
        replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in up.items()}),
                                       "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)
                   for msg, up, n in zip(sent, client_arrays(rnd, sizes, attacker_scale), sizes, strict=True)]
        new, _ = strategy.aggregate_train(rnd, replies)
        arrays = new if new is not None else arrays
        out.append({k: np.asarray(a.numpy(), dtype=np.float64) for k, a in arrays.items()})
    return out


def fedllm_rounds(name, args, rounds=range(1, ROUNDS + 1), strategy=None, state=None, sizes=SIZES,
                  attacker_scale=1.0):
    """The same rounds through fedllm's ``aggregate``: ``(global state after each round, strategy)``."""
    strategy = strategy or get_strategy(name, **args)
    state = state or {k: torch.from_numpy(v) for k, v in initial_state().items()}
    out = []
    for rnd in rounds:
        updates = [ClientUpdate(c, {k: torch.from_numpy(v) for k, v in up.items()}, n, 0.0, 1)
                   for c, (up, n) in enumerate(zip(client_arrays(rnd, sizes, attacker_scale), sizes, strict=True))]
        state = strategy.aggregate(rnd, state, updates)
        out.append(state)
    return out, strategy


def assert_equal_rounds(expected, got, what, atol=1e-6):
    """Every round's every tensor within ``atol`` of Flower's."""
    for rnd, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        assert want.keys() == have.keys()
        for k in want:
            np.testing.assert_allclose(have[k].double().numpy(), want[k], rtol=0, atol=atol,
                                       err_msg=f"{what} round {rnd} {k}")
