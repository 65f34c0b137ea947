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



@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A test parametrised with ``backend`` set to a name of ``blockdiff.attention.BACKENDS`` that has no row in
    tests/attention/backend_matrix.py fails (in its call, so it reports FAILED, not a setup error), saying what to
    add: a registered backend is never silently untested."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("backend") if callspec is not None else None
    if isinstance(name, str):
        from backend_matrix import row  # beside this file (pytest puts the test folders on sys.path)
        from blockdiff.attention import BACKENDS
        if name in BACKENDS:
            row(name)
