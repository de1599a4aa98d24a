"""A pytest plugin for tests/cli/test_interrupt.py's inner run: pytest-xdist's controller, once interrupted, waits
up to ``NodeManager.EXIT_TIMEOUT`` (10 s) for its workers before it kills them. Raised to 10 minutes here, a run
whose workers do not end hangs past the test's wait instead of ending 10 s late: the test checks that the run ends,
not a number of seconds a loaded machine may exceed."""

from xdist.workermanage import NodeManager

NodeManager.EXIT_TIMEOUT = 600
