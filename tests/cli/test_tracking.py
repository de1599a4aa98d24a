"""logging.report_to: every tracker gets the round records; read back offline from what each wrote."""

import json
from pathlib import Path

import pytest

from fedllm.common.tracking import flat_params, round_metrics

RECORD = {"round": 2, "clients": [0, 2], "lr": 0.01, "client_loss": {"0": 1.5, "2": 2.5},
          "bytes_up_total": 100, "bytes_down_total": 300, "train_loss": 2.0, "seconds": 1.25,
          "eval": {"gsm8k/accuracy": 0.5}, "personal_eval": {"1": {"acc": 0.75}}}


def test_round_metrics_and_params():
    assert round_metrics(RECORD) == {
        "train/loss": 2.0, "train/lr": 0.01, "comm/bytes_up": 100.0, "comm/bytes_down": 300.0, "time/seconds": 1.25,
        "client/0/loss": 1.5, "client/2/loss": 2.5, "eval/gsm8k/accuracy": 0.5, "personal_eval/1/acc": 0.75}
    assert flat_params({"train": {"lr": 0.1, "local_steps": None}, "eval": {"tasks": ["a"]}, "seed": 3}) == {
        "train.lr": 0.1, "train.local_steps": "None", "eval.tasks": "['a']", "seed": 3}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One tiny run reporting to all four back-ends, everything local and offline."""
    import os

    from tests.conftest import arith_records, write_jsonl

    tmp = tmp_path_factory.mktemp("tracked")
    data = write_jsonl(tmp / "arith.jsonl", arith_records(48))
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(),
           "MLFLOW_ALLOW_FILE_STORE": "true", "TRACKIO_DIR": str(tmp / "trackio"), "WANDB_PROJECT": "fedllm-test",
           "TRACKIO_PROJECT": "fedllm-test", "MLFLOW_EXPERIMENT_NAME": "fedllm-test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from fedllm.engine.server import run
        from fedllm.recipe.checks import parse_recipe

        recipe = parse_recipe({
            "seed": 0, "output_dir": str(tmp / "run"), "model": {"name": "tiny-llama"}, "lora": {"r": 4, "alpha": 8},
            "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question",
                                                                            "output": "answer"}},
            "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 2, "partition": {"method": "iid"}},
            "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 64},
            "logging": {"progress": False, "quiet": True,
                        "report_to": ["tensorboard", "wandb", "mlflow", "trackio"]}})
        result = run(recipe)
        yield tmp, result.run_dir, [h for h in result.history if h["round"] > 0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_tensorboard_event_files_read_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, history = tracked_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([h["train_loss"] for h in history], rel=1e-6)
    up = acc.Scalars("comm/bytes_up")
    assert [e.value for e in up] == [h["bytes_up_total"] for h in history]
    assert {f"client/{c}/loss" for h in history for c in h["client_loss"]} <= set(acc.Tags()["scalars"])
    assert "recipe" in str(acc.Tags()["tensors"])


def test_mlflow_local_file_store(tracked_run):
    import mlflow

    tmp, _, history = tracked_run
    client = mlflow.MlflowClient(tracking_uri=(tmp / "mlruns").as_uri())
    exp = client.get_experiment_by_name("fedllm-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.01" and run.data.params["federation.strategy"] == "fedavg"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in losses) == [(h["round"], pytest.approx(h["train_loss"])) for h in history]


def test_wandb_offline_run_holds_each_round(tracked_run):
    _, run_dir, history = tracked_run
    (offline,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    raw = offline.read_bytes()
    # history items are stored as JSON text inside the protobuf records
    for h in history:
        assert json.dumps(h["train_loss"]).encode() in raw
    assert b"train/loss" in raw and b"federation.strategy" in raw


def test_trackio_local_store(tracked_run):
    import os

    tmp, _, history = tracked_run
    os.environ["TRACKIO_DIR"] = str(tmp / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("fedllm-test", "run")
    assert [(x["step"], x["train/loss"]) for x in logs] == [(h["round"], pytest.approx(h["train_loss"]))
                                                           for h in history]
    from trackio import context_vars

    assert context_vars.current_run.get() is None  # finished: trackio's exit hook has nothing left to print


def test_only_rank_0_tracks(tiny_recipe, monkeypatch):
    from fedllm.engine.distributed import Dispatch
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    monkeypatch.setattr(Dispatch, "is_main", property(lambda self: False))
    run_dir = Path(tiny_recipe()["output_dir"])
    run(parse_recipe(tiny_recipe(logging={"progress": False, "quiet": True, "report_to": ["tensorboard"]})))
    assert not (run_dir / "tensorboard").exists()
