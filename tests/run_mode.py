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


#: pytest_configure's error where turning the Triton interpreter on came too late: triton was imported before.
TRITON_IMPORTED_BEFORE_INTERPRETER = (
    "tests/conftest.py: no CUDA is visible, so this run turns the Triton interpreter on (TRITON_INTERPRET=1) in "
    "pytest_configure, but triton was already imported in this process without it, so its library functions "
    "(tl.max, ...) stay compiled and every interpreted kernel calling them would fail with \"Cannot call "
    "@triton.jit'd outside of the scope of a kernel\". Something imported before pytest_configure imported triton: a "
    "conftest.py on the way to a path named on the command line (pytest imports those first; keep imports that can "
    "reach vLLM, which imports triton through torch._inductor, inside fixtures, as tests/integration/conftest.py "
    "does) or a plugin. Set TRITON_INTERPRET=1 in the environment to run anyway.")


#: ``TRITON_INTERPRET`` values (lower-cased) that turn Triton's interpreter on: Triton's reading, the tuple of
#: ``blockdiff.attention.env.TRITON_INTERPRET_ON`` (this module runs before blockdiff or triton may be imported;
#: tests/test_conftest_run_mode.py checks the two agree).
TRITON_INTERPRET_ON = ("1", "true", "yes", "on", "y")


def check_triton_interpreted(env, modules) -> None:
    """Where ``env`` turns the Triton interpreter on (``TRITON_INTERPRET`` in :data:`TRITON_INTERPRET_ON`, as
    Triton reads it), check that triton's
    library was not imported before with it off: triton chooses interpreted or compiled functions when a
    ``@triton.jit`` decorator runs, so ``triton.language.standard``'s functions (``tl.max``, ``tl.sum``, ...) keep
    the mode of the environment at triton's import. ``modules``: ``sys.modules``.

    Raises:
        pytest.UsageError: :data:`TRITON_IMPORTED_BEFORE_INTERPRETER`.
    """
    if env.get("TRITON_INTERPRET", "").lower() not in TRITON_INTERPRET_ON:
        return
    standard = modules.get("triton.language.standard")
    if standard is not None and type(getattr(standard, "max", None)).__name__ == "JITFunction":
        import pytest
        raise pytest.UsageError(TRITON_IMPORTED_BEFORE_INTERPRETER)
