"""The portable Triton kernel of the backend (``config["IMPL"] = "triton"``; any CUDA GPU, and the CPU through the
Triton interpreter).

FlashAttention-2's online softmax (Dao, 2023, arXiv:2307.08691) in the base-2 form of the Triton fused attention
tutorial, over vLLM's ``triton_unified_attention`` device-side tile -> sequence mapping (:mod:`.common`). The host
side (config, grid, split count) is :mod:`.config` and :mod:`.plans`; the contract is docs/ARCHITECTURE.md
§4 "The attention contract".

* **Grid** ``(n_tiles, num_kv_heads * n_dv_blocks, num_splits)``; tiles run in reverse, so the long causal tiles
  at the end of a prefill start first. Surplus programs (``tile * BLOCK_Q >= q_len``) exit at once.
* **GQA packing.** A tile's ``BLOCK_M`` rows are ``(token, head-in-group)`` pairs: ``BLOCK_Q = BLOCK_M // GP``
  tokens x ``GP`` heads (GP = group size rounded up to a power of two; padding heads are masked). K/V of a
  KV head are read once for the whole group.
* **Tile skipping for every row type.** The tile visits only key blocks in ``[min lo, max hi]`` over its valid
  rows (causal diagonal, sliding window on both sides, prefix window, mixed tiles). Blocks inside
  ``[max lo, min hi]`` are *full* (no elementwise mask, no bounds checks); only the boundary blocks before / after
  them run the masked path (three loops of :func:`_attn_range`, a constexpr ``MASK`` flag).
* **Paged KV, any page size.** When ``page_size % BLOCK_N == 0`` one scalar block-table read per key block, a
  scalar base pointer and loop-invariant int32 tile offsets (int64 ``[BLOCK_N, D]`` pointer tiles spill at
  hd 512); otherwise one vector read of the page ids (pages of 1, 16, ... or not dividing the tile). Block ids
  are widened to int64 before multiplying strides. Contiguous varlen form via ``cu_seqlens_k``. A cache whose row
  stride would carry the int32 tile offsets past 2^31 - 1 (``(BLOCK_N - 1) * stride`` plus the width: a page-major
  storage viewed as ``[num_blocks, page_size, ...]``) compiles int64 ones instead (``WIDE_KV_OFFS``, chosen on the
  host: :func:`.plans.wide_kv_offsets`); other layouts keep the int32 code.
* **Block-table prefetch (``BT_PREFETCH``).** Block j + 1's page id(s) are read while block j is computed, so
  K / V addresses never wait on a dependent block-table load.
* **Numerics.** Scores ``q.k`` in fp32 from ``tl.dot`` (bf16/fp16 operands, fp32 acc; fp32 inputs use
  ``input_precision="ieee"``); with ``|scale| * log2(e)`` at least 2**-120 (``RAW_MAX``,
  :func:`.tma.normal_kernel_scale`; a negative scale negates the Q tile, exactly: ``NEG_Q``) the running max is
  taken on raw scores and each weight is ``exp2((s - m) * scale * log2(e))`` (a raw ``s - m`` that overflows to
  ``-inf`` then stands for a weight below 2**-256, 0 anyway); other scales (0, below the normal range, below
  2**-120) are scaled first and weighted ``exp2(s - m)``. A subtraction, then a multiply: the one-FMA form
  ``exp2(fma(s, c, -round(m * c)))`` (FA4, Triton's tutorial) keeps the product's rounding error, up to half an
  ulp of the max, which is inf or 0 in ``exp2`` for scores beyond ~2^31 in log2 units. The running max is made
  finite (0) while a row has seen no allowed key, so fully masked rows / blocks never produce ``-inf - -inf``.
  Rows with no key: out 0, lse -inf. Under the interpreter (CPU CI) bf16 dots run on fp32 copies of the bf16
  values and fp32 -> bf16 casts round to nearest even by hand (the interpreter multiplies bf16 bit patterns and
  truncates casts).
* **Keys a row may not see contribute nothing, NaN / Inf V included.** Full blocks need no care. In masked blocks
  V rows past ``seq_len`` and of keys outside the tile's key union load as 0; a ragged block (keys some rows allow
  and others do not) scans its V tile for a non-finite entry (an integer max over the exponent bits): with one, P.V
  runs with the non-finite entries zeroed and a flag sends the tile, after its epilogue, through a cold pass
  (:func:`_nonfinite_tile`, not inlined) that reads those V blocks again and adds the entries to the stored output
  of exactly the rows, and columns, that allow them (IEEE: NaN, +-Inf). On the hot path: the union mask and the
  ragged test in every masked block, the scan (one CTA-wide max) in ragged blocks only; full blocks unchanged.
* **Metadata guards.** Page ids are clamped into ``[0, num_blocks)`` (two int32 min / max per block-table entry
  read), ``seq_len`` to the block table's capacity (contiguous: ``cu_seqlens_k`` and ``seq_len`` into the cache
  rows) and query rows to ``[0, total_q)`` (a few scalar ops per program): no-ops on valid input, and an unchecked
  call (``check_values=False``) with bad metadata reads and writes only inside its tensors.
* **Lazy rescaling (``LAZY_RESCALE``).** FA4's trick: the accumulator is rescaled only when some row's max grew by
  more than 8 (log2 units); otherwise the stale max is kept (p <= 2^8, exact after normalising).
* **V head-dim slices.** ``BLOCK_DV < head_dim_v`` splits the V head dim across programs (QK^T recomputed per
  slice): how hd 512 fits the registers (a 64 x 512 fp32 accumulator is 128 registers a thread).
* **Split-KV.** With ``SPLIT`` each program takes its split's share of the tile's key blocks and writes a fp32
  partial (``OPART``, ``[num_splits, total_q, num_heads, head_dim_v]``, normalised) and the split's running max
  and sum (``STATPART``, ``[num_splits, 2, num_heads, total_q]`` fp32: ``m_i`` in qk's units, raw scores of the
  possibly negated Q with ``RAW_MAX``, else scores in log2 units; ``l_i`` relative to it, ``-inf`` / 0 for a row
  with no key in the split); :func:`.common._merge_kernel` merges them in its raw-stats format with
  ``scale_log2`` = ``|qk_scale|`` (``RAW_MAX``) or 1 (:func:`.config.split_stats_scale`). Without, it writes
  ``out`` (and ``lse``).
"""
import triton
import triton.language as tl

from .common import cast, causal_rows, key_block_ranges, kv_base, row_key_interval, tile_key_bounds, tile_sequence


@triton.jit
def _page(raw, last_page):
    """Block-table entries as int64 page ids clamped into ``[0, last_page]``: an out-of-range id of an unchecked
    call (``check_values=False``) reads a wrong page, never outside the caches (two int32 min / max per entry)."""
    return tl.minimum(tl.maximum(raw.to(tl.int32), 0), last_page).to(tl.int64)


@triton.jit
def _any_nonfinite(v):
    """Whether a V tile holds a NaN / Inf entry: an integer max of its exponent-and-mantissa bits against the
    all-ones exponent (one AND per element and a tile-wide max)."""
    if v.dtype == tl.float32:
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        inf_bits = 0x7F800000
    elif v.dtype == tl.bfloat16:
        bits = v.to(tl.int16, bitcast=True) & 0x7FFF
        inf_bits = 0x7F80
    else:
        bits = v.to(tl.int16, bitcast=True) & 0x7FFF
        inf_bits = 0x7C00
    return tl.max(bits) >= inf_bits


@triton.jit
def _add_nonfinite_terms(dst, dst_mask, v, start, lo, hi, offs_n, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Add the NaN / Inf entries of a key block's V (``v``, finite entries ignored) to the stored tile ``dst``
    (pointers ``[BLOCK_M, BLOCK_DV]``, valid where ``dst_mask``) of the rows that allow their keys, one key per
    iteration: a key ``k`` holding one reaches exactly the rows with ``start + k`` in ``[lo, hi]``, in exactly its
    columns. An allowed key's weight is > 0, so ``p * NaN = NaN`` and ``p * +-Inf = +-Inf`` are the entries
    themselves, and IEEE addition makes the column NaN / +-Inf as the reference's P.V does (except where an
    allowed key's weight underflowed to 0: the reference's ``0 * Inf`` is NaN, this gives +-Inf)."""
    vf = v.to(tl.float32)
    finite = tl.abs(vf) < float("inf")
    v_nf = tl.where(finite, 0.0, vf)  # the non-finite entries only
    bad = tl.max(tl.where(finite, 0, 1), 1) > 0  # [BLOCK_N]: keys with a non-finite entry
    k = tl.min(tl.where(bad, offs_n, BLOCK_N), 0)
    while k < BLOCK_N:
        v_k = tl.sum(tl.where((offs_n == k)[:, None], v_nf, 0.0), 0)  # [BLOCK_DV]: key k's non-finite entries
        rows = dst_mask & ((start + k >= lo) & (start + k <= hi))[:, None]  # the rows that allow key k
        cur = tl.load(dst, mask=rows, other=0.0).to(tl.float32)
        tl.store(dst, cast(cur + v_k[None, :], dst.dtype.element_ty, INTERPRET), mask=rows)
        bad = bad & (offs_n != k)
        k = tl.min(tl.where(bad, offs_n, BLOCK_N), 0)


@triton.jit
def _key_offsets(BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """A key block's row offsets ``arange(0, BLOCK_N)``: int32, or int64 with ``WIDE`` (the host's
    :func:`.plans.wide_kv_offsets`: a cache whose row stride makes ``(BLOCK_N - 1) * stride`` pass int32, where the
    int32 tile offsets of :func:`_tile_ptrs` wrapped into an out-of-bounds read). Every key position and offset
    derived from them follows their type."""
    if WIDE:
        return tl.arange(0, BLOCK_N).to(tl.int64)
    else:
        return tl.arange(0, BLOCK_N)


@triton.jit
def _tile_ptrs(X, bid, start, kpos, k_base, x_head, stride_xb, stride_xp, offs_n, offs_x, BLOCK_N: tl.constexpr,
               PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Pointers ``[BLOCK_N, width]`` of a key block's rows in one cache (K or V) from its page id(s) ``bid``: a
    scalar base pointer and loop-invariant int32 tile offsets when a page holds whole blocks, per-key int64 rows
    otherwise, the contiguous form's rows from ``k_base``."""
    if PAGED:
        if PAGE % BLOCK_N == 0:
            in_page = (start % PAGE).to(tl.int64)
            return (X + (bid * stride_xb + in_page * stride_xp + x_head)) + \
                (offs_n[:, None] * stride_xp + offs_x[None, :])
        else:
            row = bid * stride_xb + (kpos % PAGE).to(tl.int64) * stride_xp
            return X + x_head + row[:, None] + offs_x[None, :]
    else:
        tok0 = (k_base + start).to(tl.int64)
        return (X + (tok0 * stride_xb + x_head)) + (offs_n[:, None] * stride_xb + offs_x[None, :])


@triton.jit
def _ragged(start, bounds, BLOCK_N: tl.constexpr):
    """Whether key block ``start`` holds keys that some valid rows of the tile allow and others do not (a scalar
    test on :func:`.common.tile_key_bounds`)."""
    kmin, kmax, lo_max, hi_min = bounds
    return ((kmin < lo_max) & (start < lo_max)) | ((hi_min < kmax) & (start + BLOCK_N - 1 > hi_min))


@triton.jit
def _log2_units(d, qk_scale, RAW_MAX: tl.constexpr):
    """A difference of scores ``d`` (``qk - m``, ``m_old - m_new``) in log2 units: ``d * qk_scale`` where scores are
    raw (``RAW_MAX``), else ``d`` (already scaled)."""
    if RAW_MAX:
        return d * qk_scale
    else:
        return d


@triton.jit
def _attn_block(acc, l_i, m_i, q, j, K, V, bt_row, k_base, k_head, v_head,
                stride_kb, stride_kp, stride_vb, stride_vp,
                seq_len, lo, hi, bounds, last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
                RAW_MAX: tl.constexpr, LAZY: tl.constexpr, bid_in, BT_PREFETCH: tl.constexpr):
    """One key block of the online softmax (MASK: boundary block with elementwise mask and bounds).
    ``bid_in``: the block's page id (scalar) or per-key page ids ([BLOCK_N]), read one iteration earlier by
    :func:`_attn_range` (BT_PREFETCH). ``bounds``: the tile's :func:`.common.tile_key_bounds`.

    A masked block keeps keys outside a row's interval out of P.V exactly, even where V holds NaN / Inf (0 * NaN
    is NaN): V rows at or past ``seq_len`` and of keys no row of the tile allows load as 0; if the block also holds
    keys some rows allow and others do not (a ragged edge: :func:`_ragged`, a scalar test), V is scanned for a
    non-finite entry (:func:`_any_nonfinite`) and, when there is one, P.V runs with those entries zeroed and the
    flag returned makes the tile's cold pass (:func:`_nonfinite_pass`) add them to the rows that allow them."""
    start = j * BLOCK_N
    kpos = start + offs_n  # [BN] int32 key positions within the sequence
    kvalid = kpos < seq_len
    if PAGED:
        if PAGE % BLOCK_N == 0:
            # the whole block lies in one page (start < seq_len: blocks come from [kmin, kmax]): one scalar
            # block-table read, a scalar base pointer and loop-invariant int32 tile offsets (few registers)
            if BT_PREFETCH:
                bid = bid_in
            else:
                bid = _page(tl.load(bt_row + start // PAGE), last_page)
        else:
            if BT_PREFETCH:
                bid = bid_in  # [BN] page ids, read one block earlier (0 beyond seq_len)
            elif MASK:
                bid = _page(tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0), last_page)
            else:
                bid = _page(tl.load(bt_row + kpos // PAGE), last_page)
    else:
        bid = 0
    k_ptrs = _tile_ptrs(K, bid, start, kpos, k_base, k_head, stride_kb, stride_kp, offs_n, offs_d, BLOCK_N, PAGE,
                        PAGED)
    v_ptrs = _tile_ptrs(V, bid, start, kpos, k_base, v_head, stride_vb, stride_vp, offs_n, offs_dv, BLOCK_N, PAGE,
                        PAGED)
    if MASK:
        if EVEN_D:
            k = tl.load(k_ptrs, mask=kvalid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=kvalid[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
    if INTERPRET:  # the interpreter multiplies bf16 as raw uint16: use fp32 operands (same rounded values)
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    # The running max m_i is taken in qk's units: raw scores (RAW_MAX) or scores scaled to log2 units first (the
    # general path). Each weight is exp2((qk - m) * qk_scale) (RAW_MAX) or exp2(qk - m): a subtraction, then a
    # multiply, so the compiler cannot contract the scaling into an FMA against a rounded max. The one-FMA form
    # exp2(fma(s, c, -round(max * c))) keeps the product's rounding error, up to half an ulp of the max (2^80 in
    # log2 units for scores near -2e31): p = inf or 0 for the row's best key, a NaN row (tuning 7.63).
    if not RAW_MAX:
        qk = qk * qk_scale
    if MASK:
        allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= hi[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
    m_cand = tl.maximum(m_i, tl.max(qk, 1))
    if LAZY:
        # FA4's lazy rescaling: keep the stale max (p <= 2^8) unless some row's max grew by more than 8 (log2 units)
        # how far some row's max grew: +inf on a row's first key (m_i = -inf), exact otherwise (a clamp of m_i to
        # -1e30 here took rows whose scores all lie below -1e30 (log2 units) for never growing: p = 0 or inf)
        grow = _log2_units(tl.where(m_cand > m_i, m_cand - m_i, 0.0), qk_scale, RAW_MAX)
        if tl.max(grow, 0) > 8.0:
            m_new = m_cand
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(_log2_units(m_i - m_use, qk_scale, RAW_MAX))
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
        else:
            m_new = m_i
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(_log2_units(qk - m_use[:, None], qk_scale, RAW_MAX))
        l_i = l_i + tl.sum(p, 1)
    else:
        m_new = m_cand
        if MASK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep exp2 finite
        else:
            m_use = m_new
        p = tl.math.exp2(_log2_units(qk - m_use[:, None], qk_scale, RAW_MAX))
        alpha = tl.math.exp2(_log2_units(m_i - m_use, qk_scale, RAW_MAX))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    nonfinite = start < 0  # (False) a masked, ragged block whose V holds NaN / Inf
    if MASK:
        kmin, kmax, lo_max, hi_min = bounds
        kload = kvalid & (kpos >= kmin) & (kpos <= kmax)  # stale rows and keys no row allows: V = 0
        if EVEN_DV:
            v = tl.load(v_ptrs, mask=kload[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=kload[:, None] & dv_mask[None, :], other=0.0)
        ragged = _ragged(start, bounds, BLOCK_N)
        if ragged:  # keys some rows allow and others do not: does V hold a non-finite entry?
            nonfinite = _any_nonfinite(v)
        if nonfinite:  # P.V without the non-finite entries; the tile's cold pass adds them to the right rows
            v = tl.where(tl.abs(v.to(tl.float32)) < float("inf"), v, 0.0).to(v.dtype)
    else:
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
    if INTERPRET:
        acc = tl.dot(cast(p, v.dtype, INTERPRET).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new, nonfinite


@triton.jit
def _bt_ids(bt_row, j, valid, seq_len, last_page, offs_n, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
            CHECK: tl.constexpr):
    """Page id(s) of key block ``j`` (int64, clamped by :func:`_page`): a scalar when a page holds whole blocks,
    else a ``[BLOCK_N]`` vector (0 for keys >= seq_len). With ``CHECK``, ``valid`` False reads nothing (an empty
    range)."""
    if PAGE % BLOCK_N == 0:
        if CHECK:
            return _page(tl.load(bt_row + (j * BLOCK_N) // PAGE, mask=valid, other=0), last_page)
        else:
            return _page(tl.load(bt_row + (j * BLOCK_N) // PAGE), last_page)
    else:
        kpos = j * BLOCK_N + offs_n
        if CHECK:
            return _page(tl.load(bt_row + kpos // PAGE, mask=(kpos < seq_len) & valid, other=0), last_page)
        else:
            return _page(tl.load(bt_row + kpos // PAGE, mask=kpos < seq_len, other=0), last_page)


@triton.jit
def _range_step(acc, l_i, m_i, had_nf, bid, q, j, j_hi, K, V, bt_row, k_base, k_head, v_head,
                stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, bounds, last_page, qk_scale,
                offs_n, offs_d, offs_dv, d_mask, dv_mask,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
                RAW_MAX: tl.constexpr, LAZY: tl.constexpr, PREF: tl.constexpr):
    """One iteration of :func:`_attn_range`: block ``j`` (page ids ``bid``, read one iteration earlier with
    ``PREF``), the next block's page ids, the NaN / Inf flag; returns the state and the next ``bid``."""
    bid_next = bid
    if PREF:
        bid_next = _bt_ids(bt_row, tl.minimum(j + 1, j_hi - 1), True, seq_len, last_page, offs_n, BLOCK_N, PAGE,
                           False)
    acc, l_i, m_i, nf = _attn_block(acc, l_i, m_i, q, j, K, V, bt_row, k_base, k_head, v_head,
                                    stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, bounds,
                                    last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                    BLOCK_N, PAGE, PAGED, MASK, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET,
                                    RAW_MAX, LAZY, bid, PREF)
    if MASK:
        had_nf = had_nf | nf
    return acc, l_i, m_i, had_nf, bid_next


@triton.jit
def _attn_range(acc, l_i, m_i, q, j_lo, j_hi, K, V, bt_row, k_base, k_head, v_head,
                stride_kb, stride_kp, stride_vb, stride_vp,
                seq_len, lo, hi, bounds, last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
                RAW_MAX: tl.constexpr, LAZY: tl.constexpr, BT_PREFETCH: tl.constexpr):
    """Key blocks ``[j_lo, j_hi)``. A pipelined ``for`` on the GPU; a ``while`` under the interpreter, whose
    ``range`` cannot take run-time tensor bounds with NumPy >= 2.3 (scalars are 1-element arrays there).
    Returns the running state and whether a masked block took NaN / Inf out of P.V (:func:`_nonfinite_pass`)."""
    # BT prefetch: the page id(s) of block j + 1 are read during block j (their latency hides behind block j's
    # math), so block j's K / V addresses do not wait on a dependent global load. Pages holding whole key blocks:
    # one scalar id; pages smaller than (or not dividing) BLOCK_N: the [BLOCK_N] vector of per-key ids, masked to
    # keys < seq_len. The interpreter runs the same indexing, so CPU tests cover it.
    PREF: tl.constexpr = BT_PREFETCH and PAGED
    bid = 0
    had_nf = j_lo != j_lo  # (False) some block's V held NaN / Inf where the tile's rows disagree (MASK only)
    if PREF:
        bid = _bt_ids(bt_row, j_lo, j_lo < j_hi, seq_len, last_page, offs_n, BLOCK_N, PAGE, True)
    if INTERPRET:
        j = j_lo
        while j < j_hi:
            acc, l_i, m_i, had_nf, bid = _range_step(
                acc, l_i, m_i, had_nf, bid, q, j, j_hi, K, V, bt_row, k_base, k_head, v_head, stride_kb, stride_kp,
                stride_vb, stride_vp, seq_len, lo, hi, bounds, last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask,
                dv_mask, BLOCK_N, PAGE, PAGED, MASK, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, RAW_MAX, LAZY, PREF)
            j += 1
    else:
        for j in range(j_lo, j_hi):
            acc, l_i, m_i, had_nf, bid = _range_step(
                acc, l_i, m_i, had_nf, bid, q, j, j_hi, K, V, bt_row, k_base, k_head, v_head, stride_kb, stride_kp,
                stride_vb, stride_vp, seq_len, lo, hi, bounds, last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask,
                dv_mask, BLOCK_N, PAGE, PAGED, MASK, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, RAW_MAX, LAZY, PREF)
    return acc, l_i, m_i, had_nf


@triton.jit
def _nonfinite_pass(dst, dst_mask, j_lo, j_hi, V, bt_row, k_base, v_head, stride_vb, stride_vp, seq_len, lo, hi,
                    bounds, last_page, offs_n, offs_dv, dv_mask, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                    PAGED: tl.constexpr, EVEN_DV: tl.constexpr, INTERPRET: tl.constexpr):
    """The cold pass of a tile whose masked blocks ``[j_lo, j_hi)`` took NaN / Inf V entries out of P.V
    (:func:`_attn_block`), run on its stored output ``dst`` (``out`` or the split's partial): each ragged
    block's V is read again and :func:`_add_nonfinite_terms` adds those entries to the rows that allow their
    keys. After the epilogue, so neither the key loops nor the accumulator hold a register for it; NaN / +-Inf
    do not depend on the normalisation."""
    kmin, kmax, _, _ = bounds
    j = j_lo
    while j < j_hi:
        start = j * BLOCK_N
        if _ragged(start, bounds, BLOCK_N):
            kpos = start + offs_n
            kvalid = kpos < seq_len
            kload = kvalid & (kpos >= kmin) & (kpos <= kmax)
            bid = 0
            if PAGED:
                if PAGE % BLOCK_N == 0:
                    bid = _page(tl.load(bt_row + start // PAGE), last_page)
                else:
                    bid = _page(tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0), last_page)
            v_ptrs = _tile_ptrs(V, bid, start, kpos, k_base, v_head, stride_vb, stride_vp, offs_n, offs_dv,
                                BLOCK_N, PAGE, PAGED)
            if EVEN_DV:
                v = tl.load(v_ptrs, mask=kload[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=kload[:, None] & dv_mask[None, :], other=0.0)
            if _any_nonfinite(v):
                _add_nonfinite_terms(dst, dst_mask, v, start, lo, hi, offs_n, BLOCK_N, INTERPRET)
        j += 1


@triton.jit
def _tile_of(CU_Q, total_q, num_seqs, n_tiles, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """This program's q tile -> (sequence b, q_start, q_len, tile index within b) (:func:`.common.tile_sequence`;
    tiles in reverse: long causal tiles at the end of a prefill first), with the query-row guard: ``q_len`` cut
    to ``total_q - q_start`` (a no-op on valid input; the caller exits for ``q_start < 0`` and for a negative tile
    index, which a non-monotone ``cu_seqlens_q`` gives the search: rows before ``q_start`` were written)."""
    t = n_tiles - 1 - tl.program_id(0)
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, tl.arange(0, 16), BLOCK_Q, SEARCH_STEPS)
    return b, q_start, tl.minimum(q_len, total_q - q_start), tile


@triton.jit
def _tile_keys(SEQ_LENS, NCQ, BT, CU_K, b, q_len, tile, split, stride_bt, window, num_splits, kv_rows, kv_cap,
               G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_Q: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr,
               NCQ_FLAGS: tl.constexpr, SPLIT: tl.constexpr):
    """A tile's keys: where they are (block-table row / first contiguous row), ``seq_len`` with the key guards
    (cut to ``[0, kv_cap]``, the block table's capacity; contiguous: ``cu_seqlens_k`` into the cache rows; no-ops on
    valid input: a negative ``seq_len`` within ``q_len`` of -2^31, e.g. an int64 2^31 wrapped by the int32 copy, made
    ``seq_len - q_len`` wrap to ~2^31, a key range past the block table: an unmasked read there and ~2^27 key blocks
    a tile), its rows ``(token i, head in group hh)`` and their validity, intervals ``[lo, hi]``, key block
    ranges and :func:`.common.tile_key_bounds`."""
    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)
    seq_len = tl.maximum(tl.minimum(tl.load(SEQ_LENS + b), kv_cap), 0)
    if not PAGED:
        k_base = tl.minimum(tl.maximum(k_base, 0), kv_rows)
        seq_len = tl.minimum(seq_len, kv_rows - k_base)
    ncq = causal_rows(NCQ, b, q_len, NCQ_FLAGS)
    offs_m = tl.arange(0, BLOCK_M)
    hh = offs_m % GP
    i = tile * BLOCK_Q + offs_m // GP
    row_valid = (i < q_len) & (hh < G)
    lo, hi = row_key_interval(i, seq_len - q_len, ncq, seq_len, window, HAS_WINDOW, PREFIX)
    a, b_mid, c_mid, d_end = key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N, SPLIT)
    bounds = tile_key_bounds(lo, hi, row_valid)
    return bt_row, k_base, seq_len, i, hh, row_valid, lo, hi, a, b_mid, c_mid, d_end, bounds


@triton.jit(noinline=True)
def _nonfinite_tile(O, OPART, V, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_vb, stride_vp, stride_vh, stride_ot,
                    stride_oh, stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits, kv_rows, kv_cap,
                    G: tl.constexpr, GP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                    N_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                    PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr,
                    NCQ_FLAGS: tl.constexpr, SPLIT: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                    INTERPRET: tl.constexpr, WIDE_KV_OFFS: tl.constexpr):
    """The cold pass of a tile whose masked blocks took NaN / Inf V entries out of P.V (:func:`_attn_block`), on
    its stored output (``out`` or the split's partial): the tile is derived again from the metadata (nothing of
    it is kept in registers across the key loops for this), then :func:`_nonfinite_pass` over its masked
    blocks."""
    kvh = tl.program_id(1) // N_DV
    split = tl.program_id(2)
    b, q_start, q_len, tile = _tile_of(CU_Q, total_q, num_seqs, n_tiles, BLOCK_Q, SEARCH_STEPS)
    bt_row, k_base, seq_len, i, hh, row_valid, lo, hi, a, b_mid, c_mid, d_end, bounds = _tile_keys(
        SEQ_LENS, NCQ, BT, CU_K, b, q_len, tile, split, stride_bt, window, num_splits, kv_rows, kv_cap, G, GP,
        BLOCK_M, BLOCK_N, BLOCK_Q, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS, SPLIT)
    head = kvh * G + hh
    offs_dv = (tl.program_id(1) % N_DV) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    tok_g = q_start.to(tl.int64) + i
    if SPLIT:
        dst = OPART + ((split.to(tl.int64) * total_q + tok_g) * num_heads + head)[:, None] * DV + offs_dv[None, :]
    else:
        dst = O + tok_g[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_dv[None, :]
    dst_mask = row_valid[:, None] & dv_mask[None, :]
    v_head = kvh.to(tl.int64) * stride_vh
    offs_n = _key_offsets(BLOCK_N, WIDE_KV_OFFS)
    EVEN_DV: tl.constexpr = BLOCK_DV * N_DV == DV
    _nonfinite_pass(dst, dst_mask, a, b_mid, V, bt_row, k_base, v_head, stride_vb, stride_vp, seq_len, lo, hi,
                    bounds, kv_rows - 1, offs_n, offs_dv, dv_mask, BLOCK_N, PAGE, PAGED, EVEN_DV, INTERPRET)
    _nonfinite_pass(dst, dst_mask, c_mid, d_end, V, bt_row, k_base, v_head, stride_vb, stride_vp, seq_len, lo, hi,
                    bounds, kv_rows - 1, offs_n, offs_dv, dv_mask, BLOCK_N, PAGE, PAGED, EVEN_DV, INTERPRET)


# Per-step integers are not specialized (divisibility by 16, == 1): a serving loop with changing batch sizes
# must not trigger recompiles (and CUDA-graph captures of several sizes share one binary).
@triton.jit(do_not_specialize=["total_q", "num_seqs", "n_tiles", "window", "num_splits", "kv_rows", "kv_cap"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, OPART, STATPART,
    CU_Q, SEQ_LENS, NCQ, BT, CU_K,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_bt,
    total_q, num_heads, num_seqs, n_tiles, window, qk_scale, num_splits, kv_rows, kv_cap,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, N_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr,
    NCQ_FLAGS: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, RAW_MAX: tl.constexpr, LAZY: tl.constexpr,
    BT_PREFETCH: tl.constexpr = False, WIDE_KV_OFFS: tl.constexpr = False, NEG_Q: tl.constexpr = False,
):
    pid1 = tl.program_id(1)
    kvh = pid1 // N_DV
    dvb = pid1 % N_DV
    split = tl.program_id(2)

    # ---- tile -> sequence (16-ary search, no host work), its rows and keys. The metadata guards (no-ops on valid
    # input: a few scalar ops) keep an unchecked call's bad cu_seqlens_q / seq_lens / cu_seqlens_k from moving a
    # row outside q / out or a key outside the caches and the block table.
    b, q_start, q_len, tile = _tile_of(CU_Q, total_q, num_seqs, n_tiles, BLOCK_Q, SEARCH_STEPS)
    if (tile < 0) | (tile * BLOCK_Q >= q_len) | (q_start < 0):
        return
    bt_row, k_base, seq_len, i, hh, row_valid, lo, hi, a, b_mid, c_mid, d_end, bounds = _tile_keys(
        SEQ_LENS, NCQ, BT, CU_K, b, q_len, tile, split, stride_bt, window, num_splits, kv_rows, kv_cap, G, GP,
        BLOCK_M, BLOCK_N, BLOCK_Q, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS, SPLIT)
    last_page = kv_rows - 1  # paged: page ids are clamped into [0, num_blocks)
    head = kvh * G + hh

    # ---- load the Q tile once
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    q_row = (q_start + i).to(tl.int64)
    q_ptrs = Q + q_row[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    if BLOCK_D == D:
        q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if NEG_Q:  # a negative scale on the raw-score path: -q (exact) and |scale|, so the max of raw scores is the
        # max of scaled ones (a constexpr: a runtime select on q cost ~100 B of spills at hd 256); the interpreter
        # negates bf16 bit patterns as integers, so it negates an fp32 copy
        if INTERPRET:
            q = (-(q.to(tl.float32))).to(q.dtype)
        else:
            q = -q
        qk_scale = -qk_scale

    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    offs_n = _key_offsets(BLOCK_N, WIDE_KV_OFFS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == D
    EVEN_DV: tl.constexpr = BLOCK_DV * N_DV == DV

    acc, l_i, m_i, nf_left = _attn_range(acc, l_i, m_i, q, a, b_mid, K, V, bt_row, k_base, k_head, v_head,
                                         stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, bounds,
                                         last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                         BLOCK_N, PAGE, PAGED, True, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, RAW_MAX,
                                         LAZY, BT_PREFETCH)
    acc, l_i, m_i, _ = _attn_range(acc, l_i, m_i, q, b_mid, c_mid, K, V, bt_row, k_base, k_head, v_head,
                                   stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, bounds,
                                   last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                   BLOCK_N, PAGE, PAGED, False, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, RAW_MAX,
                                   LAZY, BT_PREFETCH)
    acc, l_i, m_i, nf_right = _attn_range(acc, l_i, m_i, q, c_mid, d_end, K, V, bt_row, k_base, k_head, v_head,
                                          stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, bounds,
                                          last_page, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                          BLOCK_N, PAGE, PAGED, True, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, RAW_MAX,
                                          LAZY, BT_PREFETCH)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tok_g = q_start.to(tl.int64) + i
    lse_off = head.to(tl.int64) * total_q + tok_g
    if not SPLIT:
        o_ptrs = O + tok_g[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, cast(out, O.dtype.element_ty, INTERPRET), mask=row_valid[:, None] & dv_mask[None, :])
        if STORE_LSE:
            m_log2 = _log2_units(m_i, qk_scale, RAW_MAX)
            lse = tl.where(empty, float("-inf"),
                           (m_log2 + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            tl.store(LSE + lse_off, lse, mask=row_valid & (dvb == 0))
    else:
        s64 = split.to(tl.int64)
        p_row = (s64 * total_q + tok_g) * num_heads + head
        p_ptrs = OPART + p_row[:, None] * DV + offs_dv[None, :]
        tl.store(p_ptrs, out, mask=row_valid[:, None] & dv_mask[None, :])
        # the split's statistics for the merge: its running max in qk's units (raw, or log2 units) and its sum
        # relative to that max, not an LSE (whose fp32 ulp near |LSE| ~ 1000 the merge weights would inherit)
        # (int64 plane offsets: splits x heads x tokens may pass 2^31)
        tl.store(STATPART + (s64 * 2) * num_heads * total_q + lse_off, m_i, mask=row_valid & (dvb == 0))
        tl.store(STATPART + (s64 * 2 + 1) * num_heads * total_q + lse_off, l_i, mask=row_valid & (dvb == 0))
    if nf_left | nf_right:  # cold: NaN / Inf V entries of keys some rows may not see (see _attn_block)
        tl.debug_barrier()  # the tile stored above, visible to every thread of the program
        _nonfinite_tile(O, OPART, V, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_vb, stride_vp, stride_vh, stride_ot,
                        stride_oh, stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits, kv_rows,
                        kv_cap, G, GP, DV, BLOCK_DV, N_DV, BLOCK_M, BLOCK_N, BLOCK_Q, PAGE, PAGED, HAS_WINDOW,
                        PREFIX, NCQ_FLAGS, SPLIT, SEARCH_STEPS, INTERPRET, WIDE_KV_OFFS)
