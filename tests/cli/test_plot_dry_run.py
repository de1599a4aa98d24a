"""``fedllm plot`` and plot.png of every run; ``fedllm train --dry-run`` estimates and writes nothing."""

import struct

import pytest

from fedllm.commands.cli import main
from fedllm.runs.plot import DPI, PANEL_SIZE, series


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_series_cumulates_bytes_and_splits_eval():
    """Bytes in MB of 1024**2 bytes, the unit of the console's round lines and summary (README's quickstart: 56.25 MB
    on the console was 59 on the plot, which divided by 10**6)."""
    history = [{"round": 0, "eval": {"acc": 0.1}},
               {"round": 1, "train_loss": 2.0, "bytes_up_total": 1 << 20, "bytes_down_total": 2 << 20,
                "eval": {"acc": 0.2}},
               {"round": 2, "train_loss": 1.0, "bytes_up_total": 1 << 20, "bytes_down_total": 2 << 20}]
    s = series(history)
    assert s["train loss"] == ([1, 2], [2.0, 1.0])
    assert s["eval acc"] == ([0, 1], [0.1, 0.2])
    assert s["cumulative MB (up + down; MB = 1024**2 bytes)"] == ([1, 2], [3.0, 6.0])


def test_round_lines_plot_and_summary_count_bytes_in_one_unit(tmp_path, arith_file, capsys):
    """The console's per-round ``up=``/``down=`` MB, summed over the rounds, equal the summary line's MB total and
    the plot's last cumulative MB (one unit: 1024**2 bytes)."""
    import re

    from fedllm.runs.rundir import read_metrics

    (tmp_path / "r.yaml").write_text(
        f"output_dir: {tmp_path / 'run'}\nmodel: {{name: tiny-llama}}\nlora: {{r: 32}}\n"
        f"data: {{path: {arith_file}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3, clients_per_round: 2, rounds: 2}\n"
        "train: {local_steps: 1, batch_size: 2, max_length: 32, dtype: fp32}\nlogging: {progress: false}\n")
    assert main(["train", str(tmp_path / "r.yaml")]) == 0  # r=32: rounds of ~0.5 MB, where 10**6 and 1024**2 differ
    err = capsys.readouterr().err
    per_round = re.findall(r"up=([\d.]+)MB  down=([\d.]+)MB", err)
    total = float(re.search(r"communication: ([\d.,]+) MB up \+ down \(MB = 1024\*\*2 bytes\)", err).group(1))
    history = read_metrics(tmp_path / "run" / "metrics.jsonl")
    plotted = series(history)["cumulative MB (up + down; MB = 1024**2 bytes)"][1][-1]
    exact = sum(r["bytes_up_total"] + r["bytes_down_total"] for r in history) / 1024**2
    assert per_round == [(f"{r['bytes_up_total'] / 1024**2:.2f}", f"{r['bytes_down_total'] / 1024**2:.2f}")
                         for r in history if r["round"] >= 1]
    assert per_round != [(f"{r['bytes_up_total'] / 1e6:.2f}", f"{r['bytes_down_total'] / 1e6:.2f}")
                         for r in history if r["round"] >= 1]  # the sizes tell the two units apart
    assert total == pytest.approx(exact, abs=0.0051) and plotted == pytest.approx(exact)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe
    from tests.conftest import arith_records, plot_png, write_jsonl

    tmp = tmp_path_factory.mktemp("plots")
    data = write_jsonl(tmp / "arith.jsonl", arith_records(48))
    dirs = []
    for strategy in ("fedavg", "fedprox"):
        recipe = parse_recipe({
            "seed": 0, "output_dir": str(tmp / strategy), "model": {"name": "tiny-llama"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"path": str(data), "format": "instruction",
                     "fields": {"instruction": "question", "output": "answer"}},
            "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 2, "strategy": strategy,
                           "partition": {"method": "iid"}},
            "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 64},
            "logging": {"progress": False, "quiet": True}})
        with plot_png():
            dirs.append(run(recipe).run_dir)
    return tmp, dirs


def test_every_run_writes_plot_png(two_runs):
    _, dirs = two_runs
    for d in dirs:
        # panels: train loss, cumulative bytes (no eval in these runs) -> 2 panels side by side
        assert png_size(d / "plot.png") == (2 * PANEL_SIZE[0], PANEL_SIZE[1])


def test_fedllm_plot_overlays_runs(two_runs, capsys):
    tmp, dirs = two_runs
    out = tmp / "cmp" / "both.png"
    assert main(["plot", *map(str, dirs), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert png_size(out) == (2 * PANEL_SIZE[0], PANEL_SIZE[1]) and DPI == 100


def test_fedllm_plot_bad_run_dir_is_exit_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_dry_run_writes_nothing_and_matches_a_real_round(tiny_recipe, tmp_path, capsys):
    import yaml

    from fedllm.commands.dry_run import dry_run
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    raw = tiny_recipe()
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(raw))
    out_dir = tmp_path / "run"
    assert main(["train", str(recipe_file), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out_dir.exists()
    assert "per round: 4 client steps (2 clients)" in text and f"nothing was written to {out_dir}" in text

    report = dry_run(parse_recipe(raw))
    first = run(parse_recipe(raw)).history[0]
    assert main(["train", str(recipe_file), "--dry-run"]) == 0  # the real command would refuse: it says so
    said = capsys.readouterr()
    assert "warning: fedllm train without --dry-run would stop before training: " \
           f"output_dir={str(out_dir)!r} already holds a run; pass --resume" in said.err
    assert "per round: 4 client steps" in said.out
    assert report.bytes_up == first["bytes_up_total"] and report.bytes_down == first["bytes_down_total"]
    assert report.steps_per_round == sum(first["client_steps"].values())
    assert report.eval_rounds == [] and report.seconds_total == pytest.approx(report.build_seconds
                                                                               + report.seconds_per_step * 4 * 2)


def test_dry_run_times_one_batch_of_each_evaluation_and_names_what_it_cannot_time(tiny_recipe):
    """The whole-run estimate counts building, rounds and evaluations (a run of the quickstart spends a third of its
    time evaluating); a judged task is not timed (a dry run calls no judge) and the report says so."""
    from fedllm.commands.dry_run import dry_run
    from fedllm.recipe.checks import parse_recipe

    raw = tiny_recipe(data={"eval_fraction": 0.25},
                      eval={"tasks": ["held_out", "gsm8k", "mt_bench"], "batch_size": 4, "max_new_tokens": 4,
                            "before_training": True})
    report = dry_run(parse_recipe(raw))
    assert report.eval_rounds == [0, 2] and report.eval_seconds > 0
    assert [t.split(" ")[0] for t in report.eval_untimed] == ["mt_bench"]
    assert report.seconds_total == pytest.approx(report.build_seconds + report.seconds_per_round * 2
                                                 + 2 * report.eval_seconds)
    text = report.report()
    assert "evaluation (held_out, gsm8k, mt_bench) after round(s) 0, 2: up to ~" in text
    assert "not timed: mt_bench (judged or run by lm-evaluation-harness)" in text
    assert "at this machine's load now (load " in text


def test_run_eta_is_mean_round_time_times_rounds_left():
    from fedllm.engine.server import run_eta

    history = [{"round": 0, "eval": {}}, {"round": 1, "seconds": 30.0}, {"round": 2, "seconds": 50.0}]
    assert run_eta(history, 5) == "2:00"  # 3 rounds left x 40 s
    assert run_eta(history, 2) == "0:00"
    assert run_eta([], 3) == "0:00"
