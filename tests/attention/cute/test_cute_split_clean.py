"""NaN-safe V with the masked block's V stage scanned once, split between FA4's consumer warpgroups (the experiment
switch ``FlashAttentionForwardSm90Mixed._CLEAN_SPLIT_ACROSS_WG``, off by default; docs/tuning.md 2.31). By default
every consumer warpgroup scans the whole stage (tags tell the second one what the first zeroed); with the switch,
in kernels without FA4's scheduler barrier (the hd-256 launches), each thread of all consumer warpgroups scans its
share of the chunks and one ``bar.red.or`` over every consumer orders the cleaned chunks before each P V and ORs the
finding.

* CPU: off by default; where it acts (overlap, no scheduler barrier, two or more warpgroups); with
  the CuTe DSL installed, the bench's sliding launches compile with no spill and no ``R2UR`` in their key-block loops,
  and the hd-128 (ping-pong) launch's PTX is unchanged.
* GPU (``python3 -m pytest -m gpu``, on the H200; ``bench/experiments/device/cute_mixed_switch.sh`` with
  ``SWITCH=_CLEAN_SPLIT_ACROSS_WG``): on against off bit for bit (finite and poisoned caches, NaN-aware) and the
  reference's exact non-finite entries with it on, at hd 256 paged / contiguous / split with the cluster merge and a
  window, beside an hd-128 case where it must not act.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.testing import check_nonfinite_matches_reference, make_batch, poison_v_inside_seq_lens

from cute_helpers import (HAVE_FA4, check_nonfinite_v, nan_equal, needs_gpu, next_sequence_nan_v,
                          scan_at_every_head_dim, switch_runner)

_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
SWITCH = "FlashAttentionForwardSm90Mixed._CLEAN_SPLIT_ACROSS_WG"


def _kernel(**kw):
    base = dict(nan_safe_v=True, _CLEAN_SPLIT_ACROSS_WG=True, intra_wg_overlap=True, use_scheduler_barrier=False,
                num_wg_mma=2)
    return SimpleNamespace(**dict(base, **kw))


@_FA4
def test_split_clean_is_off_by_default_and_acts_only_without_the_scheduler_barrier():
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    assert M._CLEAN_SPLIT_ACROSS_WG is False
    assert M._split_clean(_kernel()) is True
    assert M._split_clean(_kernel(num_wg_mma=3)) is True
    for off in (dict(_CLEAN_SPLIT_ACROSS_WG=False), dict(nan_safe_v=False), dict(use_scheduler_barrier=True),
                dict(intra_wg_overlap=False), dict(num_wg_mma=1)):
        assert M._split_clean(_kernel(**off)) is False, off


def _sliding_specs():
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    # the scan's variants (since docs/tuning.md 2.35 the default at hd 256 is the recompute, where the switch is moot)
    return {n: SPECS["scan_" + n] for n in ("sliding_bench_mixed_ctx8k", "sliding_bench_canvas_ctx32k",
                                            "hd128_bench_canvas_bs4_ctx4k")}


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
@pytest.mark.parametrize("name", ["sliding_bench_mixed_ctx8k", "hd128_bench_canvas_bs4_ctx4k"])
def test_split_clean_compiles_without_spills_or_r2ur_and_leaves_the_ping_pong_kernel_alone(name, tmp_path):
    """The hd-256 launch with the switch: no spill, key-block loops keep the uniform datapath (<= 2 ``R2UR``); the
    hd-128 launch (FA4's scheduler barrier): the same PTX as without it."""
    from cute_helpers import compile_for_sm90_or_skip
    entry = _sliding_specs()[name]
    spec = entry["spec"]
    off = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "off"), switches=entry.get("switches") or {}, **spec)
    on = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "on"), switches=dict(entry.get("switches") or {},
                                                                           **{SWITCH: True}), **spec)
    if name.startswith("hd128"):
        assert on["ptx_sha256"] == off["ptx_sha256"]
        return
    assert on["ptx_sha256"] != off["ptx_sha256"]  # the switch acts here
    assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
    assert all(loop.get("R2UR", 0) <= 2 for loop in on["loops"]), on["loops"]
    assert len(on["loops"]) == len(off["loops"])


def _named_barriers(ptx_file):
    """(id, count) of every ``bar.red`` / ``bar.sync`` / ``bar.arrive`` of a PTX file (ids through their ``mov``)."""
    import re
    text = open(ptx_file).read()
    movs = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", text))
    out = []
    for m in re.finditer(r"\bbar\.(?:red\.or\.pred\s+\w+,|sync|arrive)\s+(%r\d+|\d+)(?:,\s*(\d+))?", text):
        bid = m.group(1)
        out.append((int(movs.get(bid, bid)), int(m.group(2)) if m.group(2) else None))
    return out


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
@pytest.mark.parametrize("head_dim,tile_m,count", [(256, 128, 256), (136, 192, 384)])
def test_split_clean_uses_barrier_15_over_every_consumer_thread_and_nothing_else_does(head_dim, tile_m, count,
                                                                                      tmp_path):
    """With the switch, the clean-up's only barrier is id 15 over 128 x warpgroups threads (3 call sites: first,
    right- and left-masked blocks), no per-warpgroup id 12-14 is left, and no other barrier uses 15 (hd 136 with
    192-row tiles: three consumer warpgroups without the scheduler barrier)."""
    from cute_helpers import compile_for_sm90_or_skip
    spec = dict(head_dim=head_dim, num_heads=16, num_kv_heads=8, page_size=64 if head_dim == 256 else None,
                window_size=1023, return_lse=False,
                config=dict(tile_m=tile_m, tile_n=64 if head_dim == 256 else 96, mma_pv_is_rs=True,
                            intra_wg_overlap=True, num_stages=2, nan_safe_v=True, num_splits=1,
                            nan_safe_v_method="scan"))  # the scan's switch (hd 256's "auto" is the recompute)
    r = compile_for_sm90_or_skip(ptx_dir=str(tmp_path), switches={SWITCH: True}, **spec)
    bars = _named_barriers(r["ptx_file"])
    assert [b for b in bars if b[0] == 15] == [(15, count)] * 3, bars
    assert not [b for b in bars if b[0] in (12, 13, 14)], bars


# --- GPU --------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _scan_at_every_head_dim(monkeypatch):
    """The switch splits the mainloop scan: the hd-256 cases still test it."""
    scan_at_every_head_dim(monkeypatch)


@pytest.fixture
def split_clean(monkeypatch):
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    return switch_runner(monkeypatch, M, "_CLEAN_SPLIT_ACROSS_WG")


CASES = [  # (id, head dim, page size or None, config, call kwargs)
    ("hd256_pagebox64", 256, 64, None, {}),
    ("hd256_contiguous", 256, None, None, {}),
    ("hd256_window1023_symmetric", 256, 64, None, dict(window_size=1023, bidirectional_window="symmetric")),
    ("hd256_window127_prefix", 256, 16, None, dict(window_size=127, bidirectional_window="prefix")),
    ("hd256_split2_cluster_window1023", 256, 64, dict(num_splits=2, split_merge="cluster"), dict(window_size=1023)),
    ("hd256_split3_combine", 256, 64, dict(num_splits=3, split_merge="combine"), {}),
    ("hd192_pagebox64", 192, 64, None, {}),  # n_chunks not a multiple of 256: the clamped last chunk
    ("hd192_window255", 192, 64, None, dict(window_size=255)),
    # with the first-block skip against its "auto" (unsplit: off, split: on): both trip-count forms of the scan
    ("hd256_skip_first_unsplit", 256, 64, dict(skip_allowed_first=True), {}),
    ("hd256_split2_cluster_no_skip", 256, 64, dict(num_splits=2, split_merge="cluster", skip_allowed_first=False), {}),
    ("hd128_pagebox64_not_acting", 128, 64, None, {}),
]


def _batch(D, page, seed):
    """A prefill, a commit + canvas, two canvases over context (one ending mid-block) and an empty sequence, NaN in
    the stale cache rows and unused pages."""
    sl, ql, ncq = [1280, 700, 333, 1300, 0], [256, 700, 64, 256, 0], [0, 700, 64, 0, 0]
    return make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=8, head_dim=D, page_size=page or 64,
                      paged=page is not None, device="cuda", seed=seed, poison_unused=page is not None)


@needs_gpu
@pytest.mark.parametrize("D,page,config,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_split_clean_keeps_nonfinite_v_exact(D, page, config, kw, split_clean):
    """Caches with NaN / Inf V inside ``seq_lens`` (in masked blocks too): exactly the reference's non-finite entries
    with the switch on, and on equals off bit for bit (NaN-aware), on the poisoned and on the finite caches."""
    inp = _batch(D, page, seed=47)
    assert split_clean(True, lambda: check_nonfinite_v(inp, config, seed=5, **kw)) > 0
    bad = poison_v_inside_seq_lens(inp, 5, 6)[0]
    for batch in (inp, bad):
        def call(batch=batch):
            return attention(**batch, backend="cute", config=dict(config or {}, nan_safe_v=True), **kw)
        off, on = split_clean(False, call), split_clean(True, call)
        assert nan_equal(on, off), (on.float() - off.float()).abs().nan_to_num().max()


@needs_gpu
def test_gpu_split_clean_zeroes_nan_a_row_may_not_see_in_both_halves_of_the_stage(split_clean):
    """Contiguous K / V, hd 256: a canvas whose context ends mid-block before a canvas whose first keys' V are NaN /
    +-Inf in every column (so both warpgroups' shares of the stage hold some): the first canvas's output stays finite,
    the second's has exactly the reference's non-finite entries."""
    # the second sequence's first 8 keys: block-local keys 20..27 of the first sequence's last 80-key block, both
    # consumer warpgroups' shares
    bad = next_sequence_nan_v(256, 8, seed=53)
    start = int(bad["cu_seqlens_k"][1])

    def call():
        return attention(**bad, backend="cute", config=dict(nan_safe_v=True), max_seqlen_q=256)
    out = split_clean(True, call)
    from blockdiff.attention.cute import interface as ca
    cfg = ca.LAST_LAUNCH["config"]
    assert (cfg.tile_m, cfg.tile_n, cfg.intra_wg_overlap) == (128, 80, True), cfg  # where the split acts
    # chunk i = key * 32 + column chunk of thread (i mod 256): the first warpgroup owns keys 0-3 mod 8
    shares = {((start + i - 1280) * 32 % 256) // 128 for i in range(8)}
    assert shares == {0, 1}, shares
    assert torch.isfinite(out[:256]).all(), "the next sequence's NaN / Inf reached the first canvas"
    assert check_nonfinite_matches_reference(out, bad, max_seqlen_q=256) > 0
