"""blockdiff.attention: mixed causal/bidirectional varlen attention over a paged KV cache.

One launch serves a serving batch that mixes prefill (causal), denoise (bidirectional over a canvas) and commit
(causal) sequences, with a per-sequence causal flag, sliding windows (one-sided for causal rows; symmetric or
prefix for bidirectional rows), paged or contiguous KV and GQA. The semantics are docs/ARCHITECTURE.md's
"The attention contract"; :mod:`blockdiff.attention.reference` is the oracle.

Backends (explicit, never a silent fallback): ``"reference"`` (dense PyTorch), ``"triton"`` (fused Triton
kernel), ``"cute"`` (CuTe DSL on FlashAttention-4). ``backend="auto"`` picks triton on CUDA and reference
elsewhere, and says so through :func:`resolve_backend`. A backend is registered by its name in :data:`BACKENDS` and
``(module, function)`` in ``_MODULES``; the shared tests read :data:`BACKENDS` and fail, naming what to add, until the
backend has its row in tests/attention/backend_matrix.py (then the contract suite runs it), its module in
``.importlinter`` and its entries in the lists outside this package (docs/ARCHITECTURE.md, "Adding an attention
backend").
"""
from __future__ import annotations

import importlib

import torch

from .cache import AttentionMetadata, write_kv_cache
from .masks import MAX_SEQ_LEN, WINDOW_NO_BOUND, _parse_device, build_mask, count_allowed_pairs, key_range
from .validate import MAX_SCALE, causal_row_counts, debug_checks, set_debug_checks

BACKENDS = ("reference", "triton", "cute")
# Backends load by name at first use (importlib in get_backend), on purpose: importing this package imports
# neither Triton nor the CuTe DSL, so a CPU entry point can set TRITON_INTERPRET=1 before Triton is first imported.
_MODULES = {
    "reference": ("blockdiff.attention.reference", "attention_reference"),
    "triton": ("blockdiff.attention.triton.interface", "attention_triton"),
    "cute": ("blockdiff.attention.cute.interface", "attention_cute"),
}


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Map ``"auto"`` to a concrete backend (triton on CUDA, reference otherwise); validate the name.

    ``device`` (read for ``"auto"`` only; whether a CUDA device is there is not checked) is None, a str or a
    ``torch.device``.

    Raises:
        TypeError: ``backend`` not a str; ``device`` neither None, a str nor a ``torch.device``.
        ValueError: unknown backend name; a ``device`` string torch cannot parse (``"bogus"``: torch's RuntimeError
            before).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS + ('auto',)}, got {type(backend).__name__}")
    if backend == "auto":
        dev = _parse_device(device, check_available=False)
        return "triton" if dev is not None and dev.type == "cuda" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r} (a new backend is registered "
                         "in BACKENDS and _MODULES of attention/__init__.py: docs/ARCHITECTURE.md section 3, "
                         "'Adding an attention backend')")
    return backend


def get_backend(backend: str):
    """The attention function of a backend.

    Raises:
        ValueError: unknown backend.
        ImportError: the backend exists but cannot be imported here (its message says why);
            there is no fallback to another backend.
    """
    backend = resolve_backend(backend)
    mod_name, fn_name = _MODULES[backend]
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"attention backend {backend!r} is not available: {e}") from e
    return getattr(mod, fn_name)


def attention(q, k_cache, v_cache, *, backend: str, **kwargs):
    """Mixed causal/bidirectional varlen attention (see :func:`blockdiff.attention.reference.attention_reference`
    for every argument, shape, dtype and error).

    Args:
        q, k_cache, v_cache: see the reference.
        backend: ``"reference"``, ``"triton"``, ``"cute"`` or ``"auto"`` (required; no silent fallback).
        **kwargs: cu_seqlens_q, seq_lens, causal | num_causal_q, block_table | cu_seqlens_k, window_size,
            bidirectional_window, scale, out, return_lse, max_seqlen_q, max_seqlen_k, check_values, and
            backend-specific options (e.g. ``config`` for triton tile shapes).

    Returns:
        ``out [total_q, num_heads, head_dim_v]`` (q's dtype), or ``(out, lse [num_heads, total_q] fp32)``.

    Raises:
        TypeError: ``q`` is not a tensor (checked first: ``backend="auto"`` reads its device); every other
            argument as the backend's validation (:func:`blockdiff.attention.validate.check_attention_inputs`).
        ValueError: an unknown backend; a contract rule broken.

    ``check_values=False`` (the fast path: no host reads, the triton backend's launch plans) trusts the caller
    for the value rules: ``cu_seqlens_q`` starts at 0, never decreases and ends at ``total_q``;
    ``q_len <= seq_lens <= MAX_SEQ_LEN``; ``num_causal_q`` in ``[0, q_len]``; every block-table entry a sequence
    uses (its first ``cdiv(seq_len, page_size)`` columns, which the table must have) a page id in
    ``[0, num_blocks)``; in the contiguous form ``cu_seqlens_k`` starts at 0, never decreases, stays within the
    cache and matches ``seq_lens``. Breaking one is undefined behaviour (each backend's docstring says what its
    kernels still guard). :func:`set_debug_checks` (or ``BLOCKDIFF_CHECK_VALUES=1``) checks them on every call.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    return get_backend(resolve_backend(backend, q.device))(q, k_cache, v_cache, **kwargs)


__all__ = [
    "attention", "build_mask", "key_range", "count_allowed_pairs", "write_kv_cache", "AttentionMetadata",
    "BACKENDS", "resolve_backend", "get_backend", "causal_row_counts", "set_debug_checks", "debug_checks",
    "MAX_SEQ_LEN", "WINDOW_NO_BOUND", "MAX_SCALE",
]
