"""Test-wide setup: without a CUDA GPU, Triton kernels run through the Triton interpreter on the CPU.

TRITON_INTERPRET must be set before triton is first imported, hence here (pytest loads this file first).
GPU-only tests carry ``@pytest.mark.gpu`` and are deselected by default (pytest.ini); run them on the H200
with ``python3 -m pytest -m gpu``. Selected on a machine without a CUDA GPU, they are skipped (with that reason),
not failed.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis: derandomized (fixed seeds) so CI is reproducible; no per-example deadline (the Triton
# interpreter is slow). Tests may still raise max_examples with their own @settings.
from hypothesis import settings  # noqa: E402

settings.register_profile("blockdiff", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("blockdiff")


def pytest_collection_modifyitems(config, items):
    """``-m gpu`` on a machine without a CUDA GPU: skip the GPU tests instead of letting each fail."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (@pytest.mark.gpu); none is available here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
