"""NaN / Inf V of keys a row may not see, cute backend (config ``nan_safe_v``; kernel.py "NaN-safe V",
docs/tuning.md 2.4): on the H200 (``python3 -m pytest -m gpu tests/attention/cute/test_cute_nan_safe_v.py``),
caches whose V holds NaN / +Inf / -Inf at keys inside ``seq_lens`` (a causal row's future keys on the diagonal
block, keys around a window edge, keys anywhere), paged (page boxes and cp.async) and contiguous, hd 128 / 256 /
512, split-KV, both window modes: the output has exactly the reference's non-finite entries (the rows that allow a
poisoned key, in its column) and every other entry within the tolerance rule. The GPU tests skip without a CUDA
GPU or without flash-attn-4 / nvidia-cutlass-dsl. CPU: the config switch (here) and the offline sm_90a compile of
the switched-on kernels (test_cute_compile_check.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.testing import check_close, make_batch

from cute_helpers import HAVE_FA4, NAN_SAFE_HD256_CASES as HD256_CASES, needs_gpu
from cute_helpers import check_nonfinite_v as _check_nonfinite_v, nonfinite_cases as _nonfinite_cases

_ON_GPU = torch.cuda.is_available() and HAVE_FA4
_SKIP = pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU (SM90) and flash-attn-4 / nvidia-cutlass-dsl")


def gpu_test(f):
    """A GPU test (``-m gpu``, hang guard) that skips cleanly where it cannot run (all 22 passed on the H200,
    2026-12-02, docs/tuning.md 2.6)."""
    return _SKIP(needs_gpu(f))


# --- hd 128: FA4's consumer with intra-warpgroup overlap (128 x 128, 3 stages) and without (192 x 128) ----------
HD128_CASES = [  # (id, page size or None, config, call kwargs)
    ("pagebox64", 64, None, {}),
    ("pagebox64_split3", 64, dict(num_splits=3), {}),
    ("pagebox64_window127", 64, None, dict(window_size=127)),
    ("pagebox64_split2_prefix100", 64, dict(num_splits=2, split_merge="combine"),
     dict(window_size=100, bidirectional_window="prefix")),
    ("pagebox64_split2_cluster_prefix100", 64, dict(num_splits=2, split_merge="cluster"),
     dict(window_size=100, bidirectional_window="prefix")),
    ("contiguous", None, None, {}),
    ("cpasync48_window127", 48, None, dict(window_size=127)),
    ("no_overlap_192x128", 64, dict(cc.LONG_PREFILL_CONFIG), {}),
    ("no_overlap_192x128_window127", 64, dict(cc.LONG_PREFILL_CONFIG), dict(window_size=127)),
]


@gpu_test
@pytest.mark.parametrize("page,config,kw", [c[1:] for c in HD128_CASES], ids=[c[0] for c in HD128_CASES])
def test_gpu_cute_nan_safe_v_hd128_keys_a_row_may_not_see_contribute_nothing(page, config, kw):
    """hd 128: causal diagonals, mixed rows, splits, both window modes, page boxes / cp.async / contiguous K/V,
    with and without FA4's intra-warpgroup overlap: a NaN / Inf V of a key a row may not see never reaches that
    row (was 0 * NaN = NaN in every row of the tile whose masked block held it)."""
    inp = _nonfinite_cases(128, 16, 8, page or 64, seed=21, paged=page is not None)
    nf = _check_nonfinite_v(inp, config, seed=1 + (page or 0), **kw)
    assert nf > 0  # some rows do see a poisoned key


# --- hd 256 (FA4's hd-256 tiles, the sliding layers' window) ---------------------------------------------------


@gpu_test
@pytest.mark.parametrize("method", ["scan", "recompute"])  # "auto" is the recompute at hd 256 (docs/tuning.md 2.35)
@pytest.mark.parametrize("page,config,kw", [c[1:] for c in HD256_CASES], ids=[c[0] for c in HD256_CASES])
def test_gpu_cute_nan_safe_v_hd256_keys_a_row_may_not_see_contribute_nothing(page, config, kw, method):
    inp = _nonfinite_cases(256, 16, 8, page or 64, seed=22, paged=page is not None)
    assert _check_nonfinite_v(inp, dict(config or {}, nan_safe_v_method=method), seed=3, **kw) > 0


# --- hd 512: the split-value kernel (WG0 and WG1 clean their own half of V), asked for by name; the default (the
# roles kernel, wide_design "auto") on pages of 64 and contiguous K/V -------------------------------------------
SPLIT_V = dict(wide_design="split_v")
HD512_CASES = [
    ("64x64_1stage", 64, SPLIT_V, {}),  # the automatic long-query tiles (q.shape[0] hint)
    ("64x32_2stages_window127", 64, dict(SPLIT_V, tile_n=32), dict(window_size=127)),
    ("64x32_split2_prefix100", 64, dict(SPLIT_V, tile_n=32, num_splits=2),
     dict(window_size=100, bidirectional_window="prefix")),
    ("64x32_split3", 64, dict(SPLIT_V, tile_n=32, num_splits=3), {}),
    ("contiguous_64x64_window127", None, SPLIT_V, dict(window_size=127)),
    ("pagebox16_two_boxes", 16, dict(SPLIT_V, tile_n=32), {}),
    ("cpasync8", 8, dict(SPLIT_V, tile_n=32), dict(window_size=127)),
    ("default_roles_page64", 64, None, {}),
    ("default_roles_contiguous_window127", None, None, dict(window_size=127)),
]


@gpu_test
@pytest.mark.parametrize("page,config,kw", [c[1:] for c in HD512_CASES], ids=[c[0] for c in HD512_CASES])
def test_gpu_cute_nan_safe_v_hd512_keys_a_row_may_not_see_contribute_nothing(page, config, kw):
    inp = _nonfinite_cases(512, 16, 2, page or 64, seed=23, paged=page is not None)
    assert _check_nonfinite_v(inp, config, seed=4 + (page or 0), **kw) > 0


@gpu_test
@pytest.mark.parametrize("method", ["scan", "recompute"])  # "auto" is the recompute at hd 256 (docs/tuning.md 2.35)
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
@pytest.mark.parametrize("num_splits,merge", [(1, "auto"), (2, "combine"), (2, "cluster"), (2, "triton")])
def test_gpu_cute_nan_safe_v_keys_no_row_sees_leave_the_output_finite(mode, num_splits, merge, method):
    """The sliding canvas (hd 256, W 1023, one 256-token canvas over 8k of context, paged 64): every V entry of
    the keys just left of every row's window, in the key block the window edge falls in, NaN / +Inf / -Inf: the
    output is finite everywhere and matches the reference of the cleaned cache (no row sees them; without the
    switch every row of a tile whose left-masked block held them was NaN)."""
    S, W = 8423, 1023  # ctx - W = 7144: 40 keys into the 64-key page 111 (7104..7167)
    canvas = make_batch([S], [256], causal=[False], num_heads=16, num_kv_heads=8, head_dim=256, page_size=64,
                        device="cuda", seed=24, poison_unused=True)
    v = canvas["v_cache"].clone()
    lo = S - 256 - W
    bt = canvas["block_table"][0].tolist()
    for key in range(lo // 64 * 64, lo):
        v[bt[key // 64], key % 64] = (float("nan"), float("inf"), -float("inf"))[key % 3]
    bad = dict(canvas, v_cache=v)
    clean = dict(canvas, v_cache=torch.nan_to_num(canvas["v_cache"]), k_cache=torch.nan_to_num(canvas["k_cache"]))
    q = bad["q"]
    out = torch.full((q.shape[0], q.shape[1], 256), float("nan"), dtype=q.dtype, device=q.device)
    cfg = dict(num_splits=num_splits, split_merge=merge, nan_safe_v_method=method)
    o = attention(**bad, out=out, backend="cute", config=dict(cfg, nan_safe_v=True),
                  window_size=W, bidirectional_window=mode, max_seqlen_q=256)
    assert ca.LAST_LAUNCH["config"].num_splits == num_splits
    assert torch.isfinite(o).all()
    check_close(o, **clean, window_size=W, bidirectional_window=mode)
    # and with the poisoned keys seen by some rows too (the mixed checks above on this canvas)
    assert _check_nonfinite_v(canvas, cfg, seed=12 + num_splits, window_size=W,
                              bidirectional_window=mode, max_seqlen_q=256) > 0


# --- CPU: the config switch -------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_FA4, reason="FA4's tile heuristic resolves the hd-128 tiles (flash-attn-4 not installed)")
def test_nan_safe_v_is_a_bool_field_that_keeps_the_automatic_tiles():
    """``nan_safe_v`` is not a tile field: setting only it resolves the tiles None resolves (the tuned hd-128
    third stage, the hd-512 default kernel's tiles), with other fields it keeps theirs; it is on by default (the
    contract), False opts out, and a non-bool is a TypeError (no coercion)."""
    assert cc.CuteConfig().nan_safe_v is True
    for hd, window, hint in ((128, None, 256), (128, None, 8192), (512, None, 256), (512, 1023, 4096)):
        auto = cc.resolve_config(hd, hd, window, None, hint)
        for cfg in (dict(nan_safe_v=True), cc.CuteConfig(nan_safe_v=True)):
            on = cc.resolve_config(hd, hd, window, cfg, hint)
            assert on == replace(auto, nan_safe_v=True)
        assert cc.resolve_config(hd, hd, window, None, hint).nan_safe_v is True
        assert cc.resolve_config(hd, hd, window, dict(nan_safe_v=False), hint) == replace(auto, nan_safe_v=False)
    both = cc.resolve_config(128, 128, None, dict(tile_n=64, num_splits=3, nan_safe_v=True), 256)
    assert (both.tile_n, both.num_splits, both.nan_safe_v) == (64, 3, True)
    assert cc.resolve_wide_config(512, 512, dict(nan_safe_v=True), 256).nan_safe_v is True
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="nan_safe_v"):
            cc.check_config(dict(nan_safe_v=bad))
    launch = cc.resolve_launch_config(
        128, 128, None, dict(nan_safe_v=True), total_q=256, num_seqs=1, num_kv_heads=8, qhead_per_kvhead=2,
        keys_capacity=32768, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    assert launch.nan_safe_v is True and launch.num_splits > 1  # the automatic split count is kept too


def test_nan_safe_v_is_on_by_default_so_keys_a_row_may_not_see_contribute_nothing():
    """The contract (docs/ARCHITECTURE.md section 4) holds by default in the cute backend: ``CuteConfig()`` and a
    config that sets no switch (None, a dict of tile fields only) resolve ``nan_safe_v`` to True (its GPU tests
    passed on the H200, 2026-12-02, docs/tuning.md 2.6); only an explicit False opts out."""
    assert cc.CuteConfig().nan_safe_v is True
    assert cc._split_switches(None)[1]["nan_safe_v"] is True
    assert cc._split_switches(dict(tile_n=64))[1]["nan_safe_v"] is True
    assert cc._split_switches(dict(nan_safe_v=False))[1]["nan_safe_v"] is False
    assert cc._split_switches(cc.CuteConfig(tile_n=64))[1]["nan_safe_v"] is True
