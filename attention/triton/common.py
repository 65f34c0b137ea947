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
* :func:`cast`: ``x.to(dtype)`` rounding to nearest even under the interpreter too.

:func:`_merge_kernel` merges the split-KV partials exactly (flash-decoding's LSE merge: Dao et al., 2023,
"Flash-Decoding for long-context inference"). Contract: docs/ARCHITECTURE.md §4 "The attention contract".
"""
import triton
import triton.language as tl


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even; the interpreter truncates fp32 -> bf16, so round by hand."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dtype)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


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


@triton.jit(do_not_specialize=["total_q", "n_rows"])
def _merge_kernel(OPART, LSEPART, O, LSE, total_q, num_heads, n_rows, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                  STORE_LSE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Exact merge of split-KV partials: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    One program merges ``BLOCK_R`` (token, head) rows (row = token * num_heads + head, OPART's order): pass 1 takes
    the max LSE over the splits, pass 2 accumulates the weighted partials with ``[BLOCK_R, BLOCK_DV]`` loads (one
    program per row was slower; docs/tuning.md).
    """
    if PDL:
        # launched with programmatic dependent launch (sm_90+): the grid is dispatched while the attention kernel
        # finishes; wait until its writes are visible
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    tq = r // num_heads
    h = r % num_heads
    lse_off = h * total_q + tq
    plane = n_rows.to(tl.int64)  # = num_heads * total_q: one split's rows (int64: splits x rows may pass 2^31)
    mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        mx = tl.maximum(mx, tl.load(LSEPART + s * plane + lse_off, mask=rmask, other=float("-inf")))
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    offs = tl.arange(0, BLOCK_DV)
    dmask = offs < DV
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(LSEPART + s * plane + lse_off, mask=rmask, other=float("-inf"))
        w = tl.exp(lse_s - mx_use)  # 0 for empty splits
        o_s = tl.load(OPART + (s * plane + r)[:, None] * DV + offs[None, :], mask=rmask[:, None] & dmask[None, :],
                      other=0.0)
        den += w
        acc += o_s * w[:, None]
    res = acc * (1.0 / tl.where(den == 0.0, 1.0, den))[:, None]
    tl.store(O + tq[:, None] * stride_ot + h[:, None] * stride_oh + offs[None, :],
             cast(res, O.dtype.element_ty, INTERPRET), mask=rmask[:, None] & dmask[None, :])
    if STORE_LSE:
        tl.store(LSE + lse_off, tl.where(den == 0.0, float("-inf"), mx_use + tl.log(den)), mask=rmask)

