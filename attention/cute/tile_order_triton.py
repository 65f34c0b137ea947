"""The cute backend's batch order in one Triton launch (:func:`batch_work_order_triton`).

The same exact rule as :func:`blockdiff.attention.cute.tile_order.batch_work_order` (the pure-torch reference
beside it; the rule, its domain and its int64 bounds are in :mod:`blockdiff.attention.cute.tile_order`'s
docstring): one program per block of ``BLOCK`` sequences computes their keys (``T2 = 2 x total``, its quotient and
remainder by ``L = max(q_len, 1)``), loops over all ``B`` sequences in blocks of ``BLOCK`` recomputing theirs, counts
for each of its sequences those that go before it (a larger key by exact comparison, or an equal key and a smaller
batch index: a stable descending sort, ``O(B^2)`` comparisons in all), and scatters ``order[rank_i] = i``. The
ranks are a permutation, so every entry is written exactly once (no initialisation needed). The grid depends only on
``B`` (a host shape) and nothing is read on the host, so a CUDA graph captures the launch and replays it with the
metadata changed in place. Ranking by counting comparisons is the classic rank (enumeration) sort, Knuth, TAOCP
vol. 3, 5.2, Algorithm C "comparison counting", here with every comparison in parallel; FA3's
``prepare_varlen_num_blocks`` likewise sorts its batch inside its one launch. The torch version's cost:
docs/tuning.md 2.14; this launch's: 2.16.

This module imports Triton at import time; the cute interface (``interface._work_order``) imports it on first use
with CUDA tensors. Off the GPU the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set
before Triton is first imported), which the CPU tests use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..env import triton_interpret
from ..masks import check_window
from .tile_order import META_MAX, check_order_metadata

__all__ = ["batch_work_order_triton"]

#: The block of sequences a program ranks (and the block it compares them against): ``BLOCK x BLOCK`` int64
#: comparisons a loop step over 4 warps. 32 compiles for sm_90a in 92-96 registers without spills; 64 spills
#: (ptxas, CPU-compiled with Triton's ``GPUTarget``). One block size for every ``B`` (masked lanes cost nothing at
#: these sizes), so a warm-up at one batch size compiles what every other size launches: vLLM captures its CUDA
#: graphs for many sizes, and a first compile must not fall inside a capture.
MAX_BLOCK = 32


@triton.jit
def _meta(cu_ptr, sl_ptr, ncq_ptr, offs, mask, META_MAX: tl.constexpr):
    """``(L, S, n)`` int64 of the sequences ``offs``, clamped into ``0 <= n <= L <= S <= META_MAX``
    (``tile_order._domain``, line by line)."""
    start = tl.load(cu_ptr + offs, mask=mask, other=0).to(tl.int64)
    end = tl.load(cu_ptr + offs + 1, mask=mask, other=0).to(tl.int64)
    q_len = tl.minimum(tl.maximum(end - start, 0), META_MAX)
    s = tl.maximum(tl.minimum(tl.load(sl_ptr + offs, mask=mask, other=0).to(tl.int64), META_MAX), q_len)
    n = tl.minimum(tl.maximum(tl.load(ncq_ptr + offs, mask=mask, other=0).to(tl.int64), 0), q_len)
    return q_len, s, n


@triton.jit
def _twice_total(q_len, s, n, w, HAS_WINDOW: tl.constexpr, SYMMETRIC: tl.constexpr):
    """``2 x`` the keys the rows see in all, int64 (``tile_order._twice_total``, line by line)."""
    if HAS_WINDOW:
        a0 = s - q_len
        a1 = a0 + n
        c0 = tl.minimum(a0, w + 1)
        c1 = tl.minimum(a1, w + 1)
        causal = c0 * (2 * w + 1 - c0) - c1 * (2 * w + 1 - c1) + 2 * (w + 1) * n
        m = q_len - n
        if SYMMETRIC:
            mid = 2 * a1 + m
            t2 = causal + m * (tl.minimum(2 * s - mid, 2 * w + 2) + tl.minimum(mid, 2 * w))
        else:
            t2 = causal + 2 * m * (s - tl.maximum(a1 - w, 0))
    else:
        t2 = 2 * q_len * (s - n) + n * (n + 1)
    return t2


@triton.jit
def _key(cu_ptr, sl_ptr, ncq_ptr, offs, mask, w, HAS_WINDOW: tl.constexpr, SYMMETRIC: tl.constexpr,
         META_MAX: tl.constexpr):
    """``(qt, r, L)`` int64: key = ``(qt + r / L) / 2`` with ``L = max(q_len, 1)``, ``T2 = qt L + r``."""
    q_len, s, n = _meta(cu_ptr, sl_ptr, ncq_ptr, offs, mask, META_MAX)
    t2 = _twice_total(q_len, s, n, w, HAS_WINDOW, SYMMETRIC)
    den = tl.maximum(q_len, 1)
    qt = t2 // den
    return qt, t2 - qt * den, den


# no recompile per batch size or window (1 would be a constexpr), nor per pointer alignment (a slice of a buffer)
@triton.jit(do_not_specialize=["cu_ptr", "sl_ptr", "ncq_ptr", "order_ptr", "B", "w_arg"])
def _batch_work_order_kernel(cu_ptr, sl_ptr, ncq_ptr, order_ptr, B, w_arg, HAS_WINDOW: tl.constexpr,
                             SYMMETRIC: tl.constexpr, META_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask_i = offs_i < B
    w = w_arg.to(tl.int64)
    qi, ri, di = _key(cu_ptr, sl_ptr, ncq_ptr, offs_i, mask_i, w, HAS_WINDOW, SYMMETRIC, META_MAX)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    j0 = B * 0  # a while loop: the interpreter (numpy 2) cannot take a runtime scalar as a range() bound
    while j0 < B:
        offs_j = j0 + tl.arange(0, BLOCK)
        mask_j = offs_j < B
        qj, rj, dj = _key(cu_ptr, sl_ptr, ncq_ptr, offs_j, mask_j, w, HAS_WINDOW, SYMMETRIC, META_MAX)
        cross_j = rj[None, :] * di[:, None]  # r_j L_i against r_i L_j: key_j vs key_i when qt_j == qt_i
        cross_i = ri[:, None] * dj[None, :]
        same = qj[None, :] == qi[:, None]
        before = ((qj[None, :] > qi[:, None]) | (same & (cross_j > cross_i))
                  | (same & (cross_j == cross_i) & (offs_j[None, :] < offs_i[:, None])))
        before = before & mask_j[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
        j0 += BLOCK
    tl.store(order_ptr + rank, offs_i, mask=mask_i)


def batch_work_order_triton(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                            window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """:func:`blockdiff.attention.cute.tile_order.batch_work_order` in one launch (the module docstring).

    Args:
        cu_seqlens_q: ``[B + 1]`` int32 or int64 tensor (query offsets).
        seq_lens: ``[B]`` int32 or int64 tensor (keys, including the query tokens).
        num_causal_q: ``[B]`` int32 or int64 tensor (leading causal rows).
        window_size: None or a host int >= 0 (``W >= 2^30`` is no bound).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.

    Returns:
        int32 ``[B]`` on the tensors' device, the permutation
        :func:`blockdiff.attention.cute.tile_order.batch_work_order` returns (exactly, ties included). ``B = 0``:
        an empty tensor, no launch.

    Raises:
        TypeError, ValueError: a bad ``window_size`` or ``bidirectional_window``
            (:func:`blockdiff.attention.masks.check_window`); a metadata argument not an integer tensor (TypeError),
            of the wrong shape or on another device (ValueError); tensors not on a CUDA device while the Triton
            interpreter is off (ValueError).
    """
    B = check_order_metadata(cu_seqlens_q, seq_lens, num_causal_q)
    w = check_window(window_size, bidirectional_window)
    if not seq_lens.is_cuda and not triton_interpret():  # (Triton's reading of TRITON_INTERPRET: "true" too)
        raise ValueError(f"seq_lens is on {seq_lens.device}: batch_work_order_triton needs CUDA tensors (or the Triton "
                         "interpreter, TRITON_INTERPRET=1); tile_order.batch_work_order runs anywhere")
    order = torch.empty(B, dtype=torch.int32, device=seq_lens.device)
    if B == 0:
        return order
    # the kernel reads element i at pointer + i: a strided or expanded view would be read wrongly (or, at stride 0,
    # past its storage); .contiguous() is free on the usual dense slices and graph-safe otherwise
    _batch_work_order_kernel[(triton.cdiv(B, MAX_BLOCK),)](
        cu_seqlens_q.contiguous(), seq_lens.contiguous(), num_causal_q.contiguous(), order, B,
        0 if w is None else w, HAS_WINDOW=w is not None, SYMMETRIC=bidirectional_window == "symmetric",
        META_MAX=META_MAX, BLOCK=MAX_BLOCK)
    return order
