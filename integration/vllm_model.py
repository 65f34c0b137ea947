"""vLLM model class for DiffusionGemma with blockdiff's ModelState (imported by vLLM through the plugin's
registry entry; importing it needs vLLM).

It is vLLM's own ``DiffusionGemmaForConditionalGeneration`` (weights, layers, vision tower) with
``get_model_state_cls()`` returning :class:`blockdiff.integration.model_state.DiffusionModelState`, so that
model runner v2 drives the blockdiff sampler and per-request causal flags, and with the model's bidirectional
window rule handed to blockdiff's ``CUSTOM`` attention layers (vLLM's attention layers carry no such option).
"""
from __future__ import annotations

from vllm.logger import init_logger  # type: ignore
from vllm.model_executor.models.diffusion_gemma import (  # type: ignore
    DiffusionGemmaForConditionalGeneration as _VllmDiffusionGemma,
)

from .vllm_attention import BlockdiffAttentionImpl
from .vllm_plugin import bidirectional_window_of

_log = init_logger(f"vllm.{__name__}")  # under vLLM's "vllm" logger: its handler prints INFO to the server log


class BlockdiffDiffusionGemmaForConditionalGeneration(_VllmDiffusionGemma):
    """vLLM's DiffusionGemma with blockdiff's :class:`DiffusionModelState`.

    Construction (``vllm_config``, ``prefix``) is vLLM's; then every attention layer on blockdiff's ``CUSTOM``
    backend gets ``impl.bidirectional_window`` =
    :func:`~blockdiff.integration.vllm_plugin.bidirectional_window_of` of ``vllm_config.model_config.hf_text_config``
    (transformers' ``"prefix"`` unless the checkpoint names another), see :func:`set_bidirectional_window`.

    Raises:
        ValueError: the checkpoint's ``text_config.bidirectional_window`` is neither ``"prefix"`` nor ``"symmetric"``.
    """

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        window = bidirectional_window_of(vllm_config.model_config.hf_text_config)
        n = set_bidirectional_window(self, window)
        _log.info("blockdiff: bidirectional window rule %r on %d CUSTOM attention layers", window, n)

    @staticmethod
    def get_model_state_cls():
        from .model_state import DiffusionModelState

        return DiffusionModelState


def set_bidirectional_window(model, window: str) -> int:
    """Set ``impl.bidirectional_window = window`` on every submodule of ``model`` whose ``impl`` is a
    :class:`~blockdiff.integration.vllm_attention.BlockdiffAttentionImpl` (vLLM's ``Attention`` layers on the
    ``CUSTOM`` backend). Returns how many were set (0 under another attention backend)."""
    n = 0
    for m in model.modules():
        impl = getattr(m, "impl", None)
        if isinstance(impl, BlockdiffAttentionImpl):
            impl.bidirectional_window = window
            n += 1
    return n
