"""Split-KV variants of the ``"cute"`` kernels: each query tile's key blocks cut into ``num_splits`` chunks,
one CTA each, every chunk's normalised partial output (fp32) and log-sum-exp written to a workspace that the
shared Triton merge (:mod:`blockdiff.attention.split_merge`, ``split_merge="triton"`` and ``"auto"``'s choice) or
FA4's combine kernel (``"combine"``) merges (:mod:`blockdiff.attention.cute.interface`).

Imported only by :mod:`blockdiff.attention.cute.interface` (lazily: it needs flash-attn-4 and nvidia-cutlass-dsl).
The split count is chosen from host shapes (:func:`blockdiff.attention.cute.config.choose_num_splits`); the
design, and the one-launch variant it leaves for later, are in docs/tuning.md, section "2.2 Split-KV".

:class:`SplitKVMixin` goes in front of :class:`~blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed` or
:class:`~blockdiff.attention.cute.kernel_wide.FlashAttentionForwardSm90WideV` and changes three things, all
host-static (``num_splits`` is part of the compile key):

* the tile scheduler: FA4's varlen scheduler already has a split axis (grid y); its arguments get
  ``num_splits`` and ``is_split_kv`` while ``__call__`` is traced (:class:`_SchedulerArgsSplit`, beside the
  base class's own trace patches). The scheduler is non-persistent: a CTA's split is ``blockIdx.y``;
* the key-block range (:class:`SplitBlockInfo`): the tile's range ``[n_min, n_max)`` of
  :class:`~blockdiff.attention.cute.kernel.MixedBlockInfo` cut into ``num_splits`` chunks of
  ``ceil((n_max - n_min) / num_splits)`` blocks; producer and consumers call the same function, so they agree.
  A split left without blocks (short sequences of a batch, or tiles narrowed by a window) still runs the
  tile's last block, because FA4's consumer always processes a first block, and its epilogue writes O = 0 and
  LSE = -inf, which the merge weighs by exp(-inf) = 0;
* the epilogue (:meth:`SplitKVMixin.epilogue`): the normalised fp32 accumulator goes to
  ``O_partial[split, token, q_head, :]`` and the LSE (natural log) to ``LSE_partial[split, q_head, token]``,
  straight from registers (PackGQA rows mapped to (token, query head) as FA4's PackGQA does).

The two workspace tensors reach the kernel through FA4's aux-tensor channel after ``num_causal_q``:
``aux_data = AuxData([num_causal_q, o_partial, lse_partial])``.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flash_attn.cute import flash_fwd_sm90 as _fa4_fwd_sm90
from quack import layout_utils

from .kernel import FlashAttentionForwardSm90Mixed, MixedBlockInfo
from .kernel_wide import FlashAttentionForwardSm90WideV


@dataclass(frozen=True)
class SplitBlockInfo(MixedBlockInfo):
    """:class:`~blockdiff.attention.cute.kernel.MixedBlockInfo` restricted to this CTA's split
    (``blockIdx.y``) of the tile's key blocks."""

    split_count: cutlass.Constexpr[int] = 1  # (FA4's BlockInfo has its own, runtime num_splits, unused here)

    @cute.jit
    def split_range(self, seqlen_info, m_block: Int32):
        """``(lo, hi, empty)``: the key-block range this CTA loads and computes, and whether its split is empty
        (then ``[lo, hi)`` is the tile's last block, whose output the epilogue discards)."""
        n_min, n_max = MixedBlockInfo.get_n_block_min_max(self, seqlen_info, m_block)
        per = (n_max - n_min + self.split_count - 1) // self.split_count
        lo = n_min + cute.arch.block_idx()[1] * per
        hi = cutlass.min(lo + per, n_max)
        empty = lo >= hi
        if empty:
            lo = n_max - 1
            hi = n_max
        return lo, hi, empty

    @cute.jit
    def get_n_block_min_max(self, seqlen_info, m_block: Int32, split_idx: Int32 = 0, num_splits: Int32 = 1):
        lo, hi, _ = self.split_range(seqlen_info, m_block)
        return lo, hi


class _SchedulerArgsSplit:
    """Stands in for ``TileSchedulerArguments`` in FA4's SM90 module while ``__call__`` is traced (host side):
    ``num_splits`` (FA4 passes 1, its fourth positional argument) and ``is_split_kv=True``. Calls from other
    threads pass through unchanged. Composes with the base class's proxy (whatever the module holds when it is
    installed is called through)."""

    def __init__(self, num_splits: int):
        self._real = _fa4_fwd_sm90.TileSchedulerArguments
        self._num_splits = num_splits
        self._thread = threading.get_ident()
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if threading.get_ident() == self._thread:
            args = list(args)
            if len(args) > 3:
                args[3] = self._num_splits
            else:
                kwargs["num_splits"] = self._num_splits
            kwargs["is_split_kv"] = True
            self.calls += 1
        return self._real(*args, **kwargs)


_SPLIT_PATCH_LOCK = threading.Lock()


class SplitKVMixin:
    """Split-KV for a FlashAttentionForwardSm90Mixed-family kernel (module docstring). Constructor keyword:
    ``num_splits`` (>= 2, compile-time). Runtime: ``aux_data = AuxData([num_causal_q, o_partial, lse_partial])``
    with ``o_partial`` ``[num_splits, total_q, num_heads, head_dim_v]`` fp32 and ``lse_partial``
    ``[num_splits, num_heads, total_q]`` fp32.

    Raises:
        ValueError: ``num_splits`` below 2 (one split is the plain kernel).
    """

    #: kernel.py's switch of the recompute's fresh tile values: off here (with it the cluster launch's key-block
    #: loops grew and it spilled more; docs/tuning.md 2.36)
    _NR_FRESH_TILE_VALUES = False

    def __init__(self, *args, num_splits: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        if num_splits < 2:
            raise ValueError(f"num_splits must be >= 2 for the split-KV kernel, got {num_splits}")
        self.num_splits = num_splits
        self._split_block_info = None

    @contextlib.contextmanager
    def trace_patches(self):
        """The base class's trace patches plus the split axis of FA4's tile scheduler (:class:`_SchedulerArgsSplit`).

        Raises RuntimeError if FA4's ``__call__`` did not build its scheduler arguments exactly once."""
        with super().trace_patches(), _SPLIT_PATCH_LOCK:
            saved = _fa4_fwd_sm90.TileSchedulerArguments
            proxy = _SchedulerArgsSplit(self.num_splits)
            _fa4_fwd_sm90.TileSchedulerArguments = proxy
            try:
                yield
            finally:
                _fa4_fwd_sm90.TileSchedulerArguments = saved
        if proxy.calls != 1:
            raise RuntimeError(f"expected FA4 to build its tile scheduler arguments once, saw {proxy.calls}")

    def _mixed_block_info(self, block_info) -> SplitBlockInfo:
        if isinstance(block_info, SplitBlockInfo):  # already ours (the wide kernel's mma converts it first)
            return block_info
        mixed = super()._mixed_block_info(block_info)
        return SplitBlockInfo(**{f.name: getattr(mixed, f.name) for f in fields(MixedBlockInfo)},
                              split_count=self.num_splits)

    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx, softmax_scale_log2, softmax_scale,
            block_info, *rest, **kwargs):
        # The epilogue needs the split's range (an empty split writes O = 0, LSE = -inf): the block info of
        # this trace, kept for it.
        self._split_block_info = self._mixed_block_info(block_info)
        return super().mma(tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink,
                           pipeline_k, pipeline_v, pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx,
                           softmax_scale_log2, softmax_scale, self._split_block_info, *rest, **kwargs)

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
        """This split's normalised fp32 output and LSE into the workspace (FA4's epilogue signature; ``mO``,
        ``mLSE``, ``sO`` unused): ``o_partial[split, offset_q + token, q_head, col]`` per accumulator element,
        ``lse_partial[split, q_head, offset_q + token]`` from the threads holding column 0 of their rows. An
        empty split writes zeros and -inf. With ``nan_safe_v``, the NaN-safe fix-up runs first (this split's
        masked blocks); with ``nan_safe_v_method="recompute"`` the test and recompute run after an empty split's
        fill (this split's key range and LSE)."""
        if const_expr(self.nan_safe_v):
            self._nonfinite_fixup(acc_O, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        mO_part, mLSE_part = self._aux_tensors[1], self._aux_tensors[2]
        split = cute.arch.block_idx()[1]
        _, _, empty = self._split_block_info.split_range(seqlen, m_block)
        qpk = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO = layout_utils.reshape_acc_to_mn(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        acc_mn = layout_utils.reshape_acc_to_mn(acc_O)
        if empty:
            acc_mn.fill(0.0)
        if const_expr(self.nan_recompute):  # after an empty split's fill: its discarded block is not tested
            self._nonfinite_recompute(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row = m_block * self.tile_m + tOcO[r, 0][0]
            token = row // qpk
            if token < seqlen.seqlen_q:
                q_row = seqlen.offset_q + token
                q_head = head_idx * qpk + row % qpk
                o_row = mO_part[split, q_row, q_head, None]  # this row's head_dim_v values
                for c in cutlass.range_constexpr(cute.size(tOcO, mode=[1])):
                    if const_expr(self.check_hdim_v_oob):  # the padded columns past head_dim_v are not the row's
                        if tOcO[r, c][1] < self._head_dims[1]:
                            o_row[tOcO[r, c][1]] = acc_mn[r, c]
                    else:
                        o_row[tOcO[r, c][1]] = acc_mn[r, c]
                if tOcO[0, 0][1] == 0:  # one thread per row (the one holding column 0) writes its LSE
                    mLSE_part[split, q_head, q_row] = -Float32.inf if empty else lse[r]


class FlashAttentionForwardSm90MixedSplit(SplitKVMixin, FlashAttentionForwardSm90Mixed):
    """:class:`~blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed` with split-KV
    (:class:`SplitKVMixin`)."""


class FlashAttentionForwardSm90WideVSplit(SplitKVMixin, FlashAttentionForwardSm90WideV):
    """:class:`~blockdiff.attention.cute.kernel_wide.FlashAttentionForwardSm90WideV` with split-KV
    (:class:`SplitKVMixin`)."""

    def _regs_one_box(self):
        # the page-box producer's split range arithmetic spills at 40 registers (compile_check.py)
        return (224, 56) if self.kv_box_rows is not None else super()._regs_one_box()
