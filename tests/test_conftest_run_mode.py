"""tests/conftest.py's run mode: a run that selects no GPU test is the CPU suite on every machine (CUDA hidden, Triton
interpreted), so CPU tests that hand CPU tensors to Triton kernels do not fail on a GPU machine (they did on an H100,
2026-12-06: "cannot be accessed from Triton (cpu tensor?)")."""
import os
from types import SimpleNamespace as NS

import pytest
import torch

import run_mode as conftest


@pytest.mark.parametrize("markexpr,selects", [
    ("not gpu", False), ("gpu", True), ("", True), (None, True), ("gpu and not slow", True), ("slow", False),
    ("not gpu and not slow", False), ("gpu or not gpu", True),
])
def test_selects_gpu_tests_reads_the_mark_expression_as_pytest_does(markexpr, selects):
    assert conftest.selects_gpu_tests(markexpr) is selects


def test_the_cpu_suite_hides_cuda_unless_blockdiff_test_cuda_is_1():
    assert conftest.hides_cuda("not gpu", {})
    assert conftest.hides_cuda("not gpu", {conftest.KEEP_CUDA_ENV: "0"})
    assert not conftest.hides_cuda("not gpu", {conftest.KEEP_CUDA_ENV: "1"})
    assert not conftest.hides_cuda("gpu", {})


def test_this_cpu_suite_run_sees_no_cuda_and_interprets_triton(pytestconfig):
    if conftest.selects_gpu_tests(pytestconfig.option.markexpr) or os.environ.get(conftest.KEEP_CUDA_ENV) == "1":
        pytest.skip("this run selects GPU tests or keeps CUDA visible")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not torch.cuda.is_available()
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_hiding_cuda_after_cuda_was_initialised_fails_instead_of_running_on_the_gpu():
    """Unit: CUDA still available after CUDA_VISIBLE_DEVICES="" means it was initialised before; a usage error."""
    env = {}
    with pytest.raises(pytest.UsageError, match="already initialised.*BLOCKDIFF_TEST_CUDA=1"):
        conftest.hide_cuda("not gpu", env, lambda: True)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert conftest.hide_cuda("not gpu", {}, lambda: False)
    # nothing hidden, nothing checked: a GPU run, or BLOCKDIFF_TEST_CUDA=1
    assert not conftest.hide_cuda("gpu", {}, lambda: True)
    assert not conftest.hide_cuda("not gpu", {conftest.KEEP_CUDA_ENV: "1"}, lambda: True)


def test_a_cpu_suite_run_in_a_process_where_cuda_is_already_up_stops_with_the_reason(tmp_path):
    """End to end through tests/conftest.py: a plugin loaded before pytest_configure stands in for CUDA initialised
    early (torch.cuda.is_available() true whatever CUDA_VISIBLE_DEVICES now says): the run exits with a usage error
    naming the cause, not a CPU suite silently run on the GPU."""
    import subprocess
    import sys

    (tmp_path / "cuda_up_early.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop(conftest.KEEP_CUDA_ENV, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "cuda_up_early", "-p", "no:xdist", "-q",
                        os.path.join(here, "test_conftest_run_mode.py"), "-k", "selects_gpu_tests"],
                       cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "CUDA was already initialised" in r.stderr + r.stdout, r.stderr[-2000:]


def test_triton_imported_compiled_before_the_interpreter_is_a_usage_error_naming_the_cause():
    """Unit: triton's library imported while TRITON_INTERPRET was unset keeps compiled functions (``tl.max`` a
    ``JITFunction``): turning the interpreter on afterwards cannot take, so the run stops with the reason."""
    class JITFunction:  # the class name is what the check reads
        pass

    class InterpretedFunction:
        pass

    compiled = {"triton.language.standard": NS(max=JITFunction())}
    with pytest.raises(pytest.UsageError, match=r"already imported.*TRITON_INTERPRET=1 in the environment"):
        conftest.check_triton_interpreted({"TRITON_INTERPRET": "1"}, compiled)
    conftest.check_triton_interpreted({"TRITON_INTERPRET": "1"}, {})  # triton not imported yet: nothing to check
    interpreted = {"triton.language.standard": NS(max=InterpretedFunction())}
    conftest.check_triton_interpreted({"TRITON_INTERPRET": "1"}, interpreted)
    conftest.check_triton_interpreted({}, compiled)  # the interpreter off: compiled is what the run asked for
    conftest.check_triton_interpreted({"TRITON_INTERPRET": "0"}, compiled)
    for off in ("false", "no", "off", "2"):  # Triton compiles: compiled functions are what the run asked for
        conftest.check_triton_interpreted({"TRITON_INTERPRET": off}, compiled)
    with pytest.raises(pytest.UsageError):
        conftest.check_triton_interpreted({"TRITON_INTERPRET": "True"}, compiled)


def test_run_mode_reads_triton_interpret_as_the_library_and_triton_do():
    """run_mode's copy of the interpreter-on values (it runs before blockdiff is importable) equals the library's
    (blockdiff.attention.env, itself checked against Triton's knobs); "false" used to count as on here."""
    from blockdiff.attention.env import TRITON_INTERPRET_ON
    from blockdiff.sampler.triton.common import TRITON_INTERPRET_ON as SAMPLER_ON

    assert conftest.TRITON_INTERPRET_ON == TRITON_INTERPRET_ON == SAMPLER_ON


def _pytest_subprocess(tmp_path, *args):
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for var in ("TRITON_INTERPRET", conftest.KEEP_CUDA_ENV):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", *args],
                          cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is turned on only where no CUDA is visible")
def test_a_run_naming_tests_integration_keeps_triton_interpreted_where_vllm_imports_triton(tmp_path):
    """End to end: with vLLM importable, importing blockdiff.integration.harness imports vLLM, which imports triton
    (vLLM 0.26.0 / 0.33.0 through torch._inductor). tests/integration/conftest.py, which pytest imports before
    pytest_configure when a path under tests/integration is named, must not do that at its top: a stand-in ``vllm``
    that imports triton on import, and the Triton-sampler harness test passes (it failed with "Cannot call
    @triton.jit'd outside of the scope of a kernel" in the CPU vLLM environment, 2026-12-06)."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import triton.language  # as vLLM's import does\n")
    r = _pytest_subprocess(tmp_path, "tests/integration/test_triton_backends.py", "-k", "reference-triton")
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-2000:])
    assert "1 passed" in r.stdout, r.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is turned on only where no CUDA is visible")
def test_a_cpu_suite_run_where_triton_was_imported_before_the_interpreter_stops_with_the_reason(tmp_path):
    """End to end through tests/conftest.py: a plugin that imports triton before pytest_configure (with
    TRITON_INTERPRET unset) stands in for any early import: a usage error naming the cause, not failing kernels."""
    (tmp_path / "triton_early.py").write_text("import triton.language\n")
    r = _pytest_subprocess(tmp_path, "-p", "triton_early", "tests/test_conftest_run_mode.py", "-k", "selects_gpu_tests")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "triton was already imported" in r.stderr + r.stdout, r.stderr[-2000:]
