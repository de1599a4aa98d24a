"""``fedllm eval --client ID|all`` and ``fedllm export --client ID|all`` for the personalized strategies."""

import json

import pytest
import torch
from strategy_helpers import make_raw

from fedllm.commands.cli import main
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe

RUNS: dict = {}


def trained(kind, data_files, tmp_path_factory):
    """A 2-round classification run with personal held-out splits (once per session per kind)."""
    if kind not in RUNS:
        strategy, args = {"fedlora": ("fedlora_pfl", {"shared": "lora"}), "pflmf": ("pflmf", {"rank": 3}),
                          "fedavg": ("fedavg", {})}[kind]
        raw = make_raw(data_files, tmp_path_factory.mktemp(kind), strategy, args, classification=True,
                       data={"client_eval_fraction": 0.25, "eval_fraction": 0.2},
                       eval={"tasks": ["rte"], "personal": strategy != "fedavg"}, federation={"clients_per_round": 3})
        RUNS[kind] = run(parse_recipe(raw))
    return RUNS[kind]


@pytest.mark.parametrize("kind", ["fedlora", "pflmf"])
def test_eval_client_all_reproduces_the_runs_personal_evaluation(kind, data_files, tmp_path_factory, tmp_path, capsys):
    result = trained(kind, data_files, tmp_path_factory)
    out = tmp_path / "eval"
    assert main(["eval", str(result.run_dir), "--client", "all", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "personal_summary.json").read_text())
    in_run = result.history[-1]["personal_eval"]
    assert report["clients"] == in_run  # rebuilt from the checkpoint: the same models on the same splits
    assert report["stats"] == result.history[-1]["personal_eval_stats"]
    printed = capsys.readouterr().out
    assert "client 2" in printed and "accuracy/mean" in printed
    one = tmp_path / "one"
    assert main(["eval", str(result.run_dir), "--client", "1", "--out", str(one), "--no-progress"]) == 0
    assert json.loads((one / "personal_summary.json").read_text())["clients"] == {"1": in_run["1"]}


def test_eval_client_errors_name_the_problem(data_files, tmp_path_factory, capsys):
    personal, fedavg = trained("fedlora", data_files, tmp_path_factory), trained("fedavg", data_files, tmp_path_factory)
    assert main(["eval", str(personal.run_dir), "--client", "3", "--no-progress"]) == 2
    assert "the run has clients 0..2" in capsys.readouterr().err
    assert main(["eval", str(fedavg.run_dir), "--client", "all", "--no-progress"]) == 2
    assert "is not personalized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(personal.run_dir), "--client", "some"])


@pytest.mark.parametrize("kind", ["fedlora", "pflmf"])
def test_export_client_all_gives_each_clients_model(kind, data_files, tmp_path_factory, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from fedllm.export.inference import model_from_checkpoint

    result = trained(kind, data_files, tmp_path_factory)
    out = tmp_path / "merged"
    assert main(["export", str(result.run_dir), "--format", "merged", "--out", str(out), "--client", "all"]) == 0
    ids = torch.tensor([[5, 17, 33, 9, 2]])
    logits = {}
    for cid in range(3):
        merged = AutoModelForSequenceClassification.from_pretrained(str(out / f"client-{cid:04d}")).eval()
        personal, _, _, _ = model_from_checkpoint(result.run_dir, client=cid)
        with torch.no_grad():
            logits[cid] = merged(input_ids=ids).logits
            assert torch.allclose(logits[cid], personal(input_ids=ids).logits, atol=1e-4)
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)  # personal models differ
