"""The roles kernel's V refill by halves (``CuteConfig.v_refill="halves"``; blockdiff.attention.cute.kernel_roles,
docs/tuning.md 2.12 remedy 2 and 2.15): each P V warpgroup's warp 0 refills the half of a V stage its own warpgroup
reads, through a per-half pipeline, as soon as its own warpgroup released it.

* CPU (CI, no flash-attn-4): the field's validation (choices, types and ``wide_design="split_v"`` in
  ``test_cute_roles_switches.py``; with
  ``"auto"`` only where it resolves to the roles kernel), dispatch (``_compile`` monkeypatched); below head
  dim 257 and the compile key in ``test_cute_roles_switches.py`` (every roles switch);
* compile-only for sm_90a without a GPU (flash-attn-4 and nvidia-cutlass-dsl installed, skipped in CI): the bench's
  paged configuration and contiguous K/V, no spills, the default kernel's registers and shared memory;
* GPU (``python3 -m pytest -m gpu``, on the H200): against the fp64 reference and against the default roles kernel
  (paged 64 / 16 / 8 / 256 and contiguous, causal / bidirectional / split rows, windows, NaN-safe V on and off,
  cache rows past each sequence's end poisoned, split-KV).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca

from cute_helpers import (HAVE_FA4, compile_for_sm90_or_skip, gpu_batch, needs_gpu, rows_past_seq_lens_check,
                          run_and_check)
from test_cute_kernel_roles import _kinds_to_ncq

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")
HALVES = dict(wide_design="roles", v_refill="halves")  # with qk_issue "auto": S issued ahead
ONE_WARP = dict(wide_design="roles", v_refill="one_warp")  # with qk_issue "auto": S serial (2.17's roles kernel)


# --- CPU: config ----------------------------------------------------------------------------------------------
def test_v_refill_defaults_to_auto_which_resolves_to_halves_for_the_roles_kernel():
    """docs/tuning.md 2.20: the roles kernel's measured best is the V refill by halves with S issued ahead."""
    assert cc.CuteConfig().v_refill == "auto"
    assert cc.V_REFILLS == ("auto", "one_warp", "halves")
    assert cc.resolve_config(512, 512, None, ROLES, 256).v_refill == "halves"
    assert cc.resolve_config(512, 512, None, dict(ROLES, v_refill="one_warp"), 256).v_refill == "one_warp"
    r = cc.resolve_config(512, 512, None, HALVES, 256)
    assert (r.tile_m, r.tile_n, r.num_stages, r.wide_design, r.v_refill) == (64, 64, 1, "roles", "halves")
    # a switch, not a tile field: the tiles are the roles kernel's automatic ones, the shared memory unchanged
    one_warp = cc.resolve_config(512, 512, None, dict(ROLES, v_refill="one_warp"), 256)
    assert replace(r, qk_issue="serial") == replace(one_warp, v_refill="halves")
    assert cc.config_smem_bytes(r, 512, 512) == 218_112
    assert cc.resolve_config(512, 512, None, cc.CuteConfig(wide_design="roles", v_refill="halves"), 256) == r


@pytest.mark.parametrize("page", [None, 64, 16, 8, 256])
def test_auto_with_halves_resolves_to_the_roles_kernel_where_auto_picks_it(page):
    """wide_design "auto" (the default) with v_refill "halves": accepted by check_config, the roles kernel at hd 512
    with the automatic tiles on contiguous K/V and pages its boxes load (and the work order)."""
    for config in (dict(v_refill="halves"), cc.CuteConfig(v_refill="halves")):
        assert cc.check_config(config) is config
        r = cc.resolve_config(512, 512, None, config, 256, page_size=page)
        assert r == cc.resolve_config(512, 512, None, HALVES, 256, page_size=page)
        assert (r.wide_design, r.v_refill, r.batch_order) == ("roles", "halves", "work")
        assert r.qk_issue == ("serial" if page in (8, 16) else "ahead")  # cc.QK_AHEAD_MIN_PAGE


@pytest.mark.parametrize("hd,config,page,why", [
    (512, dict(v_refill="halves"), 48, "page size 48"),
    (512, dict(v_refill="halves"), 12, "page size 12"),
    (512, dict(v_refill="halves", tile_n=64), None, "tile_n"),
    (512, dict(v_refill="halves", num_splits=2, num_stages=1), 64, "num_stages"),
    (512, dict(v_refill="halves", split_merge="cluster"), None, "cluster"),
    (384, dict(v_refill="halves"), 64, "head dim 512 only"),
    (288, dict(v_refill="halves"), None, "head dim 512 only"),
])
def test_auto_with_halves_is_a_value_error_naming_why_auto_did_not_pick_roles(hd, config, page, why):
    """Where "auto" resolves to the split-value kernel, "halves" (a roles-kernel switch) is refused with the rule
    and the reason, never silently dropped; an explicit "roles" is the way to ask for it there."""
    with pytest.raises(ValueError, match=f"v_refill 'halves' needs the roles kernel.*'auto'.*{why}"):
        cc.resolve_config(hd, hd, None, config, 256, page_size=page)
    with pytest.raises(ValueError, match="v_refill 'halves'"):
        cc.resolve_wide_config(hd, hd, config, 256, page_size=page)
    kw = dict(total_q=256, num_seqs=2, num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256,
              max_seqlen_k=None, num_sms=132, page_size=page)
    with pytest.raises(ValueError, match="v_refill 'halves' needs the roles kernel"):
        cc.resolve_launch_config(hd, hd, None, config, **kw)


@pytest.mark.parametrize("head_dim", [288, 320, 352, 416, 448, 480])
def test_v_refill_halves_refuses_head_dims_whose_halves_split_a_swizzle_atom(head_dim):
    """A review found that halves of V at these head dims would cut a shared-memory swizzle atom (64 columns, or 32
    below multiples of 64): a clear ValueError naming the rule, not a failed compile. 384 and 512 resolve."""
    with pytest.raises(ValueError, match=f"v_refill 'halves' needs head_dim_v divisible by 128.*got {head_dim}"):
        cc.resolve_config(head_dim, head_dim, None, HALVES, 256)
    assert cc.resolve_config(head_dim, head_dim, None, ROLES, 256).v_refill == "one_warp"
    for ok in (384, 512):
        assert cc.resolve_config(ok, ok, None, HALVES, 256).v_refill == "halves"


# --- compile only (flash-attn-4 and the CuTe DSL, no GPU) -------------------------------------------------------
@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("extra,spill_bound", [
    # the bench's mixed_global_ctx8k: 8 B (four spill instructions, one in the softmax warpgroup) with either S order
    # (docs/tuning.md 2.19's table, 2.20), in every compile on record since 2.19
    (dict(page_size=64, window_size=None, return_lse=False, max_seqlen_q=4096), 8),
    (dict(page_size=None, window_size=1023, bidirectional_window="prefix", return_lse=True, max_seqlen_q=256), 0),
], ids=["page64_bench", "contiguous_prefix"])
def test_v_refill_halves_compiles_for_sm90_with_at_most_a_few_spills(extra, spill_bound):
    """The halves kernel keeps the roles kernel's budgets: 168 registers, setmaxnreg 152 / 176, spills within the
    bound, the same shared memory (the per-half barriers sit in the barrier kilobyte); each V block is two TMA tile
    copies of half the columns (one per P V warpgroup's loader), the loaders' init barrier in the PTX."""
    spec = dict(head_dim=512, num_heads=16, num_kv_heads=2,
                config=dict(HALVES, tile_m=64, tile_n=64, num_stages=1), **extra)
    r = compile_for_sm90_or_skip(**spec)
    assert "FlashAttentionForwardSm90Roles" in r["kernel"]
    assert r["registers"] == 168
    assert [tuple(x) for x in r["setmaxreg"]] == [("producer", 152), ("consumer", 176)]
    assert r["spill_store_bytes"] <= spill_bound and r["spill_load_bytes"] <= spill_bound, r
    assert sum(r["sass_spills"].values()) <= spill_bound // 2, r
    assert r["smem_bytes"] == 218_112
    assert r["config"]["v_refill"] == "halves"


# --- GPU ---------------------------------------------------------------------------------------------------------
# (page size or None = contiguous, window mode or None = no window, extra config)
HALVES_CONFIGS = [
    (64, None, {}),
    (64, "symmetric", dict(nan_safe_v=False)),
    (None, "prefix", {}),
    (None, None, dict(nan_safe_v=False)),
    (16, "prefix", {}),
    (8, "symmetric", {}),
    (256, None, {}),
    (64, "prefix", dict(tile_n=32)),
]
HALVES_IDS = ["p64", "p64_symmetric_nonan", "contig_prefix", "contig_nonan", "p16_prefix", "p8_symmetric", "p256",
              "p64_prefix_n32"]


@needs_gpu
@pytest.mark.parametrize("page,mode,extra", HALVES_CONFIGS, ids=HALVES_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_v_refill_halves_matches_reference_and_the_default(page, mode, extra, seed):
    """Mixed batches (causal prefills, bidirectional canvases, split rows, an empty and a one-token sequence, contexts
    past 2k keys, sequence ends inside a key block) against the fp64 reference, and equal to the one-warp roles kernel
    with S serial (same tiles and MMA order: only who loads V, and when S is issued, change)."""
    q_lens = [129, 256, 0, 1, 64]
    ctxs = [0, 2100, 31, 1024, 100] if seed == 0 else [1024, 100, 0, 2100, 31]
    kinds = ["causal", "bidir", "split", "causal", "split"] if seed == 0 else ["bidir", "split", "causal",
                                                                              "bidir", "causal"]
    q, k, v, kw = gpu_batch(q_lens, ctxs, _kinds_to_ncq(q_lens, kinds), H, HKV, D, page or 64, seed=seed,
                            contiguous=page is None)
    window = None if mode is None else (100, 1023)[seed]
    run_and_check(q, k, v, kw, window, mode or "symmetric", config=dict(HALVES, **extra), max_seqlen_q=256)
    assert ca.LAST_LAUNCH["kernel"].startswith("FlashAttentionForwardSm90Roles")
    out_d = ca.attention_cute(q, k, v, window_size=window, bidirectional_window=mode or "symmetric",
                              config=dict(ONE_WARP, **extra), max_seqlen_q=256, **kw)
    got = ca.attention_cute(q, k, v, window_size=window, bidirectional_window=mode or "symmetric",
                            config=dict(HALVES, **extra), max_seqlen_q=256, **kw)
    assert torch.equal(got, out_d), (got - out_d).abs().max()


@needs_gpu
@pytest.mark.parametrize("nan_safe_v", [True, False])
def test_gpu_v_refill_halves_long_prefill_and_many_blocks(nan_safe_v):
    """A 1000-token causal prefill, a canvas over 3000 keys (~50 key blocks: each half pipeline's stage reused many
    times, the two halves' phases independent) and a one-token commit in one launch, as the one-warp kernel."""
    q, k, v, kw = gpu_batch([1000, 256, 1], [0, 3000, 77], [1000, 0, 1], H, HKV, D, 64, seed=7)
    cfg = dict(HALVES, nan_safe_v=nan_safe_v)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=cfg)
    ref = ca.attention_cute(q, k, v, max_seqlen_q=1000, config=dict(ONE_WARP, nan_safe_v=nan_safe_v), **kw)
    assert torch.equal(ca.attention_cute(q, k, v, max_seqlen_q=1000, config=cfg, **kw), ref)


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8])
def test_gpu_v_refill_halves_cache_rows_past_seq_lens_stay_out(page):
    """NaN after each sequence's last key and an all-NaN page behind every unused block-table slot: each half's
    loader zeroes its half of the tail stage's rows past the end; the output equals the clean one."""
    q, k, v, kw = gpu_batch([256, 100, 5], [1000, 5, 300], [0, 0, 5], H, HKV, D, page, seed=page,
                            nan_pad_page=True)
    rows_past_seq_lens_check(q, k, v, kw, page, HALVES)


@needs_gpu
@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_v_refill_halves_split_kv_matches_reference(num_splits):
    """Split-KV (the default merge) over a long canvas and short sequences (empty splits: no V loads at all)."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    run_and_check(q, k, v, kw, 1023, "prefix", max_seqlen_q=256, config=dict(HALVES, num_splits=num_splits))
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90RolesSplit"
