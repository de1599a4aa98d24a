"""Helpers of the evaluation tests: tiny models, a scripted model, a loopback server."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "eval"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama_config(tokenizer, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=None, **kw)


class ScriptedLM(torch.nn.Module):
    """A causal LM whose ``generate`` answers each prompt from a script (question -> answer).

    It wraps a real tiny LLaMA (so it has parameters, a config and train/eval state) and
    returns ``prompt ids + scripted answer ids + eos``, padded like HF generate does; only
    the generation is scripted, never the library. ``calls`` counts generate calls and
    ``prompts`` records every decoded prompt.
    """

    def __init__(self, base, tokenizer, script: dict[str, str], default: str = "I do not know."):
        super().__init__()
        self.base = base
        self.config = base.config
        self.generation_config = base.generation_config
        self.tok = tokenizer
        self.script = script
        self.default = default
        self.calls = 0
        self.prompts: list[str] = []
        self.decoding: dict[str, tuple] = {}

    def _answer(self, prompt: str) -> str:
        best, where = self.default, -1
        for question, answer in self.script.items():
            pos = prompt.rfind(question)
            if pos > where:
                best, where = answer, pos
        return best

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.calls += 1
        assert self.tok.padding_side == "left"
        assert not self.training
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            assert mask[-1] == 1, "prompts must be left-padded"
            prompt = self.tok.decode(ids[mask.bool()].tolist())
            self.prompts.append(prompt)
            self.decoding[prompt] = (kwargs.get("do_sample"), kwargs.get("temperature"), kwargs.get("top_p"),
                                     max_new_tokens)
            new = self.tok(self._answer(prompt), add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(ids.tolist() + new + [self.tok.eos_token_id])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """Runs a FastAPI app with uvicorn on 127.0.0.1 in a daemon thread; stops on exit."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = free_port()
        # log_config=None: uvicorn's own logging config runs logging.config.dictConfig, which closes every handler
        # of the process -- absl's (dp-accounting imports it) then closes the stream it was made with, in a test
        # pytest's capture file, and every later test of that pytest-xdist worker failed in pytest's capture
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "LoopbackServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the loopback server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=600)  # the thread's end is the event; 600 s only bounds a hung server
        if self.thread.is_alive():
            raise RuntimeError("the loopback server did not stop within 600 s")


def files_under(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob("*") if p.is_file()]


def scripted_judge_app(reply, model: str = "scripted-judge"):
    """An OpenAI-compatible chat-completions app (Starlette) whose replies come from ``reply(messages)``.

    Every request body (messages, temperature, max_tokens, model) is kept in ``app.state.requests``,
    so a test sees exactly what the judge client sent over HTTP.
    """
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list",
                             "data": [{"id": model, "object": "model", "created": 0, "owned_by": "test"}]})

    async def chat(request):
        body = await request.json()
        app.state.requests.append(body)
        text = reply(body["messages"])
        return JSONResponse({
            "id": f"chatcmpl-{len(app.state.requests)}", "object": "chat.completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    app.state.requests = []
    return app
