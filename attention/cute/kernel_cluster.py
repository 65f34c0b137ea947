"""Split-KV with the merge inside the one launch: the ``num_splits`` CTAs of a query tile form a thread-block
cluster and reduce their partial outputs through distributed shared memory (config ``split_merge="cluster"``).

Imported only by :mod:`blockdiff.attention.cute.interface` (lazily: it needs flash-attn-4 and nvidia-cutlass-dsl).
Design, shared-memory budget and expected cost: docs/tuning.md, section 2.5.

:class:`ClusterMergeMixin` goes in front of a split-KV class of :mod:`~blockdiff.attention.cute.kernel_split`
(whose scheduler split axis, key-block ranges and empty-split handling it keeps) and changes:

* the launch: while ``__call__`` is traced (:meth:`ClusterMergeMixin.trace_patches`), an instance attribute
  ``kernel`` shadows the class's ``@cute.kernel`` method; it calls the real one and adds ``cluster=[1, S, 1]`` to
  the launch FA4's ``__call__`` issues. Grid y is FA4's varlen scheduler's split axis, so one cluster holds the
  S splits of one (tile, head) and a CTA's split is its rank in the cluster. FA4's pipelines stay CTA-local
  (its ``cluster_shape_mn`` stays (1, 1): TMA without multicast, no cluster-wide barrier init);
* the epilogue (:meth:`ClusterMergeMixin.epilogue`): each CTA stores its normalised fp32 output tile and its
  rows' LSE into its own shared memory (the Q / K / V buffers, idle after the loop), a cluster barrier, then CTA
  ``s`` merges rows ``[s * ceil(tile_m / S), ...)`` reading all S tiles (``mapa`` + ``ld.shared::cluster``) and
  writes the output (q's dtype) and the LSE itself; a second cluster barrier before exit keeps every CTA's
  shared memory alive for its peers' reads;
* the producer (:meth:`ClusterMergeMixin.load`): after its load loop the producer warps take part in the two
  cluster barriers of a valid tile (``barrier.cluster`` counts every thread of the cluster).

Runtime: ``aux_data = AuxData([num_causal_q, out, lse])`` (``lse`` only when built with ``merge_lse``): ``out``
``[total_q, num_heads, head_dim_v]`` (q's dtype), ``lse`` ``[num_heads, total_q]`` fp32. No workspace.
"""
from __future__ import annotations

import contextlib
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_attn.cute.named_barrier import NamedBarrierFwd
from quack import layout_utils

from .config import MAX_CLUSTER_SPLITS
from .kernel_split import FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90WideVSplit
from .ptx import asm as _asm

_LOG2_E = math.log2(math.e)


# --- shared / distributed shared memory, 32-bit shared addresses ------------------------------------------------
@dsl_user_op
def st_shared_f32x2(addr: Int32, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.v2.f32`` at a shared-window address (8-byte aligned)."""
    _asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
                Float32(b).ir_value(loc=loc, ip=ip)],
         "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", True, loc, ip)


@dsl_user_op
def st_shared_f32(addr: Int32, a: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.f32`` at a shared-window address."""
    _asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip)],
         "st.shared.f32 [$0], $1;", "r,f", True, loc, ip)


@dsl_user_op
def mapa_cluster(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The ``shared::cluster`` address of the same offset in the shared memory of CTA ``rank`` of the cluster."""
    return Int32(_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", False, loc, ip))


@dsl_user_op
def ld_cluster_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    """``ld.shared::cluster.f32`` (a :func:`mapa_cluster` address)."""
    return Float32(_asm(T.f32(), [Int32(addr).ir_value(loc=loc, ip=ip)],
                        "ld.shared::cluster.f32 $0, [$1];", "=f,r", True, loc, ip))


@dsl_user_op
def ld_cluster_f32x4(addr: Int32, *, loc=None, ip=None):
    """``ld.shared::cluster.v4.f32`` (a 16-byte aligned :func:`mapa_cluster` address): four Float32."""
    struct_ty = ir.Type.parse("!llvm.struct<(f32, f32, f32, f32)>")
    res = _asm(struct_ty, [Int32(addr).ir_value(loc=loc, ip=ip)],
               "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r", True, loc, ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


def _tile_offset(row: Int32, col: Int32, dv: int) -> Int32:
    """Float index of (row, col) in the merge's fp32 tile of ``dv`` columns: row-major, 8-column groups
    XOR-swizzled by ``row % 8`` when ``dv % 64 == 0`` (a warp's accumulator store touches 8 rows: 2 wavefronts
    instead of 8). Traced inline."""
    if dv % 64 == 0:
        return row * dv + (col ^ ((row & 7) << 3))
    return row * dv + col


class _ClusterLaunch:
    """Stands in for the kernel's bound ``kernel`` method while ``__call__`` is traced: the launcher it returns
    launches with ``cluster=[1, num_splits, 1]``. Counts the launches (exactly one expected)."""

    def __init__(self, real, num_splits: int):
        self._real = real
        self._cluster = [1, num_splits, 1]
        self.launches = 0

    def __call__(self, *args, **kwargs):
        launcher = self._real(*args, **kwargs)
        real_launch = launcher.launch

        def launch(*l_args, **l_kwargs):
            if l_kwargs.get("cluster") is not None:
                raise RuntimeError(f"FA4's launch already has a cluster shape {l_kwargs['cluster']}")
            l_kwargs["cluster"] = list(self._cluster)
            self.launches += 1
            return real_launch(*l_args, **l_kwargs)

        launcher.launch = launch
        return launcher


class ClusterMergeMixin:
    """The one-launch cluster merge (module docstring) for a split-KV class of
    :mod:`~blockdiff.attention.cute.kernel_split`. Constructor keywords: ``num_splits`` (2 ..
    :data:`~blockdiff.attention.cute.config.MAX_CLUSTER_SPLITS`, compile-time), ``merge_lse`` (write the LSE).

    Raises:
        ValueError: ``num_splits`` outside 2 .. MAX_CLUSTER_SPLITS (the portable cluster size).
    """

    def __init__(self, *args, num_splits: int = 2, merge_lse: bool = False, **kwargs):
        super().__init__(*args, num_splits=num_splits, **kwargs)
        if not 2 <= num_splits <= MAX_CLUSTER_SPLITS:
            raise ValueError(f"the cluster merge takes 2 .. {MAX_CLUSTER_SPLITS} splits (portable cluster size), "
                             f"got {num_splits}")
        self.merge_lse = bool(merge_lse)
        self._merge_span = None  # (offset of the span from sK, span bytes): _get_shared_storage_cls
        self._merge_sK = None  # trace-time hand-off from mma()

    @contextlib.contextmanager
    def trace_patches(self):
        """The split-KV trace patches plus the cluster launch (:class:`_ClusterLaunch`).

        Raises RuntimeError if FA4's ``__call__`` did not launch exactly once."""
        with super().trace_patches():
            proxy = _ClusterLaunch(self.kernel, self.num_splits)
            self.kernel = proxy  # instance attribute: shadows the @cute.kernel method for FA4's __call__
            try:
                yield
            finally:
                del self.kernel
        if proxy.launches != 1:
            raise RuntimeError(f"expected FA4's __call__ to launch once, saw {proxy.launches}")

    def _get_shared_storage_cls(self):
        """The base class's struct; records the span of the sV, sQ and sK buffers (idle after the key loop), where
        the merge puts the fp32 tile and the LSEs. Raises ValueError when they do not fit (or another field lies
        inside the span)."""
        storage = super()._get_shared_storage_cls()
        offsets = storage._offsets
        elem = self.dtype.width // 8
        sizes = dict(sV=cute.cosize(self.sV_layout) * elem, sQ=cute.cosize(self.sQ_layout) * elem,
                     sK=cute.cosize(self.sK_layout) * elem)
        start = min(offsets[n] for n in sizes)
        end = max(offsets[n] + sizes[n] for n in sizes)
        inside = [n for n, off in offsets.items() if n not in sizes and start <= off < end]
        need = self._merge_bytes()
        if inside or need > end - start:
            raise ValueError(
                f"cluster merge: the fp32 output tile and LSEs ({need} B) do not fit the Q / K / V buffers "
                f"({end - start} B{', with ' + str(inside) + ' inside' if inside else ''}); use "
                "split_merge='combine'")
        self._merge_span = (start - offsets["sK"], end - start)
        return storage

    def _merge_bytes(self) -> int:
        return self.tile_m * self.tile_hdimv * 4 + self.tile_m * 4

    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, *rest, **kwargs):
        self._merge_sK = sK  # the merge finds its shared-memory span from sK's address
        return super().mma(tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, *rest, **kwargs)

    def load(self, *args):
        super().load(*args)
        self._producer_merge_barriers(args[-1])

    @cute.jit
    def _producer_merge_barriers(self, TileSchedulerCls):
        """The producer warps' part in the merge's two cluster barriers (only for a valid tile: the consumers of
        an invalid one skip the merge; all CTAs of a cluster share the tile)."""
        work_tile = TileSchedulerCls().initial_work_tile_info()
        if work_tile.is_valid_tile:
            for _ in cutlass.range_constexpr(2):
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE,
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """The cluster merge (FA4's epilogue signature; ``mO``, ``mLSE``, ``sO`` unused: the output and the LSE
        are the aux tensors). An empty split enters with O = 0, LSE = -inf. With ``nan_safe_v`` the NaN-safe
        fix-up runs first (this split's masked blocks); with ``nan_safe_v_method="recompute"`` the test and
        recompute run first too (an empty split's result is then replaced by its fill)."""
        if const_expr(self.nan_safe_v):
            self._nonfinite_fixup(acc_O, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        if const_expr(self.nan_recompute):  # first (the fewest values live across its cold path); an empty split's
            # recompute, if its discarded block held a NaN, is overwritten by the fill below
            self._nonfinite_recompute(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        num_splits = self.num_splits
        rank = cute.arch.block_idx_in_cluster()
        _, _, empty = self._split_block_info.split_range(seqlen, m_block)
        qpk = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO = layout_utils.reshape_acc_to_mn(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        acc_mn = layout_utils.reshape_acc_to_mn(acc_O)
        if empty:
            acc_mn.fill(0.0)
        span_from_sK, _ = self._merge_span
        dv, tile_m, nthreads = self.tile_hdimv, self.tile_m, self.num_mma_threads
        o_base = Int32(self._merge_sK.iterator.toint()) + span_from_sK
        lse_base = o_base + self.tile_m * self.tile_hdimv * 4
        # (1) every consumer thread is past its last wgmma (Q / K / V reads done): the span is free
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row = tOcO[r, 0][0]
            for c in cutlass.range_constexpr(0, cute.size(tOcO, mode=[1]), 2):
                # accumulator columns come in adjacent pairs (c, c + 1) per thread (SM90 wgmma C layout)
                st_shared_f32x2(o_base + _tile_offset(row, tOcO[r, c][1], dv) * 4, acc_mn[r, c], acc_mn[r, c + 1])
            if tOcO[0, 0][1] == 0:  # one thread per row (the one holding column 0) stores its LSE
                st_shared_f32(lse_base + row * 4, -Float32.inf if empty else lse[r])
        # (2) every CTA's tile and LSEs are in its shared memory
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        # (3) this CTA's row slice: one (row, 4-column group) per thread and step
        # (locals only inside the loop: the DSL cannot carry `self` or the seqlen info through a run-time `for`)
        rows_per = (tile_m + num_splits - 1) // num_splits
        quads = self._head_dims[1] // 4  # the row's own columns (dv, FA4's tile_hdimv, may be padded past them)
        steps = (rows_per * quads + nthreads - 1) // nthreads
        mOut = self._aux_tensors[1]
        mLSEout = self._aux_tensors[2] if const_expr(self.merge_lse) else None
        seqlen_q, offset_q = seqlen.seqlen_q, seqlen.offset_q
        for step in cutlass.range(steps, unroll=1):
            item = step * nthreads + tidx
            row_l = item // quads
            quad = item - row_l * quads
            row = rank * rows_per + row_l
            grow = m_block * tile_m + row
            token = grow // qpk
            if row_l < rows_per and row < tile_m and token < seqlen_q:
                lse_s = [ld_cluster_f32(mapa_cluster(lse_base + row * 4, Int32(s)))
                         for s in range(num_splits)]
                lse_max = lse_s[0]
                for s in cutlass.range_constexpr(1, num_splits):
                    lse_max = cutlass.max(lse_max, lse_s[s])
                lse_max_safe = Float32(0.0) if lse_max == -Float32.inf else lse_max
                total = Float32(0.0)
                for s in cutlass.range_constexpr(num_splits):
                    total += cute.math.exp2((lse_s[s] - lse_max_safe) * _LOG2_E, fastmath=True)
                lse_all = -Float32.inf
                if total > 0.0:
                    lse_all = cute.math.log(total, fastmath=True) + lse_max_safe
                lse_all_safe = Float32(0.0) if lse_all == -Float32.inf else lse_all
                o = cute.make_rmem_tensor((4,), Float32)
                o.fill(0.0)
                col = quad * 4
                for s in cutlass.range_constexpr(num_splits):
                    w = cute.math.exp2((lse_s[s] - lse_all_safe) * _LOG2_E, fastmath=True)
                    v = ld_cluster_f32x4(mapa_cluster(o_base + _tile_offset(row, col, dv) * 4, Int32(s)))
                    for i in cutlass.range_constexpr(4):
                        o[i] += w * v[i]
                q_row = offset_q + token
                q_head = head_idx * qpk + grow % qpk
                o_out = cute.make_rmem_tensor((4,), mOut.element_type)
                o_out.store(o.load().to(mOut.element_type))
                g_row = mOut[q_row, q_head, None]
                cute.autovec_copy(o_out, cute.local_tile(g_row, (4,), (quad,)))
                if const_expr(mLSEout is not None):
                    if quad == 0:
                        mLSEout[q_head, q_row] = lse_all
        # (4) no CTA leaves (freeing its shared memory) while a peer may still read it
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


class FlashAttentionForwardSm90MixedCluster(ClusterMergeMixin, FlashAttentionForwardSm90MixedSplit):
    """:class:`~blockdiff.attention.cute.kernel_split.FlashAttentionForwardSm90MixedSplit` with the cluster merge
    (:class:`ClusterMergeMixin`)."""


class FlashAttentionForwardSm90WideVCluster(ClusterMergeMixin, FlashAttentionForwardSm90WideVSplit):
    """:class:`~blockdiff.attention.cute.kernel_split.FlashAttentionForwardSm90WideVSplit` with the cluster merge
    (:class:`ClusterMergeMixin`)."""
