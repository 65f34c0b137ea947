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
