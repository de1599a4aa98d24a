"""The LLM judge: any OpenAI-compatible chat-completions endpoint, at the protocol's temperature.

FastChat's protocols (MT-Bench, Vicuna ``fastchat``) ask at temperature 0,
OpenFedLLM's Vicuna and FedLLM-Bench's Ref-GPT4 at 0.2; every request may give up
to 2048 reply tokens (all three references).

Requests run with bounded concurrency, are retried with exponential backoff on
connection errors, timeouts, rate limits and server errors, and every reply is
cached on disk (:class:`JudgmentCache`), so an interrupted evaluation resumes
without asking again. The API key is read from an environment variable at the
moment the client is built and never logged, cached or written.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Optional, Sequence

from tqdm.auto import tqdm

from fedllm.common.errors import InputError
from fedllm.evaluation.judge_cache import JudgmentCache, judgment_key
from fedllm.recipe.schema import JudgeConfig

log = logging.getLogger(__name__)

Complete = Callable[..., str]
"""A judge completion function: chat messages -> reply text. It may also take the request's
``temperature`` and ``max_tokens`` as keyword arguments (then it is given them)."""

DEFAULT_MAX_TOKENS = 2048
"""Reply limit of a judgment (FastChat's)."""

_LOCAL_HOSTS = ("127.", "localhost", "[::1]", "0.0.0.0")


class JudgeError(RuntimeError):
    """The judge did not answer after all retries."""


class JudgeConfigError(InputError):
    """The judge is not configured: no endpoint key or no model name."""


def judge_base_url(cfg: JudgeConfig) -> Optional[str]:
    """The endpoint: the config's, else ``$FEDLLM_JUDGE_BASE_URL``, else ``$OPENAI_BASE_URL``, else OpenAI's."""
    return cfg.base_url or os.environ.get("FEDLLM_JUDGE_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or None


def _is_local(url: Optional[str]) -> bool:
    host = (url or "").split("://", 1)[-1]
    return host.startswith(_LOCAL_HOSTS)


def is_retryable(error: BaseException) -> bool:
    """Whether a failed request is worth repeating (network, timeout, 408/409/429, 5xx)."""
    import openai

    if isinstance(error, (openai.APIConnectionError, ConnectionError, TimeoutError)):
        return True
    if isinstance(error, openai.APIStatusError):
        return error.status_code in (408, 409, 429) or error.status_code >= 500
    return False


def openai_complete(cfg: JudgeConfig, max_tokens: int = DEFAULT_MAX_TOKENS,
                    timeout: float = 600.0) -> tuple[str, Complete]:
    """A completion function talking to the configured endpoint with the ``openai`` client.

    The model is the config's, else ``$FEDLLM_JUDGE_MODEL``, else the only model the
    endpoint lists. The key comes from ``$<cfg.api_key_env>``; a local endpoint may
    go without one.

    Returns:
        ``(model name, complete)``.

    Raises:
        JudgeConfigError: no key for a remote endpoint, or no model name to be found.
    """
    import openai

    base_url = judge_base_url(cfg)
    key = os.environ.get(cfg.api_key_env)
    if not key:
        if base_url is None or not _is_local(base_url):
            where = base_url or "the OpenAI API"
            raise JudgeConfigError(f"no judge API key for {where}: set the environment variable ${cfg.api_key_env} "
                             "(or name another one with --judge-api-key-env)")
        key = "EMPTY"
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout)
    model = cfg.model or os.environ.get("FEDLLM_JUDGE_MODEL")
    if not model:
        try:
            served = [m.id for m in client.models.list()] if base_url else []
        except openai.APIError as e:
            raise JudgeError(f"could not list the models of {base_url}: {type(e).__name__}: {e}") from e
        if len(served) != 1:
            raise JudgeConfigError("no judge model: pass --judge-model (eval.judge.model) or set $FEDLLM_JUDGE_MODEL"
                             + (f"; the endpoint serves {served}" if served else ""))
        model = served[0]

    def complete(messages: list[dict], temperature: float = 0.0, max_tokens: int = max_tokens) -> str:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                               max_tokens=max_tokens)
        return reply.choices[0].message.content or ""

    return model, complete


def _takes_params(complete: Complete) -> bool:
    """Whether a completion function accepts ``temperature`` and ``max_tokens`` keywords."""
    try:
        params = inspect.signature(complete).parameters
    except (TypeError, ValueError):
        return False
    return all(k in params for k in ("temperature", "max_tokens")) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class JudgeClient:
    """Asks the judge many questions at once, through the cache, with retries.

    Args:
        cfg: the judge section of the recipe (concurrency, retries, endpoint).
        cache: reply cache (on disk for resumable runs).
        complete: the completion function; default: :func:`openai_complete` of ``cfg``.
        model: judge model name (cache keys and records); required with ``complete``.
        max_tokens: reply limit.
        progress: show a progress bar.
        sleep: the sleep function of the backoff (tests pass a fake).

    Attributes:
        model: the judge model's name.
        requests: requests sent so far (retries included; cached replies are not sent).
    """

    def __init__(self, cfg: JudgeConfig, cache: Optional[JudgmentCache] = None, complete: Optional[Complete] = None,
                 model: Optional[str] = None, max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = True,
                 sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.cache = cache if cache is not None else JudgmentCache()
        self.max_tokens = max_tokens
        self.progress = progress
        self.sleep = sleep
        if complete is None:
            model, complete = openai_complete(cfg, max_tokens)
        self.model = model or "judge"
        self._complete = complete
        self._takes_params = _takes_params(complete)
        self._lock = threading.Lock()
        self.requests = 0

    def _params(self, temperature: float) -> dict:
        return {"temperature": float(temperature), "max_tokens": self.max_tokens}

    def _ask(self, messages: list[dict], params: dict) -> str:
        attempts = max(0, self.cfg.max_retries) + 1
        attempt = 0
        while True:
            attempt += 1
            with self._lock:
                self.requests += 1
            try:
                return self._complete(messages, **params) if self._takes_params else self._complete(messages)
            except Exception as e:  # noqa: BLE001  (filtered by is_retryable)
                if attempt >= attempts or not is_retryable(e):
                    raise JudgeError(f"judge request failed after {attempt} attempt(s): "
                                     f"{type(e).__name__}: {e}") from e
                delay = min(60.0, 2.0 ** (attempt - 1)) * (0.5 + random.random())
                log.warning("judge request failed (%s); retrying in %.1f s", type(e).__name__, delay)
                self.sleep(delay)

    def judge_many(self, requests: Sequence[list[dict]], desc: str = "judge", temperature: float = 0.0) -> list[str]:
        """Replies to every request (chat messages), in order; cached ones are not asked again.

        Args:
            requests: chat messages per request.
            desc: progress bar label.
            temperature: the judge's sampling temperature (part of the cache key).

        Raises:
            JudgeError: a request failed after all retries (replies received so far stay cached).
        """
        params = self._params(temperature)
        keys = [judgment_key(self.model, list(m), params) for m in requests]
        replies: list[Optional[str]] = [self.cache.get(k) for k in keys]
        todo = [i for i, r in enumerate(replies) if r is None]
        if not todo:
            return replies  # type: ignore[return-value]
        bar = tqdm(total=len(todo), desc=desc, disable=not self.progress, leave=False)
        with ThreadPoolExecutor(max_workers=max(1, self.cfg.concurrency)) as pool:
            futures = {pool.submit(self._ask, list(requests[i]), params): i for i in todo}
            try:
                for fut in as_completed(futures):
                    i = futures[fut]
                    replies[i] = fut.result()
                    self.cache.put(keys[i], self.model, replies[i])
                    bar.update(1)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
            finally:
                bar.close()
        return replies  # type: ignore[return-value]
