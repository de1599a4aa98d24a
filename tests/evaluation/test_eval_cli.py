"""`fedllm eval`: flags, exit codes, the printed table, and a run directory's recipe and held-out data."""

import json

import pytest
import yaml
from evalkit import ASSETS

import fedllm.export.inference
from fedllm.commands.cli import main
from fedllm.commands.evaluate import default_out_dir, find_run_recipe, parse_data_specs, parse_task_list
from fedllm.common.errors import InputError
from fedllm.evaluation.sources import read_records

DATA = ASSETS / "gsm8k_tiny.jsonl"
SCRIPT = {"Tom has 3 apples": "#### 7", "1,200 pens": "The answer is 2,400.", "Mia earns": "50"}


@pytest.fixture
def load_scripted(monkeypatch, scripted_lm, tokenizer):
    """Replace the checkpoint loader (another module's job) with one returning a scripted model."""
    loaded = {}

    def install(script):
        model = scripted_lm(script)

        def load_for_inference(path, dtype="fp32", client=None):
            loaded.update(path=path, dtype=dtype, client=client)
            return model, tokenizer

        monkeypatch.setattr(fedllm.export.inference, "load_for_inference", load_for_inference)
        return model

    install.loaded = loaded
    return install


def test_parsers():
    assert parse_task_list(" gsm8k, mt_bench ,") == ["gsm8k", "mt_bench"]
    assert parse_task_list("lm_eval:arc_easy,gsm8k") == ["lm_eval:arc_easy", "gsm8k"]    # the harness's names
    with pytest.raises(InputError, match="unknown task"):
        parse_task_list("gsm8k,nope")
    assert parse_data_specs(["gsm8k=a/b.jsonl", "mt_bench = x=y"]) == {"gsm8k": "a/b.jsonl", "mt_bench": "x=y"}
    with pytest.raises(InputError, match="TASK=PATH"):
        parse_data_specs(["gsm8k"])


def test_eval_prints_a_table_and_writes_results(load_scripted, tmp_path, capsys):
    load_scripted(SCRIPT)
    out = tmp_path / "out"
    code = main(["eval", "HuggingFaceTB/some-model", "--tasks", "gsm8k", "--data", f"gsm8k={DATA}", "--limit", "4",
                 "--out", str(out), "--prompt-style", "plain", "--no-progress", "--dtype", "bf16"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| task | metric | value |" in printed and "| gsm8k | accuracy | 0.7500 |" in printed
    assert json.loads((out / "summary.json").read_text()) == {"metrics": {"gsm8k/accuracy": 0.75},
                                                              "protocols": {"gsm8k": "fedllm"}}
    assert load_scripted.loaded == {"path": "HuggingFaceTB/some-model", "dtype": "bf16", "client": None}


def test_answer_protocol_flag(load_scripted, tmp_path, capsys):
    load_scripted({**SCRIPT, "Mia earns": "The answer is: 50"})
    out = tmp_path / "out"
    assert main(["eval", "m", "--tasks", "gsm8k", "--data", f"gsm8k={DATA}", "--limit", "3", "--out", str(out),
                 "--answer-protocol", "metamath", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text()) == {"metrics": {"gsm8k/accuracy": pytest.approx(1 / 3)},
                                                              "protocols": {"gsm8k": "metamath"}}
    with pytest.raises(SystemExit) as exited:                                  # argparse's usage error
        main(["eval", "m", "--tasks", "gsm8k", "--answer-protocol", "nope"])
    assert exited.value.code == 2


def test_usage_errors_exit_2(load_scripted, tmp_path, capsys):
    load_scripted(SCRIPT)
    assert main(["eval", "m", "--tasks", "gsm8k,unknown", "--out", str(tmp_path)]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["eval", "m", "--out", str(tmp_path)]) == 2                       # no tasks at all
    assert main(["eval", "m", "--tasks", "gsm8k", "--data", f"gsm8k={tmp_path / 'missing.jsonl'}",
                 "--out", str(tmp_path)]) == 2
    assert main(["eval", "m", "--tasks", "gsm8k", "--limit", "0"]) == 2


def test_run_directory_uses_its_recipe_and_held_out_records(load_scripted, tmp_path, tiny_recipe, alpaca_prompt,
                                                            capsys):
    raw = tiny_recipe(data={"eval_fraction": 0.25}, eval={"tasks": ["gsm8k"], "max_new_tokens": 32})
    records = read_records(raw["data"]["path"])
    model = load_scripted({r["question"]: r["answer"] for r in records})
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert find_run_recipe(str(run / "final")) == run / "recipe.yaml"
    assert main(["eval", str(run / "final"), "--no-progress"]) == 0
    assert "| gsm8k | accuracy | 1 |" in capsys.readouterr().out
    assert len(model.prompts) == 12                                 # 25% of 48 held out
    questions = {r["question"] for r in records}
    for prompt in model.prompts:                                    # trained with Alpaca: prompted with Alpaca
        assert any(prompt == alpaca_prompt(q) for q in questions)
    assert (run / "final" / "eval" / "gsm8k.json").is_file()
    assert default_out_dir(str(run / "final")) == run / "final" / "eval"


def test_glue_test_split_without_labels_exits_2(load_scripted, tmp_path, capsys):
    """GLUE's test splits hide their labels (-1): scoring them would report 0.0, so it is refused."""
    load_scripted({})
    test_split = tmp_path / "rte_test.jsonl"
    test_split.write_text("".join(json.dumps({"sentence1": f"A man runs {i}.", "sentence2": "A man moves.", "idx": i,
                                              "label": -1}) + "\n" for i in range(3)))
    assert main(["eval", "m", "--tasks", "rte", "--data", f"rte={test_split}", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "rte" in err and str(test_split) in err and "no labels" in err and "3 of 3" in err
    assert not (tmp_path / "o" / "rte.json").exists()


def test_protocol_flags_reach_the_eval_config():
    import argparse

    from fedllm.commands.evaluate import add_eval_arguments, build_eval_config
    from fedllm.recipe.schema import EvalConfig

    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    args = parser.parse_args(["m", "--tasks", "vicuna", "--judge-protocol", "fastchat", "--decoding", "greedy",
                              "--seed", "7", "--seeding", "batch"])
    cfg = build_eval_config(args, EvalConfig())
    assert (cfg.judge.protocol, cfg.decoding, cfg.seed, cfg.seeding, cfg.max_new_tokens) == (
        "fastchat", "greedy", 7, "batch", None)
    defaults = build_eval_config(parser.parse_args(["m", "--tasks", "vicuna"]), EvalConfig())
    assert (defaults.judge.protocol, defaults.decoding, defaults.seed, defaults.seeding) == (
        "openfedllm", "protocol", 0, "question")
    args = parser.parse_args(["m", "--tasks", "mt_bench", "--judged-prompts", "training", "--judge-ratings",
                              "minus_one", "--answer-protocol", "lm_eval"])
    cfg = build_eval_config(args, EvalConfig())
    assert (cfg.judged_prompts, cfg.judge.ratings, cfg.answer_protocol) == ("training", "minus_one", "lm_eval")
    assert (defaults.judged_prompts, defaults.judge.ratings) == ("reference", "reference")
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--judge-protocol", "gpt4"])


def test_a_chat_run_trained_in_a_fastchat_template_is_prompted_in_it(load_scripted, tmp_path, tiny_recipe, capsys):
    """A run whose chat data were formatted with a FastChat conversation template (``data.template``) is asked in
    that template (FastChat renders the expected prompt), unless ``eval.chat_template`` names another."""
    pytest.importorskip("fastchat")
    from fastchat.conversation import get_conv_template

    from fedllm.evaluation.runner import eval_config_for_data
    from fedllm.recipe.schema import DataConfig, EvalConfig

    raw = tiny_recipe(data={"format": "chat", "template": "alpaca", "fields": {}},
                      eval={"tasks": ["gsm8k"], "max_new_tokens": 8})
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw))
    model = load_scripted(SCRIPT)
    assert main(["eval", str(run / "final"), "--data", f"gsm8k={DATA}", "--limit", "1", "--no-progress"]) == 0
    conv = get_conv_template("alpaca")
    conv.append_message(conv.roles[0], read_records(str(DATA))[0]["question"])
    conv.append_message(conv.roles[1], None)
    assert model.prompts == [conv.get_prompt()]

    chosen = EvalConfig(chat_template="vicuna_v1.1")
    assert eval_config_for_data(chosen, DataConfig(format="chat", template="alpaca")) is chosen
    assert eval_config_for_data(EvalConfig(), DataConfig(format="chat")).chat_template is None      # the tokenizer's
    assert eval_config_for_data(EvalConfig(), DataConfig(format="instruction")).chat_template is None
