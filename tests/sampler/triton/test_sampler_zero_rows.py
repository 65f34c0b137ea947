"""Regression (first vLLM serve on the H200): resolving the sampler's launch config for zero canvas rows divided
by zero in the split-K choice (0 tiles -> 0 / 0), which killed vLLM's engine start during its memory profile."""
import types

import torch

from blockdiff.sampler.triton import config as cfg_mod
from blockdiff.sampler.triton.config import SamplerConfig


def test_resolving_the_config_for_zero_rows_on_a_gpu_does_not_divide_by_zero(monkeypatch):
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(cfg_mod.torch.cuda, "get_device_properties", lambda device: props)
    for rows, hidden in ((0, 1), (0, 2816), (256, 1)):
        out = SamplerConfig().resolve(rows, 262144, hidden, torch.device("cuda", 0))
        assert out.split_k >= 1
