"""Triton backend of the attention contract (``backend="triton"``): one varlen launch for mixed causal /
bidirectional rows over paged or contiguous KV, split-KV with an exact LSE merge, and warp-specialised Gluon
kernels on sm_90. Semantics: docs/ARCHITECTURE.md "Attention contract"."""
from .interface import attention_triton

__all__ = ["attention_triton"]
