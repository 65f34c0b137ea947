"""The roles kernel's S issued one block ahead (``CuteConfig.qk_issue="ahead"``; blockdiff.attention.cute.kernel_roles,
docs/tuning.md 2.19-2.20): SM issues S(i + 1)'s wgmma after block i's softmax and P's conversion, before P's hand-off,
and retires it at the top of the next iteration; the tile's first key block issues nothing. ``"auto"`` (the default)
resolves to ``"ahead"`` exactly where the V refill resolves to halves.

* CPU (CI, no flash-attn-4): the field's default and resolution, its validation (choices, types and ``wide_design="split_v"`` in
  ``test_cute_roles_switches.py``; with ``"auto"`` only where it resolves to the roles kernel), the plain value below head
  dim 257 and the compile key in ``test_cute_roles_switches.py`` (every roles switch);
* GPU (``python3 -m pytest -m gpu``, on the H200): ``"ahead"``'s outputs equal ``"serial"``'s bit for bit (same
  wgmma on the same operands, same softmax order; the tile's first key block masked whatever its kind, a no-op on
  an interior block) over one-block tiles, many key blocks, windows (the left-masked loop), 32-key tiles in two
  stages, paged 64 / 16 / 8 and contiguous, split-KV, both V refills, and the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca

from cute_helpers import gpu_batch, needs_gpu, run_and_check

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")


# --- CPU: config ----------------------------------------------------------------------------------------------
def test_qk_issue_defaults_to_auto_which_follows_the_v_refill():
    """docs/tuning.md 2.20: ahead with halves was +7 % on mixed_global_ctx8k; ahead with the one-warp refill -4 %;
    at 8-token pages ahead spills 488 B in the softmax warpgroup against 184 B serial (sm_90a compile)."""
    assert cc.CuteConfig().qk_issue == "auto"
    assert cc.QK_ISSUES == ("auto", "serial", "ahead")
    for hd in (384, 512):  # halves' head dims
        r = cc.resolve_config(hd, hd, None, ROLES, 256)
        assert (r.v_refill, r.qk_issue) == ("halves", "ahead")
    assert cc.resolve_config(512, 512, None, None, 256, page_size=64).qk_issue == "ahead"  # the default dispatch
    r = cc.resolve_config(512, 512, None, dict(ROLES, v_refill="one_warp"), 256)
    assert (r.v_refill, r.qk_issue) == ("one_warp", "serial")
    for hd in (288, 320, 448, 480):  # the one-warp refill: serial
        assert cc.resolve_config(hd, hd, None, ROLES, 256).qk_issue == "serial"
    # 8- and 16-token pages: serial with halves (timed slower there on the mixed batch, 2.21); 32 and up: ahead
    assert cc.QK_AHEAD_MIN_PAGE == 32
    for page, want in ((8, "serial"), (16, "serial"), (32, "ahead"), (64, "ahead"), (256, "ahead"), (None, "ahead")):
        r = cc.resolve_config(512, 512, None, None, 256, page_size=page)
        assert (r.wide_design, r.v_refill, r.qk_issue) == ("roles", "halves", want), page
    assert cc.resolve_config(512, 512, None, dict(qk_issue="ahead"), 256, page_size=8).qk_issue == "ahead"
    # the split-value kernel (auto's choice for unaligned pages or tile fields): serial, one warp
    r = cc.resolve_config(512, 512, None, None, 256, page_size=48)
    assert (r.wide_design, r.v_refill, r.qk_issue) == ("split_v", "one_warp", "serial")


@pytest.mark.parametrize("v_refill", ["one_warp", "halves"])
@pytest.mark.parametrize("qk_issue", ["serial", "ahead"])
def test_qk_issue_explicit_values_hold_with_either_v_refill(v_refill, qk_issue):
    """Each pair runs (the A/B of 2.20); an explicit value is never overridden, and the tiles stay the roles
    kernel's automatic ones (a switch, not a tile field)."""
    for config in (dict(ROLES, v_refill=v_refill, qk_issue=qk_issue),
                   cc.CuteConfig(wide_design="roles", v_refill=v_refill, qk_issue=qk_issue)):
        r = cc.resolve_config(512, 512, None, config, 256)
        assert (r.tile_m, r.tile_n, r.num_stages, r.v_refill, r.qk_issue) == (64, 64, 1, v_refill, qk_issue)
        assert cc.resolve_config(512, 512, None, r, 256) == r  # idempotent


# --- GPU --------------------------------------------------------------------------------------------------------
def _same(call):
    """``call(qk_issue)`` with "serial" and with "ahead": bit-identical outputs."""
    ref = call("serial")
    got = call("ahead")
    assert torch.equal(got, ref), (got - ref).abs().max()


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8, None], ids=["p64", "p16", "p8", "contig"])
def test_gpu_qk_ahead_equals_serial_over_one_and_many_key_blocks(page):
    """A 1000-token causal prefill, a canvas over 3000 keys (~50 blocks issued ahead), a one-token commit over 77 keys
    (two blocks) and a one-token row over one key (a one-block tile: the branch that issues nothing ahead) in one
    launch: bit-identical to serial, and within the reference's tolerance."""
    q, k, v, kw = gpu_batch([1000, 256, 1, 1], [0, 3000, 77, 0], [1000, 0, 1, 1], H, HKV, D, page or 64, seed=7,
                            contiguous=page is None)
    _same(lambda qi: ca.attention_cute(q, k, v, max_seqlen_q=1000, config=dict(ROLES, qk_issue=qi), **kw))
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=dict(ROLES, qk_issue="ahead"))


@needs_gpu
@pytest.mark.parametrize("mode", ["prefix", "symmetric"])
@pytest.mark.parametrize("cfg", [dict(ROLES, v_refill="one_warp"), dict(ROLES, tile_n=32), dict(ROLES)],
                         ids=["one_warp", "tiles32x2", "halves"])
def test_gpu_qk_ahead_equals_serial_with_windows(mode, cfg):
    """A 1023-key window: right-masked, interior and left-masked loops all run, each stopping above the tile's
    first key block; 32-key tiles keep two K stages (the issued S reads the stage loaded by the prologue)."""
    q, k, v, kw = gpu_batch([700, 256, 5], [0, 2500, 130], [700, 0, 5], H, HKV, D, 64, seed=3)
    call = lambda qi: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window=mode,  # noqa: E731
                                        max_seqlen_q=700, config=dict(cfg, qk_issue=qi), **kw)
    _same(call)
    run_and_check(q, k, v, kw, 1023, mode, max_seqlen_q=700, config=dict(cfg, qk_issue="ahead"))


@needs_gpu
@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_qk_ahead_split_kv_equals_serial(num_splits):
    """Split-KV with a prefix window (a split of one block, empty splits, each split's own prologue)."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    _same(lambda qi: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window="prefix", max_seqlen_q=256,
                                       config=dict(ROLES, num_splits=num_splits, qk_issue=qi), **kw))


# --- CPU: refusals (the suggested fixes of every roles switch: test_cute_roles_switches.py) ---------------------
def test_split_v_refusal_names_every_roles_only_field():
    config = dict(wide_design="split_v", v_refill="halves", qk_issue="ahead")
    with pytest.raises(ValueError, match="v_refill 'halves' and qk_issue 'ahead' are built for the roles kernel only"
                                         ".*v_refill 'one_warp' .*and qk_issue 'serial'"):
        cc.check_config(config)
    cc.check_config(dict(config, v_refill="one_warp", qk_issue="serial"))


def test_the_tile_fields_blocking_auto_are_listed_in_field_order_for_a_dict_and_a_cute_config():
    for config in (dict(num_stages=2, tile_n=32, qk_issue="ahead"),
                   cc.CuteConfig(num_stages=3, tile_n=32, qk_issue="ahead")):
        with pytest.raises(ValueError, match=r"sets \['tile_n', 'num_stages'\]"):
            cc.resolve_config(512, 512, None, config, 256, page_size=64)
