"""Helpers of the integration tests (imported by conftest.py and the test modules)."""
from __future__ import annotations

import pytest
import torch

try:
    from blockdiff.sampler import SamplerState, SamplingParams, sampler_step  # noqa: F401
    from blockdiff.model import DiffusionGemma, tiny_config  # noqa: F401

    _MISSING = None
except ImportError as e:  # the sampler / model packages land separately
    _MISSING = f"blockdiff.sampler / blockdiff.model API not available yet: {e}"

needs_stack = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

CL = 8  # canvas length used by the harness tests (small: fast on 2 CPU cores)


def params(**kw):
    base = dict(canvas_length=CL, max_denoising_steps=3, seed=7)
    base.update(kw)
    return SamplingParams(**base)


def prompt(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
