"""Backend ``"cute"``: the blockdiff attention contract in CuTe DSL, on FlashAttention-4's SM90 forward kernel.

One launch serves a mixed serving batch: per-sequence causal row counts (``causal`` / ``num_causal_q``, read
from a device tensor by every work tile), sliding windows (one-sided for causal rows; symmetric or prefix for
bidirectional rows), paged (any page size; TMA loads when the page size is a multiple of 8 that divides
the key tile or is a multiple of it, see :func:`blockdiff.attention.cute.config.kv_load_path`) or contiguous KV,
GQA (FA4's PackGQA), head_dim up to 256 on FA4's kernel (128 and 256 are the tested ones) and equal head dims in
(256, 512] (multiples of 32; Gemma 4's global layers: 512) on the split-value kernel
(:class:`blockdiff.attention.cute.kernel_wide.FlashAttentionForwardSm90WideV`) or the roles kernel
(:class:`blockdiff.attention.cute.kernel_roles.FlashAttentionForwardSm90Roles`, the default at 512 where its tiles
load the pages: :func:`blockdiff.attention.cute.config.auto_wide_design`). Tile skipping follows each tile's
allowed key range in both directions (:func:`blockdiff.attention.cute.blocks.tile_plan` mirrors it on the host).
Semantics: docs/ARCHITECTURE.md "The attention contract"; the kernel is
:class:`blockdiff.attention.cute.kernel.FlashAttentionForwardSm90Mixed` (FA4's kernel, tile scheduler,
paged-KV loads and PackGQA kept; block ranges and masks replaced), algorithm from FlashAttention-3
(Shah et al., 2024) as implemented in flash-attn-4 (Dao-AILab/flash-attention, ``flash_attn/cute``); its tile
configuration: :mod:`blockdiff.attention.cute.config`.

Needs an NVIDIA Hopper GPU (SM90), flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1. This module imports
without them; :func:`attention_cute` raises ``ImportError`` naming the missing package.

CUDA graphs: no host sync on the launch path (value checks are skipped while capturing), the grid comes from
``q.shape[0]`` (a static capacity) and every per-step quantity (cu_seqlens_q, seq_lens, causal flags, block
table) is read on the device. Compile (first call per static configuration) before capturing.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import replace

import torch

from ..validate import (LOG2E, MIN_RAW_WEIGHT_SCALE_LOG2, check_attention_inputs, check_no_autograd,
                        length_hint_value, memory_overlaps)
from .compile_cache import make_compile_cache
from .config import (EXACT_WEIGHT_FFMA_BELOW, REQUIRED, WIDE_MAX_PAGE_BOXES, check_config, is_wide, kv_load_path,
                     resolve_launch_config, unsupported_head_dims)
# re-exported for bench/, which imports them from this module (their home is config.py / blocks.py)
from .blocks import tile_plan  # noqa: F401
from .config import SMEM_LIMIT_BYTES, CuteConfig, config_smem_bytes  # noqa: F401
from .tile_order import batch_work_order

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


_FA4 = None


def _fa4():
    """Import the CuTe DSL pieces lazily; ImportError names what is missing."""
    global _FA4
    if _FA4 is not None:
        return _FA4
    missing = []
    for mod, pkg in (("cutlass", "nvidia-cutlass-dsl"), ("flash_attn.cute", "flash-attn-4")):
        try:
            __import__(mod)
        except ImportError as e:  # noqa: PERF203
            missing.append(f"{pkg} (import {mod!r} failed: {e})")
    if missing:
        raise ImportError(
            f"attention backend 'cute' needs {REQUIRED}; missing: " + "; ".join(missing))
    try:
        # flash-attn-4 and the CuTe DSL are optional: imported at first use (kernel.py needs them at import)
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute.cute_dsl_utils import maybe_contiguous, to_cute_tensor
        from flash_attn.cute.testing import is_fake_mode
        from flash_attn.cute.utils import AuxData

        from flash_attn.cute.interface import flash_attn_combine

        from .kernel import FlashAttentionForwardSm90Mixed
        from .kernel_cluster import FlashAttentionForwardSm90MixedCluster, FlashAttentionForwardSm90WideVCluster
        from .kernel_split import FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90WideVSplit
        from .kernel_wide import FlashAttentionForwardSm90WideV
        # the roles kernel (wide_design "roles"; "auto" at hd 512 where its tiles load the pages) and its split-KV
        # variant
        from .kernel_roles import FlashAttentionForwardSm90Roles, FlashAttentionForwardSm90RolesSplit
    except ImportError as e:
        raise ImportError(
            f"attention backend 'cute' needs {REQUIRED}; importing them failed (wrong versions?): {e}") from e
    global _COMPILE_CACHE
    if _COMPILE_CACHE is _DEFAULT_CACHE and not _DEFAULT_CACHE:
        _COMPILE_CACHE = make_compile_cache()
    dtypes = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
    _FA4 = dict(cutlass=cutlass, cute=cute, to_cute_tensor=to_cute_tensor, maybe_contiguous=maybe_contiguous,
                is_fake_mode=is_fake_mode, AuxData=AuxData, Kernel=FlashAttentionForwardSm90Mixed,
                KernelWide=FlashAttentionForwardSm90WideV, KernelSplit=FlashAttentionForwardSm90MixedSplit,
                KernelWideSplit=FlashAttentionForwardSm90WideVSplit, KernelCluster=FlashAttentionForwardSm90MixedCluster,
                KernelWideCluster=FlashAttentionForwardSm90WideVCluster, KernelRoles=FlashAttentionForwardSm90Roles,
                KernelRolesSplit=FlashAttentionForwardSm90RolesSplit, combine=flash_attn_combine, dtypes=dtypes)
    return _FA4


#: ``FLASH_ATTENTION_ARCH`` as flash-attn-4 parses it (``sm_90``, ``sm_90a``, ``SM90``, ``90``, ``sm_100a``): the
#: last digit is the minor version, the others the major.
_ARCH_ENV = re.compile(r"(?:sm_?|SM_?)?([0-9]+)([0-9])([af]?)")


def _arch(device) -> int:
    """The compute capability as ``10 * major + minor``: ``FLASH_ATTENTION_ARCH`` when set (compile-only runs without
    a GPU, FA4's convention and format), else the device's.

    Raises:
        ValueError: ``FLASH_ATTENTION_ARCH`` set to anything else (was: its digits read loosely, so ``sm_100a`` was
            10, ``sm_90,sm_100`` and ``x9y0`` were 90, and ``""`` an int() error naming no variable).
    """
    env = os.environ.get("FLASH_ATTENTION_ARCH")
    if env is not None:
        m = _ARCH_ENV.fullmatch(env)
        if m is None:
            raise ValueError(f"FLASH_ATTENTION_ARCH must name one architecture as flash-attn-4 reads it (sm_90, "
                             f"sm_90a, 90), got {env!r}")
        return int(m[1]) * 10 + int(m[2])
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


#: Compiled kernels by compile key. The module's own empty dict until the first launch loads flash-attn-4
#: (:func:`_fa4`), which replaces it by :func:`.compile_cache.make_compile_cache` (FA4's JIT cache: on disk when
#: ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``); a cache a test put in its place stays.
_DEFAULT_CACHE: dict = {}
_COMPILE_CACHE = _DEFAULT_CACHE
#: What the last call ran (host-side record, for benchmarks and tests): ``kernel`` (the kernel class name),
#: ``config`` (the resolved :class:`~blockdiff.attention.cute.config.CuteConfig`, ``num_splits`` filled in) and
#: ``kv_path`` (:func:`~blockdiff.attention.cute.config.kv_load_path`). An empty call (no query rows) launches
#: nothing: ``kernel`` None, never the previous call's record.
LAST_LAUNCH: dict = {}


def attention_cute(
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
    """Mixed causal/bidirectional varlen attention on an H200 (SM90) in one kernel launch.

    Args:
        q: ``[total_q, num_heads, head_dim]`` bf16/fp16 on CUDA, packed by ``cu_seqlens_q``.
        k_cache, v_cache: paged ``[num_blocks, page_size, num_kv_heads, head_dim(_v)]`` with ``block_table``,
            or contiguous ``[total_k, num_kv_heads, head_dim(_v)]`` with ``cu_seqlens_k``.
        cu_seqlens_q: ``[B+1]`` int32.
        seq_lens: ``[B]`` int32 keys per sequence including its query tokens (tokens).
        causal: ``[B]`` bool per-sequence flag, or ``num_causal_q``: ``[B]`` int32 causal rows per sequence.
        block_table: ``[B, max_blocks]`` int32 (paged form); ``cu_seqlens_k``: ``[B+1]`` int32 (contiguous).
        window_size: None or int W >= 0 (keys per side, excluding the query's own position).
        bidirectional_window: ``"symmetric"`` or ``"prefix"`` (a compile-time property).
        scale: softmax scale, default ``head_dim ** -0.5``; zero, negative or below 2**-126 in magnitude runs as
            :func:`positive_scale` says.
        out: optional preallocated ``[total_q, num_heads, head_dim_v]`` of q's dtype; it may alias an input (the
            kernel then writes a private buffer, copied back).
        return_lse: a bool: also return ``lse [num_heads, total_q]`` fp32 (natural log).
        max_seqlen_q, max_seqlen_k: host hints (tokens). ``max_seqlen_q`` (default ``q.shape[0]``, i.e. total
            tokens, which turns the longest-first order on for a batch of four 256-token canvases) picks the
            long-prefill tile shape at hd 128 and the tile order (see
            :func:`~blockdiff.attention.cute.config.resolve_config`): pass the true
            maximum query length. The grid is sized from ``q.shape[0]``, so any value gives the right result.
            Both bound the keys a tile visits for the split-KV count
            (:func:`~blockdiff.attention.cute.config.choose_num_splits`; ``max_seqlen_k`` default: the cache
            capacity of a sequence), which any upper bound keeps correct.
        check_values: run the host-side value checks (default: yes unless a CUDA graph is being captured).
        config: :class:`~blockdiff.attention.cute.config.CuteConfig` or dict (tile_m, tile_n, mma_pv_is_rs,
            intra_wg_overlap, num_stages, lpt, num_splits, nan_safe_v, split_merge, wide_design, batch_order,
            v_refill, qk_issue, k_refill, skip_allowed_first, nan_safe_v_method, exact_weight); None:
            :func:`~blockdiff.attention.cute.config.resolve_launch_config`.
            ``num_splits`` > 1 runs split-KV: with ``split_merge="combine"`` the kernel writes fp32 partial
            outputs and LSEs per split and FA4's combine kernel merges them (two launches,
            :mod:`~blockdiff.attention.cute.kernel_split`); with ``"triton"`` the same partials are merged by
            :func:`blockdiff.attention.split_merge.merge_split_partials`, which also passes on a non-finite entry
            of a split whose weight underflows to 0 (``0 * NaN``; FA4's combine drops it); with ``"cluster"`` one
            launch whose splits of a tile
            form a thread-block cluster merging through distributed shared memory
            (:mod:`~blockdiff.attention.cute.kernel_cluster`); ``"auto"`` (the default) picks the cluster or
            the Triton merge (:func:`~blockdiff.attention.cute.config.auto_split_merge`). ``wide_design="auto"``
            (the default) runs the roles kernel at head dim 512 with the automatic tiles where its 64-key tiles
            load the pages by TMA boxes (``k_cache.shape[1]``), else the split-value kernel
            (:func:`~blockdiff.attention.cute.config.auto_wide_design`). ``batch_order="work"`` (``"auto"``'s
            choice for the roles kernel) has FA4's tile scheduler take the sequences longest tiles first (a
            permutation computed on the device per call, in one Triton launch:
            :func:`~blockdiff.attention.cute.tile_order_triton.batch_work_order_triton`; its torch reference
            :func:`~blockdiff.attention.cute.tile_order.batch_work_order`); the output is the same as
            ``"given"``'s. ``v_refill`` / ``qk_issue`` (``"auto"``: the V refill by halves and S issued one block
            ahead where the roles kernel runs at a value head dim divisible by 128) and ``k_refill`` (``"auto"``:
            the K stage refilled by head-dim halves where the roles kernel runs at a head dim divisible by 128,
            else the whole stage) change only the roles kernel's
            schedule; the output is the same. ``skip_allowed_first`` (``"auto"``, True or False; ``"auto"``: on
            where the launch splits KV, resolved from host shapes) skips NaN-safe V's scan of a tile's first key
            block where every row of the tile sees all of it (head dims <= 256 with ``nan_safe_v``; elsewhere
            resolved to False; :func:`~blockdiff.attention.cute.config.auto_skip_allowed_first`); the output is
            the same (the one exception: :class:`~blockdiff.attention.cute.config.CuteConfig`).
            ``nan_safe_v_method="recompute"`` keeps NaN-safe V by an epilogue test and recompute instead of the
            mainloop scan (head dims <= 256; :func:`nan_recompute_count`); ``"auto"`` (the default) takes it at head
            dim 256 and the scan elsewhere (:func:`~blockdiff.attention.cute.config.resolve_nan_safe_v_method`).
            ``exact_weight=True`` weighs each key ``exp2((s - max) * scale_log2)`` instead of FA4's one FFMA
            against a rounded ``max * scale_log2`` (which gives NaN rows for scores beyond ~2^31 in log2 units);
            default True (:class:`~blockdiff.attention.cute.config.CuteConfig`; False, FA4's weight, for A/B runs);
            ``"auto"`` keeps FA4's FFMA on a warp's key block where every row's ``|max * scale_log2|`` is below
            2**8 (each weight is then off by at most 2**-17 in log2 units, half an ulp of that product; two key
            blocks' weights relative to each other by 2**-16) and weighs exactly elsewhere (an A/B switch, not
            the default: docs/tuning.md 7.65).

    Returns:
        ``out [total_q, num_heads, head_dim_v]`` (q's dtype) or ``(out, lse)``.

    Raises:
        ImportError: flash-attn-4 / nvidia-cutlass-dsl missing (the message names them).
        TypeError, ValueError: contract violations (see :mod:`blockdiff.attention.validate`); a bad ``config``
            field (:func:`~blockdiff.attention.cute.config.check_config`, checked before the CuTe DSL import);
            tensors not on a CUDA device; a negative 0-d tensor ``max_seqlen_q`` / ``max_seqlen_k`` (read on the
            host at launch); ``v_refill="halves"`` / ``qk_issue="ahead"`` / ``k_refill="halves"`` where
            ``wide_design`` does not resolve to
            the roles kernel for this call's head dims and page size (a ValueError at the call, since the page size
            decides); ``FLASH_ATTENTION_ARCH`` / ``FLASH_ATTENTION_NUM_SMS`` set to a value that is not one
            architecture (``sm_90``, ``sm_90a``, ``90``) / a decimal int >= 1.
        NotImplementedError: valid input outside this backend: dtype other than bf16/fp16, head dims outside
            8..256 (multiples of 8) and outside equal multiples of 32 in (256, 512]
            (:func:`~blockdiff.attention.cute.config.unsupported_head_dims`), a GPU other than SM90; with an
            explicit ``wide_design="roles"`` at head dims above 256, a page size the TMA page boxes cannot load
            (``"auto"`` takes the split-value kernel there); grad mode on and an input (or ``out``) that requires
            grad (the kernels compute no gradients: :func:`blockdiff.attention.validate.check_no_autograd`).
    """
    info = check_attention_inputs(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, causal=causal,
        num_causal_q=num_causal_q, block_table=block_table, cu_seqlens_k=cu_seqlens_k,
        window_size=window_size, bidirectional_window=bidirectional_window, scale=scale, out=out,
        check_values=check_values, return_lse=return_lse, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    # Valid inputs this backend does not cover raise NotImplementedError (benchmarks record a skip).
    if q.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"backend 'cute' (FA4 SM90) runs bf16/fp16 only, got {q.dtype}")
    why = unsupported_head_dims(info.head_dim, info.head_dim_v)
    if why is not None:
        raise NotImplementedError(f"backend 'cute': {why}")
    check_no_autograd("cute", q, k_cache, v_cache, out)
    # a bad config field is refused here, before the CuTe DSL import and any GPU work
    check_config(config, head_dims=(info.head_dim, info.head_dim_v))
    fa = _fa4()
    if q.device.type != "cuda":
        raise ValueError(f"backend 'cute' needs CUDA tensors, got q on {q.device}")
    arch = _arch(q.device)
    if arch // 10 != 9:
        raise NotImplementedError(
            f"backend 'cute' runs FA4's SM90 kernel and needs a Hopper GPU (sm_90), got sm_{arch}")

    # FA4's online softmax holds for scale > 0 only; the exact weight also needs |scale * log2(e)| >= 2**-120
    q, scale = positive_scale(q, info.scale, exact_weight=_exact_weight_of(config))
    return _run(fa, q, k_cache, v_cache, out=out, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                num_causal_q=info.num_causal_q, seq_lens=info.seq_lens,
                block_table=block_table if info.paged else None, cu_seqlens_k=cu_seqlens_k,
                window_size=info.window_size, bidirectional_window=bidirectional_window, scale=scale,
                arch=arch, config=config, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


#: The least ``scale * log2(e)`` the exact key weight (``CuteConfig.exact_weight``) takes as given (2**-120;
#: :data:`..validate.MIN_RAW_WEIGHT_SCALE_LOG2` says why).
MIN_EXACT_WEIGHT_SCALE_LOG2 = MIN_RAW_WEIGHT_SCALE_LOG2


def _exact_weight_of(config) -> bool:
    """Whether ``config``'s ``exact_weight`` (None, a dict or a CuteConfig, already checked by ``check_config``)
    weighs any key exactly (True or ``"auto"``): a dict without it and None take :class:`CuteConfig`'s default, as
    the resolved config does."""
    if isinstance(config, CuteConfig):
        return bool(config.exact_weight)
    return bool((config or {}).get("exact_weight", CuteConfig.exact_weight))


def positive_scale(q: torch.Tensor, scale: float, *, exact_weight: bool = False) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` for the kernel: ``scale > 0`` and the same fp32 scores ``(q . k) * scale`` bit for bit.

    FA4's online softmax takes each row's max of the raw scores and scales after it (``exp2(S * scale_log2 -
    max(S) * scale_log2)``), which is the softmax only for ``scale > 0``: at scale 0 a masked score (-inf) times 0 is
    NaN, at a negative scale +inf, and the raw max is the scaled minimum. A negative scale runs ``-q`` with
    ``|scale|`` (negation is exact, so every product and fp32 sum is the negated one); scale 0 runs ``q * 0`` with
    scale 1 (every score 0, NaN where q or k holds a non-finite entry, as ``(q . k) * 0``).

    FA4 takes the scale as an fp32 and runs ``scale_log2 = scale * log2(e)`` in fp32, so a scale whose fp32 value
    is not a normal float (``|scale| < 2**-126``) gave a ``scale_log2`` of 0 or a subnormal (0 to a flush-to-zero
    multiply), which made every row with a masked key NaN (scale 1e-300). Such a scale runs as 0 (``q * 0``, scale
    1) where it is 0 in fp32 (``|scale| <= 2**-150``: the contract's scores are ``(q . k) * 0`` too); where its fp32
    value is a subnormal ``s`` it runs ``q * 2**-24`` (signed as the scale) with ``s * 2**24`` (a normal, as is its
    ``scale_log2``): a power of two, exact in bf16 (fp16) but for q entries below 2**-102 (2**10), rounded as
    subnormals (a score error below 2**-98 at this scale), so the scores are the contract's own, which at bf16's
    range can be of order 1 (``q . k`` near 2**126 at scale 2**-127: running it as 0 gave the mean of the keys, 0.9
    off). A positive scale returns ``q`` itself; otherwise one elementwise op into a new tensor (no host sync:
    capturable).

    With ``exact_weight`` (``CuteConfig.exact_weight``: each key weighs ``exp2((s - m) * scale_log2)`` on raw fp32
    scores) a normal scale with ``|scale| * log2(e)`` below :data:`MIN_EXACT_WEIGHT_SCALE_LOG2` (2**-120) also runs
    ``q * 2**-24`` (signed) with ``|scale| * 2**24``: at such a scale two finite raw scores near +-2**127 (3.2e38
    and -2e38 at scale 1e-38) have a difference ``s - m`` that overflows to ``-inf``, a weight of 0 where the key's
    exact weight is up to 2**-4 (e^-5.2 there); with raw scores below 2**104 it cannot overflow. FA4's own weight
    ``exp2(s * scale_log2 - m * scale_log2)`` multiplies first, so without the switch such scales pass as given."""
    if abs(scale) < 2.0 ** -126:  # (fp32 subnormal or 0; at least 2**-126, fp32 scale and scale_log2 are normal)
        s32 = struct.unpack("f", struct.pack("f", abs(scale)))[0]  # |scale| in fp32, as the contract's scores use it
        if s32 == 0.0:
            return q * 0, 1.0
        return q * math.copysign(2.0 ** -24, scale), s32 * 2.0 ** 24  # s32 * 2**24 >= 2**-125
    if exact_weight and abs(scale) * LOG2E < MIN_EXACT_WEIGHT_SCALE_LOG2:  # |scale| * 2**24 * log2(e) >= 2**-102
        return q * math.copysign(2.0 ** -24, scale), abs(scale) * 2.0 ** 24
    if scale > 0:
        return q, scale
    return torch.neg(q), -scale


def _work_order(cu_q, seq_lens, ncq, window_size, bidirectional_window):
    """The batch permutation of ``batch_order="work"``: one Triton launch for CUDA tensors
    (:func:`~blockdiff.attention.cute.tile_order_triton.batch_work_order_triton`, Triton imported on first use),
    the torch reference (:func:`~blockdiff.attention.cute.tile_order.batch_work_order`, the same permutation)
    elsewhere."""
    if seq_lens.is_cuda:
        from .tile_order_triton import batch_work_order_triton
        # int32 and dense like cu_q and ncq (seq_lens is validated < 2^31): one compiled variant per window mode
        # (paged calls pass seqused_k, already converted: no second copy)
        return batch_work_order_triton(cu_q, seq_lens.to(torch.int32).contiguous(), ncq, window_size,
                                       bidirectional_window)
    return batch_work_order(cu_q, seq_lens, ncq, window_size, bidirectional_window)


def _run(fa, q, k_cache, v_cache, *, out, return_lse, cu_seqlens_q, num_causal_q, seq_lens, block_table,
         cu_seqlens_k, window_size, bidirectional_window, scale, arch, config, max_seqlen_q=None,
         max_seqlen_k=None):
    """Launch (compiling on first use) on validated inputs. No host sync."""
    total_q, H, head_dim = q.shape
    num_kv_heads, head_dim_v = v_cache.shape[-2], v_cache.shape[-1]
    paged = block_table is not None
    given = out is not None  # only a caller's out can overlap an input (no pointer math for a fresh one)
    if out is None:
        out = torch.empty(total_q, H, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, total_q, dtype=torch.float32, device=q.device) if return_lse else None
    if total_q == 0:
        LAST_LAUNCH.clear()
        LAST_LAUNCH.update(kernel=None, config=None, kv_path=None)
        return (out, lse) if return_lse else out
    mc = fa["maybe_contiguous"]
    # The kernel writes a dense, 16-byte aligned out that overlaps no input (out may alias one: the contract; a
    # tile's output must not land on K / V rows another tile still reads); any other caller-given out gets a copy
    # back (host pointer math, no sync).
    out_k = out if mc(out) is out and out.is_contiguous() and not (given and any(
        memory_overlaps(out, t) for t in (q, k_cache, v_cache))) else torch.empty(
        total_q, H, head_dim_v, dtype=q.dtype, device=q.device)

    qhead_per_kvhead = H // num_kv_heads
    pack_gqa = qhead_per_kvhead > 1
    # the hints as host ints (a 0-d tensor is read here and checked like the int form)
    max_seqlen_q = length_hint_value("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = length_hint_value("max_seqlen_k", max_seqlen_k)
    # tiles and the split count from host shapes only (config.choose_num_splits)
    cfg = resolve_launch_config(
        head_dim, head_dim_v, window_size, config, total_q=total_q, num_seqs=cu_seqlens_q.shape[0] - 1,
        num_kv_heads=num_kv_heads, qhead_per_kvhead=qhead_per_kvhead,
        keys_capacity=block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[0],
        max_seqlen_q=max_seqlen_q if max_seqlen_q is not None else q.shape[0], max_seqlen_k=max_seqlen_k,
        num_sms=_num_sms(q.device), page_size=k_cache.shape[1] if paged else None)
    # Strided q / caches are fine (dynamic strides) as long as the last dim is dense and 16-byte aligned.
    q, k_cache, v_cache = mc(q), mc(k_cache), mc(v_cache)
    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    ncq = num_causal_q.to(torch.int32).contiguous()
    if paged:
        page_table = mc(block_table.to(torch.int32), align_bytes=4)
        seqused_k = seq_lens.to(torch.int32).contiguous()
        cu_k = None
        roles = is_wide(head_dim, head_dim_v) and cfg.wide_design == "roles"
        kv_path = kv_load_path(k_cache.shape[1], cfg.tile_n,
                               WIDE_MAX_PAGE_BOXES if is_wide(head_dim, head_dim_v) and not roles else None)
        if roles and kv_path == "cp.async":  # an explicit choice ("auto" resolves to split_v for such pages)
            raise NotImplementedError(
                f"backend 'cute', wide_design 'roles': paged K/V load by TMA page boxes only (page size a multiple "
                f"of 8 that divides tile_n {cfg.tile_n} or is a multiple of it), got page size {k_cache.shape[1]}; "
                "use wide_design 'split_v' or 'auto' (which takes the split-value kernel there)")
        paged_kv_non_tma = kv_path == "cp.async"
        kv_page_size = k_cache.shape[1] if kv_path == "tma_boxes" else None
    else:
        page_table = None
        seqused_k = None
        cu_k = cu_seqlens_k.to(torch.int32).contiguous()
        paged_kv_non_tma = False
        kv_page_size = None
        kv_path = "tma"
    has_window = window_size is not None
    # Without a window the prefix/symmetric choice is moot: one compiled kernel serves both.
    prefix = bidirectional_window == "prefix" and has_window

    split = cfg.num_splits > 1
    cluster = split and cfg.split_merge == "cluster"  # the merge inside the launch (kernel_cluster.py)
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(kernel=_kernel_name(head_dim, head_dim_v, cfg, split, cluster), config=cfg, kv_path=kv_path)
    # nan_safe_v on a dense V cache: its fix-up reads V through a layout with static strides (only the base pointer
    # stays live in the kernel: dynamic strides cost the hd-256 / paged hd-512 kernels spills), so the compile key
    # holds the cache's inner shape
    # (nan_safe_v_method "recompute": the same for the Q tensor and both caches, which it reads; a tuple of three)
    recompute = _nan_recompute(cfg)
    if recompute:
        v_static = tuple(tuple(t.shape[1:]) if t.is_contiguous() else None for t in (q, k_cache, v_cache))
    else:
        v_static = tuple(v_cache.shape[1:]) if cfg.nan_safe_v and v_cache.is_contiguous() else None
    # the NaN-safe reads of Q / K / V (cold paths) index in 64 bits only where a tensor's storage reaches 2^31
    # elements (kernel.py wide_offsets: 32-bit coordinates keep the hd-256 kernels' registers)
    wide_offsets = bool(cfg.nan_safe_v) and any(_storage_elements(t) >= 2 ** 31 for t in (q, k_cache, v_cache))
    # the two-launch merges ("combine", "triton") run the same split kernel: one compile key for both
    key_cfg = replace(cfg, split_merge="combine") if cfg.split_merge == "triton" else cfg
    # the CuTe DSL keeps a stride of 0 static in a dynamic layout (FA4's get_broadcast_dims): an expand()ed Q / K / V,
    # block table, out or metadata view compiles a kernel of its own (one compiled for stride 0 would read element 0
    # of every row of a dense tensor, and the reverse)
    broadcast = broadcast_dims(q, k_cache, v_cache, out_k, cu_q, cu_k, seqused_k, page_table, ncq)
    key = (q.dtype, head_dim, head_dim_v, qhead_per_kvhead, pack_gqa, key_cfg, paged, paged_kv_non_tma,
           kv_page_size, has_window, prefix, return_lse and (cluster or not split), arch, v_static, wide_offsets,
           broadcast)
    aux = [ncq]
    if cluster:  # the kernel merges and writes out (and the LSE) itself: no workspace
        aux += [out_k] + ([lse] if return_lse else [])
    elif split:  # each split's normalised fp32 output and LSE, merged below (FA4's combine, or the Triton merge)
        aux += [torch.empty(cfg.num_splits, total_q, H, head_dim_v, dtype=torch.float32, device=q.device),
                torch.empty(cfg.num_splits, H, total_q, dtype=torch.float32, device=q.device)]
    if recompute:  # the recompute reads Q, K and V itself and counts recomputing warps (kernel.py)
        aux += [q, k_cache, v_cache, _recompute_counter(q.device, fa["is_fake_mode"]())]
    elif cfg.nan_safe_v:  # the NaN-safe fix-up reads V itself (kernel.py, "NaN-safe V"): the last aux tensor
        aux.append(v_cache)
    if cfg.batch_order == "work":  # the scheduler's batch permutation, after every other aux tensor (kernel.py,
        # "The batch order"): one Triton launch on CUDA tensors, no host read (tile_order.py); compile-only
        # (FA4's fake mode: tensors without data, which a CPU build of torch cannot compute on) needs its shape only
        aux.append(torch.empty(cu_q.shape[0] - 1, dtype=torch.int32, device=q.device) if fa["is_fake_mode"]()
                   else _work_order(cu_q, seq_lens if seqused_k is None else seqused_k, ncq, window_size,
                                    bidirectional_window))
    lse_k = None if split else lse
    try:  # one lookup (a dict, or FA4's JIT cache, which has no .get and loads a disk entry inside [])
        compiled = _COMPILE_CACHE[key]
    except KeyError:
        compiled = None
    if compiled is None:
        with torch.profiler.record_function(compile_range_name(LAST_LAUNCH["kernel"], cfg)):
            compiled = _compile(fa, key, q, k_cache, v_cache, out_k, lse_k, scale, cu_q, cu_k, seqused_k,
                                page_table, window_size, aux)
        _COMPILE_CACHE[key] = compiled
    if not fa["is_fake_mode"]():
        compiled(q, k_cache, v_cache, out_k, lse_k, scale, cu_q, cu_k, None, seqused_k, page_table,
                 window_size, window_size, None, None, fa["AuxData"](aux, None), None, None)
    fake = fa["is_fake_mode"]()
    if split and not cluster and cfg.split_merge == "triton":
        if not fake:  # the shared Triton merge: workspace [S, total_q, H, Dv] and [S, H, total_q], lse [H, total_q]
            from ..split_merge import launch_merge  # Triton at first use, as the tile-order launch
            launch_merge(aux[1], aux[2], out_k, lse if return_lse else None)  # tensors allocated above: no checks
    elif split and not cluster:
        # (splits, total_q, H) views with total_q contiguous, FA4's combine layout for the LSEs
        _, lse_merged = fa["combine"](aux[1], aux[2].permute(0, 2, 1), out=out_k, cu_seqlens=cu_q,
                                      return_lse=return_lse)
        if return_lse and not fake:
            lse.copy_(lse_merged.t())
    if out_k is not out and not fake:
        out.copy_(out_k)
    return (out, lse) if return_lse else out


def _kernel_name(head_dim: int, head_dim_v: int, cfg: CuteConfig, split: bool, cluster: bool) -> str:
    """Class name of the kernel a resolved config runs (``LAST_LAUNCH["kernel"]``; also the key into the kernel
    classes of :func:`_fa4`): FA4's family below head dim 257, above it the split-value kernel or, with
    ``wide_design="roles"``, the roles kernel (no cluster variant: ``config.check_config`` refuses it)."""
    if not is_wide(head_dim, head_dim_v):
        base = "FlashAttentionForwardSm90Mixed"
    elif cfg.wide_design == "roles":
        base = "FlashAttentionForwardSm90Roles"
    else:
        base = "FlashAttentionForwardSm90WideV"
    return base + ("Cluster" if cluster else "Split" if split else "")


#: Kernel class names (:func:`_kernel_name`) -> keys of :func:`_fa4`'s classes.
_KERNEL_KEYS = {
    "FlashAttentionForwardSm90Mixed": "Kernel", "FlashAttentionForwardSm90MixedSplit": "KernelSplit",
    "FlashAttentionForwardSm90MixedCluster": "KernelCluster", "FlashAttentionForwardSm90WideV": "KernelWide",
    "FlashAttentionForwardSm90WideVSplit": "KernelWideSplit", "FlashAttentionForwardSm90WideVCluster":
    "KernelWideCluster", "FlashAttentionForwardSm90Roles": "KernelRoles",
    "FlashAttentionForwardSm90RolesSplit": "KernelRolesSplit",
}


def compile_range_name(kernel: str, cfg: CuteConfig) -> str:
    """Name of the profiler range around a first-use compile (``blockdiff:cute_compile <kernel> <tiles> s<splits>``):
    a serving profile's idle-gap attribution (``bench_serve.attribute_idle_gaps``) then names JIT compiles apart
    from steady-state host work. Only the compile path opens it, so a cached launch pays nothing."""
    return f"blockdiff:cute_compile {kernel} {cfg.tile_m}x{cfg.tile_n} s{cfg.num_splits}"


_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (FLASH_ATTENTION_NUM_SMS when set: compile-only runs).

    Raises:
        ValueError: ``FLASH_ATTENTION_NUM_SMS`` set to anything but a decimal int >= 1 (was: ``int()``'s reading, so
            ``1_32`` was 132, ``0`` or ``-4`` reached the split choice, or were used unchecked with a config's
            ``num_splits``, and ``abc`` raised an error naming no variable).
    """
    env = os.environ.get("FLASH_ATTENTION_NUM_SMS")
    if env is not None:
        if not re.fullmatch(r"[0-9]+", env) or int(env) < 1:
            raise ValueError(f"FLASH_ATTENTION_NUM_SMS must be a decimal int >= 1 (the GPU's SMs), got {env!r}")
        return int(env)
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _compile(fa, key, q, k, v, out, lse, scale, cu_q, cu_k, seqused_k, page_table, window_size, aux):
    (dtype, head_dim, head_dim_v, qhead_per_kvhead, pack_gqa, cfg, paged, paged_kv_non_tma, kv_page_size,
     has_window, prefix, return_lse, arch, v_static, wide_offsets, _broadcast) = key
    cute, tct = fa["cute"], fa["to_cute_tensor"]
    split = dict(num_splits=cfg.num_splits) if cfg.num_splits > 1 else {}
    cluster = bool(split) and cfg.split_merge == "cluster"
    if cluster:  # the kernel writes the merged LSE (an aux tensor) when the call returns it
        split["merge_lse"] = return_lse
    kernel_cls = fa[_KERNEL_KEYS[_kernel_name(head_dim, head_dim_v, cfg, bool(split), cluster)]]
    kernel = kernel_cls(
        fa["dtypes"][dtype],
        head_dim,
        head_dim_v,
        qhead_per_kvhead,
        pack_gqa=pack_gqa,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        num_stages=cfg.num_stages,
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs,
        paged_kv_non_tma=paged_kv_non_tma,
        prefix_window=prefix,
        kv_page_size=kv_page_size,
        lpt=cfg.lpt,
        nan_safe_v=cfg.nan_safe_v,
        batch_order=cfg.batch_order,
        v_refill=cfg.v_refill,
        qk_issue=cfg.qk_issue,
        k_refill=cfg.k_refill,
        skip_allowed_first=cfg.skip_allowed_first,
        nan_safe_v_method=cfg.nan_safe_v_method,
        wide_offsets=wide_offsets,
        exact_weight=bool(cfg.exact_weight),  # "auto": the exact weight where FA4's FFMA would err (below)
        ffma_weight_below=EXACT_WEIGHT_FFMA_BELOW if cfg.exact_weight == "auto" else 0.0,
        **split,
    )
    small = lambda t, lead=0: None if t is None else tct(t, assumed_align=4, leading_dim=lead)  # noqa: E731
    recompute = _nan_recompute(cfg)
    # the tensors NaN-safe V reads, appended to the aux tensors: V (the fix-up), or Q, K, V and the counter
    nan_v = 4 if recompute else 1 if cfg.nan_safe_v else 0
    order = 1 if cfg.batch_order == "work" else 0  # the batch permutation appended after it
    body, order_t = aux[:len(aux) - order], aux[len(aux) - order:]
    if recompute:
        nan_t = [_nan_safe_v_tensor(fa, t, st) for t, st in zip(body[-4:-1], v_static)] + [small(body[-1])]
    else:
        nan_t = [_nan_safe_v_tensor(fa, body[-1], v_static)] if nan_v else []
    with kernel.trace_patches():  # page-box K/V TMA atoms (kv_page_size), FA4's tile order off (not lpt)
        return cute.compile(
            kernel,
            tct(q), tct(k), tct(v), tct(out, assumed_align=16),
            None if lse is None or cluster else tct(lse, assumed_align=4),
            scale,
            small(cu_q), small(cu_k), None, small(seqused_k), small(page_table, 1),
            window_size, window_size,
            None,  # learnable_sink
            None,  # block-sparse tensors
            fa["AuxData"]([small(body[0])] + [tct(t, assumed_align=16) for t in body[1:len(body) - nan_v]]
                          + nan_t
                          + [small(t) for t in order_t], None),
            None, None,  # cu_total_m_blocks (batch-lookup aid, not used)
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )


def broadcast_dims(*tensors) -> tuple:
    """Per tensor (None for None), which dims have stride 0: part of the compile key, because the CuTe DSL's
    ``mark_layout_dynamic`` keeps a stride of 0 static (flash-attn-4's ``get_broadcast_dims``, in its own compile
    keys), so a kernel compiled for an ``expand()``ed tensor and one for a dense tensor of the same shape differ. A
    size-1 dim counts too: its stride may be 0 (``torch.zeros(()).expand(1)``), and a kernel that baked it in would
    read element 0 for every row of a later, longer tensor. A tensor without a stride of 0 (every call's common
    case) is ``False``, not a tuple of ``False``: the same key, at a fifth of the host cost per call (nine tensors
    a call). Host shapes and strides only."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            st = t.stride()
            out.append(0 in st and tuple(s == 0 for s in st))
    return tuple(out)


def _nan_recompute(cfg) -> bool:
    """Whether a resolved config keeps NaN-safe V by the epilogue recompute (docs/tuning.md 2.34). ``_run`` (the aux
    tensors it appends) and ``_compile`` (how many of them it hands the kernel) must agree: one test for both."""
    return bool(cfg.nan_safe_v) and cfg.nan_safe_v_method == "recompute"


def _storage_elements(t: torch.Tensor) -> int:
    """Elements of ``t``'s storage (a view's whole cache: its offsets reach that far), at least ``t.numel()``."""
    try:
        return max(t.untyped_storage().nbytes() // t.element_size(), t.numel())
    except (RuntimeError, NotImplementedError):  # a tensor without a storage to ask
        return t.numel()


#: Per-device int32 [1] counters of the warps that ran the recompute (nan_safe_v_method "recompute"); one tensor per
#: device for the process's life, so a captured CUDA graph keeps adding to the same one.
_RECOMPUTE_COUNTERS: dict = {}


def _recompute_counter(device, fake: bool) -> torch.Tensor:
    """The recompute counter of ``device`` (a fresh placeholder under FA4's fake mode: compile only)."""
    if fake:
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = torch.device(device)
    if key not in _RECOMPUTE_COUNTERS:
        _RECOMPUTE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=key)
    return _RECOMPUTE_COUNTERS[key]


def nan_recompute_count(device=None, *, reset: bool = False) -> int:
    """How many warps ran NaN-safe V's recompute (``nan_safe_v_method="recompute"``) on ``device`` (default: the
    current CUDA device) since the process started or the last reset: 0 on caches whose V holds no NaN / Inf where a
    tile reads it (a recompute there would be a false positive of the test, docs/tuning.md 2.32). Reads the device
    counter (a host sync); ``reset=True`` sets it to 0 after reading. 0 for a device that never ran the recompute.
    The counter is made at the device's first recompute launch, which should be an eager one (as the first compile
    is): made inside a CUDA-graph capture, its zero fill would be captured and replayed. The int32 counter wraps
    after 2^31 warps."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    counter = _RECOMPUTE_COUNTERS.get(dev)
    if counter is None:
        return 0
    n = int(counter.item())
    if reset:
        counter.zero_()
    return n


def _nan_safe_v_tensor(fa, v, v_static):
    """The NaN-safe fix-up's view of the V cache: static strides when the cache is dense (``v_static``, its inner
    shape, is then part of the compile key; only the outer extent is dynamic), else fully dynamic strides."""
    if v_static is None:
        return fa["to_cute_tensor"](v, assumed_align=16)
    from cutlass.cute.runtime import from_dlpack  # optional dependency (imported with the rest in _fa4)
    return from_dlpack(v.detach(), assumed_align=16, enable_tvm_ffi=True).mark_compact_shape_dynamic(
        mode=0, stride_order=v.dim_order())


def compile_only(head_dim: int = 128, num_heads: int = 16, num_kv_heads: int = 8, page_size: int | None = 128,
                 window_size=None, bidirectional_window="symmetric", return_lse=False, dtype=torch.bfloat16,
                 config=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """Compile the kernel for one static configuration without a GPU (FA4's fake-tensor route).

    The batch is 2 sequences of 256 query tokens (head dims above 256 compile the kernel ``config``'s
    ``wide_design`` resolves to: at 512 by default the roles kernel where ``page_size`` allows it);
    ``max_seqlen_q`` is the host hint of :func:`attention_cute`
    (default: total tokens, 512: longest-first order; 256: the canvas tiles and plain order).

    Sets FA4's CPU-compile variables when unset (FLASH_ATTENTION_ARCH=sm_90, CUTE_DSL_ARCH=sm_90a,
    FLASH_ATTENTION_NUM_SMS=132); the compiled kernel lands in the compile cache (not runnable without a GPU).
    Raises ImportError without the packages; ValueError where ``FLASH_ATTENTION_ARCH`` / ``FLASH_ATTENTION_NUM_SMS``
    is already set to a value flash-attn-4's format / a decimal int >= 1 does not allow (:func:`attention_cute`'s
    rule; break25b).
    """
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    _fa4()
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, L, S = 2, 256, 1024
    with FakeTensorMode():
        dev = "cuda"
        q = torch.empty(B * L, num_heads, head_dim, dtype=dtype, device=dev)
        cu = torch.empty(B + 1, dtype=torch.int32, device=dev)
        sl = torch.empty(B, dtype=torch.int32, device=dev)
        ncq = torch.empty(B, dtype=torch.int32, device=dev)
        if page_size is None:
            k = torch.empty(B * S, num_kv_heads, head_dim, dtype=dtype, device=dev)
            v = torch.empty_like(k)
            kw = dict(cu_seqlens_k=torch.empty(B + 1, dtype=torch.int32, device=dev), seq_lens=sl)
        else:
            nb = B * math.ceil(S / page_size)
            k = torch.empty(nb, page_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
            v = torch.empty_like(k)
            kw = dict(block_table=torch.empty(B, math.ceil(S / page_size), dtype=torch.int32, device=dev),
                      seq_lens=sl)
        fa = _fa4()
        _run(fa, q, k, v, out=None, return_lse=return_lse, cu_seqlens_q=cu, num_causal_q=ncq,
             seq_lens=kw["seq_lens"], block_table=kw.get("block_table"), cu_seqlens_k=kw.get("cu_seqlens_k"),
             window_size=window_size, bidirectional_window=bidirectional_window,
             scale=head_dim ** -0.5, arch=_arch(None), config=config, max_seqlen_q=max_seqlen_q,
             max_seqlen_k=max_seqlen_k)


__all__ = ["attention_cute", "compile_only", "LAST_LAUNCH", "nan_recompute_count", "broadcast_dims"]
