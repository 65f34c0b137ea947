"""Configuration of the Triton attention backend, in one place: the config type, its defaults and tuned tables, all
validation, the choice between the portable and the Gluon kernels, the split-KV count, the occupancy and register
estimates, and the kernels' constexpr arguments.

A call's ``config`` dict (keys :data:`CONFIG_KEYS`) overrides the defaults of its static signature (head dims,
GQA group, dtype, paged / page size, window, mode: :class:`StaticKey`); :meth:`TritonAttention.config` resolves and
validates it into a frozen :class:`TritonConfig`. :func:`choose_launch_config` then picks the regime (base or
split-KV tiles), the kernel (portable, or the warp-specialised Gluon kernel where it is tuned and TMA can read the
caches) and the split count from host shapes only, and :func:`kernel_constexprs` turns a config into the kernel's
constexpr arguments (used by the launch plans, :mod:`.plans`, and by the offline compile check,
:mod:`.compile_check`).

Tables map ``(head_dim, group, has_window, prefix)`` to config overrides for bf16 / fp16 on the H200; each entry
carries a one-line rationale; the measurements behind them are in docs/tuning.md §1.9 (defaults, tables) and
§1.4 (split count).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..split_merge import interpreting, merge_constexprs  # noqa: F401  (re-exported: the plans use them)
from .tma import tma_box_rows

#: the keys a call's ``config`` dict may set (the fields of :class:`TritonConfig`)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "BLOCK_DV", "LAZY_RESCALE",
               "BT_PREFETCH", "IMPL", "OVERLAP", "V_STAGES", "NAN_SAFE_V")
MAX_SPLITS = 65535  # num_splits is grid dimension z (CUDA: at most 65535)
#: config keys that pin the tiles or the kernel: the tuned tables (split regime, Gluon) then stay out of the way
_TILE_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "IMPL", "BLOCK_DV"}

# ---- Gluon register and shared-memory budgets (sm_90: 64 K registers, 227 KB of shared memory per SM)
WIDE_SMEM_LIMIT = 232448 - 1024  # 227 KB per block on sm_90, less barriers and alignment
WIDE_CONSUMER_REGS = 232  # setmaxnreg of the wide kernel's worker warpgroup (ptxas gives both consumers 232)
LOADER_REGS = 40  # registers per thread of the producer warp (setmaxnreg; scalar address math and TMA issue)
ROLES_P_STAGES = 2  # P / row-rescale slots between the roles kernel's softmax and PV warpgroups


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(frozen=True)
class TritonConfig:
    """A resolved, validated kernel config (what :meth:`TritonAttention.config` returns).

    Fields (the keys of a call's ``config`` dict):
        BLOCK_M: query rows per program (tokens x padded GQA group heads), a power of two >= 16.
        BLOCK_N: keys per block, a power of two >= 16.
        num_warps, num_stages: Triton launch options (Gluon: consumer warps, K ring depth).
        BLOCK_DV: V head-dim slice per program (the padded ``head_dim_v``: no slicing; Gluon: always all of V).
        num_splits: split-KV count, None for the automatic choice (:func:`choose_num_splits`).
        LAZY_RESCALE: FA4's conditional rescaling of the accumulator.
        BT_PREFETCH: read key block j + 1's page ids during block j (portable kernel).
        IMPL: ``"triton"`` (the portable kernel) or ``"gluon"`` (the warp-specialised sm_90 kernels).
        OVERLAP: Gluon consumer order: False (sequential), True (QK^T of block j + 1 overlaps the softmax of block
            j), ``"chain"`` (PV of block j and QK^T of block j + 1 back to back), ``"roles"`` (the roles kernel).
        V_STAGES: Gluon V ring depth (None: ``num_stages``).
        NAN_SAFE_V: Gluon kernels: keys a row may not see contribute nothing even when their V holds NaN / Inf (a
            masked block's V cleaned in shared memory before PV, a cold fix-up of the rows that do see a non-finite
            entry: :mod:`.gluon`). On by default. Off, the Gluon kernels zero V only past ``seq_len`` (their PTX
            is that of the kernels without the switch), so a non-finite V entry of a key inside ``seq_len`` that
            a row may not see reaches that row. The portable kernel always keeps such V out; it ignores the
            field.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    BLOCK_DV: int
    num_splits: int | None = None
    LAZY_RESCALE: bool = False
    BT_PREFETCH: bool = True
    IMPL: str = "triton"
    OVERLAP: bool | str = True
    V_STAGES: int | None = None
    # on by default (the contract: keys a row may not see contribute nothing); its cost and GPU tests:
    # docs/tuning.md 1.11. False trades the guarantee for that cost where V inside seq_len is known finite.
    NAN_SAFE_V: bool = True

    def as_dict(self) -> dict:
        """The fields as a new dict (e.g. ``LAST_LAUNCH["config"]``)."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ defaults, tables
def default_config(head_dim: int, head_dim_v: int, group: int, dtype: torch.dtype, interpret: bool = False) -> dict:
    """Default tile config per head dim (H200-oriented; bench/sweep_triton_attention.py tunes these).

    Returns a dict with BLOCK_M (rows = tokens x padded group heads), BLOCK_N (keys), num_warps, num_stages,
    BLOCK_DV (V head-dim slice per program; = padded head_dim_v means no split). num_splits is chosen per
    call unless given. ``interpret``: the smallest tiles, for the Triton interpreter.
    """
    gp = next_pow2(group)
    dv = max(16, next_pow2(head_dim_v))
    d = max(16, next_pow2(head_dim))
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


_SLIDING_256 = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, LAZY_RESCALE=True)
#: Portable-kernel tiles {(head_dim, group, has_window, prefix): config} (bf16 / fp16, H200 sweeps):
#: - hd 256 sliding layers (both modes): 128x64 of 8 warps beat the 64-row default; lazy rescaling helps the
#:   mixed batch and is neutral on the canvas.
#: - hd 128 (no window): 128x64, 8 warps, 4 stages: the fastest prefill tile once the block table is prefetched.
#: - hd 512 global layers: 128x32 with V in two 256-column slices beats one program holding all of V.
TUNED_CONFIGS: dict = {
    (256, 2, True, False): _SLIDING_256,
    (256, 2, True, True): _SLIDING_256,
    (128, 2, False, False): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    (512, 8, False, False): dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, BLOCK_DV=256),
}

#: Portable-kernel tiles of the split-KV regime (the base tiles would split the keys: few q tiles over a long
#: context), same keys:
#: - hd 128: 64x64 of 4 warps, 3 stages: two programs per SM (:func:`ctas_per_sm`), so the split canvas fills one
#:   wave of twice as many programs.
TUNED_SPLIT_CONFIGS: dict = {
    (128, 2, False, False): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}

_GLUON_64 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, OVERLAP=True)
_GLUON_HD128 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, V_STAGES=1, OVERLAP="chain")
_GLUON_HD512 = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=12, num_stages=1, BLOCK_DV=512, OVERLAP="roles")
#: the wide hd-512 kernel's tiles: what the roles entry gives way to when a caller asks for keys only the wide
#: kernel takes (:func:`gluon_auto`)
_GLUON_HD512_WIDE = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, BLOCK_DV=512,
                         OVERLAP=False)
#: The Gluon kernels as the automatic choice {(head_dim, group, has_window, prefix): (base regime config or None,
#: split regime config or None)}, bf16 / fp16 on sm_90 when the caches suit TMA with boxes of >= 64 rows (else the
#: tables above):
#: - hd 128, both regimes: 64x128 (a 128-key block is two 64-token pages, one TMA box each), the chained consumer
#:   (the QK^T / softmax overlap spills at 64x128), two K and one V buffer (115 KB: two programs per SM).
#: - hd 256 sliding, split regime only: 64x64 without the overlap (with it the hd-256 consumer spills); the base
#:   regime stays on the portable kernel, which is faster on the mixed batch.
#: - hd 512 global layers, both regimes: the roles kernel (a softmax warpgroup feeding two PV warpgroups), 64x64
#:   with one K and one V buffer: faster than the wide kernel at every measured batch and context.
TUNED_GLUON_CONFIGS: dict = {
    (128, 2, False, False): (_GLUON_HD128, _GLUON_HD128),
    (512, 8, False, False): (_GLUON_HD512, _GLUON_HD512),
    (256, 2, True, False): (None, dict(_GLUON_64, OVERLAP=False)),
}


def gluon_auto(entry: dict, override: dict | None) -> dict:
    """An automatic Gluon table entry merged with the caller's config keys. The hd-512 roles entry gives way to the
    wide kernel's (:data:`_GLUON_HD512_WIDE`) when the caller sets ``OVERLAP`` to anything but "roles" or asks
    for ``LAZY_RESCALE``: keys the roles kernel refuses but the wide kernel takes (or, for ``OVERLAP`` True /
    "chain", refuses with an error naming the caller's key rather than a table field)."""
    override = override or {}
    if entry.get("OVERLAP") == "roles" and entry.get("BLOCK_DV", 0) > 256 and (
            override.get("OVERLAP", "roles") != "roles" or override.get("LAZY_RESCALE")):
        entry = _GLUON_HD512_WIDE
    return dict(entry, **override)


# ------------------------------------------------------------------------------------------------ occupancy
def roles_pv_warpgroups(head_dim_v: int) -> int:
    """PV warpgroups of the roles kernel: one per 256 output columns (a 64 x 256 fp32 accumulator is 128 registers
    a thread)."""
    return 2 if head_dim_v > 256 else 1


def roles_pv_regs(head_dim_v: int) -> int:
    """setmaxnreg of each PV warpgroup of the roles kernel. Two PV warpgroups (hd 512): 12 warps share the register
    file at 168 a thread; 2 x 200 leaves 104 for the softmax warpgroup (S, P and the row statistics). One
    (hd <= 256): 8 warps, no launch cap; 240."""
    return 200 if roles_pv_warpgroups(head_dim_v) == 2 else 240


def roles_k_chunks(head_dim: int) -> int:
    """Head-dim chunks of the roles kernel's K ring (one TMA box column range and one QK^T wgmma group each, the
    slot refilled per chunk): ``head_dim // 256``, at least 1 (128-column chunks at hd 512 were slower)."""
    return max(1, head_dim // 256)


def roles_max_regs(head_dim_v: int) -> int | None:
    """``maxnreg`` at launch of the roles kernel (4 softmax + 4 per PV warpgroup warps; None: no cap)."""
    regs = (65536 // (32 * 4 * (1 + roles_pv_warpgroups(head_dim_v)))) // 8 * 8
    return regs if regs < 255 else None


def ctas_per_sm(block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int, head_dim_v: int,
                itemsize: int) -> int:
    """Estimated resident programs per SM of the portable kernel (H100 / H200: 64 K registers, 227 KB shared
    memory per SM).

    The kernel uses ~255 registers per thread (so ``8 // num_warps`` programs fit the register file) and
    shared memory for the Q tile plus ``num_stages`` K and V blocks. ``head_dim`` / ``head_dim_v``: the widths
    of those tiles (BLOCK_D, the head dim padded to a power of two, and BLOCK_DV, the V slice of one program).
    Host shapes only (no compiled binary).
    """
    smem = (block_m * head_dim + num_stages * block_n * (head_dim + head_dim_v)) * itemsize
    return max(1, min(8 // max(1, num_warps), (227 * 1024) // max(1, smem)))


def gluon_ctas_per_sm(block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int, head_dim_v: int,
                      itemsize: int, v_stages: int | None = None) -> int:
    """Resident Gluon programs per SM: shared memory (Q tile + ``num_stages`` K blocks + ``v_stages`` V blocks,
    default ``num_stages``; 227 KB per SM) and registers: two programs only for 64 rows x 4 consumer warps with
    ``head_dim_v <= 128`` (128 registers a thread at launch, 216 for a consumer thread after setmaxnreg; the
    hd-256 PV wgmma needs >= 158 at launch), else one."""
    v_stages = num_stages if v_stages is None else v_stages
    smem = (block_m * head_dim + block_n * (num_stages * head_dim + v_stages * head_dim_v)) * itemsize + 1024
    # two programs leave 128 registers a thread at launch (.maxnreg), which ptxas needs to fit the widest wgmma:
    # 64-row tiles with head_dim_v <= 128 only (hd-256 PV needs >= 158: ptxas C7602)
    regs_cap = 2 if (num_warps == 4 and block_m == 64 and head_dim_v <= 128) else 1
    return max(1, min(regs_cap, (227 * 1024) // smem))


def gluon_max_regs(num_warps: int, ctas_per_sm: int) -> int | None:
    """``maxnreg`` so that ``ctas_per_sm`` programs of ``num_warps`` consumer warps + one loader warpgroup fit
    the 64 K-register file (multiple of 8); None (no cap) when the share reaches the 255-register limit."""
    regs = (65536 // (ctas_per_sm * (num_warps + 4) * 32)) // 8 * 8
    return regs if regs < 255 else None


def tile_estimate(total_q: int, num_seqs: int, block_q: int) -> int:
    """Working q tiles of a batch from host ints: ``cdiv(total_q, BLOCK_Q)`` (exact for one sequence), and at
    least ``min(B, total_q)`` since every non-empty sequence starts its own tile (many short sequences: 100
    one-token rows are 100 tiles, not 7 of 16 tokens; counting 7 split an already full grid)."""
    return max(-(-total_q // block_q), min(num_seqs, total_q))


def choose_num_splits(n_programs: int, key_capacity: int, block_n: int, num_sms: int, ctas: int = 1) -> int:
    """Split-KV count from host-known shapes only: split when the grid fills at most half a wave.

    ``n_programs`` = (real) q tiles x KV heads x V slices; ``key_capacity`` = max keys of a sequence
    (max_seqlen_k, or the block table's capacity); ``ctas`` = programs resident per SM (:func:`ctas_per_sm`).
    The split count keeps the grid within one wave (``n_programs * splits <= num_sms * ctas``: more splits than
    one wave measured slower) and >= 8 key blocks per split, at most 64.
    """
    slots = num_sms * max(1, int(ctas))
    if n_programs <= 0 or 2 * n_programs > slots:
        return 1
    by_len = key_capacity // (8 * block_n)
    return int(max(1, min(slots // n_programs, by_len, 64)))


# ------------------------------------------------------------------------------------------------ validation
def overlap_mode(overlap) -> int:
    """The Gluon kernels' ``OVERLAP`` constexpr of a config value: 0 (False: sequential), 1 (True: QK^T of block
    j + 1 overlaps the softmax of block j), 2 ("chain": PV of block j and QK^T of block j + 1 issued back to back
    and retired together), 3 ("roles": the separate roles kernel, a softmax warpgroup feeding PV warpgroups)."""
    if overlap == "chain":
        return 2
    if overlap == "roles":
        return 3
    if not isinstance(overlap, bool):
        kind = ValueError if isinstance(overlap, str) else TypeError  # a str: a wrong name; anything else: a type
        raise kind(f"OVERLAP must be a bool, 'chain' or 'roles', got {overlap!r}")
    return int(overlap)


def check_gluon_config(cfg: TritonConfig, head_dim: int, head_dim_v: int) -> None:
    """Validate the tile fields of a config with ``IMPL="gluon"`` (raises ``ValueError`` naming the field, or
    ``TypeError`` for a field of the wrong type: a bool or a float for an int)."""
    for name in ("num_warps", "BLOCK_M", "BLOCK_N", "num_stages", "BLOCK_DV"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"config[{name!r}] must be an int with IMPL='gluon', got {type(v).__name__} ({v!r})")
    nw, bm, bn, st = cfg.num_warps, cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_stages
    roles = cfg.OVERLAP == "roles"
    if nw not in (4, 8) and not roles:
        raise ValueError(f"config['num_warps'] must be 4 or 8 (consumer warpgroups) with IMPL='gluon', got {nw!r}")
    if head_dim_v <= 256 and not roles and (bm not in (64, 128) or bm < 16 * nw):
        raise ValueError(f"config['BLOCK_M'] must be 64 or 128 and >= 16 * num_warps with IMPL='gluon', got {bm!r}")
    if bn not in (32, 64, 128):
        raise ValueError(f"config['BLOCK_N'] must be 32, 64 or 128 with IMPL='gluon', got {bn!r}")
    if not 1 <= st <= 4:
        raise ValueError(f"config['num_stages'] (K ring depth) must be in [1, 4] with IMPL='gluon', got {st!r}")
    vst = cfg.V_STAGES
    if vst is not None and (isinstance(vst, bool) or not isinstance(vst, int)):
        raise TypeError(f"config['V_STAGES'] must be None or an int, got {type(vst).__name__} ({vst!r})")
    if vst is not None and not 1 <= vst <= 4:
        raise ValueError(f"config['V_STAGES'] (V ring depth; None: num_stages) must be an int in [1, 4] or None "
                         f"with IMPL='gluon', got {vst!r}")
    if roles:
        npv = roles_pv_warpgroups(head_dim_v)
        if bm != 64 or nw != 4 * (1 + npv):
            raise ValueError(f"OVERLAP='roles' at head_dim_v {head_dim_v} needs BLOCK_M=64 and "
                             f"num_warps={4 * (1 + npv)} (a softmax warpgroup + {npv} PV warpgroup(s)), got "
                             f"BLOCK_M={bm!r}, num_warps={nw!r}")
        if cfg.LAZY_RESCALE:
            raise ValueError("OVERLAP='roles' takes LAZY_RESCALE=False (its PV warpgroups rescale every block)")
        vst = cfg.V_STAGES or st
        smem = 2 * (bm * head_dim + bn * (st * head_dim + vst * head_dim_v) + ROLES_P_STAGES * bm * bn) \
            + 4 * (ROLES_P_STAGES + 2) * bm
        if smem > WIDE_SMEM_LIMIT:
            raise ValueError(f"config BLOCK_N={bn}, num_stages={st}, V_STAGES={vst} needs {smem} B of shared memory "
                             f"at head_dim {head_dim} with OVERLAP='roles' (Q + K / V rings + the P ring); the limit "
                             f"is {WIDE_SMEM_LIMIT}")
    elif head_dim_v > 256:
        if nw != 8 or bm != 64:
            raise ValueError(f"head_dim_v {head_dim_v} with IMPL='gluon' needs num_warps=8 and BLOCK_M=64 (two "
                             f"warpgroups splitting the head dim), got num_warps={nw!r}, BLOCK_M={bm!r}")
        if cfg.OVERLAP:
            raise ValueError(f"head_dim_v {head_dim_v} with IMPL='gluon' takes OVERLAP=False, got {cfg.OVERLAP!r}")
        vst = cfg.V_STAGES or st
        smem = 2 * (bm * head_dim + bn * (st * head_dim + vst * head_dim_v)) + 2 * bm * bn * 4
        if smem > WIDE_SMEM_LIMIT:
            raise ValueError(f"config BLOCK_N={bn}, num_stages={st}, V_STAGES={vst} needs {smem} B of shared memory "
                             f"at head_dim {head_dim} with IMPL='gluon' (Q + K / V rings + the partial-S exchange); "
                             f"the limit is {WIDE_SMEM_LIMIT}")
    if cfg.BLOCK_DV < head_dim_v:
        raise ValueError("config['BLOCK_DV'] cannot split the V head dim with IMPL='gluon' (one program holds it all)")


#: The config keys by the type they take (None allowed where the second item is True): no coercion, a bool is not
#: an int (``True`` for ``num_splits`` is a TypeError, not 1).
_INT_KEYS = {"BLOCK_M": False, "BLOCK_N": False, "num_warps": False, "num_stages": False, "BLOCK_DV": False,
             "num_splits": True, "V_STAGES": True}
_BOOL_KEYS = ("LAZY_RESCALE", "BT_PREFETCH", "NAN_SAFE_V")


def _type_name(v) -> str:
    """``type(v)``'s name, module-qualified outside the builtins (numpy's bool_ is also named "bool")."""
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_config_types(cfg: dict) -> None:
    """Type rules of a config dict's present keys: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``,
    ``BLOCK_DV`` ints; ``num_splits``, ``V_STAGES`` None or ints; ``LAZY_RESCALE``, ``BT_PREFETCH``, ``NAN_SAFE_V``
    bools; ``IMPL`` a str; ``OVERLAP`` a bool or a str. A bool is not an int here, nor an int a bool.

    Raises:
        TypeError: a value of the wrong type (the key, the type wanted and the value named).
    """
    for name, none_ok in _INT_KEYS.items():
        if name not in cfg or (none_ok and cfg[name] is None):
            continue
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int):
            want = "None or an int" if none_ok else "an int"
            raise TypeError(f"config[{name!r}] must be {want} (a bool is not an int), got {_type_name(v)} ({v!r})")
    for name in _BOOL_KEYS:
        if name in cfg and not isinstance(cfg[name], bool):
            raise TypeError(f"config[{name!r}] must be a bool, got {_type_name(cfg[name])} ({cfg[name]!r})")
    if "IMPL" in cfg and not isinstance(cfg["IMPL"], str):
        raise TypeError(f"config['IMPL'] must be a str ('triton' or 'gluon'), got {_type_name(cfg['IMPL'])}")
    if "OVERLAP" in cfg and not isinstance(cfg["OVERLAP"], (bool, str)):
        raise TypeError(f"config['OVERLAP'] must be a bool, 'chain' or 'roles', got {_type_name(cfg['OVERLAP'])} "
                        f"({cfg['OVERLAP']!r})")


def resolve_config(base: dict, override: dict | None, *, group: int, head_dim: int, head_dim_v: int) -> TritonConfig:
    """``base`` (defaults + tuned table) updated with a call's ``override``, defaults filled in, validated.

    Raises:
        TypeError: a value of the wrong type (:func:`check_config_types`: e.g. ``num_splits=True``, a bool for an
            int; the message names the key).
        ValueError: an unknown key, or a value that breaks a rule (the message names the key and the rule; the
            portable kernel's launch rules: :func:`check_portable_config`).
    """
    if override:
        bad = set(override) - set(CONFIG_KEYS)
        if bad:  # (sorted by repr: keys of mixed types, 1 and "x", do not compare)
            raise ValueError(f"config has unknown keys {sorted(bad, key=repr)}; allowed: {list(CONFIG_KEYS)}")
    cfg = dict(base)
    cfg.update(override or {})
    check_config_types(cfg)
    if cfg.get("IMPL") == "gluon" and "BLOCK_DV" not in (override or {}):
        cfg["BLOCK_DV"] = max(16, next_pow2(head_dim_v))  # the Gluon kernels hold all of V
    if cfg.get("IMPL") == "gluon" and "LAZY_RESCALE" not in (override or {}):
        # the portable kernel's tuned LAZY_RESCALE (hd-256 sliding) is not the Gluon kernels': they were tuned
        # without it (inherited, it slowed the sliding canvas)
        cfg["LAZY_RESCALE"] = False
    gp = next_pow2(group)
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_DV"):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"config[{name!r}] must be a power of two >= 16 (tl.dot minimum), got {v!r}")
    if cfg["BLOCK_M"] < gp:
        raise ValueError(f"config['BLOCK_M'] = {cfg['BLOCK_M']} must be >= the padded GQA group size {gp}")
    dvp = max(16, next_pow2(head_dim_v))
    cfg["BLOCK_DV"] = min(cfg["BLOCK_DV"], dvp)
    if not isinstance(cfg.get("LAZY_RESCALE", False), bool):
        raise ValueError(f"config['LAZY_RESCALE'] must be a bool, got {cfg['LAZY_RESCALE']!r}")
    cfg.setdefault("LAZY_RESCALE", False)
    if not isinstance(cfg.get("BT_PREFETCH", False), bool):
        raise ValueError(f"config['BT_PREFETCH'] must be a bool, got {cfg['BT_PREFETCH']!r}")
    cfg.setdefault("BT_PREFETCH", True)  # on: paged K / V addresses never wait on a block-table load
    if not isinstance(cfg.get("NAN_SAFE_V", False), bool):
        raise ValueError(f"config['NAN_SAFE_V'] must be a bool, got {cfg['NAN_SAFE_V']!r}")
    cfg.setdefault("IMPL", "triton")
    if not (isinstance(cfg.get("OVERLAP", True), bool) or cfg.get("OVERLAP") in ("chain", "roles")):
        raise ValueError(f"config['OVERLAP'] must be a bool, 'chain' or 'roles', got {cfg['OVERLAP']!r}")
    # Gluon only: the QK^T / softmax overlap where its consumer compiles without spills (64-key blocks, V head dim
    # <= 128), else the chained consumer up to V head dim 256 (faster than sequential at hd 128), else (the wide
    # hd-512 kernel) sequential; the V ring depth (None: num_stages)
    cfg.setdefault("OVERLAP", True if cfg["BLOCK_N"] <= 64 and head_dim_v <= 128 else
                   "chain" if head_dim_v <= 256 else False)
    cfg.setdefault("V_STAGES", None)
    if cfg["IMPL"] not in ("triton", "gluon"):
        raise ValueError(f"config['IMPL'] must be 'triton' (the portable kernel) or 'gluon' (the warp-specialised "
                         f"Hopper kernel), got {cfg['IMPL']!r}")
    if (override or {}).get("IMPL") == "triton" and {"OVERLAP", "V_STAGES"} & set(override):
        raise ValueError("config keys OVERLAP and V_STAGES apply to the Gluon kernel; IMPL='triton' (the portable "
                         "kernel) pipelines K and V with num_stages")
    resolved = TritonConfig(**cfg)
    if resolved.IMPL == "gluon":
        check_gluon_config(resolved, head_dim, head_dim_v)
    ns = resolved.num_splits
    if ns is not None and (isinstance(ns, bool) or not isinstance(ns, int) or not 1 <= ns <= MAX_SPLITS):
        raise ValueError(f"config['num_splits'] must be an int in [1, {MAX_SPLITS}] (the launch grid's third "
                         f"dimension) or None, got {ns!r}")
    for name in ("num_warps", "num_stages"):
        v = getattr(resolved, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config[{name!r}] must be an int >= 1, got {v!r}")
    if resolved.IMPL == "triton":
        check_portable_config(resolved, head_dim)
    return resolved


#: Triton's largest tensor (``triton.language.TRITON_MAX_TENSOR_NUMEL``): a tile above it fails to compile.
MAX_TILE_NUMEL = 1 << 20


def check_portable_config(cfg: TritonConfig, head_dim: int) -> None:
    """The portable kernel's (``IMPL="triton"``) launch rules that Triton would otherwise report from deep inside
    its compiler (an ``AssertionError`` for ``num_warps=3`` on a GPU; a tile past its tensor limit a compile error,
    an ``InterpreterError`` on the CPU): ``num_warps`` a power of two in [1, 32] (at most 1024 threads a program),
    and every tile the kernel holds (``BLOCK_M`` / ``BLOCK_N`` rows by the padded head dim, by ``BLOCK_DV``, and
    ``BLOCK_M x BLOCK_N``) at most :data:`MAX_TILE_NUMEL` elements.

    Raises:
        ValueError: a rule broken (names the key and the rule).
    """
    nw = cfg.num_warps
    if nw & (nw - 1) or nw > 32:
        raise ValueError(f"config['num_warps'] must be a power of two in [1, 32] with IMPL='triton' (Triton's launch "
                         f"rule), got {nw}")
    bd = max(16, next_pow2(head_dim))
    for (a, an), (b, bn) in (((cfg.BLOCK_M, "BLOCK_M"), (cfg.BLOCK_N, "BLOCK_N")),
                             ((cfg.BLOCK_M, "BLOCK_M"), (bd, "the padded head_dim")),
                             ((cfg.BLOCK_N, "BLOCK_N"), (bd, "the padded head_dim")),
                             ((cfg.BLOCK_M, "BLOCK_M"), (cfg.BLOCK_DV, "BLOCK_DV")),
                             ((cfg.BLOCK_N, "BLOCK_N"), (cfg.BLOCK_DV, "BLOCK_DV"))):
        if a * b > MAX_TILE_NUMEL:
            raise ValueError(f"config[{an!r}] = {a} x {bn} = {b} is a tile of {a * b} elements, above Triton's "
                             f"largest tensor ({MAX_TILE_NUMEL} elements)")


# ------------------------------------------------------------------------------------------------ per signature
@dataclass(frozen=True)
class StaticKey:
    """What a call's configs depend on besides its config dict (host values that are fixed per layer)."""

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
    """The tile configs of one static signature (:class:`StaticKey`): the defaults with the tuned tables applied
    (``base``; ``split_base`` for the split-KV regime; ``gluon_base`` / ``gluon_split``: the automatic Gluon
    entries, None where the portable kernel runs), and the resolved configs of the calls' overrides.

    Instances are cached by :func:`get_kernel`; :meth:`config` resolves and validates a call's ``config`` dict;
    Triton caches compiled binaries per constexpr set.
    """

    def __init__(self, key: StaticKey):
        self.key = key
        fast = not key.interpret and key.dtype in (torch.bfloat16, torch.float16)
        table_key = (key.head_dim, key.group, key.has_window, key.prefix)
        base = default_config(key.head_dim, key.head_dim_v, key.group, key.dtype, key.interpret)
        tuned = TUNED_CONFIGS.get(table_key)
        if tuned and fast:
            base.update(tuned)
        self.base = base
        split = TUNED_SPLIT_CONFIGS.get(table_key)
        #: tiles for the split-KV regime (None: the base tiles everywhere)
        self.split_base = dict(split) if split and fast else None
        gl_base, gl_split = TUNED_GLUON_CONFIGS.get(table_key, (None, None))
        #: automatic Gluon configs (None: the portable kernel), used when the input suits TMA
        self.gluon_base = dict(gl_base) if gl_base and fast else None
        self.gluon_split = dict(gl_split) if gl_split and fast else None
        self._resolved: dict = {}

    def config(self, override: dict | None) -> TritonConfig:
        """The resolved config of a call's ``config`` dict (cached per override; see :func:`resolve_config`)."""
        # the value's type is part of the key: True == 1 == 1.0 hash alike, and a cached {BT_PREFETCH: True}
        # must not let {BT_PREFETCH: 1} (or num_splits=True after num_splits=1) skip validation
        # (the type itself, not its name: numpy's bool_ is also named "bool")
        try:
            okey = tuple(sorted((k, type(v), v) for k, v in (override or {}).items()))
            hit = self._resolved.get(okey)
        except TypeError:  # an unhashable value (e.g. a list), or keys that do not sort (1 and "x": not CONFIG_KEYS):
            okey, hit = None, None  # not cacheable, validation below rejects it
        if hit is not None:
            return hit
        cfg = resolve_config(self.base, override, group=self.key.group, head_dim=self.key.head_dim,
                             head_dim_v=self.key.head_dim_v)
        if okey is not None:
            self._resolved[okey] = cfg
        return cfg


_KERNELS: dict = {}


def get_kernel(head_dim, head_dim_v, group, dtype, paged, page_size, has_window, prefix) -> TritonAttention:
    """The cached :class:`TritonAttention` of a static signature (the interpreter gives its own)."""
    key = StaticKey(head_dim, head_dim_v, group, dtype, paged, page_size or 0, has_window, prefix, interpreting())
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = TritonAttention(key)
    return k


# ------------------------------------------------------------------------------------------------ per call
@dataclass(frozen=True)
class CallShape:
    """The host values of one call that the regime, kernel and split choice read."""

    total_q: int
    num_seqs: int
    num_kv_heads: int
    key_capacity: int  # max keys of a sequence (max_seqlen_k, or the caches' capacity)
    num_sms: int
    itemsize: int  # bytes per element of q / K / V


def choose_launch_config(kern: TritonAttention, config: dict | None, call: CallShape,
                         gluon_ineligible: Callable[[int], str | None]) -> tuple[TritonConfig, int]:
    """The config and split count of one call: the base tiles, or the split-regime tiles when the base tiles would
    split the keys (few q tiles over a long context), or the tuned Gluon entry of that regime when the input suits
    TMA; then the split count (``config["num_splits"]``, else :func:`choose_num_splits`). Tuned tables apply only
    when ``config`` pins no tile key (:data:`_TILE_KEYS`). Host shapes only: a CUDA graph replays the config it
    was captured with.

    ``gluon_ineligible(block_n)``: why the call's tensors cannot run the Gluon kernels with that BLOCK_N, or None
    (:func:`.tma.gluon_ineligible` bound to them).

    Raises:
        ValueError: a bad ``config`` (see :func:`resolve_config`), or ``IMPL="gluon"`` on an input it cannot take.
    """
    key = kern.key
    D, DV = key.head_dim, key.head_dim_v
    gp = next_pow2(key.group)
    cfg = kern.config(config)

    def auto_splits(c: TritonConfig) -> int:  # the automatic split count of the portable kernel with tiles c
        n_dv_c = -(-max(16, next_pow2(DV)) // c.BLOCK_DV)
        ctas = ctas_per_sm(c.BLOCK_M, c.BLOCK_N, c.num_warps, c.num_stages, max(16, next_pow2(D)), c.BLOCK_DV,
                           call.itemsize)
        return choose_num_splits(tile_estimate(call.total_q, call.num_seqs, c.BLOCK_M // gp) * call.num_kv_heads
                                 * n_dv_c, call.key_capacity, c.BLOCK_N, call.num_sms, ctas)

    # a tile override (BLOCK_DV included: the Gluon kernels never split V) keeps the tables' portable kernel
    auto_tiles = not (config and set(config) & _TILE_KEYS)
    split_regime = auto_tiles and cfg.num_splits is None and auto_splits(cfg) > 1
    if split_regime and kern.split_base is not None:
        cfg = kern.config(dict(kern.split_base, **(config or {})))
    gluon_cfg = (kern.gluon_split if split_regime else kern.gluon_base) if auto_tiles else None
    checked_gluon = False  # the input's Gluon eligibility already checked (for this BLOCK_N)
    # the Gluon kernels where tuned and the input suits TMA with boxes of >= 64 rows (smaller pages cost one box
    # each and were not tuned); otherwise the portable kernel above
    if gluon_cfg is not None and gluon_ineligible(gluon_cfg["BLOCK_N"]) is None \
            and tma_box_rows(key.paged, key.page_size, gluon_cfg["BLOCK_N"]) >= 64:
        cfg = kern.config(gluon_auto(gluon_cfg, config))
        checked_gluon = True
    gluon_ctas = 1
    if cfg.IMPL == "gluon":
        why = None if checked_gluon else gluon_ineligible(cfg.BLOCK_N)
        if why is not None:
            raise ValueError(f"config['IMPL'] = 'gluon' cannot run this input: {why}")
        gluon_ctas = gluon_ctas_per_sm(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages, D, DV, call.itemsize,
                                       v_stages=cfg.V_STAGES)
    ns = cfg.num_splits
    if ns is None:
        if cfg.IMPL == "gluon":
            ns = choose_num_splits(tile_estimate(call.total_q, call.num_seqs, cfg.BLOCK_M // gp) * call.num_kv_heads,
                                   call.key_capacity, cfg.BLOCK_N, call.num_sms, gluon_ctas)
        else:
            ns = auto_splits(cfg)
    return cfg, ns


# ------------------------------------------------------------------------------------------------ kernel constexprs
@dataclass(frozen=True)
class KernelShape:
    """What a kernel's constexpr arguments depend on besides its config."""

    group: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    paged: bool
    page_size: int | None  # tokens per page (paged caches)
    has_window: bool
    prefix: bool  # bidirectional_window == "prefix"
    causal_flags: bool  # the kernel reads ``causal`` [B] bool (else ``num_causal_q`` [B] int32)
    split: bool  # num_splits > 1: write fp32 partials for the merge
    store_lse: bool
    search_steps: int  # 16-ary tile -> sequence search steps: ceil(bits(B) / 4)
    # |scale| * log2(e) >= 2**-120: the portable kernel's raw-score max (RAW_MAX; tma.normal_kernel_scale)
    scale_normal: bool = True
    scale_negative: bool = False  # scale < 0 (with scale_normal: the kernel negates Q, NEG_Q)
    interpret: bool = False
    # elements between consecutive KV heads in one token row of K / V (TMA column of head h = h * stride); None:
    # head_dim / head_dim_v (separate K and V caches). vLLM's FlashAttention layout packs K and V: 2 * head_dim.
    k_head_stride: int | None = None
    v_head_stride: int | None = None
    # the portable kernel: int64 K / V tile offsets (a cache row stride that would carry int32 ones past 2^31 - 1:
    # plans.wide_kv_offsets)
    wide_kv_offsets: bool = False


def split_stats_scale(shape: KernelShape, qk_scale: float) -> float:
    """The log2 scale of the running max a split stores for the merge (``scale_log2`` of
    :func:`blockdiff.attention.split_merge.merge_split_partials`' raw-stats format), ``qk_scale`` being the
    ``scale * log2(e)`` the kernels are passed: on the raw-score path (``shape.scale_normal``; every Gluon kernel,
    the portable kernel's ``RAW_MAX``) the max is of raw scores of ``Q``, negated for a negative scale (``NEG_Q``),
    so ``|qk_scale|``; on the portable kernel's general path the max is of scores already in log2 units, so 1.
    Passed to the merge as the same Python float the kernel gets, so both round it to the same fp32."""
    return abs(qk_scale) if shape.scale_normal else 1.0


def kernel_variant(cfg: TritonConfig, head_dim_v: int) -> str:
    """Which kernel a config runs: ``"portable"`` (:func:`.portable._attn_fwd_kernel`), or a Gluon kernel
    (:data:`.gluon.KERNELS`): ``"gluon"`` (producer warp + consumer warpgroups), ``"gluon_wide"`` (head dims > 256:
    two consumer warpgroups split the head dim) or ``"gluon_roles"`` (``OVERLAP="roles"``)."""
    if cfg.IMPL != "gluon":
        return "portable"
    if cfg.OVERLAP == "roles":
        return "gluon_roles"
    return "gluon_wide" if head_dim_v > 256 else "gluon"


def tma_boxes(cfg: TritonConfig, shape: KernelShape) -> tuple:
    """The Gluon kernels' K / V TMA boxes: ``(box rows, K head-dim chunks, V head-dim chunks)``
    (:func:`.tma.make_kv_descriptors`; TMA boxes are <= 256 columns wide)."""
    chunks = 2 if shape.head_dim_v > 256 else 1
    k_chunks = roles_k_chunks(shape.head_dim) if cfg.OVERLAP == "roles" else chunks
    return tma_box_rows(shape.paged, shape.page_size, cfg.BLOCK_N), k_chunks, chunks


def kernel_constexprs(cfg: TritonConfig, shape: KernelShape) -> dict:
    """The constexpr arguments and launch options (``num_warps``, ``num_stages`` / ``maxnreg``) of the kernel
    :func:`kernel_variant` names, as keyword arguments of its launch."""
    D, DV = shape.head_dim, shape.head_dim_v
    gp = next_pow2(shape.group)
    BM, BN = cfg.BLOCK_M, cfg.BLOCK_N
    page = shape.page_size if shape.paged else 1
    variant = kernel_variant(cfg, DV)
    if variant == "portable":
        return dict(
            G=shape.group, GP=gp, D=D, DV=DV, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=cfg.BLOCK_DV,
            N_DV=-(-max(16, next_pow2(DV)) // cfg.BLOCK_DV),
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_Q=BM // gp, PAGE=page, PAGED=shape.paged, HAS_WINDOW=shape.has_window,
            NCQ_FLAGS=shape.causal_flags,
            PREFIX=shape.prefix, SPLIT=shape.split, STORE_LSE=shape.store_lse, SEARCH_STEPS=shape.search_steps,
            DOT_PREC="ieee" if shape.dtype == torch.float32 else "tf32",
            INTERPRET=shape.interpret, RAW_MAX=shape.scale_normal,
            NEG_Q=shape.scale_normal and shape.scale_negative, LAZY=bool(cfg.LAZY_RESCALE),
            BT_PREFETCH=bool(cfg.BT_PREFETCH), WIDE_KV_OFFS=bool(shape.wide_kv_offsets),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    box_n, k_chunks, _ = tma_boxes(cfg, shape)
    consts = dict(G=shape.group, GP=gp, D=D, DV=DV, KS=shape.k_head_stride or D, VS=shape.v_head_stride or DV,
                  BLOCK_M=BM, BLOCK_N=BN, BLOCK_Q=BM // gp, BOX_N=box_n, PAGE=page,
                  PAGED=shape.paged, HAS_WINDOW=shape.has_window, PREFIX=shape.prefix, NCQ_FLAGS=shape.causal_flags,
                  SPLIT=shape.split, STORE_LSE=shape.store_lse, SEARCH_STEPS=shape.search_steps,
                  STAGES=cfg.num_stages, V_STAGES=cfg.V_STAGES or cfg.num_stages, NAN_SAFE_V=bool(cfg.NAN_SAFE_V))
    if variant == "gluon_roles":
        return dict(consts, PV_REGS=roles_pv_regs(DV), P_STAGES=ROLES_P_STAGES, maxnreg=roles_max_regs(DV),
                    K_CHUNKS=k_chunks, num_warps=4)
    ctas = gluon_ctas_per_sm(BM, BN, cfg.num_warps, cfg.num_stages, D, DV, shape.dtype.itemsize,
                             v_stages=cfg.V_STAGES)
    # the producer-warp kernels
    ws = dict(LOADER_REGS=LOADER_REGS, LAZY=bool(cfg.LAZY_RESCALE), maxnreg=gluon_max_regs(cfg.num_warps, ctas))
    if variant == "gluon_wide":
        return dict(consts, **ws, CONSUMER_REGS=WIDE_CONSUMER_REGS, num_warps=4)
    return dict(consts, **ws, OVERLAP=overlap_mode(cfg.OVERLAP), num_warps=cfg.num_warps)


__all__ = ["CONFIG_KEYS", "MAX_SPLITS", "TritonConfig", "StaticKey", "TritonAttention", "get_kernel",
           "default_config", "TUNED_CONFIGS", "TUNED_SPLIT_CONFIGS", "TUNED_GLUON_CONFIGS", "gluon_auto",
           "resolve_config", "check_config_types", "check_gluon_config", "overlap_mode", "CallShape", "choose_launch_config",
           "choose_num_splits", "tile_estimate", "ctas_per_sm", "gluon_ctas_per_sm", "gluon_max_regs",
           "roles_pv_warpgroups", "roles_pv_regs", "roles_k_chunks", "roles_max_regs", "LOADER_REGS",
           "WIDE_CONSUMER_REGS", "WIDE_SMEM_LIMIT", "ROLES_P_STAGES", "KernelShape", "kernel_variant", "tma_boxes",
           "kernel_constexprs", "merge_constexprs", "next_pow2", "interpreting", "split_stats_scale"]
