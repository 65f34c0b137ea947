"""blockdiff.integration: vLLM model runner v2 hooks for block-diffusion LMs, and a harness that replays them.

* :class:`DiffusionModelState` (``model_state``): the ModelState hooks (subclasses vLLM's ModelState when vLLM
  is importable);
* :class:`DiffusionSampler` (``sampler``): what ``custom_sampler`` returns, with no rejection sampler;
* :class:`HarnessRunner` (``harness``): model runner v2's call order without vLLM, for tests and the demo;
* :func:`~blockdiff.integration.evaluate.evaluate_generation` (``evaluate``): held-out prompts served through the
  harness (``blockdiff train``'s evaluation);
* ``blockdiff demo`` / ``train`` / ``export`` (``cli`` / ``demo``) and the vLLM general plugin
  (``vllm_plugin.register``).

Semantics: docs/ARCHITECTURE.md "Integration and vLLM accounting" and "Sampler semantics".
"""
from __future__ import annotations

__all__ = ["DiffusionModelState", "DiffusionSampler", "HarnessRunner"]


# Lazy (PEP 562), on purpose: the `blockdiff` console script and vLLM's plugin loader import this package first;
# the CLI reports argument errors before torch is imported, and loading the plugin must not import vLLM's worker
# modules (model_state does, when vLLM is installed). The classes load on first attribute access.
def __getattr__(name):
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
