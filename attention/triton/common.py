"""Device helpers shared by the portable kernel (:mod:`.portable`) and the Gluon kernels (:mod:`.gluon`), and the
split-KV merge kernel both feed.

The helpers are ``@triton.jit`` functions (Gluon kernels call them too; they are inlined into each kernel):

* :func:`tile_sequence`: virtual q tile -> its sequence (a 16-ary search over ``cu_seqlens_q``, no host work);
* :func:`causal_rows`: a sequence's causal row count, from ``num_causal_q`` or the ``causal`` flags;
* :func:`kv_base`: where a sequence's keys are (block-table row, or first row of the contiguous caches);
* :func:`row_key_interval`: each query row's allowed key interval ``[lo, hi]`` (the device form of
  :func:`blockdiff.attention.masks.key_range`);
* :func:`tile_key_bounds` / :func:`key_block_ranges`: a tile's key bounds; the key blocks it visits, of which the
  full (unmasked) ones;
* :func:`cast` (defined in :mod:`blockdiff.attention.split_merge`, re-exported here): ``x.to(dtype)`` rounding to
  nearest even under the interpreter too.

The split-KV merge kernel both kernel families feed, ``_merge_kernel``, is :mod:`blockdiff.attention.split_merge`'s
(shared with the cute backend), re-exported here under its compiled symbol name. Contract: docs/ARCHITECTURE.md
§4 "The attention contract".
"""
import triton
import triton.language as tl

from ..split_merge import _merge_kernel, cast  # noqa: F401  (shared with the cute backend)


@triton.jit
def tile_sequence(CU_Q, t, num_seqs, ks, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Virtual tile ``t`` -> (sequence b, q_start, q_len, tile index within b): the largest b < num_seqs with
    ``cu_q[b] // BLOCK_Q + b <= t`` (non-decreasing in b), by a 16-ary search of ``SEARCH_STEPS`` steps
    (``16 ** SEARCH_STEPS > num_seqs``): each step loads 16 candidates at once (``ks``: ``arange(0, 16)`` int32
    in the caller's layout), so a batch of up to 15 sequences costs one dependent load round trip, not four."""
    lo_b = t * 0
    for st in tl.static_range(SEARCH_STEPS):
        w = 1 << (4 * (SEARCH_STEPS - 1 - st))
        c = lo_b + ks * w
        ok = c < num_seqs
        s_c = tl.load(CU_Q + c, mask=ok, other=0) // BLOCK_Q + c
        n_go = tl.sum((ok & (s_c <= t)).to(tl.int32), 0)  # >= 1: candidate 0 is lo_b itself
        lo_b = lo_b + (n_go - 1) * w
    q_start = tl.load(CU_Q + lo_b)
    q_len = tl.load(CU_Q + lo_b + 1) - q_start
    return lo_b, q_start, q_len, t - (q_start // BLOCK_Q + lo_b)


@triton.jit
def causal_rows(NCQ, b, q_len, FLAGS: tl.constexpr):
    """``num_causal_q`` of sequence ``b``: read from ``NCQ`` ([B] int32), or with ``FLAGS`` from the causal flags
    ([B] bool: q_len if causal else 0), so that a call with ``causal`` needs no conversion op."""
    if FLAGS:
        return tl.where(tl.load(NCQ + b) != 0, q_len, 0)
    else:
        return tl.load(NCQ + b)


@triton.jit
def kv_base(BT, CU_K, b, stride_bt, PAGED: tl.constexpr):
    """Where sequence ``b``'s keys are: its block-table row (paged; key base 0), or its first row in the
    contiguous caches (``cu_seqlens_k[b]``)."""
    if PAGED:
        return BT + b.to(tl.int64) * stride_bt, 0
    else:
        return BT, tl.load(CU_K + b)


@triton.jit
def row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr):
    """Allowed key interval ``[lo, hi]`` of query rows at positions ``i`` of a sequence
    (:func:`blockdiff.attention.masks.key_range`): causal rows (``i < ncq``) up to themselves, one-sided window;
    bidirectional rows symmetric or prefix window."""
    q_abs = ctx + i
    is_causal = i < ncq
    if HAS_WINDOW:
        lo_sl = tl.maximum(q_abs - window, 0)
        if PREFIX:
            lo_bi = tl.maximum(ctx + ncq - window, 0) + 0 * i
            hi_bi = seq_len - 1 + 0 * i
        else:
            lo_bi = lo_sl
            hi_bi = tl.minimum(q_abs + window, seq_len - 1)
    else:
        lo_sl = 0 * i
        lo_bi = lo_sl
        hi_bi = seq_len - 1 + 0 * i
    return tl.where(is_causal, lo_sl, lo_bi), tl.where(is_causal, q_abs, hi_bi)


@triton.jit
def tile_key_bounds(lo, hi, row_valid):
    """A tile's key bounds over its valid rows: ``(kmin, kmax)`` (the union of their intervals: keys outside it
    are allowed by no row) and ``(lo_max, hi_min)`` (keys in ``[lo_max, hi_min]`` are allowed by every row)."""
    BIG: tl.constexpr = 1 << 30
    kmin = tl.min(tl.where(row_valid, lo, BIG), 0)
    kmax = tl.max(tl.where(row_valid, hi, -1), 0)
    lo_max = tl.max(tl.where(row_valid, lo, 0), 0)
    hi_min = tl.min(tl.where(row_valid, hi, BIG), 0)
    return kmin, kmax, lo_max, hi_min


@triton.jit
def key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Key blocks a tile visits: ``[a, d_end)`` (this split's share of the blocks between the valid rows'
    min lo and max hi), of which ``[b_mid, c_mid)`` are full (every row allows every key: no mask)."""
    kmin, kmax, lo_max, hi_min = tile_key_bounds(lo, hi, row_valid)
    blk_lo = kmin // BLOCK_N
    blk_hi = tl.maximum(tl.where(kmax >= kmin, kmax // BLOCK_N + 1, blk_lo), blk_lo)
    if SPLIT:
        per = (blk_hi - blk_lo + num_splits - 1) // num_splits
        a = tl.minimum(blk_lo + split * per, blk_hi)
        d_end = tl.minimum(a + per, blk_hi)
    else:
        a = blk_lo
        d_end = blk_hi
    full_lo = (lo_max + BLOCK_N - 1) // BLOCK_N
    full_hi = (hi_min + 1) // BLOCK_N
    b_mid = tl.minimum(tl.maximum(full_lo, a), d_end)
    c_mid = tl.minimum(tl.maximum(full_hi, b_mid), d_end)
    return a, b_mid, c_mid, d_end
