"""The test run's device rule of tests/conftest.py (its docstring says why): a run that selects no GPU test is the
CPU suite on every machine. A module of its own so tests can import it (``conftest`` names several modules)."""
from __future__ import annotations

#: ``BLOCKDIFF_TEST_CUDA=1``: a run that selects no GPU test keeps CUDA visible (module docstring).
KEEP_CUDA_ENV = "BLOCKDIFF_TEST_CUDA"


def selects_gpu_tests(markexpr: str | None) -> bool:
    """Whether ``-m``'s expression keeps a test marked only ``gpu`` (pytest's own evaluator; no expression: yes)."""
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression
    return bool(Expression.compile(markexpr).evaluate(lambda name, **kw: name == "gpu"))


def hides_cuda(markexpr: str | None, env) -> bool:
    """Whether this run hides CUDA: it selects no GPU test and ``BLOCKDIFF_TEST_CUDA`` is not ``1``."""
    return not selects_gpu_tests(markexpr) and env.get(KEEP_CUDA_ENV, "") != "1"


#: pytest_configure's error where hiding CUDA came too late: CUDA was initialised in this process before it.
CUDA_ALREADY_INITIALISED = (
    "tests/conftest.py: this run selects no GPU test, so it hides CUDA (CUDA_VISIBLE_DEVICES=\"\") to run the CPU "
    "suite, but CUDA was already initialised in this process before pytest_configure (a plugin, a conftest.py loaded "
    "before it, or code that called pytest.main after using CUDA), so the GPU stays visible and CPU tests that hand "
    "CPU tensors to Triton kernels would fail. Start pytest in a fresh process, or set {env}=1 to keep CUDA visible "
    "on purpose.").format(env=KEEP_CUDA_ENV)


def hide_cuda(markexpr: str | None, env, cuda_available) -> bool:
    """Hide CUDA in ``env`` when :func:`hides_cuda` says so and check it took: ``cuda_available()`` (torch's
    ``torch.cuda.is_available``) still true means CUDA was initialised before, and the run would silently not be the
    CPU suite. Returns whether CUDA was hidden.

    Raises:
        pytest.UsageError: :data:`CUDA_ALREADY_INITIALISED`.
    """
    if not hides_cuda(markexpr, env):
        return False
    env["CUDA_VISIBLE_DEVICES"] = ""
    if cuda_available():
        import pytest
        raise pytest.UsageError(CUDA_ALREADY_INITIALISED)
    return True
