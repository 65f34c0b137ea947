"""The Triton backend of the blockdiff attention contract (``backend="triton"``): :func:`attention_triton`.

Semantics: docs/ARCHITECTURE.md §4 "The attention contract" (oracle: :mod:`blockdiff.attention.reference`). One fused
varlen launch serves a batch that mixes causal and bidirectional rows over paged or contiguous KV:
FlashAttention-2's online softmax (Dao, 2023, arXiv:2307.08691) with flash-decoding's split-KV and exact LSE merge
(Dao et al., 2023, "Flash-Decoding for long-context inference") and vLLM's ``triton_unified_attention``
device-side tile -> sequence mapping.

Design
------
* **One launch, mixed row types.** Grid ``(n_tiles, num_kv_heads * n_dv_blocks, num_splits)`` with
  ``n_tiles = total_q // BLOCK_Q + B`` (host shapes only). Program ``t`` finds its sequence by a 16-ary search
  over the virtual tile starts ``cu_seqlens_q[b] // BLOCK_Q + b`` (:func:`.common.tile_sequence`): no host sync,
  no cumsum op. The causal flag is ``num_causal_q[b]`` or ``causal[b]`` read on the device, so a tile may mix
  causal and bidirectional rows. Each row allows one key interval (:func:`.common.row_key_interval`); tiles visit
  only the key blocks their rows allow, unmasked where every row allows every key.
* **Two kernels.** The portable kernel (:mod:`.portable`, ``IMPL="triton"``) runs on any GPU and on the CPU
  through the Triton interpreter; the warp-specialised Gluon kernels (:mod:`.gluon`, ``IMPL="gluon"``: TMA,
  mbarrier rings, wgmma; sm_90) run where they are tuned (:data:`.config.TUNED_GLUON_CONFIGS`: hd 128, hd 512,
  the hd-256 split regime) and the caches suit TMA (:func:`.tma.gluon_ineligible`). ``LAST_LAUNCH["impl"]``
  says which ran; ``config={"IMPL": "gluon"}`` on an input it cannot take raises ``ValueError`` (no silent
  fallback).
* **Split-KV.** For few long sequences (e.g. one 256-token canvas over 32k context) the key-block range of each
  tile is cut into ``num_splits`` chunks, chosen from host shapes (:func:`.config.choose_num_splits`: programs vs
  resident-program slots, and the key capacity). Partials (normalised out in fp32, plus each split's raw running
  max and sum: not an LSE, whose fp32 ulp near ``|LSE| ~ 1000`` the merge weights would inherit) are merged
  exactly by :func:`.common._merge_kernel` (:mod:`blockdiff.attention.split_merge`'s raw-stats format), launched
  with programmatic dependent launch on sm_90+. ``num_splits = 1`` writes ``out`` directly.
* **Configs.** ``config=dict(BLOCK_M, BLOCK_N, num_warps, num_stages, num_splits, BLOCK_DV, LAZY_RESCALE,
  BT_PREFETCH, IMPL, OVERLAP, V_STAGES)`` overrides the defaults and tuned tables (:mod:`.config`); resolved
  configs (:class:`.config.TritonConfig`) are cached per static signature in :class:`TritonAttention` instances
  (:func:`get_kernel`); Triton caches the compiled kernels per constexpr set.
* **No recompiles per step.** Per-step integers (total_q, B, tile count, window, split count) are excluded from
  Triton's integer specialization; the tile search takes ceil(bits(B) / 4) 16-ary steps, so batches of 1-15
  (16-255, ...) sequences share one compiled kernel.
* **CUDA graphs.** Everything per step (cu_seqlens_q, seq_lens, num_causal_q / causal, block_table) is read on
  the device; grid and split count depend only on shapes and host ints (``max_seqlen_k``), so a graph captured
  once replays correctly with new flags, lengths and block tables (the capacities must not grow).
* **Launch plans.** Calls with ``check_values=False`` plan their launch once per key (:mod:`.plans`) and later
  launch the compiled kernels directly.

Switches (module attributes, read at each call; for A/B runs of the probes)
---------------------------------------------------------------------------
* :data:`PLANS_ENABLED` (default True): False makes every call take the full path (validation, planning) and
  stores no plan.
* :data:`MERGE_PDL` (default True): False launches the split-KV merge without programmatic dependent launch (and
  compiles it without its griddepcontrol wait).
* :data:`PLANS`: the stored plans (``PLANS.clear()`` forgets them); :data:`LAST_LAUNCH`: what the last call ran.
"""
from __future__ import annotations

import torch

from ..validate import check_attention_inputs, check_length_hint, check_no_autograd, debug_checks
from .config import (TUNED_CONFIGS, TUNED_GLUON_CONFIGS, TUNED_SPLIT_CONFIGS, TritonAttention, choose_num_splits,
                     ctas_per_sm, default_config, get_kernel, interpreting)
from .plans import make_plan, plan_key, run_plan

#: Run the split-KV merge with programmatic dependent launch on sm_90+ (hides part of its launch latency behind
#: the attention kernel's tail). A switch for A/B runs.
MERGE_PDL = True
#: Store and reuse launch plans for calls with ``check_values=False``. A switch for A/B runs: off, every call
#: takes the full path and no plan is stored.
PLANS_ENABLED = True
#: Launch plans by call key (:func:`.plans.plan_key`), for calls with ``check_values=False``: the validation,
#: config choice, split count, grid and kernel arguments that follow from the key are computed once, and later
#: calls launch the compiled kernels directly (no Triton argument binding). Cleared when full.
PLANS: dict = {}
_MAX_PLANS = 1024
#: The last launch: ``kernel`` (compiled kernel handle, with n_regs / n_spills on the GPU), ``num_splits``,
#: ``grid``, ``config`` (the resolved config as a dict) and ``impl`` ("triton" or "gluon").
LAST_LAUNCH: dict = {}


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
        window_size: None or int W >= 0 (keys per side, excluding the query's own position); any
            ``W >= WINDOW_NO_BOUND`` is None (:func:`blockdiff.attention.masks.check_window`).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.
        scale: softmax scale (default ``head_dim ** -0.5``), ``|scale| <= MAX_SCALE``; scores in fp32 as the
            reference's (a score of magnitude ``2**128 / log2(e)`` or more, whose ``* log2(e)`` overflows the
            kernels' fp32, is outside the contract).
        out: optional preallocated ``[total_q, num_heads, head_dim_v]`` (q's dtype) written in place.
        return_lse: a bool: also return ``lse [num_heads, total_q]`` fp32 (natural log; -inf for rows with no
            key).
        max_seqlen_q: unused (the grid is sized from ``total_q`` and B). Both hints: None, an int >= 0 or a 0-d
            int tensor (:func:`blockdiff.attention.validate.check_length_hint`).
        max_seqlen_k: host int >= every seq_len (static capacity is fine); sizes the split-KV count. Default:
            the block table's capacity (``max_blocks * page_size``) or ``total_k``.
        check_values: host-side value checks (default: on, except under CUDA-graph capture). False keeps
            the launch path free of host syncs, and plans the call once per key (shapes, strides, dtypes,
            devices, 16-byte alignment of the tensors, the host scalars, config, whether ``out`` overlaps an
            input): later calls with the same key skip validation and planning and launch the compiled kernels
            directly (:data:`PLANS`; values, flags, lengths and block tables may change between them).
            The fast path trusts the value rules (:func:`blockdiff.attention.attention`: ``cu_seqlens_q`` from
            0, non-decreasing, ending at ``total_q``; ``q_len <= seq_lens <= MAX_SEQ_LEN``; ``num_causal_q`` in
            ``[0, q_len]``; the block table covering ``cdiv(seq_len, page_size)`` columns of page ids in
            ``[0, num_blocks)``; in the contiguous form ``cu_seqlens_k`` from 0, non-decreasing, within the cache,
            matching ``seq_lens``): results for input breaking them are unspecified. What the kernels still
            guard: the portable kernel clamps page ids into ``[0, num_blocks)``, ``seq_lens`` into ``[0, the
            block table's capacity]`` (contiguous: ``cu_seqlens_k`` and ``seq_lens`` to the cache rows) and query rows to
            ``[0, total_q)``, so it never reads or writes outside its tensors; the Gluon kernels read K / V
            through TMA descriptors, which bounds-check (a bad page id reads zeros), but a ``seq_lens`` beyond
            the block table or a ``cu_seqlens_q`` beyond ``q`` is an out-of-bounds access there. The debug
            switch (:func:`blockdiff.attention.set_debug_checks`, ``BLOCKDIFF_CHECK_VALUES=1``) makes
            ``check_values=False`` calls take the full, checked path (no plan), except under capture.
        config: optional dict overriding BLOCK_M (rows = tokens x padded GQA group), BLOCK_N (keys per block),
            num_warps, num_stages, num_splits (split-KV count; None = automatic), BLOCK_DV (V head-dim slice per
            program), LAZY_RESCALE (bool, default False), BT_PREFETCH (bool, default True), IMPL ("triton" or
            "gluon": the warp-specialised Hopper kernel; default: chosen per input, see
            :data:`.config.TUNED_GLUON_CONFIGS`) and
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
        ``out`` or ``(out, lse)``; rows with no allowed key are 0 with lse -inf. Keys outside a row's allowed
        set contribute nothing, NaN / Inf in their K or V included, in the portable kernel, and in the Gluon
        kernels with ``config["NAN_SAFE_V"]`` (the default; a masked block's V cleaned in shared memory and a
        cold fix-up of the rows that do allow a non-finite entry: :mod:`.gluon`). With it set to False the Gluon
        kernels zero only stale V rows (at or past ``seq_len``): a non-finite V
        entry of a key inside ``seq_len`` that a row may not see, in a key block the row's tile visits (a causal
        diagonal, a window edge), reaches that row's output; finite V is exact there too.

    Raises:
        NotImplementedError: grad mode on and an input (or ``out``) that requires grad: the kernels compute no
            gradients (:func:`blockdiff.attention.validate.check_no_autograd`; the reference is differentiable).
        TypeError, ValueError: see :func:`blockdiff.attention.validate.check_attention_inputs`; also a bad
            ``config`` (unknown key, tile not a power of two >= 16: ValueError; a value of the wrong type, e.g. a
            bool for ``num_splits`` or an int for ``LAZY_RESCALE``: TypeError naming the key) or a non-unit last-dim
            stride.
    """
    if isinstance(q, torch.Tensor) and q.device.type != "cuda" and not interpreting():
        raise ValueError(f"backend 'triton' needs CUDA tensors, got q on {q.device}; on the CPU set "
                         "TRITON_INTERPRET=1 before importing triton to run the kernel in the Triton interpreter")
    check_no_autograd("triton", q, k_cache, v_cache, out)  # (the launch plans too: a host check, no sync)
    calls = (cu_seqlens_q, seq_lens, causal, num_causal_q, block_table, cu_seqlens_k)
    if check_values is False and debug_checks():
        check_values = None  # the debug switch: the full path, value checks included (unless capturing)
    key = None
    if check_values is False and PLANS_ENABLED:
        # max_seqlen_q is in no plan key (the kernels do not read it), so its type rule is checked here, as the full
        # path checks it: a planned call must not accept what the same call without a plan refuses
        check_length_hint("max_seqlen_q", max_seqlen_q)
        # the launch plan of an earlier call with the same key (host work only; see plans.plan_key)
        key = plan_key(q, k_cache, v_cache, calls, window_size, bidirectional_window, scale, out, return_lse,
                       max_seqlen_k, config, MERGE_PDL)
        plan = PLANS.get(key) if key is not None else None
        if plan is not None:
            return run_plan(plan, q, k_cache, v_cache, calls, out, LAST_LAUNCH)
    info = check_attention_inputs(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, causal=causal,
        num_causal_q=num_causal_q, block_table=block_table, cu_seqlens_k=cu_seqlens_k,
        window_size=window_size, bidirectional_window=bidirectional_window, scale=scale, out=out,
        check_values=check_values, allowed_dtypes=(torch.bfloat16, torch.float16, torch.float32),
        return_lse=return_lse, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    plan = make_plan(q, k_cache, v_cache, info, block_table, window_size, bidirectional_window, out, return_lse,
                     max_seqlen_k, config, MERGE_PDL)
    if key is not None:
        if len(PLANS) >= _MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
    # the validated seq_lens / causal row counts (already int32): not converted again
    return run_plan(plan, q, k_cache, v_cache, calls, out, LAST_LAUNCH, seq_lens=info.seq_lens,
                    causal_rows=None if info.causal is not None else info.num_causal_q)


__all__ = ["attention_triton", "default_config", "choose_num_splits", "ctas_per_sm", "get_kernel",
           "TritonAttention", "TUNED_CONFIGS", "TUNED_GLUON_CONFIGS", "TUNED_SPLIT_CONFIGS", "LAST_LAUNCH", "PLANS",
           "PLANS_ENABLED", "MERGE_PDL"]
