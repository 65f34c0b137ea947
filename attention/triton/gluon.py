"""The warp-specialised Hopper kernels of the Triton backend (``config["IMPL"] = "gluon"``), written in Gluon.

Gluon is Triton's explicit-layout dialect (``triton.experimental.gluon``, shipped with Triton 3.6): the same
compiler, with TMA, mbarriers, ``wgmma`` and warp specialisation under the kernel's control. The varlen tile ->
sequence mapping, the per-row key intervals, the full / boundary block split, the split-KV partial layout and the
merge are the portable kernel's (:mod:`.common`); the host side is :mod:`.config` (tiles, validation,
constexprs), :mod:`.tma` (eligibility, descriptors) and :mod:`.plans` (launch). Three kernels
(:data:`KERNELS`, named by :func:`.config.kernel_variant`):

* :func:`_attn_fwd_gluon` (``"gluon"``): FlashAttention-3's structure (Shah et al., 2024, arXiv:2407.08608,
  section 3.1). One producer warp streams K / V blocks with TMA into rings of ``STAGES`` K and ``V_STAGES`` V
  shared-memory buffers (a key block spanning several pages is one TMA box per page, into slices of one buffer),
  and the consumer warpgroups (``num_warps`` = 4 or 8: 64 or 128 packed rows) load the Q tile, run QK^T and PV
  on ``wgmma`` with the online softmax in between, and store the tile, all under their raised register budget
  (setmaxnreg). The consumer order is the ``OVERLAP`` constexpr (:func:`.config.overlap_mode`):

  - 0, sequential;
  - 1, FA3's intra-warpgroup overlap in part: QK^T of key block j + 1 is issued before the softmax of block j and
    both wgmma groups retire inside the iteration (an accumulator in flight across the loop's back edge makes
    ptxas serialise every wgmma, warning C7514, so PV is not kept in flight);
  - 2, chained: the sequential consumer's registers, with PV of block j and QK^T of block j + 1 issued back to
    back and retired together (no retire / issue gap between the two wgmma groups).

  ``LAZY_RESCALE`` (FA4's conditional rescaling) applies as in the portable kernel. Two programs share an SM when
  shared memory allows and ``head_dim_v <= 128`` (:func:`.config.gluon_ctas_per_sm`).
* :func:`_attn_fwd_gluon_wide` (``"gluon_wide"``, head dims > 256: Gemma 4's global layers, hd 512). A 64 x 512
  fp32 accumulator is 256 registers a thread for one warpgroup, so two consumer warpgroups (``num_warps=8`` and
  ``BLOCK_M=64`` in the config) split the head dim: warpgroup w computes the partial QK^T over head-dim half w
  and PV into V columns half w; the two partials are summed through shared memory in the same order by both, so
  both hold the same S and the same row statistics without exchanging them, and P never leaves registers. K and V
  stream as head-dim halves with a barrier pair each, so each warpgroup releases its half independently. Q
  (64 KB), one K and one V buffer of 64 keys (64 KB each) and the exchange (32 KB) fill the 227 KB of shared
  memory.
* :func:`_attn_fwd_gluon_roles` (``"gluon_roles"``, ``OVERLAP="roles"``, the automatic hd-512 choice). FA4's
  division of labour on Blackwell, on wgmma: a softmax warpgroup runs QK^T over the whole head dim and the online
  softmax, and hands P (bf16 / fp16) with each row's rescale factor through a ring of two shared-memory slots to
  PV warpgroups (two at hd 512, 256 output columns each; one below), which rescale their accumulators and run PV
  with P from shared memory. The softmax of block j + 1 thus overlaps PV of block j, and neither warpgroup waits
  for a partial S. There is no producer warp (ptxas needs >= 154 registers a thread at launch for the 64 x 256 PV
  wgmma, which 16 warps would cap at 128): each warpgroup refills its own ring with TMA as a slot's wgmma
  retires, the softmax warpgroup chunk by chunk. At hd <= 256 one consumer warpgroup holds the whole accumulator
  and keeps P in registers, so the extra shared-memory round trip of P does not pay there.

K / V reach every kernel as 2-D TMA descriptors over the caches' token rows (:func:`.tma.make_kv_descriptors`); KV
head ``h`` starts at column ``h * KS`` of K and ``h * VS`` of V (constexprs: ``head_dim`` for separate caches, ``2 *
head_dim`` for vLLM's FlashAttention layout, which packs a token's K and V of one head into one
``[num_kv_heads, 2 * head_dim]`` row).

Keys at or beyond ``seq_len`` inside the last key block (stale cache rows, which may hold NaN) are masked to
-inf in QK^T and their V rows are zeroed in shared memory before PV, so they never reach the output.

Keys a row may not see contribute nothing, NaN / Inf V included (the contract; the portable kernel does the same,
:func:`.portable._attn_block`), here with the ``NAN_SAFE_V`` constexpr (``config["NAN_SAFE_V"]``, on by default;
off, the kernels compile to the PTX they had without the switch, and the contract's gap described next is open). Their scores are -inf, so their weight is 0, but PV multiplies the
whole V tile in shared memory and 0 * NaN = NaN: without the switch a NaN / Inf V entry of a key inside ``seq_len``
that a row may not see (a causal row's future keys on the diagonal block, keys past a window edge) reaches every row
of the tile whose key block holds it (finite V is exact). With it, full key blocks (every row allows every key) need
nothing: the clean-up sits in the masked branch the softmax already takes (docs/tuning.md 1.11). In a masked block
the warpgroup that runs PV on a V tile first cleans it in shared memory (:func:`_clean_v`): the last block's rows at
or past ``seq_len`` (stale cache rows) are zeroed, as before; the NaN / Inf entries of the others are zeroed (each
thread rewrites the chunk it loaded, in chunks small enough to sit next to the live accumulator) and their rows'
largest exponent bits are folded into a per-thread flag. After the epilogue one reduction over the warpgroup decides
whether the tile runs a cold pass (:func:`_nonfinite_fixup`), which derives the tile again from the kernel's
arguments (so nothing of it is held in registers across the key loop), reads those V rows again from global memory
(the ``V`` pointer, its row stride and rows: the TMA descriptor's view, KV head ``h`` at column ``h * VS``) and adds
each entry to the stored output of exactly the rows that allow its key, in exactly its column. Cost: the scan reads
a masked block's V tile once more from shared memory (a causal tile's diagonal blocks, a window's two edge blocks, a
sequence's last block). Off, ``V``, ``v_row_stride`` and ``v_rows`` are None (constexprs: no kernel parameters).

Unchecked metadata (``check_values=False``): K / V are read through TMA descriptors, which bounds-check (a bad page
id reads zeros), but the block-table reads follow ``seq_lens`` and the Q loads / output stores follow
``cu_seqlens_q`` unguarded: a ``seq_lens`` beyond the block table or a ``cu_seqlens_q`` beyond ``q`` is an
out-of-bounds access here (the portable kernel guards both).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import causal_rows, key_block_ranges, kv_base, row_key_interval, tile_sequence


@gluon.jit
def _kv_loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
               bt_row, k_base, a, d_end, col_k, col_v, seq_len,
               BLOCK_N: gl.constexpr, BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr,
               STAGES: gl.constexpr, V_STAGES: gl.constexpr, K_CHUNKS: gl.constexpr, V_CHUNKS: gl.constexpr):
    """Producer warp: TMA K and V blocks ``[a, d_end)`` into their rings (``STAGES`` K and ``V_STAGES`` V
    buffers; waits for a slot to be released), each block in ``K_CHUNKS`` / ``V_CHUNKS`` head-dim chunks with a
    barrier pair each (1: whole blocks; the wide kernel: 2, one per consumer warpgroup).

    A key block is ``BLOCK_N // BOX_N`` TMA boxes of ``BOX_N`` rows (a block spans several pages when the page
    is smaller than the block), one expect-tx per chunk and buffer. A box starting at or beyond ``seq_len`` reads
    the sequence's last page again (its block-table column is clamped: the table need only cover
    ``cdiv(seq_len, page_size)`` pages); those keys are masked and their V rows zeroed by the consumer."""
    for j in range(a, d_end):
        it = j - a
        _tma_key_block(k_desc, k_bufs, k_ready, k_empty, it, j, col_k, bt_row, k_base, seq_len, STAGES,
                       BLOCK_N, BOX_N, PAGE, PAGED, K_CHUNKS)
        _tma_key_block(v_desc, v_bufs, v_ready, v_empty, it, j, col_v, bt_row, k_base, seq_len, V_STAGES,
                       BLOCK_N, BOX_N, PAGE, PAGED, V_CHUNKS)


@gluon.jit
def _tma_key_block(desc, bufs, ready, empty, it, j, col, bt_row, k_base, seq_len, RING: gl.constexpr,
                   BLOCK_N: gl.constexpr, BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr,
                   CHUNKS: gl.constexpr):
    """Key block ``j`` (the ``it``-th of this program) of one cache into slot ``it % RING`` of its ring, in
    ``CHUNKS`` head-dim chunks of ``desc``'s box width, each with its own empty / ready barrier pair (index
    ``slot * CHUNKS + c``): wait for the chunk's space, one expect-tx, one TMA box per ``BOX_N`` rows."""
    slot = it % RING
    for c in gl.static_range(CHUNKS):
        mbarrier.wait(empty.index(slot * CHUNKS + c), ((it // RING) & 1) ^ 1)
        _tma_chunk(desc, bufs, ready, slot, c, j, col, bt_row, k_base, seq_len, BLOCK_N, BOX_N, PAGE, PAGED, CHUNKS)


@gluon.jit
def _tma_chunk(desc, bufs, ready, slot, c, j, col, bt_row, k_base, seq_len, BLOCK_N: gl.constexpr,
               BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, CHUNKS: gl.constexpr):
    """Head-dim chunk ``c`` of key block ``j`` into ring slot ``slot`` (its ready barrier ``slot * CHUNKS + c``):
    one expect-tx, one TMA box per ``BOX_N`` rows (see :func:`_tma_key_block`; the slot must be free)."""
    NSUB: gl.constexpr = BLOCK_N // BOX_N
    DC: gl.constexpr = desc.block_type.shape[1]
    bar = slot * CHUNKS + c
    mbarrier.expect(ready.index(bar), NSUB * desc.block_type.nbytes)
    for u in gl.static_range(NSUB):
        start = j * BLOCK_N + u * BOX_N
        if PAGED:
            row = gl.load(bt_row + gl.minimum(start, seq_len - 1) // PAGE) * PAGE + start % PAGE
        else:
            row = k_base + start
        dst = bufs.index(slot)
        if CHUNKS > 1:
            dst = dst.slice(c * DC, DC, dim=1)
        tma.async_copy_global_to_shared(desc, [row, col + c * DC], ready.index(bar), dst.slice(u * BOX_N, BOX_N))


@gluon.jit
def _program_tile(CU_Q, n_tiles, num_seqs, BLOCK_Q: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                  num_warps: gl.constexpr):
    """This program's KV head, split and q tile (tiles in reverse: the long causal tiles at the end of a prefill
    first), mapped to its sequence by :func:`.common.tile_sequence`: ``(kvh, split, b, q_start, q_len, tile)``."""
    t = n_tiles - 1 - gl.program_id(0)
    ks = gl.arange(0, 16, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, ks, BLOCK_Q, SEARCH_STEPS)
    return gl.program_id(1), gl.program_id(2), b, q_start, q_len, tile


@gluon.jit
def _tile_keys(SEQ_LENS, NCQ, b, q_len, tile, split, window, num_splits, G: gl.constexpr, GP: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, HAS_WINDOW: gl.constexpr,
               PREFIX: gl.constexpr, NCQ_FLAGS: gl.constexpr, SPLIT: gl.constexpr, row_s: gl.constexpr):
    """A tile's sequence length, causal rows and context, its rows' key intervals ``[lo, hi]`` (in the softmax's
    row layout ``row_s``; rows = (token, head in group)) and its key block ranges (:mod:`.common`'s helpers),
    for every Gluon kernel."""
    seq_len = gl.load(SEQ_LENS + b)
    ncq = causal_rows(NCQ, b, q_len, NCQ_FLAGS)
    ctx = seq_len - q_len
    offs_m = gl.arange(0, BLOCK_M, layout=row_s)
    i = tile * BLOCK_Q + offs_m // GP
    row_valid = (i < q_len) & ((offs_m % GP) < G)
    lo, hi = row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW, PREFIX)
    a, b_mid, c_mid, d_end = key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N, SPLIT)
    return seq_len, ncq, ctx, lo, hi, a, b_mid, c_mid, d_end


@gluon.jit
def _kv_rings(k_desc, v_desc, BLOCK_N: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, CHUNKS: gl.constexpr):
    """The K and V shared-memory rings and their empty / ready barriers, ``CHUNKS`` barrier pairs per buffer
    (one per head-dim chunk the loader streams, :func:`_tma_key_block`), initialised."""
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK_N, DV], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES * CHUNKS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES * CHUNKS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES * CHUNKS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES * CHUNKS, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES * CHUNKS):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=1)
    for st in gl.static_range(V_STAGES * CHUNKS):
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(v_empty.index(st), count=1)
    return k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty


@gluon.jit
def _softmax_step(qk, m_i, l_i, acc, j, lo, hi, qk_scale, masked, offs_n, BLOCK_N: gl.constexpr,
                  row_o: gl.constexpr, LAZY: gl.constexpr):
    """Online-softmax update of one key block (base 2; ``masked``: apply the per-row key interval), the
    accumulator rescaled. ``LAZY``: FA4's conditional rescaling (as the portable kernel's ``LAZY_RESCALE``): the
    running max, ``l`` and the accumulator are rescaled only when some row's max grew by more than 8 (log2
    units), else the stale max is kept (p <= 2^8; exact after normalising)."""
    if masked:
        kpos = j * BLOCK_N + offs_n
        allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= hi[:, None])
        qk = gl.where(allowed, qk, float("-inf"))
    # m_i: the running max of raw scores; weights exp2((s - m) * qk_scale), a subtraction then a multiply (the
    # portable kernel's RAW_MAX rule: no FMA against a rounded max)
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    if LAZY:
        # +inf on a row's first key (m_i = -inf), exact otherwise (the portable kernel's rule: no clamp of m_i)
        grow = gl.where(m_new > m_i, m_new - m_i, 0.0) * qk_scale
        if gl.max(grow, 0) > 8.0:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2((m_i - m_use) * qk_scale)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2((qk - m_use[:, None]) * qk_scale)
        l_i = l_i + gl.sum(p, 1)
    else:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep exp2 finite
        p = gl.exp2((qk - m_use[:, None]) * qk_scale)
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        m_i = m_new
    return p, m_i, l_i, acc


@gluon.jit
def _zero_stale_v(v_buf, j, seq_len, offs_vn, v_blk: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """Zero the V rows of block ``j`` at or beyond ``seq_len`` (stale cache rows may hold NaN; 0 * NaN = NaN), in
    column chunks of ``CHUNK`` (the whole width, or a chunk's registers next to a live accumulator). The V
    clean-up of ``NAN_SAFE_V`` off; on, :func:`_clean_v` does this in masked blocks."""
    if (j + 1) * BLOCK_N > seq_len:
        keep = ((j * BLOCK_N + offs_vn) < seq_len)[:, None]
        for c in gl.static_range(v_buf.shape[1] // CHUNK):
            part = v_buf.slice(c * CHUNK, CHUNK, dim=1)
            vv = part.load(v_blk)
            part.store(gl.where(keep, vv, gl.zeros_like(vv)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _nonfinite_bits(vv):
    """Per element of a bf16 / fp16 tile: its exponent-and-mantissa bits (int16, sign cleared), and the all-ones
    exponent they reach exactly for NaN / +-Inf (``bits >= inf_bits``)."""
    bits = vv.to(gl.int16, bitcast=True) & 0x7FFF
    if vv.dtype == gl.bfloat16:
        inf_bits: gl.constexpr = 0x7F80
    else:
        inf_bits: gl.constexpr = 0x7C00
    return bits, inf_bits


@gluon.jit
def _nf_flag_init(BLOCK_N: gl.constexpr, WIDTH: gl.constexpr):
    """The per-thread NaN / Inf flag :func:`_clean_v` accumulates over a tile's masked blocks (the largest
    exponent-and-mantissa bits seen per key row, in :func:`_clean_v`'s row layout: one element a thread): zero."""
    NW: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = min(WIDTH, max(8, min(64, 8 * 32 * NW // BLOCK_N)))
    v_blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CHUNK // 8), CHUNK // 8], [NW, 1], [1, 0])
    return gl.zeros([BLOCK_N], gl.int32, gl.SliceLayout(1, v_blk))


@gluon.jit
def _nf_flag_any(flag, dtype: gl.constexpr):
    """Whether :func:`_clean_v` met a NaN / Inf in the tile (one reduction over the warps, after the key loop)."""
    if dtype == gl.bfloat16:
        inf_bits: gl.constexpr = 0x7F80
    else:
        inf_bits: gl.constexpr = 0x7C00
    return gl.max(flag, 0) >= inf_bits


@gluon.jit
def _clean_v(v_buf, j, seq_len, flag, BLOCK_N: gl.constexpr):
    """Key block ``j``'s V in shared memory before PV, for a *masked* block only (full blocks never call this):
    rows at or past ``seq_len`` (stale cache rows, which may hold anything) and NaN / Inf entries of the others are
    zeroed; returns ``flag`` with the block's largest exponent bits per row (of rows inside ``seq_len``) folded in.

    PV multiplies the whole V tile, so a key a row may not see still enters it with weight 0, and 0 * NaN = NaN. The
    tile is rewritten in column chunks small enough to sit next to a live accumulator (8 elements a thread), each
    thread storing what it loaded (its finite entries unchanged): no reduction over the warps here, one fence and
    barrier a block. After the key loop the caller reduces ``flag`` once (:func:`_nf_flag_any`) and, when a NaN /
    Inf was met, adds those entries to exactly the rows (and columns) that allow their keys
    (:func:`_nonfinite_fixup`)."""
    # column chunks of 8 contiguous elements a thread, at most 8 a thread a chunk: after the row max, a key
    # block's rows are one element a thread (the flag's layout, :func:`_nf_flag_init`)
    NW: gl.constexpr = gl.num_warps()
    WIDTH: gl.constexpr = v_buf.shape[1]
    CHUNK: gl.constexpr = min(WIDTH, max(8, min(64, 8 * 32 * NW // BLOCK_N)))
    v_blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CHUNK // 8), CHUNK // 8], [NW, 1], [1, 0])
    keep = ((j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_blk))) < seq_len)[:, None]
    for c in gl.static_range(WIDTH // CHUNK):
        part = v_buf.slice(c * CHUNK, CHUNK, dim=1)
        vv = part.load(v_blk)
        bits, inf_bits = _nonfinite_bits(vv)
        bits = gl.where(keep, bits, gl.zeros_like(bits))
        flag = gl.maximum(flag, gl.max(bits, 1).to(gl.int32))
        part.store(gl.where(keep & (bits < inf_bits), vv, gl.zeros_like(vv)))
    fence_async_shared()
    gl.thread_barrier()
    return flag


@gluon.jit
def _opaque(x):
    """``x`` (an int32 scalar) through an inline-asm move with side effects: the compiler cannot merge what is
    computed from it with the same computation elsewhere (Triton's global loads are pure inline asm, merged
    freely across a loop)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fixup_key(kpos, v, bad, O, OPART, q_start, q_len, tile, kvh, split, ctx, ncq, seq_len, window, total_q,
               num_heads, stride_ot, stride_oh, cols, G: gl.constexpr, GP: gl.constexpr, DV: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr,
               SPLIT: gl.constexpr):
    """Add key ``kpos``'s NaN / Inf entries (``v`` where ``bad``, columns ``cols``) to the stored output rows of the
    tile that allow the key, one row at a time (scalar row intervals, :func:`.common.row_key_interval`)."""
    for r in range(0, BLOCK_M):
        i = tile * BLOCK_Q + r // GP
        hh = r % GP
        lo, hi = row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW, PREFIX)
        if (i < q_len) & (hh < G) & (lo <= kpos) & (kpos <= hi):
            tok = q_start.to(gl.int64) + i
            head = kvh * G + hh
            if SPLIT:
                ptr = OPART + ((split.to(gl.int64) * total_q + tok) * num_heads + head) * DV + cols
            else:
                ptr = O + tok * stride_ot + head.to(gl.int64) * stride_oh + cols
            cur = gl.load(ptr, mask=bad, other=0.0).to(gl.float32)
            gl.store(ptr, (cur + v).to(ptr.dtype.element_ty), mask=bad)


@gluon.jit
def _nonfinite_fixup(V, v_row_stride, v_rows, O, OPART, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_ot, stride_oh,
                     stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits,
                     G: gl.constexpr, GP: gl.constexpr, DV: gl.constexpr, VS: gl.constexpr, COL0: gl.constexpr,
                     WIDTH: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
                     PAGE: gl.constexpr,
                     PAGED: gl.constexpr, HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr, NCQ_FLAGS: gl.constexpr,
                     SPLIT: gl.constexpr, SEARCH_STEPS: gl.constexpr, NW: gl.constexpr):
    """The cold pass of a tile whose masked key blocks held NaN / Inf V entries (zeroed for PV by :func:`_clean_v`),
    run by the warps that stored output columns ``[COL0, COL0 + WIDTH)`` after their epilogue, on the stored
    output (``O``, or the split's fp32 partial): each such entry is added to exactly the rows that allow its key,
    in exactly its column (IEEE: NaN, +-Inf; an allowed key's weight is > 0 unless it underflowed, where the
    reference's ``0 * Inf`` is NaN and this gives +-Inf), as the reference's P.V gives them.

    Everything is derived again from the kernel's arguments (the tile, its key blocks, where its keys are), so
    nothing of it is held in registers across the key loop, and the pass works on scalars and one column vector
    (one element a thread) so it needs few registers; V is read from global memory (``V``: the cache as
    ``v_rows`` token rows of stride ``v_row_stride``, KV head ``h`` at column ``h * VS``: the TMA descriptor's view,
    :func:`.tma.make_kv_descriptors`, so vLLM's packed layout, whose V view starts ``head_dim`` elements into a
    row with ``VS = 2 * head_dim``, reads the same entries the TMA loads do; page ids and rows clamped into it),
    one key of the masked blocks at a time, and a key holding a non-finite entry is added to the
    rows that allow it one row at a time. Slow, and only run on a cache holding NaN / Inf."""
    # Layouts of this pass only, and the program ids through an opaque copy: every value below is computed here,
    # after the key loop, not merged with the kernel's identical computations before it (which would keep them
    # live, in registers, across the loop).
    CWN: gl.constexpr = 32 * NW
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    gl.thread_barrier()  # the epilogue's stores (another layout) are read back below
    kvh = _opaque(gl.program_id(1))
    split = _opaque(gl.program_id(2))
    t = n_tiles - 1 - _opaque(gl.program_id(0))
    ks = gl.arange(0, 16, layout=gl.BlockedLayout([2], [32], [NW], [0]))
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, ks, BLOCK_Q, SEARCH_STEPS)
    seq_len, ncq, ctx, lo, hi, a, b_mid, c_mid, d_end = _tile_keys(
        SEQ_LENS, NCQ, b, q_len, tile, split, window, num_splits, G, GP, BLOCK_M, BLOCK_N, BLOCK_Q, HAS_WINDOW,
        PREFIX, NCQ_FLAGS, SPLIT, gl.BlockedLayout([2], [32], [NW], [0]))
    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)
    last_row = v_rows - 1
    n_left = (b_mid - a) * BLOCK_N
    for c in range(0, (WIDTH + CWN - 1) // CWN):
        offs = c * CWN + gl.arange(0, CWN, layout=vec)
        in_w = offs < WIDTH
        cols = COL0 + offs
        for m in range(0, n_left + (d_end - c_mid) * BLOCK_N):  # the masked blocks' keys (full ones kept their V)
            kpos = gl.where(m < n_left, a * BLOCK_N + m, c_mid * BLOCK_N + (m - n_left))
            if kpos < seq_len:
                if PAGED:
                    page = gl.minimum(gl.maximum(gl.load(bt_row + kpos // PAGE), 0), last_row // PAGE)
                    row = page.to(gl.int64) * PAGE + kpos % PAGE
                else:
                    row = (k_base + kpos).to(gl.int64)
                row = gl.minimum(gl.maximum(row, 0), last_row)
                v = gl.load(V + row * v_row_stride + kvh * VS + cols, mask=in_w, other=0.0)
                bits, inf_bits = _nonfinite_bits(v)
                bad = in_w & (bits >= inf_bits)
                if gl.max(bad.to(gl.int32), 0) > 0:
                    _fixup_key(kpos, v.to(gl.float32), bad, O, OPART, q_start, q_len, tile, kvh, split, ctx, ncq,
                               seq_len, window, total_q, num_heads, stride_ot, stride_oh, cols, G, GP, DV, BLOCK_M,
                               BLOCK_Q, HAS_WINDOW, PREFIX, SPLIT)


@gluon.jit
def _consumer_state(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, v_blk: gl.constexpr):
    """A consumer's starting running max / sum / accumulator, the zero S operand and a key block's offsets (S's
    columns, V's rows)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs_vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_blk))
    return m_i, l_i, acc, s_zero, offs_n, offs_vn


@gluon.jit
def _qk_retired(q_smem, k_buf, ready, phase, empty, s_zero):
    """QK^T of one key block (``k_buf``: the block, or its head-dim slice) once it arrived, retired, the buffer
    released."""
    mbarrier.wait(ready, phase)
    qk = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    mbarrier.arrive(empty, count=1)
    return qk


@gluon.jit
def _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, masked, offs_n, offs_vn, v_buf, v_ready, v_phase, seq_len,
                had_nf, BLOCK_N: gl.constexpr, o_layout: gl.constexpr, v_blk: gl.constexpr, LAZY: gl.constexpr,
                NAN_SAFE_V: gl.constexpr):
    """The online-softmax update of key block ``j``, then PV issued once its V (``v_buf``: the block, or its
    column slice) arrived; returns the accumulator in flight (retire it with ``warpgroup_mma_wait``), the row
    statistics and ``had_nf``. ``NAN_SAFE_V``: a masked block's V is cleaned first (:func:`_clean_v`: stale rows
    and NaN / Inf entries zeroed) and ``had_nf``, the NaN / Inf flag (:func:`_nf_flag_init`), is updated inside
    the masked branch only (a full block passes it through untouched); off: stale rows zeroed
    (:func:`_zero_stale_v`), ``had_nf`` (an empty tuple: no value) passed through."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, j, lo, hi, qk_scale, masked, offs_n, BLOCK_N, row_o, LAZY)
    p_op = gl.convert_layout(p.to(v_buf.dtype), p_layout)
    mbarrier.wait(v_ready, v_phase)
    if NAN_SAFE_V:
        if masked:
            had_nf = _clean_v(v_buf, j, seq_len, had_nf, BLOCK_N)
    else:
        _zero_stale_v(v_buf, j, seq_len, offs_vn, v_blk, BLOCK_N, v_buf.shape[1])
    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
    return acc, m_i, l_i, had_nf


@gluon.jit
def _softmax_consumer(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                      lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                      V_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, v_blk: gl.constexpr,
                      LAZY: gl.constexpr, NAN_SAFE_V: gl.constexpr):
    """Consumer warpgroups: the online softmax over key blocks ``[a, d_end)`` (boundary blocks masked)."""
    m_i, l_i, acc, s_zero, offs_n, offs_vn = _consumer_state(BLOCK_M, BLOCK_N, DV, s_layout, o_layout, v_blk)
    had_nf = _nf_flag_init(BLOCK_N, DV) if NAN_SAFE_V else ()
    for j in range(a, d_end):
        it = j - a
        ks = it % STAGES
        vs = it % V_STAGES
        qk = _qk_retired(q_smem, k_bufs.index(ks), k_ready.index(ks), (it // STAGES) & 1, k_empty.index(ks), s_zero)
        acc, m_i, l_i, had_nf = _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, (j < b_mid) | (j >= c_mid),
                                            offs_n, offs_vn, v_bufs.index(vs), v_ready.index(vs),
                                            (it // V_STAGES) & 1, seq_len, had_nf, BLOCK_N, o_layout, v_blk, LAZY,
                                            NAN_SAFE_V)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(vs), count=1)
    return acc, l_i, m_i, had_nf


@gluon.jit
def _softmax_consumer_overlap(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                              lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
                              STAGES: gl.constexpr, V_STAGES: gl.constexpr, s_layout: gl.constexpr,
                              o_layout: gl.constexpr, v_blk: gl.constexpr, LAZY: gl.constexpr,
                              NAN_SAFE_V: gl.constexpr):
    """Consumer with part of FA3's intra-warpgroup overlap: QK^T of block j + 1 runs on the tensor cores while
    the softmax of block j runs. Both wgmma groups retire inside the iteration (an accumulator still in flight
    across the loop's back edge makes ptxas serialise every wgmma, warning C7514)."""
    m_i, l_i, acc, s_zero, offs_n, offs_vn = _consumer_state(BLOCK_M, BLOCK_N, DV, s_layout, o_layout, v_blk)
    had_nf = _nf_flag_init(BLOCK_N, DV) if NAN_SAFE_V else ()
    if d_end > a:
        qk = _qk_retired(q_smem, k_bufs.index(0), k_ready.index(0), 0, k_empty.index(0), s_zero)
        for j in range(a, d_end):
            it = j - a
            vs = it % V_STAGES
            k1 = (it + 1) % STAGES
            nxt = j + 1 < d_end
            mbarrier.wait(k_ready.index(k1), ((it + 1) // STAGES) & 1, pred=nxt)
            qk_next = warpgroup_mma(q_smem, k_bufs.index(k1).permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
            acc_t, m_i, l_i, had_nf = _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, (j < b_mid) | (j >= c_mid),
                                                  offs_n, offs_vn, v_bufs.index(vs), v_ready.index(vs),
                                                  (it // V_STAGES) & 1, seq_len, had_nf, BLOCK_N, o_layout, v_blk,
                                                  LAZY, NAN_SAFE_V)
            qk, acc = warpgroup_mma_wait(num_outstanding=0, deps=(qk_next, acc_t))
            mbarrier.arrive(k_empty.index(k1), count=1, pred=nxt)
            mbarrier.arrive(v_empty.index(vs), count=1)
    return acc, l_i, m_i, had_nf


@gluon.jit
def _softmax_consumer_chain(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                            lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
                            STAGES: gl.constexpr, V_STAGES: gl.constexpr, s_layout: gl.constexpr,
                            o_layout: gl.constexpr, v_blk: gl.constexpr, LAZY: gl.constexpr,
                            NAN_SAFE_V: gl.constexpr):
    """The sequential consumer with PV of block j and QK^T of block j + 1 issued back to back and retired together
    (``OVERLAP="chain"``): the tensor cores see the two wgmma groups without the retire / issue gap between
    them; no softmax overlaps either, so the live registers are the sequential consumer's (the last block's
    PV runs alone, outside the loop)."""
    m_i, l_i, acc, s_zero, offs_n, offs_vn = _consumer_state(BLOCK_M, BLOCK_N, DV, s_layout, o_layout, v_blk)
    had_nf = _nf_flag_init(BLOCK_N, DV) if NAN_SAFE_V else ()
    if d_end > a:
        qk = _qk_retired(q_smem, k_bufs.index(0), k_ready.index(0), 0, k_empty.index(0), s_zero)
        for j in range(a, d_end - 1):
            it = j - a
            vs = it % V_STAGES
            k1 = (it + 1) % STAGES
            acc_t, m_i, l_i, had_nf = _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, (j < b_mid) | (j >= c_mid),
                                                  offs_n, offs_vn, v_bufs.index(vs), v_ready.index(vs),
                                                  (it // V_STAGES) & 1, seq_len, had_nf, BLOCK_N, o_layout, v_blk,
                                                  LAZY, NAN_SAFE_V)
            mbarrier.wait(k_ready.index(k1), ((it + 1) // STAGES) & 1)
            qk_t = warpgroup_mma(q_smem, k_bufs.index(k1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc, qk = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, qk_t))
            mbarrier.arrive(v_empty.index(vs), count=1)
            mbarrier.arrive(k_empty.index(k1), count=1)
        j = d_end - 1
        it = j - a
        vs = it % V_STAGES
        acc, m_i, l_i, had_nf = _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, (j < b_mid) | (j >= c_mid),
                                            offs_n, offs_vn, v_bufs.index(vs), v_ready.index(vs),
                                            (it // V_STAGES) & 1, seq_len, had_nf, BLOCK_N, o_layout, v_blk, LAZY,
                                            NAN_SAFE_V)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(vs), count=1)
    return acc, l_i, m_i, had_nf


@gluon.jit
def _epilogue(acc, l_i, m_i, qk_scale, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q,
              num_heads, stride_ot, stride_oh, G: gl.constexpr, GP: gl.constexpr, DV: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, SPLIT: gl.constexpr, STORE_LSE: gl.constexpr,
              o_layout: gl.constexpr, COL0: gl.constexpr, DV_ROW: gl.constexpr, ROW_STATS: gl.constexpr):
    """Normalise and store one tile's columns ``[COL0, COL0 + DV)`` of ``DV_ROW``: ``O`` (+ ``LSE``), or the
    split's fp32 partial (+ its raw max and sum, ``STATPART`` ``[num_splits, 2, num_heads, total_q]``: the merge's
    raw-stats format, :mod:`blockdiff.attention.split_merge`); the row statistics only where ``ROW_STATS``.
    ``m_i``: the row max of raw scores, ``qk_scale`` its log2 scale."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    om = gl.arange(0, BLOCK_M, layout=row_o)
    od = COL0 + gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    oi = tile * BLOCK_Q + om // GP
    oh = kvh * G + om % GP
    o_ok = (oi < q_len) & ((om % GP) < G)
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    empty = l_o == 0.0
    out = acc / gl.where(empty, 1.0, l_o)[:, None]
    tok_g = q_start.to(gl.int64) + oi
    lse_off = oh.to(gl.int64) * total_q + tok_g
    if not SPLIT:
        o_ptrs = O + tok_g[:, None] * stride_ot + oh.to(gl.int64)[:, None] * stride_oh + od[None, :]
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_ok[:, None])
        if STORE_LSE and ROW_STATS:
            lse = gl.where(empty, float("-inf"),
                           (m_o * qk_scale + gl.log2(gl.where(empty, 1.0, l_o))) * 0.6931471805599453)
            gl.store(LSE + lse_off, lse, mask=o_ok)
    else:
        s64 = split.to(gl.int64)
        p_row = (s64 * total_q + tok_g) * num_heads + oh
        gl.store(OPART + p_row[:, None] * DV_ROW + od[None, :], out, mask=o_ok[:, None])
        if ROW_STATS:
            # the split's raw max and its sum relative to it, not an LSE (whose fp32 ulp near |LSE| ~ 1000 the
            # merge weights would inherit); int64 plane offsets
            gl.store(STATPART + (s64 * 2) * num_heads * total_q + lse_off, m_o, mask=o_ok)
            gl.store(STATPART + (s64 * 2 + 1) * num_heads * total_q + lse_off, l_o, mask=o_ok)


@gluon.jit
def _load_q(q_smem, Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, G: gl.constexpr, GP: gl.constexpr,
            D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, blk: gl.constexpr, COL0: gl.constexpr):
    """The tile's packed query rows (token, head in group), head-dim columns ``[COL0, COL0 + D)`` -> ``q_smem``,
    zero for padding rows."""
    qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    qd = COL0 + gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qi = tile * BLOCK_Q + qm // GP
    qh = kvh * G + qm % GP
    q_ok = (qi < q_len) & ((qm % GP) < G)
    q_ptrs = Q + (q_start + qi).to(gl.int64)[:, None] * stride_qt + qh.to(gl.int64)[:, None] * stride_qh \
        + qd[None, :]
    q_smem.store(gl.load(q_ptrs, mask=q_ok[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, lo, hi, a, b_mid, c_mid, d_end, seq_len,
              qk_scale, Q, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads,
              stride_qt, stride_qh, stride_ot, stride_oh, G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr,
              BLOCK_Q: gl.constexpr, SPLIT: gl.constexpr,
              STORE_LSE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
              STAGES: gl.constexpr, V_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
              v_blk: gl.constexpr, OVERLAP: gl.constexpr, LAZY: gl.constexpr,
              V, v_row_stride, v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window,
              num_splits, VS: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, HAS_WINDOW: gl.constexpr,
              PREFIX: gl.constexpr, NCQ_FLAGS: gl.constexpr, SEARCH_STEPS: gl.constexpr, NW: gl.constexpr,
              NAN_SAFE_V: gl.constexpr):
    """The default partition: the sequential (``OVERLAP`` 0), the overlapped (1) or the chained (2) consumer, then
    the epilogue, then (``NAN_SAFE_V`` only), for a tile whose masked key blocks held NaN / Inf V entries, the
    cold fix-up (:func:`_nonfinite_fixup`; its arguments from ``V`` on are kernel arguments, which cost no
    registers in the key loop).

    The Q load and the epilogue run here, under the consumer's raised register budget (setmaxnreg), not in the
    parent before / after the partitions: the loader's first K / V loads overlap the Q load, and the
    accumulator is stored without returning it across the partition boundary."""
    gl.static_assert((OVERLAP == 0) | (OVERLAP == 1) | (OVERLAP == 2), "OVERLAP: 0, 1 or 2 (overlap_mode)")
    _load_q(q_smem, Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, G, GP, D, BLOCK_M, BLOCK_Q, v_blk, 0)
    if OVERLAP == 2:
        acc, l_i, m_i, had_nf = _softmax_consumer_chain(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                                        lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale, BLOCK_M,
                                                        BLOCK_N, DV, STAGES, V_STAGES, s_layout, o_layout, v_blk,
                                                        LAZY, NAN_SAFE_V)
    elif OVERLAP == 1:
        acc, l_i, m_i, had_nf = _softmax_consumer_overlap(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                                          v_empty, lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale,
                                                          BLOCK_M, BLOCK_N, DV, STAGES, V_STAGES, s_layout, o_layout,
                                                          v_blk, LAZY, NAN_SAFE_V)
    else:
        acc, l_i, m_i, had_nf = _softmax_consumer(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, lo,
                                                  hi, a, b_mid, c_mid, d_end, seq_len, qk_scale, BLOCK_M, BLOCK_N,
                                                  DV, STAGES, V_STAGES, s_layout, o_layout, v_blk, LAZY,
                                                  NAN_SAFE_V)
    _epilogue(acc, l_i, m_i, qk_scale, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q,
              num_heads, stride_ot, stride_oh, G, GP, DV, BLOCK_M, BLOCK_Q, SPLIT, STORE_LSE, o_layout, 0, DV, True)
    if NAN_SAFE_V:
        if _nf_flag_any(had_nf, Q.dtype.element_ty):
            _nonfinite_fixup(V, v_row_stride, v_rows, O, OPART, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_ot, stride_oh,
                             stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits, G, GP, DV, VS, 0,
                             DV, BLOCK_M, BLOCK_N, BLOCK_Q, PAGE, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS, SPLIT,
                             SEARCH_STEPS, NW)


@gluon.jit(do_not_specialize=["total_q", "num_seqs", "n_tiles", "window", "num_splits", "v_rows"])
def _attn_fwd_gluon(
    Q, k_desc, v_desc, O, LSE, OPART, STATPART,
    CU_Q, SEQ_LENS, NCQ, BT, CU_K,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    total_q, num_heads, num_seqs, n_tiles, window, qk_scale, num_splits, V, v_row_stride, v_rows,
    G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, KS: gl.constexpr, VS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
    BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr,
    NCQ_FLAGS: gl.constexpr,
    SPLIT: gl.constexpr, STORE_LSE: gl.constexpr, SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, OVERLAP: gl.constexpr, LAZY: gl.constexpr,
    NAN_SAFE_V: gl.constexpr, num_warps: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DV, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # ---- tile -> sequence, per-row key intervals, key block ranges: the shared helpers (.common)
    kvh, split, b, q_start, q_len, tile = _program_tile(CU_Q, n_tiles, num_seqs, BLOCK_Q, SEARCH_STEPS, num_warps)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len, ncq, ctx, lo, hi, a, b_mid, c_mid, d_end = _tile_keys(
        SEQ_LENS, NCQ, b, q_len, tile, split, window, num_splits, G, GP, BLOCK_M, BLOCK_N, BLOCK_Q, HAS_WINDOW,
        PREFIX, NCQ_FLAGS, SPLIT, row_s)

    # ---- Q tile: shared memory (the wgmma A operand) filled by the consumer partition, so that the loader's
    # first K / V loads are in flight while Q arrives
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, D], q_sl)

    ONE: gl.constexpr = 1
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = _kv_rings(k_desc, v_desc, BLOCK_N, D, DV, STAGES,
                                                                   V_STAGES, ONE)

    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)

    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                     lo, hi, a, b_mid, c_mid, d_end, seq_len, qk_scale,
                     Q, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads,
                     stride_qt, stride_qh, stride_ot, stride_oh, G, GP, D, BLOCK_Q, SPLIT, STORE_LSE,
                     BLOCK_M, BLOCK_N, DV, STAGES, V_STAGES, s_layout, o_layout, blk, OVERLAP, LAZY,
                     V, v_row_stride, v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window,
                     num_splits, VS, PAGE, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS, SEARCH_STEPS, num_warps,
                     NAN_SAFE_V)),
        (_kv_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                      bt_row, k_base, a, d_end, kvh * KS, kvh * VS, seq_len, BLOCK_N, BOX_N, PAGE, PAGED, STAGES,
                      V_STAGES, ONE, ONE)),
    ], [1], [LOADER_REGS])


@gluon.jit
def _exchange_s(W: gl.constexpr, part, x_mine, x_other, x_ready, x_free, it, s_layout: gl.constexpr):
    """The wide kernel's partial-S exchange of key block ``it``: publish this warpgroup's partial, take the
    other's (one buffer each: wait until it was read), and sum them in the same order in both warpgroups."""
    mbarrier.wait(x_free.index(W), (it & 1) ^ 1)
    x_mine.store(part)
    gl.thread_barrier()
    mbarrier.arrive(x_ready.index(W), count=1)
    mbarrier.wait(x_ready.index(1 - W), it & 1)
    other = x_other.load(s_layout)
    gl.thread_barrier()
    mbarrier.arrive(x_free.index(1 - W), count=1)
    if W == 0:
        qk = part + other
    else:
        qk = other + part
    return qk


@gluon.jit
def _wide_half(W: gl.constexpr, q_half, x_mine, x_other, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
               x_ready, x_free,
               Q, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads,
               stride_qt, stride_qh, stride_ot, stride_oh, ctx, ncq, seq_len, window, qk_scale,
               a, b_mid, c_mid, d_end,
               G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
               HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr, SPLIT: gl.constexpr, STORE_LSE: gl.constexpr,
               LAZY: gl.constexpr, V, v_row_stride, v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs,
               n_tiles, num_splits, VS: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr,
               NCQ_FLAGS: gl.constexpr, SEARCH_STEPS: gl.constexpr, NAN_SAFE_V: gl.constexpr):
    """One consumer warpgroup of the wide kernel (``W`` = 0: the default partition, 1: a worker): QK^T over its
    head-dim half (a partial S), the partials summed through shared memory (both warpgroups then hold the same
    full S, summed in the same order, so their softmax statistics agree bit for bit), the online softmax, and PV
    into its half of the V columns, then its half of the output; then (``NAN_SAFE_V`` only), for a tile whose
    masked key blocks held NaN / Inf entries in its V half, the cold fix-up of its columns
    (:func:`_nonfinite_fixup`)."""
    DH: gl.constexpr = D // 2
    DVH: gl.constexpr = DV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DVH, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    _load_q(q_half, Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, G, GP, DH, BLOCK_M, BLOCK_Q, blk, W * DH)
    offs_m = gl.arange(0, BLOCK_M, layout=row_s)
    lo, hi = row_key_interval(tile * BLOCK_Q + offs_m // GP, ctx, ncq, seq_len, window, HAS_WINDOW, PREFIX)
    m_i, l_i, acc, s_zero, offs_n, offs_vn = _consumer_state(BLOCK_M, BLOCK_N, DVH, s_layout, o_layout, blk)
    had_nf = _nf_flag_init(BLOCK_N, DVH) if NAN_SAFE_V else ()
    for j in range(a, d_end):
        it = j - a
        ks = it % STAGES
        vs = it % V_STAGES
        part = _qk_retired(q_half, k_bufs.index(ks).slice(W * DH, DH, dim=1), k_ready.index(ks * 2 + W),
                           (it // STAGES) & 1, k_empty.index(ks * 2 + W), s_zero)
        qk = _exchange_s(W, part, x_mine, x_other, x_ready, x_free, it, s_layout)
        acc, m_i, l_i, had_nf = _softmax_pv(qk, m_i, l_i, acc, j, lo, hi, qk_scale, (j < b_mid) | (j >= c_mid),
                                            offs_n, offs_vn, v_bufs.index(vs).slice(W * DVH, DVH, dim=1),
                                            v_ready.index(vs * 2 + W), (it // V_STAGES) & 1, seq_len, had_nf,
                                            BLOCK_N, o_layout, blk, LAZY, NAN_SAFE_V)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(vs * 2 + W), count=1)
    _epilogue(acc, l_i, m_i, qk_scale, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q,
              num_heads, stride_ot, stride_oh, G, GP, DVH, BLOCK_M, BLOCK_Q, SPLIT, STORE_LSE, o_layout, W * DVH, DV,
              W == 0)
    if NAN_SAFE_V:
        if _nf_flag_any(had_nf, Q.dtype.element_ty):
            _nonfinite_fixup(V, v_row_stride, v_rows, O, OPART, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_ot, stride_oh,
                             stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits, G, GP, DV, VS,
                             W * DVH, DVH, BLOCK_M, BLOCK_N, BLOCK_Q, PAGE, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS,
                             SPLIT, SEARCH_STEPS, 4)


@gluon.jit(do_not_specialize=["total_q", "num_seqs", "n_tiles", "window", "num_splits", "v_rows"])
def _attn_fwd_gluon_wide(
    Q, k_desc, v_desc, O, LSE, OPART, STATPART,
    CU_Q, SEQ_LENS, NCQ, BT, CU_K,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    total_q, num_heads, num_seqs, n_tiles, window, qk_scale, num_splits, V, v_row_stride, v_rows,
    G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, KS: gl.constexpr, VS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
    BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr,
    NCQ_FLAGS: gl.constexpr,
    SPLIT: gl.constexpr, STORE_LSE: gl.constexpr, SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LAZY: gl.constexpr,
    NAN_SAFE_V: gl.constexpr, num_warps: gl.constexpr,
):
    """The Gluon kernel for head dims > 256 (Gemma 4 global layers: hd 512): 64 packed rows, two consumer
    warpgroups (the default partition and a worker, ``num_warps`` = 4 each) that split the head dim. Warpgroup w
    computes the partial QK^T over head-dim half w (wgmma N = BLOCK_N, not BLOCK_N / 2) and PV into V columns half
    w; the partials are summed through shared memory, so the row statistics and P need no cross-warpgroup
    exchange. The loader streams K and V blocks as two head-dim halves each, one barrier pair per half, so each
    warpgroup releases its half independently."""
    row_s: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                      instr_shape=[16, BLOCK_N, 16]))
    kvh, split, b, q_start, q_len, tile = _program_tile(CU_Q, n_tiles, num_seqs, BLOCK_Q, SEARCH_STEPS, num_warps)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len, ncq, ctx, lo, hi, a, b_mid, c_mid, d_end = _tile_keys(
        SEQ_LENS, NCQ, b, q_len, tile, split, window, num_splits, G, GP, BLOCK_M, BLOCK_N, BLOCK_Q, HAS_WINDOW,
        PREFIX, NCQ_FLAGS, SPLIT, row_s)

    DH: gl.constexpr = D // 2
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH], Q.dtype.element_ty)
    q0 = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, DH], q_sl)
    q1 = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, DH], q_sl)
    HALVES: gl.constexpr = 2
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = _kv_rings(k_desc, v_desc, BLOCK_N, D, DV, STAGES,
                                                                   V_STAGES, HALVES)
    # the partial-S exchange: an accumulator store covers 8 rows x 8 columns; 32-byte groups XOR-swizzled by
    # row % 4 put 4 rows in disjoint banks (2 wavefronts, the minimum; 8-byte groups by row % 8 take 4x that)
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, [1, 0])
    x0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], x_sl)
    x1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], x_sl)
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(x_ready.index(w), count=1)
        mbarrier.init(x_free.index(w), count=1)

    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)
    W0: gl.constexpr = 0
    W1: gl.constexpr = 1
    gl.warp_specialize([
        (_wide_half, (W0, q0, x0, x1, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, x_ready, x_free,
                      Q, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads,
                      stride_qt, stride_qh, stride_ot, stride_oh, ctx, ncq, seq_len, window, qk_scale,
                      a, b_mid, c_mid, d_end, G, GP, D, DV, BLOCK_M, BLOCK_N, BLOCK_Q, STAGES, V_STAGES,
                      HAS_WINDOW, PREFIX, SPLIT, STORE_LSE, LAZY, V, v_row_stride, v_rows, CU_Q, SEQ_LENS, NCQ, BT,
                      CU_K, stride_bt, num_seqs, n_tiles, num_splits, VS, PAGE, PAGED, NCQ_FLAGS, SEARCH_STEPS,
                      NAN_SAFE_V)),
        (_wide_half, (W1, q1, x1, x0, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, x_ready, x_free,
                      Q, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads,
                      stride_qt, stride_qh, stride_ot, stride_oh, ctx, ncq, seq_len, window, qk_scale,
                      a, b_mid, c_mid, d_end, G, GP, D, DV, BLOCK_M, BLOCK_N, BLOCK_Q, STAGES, V_STAGES,
                      HAS_WINDOW, PREFIX, SPLIT, STORE_LSE, LAZY, V, v_row_stride, v_rows, CU_Q, SEQ_LENS, NCQ, BT,
                      CU_K, stride_bt, num_seqs, n_tiles, num_splits, VS, PAGE, PAGED, NCQ_FLAGS, SEARCH_STEPS,
                      NAN_SAFE_V)),
        (_kv_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                      bt_row, k_base, a, d_end, kvh * KS, kvh * VS, seq_len, BLOCK_N, BOX_N, PAGE, PAGED, STAGES,
                      V_STAGES, HALVES, HALVES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _roles_softmax(q_smem, k_desc, k_bufs, k_ready, p_smem, a_smem, st_smem, p_ready, p_free, st_ready,
                   Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, lo, hi, a, b_mid, c_mid, d_end, qk_scale,
                   bt_row, k_base, seq_len,
                   G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, KS: gl.constexpr, KC: gl.constexpr,
                   BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, BOX_N: gl.constexpr, PAGE: gl.constexpr,
                   PAGED: gl.constexpr, STAGES: gl.constexpr, P_STAGES: gl.constexpr, s_layout: gl.constexpr):
    """The roles kernel's softmax warpgroup (the default partition). It streams its own K ring (TMA into the slot
    whose QK^T just retired, ``STAGES`` blocks ahead), loads the Q tile, and per key block runs QK^T over the whole
    head dim (``KC`` chunks) and the online softmax's statistics; P (bf16 / fp16) and the block's row rescale
    factors go to the PV warpgroups through a ring of ``P_STAGES`` shared-memory slots, and at the end the row max
    and sum. It holds no output accumulator, so it runs up to ``P_STAGES`` blocks ahead of PV."""
    DC: gl.constexpr = D // KC
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    for st in gl.static_range(STAGES):
        if a + st < d_end:
            for c in gl.static_range(KC):
                _tma_chunk(k_desc, k_bufs, k_ready, st, c, a + st, kvh * KS, bt_row, k_base, seq_len, BLOCK_N, BOX_N,
                           PAGE, PAGED, KC)
    QW: gl.constexpr = 64 if DC > 64 else DC  # Q in 64-column pieces: a whole [64, 256] load holds 64 data and
    for c in gl.static_range(KC):            # 32 address registers, which this warpgroup's budget cannot spare
        for u in gl.static_range(DC // QW):
            _load_q(q_smem.index(c).slice(u * QW, QW, dim=1), Q, q_start, q_len, tile, kvh, stride_qt, stride_qh,
                    G, GP, QW, BLOCK_M, BLOCK_Q, blk, c * DC + u * QW)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for j in range(a, d_end):
        it = j - a
        ks = it % STAGES
        qk = s_zero
        for c in gl.static_range(KC):
            mbarrier.wait(k_ready.index(ks * KC + c), (it // STAGES) & 1)
            qk = warpgroup_mma(q_smem.index(c), k_bufs.index(ks).slice(c * DC, DC, dim=1).permute((1, 0)), qk,
                               use_acc=c > 0, is_async=True)
        # each chunk's slot is refilled as soon as its QK^T group retired (chunk 0 while chunk 1 multiplies), which
        # was faster than refilling after the whole QK^T
        for c in gl.static_range(KC):
            warpgroup_mma_wait(num_outstanding=KC - 1 - c, deps=(qk,))
            if j + STAGES < d_end:
                gl.thread_barrier()  # every warp's part of the chunk's wgmma retired before any warp's TMA box
                _tma_chunk(k_desc, k_bufs, k_ready, ks, c, j + STAGES, kvh * KS, bt_row, k_base, seq_len, BLOCK_N,
                           BOX_N, PAGE, PAGED, KC)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        if (j < b_mid) | (j >= c_mid):
            kpos = j * BLOCK_N + offs_n
            allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= hi[:, None])
            qk = gl.where(allowed, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))  # raw scores (_softmax_step's rule)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep exp2 finite
        p = gl.exp2((qk - m_use[:, None]) * qk_scale)
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        ps = it % P_STAGES
        mbarrier.wait(p_free.index(ps), ((it // P_STAGES) & 1) ^ 1)
        p_smem.index(ps).store(p.to(p_smem.dtype))
        a_smem.index(ps).store(alpha)
        fence_async_shared()  # P is read by the PV warpgroups' wgmma (the async proxy)
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(ps), count=1)
    st_smem.index(0).store(m_i)  # the row max of raw scores, for the PV warpgroups' epilogue
    st_smem.index(1).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(st_ready.index(0), count=1)


@gluon.jit
def _roles_pv(W: gl.constexpr, p_smem, a_smem, st_smem, v_desc, v_bufs, v_ready, p_ready, p_free, st_ready, qk_scale, O,
              LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads, stride_ot, stride_oh, a,
              b_mid, c_mid, d_end, seq_len, bt_row, k_base, G: gl.constexpr, GP: gl.constexpr, DV: gl.constexpr,
              VS: gl.constexpr, NPV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
              BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, V_STAGES: gl.constexpr,
              P_STAGES: gl.constexpr, SPLIT: gl.constexpr, STORE_LSE: gl.constexpr, V, v_row_stride, v_rows, CU_Q,
              SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window, num_splits, HAS_WINDOW: gl.constexpr,
              PREFIX: gl.constexpr, NCQ_FLAGS: gl.constexpr, SEARCH_STEPS: gl.constexpr, NAN_SAFE_V: gl.constexpr):
    """PV warpgroup ``W`` of the roles kernel (a worker partition): V columns ``[W * DV / NPV, (W + 1) * DV / NPV)``
    of the output. It streams its own V column slice (TMA into the slot whose PV just retired, ``V_STAGES`` blocks
    ahead); per key block it waits for P and the row rescale factors, rescales its accumulator, cleans its V
    slice (``NAN_SAFE_V``: a masked block's, :func:`_clean_v`; off: the last block's stale rows,
    :func:`_zero_stale_v`) and runs PV (P from shared memory), then releases the P slot; at the end it normalises
    with the softmax warpgroup's statistics and stores its columns (the LSE from warpgroup 0 only), then
    (``NAN_SAFE_V`` only), for a tile whose masked blocks held NaN / Inf in its V slice, the cold fix-up of its
    columns (:func:`_nonfinite_fixup`)."""
    PVW: gl.constexpr = DV // NPV
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PVW, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for st in gl.static_range(V_STAGES):
        if a + st < d_end:
            _tma_chunk(v_desc, v_bufs, v_ready, st, W, a + st, kvh * VS, bt_row, k_base, seq_len, BLOCK_N, BOX_N,
                       PAGE, PAGED, NPV)
    acc = gl.zeros([BLOCK_M, PVW], gl.float32, o_layout)
    offs_vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
    had_nf = _nf_flag_init(BLOCK_N, PVW) if NAN_SAFE_V else ()
    for j in range(a, d_end):
        it = j - a
        ps = it % P_STAGES
        vs = it % V_STAGES
        mbarrier.wait(p_ready.index(ps), (it // P_STAGES) & 1)
        alpha = a_smem.index(ps).load(row_o)
        acc = acc * alpha[:, None]
        v_buf = v_bufs.index(vs)
        if NPV > 1:
            v_buf = v_buf.slice(W * PVW, PVW, dim=1)
        mbarrier.wait(v_ready.index(vs * NPV + W), (it // V_STAGES) & 1)
        if NAN_SAFE_V:
            if (j < b_mid) | (j >= c_mid):
                had_nf = _clean_v(v_buf, j, seq_len, had_nf, BLOCK_N)
        else:
            _zero_stale_v(v_buf, j, seq_len, offs_vn, blk, BLOCK_N, 64)
        acc = warpgroup_mma(p_smem.index(ps), v_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p_free.index(ps), count=1)
        if j + V_STAGES < d_end:  # the slot is free once its PV retired: refill it
            _tma_chunk(v_desc, v_bufs, v_ready, vs, W, j + V_STAGES, kvh * VS, bt_row, k_base, seq_len, BLOCK_N,
                       BOX_N, PAGE, PAGED, NPV)
    mbarrier.wait(st_ready.index(0), 0)
    m_i = st_smem.index(0).load(row_o)
    l_i = st_smem.index(1).load(row_o)
    _epilogue(acc, l_i, m_i, qk_scale, O, LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q,
              num_heads, stride_ot, stride_oh, G, GP, PVW, BLOCK_M, BLOCK_Q, SPLIT, STORE_LSE, o_layout, W * PVW, DV,
              W == 0)
    if NAN_SAFE_V:
        if _nf_flag_any(had_nf, v_desc.dtype):
            _nonfinite_fixup(V, v_row_stride, v_rows, O, OPART, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_ot, stride_oh,
                             stride_bt, total_q, num_heads, num_seqs, n_tiles, window, num_splits, G, GP, DV, VS,
                             W * PVW, PVW, BLOCK_M, BLOCK_N, BLOCK_Q, PAGE, PAGED, HAS_WINDOW, PREFIX, NCQ_FLAGS,
                             SPLIT, SEARCH_STEPS, 4)


@gluon.jit(do_not_specialize=["total_q", "num_seqs", "n_tiles", "window", "num_splits", "v_rows"])
def _attn_fwd_gluon_roles(
    Q, k_desc, v_desc, O, LSE, OPART, STATPART,
    CU_Q, SEQ_LENS, NCQ, BT, CU_K,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    total_q, num_heads, num_seqs, n_tiles, window, qk_scale, num_splits, V, v_row_stride, v_rows,
    G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, KS: gl.constexpr, VS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
    BOX_N: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, HAS_WINDOW: gl.constexpr, PREFIX: gl.constexpr,
    NCQ_FLAGS: gl.constexpr,
    SPLIT: gl.constexpr, STORE_LSE: gl.constexpr, SEARCH_STEPS: gl.constexpr, STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, PV_REGS: gl.constexpr, P_STAGES: gl.constexpr, K_CHUNKS: gl.constexpr,
    NAN_SAFE_V: gl.constexpr, num_warps: gl.constexpr,
):
    """The roles kernel (``OVERLAP="roles"``): FA4's division of labour between a softmax warpgroup and the
    warpgroups that own the output accumulator (Dao et al., FlashAttention-4, 2026; the flash-attention ``cute``
    sources), on Hopper's wgmma. The softmax warpgroup (the default partition, 4 warps) runs QK^T and the online
    softmax and hands P through shared memory to ``NPV`` PV warpgroups (2 for hd 512, else 1), each owning a
    256- (or DV-) column slice of the output accumulator, so the softmax of block j + 1 runs while the PV
    warpgroups multiply block j. There is no producer warp: ptxas needs >= 154 registers a thread at launch for the
    64 x 256 PV wgmma, which 16 warps (a padded loader warpgroup) would leave at 128; each warpgroup refills its
    own ring with TMA as a slot retires."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    KC: gl.constexpr = K_CHUNKS
    NPV: gl.constexpr = 2 if DV > 256 else 1
    gl.static_assert(k_desc.block_type.shape[1] * KC == D, "K chunks: the descriptor's box width x K_CHUNKS == D")
    gl.static_assert(v_desc.block_type.shape[1] * NPV == DV, "V chunks: the descriptor's box width x PV warpgroups")

    kvh, split, b, q_start, q_len, tile = _program_tile(CU_Q, n_tiles, num_seqs, BLOCK_Q, SEARCH_STEPS, num_warps)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len, ncq, ctx, lo, hi, a, b_mid, c_mid, d_end = _tile_keys(
        SEQ_LENS, NCQ, b, q_len, tile, split, window, num_splits, G, GP, BLOCK_M, BLOCK_N, BLOCK_Q, HAS_WINDOW,
        PREFIX, NCQ_FLAGS, SPLIT, row_s)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // KC], Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [KC, BLOCK_M, D // KC], q_sl)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK_N, DV], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES * KC, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES * NPV, 1], mbarrier.MBarrierLayout())
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], Q.dtype.element_ty)
    p_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [P_STAGES, BLOCK_M, BLOCK_N], p_sl)
    r_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_smem = gl.allocate_shared_memory(gl.float32, [P_STAGES, BLOCK_M], r_sl)
    st_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], r_sl)
    p_ready = gl.allocate_shared_memory(gl.int64, [P_STAGES, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [P_STAGES, 1], mbarrier.MBarrierLayout())
    st_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES * KC):
        mbarrier.init(k_ready.index(st), count=1)
    for st in gl.static_range(V_STAGES * NPV):
        mbarrier.init(v_ready.index(st), count=1)
    for st in gl.static_range(P_STAGES):
        mbarrier.init(p_ready.index(st), count=1)
        mbarrier.init(p_free.index(st), count=NPV)
    mbarrier.init(st_ready.index(0), count=1)

    bt_row, k_base = kv_base(BT, CU_K, b, stride_bt, PAGED)
    W0: gl.constexpr = 0
    W1: gl.constexpr = 1
    if NPV == 2:
        gl.warp_specialize([
            (_roles_softmax, (q_smem, k_desc, k_bufs, k_ready, p_smem, a_smem, st_smem, p_ready, p_free, st_ready,
                              Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, lo, hi, a, b_mid, c_mid, d_end,
                              qk_scale, bt_row, k_base, seq_len, G, GP, D, KS, KC, BLOCK_M, BLOCK_N, BLOCK_Q, BOX_N, PAGE,
                              PAGED, STAGES, P_STAGES, s_layout)),
            (_roles_pv, (W0, p_smem, a_smem, st_smem, v_desc, v_bufs, v_ready, p_ready, p_free, st_ready, qk_scale, O,
                         LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads, stride_ot,
                         stride_oh, a, b_mid, c_mid, d_end, seq_len, bt_row, k_base, G, GP, DV, VS, NPV, BLOCK_M,
                         BLOCK_N, BLOCK_Q, BOX_N, PAGE, PAGED, V_STAGES, P_STAGES, SPLIT, STORE_LSE, V, v_row_stride,
                         v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window, num_splits,
                         HAS_WINDOW, PREFIX, NCQ_FLAGS, SEARCH_STEPS, NAN_SAFE_V)),
            (_roles_pv, (W1, p_smem, a_smem, st_smem, v_desc, v_bufs, v_ready, p_ready, p_free, st_ready, qk_scale, O,
                         LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads, stride_ot,
                         stride_oh, a, b_mid, c_mid, d_end, seq_len, bt_row, k_base, G, GP, DV, VS, NPV, BLOCK_M,
                         BLOCK_N, BLOCK_Q, BOX_N, PAGE, PAGED, V_STAGES, P_STAGES, SPLIT, STORE_LSE, V, v_row_stride,
                         v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window, num_splits,
                         HAS_WINDOW, PREFIX, NCQ_FLAGS, SEARCH_STEPS, NAN_SAFE_V)),
        ], [4, 4], [PV_REGS, PV_REGS])
    else:
        gl.warp_specialize([
            (_roles_softmax, (q_smem, k_desc, k_bufs, k_ready, p_smem, a_smem, st_smem, p_ready, p_free, st_ready,
                              Q, q_start, q_len, tile, kvh, stride_qt, stride_qh, lo, hi, a, b_mid, c_mid, d_end,
                              qk_scale, bt_row, k_base, seq_len, G, GP, D, KS, KC, BLOCK_M, BLOCK_N, BLOCK_Q, BOX_N, PAGE,
                              PAGED, STAGES, P_STAGES, s_layout)),
            (_roles_pv, (W0, p_smem, a_smem, st_smem, v_desc, v_bufs, v_ready, p_ready, p_free, st_ready, qk_scale, O,
                         LSE, OPART, STATPART, q_start, q_len, tile, kvh, split, total_q, num_heads, stride_ot,
                         stride_oh, a, b_mid, c_mid, d_end, seq_len, bt_row, k_base, G, GP, DV, VS, NPV, BLOCK_M,
                         BLOCK_N, BLOCK_Q, BOX_N, PAGE, PAGED, V_STAGES, P_STAGES, SPLIT, STORE_LSE, V, v_row_stride,
                         v_rows, CU_Q, SEQ_LENS, NCQ, BT, CU_K, stride_bt, num_seqs, n_tiles, window, num_splits,
                         HAS_WINDOW, PREFIX, NCQ_FLAGS, SEARCH_STEPS, NAN_SAFE_V)),
        ], [4], [PV_REGS])


#: The Gluon kernels by :func:`.config.kernel_variant` name.
KERNELS = {"gluon": _attn_fwd_gluon, "gluon_wide": _attn_fwd_gluon_wide, "gluon_roles": _attn_fwd_gluon_roles}

__all__ = ["KERNELS"]
