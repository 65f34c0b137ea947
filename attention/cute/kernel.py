"""CuTe DSL kernel of the ``"cute"`` backend: FlashAttention-4's SM90 forward kernel, extended.

Imported only by :mod:`blockdiff.attention.cute.interface` (lazily: this module needs flash-attn-4 and
nvidia-cutlass-dsl at import time). Its tile configuration and K/V load rule: :mod:`blockdiff.attention.cute.config`.

What is FA4's and what is ours
------------------------------
:class:`FlashAttentionForwardSm90Mixed` subclasses ``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90``
(flash-attn-4 4.0.0b36). FA4's ``__call__`` (TMA atoms, PackGQA layouts, the varlen tile scheduler, grid),
its ``kernel`` body (pipelines, shared memory, warp specialisation), its producer ``load`` for contiguous K/V
and for its cp.async paged path, and its consumer ``mma`` (intra-warpgroup-overlapped QK/PV GEMMs, online
softmax, epilogue) run unchanged. We replace three small pieces that FA4 builds per work tile and hands to
``load`` and ``mma``, and the producer of paged TMA loads (below):

- ``SeqlenInfoCls`` -> :class:`MixedSeqlenInfoQK`: FA4's per-tile sequence info plus ``num_causal_q`` of the
  tile's sequence, read from a device tensor (one load per tile);
- ``block_info`` -> :class:`MixedBlockInfo`: the key-block range ``[n_block_min, n_block_max)`` of a query
  tile and the bounds of its masked / unmasked sub-ranges, from the per-row allowed key interval
  ``[lo(i), hi(i)]`` of docs/ARCHITECTURE.md ("Which keys a row sees"). Producer and consumer call the same
  function, so they agree on the blocks (a disagreement would deadlock the K/V pipeline);
- ``AttentionMaskCls`` -> :class:`MixedAttentionMask`: per-row ``[lo, hi]`` masking with FA4's R2P
  bitmask helpers (rows of one tile may mix causal and bidirectional rows when ``0 < num_causal_q < q_len``).

The tile order. FA4's ``__call__`` gives its varlen scheduler ``lpt=is_causal or is_local`` (longest tiles
first, heads grouped in L2 sections); built ``is_local``, our kernel would always get that order. ``lpt`` is a
constructor argument instead (default on; ``config.resolve_config`` turns it off below 512 query tokens,
``config.longest_first_tiles``), applied by :class:`_SchedulerArgsLpt` while ``__call__`` is traced. It pays on
causal prefills and mixed batches, and costs canvases, hence a config field.

The batch order (constructor ``batch_order``, config ``CuteConfig.batch_order``). FA4's varlen scheduler takes the
sequences in batch order (``lpt`` orders tiles only within a sequence). With ``batch_order="work"`` the kernel takes
one more aux tensor, the last one: an int32 ``[B]`` permutation (:func:`blockdiff.attention.cute.tile_order.
batch_work_order`, computed on the device per call), which :meth:`FlashAttentionForwardSm90Mixed.kernel` puts into
the scheduler's parameters as FA4's ``VarlenDecoder.virtual_batch_idx_ptr`` (:func:`_with_batch_order`): the decoder
then walks the sequences in that order, reads each one's query length through it, and
``SingleTileVarlenScheduler`` hands every work tile its real batch index, so everything after the scheduler
(sequence info, page table, causal row counts, the epilogue's rows) is unchanged and each tile computes exactly what
it computes in batch order. FA4's SM90 ``__call__`` passes no permutation; the parameters are a value of the kernel,
so the substitution happens where the kernel's trace receives them, and the grid (from ``total_q``) is unchanged.

The producer for paged K/V. When the page size is not the key tile (``tile_n``), FA4 loads K/V with cp.async
and a page-table lookup per row (its TMA path needs ``page_size == tile_n``); that path is slower than TMA. With
``kv_page_size`` set, FA4's ``__call__`` builds its K and V TMA atoms with a ``(min(page_size, tile_n),
head_dim)`` box (:class:`_PageBoxTmaAtoms`, active only while ``cute.compile`` traces it) and
:meth:`FlashAttentionForwardSm90Mixed._load_paged_boxes` (FA4's TMA producer loop, K/V stage order unchanged)
fills each K/V stage with ``tile_n // box`` page boxes that complete on the stage's one barrier. Pages must be
multiples of 8 rows that divide ``tile_n`` or are multiples of it (``config.kv_load_path``).

Every paged TMA load goes through this producer, ``page_size == tile_n`` included (one box per stage), because
FA4's own paged TMA path has a hole: a box holding the sequence's last key also brings in the rest of that
page (and boxes of the last key block that lie past the last page reload its last box). Those columns are
masked (P = 0), but 0 * NaN = NaN in P @ V, so a NaN or Inf left in the cache there (a freed page's stale
values) reached the output. The V stage of a sequence's last key block is therefore loaded on the producer's
own mbarrier, its rows past the last key are zeroed, and only then is the stage released to the consumers
(``_acquire_load_v``); K needs no clean-up (its scores are masked to -inf). FA4's cp.async path and the triton
backend zero-fill those rows too. Tested by
``test_gpu_nonfinite_cache_rows_past_seq_lens_stay_out_of_the_output``.

NaN-safe V (constructor ``nan_safe_v``, default False; config ``CuteConfig.nan_safe_v``, on by default, which the
interface passes; off, the kernel is the one built without it). Keys inside ``seq_lens`` that a row may not see (a
causal row's future keys on the diagonal block, keys past a window edge) have P = 0, but FA4's PV wgmma multiplies
the whole V stage, so a NaN / Inf there gave ``0 * NaN = NaN`` in every row of the tile. Only masked key blocks can
hold such keys, and FA4's consumer hands a ``mask_fn`` exactly to their calls (the tile's first block, the right-
and left-masked loops; the interior loop gets None).
With the switch, in every such call each consumer warpgroup cleans that
block's V stage in shared memory before its PV wgmma reads it (:meth:`FlashAttentionForwardSm90Mixed._clean_v_stage`:
NaN / Inf entries zeroed, a ``bar.red.or`` over the warpgroup ORs "there was one" into a per-warpgroup flag, and
a per-stage tag in shared memory tells the warpgroup that cleans second, which finds the stage already clean);
with FA4's intra-warpgroup overlap at the end of the block's call (its PV runs in the next call), without it right
before the PV (placements under a GEMM were tried and refuted: docs/tuning.md 2.30). With the constructor's
``skip_allowed_first`` (config ``CuteConfig.skip_allowed_first``) the scan of a tile's (a split's) first block is
skipped when every row of the tile sees all of it (2.27). The epilogue hook
(:meth:`~FlashAttentionForwardSm90Mixed._nonfinite_fixup`) then, only for a flagged tile, adds each non-finite V
entry of the masked blocks' keys to exactly the accumulator rows that allow the key, in its column, reading V from
global memory (the cache is appended to the aux tensors: on its TMA paths FA4 hands the kernel coordinate tensors as
``mV``). The interior loop's code is unchanged. Design and expected
cost: docs/tuning.md 2.4.

The device tensor ``num_causal_q`` reaches the kernel through FA4's own ``aux_data`` argument (its
FlexAttention aux-tensor channel); :meth:`FlashAttentionForwardSm90Mixed.kernel` takes it out and runs FA4's
kernel body with an empty ``AuxData``, so FA4 does no aux-tensor work. The kernel is built with
``is_causal=False, is_local=True``: FA4's consumer then emits its three loops (right-masked blocks,
unmasked interior blocks, left-masked blocks) and our block info decides their bounds per tile.

Why not FA4's ``mask_mod`` + block-sparsity route (read in flash-attn-4 4.0.0b36): on SM90 the block-sparse
producer (``block_sparse_utils.produce_block_sparse_loads``) issues K/V loads with ``page_idx=None`` through the
TMA closures only, so it has no paged-KV path (neither the page-table TMA nor the cp.async ``PagedKVManager``);
the per-(batch, head, m_block) block lists must be rebuilt for every step's metadata (host code or extra
launches: ``compute_block_sparsity``); and ``mask_mod`` is evaluated element by element (scalar, no R2P) in
every partial block. Without block sparsity a ``mask_mod`` gets no tile skipping at all (FA4's block range
ignores it). Per-tile block ranges computed in the kernel from device metadata give the skipping in both
directions, keep the paged loads, and need no mask building.

Row semantics (row ``i`` of a sequence, ``ctx = seqlen_k - seqlen_q``, ``q_abs = ctx + i``, ``W`` window):
causal row ``i < num_causal_q``: ``[max(0, q_abs - W), q_abs]``; bidirectional row, symmetric:
``[max(0, q_abs - W), min(seqlen_k - 1, q_abs + W)]``; bidirectional row, prefix:
``[max(0, ctx + num_causal_q - W), seqlen_k - 1]``; no window: ``W = inf``. Both ``lo(i)`` and ``hi(i)``
are non-decreasing in ``i`` for every mix of row types and both window modes (a causal row's ``hi`` is
``q_abs`` <= every later row's ``hi``; in prefix mode the last causal row's ``lo`` is ``ctx + ncq - 1 - W``
< the bidirectional ``lo``), so a tile's block range needs only its first and last rows. Every row allows at
least its own key, so no tile is empty.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr, pipeline
from cutlass.base_dsl.dsl import BaseDSL
from cutlass.cute.nvgpu import cpasync

from quack import copy_utils, layout_utils
from quack.cute_dsl_utils import ParamsBase

from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute import flash_fwd_sm90 as _fa4_fwd_sm90
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.mask import (
    mask_r2p_lambda,
    r2p_bitmask_above,
    r2p_bitmask_below,
    sm90_col_to_r2p_idx,
)
from flash_attn.cute.pack_gqa import PackGQA
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.tile_scheduler import SingleTileVarlenScheduler
from flash_attn.cute.utils import AuxData

from .config import page_box_tma_ok
from .ptx import barrier_or, fma_zero, is_finite_f32, opaque


@cute.jit
def row_key_range(
    row: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    num_causal_q: Int32,
    window: Optional[Int32],
    prefix_window: cutlass.Constexpr[bool],
):
    """Allowed keys ``[lo, hi]`` (inclusive, absolute key positions) of query row ``row`` of a sequence.

    Same formulas as :func:`blockdiff.attention.masks.key_range` (the host implementation; docs/ARCHITECTURE.md
    "Which keys a row sees"), here in CuTe DSL integers on the device. ``window`` None means no window (a
    compile-time property).
    """
    ctx = seqlen_k - seqlen_q
    q_abs = ctx + row
    is_causal_row = row < num_causal_q
    lo = Int32(0)
    hi_bi = seqlen_k - 1
    if const_expr(window is not None):
        lo_sliding = cutlass.max(q_abs - window, 0)
        if const_expr(prefix_window):
            lo_prefix = cutlass.max(ctx + num_causal_q - window, 0)
            lo = lo_sliding if is_causal_row else lo_prefix
        else:
            lo = lo_sliding
            hi_bi = cutlass.min(q_abs + window, seqlen_k - 1)
    hi = q_abs if is_causal_row else hi_bi
    return lo, hi


#: Named barriers of the NaN-safe V clean-up, one per consumer warpgroup (ids 12-14: FA4's ``NamedBarrierFwd`` uses
#: 1-6, the split-value kernel 7-11).
NAN_CLEAN_BARRIER_WG1 = 12
#: Named barrier of :attr:`FlashAttentionForwardSm90Mixed._CLEAN_SPLIT_ACROSS_WG`'s clean-up, over every consumer
#: warpgroup of FA4's consumer (id 15; the roles kernel's own use of 15 is another kernel).
NAN_CLEAN_BARRIER_ALL = 15

#: fp32 exponent bits: an entry is NaN / +-Inf iff ``bits & F32_EXP_MASK == F32_EXP_MASK`` (the recompute's cold path
#: marks the entries it rewrites by it).
F32_EXP_MASK = 0x7F800000
#: Independent ``fma(x, 0, s)`` chains per accumulator row of the recompute's epilogue test
#: (:meth:`FlashAttentionForwardSm90Mixed._nr_ffma_test`): fewer are longer dependency chains, more are more
#: registers and sums.
NR_FFMA_CHAINS = 4
#: log2(e), natural-log LSEs to base 2 (the recompute's P = exp2(S * scale_log2 - lse * LOG2_E)).
LOG2_E = 1.4426950408889634
#: The largest ``ffma_weight_below`` a kernel takes: below ``|max * scale_log2| = 2**16`` FA4's FFMA weight errs by
#: at most half an ulp of that product, 2**-9 in log2 units (a relative weight error of 0.14 %, about bf16's own
#: rounding); past it the FFMA's error would exceed the outputs' precision.
MAX_FFMA_WEIGHT_BELOW = 2.0 ** 16

#: Int64 shared-memory slots of the recompute's addresses (:meth:`FlashAttentionForwardSm90Mixed._stash_write`): Q,
#: K, V, the page table and the counter, each its address and its dynamic strides and shapes. At most 24: a strided
#: Q (1 + 2 strides + 2 shapes), strided paged K and V (1 + 3 + 3 each, vLLM's cache views), the page table
#: (1 + 1 + 1), the counter (1 + 1).
NR_STASH_SLOTS = 24

#: First value of the clean-up's per-warpgroup use counter (the tags of :meth:`FlashAttentionForwardSm90Mixed.
#: _clean_v_stage`); any value works, this one makes a stale shared-memory word unlikely to match.
NAN_TAG_BASE = 0x4E614E00


def _row_coord(x, wide: bool):
    """A cache / Q row or page coordinate of the cold paths: Int64 when the kernel was built for tensors of 2^31 or
    more elements (``wide_offsets``: the offset ``coordinate x stride`` must not wrap in 32 bits), else as it is
    (64-bit coordinates always cost the hd-256 kernels spills: docs/tuning.md 2.34)."""
    return cutlass.Int64(x) if wide else x


def _int32_bit(b: int) -> int:
    """Bit ``b`` (0-31) of an Int32 as a Python int in the int32 range (bit 31: -2^31)."""
    return -(1 << 31) if b == 31 else 1 << b


@dataclass(frozen=True)
class MixedSeqlenInfoQK(SeqlenInfoQK):
    """FA4's ``SeqlenInfoQK`` plus the causal row count of the tile's sequence."""

    num_causal_q: Optional[Int32] = None

    @staticmethod
    def wrap(base: SeqlenInfoQK, num_causal_q: Int32) -> "MixedSeqlenInfoQK":
        vals = {f.name: getattr(base, f.name) for f in fields(SeqlenInfoQK)}
        return MixedSeqlenInfoQK(**vals, num_causal_q=num_causal_q)


@dataclass(frozen=True)
class MixedBlockInfo(BlockInfo):
    """FA4's ``BlockInfo`` with block ranges from per-row key intervals (mixed causal/bidirectional rows).

    ``window_size_left`` holds W (None: no window); ``window_size_right`` is unused.
    """

    prefix_window: cutlass.Constexpr[bool] = False

    @cute.jit
    def tile_rows(self, seqlen_info: MixedSeqlenInfoQK, m_block: Int32):
        """First and last query row (within the sequence) of tile ``m_block`` (PackGQA-aware)."""
        m_idx_min = m_block * self.tile_m
        m_idx_max = (m_block + 1) * self.tile_m
        if const_expr(self.qhead_per_kvhead_packgqa > 1):
            m_idx_min = m_idx_min // self.qhead_per_kvhead_packgqa
            m_idx_max = cute.ceil_div(m_idx_max, self.qhead_per_kvhead_packgqa)
        row_last = cutlass.min(m_idx_max, seqlen_info.seqlen_q) - 1
        return m_idx_min, row_last

    @cute.jit
    def row_range(self, seqlen_info: MixedSeqlenInfoQK, row: Int32):
        return row_key_range(
            row,
            seqlen_info.seqlen_q,
            seqlen_info.seqlen_k,
            seqlen_info.num_causal_q,
            self.window_size_left,
            self.prefix_window,
        )

    @cute.jit
    def get_n_block_min_max(
        self,
        seqlen_info: MixedSeqlenInfoQK,
        m_block: Int32,
        split_idx: Int32 = 0,
        num_splits: Int32 = 1,
    ):
        row_first, row_last = self.tile_rows(seqlen_info, m_block)
        lo_first, _ = self.row_range(seqlen_info, row_first)
        _, hi_last = self.row_range(seqlen_info, row_last)
        n_block_min = lo_first // self.tile_n
        n_block_max = (hi_last + self.tile_n) // self.tile_n  # ceil((hi_last + 1) / tile_n)
        n_block_max = cutlass.max(n_block_max, n_block_min + 1)
        return n_block_min, n_block_max

    @cute.jit
    def get_n_block_min_causal_local_mask(
        self, seqlen_info: MixedSeqlenInfoQK, m_block: Int32, n_block_min: Int32
    ) -> Int32:
        """Blocks ``n >= result`` may hold keys past some row's ``hi`` (right-masked iterations)."""
        row_first, _ = self.tile_rows(seqlen_info, m_block)
        _, hi_first = self.row_range(seqlen_info, row_first)
        return cutlass.max(n_block_min, (hi_first + 1) // self.tile_n)

    @cute.jit
    def get_n_block_min_before_local_mask(
        self, seqlen_info: MixedSeqlenInfoQK, m_block: Int32, n_block_min: Int32
    ) -> Int32:
        """Blocks ``n < result`` may hold keys before some row's ``lo`` (left-masked iterations)."""
        result = n_block_min
        if const_expr(self.window_size_left is not None):
            _, row_last = self.tile_rows(seqlen_info, m_block)
            lo_last, _ = self.row_range(seqlen_info, row_last)
            result = cutlass.max(n_block_min, cute.ceil_div(lo_last, self.tile_n))
        return result


@dataclass(frozen=True)
class MixedAttentionMask:
    """Per-row ``[lo, hi]`` masking of an SM90 S accumulator tile (replaces FA4's ``AttentionMask``)."""

    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    seqlen_info: MixedSeqlenInfoQK
    window_size: Optional[Int32] = None
    qhead_per_kvhead_packgqa: cutlass.Constexpr[int] = 1
    prefix_window: cutlass.Constexpr[bool] = False

    @cute.jit
    def apply_mask(
        self,
        acc_S: cute.Tensor,
        batch_idx: Int32,
        head_idx: Int32,
        m_block: Int32,
        n_block: Int32,
        thr_mma: cute.TiledMma,
        mask_seqlen: cutlass.Constexpr[bool] = True,
        mask_causal: cutlass.Constexpr[bool] = False,
        mask_local: cutlass.Constexpr[bool] = False,
        mask_mod: cutlass.Constexpr[Optional[Callable]] = None,
        aux_data: AuxData = AuxData(),
        fastdiv_mods=(None, None),
    ) -> None:
        # Every row's hi is clamped to seqlen_k - 1, so the seqlen bound is part of the interval and
        # mask_seqlen / mask_causal / mask_local need no separate handling.
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS))
        # Columns of thread 0 are compile-time known; other threads shift the limits by their offset.
        thr_col_offset = tScS_mn[0][1]
        col_base = n_block * self.tile_n + thr_col_offset
        seqlen = self.seqlen_info
        for r in cutlass.range(cute.size(tScS_mn.shape[0]), unroll_full=True):
            row = tScS_mn[r, 0][0] + m_block * self.tile_m
            if const_expr(self.qhead_per_kvhead_packgqa > 1):
                row = row // self.qhead_per_kvhead_packgqa
            lo, hi = row_key_range(
                row, seqlen.seqlen_q, seqlen.seqlen_k, seqlen.num_causal_q, self.window_size,
                self.prefix_window,
            )
            col_limit_left = cutlass.max(cutlass.min(lo - col_base, self.tile_n), 0)
            col_limit_right = cutlass.max(cutlass.min(hi + 1 - col_base, self.tile_n), 0)
            col_limit_left_r2p = sm90_col_to_r2p_idx(col_limit_left)
            col_limit_right_r2p = sm90_col_to_r2p_idx(col_limit_right)

            def mask_gen_fn(s: int) -> cutlass.Uint32:
                return r2p_bitmask_below(col_limit_right_r2p, s) & r2p_bitmask_above(
                    col_limit_left_r2p, s
                )

            mask_r2p_lambda(acc_S_mn[r, None], mask_gen_fn, rank1=True)


class _PageBoxTmaAtoms:
    """Stands in for ``cpasync`` in FA4's SM90 module while its ``__call__`` is traced (host side only).

    FA4 builds the K and V TMA atoms with a ``(tile_n, head_dim)`` box, and its producer indexes the page table
    by key block, so FA4 uses TMA only when ``page_size == tile_n`` (cp.async otherwise). Here the K / V
    atoms get a ``(box_rows, head_dim)`` box instead (``box_rows = min(page_size, tile_n)``), with the shared
    memory layout of the first ``box_rows`` rows of FA4's own K / V stage (same swizzle, same strides), so a
    stage of ``tile_n`` rows is filled by ``tile_n // box_rows`` TMA loads into consecutive row slices
    (:meth:`FlashAttentionForwardSm90Mixed._load_paged_boxes`). Every other attribute (and the Q / O atoms,
    recognised by their shared-memory layout or copy op) passes through to the real module, as does every call
    from a thread other than the one that installed the proxy.
    """

    def __init__(self, kernel: "FlashAttentionForwardSm90Mixed"):
        self._real = cpasync
        self._kernel = kernel
        self._thread = threading.get_ident()
        self.replaced = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def make_tiled_tma_atom(self, op, gmem_tensor, smem_layout, cta_tiler, *args, **kwargs):
        k = self._kernel
        is_kv = (threading.get_ident() == self._thread and isinstance(op, self._real.CopyBulkTensorTileG2SOp)
                 and smem_layout is not k.sQ_layout and cta_tiler[0] == k.tile_n
                 and cta_tiler[1] in (k.tile_hdim, k.tile_hdimv))
        if not is_kv:
            return self._real.make_tiled_tma_atom(op, gmem_tensor, smem_layout, cta_tiler, *args, **kwargs)
        self.replaced += 1
        box = (k.kv_box_rows, cta_tiler[1])
        return self._real.make_tiled_tma_atom(
            op, gmem_tensor, cute.composition(smem_layout, box), box, *args, **kwargs)


class _SchedulerArgsLpt:
    """Stands in for ``TileSchedulerArguments`` in FA4's SM90 module while its ``__call__`` is traced: the
    tile scheduler gets ``lpt=<ours>`` instead of FA4's ``is_causal or is_local`` (our kernel is built
    ``is_local``, which would always select FA4's longest-first order with its L2 head sections). Calls from
    other threads pass through unchanged."""

    def __init__(self, lpt: bool):
        self._real = _fa4_fwd_sm90.TileSchedulerArguments
        self._lpt = lpt
        self._thread = threading.get_ident()
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if threading.get_ident() == self._thread:
            kwargs["lpt"] = self._lpt
            self.calls += 1
        return self._real(*args, **kwargs)


@dataclass
class ExactWeightSoftmax(Softmax):
    """FA4's SM90 online softmax (``flash_attn.cute.softmax.Softmax``, flash-attn-4 4.0.0b36) with the exact key
    weight: the running max stays on raw scores, as in FA4, and each key weighs ``exp2((s - m) * scale_log2)``, a
    subtraction then a multiply, where FA4 weighs ``exp2(s * scale_log2 - m * scale_log2)``, which LLVM contracts
    into one FFMA against the rounded product ``m * scale_log2``. That FFMA keeps the product's rounding error, up
    to half an ulp of ``|m| * scale_log2``; beyond ~2^31 in log2 units (scores near -2e31 at scale 1) the row's
    best key then weighs inf or 0 and the row is NaN (docs/ARCHITECTURE.md section 4, "Scores beyond ~2^31 in log2
    units"; the triton backend's fix of the same weight, ``attention/triton/portable.py``). ``s - m`` is exact
    where ``s`` and ``m`` are within a factor two (Sterbenz) and is otherwise rounded relative to itself, so the
    best key weighs exactly 1. The rescale of O, ``exp2((m_old - m_new) * scale_log2)``, and the LSE,
    ``(m * scale_log2 + log2(l)) * ln 2`` from the raw max (:meth:`finalize`), are FA4's unchanged. One more FP32
    operation per score than FA4.

    Shapes / dtypes as FA4's: ``acc_S`` the fp32 S accumulator of one thread (``num_rows`` rows in the MMA's C
    layout), ``row_max`` / ``row_sum`` fp32 register tensors ``[num_rows]``; ``scale_log2`` fp32, at least
    2**-120 (the interface runs non-positive scales as a positive one and, with ``exact_weight``, a smaller one on
    ``q * 2**-24``: ``interface.positive_scale``; below it a raw ``s - m`` overflowing to ``-inf`` would drop a key
    of weight up to 2**-4).

    ``ffma_below`` (compile time, default 0: off): per key block, where every row of the warp has
    ``|m * scale_log2| < ffma_below`` (one ``vote.all``; an inf max takes the exact side, a NaN max leaves the
    choice to the other rows and its row is NaN either way), the weight is FA4's
    FFMA ``exp2(s * scale_log2 - round(m * scale_log2))``, which errs there by half an ulp of that product at most,
    ``2**(ceil(log2(ffma_below)) - 25)`` in log2 units (``ffma_below * 2**-25`` for a power of two: 2**-17 at
    ``config.EXACT_WEIGHT_FFMA_BELOW``, 2**8; the weights of two key blocks, each off by its own max's rounding,
    relative to each other twice that); elsewhere the exact weight. The branch is uniform per warp and covers
    all of the thread's rows, so each side is FA4's or the exact straight-line body whole, exp2s included
    (:meth:`_online_softmax_voted`). The rescale and LSE are as above either way; the
    recompute's exact weights then differ from the mainloop's by that error at most.

    ``keep_inv_sum`` (compile time): :meth:`finalize` also keeps the normalisation factor it applies to O
    (``1 / l``, or 1 for a zero or NaN sum: FA4's rule) in ``row_inv_sum`` (fp32 ``[num_rows]``), for NaN-safe V's
    recompute (``FlashAttentionForwardSm90Mixed._recompute_warp``), which then weighs a key exactly as the mainloop
    did, ``exp2((s - m) * scale_log2) / l``, instead of through the rounded LSE.
    """

    keep_inv_sum: cutlass.Constexpr[bool] = False
    row_inv_sum: Optional[cute.Tensor] = None
    ffma_below: cutlass.Constexpr[float] = 0.0

    @staticmethod
    def create(scale_log2: Float32, num_rows: cutlass.Constexpr[int], arch: cutlass.Constexpr[int] = 80,
               softmax_scale: Optional[Float32] = None, keep_inv_sum: cutlass.Constexpr[bool] = False,
               ffma_below: cutlass.Constexpr[float] = 0.0):
        """FA4's ``Softmax.create`` for this class (register tensors ``row_max`` / ``row_sum``, and
        ``row_inv_sum`` with ``keep_inv_sum``), trace time."""
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        inv = cute.make_rmem_tensor(num_rows, Float32) if keep_inv_sum else None
        return ExactWeightSoftmax(scale_log2, num_rows, row_max, row_sum, arch, softmax_scale,
                                  keep_inv_sum=keep_inv_sum, row_inv_sum=inv, ffma_below=float(ffma_below))

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool] = False,
                       check_inf: cutlass.Constexpr[bool] = True) -> cute.Tensor:
        """FA4's ``online_softmax`` (same arguments, same state, same return: the rescale factor of O per row) with
        the weight ``exp2((s - m) * scale_log2)`` (with ``ffma_below``: :meth:`_online_softmax_voted`). Raises
        nothing (trace time)."""
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        if const_expr(self.ffma_below > 0.0):
            self._online_softmax_voted(acc_S_mn, row_scale, is_first, check_inf)
            return row_scale
        row_max = self.row_max
        arch = self.arch
        for r in cutlass.range(cute.size(row_max), unroll_full=True):
            acc_S_row = acc_S_mn[r, None].load()
            row_max_cur = fa_utils.fmax_reduce(
                acc_S_row, init_val=row_max[r] if const_expr(not is_first) else None, arch=arch)
            row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
            row_max_prev = row_max[r]
            row_max[r] = row_max_cur  # the raw max, before it is made safe for -inf
            if const_expr(check_inf):
                row_max_cur = 0.0 if row_max_cur == -Float32.inf else row_max_cur
            # the exact weight: subtract, then multiply (no FFMA against a rounded max * scale_log2)
            self._weigh_row(acc_S_mn, acc_S_row, r, row_scale, row_max_prev, row_max_cur, is_first, False)
        return row_scale

    @cute.jit
    def _online_softmax_voted(self, acc_S_mn: cute.Tensor, row_scale: cute.Tensor,
                              is_first: cutlass.Constexpr[bool], check_inf: cutlass.Constexpr[bool]):
        """``ffma_below`` ("auto"): the maxima of every row of this thread first, then one ``vote.all`` per key
        block over the warp on ``max_r |m_r * scale_log2| < ffma_below``, then either side whole
        (:meth:`_weigh_rows`): FA4's FFMA weights or the exact ones, each straight-line code over all rows as in
        FA4 (a branch per row would end ptxas' interleave of one row's exp2s with the next row's FP32 work). A NaN
        max leaves the vote to the other rows; its row is NaN either way.
        Fills ``row_scale``; trace time."""
        row_max = self.row_max
        arch = self.arch
        row_max_prev = cute.make_fragment_like(row_max, Float32)
        row_max_safe = cute.make_fragment_like(row_max, Float32)
        worst = Float32(0.0)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            row_max_cur = fa_utils.fmax_reduce(
                acc_S_mn[r, None].load(), init_val=row_max[r] if const_expr(not is_first) else None, arch=arch)
            row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
            row_max_prev[r] = row_max[r]
            row_max[r] = row_max_cur  # the raw max, before it is made safe for -inf
            if const_expr(check_inf):
                row_max_cur = 0.0 if row_max_cur == -Float32.inf else row_max_cur
            row_max_safe[r] = row_max_cur
            scaled = row_max_cur * self.scale_log2
            worst = fa_utils.fmax(worst, fa_utils.fmax(scaled, -scaled))
        if cute.arch.vote_all_sync(worst < self.ffma_below):
            self._weigh_rows(acc_S_mn, row_scale, row_max_prev, row_max_safe, is_first, True)
        else:
            self._weigh_rows(acc_S_mn, row_scale, row_max_prev, row_max_safe, is_first, False)

    @cute.jit
    def _weigh_rows(self, acc_S_mn: cute.Tensor, row_scale: cute.Tensor, row_max_prev: cute.Tensor,
                    row_max_safe: cute.Tensor, is_first: cutlass.Constexpr[bool], ffma: cutlass.Constexpr[bool]):
        """Every row's weights (in place in ``acc_S_mn``), sum and rescale factor against the maxima
        ``row_max_safe``: FA4's ``exp2(s * scale_log2 - m * scale_log2)`` (one FFMA) with ``ffma``, else
        ``exp2((s - m) * scale_log2)``; trace time."""
        for r in cutlass.range_constexpr(cute.size(row_max_safe)):
            self._weigh_row(acc_S_mn, acc_S_mn[r, None].load(), r, row_scale, row_max_prev[r], row_max_safe[r],
                            is_first, ffma)

    @cute.jit
    def _weigh_row(self, acc_S_mn: cute.Tensor, acc_S_row: cute.TensorSSA, r,
                   row_scale: cute.Tensor, row_max_prev: Float32, row_max: Float32, is_first: cutlass.Constexpr[bool],
                   ffma: cutlass.Constexpr[bool]):
        """Row ``r``'s weights (stored into ``acc_S_mn``), sum (``row_sum[r]``) and rescale factor (``row_scale[r]``)
        against its max ``row_max`` (made safe for -inf), ``row_max_prev`` the raw max before this key block:
        FA4's ``exp2(s * scale_log2 - m * scale_log2)`` (one FFMA) with ``ffma``, else ``exp2((s - m) *
        scale_log2)``; FA4's rescale ``exp2((m_prev - m) * scale_log2)``; trace time."""
        scale_log2 = self.scale_log2
        if const_expr(ffma):
            acc_S_row_exp = cute.math.exp2(acc_S_row * scale_log2 - row_max * scale_log2, fastmath=True)
        else:
            acc_S_row_exp = cute.math.exp2((acc_S_row - row_max) * scale_log2, fastmath=True)
        if const_expr(is_first):
            acc_S_row_sum = fa_utils.fadd_reduce(acc_S_row_exp, init_val=None, arch=self.arch)
            row_scale[r] = 1.0
        else:
            row_scale[r] = cute.math.exp2((row_max_prev - row_max) * scale_log2, fastmath=True)
            acc_S_row_sum = fa_utils.fadd_reduce(acc_S_row_exp, init_val=self.row_sum[r] * row_scale[r],
                                                 arch=self.arch)
        self.row_sum[r] = acc_S_row_sum
        acc_S_mn[r, None].store(acc_S_row_exp)

    @cute.jit
    def finalize(self, final_scale: Float32 = 1.0, sink_val=None) -> cute.Tensor:
        """FA4's ``finalize`` (the LSE into ``row_sum``, the normalisation factor of O returned); with
        ``keep_inv_sum`` that factor is also kept in ``row_inv_sum``."""
        row_scale = Softmax.finalize(self, final_scale, sink_val)
        if const_expr(self.keep_inv_sum):
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                self.row_inv_sum[r] = row_scale[r]
        return row_scale


class _ExactSoftmaxFactory:
    """Stands in for ``Softmax`` in FA4's SM90 module while a kernel built with ``exact_weight`` is traced
    (:meth:`FlashAttentionForwardSm90Mixed.trace_patches`): FA4's consumer ``mma`` then creates an
    :class:`ExactWeightSoftmax` (kept on the kernel as ``_exact_softmax`` for the recompute). Calls from other
    threads get FA4's ``Softmax`` unchanged."""

    def __init__(self, kernel: "FlashAttentionForwardSm90Mixed"):
        self._real = _fa4_fwd_sm90.Softmax
        self._kernel = kernel
        self._thread = threading.get_ident()
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def create(self, scale_log2, num_rows, arch=80, softmax_scale=None):
        if threading.get_ident() != self._thread:
            return self._real.create(scale_log2, num_rows, arch=arch, softmax_scale=softmax_scale)
        self.calls += 1
        return self._kernel._make_softmax(scale_log2, num_rows, softmax_scale=softmax_scale, arch=arch)


_PROXY_LOCK = threading.Lock()


def _with_batch_order(params, order):
    """FA4's varlen tile scheduler parameters (``SingleTileVarlenScheduler.Params``, a value of the kernel's trace)
    with ``order`` (an int32 ``[B]`` batch permutation, a tensor of the trace) as its decoder's
    ``virtual_batch_idx_ptr``. Trace time, host side.

    Raises:
        ValueError: the parameters are not those of FA4's varlen scheduler with a ``virtual_batch_idx_ptr`` slot, or
            carry a per-batch table of their own (tile counts, cumulative counts, a block-to-batch index, a
            permutation) that the permutation would have to match.
    """
    decoder = getattr(params, "decoder", None)
    if not (isinstance(params, SingleTileVarlenScheduler.Params) and hasattr(decoder, "virtual_batch_idx_ptr")):
        raise ValueError("batch_order 'work' needs FA4's varlen tile scheduler (SingleTileVarlenScheduler with "
                         f"VarlenDecoder.virtual_batch_idx_ptr); this kernel's is {type(params).__qualname__}: use "
                         "batch_order 'given'")
    tables = [n for n in ("virtual_batch_idx_ptr", "num_m_blocks_ptr", "num_splits_dynamic_ptr",
                          "num_nheads_in_l2_ptr", "cu_total_m_blocks_ptr", "cu_total_splits_m_blocks_ptr",
                          "blocks_to_batch_idx_ptr") if getattr(decoder, n, None) is not None]
    if tables:
        raise ValueError(f"batch_order 'work': FA4's scheduler already has per-batch tables {tables}; use "
                         "batch_order 'given'")
    return replace(params, decoder=replace(decoder, virtual_batch_idx_ptr=order))


def _call_fa4_kernel_body(*args):
    """Trace FA4's SM90 ``kernel`` body inside our kernel, as the DSL traces any nested ``@cute.jit`` call.

    ``FlashAttentionForwardSm90.kernel`` is a ``@cute.kernel``; its undecorated function (``__wrapped__``) is
    AST-preprocessed exactly as the decorator would do, then inlined through the DSL's nested-call path
    (``_func``: inside an active trace it runs the body in place, no new kernel).
    """
    raw = FlashAttentionForwardSm90.kernel.__wrapped__
    BaseDSL._preprocess_and_replace_code(raw)
    return raw._dsl_object._func(raw, *args)


class FlashAttentionForwardSm90Mixed(FlashAttentionForwardSm90):
    """FA4 SM90 forward with per-sequence causal row counts and one-interval-per-row windows.

    Args (beyond FA4's): ``prefix_window`` (compile-time): bidirectional rows use the "prefix" window
    (else "symmetric"). The window size W is FA4's runtime ``window_size_left`` argument (None: no window).
    ``lpt`` (compile-time, default True): FA4's longest-first tile order with L2 head sections (FA4 uses it for
    causal / local kernels); False: its plain order (heads of a sequence in turn, m-blocks inner), as for FA4's
    non-causal kernel.
    ``nan_safe_v`` (compile-time, default False): keys a row may not see contribute nothing even when their V
    holds NaN / Inf (masked key blocks' V stages cleaned before P V, a cold fix-up in the epilogue; see "NaN-safe
    V" in the module docstring). Off, the kernel is the one built without it.
    ``batch_order`` (compile-time, default ``"given"``): ``"work"`` has FA4's varlen scheduler take the sequences
    in the order of a permutation passed as the last aux tensor (module docstring, "The batch order").
    Runtime extra input: ``aux_data = AuxData([num_causal_q])`` with ``num_causal_q`` ``[B]`` int32 (with
    ``nan_safe_v``, the V cache as the last aux tensor: ``AuxData([num_causal_q, ..., v_cache])``; with
    ``batch_order="work"`` the int32 ``[B]`` batch permutation after all of them).
    ``v_refill`` (compile-time, default ``"one_warp"``): who loads V; ``"halves"`` is built by the roles kernel
    only (:attr:`V_REFILLS` of the class; kernel_roles.py). ``qk_issue`` (compile-time, default ``"serial"``): when
    the next key block's S = Q K^T is issued; ``"ahead"`` is built by the roles kernel only (:attr:`QK_ISSUES`).
    ``k_refill`` (compile-time, default ``"whole"``): whether a K stage is refilled as one block or by head-dim
    halves; ``"halves"`` is built by the roles kernel only (:attr:`K_REFILLS`).
    ``skip_allowed_first`` (compile-time bool, default False; acts with ``nan_safe_v`` only): with NaN-safe V, do not
    scan the tile's (a split's) first key block when every key of it lies inside every row's interval of the tile
    (the block FA4 masks only because it is the first: e.g. a canvas without a window whose context ends on a block
    boundary, or an interior split's first block). Such a block holds no key a row may not see, so its NaN / Inf
    reach exactly the rows the reference gives them to. A tile-uniform scalar test (:meth:`_first_block_needs_clean`,
    the block info's own bounds) sets the scan's trip count to 0; the wait, the barrier and the tag test still run,
    so both warpgroups make the same calls (docs/tuning.md 2.27). True is built by FA4's consumer only
    (:attr:`BUILDS_SKIP_ALLOWED_FIRST`; the wide kernels place their own clean-up).
    ``nan_safe_v_method`` (compile-time, ``"scan"`` default, or ``"recompute"``; acts with ``nan_safe_v`` only):
    how NaN-safe V is kept. ``"scan"``: the masked blocks' V stages cleaned in the mainloop and the additive fix-up
    (above). ``"recompute"`` (docs/tuning.md 2.32, 2.34): the mainloop of ``nan_safe_v=False`` and, at the epilogue
    hook, a test of the accumulator's real rows; a warp that holds a non-finite entry recomputes exactly those
    entries from global memory (:meth:`_nonfinite_recompute`). Then ``self.nan_safe_v`` is False (every mainloop
    hook off) and ``self.nan_recompute`` True. Runtime: the Q tensor, the K and V caches and an int32 ``[1]``
    counter of recomputing warps as the last four aux tensors (before the batch permutation). Built by FA4's
    consumer only (:attr:`BUILDS_NAN_RECOMPUTE`).
    ``wide_offsets`` (compile-time, default False): the NaN-safe fix-up's and the recompute's own reads of Q / K / V
    (cold paths) index with 64-bit row and page coordinates; needed when a tensor holds 2^31 elements or more (the
    interface sets it from the storage sizes). FA4's own loads are TMA / 64-bit already.
    ``exact_weight`` (compile-time bool, default False here, FA4's weight; ``CuteConfig.exact_weight``, on by default,
    sets it for every launch of the backend): the online softmax weighs each key ``exp2((s - m) * scale_log2)``
    (:class:`ExactWeightSoftmax`) instead of FA4's one FFMA
    ``exp2(s * scale_log2 - m * scale_log2)``, which gives NaN rows for scores beyond ~2^31 in log2 units; with
    ``nan_safe_v_method="recompute"`` the recompute weighs its keys the same way (:meth:`_recompute_warp`). FA4's
    consumer gets it through :meth:`trace_patches`, the wide kernels through :meth:`_make_softmax`.
    ``ffma_weight_below`` (compile-time float in [0, :data:`MAX_FFMA_WEIGHT_BELOW`], default 0: off; with
    ``exact_weight`` only; ``CuteConfig.exact_weight="auto"`` sets ``config.EXACT_WEIGHT_FFMA_BELOW``): per key
    block, FA4's FFMA weight where every row of the warp has ``|max * scale_log2|`` below it, the exact weight
    elsewhere (:attr:`ExactWeightSoftmax.ffma_below`).

    Raises:
        ValueError: ``batch_order`` other than ``"given"`` / ``"work"``; a ``v_refill``, ``qk_issue`` or
            ``k_refill`` the class does not build; ``skip_allowed_first=True`` in a class that does not build it;
            a ``kv_page_size`` the page boxes cannot load; ``nan_safe_v_method`` not ``"scan"`` / ``"recompute"``,
            or ``"recompute"`` in a class that does not build it.
        TypeError: ``skip_allowed_first`` or ``exact_weight`` not a bool (``"auto"`` resolves in the config, never
            here); ``ffma_weight_below`` not an int or float.
        ValueError (also): ``ffma_weight_below`` outside ``[0, MAX_FFMA_WEIGHT_BELOW]``, or above 0 without
            ``exact_weight``.
    """

    #: The ``v_refill`` values this class builds (kernel_roles.py adds ``"halves"``).
    V_REFILLS = ("one_warp",)
    #: The ``qk_issue`` values this class builds (kernel_roles.py adds ``"ahead"``).
    QK_ISSUES = ("serial",)
    #: The ``k_refill`` values this class builds (kernel_roles.py adds ``"halves"``).
    K_REFILLS = ("whole",)
    #: Whether this class runs FA4's consumer ``mma`` (which creates its softmax through FA4's module: the
    #: ``exact_weight`` patch of :meth:`trace_patches`); kernel_wide.py's classes create theirs (:meth:`_make_softmax`).
    USES_FA4_MMA = True
    #: Whether this class builds ``skip_allowed_first=True`` (kernel_wide.py's classes do not).
    BUILDS_SKIP_ALLOWED_FIRST = True
    #: Whether this class builds ``nan_safe_v_method="recompute"`` (FA4's consumer: this class, its split and
    #: cluster variants; kernel_wide.py's classes do not).
    BUILDS_NAN_RECOMPUTE = True
    #: Experiment switch (compile time, off; docs/tuning.md 2.31): with ``nan_safe_v`` in FA4's intra-warpgroup
    #: overlap consumer without its scheduler barrier (head dims above 128, e.g. the hd-256 launches; FA4's
    #: ``use_scheduler_barrier`` looks at the QK head dim only), the consumer warpgroups split a masked
    #: block's V stage between them (each thread scans ``n_chunks / (128 x warpgroups)`` 16-byte chunks, half of
    #: what each scanned) and meet at one ``bar.red.or`` over all of them (:data:`NAN_CLEAN_BARRIER_ALL`), which
    #: orders every cleaned chunk before every warpgroup's P V wgmma and gives each the OR of all; no tags (every
    #: chunk has one scanner). Not with the scheduler barrier (its ping-pong keeps the warpgroups out of phase; a
    #: barrier across them would undo it).
    _CLEAN_SPLIT_ACROSS_WG = False
    #: Compile time, with ``nan_safe_v_method="recompute"`` at head dims above 128: the epilogue test and cold path
    #: take the tile's indices through :func:`opaque` and the cold path loads the sequence info anew
    #: (:meth:`_nonfinite_recompute`). On for this (unsplit) class; kernel_split.py's classes turn it off, and it does
    #: not act at hd 128, where it lengthened the compiled key-block loops (docs/tuning.md 2.36).
    _NR_FRESH_TILE_VALUES = True
    #: Timing experiment only (compile time, off; docs/tuning.md 2.37): with ``nan_safe_v_method="recompute"``, the
    #: cold path is replaced by a trivial one (:meth:`_trivial_cold_path`: lane 0 adds 1 to the recompute counter,
    #: nothing is recomputed), so the epilogue test and its vote stay but the recompute's code is gone. It gives WRONG
    #: results wherever a masked key's V is non-finite (those entries stay NaN / Inf); finite caches are unaffected
    #: (the cold path never runs there). Never on outside an A/B.
    _NR_TRIVIAL_COLD_PATH = False
    #: Timing experiment only (compile time, off; docs/tuning.md 2.37), with :attr:`_NR_TRIVIAL_COLD_PATH` only: no
    #: stash writes at the consumers' entry (:meth:`_stash_write`); the trivial cold path takes the counter's address
    #: from the kernel parameter instead.
    _NR_NO_STASH = False

    def __init__(self, *args, prefix_window: bool = False, kv_page_size: Optional[int] = None, lpt: bool = True,
                 nan_safe_v: bool = False, batch_order: str = "given", v_refill: str = "one_warp",
                 qk_issue: str = "serial", k_refill: str = "whole", skip_allowed_first: bool = False,
                 nan_safe_v_method: str = "scan", wide_offsets: bool = False, exact_weight: bool = False,
                 ffma_weight_below: float = 0.0, **kwargs):
        kwargs["is_causal"] = False
        kwargs["is_local"] = True
        # FA4's (dtype, head_dim, head_dim_v, ...): the real head dims (FA4 keeps the 16-padded tile_hdim / tile_hdimv;
        # the recompute's dot products and every epilogue write stop at the real ones)
        head_dim = args[1] if len(args) > 1 else kwargs["head_dim"]
        head_dim_v = (args[2] if len(args) > 2 else kwargs.get("head_dim_v")) or head_dim
        super().__init__(*args, **kwargs)
        self._head_dims = (int(head_dim), int(head_dim_v))
        if batch_order not in ("given", "work"):
            raise ValueError(f"batch_order must be 'given' or 'work', got {batch_order!r}")
        if v_refill not in self.V_REFILLS:
            raise ValueError(f"v_refill {v_refill!r} is not built by {type(self).__name__} (builds {self.V_REFILLS})")
        self.v_refill = v_refill
        if qk_issue not in self.QK_ISSUES:
            raise ValueError(f"qk_issue {qk_issue!r} is not built by {type(self).__name__} (builds {self.QK_ISSUES})")
        self.qk_issue = qk_issue
        if k_refill not in self.K_REFILLS:
            raise ValueError(f"k_refill {k_refill!r} is not built by {type(self).__name__} (builds {self.K_REFILLS})")
        self.k_refill = k_refill
        if not isinstance(skip_allowed_first, bool):
            raise TypeError(f"skip_allowed_first must be a bool, got {type(skip_allowed_first).__name__} "
                            f"({skip_allowed_first!r}); config 'auto' resolves in config.resolve_launch_config")
        if skip_allowed_first and not self.BUILDS_SKIP_ALLOWED_FIRST:
            raise ValueError(f"skip_allowed_first=True is not built by {type(self).__name__} (FA4's consumer only, "
                             "head dims <= 256)")
        self.skip_allowed_first = skip_allowed_first
        self.prefix_window = prefix_window
        self.lpt = lpt
        if nan_safe_v_method not in ("scan", "recompute"):
            raise ValueError(f"nan_safe_v_method must be 'scan' or 'recompute', got {nan_safe_v_method!r}")
        if nan_safe_v_method == "recompute" and not self.BUILDS_NAN_RECOMPUTE:
            raise ValueError(f"nan_safe_v_method='recompute' is not built by {type(self).__name__} (FA4's consumer "
                             "only, head dims <= 256)")
        # "recompute": the mainloop of nan_safe_v=False (every nan_safe_v hook off), the epilogue test and recompute
        self.nan_recompute = bool(nan_safe_v) and nan_safe_v_method == "recompute"
        self.nan_safe_v = bool(nan_safe_v) and not self.nan_recompute
        self.wide_offsets = bool(wide_offsets)
        if not isinstance(exact_weight, bool):
            raise TypeError(f"exact_weight must be a bool, got {type(exact_weight).__name__} ({exact_weight!r})")
        self.exact_weight = exact_weight
        if isinstance(ffma_weight_below, bool) or not isinstance(ffma_weight_below, (int, float)):
            raise TypeError(f"ffma_weight_below must be a float, got {type(ffma_weight_below).__name__} "
                            f"({ffma_weight_below!r})")
        if not 0.0 <= ffma_weight_below <= MAX_FFMA_WEIGHT_BELOW:
            raise ValueError(f"ffma_weight_below must be in [0, {MAX_FFMA_WEIGHT_BELOW}], got {ffma_weight_below!r}")
        if ffma_weight_below > 0.0 and not exact_weight:
            raise ValueError("ffma_weight_below > 0 needs exact_weight=True (it chooses between FA4's weight and the "
                             "exact one)")
        self.ffma_weight_below = float(ffma_weight_below)
        self._exact_softmax = None  # the consumer's ExactWeightSoftmax of this trace (_make_softmax)
        self.batch_order = batch_order
        # trace-time hand-offs of the NaN-safe V path (set in kernel() / mma(); see _nan_safe_setup)
        self._mV = self._mPageTable = None
        self._nf_flag = self._nf_sVt = self._nf_pipeline_v = self._nf_block_info = None
        self._mNumCausalQ = None
        # the recompute's trace-time hand-offs (kernel() / mma())
        self._nr_q = self._nr_k = self._nr_count = self._nr_block_info = self._nr_slots = None
        self._nr_seqlen_cls = None
        # Paged TMA (any page size page_box_tma_ok accepts): K / V stages filled box by box (_PageBoxTmaAtoms).
        self.kv_page_size = None
        self.kv_box_rows = None
        if kv_page_size is not None:
            if not self.use_tma_KV:
                raise ValueError("kv_page_size is for the TMA paged path; pass paged_kv_non_tma=False")
            if not page_box_tma_ok(kv_page_size, self.tile_n):
                raise ValueError(
                    f"kv_page_size={kv_page_size} with tile_n={self.tile_n}: TMA page boxes need one to divide "
                    "the other and a multiple of 8 rows (1 KB-aligned 128-byte-swizzled boxes)")
            self.kv_page_size = kv_page_size
            self.kv_box_rows = min(kv_page_size, self.tile_n)

    @contextlib.contextmanager
    def trace_patches(self):
        """Context for tracing ``__call__`` (``cute.compile``), host side only. Swaps, in FA4's SM90 module:

        * ``cpasync`` for :class:`_PageBoxTmaAtoms` when ``kv_page_size`` was given (K / V TMA atoms with
          page-sized boxes);
        * ``TileSchedulerArguments`` for :class:`_SchedulerArgsLpt` when ``lpt`` is False (FA4 would pick
          its longest-first tile order for every ``is_local`` kernel).

        * ``Softmax`` for :class:`_ExactSoftmaxFactory` when ``exact_weight`` is on (FA4's consumer ``mma`` then
          creates an :class:`ExactWeightSoftmax`).

        A no-op when none applies. Raises RuntimeError if FA4's ``__call__`` did not build exactly the two
        K / V atoms, or the scheduler arguments once, or (``exact_weight``, FA4's consumer) FA4's ``mma`` did not
        create its softmax exactly once (another FA4 version).
        """
        if self.kv_box_rows is None and self.lpt and not self.exact_weight:
            yield
            return
        with _PROXY_LOCK:  # one swap at a time: a second one would save the first proxy as "real"
            real_cpasync, real_args = _fa4_fwd_sm90.cpasync, _fa4_fwd_sm90.TileSchedulerArguments
            real_softmax = _fa4_fwd_sm90.Softmax
            proxy = _PageBoxTmaAtoms(self) if self.kv_box_rows is not None else None
            sched = _SchedulerArgsLpt(self.lpt) if not self.lpt else None
            exact = _ExactSoftmaxFactory(self) if self.exact_weight else None
            if proxy is not None:
                _fa4_fwd_sm90.cpasync = proxy
            if sched is not None:
                _fa4_fwd_sm90.TileSchedulerArguments = sched
            if exact is not None:
                _fa4_fwd_sm90.Softmax = exact
            try:
                yield
            finally:
                _fa4_fwd_sm90.cpasync, _fa4_fwd_sm90.TileSchedulerArguments = real_cpasync, real_args
                _fa4_fwd_sm90.Softmax = real_softmax
        if exact is not None and self.USES_FA4_MMA and exact.calls != 1:
            raise RuntimeError(f"exact_weight: expected FA4's mma to create its softmax once, saw {exact.calls}")
        if proxy is not None and proxy.replaced != 2:
            raise RuntimeError(f"expected FA4 to build 2 K/V TMA atoms, replaced {proxy.replaced}")
        if sched is not None and sched.calls != 1:
            raise RuntimeError(f"expected FA4 to build its tile scheduler arguments once, saw {sched.calls}")

    def _make_softmax(self, scale_log2, num_rows, softmax_scale=None, arch=80):
        """Trace time: the online softmax of a consumer (FA4's ``Softmax.create`` arguments): an
        :class:`ExactWeightSoftmax` with ``exact_weight`` (kept as ``self._exact_softmax``; with the recompute it
        keeps ``1 / l`` for it), else FA4's ``Softmax``. The wide kernels call it for their softmax warpgroup;
        FA4's consumer reaches it through :class:`_ExactSoftmaxFactory`."""
        if not self.exact_weight:
            return Softmax.create(scale_log2, num_rows=num_rows, arch=arch, softmax_scale=softmax_scale)
        sm = ExactWeightSoftmax.create(scale_log2, num_rows, arch=arch, softmax_scale=softmax_scale,
                                       keep_inv_sum=self.nan_recompute, ffma_below=self.ffma_weight_below)
        self._exact_softmax = sm
        return sm

    def _get_shared_storage_cls(self):
        """FA4's shared storage; with the page-box producer, one more mbarrier right after the V pipeline's
        2 x num_stages (the producer's ``tail_bar``, see ``_acquire_load_v``); with ``nan_safe_v`` that slot
        and ``num_stages`` tag slots after it (:meth:`_clean_v_stage`); with the recompute that slot and
        :data:`NR_STASH_SLOTS` address slots (:meth:`_stash_write`). Same size otherwise: the barriers sit before
        1024-byte-aligned buffers."""
        if self.kv_box_rows is None and not self.nan_safe_v and not self.nan_recompute:
            return super()._get_shared_storage_cls()
        assert not self.Q_in_regs, "the page-box producer and nan_safe_v are built with Q_in_regs=False"
        sQ_struct, sK_struct, sV_struct = [
            cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], self.buffer_align_bytes]
            for layout in (self.sQ_layout, self.sK_layout, self.sV_layout)
        ]
        cosize_sP = cute.cosize(self.sP_layout) if const_expr(self.sP_layout is not None) else 0
        sP_struct = cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_sP], 1024]
        mbar_ptr_Q_struct = cute.struct.MemRange[cutlass.Int64, 1 * 2]
        mbar_ptr_K_struct = cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
        # V: full / empty barriers, the page-box producer's tail barrier, and with nan_safe_v one tag slot per stage
        # (the clean-up's "a non-finite entry was zeroed in this use of the stage", _clean_v_stage)
        n_tags = self.num_stages if self.nan_safe_v else 0
        if self.nan_recompute:  # the recompute's address slots (_stash_write); nan_safe_v is False then
            n_tags = NR_STASH_SLOTS
        mbar_ptr_V_struct = cute.struct.MemRange[cutlass.Int64, self.num_stages * 2 + 1 + n_tags]

        # Built with type(): this module's `from __future__ import annotations` would turn class-body annotations
        # into strings, which cute.struct does not resolve. Field order is FA4's.
        fields_ = dict(mbar_ptr_Q=mbar_ptr_Q_struct, mbar_ptr_K=mbar_ptr_K_struct, mbar_ptr_V=mbar_ptr_V_struct,
                       sV=sV_struct, sQ=sQ_struct, sK=sK_struct, sP=sP_struct)
        return cute.struct(type("SharedStorageQKV", (), {"__annotations__": fields_}))

    # --- the three per-tile pieces we replace -------------------------------------------------------
    def _mixed_block_info(self, block_info: BlockInfo) -> MixedBlockInfo:
        return MixedBlockInfo(
            self.tile_m,
            self.tile_n,
            False,
            True,
            False,
            block_info.window_size_left,
            block_info.window_size_left,
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1,
            prefix_window=self.prefix_window,
        )

    def _mixed_seqlen_cls(self, SeqlenInfoCls: Callable) -> Callable:
        mNumCausalQ = self._mNumCausalQ

        def create(batch_idx):
            return MixedSeqlenInfoQK.wrap(SeqlenInfoCls(batch_idx), mNumCausalQ[batch_idx])

        return create

    def _mixed_mask_cls(self, block_info: BlockInfo) -> Callable:
        return partial(
            MixedAttentionMask,
            self.tile_m,
            self.tile_n,
            window_size=block_info.window_size_left,
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1,
            prefix_window=self.prefix_window,
        )

    # --- FA4 entry points, wrapped --------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        tma_atom_Q: Optional[cute.CopyAtom],
        tma_atom_K: Optional[cute.CopyAtom],
        tma_atom_V: Optional[cute.CopyAtom],
        tma_atom_O: Optional[cute.CopyAtom],
        softmax_scale_log2: cutlass.Float32,
        softmax_scale: Optional[cutlass.Float32],
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        learnable_sink: Optional[cute.Tensor],
        blocksparse_tensors: Optional[BlockSparseTensors],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout | None,
        gmem_tiled_copy_Q: cute.TiledCopy,
        gmem_tiled_copy_K: cute.TiledCopy,
        gmem_tiled_copy_V: cute.TiledCopy,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tile_sched_params: ParamsBase,
        TileScheduler: cutlass.Constexpr[Callable],
        SharedStorage: cutlass.Constexpr[Callable],
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
    ):
        aux_tensors = aux_data.tensors
        if const_expr(self.batch_order == "work"):
            # the batch permutation (the last aux tensor) into FA4's varlen scheduler (module docstring)
            tile_sched_params = _with_batch_order(tile_sched_params, aux_tensors[-1])
            aux_tensors = aux_tensors[:-1]
        # Trace-time hand-off: the num_causal_q tensor (a value of this kernel) for load() and mma(); the aux
        # tensors after it belong to subclasses (kernel_split.py's workspace).
        self._mNumCausalQ = aux_tensors[0]
        self._aux_tensors = aux_tensors
        # the softmax scales and P's layout, for a subclass whose producer warpgroup also computes the softmax
        # (kernel_roles.py)
        self._softmax_scales = (softmax_scale_log2, softmax_scale)
        self._sP_layout_arg = sP_layout
        if const_expr(self.nan_safe_v):
            # the NaN-safe fix-up reads V itself: the caller's cache, appended to the aux tensors (FA4 hands the
            # kernel TMA coordinate tensors as mK / mV on its TMA paths), and the page table
            self._mV, self._mPageTable = aux_tensors[-1], mPageTable
        if const_expr(self.nan_recompute):
            # the recompute reads Q, K and V itself (the caller's tensors: on its TMA paths FA4 hands the kernel
            # coordinate tensors) and counts recomputing warps: the last four aux tensors
            self._nr_q, self._nr_k, self._mV, self._nr_count = aux_tensors[-4:]
            self._mPageTable = mPageTable
        _call_fa4_kernel_body(
            self,
            mQ,
            mK,
            mV,
            mO,
            mLSE,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedQ,
            mSeqUsedK,
            mPageTable,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            softmax_scale_log2,
            softmax_scale,
            window_size_left,
            window_size_right,
            learnable_sink,
            blocksparse_tensors,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            sP_layout,
            gmem_tiled_copy_Q,
            gmem_tiled_copy_K,
            gmem_tiled_copy_V,
            gmem_tiled_copy_O,
            tiled_mma_qk,
            tiled_mma_pv,
            tile_sched_params,
            TileScheduler,
            SharedStorage,
            AuxData(),
            None,
        )

    def load(self, *args):
        # FA4 signature: (..., blocksparse_tensors, block_info, SeqlenInfoCls, TileSchedulerCls)
        *head, block_info, SeqlenInfoCls, TileSchedulerCls = args
        if const_expr(self.kv_box_rows is not None):
            (mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k, pipeline_v, pipeline_q,
             gmem_tiled_copy_Q, mPageTable, _blocksparse) = head
            return self._load_paged_boxes(
                mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k, pipeline_v,
                pipeline_q, gmem_tiled_copy_Q, mPageTable, self._mixed_block_info(block_info),
                self._mixed_seqlen_cls(SeqlenInfoCls), TileSchedulerCls,
            )
        return FlashAttentionForwardSm90.load(
            self,
            *head,
            self._mixed_block_info(block_info),
            self._mixed_seqlen_cls(SeqlenInfoCls),
            TileSchedulerCls,
        )

    @cute.jit
    def _load_paged_boxes(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: Optional[cute.CopyAtom],
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        pipeline_q: pipeline.PipelineAsync,
        gmem_tiled_copy_Q: cute.TiledCopy,
        mPageTable: cute.Tensor,
        block_info: MixedBlockInfo,
        SeqlenInfoCls: Callable,
        TileSchedulerCls: Callable,
    ):
        """FA4's SM90 producer (``FlashAttentionForwardSm90.load``, TMA K/V branch, no block sparsity) with
        each K / V stage loaded as ``tile_n // box_rows`` page boxes.

        Key block ``n`` covers key rows ``[n * tile_n, (n + 1) * tile_n)``; box ``j`` of it starts at key row
        ``r = n * tile_n + j * box_rows``, i.e. page ``block_table[b, r // page_size]``, box
        ``(r % page_size) // box_rows`` within that page. Boxes of the last key block that start past the
        sequence's last key reload its last box (the stage's transaction byte count stays that of a full tile,
        so the pipeline barrier completes; V rows past the last key are zeroed, see ``_acquire_load_v``). The
        load order of K / V stages is FA4's (same ``intra_wg_overlap`` handling), so producer and consumer agree
        on stages and block ranges.
        """
        warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        tidx, _, _ = cute.arch.thread_idx()
        is_load_warp = warp_idx_in_wg == 0 or const_expr(not self.use_tma_Q)
        box_rows = self.kv_box_rows
        # Shared memory: ((box_rows, d), (boxes_per_tile, 1, stages));
        # gmem (TMA coordinates): ((box_rows, d), (boxes_per_page, 1, pages))
        sK_boxes = cute.zipped_divide(sK, (box_rows, self.tile_hdim))
        sV_boxes = cute.zipped_divide(sV, (box_rows, self.tile_hdimv))
        if is_load_warp:
            q_producer_phase = Int32(1)
            kv_producer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_stages
            )
            # The producer's own mbarrier for V stages that hold rows past the sequence's last key: the slot
            # after the V pipeline's full / empty barriers (see _get_shared_storage_cls).
            tail_bar = pipeline_v.sync_object_empty.get_barrier(0) + self.num_stages
            tail_phase = Int32(0)
            if warp_idx_in_wg == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(tail_bar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.sync_warp()
            tile_scheduler = TileSchedulerCls()
            work_tile = tile_scheduler.initial_work_tile_info()
            while work_tile.is_valid_tile:
                m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                seqlen = SeqlenInfoCls(batch_idx)
                mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
                head_idx_kv = (
                    head_idx // self.qhead_per_kvhead if const_expr(not self.pack_gqa) else head_idx
                )
                gK = cute.zipped_divide(mK[None, None, head_idx_kv, None], (box_rows, self.tile_hdim))
                gV = cute.zipped_divide(mV[None, None, head_idx_kv, None], (box_rows, self.tile_hdimv))
                tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), sK_boxes, gK)
                tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), sV_boxes, gV)
                last_box_row = cutlass.max(seqlen.seqlen_k - 1, 0) // box_rows * box_rows
                load_K = partial(
                    self._load_kv_boxes, tma_atom_K, tKsK, tKgK, pipeline_k, mPageTable, batch_idx,
                    last_box_row,
                )
                acquire_load_V = partial(
                    self._acquire_load_v, tma_atom_V, tVsV, tVgV, pipeline_v, mPageTable, batch_idx,
                    last_box_row, sV, seqlen.seqlen_k, tail_bar,
                )

                n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
                n_block = n_block_max - 1
                if warp_idx_in_wg == 0:
                    pipeline_k.producer_acquire(kv_producer_state)
                    load_K(n_block, kv_producer_state)
                if const_expr(self.use_tma_Q):
                    if warp_idx_in_wg == 0:
                        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
                        load_Q, _, _ = copy_utils.tma_get_copy_fn(
                            tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True
                        )
                        pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
                        load_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))
                        q_producer_phase ^= 1
                else:
                    pack_gqa = PackGQA(
                        self.tile_m, self.tile_hdim, self.check_hdim_oob, self.qhead_per_kvhead
                    )
                    pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
                    pack_gqa.load_Q(mQ_cur, sQ, gmem_tiled_copy_Q, tidx, m_block, seqlen.seqlen_q)
                    cute.arch.cp_async_commit_group()
                    pipeline_q.producer_commit_w_index(0)
                    q_producer_phase ^= 1
                if warp_idx_in_wg == 0:
                    if const_expr(not self.intra_wg_overlap):
                        tail_phase = acquire_load_V(n_block, kv_producer_state, tail_phase)
                        kv_producer_state.advance()
                        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                            n_block = n_block_max - 1 - i - 1
                            pipeline_k.producer_acquire(kv_producer_state)
                            load_K(n_block, kv_producer_state)
                            tail_phase = acquire_load_V(n_block, kv_producer_state, tail_phase)
                            kv_producer_state.advance()
                    else:
                        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                            n_block_prev = n_block_max - i - 1
                            n_block = n_block_prev - 1
                            kv_producer_state_prev = kv_producer_state.clone()
                            kv_producer_state.advance()
                            pipeline_k.producer_acquire(kv_producer_state)
                            load_K(n_block, kv_producer_state)
                            tail_phase = acquire_load_V(n_block_prev, kv_producer_state_prev, tail_phase)
                        tail_phase = acquire_load_V(n_block_min, kv_producer_state, tail_phase)
                        kv_producer_state.advance()
                tile_scheduler.prefetch_next_work()
                tile_scheduler.advance_to_next_work()
                work_tile = tile_scheduler.get_current_work()
            if warp_idx_in_wg == 0:
                pipeline_v.producer_tail(kv_producer_state)

    @cute.jit
    def _issue_boxes(
        self,
        tma_atom: cute.CopyAtom,
        tXsX: cute.Tensor,
        tXgX: cute.Tensor,
        bar_ptr: cute.Pointer,
        mPageTable: cute.Tensor,
        batch_idx: Int32,
        last_box_row: Int32,
        n_block: Int32,
        stage: Int32,
    ):
        """Issue the ``tile_n // box_rows`` TMA loads of key block ``n_block`` into ``stage``, all completing
        on ``bar_ptr`` (see ``_load_paged_boxes``)."""
        box_rows = self.kv_box_rows
        for j in cutlass.range_constexpr(self.tile_n // box_rows):
            row = cutlass.min(n_block * self.tile_n + j * box_rows, last_box_row)
            page = mPageTable[batch_idx, row // self.kv_page_size]
            box_in_page = (row % self.kv_page_size) // box_rows
            cute.copy(
                tma_atom,
                tXgX[None, (box_in_page, 0, page)],
                tXsX[None, (j, 0, stage)],
                tma_bar_ptr=bar_ptr,
            )

    @cute.jit
    def _load_kv_boxes(
        self,
        tma_atom: cute.CopyAtom,
        tXsX: cute.Tensor,
        tXgX: cute.Tensor,
        pipeline_kv: pipeline.PipelineAsync,
        mPageTable: cute.Tensor,
        batch_idx: Int32,
        last_box_row: Int32,
        n_block: Int32,
        producer_state: pipeline.PipelineState,
    ):
        """K: the boxes of key block ``n_block`` into an acquired stage, on the pipeline's barrier. Rows past
        the sequence's last key need no clean-up in K: the consumer masks their scores to -inf."""
        self._issue_boxes(
            tma_atom, tXsX, tXgX, pipeline_kv.producer_get_barrier(producer_state), mPageTable, batch_idx,
            last_box_row, n_block, producer_state.index,
        )
        pipeline_kv.producer_commit(producer_state)

    @cute.jit
    def _acquire_load_v(
        self,
        tma_atom: cute.CopyAtom,
        tVsV: cute.Tensor,
        tVgV: cute.Tensor,
        pipeline_v: pipeline.PipelineAsync,
        mPageTable: cute.Tensor,
        batch_idx: Int32,
        last_box_row: Int32,
        sV: cute.Tensor,
        seqlen_k: Int32,
        tail_bar: cute.Pointer,
        n_block: Int32,
        producer_state: pipeline.PipelineState,
        tail_phase: Int32,
    ) -> Int32:
        """V of key block ``n_block``: acquire the stage, load its boxes, release it to the consumers.

        A stage holding rows past the sequence's last key (only the sequence's last key block, when
        ``seqlen_k % tile_n != 0``) would hand the consumers whatever the cache holds there: the rest of the
        last page and, for boxes past the last page, a reloaded box. The scores of those columns are masked
        (P = 0), but 0 * NaN = NaN in P @ V, so a non-finite value there would reach the output. That stage is
        therefore loaded on the producer's own barrier ``tail_bar``; the producer waits for it, zeroes rows
        ``[seqlen_k - n_block * tile_n, tile_n)``, fences the generic stores for the async proxy (the
        consumers' wgmma) and only then arrives on the stage's full barrier (arrival count 1, no bytes
        expected). Every other stage takes FA4's path: acquire with the stage's byte count, TMA, commit.
        Returns the phase of ``tail_bar`` for its next use.
        """
        first_past_end = seqlen_k - n_block * self.tile_n
        phase = tail_phase
        if first_past_end < self.tile_n:
            pipeline_v.sync_object_empty.wait(producer_state.index, producer_state.phase)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(tail_bar, self.tma_copy_bytes["V"])
            self._issue_boxes(
                tma_atom, tVsV, tVgV, tail_bar, mPageTable, batch_idx, last_box_row, n_block,
                producer_state.index,
            )
            cute.arch.mbarrier_wait(tail_bar, phase)
            self._zero_rows(sV, producer_state.index, first_past_end)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(pipeline_v.sync_object_full.get_barrier(producer_state.index))
            phase = phase ^ 1
        else:
            pipeline_v.producer_acquire(producer_state)
            self._issue_boxes(
                tma_atom, tVsV, tVgV, pipeline_v.producer_get_barrier(producer_state), mPageTable,
                batch_idx, last_box_row, n_block, producer_state.index,
            )
            pipeline_v.producer_commit(producer_state)
        return phase

    @cute.jit
    def _zero_rows(self, sX: cute.Tensor, stage: Int32, row_start: Int32):
        """Zero rows ``[row_start, tile_n)`` of K/V stage ``stage`` (shared memory, swizzled), one warp, in
        16-byte chunks of 8 elements (a chunk never crosses a swizzle unit)."""
        n_chunks = self.tile_hdimv // 8
        sX_chunks = cute.zipped_divide(sX[None, None, stage], (1, 8))  # ((1, 8), (tile_n, n_chunks))
        zero = cute.make_rmem_tensor((1, 8), sX.element_type)
        zero.fill(0.0)
        lane = cute.arch.lane_idx()
        for i in cutlass.range(lane, (self.tile_n - row_start) * n_chunks, cute.arch.WARP_SIZE, unroll=1):
            cute.autovec_copy(zero, sX_chunks[None, (row_start + i // n_chunks, i % n_chunks)])

    def mma(
        self,
        tiled_mma_qk,
        tiled_mma_pv,
        mO,
        mLSE,
        sQ,
        sK,
        sVt,
        sP,
        sO,
        learnable_sink,
        pipeline_k,
        pipeline_v,
        pipeline_q,
        gmem_tiled_copy_O,
        tma_atom_O,
        tidx,
        softmax_scale_log2,
        softmax_scale,
        block_info,
        SeqlenInfoCls,
        AttentionMaskCls,
        TileSchedulerCls,
        blocksparse_tensors,
        aux_data=AuxData(),
        fastdiv_mods=None,
    ):
        if const_expr(self.nan_safe_v):
            self._nan_safe_setup(sVt, pipeline_v, self._mixed_block_info(block_info), shared_tags=True)
        if const_expr(self.nan_recompute):
            self._nr_block_info = self._mixed_block_info(block_info)
            self._nr_seqlen_cls = self._mixed_seqlen_cls(SeqlenInfoCls)  # the cold path's own load of it
            if const_expr(not self._nr_no_stash()):
                self._stash_write(pipeline_v)
        return FlashAttentionForwardSm90.mma(
            self,
            tiled_mma_qk,
            tiled_mma_pv,
            mO,
            mLSE,
            sQ,
            sK,
            sVt,
            sP,
            sO,
            learnable_sink,
            pipeline_k,
            pipeline_v,
            pipeline_q,
            gmem_tiled_copy_O,
            tma_atom_O,
            tidx,
            softmax_scale_log2,
            softmax_scale,
            self._mixed_block_info(block_info),
            self._mixed_seqlen_cls(SeqlenInfoCls),
            self._mixed_mask_cls(block_info),
            TileSchedulerCls,
            blocksparse_tensors,
            aux_data,
            fastdiv_mods,
        )

    # --- NaN-safe V (config nan_safe_v; docs/tuning.md 2.4) ---------------------------------------------------
    # FA4's consumer passes a mask_fn exactly to the calls of masked key blocks (the tile's first block, the
    # right- and left-masked loops); the interior loop's calls are passed through untouched.
    def _nan_safe_setup(self, sVt, pipeline_v, block_info, shared_tags: bool = False) -> None:
        """Trace-time, at the consumers' entry: the per-warpgroup flag "a masked block's V held NaN / Inf" (one
        Int32 register, carried through FA4's loops as a register tensor), and what the clean-up and the fix-up
        need (V's shared-memory view, the V pipeline, the consumers' block info: the split's range too).

        ``shared_tags`` (FA4's consumer, where every warpgroup cleans the whole stage): the per-stage tag slots in
        shared memory (after the V barriers, :meth:`_get_shared_storage_cls`) and the per-warpgroup use counter
        that names a stage's current use (see :meth:`_clean_v_stage`)."""
        self._nf_flag = cute.make_rmem_tensor((1,), Int32)
        self._nf_flag[0] = Int32(0)
        self._nf_sVt, self._nf_pipeline_v, self._nf_block_info = sVt, pipeline_v, block_info
        self._nf_tags = self._nf_use = None
        if shared_tags:
            base = pipeline_v.sync_object_empty.get_barrier(0) + self.num_stages + 1  # past full, empty, tail
            self._nf_tags = cute.make_tensor(cute.recast_ptr(base, dtype=Int32),
                                             cute.make_layout((self.num_stages,), stride=(2,)))
            self._nf_use = cute.make_rmem_tensor((1,), Int32)
            self._nf_use[0] = Int32(NAN_TAG_BASE)

    def _skip_allowed_first(self) -> bool:
        """Trace-time: the first block's clean-up is skipped when the whole block is allowed (constructor
        ``skip_allowed_first``, with ``nan_safe_v``)."""
        return bool(self.nan_safe_v and self.skip_allowed_first)

    def _split_clean(self) -> bool:
        """Trace-time: :attr:`_CLEAN_SPLIT_ACROSS_WG` acts (FA4's overlap consumer, two or more consumer warpgroups,
        no scheduler barrier)."""
        return bool(self.nan_safe_v and self._CLEAN_SPLIT_ACROSS_WG and self.intra_wg_overlap
                    and not self.use_scheduler_barrier and self.num_wg_mma >= 2)

    def _first_needs(self, kwargs: dict):
        """The tile's first block needs its clean-up: Int32(1), or with ``skip_allowed_first`` the run-time
        test :meth:`_first_block_needs_clean` on the call's ``seqlen``, ``n_block`` and the tile's ``m_block`` (FA4
        binds it into the call's ``mask_fn``)."""
        if not self._skip_allowed_first():
            return Int32(1)
        mask_fn = kwargs.get("mask_fn")
        m_block = getattr(mask_fn, "keywords", {}).get("m_block")
        if m_block is None:
            raise RuntimeError("skip_allowed_first: FA4's first-block call carries no m_block in its mask_fn "
                               "(another flash-attn-4 version?)")
        return self._first_block_needs_clean(kwargs["seqlen"], m_block, kwargs["n_block"])

    @cute.jit
    def _first_block_needs_clean(self, seqlen: MixedSeqlenInfoQK, m_block: Int32, n_block: Int32) -> Int32:
        """0 when key block ``n_block`` lies inside every row's interval of tile ``m_block`` (no key of it is one
        a row may not see; it is inside ``seq_lens`` too), else 1. The block info's own bounds: the block is below
        every right-masked block (``(hi of the tile's first row + 1) // tile_n``) and at or above every left-masked
        one (``ceil(lo of its last row / tile_n)``), i.e. a block FA4 would call unmasked."""
        bi = self._nf_block_info
        right = bi.get_n_block_min_causal_local_mask(seqlen, m_block, n_block)  # max(n_block, first right-masked)
        left = bi.get_n_block_min_before_local_mask(seqlen, m_block, Int32(0))  # first block past the left mask
        needs = Int32(1)
        if n_block < right:
            if n_block >= left:
                needs = Int32(0)
        return cute.arch.make_warp_uniform(needs)

    def first_half_block_overlap(self, *args, **kwargs):
        state = FlashAttentionForwardSm90.first_half_block_overlap(self, *args, **kwargs)
        if const_expr(self.nan_safe_v):  # the tile's first block is always masked; its PV runs in the next call
            needs = None
            if const_expr(self._skip_allowed_first()):  # scanned unless the whole block is allowed
                needs = self._first_needs(kwargs)
            self._wait_clean_v(state, 0, self.tile_hdimv, shared_tag=True, active=needs)
        return state

    def mma_one_n_block_intrawg_overlap(self, *args, **kwargs):
        masked = kwargs.get("mask_fn") is not None
        state = FlashAttentionForwardSm90.mma_one_n_block_intrawg_overlap(self, *args, **kwargs)
        if const_expr(self.nan_safe_v and masked):
            # V of this call's block; its PV runs in the next call
            self._wait_clean_v(state, 0, self.tile_hdimv, shared_tag=True)
        return state

    def mma_one_n_block(self, *args, **kwargs):
        if const_expr(self.nan_safe_v and kwargs.get("mask_fn") is not None):
            pv = kwargs["mma_pv_fn"]
            needs = None
            if const_expr(self._skip_allowed_first() and kwargs.get("is_first_n_block", False)):
                needs = self._first_needs(kwargs)  # the tile's first block: skipped when the whole block is allowed

            def clean_then_pv(B_idx, **kw):  # no overlap: this call's PV reads this call's block
                self._clean_v_stage(self._nf_sVt, B_idx, 0, self.tile_hdimv, shared_tag=True, active=needs)
                return pv(B_idx=B_idx, **kw)

            kwargs["mma_pv_fn"] = clean_then_pv
        return FlashAttentionForwardSm90.mma_one_n_block(self, *args, **kwargs)

    def epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma, tidx, m_block,
                 head_idx, batch_idx):
        if const_expr(self.nan_safe_v):
            self._nonfinite_fixup(acc_O, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        if const_expr(self.nan_recompute):
            self._nonfinite_recompute(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        return FlashAttentionForwardSm90.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O,
                                                  tma_atom_O, tiled_mma, tidx, m_block, head_idx, batch_idx)

    @cute.jit
    def _wait_clean_v(self, state, col0: cutlass.Constexpr[int], width: cutlass.Constexpr[int],
                      shared_tag: cutlass.Constexpr[bool] = False, active: Optional[Int32] = None):
        """Wait for V of the stage of ``state`` (a completed phase waits no longer: its consumers have not
        released it) and clean columns ``[col0, col0 + width)`` of it (:meth:`_clean_v_stage`; ``active`` its
        tile-uniform trip-count factor). The wait, the barrier and the tag test run whatever ``active`` is: with the
        call under a run-time ``if`` ptxas moved the hd-128 kernel's wgmma descriptors out of the uniform datapath
        (docs/tuning.md 2.27)."""
        pipeline_v = self._nf_pipeline_v
        pipeline_v.consumer_wait(state, pipeline_v.consumer_try_wait(state))
        self._clean_v_stage(self._nf_sVt, state.index, col0, width, shared_tag=shared_tag, active=active)

    @cute.jit
    def _clean_v_stage(self, sVt: cute.Tensor, stage: Int32, col0: cutlass.Constexpr[int],
                       width: cutlass.Constexpr[int], shared_tag: cutlass.Constexpr[bool] = False,
                       active: Optional[Int32] = None):
        """Zero the NaN / Inf entries of value columns ``[col0, col0 + width)`` of V stage ``stage`` in shared
        memory, for this warpgroup's PV wgmma, and OR "there was one" into the warpgroup's flag.

        One warpgroup, 16-byte chunks (8 elements, never split by the 128-byte swizzle), chunk ``t + 128 j`` for
        thread ``t``; an element is non-finite when its exponent bits are all ones, found per 32-bit word with
        ``((x & E) + ONE) & 0x80008000`` (bit 15 / 31: the low / high half; no carry crosses a half). Only chunks
        holding one are written back (finite entries unchanged). Then ``fence.proxy.async`` (the wgmma reads
        through the async proxy) and one ``bar.red.or`` over the warpgroup, which also gives every thread the
        warpgroup's result. Another warpgroup cleaning the same stage concurrently writes the same bytes.
        ``active`` (a tile-uniform 0 / 1, :meth:`_first_block_needs_clean`) is the scan's trip count; the barrier and the
        tag test run either way.

        With :attr:`_CLEAN_SPLIT_ACROSS_WG` where it acts (:meth:`_split_clean`, FA4's consumer without its scheduler
        barrier) and ``shared_tag``: chunk ``t + 128 n j`` for consumer thread ``t`` of ``n`` warpgroups, one
        ``bar.red.or`` over all of them after the fence (every cleaned chunk before any warpgroup's P V wgmma, the OR
        of all to each thread), no tags.

        ``shared_tag`` (FA4's consumer: every warpgroup cleans the whole stage, unsynchronised): the warpgroup
        that cleans a chunk second reads it already cleaned, so its own scan alone would miss the entry and skip
        its rows' fix-up (issue 26, docs/tuning.md 2.4). So a thread that finds a non-finite entry
        first writes this use's tag (a per-warpgroup counter, advanced once a call: every consumer warpgroup
        makes the same calls in the same order, so the counters agree) into the stage's tag slot, then
        ``fence.acq_rel.cta``, then the cleaned chunk; after its barrier every thread ORs "the slot holds this
        use's tag" into the flag. A warpgroup that read a cleaned chunk therefore sees the tag (the other's
        fence orders it before the chunk; the barrier orders this warpgroup's reads before the slot's). A stage
        is refilled only after every warpgroup has released it, after its clean-up, so a slot is not
        overwritten before it is read; a stale or uninitialised slot that matches costs a fix-up that adds
        nothing (it adds only non-finite entries it reads from global memory)."""
        exp_bits = 0x7F807F80 if const_expr(self.dtype == cutlass.BFloat16) else 0x7C007C00
        one = 0x00800080 if const_expr(self.dtype == cutlass.BFloat16) else 0x04000400
        high = Uint32(0x80008000)
        split = shared_tag and self._split_clean()  # the consumer warpgroups share the stage's chunks (no tags)
        tagged = shared_tag and not split
        n_scan = 128 * self.num_wg_mma if split else 128  # threads scanning the stage together
        tid = cute.arch.thread_idx()[0]
        t_wg = tid - 128 if split else tid % 128  # split: every consumer thread (warpgroup 0 is the producer)
        wg = cute.arch.make_warp_uniform(tid // 128)  # consumer warpgroups are 1..3 (0 is the producer)
        chunks = cute.zipped_divide(sVt[None, None, stage], (8, 1))  # ((8, 1), (head_dim_v / 8, tile_n))
        n_col_chunks = width // 8
        n_chunks = n_col_chunks * self.tile_n
        found = Int32(0)
        tag = Int32(0)
        if const_expr(tagged):
            tag = self._nf_use[0] + 1
            self._nf_use[0] = tag
        n_iter = (n_chunks + n_scan - 1) // n_scan
        if const_expr(active is not None):  # a tile-uniform 0 / 1: 0 scans nothing (bar.red.or still runs)
            n_iter = n_iter * active
        for j in cutlass.range(n_iter, unroll=2):
            i = t_wg + j * n_scan
            if const_expr(n_chunks % n_scan != 0):
                i = cutlass.min(i, n_chunks - 1)  # a repeated chunk is harmless (idempotent)
            src = chunks[None, (col0 // 8 + i % n_col_chunks, i // n_col_chunks)]
            r = cute.make_rmem_tensor((8, 1), self.dtype)
            cute.autovec_copy(src, r)
            w = cute.recast_tensor(r, Uint32)
            bad = Uint32(0)
            for k in cutlass.range_constexpr(4):
                bad = bad | ((w[k] & Uint32(exp_bits)) + Uint32(one))
            if (bad & high) != Uint32(0):
                for k in cutlass.range_constexpr(4):
                    x = w[k]
                    m = ((((x & Uint32(exp_bits)) + Uint32(one)) & high) >> Uint32(15)) * Uint32(0xFFFF)
                    w[k] = x & (m ^ Uint32(0xFFFFFFFF))
                if const_expr(tagged):  # the tag before the cleaned chunk (docstring)
                    self._publish_tag(stage, tag)
                cute.autovec_copy(r, src)
                found = Int32(1)
        if found != 0:
            cute.arch.fence_view_async_shared()
        if const_expr(split):  # every consumer warpgroup's chunks, ordered before every P V wgmma
            self._nf_flag[0] = self._nf_flag[0] | barrier_or(found, NAN_CLEAN_BARRIER_ALL, n_scan)
        else:
            any_wg = barrier_or(found, NAN_CLEAN_BARRIER_WG1 - 1 + wg, 128)
            if const_expr(tagged):  # another warpgroup zeroed an entry of this use first
                if self._nf_tags[stage] == tag:
                    any_wg = Int32(1)
            self._nf_flag[0] = self._nf_flag[0] | any_wg

    @cute.jit
    def _publish_tag(self, stage: Int32, tag: Int32):
        """Stage ``stage``'s tag slot := ``tag``, ordered before this thread's later shared-memory writes (the
        cleaned chunk) by ``fence.acq_rel.cta`` (:meth:`_clean_v_stage`)."""
        tags = self._nf_tags
        tags[stage] = tag
        cute.arch.fence_acq_rel_cta()

    @cute.jit
    def _nonfinite_fixup(self, acc_O: cute.Tensor, seqlen: MixedSeqlenInfoQK, tiled_mma: cute.TiledMma,
                         tidx: Int32, m_block: Int32, head_idx: Int32, batch_idx: Int32):
        """Cold pass before the epilogue, only when this warpgroup's clean-up met a NaN / Inf (its flag; reset
        here): every key of the tile's masked blocks (the same block-info functions as FA4's loops) that one of
        this thread's accumulator rows allows gets its V row read from global memory (the caller's cache, the last
        aux tensor: paged through the page table, contiguous at ``cu_seqlens_k``), and each non-finite entry in this thread's columns is added to
        the normalised accumulator of exactly the rows that allow the key: NaN stays NaN, +-Inf gives +-Inf (or
        NaN with the opposite sign), as the reference's ``p * v`` does for a weight p > 0. Keys past
        ``seq_lens`` are no row's keys."""
        flag = self._nf_flag
        if flag[0] != 0:
            bi = self._nf_block_info
            n_min, n_max = bi.get_n_block_min_max(seqlen, m_block)
            n_right = bi.get_n_block_min_causal_local_mask(seqlen, m_block, n_min)
            r0 = cutlass.min(n_right, n_max - 1) * self.tile_n  # the first block and the right-masked ones
            r1 = n_max * self.tile_n
            l0 = n_min * self.tile_n
            l1 = l0
            if const_expr(bi.window_size_left is not None):  # the left-masked ones
                n_left = bi.get_n_block_min_before_local_mask(seqlen, m_block, n_min)
                l1 = cutlass.max(cutlass.min(cutlass.min(n_max - 1, n_right), n_left) * self.tile_n, l0)
            n_l = l1 - l0
            qpk = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
            head_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead
            tOcO = layout_utils.reshape_acc_to_mn(
                tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
            acc = layout_utils.reshape_acc_to_mn(acc_O)
            n_rows = cute.size(tOcO, mode=[0])
            lo_r = cute.make_rmem_tensor((n_rows,), Int32)
            hi_r = cute.make_rmem_tensor((n_rows,), Int32)
            for r in cutlass.range_constexpr(n_rows):
                token = (m_block * self.tile_m + tOcO[r, 0][0]) // qpk
                lo, hi = row_key_range(token, seqlen.seqlen_q, seqlen.seqlen_k, seqlen.num_causal_q,
                                       bi.window_size_left, self.prefix_window)
                lo_r[r] = lo
                hi_r[r] = hi
                if token >= seqlen.seqlen_q:  # padding rows of the tile: no keys
                    lo_r[r] = Int32(1)
                    hi_r[r] = Int32(0)
            mV = self._mV
            for m in cutlass.range(n_l + r1 - r0, unroll=1):
                key = l0 + m
                if m >= n_l:
                    key = r0 + (m - n_l)
                sees = Int32(0)
                for r in cutlass.range_constexpr(n_rows):
                    if lo_r[r] <= key:
                        if key <= hi_r[r]:
                            sees = Int32(1)
                if sees != 0:
                    self._fixup_key(acc, tOcO, lo_r, hi_r, mV, seqlen, key, head_kv, batch_idx)
        flag[0] = Int32(0)

    def _cache_coord(self, mPageTable: Optional[cute.Tensor], mX: cute.Tensor, seqlen: MixedSeqlenInfoQK,
                     key: Int32, batch_idx: Int32) -> tuple:
        """The leading coordinates of key ``key``'s row in a cache the cold paths read themselves: ``(page, slot)``
        of a paged ``[num_pages, page_size, h_kv, d]`` cache through ``mPageTable``, or ``(row,)`` of a contiguous
        ``[total_k, h_kv, d]`` one at ``cu_seqlens_k``; 64-bit where the kernel was built with ``wide_offsets``
        (:func:`_row_coord`). ``mX``: the cache whose ``shape[1]`` is the page size when the page boxes did not fix
        it."""
        if const_expr(mPageTable is not None):
            page_size = self.kv_page_size if const_expr(self.kv_page_size is not None) else mX.shape[1]
            page = _row_coord(mPageTable[batch_idx, key // page_size], self.wide_offsets)
            return (page, key % page_size)
        return (_row_coord(seqlen.offset_k + key, self.wide_offsets),)

    @cute.jit
    def _fixup_key(self, acc: cute.Tensor, tOcO: cute.Tensor, lo_r: cute.Tensor, hi_r: cute.Tensor,
                   mV: cute.Tensor, seqlen: MixedSeqlenInfoQK, key: Int32, head_kv: Int32, batch_idx: Int32):
        """Key ``key``'s non-finite V entries in this thread's columns, added to the rows that allow it."""
        v_row = mV[self._cache_coord(self._mPageTable, mV, seqlen, key, batch_idx) + (head_kv, None)]
        for c in cutlass.range_constexpr(cute.size(tOcO, mode=[1])):
            col = tOcO[0, c][1]
            in_v = Int32(1)
            if const_expr(self.check_hdim_v_oob):  # a padded value column (past head_dim_v): not V's, not read
                if col >= self._head_dims[1]:
                    in_v = Int32(0)
            if in_v != 0:
                v = Float32(v_row[col])
                if is_finite_f32(v) == 0:
                    for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                        if lo_r[r] <= key:
                            if key <= hi_r[r]:
                                acc[r, c] = acc[r, c] + v

    # --- NaN-safe V by recompute (nan_safe_v_method="recompute"; docs/tuning.md 2.32, 2.34) ---------------------
    def _nr_fresh_tile_values(self) -> bool:
        """Trace-time: :attr:`_NR_FRESH_TILE_VALUES` acts (head dims above 128)."""
        return bool(self._NR_FRESH_TILE_VALUES and max(self._head_dims) > 128)

    def _nr_no_stash(self) -> bool:
        """Trace-time: :attr:`_NR_NO_STASH` (timing only, docs/tuning.md 2.37).

        Raises:
            ValueError: :attr:`_NR_NO_STASH` without :attr:`_NR_TRIVIAL_COLD_PATH` (the recompute reads the stash).
        """
        if self._NR_NO_STASH and not self._NR_TRIVIAL_COLD_PATH:
            raise ValueError("_NR_NO_STASH needs _NR_TRIVIAL_COLD_PATH: the recompute's cold path reads the stash")
        return bool(self._NR_NO_STASH)

    @cute.jit
    def _nonfinite_recompute(self, acc_O: cute.Tensor, lse: cute.Tensor, seqlen: MixedSeqlenInfoQK,
                             tiled_mma: cute.TiledMma, tidx: Int32, m_block: Int32, head_idx: Int32,
                             batch_idx: Int32):
        """At the epilogue hook (``acc_O`` normalised, ``lse`` final, before any store or merge): find whether
        this thread holds a non-finite accumulator entry in a real row (``token < seqlen_q``: PackGQA's padding
        rows may hold anything, docs/tuning.md 2.32 F4), OR it over the warp (``vote.any``), and only then
        recompute the warp's non-finite entries (:meth:`_recompute_warp`).

        Why it is complete (2.32): a key a row may not see has P = 0 in the P V wgmma, so a NaN / Inf in its V row
        makes that column NaN in every row of the warpgroup (IEEE ``0 * NaN``, ``0 * Inf``), and no later step
        makes a non-finite entry finite again (the rescales multiply by finite factors); a finite entry therefore
        saw no such key. The test is one FFMA per entry (:meth:`_nr_ffma_test`)."""
        # The tile's indices as values LLVM cannot relate to the mainloop's (opaque), and the sequence info loaded
        # anew in the cold path (_recompute_warp): otherwise LLVM reuses the mainloop's key-block range and sequence
        # values there, which ptxas then holds across the key-block loops, and the unsplit hd-256 launch's interior
        # loop recomputed its wgmma descriptors in the loop (docs/tuning.md 2.34, 2.36)
        if const_expr(self._nr_fresh_tile_values()):
            m_block = opaque(m_block)
            head_idx = opaque(head_idx)
            batch_idx = opaque(batch_idx)
        qpk = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
        tOcO = layout_utils.reshape_acc_to_mn(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        bad = self._nr_ffma_test(acc_O, tOcO, seqlen, m_block, qpk)
        if cute.arch.vote_any_sync(bad != 0):
            if const_expr(self._NR_TRIVIAL_COLD_PATH):  # timing only: WRONG results on non-finite V (2.37)
                self._trivial_cold_path()
            else:
                self._recompute_warp(acc_O, lse, tOcO, seqlen, m_block, head_idx, batch_idx)

    @cute.jit
    def _nr_ffma_test(self, acc_O: cute.Tensor, tOcO: cute.Tensor, seqlen: MixedSeqlenInfoQK, m_block: Int32,
                      qpk: cutlass.Constexpr[int]) -> Int32:
        """The recompute's epilogue test: 1 when an entry of this thread's real rows (``token < seqlen_q``; value
        columns below ``head_dim_v``) is NaN / +-Inf. Per row :data:`NR_FFMA_CHAINS` chains ``s = fma(x, 0, s)`` from
        0 over the row's entries (columns ``c`` with ``c % chains == j``; :func:`fma_zero`, inline asm so that
        ``x * 0`` is not folded), summed, then one finiteness test a row. A padded value column (past ``head_dim_v``)
        adds 0.

        Exact (docs/tuning.md 2.38, 2.39): ``x * 0`` is +-0 for every finite ``x`` (subnormal or near FLT_MAX) and NaN
        for a NaN / +-Inf one, a sum of zeros is a zero and NaN propagates, so the row's sum is NaN iff an entry is
        non-finite (never Inf): the same flag as testing each entry's exponent for all ones, bit for bit the same
        decisions. Why FFMA rather than that mask test (an AND with :data:`F32_EXP_MASK` and an integer max an entry):
        one FFMA an entry on the FP32 pipe, beside FA4's normalisation, instead of two integer instructions an entry
        on the ALU pipe, which issues at half the FP32 pipe's rate on Hopper."""
        acc = layout_utils.reshape_acc_to_mn(acc_O)
        head_dim_v = self._head_dims[1]
        n_cols = cute.size(tOcO, mode=[1])
        chains = min(NR_FFMA_CHAINS, n_cols)
        sums = cute.make_rmem_tensor((chains,), Float32)
        bad = Int32(0)
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            for j in cutlass.range_constexpr(chains):
                sums[j] = Float32(0.0)
            for c in cutlass.range_constexpr(n_cols):
                x = acc[r, c]
                if const_expr(self.check_hdim_v_oob):  # a padded value column is no output (nor evidence)
                    if tOcO[r, c][1] >= head_dim_v:
                        x = Float32(0.0)
                sums[c % chains] = fma_zero(x, sums[c % chains])
            s = sums[0]
            for j in cutlass.range_constexpr(1, chains):
                s = s + sums[j]
            token = (m_block * self.tile_m + tOcO[r, 0][0]) // qpk
            if is_finite_f32(s) == 0:
                if token < seqlen.seqlen_q:
                    bad = Int32(1)
        return bad

    @cute.jit
    def _trivial_cold_path(self):
        """The cold path of :attr:`_NR_TRIVIAL_COLD_PATH`, for timing only: it recomputes NOTHING, so the
        non-finite entries of a masked key's NaN / Inf V stay in the output (WRONG results on such a cache). Lane 0
        adds 1 to the recompute counter, a side effect the compiler keeps, so the epilogue test and its vote stay as
        built. The counter's address comes from the stash (:meth:`_stash_read`) or, with :attr:`_NR_NO_STASH`, from
        the kernel parameter."""
        if const_expr(self._nr_no_stash()):
            mCount = self._nr_count
        else:
            mCount = self._stash_read()[4]
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_add(mCount.iterator, Int32(1))

    @cute.jit
    def _recompute_warp(self, acc_O: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor, seqlen: MixedSeqlenInfoQK,
                        m_block: Int32, head_idx: Int32, batch_idx: Int32):
        """Cold path, warp-uniform: every non-finite entry of this thread's real rows (value columns below
        ``head_dim_v``) becomes ``sum_k P[r, k] V[k, c]`` over the keys ``k`` of this tile's (this split's) key-block
        range that row ``r`` allows, in fp32 from global memory, with ``P = exp2(S * scale_log2 - lse * log2(e))``
        from FA4's own ``lse`` (so the LSE, and a split's merge weight, are unchanged); every finite entry is left
        as it is, bit for bit. A row whose ``lse`` is -inf (no allowed key in the split, or a NaN row sum) takes
        ``lse = +inf``: P = 0 for a finite score, NaN for a NaN one. Q, K and V are the caller's tensors (paged
        through the page table or contiguous at ``cu_seqlens_k``), their addresses read from shared memory
        (:meth:`_stash_read`). The thread's rows are marked first (that order spills less in the cluster launch,
        docs/tuning.md 2.36); then one key loop per row a lane of the warp marked (the fewest registers beside the
        accumulator). ``S`` is split over the four threads of a row quad (8-element chunks
        ``lane % 4 + 4 j`` of the head dim) and summed with two butterfly shuffles, which is why the key loop is
        warp-uniform (the tile's range; the row's own range is a predicate). Then lane 0 adds 1 to the recompute
        counter.

        With ``exact_weight`` the recompute weighs a key as the mainloop did, ``P = exp2((S - m) * scale_log2) / l``
        (the row's raw max ``m`` and FA4's normalisation factor ``1 / l`` kept by :class:`ExactWeightSoftmax`; ``lse``
        = -inf takes ``m = +inf``, as above): from the LSE, ``S * scale_log2 - lse * log2(e)`` is an FFMA against a
        rounded ``lse * log2(e)`` whose own rounding error (half an ulp of it, 2^83 at an LSE of -1.6e32) makes the
        row's best key weigh inf or 0 beyond ~2^31 in log2 units, so a non-finite V entry of a key the row sees would
        be recomputed as NaN where the reference gives +-Inf."""
        head_dim, head_dim_v = self._head_dims
        qpk = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
        head_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead
        acc = layout_utils.reshape_acc_to_mn(acc_O)
        acc_bits = layout_utils.reshape_acc_to_mn(cute.recast_tensor(acc_O, Int32))
        n_cols = cute.size(tOcO, mode=[1])
        n_words = (n_cols + 31) // 32
        bi = self._nr_block_info
        if const_expr(self._nr_fresh_tile_values()):
            seqlen = self._nr_seqlen_cls(batch_idx)  # loaded anew (the same values): see _nonfinite_recompute
        n_min, n_max = bi.get_n_block_min_max(seqlen, m_block)
        k0 = n_min * self.tile_n
        k1 = cutlass.min(n_max * self.tile_n, seqlen.seqlen_k)
        scale_log2 = self._softmax_scales[0]
        mQ, mK, mV, mPageTable, mCount = self._stash_read()
        n_rows = cute.size(tOcO, mode=[0])
        marks = cute.make_rmem_tensor((n_rows * n_words,), Int32)
        lo_t = cute.make_rmem_tensor((n_rows,), Int32)
        hi_t = cute.make_rmem_tensor((n_rows,), Int32)
        lse2_t = cute.make_rmem_tensor((n_rows,), Float32)
        q_row_t = cute.make_rmem_tensor((n_rows,), cutlass.Int64 if const_expr(self.wide_offsets) else Int32)
        q_head_t = cute.make_rmem_tensor((n_rows,), Int32)
        for r in cutlass.range_constexpr(n_rows):
            row = m_block * self.tile_m + tOcO[r, 0][0]
            token = row // qpk
            lo, hi = row_key_range(token, seqlen.seqlen_q, seqlen.seqlen_k, seqlen.num_causal_q,
                                   bi.window_size_left, self.prefix_window)
            real = Int32(1)
            if token >= seqlen.seqlen_q:  # padding rows of the tile: no keys, nothing rewritten
                lo = Int32(1)
                hi = Int32(0)
                real = Int32(0)
            lo_t[r] = lo
            hi_t[r] = hi
            # a padding row reads the sequence's last Q row (in bounds); its P is 0 (no allowed key)
            q_row_t[r] = _row_coord(seqlen.offset_q + cutlass.min(token, seqlen.seqlen_q - 1), self.wide_offsets)
            q_head = head_idx
            if const_expr(self.pack_gqa):
                q_head = head_idx * qpk + row % qpk
            q_head_t[r] = q_head
            if const_expr(self.exact_weight):  # the row's raw max (the key weights' reference point)
                lse2 = self._exact_softmax.row_max[r]
            else:
                lse2 = lse[r] * Float32(LOG2_E)
            if lse[r] == -Float32.inf:
                lse2 = Float32.inf
            lse2_t[r] = lse2
            for w in cutlass.range_constexpr(n_words):
                word = Int32(0)
                for c in cutlass.range_constexpr(w * 32, min(n_cols, w * 32 + 32)):
                    if (acc_bits[r, c] & Int32(F32_EXP_MASK)) == Int32(F32_EXP_MASK):
                        if real != 0:
                            if tOcO[r, c][1] < head_dim_v:
                                word = word | Int32(_int32_bit(c - w * 32))
                                acc[r, c] = Float32(0.0)
                marks[r * n_words + w] = word
        # a key loop per row that a lane of the warp marked; warp-uniform: the key loop's shuffles need every lane
        # (the row quad's four threads share the row)
        for r in cutlass.range_constexpr(n_rows):
            row_mark = Int32(0)
            for w in cutlass.range_constexpr(n_words):
                row_mark = row_mark | marks[r * n_words + w]
            if cute.arch.vote_any_sync(row_mark != 0):
                q_vec = mQ[q_row_t[r], q_head_t[r], None]
                for key in cutlass.range(k0, k1, unroll=1):
                    inv = None
                    if const_expr(self.exact_weight):
                        inv = self._exact_softmax.row_inv_sum[r]
                    self._recompute_key(acc, r, marks, tOcO, lo_t[r], hi_t[r], lse2_t[r], scale_log2, q_vec,
                                        mK, mV, mPageTable, seqlen, key, head_kv, batch_idx, r * n_words, inv)
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_add(mCount.iterator, Int32(1))

    @cute.jit
    def _recompute_key(self, acc: cute.Tensor, r: cutlass.Constexpr[int], marks: cute.Tensor, tOcO: cute.Tensor,
                       lo: Int32, hi: Int32, lse2: Float32, scale_log2: Float32, q_vec: cute.Tensor,
                       mK: cute.Tensor, mV: cute.Tensor, mPageTable: Optional[cute.Tensor],
                       seqlen: MixedSeqlenInfoQK, key: Int32, head_kv: Int32, batch_idx: Int32,
                       w0: cutlass.Constexpr[int] = 0, inv: Optional[Float32] = None):
        """Key ``key``'s term ``P[r, key] V[key, c]`` added to the marked entries of this thread's row ``r``
        (:meth:`_recompute_warp`; ``q_vec`` its Q row; its mark words ``marks[w0:]``). Every lane of the warp calls
        it (two shuffles). ``lse2``: the row's LSE in log2 units, or with ``exact_weight`` its raw max, with ``inv``
        the row's ``1 / l`` (``P = exp2((S - m) * scale_log2) * inv``)."""
        CHUNK = 8  # elements of a K / Q chunk (4-byte-aligned loads: _stash_read)
        head_dim, head_dim_v = self._head_dims
        n_cols = cute.size(tOcO, mode=[1])
        coord = self._cache_coord(mPageTable, mV, seqlen, key, batch_idx)  # one page lookup for K and V
        k_row = mK[coord + (head_kv, None)]
        v_row = mV[coord + (head_kv, None)]
        quad = cute.arch.lane_idx() % 4
        n_chunks = head_dim // CHUNK  # head dims are multiples of 8 (config.unsupported_head_dims)
        kr = cute.make_rmem_tensor((CHUNK,), self.dtype)
        qr = cute.make_rmem_tensor((CHUNK,), self.dtype)
        x = Float32(0.0)
        for t in cutlass.range_constexpr((n_chunks + 3) // 4):
            j = quad + 4 * t
            if j < n_chunks:
                cute.autovec_copy(cute.local_tile(k_row, (CHUNK,), (j,)), kr)
                cute.autovec_copy(cute.local_tile(q_vec, (CHUNK,), (j,)), qr)
                kf = kr.load().to(Float32)
                qf = qr.load().to(Float32)
                for i in cutlass.range_constexpr(CHUNK):
                    x = x + qf[i] * kf[i]
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
        x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
        # only keys the row sees add a term (a key it may not see must not add 0 * NaN, regression test
        # test_gpu_recompute_keys_no_row_sees_leave_the_output_finite), with P however small: an allowed key whose
        # P underflows to 0 still adds 0 * NaN, as the reference's p * v does. exp2 without flush-to-zero: a
        # subnormal P of an allowed key times +-Inf stays +-Inf, as in the reference (the simulation's ftz case)
        if lo <= key:
            if key <= hi:
                if const_expr(self.exact_weight):  # subtract, then multiply: no FFMA against a rounded reference
                    p = cute.math.exp2((x - lse2) * scale_log2, fastmath=False) * inv
                else:
                    p = cute.math.exp2(x * scale_log2 - lse2, fastmath=False)
                # the thread's value columns come in adjacent pairs (c, c + 1) (SM90 wgmma C layout): one 4-byte
                # load each
                v2 = cute.make_rmem_tensor((2,), self.dtype)
                vf = cute.make_rmem_tensor((2,), Float32)
                for c in cutlass.range_constexpr(0, n_cols, 2):
                    if (marks[w0 + c // 32] >> Int32(c % 32)) & Int32(3) != 0:
                        cute.autovec_copy(cute.local_tile(v_row, (2,), (tOcO[r, c][1] // 2,)), v2)
                        vf.store(v2.load().to(Float32))
                        for i in cutlass.range_constexpr(2):
                            if (marks[w0 + c // 32] >> Int32(c % 32 + i)) & Int32(1) != 0:
                                acc[r, c + i] = acc[r, c + i] + p * vf[i]

    # The recompute reads Q, K, V, the page table and its counter through global addresses that would otherwise stay
    # in registers across the key-block loops (kernel parameters loaded at the kernel's entry): with them there,
    # ptxas changed the hd-256 bench launches' key-block loops (docs/tuning.md 2.34). So each
    # consumer warp's lane 0 writes the addresses and the dynamic strides into shared-memory slots after the V
    # barriers at the consumers' entry, and the cold path reads them back.
    def _stash_fields(self):
        """Trace-time: ``[(tensor, dynamic stride modes, dynamic shape modes past the first)]`` of Q, K, V, the page
        table (None when contiguous) and the counter, and the number of Int64 slots they take (the address, then
        each dynamic stride and shape; at most :data:`NR_STASH_SLOTS`)."""
        out, n = [], 0
        for t in (self._nr_q, self._nr_k, self._mV, self._mPageTable, self._nr_count):
            if t is None:
                out.append(None)
                continue
            dyn_st = [i for i, st in enumerate(t.stride) if not isinstance(st, int)]
            dyn_sh = [i for i, d in enumerate(t.shape) if i > 0 and not isinstance(d, int)]
            out.append((t, dyn_st, dyn_sh))
            n += 1 + len(dyn_st) + len(dyn_sh)
        if n > NR_STASH_SLOTS:
            raise ValueError(f"nan_safe_v_method='recompute': Q, K, V, the page table and the counter need {n} "
                             f"address / stride / shape slots, more than the {NR_STASH_SLOTS} reserved "
                             "(NR_STASH_SLOTS)")
        return out, n

    def _stash_slots(self, pipeline_v) -> cute.Tensor:
        """The Int64 slots after the V pipeline's barriers and the producer's tail barrier
        (:meth:`_get_shared_storage_cls`)."""
        base = pipeline_v.sync_object_empty.get_barrier(0) + self.num_stages + 1  # past full, empty, tail
        return cute.make_tensor(base, cute.make_layout((NR_STASH_SLOTS,)))

    @cute.jit
    def _stash_write(self, pipeline_v):
        """At the consumers' entry: every consumer warp's lane 0 writes the same values, then ``__syncwarp``, so
        each warp reads what it (or another warp, the same bytes) wrote."""
        slots = self._stash_slots(pipeline_v)
        fields_, _ = self._stash_fields()
        if cute.arch.lane_idx() == 0:
            i = 0
            for f in fields_:
                if const_expr(f is not None):
                    t, dyn_st, dyn_sh = f
                    slots[i] = cutlass.Int64(t.iterator.toint())
                    i += 1
                    for m in dyn_st:
                        slots[i] = cutlass.Int64(t.stride[m])
                        i += 1
                    for m in dyn_sh:
                        slots[i] = cutlass.Int64(t.shape[m])
                        i += 1
        cute.arch.sync_warp()
        self._nr_slots = slots

    def _stash_read(self):
        """In the cold path: Q, K, V, the page table (or None) and the counter rebuilt from the slots (the traced
        static strides and shapes; the addresses and the dynamic ones loaded; a dynamic first mode's extent is
        2^30, which no index reaches)."""
        fields_, _ = self._stash_fields()
        slots = self._nr_slots
        out, i = [], 0
        for f in fields_:
            if f is None:
                out.append(None)
                continue
            t, dyn_st, dyn_sh = f
            addr = slots[i]
            i += 1
            strides = list(t.stride)
            for m in dyn_st:
                strides[m] = slots[i]
                i += 1
            shape = [d if isinstance(d, int) else 1 << 30 for d in t.shape]
            for m in dyn_sh:
                shape[m] = Int32(slots[i])
                i += 1
            # 4-byte alignment even for Q / K / V (16 in fact): with 16, ptxas issued the 16-byte loads early and the
            # hd-256 kernels spilled (docs/tuning.md 2.34); the cold path's load width does not matter
            ptr = cute.make_ptr(t.element_type, addr, cute.AddressSpace.gmem, assumed_align=4)
            out.append(cute.make_tensor(ptr, cute.make_layout(tuple(shape), stride=tuple(strides))))
        return tuple(out)
