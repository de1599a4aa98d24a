"""A pytest plugin for tests/cli/test_interrupt.py's inner run: pytest-xdist's controller, once interrupted, waits
up to ``NodeManager.EXIT_TIMEOUT`` (10 s) for its workers before it kills them. Raised to 10 minutes here, a run that
relied on that kill would hang for minutes instead of ending 10 s late, so the test tells "stopped by the hooks"
from "stopped by xdist's timeout" by whether the run ends at all, not by a number of seconds a loaded machine may
exceed."""

from xdist.workermanage import NodeManager

NodeManager.EXIT_TIMEOUT = 600
