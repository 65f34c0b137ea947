"""Static configuration of the ``"cute"`` attention backend: the tile config type (part of the compile key), its
defaults and tuned choices, the SM90 shared-memory check and the K/V load path.

One owner: :func:`resolve_config` turns a call's head dims, window, host query-length hint and K/V page size (plus
an optional override) into the :class:`CuteConfig` the kernel is compiled for; :func:`kv_load_path` says how paged
K/V reach shared memory. This module imports neither flash-attn-4 nor the CuTe DSL at load time (FA4's tile heuristic is
imported when :func:`resolve_config` first needs it). The measured history of the tuned values is in
docs/tuning.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = [
    "REQUIRED", "CuteConfig", "resolve_config", "check_config_fits", "config_smem_bytes", "SMEM_LIMIT_BYTES",
    "LONG_PREFILL_Q", "LONG_PREFILL_CONFIG", "HD128_CONFIG", "LPT_MIN_SEQLEN_Q", "longest_first_tiles",
    "page_box_tma_ok", "kv_load_path", "MAX_HEAD_DIM", "WIDE_MIN_HEAD_DIM_V", "WIDE_CONFIG", "is_wide",
    "unsupported_head_dims", "resolve_wide_config", "WIDE_LONG_Q_CONFIG", "WIDE_MAX_PAGE_BOXES", "MAX_SPLITS",
    "MIN_KEYS_PER_SPLIT", "grid_tiles", "choose_num_splits", "key_bound", "resolve_launch_config", "check_config",
    "SPLIT_MERGES", "MAX_CLUSTER_SPLITS", "AUTO_CLUSTER_SPLITS", "auto_split_merge", "cluster_merge_fits",
    "WIDE_DESIGNS", "ROLES_CONFIG", "BATCH_ORDERS", "V_REFILLS", "QK_ISSUES", "QK_AHEAD_MIN_PAGE", "auto_wide_design",
    "K_REFILLS", "SKIP_ALLOWED_FIRST_VALUES", "auto_skip_allowed_first", "NAN_SAFE_V_METHODS",
    "resolve_nan_safe_v_method", "AUTO_RECOMPUTE_HEAD_DIMS",
]

#: The optional packages this backend runs on (the ``cute`` extra of setup.py).
REQUIRED = "flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1"


@dataclass(frozen=True)
class CuteConfig:
    """Static tile configuration (part of the compile key). None fields take FA4's SM90 heuristic.

    tile_m / tile_n: query rows (PackGQA: packed rows) / keys per tile; mma_pv_is_rs: P stays in registers for
    the PV GEMM (else it goes through shared memory); intra_wg_overlap: FA4's overlap of the QK and PV GEMMs
    within a warpgroup; num_stages: K/V pipeline stages; lpt: FA4's longest-first tile order (None: from
    ``max_seqlen_q``, :func:`longest_first_tiles`); num_splits: split-KV chunks per query tile (None: from the
    call's host shapes, :func:`choose_num_splits`; 1: no split); nan_safe_v: keys a row may not see contribute
    nothing even when their V holds NaN / Inf (by ``nan_safe_v_method``: masked key blocks' V cleaned in shared
    memory before P V and a cold fix-up of the rows that do see such a key, docs/tuning.md 2.4; or an epilogue test
    and recompute, 2.34). On by default (the contract: a key outside a
    row's allowed set contributes nothing); False opts out of its cost (measured in docs/tuning.md 2.6) and builds
    the kernels without it. Not a tile field: setting only it keeps the automatic tiles.
    split_merge: how split-KV partial outputs are merged: ``"auto"`` (default: ``"cluster"`` where it was
    measured faster, else ``"triton"``; :func:`auto_split_merge`), ``"combine"`` (FA4's combine kernel, a
    second launch; it skips a split whose weight underflows to 0, and with it a non-finite V entry of a key the
    row sees there, which the contract passes on: docs/tuning.md 2.33), ``"triton"`` (the shared Triton merge of
    :mod:`blockdiff.attention.split_merge`, a second launch that multiplies every split by its weight, 0
    included) or ``"cluster"`` (the splits of a tile as a thread-block cluster reducing through distributed
    shared memory inside the one launch; 2 .. :data:`MAX_CLUSTER_SPLITS` splits, and the fp32 tile must fit the
    Q / K / V buffers: :func:`cluster_merge_fits`; docs/tuning.md 2.5). Not a tile field either; it resolves in
    :func:`resolve_launch_config`, with one split to ``"combine"`` (the plain kernel).
    wide_design: the kernel of head dims above 256 (:func:`is_wide`): ``"auto"`` (default), ``"split_v"`` (two
    consumer warpgroups, the first computing S, the softmax and half of P V; ``kernel_wide.py``, docs/tuning.md 2.1
    design (c2)) or ``"roles"`` (one softmax warpgroup feeding two P V warpgroups through shared memory;
    ``kernel_roles.py``, design (c1); its tiles: :data:`ROLES_CONFIG`; no cluster merge). ``"auto"`` resolves to
    ``"roles"`` iff head_dim == head_dim_v == 512, the config sets no tile field (only switches, ``num_splits``
    and ``lpt``: automatic tiles), ``split_merge`` is not ``"cluster"`` and the K/V layout loads by TMA page
    boxes at the roles tile_n (``page_size`` of :func:`resolve_config`: contiguous / unknown, or
    :func:`page_box_tma_ok`); else to
    ``"split_v"`` (:func:`auto_wide_design`). Rationale: measured faster on every hd-512 workload on the H200
    (docs/tuning.md 2.17); other wide head dims were not measured with it. Below head dim 257 it resolves to
    ``"split_v"`` (FA4's kernel either way).
    batch_order: the order in which FA4's varlen tile scheduler takes the sequences: ``"auto"`` (default),
    ``"given"`` (batch order, each sequence's tiles in turn) or ``"work"`` (the sequences by their mean keys per
    tile, descending, a permutation computed on the device per call in one Triton launch and read by the scheduler
    through FA4's ``virtual_batch_idx_ptr``; :mod:`blockdiff.attention.cute.tile_order`, docs/tuning.md 2.13).
    Each tile's result does not depend on the order, so all give identical outputs; ``"work"`` puts a mixed batch's
    long canvas tiles before a prefill's short ones (less idle tail). ``"auto"`` resolves to ``"work"`` when the
    resolved kernel is the roles kernel, else ``"given"``. Rationale: on the H200 it was never slower for the roles
    kernel and faster on mixed batches, while it cost the split-value and hd-256 windowed kernels on some
    workloads (docs/tuning.md 2.17). Not a tile field; with one sequence ``"work"`` (explicit or resolved)
    resolves to ``"given"`` (:func:`resolve_launch_config`).
    v_refill: who refills the roles kernel's V stages (roles kernel only): ``"auto"`` (default: ``"halves"``
    where the resolved kernel is the roles kernel and head_dim_v is divisible by 128, else ``"one_warp"``),
    ``"one_warp"`` (PV0's warp 0 loads the whole ``tile_n x d`` block once both P V warpgroups released the
    stage) or ``"halves"`` (each P V warpgroup's warp 0 loads the half of the value columns its own warpgroup
    reads, through a per-half pipeline, as soon as its own warpgroup released it, a one-box block's page index read
    before the P V; ``kernel_roles.py``, docs/tuning.md 2.12 remedy 2 and 2.15). Identical outputs. Not a tile
    field; ``"halves"`` with ``wide_design="split_v"`` is a ValueError; with ``wide_design="auto"`` at head dims
    above 256 it is a ValueError saying why unless ``"auto"`` resolves to ``"roles"``; below head dim 257 (FA4's
    kernel) it resolves to ``"one_warp"`` (``"halves"`` with an explicit ``wide_design="split_v"`` is refused at
    every head dim).
    qk_issue: when the roles kernel's softmax warpgroup issues the next key block's S = Q K^T (roles kernel only):
    ``"auto"`` (default: ``"ahead"`` where ``v_refill`` resolves to ``"halves"`` and the K/V pages hold at least
    :data:`QK_AHEAD_MIN_PAGE` tokens or K/V are contiguous, else ``"serial"``),
    ``"serial"`` (after block i's softmax and P hand-off) or ``"ahead"`` (after block i's softmax and P's
    conversion, before P's hand-off, so S(i + 1)'s wgmma overlaps the hand-off; ``kernel_roles.py``, docs/tuning.md
    2.19). Identical outputs. Not a tile field; ``"ahead"`` follows ``"halves"``' rules above (ValueError with
    ``wide_design="split_v"`` or where ``"auto"`` does not resolve to ``"roles"``; ``"serial"`` below head dim
    257, as ``"halves"``' ``"one_warp"``). Rationale for both ``"auto"`` rules (docs/tuning.md 2.20, 2.21): together
    they were the fastest roles kernel measured on the hd-512 workloads (H200, pages of 32 and 64); at pages of 8
    and 16 S ahead was slower on the mixed batch.
    k_refill: how the roles kernel's softmax warpgroup refills its K stage (roles kernel only): ``"auto"``
    (default: ``"halves"`` where the roles kernel runs at a head dim divisible by 128, else ``"whole"``; rationale:
    docs/tuning.md 2.22, 2.23), ``"whole"`` (one barrier pair per stage: the next block's K
    is requested once S = Q K^T of the whole stage retired) or ``"halves"`` (two barrier pairs per stage, one per
    half of the head dim: S is issued as two wgmma groups over the contraction dimension, each after its half of
    K landed, and each half is released and refilled as soon as its group retired; ``kernel_roles.py``,
    "K refill by halves"). Identical outputs (the same wgmma k-steps in the same order). Not a tile field;
    ``"halves"`` follows ``v_refill="halves"``'s rules (ValueError with ``wide_design="split_v"``, or where
    ``"auto"`` does not resolve to ``"roles"``; ``"whole"`` below head dim 257) and needs head_dim divisible by
    128 (a half is whole 64-column swizzle atoms), with either ``v_refill`` and either ``qk_issue``.
    skip_allowed_first: whether NaN-safe V skips the scan of a tile's (a split's) first key block when every row of
    the tile sees every key of it (FA4 masks that block only because it is the first; its NaN / Inf reach exactly
    the rows the reference gives them to; ``kernel.py``, docs/tuning.md 2.27): ``"auto"`` (default), True or False (a
    bool; no other type, no other str). The same outputs either way, bit for bit, except where a row's weight of a
    non-finite V entry underflows to 0 (the skip then gives the reference's NaN; 2.27). It acts only in FA4's
    consumer (head dims <= 256) with ``nan_safe_v`` kept by the scan (``nan_safe_v_method`` resolved to
    ``"scan"``: at hd 256 only by name since 2.35); elsewhere it resolves to False (the kernel built without it, one
    compile key). ``"auto"`` resolves, from host shapes only, to True when the launch splits KV (``num_splits > 1``,
    either ``split_merge``) and to False otherwise (:func:`auto_skip_allowed_first`). Not a tile field; it resolves
    in :func:`resolve_launch_config`, which knows the split count.
    nan_safe_v_method: how ``nan_safe_v`` is kept in FA4's consumer (head dims <= 256): ``"auto"`` (default:
    :func:`resolve_nan_safe_v_method`, ``"recompute"`` at the head dims of :data:`AUTO_RECOMPUTE_HEAD_DIMS`, where
    it was measured faster, ``"scan"`` elsewhere), ``"scan"`` (the masked key blocks' V stages scanned and cleaned
    in shared memory in the mainloop, the additive fix-up; docs/tuning.md 2.4) or ``"recompute"`` (docs/tuning.md
    2.32, 2.34: the mainloop of ``nan_safe_v=False``; at the epilogue a test of the accumulator's real rows, and
    only in a warp that holds a non-finite entry, an fp32 recompute of exactly those entries from global memory with the tile's own LSE; a device counter of recomputing
    warps, :func:`blockdiff.attention.cute.interface.nan_recompute_count`). The same contract either way; the
    finite entries are bit-identical to ``nan_safe_v=False``'s, the recomputed ones agree within fp32-vs-bf16-P
    rounding. A str of :data:`NAN_SAFE_V_METHODS`; it resolves to ``"scan"`` where ``"recompute"`` cannot act
    (``nan_safe_v`` off, head dims above 256: one compile key; :func:`resolve_nan_safe_v_method`), and with
    ``"recompute"`` ``skip_allowed_first`` resolves to False (no scan to skip). Not a tile field.
    exact_weight: the online softmax's key weight (every kernel): True (default) weighs
    ``exp2((s - max) * scale_log2)`` (a subtraction then a multiply, the running max on raw scores;
    :class:`~blockdiff.attention.cute.kernel.ExactWeightSoftmax`), as the triton backend does, and so does NaN-safe
    V's recompute; one more FP32 operation per score. False is FA4's weight ``exp2(s * scale_log2 - max *
    scale_log2)``, one FFMA against the rounded product ``max * scale_log2``, which keeps that product's rounding
    error (up to half an ulp of it) and gives the row's best key inf or 0, a NaN row, for scores beyond ~2^31 in log2
    units (near -2e31 at scale 1): outside the contract there, kept for A/B runs (docs/ARCHITECTURE.md section 4).
    ``"auto"`` chooses per warp and key block: FA4's FFMA where every row of the warp has ``|max * scale_log2|``
    below :data:`EXACT_WEIGHT_FFMA_BELOW` (2**8: each weight is then off by half an ulp of that product at most,
    2**-17 in log2 units, so the weights of two key blocks relative to each other by 2**-16 at most, a relative
    error of 1.1e-5, 40x below fp16's rounding), the exact weight elsewhere (a warp-uniform branch, so each side
    runs as straight-line code): never the NaN rows of False. An A/B switch, not the default until its cost is
    measured (docs/tuning.md 7.65). Not a tile field.
    """

    tile_m: int | None = None
    tile_n: int | None = None
    mma_pv_is_rs: bool | None = None
    intra_wg_overlap: bool | None = None
    num_stages: int = 2
    lpt: bool | None = None
    num_splits: int | None = None
    nan_safe_v: bool = True
    split_merge: str = "auto"
    wide_design: str = "auto"
    batch_order: str = "auto"
    v_refill: str = "auto"
    qk_issue: str = "auto"
    k_refill: str = "auto"
    skip_allowed_first: bool | str = "auto"
    nan_safe_v_method: str = "auto"
    exact_weight: bool | str = True


#: ``CuteConfig.exact_weight="auto"``: FA4's one-FFMA key weight where every row of a warp has ``|max *
#: scale_log2|`` below this (2**8: the FFMA's error, half an ulp of that product, is then at most 2**-17 in log2
#: units per weight, 2**-16 between two key blocks' weights; ordinary attention scores stay far below it), the exact
#: weight elsewhere.
EXACT_WEIGHT_FFMA_BELOW = 2.0 ** 8
#: The values of ``CuteConfig.exact_weight``.
EXACT_WEIGHTS = (True, False, "auto")


#: The merges of split-KV partial outputs (CuteConfig.split_merge).
SPLIT_MERGES = ("auto", "combine", "cluster", "triton")
#: The kernels of head dims above 256 (CuteConfig.wide_design): automatic (default, :func:`auto_wide_design`), the
#: split-value kernel and the roles kernel.
WIDE_DESIGNS = ("auto", "split_v", "roles")
#: The scheduler's batch orders (CuteConfig.batch_order): automatic (default: ``"work"`` for the roles kernel, else
#: ``"given"``), batch order and longest tiles first by sequence.
BATCH_ORDERS = ("auto", "given", "work")
#: Who refills the roles kernel's V stages (CuteConfig.v_refill): automatic (default: halves where the roles
#: kernel runs at a value head dim divisible by 128), one warp for the whole block or each P V warpgroup its own
#: half of the value columns.
V_REFILLS = ("auto", "one_warp", "halves")
#: When the roles kernel's softmax warpgroup issues the next block's S (CuteConfig.qk_issue): automatic (default:
#: ahead where the V refill resolves to halves, pages of at least QK_AHEAD_MIN_PAGE), after P's hand-off or before it.
QK_ISSUES = ("auto", "serial", "ahead")
#: Smallest K/V page (tokens) at which ``qk_issue="auto"`` issues S ahead: timed on the H200, S ahead is faster on
#: both hd-512 workloads at pages of 32 and 64, slower on both at 8 and split at 16, where the mixed batch loses
#: more than the canvas gains (docs/tuning.md 2.20, 2.21).
QK_AHEAD_MIN_PAGE = 32
#: How the roles kernel refills its K stage (CuteConfig.k_refill): automatic (default: halves where the roles kernel
#: runs at a head dim divisible by 128), the whole stage at once or by head-dim halves (two wgmma groups of S, each
#: half refilled when its group retired).
K_REFILLS = ("auto", "whole", "halves")
#: Whether NaN-safe V skips the scan of a first key block every row of the tile sees whole
#: (CuteConfig.skip_allowed_first): automatic (default: on for split-KV launches, :func:`auto_skip_allowed_first`),
#: on or off.
SKIP_ALLOWED_FIRST_VALUES = ("auto", True, False)
#: How NaN-safe V is kept in FA4's consumer (CuteConfig.nan_safe_v_method): automatic (default,
#: :func:`resolve_nan_safe_v_method`), the mainloop scan and fix-up, or the epilogue test and recompute
#: (docs/tuning.md 2.32, 2.34).
NAN_SAFE_V_METHODS = ("auto", "scan", "recompute")
#: Head dims (``head_dim == head_dim_v``) at which ``nan_safe_v_method="auto"`` takes the recompute; the scan
#: elsewhere. Only where it was measured faster in two runs (both hd-256 launch kinds); the hd-128 launches lost or
#: tied, other head dims were not timed (docs/tuning.md 2.35).
AUTO_RECOMPUTE_HEAD_DIMS = frozenset({256})
#: The roles kernel's switches: (field, the value only the roles kernel builds, the value every kernel builds).
_ROLES_ONLY = (("v_refill", "halves", "one_warp"), ("qk_issue", "ahead", "serial"), ("k_refill", "halves", "whole"))
#: Most splits of the cluster merge: the portable thread-block cluster size (8 CTAs).
MAX_CLUSTER_SPLITS = 8


#: Long causal prefills at hd 128 without a window run faster with three MMA warpgroups (192-row tiles, no
#: intra-warpgroup overlap) than with FA4's 128 x 128 default, while canvas batches lose with it; chosen from the
#: host-side query-length hint only (tokens).
LONG_PREFILL_Q = 4096
LONG_PREFILL_CONFIG = dict(tile_m=192, tile_n=128, intra_wg_overlap=False)
#: Other hd-128 calls without a window (canvases, short prefills) keep FA4's 128 x 128 tiles with a third K/V
#: stage (a small gain in the cp.async sweep; a tie with two stages since the page-box loads).
HD128_CONFIG = dict(num_stages=3)

#: FA4 orders the tiles of causal and local kernels longest first, in L2 sections of heads; our kernel is built
#: ``is_local`` (per-row intervals), so FA4 would always pick that order. It pays off only when one sequence's
#: causal tiles differ in length (long prefills) and costs on canvases: longest-first from this host-side
#: ``max_seqlen_q`` (tokens) on.
LPT_MIN_SEQLEN_Q = 512


def longest_first_tiles(max_seqlen_q: int | None) -> bool:
    """Whether a call with this host hint (tokens; None: unknown) uses FA4's longest-first tile order."""
    return max_seqlen_q is None or max_seqlen_q >= LPT_MIN_SEQLEN_Q


#: Largest dynamic shared memory one block may use on SM90 (H100 / H200: 227 KB).
SMEM_LIMIT_BYTES = 232448

#: Largest head dim of the backend. Value head dims from WIDE_MIN_HEAD_DIM_V on run the split-value kernel
#: (kernel_wide.py): one warpgroup cannot hold a 64 x 512 fp32 output tile (256 registers a thread), so two
#: consumer warpgroups own half of the value columns each (docs/tuning.md, section 2.1).
MAX_HEAD_DIM = 512
WIDE_MIN_HEAD_DIM_V = 257
#: Split-value tiles: 64 query rows (one wgmma M block per consumer warpgroup); 32-key blocks, because two K/V
#: stages of them fit beside Q in 227 KB (a 64-key block fits one stage only, which serialises load and MMA).
WIDE_CONFIG = dict(tile_m=64, tile_n=32, num_stages=2)
#: Split-value tiles when the query-length hint is long (``longest_first_tiles``: >= LPT_MIN_SEQLEN_Q or unknown):
#: 64-key blocks in the one stage that fits. A long query tile walks many key blocks and is MMA-bound, so halving
#: the blocks (softmax passes, barriers) per key beats the second stage; a 256-row canvas over a split key range is
#: latency-bound and keeps two stages (measured: docs/tuning.md section 2.3).
WIDE_LONG_Q_CONFIG = dict(tile_m=64, tile_n=64, num_stages=1)
#: P slots and fp32 row-factor slots (2 + the final one, 2 rows x 128 threads each) of the split-value kernel.
_WIDE_P_SLOTS, _WIDE_SCALE_BYTES = 2, 3 * 2 * 128 * 4
#: Tiles of the roles kernel (``wide_design="roles"``) without a config: 64-key blocks in the one K / V stage that
#: fits beside Q and two P slots (the softmax warpgroup runs up to two blocks ahead of the P V warpgroups, which
#: hides the single stage's refill behind the other role's work; kernel_roles.py). Whatever the query length.
ROLES_CONFIG = dict(tile_m=64, tile_n=64, num_stages=1)
#: The roles kernel's fp32 factor slots: two per block, the final 1 / rowsum, the LSE (2 rows x 128 threads each).
_ROLES_SCALE_BYTES = 4 * 2 * 128 * 4


def is_wide(head_dim: int, head_dim_v: int) -> bool:
    """Whether a call runs the split-value kernel (either head dim above FA4 SM90's 256)."""
    return head_dim > 256 or head_dim_v > 256


def unsupported_head_dims(head_dim: int, head_dim_v: int) -> str | None:
    """Why the backend cannot run these head dims (None: it can). FA4's kernel takes 8..256 (multiples of 8);
    the split-value kernel equal head dims in (256, 512], multiples of 32 (two 16-aligned halves of V)."""
    if not is_wide(head_dim, head_dim_v):
        for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if not (8 <= d and d % 8 == 0):
                return f"{name} must be a multiple of 8 in [8, 256] (FA4 SM90), got {d}"
        return None
    if head_dim != head_dim_v or not (256 < head_dim <= MAX_HEAD_DIM and head_dim % 32 == 0):
        return ("head dims above 256 run the split-value kernel, which needs head_dim == head_dim_v, a multiple "
                f"of 32 in (256, {MAX_HEAD_DIM}]; got head_dim {head_dim}, head_dim_v {head_dim_v}")
    return None


def config_smem_bytes(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> int:
    """Shared memory (bytes) of a resolved config in FA4's SM90 forward: Q (the output tile reuses it) +
    ``num_stages`` x (K + V) tiles + P when it goes through shared memory (not ``mma_pv_is_rs``), 2-byte
    elements, plus 1 KB for barriers and alignment (FA4's sm90_config_search rule, with num_stages). The
    split-value kernel (:func:`is_wide`) has two P slots and 3 KB of fp32 row factors; the roles kernel
    (``cfg.wide_design == "roles"``) two P slots and 4 KB of factors (kernel_roles.py's table)."""
    if is_wide(head_dim, head_dim_v):
        p_tiles = _WIDE_P_SLOTS * cfg.tile_m * cfg.tile_n
        scale = _ROLES_SCALE_BYTES if cfg.wide_design == "roles" else _WIDE_SCALE_BYTES
        return (2 * (cfg.tile_m * head_dim + cfg.num_stages * cfg.tile_n * (head_dim + head_dim_v) + p_tiles)
                + scale + 1024)
    p_tile = 0 if cfg.mma_pv_is_rs else cfg.tile_m * cfg.tile_n
    return 2 * (cfg.tile_m * head_dim + cfg.num_stages * cfg.tile_n * (head_dim + head_dim_v) + p_tile) + 1024


def check_config_fits(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> None:
    """ValueError naming the config when its shared memory exceeds what one SM90 block can have (the
    launch would otherwise fail with a CUDA invalid-configuration error after compiling)."""
    smem = config_smem_bytes(cfg, head_dim, head_dim_v)
    if smem > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"config {cfg} needs ~{smem} bytes of shared memory at head_dim {head_dim} / head_dim_v "
            f"{head_dim_v}, more than the {SMEM_LIMIT_BYTES} an SM90 block can use: lower num_stages, "
            "tile_n or tile_m")


def _fa4_tile_size(head_dim: int, head_dim_v: int, is_local: bool):
    """FA4's SM90 forward tile heuristic (``m_block_size``, ``n_block_size``, ``mma_pv_is_rs``,
    ``intra_wg_overlap``). Raises ImportError naming :data:`REQUIRED` without flash-attn-4."""
    try:
        # flash-attn-4 is optional: imported at first use so this module loads without it
        from flash_attn.cute.interface import _tile_size_fwd_sm90
    except ImportError as e:
        raise ImportError(f"attention backend 'cute' needs {REQUIRED}; importing flash_attn.cute failed: {e}") from e
    return _tile_size_fwd_sm90(head_dim, head_dim_v, False, is_local)


def resolve_config(head_dim: int, head_dim_v: int, window_size, config=None, max_seqlen_q: int | None = None, *,
                   page_size: int | None = None) -> CuteConfig:
    """Tile shape for a call: FA4's SM90 forward heuristic (local variant when windowed) unless overridden.

    ``max_seqlen_q`` (host int, tokens) selects the long-prefill tiles at hd 128 without a window (see
    ``LONG_PREFILL_CONFIG``) and the longest-first tile order (``LPT_MIN_SEQLEN_Q``; None counts as long).
    Any upper bound gives correct results, but a static capacity >= 512 gives canvas batches the long-prefill
    choices: pass the step's true maximum query length. Explicit ``config`` fields always win.

    ``page_size`` (keyword; tokens a K/V page, None: contiguous K/V or not known) is what ``wide_design="auto"``
    reads at head dims above 256: the roles kernel only where its tiles load the pages by TMA boxes
    (:func:`auto_wide_design`), and S issued ahead only from :data:`QK_AHEAD_MIN_PAGE`-token pages. The switches
    ``wide_design``, ``batch_order``, ``v_refill``, ``qk_issue`` and ``k_refill`` resolve here (never ``"auto"`` in
    the result; a resolved config re-resolves to itself at any page size); ``split_merge`` and
    ``skip_allowed_first`` in :func:`resolve_launch_config`.

    Head dims above 256 (:func:`is_wide`) resolve through :func:`resolve_wide_config` (no flash-attn-4 needed).

    Raises:
        ValueError: head dims the backend does not run (:func:`unsupported_head_dims`), a config field outside
            its range (:func:`check_config`; checked before flash-attn-4 is imported), the resolved tiles do not
            fit SM90 shared memory (:func:`check_config_fits`), a wide config field outside what its kernel
            takes, ``v_refill="halves"`` / ``qk_issue="ahead"`` / ``k_refill="halves"`` where the kernel does not
            resolve to the roles kernel, ``"halves"`` at a head dim not divisible by 128, or ``page_size`` below 1.
        TypeError: ``config`` is not a CuteConfig, a dict or None, or a field of the wrong type / an unknown
            field (:func:`check_config`); ``page_size`` neither None nor an int.
        ImportError: flash-attn-4 is not installed (its heuristic gives the unset fields).
    """
    _check_head_dims(head_dim, head_dim_v)
    _check_page_size(page_size)
    config, switches = _split_switches(check_config(config, head_dims=(head_dim, head_dim_v)))
    if is_wide(head_dim, head_dim_v):  # head dims and config checked above
        switches = _resolve_wide_switches(head_dim, head_dim_v, config, switches, page_size)
        return replace(_resolve_wide(head_dim, head_dim_v, config, max_seqlen_q, switches["wide_design"]),
                       **switches)
    switches["wide_design"] = "split_v"  # FA4's kernel below head dim 257: one compile key for both designs
    switches["v_refill"] = "one_warp"  # likewise: roles-kernel switches
    switches["qk_issue"] = "serial"
    switches["k_refill"] = "whole"
    if switches["batch_order"] == "auto":  # the roles kernel's default only
        switches["batch_order"] = "given"
    if config is None:
        config = CuteConfig()
        if (head_dim == head_dim_v == 128 and window_size is None and max_seqlen_q is not None
                and max_seqlen_q >= LONG_PREFILL_Q):
            config = CuteConfig(**LONG_PREFILL_CONFIG)
        elif head_dim == head_dim_v == 128 and window_size is None:
            config = CuteConfig(**HD128_CONFIG)
    elif isinstance(config, dict):
        config = CuteConfig(**config)
    base = _fa4_tile_size(head_dim, head_dim_v, window_size is not None)
    resolved = CuteConfig(
        tile_m=config.tile_m or base.m_block_size,
        tile_n=config.tile_n or base.n_block_size,
        mma_pv_is_rs=base.mma_pv_is_rs if config.mma_pv_is_rs is None else config.mma_pv_is_rs,
        intra_wg_overlap=base.intra_wg_overlap if config.intra_wg_overlap is None else config.intra_wg_overlap,
        num_stages=config.num_stages,
        lpt=longest_first_tiles(max_seqlen_q) if config.lpt is None else bool(config.lpt),
        num_splits=_check_num_splits(config.num_splits),
        **switches,
    )
    check_config_fits(resolved, head_dim, head_dim_v)
    return resolved


def _check_page_size(page_size) -> None:
    """``page_size`` of the resolve functions: None or an int >= 1 (no bool, no float)."""
    if page_size is None:
        return
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be None (contiguous K/V or not known) or an int, got "
                        f"{type(page_size).__name__} ({page_size!r})")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1 (tokens a K/V page) or None, got {page_size}")


#: Fields besides the switches that keep ``wide_design="auto"`` on the roles kernel: they schedule its tiles (split
#: count, tile order) without changing them, and the roles kernel takes every value of them.
_ROLES_AUTO_FIELDS = ("num_splits", "lpt")


def _roles_blocker(head_dim: int, head_dim_v: int, config, split_merge: str,
                   page_size: int | None) -> tuple[str, bool] | None:
    """Why ``wide_design="auto"`` does not resolve to the roles kernel (None: it does), on checked arguments, and
    whether an explicit ``wide_design="roles"`` would run there (no cluster merge, and the pages load by TMA boxes
    at the tile_n it would get); ``config`` is the non-switch part of :func:`_split_switches`. The rule:
    :func:`auto_wide_design`."""
    fields_ = {} if config is None else (
        {f: config[f] for f in _CONFIG_FIELDS if f in config} if isinstance(config, dict) else _set_fields(config))
    tile_n = fields_.get("tile_n") or ROLES_CONFIG["tile_n"]
    runs = split_merge != "cluster" and (page_size is None or page_box_tma_ok(page_size, tile_n))
    if not head_dim == head_dim_v == 512:
        return (f"the roles kernel is the automatic choice at head dim 512 only (the one measured), got head_dim "
                f"{head_dim} / head_dim_v {head_dim_v}"), runs
    tiles = [f for f in fields_ if f not in _ROLES_AUTO_FIELDS]  # field order, for a dict and a CuteConfig alike
    if tiles:
        return (f"the config sets {tiles}: the roles kernel is the automatic choice with its automatic tiles "
                f"only (set no field besides the switches and {list(_ROLES_AUTO_FIELDS)})"), runs
    if split_merge == "cluster":
        return "split_merge 'cluster' is not built for the roles kernel", False
    if page_size is not None and not page_box_tma_ok(page_size, ROLES_CONFIG["tile_n"]):
        return (f"page size {page_size} does not load by TMA page boxes at the roles tile_n "
                f"{ROLES_CONFIG['tile_n']} (a multiple of 8 that divides it or is a multiple of it)"), False
    return None


def auto_wide_design(head_dim: int, head_dim_v: int, config=None, *, page_size: int | None = None) -> str:
    """The kernel ``wide_design="auto"`` resolves to at head dims above 256: ``"roles"`` iff head_dim ==
    head_dim_v == 512, ``config`` sets no tile field (only the switches, ``num_splits`` and ``lpt``: the roles
    kernel's automatic tiles; with 32-key tiles it was slower than the split-value kernel, docs/tuning.md 2.9), its
    ``split_merge`` is not
    ``"cluster"`` (no roles variant) and ``page_size`` (None: contiguous K/V or not known) loads by TMA page
    boxes at the roles tile_n (:func:`page_box_tma_ok` with :data:`ROLES_CONFIG`); else ``"split_v"``. Below
    head dim 257: ``"split_v"`` (FA4's kernel either way). Rationale: the roles kernel was measured faster on
    every hd-512 workload on the H200 (docs/tuning.md 2.17). An explicit ``wide_design`` in ``config`` is not
    read: this is the rule for ``"auto"``.

    Raises:
        As :func:`check_config` for ``config``; TypeError / ValueError naming ``page_size`` (None or an int >= 1)
        and the head dims (:func:`unsupported_head_dims`).
    """
    _check_head_dims(head_dim, head_dim_v)
    _check_page_size(page_size)
    config, switches = _split_switches(check_config(config, head_dims=(head_dim, head_dim_v)))
    if not is_wide(head_dim, head_dim_v):
        return "split_v"
    return "split_v" if _roles_blocker(head_dim, head_dim_v, config, switches["split_merge"], page_size) else "roles"


def _resolve_wide_switches(head_dim: int, head_dim_v: int, config, switches: dict, page_size: int | None) -> dict:
    """The switches of a wide call (head dims above 256, arguments checked) with ``wide_design`` and
    ``batch_order`` resolved (:func:`auto_wide_design`; ``batch_order="auto"``: ``"work"`` for the roles kernel,
    else ``"given"``), ``v_refill`` / ``qk_issue`` / ``k_refill`` resolved (``"auto"``: :class:`CuteConfig`) and
    their roles-only values (``"halves"``, ``"ahead"``) checked against the resolved kernel and the head dims."""
    switches = dict(switches)
    explicit = [f"{name} {value!r}" for name, value, _ in _ROLES_ONLY if switches[name] == value]
    if switches["wide_design"] == "auto":
        blocker = _roles_blocker(head_dim, head_dim_v, config, switches["split_merge"], page_size)
        if blocker is not None and explicit:
            why, roles_runs = blocker
            plain = " and ".join(f"{name} {p!r}" for name, value, p in _ROLES_ONLY if switches[name] == value)
            halves_ok = ((switches["v_refill"] != "halves" or head_dim_v % 128 == 0)
                         and (switches["k_refill"] != "halves" or head_dim % 128 == 0))
            fix = (f"set wide_design 'roles' or use {plain}"
                   if roles_runs and halves_ok
                   else f"use {plain}")  # (halves: head dims divisible by 128, below)
            verb = "needs" if len(explicit) == 1 else "need"
            raise ValueError(f"config {' and '.join(explicit)} {verb} the roles kernel, and wide_design 'auto' "
                             f"resolves to 'split_v' here: {why}; {fix}")
        switches["wide_design"] = "split_v" if blocker else "roles"
    roles = switches["wide_design"] == "roles"
    if switches["batch_order"] == "auto":
        switches["batch_order"] = "work" if roles else "given"
    _check_halves_head_dims(head_dim, head_dim_v, switches)
    if switches["k_refill"] == "auto":  # halves: bit-identical, faster on both hd-512 workloads (2.22, 2.23)
        switches["k_refill"] = "halves" if roles and head_dim % 128 == 0 else "whole"
    if switches["v_refill"] == "auto":  # the measured best (docs/tuning.md 2.20)
        switches["v_refill"] = "halves" if roles and head_dim_v % 128 == 0 else "one_warp"
    if switches["qk_issue"] == "auto":  # S ahead gains with halves only; from QK_AHEAD_MIN_PAGE-token pages (2.21)
        pages_ok = page_size is None or page_size >= QK_AHEAD_MIN_PAGE
        switches["qk_issue"] = "ahead" if switches["v_refill"] == "halves" and pages_ok else "serial"
    return switches


def _check_halves_head_dims(head_dim: int, head_dim_v: int, values: dict) -> None:
    """ValueError where ``values`` (config fields by name) asks for ``v_refill`` / ``k_refill`` ``"halves"`` at a
    wide head dim not divisible by 128 (fields not yet checked: only compared with ``"halves"``)."""
    if not is_wide(head_dim, head_dim_v):
        return
    if values.get("v_refill") == "halves" and head_dim_v % 128:
        # each half of V must be whole shared-memory swizzle atoms (64 columns at head dims divisible by 64,
        # else 32) and whole page boxes: of the wide head dims (multiples of 32 in (256, 512]) only 384 and 512
        raise ValueError(f"config v_refill 'halves' needs head_dim_v divisible by 128 (384 or 512), got "
                         f"{head_dim_v}: each P V warpgroup's half of V must be whole swizzle atoms; use "
                         f"v_refill 'one_warp' or 'auto'")
    if values.get("k_refill") == "halves" and head_dim % 128:
        # as v_refill's halves: each half of K (the contraction dimension of S) must be whole 64-column swizzle atoms
        raise ValueError(f"config k_refill 'halves' needs head_dim divisible by 128 (384 or 512), got {head_dim}: "
                         f"each half of K must be whole swizzle atoms; use k_refill 'whole' or 'auto'")


#: CuteConfig fields that are switches, not tile fields, with their defaults.
_SWITCHES = dict(nan_safe_v=True, split_merge="auto", wide_design="auto", batch_order="auto",
                 v_refill="auto", qk_issue="auto", k_refill="auto", skip_allowed_first="auto",
                 nan_safe_v_method="auto", exact_weight=True)


#: CuteConfig fields whose default is None ("automatic"): a dict giving them None leaves them unset.
_NONE_DEFAULT_FIELDS = frozenset(f.name for f in fields(CuteConfig) if f.default is None)


def _set_fields(config: CuteConfig) -> dict:
    """The fields of ``config`` that differ from ``CuteConfig()``, in field order."""
    default = CuteConfig()
    return {f: getattr(config, f) for f in _CONFIG_FIELDS if getattr(config, f) != getattr(default, f)}


def _split_switches(config):
    """``(config without the switches, {switch: value})`` (``nan_safe_v``, ``split_merge``, ``wide_design``,
    ``batch_order``, ``v_refill``, ``qk_issue``, ``k_refill``, ``skip_allowed_first``, ``nan_safe_v_method``,
    ``exact_weight``): they
    are not tile fields, so
    a config that sets only them resolves the tiles as None does (the tuned automatic choices)."""
    if config is None:
        return None, dict(_SWITCHES)
    if isinstance(config, dict):  # a field whose default is None given as None is unset, as in a CuteConfig
        rest = {k: v for k, v in config.items()
                if k not in _SWITCHES and not (v is None and k in _NONE_DEFAULT_FIELDS)}
        return (rest or None), {k: config.get(k, d) for k, d in _SWITCHES.items()}
    rest = replace(config, **_SWITCHES)
    return (None if rest == CuteConfig() else rest), {k: getattr(config, k) for k in _SWITCHES}


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):  # a bool is not a split count
        raise TypeError(f"config num_splits must be None or an int, got {type(num_splits).__name__} ({num_splits!r})")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"config num_splits must be None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    return num_splits


def _check_head_dims(head_dim, head_dim_v) -> None:
    for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"{name} must be an int, got {type(d).__name__} ({d!r})")
    why = unsupported_head_dims(head_dim, head_dim_v)
    if why is not None:
        raise ValueError(f"backend 'cute': {why}")


_CONFIG_FIELDS = ("tile_m", "tile_n", "mma_pv_is_rs", "intra_wg_overlap", "num_stages", "lpt", "num_splits",
                  "nan_safe_v", "split_merge", "wide_design", "batch_order", "v_refill", "qk_issue", "k_refill",
                  "skip_allowed_first", "nan_safe_v_method", "exact_weight")


def _check_field(name: str, v) -> None:
    choices = {"wide_design": WIDE_DESIGNS, "split_merge": SPLIT_MERGES, "batch_order": BATCH_ORDERS,
               "v_refill": V_REFILLS, "qk_issue": QK_ISSUES, "k_refill": K_REFILLS,
               "nan_safe_v_method": NAN_SAFE_V_METHODS}.get(name)
    if choices is not None:  # a str switch with named values
        if not isinstance(v, str):
            raise TypeError(f"config {name} must be a str, one of {choices}, got {type(v).__name__} ({v!r})")
        if v not in choices:
            raise ValueError(f"config {name} must be one of {choices}, got {v!r}")
        return
    if name == "nan_safe_v":
        if not isinstance(v, bool):
            raise TypeError(f"config {name} must be a bool, got {type(v).__name__} ({v!r})")
        return
    if name in ("skip_allowed_first", "exact_weight"):  # "auto" or a bool (1 / 0 / None are not: no coercion)
        if isinstance(v, str):
            if v != "auto":
                raise ValueError(f"config {name} must be 'auto', True or False, got {v!r}")
        elif not isinstance(v, bool):
            raise TypeError(f"config {name} must be 'auto' or a bool, got {type(v).__name__} ({v!r})")
        return
    if name in ("mma_pv_is_rs", "intra_wg_overlap", "lpt"):
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"config {name} must be None or a bool, got {type(v).__name__} ({v!r})")
        return
    if name == "num_splits":
        _check_num_splits(v)
        return
    if name == "num_stages" and v is None:
        raise TypeError("config num_stages must be an int >= 1, got None")
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"config {name} must be {'an int' if name == 'num_stages' else 'None or an int'}, got "
                        f"{type(v).__name__} ({v!r})")
    # wgmma: 64 query rows per MMA warpgroup, key tiles in steps of 8 (the MMA's N granularity)
    step = {"tile_m": 64, "tile_n": 8, "num_stages": 1}[name]
    if v < 1 or v % step:
        rule = ">= 1" if step == 1 else f"a positive multiple of {step}"
        raise ValueError(f"config {name} must be {rule}, got {v}")


def check_config(config, *, head_dims: tuple[int, int] | None = None):
    """The ``config`` argument checked field by field, before anything is resolved or imported: None, a dict
    with :class:`CuteConfig` field names, or a CuteConfig (returned as given). ``tile_m`` / ``tile_n``: None or a
    positive int, ``tile_m`` a multiple of 64 (query rows of one MMA warpgroup), ``tile_n`` a multiple of 8 (the
    MMA's N step); ``num_stages``: an int >= 1; ``mma_pv_is_rs`` / ``intra_wg_overlap`` / ``lpt``: None or a
    bool; ``num_splits``: None or an int in [1, :data:`MAX_SPLITS`]; ``nan_safe_v``: a bool; ``split_merge``:
    one of :data:`SPLIT_MERGES`, and ``"cluster"`` with an explicit ``num_splits`` at most
    :data:`MAX_CLUSTER_SPLITS`; ``wide_design``: one of :data:`WIDE_DESIGNS`, not with ``split_merge="cluster"``;
    ``batch_order``: one of :data:`BATCH_ORDERS`; ``v_refill``: one of :data:`V_REFILLS`, ``"halves"`` not with
    ``wide_design="split_v"`` (with ``"auto"``, :func:`resolve_config` refuses it where ``"auto"`` does not pick
    the roles kernel); ``qk_issue``: one of :data:`QK_ISSUES`, ``"ahead"`` as ``"halves"``; ``k_refill``: one of
    :data:`K_REFILLS`, ``"halves"`` as ``v_refill``'s; ``skip_allowed_first``: ``"auto"`` or a bool;
    ``nan_safe_v_method``: one of :data:`NAN_SAFE_V_METHODS`; ``exact_weight``: a bool or ``"auto"``.
    Kernel-specific rules (the split-value kernel's tiles, shared memory, whether the cluster merge's tile fits)
    are :func:`resolve_config`'s and :func:`resolve_launch_config`'s. ``head_dims`` (keyword; ``(head_dim,
    head_dim_v)`` where the call knows them): a ``"halves"`` value those head dims cannot take is refused by its
    own rule before the ``wide_design="split_v"`` one, whose fix ``wide_design 'roles'`` would fail there.

    Raises:
        TypeError: ``config`` of another type, an unknown field, a field of the wrong type (bool for an int, a
            float, a str: no coercion).
        ValueError: a field out of its range (0 is not "unset": use None).
    """
    if config is None:
        return None
    if isinstance(config, dict):
        unknown = sorted(map(str, set(config) - set(_CONFIG_FIELDS)))
        if unknown:
            raise TypeError(f"config has unknown fields {unknown}; CuteConfig fields: {list(_CONFIG_FIELDS)}")
        items = config.items()
    elif isinstance(config, CuteConfig):
        items = ((f, getattr(config, f)) for f in _CONFIG_FIELDS)
    else:
        raise TypeError(f"config must be a CuteConfig, a dict or None, got {type(config).__name__}")
    values = {}
    for name, v in items:
        _check_field(name, v)
        values[name] = v
    n = values.get("num_splits")
    if values.get("split_merge") == "cluster" and values.get("wide_design") == "roles":
        raise ValueError("config split_merge 'cluster' is not built for wide_design 'roles'; use split_merge "
                         "'triton' or 'auto'")
    roles_only = [row for row in _ROLES_ONLY if values.get(row[0]) == row[1]]
    if roles_only and values.get("wide_design", "auto") == "split_v":
        if head_dims is not None:  # halves these head dims cannot take: that rule (its fix resolves; 'roles' would not)
            _check_halves_head_dims(*head_dims, values)
        given = " and ".join(f"{name} {value!r}" for name, value, _ in roles_only)
        plain = " and ".join(f"{name} {p!r} (or 'auto')" for name, _, p in roles_only)
        raise ValueError(f"config {given} {'is' if len(roles_only) == 1 else 'are'} built for the roles kernel only, "
                         f"got wide_design 'split_v'; set wide_design 'roles' (or 'auto', which picks it at head dim "
                         f"512 with the automatic tiles) or {plain}")
    if values.get("split_merge") == "cluster" and n is not None and n > MAX_CLUSTER_SPLITS:
        raise ValueError(f"config split_merge 'cluster' takes at most {MAX_CLUSTER_SPLITS} splits (the portable "
                         f"cluster size), got num_splits {n}; use split_merge 'triton'")
    return config


def resolve_wide_config(head_dim: int, head_dim_v: int, config=None, max_seqlen_q: int | None = None, *,
                        page_size: int | None = None) -> CuteConfig:
    """Tile shape of the kernels of head dims above 256, after ``wide_design`` resolves (``"auto"``:
    :func:`auto_wide_design`, with ``page_size`` as in :func:`resolve_config`). The split-value kernel: without
    a config :data:`WIDE_LONG_Q_CONFIG` when :func:`longest_first_tiles` holds for ``max_seqlen_q`` (long or
    unknown), else :data:`WIDE_CONFIG`; a dict overrides fields of :data:`WIDE_CONFIG`. The roles kernel: likewise
    on :data:`ROLES_CONFIG`, whatever the query length. A CuteConfig resolves as the dict of its fields that
    differ from ``CuteConfig()`` (so its ``num_stages`` at the default 2 counts as unset).

    ``tile_m`` must be 64 and ``tile_n`` a multiple of 16; ``mma_pv_is_rs`` / ``intra_wg_overlap`` are fixed
    by the kernel (WG0 keeps P in registers, WG1 reads it from shared memory; overlap on) and resolve to
    False / True (an explicit other value is a ValueError). ``lpt`` as :func:`resolve_config`. A dict without
    ``num_stages`` gets the most stages that fit (a 64-key block fits one).

    Raises:
        TypeError: ``config`` is not a CuteConfig, a dict or None; a field of the wrong type or an unknown field
            (:func:`check_config`); ``page_size`` neither None nor an int.
        ValueError: head dims outside the wide kernels' (:func:`unsupported_head_dims`), a field outside the
            above, the tiles do not fit SM90 shared memory, ``v_refill="halves"`` / ``qk_issue="ahead"`` /
            ``k_refill="halves"`` without the roles kernel, ``"halves"`` at a head dim not divisible by 128, or
            ``page_size`` below 1.
    """
    _check_head_dims(head_dim, head_dim_v)
    _check_page_size(page_size)
    config, switches = _split_switches(check_config(config, head_dims=(head_dim, head_dim_v)))
    switches = _resolve_wide_switches(head_dim, head_dim_v, config, switches, page_size)
    return replace(_resolve_wide(head_dim, head_dim_v, config, max_seqlen_q, switches["wide_design"]), **switches)


def _resolve_wide(head_dim: int, head_dim_v: int, config, max_seqlen_q: int | None,
                  wide_design: str = "split_v") -> CuteConfig:
    """:func:`resolve_wide_config` after its argument checks (head dims, :func:`check_config`). ``wide_design``
    ``"roles"``: :data:`ROLES_CONFIG` without a config (and as the base of a dict), its shared-memory rule."""
    roles = wide_design == "roles"
    if isinstance(config, CuteConfig):  # its fields at their defaults are unset, as a dict's missing keys
        config = _set_fields(config)
    if config is None:
        config = CuteConfig(**(ROLES_CONFIG if roles else WIDE_LONG_Q_CONFIG if longest_first_tiles(max_seqlen_q)
                               else WIDE_CONFIG))
    elif isinstance(config, dict):
        fields_ = {**(ROLES_CONFIG if roles else WIDE_CONFIG), **config}
        if "num_stages" not in config:  # the most K/V stages that fit (2 at 32-key blocks, 1 at 64)
            fields_["num_stages"] = max(
                [1] + [s for s in (1, 2) if config_smem_bytes(
                    CuteConfig(**{**fields_, "num_stages": s, "wide_design": wide_design}), head_dim, head_dim_v)
                    <= SMEM_LIMIT_BYTES])
        config = CuteConfig(**fields_)
    tile_m = WIDE_CONFIG["tile_m"] if config.tile_m is None else config.tile_m
    tile_n = WIDE_CONFIG["tile_n"] if config.tile_n is None else config.tile_n
    if tile_m != 64:
        raise ValueError(f"config tile_m must be 64 for head dims above 256 (one wgmma row block per consumer "
                         f"warpgroup), got {tile_m}")
    if tile_n % 16 != 0 or tile_n <= 0:
        raise ValueError(f"config tile_n must be a positive multiple of 16 for head dims above 256, got {tile_n}")
    if config.mma_pv_is_rs not in (None, False) or config.intra_wg_overlap not in (None, True):
        raise ValueError("config mma_pv_is_rs / intra_wg_overlap are fixed by the split-value kernel (head dims "
                         f"above 256): leave them None, got {config.mma_pv_is_rs} / {config.intra_wg_overlap}")
    if config.num_stages < 1:
        raise ValueError(f"config num_stages must be >= 1, got {config.num_stages}")
    resolved = CuteConfig(tile_m=tile_m, tile_n=tile_n, mma_pv_is_rs=False, intra_wg_overlap=True,
                          num_stages=config.num_stages,
                          lpt=longest_first_tiles(max_seqlen_q) if config.lpt is None else bool(config.lpt),
                          num_splits=_check_num_splits(config.num_splits), wide_design=wide_design)
    check_config_fits(resolved, head_dim, head_dim_v)
    return resolved


def page_box_tma_ok(page_size: int, tile_n: int) -> bool:
    """Whether paged K/V with ``page_size``-token pages load by TMA in boxes of ``min(page_size, tile_n)`` rows.

    The boxes must tile both the page and the key tile (one divides the other) and start 1 KB-aligned in a
    128-byte-swizzled K/V stage (a multiple of 8 rows). ``page_size == tile_n`` is one box per stage.
    """
    return page_size % 8 == 0 and (tile_n % page_size == 0 or page_size % tile_n == 0)


#: Page boxes per K / V stage the split-value kernel's producer takes (2 x 8 TMA copies of 64 columns at hd 512;
#: more spill its registers): smaller pages load by cp.async there.
WIDE_MAX_PAGE_BOXES = 2


def kv_load_path(page_size: int | None, tile_n: int, max_boxes: int | None = None) -> str:
    """How the kernel loads K/V: ``"tma"`` (contiguous K/V, FA4's producer), ``"tma_boxes"`` (paged, our
    producer: one TMA box per page slice, ``tile_n // page_size`` boxes per K/V stage, one box when
    ``page_size == tile_n``, one box per ``tile_n`` rows of a larger page; V rows past a sequence's last key
    zeroed) or ``"cp.async"`` (FA4's paged fallback, per-row page lookups, zero-filled past the last key).

    ``max_boxes`` (None: any) caps the boxes per stage (``tile_n // page_size``); pages smaller than
    ``tile_n // max_boxes`` go to cp.async (the split-value kernel: :data:`WIDE_MAX_PAGE_BOXES`).

    Rationale: FA4's own paged TMA path needs ``page_size == tile_n``, and its cp.async path is markedly slower
    than contiguous loads on hd-128 canvases; page-sized boxes bring paged loads to contiguous speed.
    """
    if page_size is None:
        return "tma"
    if max_boxes is not None and page_size * max_boxes < tile_n:
        return "cp.async"
    return "tma_boxes" if page_box_tma_ok(page_size, tile_n) else "cp.async"


#: Split-KV (kernel_split.py): at most this many splits (FA4's combine takes up to 256; more than 16 only adds
#: merge traffic), each with at least MIN_KEYS_PER_SPLIT keys (a split's prologue, epilogue and share of the
#: merge cost about as much as that many keys of its loop).
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 1024


def grid_tiles(total_q: int, num_seqs: int, num_kv_heads: int, qhead_per_kvhead: int, tile_m: int) -> int:
    """Query tiles FA4's varlen scheduler launches (its grid: packed rows plus one partial tile per sequence,
    times the KV heads; PackGQA packs ``qhead_per_kvhead`` query heads into a tile's rows). Host ints only."""
    return (total_q * qhead_per_kvhead + num_seqs * (tile_m - 1)) // tile_m * num_kv_heads


def choose_num_splits(num_tiles: int, max_keys: int, num_sms: int) -> int:
    """Split-KV chunks per query tile, from host shapes (no device read, so a CUDA graph keeps it).

    Splits only a grid that fills at most half of the SMs (few long sequences: batch-1 canvases over a long
    context), to at most one wave (``num_sms // num_tiles``, one CTA per SM), with at least
    :data:`MIN_KEYS_PER_SPLIT` keys of the longest sequence's bound ``max_keys`` per split, and at most
    :data:`MAX_SPLITS`. Rationale: a grid of at least half a wave gains less from filling the rest than the
    workspace and merge cost; within one wave every split runs concurrently.

    Raises:
        TypeError: an argument that is not an int (bool, float, None). ValueError: a count below 1 or a negative
            key bound.
    """
    for name, v in (("num_tiles", num_tiles), ("max_keys", max_keys), ("num_sms", num_sms)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if num_tiles < 1 or num_sms < 1 or max_keys < 0:
        raise ValueError(f"num_tiles / num_sms must be >= 1 and max_keys >= 0, got {num_tiles}, {num_sms}, "
                         f"{max_keys}")
    if 2 * num_tiles > num_sms:
        return 1
    return max(1, min(num_sms // num_tiles, max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def key_bound(keys_capacity: int, max_seqlen_k: int | None, window_size, max_seqlen_q: int) -> int:
    """Upper bound on the keys one query tile visits, from host ints: the cache capacity of a sequence (paged:
    block-table width x page size; contiguous: all cache rows), the ``max_seqlen_k`` hint when given, and with
    a window ``W`` the widest row span ``2 W + max_seqlen_q + 1`` (symmetric bidirectional rows)."""
    bound = keys_capacity if max_seqlen_k is None else min(keys_capacity, max_seqlen_k)
    if window_size is not None:
        bound = min(bound, 2 * window_size + max_seqlen_q + 1)
    return max(bound, 0)


def resolve_launch_config(head_dim: int, head_dim_v: int, window_size, config=None, *, total_q: int,
                          num_seqs: int, num_kv_heads: int, qhead_per_kvhead: int, keys_capacity: int,
                          max_seqlen_q: int, max_seqlen_k: int | None, num_sms: int,
                          page_size: int | None = None) -> CuteConfig:
    """:func:`resolve_config` plus the split count when the config leaves it None (:func:`choose_num_splits` on
    :func:`grid_tiles` and :func:`key_bound`) and the split merge: ``"auto"`` resolves here
    (:func:`auto_split_merge`), so the result's ``split_merge`` is ``"combine"``, ``"cluster"`` or ``"triton"``,
    and ``"combine"`` whenever there is one split; ``batch_order="work"`` (explicit, or ``"auto"`` resolved to it
    for the roles kernel by :func:`resolve_config`) resolves to ``"given"`` with at most one sequence (nothing to
    order: the kernel without the permutation); ``skip_allowed_first`` resolves here to a bool
    (:func:`auto_skip_allowed_first`: ``"auto"`` on split-KV launches only; False wherever it cannot act), and
    ``nan_safe_v_method`` to ``"scan"`` wherever ``"recompute"`` cannot act (:func:`resolve_nan_safe_v_method`).
    Host ints
    only: ``total_q`` (``q.shape[0]``), ``num_seqs``
    (``cu_seqlens_q.shape[0] - 1``), ``keys_capacity`` (paged: block-table width x page size; contiguous: cache
    rows), the hints, ``num_sms``, ``page_size`` (paged: ``k_cache.shape[1]``; None: contiguous K/V or not known;
    read by ``wide_design="auto"``, :func:`auto_wide_design`).

    Raises:
        As :func:`resolve_config` (``page_size`` included); ValueError also when an explicit
        ``split_merge="cluster"`` meets a tile whose fp32 merge tile does not fit (:func:`cluster_merge_fits`).
    """
    cfg = resolve_config(head_dim, head_dim_v, window_size, config, max_seqlen_q, page_size=page_size)
    if cfg.batch_order == "work" and num_seqs <= 1:
        cfg = replace(cfg, batch_order="given")
    cluster = cfg.split_merge == "cluster"
    if cfg.num_splits is None:
        tiles = grid_tiles(total_q, num_seqs, num_kv_heads, qhead_per_kvhead, cfg.tile_m)
        keys = key_bound(keys_capacity, max_seqlen_k, window_size, max_seqlen_q)
        n = choose_num_splits(max(tiles, 1), keys, num_sms)
        cfg = replace(cfg, num_splits=min(n, MAX_CLUSTER_SPLITS) if cluster else n)
    if cfg.split_merge == "auto":
        cfg = replace(cfg, split_merge=auto_split_merge(cfg, head_dim, head_dim_v))
        cluster = cfg.split_merge == "cluster"
    if cfg.split_merge in ("cluster", "triton") and cfg.num_splits == 1:
        cfg = replace(cfg, split_merge="combine")  # one split: the plain kernel, one compiled kernel for all
    elif cluster and not cluster_merge_fits(cfg, head_dim, head_dim_v):
        raise ValueError(
            f"config {cfg}: the cluster merge's fp32 output tile ({cfg.tile_m} x {head_dim_v} x 4 B plus the LSEs) "
            "does not fit the Q / K / V shared-memory buffers it reuses: use split_merge 'triton' or larger tiles")
    cfg = replace(cfg, nan_safe_v_method=resolve_nan_safe_v_method(cfg, head_dim, head_dim_v))
    return replace(cfg, skip_allowed_first=auto_skip_allowed_first(cfg, head_dim, head_dim_v))


def resolve_nan_safe_v_method(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> str:
    """The value ``nan_safe_v_method`` resolves to, ``"scan"`` or ``"recompute"``: ``"recompute"`` only where it acts
    (``nan_safe_v`` on, FA4's consumer: head dims <= 256), else ``"scan"`` (the wide kernels keep their own clean-up;
    with ``nan_safe_v`` off the method is moot), so launches it cannot change keep one compile key. ``"auto"`` is
    ``"recompute"`` where ``head_dim == head_dim_v`` is in :data:`AUTO_RECOMPUTE_HEAD_DIMS`, else ``"scan"``
    (measured per launch kind, docs/tuning.md 2.35). Host ints only."""
    if not cfg.nan_safe_v or is_wide(head_dim, head_dim_v):
        return "scan"
    if cfg.nan_safe_v_method == "auto":  # the recompute gained at hd 256, lost or tied at hd 128 (2.35)
        return "recompute" if head_dim == head_dim_v and head_dim in AUTO_RECOMPUTE_HEAD_DIMS else "scan"
    return cfg.nan_safe_v_method


def auto_skip_allowed_first(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> bool:
    """The value ``skip_allowed_first`` resolves to for a config whose ``num_splits`` is set (an int; host ints
    only, no device read). False where it cannot act (``nan_safe_v`` off, ``nan_safe_v_method`` resolving to
    ``"recompute"``, or head
    dims above 256: the wide kernels place their own clean-up), so those launches keep one compile key whatever it
    says; else an explicit bool as given, and ``"auto"`` True iff ``num_splits > 1`` (either merge).

    Rationale (docs/tuning.md 2.30): in a split launch each split that does not hold the tile's last keys starts on a
    block every row sees whole (one scan fewer each), and the skip was measured faster there; on the unsplit
    windowed launch it was measured slower (unexplained), on unsplit hd-128 canvases faster by less than the keep
    bar.

    Raises:
        TypeError: ``num_splits`` is not an int (an unresolved config).
    """
    n = cfg.num_splits
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"auto_skip_allowed_first needs a config with num_splits set (an int), got {n!r}")
    if (not cfg.nan_safe_v or is_wide(head_dim, head_dim_v)
            or resolve_nan_safe_v_method(cfg, head_dim, head_dim_v) == "recompute"):
        return False  # (with "recompute", named or "auto"'s, there is no mainloop scan to skip)
    if cfg.skip_allowed_first == "auto":  # split launches measured faster with it, the unsplit windowed one slower
        return n > 1
    return bool(cfg.skip_allowed_first)


#: The split count at which ``split_merge="auto"`` takes the cluster merge: the one count at which the one launch
#: was measured faster than FA4's combine (hd <= 256); clusters of 4, and the split-value hd-512 kernel at 2, were
#: slower (docs/tuning.md 2.6, 2.7).
AUTO_CLUSTER_SPLITS = 2


def auto_split_merge(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> str:
    """The merge ``split_merge="auto"`` resolves to, for a resolved config (tile fields and ``num_splits`` set).

    ``"combine"`` with one split (the plain kernel, no merge); ``"cluster"`` at exactly :data:`AUTO_CLUSTER_SPLITS`
    splits, head dims <= 256, P kept in registers (``mma_pv_is_rs``, as in every measured configuration: a P buffer
    in shared memory may lie inside the Q / K / V span the merge reuses, which the kernel refuses at trace time) and
    a tile that fits the merge (:func:`cluster_merge_fits`); else ``"triton"``, the shared Triton merge, which keeps
    a split whose weight underflows (the contract's ``0 * NaN``; FA4's combine drops it) and was measured no slower
    than the combine on every split launch (docs/tuning.md 2.35). Host ints only.

    Returns:
        ``"combine"``, ``"cluster"`` or ``"triton"``, never ``"auto"``.

    Raises:
        TypeError: ``cfg`` is not a resolved config (``tile_m`` / ``tile_n`` None where the rule needs them).
    """
    if cfg.num_splits == 1:
        return "combine"  # one split: the plain kernel (resolve_launch_config maps any merge there to it)
    if cfg.num_splits != AUTO_CLUSTER_SPLITS or is_wide(head_dim, head_dim_v) or cfg.mma_pv_is_rs is not True:
        return "triton"
    if cfg.tile_m is None or cfg.tile_n is None:
        raise TypeError(f"auto_split_merge needs a resolved config (tile_m and tile_n set), got {cfg}")
    return "cluster" if cluster_merge_fits(cfg, head_dim, head_dim_v) else "triton"


def cluster_merge_fits(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> bool:
    """Whether the cluster merge's fp32 output tile and LSEs (``tile_m x (head_dim_v + 1) x 4`` bytes) fit the Q,
    K and V buffers of a resolved config (2-byte elements; the kernel re-checks against FA4's struct at trace
    time, ``kernel_cluster.ClusterMergeMixin._get_shared_storage_cls``)."""
    qkv = 2 * (cfg.tile_m * head_dim + cfg.num_stages * cfg.tile_n * (head_dim + head_dim_v))
    return cfg.tile_m * (head_dim_v + 1) * 4 <= qkv
