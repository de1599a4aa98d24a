"""`fedllm serve` bounds what it reads: chunked bodies at the cap, prompt size before tokenizing, seeds and
lone surrogates answered 400 (issue #20, items 5 and 6)."""

import httpx
import pytest
from evalkit import LoopbackServer

from fedllm.commands.serve import MAX_BODY_BYTES, build_app, longest_token_chars

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served(tiny_lm, tokenizer):
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=4)
    with LoopbackServer(app) as srv:
        yield srv, app


def _chunks(total, size=1 << 20):
    sent = 0
    while sent < total:
        block = b" " * min(size, total - sent)
        sent += len(block)
        yield block


def test_a_chunked_body_is_read_only_up_to_the_cap(served):
    server, _ = served
    url = f"{server.base_url}/chat/completions"
    try:
        r = httpx.post(url, content=_chunks(MAX_BODY_BYTES * 4), timeout=60,
                       headers={"content-type": "application/json"})  # no Content-Length: chunked
        assert r.status_code == 413 and f"at most {MAX_BODY_BYTES}" in r.json()["error"]["message"]
    except httpx.TransportError:  # the server may close before the client finished sending: also refused
        pass
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = httpx.post(url, content=iter([body[:10], body[10:]]), timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 200  # a chunked body under the cap is served


def test_seed_out_of_range_and_lone_surrogates_are_400(served):
    server, _ = served
    url = f"{server.base_url}/chat/completions"
    for seed in (2**70, -1):
        r = httpx.post(url, json={"messages": HI, "seed": seed}, timeout=30)
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"], (seed, r.text)
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    r = httpx.post(url, content=raw, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "messages[0].content: not valid Unicode text" in r.json()["error"]["message"]
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}'
    r = httpx.post(url, content=raw, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "stop[0]" in r.json()["error"]["message"]
    assert httpx.post(url, json={"messages": HI, "max_tokens": 2, "seed": 2**63 - 1}, timeout=30).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_lm, tokenizer, monkeypatch):
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(t) for t in tokenizer.get_vocab())
    window = tiny_lm.config.max_position_embeddings
    calls = []
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=4)
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with LoopbackServer(app) as server:
        big = "x" * (window * longest + 1)
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": [{"role": "user", "content": big}]},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "context_length_exceeded"
        assert calls == []  # never tokenized
        assert httpx.post(f"{server.base_url}/chat/completions", json={"messages": HI, "max_tokens": 2},
                          timeout=30).status_code == 200
        assert calls  # a prompt that may fit is tokenized
