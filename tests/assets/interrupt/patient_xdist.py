"""A pytest plugin for tests/cli/test_interrupt.py's inner run: pytest-xdist's controller, once interrupted, waits
up to ``NodeManager.EXIT_TIMEOUT`` (10 s) for its workers before it kills them. Raised to 10 minutes here, a run
whose workers do not end would hang past the test's wait instead of ending 10 s late, so the test tells a run that
ended from one xdist's timeout ended by whether it ends at all, not by a number of seconds a loaded machine may
exceed."""

from xdist.workermanage import NodeManager

NodeManager.EXIT_TIMEOUT = 600
