"""Triton backend of the attention contract (``backend="triton"``): one varlen launch for mixed causal /
bidirectional rows over paged or contiguous KV, split-KV with an exact LSE merge, and warp-specialised Gluon
kernels on sm_90. Semantics: docs/ARCHITECTURE.md §4 "The attention contract".

Modules (each imports only those above it; tests in tests/attention/triton/test_triton_<module>.py):

* :mod:`.common`: the ``@triton.jit`` helpers both kernel families share (tile -> sequence search, causal rows,
  KV base, per-row key interval, key-block ranges), with the rounding cast and the split-KV merge kernel
  ``_merge_kernel`` re-exported from :mod:`blockdiff.attention.split_merge` (shared with the cute backend).
* :mod:`.portable`: the portable Triton kernel ``_attn_fwd_kernel`` (``IMPL="triton"``; CPU via the interpreter).
* :mod:`.gluon`: the warp-specialised Gluon kernels ``_attn_fwd_gluon``, ``_attn_fwd_gluon_wide``,
  ``_attn_fwd_gluon_roles`` (``IMPL="gluon"``, sm_90).
* :mod:`.tma`: which inputs the Gluon kernels can read, TMA box geometry, cached TMA descriptors (host).
* :mod:`.config`: the config type :class:`~.config.TritonConfig`, defaults, tuned tables, all validation, the
  kernel / regime / split choice, occupancy estimates and the kernels' constexpr arguments.
* :mod:`.plans`: launch plans (planning a call once, launching it without re-binding).
* :mod:`.compile_check`: the offline sm_90a compile check of the Gluon kernels (``compile_for_sm90``).
* :mod:`.interface`: the public :func:`attention_triton`, its plan cache, ``LAST_LAUNCH`` and the A/B switches.

The kernels keep their compiled symbol names (``_attn_fwd_kernel``, ``_merge_kernel``, ``_attn_fwd_gluon*``):
they are what profilers and PTX dumps show.
"""
from .interface import attention_triton

__all__ = ["attention_triton"]
