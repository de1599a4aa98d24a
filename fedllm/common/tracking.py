"""Experiment tracking: ``logging.report_to: [tensorboard, wandb, mlflow, trackio]`` (HF Trainer's convention).

The trackers are fed from the same per-round records as ``metrics.jsonl`` (rank 0 /
the server only): train loss, per-client losses and steps, eval metrics (and personal
eval), bytes up/down, seconds and learning rate, with the round as the step; the
resolved recipe is logged once as hyper-parameters. Each back-end's library is
imported only when a recipe asks for it.

- ``tensorboard``: event files under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``).
- ``wandb``: project ``$WANDB_PROJECT`` (default ``fedllm``), files under ``RUN_DIR``;
  ``WANDB_MODE=offline`` works without an account.
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a local file store in ``RUN_DIR/mlruns``;
  experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``fedllm``).
- ``trackio``: project ``$TRACKIO_PROJECT`` (default ``fedllm``), local by default.
"""

from __future__ import annotations

import abc
import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

#: Tracker names accepted in ``logging.report_to`` (read by config validation without importing anything).
log = logging.getLogger("fedllm")

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


def round_metrics(record: dict[str, Any]) -> dict[str, float]:
    """Flat ``name -> number`` of one ``metrics.jsonl`` record (the tracker's scalars)."""
    out: dict[str, float] = {}
    for key, name in (("train_loss", "train/loss"), ("lr", "train/lr"), ("bytes_up_total", "comm/bytes_up"),
                      ("bytes_down_total", "comm/bytes_down"), ("seconds", "time/seconds")):
        if isinstance(record.get(key), (int, float)):
            out[name] = float(record[key])
    for cid, loss in record.get("client_loss", {}).items():
        out[f"client/{cid}/loss"] = float(loss)
    for metric, value in record.get("eval", {}).items():
        if isinstance(value, (int, float)):
            out[f"eval/{metric}"] = float(value)
    for cid, metrics in record.get("personal_eval", {}).items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)):
                out[f"personal_eval/{cid}/{metric}"] = float(value)
    return out


def flat_params(recipe: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 0.001, ...}`` from the nested recipe dict (lists and None as strings)."""
    out: dict[str, Any] = {}
    for key, value in recipe.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


class Tracker(abc.ABC):
    """One experiment-tracking back-end."""

    @abc.abstractmethod
    def start(self, run_dir: Path, run_name: str, params: dict[str, Any], recipe_yaml: str) -> None:
        """Open the run and log the recipe (``params`` flat, ``recipe_yaml`` as text)."""

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars of one round."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Flush and close."""


class TensorBoard(Tracker):
    def start(self, run_dir: Path, run_name: str, params: dict[str, Any], recipe_yaml: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("recipe", "```yaml\n" + recipe_yaml + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def start(self, run_dir: Path, run_name: str, params: dict[str, Any], recipe_yaml: str) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fedllm"), name=run_name, dir=str(run_dir),
                              config=params, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    def start(self, run_dir: Path, run_name: str, params: dict[str, Any], recipe_yaml: str) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # a local file store: still supported, opt-in since MLflow 3
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fedllm")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:500])
        self.client.log_text(self.run_id, recipe_yaml, "recipe.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.client.log_metric(self.run_id, name, value, step=step)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio(Tracker):
    """trackio prints its progress ("* Created new run", "* Run finished. Uploading logs ...") on stdout, where
    ``fedllm train`` prints only the run directory: those lines go to fedllm's debug log instead."""

    def start(self, run_dir: Path, run_name: str, params: dict[str, Any], recipe_yaml: str) -> None:
        import trackio

        with _stdout_to_debug_log():
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "fedllm"), name=run_name,
                                    config=params, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        import trackio

        with _stdout_to_debug_log():
            trackio.finish()  # also clears trackio's current run, so its exit hook does not finish it again


@contextlib.contextmanager
def _stdout_to_debug_log() -> Iterator[None]:
    """Capture what is printed on stdout inside the block and log it at debug level."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                log.debug("%s", line)


BACKENDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow,
                                      "trackio": Trackio}


class Tracking:
    """The recipe's trackers as one: ``start`` once, ``log_round`` per record, ``finish`` at the end."""

    def __init__(self, names: list[str]):
        self.trackers = [BACKENDS[name]() for name in names]

    def start(self, run_dir: Path, recipe: dict[str, Any], recipe_yaml: str, run_name: Optional[str] = None) -> None:
        name = run_name or Path(run_dir).name
        for tracker in self.trackers:
            tracker.start(Path(run_dir), name, flat_params(recipe), recipe_yaml)

    def log_round(self, record: dict[str, Any]) -> None:
        metrics = round_metrics(record)
        if metrics:
            for tracker in self.trackers:
                tracker.log(int(record["round"]), metrics)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
