"""Static configuration of the ``"cute"`` attention backend: the tile config type (part of the compile key), its
defaults and tuned choices, the SM90 shared-memory check and the K/V load path.

One owner: :func:`resolve_config` turns a call's head dims, window and host query-length hint (plus an optional
override) into the :class:`CuteConfig` the kernel is compiled for; :func:`kv_load_path` says how paged K/V reach
shared memory. This module imports neither flash-attn-4 nor the CuTe DSL at load time (FA4's tile heuristic is
imported when :func:`resolve_config` first needs it). The measured history of the tuned values is in
docs/tuning.md.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REQUIRED", "CuteConfig", "resolve_config", "check_config_fits", "config_smem_bytes", "SMEM_LIMIT_BYTES",
    "LONG_PREFILL_Q", "LONG_PREFILL_CONFIG", "HD128_CONFIG", "LPT_MIN_SEQLEN_Q", "longest_first_tiles",
    "page_box_tma_ok", "kv_load_path",
]

#: The optional packages this backend runs on (the ``cute`` extra of setup.py).
REQUIRED = "flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1"


@dataclass(frozen=True)
class CuteConfig:
    """Static tile configuration (part of the compile key). None fields take FA4's SM90 heuristic.

    tile_m / tile_n: query rows (PackGQA: packed rows) / keys per tile; mma_pv_is_rs: P stays in registers for
    the PV GEMM (else it goes through shared memory); intra_wg_overlap: FA4's overlap of the QK and PV GEMMs
    within a warpgroup; num_stages: K/V pipeline stages; lpt: FA4's longest-first tile order (None: from
    ``max_seqlen_q``, :func:`longest_first_tiles`).
    """

    tile_m: int | None = None
    tile_n: int | None = None
    mma_pv_is_rs: bool | None = None
    intra_wg_overlap: bool | None = None
    num_stages: int = 2
    lpt: bool | None = None


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


def config_smem_bytes(cfg: CuteConfig, head_dim: int, head_dim_v: int) -> int:
    """Shared memory (bytes) of a resolved config in FA4's SM90 forward: Q (the output tile reuses it) +
    ``num_stages`` x (K + V) tiles + P when it goes through shared memory (not ``mma_pv_is_rs``), 2-byte
    elements, plus 1 KB for barriers and alignment (FA4's sm90_config_search rule, with num_stages)."""
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


def resolve_config(head_dim: int, head_dim_v: int, window_size, config=None, max_seqlen_q: int | None = None
                   ) -> CuteConfig:
    """Tile shape for a call: FA4's SM90 forward heuristic (local variant when windowed) unless overridden.

    ``max_seqlen_q`` (host int, tokens) selects the long-prefill tiles at hd 128 without a window (see
    ``LONG_PREFILL_CONFIG``) and the longest-first tile order (``LPT_MIN_SEQLEN_Q``; None counts as long).
    Any upper bound gives correct results, but a static capacity >= 512 gives canvas batches the long-prefill
    choices: pass the step's true maximum query length. Explicit ``config`` fields always win.

    Raises:
        ValueError: the resolved tiles do not fit SM90 shared memory (:func:`check_config_fits`).
        TypeError: ``config`` is not a CuteConfig, a dict or None.
        ImportError: flash-attn-4 is not installed (its heuristic gives the unset fields).
    """
    if config is None:
        config = CuteConfig()
        if (head_dim == head_dim_v == 128 and window_size is None and max_seqlen_q is not None
                and max_seqlen_q >= LONG_PREFILL_Q):
            config = CuteConfig(**LONG_PREFILL_CONFIG)
        elif head_dim == head_dim_v == 128 and window_size is None:
            config = CuteConfig(**HD128_CONFIG)
    elif isinstance(config, dict):
        config = CuteConfig(**config)
    elif not isinstance(config, CuteConfig):
        raise TypeError(f"config must be a CuteConfig, a dict or None, got {type(config).__name__}")
    base = _fa4_tile_size(head_dim, head_dim_v, window_size is not None)
    resolved = CuteConfig(
        tile_m=config.tile_m or base.m_block_size,
        tile_n=config.tile_n or base.n_block_size,
        mma_pv_is_rs=base.mma_pv_is_rs if config.mma_pv_is_rs is None else config.mma_pv_is_rs,
        intra_wg_overlap=base.intra_wg_overlap if config.intra_wg_overlap is None else config.intra_wg_overlap,
        num_stages=config.num_stages,
        lpt=longest_first_tiles(max_seqlen_q) if config.lpt is None else bool(config.lpt),
    )
    check_config_fits(resolved, head_dim, head_dim_v)
    return resolved


def page_box_tma_ok(page_size: int, tile_n: int) -> bool:
    """Whether paged K/V with ``page_size``-token pages load by TMA in boxes of ``min(page_size, tile_n)`` rows.

    The boxes must tile both the page and the key tile (one divides the other) and start 1 KB-aligned in a
    128-byte-swizzled K/V stage (a multiple of 8 rows). ``page_size == tile_n`` is one box per stage.
    """
    return page_size % 8 == 0 and (tile_n % page_size == 0 or page_size % tile_n == 0)


def kv_load_path(page_size: int | None, tile_n: int) -> str:
    """How the kernel loads K/V: ``"tma"`` (contiguous K/V, FA4's producer), ``"tma_boxes"`` (paged, our
    producer: one TMA box per page slice, ``tile_n // page_size`` boxes per K/V stage, one box when
    ``page_size == tile_n``, one box per ``tile_n`` rows of a larger page; V rows past a sequence's last key
    zeroed) or ``"cp.async"`` (FA4's paged fallback, per-row page lookups, zero-filled past the last key).

    Rationale: FA4's own paged TMA path needs ``page_size == tile_n``, and its cp.async path is markedly slower
    than contiguous loads on hd-128 canvases; page-sized boxes bring paged loads to contiguous speed.
    """
    if page_size is None:
        return "tma"
    return "tma_boxes" if page_box_tma_ok(page_size, tile_n) else "cp.async"
