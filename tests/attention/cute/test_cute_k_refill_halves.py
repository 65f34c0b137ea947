"""The roles kernel's K stage refilled by head-dim halves (``CuteConfig.k_refill="halves"``;
blockdiff.attention.cute.kernel_roles, "K refill by halves"): SM issues S = Q K^T as two wgmma groups over the
contraction (head) dimension, each once its half of K landed, and releases and refills each half as soon as its group
retired. ``"auto"`` (the default) resolves to ``"halves"`` where the roles kernel runs at a head dim divisible by
128, else ``"whole"`` (measurements: docs/tuning.md 2.22, 2.23).

* CPU (CI, no flash-attn-4): the field's default and resolution, its validation (choices, types and ``wide_design="split_v"`` in
  ``test_cute_roles_switches.py``; with ``"auto"`` only where it resolves to the roles kernel; head dims divisible by 128),
  the refusals' suggested fixes; ``"whole"`` below head dim 257 and the compile key in
  ``test_cute_roles_switches.py`` (every roles switch);
* compile-only for sm_90a without a GPU (flash-attn-4 and nvidia-cutlass-dsl installed, skipped in CI): no spills
  beyond the measured bounds, no wgmma serialisation (no ptxas warning, two ``WARPGROUP.DEPBAR`` in SM's key-block
  loops: one per wgmma group of S), the same registers and shared memory;
* GPU (``python3 -m pytest -m gpu``, on the H200; ``bench/experiments/device/cute_k_refill.sh``): ``"halves"``' outputs
  and LSEs equal ``"whole"``'s bit for bit (the same wgmma k-steps in the same order into the same accumulator) over
  one-block tiles, many key blocks, windows (both modes, the left-masked loop), 32-key tiles in two stages, paged
  64 / 16 / 8 and contiguous, split-KV 2 / 3, both ``qk_issue`` values, both ``v_refill`` values, K / V rows past
  each sequence's end poisoned, a CUDA-graph replay, and the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca

from cute_helpers import (HAVE_FA4, compile_for_sm90_or_skip, gpu_batch, graph_replay_check, needs_gpu,
                          rows_past_seq_lens_check, run_and_check)

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")


# --- CPU: config ----------------------------------------------------------------------------------------------
def test_k_refill_defaults_to_auto_which_resolves_to_halves_on_the_roles_kernel():
    """``"auto"`` refills K by halves wherever the roles kernel runs at a head dim divisible by 128 (every page size
    it serves, contiguous too); the whole stage at other roles head dims and on the split-value kernel."""
    assert cc.CuteConfig().k_refill == "auto"
    assert cc.K_REFILLS == ("auto", "whole", "halves")
    assert ("k_refill", "halves", "whole") in cc._ROLES_ONLY
    for page in (8, 16, 32, 64, 256, None):
        r = cc.resolve_config(512, 512, None, None, 256, page_size=page)
        assert (r.wide_design, r.k_refill) == ("roles", "halves"), page
    for hd, want in ((384, "halves"), (512, "halves"), (288, "whole"), (320, "whole")):
        assert cc.resolve_config(hd, hd, None, ROLES, 256).k_refill == want, hd
    r = cc.resolve_config(512, 512, None, None, 256, page_size=48)  # the split-value kernel
    assert (r.wide_design, r.k_refill) == ("split_v", "whole")
    r = cc.resolve_config(512, 512, None, dict(wide_design="split_v"), 256, page_size=64)
    assert (r.wide_design, r.k_refill) == ("split_v", "whole")


@pytest.mark.parametrize("v_refill", ["one_warp", "halves"])
@pytest.mark.parametrize("qk_issue", ["serial", "ahead"])
@pytest.mark.parametrize("k_refill", ["whole", "halves"])
def test_k_refill_explicit_values_hold_with_either_v_refill_and_s_order(v_refill, qk_issue, k_refill):
    """Each combination runs; an explicit value is never overridden; the tiles and the shared memory stay the roles
    kernel's automatic ones (a switch, not a tile field; the per-half barriers sit in the barrier kilobyte)."""
    for config in (dict(ROLES, v_refill=v_refill, qk_issue=qk_issue, k_refill=k_refill),
                   cc.CuteConfig(wide_design="roles", v_refill=v_refill, qk_issue=qk_issue, k_refill=k_refill)):
        for page in (64, 16, 8, None):
            r = cc.resolve_config(512, 512, None, config, 256, page_size=page)
            assert (r.tile_m, r.tile_n, r.num_stages) == (64, 64, 1)
            assert (r.v_refill, r.qk_issue, r.k_refill) == (v_refill, qk_issue, k_refill)
            assert cc.resolve_config(512, 512, None, r, 256, page_size=page) == r  # idempotent
            assert cc.config_smem_bytes(r, 512, 512) == 218_112
    # wide_design "auto" picks the roles kernel with it where it would without it
    r = cc.resolve_config(512, 512, None, dict(k_refill=k_refill), 256, page_size=64)
    assert (r.wide_design, r.k_refill) == ("roles", k_refill)


def test_split_v_refusal_names_every_roles_only_field_k_refill_included():
    config = dict(wide_design="split_v", v_refill="halves", qk_issue="ahead", k_refill="halves")
    with pytest.raises(ValueError, match="v_refill 'halves' and qk_issue 'ahead' and k_refill 'halves' are built for "
                                         "the roles kernel only.*and k_refill 'whole'"):
        cc.check_config(config)
    cc.check_config(dict(config, v_refill="one_warp", qk_issue="serial", k_refill="whole"))


@pytest.mark.parametrize("head_dim", [288, 320, 352, 416, 448, 480])
def test_k_refill_halves_refuses_head_dims_whose_halves_split_a_swizzle_atom(head_dim):
    """A half of K must be whole 64-column swizzle atoms: a clear ValueError naming the rule, not a failed compile.
    384 and 512 resolve."""
    with pytest.raises(ValueError, match=f"k_refill 'halves' needs head_dim divisible by 128.*got {head_dim}"):
        cc.resolve_config(head_dim, head_dim, None, dict(ROLES, k_refill="halves"), 256)
    assert cc.resolve_config(head_dim, head_dim, None, ROLES, 256).k_refill == "whole"
    for ok in (384, 512):
        assert cc.resolve_config(ok, ok, None, dict(ROLES, k_refill="halves"), 256).k_refill == "halves"


@pytest.mark.parametrize("hd", [288, 320, 448])
@pytest.mark.parametrize("field,plain", [("k_refill", "whole"), ("v_refill", "one_warp")])
def test_split_v_refusal_of_halves_never_suggests_roles_where_halves_cannot_run(hd, field, plain):
    """``wide_design="split_v"`` with "halves" at a head dim not divisible by 128: the refusal is the head-dim rule
    (use the plain value), not check_config's "set wide_design 'roles'", which would fail there on that rule;
    every fix the message offers resolves (resolve_config, auto_wide_design and check_config given the head dims)."""
    config = {"wide_design": "split_v", field: "halves"}
    for call in (lambda c: cc.resolve_config(hd, hd, None, c, 256), lambda c: cc.resolve_wide_config(hd, hd, c),
                 lambda c: cc.auto_wide_design(hd, hd, c), lambda c: cc.check_config(c, head_dims=(hd, hd))):
        with pytest.raises(ValueError, match=f"{field} 'halves' needs head_dim") as e:
            call(config)
        assert "wide_design 'roles'" not in str(e.value), str(e.value)
    assert cc.resolve_config(hd, hd, None, dict(config, **{field: plain}), 256).wide_design == "split_v"
    # without head dims (a config alone) the split-value rule stands; at 384 / 512 it offers 'roles', which resolves
    with pytest.raises(ValueError, match="built for the roles kernel only.*set wide_design 'roles'"):
        cc.check_config(config)
    for ok in (384, 512):
        with pytest.raises(ValueError, match="set wide_design 'roles'"):
            cc.resolve_config(ok, ok, None, config, 256)
        assert getattr(cc.resolve_config(ok, ok, None, dict(config, wide_design="roles"), 256), field) == "halves"


# --- compile only (flash-attn-4 and the CuTe DSL, no GPU) -------------------------------------------------------
@pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, nvidia-cutlass-dsl)")
def test_only_the_roles_kernel_builds_k_halves():
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert FlashAttentionForwardSm90Mixed.K_REFILLS == ("whole",)
    assert R.K_REFILLS == ("whole", "halves")
    probe = R.__new__(R)  # the all-warps experiment does not combine with the halves (warp 0 refills them)
    probe.tile_hdim, probe._K_REFILL_ALL_WARPS = 512, True
    for k_refill, on in (("whole", True), ("halves", False)):
        probe.k_refill = k_refill
        assert probe._k_refill_all_warps() is on


# (spec, spill-store bound in bytes) of k_refill "halves", 2 KV splits (the canvas's kernel). The sm_90a compile of
# this change (to be folded into docs/tuning.md) measured 0 B at pages 64 / 16 / 8 with S serial, 64 and contiguous
# with S ahead, and 228 B at page 8 with S ahead: never more than the whole-stage kernel's (0, 156, 200, 0, 0, 492 B
# there); the bounds allow a few bytes of drift.
K_HALVES_COMPILE_SPECS = [
    (dict(page_size=64, config=dict(num_splits=2, qk_issue="ahead")), 0),
    (dict(page_size=64, config=dict(num_splits=2, qk_issue="serial")), 0),
    (dict(page_size=None, config=dict(num_splits=2, qk_issue="ahead")), 0),
    (dict(page_size=16, config=dict(num_splits=2, qk_issue="serial")), 8),
    (dict(page_size=8, config=dict(num_splits=2, qk_issue="serial")), 8),
    (dict(page_size=8, config=dict(num_splits=2, qk_issue="ahead")), 240),
]


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("extra,spill_bound", K_HALVES_COMPILE_SPECS,
                         ids=["page64_split2_ahead", "page64_split2_serial", "contiguous_split2_ahead",
                              "page16_split2_serial", "page8_split2_serial", "page8_split2_ahead"])
def test_k_refill_halves_compiles_for_sm90_without_wgmma_serialisation(extra, spill_bound):
    """hd 512, 16 q / 2 KV heads, LSE: 168 registers, setmaxnreg 152 / 176, the same shared memory, spills within the
    bound; no ptxas warning (C7518: wgmma serialised when the in-flight set depends on the path) and SM's key-block
    loops (32 HGMMA: S over 512 dims in 16-dim k-steps) wait twice (one ``wait_group`` per half), not per wgmma."""
    spec = dict(head_dim=512, num_heads=16, num_kv_heads=2, return_lse=True, max_seqlen_q=256, window_size=None,
                **dict(extra, config=dict(ROLES, k_refill="halves", **extra["config"])))
    r = compile_for_sm90_or_skip(**spec)
    assert "FlashAttentionForwardSm90RolesSplit" in r["kernel"]
    assert r["registers"] == 168
    assert [tuple(x) for x in r["setmaxreg"]] == [("producer", 152), ("consumer", 176)]
    assert r["spill_store_bytes"] <= spill_bound and r["spill_load_bytes"] <= 2 * spill_bound, r
    if spill_bound == 0:
        assert sum(r["sass_spills"].values()) == 0, r
    assert r["smem_bytes"] == 218_112
    assert r["config"]["k_refill"] == "halves"
    assert not r["ptxas_warnings"], r["ptxas_warnings"]
    sm_loops = [lp for lp in r["loops"] if lp["HGMMA"] == 32]
    assert sm_loops and all(lp["WARPGROUP.DEPBAR"] == 2 for lp in sm_loops), sm_loops


# --- GPU --------------------------------------------------------------------------------------------------------
def _same(call):
    """``call(k_refill)`` -> (out, lse) with "whole" and with "halves": bit-identical outputs and LSEs; returns the
    halves' output."""
    ref_o, ref_l = call("whole")
    got_o, got_l = call("halves")
    assert torch.equal(got_o, ref_o), (got_o - ref_o).abs().max()
    assert torch.equal(got_l, ref_l), (got_l - ref_l).abs().max()
    return got_o


@needs_gpu
@pytest.mark.parametrize("qk_issue", ["serial", "ahead"])
@pytest.mark.parametrize("page", [64, 16, 8, None], ids=["p64", "p16", "p8", "contig"])
def test_gpu_k_halves_equal_whole_over_one_and_many_key_blocks(page, qk_issue):
    """A 1000-token causal prefill, a canvas over 3000 keys (~50 refills of the one K stage by halves: each half's
    phases independent), a one-token commit over 77 keys (two blocks) and a one-token row over one key (a one-block
    tile: no refill; with S ahead the branch without a second issue) in one launch: bit-identical to the whole-stage
    refill, and within the reference's tolerance."""
    q, k, v, kw = gpu_batch([1000, 256, 1, 1], [0, 3000, 77, 0], [1000, 0, 1, 1], H, HKV, D, page or 64, seed=7,
                            contiguous=page is None)
    cfg = dict(ROLES, qk_issue=qk_issue)
    _same(lambda kr: ca.attention_cute(q, k, v, max_seqlen_q=1000, return_lse=True,
                                       config=dict(cfg, k_refill=kr), **kw))
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90Roles"
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=dict(cfg, k_refill="halves"))


# (window mode, config): both V refills and both S orders; 32-key tiles keep two K stages (the refill of block
# n - 2 goes to the other stage's halves)
WINDOW_CONFIGS = [
    ("prefix", dict(ROLES, v_refill="one_warp", qk_issue="serial")),
    ("symmetric", dict(ROLES, v_refill="one_warp", qk_issue="ahead")),
    ("symmetric", dict(ROLES, v_refill="halves", qk_issue="ahead")),
    ("prefix", dict(ROLES, v_refill="halves", qk_issue="serial")),
    ("prefix", dict(ROLES, tile_n=32, qk_issue="ahead")),
    ("symmetric", dict(ROLES, tile_n=32, qk_issue="serial")),
]
WINDOW_IDS = ["prefix_one_warp_serial", "symmetric_one_warp_ahead", "symmetric_halves_ahead",
              "prefix_halves_serial", "prefix_tiles32x2_ahead", "symmetric_tiles32x2_serial"]


@needs_gpu
@pytest.mark.parametrize("mode,cfg", WINDOW_CONFIGS, ids=WINDOW_IDS)
def test_gpu_k_halves_equal_whole_with_windows(mode, cfg):
    """A 1023-key window: right-masked, interior and left-masked loops all run (with S ahead each stopping above the
    tile's first key block); bit-identical to the whole-stage refill and within the reference's tolerance."""
    q, k, v, kw = gpu_batch([700, 256, 5], [0, 2500, 130], [700, 0, 5], H, HKV, D, 64, seed=3)
    call = lambda kr: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window=mode,  # noqa: E731
                                        max_seqlen_q=700, return_lse=True, config=dict(cfg, k_refill=kr), **kw)
    _same(call)
    run_and_check(q, k, v, kw, 1023, mode, max_seqlen_q=700, config=dict(cfg, k_refill="halves"))


@needs_gpu
@pytest.mark.parametrize("num_splits,v_refill,qk_issue", [(2, "halves", "ahead"), (2, "one_warp", "serial"),
                                                          (3, "halves", "serial"), (3, "one_warp", "ahead")])
def test_gpu_k_halves_split_kv_equal_whole(num_splits, v_refill, qk_issue):
    """Split-KV (the canvas workload's kernel) with a prefix window: a split of one block, empty splits, each split's
    own prologue loading its first K block by halves; bit-identical, and within the reference's tolerance."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    cfg = dict(ROLES, num_splits=num_splits, v_refill=v_refill, qk_issue=qk_issue)
    _same(lambda kr: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window="prefix", max_seqlen_q=256,
                                       return_lse=True, config=dict(cfg, k_refill=kr), **kw))
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90RolesSplit"
    run_and_check(q, k, v, kw, 1023, "prefix", max_seqlen_q=256, config=dict(cfg, k_refill="halves"))


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8])
def test_gpu_k_halves_cache_rows_past_seq_lens_stay_out(page):
    """NaN after each sequence's last key (K and V) and an all-NaN page behind every unused block-table slot: a
    half's boxes past the end load whatever the cache holds there, whose scores the mask discards as the whole
    stage's; the output equals the clean one."""
    q, k, v, kw = gpu_batch([256, 100, 5], [1000, 5, 300], [0, 0, 5], H, HKV, D, page, seed=page,
                            nan_pad_page=True)
    cfg = dict(ROLES, k_refill="halves")
    rows_past_seq_lens_check(q, k, v, kw, page, cfg)


@needs_gpu
@pytest.mark.parametrize("qk_issue", ["serial", "ahead"])
def test_gpu_k_halves_cuda_graph_replay_with_metadata_changed_in_place(qk_issue):
    """One capture, replayed with other lengths, causal row counts and a permuted block table written in place: each
    replay matches the reference (the per-half barriers' phases carry over from one replay's CTAs to none: every
    CTA initialises them)."""
    steps = [([512, 128, 128], [0, 2000, 100], [512, 0, 64], 1),
             ([256, 256, 256], [2800, 1000, 0], [0, 256, 100], 2)]
    graph_replay_check(steps, H=H, Hkv=HKV, D=D, page=64, B=3, cap_q=768, max_blocks=48, max_seqlen_q=512,
                       config=dict(ROLES, k_refill="halves", qk_issue=qk_issue))


# Shapes the grid above does not draw (a review of d4f2422 before the roles fuzz ran with halves): a head dim of 384
# (halves of three 64-column swizzle atoms, 12 of S's 24 k-steps a group; the roles kernel's only other head dim
# with halves), GQA ratios other than 8 (4; 3: PackGQA tiles without whole token groups, Q by cp.async over SM's
# 128 threads, O without TMA), pages of 32 (two page boxes a half; "auto" issues S ahead from there), no LSE, q
# longer than its context, one-block tiles and windows that raise n_block_min above 0. Two compiles each (whole,
# halves).
@needs_gpu
def test_gpu_k_halves_equal_whole_at_head_dim_384_gqa_4_with_a_window():
    """hd 384, 8 q / 2 KV heads, page 64, the roles kernel's automatic switches at 384 (V by halves, S ahead), a
    100-key symmetric window (n_block_min > 0 and the left-masked loop on the long canvas): a causal prefill, a
    canvas longer than its context, a one-token row over one key; bit-identical to the whole-stage refill, and
    within the reference's tolerance."""
    q, k, v, kw = gpu_batch([300, 256, 1, 200], [0, 1500, 0, 31], [300, 0, 1, 100], 8, 2, 384, 64, seed=5)
    cfg = dict(ROLES)
    _same(lambda kr: ca.attention_cute(q, k, v, window_size=100, bidirectional_window="symmetric", max_seqlen_q=300,
                                       return_lse=True, config=dict(cfg, k_refill=kr), **kw))
    assert ca.LAST_LAUNCH["kernel"].startswith("FlashAttentionForwardSm90Roles")  # split-KV if "auto" picks it
    assert (ca.LAST_LAUNCH["config"].k_refill, ca.LAST_LAUNCH["config"].qk_issue) == ("halves", "ahead")
    run_and_check(q, k, v, kw, 100, "symmetric", max_seqlen_q=300, config=dict(cfg, k_refill="halves"))


@needs_gpu
def test_gpu_k_halves_equal_whole_gqa_3_page_32_without_lse():
    """12 q / 4 KV heads (Q loaded by cp.async over SM's 128 threads while warp 0 issues K's halves), pages of 32
    (two page boxes a half; S ahead by "auto"), no LSE: prefills and canvases longer than their contexts, an empty
    context, a one-token row over one key, 2100 keys of context (~33 refills); bit-identical outputs, and within
    the reference's tolerance."""
    q, k, v, kw = gpu_batch([129, 256, 1, 64, 7], [0, 31, 0, 2100, 100], [129, 0, 1, 32, 0], 12, 4, D, 32, seed=13)
    cfg = dict(ROLES)
    call = lambda kr: ca.attention_cute(q, k, v, max_seqlen_q=256, return_lse=False,  # noqa: E731
                                        config=dict(cfg, k_refill=kr), **kw)
    ref, got = call("whole"), call("halves")
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert ca.LAST_LAUNCH["kernel"].startswith("FlashAttentionForwardSm90Roles")  # split-KV if "auto" picks it
    assert (ca.LAST_LAUNCH["config"].k_refill, ca.LAST_LAUNCH["config"].qk_issue) == ("halves", "ahead")
    run_and_check(q, k, v, kw, None, "symmetric", return_lse=False, max_seqlen_q=256,
                  config=dict(cfg, k_refill="halves"))
