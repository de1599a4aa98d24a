"""`fedllm serve`: one log line per request (status, tokens, seconds); the served id is the run's name."""

import io
import re
import sys

import openai
import pytest
from evalkit import LoopbackServer

from fedllm.commands.serve import build_app, default_model_name, request_log_line


def test_one_line_per_request_with_status_and_tokens(tiny_lm, tokenizer, monkeypatch):
    err = io.StringIO()  # the server thread prints to sys.stderr
    monkeypatch.setattr(sys, "stderr", err)
    app = build_app(tiny_lm, tokenizer, "tiny", max_new_tokens_limit=8)
    with LoopbackServer(app) as server, openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                                      timeout=30) as client:
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "3 + 4?"}],
                                               temperature=0, max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    lines = [x for x in err.getvalue().splitlines() if "/v1/chat/completions" in x]
    assert len(lines) == 2
    ok = re.fullmatch(r"POST /v1/chat/completions 200 prompt=(\d+) completion=(\d+) tokens (\d+\.\d\d) s", lines[0])
    assert ok and (int(ok[1]), int(ok[2])) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert re.fullmatch(r"POST /v1/chat/completions 404 prompt=- completion=- tokens \d+\.\d\d s", lines[1])


def test_request_log_line_format():
    assert request_log_line("POST", "/v1/chat/completions", 200, (12, 30), 1.4249) == \
        "POST /v1/chat/completions 200 prompt=12 completion=30 tokens 1.42 s"


def test_served_id_is_the_run_name(tmp_path):
    run = tmp_path / "runs" / "quickstart"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "round-0002").mkdir(parents=True)
    assert default_model_name(str(run)) == "quickstart"
    assert default_model_name(str(run / "final")) == "quickstart"
    assert default_model_name(str(run / "checkpoints" / "round-0002")) == "quickstart-round-0002"
    assert default_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_loopback_server_leaves_the_process_log_handlers_alone():
    """uvicorn's default log config (logging.config.dictConfig) closes every logging handler of the process, and
    absl's handler then closes its stream: in the full suite that stream was pytest's capture file, and a test that
    swapped sys.stderr (this file's first) broke every later test of its worker. The test servers configure none."""
    from absl.logging import PythonHandler
    from starlette.applications import Starlette

    stream = io.StringIO()
    handler = PythonHandler(stream)  # as absl makes it at import: on the sys.stderr of that moment
    try:
        with LoopbackServer(Starlette()):
            pass
        assert not stream.closed
    finally:
        handler.close()
