"""A test waiting on a child in this process group (tests/cli/test_interrupt.py)."""

from sleepers import waits_on_a_child


def test_child_in_the_same_group():
    waits_on_a_child(session=False)
