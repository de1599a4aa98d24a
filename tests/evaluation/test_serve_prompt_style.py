"""`fedllm serve` renders requests in the run's prompt style (Alpaca for an Alpaca-trained run)."""

from fastapi.testclient import TestClient

from fedllm.commands.serve import build_app

ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\nWhat is 3 + 4?\n\n### Response:\n")


def _prompt_tokens(app) -> int:
    reply = TestClient(app).post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 2,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


def test_alpaca_style_serves_the_training_prompt(tiny_lm, tokenizer):
    expected = len(tokenizer(ALPACA)["input_ids"])  # the hand-written Alpaca prompt, as training formats it
    assert _prompt_tokens(build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=2, prompt_style="alpaca")) \
        == expected
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert _prompt_tokens(build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=2)) == len(
        tokenizer(chat, add_special_tokens=not chat.startswith(tokenizer.bos_token or "\0"))["input_ids"])
    assert expected != len(tokenizer(chat)["input_ids"])  # the two styles really differ
