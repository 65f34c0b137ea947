"""CuTe DSL "roles" kernel of the ``"cute"`` backend for value head dims in (256, 512] (Gemma 4's global layers).

Imported only by :mod:`blockdiff.attention.cute.interface` (lazily: it needs flash-attn-4 and nvidia-cutlass-dsl),
and only when a call's config resolves to it (``CuteConfig.wide_design="roles"``, or the default ``"auto"`` at
head dim 512 with the automatic tiles and pages its tiles load by TMA boxes:
:func:`blockdiff.attention.cute.config.auto_wide_design`; otherwise ``"split_v"`` runs
:mod:`blockdiff.attention.cute.kernel_wide`). Design (c1) of docs/tuning.md 2.1: the division of labour of the
triton backend's Gluon roles kernel (docs/tuning.md 1.7) and of FlashAttention-4 on Blackwell (a softmax
warpgroup feeding MMA warpgroups through shared memory), on FA4's SM90 forward kernel body (flash-attn-4
4.0.0b36: pipelines, shared memory, warp specialisation, tile scheduler, epilogue) and the split-value kernel's
pieces (P slots, factor slots, tiled MMAs, NaN-safe V clean-up).

Why the softmax warpgroup is also the producer
----------------------------------------------
With the CuTe DSL 4.8.1, a separate producer warpgroup beside three compute warpgroups did not compile: at 512
threads (128 registers each at launch) ptxas refused the P V multiply with an m64n256 fp32 accumulator
("Insufficient registers (128) ... target of 154", NVIDIA/cutlass#2904), and at 768 threads four m64n128 quarters
needed 90 against 80 (why is not established; the compile records are in docs/tuning.md 2.8). So a P V warpgroup owning half of the 64 x 512
output is built in a CTA of 384 threads (168 registers), i.e. three warpgroups, and FA4's body gives
warpgroup 0 to its producer. Here warpgroup 0 is the softmax warpgroup and issues the loads of Q and K itself
(one warp of it), and the first P V warpgroup issues the loads of V: each buffer is refilled by the role that
frees it, right when it frees it (K as soon as S's wgmma retires, the triton roles kernel's early refill at
whole-block granularity; V as soon as both P V warpgroups released it).

The division of labour
----------------------
One 64-row query tile (PackGQA: 64 packed rows), three warpgroups, 384 threads:

* warpgroup 0 (**SM**, FA4's producer slot, :meth:`FlashAttentionForwardSm90Roles.load`): per key block, S = Q K^T
  for all 64 x ``tile_n`` scores (both operands in shared memory), then (warp 0) the TMA load of the K block
  ``num_stages`` blocks ahead into the stage S just freed, then the per-row mask and the online softmax (row max
  and sum stay in its registers); P (bf16/fp16) goes to one of two shared-memory slots with each row's rescale
  factor; after the last block 1 / rowsum and the LSE go through two more factor slots. Warp 0 also loads Q
  (TMA; PackGQA tiles whose rows do not hold whole token groups load Q by cp.async over the warpgroup). SM never
  touches V or O, so it runs ahead of the P V warpgroups by up to two blocks (the two P slots): the QK^T and
  softmax of block j + 1 overlap the P V of block j;
* consumer warpgroups 0 and 1 (**PV0**, **PV1**, :meth:`FlashAttentionForwardSm90Roles.mma`): per key block,
  wait for P's slot, rescale their half of O by the factors beside P, and run ``O[:, half] += P V[:, half]``
  with P and V from shared memory (SS wgmma, m64 x dv/2 x tile_n); after the last block the final 1 / rowsum and
  the LSE, then FA4's epilogue (O through Q's shared memory, TMA store by warp 4, PV0's first). Warp 0 of PV0
  (CTA warp 4) issues the V loads: ``num_stages`` blocks at the tile's start, then each block's
  ``num_stages``-ahead block once both warpgroups released the stage.

Loads: contiguous K / V by TMA (FA4's atoms), paged K / V by our page boxes (any page size
:func:`~blockdiff.attention.cute.config.page_box_tma_ok` accepts, V rows past the last key zeroed before the
stage is handed over: :meth:`~blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed._acquire_load_v`).
FA4's cp.async paged path is not built for this kernel (the interface refuses those page sizes). Masks, windows,
causal rows and block ranges are :class:`~blockdiff.attention.cute.kernel.MixedBlockInfo` /
:class:`~blockdiff.attention.cute.kernel.MixedAttentionMask`, called in the split-value kernel's order (the tile's
last block first, then FA4's right-masked / interior / left-masked loops, all in descending key order).

Pipelines and hand-offs
-----------------------
FA4's kernel body creates the Q / K / V pipelines with one producer arrival (plus the TMA bytes) and the 8 warps of
the two consumer warpgroups as consumers (one arrival per warp on a stage's empty barrier). Only SM reads K: it
releases each K stage twice (its 4 warps x 2 = 8 arrivals) when S's wgmma retires, then acquires it for the next
load. PV0 and PV1 each release a V stage once after their P V retires (FA4's count). Q: SM waits for it; the P V
warpgroups release it once per tile after their epilogue (after waiting for its load, so never early).

P hand-off (CTA named barriers, ids 7-11 as the split-value kernel): SM writes P and the factors into slot
``i % 2``, fences for the async proxy (wgmma reads P) and arrives on ``P_FULL[slot]`` (128 arrive + 256 sync =
384); PV0 and PV1 wait there and, after their P V retires, arrive on ``P_EMPTY[slot]``, on which SM waits before
reusing the slot (from the third block on; the P V warpgroups skip arrivals SM would never consume, so every
barrier generation completes). ``FINAL`` carries 1 / rowsum and the LSE after SM's last QK^T, so the P V
warpgroups write O into Q's shared memory only after SM stopped reading Q. A thread's two accumulator rows are
the same rows in every m64 wgmma fragment (S, either half of O), so thread t of a P V warpgroup reads exactly the
factors thread t of SM wrote.

V refill by halves (``v_refill="halves"``; docs/tuning.md 2.12 remedy 2, 2.15, 2.20)
------------------------------------------------------------------------------------
The config's ``"auto"`` picks it at value head dims divisible by 128 (with S issued ahead, below). With
``"one_warp"`` the V stage is one pipeline stage of FA4's V pipeline: V(i + num_stages) is requested
only after P V(i) retired in *both* P V warpgroups, and PV0's warp 0 then issues all the stage's TMA boxes (eight
64-column boxes per page box at dv 512, each behind its own ``elect.sync``, after the page-table load), while the 8
P V warps wait for it at the next ``P_FULL``. But PV0 reads only ``V[:, :dv/2]`` and PV1 only ``V[:, dv/2:]``. With
``"halves"`` each P V warpgroup has its own V pipeline over the same stages' half of the columns
(:class:`_HalfVPipeline`: ``full`` / ``empty`` mbarriers per stage and its own tail barrier, after FA4's V barriers
in the barrier kilobyte, so the shared memory is unchanged; ``empty`` counts the warpgroup's 4 warps), and each
warpgroup's warp 0 (CTA warps 4 and 8) refills its half as soon as its *own* warpgroup released it: the two loaders
run in parallel, each issues half the boxes (the same V TMA atom, partitioned into ``tile_n x dv/2`` tiles), and no
P V warpgroup waits on the other's release. When one page box covers a key block (page size >= ``tile_n``, e.g. 64),
the refill's page index is read before the block's ``P_FULL`` wait (held in one register across the P V), off the
refill's dependent chain; smaller pages, PackGQA tiles without TMA for Q / O and the split-KV subclass (where that
register spilled), read theirs at the load, as the default does. A stage holding rows past the sequence's last key is loaded on the half's tail barrier
and each loader zeroes its own half of those rows before handing the half over (the contract of
:meth:`~blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed._acquire_load_v`, per half). Contiguous K / V
take the same split (two tile copies of half the columns; rows past the end are the next sequence's, as by default).
The loaders initialise their barriers after the kernel body's pipeline set-up, so both P V warpgroups meet once at
named barrier 15 (``V_HALVES_INIT_BARRIER``) before any wait on them. The P hand-off, the MMAs and their order are
unchanged, so the outputs equal the default's. Not done here (2.12's remedy 2 lists them): one ``elect.sync`` around
a half's boxes (the DSL's TMA copy emits its own per box; a single elect needs the raw ``cp.async.bulk.tensor``),
the same split for K (SM alone reads K: ``k_refill``, below), a page index fetched a whole block ahead.

K refill by halves (``k_refill="halves"``; the config's ``"auto"`` at head dims divisible by 128)
--------------------------------------------------------------------------------------------------
With ``"whole"`` the K stage is one stage of FA4's K pipeline: K(i + num_stages) is requested only once S(i) = Q K^T
retired over all ``d`` columns, and at one 64-key stage of 64 KB that load sits on SM's chain (the ncu profile of
the default kernel on ``canvas_bs1_ctx32k_global``: docs/tuning.md 2.21). With ``"halves"`` SM's K stages
get two barrier pairs each, one per half of the head dim (:class:`_KHalvesPipeline`, after V's barriers in the
barrier kilobyte: the shared memory is unchanged; SM's warp 0 initialises them and SM meets at named barrier 14,
``K_HALVES_INIT_BARRIER``). S is issued as two wgmma groups over the contraction dimension (:meth:`_qk_half`):
the k-steps of dims ``[0, d/2)`` once K's half 0 landed, then those of ``[d/2, d)`` once half 1 landed, the same
k-steps in the same order into the same accumulator, so S is bit-identical to ``"whole"``'s. Retiring S
(:meth:`_sm_retire_qk_halves`): ``wait_group(1)`` (the first group), half 0 released (one arrival per SM warp) and
at once refilled by warp 0 with block ``n - num_stages`` (its column boxes: one tile copy of ``tile_n x d/2``
contiguous, or the page boxes of that half, as ``v_refill``'s halves) while the second group still runs; then
``wait_group(0)``, half 1 released and refilled. So K(i + 1)'s first half is requested about half an S earlier,
and S(i + 1) starts on it before the second half lands. Both S orders take it (``"serial"``:
:meth:`_sm_qk_halves`; ``"ahead"``: :meth:`_sm_issue_qk_halves` issues both groups, the retire above at the next
iteration's top), with either V refill and in the split-KV subclass; no wgmma issue sits in a branch (every
path has the same groups in flight; no C7518, 2.19). Needs head dims divisible by 128 (a half is whole 64-column
swizzle atoms). The all-warps K refill experiment (``_K_REFILL_ALL_WARPS``) does not combine with it.

S issued one block ahead (``qk_issue="ahead"``; docs/tuning.md 2.19, 2.20)
-------------------------------------------------------------------------
With ``"serial"`` SM's iteration for key block i is: S(i), then mask, softmax, P's conversion and P's hand-off, and
S(i + 1)'s wgmma starts only after all of it. With ``"ahead"`` SM retires S(i) (issued one iteration earlier),
releases and refills its K stage, masks, runs the softmax and converts P, then waits for K(i + 1) and issues
S(i + 1) into the same accumulator without waiting for it, and only then hands P over (``P_EMPTY`` wait, store,
fence, ``P_FULL``): S's wgmma overlaps the hand-off and the loop's control. The tile's last key block is issued
before the loops; the tile's first key block gets an iteration of its own that issues nothing (masked whatever its
kind: the mask is exact per key), and a one-block tile takes a branch without a second issue. No wgmma issue sits in
a branch that another path skips: ptxas serialises every wgmma of the kernel otherwise (C7518, 2.19). The same
wgmma run on the same operands in the same softmax order, so the outputs equal ``"serial"``'s bit for bit. The
config's ``"auto"`` picks it where the V refill resolves to halves and pages hold at least ``QK_AHEAD_MIN_PAGE``
tokens (the measured reasons: docs/tuning.md 2.20, 2.21).

NaN-safe V (``nan_safe_v``): each P V warpgroup cleans its own half of a masked block's V stage before its P V
(named barriers 12 and 13) in SM's hand-off order, and the epilogue's fix-up adds the non-finite V entries of the
rows that allow them, exactly as the split-value kernel's WG1.

Registers
---------
384 threads launch with 168 registers each. ``setmaxnreg`` (FA4's body): SM (producer slot) decreases to 152, the
P V warpgroups increase to 176, 152 + 2 x 176 = 504 <=
3 x 168 (a larger sum would make an increase wait forever). A P V thread holds 128
accumulator registers (64 x 256 fp32 over 128 threads); SM holds S (``tile_n / 2``) and P (``tile_n / 4``).

Shared memory
-------------
Bytes, 2-byte elements (:func:`blockdiff.attention.cute.config.config_smem_bytes` with ``wide_design="roles"``;
limit 232,448): Q ``64 x d`` (the output tile reuses it), ``num_stages`` x (K + V) ``tile_n x d``, two P slots
``64 x tile_n``, four fp32 factor slots (two per block, 1 / rowsum, LSE; 2 rows x 128 threads each: 4 KB), 1 KB of
barriers and alignment. At d = 512:

==================  =======  =======  =======  ========  =======  =========
tile_n x stages     Q        K + V    P        factors   barr.    total
==================  =======  =======  =======  ========  =======  =========
64 x 1 (default)    65,536   131,072  16,384   4,096     1,024    218,112
32 x 2              65,536   131,072  8,192    4,096     1,024    209,920
64 x 2, 48 x 2      -        -        -        -         -        do not fit
==================  =======  =======  =======  ========  =======  =========

Errors: the constructor raises ValueError for tiles / head dims outside the split-value kernel's and for FA4's
cp.async paged path (``paged_kv_non_tma``).
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from quack import copy_utils, layout_utils
from quack import sm90_utils

from flash_attn.cute import utils as fa_utils
from flash_attn.cute.pack_gqa import PackGQA
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.utils import AuxData

from .kernel_split import SplitKVMixin
from .kernel_wide import FlashAttentionForwardSm90WideV, NamedBarrierWideV

#: Threads per warpgroup; P slots; factor slots: two per-block slots, the final 1 / rowsum, the LSE.
_WG = 128
_P_SLOTS = 2
_SCALE_SLOTS = 4
_FINAL_SLOT, _LSE_SLOT = 2, 3
#: Threads of every hand-off barrier: SM (arrives or waits) and the two P V warpgroups.
_BAR_THREADS = 3 * _WG
#: setmaxnreg (module docstring, "Registers"): SM (FA4's producer slot), P V warpgroups.
ROLES_REGS = (152, 176)
#: ``v_refill="halves"``: the CTA named barrier after which both P V warpgroups use their per-half V pipelines
#: (their loaders initialised them). FA4's ``NamedBarrierFwd`` uses 1-6, the P hand-off 7-11, the NaN-safe V
#: clean-up 12-14 (12-13 here); 15 is also FA4's consumer's split clean-up barrier (kernel.py
#: ``NAN_CLEAN_BARRIER_ALL``, another kernel: this one never takes that path). Every id 0-15 is now taken.
V_HALVES_INIT_BARRIER = 15
#: ``k_refill="halves"``: the named barrier after which SM's 4 warps use the per-half K barriers (SM's warp 0
#: initialised them; 128 threads). 14 is the NaN-safe clean-up's third id, which only FA4's three-warpgroup kernel
#: uses (this kernel's P V warpgroups use 12 and 13).
K_HALVES_INIT_BARRIER = 14


class _HalfVPipeline:
    """One P V warpgroup's V pipeline (``v_refill="halves"``): the ``num_stages`` V stages' columns that
    warpgroup reads, with its own mbarriers in shared memory (trace-time object; no state of its own).

    Barriers from ``base`` (``_get_shared_storage_cls``): ``full[s]`` (``base + s``, arrival count 1: the
    loader's ``arrive.expect_tx`` of the half's bytes, or its plain arrive after a tail stage's clean-up),
    ``empty[s]`` (``base + num_stages + s``, arrival count 4: one per warp of the warpgroup, as FA4's
    PipelineTmaAsync counts a consumer warp), ``tail`` (``base + 2 num_stages``: the loader's own barrier for a
    sequence's last block, as ``_acquire_load_v``). The same protocol and phases as FA4's PipelineTmaAsync with
    a producer of one warp and a consumer of 4 warps, so :func:`cutlass.pipeline.make_pipeline_state` states
    drive it. A DSL value (its base pointer) where control flow carries it."""

    def __init__(self, base, num_stages: int, tx_bytes: int):
        self.base, self.num_stages, self.tx_bytes = base, num_stages, tx_bytes
        self.tail = base + 2 * num_stages

    def __extract_mlir_values__(self):
        return [self.base]

    def __new_from_mlir_values__(self, values):
        return _HalfVPipeline(values[0], self.num_stages, self.tx_bytes)

    @staticmethod
    def slots(num_stages: int) -> int:
        """mbarriers of one half: full and empty per stage, the tail barrier."""
        return 2 * num_stages + 1

    def full(self, index):
        return self.base + index

    def empty(self, index):
        return self.base + self.num_stages + index

    def init(self):
        """By the loader warp (one elected thread), then fenced for the async proxy; the consumers may use the
        barriers after a CTA barrier that follows this (``V_HALVES_INIT_BARRIER``)."""
        with cute.arch.elect_one():
            for s in range(self.num_stages):
                cute.arch.mbarrier_init(self.full(s), 1)
                cute.arch.mbarrier_init(self.empty(s), _WG // cute.arch.WARP_SIZE)
            cute.arch.mbarrier_init(self.tail, 1)
        cute.arch.mbarrier_init_fence()

    def producer_wait_empty(self, state):
        cute.arch.mbarrier_wait(self.empty(state.index), state.phase)

    def producer_acquire(self, state):
        """Wait until the warpgroup released the stage's half, then expect its bytes on ``full``."""
        self.producer_wait_empty(state)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self.full(state.index), self.tx_bytes)

    def consumer_wait(self, state):
        cute.arch.mbarrier_wait(self.full(state.index), state.phase)

    def consumer_release(self, state):
        """One arrival per warp (every warp of the warpgroup calls this after its P V retired)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(self.empty(state.index))


class _KHalvesPipeline:
    """SM's K stages by head-dim halves (``k_refill="halves"``): per stage and half ``h`` (0: dims ``[0, d/2)``,
    1: ``[d/2, d)``) a ``full`` and an ``empty`` mbarrier in shared memory (trace-time object; no state of its own).

    Barriers from ``base`` (after V's, ``_extra_v_barriers``): half ``h``'s ``full[s]`` at ``base + 2 h num_stages
    + s`` (arrival count 1: SM warp 0's ``arrive.expect_tx`` of the half's bytes), ``empty[s]`` at ``base + 2 h
    num_stages + num_stages + s`` (arrival count 4: one per SM warp once S's wgmma group over that half retired).
    The protocol and phases of FA4's PipelineTmaAsync with a producer of one warp and a consumer of 4 warps, so
    :func:`cutlass.pipeline.make_pipeline_state` states drive both halves (the half is a Python int at every
    call: immediate barrier offsets). A DSL value (its base pointer) where control flow carries it."""

    def __init__(self, base, num_stages: int, tx_bytes: int):
        self.base, self.num_stages, self.tx_bytes = base, num_stages, tx_bytes

    def __extract_mlir_values__(self):
        return [self.base]

    def __new_from_mlir_values__(self, values):
        return _KHalvesPipeline(values[0], self.num_stages, self.tx_bytes)

    @staticmethod
    def slots(num_stages: int) -> int:
        """mbarriers of both halves: full and empty per stage and half."""
        return 4 * num_stages

    def full(self, h: int, index):
        return self.base + 2 * h * self.num_stages + index

    def empty(self, h: int, index):
        return self.base + (2 * h + 1) * self.num_stages + index

    def init(self):
        """By SM's warp 0 (one elected thread), then fenced for the async proxy; SM's warps may use the barriers
        after a barrier of the warpgroup that follows this (``K_HALVES_INIT_BARRIER``)."""
        with cute.arch.elect_one():
            for h in range(2):
                for s in range(self.num_stages):
                    cute.arch.mbarrier_init(self.full(h, s), 1)
                    cute.arch.mbarrier_init(self.empty(h, s), _WG // cute.arch.WARP_SIZE)
        cute.arch.mbarrier_init_fence()

    def producer_acquire(self, h: int, state):
        """Wait until SM's 4 warps released half ``h`` of the stage, then expect its bytes on its ``full``."""
        cute.arch.mbarrier_wait(self.empty(h, state.index), state.phase)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self.full(h, state.index), self.tx_bytes)

    def consumer_wait(self, h: int, state):
        cute.arch.mbarrier_wait(self.full(h, state.index), state.phase)

    def consumer_release(self, h: int, state):
        """One arrival per warp (every SM warp calls this after its wgmma group over half ``h`` retired)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(self.empty(h, state.index))


class FlashAttentionForwardSm90Roles(FlashAttentionForwardSm90WideV):
    """FA4 SM90 forward with a softmax warpgroup (also loading Q and K) feeding two P V warpgroups through shared
    memory (module docstring).

    Constructor arguments are :class:`~blockdiff.attention.cute.kernel_wide.FlashAttentionForwardSm90WideV`'s
    (``tile_m`` 64, equal head dims in (256, 512], multiples of 32; ``tile_n`` a multiple of 16);
    ``mma_pv_is_rs`` / ``intra_wg_overlap`` are fixed (P from shared memory) and ignored; ``v_refill``
    ``"one_warp"`` (default) or ``"halves"`` (module docstring, "V refill by halves"); ``qk_issue`` ``"serial"``
    (default) or ``"ahead"`` (module docstring, "S issued one block ahead"); ``k_refill`` ``"whole"`` (default) or
    ``"halves"`` (module docstring, "K refill by halves"). The config's ``"auto"`` resolves them
    (:func:`blockdiff.attention.cute.config.resolve_config`); the class defaults are the plain orders.

    Raises:
        ValueError: a tile shape or head dim outside the above, ``v_refill`` / ``k_refill`` ``"halves"`` at a head dim
            not divisible by 128, or ``paged_kv_non_tma=True`` (FA4's cp.async paged loads are not built for this
            kernel).
    """

    V_REFILLS = ("one_warp", "halves")
    #: ``qk_issue="ahead"`` (module docstring, "S issued one block ahead"): SM issues S(i + 1) before P(i)'s
    #: hand-off instead of after it.
    QK_ISSUES = ("serial", "ahead")
    #: ``k_refill="halves"`` (module docstring, "K refill by halves"): SM's K stage by head-dim halves, each
    #: released and refilled as soon as S's wgmma group over it retired.
    K_REFILLS = ("whole", "halves")
    #: ``v_refill="halves"``: read a refill's page index before the block's ``P_FULL`` wait (one register held
    #: across the P V; module docstring), when O is stored by TMA. The split-KV subclass reads it at the load.
    _V_PAGE_AHEAD = True
    #: ``v_refill="halves"``: issue a half's TMA copies in a compile-time branch per half (immediate coordinates
    #: and shared-memory offsets, twice the loop's TMA code) instead of with the half index in a register. Chosen
    #: per kernel by the sm_90a compile (docs/tuning.md 2.15): off here (no spills either way at page 64; on, the
    #: page-16 kernel spilled 4 B more than the default's), on in the split-KV subclass (off, it spilled 4 B).
    _V_HALF_BRANCH = False
    #: Experiment (docs/tuning.md 2.17; off: no gain measured, 2.18): SM's 4 warps share the K refill, each issuing
    #: a quarter of the column boxes as soon as the stage is empty (warp 0 also arrives with the whole stage's
    #: bytes), instead of warp 0 issuing all 8 while warps 1-3 wait for it at the hand-off. Needs head dims
    #: divisible by 256 (a quarter is whole 64-column swizzle atoms); other head dims keep warp 0's refill.
    #: ``bench/experiments/ab_roles_switch.py`` switches it on; with it off the kernel is unchanged.
    _K_REFILL_ALL_WARPS = False
    #: Experiment (docs/tuning.md 2.25; off until an A/B on the GPU): FA4's epilogue picks the warp that stores O by
    #: TMA with ``cute.arch.warp_idx() == 4``, which the compile merges with the kernel entry's warp index (the same
    #: ``tid.x >> 5``), so that one register lives from the entry through every key-block loop of the P V
    #: warpgroups to the epilogue; the sm_90a compile spills it (a store at the entry, one in P V warpgroup 1's
    #: NaN-safe clean-up of each masked block, a load per tile). On, the roles kernel's epilogue (O by TMA only)
    #: computes that warp index from the consumer's ``tidx`` where it is used (:meth:`_epilogue`). Same warp,
    #: same stores: outputs bit-identical by construction. ``bench/experiments/ab_roles_switch.py`` switches it on.
    _EPILOGUE_LOCAL_WARP = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.use_tma_KV:
            raise ValueError("the roles kernel loads K / V by TMA (contiguous or page boxes), not by cp.async")
        if self.v_refill == "halves" and self.tile_hdimv % 128:  # config.resolve_config refuses it first
            raise ValueError(f"v_refill 'halves' needs a value head dim divisible by 128, got {self.tile_hdimv}")
        if self.k_refill == "halves" and self.tile_hdim % 128:  # likewise
            raise ValueError(f"k_refill 'halves' needs a head dim divisible by 128, got {self.tile_hdim}")

    def _setup_attributes(self):
        super()._setup_attributes()  # the split-value kernel's thread counts: 2 consumer warpgroups, 384 threads
        self.num_producer_regs, self.num_mma_regs = ROLES_REGS
        launch_regs = 65536 // self.num_threads // 8 * 8
        assert self.num_producer_regs + 2 * self.num_mma_regs <= 3 * launch_regs, "setmaxnreg over the CTA pool"

    def _scale_elems(self) -> int:
        return self._rows_per_thread() * _WG * _SCALE_SLOTS

    def _extra_v_barriers(self) -> int:
        """After the V pipeline's barriers: :meth:`_v_extra_barriers`, then ``k_refill="halves"``' per-half K
        barriers (:class:`_KHalvesPipeline`)."""
        k_halves = _KHalvesPipeline.slots(self.num_stages) if self.k_refill == "halves" else 0
        return self._v_extra_barriers() + k_halves

    def _v_extra_barriers(self) -> int:
        """V's own barriers after its pipeline's: the page-box tail barrier slot (kept unused by ``"halves"`` on a
        contiguous cache, so the halves' offset is the same), then ``"halves"``' two per-half pipelines."""
        if self.v_refill != "halves":
            return super()._extra_v_barriers()
        return 1 + 2 * _HalfVPipeline.slots(self.num_stages)

    def _k_halves_pipeline(self, pipeline_v) -> _KHalvesPipeline:
        """SM's per-half K barriers (``k_refill="halves"``), after FA4's V barriers and V's own
        (:meth:`_v_extra_barriers`); each half expects half of a K stage's bytes."""
        first = pipeline_v.sync_object_full.get_barrier(0) + 2 * self.num_stages + self._v_extra_barriers()
        return _KHalvesPipeline(first, self.num_stages, self.tma_copy_bytes["K"] // 2)

    def _half_v_pipeline(self, pipeline_v, pv: Int32) -> _HalfVPipeline:
        """P V warpgroup ``pv``'s half-V pipeline (``v_refill="halves"``): its barriers follow FA4's V barriers
        and the tail barrier slot (``_extra_v_barriers``)."""
        first = pipeline_v.sync_object_full.get_barrier(0) + 2 * self.num_stages + 1
        return _HalfVPipeline(first + pv * _HalfVPipeline.slots(self.num_stages), self.num_stages,
                              self.tma_copy_bytes["V"] // 2)

    def _get_shared_storage_cls(self):
        """The split-value kernel's struct (Q, K, V, two P slots, then the factor slots); K's size in bytes is
        kept for :meth:`_sP_from_sK` (a Python int for the kernel trace)."""
        self._sK_bytes = int(cute.cosize(self.sK_layout)) * self.dtype.width // 8
        storage_cls = super()._get_shared_storage_cls()
        offsets = storage_cls._offsets  # the struct's static byte offsets (cute.struct); _sP_from_sK relies on them
        assert offsets["sP"] - offsets["sK"] == (self._sK_bytes + 1023) // 1024 * 1024, (
            "_sP_from_sK: P no longer follows K in the shared-storage struct", offsets)
        return storage_cls

    def _sP_from_sK(self, sK: cute.Tensor) -> cute.Tensor:
        """The P slots in shared memory, found from K's buffer: the shared-storage struct places them right after
        it, 1024-byte aligned (``_get_shared_storage_cls``; FA4's body hands the producer no P tensor)."""
        base = (sK.iterator.toint() + (self._sK_bytes + 1023) // 1024 * 1024)
        ptr = cute.make_ptr(self.dtype, base, cute.AddressSpace.smem, assumed_align=1024)
        layout = self._sP_layout_arg  # the kernel's argument (FA4 passes layouts to the kernel)
        return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=self.dtype), layout.outer)

    # --- warpgroup 0: SM, and the loads of Q and K ---------------------------------------------------------
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k, pipeline_v, pipeline_q,
             gmem_tiled_copy_Q, mPageTable, blocksparse_tensors, block_info, SeqlenInfoCls, TileSchedulerCls):
        """FA4's producer slot (warpgroup 0, signature of FA4's ``load``): runs SM (:meth:`_softmax_and_load_qk`).
        Also hands V's global tensor, shared buffer, TMA atom and the page table to the consumers' V loads (trace
        time: FA4's body passes them to its producer only; this branch is traced first)."""
        self._mV_load, self._sV_load, self._tma_atom_V, self._mPageTable_load = mV, sV, tma_atom_V, mPageTable
        # k_refill="halves": SM's per-half K barriers follow V's (the one pipeline SM does not otherwise use)
        self._k_halves_load = self._k_halves_pipeline(pipeline_v) if self.k_refill == "halves" else None
        return self._softmax_and_load_qk(
            mQ, mK, sQ, sK, tma_atom_Q, tma_atom_K, pipeline_k, pipeline_q, gmem_tiled_copy_Q, mPageTable,
            self._mixed_block_info(block_info), self._mixed_seqlen_cls(SeqlenInfoCls), TileSchedulerCls,
            self._mixed_mask_cls(block_info))

    @cute.jit
    def _softmax_and_load_qk(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        tma_atom_Q: Optional[cute.CopyAtom],
        tma_atom_K: cute.CopyAtom,
        pipeline_k,
        pipeline_q,
        gmem_tiled_copy_Q: cute.TiledCopy,
        mPageTable: Optional[cute.Tensor],
        block_info,
        SeqlenInfoCls: Callable,
        TileSchedulerCls: Callable,
        AttentionMaskCls: Callable,
    ):
        """SM: per key block S = Q K^T, the K stage released and refilled (warp 0) as soon as S retires (with
        ``k_refill="halves"`` each half of it as soon as S's group over it retires), mask, online softmax, P and the
        row factors into a slot; after the tile's last block 1 / rowsum and the LSE."""
        t_sm, _, _ = cute.arch.thread_idx()
        warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        softmax_scale_log2, softmax_scale = self._softmax_scales
        sP = self._sP_from_sK(sK)
        sScale = self._scale_tensor(sP)
        tiled_mma_qk, _ = self._get_tiled_mma()
        thr_mma_qk = tiled_mma_qk.get_slice(t_sm)
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
            tiled_mma_qk.get_slice(0), (self.tile_m, self.tile_n, self.tile_hdim), sQ, sK)
        mma_qk_fn = partial(sm90_utils.gemm_zero_init, tiled_mma_qk, (self.tile_m, self.tile_n), tSrQ, tSrK)
        smem_copy_atom_P = fa_utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr_copy_P = cute.make_tiled_copy_C(smem_copy_atom_P, tiled_mma_qk).get_slice(t_sm)
        tPsP = smem_thr_copy_P.partition_D(sP)
        softmax = self._make_softmax(softmax_scale_log2, self._rows_per_thread(), softmax_scale=softmax_scale)
        hand_off = partial(self._hand_off_p_smem, smem_thr_copy_P, tPsP, sScale, t_sm)
        acc_S_next = None
        if const_expr(self.qk_issue == "ahead"):  # S of the block in flight (issued one iteration ahead)
            acc_S_next = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        khalves = None
        if const_expr(self.k_refill == "halves"):  # warp 0 initialises the per-half K barriers, then SM meets
            khalves = self._k_halves_load
            if warp_idx_in_wg == 0:
                khalves.init()
            cute.arch.barrier(barrier_id=K_HALVES_INIT_BARRIER, number_of_threads=_WG)

        q_producer_phase = Int32(1)
        q_consumer_phase = Int32(0)
        k_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        kv_consumer_state = self._consumer_state()
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            mask = AttentionMaskCls(seqlen)
            mask_fn = partial(mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx, m_block=m_block,
                              thr_mma=thr_mma_qk, mask_causal=False, mask_local=True)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            head_idx_kv = head_idx // self.qhead_per_kvhead if const_expr(not self.pack_gqa) else head_idx
            load_K = self._block_loader(mK, sK, tma_atom_K, pipeline_k, mPageTable, seqlen, batch_idx, head_idx_kv,
                                        self.tile_hdim)
            load_K_half = None
            if const_expr(khalves is not None):
                load_K_half = self._k_part_loader(mK, sK, tma_atom_K, 2, lambda state, h: khalves.full(h, state.index),
                                                  mPageTable, seqlen, batch_idx, head_idx_kv)
            # The first num_stages K blocks (descending key order), then Q.
            if const_expr(khalves is not None):  # each block by halves (half 0 first: S starts on it)
                if warp_idx_in_wg == 0:
                    for i in cutlass.range(cutlass.min(self.num_stages, n_block_max - n_block_min), unroll=1):
                        for h in cutlass.range_constexpr(2):
                            khalves.producer_acquire(h, k_producer_state)
                            load_K_half(n_block_max - 1 - i, k_producer_state, h)
                        k_producer_state.advance()
            elif const_expr(not self._k_refill_all_warps()):
                if warp_idx_in_wg == 0:
                    for i in cutlass.range(cutlass.min(self.num_stages, n_block_max - n_block_min), unroll=1):
                        pipeline_k.producer_acquire(k_producer_state)
                        load_K(n_block_max - 1 - i, k_producer_state)
                        k_producer_state.advance()
            else:  # every SM warp acquires stages in the refill, so every warp's producer state counts these loads
                for i in cutlass.range(cutlass.min(self.num_stages, n_block_max - n_block_min), unroll=1):
                    if warp_idx_in_wg == 0:
                        pipeline_k.producer_acquire(k_producer_state)
                        load_K(n_block_max - 1 - i, k_producer_state)
                    k_producer_state.advance()
            self._load_q(mQ, sQ, tma_atom_Q, pipeline_q, gmem_tiled_copy_Q, seqlen, m_block, head_idx, batch_idx,
                         q_producer_phase, warp_idx_in_wg, t_sm)
            q_producer_phase ^= 1
            load_K_part = None
            if const_expr(self._k_refill_all_warps()):
                load_K_part = self._k_part_loader(mK, sK, tma_atom_K, 4,
                                                  lambda state, part: pipeline_k.producer_get_barrier(state),
                                                  mPageTable, seqlen, batch_idx, head_idx_kv)
            refill = partial(self._refill_k, pipeline_k=pipeline_k, load_K=load_K, n_block_min=n_block_min,
                             warp_idx_in_wg=warp_idx_in_wg, load_K_part=load_K_part)
            qk = partial(self._sm_qk, mma_qk_fn=mma_qk_fn, pipeline_k=pipeline_k)
            retire_halves = None  # k_refill="halves": retires S's two groups, releasing and refilling each half
            if const_expr(khalves is not None):
                retire_halves = partial(self._sm_retire_qk_halves, khalves=khalves, load_K_half=load_K_half,
                                        n_block_min=n_block_min, warp_idx_in_wg=warp_idx_in_wg)
            qk_halves = None
            if const_expr(khalves is not None and self.qk_issue != "ahead"):
                qk_halves = partial(self._sm_qk_halves, tiled_mma_qk=tiled_mma_qk, tSrQ=tSrQ, tSrK=tSrK,
                                    khalves=khalves, retire_halves=retire_halves)
            step = partial(self._sm_step, qk=qk, refill=refill, softmax=softmax, hand_off=hand_off,
                           qk_halves=qk_halves)
            pipeline_q.consumer_wait_w_index_phase(0, q_consumer_phase)
            q_consumer_phase ^= 1
            if const_expr(self.qk_issue != "ahead"):
                # First block (the tile's last key block): S, mask (sequence end included), softmax.
                if const_expr(qk_halves is None):
                    acc_S = qk(kv_consumer_state)
                    k_producer_state = refill(k_producer_state, n_block_max - 1)
                else:
                    acc_S, k_producer_state = qk_halves(kv_consumer_state, k_producer_state, n_block_max - 1)
                mask_fn(acc_S, n_block=n_block_max - 1, mask_seqlen=True)
                row_scale = softmax.online_softmax(acc_S, is_first=True)
                hand_off(acc_S, row_scale, Int32(0))
                kv_consumer_state.advance()
                block_i = Int32(1)  # blocks handed to the P V warpgroups so far
                kv_consumer_state, k_producer_state, block_i = self._sm_key_loops(
                    step, kv_consumer_state, k_producer_state, block_i, n_block_max - 1, n_block_min, n_block_min,
                    m_block, seqlen, block_info, mask_fn)
            else:
                kv_consumer_state, k_producer_state = self._sm_tile_overlap(
                    kv_consumer_state, k_producer_state, n_block_min, n_block_max, m_block, seqlen, block_info,
                    mask_fn, refill, softmax, acc_S_next, tiled_mma_qk, tSrQ, tSrK, pipeline_k,
                    partial(self._store_p_smem, smem_thr_copy_P, tPsP, sScale, t_sm), khalves=khalves,
                    retire_halves=retire_halves)
            # Every QK^T of the tile has retired: the P V warpgroups may write O into Q's buffer after FINAL.
            row_scale = softmax.finalize()
            self._store_scale(sScale, row_scale, t_sm, Int32(_FINAL_SLOT))
            self._store_scale(sScale, softmax.row_sum, t_sm, Int32(_LSE_SLOT))  # finalize left the LSE there
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.FINAL), number_of_threads=_BAR_THREADS)
            tile_scheduler.prefetch_next_work()
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()

    @cute.jit
    def _load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, tma_atom_Q: Optional[cute.CopyAtom], pipeline_q,
                gmem_tiled_copy_Q: cute.TiledCopy, seqlen, m_block: Int32, head_idx: Int32, batch_idx: Int32,
                q_producer_phase: Int32, warp_idx_in_wg: Int32, t_sm: Int32):
        """Q of the tile: TMA from warp 0, or (PackGQA rows without whole token groups) cp.async over SM's 128
        threads, as FA4's producer does."""
        mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
        if const_expr(self.use_tma_Q):
            if warp_idx_in_wg == 0:
                gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
                load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ,
                                                          single_stage=True)
                pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
                load_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))
        else:
            pack_gqa = PackGQA(self.tile_m, self.tile_hdim, self.check_hdim_oob, self.qhead_per_kvhead)
            pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
            pack_gqa.load_Q(mQ_cur, sQ, gmem_tiled_copy_Q, t_sm, m_block, seqlen.seqlen_q)
            cute.arch.cp_async_commit_group()
            pipeline_q.producer_commit_w_index(0)

    def _block_loader(self, mX, sX, tma_atom, pipeline_x, mPageTable, seqlen, batch_idx, head_idx_kv, width):
        """``load(n_block, producer_state)`` for K (``width`` = head_dim) or V (head_dim_v): one acquired stage
        by TMA, committed on the pipeline's barrier (contiguous: FA4's tile atom; paged: our page boxes). V's
        page-box loads go through :meth:`_v_loader` instead (rows past the last key zeroed)."""
        if const_expr(self.kv_box_rows is None):
            mX_cur = seqlen.offset_batch_K(mX, batch_idx, dim=3)[None, None, head_idx_kv]
            gX = cute.local_tile(mX_cur, (self.tile_n, width), (None, 0))
            copy_fn, _, _ = copy_utils.tma_get_copy_fn(tma_atom, 0, cute.make_layout(1), gX, sX)
            copy_fn = copy_utils.tma_producer_copy_fn(copy_fn, pipeline_x)

            def load(n_block, producer_state):
                copy_fn(src_idx=n_block, producer_state=producer_state)
                pipeline_x.producer_commit(producer_state)
            return load
        tXsX, tXgX, last_box_row = self._box_partitions(mX, sX, tma_atom, seqlen, head_idx_kv, width)
        return partial(self._load_kv_boxes, tma_atom, tXsX, tXgX, pipeline_x, mPageTable, batch_idx, last_box_row)

    def _box_partitions(self, mX, sX, tma_atom, seqlen, head_idx_kv, width):
        """Page-box TMA partitions of K or V (as ``_load_paged_boxes``) and the sequence's last box row."""
        box_rows = self.kv_box_rows
        sX_boxes = cute.zipped_divide(sX, (box_rows, width))
        gX = cute.zipped_divide(mX[None, None, head_idx_kv, None], (box_rows, width))
        tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), sX_boxes, gX)
        last_box_row = cutlass.max(seqlen.seqlen_k - 1, 0) // box_rows * box_rows
        return tXsX, tXgX, last_box_row

    @cute.jit
    def _sm_qk(self, kv_consumer_state, mma_qk_fn: Callable, pipeline_k) -> cute.Tensor:
        """S of the K stage of ``kv_consumer_state`` (waits for it, retires the wgmma, then releases the stage:
        two arrivals per warp, the 8 of FA4's count)."""
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        acc_S = mma_qk_fn(B_idx=kv_consumer_state.index, wg_wait=0)
        pipeline_k.consumer_release(kv_consumer_state)
        pipeline_k.consumer_release(kv_consumer_state)
        return acc_S

    @cute.jit
    def _refill_k(self, k_producer_state, n_block: Int32, pipeline_k, load_K: Callable, n_block_min: Int32,
                  warp_idx_in_wg: Int32, load_K_part: Optional[Callable] = None):
        """After S of key block ``n_block`` retired: warp 0 loads block ``n_block - num_stages`` (if in the
        tile's range) into the stage just released. With ``load_K_part`` (``_K_REFILL_ALL_WARPS``) each SM warp
        waits for the stage to be empty and loads its quarter of the columns on the stage's full barrier, warp 0
        arriving there with the whole stage's bytes (a quarter's bytes may land before that arrival: the
        barrier's transaction count goes below zero meanwhile, and its phase cannot complete before the one
        arrival it expects). Returns the producer state (advanced when it loaded)."""
        n_next = n_block - self.num_stages
        if n_next >= n_block_min:
            if const_expr(load_K_part is None):
                if warp_idx_in_wg == 0:
                    pipeline_k.producer_acquire(k_producer_state)
                    load_K(n_next, k_producer_state)
            else:
                if warp_idx_in_wg == 0:
                    pipeline_k.producer_acquire(k_producer_state)
                else:
                    pipeline_k.sync_object_empty.wait(k_producer_state.index, k_producer_state.phase)
                load_K_part(n_next, k_producer_state, warp_idx_in_wg)
            k_producer_state.advance()
        return k_producer_state

    def _k_refill_all_warps(self) -> bool:
        """Whether SM's 4 warps share the K refill (``_K_REFILL_ALL_WARPS`` and a head dim whose quarters are
        whole 64-column swizzle atoms; not with ``k_refill="halves"``, which refills by halves from warp 0)."""
        return self._K_REFILL_ALL_WARPS and self.tile_hdim % 256 == 0 and self.k_refill != "halves"

    def _k_part_loader(self, mK, sK, tma_atom, parts: int, barrier: Callable, mPageTable, seqlen, batch_idx,
                       head_idx_kv):
        """``load(n_block, producer_state, part)``: column part ``part`` of ``parts`` equal parts of K's head dim
        (dims ``[part d/parts, (part + 1) d/parts)``) of key block ``n_block`` into the producer state's stage, on
        the barrier ``barrier(producer_state, part)`` returns (the caller acquires the stage or part and arrives
        with its bytes). The same TMA atom as the whole block's, partitioned into ``tile_n x d/parts`` tiles:
        contiguous, one tile copy; paged, the page boxes of that part (:meth:`_issue_half_boxes_of`, a page-table
        read per box). ``part`` may be a Python int (immediate coordinates) or a register value.

        Two users: ``k_refill="halves"`` (``parts=2``, half ``h`` on that half's full barrier of
        :class:`_KHalvesPipeline`: 4 of the 8 64-column boxes at d 512; pages of 64 / 16 / 8: one / four / eight
        boxes a half) and the all-warps K experiment (``_K_REFILL_ALL_WARPS``, ``parts=4``, an SM warp's quarter on
        the whole stage's full barrier of ``pipeline_k``)."""
        width = self.tile_hdim // parts
        if const_expr(self.kv_box_rows is None):
            mK_cur = seqlen.offset_batch_K(mK, batch_idx, dim=3)[None, None, head_idx_kv]
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1), cute.zipped_divide(sK, (self.tile_n, width)),
                cute.zipped_divide(mK_cur, (self.tile_n, width)))

            def load(n_block, producer_state, part):
                cute.copy(tma_atom, tKgK[None, (n_block, part)], tKsK[None, (0, part, producer_state.index)],
                          tma_bar_ptr=barrier(producer_state, part))
            return load
        box_rows = self.kv_box_rows
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.zipped_divide(sK, (box_rows, width)),
            cute.zipped_divide(mK[None, None, head_idx_kv, None], (box_rows, width)))
        last_box_row = cutlass.max(seqlen.seqlen_k - 1, 0) // box_rows * box_rows

        def load(n_block, producer_state, part):
            self._issue_half_boxes_of(tma_atom, tKsK, tKgK, barrier(producer_state, part), mPageTable, batch_idx,
                                      last_box_row, n_block, producer_state.index, Int32(0), False, part)
        return load

    # --- k_refill="halves": SM's K stage by head-dim halves -----------------------------------------------------
    @cute.jit
    def _qk_half(self, tiled_mma_qk, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK_stage: cute.Tensor,
                 h: cutlass.Constexpr[int]):
        """One wgmma group of S = Q K^T over half ``h`` of the head dim: k-steps ``[h n/2, (h + 1) n/2)`` of the
        ``n`` that ``sm90_utils.gemm`` issues for the whole stage, in its order, into ``acc_S`` (half 0
        zero-initialises it, as the whole S's first k-step does); committed, not waited for. The two groups are
        the whole S's k-steps in order, so S is bit-identical to it."""
        n_k = cute.size(tSrQ.shape[2])
        warpgroup.fence()
        mma_atom = cute.make_mma_atom(tiled_mma_qk.op)
        mma_atom.set(warpgroup.Field.ACCUMULATE, h != 0)
        for k in cutlass.range_constexpr(h * (n_k // 2), (h + 1) * (n_k // 2)):
            cute.gemm(mma_atom, acc_S, tSrQ[None, None, k], tSrK_stage[None, None, k], acc_S)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _sm_issue_qk_halves(self, kv_consumer_state, acc_S: cute.Tensor, tiled_mma_qk, tSrQ: cute.Tensor,
                            tSrK: cute.Tensor, khalves: _KHalvesPipeline):
        """S = Q K^T of the K stage of ``kv_consumer_state`` into ``acc_S`` as two wgmma groups, each issued once
        its half of K landed (the second half may still be in flight while the first group runs); neither is
        waited for (:meth:`_sm_retire_qk_halves`)."""
        tSrK_stage = tSrK[None, None, None, kv_consumer_state.index]
        khalves.consumer_wait(0, kv_consumer_state)
        self._qk_half(tiled_mma_qk, acc_S, tSrQ, tSrK_stage, 0)
        khalves.consumer_wait(1, kv_consumer_state)
        self._qk_half(tiled_mma_qk, acc_S, tSrQ, tSrK_stage, 1)

    @cute.jit
    def _sm_retire_qk_halves(self, kv_consumer_state, k_producer_state, n_block: Int32, khalves: _KHalvesPipeline,
                             load_K_half: Callable, n_block_min: Int32, warp_idx_in_wg: Int32,
                             refill: cutlass.Constexpr[bool] = True):
        """Retires the two wgmma groups of S of key block ``n_block`` (stage of ``kv_consumer_state``, which is not
        advanced) one at a time: when the first retired (``wait_group(1)``), half 0 is released (one arrival
        per warp) and warp 0 refills it with block ``n_block - num_stages`` at once (if in the tile's range and
        ``refill``), while the second group still runs; then half 1 likewise after ``wait_group(0)``. No wgmma
        is issued here (the in-flight set is the same on every path). Returns the producer state (advanced
        when it loaded)."""
        n_next = n_block - self.num_stages
        warpgroup.wait_group(1)
        khalves.consumer_release(0, kv_consumer_state)
        if const_expr(refill):
            if n_next >= n_block_min:
                if warp_idx_in_wg == 0:
                    khalves.producer_acquire(0, k_producer_state)
                    load_K_half(n_next, k_producer_state, 0)
        warpgroup.wait_group(0)
        khalves.consumer_release(1, kv_consumer_state)
        if const_expr(refill):
            if n_next >= n_block_min:
                if warp_idx_in_wg == 0:
                    khalves.producer_acquire(1, k_producer_state)
                    load_K_half(n_next, k_producer_state, 1)
                k_producer_state.advance()
        return k_producer_state

    @cute.jit
    def _sm_qk_halves(self, kv_consumer_state, k_producer_state, n_block: Int32, tiled_mma_qk, tSrQ: cute.Tensor,
                      tSrK: cute.Tensor, khalves: _KHalvesPipeline, retire_halves: Callable):
        """(``qk_issue="serial"``) S of key block ``n_block`` by halves (:meth:`_sm_issue_qk_halves`), retired with
        each half's release and refill (:meth:`_sm_retire_qk_halves`). Returns S (a new accumulator, as
        :meth:`_sm_qk`'s) and the producer state."""
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        self._sm_issue_qk_halves(kv_consumer_state, acc_S, tiled_mma_qk, tSrQ, tSrK, khalves)
        k_producer_state = retire_halves(kv_consumer_state, k_producer_state, n_block)
        return acc_S, k_producer_state

    @cute.jit
    def _sm_step(self, kv_consumer_state, k_producer_state, n_block: Int32, block_i: Int32, qk: Callable,
                 refill: Callable, softmax: Softmax, hand_off: Callable, mask_fn: Optional[Callable] = None,
                 qk_halves: Optional[Callable] = None):
        """One SM iteration: S of key block ``n_block``, the K refill, its mask (``mask_fn`` None: an interior
        block), the online softmax, hand-off ``block_i``. With ``qk_halves`` (``k_refill="halves"``) S and the
        refill are :meth:`_sm_qk_halves`. Returns the consumer and producer states and ``block_i + 1``."""
        if const_expr(qk_halves is None):
            acc_S = qk(kv_consumer_state)
            k_producer_state = refill(k_producer_state, n_block)
        else:
            acc_S, k_producer_state = qk_halves(kv_consumer_state, k_producer_state, n_block)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, check_inf=True)
        hand_off(acc_S, row_scale, block_i)
        kv_consumer_state.advance()
        return kv_consumer_state, k_producer_state, block_i + 1

    @cute.jit
    def _sm_key_loops(self, step: Callable, kv_consumer_state, k_producer_state, block_i: Int32, n_hi: Int32,
                      n_block_min: Int32, n_floor: Int32, m_block: Int32, seqlen, block_info, mask_fn: Callable,
                      floor_bounds: cutlass.Constexpr[bool] = False):
        """FA4's three loops with our per-row bounds (as kernel_wide's WG0), descending from block ``n_hi - 1``
        to ``n_floor``: right-masked, interior, left-masked blocks, each an SM ``step``. ``floor_bounds``: the
        right / left bounds raised to ``n_floor`` (a floor above ``n_block_min``; the default passes
        ``n_block_min``, which they never go below). Returns the consumer and producer states and ``block_i``."""
        n_block_right = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
        if const_expr(floor_bounds):
            n_block_right = cutlass.max(n_block_right, n_floor)
        for n_tile in cutlass.range(n_hi - n_block_right, unroll=1):
            kv_consumer_state, k_producer_state, block_i = step(
                kv_consumer_state, k_producer_state, n_hi - 1 - n_tile, block_i,
                mask_fn=partial(mask_fn, mask_seqlen=False))
        n_hi = cutlass.min(n_hi, n_block_right)
        n_block_left = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
        if const_expr(floor_bounds):
            n_block_left = cutlass.max(n_block_left, n_floor)
        for n_tile in cutlass.range(n_hi - n_block_left, unroll=1):
            kv_consumer_state, k_producer_state, block_i = step(
                kv_consumer_state, k_producer_state, n_hi - 1 - n_tile, block_i, mask_fn=None)
        if const_expr(block_info.window_size_left is not None):
            n_hi = cutlass.min(n_hi, n_block_left)
            for n_tile in cutlass.range(n_hi - n_floor, unroll=1):
                kv_consumer_state, k_producer_state, block_i = step(
                    kv_consumer_state, k_producer_state, n_hi - 1 - n_tile, block_i,
                    mask_fn=partial(mask_fn, mask_seqlen=False))
        return kv_consumer_state, k_producer_state, block_i

    @cute.jit
    def _sm_issue_qk(self, kv_consumer_state, acc_S: cute.Tensor, tiled_mma_qk, tSrQ: cute.Tensor,
                     tSrK: cute.Tensor, pipeline_k):
        """(``qk_issue="ahead"``) Waits for the K stage of ``kv_consumer_state`` and issues S = Q K^T into ``acc_S``
        without waiting for it (retired by :meth:`_sm_retire_qk`)."""
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        sm90_utils.gemm_w_idx(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True, B_idx=kv_consumer_state.index,
                              wg_wait=-1)

    @cute.jit
    def _sm_retire_qk(self, kv_consumer_state, pipeline_k):
        """(``qk_issue="ahead"``) Waits for SM's issued S, releases its K stage (two arrivals per warp, as
        :meth:`_sm_qk`) and returns the consumer state advanced to the next block."""
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(kv_consumer_state)
        pipeline_k.consumer_release(kv_consumer_state)
        kv_consumer_state.advance()
        return kv_consumer_state

    @cute.jit
    def _sm_tile_overlap(self, kv_consumer_state, k_producer_state, n_block_min: Int32, n_block_max: Int32,
                         m_block: Int32, seqlen, block_info, mask_fn: Callable, refill: Callable, softmax: Softmax,
                         acc_S: cute.Tensor, tiled_mma_qk, tSrQ: cute.Tensor, tSrK: cute.Tensor, pipeline_k,
                         store_p: Callable, khalves: Optional[_KHalvesPipeline] = None,
                         retire_halves: Optional[Callable] = None):
        """(``qk_issue="ahead"``) SM's blocks of one tile with S issued one block ahead. Every wgmma is issued outside
        a branch that another path skips (ptxas serialises all wgmma of the kernel when the in-flight set
        depends on the path, C7518): the tile's last key block's S before the branch on the block count; the
        loops stop above the tile's first key block (``n_block_min``), whose iteration issues nothing, masked
        whatever its kind (exact per key, a no-op on an interior block). With ``khalves`` / ``retire_halves``
        (``k_refill="halves"``) S is issued by :meth:`_sm_issue_qk_halves` and retired (each half released and
        refilled) by :meth:`_sm_retire_qk_halves`. Returns the consumer and producer states."""
        issue = partial(self._sm_issue_qk, acc_S=acc_S, tiled_mma_qk=tiled_mma_qk, tSrQ=tSrQ, tSrK=tSrK,
                        pipeline_k=pipeline_k)
        if const_expr(khalves is not None):
            issue = partial(self._sm_issue_qk_halves, acc_S=acc_S, tiled_mma_qk=tiled_mma_qk, tSrQ=tSrQ, tSrK=tSrK,
                            khalves=khalves)
        issue(kv_consumer_state)
        if n_block_max - n_block_min == 1:  # one block: no S after it
            if const_expr(khalves is None):
                kv_consumer_state = self._sm_retire_qk(kv_consumer_state, pipeline_k)
            else:
                k_producer_state = retire_halves(kv_consumer_state, k_producer_state, n_block_max - 1, refill=False)
                kv_consumer_state.advance()
            mask_fn(acc_S, n_block=n_block_max - 1, mask_seqlen=True)
            row_scale = softmax.online_softmax(acc_S, is_first=True)
            store_p(self._convert_p(acc_S), row_scale, Int32(0))
        else:
            if const_expr(khalves is None):
                kv_consumer_state = self._sm_retire_qk(kv_consumer_state, pipeline_k)
                k_producer_state = refill(k_producer_state, n_block_max - 1)
            else:
                k_producer_state = retire_halves(kv_consumer_state, k_producer_state, n_block_max - 1)
                kv_consumer_state.advance()
            mask_fn(acc_S, n_block=n_block_max - 1, mask_seqlen=True)
            row_scale = softmax.online_softmax(acc_S, is_first=True)
            tOrP = self._convert_p(acc_S)
            issue(kv_consumer_state)
            store_p(tOrP, row_scale, Int32(0))
            block_i = Int32(1)  # blocks handed to the P V warpgroups so far
            step = partial(self._sm_step_overlap, acc_S=acc_S, issue=issue, pipeline_k=pipeline_k, refill=refill,
                           softmax=softmax, store_p=store_p, retire_halves=retire_halves)
            # the loops' lowest block is the one above the tile's first key block, which issues nothing
            kv_consumer_state, k_producer_state, block_i = self._sm_key_loops(
                step, kv_consumer_state, k_producer_state, block_i, n_block_max - 1, n_block_min, n_block_min + 1,
                m_block, seqlen, block_info, mask_fn, floor_bounds=True)
            # The tile's first key block (n_block_min): its S was issued by the last iteration.
            if const_expr(khalves is None):
                kv_consumer_state = self._sm_retire_qk(kv_consumer_state, pipeline_k)
            else:
                k_producer_state = retire_halves(kv_consumer_state, k_producer_state, n_block_min, refill=False)
                kv_consumer_state.advance()
            mask_fn(acc_S, n_block=n_block_min, mask_seqlen=False)
            row_scale = softmax.online_softmax(acc_S, check_inf=True)
            store_p(self._convert_p(acc_S), row_scale, block_i)
        return kv_consumer_state, k_producer_state

    @cute.jit
    def _sm_step_overlap(self, kv_consumer_state, k_producer_state, n_block: Int32, block_i: Int32,
                         acc_S: cute.Tensor, issue: Callable, pipeline_k, refill: Callable, softmax: Softmax,
                         store_p: Callable, mask_fn: Optional[Callable] = None,
                         retire_halves: Optional[Callable] = None):
        """(``qk_issue="ahead"``) One SM iteration with S of key block ``n_block`` (above the tile's first key block)
        already issued into ``acc_S``: retire it, the K refill (with ``retire_halves``, ``k_refill="halves"``: half
        by half, :meth:`_sm_retire_qk_halves`), mask, online softmax, P converted, S of block ``n_block - 1``
        issued, P handed off as ``block_i``. Returns the consumer and producer states and ``block_i + 1``."""
        if const_expr(retire_halves is None):
            kv_consumer_state = self._sm_retire_qk(kv_consumer_state, pipeline_k)
            k_producer_state = refill(k_producer_state, n_block)
        else:
            k_producer_state = retire_halves(kv_consumer_state, k_producer_state, n_block)
            kv_consumer_state.advance()
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, check_inf=True)
        tOrP = self._convert_p(acc_S)
        issue(kv_consumer_state)
        store_p(tOrP, row_scale, block_i)
        return kv_consumer_state, k_producer_state, block_i + 1

    @cute.jit
    def _convert_p(self, acc_S: cute.Tensor) -> cute.Tensor:
        """P (softmax numerators in ``acc_S``) in the input dtype, as an A-operand fragment."""
        tOrP_acc = layout_utils.reshape_acc_to_frgA(acc_S)
        tOrP = cute.make_fragment_like(tOrP_acc, self.dtype)
        fa_utils.cvt_f16(tOrP_acc, tOrP)
        return tOrP

    @cute.jit
    def _store_p_smem(self, smem_thr_copy_P: cute.TiledCopy, tPsP: cute.Tensor, sScale: cute.Tensor, t_sm: Int32,
                      tOrP: cute.Tensor, row_scale: cute.Tensor, block_i: Int32,
                      convert: cutlass.Constexpr[bool] = False):
        """P into P slot ``block_i % 2`` and the row factors beside it (after ``P_EMPTY`` from the third hand-off
        on), fenced, then ``P_FULL``. ``tOrP``: P converted (:meth:`_convert_p`; ``qk_issue="ahead"`` converts apart),
        or with ``convert`` the softmax numerators, converted here after the slot index (the default's order)."""
        slot = block_i % _P_SLOTS
        if const_expr(convert):
            tOrP = self._convert_p(tOrP)
        if block_i >= _P_SLOTS:
            cute.arch.barrier(barrier_id=int(NamedBarrierWideV.P_EMPTY_0) + slot, number_of_threads=_BAR_THREADS)
        cute.copy(smem_thr_copy_P, smem_thr_copy_P.retile(tOrP), tPsP[None, None, None, slot])
        self._store_scale(sScale, row_scale, t_sm, slot)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.P_FULL_0) + slot, number_of_threads=_BAR_THREADS)

    @cute.jit
    def _hand_off_p_smem(
        self,
        smem_thr_copy_P: cute.TiledCopy,
        tPsP: cute.Tensor,
        sScale: cute.Tensor,
        t_sm: Int32,
        acc_S: cute.Tensor,
        row_scale: cute.Tensor,
        block_i: Int32,
    ):
        """P of hand-off ``block_i`` (softmax numerators in ``acc_S``, converted to the input dtype) into P slot
        ``block_i % 2`` and the row factors into factor slot ``block_i % 2``; fenced for wgmma, then
        ``P_FULL``. From the third hand-off on, waits for both P V warpgroups to free the slot (``P_EMPTY``)."""
        self._store_p_smem(smem_thr_copy_P, tPsP, sScale, t_sm, acc_S, row_scale, block_i, convert=True)

    # --- consumer warpgroups: P V, and the loads of V -------------------------------------------------------
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
        """Consumer entry (FA4's ``mma`` signature): ``tidx`` in ``[0, 256)``, warpgroup ``tidx // 128`` runs
        :meth:`_mma_pv` on its half of V."""
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
        self._mma_pv(ctx, cute.arch.make_warp_uniform(tidx // _WG))

    @cute.jit
    def _mma_pv(self, ctx: SimpleNamespace, pv: Int32):
        """P V warpgroup ``pv`` (0 or 1): per key block, P and the factors from their slot, its half of O
        rescaled and += P V[:, half]; PV0's warp 0 loads V (``v_refill="halves"``: each warpgroup's warp 0 its
        half, through its own pipeline); then the final factors and FA4's epilogue over both P V warpgroups."""
        tidx = ctx.tidx  # [0, 256): the epilogue's numbering
        t_wg = tidx - pv * _WG
        halves = self.v_refill == "halves"
        if const_expr(halves):  # warp 0 of each P V warpgroup (CTA warps 4 and 8) loads its warpgroup's half
            is_v_loader = cute.arch.make_warp_uniform(t_wg // cute.arch.WARP_SIZE) == 0
        else:
            is_v_loader = cute.arch.make_warp_uniform(tidx // cute.arch.WARP_SIZE) == 0  # PV0's warp 0 (CTA warp 4)
        # locals only inside the loops below: the DSL would try to carry the namespace's fields through them
        block_info, sScale, SeqlenInfoCls = ctx.block_info, ctx.sScale, ctx.SeqlenInfoCls
        pipeline_v, pipeline_q = ctx.pipeline_v, ctx.pipeline_q
        epilogue = partial(self._epilogue, ctx)
        # this thread's slice of the two-atom tiled MMA: atom `pv`, value columns [pv dv/2, (pv+1) dv/2)
        acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
            ctx.tiled_mma_pv.get_slice(tidx), (self.tile_m, self.tile_hdimv, self.tile_n), ctx.sP, ctx.sVt)
        mma_pv_fn = partial(sm90_utils.gemm_w_idx, ctx.tiled_mma_pv, acc_O, tOrP, tOrVt)
        # Only its rescale is used (the row statistics live in SM).
        softmax = Softmax.create(ctx.softmax_scale_log2, num_rows=self._rows_per_thread(),
                                 softmax_scale=ctx.softmax_scale)
        softmax.reset()
        mV, mPageTable, sV = self._mV_load, self._mPageTable_load, self._sV_load
        # The page-box V loads' own barrier for a sequence's last block (_acquire_load_v), in the slot after the
        # V pipeline's barriers (_get_shared_storage_cls), initialised by the loading warp.
        tail_bar = pipeline_v.sync_object_empty.get_barrier(0) + self.num_stages
        tail_phase = Int32(0)
        if const_expr(halves):
            # this warpgroup's half-V pipeline (its own tail barrier inside), initialised by its loader; both
            # warpgroups pass one barrier before any wait on it
            self._init_half_v(self._half_v_pipeline(pipeline_v, pv), is_v_loader)
        elif const_expr(self.kv_box_rows is not None):
            if is_v_loader:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(tail_bar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.sync_warp()
        q_consumer_phase = Int32(0)
        v_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        kv_consumer_state = self._consumer_state()
        tile_scheduler = ctx.TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            num_blocks = n_block_max - n_block_min
            head_idx_kv = head_idx // self.qhead_per_kvhead if const_expr(not self.pack_gqa) else head_idx
            if const_expr(halves):
                # built per tile (a value of the loop body: the smem base and pv), not carried through the loop
                vpipe = self._half_v_pipeline(pipeline_v, pv)
                load_V, page_of = self._v_half_loader(mV, sV, vpipe, mPageTable, seqlen, batch_idx, head_idx_kv,
                                                      pv)
                if is_v_loader:  # the first num_stages V blocks' halves (descending key order)
                    for i in cutlass.range(cutlass.min(self.num_stages, num_blocks), unroll=1):
                        n_first = n_block_max - 1 - i
                        page = page_of(n_first) if const_expr(page_of is not None) else Int32(0)
                        tail_phase = load_V(n_first, v_producer_state, tail_phase, page)
                        v_producer_state.advance()
                block = partial(self._pv_block_halves, vpipe=vpipe, mma_pv_fn=mma_pv_fn, acc_O=acc_O,
                                softmax=softmax, sScale=sScale, t_wg=t_wg, pv=pv, num_blocks=num_blocks,
                                n_block_max=n_block_max, load_V=load_V, page_of=page_of, is_v_loader=is_v_loader)
            else:
                load_V = self._v_loader(mV, sV, pipeline_v, mPageTable, seqlen, batch_idx, head_idx_kv, tail_bar)
                if is_v_loader:  # the first num_stages V blocks (descending key order)
                    for i in cutlass.range(cutlass.min(self.num_stages, num_blocks), unroll=1):
                        tail_phase = load_V(n_block_max - 1 - i, v_producer_state, tail_phase)
                        v_producer_state.advance()
                block = partial(self._pv_block, pipeline_v=pipeline_v, mma_pv_fn=mma_pv_fn, acc_O=acc_O,
                                softmax=softmax, sScale=sScale, t_wg=t_wg, pv=pv, num_blocks=num_blocks,
                                n_block_max=n_block_max, load_V=load_V, is_v_loader=is_v_loader)
            if const_expr(not self.nan_safe_v):
                for block_i in cutlass.range(num_blocks, unroll=1):
                    kv_consumer_state, v_producer_state, tail_phase = block(
                        kv_consumer_state, v_producer_state, tail_phase, block_i)
            else:
                # SM's three loops in hand-off order (kernel_wide's WG1): this warpgroup cleans its half of V in
                # the masked ones.
                n_block_right = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
                n_block_left = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
                end_right = 1 + cutlass.max(n_block_max - 1 - n_block_right, 0)
                end_interior = end_right + cutlass.max(
                    cutlass.min(n_block_max - 1, n_block_right) - n_block_left, 0)
                for block_i in cutlass.range(0, end_right, unroll=1):
                    kv_consumer_state, v_producer_state, tail_phase = block(
                        kv_consumer_state, v_producer_state, tail_phase, block_i, clean=True)
                for block_i in cutlass.range(end_right, end_interior, unroll=1):
                    kv_consumer_state, v_producer_state, tail_phase = block(
                        kv_consumer_state, v_producer_state, tail_phase, block_i)
                for block_i in cutlass.range(end_interior, num_blocks, unroll=1):
                    kv_consumer_state, v_producer_state, tail_phase = block(
                        kv_consumer_state, v_producer_state, tail_phase, block_i, clean=True)
            cute.arch.barrier(barrier_id=int(NamedBarrierWideV.FINAL), number_of_threads=_BAR_THREADS)
            softmax.rescale_O(acc_O, self._load_scale(sScale, softmax.row_sum, t_wg, Int32(_FINAL_SLOT)))
            lse = self._load_scale(sScale, softmax.row_sum, t_wg, Int32(_LSE_SLOT))
            epilogue(acc_O, lse, seqlen, m_block, head_idx, batch_idx)
            # Q is SM's; the P V warpgroups' releases (after Q's load, so never early) free it for the next tile.
            pipeline_q.consumer_wait_w_index_phase(0, q_consumer_phase)
            pipeline_q.consumer_release_w_index(0)
            q_consumer_phase ^= 1
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
        if is_v_loader:
            if const_expr(halves):  # every stage's half released by this warpgroup before the CTA exits
                vpipe_end = self._half_v_pipeline(pipeline_v, pv)
                for _ in cutlass.range_constexpr(self.num_stages):
                    vpipe_end.producer_wait_empty(v_producer_state)
                    v_producer_state.advance()
            else:
                pipeline_v.producer_tail(v_producer_state)

    def _epilogue(self, ctx: SimpleNamespace, acc_O: cute.Tensor, lse: cute.Tensor, seqlen, m_block: Int32,
                  head_idx: Int32, batch_idx: Int32):
        """The split-value kernel's epilogue (FA4's over both P V warpgroups); with ``_EPILOGUE_LOCAL_WARP`` and O
        stored by TMA, FA4's ``cute.arch.warp_idx()`` inside it returns ``tidx // 32 + 4`` (``tidx`` the consumer's
        ``[0, 256)`` numbering: the same CTA warp index, computed here and not merged with the entry's; the
        module attribute is swapped only while this call is traced)."""
        run = partial(FlashAttentionForwardSm90WideV._epilogue, self, ctx, acc_O, lse, seqlen, m_block, head_idx,
                      batch_idx)
        if not (self._EPILOGUE_LOCAL_WARP and self.use_tma_O):
            return run()
        arch, entry_warp_idx, tidx = cute.arch, cute.arch.warp_idx, ctx.tidx

        def local_warp_idx(*, loc=None, ip=None):
            return arch.make_warp_uniform(tidx // arch.WARP_SIZE + _WG // arch.WARP_SIZE, loc=loc, ip=ip)

        arch.warp_idx = local_warp_idx
        try:
            return run()
        finally:
            arch.warp_idx = entry_warp_idx

    def _v_loader(self, mV, sV, pipeline_v, mPageTable, seqlen, batch_idx, head_idx_kv, tail_bar):
        """``load(n_block, producer_state, tail_phase) -> tail_phase``: acquire a V stage and load it
        (contiguous: FA4's tile atom; paged: page boxes with the rows past the last key zeroed,
        ``_acquire_load_v``)."""
        tma_atom_V = self._tma_atom_V
        if const_expr(self.kv_box_rows is None):
            load = self._block_loader(mV, sV, tma_atom_V, pipeline_v, mPageTable, seqlen, batch_idx, head_idx_kv,
                                      self.tile_hdimv)

            def acquire_load(n_block, producer_state, tail_phase):
                pipeline_v.producer_acquire(producer_state)
                load(n_block, producer_state)
                return tail_phase
            return acquire_load
        tVsV, tVgV, last_box_row = self._box_partitions(mV, sV, tma_atom_V, seqlen, head_idx_kv, self.tile_hdimv)
        return partial(self._acquire_load_v, tma_atom_V, tVsV, tVgV, pipeline_v, mPageTable, batch_idx,
                       last_box_row, sV, seqlen.seqlen_k, tail_bar)

    @cute.jit
    def _pv_block(self, kv_consumer_state, v_producer_state, tail_phase: Int32, block_i: Int32, pipeline_v,
                  mma_pv_fn: Callable, acc_O: cute.Tensor, softmax: Softmax, sScale: cute.Tensor, t_wg: Int32,
                  pv: Int32, num_blocks: Int32, n_block_max: Int32, load_V: Callable, is_v_loader,
                  clean: cutlass.Constexpr[bool] = False):
        """One P V iteration (hand-off ``block_i``): P and the factors from their slot, this half of O rescaled,
        P V (with ``clean``: the NaN-safe clean-up of this half of V first), the V stage released; PV0's warp 0
        then loads block ``block_i + num_stages`` into it (waiting for the other warpgroup's release). Returns the
        consumer and producer states and the tail barrier's phase."""
        slot = block_i % _P_SLOTS
        cute.arch.barrier(barrier_id=int(NamedBarrierWideV.P_FULL_0) + slot, number_of_threads=_BAR_THREADS)
        if block_i > 0:
            softmax.rescale_O(acc_O, self._load_scale(sScale, softmax.row_sum, t_wg, slot))
        pipeline_v.consumer_wait(kv_consumer_state, pipeline_v.consumer_try_wait(kv_consumer_state))
        if const_expr(clean):
            if pv == 0:
                self._clean_v_stage(self._nf_sVt, kv_consumer_state.index, 0, self.half_v)
            else:
                self._clean_v_stage(self._nf_sVt, kv_consumer_state.index, self.half_v, self.half_v)
        mma_pv_fn(A_idx=slot, B_idx=kv_consumer_state.index, zero_init=block_i == 0, wg_wait=0)
        pipeline_v.consumer_release(kv_consumer_state)
        kv_consumer_state.advance()
        if block_i + _P_SLOTS < num_blocks:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.P_EMPTY_0) + slot,
                                     number_of_threads=_BAR_THREADS)
        j = block_i + self.num_stages
        if j < num_blocks:
            if is_v_loader:
                tail_phase = load_V(n_block_max - 1 - j, v_producer_state, tail_phase)
            v_producer_state.advance()
        return kv_consumer_state, v_producer_state, tail_phase


    # --- v_refill="halves": each P V warpgroup refills its own half of V --------------------------------------
    @cute.jit
    def _init_half_v(self, vpipe: _HalfVPipeline, is_v_loader):
        """The loader warp initialises its warpgroup's half-V barriers; then both P V warpgroups meet at
        ``V_HALVES_INIT_BARRIER`` (no thread waits on a barrier before its initialisation)."""
        if is_v_loader:
            vpipe.init()
        cute.arch.barrier(barrier_id=V_HALVES_INIT_BARRIER, number_of_threads=2 * _WG)

    def _v_half_loader(self, mV, sV, vpipe: _HalfVPipeline, mPageTable, seqlen, batch_idx, head_idx_kv, pv):
        """``(load, page_of)`` for P V warpgroup ``pv``'s half of the value columns: ``load(n_block,
        producer_state, tail_phase, page) -> tail_phase`` acquires the half of a V stage and loads it on
        ``vpipe`` (the same TMA atom as the whole block's, partitioned into ``tile_n x dv/2`` tiles: 4 of its
        8 column boxes at dv 512). Contiguous: one tile copy. Paged: the page boxes of this half, rows past the
        last key zeroed in this half (:meth:`_acquire_load_v_half`). ``page_of(n_block)``: the page index of
        key block ``n_block`` when one page box covers a block (page size >= ``tile_n``), read by the caller
        ahead of the load (``page`` argument); None otherwise (the boxes' pages are read at the load)."""
        tma_atom = self._tma_atom_V
        half = self.tile_hdimv // 2
        if const_expr(self.kv_box_rows is None):
            mV_cur = seqlen.offset_batch_K(mV, batch_idx, dim=3)[None, None, head_idx_kv]
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1), cute.zipped_divide(sV, (self.tile_n, half)),
                cute.zipped_divide(mV_cur, (self.tile_n, half)))

            def load(n_block, producer_state, tail_phase, page):
                vpipe.producer_acquire(producer_state)
                self._copy_half_tile(tma_atom, tVsV, tVgV, vpipe.full(producer_state.index), pv, n_block,
                                     producer_state.index)
                return tail_phase
            return load, None
        box_rows = self.kv_box_rows
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.zipped_divide(sV, (box_rows, half)),
            cute.zipped_divide(mV[None, None, head_idx_kv, None], (box_rows, half)))
        last_box_row = cutlass.max(seqlen.seqlen_k - 1, 0) // box_rows * box_rows
        page_of = None
        # ahead only where the compile showed it free: one box per block, O stored by TMA (with PackGQA rows
        # that hold partial token groups, Q / O without TMA, the held register spilled 12 B), no split-KV
        if const_expr(box_rows == self.tile_n and self._V_PAGE_AHEAD and self.use_tma_O):
            def page_of(n_block):
                return mPageTable[batch_idx, cutlass.min(n_block * self.tile_n, last_box_row) // self.kv_page_size]
        load = partial(self._acquire_load_v_half, tma_atom, tVsV, tVgV, vpipe, mPageTable, batch_idx,
                       last_box_row, sV, seqlen.seqlen_k, pv, page_of is not None)
        return load, page_of

    @cute.jit
    def _copy_half_tile(self, tma_atom: cute.CopyAtom, tVsV: cute.Tensor, tVgV: cute.Tensor, bar_ptr: cute.Pointer,
                        pv: Int32, n_block: Int32, stage: Int32):
        """Contiguous K / V: half ``pv`` of key block ``n_block`` into ``stage`` (one tile copy; ``pv`` as
        :meth:`_issue_half_boxes` takes it)."""
        if const_expr(self._V_HALF_BRANCH):
            if pv == 0:
                cute.copy(tma_atom, tVgV[None, (n_block, 0)], tVsV[None, (0, 0, stage)], tma_bar_ptr=bar_ptr)
            else:
                cute.copy(tma_atom, tVgV[None, (n_block, 1)], tVsV[None, (0, 1, stage)], tma_bar_ptr=bar_ptr)
        else:
            cute.copy(tma_atom, tVgV[None, (n_block, pv)], tVsV[None, (0, pv, stage)], tma_bar_ptr=bar_ptr)

    @cute.jit
    def _issue_half_boxes(self, tma_atom: cute.CopyAtom, tVsV: cute.Tensor, tVgV: cute.Tensor,
                          bar_ptr: cute.Pointer, mPageTable: cute.Tensor, batch_idx: Int32, last_box_row: Int32,
                          pv: Int32, n_block: Int32, stage: Int32, page: Int32,
                          prefetched: cutlass.Constexpr[bool]):
        """The page boxes of key block ``n_block``'s half ``pv`` into ``stage`` on ``bar_ptr`` (as
        ``_issue_boxes``; with ``prefetched`` the one box's page is ``page``, read ahead by the caller). ``pv`` a
        register value in the box coordinates, or with ``_V_HALF_BRANCH`` a compile-time index in a branch per
        half (immediate coordinates and offsets, twice the TMA code)."""
        issue = partial(self._issue_half_boxes_of, tma_atom, tVsV, tVgV, bar_ptr, mPageTable, batch_idx,
                        last_box_row, n_block, stage, page, prefetched)
        if const_expr(self._V_HALF_BRANCH):
            if pv == 0:
                issue(0)
            else:
                issue(1)
        else:
            issue(pv)

    @cute.jit
    def _issue_half_boxes_of(self, tma_atom: cute.CopyAtom, tVsV: cute.Tensor, tVgV: cute.Tensor,
                             bar_ptr: cute.Pointer, mPageTable: cute.Tensor, batch_idx: Int32, last_box_row: Int32,
                             n_block: Int32, stage: Int32, page: Int32, prefetched: cutlass.Constexpr[bool], h):
        """The page boxes of key block ``n_block``'s column part ``h`` (of the partition ``tVsV`` / ``tVgV`` were made
        with: V's halves, or K's halves or quarters from :meth:`_k_part_loader`) into ``stage`` on ``bar_ptr``;
        with ``prefetched`` the one box's page is ``page``, else each box's page is read from the page table."""
        box_rows = self.kv_box_rows
        for j in cutlass.range_constexpr(self.tile_n // box_rows):
            row = cutlass.min(n_block * self.tile_n + j * box_rows, last_box_row)
            pg = page
            if const_expr(not prefetched):
                pg = mPageTable[batch_idx, row // self.kv_page_size]
            box_in_page = (row % self.kv_page_size) // box_rows
            cute.copy(tma_atom, tVgV[None, (box_in_page, h, pg)], tVsV[None, (j, h, stage)], tma_bar_ptr=bar_ptr)

    @cute.jit
    def _acquire_load_v_half(self, tma_atom: cute.CopyAtom, tVsV: cute.Tensor, tVgV: cute.Tensor,
                             vpipe: _HalfVPipeline, mPageTable: cute.Tensor, batch_idx: Int32,
                             last_box_row: Int32, sV: cute.Tensor, seqlen_k: Int32, pv: Int32,
                             prefetched: cutlass.Constexpr[bool], n_block: Int32, producer_state, tail_phase: Int32,
                             page: Int32) -> Int32:
        """``_acquire_load_v`` for one half: a stage holding rows past the sequence's last key is loaded on the
        half's own tail barrier, its rows past the end zeroed in this half's columns (the other warpgroup's
        loader zeroes the other half), fenced, then handed over by a plain arrive on the half's full barrier;
        any other stage: acquire with the half's bytes, the boxes. Returns the tail barrier's phase."""
        issue = partial(self._issue_half_boxes, tma_atom, tVsV, tVgV, mPageTable=mPageTable, batch_idx=batch_idx,
                        last_box_row=last_box_row, pv=pv, n_block=n_block, stage=producer_state.index, page=page,
                        prefetched=prefetched)
        first_past_end = seqlen_k - n_block * self.tile_n
        phase = tail_phase
        if first_past_end < self.tile_n:
            vpipe.producer_wait_empty(producer_state)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(vpipe.tail, vpipe.tx_bytes)
            issue(bar_ptr=vpipe.tail)
            cute.arch.mbarrier_wait(vpipe.tail, phase)
            self._zero_rows_half(sV, producer_state.index, first_past_end, pv)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(vpipe.full(producer_state.index))
            phase = phase ^ 1
        else:
            vpipe.producer_acquire(producer_state)
            issue(bar_ptr=vpipe.full(producer_state.index))
        return phase

    @cute.jit
    def _zero_rows_half(self, sX: cute.Tensor, stage: Int32, row_start: Int32, pv: Int32):
        """``_zero_rows`` over value columns ``[pv dv/2, (pv + 1) dv/2)`` only (one warp, 16-byte chunks)."""
        n_chunks = self.tile_hdimv // 2 // 8
        sX_chunks = cute.zipped_divide(sX[None, None, stage], (1, 8))  # ((1, 8), (tile_n, dv / 8))
        zero = cute.make_rmem_tensor((1, 8), sX.element_type)
        zero.fill(0.0)
        col0 = pv * n_chunks
        lane = cute.arch.lane_idx()
        for i in cutlass.range(lane, (self.tile_n - row_start) * n_chunks, cute.arch.WARP_SIZE, unroll=1):
            cute.autovec_copy(zero, sX_chunks[None, (row_start + i // n_chunks, col0 + i % n_chunks)])

    @cute.jit
    def _pv_block_halves(self, kv_consumer_state, v_producer_state, tail_phase: Int32, block_i: Int32,
                         vpipe: _HalfVPipeline, mma_pv_fn: Callable, acc_O: cute.Tensor, softmax: Softmax,
                         sScale: cute.Tensor, t_wg: Int32, pv: Int32, num_blocks: Int32, n_block_max: Int32,
                         load_V: Callable, page_of: Optional[Callable], is_v_loader,
                         clean: cutlass.Constexpr[bool] = False):
        """:meth:`_pv_block` with ``v_refill="halves"``: this warpgroup waits for and releases only its half of
        the V stage (``vpipe``), and its warp 0 refills that half with block ``block_i + num_stages`` right
        after this warpgroup's P V retired (no wait for the other warpgroup); the refill's page index is read
        before the P_FULL wait, off the refill's dependent chain."""
        slot = block_i % _P_SLOTS
        j = block_i + self.num_stages
        page = Int32(0)
        if const_expr(page_of is not None):
            if j < num_blocks:
                if is_v_loader:
                    page = page_of(n_block_max - 1 - j)
        cute.arch.barrier(barrier_id=int(NamedBarrierWideV.P_FULL_0) + slot, number_of_threads=_BAR_THREADS)
        if block_i > 0:
            softmax.rescale_O(acc_O, self._load_scale(sScale, softmax.row_sum, t_wg, slot))
        vpipe.consumer_wait(kv_consumer_state)
        if const_expr(clean):
            if pv == 0:
                self._clean_v_stage(self._nf_sVt, kv_consumer_state.index, 0, self.half_v)
            else:
                self._clean_v_stage(self._nf_sVt, kv_consumer_state.index, self.half_v, self.half_v)
        mma_pv_fn(A_idx=slot, B_idx=kv_consumer_state.index, zero_init=block_i == 0, wg_wait=0)
        vpipe.consumer_release(kv_consumer_state)
        kv_consumer_state.advance()
        if block_i + _P_SLOTS < num_blocks:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierWideV.P_EMPTY_0) + slot,
                                     number_of_threads=_BAR_THREADS)
        if j < num_blocks:
            if is_v_loader:
                tail_phase = load_V(n_block_max - 1 - j, v_producer_state, tail_phase, page)
            v_producer_state.advance()
        return kv_consumer_state, v_producer_state, tail_phase


class FlashAttentionForwardSm90RolesSplit(SplitKVMixin, FlashAttentionForwardSm90Roles):
    """:class:`FlashAttentionForwardSm90Roles` with split-KV (:class:`~blockdiff.attention.cute.kernel_split.
    SplitKVMixin`: this CTA's chunk of the tile's key blocks, normalised fp32 partial output and LSE written by the
    P V warpgroups' epilogue, merged by the shared Triton merge or FA4's combine kernel). With ``v_refill="halves"``
    its loaders read the page index at the load (``_V_PAGE_AHEAD`` False: held across the P V, that register made
    the split epilogue's live values spill 16 B, sm_90a compile on the CPU, docs/tuning.md 2.15) and issue each half's copies in a
    branch of their own (``_V_HALF_BRANCH``: without it 4 B spilled)."""

    _V_PAGE_AHEAD = False
    _V_HALF_BRANCH = True
