"""tests/conftest.py's run mode: a run that selects no GPU test is the CPU suite on every machine (CUDA hidden, Triton
interpreted), so CPU tests that hand CPU tensors to Triton kernels do not fail on a GPU machine (they did on an H100,
2026-12-06: "cannot be accessed from Triton (cpu tensor?)")."""
import os

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
