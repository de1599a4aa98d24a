"""One writer per run directory: a second train / --resume / --overwrite / export --overwrite is refused (exit 2)
naming the holder; a lock left by a killed holder is stale, taken over and reported."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from fedllm.commands.cli import main
from fedllm.runs import runlock

HOLD = ("import sys, time; from fedllm.runs.runlock import hold\n"
        "with hold(sys.argv[1]):\n"
        "    print('held', flush=True); time.sleep(120)\n")


def _recipe(tmp_path, raw):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(
        run_copy, tmp_path, capsys, caplog):
    run_dir, raw = run_copy
    recipe = _recipe(tmp_path, raw)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(runlock.__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        for flags in (["--overwrite"], ["--resume"], []):
            assert main(["train", str(recipe), *flags]) == 2, flags
            err = capsys.readouterr().err
            assert f"is in use by pid {holder.pid} on host {socket.gethostname()}" in err, err
            assert str(runlock.lock_path(run_dir)) in err
        out = tmp_path / "export"
        with runlock.hold(out, what="--out"):  # an export in progress (this process) holds --out
            assert main(["export", str(run_dir), "--format", "adapter", "--out", str(out), "--overwrite"]) == 2
            assert f"--out={str(out)!r} is in use by pid {os.getpid()}" in capsys.readouterr().err
        assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before  # nothing touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = runlock.lock_path(run_dir)
    assert json.loads(lock.read_text())["pid"] == holder.pid  # kill -9 leaves the file: a stale lock
    (run_dir / "summary.json").unlink()  # something left to do for --resume (it completes the summary)
    with caplog.at_level("WARNING", logger="fedllm"):
        assert main(["train", str(recipe), "--resume"]) == 0
    assert f"stale lock of pid {holder.pid} on host {socket.gethostname()}" in caplog.text
    assert "not running" in caplog.text
    assert not lock.exists()  # released on exit


def test_the_lock_is_released_on_any_exit_and_leaves_nothing_behind(tiny_recipe, tmp_path, crash_at_round):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    out = tmp_path / "deep" / "run"
    recipe = parse_recipe(tiny_recipe(output_dir=str(out), federation={"rounds": 1}))
    crash_at_round(1)
    try:
        run(recipe)
    except RuntimeError as e:
        assert "power cut" in str(e)
    assert not runlock.lock_path(out).exists()
    crash_at_round(None)
    run(recipe, resume=True)  # not refused: the crashed run released its lock
    assert not runlock.lock_path(out).exists() and (out / "summary.json").is_file()
    with runlock.hold(tmp_path / "new" / "dir"):
        assert (tmp_path / "new").is_dir()
    assert not (tmp_path / "new").exists()  # parents created only for the lock are removed again


def test_without_flock_a_dead_pid_is_stale_and_a_live_one_holds(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runlock, "fcntl", None)
    target = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runlock.lock_path(target).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    with caplog.at_level("WARNING", logger="fedllm"), runlock.hold(target):
        assert f"stale lock of pid {dead.pid}" in caplog.text
        try:
            with runlock.hold(target):
                raise AssertionError("a live holder was not honoured")
        except runlock.LockedError as e:
            assert f"pid {os.getpid()}" in str(e)
    runlock.lock_path(target).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    try:
        with runlock.hold(target):
            raise AssertionError("another host's lock was not honoured")
    except runlock.LockedError as e:
        assert "on host elsewhere" in str(e)


def test_only_rank_0_checks_the_run_dir_of_a_launch(run_copy, tmp_path, monkeypatch, capsys):
    """In an N-process launch the other ranks may start after rank 0 began writing the run; were they to check
    the directory, they would see "a run" there and exit 2, stranding the launch (a race seen in the 2-process
    tests). Rank 0 alone refuses; the others go on to the run, whose collectives follow rank 0."""
    from fedllm.engine import server

    run_dir, raw = run_copy
    recipe = _recipe(tmp_path, raw)
    reached = []

    def built(recipe):  # where _run_locked goes after its run-dir check
        reached.append("build_federation")
        return object()

    def loop(fed, run_dir, *args):  # where it goes after prepare_run_dir, which checks the directory again
        reached.append("RoundLoop")
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "build_federation", built)
    monkeypatch.setattr(server, "RoundLoop", loop)
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    monkeypatch.setenv("RANK", "0")
    assert main(["train", str(recipe)]) == 2
    assert "already holds a run" in capsys.readouterr().err and not reached
    monkeypatch.setenv("RANK", "1")
    assert main(["train", str(recipe)]) == 130  # the stand-in RoundLoop's KeyboardInterrupt: the run got that far
    assert reached == ["build_federation", "RoundLoop"], capsys.readouterr().err
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
