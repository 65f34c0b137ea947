"""Fixtures shared by the attention tests."""
import pytest

from blockdiff.attention import debug_checks, set_debug_checks


@pytest.fixture
def debug_on():
    """The debug switch (every call runs the value checks) on for one test, then back as it was."""
    was = debug_checks()
    set_debug_checks(True)
    yield
    set_debug_checks(was)
