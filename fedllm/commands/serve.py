"""`fedllm serve CHECKPOINT`: an OpenAI-compatible chat server for a checkpoint or exported model.

Endpoints: ``GET /v1/models`` and ``POST /v1/chat/completions`` (non-streaming,
or streamed as server-sent events). Conversations are rendered in the prompt
style the run trained with, as ``fedllm eval`` does (the Alpaca template for
instruction data with ``data.template: alpaca``, else the tokenizer's chat
template or a FastChat template; ``--prompt-style`` overrides), generation is greedy at
temperature 0 and sampled otherwise; requests are served one at a time. Any
OpenAI client can talk to it, e.g. to chat with a trained model or to use a
local model as the LLM judge of ``fedllm eval``. Binds 127.0.0.1 by default.

Hardening: every request field is validated (a bad value answers 400 with an OpenAI-style
error, never 500); a prompt that does not fit the model's context window is rejected (400) and
a completion is capped so that prompt + completion fit; at most ``max_queue`` requests wait
while one generates (more answer 429); a request waits at most ``request_timeout`` seconds for
its turn (then 503) and generates for at most ``request_timeout`` seconds (then it ends with
``finish_reason: length``), so one request cannot starve the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from fedllm.common.errors import InputError

DEFAULT_MAX_NEW_TOKENS = 2048
"""Largest completion served (requests asking for more are capped)."""
DEFAULT_MAX_QUEUE = 8
"""Requests that may wait while one generates; more answer 429."""
DEFAULT_REQUEST_TIMEOUT = 120.0
"""Seconds a request may wait for its turn (then 503) and may generate (then it ends early)."""
MAX_BODY_BYTES = 8 << 20
"""Largest request body read (8 MiB; chunked bodies too); larger ones answer 413 before they are parsed."""
MAX_SEED = 2**63 - 1
"""Largest ``seed`` a request may give (torch seeds are 64-bit)."""


class TextPart(BaseModel):
    """One part of a message's content list (text only)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = "text"
    text: StrictStr


class ChatMessage(BaseModel):
    """One message of a chat request (text content, or a list of text parts)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart], None] = None


class ChatRequest(BaseModel):
    """The supported subset of an OpenAI chat-completions request (values checked as OpenAI does)."""

    model: Optional[StrictStr] = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    stop: Union[StrictStr, list[StrictStr], None] = Field(None, max_length=4)
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    seed: Optional[StrictInt] = Field(None, ge=0, le=MAX_SEED)


def _text(content: Union[str, list[TextPart], None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def context_window(model: Any, tokenizer: Any) -> Optional[int]:
    """Tokens the model can attend to: its config's position limit, else a sane tokenizer limit."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else None


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (a prompt longer than window x this cannot fit); 64 if unknown."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 — a tokenizer without a vocabulary listing
        return 64
    return max((len(t) for t in vocab), default=64) or 64


def not_utf8(messages: list[dict], stop: list[str]) -> Optional[str]:
    """Why a request's text cannot be encoded (a lone surrogate such as ``\\ud800``), or None."""
    texts = [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
    texts += [(f"stop[{i}]", t) for i, t in enumerate(stop)]
    for where, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{where}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character {e.start})"
    return None


class BodyLimit:
    """ASGI middleware: read at most ``limit`` bytes of any request body (``Content-Length`` or chunked);
    more answer 413 before the body is parsed (and before the rest is read)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = dict(scope.get("headers") or []).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limit):
            return await self.refuse(scope, receive, send, size.decode("latin-1"))
        body, more = [], True
        read = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, receive, send)  # the client went away
            body.append(message.get("body", b""))
            read += len(body[-1])
            more = message.get("more_body", False)
            if read > self.limit:
                return await self.refuse(scope, receive, send, f"more than {self.limit}")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: dict, receive: Any, send: Any, size: str) -> None:
        await _error(413, f"request body of {size} bytes; at most {self.limit} are read")(scope, receive, send)


def _set_time_limit(model: Any, seconds: float) -> None:
    """Make ``generate`` stop after ``seconds`` (``max_time`` of the generation configs in use)."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        config = getattr(m, "generation_config", None)
        if config is not None:
            config.max_time = seconds


def _first_error(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    e = errors[0]
    where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {e.get('msg', 'invalid value')}; got {e.get('input')!r:.80}{more}"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def check_limits(max_new_tokens: int, max_queue: int, request_timeout: float) -> None:
    """:class:`InputError` unless ``max_new_tokens >= 1``, ``max_queue >= 0`` and ``0 < request_timeout < inf``."""
    problems = [f"--max-new-tokens {max_new_tokens}: expected an integer >= 1"] if max_new_tokens < 1 else []
    if max_queue < 0:
        problems.append(f"--max-queue {max_queue}: expected an integer >= 0")
    if not 0 < request_timeout < float("inf"):
        problems.append(f"--request-timeout {request_timeout}: expected a positive number of seconds")
    if problems:
        raise InputError("; ".join(problems))


def build_app(model, tokenizer, model_name: str, chat_template: Optional[str] = None,
              max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE,
              request_timeout: float = DEFAULT_REQUEST_TIMEOUT, context_length: Optional[int] = None,
              prompt_style: str = "chat") -> FastAPI:
    """The FastAPI app serving ``model`` under the name ``model_name``.

    Args:
        model: a causal LM (plain or PEFT) in memory.
        tokenizer: its tokenizer (with a chat template unless ``chat_template`` is given).
        model_name: the id listed by ``/v1/models`` and accepted in requests.
        chat_template: FastChat conversation template name instead of the tokenizer's template.
        max_new_tokens_limit: cap on a completion's length.
        max_queue: requests that may wait while one generates (more answer 429).
        request_timeout: seconds a request may wait for its turn (then 503) and generate.
        context_length: the model's context window (default: from its config).
        prompt_style: how a conversation becomes the prompt: ``chat`` (the chat template), ``alpaca``
            (the Alpaca instruction template a run trained with) or ``plain``.

    Returns:
        The app; ``app.state.requests`` counts the completions served, ``app.state.rejected`` the 429
        answers, ``app.state.admitted`` the requests generating or waiting now.

    Raises:
        InputError: no chat template to render conversations with.
    """
    import torch

    from fedllm.evaluation.generation import generate_completions
    from fedllm.evaluation.prompt_styles import make_prompt_style

    if prompt_style == "chat" and not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template: pass a FastChat template name (--chat-template) "
                         "or --prompt-style alpaca|plain")
    check_limits(max_new_tokens_limit, max_queue, request_timeout)
    style = make_prompt_style(prompt_style, tokenizer, chat_template)
    window = context_length or context_window(model, tokenizer)
    longest = longest_token_chars(tokenizer)
    _set_time_limit(model, request_timeout)
    lock = threading.Lock()
    admitted = threading.BoundedSemaphore(max_queue + 1)  # the one generating + those waiting
    app = FastAPI(title="fedllm serve")
    app.state.requests = 0
    app.state.rejected = 0  # answered 429
    app.state.admitted = 0  # generating or waiting now
    created = int(time.time())

    @app.middleware("http")
    async def log_request(request: Request, call_next):
        started = time.monotonic()
        response = await call_next(request)
        print(request_log_line(request.method, request.url.path, response.status_code,
                               getattr(request.state, "usage", None), time.monotonic() - started),
              file=sys.stderr, flush=True)
        return response

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _first_error(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")

    @app.get("/v1/models")
    def list_models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "fedllm"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatRequest, request: Request):
        if req.model and req.model != model_name:
            return _error(404, f"model {req.model!r} not found; this server serves {model_name!r}", "not_found_error")
        if req.n != 1:
            return _error(400, "only n=1 is supported")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                    for m in req.messages]
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        bad = not_utf8(messages, stop)
        if bad:
            return _error(400, bad)
        stop += list(style.stop)  # the run's prompt style ends a turn where it trained to
        if not admitted.acquire(blocking=False):  # before any tokenizing: at most max_queue + 1 prompts in memory
            app.state.rejected += 1
            return _error(429, f"server busy: {max_queue} request(s) already waiting; retry later",
                          "rate_limit_error")
        app.state.admitted += 1
        try:
            try:
                prompt = style.render(messages)
            except (ValueError, ImportError) as e:
                return _error(400, str(e))
            limit = min(req.max_completion_tokens or req.max_tokens or max_new_tokens_limit, max_new_tokens_limit)
            if window is not None:
                if len(prompt) > window * longest:  # cannot fit whatever the tokenizer does: not tokenized
                    return _error(400, f"the prompt is {len(prompt)} characters; this model's context window is "
                                       f"{window} tokens (at most {window * longest} characters fit); shorten the "
                                       "conversation", "context_length_exceeded")
                prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
                if prompt_tokens >= window:
                    return _error(400, f"the prompt is {prompt_tokens} tokens; this model's context window is "
                                       f"{window} tokens (prompt + completion); shorten the conversation",
                                  "context_length_exceeded")
                limit = min(limit, window - prompt_tokens)
            if not lock.acquire(timeout=request_timeout):
                return _error(503, f"server busy: no turn within {request_timeout:g} s; retry later", "server_error")
            try:
                if req.seed is not None:
                    torch.manual_seed(req.seed)
                started = time.monotonic()
                comp = generate_completions(model, tokenizer, [prompt], limit, 1, progress=False, stop=stop,
                                            temperature=req.temperature, top_p=req.top_p)[0]
                if time.monotonic() - started >= request_timeout:
                    comp.finish_reason = "length"  # cut by the time limit
                app.state.requests += 1
            finally:
                lock.release()
        finally:
            app.state.admitted -= 1
            admitted.release()
        request.state.usage = (comp.prompt_tokens, comp.completion_tokens)
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
    parser.add_argument("--prompt-style", choices=["chat", "alpaca", "plain"], default=None,
                        help="how a conversation becomes the prompt (default: as the run was trained — alpaca for "
                             "instruction data with the Alpaca template — else chat, the tokenizer's chat template)")
    parser.add_argument("--chat-template", default=None,
                        help="FastChat conversation template (default: the tokenizer's chat template)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                        help="weights dtype (default: a run or checkpoint in its recipe's model.dtype, as it trained "
                             "and evaluated; fp32 for anything else)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="cap on a completion's length")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait while one generates; more answer 429 (default: 8)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds a request may wait for its turn (then 503) and generate (default: 120)")


def default_model_name(checkpoint: str) -> str:
    """The served model id: the run's name for a run directory or its ``final/`` (``RUN-round-0002`` for a
    round checkpoint), the directory's name for an export, the id itself for a hub id."""
    parts = [p for p in checkpoint.replace("\\", "/").rstrip("/").split("/") if p not in ("", ".")]
    local = Path(checkpoint).expanduser()
    if local.exists():
        parts = list(local.resolve().parts)
    if len(parts) >= 2 and parts[-1] == "final":
        return parts[-2]
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}-{parts[-1]}"
    if local.exists():
        return local.resolve().stem if local.is_file() else parts[-1]
    return "/".join(parts[-2:]) if parts else "model"


def request_log_line(method: str, path: str, status: int, usage: Optional[tuple[int, int]], seconds: float) -> str:
    """One line per request: ``POST /v1/chat/completions 200 prompt=12 completion=30 tokens 1.42 s``."""
    tokens = f"prompt={usage[0]} completion={usage[1]} tokens" if usage else "prompt=- completion=- tokens"
    return f"{method} {path} {status} {tokens} {seconds:.2f} s"


def bind(host: str, port: int) -> Any:
    """A listening socket on ``host:port`` (taken before the model loads, handed to the server).

    Raises:
        InputError: the address is in use or cannot be bound.
    """
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                         "pick another --port (or stop what uses it)") from None
    sock.listen(128)
    return sock


def run_prompt_style(checkpoint: str) -> str:
    """The prompt style the run behind ``checkpoint`` trained with (as ``fedllm eval`` picks it), else ``chat``.

    An export records it in its ``export.json``; a run directory or checkpoint in its ``recipe.yaml``.
    """
    from fedllm.commands.evaluate import find_run_recipe

    path = Path(checkpoint).expanduser()
    facts = path / "export.json"
    if facts.is_file():
        return json.loads(facts.read_text()).get("prompt_style") or "chat"
    recipe = find_run_recipe(checkpoint)
    if recipe is None:
        return "chat"
    from fedllm.evaluation.runner import prompt_style_for_data
    from fedllm.recipe.checks import load_recipe

    loaded = load_recipe(recipe)
    return prompt_style_for_data(loaded.data, loaded.eval) or "chat"


def run_serve_command(args: argparse.Namespace) -> int:
    """``fedllm serve``: load the checkpoint and serve it until interrupted; returns the exit code.

    The port is taken, and the limits checked, before the model loads, so a busy port is refused at once.

    Raises:
        InputError: a busy port, a path that does not exist, an unloadable checkpoint or no chat template
            (exit code 2 on the CLI).
    """
    from fedllm.common.errors import check_local_path

    check_limits(args.max_new_tokens, args.max_queue, args.request_timeout)
    check_local_path(args.checkpoint, "checkpoint")
    sock = bind(args.host, args.port)
    try:
        import uvicorn

        from fedllm.export.inference import load_for_inference

        style = args.prompt_style or run_prompt_style(args.checkpoint)
        model, tokenizer = load_for_inference(args.checkpoint, dtype=args.dtype)
        name = args.model_name or default_model_name(args.checkpoint)
        app = build_app(model, tokenizer, name, args.chat_template, args.max_new_tokens, args.max_queue,
                        args.request_timeout, prompt_style=style)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: serving on {args.host}: anyone who can reach it can use the model", file=sys.stderr)
        print(f"serving {name!r} at http://{args.host}:{sock.getsockname()[1]}/v1 (OpenAI-compatible, "
              f"{style} prompts; Ctrl-C stops)", flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
    return 0
