"""A SuperNode waits for its SuperLink: ``fedllm flower supernode`` starts Flower's SuperNode once the SuperLink takes
nodes, not before.

Started before the SuperLink (README's commands typed in any order), or while a starting SuperLink still registers
its node keys (a ``flwr`` process per key: 18 s for four at load 6 on 2 cores, longer on a busier machine), Flower's
SuperNode was refused ("Failed to activate SuperNode") and gave up. So the command first asks the SuperLink's
:data:`~fedllm.flower.superlink.READY_PATH` (fedllm's SuperLink answers it for any peer: 200 once its node keys are
registered, 503 and what it waits for before) every second, saying every :data:`SAY_EVERY_S` what it waits for, for
up to ``--wait-superlink`` seconds. A SuperLink that answers otherwise (not fedllm's, or another protocol or
certificate than the node's) counts as there: Flower's SuperNode then reports what is wrong itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SAY_EVERY_S = 15.0
"""How often a waiting node says again what it waits for (and at once when that changes)."""
NOT_ANSWERING = "nothing answers there yet (not started, or unreachable)"


def ready_url(address: str, root_certificates: str | None) -> str:
    from fedllm.flower.superlink import READY_PATH

    return f"{'https' if root_certificates else 'http'}://{address}{READY_PATH}"


def verify(root_certificates: str | None):
    """The TLS check of a request to the SuperLink: its certificate signed by ``root_certificates`` (else no TLS)."""
    import ssl

    return ssl.create_default_context(cafile=root_certificates) if root_certificates else False


def asks(address: str, root_certificates: str | None, timeout_s: float = 5.0) -> str | None:
    """What the SuperLink at ``address`` (HOST:PORT) is still waiting for before it takes nodes; None when it takes
    them (or answers in a way only Flower's SuperNode can judge)."""
    import httpx

    try:
        with httpx.Client(verify=verify(root_certificates), timeout=timeout_s) as client:
            response = client.get(ready_url(address, root_certificates))
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        text = str(e).lower()
        if any(word in text for word in ("ssl", "certificate", "tls", "wrong version")):
            return None  # something answers, with another certificate or protocol: Flower's SuperNode says what
        return NOT_ANSWERING
    except httpx.HTTPError:
        return None
    if response.status_code == 503:
        try:
            return str(response.json().get("waiting") or "not ready yet")
        except ValueError:
            return "not ready yet (503)"
    return None


def wait_for_superlink(address: str, root_certificates: str | None, wait_s: float, say: Callable[[str], None],
                       ask: Callable[[], str | None] | None = None, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], object] = time.sleep, every_s: float = 1.0) -> bool:
    """Ask the SuperLink at ``address`` every ``every_s`` until it takes nodes (True) or ``wait_s`` have passed
    (False, said); ``say(line)`` reports what it waits for."""
    ask = ask or (lambda: asks(address, root_certificates))
    start = clock()
    said, said_at = None, -float("inf")
    while True:
        waiting = ask()
        if waiting is None:
            if said is not None:
                say(f"the SuperLink at {address} takes nodes now (after {clock() - start:.0f} s)")
            return True
        left = wait_s - (clock() - start)
        if left <= 0:
            say(f"the SuperLink at {address} did not take nodes within {wait_s:.0f} s (--wait-superlink): {waiting}; "
                "giving up")
            return False
        if waiting != said or clock() - said_at >= SAY_EVERY_S:
            say(f"waiting for the SuperLink at {address}: {waiting}; for up to {left:.0f} s more (--wait-superlink)")
            said, said_at = waiting, clock()
        sleep(min(every_s, left))


PREVIOUS_SESSION = ("the SuperLink still counts this key's previous session online (a node killed without signing "
                    "off?) until its heartbeats time out (Flower: 2 x 30 s)")
REFUSALS = {
    "online": PREVIOUS_SESSION,
    "offline": PREVIOUS_SESSION,  # offline by the time it was asked: its heartbeats have just timed out
    "unknown": "the SuperLink does not know this node's key (unregistered with flwr supernode unregister, or a "
               "SuperLink restarted without its --database: fedllm flower superlink registers DIR/nodes/client-K.pub "
               "as it starts)",
}
"""Why a SuperLink refused to activate a node, by the key's status there (:func:`key_status`)."""


def key_status(address: str, root_certificates: str | None, key: bytes, timeout_s: float = 5.0) -> str:
    """The status of node key ``key`` in the SuperLink at ``address`` (``online``, ``unknown``, ...; empty when it
    cannot tell: not fedllm's SuperLink, or not answering)."""
    import httpx

    try:
        with httpx.Client(verify=verify(root_certificates), timeout=timeout_s) as client:
            response = client.get(ready_url(address, root_certificates), params={"key": key.hex()})
        return str(response.json().get("key", "")) if response.status_code == 200 else ""
    except (httpx.HTTPError, ValueError):
        return ""


def refusal_cause(status: str) -> str:
    """Why the SuperLink refused to activate a node whose key has ``status`` there."""
    return REFUSALS.get(status) or ("the SuperLink refused to activate it (its key's status there: "
                                    f"{status or 'not told'}; a previous session still counted online, or a key it "
                                    "does not know)")
