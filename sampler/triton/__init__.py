"""Triton backend of the sampler step (``backend="triton"``): streaming fused kernels for the Gumbel-max sample,
entropy statistics and step bookkeeping, and the chunked self-conditioning soft embedding. Semantics:
docs/ARCHITECTURE.md "Sampler semantics"."""
from .kernels import SamplerConfig, sampler_step

__all__ = ["SamplerConfig", "sampler_step"]
