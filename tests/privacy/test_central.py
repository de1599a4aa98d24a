"""Client-level DP (privacy.mechanism central / central_client_clipping) against Flower's DP strategy wrappers
and accountant, and its noise, adaptive norm and checkpointed state."""

import math

import numpy as np
import pytest
import torch
from flwr.serverapp import strategy as flower
from flwr.supercore.differential_privacy import compute_clip_model_update
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedllm.config import parse_recipe
from fedllm.privacy import accounting, with_privacy
from fedllm.privacy.central import ClientLevelDP
from fedllm.strategies import ClientUpdate, get_strategy
from tests.strategies.flower_reference import SHAPES, assert_equal_rounds, client_arrays, flower_rounds, initial_state

SIZES = [20, 20, 20]  # equal weights: Flower's accounted DP path needs them, and fedllm's DP mean is uniform
Z, C = 0.8, 0.5


def dp_strategy(mechanism="central", strategy="fedavg", clients=3, per_round=3, **privacy):
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": clients, "clients_per_round": per_round, "rounds": 4,
                                          "strategy": strategy},
                           "privacy": {"mechanism": mechanism, "noise_multiplier": Z, "clipping_norm": C,
                                       "noise_seed": 0, **privacy}})
    s = with_privacy(get_strategy(strategy), recipe)
    s.recipe = recipe
    return s


def numpy_noise(monkeypatch):
    """fedllm draws its noise from numpy's global generator in Flower's order (Flower's ``np.random.normal``)."""
    monkeypatch.setattr(ClientLevelDP, "gaussian", staticmethod(
        lambda gen, shape, std: torch.from_numpy(np.asarray(np.random.normal(0, std, shape), dtype=np.float32))))


def run_fedllm(strategy, rounds=3, client_side=False):
    state = {k: torch.from_numpy(v) for k, v in initial_state().items()}
    out = []
    for rnd in range(1, rounds + 1):
        updates = []
        for cid, (up, n) in enumerate(zip(client_arrays(rnd, SIZES), SIZES, strict=True)):
            trained = {k: torch.from_numpy(v) for k, v in up.items()}
            if client_side:
                plan = strategy.configure_client(rnd, cid, state)
                trained = strategy.client_upload(plan, trained, 1)
            updates.append(ClientUpdate(cid, trained, n, 0.0, 1))
        state = strategy.aggregate(rnd, state, updates)
        out.append(state)
    return out


def flower_fedavg():
    return flower.FedAvg(min_train_nodes=3, min_available_nodes=3)


def test_server_side_fixed_clipping_equals_flower_with_the_same_noise(monkeypatch):
    np.random.seed(7)
    expected = flower_rounds(flower.DifferentialPrivacyServerSideFixedClipping(flower_fedavg(), Z, C, 3),
                             monkeypatch, SIZES, rounds=3)
    numpy_noise(monkeypatch)
    np.random.seed(7)
    got = run_fedllm(dp_strategy())
    assert_equal_rounds(expected, got, "server-side fixed clipping")
    np.random.seed(8)  # another noise draw moves the result: the noise is really there
    other = run_fedllm(dp_strategy())
    assert not torch.allclose(other[0]["classifier.weight"], got[0]["classifier.weight"], atol=1e-3)


def test_client_side_fixed_clipping_equals_flower_with_the_same_noise(monkeypatch):
    def clipped(rnd, sent):  # what Flower's fixedclipping_mod does on each client: clip against what it received
        out = []
        for up in client_arrays(rnd, SIZES):
            arrays = list(up.values())
            compute_clip_model_update(arrays, list(sent.values()), C)
            out.append(dict(zip(up, arrays, strict=True)))
        return out

    np.random.seed(3)
    expected = flower_loop(flower.DifferentialPrivacyClientSideFixedClipping(flower_fedavg(), Z, C, 3), clipped,
                           monkeypatch)
    numpy_noise(monkeypatch)
    np.random.seed(3)
    got = run_fedllm(dp_strategy("central_client_clipping"), client_side=True)
    assert_equal_rounds(expected, got, "client-side fixed clipping")


def flower_loop(strategy, uploads, monkeypatch, rounds=3):
    """Rounds of a Flower strategy whose clients upload ``uploads(rnd, arrays they received)``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.app.message import arrayrecord
    from flwr.supercore.task_identity import TaskIdentity

    from tests.strategies.flower_reference import Grid

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    monkeypatch.setattr(arrayrecord.gc, "collect", lambda *a: 0)
    current = initial_state()
    out = []
    for rnd in range(1, rounds + 1):
        arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
        sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(3)))
        replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in up.items()}),
                                       "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)
                   for msg, up, n in zip(sent, uploads(rnd, current), SIZES, strict=True)]
        new, _ = strategy.aggregate_train(rnd, replies)
        current = {k: np.asarray(a.numpy()) for k, a in new.items()}
        out.append({k: v.astype(np.float64) for k, v in current.items()})
    return out
