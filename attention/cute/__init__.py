"""CuTe DSL backend of the attention contract (``backend="cute"``): FlashAttention-4's SM90 kernel extended with
per-sequence causal flags, prefix / symmetric windows and page-sized TMA boxes, and a split-value variant for head
dims above 256 (two consumer warpgroups own half of V each). Needs flash-attn-4 and the CuTe
DSL (imported at first use). Semantics: docs/ARCHITECTURE.md "The attention contract"."""
from .interface import attention_cute

__all__ = ["attention_cute"]
