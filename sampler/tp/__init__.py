"""Tensor-parallel sampler step over a vocabulary-sharded LM head: per-shard local statistics (reference or
Triton), one all-gather of fixed-size records, and the exact combination. Semantics: docs/ARCHITECTURE.md
"Sampler semantics" (the sharded step equals the unsharded one)."""
from .reference import *  # noqa: F401,F403
from .reference import __all__  # noqa: F401
