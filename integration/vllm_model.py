"""vLLM model class for DiffusionGemma with blockdiff's ModelState (imported by vLLM through the plugin's
registry entry; importing it needs vLLM).

It is vLLM's own ``DiffusionGemmaForConditionalGeneration`` (weights, layers, vision tower) with
``get_model_state_cls()`` returning :class:`blockdiff.integration.model_state.DiffusionModelState`, so that
model runner v2 drives the blockdiff sampler and per-request causal flags.
"""
from __future__ import annotations

from vllm.model_executor.models.diffusion_gemma import (  # type: ignore
    DiffusionGemmaForConditionalGeneration as _VllmDiffusionGemma,
)


class BlockdiffDiffusionGemmaForConditionalGeneration(_VllmDiffusionGemma):
    """vLLM's DiffusionGemma with blockdiff's :class:`DiffusionModelState`."""

    @staticmethod
    def get_model_state_cls():
        from .model_state import DiffusionModelState

        return DiffusionModelState
