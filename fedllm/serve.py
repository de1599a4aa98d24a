"""`fedllm serve CHECKPOINT`: an OpenAI-compatible chat server for a checkpoint or exported model.

Endpoints: ``GET /v1/models`` and ``POST /v1/chat/completions`` (non-streaming,
or streamed as server-sent events). Conversations are rendered with the
tokenizer's chat template (or a FastChat template), generation is greedy at
temperature 0 and sampled otherwise; requests are served one at a time. Any
OpenAI client can talk to it, e.g. to chat with a trained model or to use a
local model as the LLM judge of ``fedllm eval``. Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from fedllm.errors import InputError

DEFAULT_MAX_NEW_TOKENS = 2048
"""Largest completion served (requests asking for more are capped)."""


class ChatMessage(BaseModel):
    """One message of a chat request (text content, or a list of text parts)."""

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(BaseModel):
    """The supported subset of an OpenAI chat-completions request."""

    model: Optional[str] = None
    messages: list[ChatMessage]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    seed: Optional[int] = None


def _text(content: Union[str, list[dict[str, Any]], None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type", "text") == "text")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def build_app(model, tokenizer, model_name: str, chat_template: Optional[str] = None,
              max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS) -> FastAPI:
    """The FastAPI app serving ``model`` under the name ``model_name``.

    Args:
        model: a causal LM (plain or PEFT) in memory.
        tokenizer: its tokenizer (with a chat template unless ``chat_template`` is given).
        model_name: the id listed by ``/v1/models`` and accepted in requests.
        chat_template: FastChat conversation template name instead of the tokenizer's template.
        max_new_tokens_limit: cap on a completion's length.

    Returns:
        The app; ``app.state.requests`` counts the completions served.

    Raises:
        InputError: no chat template to render conversations with.
    """
    import torch

    from fedllm.evaluation.generation import generate_completions
    from fedllm.evaluation.prompt_styles import make_prompt_style

    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template: pass a FastChat template name (--chat-template)")
    style = make_prompt_style("chat", tokenizer, chat_template)
    lock = threading.Lock()
    app = FastAPI(title="fedllm serve")
    app.state.requests = 0
    created = int(time.time())

    @app.get("/v1/models")
    def list_models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "fedllm"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatRequest):
        if req.model and req.model != model_name:
            return _error(404, f"model {req.model!r} not found; this server serves {model_name!r}", "not_found_error")
        if req.n != 1:
            return _error(400, "only n=1 is supported")
        messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        try:
            prompt = style.render(messages)
        except (ValueError, ImportError) as e:
            return _error(400, str(e))
        limit = req.max_completion_tokens or req.max_tokens or max_new_tokens_limit
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        with lock:
            if req.seed is not None:
                torch.manual_seed(req.seed)
            comp = generate_completions(model, tokenizer, [prompt], min(limit, max_new_tokens_limit), 1,
                                        progress=False, stop=stop, temperature=max(0.0, req.temperature),
                                        top_p=req.top_p)[0]
            app.state.requests += 1
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        if req.stream:
            return StreamingResponse(_stream(cid, now, model_name, comp.text, comp.finish_reason),
                                     media_type="text/event-stream")
        return {
            "id": cid, "object": "chat.completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": comp.text},
                         "finish_reason": comp.finish_reason}],
            "usage": {"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens,
                      "total_tokens": comp.prompt_tokens + comp.completion_tokens},
        }

    return app


def _stream(cid: str, created: int, model_name: str, text: str, finish_reason: str):
    """Server-sent events of one completion: role, content, finish reason, [DONE]."""
    def chunk(delta: dict, reason: Optional[str]) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant"}, None)
    yield chunk({"content": text}, None)
    yield chunk({}, finish_reason)
    yield "data: [DONE]\n\n"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedllm serve``."""
    parser.add_argument("checkpoint", help="run directory, round checkpoint, exported model or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--model-name", default=None, help="model id served (default: the checkpoint's name)")
    parser.add_argument("--chat-template", default=None,
                        help="FastChat conversation template (default: the tokenizer's chat template)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights dtype")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="cap on a completion's length")


def default_model_name(checkpoint: str) -> str:
    """A served model id for a checkpoint path or hub id (its last path parts)."""
    parts = [p for p in checkpoint.replace("\\", "/").rstrip("/").split("/") if p not in ("", ".")]
    return "/".join(parts[-2:]) if parts else "model"


def run_serve_command(args: argparse.Namespace) -> int:
    """``fedllm serve``: load the checkpoint and serve it until interrupted; returns the exit code.

    Raises:
        InputError: an unloadable checkpoint or no chat template (exit code 2 on the CLI).
    """
    import uvicorn

    from fedllm.inference import load_for_inference

    model, tokenizer = load_for_inference(args.checkpoint, dtype=args.dtype)
    name = args.model_name or default_model_name(args.checkpoint)
    app = build_app(model, tokenizer, name, args.chat_template, args.max_new_tokens)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: anyone who can reach it can use the model", file=sys.stderr)
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (OpenAI-compatible; Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
