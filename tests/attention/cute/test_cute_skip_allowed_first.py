"""NaN-safe V without the clean-up of a first key block every row of the tile may see whole (the config switch
``CuteConfig.skip_allowed_first``: ``"auto"``, its default, is on where the launch splits KV; docs/tuning.md 2.27,
2.30; until 2.30 the class attribute ``FlashAttentionForwardSm90Mixed._SKIP_ALLOWED_FIRST``). FA4 masks a tile's (a
split's) first key block whatever it holds, so the NaN-safe clean-up scanned it in every tile; a block inside every
row's interval holds no key a row may not see, and its NaN / Inf reach exactly the rows the reference gives them to.

* CPU (CI): the rule the kernel uses (the block is at or above ``ceil(lo(last row) / tile_n)`` and below
  ``(hi(first row) + 1) // tile_n``, the block info's own bounds) holds exactly when every key of the block is in
  every row's interval, over random tiles of mixed causal / bidirectional sequences, both window modes, packed GQA
  (hypothesis, against :func:`blockdiff.attention.masks.key_range` row by row); the config field: refused by name
  when not ``"auto"`` or a bool; ``"auto"`` on for split launches (either merge) and off otherwise, every value False
  where it cannot act (``nan_safe_v`` off, head dims above 256), from host shapes, idempotent; part of the compile key
  (``"auto"`` compiles the key of the value it resolves to; one key where it cannot act);
* CPU with the CuTe DSL: the kernels' constructor argument (a bool, False by default; True refused by the wide
  kernels); the switch needs FA4's ``m_block`` in the first block's ``mask_fn`` (a RuntimeError otherwise); the
  overrides' call sequences with FA4's GEMM calls as recorders (overlap, no overlap): only the first block's scan
  follows the test, the other clean-up calls unchanged; the hd-128 ping-pong kernel's loops keep their size;
* GPU (``python3 -m pytest -m gpu``, on the H200; ``bench/experiments/device/cute_mixed_switch.sh``): True against
  False bit for bit (finite and poisoned caches, NaN-aware), and exactly the reference's non-finite entries with it
  on, over batches whose canvases end on a key-block boundary (the skipped case) with NaN / Inf inside ``seq_lens``,
  hd 128 (with FA4's scheduler barrier, without the overlap, split-KV) and hd 256; the default (``"auto"``) on a
  split launch is the True kernel.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiff.attention import attention
from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.masks import key_range
from blockdiff.attention.testing import check_nonfinite_matches_reference, make_batch, poison_v_inside_seq_lens

from cute_helpers import (HAVE_FA4, check_nonfinite_v, nan_equal, needs_gpu, next_sequence_nan_v,
                          scan_at_every_head_dim)

_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, nvidia-cutlass-dsl)")


@pytest.fixture(autouse=True)
def _scan_at_every_head_dim(monkeypatch):
    """The switch skips a step of the mainloop scan: the hd-256 launches still test it
    (``test_default_at_hd_256_takes_the_recompute_and_no_skip`` checks the real default)."""
    scan_at_every_head_dim(monkeypatch)


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


# --- the config field (CPU, no flash-attn-4) --------------------------------------------------------------------
def _fa4_tiles(monkeypatch):
    """FA4's SM90 tile heuristic as it answers for these head dims (128 x 64 at hd 256, 128 x 128 at hd 128), so
    the configs resolve on a CPU without flash-attn-4."""
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda hd, hdv, local: SimpleNamespace(
        m_block_size=128, n_block_size=64 if hd > 128 else 128, mma_pv_is_rs=True, intra_wg_overlap=True))


def _launch(hd, window, config, **kw):
    """``resolve_launch_config`` for one canvas of 256 queries (the bench's ``canvas_bs1_ctx32k_*`` shapes: 2 splits
    at hd 256 with the window, 4 at hd 128) unless ``kw`` says otherwise."""
    args = dict(total_q=256, num_seqs=1, num_kv_heads=8 if hd <= 256 else 2, qhead_per_kvhead=2 if hd <= 256 else 8,
                keys_capacity=33024, max_seqlen_q=256, max_seqlen_k=None, num_sms=132, page_size=64)
    return cc.resolve_launch_config(hd, hd, window, config, **dict(args, **kw))


#: the unsplit launches: mixed_sliding_ctx8k's shapes (hd 256, window 1023) and four hd-128 canvases over 4,352 keys
_MIXED = dict(total_q=4096 + 512 + 256, num_seqs=4, max_seqlen_q=4096, keys_capacity=8448)
_BS4 = dict(total_q=1024, num_seqs=4, keys_capacity=4352)


@pytest.mark.parametrize("bad,err", [(1, TypeError), (0, TypeError), (None, TypeError), (1.0, TypeError),
                                     ((True,), TypeError), ("True", ValueError), ("on", ValueError),
                                     ("Auto", ValueError), ("", ValueError), ("halves", ValueError)])
def test_skip_allowed_first_is_validated_by_name(bad, err, monkeypatch):
    """``"auto"`` or a bool, nothing else (no coercion of 1 / 0 / None / a str): a TypeError for another type, a
    ValueError for another str, each naming the field, from a dict and a CuteConfig, before anything resolves."""
    _fa4_tiles(monkeypatch)
    assert cc.CuteConfig().skip_allowed_first == "auto" and cc.SKIP_ALLOWED_FIRST_VALUES == ("auto", True, False)
    for config in (dict(skip_allowed_first=bad), cc.CuteConfig(skip_allowed_first=bad)):
        with pytest.raises(err, match="skip_allowed_first"):
            cc.check_config(config)
        with pytest.raises(err, match="skip_allowed_first"):
            cc.resolve_config(256, 256, 1023, config, 256)
        with pytest.raises(err, match="skip_allowed_first"):
            _launch(512, None, config)
    for good in cc.SKIP_ALLOWED_FIRST_VALUES:
        cc.check_config(dict(skip_allowed_first=good))


def test_auto_is_on_for_split_launches_only(monkeypatch):
    """``"auto"``: True where the launch splits KV (either merge, any head dim <= 256), False on the unsplit
    launches; an explicit bool as given; from host shapes only (the split count); resolve_config leaves it as given
    (it resolves with the split count); a resolved launch config resolves to itself."""
    _fa4_tiles(monkeypatch)
    canvas = _launch(256, 1023, None)  # canvas_bs1_ctx32k_sliding
    assert (canvas.num_splits, canvas.split_merge, canvas.skip_allowed_first) == (2, "cluster", True)
    combine = _launch(256, 1023, dict(split_merge="combine"))
    assert (combine.num_splits, combine.split_merge, combine.skip_allowed_first) == (2, "combine", True)
    hd128 = _launch(128, None, None)  # canvas_bs1_ctx32k_hd128
    assert (hd128.num_splits, hd128.split_merge, hd128.skip_allowed_first) == (4, "triton", True)
    assert _launch(128, None, dict(num_splits=3)).skip_allowed_first is True
    mixed = _launch(256, 1023, None, **_MIXED)  # mixed_sliding_ctx8k
    assert (mixed.num_splits, mixed.skip_allowed_first) == (1, False)
    bs4 = _launch(128, None, None, **_BS4)  # canvas_bs4_ctx4k_hd128
    assert (bs4.num_splits, bs4.skip_allowed_first) == (1, False)
    assert _launch(256, 1023, dict(num_splits=1)).skip_allowed_first is False
    # explicit values win where it acts
    assert _launch(256, 1023, dict(skip_allowed_first=True), **_MIXED).skip_allowed_first is True
    assert _launch(128, None, dict(skip_allowed_first=True), **_BS4).skip_allowed_first is True
    assert _launch(256, 1023, dict(skip_allowed_first=False)).skip_allowed_first is False
    assert _launch(256, 1023, cc.CuteConfig(skip_allowed_first=False)).skip_allowed_first is False
    # resolve_config leaves it as given; the launch config is idempotent
    for value in cc.SKIP_ALLOWED_FIRST_VALUES:
        assert cc.resolve_config(256, 256, 1023, dict(skip_allowed_first=value), 256).skip_allowed_first == value
    for config in (None, dict(skip_allowed_first=True), dict(skip_allowed_first=False), dict(nan_safe_v=False)):
        for extra in ({}, _MIXED):
            lc = _launch(256, 1023, config, **extra)
            assert _launch(256, 1023, lc, **extra) == lc
    assert _launch(256, 1023, dict(skip_allowed_first="auto")) == canvas  # "auto" is the default
    assert cc.auto_skip_allowed_first(canvas, 256, 256) is True
    with pytest.raises(TypeError, match="num_splits"):  # an unresolved config (the split count not known)
        cc.auto_skip_allowed_first(cc.CuteConfig(), 256, 256)


@pytest.mark.parametrize("value", cc.SKIP_ALLOWED_FIRST_VALUES)
def test_skip_allowed_first_resolves_off_where_it_cannot_act(value, monkeypatch):
    """Without NaN-safe V (nothing to skip) and at head dims above 256 (the wide kernels place their own clean-up)
    every value resolves to False, split or not: the kernel built without it, one compile key."""
    _fa4_tiles(monkeypatch)
    for config in (dict(nan_safe_v=False, skip_allowed_first=value),
                   dict(nan_safe_v=False, skip_allowed_first=value, num_splits=2)):
        lc = _launch(256, 1023, config)
        assert lc.skip_allowed_first is False and lc == _launch(256, 1023, dict(nan_safe_v=False,
                                                                               num_splits=lc.num_splits))
    for hd in (512, 384):
        for design in ("auto", "split_v"):
            split = _launch(hd, None, dict(skip_allowed_first=value, wide_design=design))
            assert split.num_splits == 2 and split.skip_allowed_first is False
            assert split == _launch(hd, None, dict(wide_design=design))
            unsplit = _launch(hd, None, dict(skip_allowed_first=value, wide_design=design), total_q=1024, num_seqs=4,
                              keys_capacity=8448)
            assert unsplit.num_splits == 1 and unsplit.skip_allowed_first is False


def _fake_run(monkeypatch, config, D=256, window=1023, canvas=True):
    """``ca._run`` on CPU tensors with ``_compile`` replaced: the compile keys of one launch (hd ``D``, 16 / 8 heads,
    paged 64): one canvas of 256 over 33,024 keys (``canvas``: split at these head dims), else four canvases over
    4,352 keys (one split)."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    _fa4_tiles(monkeypatch)
    compiles = []
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: compiles.append(key) or (lambda *x: None))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: True,
          "combine": lambda *a, **k: (None, None)}
    B, keys = (1, 33024) if canvas else (4, 4352)
    pages = -(-keys // 64)
    q = torch.zeros(256 * B, 16, D, dtype=torch.bfloat16)
    k = torch.zeros(pages * B, 64, 8, D, dtype=torch.bfloat16)
    kw = dict(out=None, return_lse=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32) * 256,
              num_causal_q=torch.zeros(B, dtype=torch.int32), seq_lens=torch.full((B,), keys, dtype=torch.int32),
              block_table=torch.arange(pages * B, dtype=torch.int32).reshape(B, pages), cu_seqlens_k=None,
              window_size=window, bidirectional_window="symmetric", scale=D ** -0.5, arch=90, config=config,
              max_seqlen_q=256)
    ca._run(fa, q, k, k, **kw)
    return compiles


def test_default_at_hd_256_takes_the_recompute_and_no_skip(monkeypatch):
    """With the real ``AUTO_RECOMPUTE_HEAD_DIMS`` the hd-256 launches resolve to the recompute, where the switch
    resolves to False whatever it says (no scan to skip); hd 128 keeps the scan and the skip on split launches."""
    monkeypatch.undo()
    _fa4_tiles(monkeypatch)
    for kw in (dict(), _MIXED):
        for value in cc.SKIP_ALLOWED_FIRST_VALUES:
            lc = _launch(256, 1023, dict(skip_allowed_first=value), **kw)
            assert (lc.nan_safe_v_method, lc.skip_allowed_first) == ("recompute", False), (kw, value)
    hd128 = _launch(128, None, None)
    assert (hd128.nan_safe_v_method, hd128.num_splits, hd128.skip_allowed_first) == ("scan", 4, True)


@pytest.mark.parametrize("D,window", [(256, 1023), (128, None)])
def test_skip_allowed_first_is_part_of_the_compile_key(D, window, monkeypatch):
    """True and False compile two kernels (the key holds the resolved config); ``"auto"`` (the default) compiles the
    key of the value it resolves to: True's on the split canvas (the cluster or the combine kernel), False's on the
    unsplit canvases; with NaN-safe V off every value is the one kernel."""
    for canvas, split_kernel in ((True, "Cluster" if D == 256 else "Split"), (False, "")):
        on, off, auto = (_fake_run(monkeypatch, dict(skip_allowed_first=v), D, window, canvas)
                         for v in (True, False, "auto"))
        assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90Mixed" + split_kernel
        assert on != off and (on[0][5].skip_allowed_first, off[0][5].skip_allowed_first) == (True, False)
        assert auto == (on if canvas else off) == _fake_run(monkeypatch, None, D, window, canvas)
        nan_off = [_fake_run(monkeypatch, dict(nan_safe_v=False, skip_allowed_first=v), D, window, canvas)
                   for v in cc.SKIP_ALLOWED_FIRST_VALUES]
        assert nan_off[0] == nan_off[1] == nan_off[2] and nan_off[0][0][5].skip_allowed_first is False


def test_wide_kernels_compile_one_key_whatever_skip_allowed_first_says(monkeypatch):
    """Head dim 512 (the roles kernel, the default there, and the split-value kernel; split and unsplit): every value
    resolves to False, so one compile key each (their constructors refuse True)."""
    from test_cute_kernel_roles import _fake_run as fake_run_512
    for base in (dict(), dict(wide_design="split_v"), dict(num_splits=2), dict(wide_design="split_v", num_splits=2)):
        keys = [fake_run_512(monkeypatch, dict(base, skip_allowed_first=v))[0] for v in cc.SKIP_ALLOWED_FIRST_VALUES]
        assert keys[0] == keys[1] == keys[2] and keys[0][0][5].skip_allowed_first is False, base


# --- the kernel (CPU with the CuTe DSL) -----------------------------------------------------------------------------
_CONSTRUCTORS = r"""
import inspect

import cutlass
import pytest
from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
from blockdiff.attention.cute.kernel_cluster import FlashAttentionForwardSm90MixedCluster as C
from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
from blockdiff.attention.cute.kernel_split import FlashAttentionForwardSm90MixedSplit as S
from blockdiff.attention.cute.kernel_wide import FlashAttentionForwardSm90WideV as W
assert inspect.signature(M.__init__).parameters["skip_allowed_first"].default is False
kw = dict(pack_gqa=True, tile_m=128, tile_n=64, num_stages=2, num_threads=384, Q_in_regs=False,
          intra_wg_overlap=True, mma_pv_is_rs=True, nan_safe_v=True)
k = M(cutlass.BFloat16, 256, 256, 2, **kw)
assert k.skip_allowed_first is False and k._skip_allowed_first() is False
for cls, extra in ((M, {}), (C, dict(num_splits=2)), (S, dict(num_splits=3))):
    assert cls(cutlass.BFloat16, 256, 256, 2, skip_allowed_first=True, **kw, **extra)._skip_allowed_first() is True
    assert cls(cutlass.BFloat16, 256, 256, 2, skip_allowed_first=True, **dict(kw, nan_safe_v=False),
               **extra)._skip_allowed_first() is False  # acts with nan_safe_v only
for bad in ("auto", 1, None):
    with pytest.raises(TypeError, match="skip_allowed_first"):
        M(cutlass.BFloat16, 256, 256, 2, skip_allowed_first=bad, **kw)
wide = dict(pack_gqa=True, tile_m=64, tile_n=64, num_stages=1, num_threads=384, Q_in_regs=False, nan_safe_v=True)
for cls in (W, R):
    with pytest.raises(ValueError, match="skip_allowed_first=True is not built by " + cls.__name__):
        cls(cutlass.BFloat16, 512, 512, 8, skip_allowed_first=True, **wide)
    assert cls(cutlass.BFloat16, 512, 512, 8, skip_allowed_first=False, **wide).skip_allowed_first is False
print("constructors ok")
"""


@_FA4
def test_kernels_take_skip_allowed_first_as_a_bool_and_the_wide_ones_refuse_true():
    """FA4's consumer (and its split / cluster subclasses) takes a bool, False by default, acting with
    ``nan_safe_v`` only (the config's ``"auto"`` resolves before, never here: a TypeError); the split-value and
    roles kernels refuse True (a ValueError naming the class) and take False. In a fresh interpreter: FA4 reads the
    target architecture (sm_90a, set for the CPU as the compile check does) once per process."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a")
    r = subprocess.run([sys.executable, "-c", _CONSTRUCTORS], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "constructors ok" in r.stdout, r.stderr[-3000:]


@_FA4
def test_skip_allowed_first_needs_fa4s_m_block():
    """On, the first block's test needs the tile's ``m_block``, which FA4 binds into the call's ``mask_fn`` (a
    partial): without it (another flash-attn-4) a RuntimeError says so instead of a wrong skip."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    k = SimpleNamespace(nan_safe_v=True, skip_allowed_first=True)
    k._skip_allowed_first = lambda: M._skip_allowed_first(k)
    assert M._skip_allowed_first(k) is True
    with pytest.raises(RuntimeError, match="m_block"):
        M._first_needs(k, dict(mask_fn=lambda **kw: None, n_block=3, seqlen=None))
    assert M._skip_allowed_first(SimpleNamespace(nan_safe_v=False, skip_allowed_first=True)) is False

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
    k.nan_safe_v, k.skip_allowed_first = True, True
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
    k._wait_clean_v = lambda state, col0, width, shared_tag=False, active=None: events.append(
        ("clean", stage_block[state.index], active))
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
    """``canvas_bs4_ctx4k_hd128``'s launch (the ping-pong consumer) with ``skip_allowed_first=True`` (its ``"auto"``
    is False there: one split): no spill and key-block loops of the default kernel's size. The first form, the first
    block's wait and clean-up under a run-time ``if``, made ptxas move the loops' wgmma descriptors out of the
    uniform datapath (R2UR / IMAD in every key block) and spill; the scan's trip count set to 0 keeps them
    (docs/tuning.md 2.27)."""
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    from cute_helpers import compile_for_sm90_or_skip
    spec = SPECS["skipfirst_hd128_bench_canvas_bs4_ctx4k"]["spec"]
    assert spec["config"]["skip_allowed_first"] is True and spec["config"]["num_splits"] == 1
    on = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "on"), **spec)
    off = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "off"), **SPECS["hd128_bench_canvas_bs4_ctx4k"]["spec"])
    assert (on["config"]["skip_allowed_first"], off["config"]["skip_allowed_first"]) == (True, False)
    assert on["ptx_sha256"] != off["ptx_sha256"]  # the switch acts here
    assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
    assert [loop["instructions"] for loop in on["loops"]] == [loop["instructions"] for loop in off["loops"]], (
        on["loops"], off["loops"])


# --- GPU --------------------------------------------------------------------------------------------------------
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


@needs_gpu
@pytest.mark.parametrize("D,page,config,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_skip_allowed_first_keeps_nonfinite_v_exact(D, page, config, kw):
    """Caches with NaN / Inf V inside ``seq_lens`` (some inside the skipped blocks, which every row sees): exactly
    the reference's non-finite entries with ``skip_allowed_first=True``, and True equals False bit for bit
    (NaN-aware), on the poisoned and on the finite caches; the default (``"auto"``) runs one of the two kernels (True
    where the case splits KV) and gives their output."""
    inp = _block_aligned_cases(D, 16, 8, page or 64, seed=41, paged=page is not None)
    assert check_nonfinite_v(inp, dict(config or {}, skip_allowed_first=True), seed=5, **kw) > 0
    assert ca.LAST_LAUNCH["config"].skip_allowed_first is True
    bad = poison_v_inside_seq_lens(inp, 5, 6)[0]
    for batch in (inp, bad):
        def call(value, batch=batch):
            out = attention(**batch, backend="cute", config=dict(config or {}, nan_safe_v=True,
                                                                 skip_allowed_first=value), **kw)
            return out, ca.LAST_LAUNCH["config"]
        (off, cfg_off), (on, cfg_on), (auto, cfg_auto) = call(False), call(True), call("auto")
        assert (cfg_off.skip_allowed_first, cfg_on.skip_allowed_first) == (False, True)
        assert cfg_auto == (cfg_on if cfg_auto.num_splits > 1 else cfg_off)
        assert nan_equal(on, off), (on.float() - off.float()).abs().nan_to_num().max()
        assert nan_equal(auto, off)


@needs_gpu
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_skip_allowed_first_scans_a_contiguous_block_that_reaches_into_the_next_sequence(D):
    """Contiguous K / V: a canvas over context whose keys end mid-block (1,300 keys: its tiles' first block reaches
    into the next sequence's keys), then a canvas whose first keys' V are NaN / +Inf / -Inf in every head and column.
    The first canvas's rows see none of them: its output stays finite and within the tolerance rule (the block is
    scanned: its rows past ``seq_lens`` are the next sequence's), the second's has exactly the reference's
    non-finite entries."""
    bad = next_sequence_nan_v(D, 4, seed=43)

    out = attention(**bad, backend="cute", config=dict(nan_safe_v=True, skip_allowed_first=True), max_seqlen_q=256)
    assert ca.LAST_LAUNCH["config"].skip_allowed_first is True
    assert torch.isfinite(out[:256]).all(), "the next sequence's NaN / Inf reached the first canvas"
    assert check_nonfinite_matches_reference(out, bad, max_seqlen_q=256) > 0

