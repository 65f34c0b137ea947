"""blockdiff.integration: vLLM model runner v2 hooks for block-diffusion LMs, and a harness that replays them.

* :class:`DiffusionModelState` (``model_state``): the ModelState hooks (subclasses vLLM's ModelState when vLLM
  is importable);
* :class:`DiffusionSampler` (``sampler``): what ``custom_sampler`` returns, with no rejection sampler;
* :class:`HarnessRunner` (``harness``): model runner v2's call order without vLLM, for tests and the demo;
* ``blockdiff demo`` (``cli`` / ``demo``) and the vLLM general plugin (``vllm_plugin.register``).

Semantics: ARCHITECTURE.md "Integration" and "Sampler semantics".
"""
from __future__ import annotations

__all__ = ["DiffusionModelState", "DiffusionSampler", "HarnessRunner"]


def __getattr__(name):  # lazy: importing the package does not import torch-heavy modules or vLLM
    if name == "DiffusionModelState":
        from .model_state import DiffusionModelState

        return DiffusionModelState
    if name == "DiffusionSampler":
        from .sampler import DiffusionSampler

        return DiffusionSampler
    if name == "HarnessRunner":
        from .harness import HarnessRunner

        return HarnessRunner
    raise AttributeError(name)
