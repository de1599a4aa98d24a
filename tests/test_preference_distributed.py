"""DPO on two CPU processes gives the single-process result (FedAvg, FRLoRA, SCAFFOLD, FedAvg under DP-SGD).

Each process computes the reference log-probabilities of its share of the clients before round 1 and every
process gathers all of them (:mod:`fedllm.engine.reference`); a client trained by rank 1 in one round and by
rank 0 in the next uses the same reference. The session's one torchrun launch runs the jobs
(tests/distributed_jobs.py, tests/conftest.py's ``two_processes``).
"""

import pytest

from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from tests.conftest import tiny_raw, write_jsonl
from tests.preference_helpers import preference_records
from tests.test_distributed import TwoProcessLaunch, assert_same, final_tensors

#: DP-SGD (a pair is one example: clipped per pair): Poisson draws and noise seeded per (noise_seed, round, client)
DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 0.8, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 5}
CASES = {
    "fedavg": ("fedavg", {}, {}),
    "frlora": ("frlora", {}, {"optimizer_state": "per_client"}),
    "scaffold": ("scaffold", {}, {}),
    "fedavg-dp-sgd": ("fedavg", {}, {}, DP_SGD),
}


def dpo_raw(data, strategy: str, args: dict, train: dict, privacy: dict | None = None) -> dict:
    return tiny_raw(
        "-",
        data,
        data={"path": str(data), "format": "preference", "fields": {}},
        federation={"num_clients": 4, "clients_per_round": 3, "rounds": 2, "strategy": strategy, "strategy_args": args},
        train={"objective": "dpo", "max_length": 48, "lr": 5e-2, **train},
        **({"privacy": privacy} if privacy else {}),
    )


def two_process_jobs(launch: TwoProcessLaunch, tests: list) -> None:
    """Queue the jobs of this module's ``tests`` in the session's launch (tests/test_distributed.py's
    :func:`~tests.test_distributed.shared_launch`)."""
    data = write_jsonl(launch.root / "pairs.jsonl", preference_records(40))
    for test in tests:
        case = test.callspec.params["case"]
        launch.add(f"dpo-{case}", dpo_raw(data, *CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_preference_two_processes_match_one(case, two_processes, tmp_path):
    one = run(parse_recipe(two_processes.recipe(f"dpo-{case}", tmp_path / "one")))
    two = final_tensors(two_processes.run_dir(f"dpo-{case}"))
    assert any(k.endswith("reference/logps") for k in two["clients"])  # every client's reference, gathered
    assert (one.history[-1].get("epsilon", 0) > 0) == ("dp-sgd" in case)
    assert_same(final_tensors(one.run_dir), two)
