"""Helpers shared by the Triton sampler kernels: Philox4x32-10 and the per-position id streams, float32 rounding,
the online softmax's initial max, the interpreter switch and the cached side streams.

The ``@triton.jit`` helpers here are bit for bit :mod:`blockdiff.sampler.rng` (Philox4x32-10, Salmon et al.,
SC'11, with ``tl.umulhi`` and wrapping uint32 products; the counter layout of docs/ARCHITECTURE.md "Sampler
semantics"), so every backend draws the same noise and ids. The tensor-parallel shard kernel
(:mod:`blockdiff.sampler.tp.triton`) uses them too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import rng

__all__ = ["philox4x32_10", "position_ids", "FLT_LOWEST", "round_to", "interpret_mode", "random_ids", "side_stream",
           "INT32_MAX", "check_int32_index"]


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors (Random123); same words as blockdiff.sampler.rng.philox4x32_10."""
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def position_ids(seed, rid, cidx, step, p, V, STREAM: tl.constexpr):
    """Random ids of a per-position stream (blockdiff.sampler.rng.random_ids) of one row at positions ``p``.

    seed, rid, cidx, step: int64 scalars of the row; p: int64 [B] positions (any order); returns int64 [B]: words
    0, 1 of Philox(key(seed), (0, p | stream << 16 | step << 18, rid lo, rid hi16 | cidx << 16)),
    id = floor((w0 | w1 << 32) * V / 2**64) exactly, in 32-bit limbs (umulhi + carry).
    """
    zero = (p * 0).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32) + zero
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) + zero
    c1 = ((p & 0xFFFF) | (STREAM << 16) | ((step & 16383) << 18)).to(tl.uint32)
    c2 = (rid & 0xFFFFFFFF).to(tl.uint32) + zero
    c3 = (((rid >> 32) & 0xFFFF) | ((cidx & 0xFFFF) << 16)).to(tl.uint32) + zero
    w0, w1, _, _ = philox4x32_10(zero, c1, c2, c3, k0, k1)
    v = (zero + V).to(tl.uint32)
    a_hi = tl.umulhi(w0, v)                      # (w0 * V) >> 32
    b_lo = w1 * v                                # (w1 * V) mod 2**32
    b_hi = tl.umulhi(w1, v)
    lo = b_lo + a_hi
    ids = b_hi + (lo < b_lo).to(tl.uint32)       # carry of the low word
    return ids.to(tl.int64)


#: Largest index the sampler's kernels may form in int32 arithmetic. Row products (``row * V``, ``row * hidden``) are
#: int64 in every kernel; token ids, flat positions and the split / tile ends built from them are int32 (cheaper in
#: the hot loops), so each launcher checks the largest one its grid and tiles form (:func:`check_int32_index`).
INT32_MAX = 2**31 - 1


def check_int32_index(largest: int, what: str, hint: str) -> None:
    """Refuse a launch whose largest int32 index ``largest`` (a token id, a flat position or a split end that the
    kernel forms, masked lanes and padded tiles included) exceeds :data:`INT32_MAX`: the value would wrap to a
    negative one, pass a ``< V`` mask, and read outside the tensor, or end a split before it began (its tokens
    silently left out).

    Raises:
        ValueError: names ``what`` (the arguments that set the index), the value and ``hint`` (what to change).
    """
    if largest > INT32_MAX:
        raise ValueError(f"{what}: the Triton sampler forms int32 indices up to {largest}, past 2**31 - 1 "
                         f"(they would wrap and read out of bounds); {hint}")


#: The lowest finite float32 (-3.4028235e38): the online softmax's initial max, <= every finite z (a larger start
#: such as -3e38 would leave z below it out of the sums: s = 0, a NaN entropy on a valid row).
FLT_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 values of ``x.to(dtype)`` with round-to-nearest-even (by hand for bf16; used under the interpreter)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


#: ``TRITON_INTERPRET`` values that turn Triton's interpreter on, lower-cased: Triton's own reading (its
#: ``getenv_bool``), the same tuple as ``blockdiff.attention.env.TRITON_INTERPRET_ON`` (the sampler does not import the
#: attention package; tests/attention/test_env.py checks both against Triton).
TRITON_INTERPRET_ON = ("1", "true", "yes", "on", "y")


def interpret_mode() -> bool:
    """Whether Triton kernels run through the interpreter (``TRITON_INTERPRET`` read as Triton reads it: ``1``,
    ``true``, ``yes``, ``on``, ``y`` in any case; ``false`` / ``0`` / ``off`` compile): the CPU tests. Was: "set and
    not 0", so ``false`` counted as the interpreter while Triton compiled."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_INTERPRET_ON


@triton.jit
def _random_ids_kernel(seed_ptr, rid_ptr, cidx_ptr, step_ptr, out_ptr, CL, V,
                       STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (N, cdiv(CL, BLOCK)): out[n, p] = blockdiff.sampler.rng.random_ids(...)[n, p] for a per-position
    stream (:func:`position_ids`)."""
    n = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pmask = p < CL
    seed = tl.load(seed_ptr + n).to(tl.int64)
    rid = tl.load(rid_ptr + n).to(tl.int64)
    cidx = tl.load(cidx_ptr + n).to(tl.int64)
    step = tl.load(step_ptr + n).to(tl.int64)
    ids = position_ids(seed, rid, cidx, step, p.to(tl.int64), V, STREAM)
    tl.store(out_ptr + n.to(tl.int64) * CL + p, ids, mask=pmask)


def random_ids(seed: torch.Tensor, request_id: torch.Tensor, canvas_index: torch.Tensor, step: torch.Tensor,
               canvas_length: int, vocab_size: int, stream: int) -> torch.Tensor:
    """:func:`blockdiff.sampler.rng.random_ids` in one Triton launch (same ids, bit for bit): int64 [N, CL].

    Raises:
        ValueError: a stream other than RENOISE / INITIAL, or a size out of range; TypeError: a size that is not an
            int (:func:`blockdiff.sampler.rng.check_sizes`, the torch version's rules); ``seed``, ``request_id``,
            ``canvas_index`` or ``step`` not an integer tensor (the kernel's ``.to(tl.int64)`` truncated a float
            seed; :func:`blockdiff.sampler.rng.check_int_coordinates`).
    """
    rng.check_sizes(canvas_length, vocab_size, stream)
    rng.check_int_coordinates(seed, request_id, canvas_index, step)
    n = seed.shape[0]
    out = torch.empty(n, canvas_length, dtype=torch.int64, device=seed.device)
    if n > 0 and canvas_length > 0:
        block = min(1024, triton.next_power_of_2(canvas_length))
        _random_ids_kernel[(n, triton.cdiv(canvas_length, block))](
            seed.contiguous(), request_id.contiguous(), canvas_index.contiguous(), step.contiguous(), out,
            canvas_length, vocab_size, STREAM=stream, BLOCK=block, num_warps=4)
    return out


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, priority: int = 0) -> "torch.cuda.Stream":
    """One cached CUDA side stream per (device, priority): priority 0 writes the chunked soft embedding's P chunks
    (``SamplerConfig.soft_overlap``); priority -1 (high) runs the soft embedding beside the stats pass
    (``SamplerConfig.stats_overlap``), so the two uses never share a stream."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=priority)
    return _SIDE_STREAMS[key]
