"""`fedllm serve`: an OpenAI-compatible server on loopback, talked to with the real `openai` client."""

import argparse

import openai
import pytest
from evalkit import LoopbackServer

from fedllm.commands.serve import add_serve_arguments, build_app, default_model_name


@pytest.fixture
def served(tiny_lm, tokenizer):
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=16)
    with LoopbackServer(app) as server:
        yield app, openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def test_models_and_chat_completions(served):
    app, client = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=5)
    second = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=5)
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == second.choices[0].message.content      # greedy at temperature 0
    assert first.usage.completion_tokens <= 5
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.choices[0].finish_reason in ("stop", "length")
    capped = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=1000)
    assert capped.usage.completion_tokens <= 16                                         # the server's cap
    assert app.state.requests == 3


def test_streaming_matches_the_plain_reply(served):
    _, client = served
    messages = [{"role": "user", "content": "Tell me about Hawaii."}]
    plain = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    chunks = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content


def test_errors_are_openai_errors(served):
    _, client = served
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)


def test_sampling_with_a_seed_is_reproducible(served):
    _, client = served
    messages = [{"role": "user", "content": "Say something."}]
    a, b = (client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, max_tokens=6, seed=3)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_needs_a_chat_template(tiny_lm, tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        build_app(tiny_lm, tokenizer, "tiny")


def test_arguments_default_to_loopback():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["runs/x/final"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert default_model_name("runs/x/final/") == "x"
    assert default_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
