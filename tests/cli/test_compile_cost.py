"""``train.compile``'s cost said before it is paid (fedllm.recipe.compile_cost), and its progress while it compiles
(fedllm.engine.compiled.compile_progress)."""

import logging
import re

import pytest

from fedllm.recipe.checks import load_recipe
from fedllm.recipe.compile_cost import QUICKSTART_LINEAR_PARAMETERS, break_even_rounds, compile_warning, linear_parameters
from tests.cli.conftest import ROOT


def recipe(path, *overrides):
    return load_recipe(ROOT / path, list(overrides))


def test_the_quickstart_breaks_even_after_the_12_rounds_measured():
    """SmolLM2-135M's linear layers read from its GGUF header (hand count: 30 layers of q, o 576 x 576, k, v 192 x 576,
    gate, up, down 1536 x 576 = 106,168,320), and the quickstart's break-even is docs/performance.md's 12 rounds."""
    quick = recipe("recipes/quickstart/smollm2-arith-fedavg.yaml", "train.compile=true")
    assert linear_parameters(quick.model) == QUICKSTART_LINEAR_PARAMETERS == 106_168_320
    assert break_even_rounds(quick) == pytest.approx(12)
    said = compile_warning(quick)  # 4 rounds < 12: said
    assert "pay it back after about 12 rounds, and the run has 4" in said
    assert compile_warning(recipe("recipes/quickstart/smollm2-arith-fedavg.yaml", "train.compile=true",
                                  "federation.rounds=12")) is None
    # twice the clients and twice the steps a round: the same saving in a quarter of the rounds
    assert break_even_rounds(recipe("recipes/quickstart/smollm2-arith-fedavg.yaml", "federation.clients_per_round=4",
                                    "train.local_steps=12")) == pytest.approx(3)


def test_a_tiny_recipe_is_warned_and_a_large_one_is_not():
    """The tiny recipe of issue 52 (compiling took 25 min there) never pays back; Llama-2-7B's paper recipe does at
    once; compile off, or epochs (steps unknown before the data is read): no warning."""
    tiny = recipe("recipes/frlora/tiny-llama-arith-frlora.yaml", "train.compile=true")
    # tiny-llama: 2 layers x (q, o 64 x 64; k, v 32 x 64; gate, up, down 128 x 64) = 73,728; 2 x 2 x 4 x 64 tokens
    assert linear_parameters(tiny.model) == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) == 73_728
    assert break_even_rounds(tiny) == pytest.approx(12 * (4608 * 106_168_320) / (1024 * 73_728))
    assert re.search(r"pay it back after about [\d,]+ rounds, and the run has 3", compile_warning(tiny))
    assert compile_warning(recipe("recipes/frlora/tiny-llama-arith-frlora.yaml")) is None
    assert compile_warning(recipe("recipes/frlora/llama2-7b-metamathqa-frlora.yaml", "train.compile=true")) is None


def test_the_cli_warns_before_the_dry_run_or_the_run_compiles(tmp_path, arith_file, monkeypatch, capsys):
    """The warning comes before anything is built or compiled (the dry run times compiled steps: minutes)."""
    import fedllm.commands.dry_run
    import fedllm.engine.server
    from fedllm.commands.cli import main

    def reached(*args, **kwargs):
        raise RuntimeError("reached")

    monkeypatch.setattr(fedllm.commands.dry_run, "dry_run", reached)
    monkeypatch.setattr(fedllm.engine.server, "run", reached)
    (tmp_path / "r.yaml").write_text(
        f"output_dir: {tmp_path / 'run'}\nmodel: {{name: tiny-llama}}\nlora: {{r: 4}}\n"
        f"data: {{path: {arith_file}, fields: {{instruction: question, output: answer}}}}\n"
        "federation: {num_clients: 3, clients_per_round: 2, rounds: 2}\ntrain: {local_steps: 1, compile: true}\n")
    for extra in (["--dry-run"], []):
        assert main(["train", str(tmp_path / "r.yaml"), *extra]) == 1
        err = capsys.readouterr().err
        assert err.index("warning: train.compile: compiling costs about 35 CPU-s") < err.index("reached")


def test_compiling_says_when_each_graph_starts_and_how_long_it_took(monkeypatch, caplog):
    """Under dynamo's eager backend (no inductor: seconds, not minutes): a line when a graph starts compiling and one
    when it is done, with its seconds; the callbacks are gone after the client."""
    import torch
    from torch._dynamo.callback import callback_handler

    from fedllm.engine import compiled
    from fedllm.models.loading import load_model
    from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig

    monkeypatch.setattr(compiled, "BACKEND", "eager")
    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, alpha=8)).model
    before = (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks))
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    caplog.set_level(logging.INFO, logger="fedllm.compile")
    with compiled.compiled_training(model, TrainConfig(compile=True)):
        model(input_ids=ids)
    lines = [r.getMessage() for r in caplog.records if r.name == "fedllm.compile"]
    starts = [m.group(1) for line in lines if (m := re.fullmatch(r"train\.compile: compiling graph (\S+) \.\.\.", line))]
    ends = [(m.group(1), float(m.group(2)), float(m.group(3))) for line in lines if (m := re.fullmatch(
        r"train\.compile: graph (\S+) compiled in ([\d.]+) s \(([\d.]+) s compiling so far\)", line))]
    assert starts and [graph for graph, _, _ in ends] == starts, lines
    totals = [so_far for _, _, so_far in ends]
    assert totals == sorted(totals) and totals[-1] == pytest.approx(sum(took for _, took, _ in ends), abs=0.1 * len(ends))
    assert (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)) == before
