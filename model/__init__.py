"""blockdiff.model: DiffusionGemma (Gemma 4 text backbone) with encoder (causal, writes the paged KV cache)
and decoder (bidirectional over the canvas, reads the cache) rows in one flat mixed-batch forward, and
loading of transformers DiffusionGemma checkpoints by their parameter names.

Reference implementation matched: transformers 5.24 ``transformers.models.diffusion_gemma``.

MoE: ``DiffusionGemma(..., moe_impl=None)`` (the default) runs ``"grouped_mm"`` (no host sync, CUDA-graph
capturable) for bf16 on sm90 / sm100 GPUs and ``"loop"`` elsewhere (:func:`blockdiff.model.layers.default_moe_impl`);
both are deterministic (each token's expert outputs summed in ascending expert order, no atomics).

A bad checkpoint (config, weights, shard index, tokenizer, generation config) raises :class:`CheckpointError` (a
``ValueError``) naming the file and the rule; a missing file :class:`CheckpointFileNotFoundError` (both a
CheckpointError and a ``FileNotFoundError``). A checkpoint's default sampling parameters:
:func:`load_generation_config` (``DiffusionGemma.generation_config`` once loaded).
"""
from .config import DIFFUSIONGEMMA_26B_A4B, GEOMETRIES, DiffusionGemmaConfig, geometry_config, tiny_config
from .errors import CheckpointError, CheckpointFileNotFoundError
from .generation import load_generation_config
from .loading import convert_hf_state_dict, load_hf_state_dict, read_safetensors
from .modeling import DiffusionGemma

__all__ = [
    "CheckpointError", "CheckpointFileNotFoundError", "DiffusionGemmaConfig", "tiny_config", "DiffusionGemma",
    "DIFFUSIONGEMMA_26B_A4B", "GEOMETRIES", "geometry_config",
    "convert_hf_state_dict", "load_generation_config", "load_hf_state_dict", "read_safetensors",
]
