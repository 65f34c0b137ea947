"""Shared fixtures of the integration tests: a tiny random-weight DiffusionGemma and harness factories.

blockdiff.integration.harness is imported inside the fixture, not here: pytest imports this file before
tests/conftest.py's pytest_configure turns the Triton interpreter on (whenever a path under tests/integration is named
on the command line), and with vLLM importable the harness imports vLLM, which imports triton through
torch._inductor; triton imported before TRITON_INTERPRET=1 keeps its library functions compiled, and every interpreted
kernel calling them would fail ("Cannot call @triton.jit'd outside of the scope of a kernel"; tests/conftest.py now
stops such a run with a usage error instead). tests/test_conftest_run_mode.py checks it.
"""
from __future__ import annotations

import pytest
import torch
from integration_helpers import _MISSING, CL, params

from blockdiff.model import DiffusionGemma, tiny_config


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model's ops take microseconds; intra-op threads only add contention on a 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model():
    if _MISSING:
        pytest.skip(_MISSING)
    torch.manual_seed(1234)
    return DiffusionGemma(tiny_config(canvas_length=CL)).eval()


@pytest.fixture
def make_runner(tiny_model):
    from blockdiff.integration.harness import HarnessRunner

    def make(**kw):
        kw.setdefault("default_params", params())
        kw.setdefault("max_num_reqs", 4)
        kw.setdefault("max_num_batched_tokens", 4 * CL)
        kw.setdefault("page_size", 4)
        kw.setdefault("max_model_len", 160)
        return HarnessRunner(tiny_model, **kw)

    return make
