"""The batch order of the ``"cute"`` kernels' tile scheduler (config ``batch_order="work"``): a permutation of the
sequences, computed on the device, longest tiles first.

FA4's varlen tile scheduler (``flash_attn.cute.tile_scheduler.VarlenDecoder`` / ``SingleTileVarlenScheduler``,
flash-attn-4 4.0.0b36) hands out a launch's tiles sequence by sequence in batch order, longest-first only within a
sequence (``lpt``). In a mixed serving batch (a 4,096-token causal prefill, then canvases over an 8k context) the
canvases' long tiles then start last and leave SMs idle at the end (measured in docs/tuning.md 2.12). Its decoder
takes ``virtual_batch_idx_ptr``, a batch permutation: it walks the batches in that order, reads each one's length
through it and maps a tile back to its real batch index. FA3's ``hopper/flash_prepare_scheduler.cu``
(``prepare_varlen_num_blocks`` with ``sort``) fills it with an LPT batch sort; FA4's port
(``flash_attn/cute/prepare_scheduler.py``) leaves that sort unimplemented and its SM90 forward passes no permutation.
:func:`batch_work_order` computes one; the kernel takes it as its last aux tensor
(:mod:`blockdiff.attention.cute.kernel`, "The batch order").

The key is a sequence's mean keys per query row, a proxy of its mean keys per tile: a tile visits the union of its
rows' key intervals, at most one tile height more than its rows' mean. Rationale for the mean and not the longest
tile: a causal sequence's tiles run longest-first from its longest down to a few keys (mean about half the
longest), so ordering by the mean puts it after the sequences whose tiles are all about as long (canvases over the
whole context), and the launch ends on the causal sequences' short tiles instead of on canvas tiles. Closed forms,
``[B]``-sized ops only (no per-row work): exact for the causal rows (a sum of ``min(q_abs, W) + 1``) and for
bidirectional rows without a window or with the prefix window (one span for all); symmetric-window bidirectional
rows take the span at their midpoint (exact where the span is linear in the row, e.g. a canvas within ``W`` keys
of its sequence's end).

The exact rule. All totals of keys over a sequence's rows are integers or half-integers, so the order compares
``T2 = 2 x total`` (int64) over ``L = max(q_len, 1)`` without rounding: writing ``T2 = qt L + r`` (``0 <= r < L``),
key_i > key_j exactly when ``qt_i > qt_j``, or ``qt_i == qt_j`` and ``r_i L_j > r_j L_i``. The metadata is first
clamped into the domain ``0 <= num_causal_q <= q_len <= seq_len <= 2^31 - 1`` (identities on valid metadata, which
``masks.MAX_SEQ_LEN = 2^30`` keeps inside it; garbage still yields a permutation, so the scheduler never reads a
batch index out of range). In that domain every intermediate stays below 2^63: ``T2 <= 2 q_len seq_len < 2^63``,
the window terms ``c (2W + 1 - c) < 2^61`` and ``2 n (W + 1) < 2^62`` (``W < 2^30`` after ``check_window``), and the
cross products ``r L < 2^62``. The rank of sequence ``i`` is ``#{j: key_j > key_i} + #{j < i: key_j == key_i}``
(a stable descending sort), and ``order[rank_i] = i``.

Two implementations of the same rule, which agree exactly (ties included): :func:`batch_work_order` here, pure torch
(``O(B^2)`` comparisons in row chunks: the reference, and what CPU tensors take), and
:func:`blockdiff.attention.cute.tile_order_triton.batch_work_order_triton`, one Triton launch (every sequence's key,
its rank and the scatter), which the interface takes for CUDA tensors (importing it on first use, so this module and
the interface need no Triton until then). Neither reads anything on the host (``.item()``, ``.tolist()``,
data-dependent shapes), so a CUDA graph captures either and replays it with new metadata. The cost is per call (the
cute launch path has no plan shared by a step's layers, and the order depends on the layer's window): the one launch
replaced the dozen or two small torch kernels the first version issued on the GPU (docs/tuning.md 2.13 counted them,
2.14 measured their cost; 2.16 the one launch's). Any permutation gives the same outputs, so sharing one order
between layers (a per-step cache) could only cost balance, never correctness: the remedy left if the one launch
still shows.
"""
from __future__ import annotations

import torch

from ..masks import check_window

__all__ = ["sequence_work_key", "sequence_work_twice_total", "batch_work_order", "META_MAX"]

#: The largest length the exact rule admits (``seq_len``, ``q_len``; the module docstring's bounds): metadata is
#: clamped to ``[0, META_MAX]`` first, an identity on valid metadata (``masks.MAX_SEQ_LEN = 2^30``).
META_MAX = (1 << 31) - 1

#: Rows of the reference's ``[chunk, B]`` comparison at a time (bounds its memory for large batches).
_REFERENCE_CHUNK = 1024


def check_order_metadata(cu_seqlens_q, seq_lens, num_causal_q) -> int:
    """The batch size ``B`` after checking the metadata's types and host shapes (nothing read on the host).

    Raises:
        TypeError: an argument is not a torch.Tensor, or not of an integer dtype (bool, float rejected).
        ValueError: ``cu_seqlens_q`` not 1-D of ``B + 1 >= 1`` entries, ``seq_lens`` / ``num_causal_q`` not 1-D of
            ``B``, or the three on different devices.
    """
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("num_causal_q", num_causal_q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be 1-D with B + 1 >= 1 entries, got shape {tuple(cu_seqlens_q.shape)}")
    B = cu_seqlens_q.shape[0] - 1
    for name, t in (("seq_lens", seq_lens), ("num_causal_q", num_causal_q)):
        if tuple(t.shape) != (B,):
            raise ValueError(f"{name} must have shape ({B},) (cu_seqlens_q has {B + 1} entries), got {tuple(t.shape)}")
        if t.device != cu_seqlens_q.device:
            raise ValueError(f"{name} is on {t.device}, cu_seqlens_q on {cu_seqlens_q.device}: one device needed")
    return B


def _domain(cu_seqlens_q, seq_lens, num_causal_q):
    """``(L, S, n)`` int64, clamped into ``0 <= n <= L <= S <= META_MAX`` (the Triton kernel's ``_meta`` mirrors
    this line by line)."""
    cu = cu_seqlens_q.long()
    q_len = (cu[1:] - cu[:-1]).clamp(0, META_MAX)
    s = torch.maximum(seq_lens.long().clamp(max=META_MAX), q_len)
    n = torch.minimum(num_causal_q.long().clamp(min=0), q_len)
    return q_len, s, n


def _twice_total(q_len, s, n, w, bidirectional_window):
    """``2 x`` the sum of the keys each query row of a sequence sees (int64, exact; see sequence_work_key for the
    closed form). The Triton kernel's ``_twice_total`` mirrors this line by line."""
    if w is None:
        # causal rows see q_abs + 1 keys, bidirectional rows all S: 2 sum = 2 L (S - n) + n (n + 1)
        return 2 * q_len * (s - n) + n * (n + 1)
    a0 = s - q_len  # ctx: the first row's q_abs
    a1 = a0 + n  # the first bidirectional row's q_abs
    c0 = a0.clamp(max=w + 1)  # 2 sum_{a < x} min(a, W) = 2 x W - c (2W + 1 - c), c = min(x, W + 1)
    c1 = a1.clamp(max=w + 1)
    causal = c0 * (2 * w + 1 - c0) - c1 * (2 * w + 1 - c1) + 2 * (w + 1) * n  # 2 sum of min(q_abs, W) + 1
    m = q_len - n
    if bidirectional_window == "symmetric":
        mid = 2 * a1 + m  # twice the bidirectional rows' midpoint a; span 2 (min(S - a, W + 1) + min(a, W))
        return causal + m * ((2 * s - mid).clamp(max=2 * w + 2) + mid.clamp(max=2 * w))
    return causal + 2 * m * (s - (a1 - w).clamp(min=0))


def sequence_work_twice_total(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                              window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """Twice the keys each sequence's query rows see in all (:func:`sequence_work_key`'s numerator, exact).

    Args: as :func:`sequence_work_key`.

    Returns:
        int64 ``[B]`` on ``seq_lens``' device: ``2 x total`` of the clamped metadata (the module docstring's domain;
        at most ``2 q_len seq_len < 2^63``).

    Raises:
        As :func:`sequence_work_key`.
    """
    check_order_metadata(cu_seqlens_q, seq_lens, num_causal_q)
    w = check_window(window_size, bidirectional_window)
    return _twice_total(*_domain(cu_seqlens_q, seq_lens, num_causal_q), w, bidirectional_window)


def sequence_work_key(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                      window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """Each sequence's mean keys per query row (docs/ARCHITECTURE.md "Which keys a row sees"; the module docstring).

    For a sequence of ``L`` query rows, ``S`` keys (``ctx = S - L``), ``n`` causal rows, ``m = L - n``
    bidirectional rows and window ``W`` (``inf`` without one): ``(sum_{q_abs in [ctx, ctx + n)} (min(q_abs, W) + 1)
    + m * span_b) / max(L, 1)``, where ``span_b`` is ``S`` without a window, ``S - max(0, ctx + n - W)`` with the
    prefix window, and with the symmetric window ``min(S - 1, a + W) - max(0, a - W) + 1`` at the bidirectional
    rows' midpoint ``a = ctx + n + m / 2``. A sequence with no query rows has key 0. For inspection: the order
    compares the exact fractions (:func:`sequence_work_twice_total` over ``2 max(L, 1)``); this float64 is their
    correctly rounded value (the numerator is exact below 2^53), so it never increases along the order.

    Args:
        cu_seqlens_q: ``[B + 1]`` integer tensor (query offsets).
        seq_lens: ``[B]`` integer tensor (keys, including the query tokens).
        num_causal_q: ``[B]`` integer tensor (leading causal rows; ``q_len`` for a causal sequence).
        window_size: None or a host int >= 0 (:func:`blockdiff.attention.masks.check_window`: ``W >= 2^30`` is
            no bound).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.

    Returns:
        float64 ``[B]`` on ``seq_lens``' device.

    Raises:
        TypeError, ValueError: a bad ``window_size`` or ``bidirectional_window`` (``check_window``); a metadata
            argument that is not an integer tensor (TypeError), of the wrong shape or on another device
            (ValueError). The tensors' values are the caller's (the contract's fast path: nothing is read on the
            host); values outside the module docstring's domain are clamped into it.
    """
    check_order_metadata(cu_seqlens_q, seq_lens, num_causal_q)
    w = check_window(window_size, bidirectional_window)
    q_len, s, n = _domain(cu_seqlens_q, seq_lens, num_causal_q)
    return _twice_total(q_len, s, n, w, bidirectional_window).double() / (2 * q_len.clamp(min=1)).double()


def batch_work_order(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                     window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """The sequences by :func:`sequence_work_key`, descending, compared exactly (the module docstring's rule); ties
    (and sequences with no query rows, key 0, last) keep their batch order (a stable sort). Pure torch on the tensors'
    device, the reference of the one-launch kernel
    (:func:`blockdiff.attention.cute.tile_order_triton.batch_work_order_triton`, which returns the same permutation
    and which the interface takes for CUDA tensors): ``O(B^2)`` comparisons in chunks of rows against all sequences,
    then the scatter ``order[rank_i] = i``.

    Args: as :func:`sequence_work_key`.

    Returns:
        int32 ``[B]`` on ``seq_lens``' device, a permutation of ``0 .. B - 1``: position ``v`` holds the batch index
        FA4's varlen scheduler takes ``v``-th (its ``virtual_batch_idx_ptr``).

    Raises:
        As :func:`sequence_work_key`.
    """
    B = check_order_metadata(cu_seqlens_q, seq_lens, num_causal_q)
    w = check_window(window_size, bidirectional_window)
    q_len, s, n = _domain(cu_seqlens_q, seq_lens, num_causal_q)
    t2 = _twice_total(q_len, s, n, w, bidirectional_window)
    den = q_len.clamp(min=1)
    qt = torch.div(t2, den, rounding_mode="floor")
    r = t2 - qt * den  # key = (qt + r / den) / 2, 0 <= r < den
    idx = torch.arange(B, device=t2.device)
    rank = torch.empty(B, dtype=torch.int64, device=t2.device)
    for i0 in range(0, B, _REFERENCE_CHUNK):  # rows i (a column), against every j
        sl = slice(i0, min(i0 + _REFERENCE_CHUNK, B))
        qi, ri, di, ii = qt[sl, None], r[sl, None], den[sl, None], idx[sl, None]
        cross_j, cross_i = r * di, ri * den  # r_j L_i and r_i L_j: key_j vs key_i when qt_j == qt_i
        same = qt == qi
        before = (qt > qi) | (same & (cross_j > cross_i)) | (same & (cross_j == cross_i) & (idx < ii))
        rank[sl] = before.sum(1)
    order = torch.empty(B, dtype=torch.int32, device=t2.device)
    order[rank] = idx.to(torch.int32)
    return order
