"""Test-wide setup: without a CUDA GPU, Triton kernels run through the Triton interpreter on the CPU.

GPU-only tests carry ``@pytest.mark.gpu`` and are deselected by default (pytest.ini); run them on the H200
with ``python3 -m pytest -m gpu``. Selected on a machine without a CUDA GPU, they are skipped (with that reason),
not failed.

A run that selects no GPU test (README's command, pytest.ini's ``-m "not gpu"``) is the CPU suite on every machine,
CI's: on a GPU machine :func:`pytest_configure` hides CUDA (``CUDA_VISIBLE_DEVICES=""``) before anything initialises
it, so the tests see no GPU and Triton runs through its interpreter; where CUDA was initialised in the process before
(a plugin, an earlier conftest, ``pytest.main`` called after CUDA work) hiding cannot take, and the run stops with a
usage error saying so instead of running the CPU suite on the GPU. Many CPU tests hand CPU tensors to Triton kernels,
which compiled Triton refuses ("cannot be accessed from Triton (cpu tensor?)": 15 of tests/sampler/test_overflowing_z.py
and most of tests/sampler/triton on an H100, 2026-12-06). ``BLOCKDIFF_TEST_CUDA=1`` keeps CUDA visible for such a
run: the backend matrix's interpreter rows then run compiled on the GPU (e.g. ``BLOCKDIFF_TEST_CUDA=1 python3 -m
pytest tests/attention/test_backends_contract.py``), and tests that hand CPU tensors to Triton fail as above. A run
that selects GPU tests sees CUDA; run those apart from the CPU suite. TRITON_INTERPRET must be set before triton is
first imported, hence here, before collection imports any test module. pytest imports the conftest.py files on the way
to a path named on the command line (tests/integration/conftest.py for ``pytest tests/integration``) before
pytest_configure, so those must not import triton, directly or through vLLM (which imports it through
torch._inductor); where something did, :func:`pytest_configure` stops the run with a usage error naming the cause
instead of letting interpreted kernels fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
"""
import os
import sys

# One intra-op thread (torch's OpenMP, numpy's OpenBLAS, MKL) in each pytest-xdist worker unless set otherwise:
# README's command runs two workers on the 2-core CI machine, and two workers each with a pool of 2 threads would
# oversubscribe the cores (the Triton interpreter runs on one thread anyway; the tests' torch ops are small). The
# pools read these variables when numpy / torch load, hence before those imports; subprocesses that tests start
# inherit them. A single process (`python3 -m pytest`, the GPU runs) keeps the libraries' defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from run_mode import check_triton_interpreted, hide_cuda  # noqa: E402  (the rules; tests/test_conftest_run_mode.py)


def pytest_configure(config):
    """The run's device (module docstring): CUDA hidden for the CPU suite, then the interpreter where no CUDA is
    visible. Before collection, so before any test module imports Triton or initialises CUDA."""
    hide_cuda(config.option.markexpr, os.environ, torch.cuda.is_available)  # fails where CUDA is already up
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        check_triton_interpreted(os.environ, sys.modules)  # fails where triton was imported before, compiled

# Hypothesis: derandomized (fixed seeds) so CI is reproducible; no per-example deadline (the Triton
# interpreter is slow). Tests may still raise max_examples with their own @settings. derandomize implies no example
# database; Hypothesis still caches the constants it finds in the project's modules under .hypothesis/constants,
# written in place (truncate, then write): each pytest-xdist worker gets its own folder, so no worker reads a file
# the other is writing.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(
        os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY", ".hypothesis"), os.environ["PYTEST_XDIST_WORKER"])

from hypothesis import settings  # noqa: E402

settings.register_profile("blockdiff", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("blockdiff")


def pytest_collection_finish(session):
    """Freeze Hypothesis's pool of local constants once every test module is imported.

    Besides its seeded draws, Hypothesis sometimes draws a constant found in the project's imported modules, and it
    rescans ``sys.modules`` whenever a module was imported since: a fuzzer's examples then depend on what the tests
    before it imported in the same process, which under pytest-xdist (README's ``-n 2``) is decided by timing. Frozen
    after collection, the pool is the same in every worker and in a single-process run (the same test modules), so
    derandomized runs draw the same examples. Private API: without it (another Hypothesis), nothing is changed."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return
    get, cache = getattr(providers, "_get_local_constants", None), getattr(providers, "CONSTANTS_CACHE", None)
    if get is None or not hasattr(cache, "cache"):
        return
    frozen = get()
    cache.cache.clear()
    providers._get_local_constants = lambda: frozen


def pytest_collection_modifyitems(config, items):
    """``-m gpu`` on a machine without a CUDA GPU: skip the GPU tests instead of letting each fail."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (@pytest.mark.gpu); none is available here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
