"""Triton backend of the sampler step (``backend="triton"``): streaming fused kernels for the Gumbel-max sample,
entropy statistics and step bookkeeping, and the self-conditioning soft embedding. Semantics:
docs/ARCHITECTURE.md "Sampler semantics".

Modules, in the order a step runs them (:func:`sampler_step`, in :mod:`.step`): :mod:`.stats` (stage a: one
streaming pass over the logits), :mod:`.step` (stage b: decisions and phase bookkeeping in one kernel),
:mod:`.soft_embedding` (stage c: split-K Triton GEMM or chunked cuBLAS product); :mod:`.config`
(:class:`SamplerConfig`, every tunable and its default) and :mod:`.common` (Philox, rounding, side streams).
"""
from .config import SamplerConfig
from .step import sampler_step

__all__ = ["SamplerConfig", "sampler_step"]
