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
  are widened to int64 before multiplying strides. Contiguous varlen form via ``cu_seqlens_k``.
* **Block-table prefetch (``BT_PREFETCH``).** Block j + 1's page id(s) are read while block j is computed, so
  K / V addresses never wait on a dependent block-table load.
* **Numerics.** Scores ``q.k`` in fp32 from ``tl.dot`` (bf16/fp16 operands, fp32 acc; fp32 inputs use
  ``input_precision="ieee"``); with ``scale > 0`` (``SCALE_POS``) the running max is taken on raw scores and
  ``exp2(s * scale * log2(e) - m)`` is one FMA per score (other scales multiply first). The running max is made
  finite (0) while a row has seen no allowed key, so fully masked rows / blocks never produce ``-inf - -inf``.
  Rows with no key: out 0, lse -inf. Under the interpreter (CPU CI) bf16 dots run on fp32 copies of the bf16
  values and fp32 -> bf16 casts round to nearest even by hand (the interpreter multiplies bf16 bit patterns and
  truncates casts).
* **Lazy rescaling (``LAZY_RESCALE``).** FA4's trick: the accumulator is rescaled only when some row's max grew by
  more than 8 (log2 units); otherwise the stale max is kept (p <= 2^8, exact after normalising).
* **V head-dim slices.** ``BLOCK_DV < head_dim_v`` splits the V head dim across programs (QK^T recomputed per
  slice): how hd 512 fits the registers (a 64 x 512 fp32 accumulator is 128 registers a thread).
* **Split-KV.** With ``SPLIT`` each program takes its split's share of the tile's key blocks and writes a fp32
  partial and its LSE; :func:`.common._merge_kernel` merges them. Without, it writes ``out`` (and ``lse``).
"""
import triton
import triton.language as tl

from .common import cast, causal_rows, key_block_ranges, kv_base, row_key_interval, tile_sequence


@triton.jit
def _attn_block(acc, l_i, m_i, q, j, K, V, bt_row, k_base, k_head, v_head,
                stride_kb, stride_kp, stride_vb, stride_vp,
                seq_len, lo, hi, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
                SCALE_POS: tl.constexpr, LAZY: tl.constexpr, bid_in, BT_PREFETCH: tl.constexpr):
    """One key block of the online softmax (MASK: boundary block with elementwise mask and bounds).
    ``bid_in``: the block's page id (scalar) or per-key page ids ([BLOCK_N]), read one iteration earlier by
    :func:`_attn_range` (BT_PREFETCH)."""
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
                bid = tl.load(bt_row + start // PAGE).to(tl.int64)
            in_page = (start % PAGE).to(tl.int64)
            k_ptrs = (K + (bid * stride_kb + in_page * stride_kp + k_head)) + \
                (offs_n[:, None] * stride_kp + offs_d[None, :])
            v_ptrs = (V + (bid * stride_vb + in_page * stride_vp + v_head)) + \
                (offs_n[:, None] * stride_vp + offs_dv[None, :])
        else:
            if BT_PREFETCH:
                bid = bid_in  # [BN] page ids, read one block earlier (0 beyond seq_len)
            elif MASK:
                bid = tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0).to(tl.int64)
            else:
                bid = tl.load(bt_row + kpos // PAGE).to(tl.int64)
            poff = (kpos % PAGE).to(tl.int64)
            row_k = bid * stride_kb + poff * stride_kp
            row_v = bid * stride_vb + poff * stride_vp
            k_ptrs = K + k_head + row_k[:, None] + offs_d[None, :]
            v_ptrs = V + v_head + row_v[:, None] + offs_dv[None, :]
    else:
        tok0 = (k_base + start).to(tl.int64)
        k_ptrs = (K + (tok0 * stride_kb + k_head)) + (offs_n[:, None] * stride_kb + offs_d[None, :])
        v_ptrs = (V + (tok0 * stride_vb + v_head)) + (offs_n[:, None] * stride_vb + offs_dv[None, :])
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
    # block row max in log2 units; SCALE_POS: max over raw scores, then one FMA per score inside exp2
    # (scale > 0 keeps the argmax and -inf); otherwise scale first
    if not SCALE_POS:
        qk = qk * qk_scale
    if MASK:
        allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= hi[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
    if SCALE_POS:
        m_cand = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    else:
        m_cand = tl.maximum(m_i, tl.max(qk, 1))
    if LAZY:
        # FA4's lazy rescaling: keep the stale max (p <= 2^8) unless some row's max grew by more than 8
        grow = tl.where(m_cand > m_i, m_cand - tl.maximum(m_i, -1e30), 0.0)  # huge on a row's first key
        if tl.max(grow, 0) > 8.0:
            m_new = m_cand
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
        else:
            m_new = m_i
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if SCALE_POS:
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            p = tl.math.exp2(qk - m_use[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        m_new = m_cand
        if MASK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep exp2 finite
        else:
            m_use = m_new
        if SCALE_POS:
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    if MASK:
        if EVEN_DV:
            v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=kvalid[:, None] & dv_mask[None, :], other=0.0)
    else:
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
    if INTERPRET:
        acc = tl.dot(cast(p, v.dtype, INTERPRET).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _bt_ids(bt_row, j, valid, seq_len, offs_n, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CHECK: tl.constexpr):
    """Page id(s) of key block ``j`` (int64): a scalar when a page holds whole blocks, else a ``[BLOCK_N]`` vector
    (0 for keys >= seq_len). With ``CHECK``, ``valid`` False reads nothing (an empty range)."""
    if PAGE % BLOCK_N == 0:
        if CHECK:
            return tl.load(bt_row + (j * BLOCK_N) // PAGE, mask=valid, other=0).to(tl.int64)
        else:
            return tl.load(bt_row + (j * BLOCK_N) // PAGE).to(tl.int64)
    else:
        kpos = j * BLOCK_N + offs_n
        if CHECK:
            return tl.load(bt_row + kpos // PAGE, mask=(kpos < seq_len) & valid, other=0).to(tl.int64)
        else:
            return tl.load(bt_row + kpos // PAGE, mask=kpos < seq_len, other=0).to(tl.int64)


@triton.jit
def _attn_range(acc, l_i, m_i, q, j_lo, j_hi, K, V, bt_row, k_base, k_head, v_head,
                stride_kb, stride_kp, stride_vb, stride_vp,
                seq_len, lo, hi, qk_scale, offs_n, offs_d, offs_dv, d_mask, dv_mask,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
                SCALE_POS: tl.constexpr, LAZY: tl.constexpr, BT_PREFETCH: tl.constexpr):
    """Key blocks ``[j_lo, j_hi)``. A pipelined ``for`` on the GPU; a ``while`` under the interpreter, whose
    ``range`` cannot take run-time tensor bounds with NumPy >= 2.3 (scalars are 1-element arrays there)."""
    # BT prefetch: the page id(s) of block j + 1 are read during block j (their latency hides behind block j's
    # math), so block j's K / V addresses do not wait on a dependent global load. Pages holding whole key blocks:
    # one scalar id; pages smaller than (or not dividing) BLOCK_N: the [BLOCK_N] vector of per-key ids, masked to
    # keys < seq_len. The interpreter runs the same indexing, so CPU tests cover it.
    PREF: tl.constexpr = BT_PREFETCH and PAGED
    bid = 0
    if PREF:
        bid = _bt_ids(bt_row, j_lo, j_lo < j_hi, seq_len, offs_n, BLOCK_N, PAGE, True)
    if INTERPRET:
        j = j_lo
        while j < j_hi:
            bid_next = bid
            if PREF:
                bid_next = _bt_ids(bt_row, tl.minimum(j + 1, j_hi - 1), True, seq_len, offs_n,
                                   BLOCK_N, PAGE, False)
            acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, j, K, V, bt_row, k_base, k_head, v_head,
                                        stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, qk_scale,
                                        offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                        BLOCK_N, PAGE, PAGED, MASK, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET,
                                        SCALE_POS, LAZY, bid, PREF)
            bid = bid_next
            j += 1
    else:
        for j in range(j_lo, j_hi):
            bid_next = bid
            if PREF:
                bid_next = _bt_ids(bt_row, tl.minimum(j + 1, j_hi - 1), True, seq_len, offs_n,
                                   BLOCK_N, PAGE, False)
            acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, j, K, V, bt_row, k_base, k_head, v_head,
                                        stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, qk_scale,
                                        offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                        BLOCK_N, PAGE, PAGED, MASK, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET,
                                        SCALE_POS, LAZY, bid, PREF)
            bid = bid_next
    return acc, l_i, m_i



# Per-step integers are not specialized (divisibility by 16, == 1): a serving loop with changing batch sizes
# must not trigger recompiles (and CUDA-graph captures of several sizes share one binary).
@triton.jit(do_not_specialize=["total_q", "num_seqs", "n_tiles", "window", "num_splits"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, OPART, LSEPART,
    CU_Q, SEQ_LENS, NCQ, BT, CU_K,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_ot, stride_oh, stride_bt,
    total_q, num_heads, num_seqs, n_tiles, window, qk_scale, num_splits,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, N_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr,
    NCQ_FLAGS: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, SCALE_POS: tl.constexpr, LAZY: tl.constexpr,
    BT_PREFETCH: tl.constexpr = False,
):
    t = n_tiles - 1 - tl.program_id(0)  # reverse: long causal tiles (end of a prefill) first
    pid1 = tl.program_id(1)
    kvh = pid1 // N_DV
    dvb = pid1 % N_DV
    split = tl.program_id(2)

    # ---- tile -> sequence (16-ary search, no host work)
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, tl.arange(0, 16), BLOCK_Q, SEARCH_STEPS)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + b)
    ncq = causal_rows(NCQ, b, q_len, NCQ_FLAGS)
    ctx = seq_len - q_len

    # ---- rows = (token, head in group)
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GP
    hh = offs_m % GP
    i = tile * BLOCK_Q + tok
    row_valid = (i < q_len) & (hh < G)
    head = kvh * G + hh
    lo, hi = row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW, PREFIX)
    a, b_mid, c_mid, d_end = key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N, SPLIT)

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

    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == D
    EVEN_DV: tl.constexpr = BLOCK_DV * N_DV == DV

    acc, l_i, m_i = _attn_range(acc, l_i, m_i, q, a, b_mid, K, V, bt_row, k_base, k_head, v_head,
                                stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, qk_scale,
                                offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                BLOCK_N, PAGE, PAGED, True, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, SCALE_POS,
                                LAZY, BT_PREFETCH)
    acc, l_i, m_i = _attn_range(acc, l_i, m_i, q, b_mid, c_mid, K, V, bt_row, k_base, k_head, v_head,
                                stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, qk_scale,
                                offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                BLOCK_N, PAGE, PAGED, False, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, SCALE_POS,
                                LAZY, BT_PREFETCH)
    acc, l_i, m_i = _attn_range(acc, l_i, m_i, q, c_mid, d_end, K, V, bt_row, k_base, k_head, v_head,
                                stride_kb, stride_kp, stride_vb, stride_vp, seq_len, lo, hi, qk_scale,
                                offs_n, offs_d, offs_dv, d_mask, dv_mask,
                                BLOCK_N, PAGE, PAGED, True, EVEN_D, EVEN_DV, DOT_PREC, INTERPRET, SCALE_POS,
                                LAZY, BT_PREFETCH)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tok_g = q_start.to(tl.int64) + i
    lse_off = head.to(tl.int64) * total_q + tok_g
    if not SPLIT:
        o_ptrs = O + tok_g[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, cast(out, O.dtype.element_ty, INTERPRET), mask=row_valid[:, None] & dv_mask[None, :])
        if STORE_LSE:
            tl.store(LSE + lse_off, lse, mask=row_valid & (dvb == 0))
    else:
        s64 = split.to(tl.int64)
        p_row = (s64 * total_q + tok_g) * num_heads + head
        p_ptrs = OPART + p_row[:, None] * DV + offs_dv[None, :]
        tl.store(p_ptrs, out, mask=row_valid[:, None] & dv_mask[None, :])
        tl.store(LSEPART + s64 * num_heads * total_q + lse_off, lse, mask=row_valid & (dvb == 0))

