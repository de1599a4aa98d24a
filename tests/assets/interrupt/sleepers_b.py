"""A test waiting on a child in a session of its own (tests/cli/test_interrupt.py)."""

from sleepers import waits_on_a_child


def test_child_in_its_own_session():
    waits_on_a_child(session=True)
