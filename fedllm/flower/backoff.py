"""Waits between polls that start short after something happened and double while nothing does.

A Flower deployment has no push from the SuperLink: the SuperNode asks it for messages and the ServerApp asks it
for replies. The next message of a round (a SecAgg+ stage, a reply to a message just pushed) usually comes within
a fraction of a second after the last one, and rarely during a long idle stretch, so both ask quickly right after
an event and then less and less often, down to a cap that bounds what an idle deployment spends on asking
(docs/flower.md, "Where the time goes").
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    """Sleeps of ``first`` seconds, doubling after each up to ``cap``; :meth:`reset` starts again at ``first``.

    ``sleep`` is injected (tests record the waits instead of sleeping).
    """

    def __init__(self, first: float, cap: float, sleep: Callable[[float], object] = time.sleep):
        if not 0 < first <= cap:
            raise ValueError(f"Backoff needs 0 < first <= cap, got first={first}, cap={cap}")
        self.first, self.cap, self.sleep = first, cap, sleep
        self.next_s = first

    def wait(self) -> float:
        """Sleep the current wait, double the next one (at most ``cap``); return the seconds slept."""
        seconds = self.next_s
        self.sleep(seconds)
        self.next_s = min(2 * seconds, self.cap)
        return seconds

    def reset(self) -> None:
        """Something happened: the next wait is ``first`` again."""
        self.next_s = self.first
