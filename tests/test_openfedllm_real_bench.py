"""bench/openfedllm_real.py's pure parts: round timing from marks, OpenFedLLM's loss file, options, the two runs' settings.

The bench itself needs OpenFedLLM's own environment; nothing here does.
"""

import math
from pathlib import Path

import pytest

from fedllm.recipe.checks import parse_recipe
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "bench" / "openfedllm_real.py")


def mark(label, wall, cpu):
    return {"label": label, "wall": wall, "cpu": cpu}


def test_fedllm_rounds_are_timed_from_start_to_end_of_each_round(bench):
    marks = [mark("start 1", 10.0, 1.0), mark("end 1", 14.0, 4.5), mark("start 2", 15.0, 5.0),
             mark("end 2", 18.5, 7.0)]
    assert bench.round_times(marks) == [{"round": 1, "wall": 4.0, "cpu": 3.5}, {"round": 2, "wall": 3.5, "cpu": 2.0}]


def test_openfedllm_rounds_run_from_one_round_line_to_the_next_and_the_last_to_exit(bench):
    marks = [mark("start 1", 100.0, 20.0), mark("start 2", 160.0, 50.0), mark("start 3", 190.0, 65.0),
             mark("end", 215.0, 77.0)]
    assert bench.round_times(marks) == [{"round": 1, "wall": 60.0, "cpu": 30.0},
                                        {"round": 2, "wall": 30.0, "cpu": 15.0},
                                        {"round": 3, "wall": 25.0, "cpu": 12.0}]


def test_a_run_stopped_inside_its_first_round_has_no_round(bench):
    assert bench.round_times([mark("start 1", 1.0, 1.0)]) == []


def test_openfedllm_losses_average_the_clients_trained_each_round(bench):
    # training_loss.npy: clients x rounds, -1 where a client was not sampled (main_sft.py / main_dpo.py)
    table = [[1.0, -1, 0.5], [-1, 2.0, -1], [3.0, 1.0, -1]]
    assert bench.ofl_round_losses(table) == [2.0, 1.5, 0.5]
    assert math.isnan(bench.ofl_round_losses([[-1], [-1]])[0])


def test_summary_takes_rounds_from_the_second_on_and_the_median_over_trials(bench):
    def trial(walls, cpus, loss, peak_kib):
        return {"rounds": [{"round": i + 1, "wall": w, "cpu": c} for i, (w, c) in enumerate(zip(walls, cpus))],
                "process_wall": sum(walls), "process_cpu": sum(cpus), "losses": [loss], "peak_kib": peak_kib,
                "baseline_kib": 1024 * 300}

    s = bench.summarize([trial([100, 4, 6], [50, 2, 4], 0.9, 1024 * 1300), trial([100, 8, 8], [50, 5, 5], 0.8,
                                                                                1024 * 1100),
                         trial([100, 20, 30], [50, 9, 11], 0.7, 1024 * 1500)])
    assert s["wall_trials"] == [5.0, 8.0, 25.0] and s["wall_per_round"] == 8.0
    assert s["cpu_trials"] == [3.0, 5.0, 10.0] and s["cpu_per_round"] == 5.0
    assert s["peak_trials"] == [1000.0, 800.0, 1200.0] and s["peak_mib"] == 1000.0  # MiB above the baseline
    assert s["losses"] == [0.7]


@pytest.mark.parametrize("argv", [["--rounds", "1"], ["--configs", "fedllm,ofl-bf16"], ["--workloads", "ppo"],
                                  ["--configs", "ofl"]])
def test_bad_options_exit_2(bench, argv, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv)
    assert stop.value.code == 2


@pytest.mark.parametrize("workload", ["sft", "dpo"])
def test_both_systems_get_the_same_federation_and_training_settings(bench, workload, tmp_path):
    args = bench.parse_args(["--configs", "fedllm", "--clients", "6", "--per-round", "3", "--steps", "5", "--batch", "2", "--rounds", "4",
                             "--max-length", "64", "--lr", "1e-4", "--rank", "4", "--records", "30"])
    argv = bench.ofl_argv(args, workload, tmp_path / "data", tmp_path / "model", tmp_path / "out", True)
    flags = argv[:]
    flags.remove("--use_peft")  # OpenFedLLM's one switch without a value
    ofl = dict(zip(flags[::2], flags[1::2]))
    raw = bench.fedllm_recipe(args, workload, tmp_path / "data", tmp_path / "out", "fp32")
    recipe = parse_recipe(raw)
    fed, train, lora = recipe.federation, recipe.train, recipe.lora
    assert (fed.num_clients, fed.clients_per_round, fed.rounds) == (6, 3, 4)
    assert (ofl["--num_clients"], ofl["--sample_clients"], ofl["--num_rounds"]) == ("6", "3", "4")
    assert (train.local_steps, train.batch_size, train.max_length, train.lr) == (5, 2, 64, 1e-4)
    assert (ofl["--max_steps"], ofl["--batch_size"], ofl["--seq_length"], ofl["--learning_rate"]) == \
        ("5", "2", "64", "0.0001")
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (4, 8, 0.05, ["q_proj", "v_proj"])
    assert (ofl["--peft_lora_r"], ofl["--peft_lora_alpha"]) == ("4", "8")
    # OpenFedLLM's cosine floors and round positions (cosine_learning_rate(round, num_rounds, lr, floor))
    assert train.lr_progress == "openfedllm" and train.min_lr == {"sft": 1e-6, "dpo": 1e-5}[workload]
    assert train.max_grad_norm == 1.0  # TrainingArguments' default max_grad_norm
    assert ofl["--dataset_name"] == bench.OFL_DATASETS[workload] and ofl["--local_data_dir"].endswith("/")
    assert Path(recipe.data.path).parent == tmp_path / "data" / bench.OFL_DATASETS[workload]
    if workload == "dpo":
        assert train.objective == "dpo" and train.preference.beta == 0.1  # main_dpo.py's dpo_beta default
        assert ofl["--template"] == recipe.data.template == "vicuna_v1.1"
    else:
        assert ofl["--template"] == "alpaca" and recipe.data.template == "openfedllm"


def test_a_process_s_peak_is_its_own_high_water_mark_not_its_rss_at_exit_nor_its_parent_s(bench):
    import sys

    # 256 MiB touched then freed: the peak holds it, the RSS at exit does not; the parent (this test process,
    # hundreds of MiB) does not count (wait4's ru_maxrss would fold in its RSS at the fork)
    grow = "b = bytearray(256 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); del b"
    small = bench.peak_of_code(sys.executable, "pass", {})
    big = bench.peak_of_code(sys.executable, grow, {})
    assert small < 64 * 1024
    assert 240 * 1024 <= big - small <= 300 * 1024  # (the interpreter's file pages may be evicted under pressure)
    assert bench.vmhwm_kib("Name:\tpython\nVmPeak:\t  9000 kB\nVmHWM:\t  1234 kB\nVmRSS:\t  1000 kB\n") == 1234
    with pytest.raises(SystemExit):
        bench.peak_of_code(sys.executable, "raise SystemExit(3)", {})


@pytest.mark.parametrize("config,dtype,gc", [("fedllm", "auto", False), ("fedllm-gc", "auto", True),
                                             ("fedllm-fp32", "fp32", False), ("fedllm-fp32-gc", "fp32", True)])
def test_fedllm_configurations_set_dtype_and_checkpointing(bench, config, dtype, gc, tmp_path):
    args = bench.parse_args(["--configs", config])
    assert args.configs == [config]
    raw = bench.fedllm_recipe(args, "sft", tmp_path / "data", tmp_path / "out", dtype, gradient_checkpointing=gc)
    recipe = parse_recipe(raw)
    assert recipe.train.gradient_checkpointing is gc and recipe.train.dtype == dtype


def test_both_environments_get_the_same_allocator_setting(bench):
    args = bench.parse_args(["--configs", "fedllm", "--mmap-threshold", "131072", "--threads", "2"])
    fedllm, ofl = bench.child_env(args, False), bench.child_env(args, True)
    assert fedllm["MALLOC_MMAP_THRESHOLD_"] == ofl["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert fedllm["OMP_NUM_THREADS"] == ofl["OMP_NUM_THREADS"] == "2" and "PYTHONPATH" not in ofl
    assert "MALLOC_MMAP_THRESHOLD_" not in bench.child_env(bench.parse_args(["--configs", "fedllm"]), True)


def test_long_answers_fill_every_sequence_to_the_maximum_length(bench, tmp_path):
    import json

    from fedllm.models.loading import load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    bench.write_data(tmp_path, 3, long_answers=True)
    rows = [json.loads(x) for x in (tmp_path / bench.OFL_DATASETS["sft"] / "train.jsonl").read_text().splitlines()]
    tok = load_tokenizer(ModelConfig(name="smollm2-135m-instruct"))
    assert len(rows) == 3 and len({r["output"] for r in rows}) == 3
    assert all(len(tok(r["output"])["input_ids"]) > 1024 for r in rows)  # past the longest --max-length measured
    bench.write_data(tmp_path, 3)
    short = [json.loads(x) for x in (tmp_path / bench.OFL_DATASETS["sft"] / "train.jsonl").read_text().splitlines()]
    assert all(len(tok(r["output"])["input_ids"]) < 64 for r in short)
