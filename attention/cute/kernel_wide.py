"""CuTe DSL kernel of the ``"cute"`` backend for value head dims above 256 (Gemma 4's global layers: hd 512).

Imported only by :mod:`blockdiff.attention.cute.interface` (lazily: it needs flash-attn-4 and nvidia-cutlass-dsl).
The design, its register and shared-memory arithmetic and the alternatives it was chosen over are in
docs/tuning.md, section "2.1 Head dim 512 on SM90"; the tile rules in :mod:`blockdiff.attention.cute.config`
(``resolve_wide_config``).

The problem
-----------
An SM90 warpgroup multiplies 64 rows at a time (wgmma M = 64), and FA4's consumer keeps its whole output tile in
registers: 64 x 512 fp32 is 256 registers per thread of one warpgroup, more than a thread can hold. The output
must be split over two warpgroups along the value dimension (256 columns, 128 registers each).

The division of labour (FlashAttention-3's ``LargeHeadDimV`` arrangement)
------------------------------------------------------------------------
:class:`FlashAttentionForwardSm90WideV` subclasses
:class:`blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed` (itself FA4's ``FlashAttentionForwardSm90``):
FA4's ``__call__`` (TMA atoms, PackGQA layouts, the varlen tile scheduler, grid), its kernel body (pipelines,
shared memory, warp specialisation, register reallocation), its producers (contiguous TMA, cp.async paged) and
ours (page-box TMA, V rows past the last key zeroed), our per-row block ranges and masks, and FA4's epilogue run
unchanged. Replaced: the consumer (:meth:`mma`), the two tiled
MMAs, the shared-storage struct, and the thread-count attributes ``__call__`` derives (``_setup_attributes``).

One 64-row query tile (PackGQA: 64 packed rows), 384 threads:

* warpgroup 0 (FA4's producer): warp 0 issues the TMA loads of Q and of whole K / V key blocks
  (``tile_n x head_dim``), in FA4's order;
* consumer warpgroup 0 (**WG0**): S = Q K^T for all 64 x ``tile_n`` scores (both operands in shared memory),
  the per-row mask, the online softmax; P goes to a shared-memory slot (bf16/fp16) together with each row's
  rescale factor; then O[:, :dv/2] += P V[:, :dv/2] with P from its registers. FA4's intra-warpgroup overlap
  is kept: the QK^T of key block j is issued together with the PV of block j - 1, and the softmax of block j
  runs while that PV is in flight;
* consumer warpgroup 1 (**WG1**): per key block, waits for P's slot, rescales O[:, dv/2:] by the factors WG0
  left beside P, and runs O[:, dv/2:] += P V[:, dv/2:] with P from shared memory.

The hand-off uses two P slots (WG0 writes block j + 1 while WG1 reads block j) and CTA named barriers: WG0 fences
its P stores for the async proxy (wgmma reads them) and arrives on ``P_FULL[slot]``; WG1 waits there, and after
its PV retires arrives on ``P_EMPTY[slot]``, on which WG0 waits before it reuses the slot (from the third block
on; WG1 skips the arrivals WG0 would never consume, so every barrier generation completes). After the last
block WG0 sends the final 1 / rowsum through a third scale slot (``FINAL``). A thread's two accumulator rows are
the same rows in every m64 wgmma fragment (S, O[:, :dv/2], O[:, dv/2:]), so thread t of WG1 reads exactly the
factors thread t of WG0 wrote.

FA4's K pipeline counts both consumer warpgroups. WG1 does not read K; it waits for each K stage and releases it
at the start of its iteration for that block, which never completes a stage's phase early (the stage's next
load needs WG0's release of it). The V stages are released by both warpgroups after their PV retires.

Shared memory (2-byte elements): Q ``64 x d`` (the output tile reuses it), ``num_stages`` x (K + V)
``tile_n x d``, 2 P slots ``64 x tile_n``, the scale slots (3 x 128 threads x 2 rows x 4 B). Registers per
thread: 232 per consumer and 40 for the producer, or 224 / 56 when a K / V stage takes two page boxes
(``_setup_attributes``; the three warpgroups share the 3 x 168 registers a thread they launch with).

Named barriers: FA4's ``NamedBarrierFwd`` uses ids 1-6 (only ``Epilogue`` here); this kernel adds ids 7-11 (and
12-13 for the NaN-safe V clean-up, ``nan_safe_v``: WG0 and WG1 each clean their own half of a masked block's V
stage, WG0 at the end of the block's step, WG1 before its PV; WG1's block loop then runs as WG0's three ranges).
Each key block of a tile goes through both consumer warpgroups in the same order, and every row allows at
least its own key, so a tile has at least one block.
"""
from __future__ import annotations

import enum
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils_basic
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from quack import layout_utils
from quack import sm90_utils

from flash_attn.cute import utils as fa_utils
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.utils import AuxData

from .kernel import FlashAttentionForwardSm90Mixed


class NamedBarrierWideV(enum.IntEnum):
    """CTA named barriers of the P hand-off (FA4's ``NamedBarrierFwd`` ends at 6)."""

    P_FULL_0 = 7
    P_FULL_1 = 8
    P_EMPTY_0 = 9
    P_EMPTY_1 = 10
    FINAL = 11


#: Threads per warpgroup, P slots, scale slots (two per-block slots + the final 1 / rowsum).
_WG = 128
_P_SLOTS = 2
_SCALE_SLOTS = 3


class FlashAttentionForwardSm90WideV(FlashAttentionForwardSm90Mixed):
    """FA4 SM90 forward with the value dimension split over two consumer warpgroups (module docstring).

    Constructor arguments are :class:`~blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed`'s;
    ``tile_m`` must be 64 (one query-row block per consumer warpgroup), ``head_dim_v`` an even number of 16-wide
    column groups of at most 256 per warpgroup (272..512 in steps of 32), ``head_dim == head_dim_v`` (the output
    tile reuses Q's shared memory). ``mma_pv_is_rs`` and ``intra_wg_overlap`` are fixed (WG0: P in registers,
    WG1: P in shared memory; overlap on) and ignored. ``skip_allowed_first`` must be False (this class's consumers,
    and the roles kernel's, place their own NaN-safe clean-up; the config resolves it to False above head dim 256).

    Raises:
        ValueError: a tile shape or head dim outside the above, or ``skip_allowed_first=True``.
    """

    #: ``skip_allowed_first=True`` is FA4's consumer's (kernel.py); refused here and in the roles kernel.
    BUILDS_SKIP_ALLOWED_FIRST = False
    BUILDS_NAN_RECOMPUTE = False  # its consumers place their own clean-up (and the roles kernel's row statistics)
    USES_FA4_MMA = False  # its consumers create their softmax (_make_softmax: exact_weight reaches them there)

    def __init__(self, *args, **kwargs):
        kwargs["mma_pv_is_rs"] = False  # FA4 then builds a P layout; two slots are made of it
        kwargs["intra_wg_overlap"] = True
        super().__init__(*args, **kwargs)
        if self.tile_m != 64:
            raise ValueError(f"tile_m must be 64 for the split-value kernel, got {self.tile_m}")
        if not (256 < self.tile_hdimv <= 512 and self.tile_hdimv % 32 == 0):
            raise ValueError(f"head_dim_v must be in (256, 512] and a multiple of 32, got {self.tile_hdimv}")
        if self.tile_hdim != self.tile_hdimv or self.check_hdim_oob or self.check_hdim_v_oob:
            raise ValueError("the split-value kernel needs head_dim == head_dim_v, a multiple of 32")
        if self.tile_n % 16 != 0:
            raise ValueError(f"tile_n must be a multiple of 16, got {self.tile_n}")
        self.half_v = self.tile_hdimv // 2

    # --- what FA4's __call__ derives from the tiled MMAs --------------------------------------------------
    def _get_tiled_mma(self):
        """(QK^T for WG0: one warpgroup, 64 x tile_n, both operands in shared memory; PV for both consumer
        warpgroups: two m64 x (dv/2) atoms side by side along the value dimension, P from shared memory)."""
        tiled_mma_qk = sm90_utils_basic.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = self._tiled_mma_pv(warpgroup.OperandSource.SMEM)
        return tiled_mma_qk, tiled_mma_pv

    def _tiled_mma_pv(self, a_source):
        return sm90_utils_basic.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 2, 1), tiler_mn=(64, self.half_v), a_source=a_source,
        )

    def _setup_attributes(self):
        # FA4's __call__ counts the consumer threads from the QK^T tiled MMA (one warpgroup here) and picks the
        # register split and scheduler barrier from that count; both consumer warpgroups run this kernel's mma.
        self.num_mma_threads = 2 * _WG
        self.num_wg_mma = 2
        self.num_threads = 3 * _WG
        self.num_epilogue_threads = self.num_mma_threads
        # setmaxnreg moves registers within the CTA's launch allocation: 384 threads launch with 168 each (64 K
        # registers / 384, rounded down to 8), so producer + 2 x consumer <= 3 x 168 = 504 a thread of a
        # warpgroup, or the consumers' increase waits forever. At hd 512 the producer spills at FA4's 24 (each
        # K / V box is 8 TMA copies of 64 columns): 40 suffice for one box per K / V stage; with two it keeps
        # a few spills at 56 (config.kv_load_path sends more boxes to cp.async), which cost less than the
        # consumers' spills at 216 (compile_check.py).
        boxes = self.tile_n // self.kv_box_rows if self.kv_box_rows is not None else 1
        self.num_mma_regs, self.num_producer_regs = (224, 56) if boxes > 1 else self._regs_one_box()
        launch_regs = 65536 // self.num_threads // 8 * 8
        assert self.num_producer_regs + 2 * self.num_mma_regs <= 3 * launch_regs, "setmaxnreg over the CTA pool"
        self.use_scheduler_barrier = False
        self.rescale_O_before_gemm = False
        super()._setup_attributes()

    def _regs_one_box(self):
        """(consumer, producer) registers with at most one page box per K / V stage."""
        return 232, 40

    def _get_shared_storage_cls(self):
        """FA4's fields (plus the page-box producer's tail barrier) with two P slots and the scale slots after
        them (fp32, ``(rows per thread, 128 threads, 3 slots)``, found by :meth:`_scale_tensor`)."""
        self.sP_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n),
                                                     _P_SLOTS)
        sQ_struct, sK_struct, sV_struct = [
            cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], self.buffer_align_bytes]
            for layout in (self.sQ_layout, self.sK_layout, self.sV_layout)
        ]
        cosize_sP = cute.cosize(self.sP_layout)
        self._sP_bytes = int(cosize_sP) * self.dtype.width // 8  # a Python int for the kernel trace
        assert self._sP_bytes % 16 == 0
        sP_struct = cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_sP], 1024]
        sScale_struct = cute.struct.Align[cute.struct.MemRange[Float32, self._scale_elems()], 16]
        extra_v = self._extra_v_barriers()
        fields_ = dict(
            mbar_ptr_Q=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_ptr_K=cute.struct.MemRange[cutlass.Int64, self.num_stages * 2],
            mbar_ptr_V=cute.struct.MemRange[cutlass.Int64, self.num_stages * 2 + extra_v],
            sV=sV_struct, sQ=sQ_struct, sK=sK_struct, sP=sP_struct, sScale=sScale_struct,
        )
        assert not self.Q_in_regs
        # type(): this module's `from __future__ import annotations` would make class-body annotations strings
        return cute.struct(type("SharedStorageWideV", (), {"__annotations__": fields_}))

    def _extra_v_barriers(self) -> int:
        """mbarriers after the V pipeline's full / empty ones: the page-box producer's tail barrier
        (kernel_roles.py adds its per-half V pipelines)."""
        return 1 if self.kv_box_rows is not None else 0

    def _rows_per_thread(self) -> int:
        return 2  # an m64 wgmma accumulator gives each thread rows r and r + 8 of its warp's 16

    def _scale_elems(self) -> int:
        return self._rows_per_thread() * _WG * _SCALE_SLOTS

    def _scale_tensor(self, sP: cute.Tensor) -> cute.Tensor:
        """The fp32 scale slots, right after the P slots in shared memory (``_get_shared_storage_cls``)."""
        base = sP.iterator.toint() + self._sP_bytes
        ptr = cute.make_ptr(Float32, base, cute.AddressSpace.smem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout((self._rows_per_thread(), _WG, _SCALE_SLOTS)))

    # --- the consumers -------------------------------------------------------------------------------------
    @cute.jit
    def mma(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sVt: cute.Tensor,
        sP: Optional[cute.Tensor],
        sO: cute.Tensor,
        learnable_sink: Optional[cute.Tensor],
        pipeline_k,
        pipeline_v,
        pipeline_q,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tidx: Int32,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        block_info,
        SeqlenInfoCls: Callable,
        AttentionMaskCls: Callable,
        TileSchedulerCls: Callable,
        blocksparse_tensors=None,
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
    ):
        """Consumer entry (FA4's ``mma`` signature): ``tidx`` in ``[0, 256)``; warpgroup 0 of them runs
        :meth:`_mma_wg0`, warpgroup 1 :meth:`_mma_wg1`, both with the shared pieces bundled in ``ctx``."""
        block_info = self._mixed_block_info(block_info)
        if const_expr(self.nan_safe_v):
            self._nan_safe_setup(sVt, pipeline_v, block_info)
        ctx = SimpleNamespace(
            tiled_mma_pv=tiled_mma_pv, mO=mO, mLSE=mLSE, sVt=sVt, sP=sP, sScale=self._scale_tensor(sP), sO=sO,
            pipeline_k=pipeline_k, pipeline_v=pipeline_v, pipeline_q=pipeline_q,
            gmem_tiled_copy_O=gmem_tiled_copy_O, tma_atom_O=tma_atom_O, tidx=tidx,
            softmax_scale_log2=softmax_scale_log2, softmax_scale=softmax_scale, block_info=block_info,
            SeqlenInfoCls=self._mixed_seqlen_cls(SeqlenInfoCls), TileSchedulerCls=TileSchedulerCls,
        )
        warp_group_idx = cute.arch.make_warp_uniform(tidx // _WG)
        if warp_group_idx == 0:
            self._mma_wg0(ctx, tiled_mma_qk, sQ, sK, self._mixed_mask_cls(block_info))
        else:
            self._mma_wg1(ctx)

    @cute.jit
    def _mma_wg0(self, ctx: SimpleNamespace, tiled_mma_qk: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor,
                 AttentionMaskCls: Callable):
        """WG0: S = Q K^T, mask, online softmax, P and the row factors to WG1, O[:, :dv/2] += P V."""
        # locals only inside the loops below: the DSL would try to carry the namespace's fields through them
        tidx, block_info, sScale, SeqlenInfoCls = ctx.tidx, ctx.block_info, ctx.sScale, ctx.SeqlenInfoCls
        pipeline_k, pipeline_v, pipeline_q = ctx.pipeline_k, ctx.pipeline_v, ctx.pipeline_q
        epilogue = partial(self._epilogue, ctx)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
            tiled_mma_qk.get_slice(0), (self.tile_m, self.tile_n, self.tile_hdim), sQ, sK)
        mma_qk_fn = partial(sm90_utils.gemm_zero_init, tiled_mma_qk, (self.tile_m, self.tile_n), tSrQ, tSrK)
        # P V with P from registers: the same two-atom layout as the SS tiled MMA, this warpgroup's half
        tiled_mma_pv_rs = self._tiled_mma_pv(warpgroup.OperandSource.RMEM)
        acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
            tiled_mma_pv_rs.get_slice(0), (self.tile_m, self.tile_hdimv, self.tile_n), None, ctx.sVt)
        mma_pv_fn = partial(sm90_utils.gemm_w_idx, tiled_mma_pv_rs, acc_O, tOrP, tOrVt)
        smem_copy_atom_P = fa_utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr_copy_P = cute.make_tiled_copy_C(smem_copy_atom_P, tiled_mma_qk).get_slice(tidx)
        tPsP = smem_thr_copy_P.partition_D(ctx.sP)
        softmax = self._make_softmax(ctx.softmax_scale_log2, acc_O.shape[0][0] * acc_O.shape[1],
                                     softmax_scale=ctx.softmax_scale)  # the row statistics (exact_weight: exact)
        hand_off = partial(self._hand_off_p, smem_thr_copy_P, tPsP, tOrP, ctx.sScale, tidx)

        q_consumer_phase = Int32(0)
        kv_consumer_state = self._consumer_state()
        tile_scheduler = ctx.TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            mask = AttentionMaskCls(seqlen)
            mask_fn = partial(mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx, m_block=m_block,
                              thr_mma=thr_mma_qk, mask_causal=False, mask_local=True)
            step = partial(self._wg0_step, mma_qk_fn=mma_qk_fn, mma_pv_fn=mma_pv_fn, pipeline_k=pipeline_k,
                           pipeline_v=pipeline_v, acc_O=acc_O, softmax=softmax, hand_off=hand_off)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            pipeline_q.consumer_wait_w_index_phase(0, q_consumer_phase)
            # First block (the tile's last key block): S, mask, softmax; its PV runs in the next step.
            pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
            acc_S = mma_qk_fn(B_idx=kv_consumer_state.index, wg_wait=0)
            pipeline_k.consumer_release(kv_consumer_state)
            mask_fn(acc_S, n_block=n_block_max - 1, mask_seqlen=True)
            row_scale = softmax.online_softmax(acc_S, is_first=True)
            hand_off(acc_S, row_scale, Int32(0))
            if const_expr(self.nan_safe_v):  # masked: clean this warpgroup's half of its V before the next PV
                self._wait_clean_v(kv_consumer_state, 0, self.half_v)
            block_i = Int32(1)  # blocks handed to WG1 so far
            n_block_max -= 1
            # Blocks that may hold keys right of some row's hi (masked), interior blocks (unmasked), blocks
            # that may hold keys left of some row's lo (masked): FA4's three loops, our per-row bounds.
            n_block_right = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
            for n_tile in cutlass.range(n_block_max - n_block_right, unroll=1):
                kv_consumer_state, block_i = step(kv_consumer_state, n_block_max - 1 - n_tile, block_i,
                                                  mask_fn=partial(mask_fn, mask_seqlen=False))
            n_block_max = cutlass.min(n_block_max, n_block_right)
            n_block_left = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
            for n_tile in cutlass.range(n_block_max - n_block_left, unroll=1):
                kv_consumer_state, block_i = step(kv_consumer_state, n_block_max - 1 - n_tile, block_i,
                                                  mask_fn=None)
            if const_expr(block_info.window_size_left is not None):
                n_block_max = cutlass.min(n_block_max, n_block_left)
                for n_tile in cutlass.range(n_block_max - n_block_min, unroll=1):
                    kv_consumer_state, block_i = step(kv_consumer_state, n_block_max - 1 - n_tile, block_i,
                                                      mask_fn=partial(mask_fn, mask_seqlen=False))
            pipeline_q.consumer_release_w_index(0)
            q_consumer_phase ^= 1
            # 1 / rowsum and the LSE; the factor goes to WG1 before this warpgroup's last PV.
            row_scale = softmax.finalize()
            self._store_scale(sScale, row_scale, tidx, Int32(_SCALE_SLOTS - 1))
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.FINAL), number_of_threads=2 * _WG)
            # Last PV: the block handed off last (zero-initialised if it is the tile's only block).
            pipeline_v.consumer_wait(kv_consumer_state, pipeline_v.consumer_try_wait(kv_consumer_state))
            mma_pv_fn(B_idx=kv_consumer_state.index, zero_init=block_i == 1, wg_wait=0)
            pipeline_v.consumer_release(kv_consumer_state)
            kv_consumer_state.advance()
            softmax.rescale_O(acc_O, row_scale)
            epilogue(acc_O, softmax.row_sum, seqlen, m_block, head_idx, batch_idx)
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()

    @cute.jit
    def _wg0_step(
        self,
        kv_consumer_state,
        n_block: Int32,
        block_i: Int32,
        mma_qk_fn: Callable,
        mma_pv_fn: Callable,
        pipeline_k,
        pipeline_v,
        acc_O: cute.Tensor,
        softmax: Softmax,
        hand_off: Callable,
        mask_fn: Optional[Callable] = None,
    ):
        """One WG0 iteration: QK^T of key block ``n_block`` issued with the PV of the block handed off before
        (``block_i - 1``, in P's registers), the softmax of ``n_block`` while that PV runs, then the hand-off
        and the rescale of O. Returns the advanced consumer state and ``block_i + 1``."""
        smem_pipe_read_v = kv_consumer_state.clone()
        kv_consumer_state.advance()
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        acc_S = mma_qk_fn(B_idx=kv_consumer_state.index, wg_wait=-1)
        pipeline_v.consumer_wait(smem_pipe_read_v, pipeline_v.consumer_try_wait(smem_pipe_read_v))
        mma_pv_fn(B_idx=smem_pipe_read_v.index, zero_init=block_i == 1, wg_wait=-1)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(kv_consumer_state)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, check_inf=True)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(smem_pipe_read_v)
        hand_off(acc_S, row_scale, block_i)
        softmax.rescale_O(acc_O, row_scale)
        if const_expr(self.nan_safe_v and mask_fn is not None):
            # a masked block: this warpgroup's half of its V cleaned before its PV (the next step)
            self._wait_clean_v(kv_consumer_state, 0, self.half_v)
        return kv_consumer_state, block_i + 1

    @cute.jit
    def _hand_off_p(
        self,
        smem_thr_copy_P: cute.TiledCopy,
        tPsP: cute.Tensor,
        tOrP: cute.Tensor,
        sScale: cute.Tensor,
        tidx: Int32,
        acc_S: cute.Tensor,
        row_scale: cute.Tensor,
        block_i: Int32,
    ):
        """P of hand-off ``block_i`` (softmax numerators in ``acc_S``) into ``tOrP`` (WG0's PV operand) and
        P slot ``block_i % 2``, the row factors into scale slot ``block_i % 2``; fenced for wgmma, then
        ``P_FULL``. From the third hand-off on, waits for WG1 to free the slot first (``P_EMPTY``)."""
        slot = block_i % _P_SLOTS
        if block_i >= _P_SLOTS:
            cute.arch.barrier(barrier_id=int(NamedBarrierWideV.P_EMPTY_0) + slot, number_of_threads=2 * _WG)
        tOrP_acc = layout_utils.reshape_acc_to_frgA(acc_S)
        fa_utils.cvt_f16(tOrP_acc, tOrP)
        cute.copy(smem_thr_copy_P, smem_thr_copy_P.retile(tOrP), tPsP[None, None, None, slot])
        self._store_scale(sScale, row_scale, tidx, slot)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.P_FULL_0) + slot, number_of_threads=2 * _WG)

    @cute.jit
    def _mma_wg1(self, ctx: SimpleNamespace):
        """WG1: per key block, P from its slot, O[:, dv/2:] rescaled and += P V[:, dv/2:]."""
        t_wg = ctx.tidx - _WG
        # locals only inside the loops below (as in _mma_wg0)
        block_info, sScale, SeqlenInfoCls = ctx.block_info, ctx.sScale, ctx.SeqlenInfoCls
        pipeline_k, pipeline_v, pipeline_q = ctx.pipeline_k, ctx.pipeline_v, ctx.pipeline_q
        epilogue = partial(self._epilogue, ctx)
        acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
            ctx.tiled_mma_pv.get_slice(_WG), (self.tile_m, self.tile_hdimv, self.tile_n), ctx.sP, ctx.sVt)
        mma_pv_fn = partial(sm90_utils.gemm_w_idx, ctx.tiled_mma_pv, acc_O, tOrP, tOrVt)
        # Only its rescale is used (the row statistics live in WG0); row_sum is the epilogue's unused LSE here.
        softmax = Softmax.create(ctx.softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1],
                                 softmax_scale=ctx.softmax_scale)
        softmax.reset()
        q_consumer_phase = Int32(0)
        kv_consumer_state = self._consumer_state()
        tile_scheduler = ctx.TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            num_blocks = n_block_max - n_block_min
            pipeline_q.consumer_wait_w_index_phase(0, q_consumer_phase)
            block = partial(self._wg1_block, pipeline_k=pipeline_k, pipeline_v=pipeline_v, mma_pv_fn=mma_pv_fn,
                            acc_O=acc_O, softmax=softmax, sScale=sScale, t_wg=t_wg, num_blocks=num_blocks)
            if const_expr(not self.nan_safe_v):
                for block_i in cutlass.range(num_blocks, unroll=1):
                    kv_consumer_state = block(kv_consumer_state, block_i)
            else:
                # WG0's three loops in hand-off order: the first block and the right-masked ones, the interior
                # ones, the left-masked ones; this warpgroup cleans its half of V in the masked ones.
                n_block_right = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
                n_block_left = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
                end_right = 1 + cutlass.max(n_block_max - 1 - n_block_right, 0)
                end_interior = end_right + cutlass.max(
                    cutlass.min(n_block_max - 1, n_block_right) - n_block_left, 0)
                for block_i in cutlass.range(0, end_right, unroll=1):
                    kv_consumer_state = block(kv_consumer_state, block_i, clean=True)
                for block_i in cutlass.range(end_right, end_interior, unroll=1):
                    kv_consumer_state = block(kv_consumer_state, block_i)
                for block_i in cutlass.range(end_interior, num_blocks, unroll=1):
                    kv_consumer_state = block(kv_consumer_state, block_i, clean=True)
            pipeline_q.consumer_release_w_index(0)
            q_consumer_phase ^= 1
            cute.arch.barrier(barrier_id=int(NamedBarrierWideV.FINAL), number_of_threads=2 * _WG)
            softmax.rescale_O(acc_O, self._load_scale(sScale, softmax.row_sum, t_wg, Int32(_SCALE_SLOTS - 1)))
            epilogue(acc_O, softmax.row_sum, seqlen, m_block, head_idx, batch_idx)
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()

    @cute.jit
    def _wg1_block(self, kv_consumer_state, block_i: Int32, pipeline_k, pipeline_v, mma_pv_fn: Callable,
                   acc_O: cute.Tensor, softmax: Softmax, sScale: cute.Tensor, t_wg: Int32, num_blocks: Int32,
                   clean: cutlass.Constexpr[bool] = False):
        """One WG1 iteration (hand-off ``block_i``): K stage released, P and the factors from their slot, O
        rescaled, PV (with ``clean``: the NaN-safe clean-up of this warpgroup's half of V first). Returns the
        advanced consumer state."""
        # K is WG0's; this warpgroup's arrival completes each K stage's release (module docstring).
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        pipeline_k.consumer_release(kv_consumer_state)
        slot = block_i % _P_SLOTS
        cute.arch.barrier(barrier_id=int(NamedBarrierWideV.P_FULL_0) + slot, number_of_threads=2 * _WG)
        if block_i > 0:
            softmax.rescale_O(acc_O, self._load_scale(sScale, softmax.row_sum, t_wg, slot))
        pipeline_v.consumer_wait(kv_consumer_state, pipeline_v.consumer_try_wait(kv_consumer_state))
        if const_expr(clean):
            self._clean_v_stage(self._nf_sVt, kv_consumer_state.index, self.half_v, self.half_v)
        mma_pv_fn(A_idx=slot, B_idx=kv_consumer_state.index, zero_init=block_i == 0, wg_wait=0)
        pipeline_v.consumer_release(kv_consumer_state)
        kv_consumer_state.advance()
        if block_i + _P_SLOTS < num_blocks:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.P_EMPTY_0) + slot,
                                     number_of_threads=2 * _WG)
        return kv_consumer_state

    @cute.jit
    def _epilogue(self, ctx: SimpleNamespace, acc_O: cute.Tensor, lse: cute.Tensor, seqlen, m_block: Int32,
                  head_idx: Int32, batch_idx: Int32):
        """FA4's epilogue over both consumer warpgroups (``tidx`` in ``[0, 256)``, the two-atom PV tiled MMA):
        O through shared memory (Q's) to global memory; the LSE from WG0's threads of column 0."""
        self.epilogue(acc_O, lse, ctx.mO, ctx.mLSE, ctx.sO, seqlen, ctx.gmem_tiled_copy_O, ctx.tma_atom_O,
                      ctx.tiled_mma_pv, ctx.tidx, m_block, head_idx, batch_idx)

    # --- small helpers -------------------------------------------------------------------------------------
    def _consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

    @cute.jit
    def _store_scale(self, sScale: cute.Tensor, row_scale: cute.Tensor, t: Int32, slot: Int32):
        for r in cutlass.range_constexpr(self._rows_per_thread()):
            sScale[r, t, slot] = row_scale[r]

    @cute.jit
    def _load_scale(self, sScale: cute.Tensor, like: cute.Tensor, t: Int32, slot: Int32) -> cute.Tensor:
        scale = cute.make_fragment_like(like, Float32)
        for r in cutlass.range_constexpr(self._rows_per_thread()):
            scale[r] = sScale[r, t, slot]
        return scale
