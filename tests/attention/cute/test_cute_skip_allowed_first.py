"""NaN-safe V without the clean-up of a first key block every row of the tile may see whole (the experiment switch
``FlashAttentionForwardSm90Mixed._SKIP_ALLOWED_FIRST``, off by default; docs/tuning.md 2.27). FA4 masks a tile's (a
split's) first key block whatever it holds, so the NaN-safe clean-up scanned it in every tile; a block inside every
row's interval holds no key a row may not see, and its NaN / Inf reach exactly the rows the reference gives them to.

* CPU (CI): the rule the kernel uses (the block is at or above ``ceil(lo(last row) / tile_n)`` and below
  ``(hi(first row) + 1) // tile_n``, the block info's own bounds) holds exactly when every key of the block is in
  every row's interval, over random tiles of mixed causal / bidirectional sequences, both window modes, packed GQA
  (hypothesis, against :func:`blockdiff.attention.masks.key_range` row by row);
* CPU with the CuTe DSL: off by default; the switch needs FA4's ``m_block`` in the first block's ``mask_fn`` (a
  RuntimeError otherwise); the overrides' call sequences with FA4's GEMM calls as recorders (overlap, no overlap):
  only the first block's scan follows the test, the other clean-up calls unchanged;
* GPU (``python3 -m pytest -m gpu``, on the H200; ``bench/experiments/device/cute_mixed_switch.sh`` with
  ``SWITCH=_SKIP_ALLOWED_FIRST`` and this file as ``TESTS``): on against off bit for bit (finite and poisoned caches,
  NaN-aware), and exactly the reference's non-finite entries, over batches whose canvases end on a key-block
  boundary (the skipped case) with NaN / Inf inside ``seq_lens``, hd 128 (with FA4's scheduler barrier, without
  the overlap, split-KV) and hd 256.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiff.attention import attention
from blockdiff.attention.cute import config as cc
from blockdiff.attention.masks import key_range
from blockdiff.attention.testing import check_nonfinite_matches_reference, make_batch, poison_v_inside_seq_lens

from cute_helpers import HAVE_FA4, check_nonfinite_v, needs_gpu, switch_runner

_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, nvidia-cutlass-dsl)")


def _rule_skips(lo_last: int, hi_first: int, block: int, tile_n: int) -> bool:
    """The kernel's test (``_first_block_needs_clean``) in host integers: below every right-masked block, at or
    above every left-masked one."""
    return block < (hi_first + 1) // tile_n and block >= -(-lo_last // tile_n)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_skip_rule_holds_exactly_when_every_row_sees_the_whole_block(data):
    """Every tile (``tile_m`` packed rows, ``qhead`` heads a KV head) of a sequence and every key block of its range:
    the rule on the tile's first and last rows says "skip" exactly when every key of the block is inside
    ``[0, seq_len)`` and inside every row's interval (the intervals' bounds are non-decreasing in the row, for every
    mix of causal and bidirectional rows and both window modes, so the two end rows decide)."""
    q_len = data.draw(st.integers(1, 300), label="q_len")
    seq_len = q_len + data.draw(st.sampled_from([0, 1, 63, 64, 200, 511, 512, 1000]), label="context")
    ncq = data.draw(st.integers(0, q_len), label="num_causal_q")
    window = data.draw(st.sampled_from([None, 0, 1, 63, 64, 127, 1023]), label="window")
    mode = data.draw(st.sampled_from(["symmetric", "prefix"]), label="mode")
    tile_n = data.draw(st.sampled_from([32, 64, 80, 128]), label="tile_n")
    qhead = data.draw(st.sampled_from([1, 2, 3, 6, 8]), label="qhead")
    tile_m = data.draw(st.sampled_from([64, 128, 192]), label="tile_m")
    rows = torch.arange(q_len)
    t = lambda v: torch.tensor(v)  # noqa: E731
    lo, hi = key_range(rows, t(q_len), t(seq_len), t(ncq), window, mode)
    for m_block in range(-(-q_len * qhead // tile_m)):
        first, last = m_block * tile_m // qhead, min(-(-(m_block + 1) * tile_m // qhead), q_len) - 1
        n_min, n_max = int(lo[first]) // tile_n, (int(hi[last]) + tile_n) // tile_n
        for block in range(n_min, n_max):
            k0, k1 = block * tile_n, (block + 1) * tile_n - 1
            whole = k1 < seq_len and bool(((lo[first:last + 1] <= k0) & (hi[first:last + 1] >= k1)).all())
            assert _rule_skips(int(lo[last]), int(hi[first]), block, tile_n) == whole, (m_block, block)


@_FA4
def test_skip_allowed_first_is_off_by_default_and_needs_fa4s_m_block():
    """Off by default; on, the first block's test needs the tile's ``m_block``, which FA4 binds into the call's
    ``mask_fn`` (a partial): without it (another flash-attn-4) a RuntimeError says so instead of a wrong skip."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    assert M._SKIP_ALLOWED_FIRST is False
    k = SimpleNamespace(nan_safe_v=True, _SKIP_ALLOWED_FIRST=True)
    k._skip_allowed_first = lambda: M._skip_allowed_first(k)
    assert M._skip_allowed_first(k) is True
    with pytest.raises(RuntimeError, match="m_block"):
        M._first_needs(k, dict(mask_fn=lambda **kw: None, n_block=3, seqlen=None))
    assert M._skip_allowed_first(SimpleNamespace(nan_safe_v=False, _SKIP_ALLOWED_FIRST=True)) is False


class _State:
    def __init__(self, index):
        self.index = index


@_FA4
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("needs", [0, 1])
def test_skip_allowed_first_call_sequences(needs, overlap, monkeypatch):
    """The overrides' calls with FA4's GEMM calls replaced by recorders, for one tile (first block, a right-masked
    block, an interior one, the last half block): the first block's test gets the ``m_block`` of FA4's nested
    ``mask_fn`` partial and the call's ``n_block`` / ``seqlen``; with the test's 0 the first block's scan has
    trip count 0 (``active``) but its call still runs (overlap, no overlap: the tags' counters agree between the
    warpgroups); the other masked block is cleaned as before (``active`` None), the interior one never."""
    from functools import partial
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90 as F
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    k = M.__new__(M)
    k.nan_safe_v, k._SKIP_ALLOWED_FIRST = True, True
    k.intra_wg_overlap, k.use_scheduler_barrier, k.num_stages = overlap, False, 2
    k.tile_hdimv, k._nf_sVt, k._nf_pipeline_v = 128, None, None
    stage_block, events, tests = {}, [], []
    seqlen = object()

    def apply_mask(**kw):
        pass
    mask_fn = partial(apply_mask, batch_idx=0, head_idx=1, m_block=7, thr_mma=None)  # FA4's per-tile partial

    def stage(n_block):
        st = _State(len(stage_block) % 2)
        stage_block[st.index] = n_block
        return st

    k._first_block_needs_clean = lambda sq, m_block, n_block: tests.append((sq, m_block, n_block)) or needs
    k._clean_v_stage = lambda sVt, st, col0, width, shared_tag=False, active=None: events.append(
        ("clean", stage_block[st], active))
    k._wait_clean_v = lambda state, col0, width, shared_tag=False: events.append(
        ("clean", stage_block[state.index], None))
    k._wait_clean_v_if = lambda nd, state: events.append(("clean", stage_block[state.index], nd))
    from blockdiff.attention.cute import kernel as K
    monkeypatch.setattr(K.cute.arch, "make_warp_uniform", lambda x: x)  # (a DSL op; plain ints here)
    pv = lambda B_idx, **kw: events.append(("PV", stage_block[B_idx]))  # noqa: E731
    first = 9
    if overlap:
        monkeypatch.setattr(F, "first_half_block_overlap", lambda self, n_block, **kw: stage(n_block))

        def fake_overlap(self, state, n_block, mma_pv_fn, **kw):  # FA4 advances the passed state in place
            v_index = state.index
            state.index = stage(n_block).index
            mma_pv_fn(B_idx=v_index)
            return state
        monkeypatch.setattr(F, "mma_one_n_block_intrawg_overlap", fake_overlap)
        monkeypatch.setattr(F, "last_half_block_overlap",
                            lambda self, kv_consumer_state, mma_pv_fn, **kw: mma_pv_fn(B_idx=kv_consumer_state.index))
        st = M.first_half_block_overlap(k, n_block=first, seqlen=seqlen, mask_fn=partial(mask_fn, mask_mod=None),
                                        is_first_block=True)
        st = M.mma_one_n_block_intrawg_overlap(k, st, n_block=first - 1, seqlen=seqlen, mma_pv_fn=pv,
                                               mask_fn=partial(mask_fn, mask_mod=None, mask_seqlen=False))
        st = M.mma_one_n_block_intrawg_overlap(k, st, n_block=first - 2, seqlen=seqlen, mma_pv_fn=pv, mask_fn=None)
        M.last_half_block_overlap(k, kv_consumer_state=st, mma_pv_fn=pv, zero_init=False)
    else:
        def fake_one(self, state, n_block, mma_pv_fn, **kw):
            mma_pv_fn(B_idx=stage(n_block).index)
            return state
        monkeypatch.setattr(F, "mma_one_n_block", fake_one)
        for n, mf, is_first in ((first, partial(mask_fn, mask_mod=None, mask_seqlen=True), True),
                                (first - 1, partial(mask_fn, mask_mod=None, mask_seqlen=False), False),
                                (first - 2, None, False)):
            M.mma_one_n_block(k, None, n_block=n, seqlen=seqlen, mma_pv_fn=pv, mask_fn=mf,
                              **(dict(is_first_n_block=True) if is_first else {}))
    assert tests == [(seqlen, 7, first)]
    cleans = [e for e in events if e[0] == "clean"]
    assert [(b, int(a) if a is not None else None) for _, b, a in cleans] == [(first, needs), (first - 1, None)]
    for e in cleans:  # each clean-up before its block's P V
        assert events.index(e) < events.index(("PV", e[1])), events


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
def test_skip_allowed_first_leaves_the_hd128_key_block_loops_as_they_were(tmp_path):
    """``canvas_bs4_ctx4k_hd128``'s launch (the ping-pong consumer) with the switch: no spill and key-block loops of
    the switch-off kernel's size. The first form, the first block's wait and clean-up under a run-time ``if``, made
    ptxas move the loops' wgmma descriptors out of the uniform datapath (+80 / +57 instructions a key block, R2UR /
    IMAD) and spill 68 B; the scan's trip count set to 0 keeps them (docs/tuning.md 2.27)."""
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    from cute_helpers import compile_for_sm90_or_skip
    spec = SPECS["hd128_bench_canvas_bs4_ctx4k"]["spec"]
    on = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "on"), switches={
        "FlashAttentionForwardSm90Mixed._SKIP_ALLOWED_FIRST": True}, **spec)
    off = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "off"), **spec)
    assert on["ptx_sha256"] != off["ptx_sha256"]  # the switch acts here
    assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
    assert [loop["instructions"] for loop in on["loops"]] == [loop["instructions"] for loop in off["loops"]], (
        on["loops"], off["loops"])


# --- GPU --------------------------------------------------------------------------------------------------------
@pytest.fixture
def skip_first(monkeypatch):
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    return switch_runner(monkeypatch, M, "_SKIP_ALLOWED_FIRST")


def _block_aligned_cases(D, H, Hkv, page_size, seed, paged=True):
    """Mixed batches whose canvases (bidirectional, no causal rows) end on a boundary of 128-, 80- and 64-key blocks
    (the tile_n of every case here; with 1536 / 2048 the hd-256 80-key tiles skipped nothing): the first block of
    their tiles holds only keys every row sees (skipped), beside a prefill, a commit + canvas sequence and an empty
    one, NaN in the stale cache rows and unused pages."""
    sl, ql, ncq = [1280, 700, 333, 1920, 0], [256, 700, 64, 256, 0], [0, 700, 64, 0, 0]  # 640 | 1280, 1920
    return make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                      paged=paged, device="cuda", seed=seed, poison_unused=paged)


CASES = [  # (id, head dim, page size or None, config, call kwargs)
    ("hd128_pagebox64", 128, 64, None, {}),
    ("hd128_contiguous", 128, None, None, {}),
    ("hd128_split3", 128, 64, dict(num_splits=3), {}),
    ("hd128_no_overlap_192x128", 128, 64, dict(cc.LONG_PREFILL_CONFIG), {}),
    ("hd128_window127", 128, 64, None, dict(window_size=127)),
    ("hd256_pagebox64", 256, 64, None, {}),
    ("hd256_split2_cluster_window1023", 256, 64, dict(num_splits=2, split_merge="cluster"), dict(window_size=1023)),
]


def _nan_equal(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@needs_gpu
@pytest.mark.parametrize("D,page,config,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_skip_allowed_first_keeps_nonfinite_v_exact(D, page, config, kw, skip_first):
    """Caches with NaN / Inf V inside ``seq_lens`` (some inside the skipped blocks, which every row sees): exactly
    the reference's non-finite entries with the switch on, and on equals off bit for bit (NaN-aware), on the
    poisoned and on the finite caches."""
    inp = _block_aligned_cases(D, 16, 8, page or 64, seed=41, paged=page is not None)
    assert skip_first(True, lambda: check_nonfinite_v(inp, config, seed=5, **kw)) > 0
    bad = poison_v_inside_seq_lens(inp, 5, 6)[0]
    for batch in (inp, bad):
        def call(batch=batch):
            return attention(**batch, backend="cute", config=dict(config or {}, nan_safe_v=True), **kw)
        off, on = skip_first(False, call), skip_first(True, call)
        assert _nan_equal(on, off), (on.float() - off.float()).abs().nan_to_num().max()


@needs_gpu
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_skip_allowed_first_scans_a_contiguous_block_that_reaches_into_the_next_sequence(D, skip_first):
    """Contiguous K / V: a canvas over context whose keys end mid-block (1,300 keys: its tiles' first block reaches
    into the next sequence's keys), then a canvas whose first keys' V are NaN / +Inf / -Inf in every head and column.
    The first canvas's rows see none of them: its output stays finite and within the tolerance rule (the block is
    scanned: its rows past ``seq_lens`` are the next sequence's), the second's has exactly the reference's
    non-finite entries."""
    inp = make_batch([1300, 1280], [256, 256], num_causal_q=[0, 0], num_heads=16, num_kv_heads=8, head_dim=D,
                     paged=False, device="cuda", seed=43)
    v = inp["v_cache"].clone()
    start = int(inp["cu_seqlens_k"][1])
    for i, val in enumerate((float("nan"), float("inf"), -float("inf"), float("nan"))):
        v[start + i] = val
    bad = dict(inp, v_cache=v)

    def call():
        return attention(**bad, backend="cute", config=dict(nan_safe_v=True), max_seqlen_q=256)
    out = skip_first(True, call)
    assert torch.isfinite(out[:256]).all(), "the next sequence's NaN / Inf reached the first canvas"
    assert check_nonfinite_matches_reference(out, bad, max_seqlen_q=256) > 0

