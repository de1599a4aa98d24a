"""DPO on Flower (the real ServerApp/ClientApp over a loopback grid) gives the simulation's result.

Each SuperNode computes its client's reference log-probabilities once, from the model as it builds it (before any
catch-up of merges it missed: FRLoRA), keeps them in its own state directory and never sends them.
"""

import pytest

pytest.importorskip("flwr")

from fedllm.engine.server import run
from fedllm.flower.executor import FlowerExecutor
from fedllm.recipe.checks import parse_recipe
from tests.conftest import write_jsonl
from tests.preference_helpers import preference_records
from tests.test_flower_apps import LoopbackGrid, assert_close, flower_identity, node_state, nodes, parts  # noqa: F401

#: DP-SGD on the nodes, a pair one example: Poisson draws and noise seeded per (noise_seed, round, client)
DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 0.8, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 5}
CASES = {"fedavg": ("fedavg", {}), "frlora": ("frlora", {}), "scaffold": ("scaffold", {}),
         "fedavg-dp-sgd": ("fedavg", {}, {"privacy": DP_SGD})}


@pytest.mark.parametrize("case", sorted(CASES))
def test_preference_flower_matches_the_simulation(case, tiny_recipe, tmp_path, flower_identity):  # noqa: F811
    strategy, args, *more = CASES[case]
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_records(30))
    raw = tiny_recipe(
        data={"path": str(data), "format": "preference", "fields": {}},
        federation={"num_clients": 3, "clients_per_round": 2, "rounds": 3, "strategy": strategy, "strategy_args": args},
        train={"objective": "dpo", "max_length": 48, "lr": 5e-2},
        **(more[0] if more else {}),
    )
    sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")}))
    flower = run(
        parse_recipe({**raw, "output_dir": str(tmp_path / "flower")}),
        executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 3))),
    )
    expected, got = parts(sim.run_dir), parts(flower.run_dir)
    assert_close(expected["adapter"], got["adapter"], "global adapter")
    assert "clients" not in got  # per-client state, the reference included, never reaches the server
    for cid in range(3):
        node_entry = {k.split("/", 1)[1]: v for k, v in node_state(tmp_path, cid).get("clients", {}).items()}
        sim_entry = {k.split("/", 1)[1]: v for k, v in expected["clients"].items() if k.startswith(f"client{cid}/")}
        assert "reference/logps" in node_entry
        assert_close(sim_entry, node_entry, f"per-client state of client {cid}")
    for key in ("train_loss", "epsilon"):  # DP-SGD: no loss released, the same per-client budget spent
        want = [h.get(key) for h in sim.history]
        assert [h.get(key) for h in flower.history] == (want if None in want else pytest.approx(want, abs=1e-6))
