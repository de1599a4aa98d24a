"""CPU threading policy: set by the entry point before torch loads, never over the user's choice."""

import json
import os

import pytest

from fedllm.common import threads


def test_entry_point_sets_threads_when_nothing_is_given(probe, tmp_path):
    report, _, _ = probe("export", str(tmp_path / "no-run"), "--format", "merged", "--out", str(tmp_path / "o"))
    cores = len(os.sched_getaffinity(0))
    assert report["env"]["OMP_NUM_THREADS"] == str(cores) and report["env"]["MKL_NUM_THREADS"] == str(cores)
    assert report["env"]["RAYON_NUM_THREADS"] == str(cores)  # the tokenizers' pool follows the same count


def test_entry_point_divides_cores_by_local_processes(probe, tmp_path):
    report, _, _ = probe("export", str(tmp_path / "no-run"), "--format", "merged", "--out", str(tmp_path / "o"),
                         LOCAL_WORLD_SIZE="2")
    assert report["env"]["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_entry_point_leaves_user_variables_alone(probe, tmp_path):
    report, _, _ = probe("export", str(tmp_path / "no-run"), "--format", "merged", "--out", str(tmp_path / "o"),
                         OMP_NUM_THREADS="3", OMP_WAIT_POLICY="ACTIVE")
    assert report["env"]["OMP_NUM_THREADS"] == "3" and report["env"]["OMP_WAIT_POLICY"] == "ACTIVE"
    assert report["env"]["GOMP_SPINCOUNT"] is None


def test_fedllm_threads_env_overrides(probe, tmp_path):
    report, _, _ = probe("export", str(tmp_path / "no-run"), "--format", "merged", "--out", str(tmp_path / "o"),
                         FEDLLM_THREADS="1")
    assert report["env"]["OMP_NUM_THREADS"] == "1"


def test_precedence_and_busy_policy(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(threads, "busy_fraction", lambda seconds=0: 0.5)
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # "not loaded yet" for choose()
    monkeypatch.delitem(__import__("sys").modules, "torch")
    env = {"LOCAL_WORLD_SIZE": "4"}
    p = threads.choose(env)
    assert (p.threads, p.source, p.wait, p.wait_source) == (2, "auto", {"OMP_WAIT_POLICY": "PASSIVE"}, "fedllm (busy)")
    assert threads.choose({"OMP_NUM_THREADS": "3"}).threads == 3
    assert threads.choose({"OMP_NUM_THREADS": "3"}, train_threads=5).source == "train.threads"
    p = threads.choose({"OMP_NUM_THREADS": "3", "FEDLLM_THREADS": "6"}, train_threads=5)
    assert (p.threads, p.source) == (6, "FEDLLM_THREADS")
    monkeypatch.setattr(threads, "busy_fraction", lambda seconds=0: 0.0)
    assert threads.choose({}).wait == {}  # idle: OpenMP's default (spinning keeps the idle speed)
    assert threads.choose({"GOMP_SPINCOUNT": "0"}).wait == {"GOMP_SPINCOUNT": "0"}


def test_bad_fedllm_threads_is_an_input_error():
    from fedllm.common.errors import InputError

    with pytest.raises(InputError, match="FEDLLM_THREADS='two'"):
        threads.choose({"FEDLLM_THREADS": "two"})


def test_train_threads_reaches_torch_and_summary(tiny_recipe, monkeypatch):
    import torch

    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    before = torch.get_num_threads()
    monkeypatch.delenv("FEDLLM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_set_by_us", {})
    try:
        result = run(parse_recipe(tiny_recipe(train={"local_steps": 1, "batch_size": 4, "lr": 1e-2,
                                                     "max_length": 64, "threads": 1})))
        summary = json.loads((result.run_dir / "summary.json").read_text())
        assert summary["threads"]["threads"] == 1 and summary["threads"]["source"] == "train.threads"
        assert summary["threads"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)
        monkeypatch.setattr(threads, "_chosen", None)


def test_losses_do_not_depend_on_the_thread_count(tiny_recipe, monkeypatch):
    """A tiny run with 1 and with 2 threads: per-round losses equal to fp32 tolerance (rtol 1e-5).

    Reductions split across threads may round differently in the last bits, so not bit-equal in general;
    observed here: equal to ~1e-7 relative.
    """
    import torch

    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_chosen", None)  # no earlier CLI choice in this process: run() keeps ours
    losses = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            raw = tiny_recipe(output_dir=str(__import__("pathlib").Path(tiny_recipe()["output_dir"]).parent / f"t{n}"))
            result = run(parse_recipe(raw))
            assert json.loads((result.run_dir / "summary.json").read_text())["threads"]["torch_threads"] == n
            losses[n] = [h["train_loss"] for h in result.history]
    finally:
        torch.set_num_threads(before)
    assert losses[1] == pytest.approx(losses[2], rel=1e-5)
    assert len(losses[1]) == 2
