"""A FedLLM-Bench user without records is a client with no records (``partition: natural`` on ``user`` of a
user-keyed JSON), numbered as FedLLM-Bench numbers it; a round that samples it equals the round without it.

FedLLM-Bench (``utils/benchmark_dataset.py`` ``get_fed_datasets``; ``main_sft.py``) makes an empty ``Dataset`` for
such a user, samples clients by index among all ``num_clients``, and its FedAvg weighs each sampled client by its
sample count (``sample_num_list``), 0 for the empty one, whose local state equals the global one (its trainer runs
no step). fedllm trains the empty client not at all and sends it nothing, under every strategy: the round
aggregates the other sampled clients, and a round whose sampled clients are all empty leaves the model as it was.
The sample is fixed per round here (``server.sample_clients`` patched), so that the two runs compared differ only
in the empty client being sampled. Also: a resumed run, Flower's apps (loopback grid), the refusals where every
sampled client must answer (client-level DP, SecAgg+, async).
"""

import json

import pytest
import torch

from fedllm.common.errors import InputError
from fedllm.engine import server
from fedllm.engine.empty_clients import EMPTY_CLIENT
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe
from tests.conftest import arith_records

#: FedLLM-Bench's layout, the empty user second: FedLLM-Bench's client 1
USERS = ("u_a", "u_empty", "u_b", "u_c")
SIZES = {"u_a": 5, "u_empty": 0, "u_b": 4, "u_c": 6}


@pytest.fixture
def user_file(tmp_path):
    records, by_user = iter(arith_records(15)), {}
    for user in USERS:
        by_user[user] = [{k: v for k, v in next(records).items() if k != "category"} for _ in range(SIZES[user])]
    path = tmp_path / "by_user.json"
    path.write_text(json.dumps(by_user))
    return path


def _raw(user_file, out, strategy="fedavg", rounds=2, **federation):
    return {
        "seed": 0, "output_dir": str(out), "model": {"name": "tiny-llama"}, "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(user_file), "format": "instruction", "cache": False,
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": rounds, "strategy": strategy,
                       "partition": {"method": "natural", "column": "user"}, **federation},
        "train": {"local_steps": 2, "batch_size": 2, "lr": 1e-2, "max_length": 64, "dtype": "fp32"},
        "logging": {"progress": False, "quiet": True},
    }


def _recipe(*args, **kwargs):
    return parse_recipe(_raw(*args, **kwargs))


@pytest.fixture
def samples(monkeypatch):
    """``samples[rnd] = [clients]``: the sample of round ``rnd`` (the recipe's clients_per_round is not used)."""
    fixed = {}

    def sample(seed, rnd, num_clients, k, attempt=0, exclude=frozenset()):
        return list(fixed.get((rnd, attempt), fixed[rnd]))  # (rnd, attempt): a retried sample

    monkeypatch.setattr(server, "sample_clients", sample)
    return fixed


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_clients_are_the_files_keys_an_empty_user_included(user_file, tmp_path):
    fed = server.build_federation(_recipe(user_file, tmp_path / "run"))
    assert [len(ix) for ix in fed.data.clients] == [SIZES[u] for u in USERS]   # client k = the k-th key
    by_client = json.loads(user_file.read_text())
    for cid, user in enumerate(USERS):
        questions = [fed.loaded.tokenizer.decode(fed.data.examples[i]["input_ids"]) for i in fed.data.clients[cid]]
        assert len(questions) == len(by_client[user])
        assert all(r["question"] in q for r, q in zip(by_client[user], questions, strict=True))


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold", "fedadam", "frlora", "fedsa_lora", "pflmf", "fedloru"])
def test_a_round_that_samples_the_empty_client_equals_the_round_without_it(user_file, tmp_path, samples, strategy,
                                                                           monkeypatch):
    """Round 1 samples clients 0, 1 (empty) and 2, round 2 clients 1 and 3: the run equals, bit for bit (global
    state, server state, every client's state), the run whose rounds sample 0, 2 and then 3 alone. FedAvg's
    aggregate of round 1 is FedLLM-Bench's Σ n_k θ_k / Σ n_k with the empty client's term (n = 0, θ = the global
    state) in it."""
    samples.update({1: [0, 1, 2], 2: [1, 3]})
    uploads = {}
    original = server.run_client

    def seen(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        uploads[(plan.rnd, plan.client_id)] = ({k: v.clone() for k, v in update.state.items()}, update.num_examples)
        return update

    monkeypatch.setattr(server, "run_client", seen)
    with_empty = server.run(_recipe(user_file, tmp_path / "with", strategy, clients_per_round=3))
    first = dict(uploads)
    samples.update({1: [0, 2], 2: [3]})
    without = server.run(_recipe(user_file, tmp_path / "without", strategy, clients_per_round=3))
    assert {c for _, c in first} == {0, 2, 3}   # the empty client is never trained
    assert _equal(with_empty.global_state, without.global_state)
    assert _equal(with_empty.strategy.state_dict(), without.strategy.state_dict())
    assert _equal(with_empty.clients.flat(), without.clients.flat())
    records = _records(with_empty.run_dir)
    assert [r["clients"] for r in records] == [[0, 1, 2], [1, 3]]
    assert all(r["dropped"] == {"1": EMPTY_CLIENT} for r in records)
    assert set(records[0]["client_loss"]) == {"0", "2"} and set(records[1]["client_loss"]) == {"3"}
    if strategy == "fedavg":  # FedLLM-Bench's global_aggregate over clients_this_round = [0, 1, 2]
        start = read_state(server.build_federation(_recipe(user_file, tmp_path / "x")).loaded.model,
                           with_empty.global_state.keys())
        (s0, n0), (s2, n2) = first[(1, 0)], first[(1, 2)]
        terms = [(s0, n0), (start, 0), (s2, n2)]
        expected = {k: sum(s[k] * n for s, n in terms) / (n0 + 0 + n2) for k in s0}
        samples.update({1: [0, 1, 2]})
        round1 = server.run(_recipe(user_file, tmp_path / "one", rounds=1, clients_per_round=3))
        assert all(torch.allclose(round1.global_state[k], expected[k], atol=1e-7) for k in expected)


@pytest.mark.parametrize("strategy, args", [("fedavg", {}), ("fedadam", {}), ("scaffold", {}), ("frlora", {}),
                                            ("fedloru", {"tau": 3})])  # (FedLoRU accumulates in round 3)
def test_a_round_of_empty_clients_only_leaves_the_model_unchanged(user_file, tmp_path, samples, strategy, args):
    """A round that samples only the empty client trains and aggregates nothing and is neither retried nor
    stopped (``on_client_error: fail``): after it the model (adapter and base: FRLoRA and FedLoRU merge into the
    base) and the server's state (FedAdam's moments, SCAFFOLD's c) are those before it: in round 1, those before
    training; in round 3, those after round 2."""
    samples.update({1: [1], 2: [0, 2], 3: [1]})

    def run(name, rounds):
        return server.run(_recipe(user_file, tmp_path / name, strategy, rounds=rounds, on_client_error="fail",
                                  strategy_args=args))

    fresh = server.build_federation(_recipe(user_file, tmp_path / "fresh", strategy, strategy_args=args))
    keys = fresh.global_keys
    idle = run("idle", 1)
    assert _equal(_model(idle.model, keys), _model(fresh.loaded.model, keys))
    assert _equal(idle.strategy.state_dict(), fresh.strategy.state_dict())
    two, three = run("two", 2), run("three", 3)
    assert not _equal(_model(two.model, keys), _model(fresh.loaded.model, keys))  # round 2 trained
    if strategy == "fedloru":  # its accumulation due in round 3 moves B·A into the base: the same function
        assert not _equal(_model(three.model, keys), _model(two.model, keys))  # (it did accumulate)
        assert torch.allclose(_logits(three.model), _logits(two.model), atol=1e-6)
    else:
        assert _equal(_model(three.model, keys), _model(two.model, keys))
        assert _equal(three.strategy.state_dict(), two.strategy.state_dict())
    records = _records(three.run_dir)
    assert [r["clients"] for r in records] == [[1], [0, 2], [1]]
    for r in (records[0], records[2]):
        assert r["dropped"] == {"1": EMPTY_CLIENT} and r["client_loss"] == {} and "train_loss" not in r
        assert "retries" not in r and r["bytes_up_total"] == 0


def _logits(model):
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).reshape(1, -1)).logits


def _model(model, keys):
    """The adapter and the LoRA-wrapped base weights of ``model``."""
    return {**read_state(model, keys), **server.base_weights(model)}


def test_min_clients_counts_the_sampled_clients_with_records(user_file, tmp_path, samples):
    """min_clients_per_round 2 with clients 0 and 1 (empty) sampled: the round aggregates client 0 alone, as
    FedLLM-Bench does; it is neither retried nor stopped."""
    samples.update({1: [0, 1]})
    run = server.run(_recipe(user_file, tmp_path / "min", rounds=1, min_clients_per_round=2))
    record = _records(run.run_dir)[0]
    assert set(record["client_loss"]) == {"0"} and "retries" not in record


def test_a_faulty_client_beside_an_empty_one_is_retried(user_file, tmp_path, samples, monkeypatch):
    """Clients 0 (which raises) and 1 (empty): no valid update from a client with records, so the round is tried
    again with a fresh sample, as without the empty client (it is no reason to leave the model unchanged)."""
    samples.update({1: [0, 1], (1, 1): [2, 3]})
    original = server.run_client

    def faulty(model, plan, *args, **kwargs):
        if plan.client_id == 0:
            raise RuntimeError("disk full")
        return original(model, plan, *args, **kwargs)

    monkeypatch.setattr(server, "run_client", faulty)
    record = _records(server.run(_recipe(user_file, tmp_path / "retry", rounds=1)).run_dir)[0]
    assert record["retries"][0]["clients"] == [0, 1] and set(record["retries"][0]["dropped"]) == {"0"}
    assert record["clients"] == [2, 3] and set(record["client_loss"]) == {"2", "3"}


@pytest.mark.parametrize("privacy, federation", [
    ({"mechanism": "central", "clipping_norm": 1.0, "noise_multiplier": 1.0}, {}),
    ({"secure_aggregation": "secagg_plus"}, {"clients_per_round": 4}),
    ({}, {"mode": "async"}),
])
def test_where_each_sampled_client_must_answer_an_empty_client_is_refused(user_file, tmp_path, privacy, federation):
    raw = {**_raw(user_file, tmp_path / "run", **federation), "privacy": privacy}
    with pytest.raises(InputError, match=r"needs every client to hold training records; .* \(client\(s\) \[1\]: "
                                         r".*set federation.num_clients: 1 or less"):
        server.build_federation(parse_recipe(raw))


def test_a_resumed_run_with_an_empty_client_equals_the_whole_run(user_file, tmp_path, samples, crash_at_round):
    """Cut in round 3 after a round of the empty client alone (round 2), resumed: the same model as the run that
    was never cut (the checkpoint keeps the client sizes, 0 included)."""
    from tests.conftest import cut_and_resume

    samples.update({1: [0, 1], 2: [1], 3: [1, 2, 3]})
    def recipe(out):
        return parse_recipe({**_raw(user_file, out, "scaffold", rounds=3), "checkpoint": {"every": 1}})

    whole = server.run(recipe(tmp_path / "whole"))
    resumed = cut_and_resume(recipe(tmp_path / "cut"), crash_at_round, rnd=3)
    assert _equal(whole.global_state, resumed.global_state)
    assert _equal(whole.strategy.state_dict(), resumed.strategy.state_dict())


@pytest.mark.parametrize("strategy", ["fedavg", "frlora"])
def test_flower_apps_with_an_empty_client_match_the_simulation(user_file, tmp_path, samples, strategy, monkeypatch):
    """On Flower (the loopback grid of tests/test_flower_apps.py: the real ServerApp logic and ClientApp), the
    empty client's node is never sent a train message, and a round of it alone leaves every node where the
    simulation's is: adapter and base (FRLoRA's merges replayed on every node)."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, assert_close, node_state, nodes, parts

    for attr in ("_run_id", "_node_id", "_task_id"):  # (tests/test_flower_apps.py's flower_identity)
        monkeypatch.setattr(TaskIdentity, attr, 1)
    samples.update({1: [0, 1, 2], 2: [1], 3: [1, 3]})
    sim = server.run(_recipe(user_file, tmp_path / "sim", strategy, rounds=3, clients_per_round=3))
    grid = LoopbackGrid(nodes(tmp_path, 4))
    flower = server.run(_recipe(user_file, tmp_path / "flower", strategy, rounds=3, clients_per_round=3),
                        executor=FlowerExecutor(grid))
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    assert_close(expected["adapter"], got["adapter"], "global adapter")
    for cid in range(4):
        if "base" in expected:
            assert_close(expected["base"], node_state(tmp_path, cid)["base"], f"base on node {cid}")
    trained = [m.metadata.dst_node_id - 100 for m in grid.messages if m.metadata.message_type == "train"]
    assert sorted(set(trained)) == [0, 2, 3]
    assert [h["dropped"] for h in flower.history] == [{"1": EMPTY_CLIENT}] * 3
