"""Triton backend of the blockdiff attention contract (backend ``"triton"``): one fused varlen launch.

Semantics: ARCHITECTURE.md "Attention semantics" (oracle: :mod:`blockdiff.attention.reference`). The algorithm
is FlashAttention-2's online softmax (Dao, 2023, arXiv:2307.08691) in the base-2 form of the Triton fused
attention tutorial, with flash-decoding's split-KV and exact LSE merge (Dao et al., 2023, "Flash-Decoding for
long-context inference") and vLLM's ``triton_unified_attention`` device-side tile -> sequence mapping.

Design
------
* **One launch, mixed row types.** Grid ``(n_tiles, num_kv_heads * n_dv_blocks, num_splits)`` with
  ``n_tiles = total_q // BLOCK_Q + B`` (host shapes only). Program ``t`` finds its sequence by a 16-ary search
  (16 candidates per dependent load) over the virtual tile starts ``cu_seqlens_q[b] // BLOCK_Q + b`` (monotone
  in b; each sequence owns
  ``>= cdiv(q_len, BLOCK_Q)`` virtual tiles, surplus programs exit at once). No host sync, no cumsum op.
  Tiles are visited in reverse so the long causal tiles at the end of a prefill start first.
  The causal flag is ``num_causal_q[b]`` read on the device (``causal`` is converted by validation), so a
  tile may mix causal and bidirectional rows (stretch goal of the contract).
* **GQA packing.** A tile's ``BLOCK_M`` rows are ``(token, head-in-group)`` pairs: ``BLOCK_Q = BLOCK_M // GP``
  tokens x ``GP`` heads (GP = group size rounded up to a power of two; padding heads are masked). K/V of a
  KV head are read once for the whole group.
* **Tile skipping for every row type.** Each row allows one key interval ``[lo, hi]`` (masks.key_range). The
  kernel computes it per row and takes ``kmin = min lo``, ``kmax = max hi`` over the tile's valid rows: it
  visits only key blocks in ``[kmin, kmax]`` (causal diagonal, sliding window on both sides, prefix window,
  mixed tiles). Blocks inside ``[max lo, min hi]`` are *full* (no elementwise mask, no bounds checks); only
  the boundary blocks before/after them run the masked path (three loops, a constexpr MASK flag).
* **Paged KV, any page size.** A key block of BLOCK_N keys: when ``page_size % BLOCK_N == 0`` one scalar
  block-table read per block, otherwise one vector read of the page ids (pages of 1, 16, ... or not dividing
  the tile). Block ids are widened to int64 before multiplying strides. Contiguous varlen form via
  ``cu_seqlens_k``.
* **Numerics.** Scores ``q.k`` in fp32 from ``tl.dot`` (bf16/fp16 operands, fp32 acc; fp32 inputs use
  ``input_precision="ieee"``); the running max is taken on raw scores and ``exp2(s * scale * log2(e) - m)`` is one
  FMA per score (scale > 0; other scales multiply first). The running max is made finite (0) while a row has
  seen no allowed key, so fully masked rows/blocks never produce ``-inf - -inf``. Rows with no key: out 0,
  lse -inf. Under the interpreter (CPU CI) bf16 dots run on fp32 copies of the bf16 values and fp32 -> bf16
  casts round to nearest even by hand (the interpreter multiplies bf16 bit patterns and truncates casts).
* **No recompiles per step.** Per-step integers (total_q, B, tile count, window, split count) are excluded from
  Triton's integer specialization; the tile -> sequence search takes ceil(bits(B) / 4) 16-ary steps, so batches
  of 1-15 (16-255, ...) sequences share one compiled kernel.
* **Split-KV.** For few long sequences (e.g. one 256-token canvas over 32k context: 8 tiles of 64 rows x 8 KV
  heads = 64 programs) the key-block range of each tile is cut into ``num_splits`` chunks (chosen from host
  shapes: programs vs resident-program slots, SM count x :func:`ctas_per_sm`, and the key capacity; 4 there).
  Partials (normalised out in fp32 + LSE) are merged exactly by a second small kernel. ``num_splits = 1``
  writes ``out`` directly.
* **head_dim 512** (Gemma 4 global layers, 2 KV heads for 16 q heads). Automatically the Gluon roles kernel (a
  softmax warpgroup hands P to two PV warpgroups of 256 output columns each; ``OVERLAP="roles"``,
  :mod:`blockdiff.attention.triton.gluon`); its wide variant (two consumer warpgroups split the head dim,
  ``OVERLAP=False``) stays selectable. The portable
  kernel (``IMPL="triton"``, or inputs TMA cannot read) keeps either the whole V head dim per program
  (``BLOCK_M 64, BLOCK_N 32``, 8 warps: the fp32 accumulator is 64x512 = 128 registers/thread) or
  ``BLOCK_DV < head_dim_v`` splits the V head dim across programs (QK^T recomputed per V slice).
* **Registers.** Pre-screened offline (sm_90a compile + ``ptxas -v``, bench/results/triton_configs.md): Q sits in
  shared memory as the wgmma A operand, P in registers; a key block in one page uses a scalar base pointer
  plus loop-invariant int32 tile offsets (building [BLOCK_N, D] int64 pointers spilled 1-2.5 KB at hd 512).
* **Block-table prefetch (``BT_PREFETCH``, default on).** Block j + 1's page id (a scalar when a page holds
  whole key blocks; the ``[BLOCK_N]`` per-key ids when pages are smaller than or do not divide BLOCK_N) is read
  while block j is computed, so K / V addresses never wait on a dependent block-table load
  (H200 same-run A/B: prefill16k_hd128 paged 2.909 -> 2.430 ms, canvas_bs4_ctx4k_hd128 0.112 -> 0.091 ms,
  mixed_sliding_ctx8k 0.239 -> 0.215 ms; the paged path had been 16-29 % slower than the contiguous one).
* **Lazy rescaling (opt-in, ``LAZY_RESCALE``).** FA4's trick: the accumulator is rescaled only when some row's
  max grew by more than 8 (log2 units); otherwise the stale max is kept (p <= 2^8, exact after normalising).
* **Warp-specialised Gluon kernel (``IMPL="gluon"``, :mod:`blockdiff.attention.triton.gluon`).** The same tile
  mapping, row intervals, boundary/full split and split-KV partials, written in Gluon (Triton's explicit-layout
  dialect): a producer warp streams K / V with TMA into mbarrier rings (``num_stages`` K and ``V_STAGES`` V
  buffers; a key block spanning several pages is one TMA box per page), consumer warpgroups run ``wgmma``,
  optionally with QK^T of block j + 1 overlapping the softmax of block j (``OVERLAP=True``) or with PV of block j
  and QK^T of block j + 1 issued back to back (``OVERLAP="chain"``, the hd-128 choice). ``OVERLAP="roles"`` (the
  hd-512 choice) is a separate kernel without a producer warp: a softmax warpgroup runs QK^T and the softmax and
  hands P with the row rescale factors through shared memory to PV warpgroups that own the output (FA4's
  division of labour on wgmma). Head dims > 256 otherwise run the wide variant, two consumer warpgroups
  splitting the head dim. Chosen automatically where it measured
  faster (:data:`TUNED_GLUON_CONFIGS`: hd 128, hd 512, and the hd-256 split regime) when the caches suit TMA
  (evenly strided pages of >= 64 tokens holding or tiling BLOCK_N, bf16/fp16, sm_90); ``LAST_LAUNCH["impl"]``
  says which kernel ran. ``config={"IMPL": "gluon"}`` on an input it cannot take raises ``ValueError`` (no
  silent fallback).
* **Configs.** ``config=dict(BLOCK_M, BLOCK_N, num_warps, num_stages, num_splits, BLOCK_DV, LAZY_RESCALE,
  BT_PREFETCH, IMPL, OVERLAP, V_STAGES)``
  overrides the defaults; resolved configs are cached per static key (head dims, group size, dtype, paged,
  page size, window, mode) in :class:`TritonAttention` instances; Triton caches the compiled kernels per constexpr.
  Calls with ``check_values=False`` also cache their whole launch (``_PLANS``, see :func:`attention_triton`).
* **CUDA graphs.** Everything per step (cu_seqlens_q, seq_lens, num_causal_q/causal, block_table) is read on
  the device; grid and split count depend only on shapes and host ints (``max_seqlen_k``), so a graph captured
  once replays correctly with new flags, lengths and block tables (the capacities must not grow).

Predictions (H200, bf16; ceilings ~790 TFLOP/s dense bf16, ~4.3 TB/s; FLOPs = 4 H D pairs)
------------------------------------------------------------------------------------------
* ``mixed_sliding_ctx8k`` (hd 256, H 16/8, W 1023): ~4.5 M allowed pairs/head -> 74 GFLOP; K/V read
  ~ (4096 + 3 x 1280) keys x 8 heads x 256 x 2 B x 2 = 33 MB (~8 us). Compute bound: at ~400 TFLOP/s
  effective ~0.19 ms (target 0.205 ms). Boundary (masked) blocks are ~2-3 of ~18 per tile.
* ``mixed_global_ctx8k`` (hd 512, H 16/2, no window): pairs ~ 8.4 M (prefill) + 3 x 256 x 8.4 k -> ~15 M x
  4 x 16 x 512 = 0.49 TFLOP; at ~450 TFLOP/s -> ~1.1 ms. The hardest shape for Triton (register pressure).
* ``canvas_bs1_ctx32k_hd128``: 256 x 33 k pairs x 4 x 16 x 128 = 68.7 GFLOP, K/V 134 MB (~31 us at
  4.3 TB/s, read once per q tile but L2-shared across tiles) -> compute bound, needs split-KV (40 programs
  without it): ~0.14-0.17 ms at 400-500 TFLOP/s.
* ``canvas_bs1_ctx32k_sliding``: 256 rows x ~1150 keys -> 4.8 GFLOP, 10.5 MB of K/V: ~8-15 us, launch and
  latency bound (two kernels with the merge).
* ``prefill16k_hd128``: 134 M pairs x 8192 FLOP = 1.1 TFLOP; at 450 TFLOP/s ~2.4 ms (target 2.47 ms).

Measured (H200, CUDA-graph medians, 100 ms do_bench windows, paged KV page 64, same run as FA4 at dcaa61f:
bench/results/attention-targets-h200.json; the f928727 run in brackets. The H200 runs 1.7-1.98 GHz in these
windows; run to run the hd-512 and hd-128 rows move by up to ~8 %: bench/results/clock_windows-h200.md)
------------------------------------------------------------------------------------------------------
* ``mixed_sliding_ctx8k`` 0.200 ms, 370 TFLOP/s, portable kernel [0.201] (FA4 0.165 paged / 0.164 contiguous:
  1.21x / 1.22x): 128-row tiles of 8 warps hold one program per SM at 255 registers, and the 608 programs make 4.6
  waves. The Gluon kernel measured 0.250 ms here (64-row hd-256 tiles, one program per SM).
* ``mixed_global_ctx8k`` 1.034 ms, 471 TFLOP/s (the issue asks >= 450), the Gluon roles kernel 64x64 with one K
  and one V buffer and two P slots (dcaa61f, attention-targets-h200.json). Across this session's processes it read
  0.959-1.040 ms (507-468 TFLOP/s; gluon_roles_early.md, gluon_roles_kc.md); the wide kernel it replaced read
  1.091-1.102 ms in the gluon_roles_early processes, where the roles kernel read 1.001-1.040 ms, and 1.100 ms in
  the previous targets run (f928727). On the global-layer ladders (attention-roles_{batch,ctx}_ladder_global-h200
  .json, same run): 6.8-11 % less time at 1-32 canvases over 8k, 6.3-11 % at 4k-128k contexts, 1.5 / 3.6 % at
  1k / 2k. The portable kernel measured 2.00 ms, 243 TFLOP/s: it keeps 128 x
  256 fp32 accumulator elements per V slice in registers (255 per thread, one program per SM) and recomputes
  QK^T for each of the two V slices.
* ``canvas_bs1_ctx32k_hd128`` 0.131 ms, 527 TFLOP/s, Gluon kernel 64x128 with the chained consumer, 4 splits
  [0.134]: 0.32x paged FA4 (0.406), 0.38x contiguous FA4 (0.345). The merge runs with programmatic dependent
  launch (PDL; three alternating rounds: 131-134 against 133-135 us without, a gain within the run noise;
  bench/results/merge_pdl-h200.md). Eager (no graph), calls with ``check_values=False`` reuse a launch plan
  (``_PLANS``) and launch the compiled kernels directly: 83-114 us of host time per call against 381-423 us for
  the full path, eager 134-137 us (bench/results/host_plans-h200.md).
* ``canvas_bs1_ctx32k_sliding`` 26.8 us [26.8] (FA4 35.3 / 35.2 us), Gluon kernel 64x64 without the overlap, 2 splits, merge
  with PDL (26.0-26.7 against 26.6-26.9 us without, within noise; merge_pdl-h200.md). The c514fe9 run's 31 us
  was a regression: the automatic Gluon config inherited the portable table's LAZY_RESCALE (30.2 against 26.8 us without it, same run,
  gluon_pv_sliding-h200.json). ncu (with its cache flush; bench/results/ncu_sliding-h200.md): the kernel 23 us,
  tensor pipe 26 % active, L2 throughput 27 %, 82 MB from L2 (each KV block is read by the 8 q tiles of its head
  and 2 splits), a third of the consumer's samples in the prologue (tile search, causal flags, the Q load) and
  half in the loop. 128-row tiles, 3-4 splits, 32- or 128-key blocks, 3-4 K / V stages and the chained consumer
  measured 26.1-34 us (gluon_stages_sliding / gluon_chain_sliding / gluon_overlap2-h200.json); merging the splits
  in-kernel by the last split of each tile measured 35.6 against ~30 us (gluon_merge-h200.json); the roles kernel
  (one PV warpgroup at hd 256) 29.5 against 25.9-26.6 us (gluon_roles_hd256-h200.json). The issue's 15 us is not
  reached. Where the time goes (bench/results/floor_sliding-h200.md, window varied): the attention kernel
  costs 5.9 us + 1.18 us per key block of a program (10 blocks here), the merge 3.5 us, and an empty two-kernel
  CUDA graph 5.7 us in this timing; at one key block per program (window 0) the call already takes 16.3 us.
  Eager, planned calls take 46-48 us (240-248 us for the full path; host_plans-h200.md). Without the
  benchmarks' L2 flush between replays (Q and metadata in L2, as in a serving step): 21.7 us against FA4's 31 us
  (warm_l2-h200.md). Signalling the merge's PDL launch from the split programs' epilogue
  (griddepcontrol.launch_dependents) measured no gain and was dropped (gdc_trigger_ab-h200.md).
* ``prefill16k_hd128`` 1.949 ms, 564 TFLOP/s [1.972], Gluon kernel 64x128 with the chained consumer (FA4 1.913
  paged / 1.725 contiguous: 0.98x / 0.89x of FA4's throughput). The sweep measured it at 1.803 ms (610 TFLOP/s)
  against 2.177 ms for the sequential consumer in the same run (gluon_chain_hd128-h200.json).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..validate import check_attention_inputs

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_WINDOW_CLAMP = 1 << 30  # windows wider than any sequence behave as "no window"; keeps q_abs + W in int32


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
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
        acc = tl.dot(_cast(p, v.dtype, INTERPRET).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
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


@triton.jit
def _tile_sequence(CU_Q, t, num_seqs, ks, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Virtual tile ``t`` -> (sequence b, q_start, q_len, tile index within b): the largest b < num_seqs with
    ``cu_q[b] // BLOCK_Q + b <= t`` (non-decreasing in b), by a 16-ary search of ``SEARCH_STEPS`` steps
    (``16 ** SEARCH_STEPS > num_seqs``): each step loads 16 candidates at once (``ks``: ``arange(0, 16)`` int32
    in the caller's layout), so a batch of up to 15 sequences costs one dependent load round trip, not four.
    Shared with the Gluon kernel (triton_gluon.py)."""
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
def _causal_rows(NCQ, b, q_len, FLAGS: tl.constexpr):
    """``num_causal_q`` of sequence ``b``: read from ``NCQ`` ([B] int32), or with ``FLAGS`` from the causal flags
    ([B] bool: q_len if causal else 0), so that a call with ``causal`` needs no conversion op. Shared with the
    Gluon kernel (triton_gluon.py)."""
    if FLAGS:
        return tl.where(tl.load(NCQ + b) != 0, q_len, 0)
    else:
        return tl.load(NCQ + b)


@triton.jit
def _kv_base(BT, CU_K, b, stride_bt, PAGED: tl.constexpr):
    """Where sequence ``b``'s keys are: its block-table row (paged; key base 0), or its first row in the
    contiguous caches (``cu_seqlens_k[b]``). Shared with the Gluon kernel (triton_gluon.py)."""
    if PAGED:
        return BT + b.to(tl.int64) * stride_bt, 0
    else:
        return BT, tl.load(CU_K + b)


@triton.jit
def _row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW: tl.constexpr, PREFIX: tl.constexpr):
    """Allowed key interval ``[lo, hi]`` of query rows at positions ``i`` of a sequence (masks.key_range): causal
    rows (``i < ncq``) up to themselves, one-sided window; bidirectional rows symmetric or prefix window."""
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
def _key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Key blocks a tile visits: ``[a, d_end)`` (this split's share of the blocks between the valid rows'
    min lo and max hi), of which ``[b_mid, c_mid)`` are full (every row allows every key: no mask)."""
    BIG: tl.constexpr = 1 << 30
    kmin = tl.min(tl.where(row_valid, lo, BIG), 0)
    kmax = tl.max(tl.where(row_valid, hi, -1), 0)
    lo_max = tl.max(tl.where(row_valid, lo, 0), 0)
    hi_min = tl.min(tl.where(row_valid, hi, BIG), 0)
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
    b, q_start, q_len, tile = _tile_sequence(CU_Q, t, num_seqs, tl.arange(0, 16), BLOCK_Q, SEARCH_STEPS)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + b)
    ncq = _causal_rows(NCQ, b, q_len, NCQ_FLAGS)
    ctx = seq_len - q_len

    # ---- rows = (token, head in group)
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GP
    hh = offs_m % GP
    i = tile * BLOCK_Q + tok
    row_valid = (i < q_len) & (hh < G)
    head = kvh * G + hh
    lo, hi = _row_key_interval(i, ctx, ncq, seq_len, window, HAS_WINDOW, PREFIX)
    a, b_mid, c_mid, d_end = _key_block_ranges(lo, hi, row_valid, split, num_splits, BLOCK_N, SPLIT)

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

    bt_row, k_base = _kv_base(BT, CU_K, b, stride_bt, PAGED)
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
        tl.store(o_ptrs, _cast(out, O.dtype.element_ty, INTERPRET), mask=row_valid[:, None] & dv_mask[None, :])
        if STORE_LSE:
            tl.store(LSE + lse_off, lse, mask=row_valid & (dvb == 0))
    else:
        s64 = split.to(tl.int64)
        p_row = (s64 * total_q + tok_g) * num_heads + head
        p_ptrs = OPART + p_row[:, None] * DV + offs_dv[None, :]
        tl.store(p_ptrs, out, mask=row_valid[:, None] & dv_mask[None, :])
        tl.store(LSEPART + s64 * num_heads * total_q + lse_off, lse, mask=row_valid & (dvb == 0))


@triton.jit(do_not_specialize=["total_q", "n_rows"])
def _merge_kernel(OPART, LSEPART, O, LSE, total_q, num_heads, n_rows, stride_ot, stride_oh,
                  NUM_SPLITS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                  STORE_LSE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Exact merge of split-KV partials: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    One program merges ``BLOCK_R`` (token, head) rows (row = token * num_heads + head, OPART's order): pass 1 takes
    the max LSE over the splits, pass 2 accumulates the weighted partials with ``[BLOCK_R, BLOCK_DV]`` loads.
    (It was one program per row with all splits in one ``[splits, DV]`` load: 12.9 us of the 167 us
    canvas_bs1_ctx32k_hd128 on the H200.)
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
             _cast(res, O.dtype.element_ty, INTERPRET), mask=rmask[:, None] & dmask[None, :])
    if STORE_LSE:
        tl.store(LSE + lse_off, tl.where(den == 0.0, float("-inf"), mx_use + tl.log(den)), mask=rmask)


# ------------------------------------------------------------------------------------------------ host side
#: launch the split-KV merge with programmatic dependent launch (sm_90+): hides part of its launch latency behind
#: the attention kernel's tail (a module switch for A/B runs; off, the merge is compiled without its
#: griddepcontrol.wait). H200 A/B, three alternating rounds: bench/results/merge_pdl-h200.md
_MERGE_PDL = True

_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "BLOCK_DV", "LAZY_RESCALE",
                "BT_PREFETCH", "IMPL", "OVERLAP", "V_STAGES")
_DEVICE_PROPS: dict = {}  # per CUDA device index
_MAX_SPLITS = 65535  # num_splits is grid dimension z (CUDA: at most 65535)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _device_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA device, cached per index (host only, no sync)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_PROPS:
        _DEVICE_PROPS[idx] = torch.cuda.get_device_properties(idx)
    return _DEVICE_PROPS[idx]


def _capability(device: torch.device) -> tuple:
    """(major, minor) compute capability of a device ((0, 0) off CUDA)."""
    if device.type != "cuda":
        return (0, 0)
    p = _device_props(device)
    return (p.major, p.minor)


def _merge_pdl(device: torch.device) -> bool:
    """Whether the split-KV merge launches with PDL and waits with griddepcontrol (sm_90+; never interpreted)."""
    return bool(_MERGE_PDL) and not _interpreting() and _capability(device)[0] >= 9


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200; only the split heuristic uses it
    return _device_props(device).multi_processor_count


def default_config(head_dim: int, head_dim_v: int, group: int, dtype: torch.dtype, interpret: bool = False) -> dict:
    """Default tile config per head dim (H200-oriented; bench/sweep_triton_attention.py tunes these).

    Returns a dict with BLOCK_M (rows = tokens x padded group heads), BLOCK_N (keys), num_warps, num_stages,
    BLOCK_DV (V head-dim slice per program; = padded head_dim_v means no split). num_splits is chosen per
    call unless given.
    """
    gp = _next_pow2(group)
    dv = max(16, _next_pow2(head_dim_v))
    d = max(16, _next_pow2(head_dim))
    if interpret:
        return dict(BLOCK_M=max(16, gp), BLOCK_N=16, num_warps=4, num_stages=1, BLOCK_DV=dv)
    big = max(d, dv)
    if big <= 64:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    elif big <= 128:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    elif big <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    if dtype == torch.float32:  # fp32 operands: halve the tiles (registers, shared memory)
        cfg["BLOCK_N"] = max(16, cfg["BLOCK_N"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], gp, 16)
    cfg["BLOCK_DV"] = dv
    return cfg


#: Tuned overrides {(head_dim, group, has_window, prefix): config} for bf16/fp16, from the H200 sweep
#: bench/results/triton_sweep-h200.json (CUDA-graph medians, page 64, kernel of commit 60a1efe):
#: - hd 256, group 2, window (sliding layers, both modes): 128x64, 8 warps, 2 stages: mixed_sliding_ctx8k
#:   0.247 ms (default 64x64/8w: 0.451), canvas_bs1_ctx32k_sliding 40 us (64x32/4w: 0.240 ms / 54 us).
#: - hd 128, group 2, no window: 128x64, 8 warps, 4 stages (re-swept after the block-table prefetch,
#:   attention-sweep_prefill-h200.json / attention-sweep_hd128b-h200.json, acc9a38 / c24ce39): prefill16k 2.331 ms
#:   (64x64/4w/3s, the earlier choice: 2.437; 128x64/8w/3s 2.352; 128x128/8w/3s 2.911), canvas_bs4 0.092 ms
#:   (64x64/4w/3s 0.090). The split regime keeps 64x64/4w/3s (TUNED_SPLIT_CONFIGS).
#: - hd 512, group 8 (global layers): 128x32, 8 warps, 2 stages, V head dim in two 256 slices:
#:   mixed_global_ctx8k 2.03 ms (default 64x32 whole-V: 2.93 ms), canvas_bs1_ctx32k_global 1.19 ms.
#: - hd 256 sliding, lazy rescaling (bench/results/attention-sweep_hd256-h200.json, e59f24d): mixed_sliding_ctx8k
#:   0.214 -> 0.203 ms, canvas_bs1_ctx32k_sliding 0.035 -> 0.036 ms (noise level); the other tiles of that sweep
#:   (64x64/4w, 64x32/4w, 128x32/8w, 64x64/8w, explicit split counts) measured 0.241-0.383 ms / 38-49 us.
_SLIDING_256 = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, LAZY_RESCALE=True)
TUNED_CONFIGS: dict = {
    (256, 2, True, False): _SLIDING_256,
    (256, 2, True, True): _SLIDING_256,
    (128, 2, False, False): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    (512, 8, False, False): dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, BLOCK_DV=256),
}


#: Tuned tiles for the split-KV regime {(head_dim, group, has_window, prefix): config}: used instead of the base
#: tiles when those would split the keys (few q tiles over a long context; host shapes only):
#: - hd 128, group 2, no window: 64x64, 4 warps, 3 stages (two programs per SM, :func:`ctas_per_sm`):
#:   canvas_bs1_ctx32k_hd128 at 4 splits 0.159 ms vs 0.164 for the base 128x64/8w/4s (c24ce39); before the
#:   block-table prefetch of two-page blocks and the resident-program split count this entry was 128x128/8w/3s
#:   (0.242 ms at 60a1efe; 0.193 ms with the prefetch, e59f24d).
TUNED_SPLIT_CONFIGS: dict = {
    (128, 2, False, False): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}

_GLUON_64 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, OVERLAP=True)
_GLUON_HD128 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, V_STAGES=1, OVERLAP="chain")
_GLUON_HD512 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=12, num_stages=1, BLOCK_DV=512, OVERLAP="roles")
#: the wide hd-512 kernel's tiles: the automatic choice before the roles kernel, and what it gives way to when a
#: caller asks for keys only the wide kernel takes (:func:`_gluon_auto`)
_GLUON_HD512_WIDE = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, BLOCK_DV=512,
                         OVERLAP=False)
#: The warp-specialised Gluon kernel (:mod:`blockdiff.attention.triton.gluon`) as the automatic choice
#: {(head_dim, group, has_window, prefix): (base regime config or None, split regime config or None)}, bf16/fp16 on
#: sm_90 when the caches suit TMA with boxes of >= 64 rows (else the tables above). H200 CUDA-graph medians, page 64:
#: - hd 128: 64x128 tiles (a 128-key block is two 64-token pages, one TMA box each), 4 consumer warps, two K and
#:   one V buffer (115 KB: two programs per SM), the chained consumer (PV of block j and QK^T of block j + 1 issued
#:   back to back; the QK^T / softmax overlap spills at 64x128). Same run (bench/results/gluon_chain_hd128-h200.json,
#:   3297f56, 100 ms windows): prefill16k_hd128 1.803 ms against 2.177 sequential, canvas_bs1_ctx32k_hd128 0.134
#:   against 0.142 ms (4 splits), canvas_bs4_ctx4k_hd128 0.0747 against 0.0748. Before (gluon_kv_stages-h200.json,
#:   330f30d, 40 ms windows): the sequential 64x128 against 64x64/4w/2st with the overlap: prefill16k 1.834 vs
#:   2.236 ms, canvas_bs4 0.079 vs 0.089, canvas_bs1 0.139 vs 0.156; one K and one V buffer: 1.976 ms on prefill16k.
#: - hd 256 sliding, split regime: 64x64/4w/2st without the overlap (with it the hd-256 consumer spills):
#:   canvas_bs1_ctx32k_sliding 32.7 us vs 36.8 on the portable kernel (gluon_overlap2-h200.json); 26.8 us once the
#:   Gluon config stopped inheriting the portable table's LAZY_RESCALE (30.2 with it, gluon_pv_sliding-h200.json);
#:   the chained consumer 26.9 us (gluon_chain_sliding-h200.json). hd 256 runs one
#:   program per SM (the PV wgmma needs >= 158 registers a thread at launch). The hd-256 base regime stays on the
#:   portable kernel: mixed_sliding_ctx8k 0.210 ms vs 0.250 ms in Gluon.
#: - hd 512, group 8 (global layers), both regimes: the roles kernel (``OVERLAP="roles"``: a softmax warpgroup
#:   hands P through shared memory to two PV warpgroups of 256 output columns each), 64x64, one K and one V buffer
#:   (Q 64 KB + K 64 KB + V 64 KB + two P slots 16 KB). Same run (bench/results/gluon_roles_hd512-h200.json,
#:   f8bcc40, 100 ms windows): mixed_global_ctx8k 1.037 ms against 1.094-1.097 for the wide kernel,
#:   canvas_bs1_ctx32k_global 0.534 against 0.582 ms; 64x32 with two K / V buffers 1.270 / 0.716 ms.
#:   Before, the wide kernel (two consumer warpgroups splitting the head
#:   dim), 64x64, one K and one V buffer (Q 64 KB + K 64 KB + V 64 KB + the partial-S exchange 32 KB). Same run
#:   in the sweep's then 40 ms windows (boost clock, 3-8 % fast; bench/results/gluon_hd512_lazy-h200.json,
#:   2a25e46): mixed_global_ctx8k 1.009 ms, canvas_bs1_ctx32k_global 0.569 ms (2 splits); the (removed) 8-warp
#:   kernel splitting S's keys and O's columns instead: 1.208 / 0.672 ms; with LAZY_RESCALE (the conditional
#:   rescale spills): 1.155 / 0.636 ms; 64x32 with two K and two V buffers: 1.307 / 0.754 ms (lazy). The portable
#:   kernel (128x32, V in two 256 slices, QK^T recomputed per slice): 2.001 / 1.174 ms (gluon_hd512_wide).
#:   bench_attention's 100 ms windows: 1.091 / 0.598 ms (attention-hd512-h200.json, c514fe9).
TUNED_GLUON_CONFIGS: dict = {
    (128, 2, False, False): (_GLUON_HD128, _GLUON_HD128),
    (512, 8, False, False): (_GLUON_HD512, _GLUON_HD512),
    (256, 2, True, False): (None, dict(_GLUON_64, OVERLAP=False)),
}


def _gluon_auto(entry: dict, override: dict | None) -> dict:
    """An automatic Gluon table entry merged with the caller's config keys. The hd-512 roles entry gives way to the
    wide kernel's (:data:`_GLUON_HD512_WIDE`) when the caller sets ``OVERLAP`` to anything but "roles" or asks
    for ``LAZY_RESCALE``: keys the roles kernel refuses but the wide kernel takes (or, for ``OVERLAP`` True /
    "chain", refuses with an error naming the caller's key rather than a table field)."""
    override = override or {}
    if entry.get("OVERLAP") == "roles" and entry.get("BLOCK_DV", 0) > 256 and (
            override.get("OVERLAP", "roles") != "roles" or override.get("LAZY_RESCALE")):
        entry = _GLUON_HD512_WIDE
    return dict(entry, **override)


@dataclass(frozen=True)
class _StaticKey:
    head_dim: int
    head_dim_v: int
    group: int
    dtype: torch.dtype
    paged: bool
    page_size: int
    has_window: bool
    prefix: bool
    interpret: bool


class TritonAttention:
    """The resolved tile configs of one static signature (head dims, group size, dtype, paged/page size, window,
    mode).

    Instances are cached by :func:`get_kernel`; :meth:`config` resolves tile configs (defaults, tuned table,
    per-call overrides) and validates them; Triton caches compiled binaries per constexpr set.
    """

    def __init__(self, key: _StaticKey):
        self.key = key
        base = default_config(key.head_dim, key.head_dim_v, key.group, key.dtype, key.interpret)
        tuned = TUNED_CONFIGS.get((key.head_dim, key.group, key.has_window, key.prefix))
        if tuned and not key.interpret and key.dtype in (torch.bfloat16, torch.float16):
            base.update(tuned)
        self.base = base
        split = TUNED_SPLIT_CONFIGS.get((key.head_dim, key.group, key.has_window, key.prefix))
        #: tiles for the split-KV regime (None: the base tiles everywhere)
        self.split_base = dict(split) if split and not key.interpret and key.dtype in (torch.bfloat16,
                                                                                       torch.float16) else None
        gl_base, gl_split = TUNED_GLUON_CONFIGS.get((key.head_dim, key.group, key.has_window, key.prefix), (None, None))
        fast = not key.interpret and key.dtype in (torch.bfloat16, torch.float16)
        #: automatic Gluon configs (None: the portable kernel), used when the input suits TMA
        self.gluon_base = dict(gl_base) if gl_base and fast else None
        self.gluon_split = dict(gl_split) if gl_split and fast else None
        self._resolved: dict = {}

    def config(self, override: dict | None) -> dict:
        # the value's type is part of the key: True == 1 == 1.0 hash alike, and a cached {BT_PREFETCH: True}
        # must not let {BT_PREFETCH: 1} (or num_splits=True after num_splits=1) skip validation
        # (the type itself, not its name: numpy's bool_ is also named "bool")
        okey = tuple(sorted((k, type(v), v) for k, v in (override or {}).items()))
        try:
            hit = self._resolved.get(okey)
        except TypeError:  # an unhashable value (e.g. a list): not cacheable, validation below rejects it
            okey, hit = None, None
        if hit is not None:
            return hit
        if override:
            bad = set(override) - set(_CONFIG_KEYS)
            if bad:
                raise ValueError(f"config has unknown keys {sorted(bad)}; allowed: {list(_CONFIG_KEYS)}")
        cfg = dict(self.base)
        cfg.update(override or {})
        if cfg.get("IMPL") == "gluon" and "BLOCK_DV" not in (override or {}):
            cfg["BLOCK_DV"] = max(16, _next_pow2(self.key.head_dim_v))  # the Gluon kernels hold all of V
        if cfg.get("IMPL") == "gluon" and "LAZY_RESCALE" not in (override or {}):
            # the portable kernel's tuned LAZY_RESCALE (hd-256 sliding) is not the Gluon kernels': they were tuned
            # without it (inherited, it cost canvas_bs1_ctx32k_sliding 26.8 -> 30.2 us, gluon_pv_sliding-h200)
            cfg["LAZY_RESCALE"] = False
        gp = _next_pow2(self.key.group)
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_DV"):
            v = cfg[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"config[{name!r}] must be a power of two >= 16 (tl.dot minimum), got {v!r}")
        if cfg["BLOCK_M"] < gp:
            raise ValueError(f"config['BLOCK_M'] = {cfg['BLOCK_M']} must be >= the padded GQA group size {gp}")
        dvp = max(16, _next_pow2(self.key.head_dim_v))
        cfg["BLOCK_DV"] = min(cfg["BLOCK_DV"], dvp)
        if not isinstance(cfg.get("LAZY_RESCALE", False), bool):
            raise ValueError(f"config['LAZY_RESCALE'] must be a bool, got {cfg['LAZY_RESCALE']!r}")
        cfg.setdefault("LAZY_RESCALE", False)
        if not isinstance(cfg.get("BT_PREFETCH", False), bool):
            raise ValueError(f"config['BT_PREFETCH'] must be a bool, got {cfg['BT_PREFETCH']!r}")
        cfg.setdefault("BT_PREFETCH", True)   # H200: prefill16k_hd128 paged 2.909 -> 2.430 ms (see _attn_range)
        cfg.setdefault("IMPL", "triton")
        if not (isinstance(cfg.get("OVERLAP", True), bool) or cfg.get("OVERLAP") in ("chain", "roles")):
            raise ValueError(f"config['OVERLAP'] must be a bool, 'chain' or 'roles', got {cfg['OVERLAP']!r}")
        # Gluon only: the QK^T / softmax overlap by default where its consumer compiles without spills (64-key
        # blocks, V head dim <= 128; the 64x128 consumer spills ~1.3 KB with it), else the chained consumer up to
        # V head dim 256 (prefill16k_hd128 1.80 vs 2.18 ms sequential; hd 256 neutral), else (the wide hd-512
        # kernel) sequential; the V ring depth (None: num_stages)
        dv = self.key.head_dim_v
        cfg.setdefault("OVERLAP", True if cfg["BLOCK_N"] <= 64 and dv <= 128 else "chain" if dv <= 256 else False)
        cfg.setdefault("V_STAGES", None)
        if cfg["IMPL"] not in ("triton", "gluon"):
            raise ValueError(f"config['IMPL'] must be 'triton' (the portable kernel) or 'gluon' (the warp-specialised "
                             f"Hopper kernel), got {cfg['IMPL']!r}")
        if (override or {}).get("IMPL") == "triton" and {"OVERLAP", "V_STAGES"} & set(override):
            raise ValueError("config keys OVERLAP and V_STAGES apply to the Gluon kernel; IMPL='triton' (the portable "
                             "kernel) pipelines K and V with num_stages")
        if cfg["IMPL"] == "gluon":
            from .gluon import check_gluon_config
            check_gluon_config(cfg, self.key.head_dim, self.key.head_dim_v)
        ns = cfg.get("num_splits")
        if ns is not None and (isinstance(ns, bool) or not isinstance(ns, int) or not 1 <= ns <= _MAX_SPLITS):
            raise ValueError(f"config['num_splits'] must be an int in [1, {_MAX_SPLITS}] (the launch grid's third "
                             f"dimension) or None, got {ns!r}")
        for name in ("num_warps", "num_stages"):
            v = cfg[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config[{name!r}] must be an int >= 1, got {v!r}")
        if okey is not None:
            self._resolved[okey] = cfg
        return cfg


_KERNELS: dict = {}
#: The last launch (compiled kernel handle with n_regs/n_spills on the GPU, split count, grid, config).
LAST_LAUNCH: dict = {}


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def get_kernel(head_dim, head_dim_v, group, dtype, paged, page_size, has_window, prefix) -> TritonAttention:
    """The cached :class:`TritonAttention` of a static signature."""
    key = _StaticKey(head_dim, head_dim_v, group, dtype, paged, page_size or 0, has_window, prefix,
                     _interpreting())
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = TritonAttention(key)
    return k


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans intersect (host pointer arithmetic only; conservative)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t):
        start = t.data_ptr()
        extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
        return start, start + extent * t.element_size()

    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1


def ctas_per_sm(block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int, head_dim_v: int,
                itemsize: int) -> int:
    """Estimated resident programs per SM (H100 / H200: 64 K registers, 227 KB shared memory per SM).

    The kernels use ~255 registers per thread (so ``8 // num_warps`` programs fit the register file) and
    shared memory for the Q tile plus ``num_stages`` K and V blocks. ``head_dim`` / ``head_dim_v``: the widths
    of those tiles (:func:`attention_triton` passes BLOCK_D, the head dim padded to a power of two, and
    BLOCK_DV, the V slice of one program). Host shapes only (no compiled binary).
    """
    smem = (block_m * head_dim + num_stages * block_n * (head_dim + head_dim_v)) * itemsize
    return max(1, min(8 // max(1, num_warps), (227 * 1024) // max(1, smem)))


def _tile_estimate(total_q: int, num_seqs: int, block_q: int) -> int:
    """Working q tiles of a batch from host ints: ``cdiv(total_q, BLOCK_Q)`` (exact for one sequence), and at
    least ``min(B, total_q)`` since every non-empty sequence starts its own tile (many short sequences: 100
    one-token rows are 100 tiles, not 7 of 16 tokens; counting 7 split an already full grid)."""
    return max(-(-total_q // block_q), min(num_seqs, total_q))


def choose_num_splits(n_programs: int, key_capacity: int, block_n: int, num_sms: int, ctas: int = 1) -> int:
    """Split-KV count from host-known shapes only: split when the grid fills less than half a wave.

    ``n_programs`` = (real) q tiles x KV heads x V slices; ``key_capacity`` = max keys of a sequence
    (max_seqlen_k, or the block table's capacity); ``ctas`` = programs resident per SM (:func:`ctas_per_sm`).
    The split count keeps the grid within one wave (``n_programs * splits <= num_sms * ctas``) and >= 8 key
    blocks per split. H200, canvas_bs1_ctx32k_hd128 with 64x64 tiles / 4 warps (2 programs per SM): 4 splits
    0.167 ms, 8 splits 0.175 ms (e59f24d, attention-sweep_hd128-h200.json); 2 splits (the one-program-per-SM
    wave) was measured only at 60a1efe, before the block-table prefetch: 0.365 ms (triton_sweep-h200.json).
    """
    slots = num_sms * max(1, int(ctas))
    if n_programs <= 0 or 2 * n_programs > slots:
        return 1
    by_len = key_capacity // (8 * block_n)
    return int(max(1, min(slots // n_programs, by_len, 64)))


def attention_triton(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    seq_lens=None,
    causal=None,
    num_causal_q=None,
    block_table=None,
    cu_seqlens_k=None,
    window_size=None,
    bidirectional_window="symmetric",
    scale=None,
    out=None,
    return_lse=False,
    max_seqlen_q=None,
    max_seqlen_k=None,
    check_values=None,
    config=None,
):
    """Fused Triton attention over a mixed causal/bidirectional varlen batch (one launch, + merge if split).

    Args:
        q: ``[total_q, num_heads, head_dim]`` bf16/fp16/fp32, packed by ``cu_seqlens_q``.
        k_cache, v_cache: paged ``[num_blocks, page_size, num_kv_heads, head_dim(_v)]`` with ``block_table``
            ``[B, max_blocks]`` int32/int64, or contiguous ``[total_k, num_kv_heads, head_dim(_v)]`` with
            ``cu_seqlens_k`` ``[B+1]``. The last dim must be contiguous (stride 1).
        cu_seqlens_q: ``[B+1]`` int32 (int64 accepted).
        seq_lens: ``[B]`` int32 keys per sequence including its query tokens.
        causal: ``[B]`` bool, or ``num_causal_q`` ``[B]`` int32 (the first n rows causal). Device tensors.
        window_size: None or int W >= 0 (keys per side, excluding the query's own position).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.
        scale: softmax scale (default ``head_dim ** -0.5``).
        out: optional preallocated ``[total_q, num_heads, head_dim_v]`` (q's dtype) written in place.
        return_lse: also return ``lse [num_heads, total_q]`` fp32 (natural log; -inf for rows with no key).
        max_seqlen_q: unused (the grid is sized from ``total_q`` and B).
        max_seqlen_k: host int >= every seq_len (static capacity is fine); sizes the split-KV count. Default:
            the block table's capacity (``max_blocks * page_size``) or ``total_k``.
        check_values: host-side value checks (default: on, except under CUDA-graph capture). False keeps
            the launch path free of host syncs, and plans the call once per key (shapes, strides, dtypes,
            devices, 16-byte alignment of the tensors, the host scalars, config, whether ``out`` overlaps an
            input): later calls with the same key skip validation and planning and launch the compiled kernels
            directly (``_PLANS``; values, flags, lengths and block tables may change between them).
        config: optional dict overriding BLOCK_M (rows = tokens x padded GQA group), BLOCK_N (keys per block),
            num_warps, num_stages, num_splits (split-KV count; None = automatic), BLOCK_DV (V head-dim slice per
            program), LAZY_RESCALE (bool, default False), BT_PREFETCH (bool, default True), IMPL ("triton" or
            "gluon": the warp-specialised Hopper kernel; default: chosen per input, see TUNED_GLUON_CONFIGS) and
            OVERLAP (Gluon only: True: QK^T of the next key block overlaps the softmax; "chain": PV of a key block
            and QK^T of the next issued back to back; "roles": a softmax warpgroup hands P through shared memory
            to PV warpgroups that own the output, BLOCK_M=64 and num_warps=8 (hd <= 256) or 12 (hd 512),
            LAZY_RESCALE=False; default True for BLOCK_N <= 64 and head_dim_v <= 128, else "chain" up to
            head_dim_v 256, else False; head_dim_v > 256 takes False (the wide kernel) or "roles", and any other
            value raises ValueError there, also when the automatic choice picked the Gluon kernel),
            V_STAGES (Gluon only: V ring depth; default None =
            num_stages, the K ring depth). With IMPL unset the Gluon-only keys apply when the automatic choice
            runs the Gluon kernel (``LAST_LAUNCH["impl"]``); with IMPL="triton" they are a ValueError.

    Returns:
        ``out`` or ``(out, lse)``; rows with no allowed key are 0 with lse -inf.

    Raises:
        TypeError, ValueError: see :func:`blockdiff.attention.validate.check_attention_inputs`; also a bad
            ``config`` (unknown key, tile not a power of two >= 16) or a non-unit last-dim stride.
    """
    if isinstance(q, torch.Tensor) and q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"backend 'triton' needs CUDA tensors, got q on {q.device}; on the CPU set "
                         "TRITON_INTERPRET=1 before importing triton to run the kernel in the Triton interpreter")
    calls = (cu_seqlens_q, seq_lens, causal, num_causal_q, block_table, cu_seqlens_k)
    plan_key = None
    if check_values is False and _PLANS_ENABLED:
        # the launch plan of an earlier call with the same key (host work only; see _plan_key)
        plan_key = _plan_key(q, k_cache, v_cache, calls, window_size, bidirectional_window, scale, out, return_lse,
                             max_seqlen_k, config)
        plan = _PLANS.get(plan_key) if plan_key is not None else None
        if plan is not None:
            return _run_plan(plan, q, k_cache, v_cache, calls, out)
    info = check_attention_inputs(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, causal=causal,
        num_causal_q=num_causal_q, block_table=block_table, cu_seqlens_k=cu_seqlens_k,
        window_size=window_size, bidirectional_window=bidirectional_window, scale=scale, out=out,
        check_values=check_values, allowed_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    )
    plan = _make_plan(q, k_cache, v_cache, info, block_table, window_size, bidirectional_window, out, return_lse,
                      max_seqlen_k, config)
    if plan_key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[plan_key] = plan
    # the validated seq_lens / causal row counts (already int32): not converted again
    return _run_plan(plan, q, k_cache, v_cache, calls, out, seq_lens=info.seq_lens,
                     causal_rows=None if info.causal is not None else info.num_causal_q)


#: Launch plans by call key (:func:`_plan_key`), for calls with ``check_values=False``: the validation, config
#: choice, split count, grid and kernel arguments that follow from the key are computed once, and later calls
#: launch the compiled kernels directly (no Triton argument binding). Cleared when full.
_PLANS: dict = {}
_MAX_PLANS = 1024
#: a module switch for A/B runs (bench/probe_host_overhead.py, bench/probe_e2e_plans.py): off, every call takes
#: the full path and no plan is stored
_PLANS_ENABLED = True


def _tensor_key(t):
    """What a plan may depend on of a tensor argument: shape, strides, dtype, device and whether its address is
    16-byte aligned (Triton specialises pointer arguments on that); None for None. Raises for a non-tensor."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _plan_key(q, k_cache, v_cache, calls, window_size, bidirectional_window, scale, out, return_lse, max_seqlen_k,
              config):
    """The key of a call's launch plan, or None (then the call takes the full path, which raises for bad input).

    Everything the plan is computed from: the tensor arguments' :func:`_tensor_key`, the host scalars with their
    types (``True`` and ``1`` differ; ``max_seqlen_k`` must be a Python int), the config items, whether ``out``
    overlaps an input (the kernel then writes a private buffer), and the module switches read while planning.
    Data pointers are not in it (beyond their alignment): they change every call and only the kernels read them.
    ``max_seqlen_k`` is: a caller passing each step's actual maximum gets one plan per step (reused by the
    step's layers), a static capacity one plan in all.
    """
    if max_seqlen_k is not None and type(max_seqlen_k) is not int:
        return None  # e.g. a 0-d tensor, whose value may change in place: no plan (the full path reads it)
    try:
        aliased = out is not None and any(_overlaps(out, t) for t in (q, k_cache, v_cache))
        cfg = None if config is None else tuple(sorted((k, type(v), v) for k, v in config.items()))
        key = (tuple(_tensor_key(t) for t in (q, k_cache, v_cache, out) + tuple(calls)),
               type(window_size), window_size, type(bidirectional_window), bidirectional_window, type(scale), scale,
               type(return_lse), return_lse, type(max_seqlen_k), max_seqlen_k, type(config), cfg, aliased,
               bool(_MERGE_PDL), _interpreting())
        hash(key)
        return key
    except Exception:  # not a tensor / dict, unhashable values, ...: no plan
        return None


class _Launch:
    """One kernel launch of a plan: the JIT function, its grid and its keyword arguments (constexprs and launch
    options). The first launch goes through Triton's JIT (compiling once); later ones call the compiled kernel
    with the constexpr values appended in parameter order (the launcher skips them), which is what the JIT does
    after binding the arguments, without re-binding them. Not under the interpreter (it has no compiled kernel).
    What the JIT does per launch and this skips: its argument specialisation (every integer argument and pointer
    alignment is fixed by the plan key), its check that the kernel's global variables did not change, its
    pre-run hooks and debug / instrumentation knobs (read at the first launch), and re-selecting the binary for
    the current device (the plan key holds q's device; the compiled kernel is loaded on the device current at the
    first launch, as the JIT would for a call from that device).
    """

    __slots__ = ("fn", "grid", "kwargs", "compiled", "consts")

    def __init__(self, fn, grid, kwargs):
        # (x, y, z): a compiled kernel's launcher reads all three
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.compiled = self.consts = None

    def __call__(self, *args):
        if self.compiled is not None:
            self.compiled[self.grid](*args, *self.consts)
            return self.compiled
        handle = self.fn[self.grid](*args, **self.kwargs)
        if not _interpreting() and hasattr(handle, "packed_metadata"):
            consts = []
            for p in self.fn.params[len(args):]:
                if p.name in self.kwargs:
                    consts.append(self.kwargs[p.name])
                elif p.default is not inspect.Parameter.empty:
                    consts.append(p.default)
                else:
                    return handle
            self.compiled, self.consts = handle, tuple(consts)
        return handle


@dataclass
class _Plan:
    """The host-side result of planning one call (see :func:`_plan_key`)."""

    total_q: int
    num_heads: int
    head_dim_v: int
    empty: bool  # no query token or no sequence: nothing to launch
    return_lse: bool
    private_dst: bool = False  # the kernel writes a private buffer, copied into ``out``
    paged: bool = False
    ncq_flags: bool = True  # the kernel reads the causal flags (else num_causal_q)
    impl: str = "triton"
    cfg: dict | None = None
    num_splits: int = 1
    grid: tuple = ()
    descriptors: tuple | None = None  # Gluon: (box rows, K chunks, V chunks) of the TMA descriptors
    tail: tuple = ()  # the main kernel's host-int arguments after the tensors
    main: _Launch | None = None
    merge: _Launch | None = None
    merge_tail: tuple = ()


def _make_plan(q, k_cache, v_cache, info, block_table, window_size, bidirectional_window, out, return_lse,
               max_seqlen_k, config) -> _Plan:
    """Plan a validated call: config, kernel (portable or Gluon), split count, grid, host-int arguments."""
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got {t.stride()}")
    total_q, H, D = q.shape
    Hkv, DV = info.num_kv_heads, info.head_dim_v
    B = info.batch_size
    group = H // Hkv
    # an out that overlaps an input (e.g. out=q) would be overwritten while other programs still read it (V
    # head-dim slices re-read the Q tile): write a private buffer and copy back (host pointer math, no sync)
    private = out is not None and (not (out.numel() == 0 or out.stride(-1) == 1)
                                   or any(_overlaps(out, t) for t in (q, k_cache, v_cache)))
    plan = _Plan(total_q=total_q, num_heads=H, head_dim_v=DV, empty=total_q == 0 or B == 0, return_lse=return_lse,
                 private_dst=private, paged=info.paged, ncq_flags=info.causal is not None)
    if plan.empty:
        return plan

    has_window = window_size is not None
    prefix = bidirectional_window == "prefix"
    kern = get_kernel(D, DV, group, q.dtype, info.paged, info.page_size, has_window, prefix)
    cfg = kern.config(config)
    gp = _next_pow2(group)
    if max_seqlen_k is not None:
        kcap = int(max_seqlen_k)
    elif info.paged:
        kcap = block_table.shape[1] * info.page_size
    else:
        kcap = k_cache.shape[0]
    split_cfg = kern.split_base

    def auto_splits(c: dict) -> int:  # the automatic split count of tile config c for this batch (host ints)
        n_dv_c = -(-max(16, _next_pow2(DV)) // c["BLOCK_DV"])
        ctas = ctas_per_sm(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"], max(16, _next_pow2(D)),
                           c["BLOCK_DV"], q.element_size())
        return choose_num_splits(_tile_estimate(total_q, B, c["BLOCK_M"] // gp) * Hkv * n_dv_c, kcap, c["BLOCK_N"],
                                 _num_sms(q.device), ctas)

    # a tile override (BLOCK_DV included: the Gluon kernels never split V) keeps the tables' portable kernel
    auto_tiles = not (config and set(config) & {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "IMPL", "BLOCK_DV"})
    split_regime = auto_tiles and cfg.get("num_splits") is None and auto_splits(cfg) > 1
    if split_regime and split_cfg is not None:
        # decode-like regime (the base tiles would split the keys: few q tiles over a long context): the tuned
        # split-regime tiles instead (host shapes only; a graph replays the config it was captured with)
        cfg = kern.config(dict(split_cfg, **(config or {})))
    gluon_cfg = (kern.gluon_split if split_regime else kern.gluon_base) if auto_tiles else None
    checked_gluon = False  # the input's Gluon eligibility already checked (for this BLOCK_N)
    if gluon_cfg is not None:
        # the warp-specialised Gluon kernel where it was measured faster and the input suits TMA (host
        # attributes only); otherwise the portable kernel above. LAST_LAUNCH["impl"] says which ran.
        # (and TMA boxes of >= 64 rows: smaller pages were not measured, they cost one box per page)
        from .gluon import gluon_ineligible, tma_box_rows
        if gluon_ineligible(q, k_cache, v_cache, paged=info.paged, page_size=info.page_size, head_dim_v=DV,
                            scale=info.scale, block_n=gluon_cfg["BLOCK_N"]) is None \
                and tma_box_rows(info.paged, info.page_size, gluon_cfg["BLOCK_N"]) >= 64:
            cfg = kern.config(_gluon_auto(gluon_cfg, config))
            checked_gluon = True
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    BQ = BM // gp
    BD = max(16, _next_pow2(D))
    BDV = cfg["BLOCK_DV"]
    n_dv = -(-max(16, _next_pow2(DV)) // BDV)
    n_tiles = total_q // BQ + B

    impl = cfg["IMPL"]
    gluon_ctas = 1
    if impl == "gluon":
        from .gluon import gluon_ctas_per_sm, gluon_ineligible
        why = None if checked_gluon else gluon_ineligible(q, k_cache, v_cache, paged=info.paged,
                                                          page_size=info.page_size, head_dim_v=DV,
                                                          scale=info.scale, block_n=BN)
        if why is not None:
            raise ValueError(f"config['IMPL'] = 'gluon' cannot run this input: {why}")
        gluon_ctas = gluon_ctas_per_sm(BM, BN, cfg["num_warps"], cfg["num_stages"], D, DV, q.element_size(),
                                       v_stages=cfg["V_STAGES"])
    ns = cfg.get("num_splits")
    if ns is None:
        if impl == "gluon":
            ns = choose_num_splits(_tile_estimate(total_q, B, BQ) * Hkv, kcap, BN, _num_sms(q.device), gluon_ctas)
        else:
            ns = auto_splits(cfg)

    # strides of what the kernel writes: out, or the private (contiguous) buffer
    st_o = (H * DV, DV) if private or out is None else (out.stride(0), out.stride(1))
    # block_table rows by stride(0), columns densely (a strided view gets a dense copy per call, _run_plan)
    if info.paged:
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
        stride_vb, stride_vp, stride_vh = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
        stride_bt = block_table.stride(0) if block_table.stride(1) == 1 else block_table.shape[1]
        page = info.page_size
    else:
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), 0, k_cache.stride(1)
        stride_vb, stride_vp, stride_vh = v_cache.stride(0), 0, v_cache.stride(1)
        stride_bt = 0
        page = 1
    W = min(int(window_size), _WINDOW_CLAMP) if has_window else 0
    qk_scale = info.scale * LOG2E
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # 16-ary tile -> sequence search: ceil(bits(B) / 4) steps, so batches of 1..15 (16..255, ...) sequences
    # share one compiled kernel
    search_steps = -(-max(1, int(B).bit_length()) // 4)
    ncq_flags = plan.ncq_flags
    grid = (n_tiles, Hkv * n_dv, ns)
    plan.impl, plan.cfg, plan.num_splits, plan.grid = impl, cfg, ns, grid
    common_tail = (total_q, H, B, n_tiles, W, qk_scale, ns)
    if impl == "gluon":
        from . import gluon as _tg
        box_n = _tg.tma_box_rows(info.paged, info.page_size, BN)
        roles = cfg["OVERLAP"] == "roles"  # softmax + PV warpgroups (triton_gluon._attn_fwd_gluon_roles)
        wide = DV > 256 and not roles  # two consumer warpgroups split the head dim (triton_gluon._attn_fwd_gluon_wide)
        chunks = 2 if DV > 256 else 1  # K / V streamed as head-dim halves (TMA boxes are <= 256 wide)
        k_chunks = _tg.roles_k_chunks(D) if roles else chunks
        plan.descriptors = (box_n, k_chunks, chunks)
        plan.tail = (q.stride(0), q.stride(1), st_o[0], st_o[1], stride_bt) + common_tail
        consts = dict(G=group, GP=gp, D=D, DV=DV, BLOCK_M=BM, BLOCK_N=BN, BLOCK_Q=BQ, BOX_N=box_n, PAGE=page,
                      PAGED=info.paged, HAS_WINDOW=has_window, PREFIX=prefix, NCQ_FLAGS=ncq_flags, SPLIT=ns > 1,
                      STORE_LSE=return_lse, SEARCH_STEPS=search_steps, STAGES=cfg["num_stages"],
                      V_STAGES=cfg["V_STAGES"] or cfg["num_stages"])
        ws = dict(LOADER_REGS=_tg.LOADER_REGS, LAZY=bool(cfg["LAZY_RESCALE"]),
                  maxnreg=_tg.gluon_max_regs(cfg["num_warps"], gluon_ctas))  # the producer-warp kernels
        if roles:
            plan.main = _Launch(_tg._attn_fwd_gluon_roles, grid, dict(
                consts, PV_REGS=_tg.roles_pv_regs(DV), P_STAGES=_tg.ROLES_P_STAGES, maxnreg=_tg.roles_max_regs(DV),
                K_CHUNKS=k_chunks, num_warps=4))
        elif wide:
            plan.main = _Launch(_tg._attn_fwd_gluon_wide, grid, dict(
                consts, **ws, CONSUMER_REGS=_tg.WIDE_CONSUMER_REGS, num_warps=4))
        else:
            plan.main = _Launch(_tg._attn_fwd_gluon, grid, dict(
                consts, **ws, OVERLAP=_tg.overlap_mode(cfg["OVERLAP"]), num_warps=cfg["num_warps"]))
    else:
        plan.tail = (q.stride(0), q.stride(1), stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                     st_o[0], st_o[1], stride_bt) + common_tail
        plan.main = _Launch(_attn_fwd_kernel, grid, dict(
            G=group, GP=gp, D=D, DV=DV, BLOCK_D=BD, BLOCK_DV=BDV, N_DV=n_dv,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_Q=BQ, PAGE=page, PAGED=info.paged, HAS_WINDOW=has_window,
            NCQ_FLAGS=ncq_flags,
            PREFIX=prefix, SPLIT=ns > 1, STORE_LSE=return_lse, SEARCH_STEPS=search_steps, DOT_PREC=dot_prec,
            INTERPRET=_interpreting(), SCALE_POS=qk_scale > 0, LAZY=bool(cfg["LAZY_RESCALE"]),
            BT_PREFETCH=bool(cfg["BT_PREFETCH"]),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        ))
    if ns > 1:
        bdv_m = max(16, _next_pow2(DV))
        block_r = max(1, min(64, 4096 // bdv_m))  # <= 4096 fp32 partial elements per program per split
        n_rows = total_q * H
        pdl = _merge_pdl(q.device)
        plan.merge_tail = (total_q, H, n_rows, st_o[0], st_o[1])
        plan.merge = _Launch(_merge_kernel, (triton.cdiv(n_rows, block_r),), dict(
            NUM_SPLITS=ns, DV=DV, BLOCK_DV=bdv_m, BLOCK_R=block_r, STORE_LSE=return_lse,
            INTERPRET=_interpreting(), PDL=pdl, num_warps=4, launch_pdl=pdl))
    return plan


def _run_plan(plan: _Plan, q, k_cache, v_cache, calls, out, seq_lens=None, causal_rows=None):
    """Launch a planned call on this call's tensors (allocations and dtype / layout conversions of the metadata
    are per call: device ops without a host sync)."""
    cu_seqlens_q, seq_lens_arg, causal, num_causal_q, block_table, cu_seqlens_k = calls
    seq_lens = seq_lens_arg if seq_lens is None else seq_lens
    num_causal_q = num_causal_q if causal_rows is None else causal_rows
    if out is None:
        out = torch.empty(plan.total_q, plan.num_heads, plan.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.num_heads, plan.total_q, dtype=torch.float32, device=q.device) if plan.return_lse \
        else None
    if plan.empty:
        return (out, lse) if plan.return_lse else out
    dst = torch.empty_like(out, memory_format=torch.contiguous_format) if plan.private_dst else out
    # the kernel indexes metadata as dense 1-D arrays: strided views get a dense copy (a device copy, no host
    # sync; capturable); the causal flags go to the kernel as they are (no conversion op per call)
    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    if seq_lens is None:  # the contiguous form without seq_lens
        seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    sl = seq_lens.to(torch.int32).contiguous()
    ncq = (causal if plan.ncq_flags else num_causal_q.to(torch.int32)).contiguous()
    if plan.paged:
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        cu_k = cu_q  # unused
    else:
        bt = cu_q  # unused
        cu_k = cu_seqlens_k.to(torch.int32).contiguous()
    ns = plan.num_splits
    if ns > 1:
        opart = torch.empty(ns, plan.total_q, plan.num_heads, plan.head_dim_v, dtype=torch.float32, device=q.device)
        lsepart = torch.empty(ns, plan.num_heads, plan.total_q, dtype=torch.float32, device=q.device)
    else:
        opart = lsepart = dst  # unused
    lse_arg = lse if lse is not None else dst
    if plan.descriptors is not None:
        from .gluon import make_kv_descriptors
        k_arg, v_arg = make_kv_descriptors(k_cache, v_cache, *plan.descriptors)
    else:
        k_arg, v_arg = k_cache, v_cache
    handle = plan.main(q, k_arg, v_arg, dst, lse_arg, opart, lsepart, cu_q, sl, ncq, bt, cu_k, *plan.tail)
    # a copy: the resolved config is shared by the plan and the config cache
    LAST_LAUNCH.update(kernel=handle, num_splits=ns, grid=plan.grid, config=dict(plan.cfg), impl=plan.impl)
    if plan.merge is not None:
        plan.merge(opart, lsepart, dst, lse_arg, *plan.merge_tail)
    if dst is not out:
        out.copy_(dst)
    return (out, lse) if plan.return_lse else out


__all__ = ["attention_triton", "default_config", "choose_num_splits", "ctas_per_sm", "get_kernel",
           "TritonAttention", "TUNED_CONFIGS", "TUNED_GLUON_CONFIGS", "TUNED_SPLIT_CONFIGS"]
