"""Credentials never reach a file fedllm writes or a message it prints: redaction by rule, not by list.

Rules, applied to every string fedllm writes (``recipe.yaml`` of the run and of each checkpoint,
``partition.json``, ``metrics.jsonl``, ``summary.json``, model cards and ``export.json``, the recipe
given to experiment trackers) and prints (CLI errors, log lines through the CLI's handlers, the
Ctrl-C resume hint):

1. **Every URL** (``scheme://...``) keeps its scheme, host, port and path; its userinfo, every query
   value and its fragment become ``***``:
   ``https://me:pw@h.example/v1?model=x&X-Goog-Signature=s#access_token=t`` ->
   ``https://***@h.example/v1?model=***&X-Goog-Signature=***#***``.
2. **Secret-named keys** outside URLs: a name ending in ``password``, ``passwd``, ``pwd``, ``secret``,
   ``token``, ``api_key``/``apikey``, ``access_key``, ``secret_key``, ``private_key`` (and the like),
   ``signature``, ``credential``,
   ``cookie`` or ``auth``/``authorization`` followed by ``=`` or ``:`` has its value masked
   (``private_token=abc``, ``"password": "pw"``, ``Authorization: Bearer abc``, ``X-Api-Key: k``);
   in a mapping, such a key's value is masked whatever it holds. Tokenizer names (``pad_token``,
   ``eos_token`` ...) are not secrets.

The run uses the values as given; API keys are read only from the environment
(``eval.judge.api_key_env``), never from a recipe. Not covered: a secret in free text with no
URL and no secret-named key before it (nothing marks it as one).
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"

_STOP = r"\s'\"<>`"
_URL = re.compile(rf"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#{_STOP}]*)(?P<path>[^?#{_STOP}]*)"
                  rf"(?:\?(?P<query>[^#{_STOP}]*))?(?:#(?P<fragment>[^{_STOP}]*))?")
_SECRET_NAME = (r"[A-Za-z0-9_.-]*?(?:password|passwd|pwd|secret|token|apikey|"
                r"(?:api|access|secret|private|client|signing|master|encryption|account)[_-]?key|"
                r"signature|credentials?|cookie|auth|authorization)")
_NOT_SECRET = re.compile(r"(?i)^(?:.*[_-])?(?:pad|eos|bos|unk|sep|cls|mask|additional_special|chat)[_-]?tokens?$")
_SECRET_PAIR = re.compile(
    rf"(?i)(?<![A-Za-z0-9_.-])(?P<name>{_SECRET_NAME})(?![A-Za-z0-9_-])(?P<sep>[\"']?\s*[=:]\s*[\"']?)"
    rf"(?P<value>(?:(?:bearer|basic|token|digest)\s+)?[^\s\"'&,;}}\]]+)")


def _mask_url(m: re.Match) -> str:
    authority = m["authority"]
    if "@" in authority:
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    out = f"{m['scheme']}{authority}{m['path']}"
    if m["query"] is not None:
        parts = re.split(r"([&;])", m["query"])
        out += "?" + "".join(p if p in ("&", ";") or not p else
                             (f"{p.split('=', 1)[0]}={MASK}" if "=" in p else MASK) for p in parts)
    if m["fragment"] is not None:
        out += f"#{MASK}" if m["fragment"] else "#"
    return out


def _mask_pair(m: re.Match) -> str:
    if _NOT_SECRET.match(m["name"]) or m["value"] == MASK or m["value"].startswith(f"{MASK}@"):
        return m.group(0)
    return f"{m['name']}{m['sep']}{MASK}"


def is_secret_name(name: str) -> bool:
    """Whether a mapping key names a secret (its value is masked whatever it is)."""
    return bool(re.fullmatch(rf"(?i){_SECRET_NAME}", name)) and not _NOT_SECRET.match(name)


def redact_text(text: str) -> str:
    """``text`` with every URL's userinfo, query values and fragment, and every secret-named value, masked."""
    return _SECRET_PAIR.sub(_mask_pair, _URL.sub(_mask_url, text))


def has_credentials(text: str) -> bool:
    """Whether :func:`redact_text` would change ``text``."""
    return redact_text(text) != text


def redact(value: Any) -> Any:
    """``value`` with every string inside it (dicts, lists, tuples) passed through :func:`redact_text`, and
    the value of every secret-named mapping key masked."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: MASK if isinstance(k, str) and is_secret_name(k) and value_is_set(v) else redact(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def value_is_set(value: Any) -> bool:
    """A value worth masking (not None, not empty, not a bool)."""
    return value not in (None, "", [], {}) and not isinstance(value, bool)


class RedactingFilter(logging.Filter):
    """A handler filter that redacts the formatted message of every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True
