"""blockdiff.model: DiffusionGemma (Gemma 4 text backbone) with encoder (causal, writes the paged KV cache)
and decoder (bidirectional over the canvas, reads the cache) rows in one flat mixed-batch forward, and
loading of transformers DiffusionGemma checkpoints by their parameter names.

Reference implementation matched: transformers 5.24 ``transformers.models.diffusion_gemma``.
"""
from .config import DiffusionGemmaConfig, tiny_config
from .loading import convert_hf_state_dict, load_hf_state_dict, read_safetensors
from .modeling import DiffusionGemma

__all__ = [
    "DiffusionGemmaConfig", "tiny_config", "DiffusionGemma", "convert_hf_state_dict", "load_hf_state_dict",
    "read_safetensors",
]
