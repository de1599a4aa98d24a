"""`fedllm serve` under hostile requests: 400 for bad values, context window, 429 when the queue is full,
503 after waiting too long, a time limit on generation (bounded loops on 127.0.0.1)."""

import threading
import time

import httpx
import pytest
from evalkit import LoopbackServer

import fedllm.evaluation.generation as generation
from fedllm.commands.cli import main
from fedllm.commands.serve import build_app

HI = [{"role": "user", "content": "hi"}]


def post(server, body, timeout=30):
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


@pytest.fixture
def server(tiny_lm, tokenizer):
    with LoopbackServer(build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=8)) as srv:
        yield srv


BAD = [
    {"messages": HI, "max_tokens": -5},
    {"messages": HI, "max_tokens": 0},
    {"messages": HI, "max_tokens": "many"},
    {"messages": HI, "max_completion_tokens": 0},
    {"messages": HI, "temperature": -1},
    {"messages": HI, "temperature": 9},
    {"messages": HI, "top_p": 0},
    {"messages": HI, "top_p": 1.5},
    {"messages": HI, "n": 0},
    {"messages": HI, "stop": ["a", "b", "c", "d", "e"]},
    {"messages": HI, "stop": 3},
    {"messages": HI, "seed": "x"},
    {"messages": HI, "stream": "yes"},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user"}], "model": 7},
    {},
]


def test_every_bad_field_is_a_400_with_an_openai_error(server):
    for body in BAD:
        r = post(server, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
        assert "Traceback" not in r.text
    r = httpx.post(f"{server.base_url}/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    ok = post(server, {"messages": HI, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3


def test_a_prompt_longer_than_the_context_window_is_rejected_at_once(server, tiny_lm):
    window = tiny_lm.config.max_position_embeddings
    started = time.monotonic()
    r = post(server, {"messages": [{"role": "user", "content": "word " * 60_000}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "context_length_exceeded"
    assert f"context window is {window} tokens" in r.json()["error"]["message"]
    assert time.monotonic() - started < 20
    assert post(server, {"messages": HI, "max_tokens": 2}).status_code == 200  # the server still answers


def test_an_oversized_body_is_refused_before_parsing(server):
    r = post(server, {"messages": [{"role": "user", "content": "x" * (9 << 20)}]})
    assert r.status_code == 413 and "at most 8388608" in r.json()["error"]["message"]
    assert post(server, {"messages": HI, "max_tokens": 2}).status_code == 200


@pytest.fixture
def slow_generation(monkeypatch):
    """Generation blocks until ``release`` is set; ``inside`` is set while a request generates."""
    inside, release = threading.Event(), threading.Event()
    original = generation.generate_completions

    def slow(*args, **kwargs):
        inside.set()
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(generation, "generate_completions", slow)
    return inside, release


def test_a_full_queue_answers_429_and_a_long_wait_503(tiny_lm, tokenizer, slow_generation):
    inside, release = slow_generation
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=4, max_queue=1, request_timeout=2.0)
    results = {}
    with LoopbackServer(app) as srv:
        first = threading.Thread(target=lambda: results.setdefault("first", post(srv, {"messages": HI})))
        first.start()
        assert inside.wait(20)
        waiting = threading.Thread(target=lambda: results.setdefault("waiting", post(srv, {"messages": HI})))
        waiting.start()
        deadline = time.monotonic() + 20
        while app.state.admitted < 2 and time.monotonic() < deadline:  # one generates, one waits
            time.sleep(0.01)
        third = post(srv, {"messages": HI})
        assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
        waiting.join(20)
        assert results["waiting"].status_code == 503  # waited longer than request_timeout
        assert "no turn within 2 s" in results["waiting"].json()["error"]["message"]
        release.set()
        first.join(20)
    assert results["first"].status_code == 200 and app.state.rejected == 1 and app.state.admitted == 0


def test_generation_stops_at_the_time_limit(tiny_lm, tokenizer):
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=100_000, request_timeout=0.3,
                    context_length=100_000)
    tiny_lm.generation_config.eos_token_id = None  # nothing ends the completion but the limits
    with LoopbackServer(app) as srv:
        started = time.monotonic()
        r = post(srv, {"messages": HI, "temperature": 0})
        elapsed = time.monotonic() - started
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] < 100_000 and elapsed < 15


def test_bad_server_limits_exit_2(capsys):
    assert main(["serve", "tiny-llama", "--max-queue", "-1", "--request-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-queue -1" in err and "--request-timeout 0.0" in err
