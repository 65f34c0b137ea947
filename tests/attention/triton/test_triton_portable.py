"""The portable Triton kernel (attention/triton/portable.py) against the dense reference (attention/testing.py
tolerance rule) through ``attention(backend="triton")``, fuzzed with hypothesis: mixed row types, windows, splits,
page sizes, GQA, dtypes, lazy rescaling, V head-dim slices, the block-table prefetch and the kernel's memory
accesses (interpreter only)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from blockdiff.attention import attention
from blockdiff.attention.testing import check_close
from blockdiff.attention.triton.interface import LAST_LAUNCH, attention_triton

from triton_helpers import (MIXED, SMALL, batches, make_batch, run_and_check, scores_near_1000_batch,
                            very_negative_scores_batch)


@pytest.mark.parametrize("window_size", [None, 0, 1, 7, 100])
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_mixed_prefill_denoise_commit_batch_in_one_launch(window_size, mode):
    inp = make_batch(**MIXED)
    run_and_check(inp, config=SMALL, window_size=window_size, bidirectional_window=mode)


@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_num_causal_q_mixes_causal_and_bidirectional_rows_in_one_tile(mode):
    # commit rows then the next canvas in one sequence, tiles straddle the boundary
    inp = make_batch(seq_lens=[20, 17, 9], q_lens=[11, 9, 9], num_causal_q=[5, 9, 0], num_heads=4, num_kv_heads=1)
    for w in (None, 2, 6):
        run_and_check(inp, config=dict(BLOCK_M=16, BLOCK_N=16), window_size=w, bidirectional_window=mode)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_any_split_count_equals_one_split(num_splits):
    inp = make_batch(seq_lens=[40, 7], q_lens=[6, 7], causal=[False, True], num_heads=4, num_kv_heads=1, page_size=8)
    one, lse1 = run_and_check(inp, config=dict(SMALL, num_splits=1))
    many, lsen = run_and_check(inp, config=dict(SMALL, num_splits=num_splits))
    torch.testing.assert_close(many.float(), one.float(), rtol=0, atol=2 ** -7)
    torch.testing.assert_close(lsen, lse1, rtol=0, atol=1e-5)


def test_more_splits_than_key_blocks_leaves_empty_splits_harmless():
    inp = make_batch(seq_lens=[3, 5], q_lens=[3, 2], causal=[True, False])
    run_and_check(inp, config=dict(SMALL, num_splits=6), window_size=1)


@pytest.mark.parametrize("page_size", [1, 3, 5, 16, 32])
def test_page_sizes_that_do_not_divide_tiles(page_size):
    inp = make_batch(seq_lens=[37, 20], q_lens=[5, 20], causal=[False, True], page_size=page_size)
    run_and_check(inp, config=SMALL, window_size=9)


def test_contiguous_varlen_form():
    inp = make_batch(**MIXED, paged=False)
    run_and_check(inp, config=SMALL, window_size=4)
    run_and_check(inp, config=dict(SMALL, num_splits=2), bidirectional_window="prefix", window_size=3)


@pytest.mark.parametrize("H,Hkv", [(2, 2), (4, 2), (4, 1), (8, 1), (6, 2)])
def test_gqa_ratios_pack_query_heads_of_one_kv_head(H, Hkv):
    inp = make_batch(seq_lens=[12, 9], q_lens=[5, 9], causal=[False, True], num_heads=H, num_kv_heads=Hkv)
    run_and_check(inp, config=dict(BLOCK_M=16, BLOCK_N=16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype):
    inp = make_batch(**MIXED, dtype=dtype)
    run_and_check(inp, config=SMALL, window_size=3)


def test_zero_length_sequences_and_empty_batch():
    inp = make_batch(seq_lens=[0, 6, 0, 3], q_lens=[0, 2, 0, 0], causal=[True, False, False, True])
    run_and_check(inp, config=SMALL)
    empty = make_batch(seq_lens=[], q_lens=[], causal=[])
    out, lse = attention(**empty, return_lse=True, backend="triton")
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_an_empty_call_records_that_nothing_launched():
    """``LAST_LAUNCH`` after a call with no query rows is ``kernel`` None, not the previous call's record (the
    cute backend's roles fuzz read a stale record after an empty batch on the H200, 2026-12-03)."""
    run_and_check(make_batch(**MIXED), config=SMALL)
    assert LAST_LAUNCH["grid"] is not None and LAST_LAUNCH["num_splits"] >= 1
    attention_triton(**make_batch(seq_lens=[0, 5], q_lens=[0, 0], causal=[True, False]))
    assert LAST_LAUNCH == dict.fromkeys(("kernel", "num_splits", "grid", "config", "impl"))


def test_fewer_query_tokens_than_sequences():
    inp = make_batch(seq_lens=[4, 7, 2, 9, 5, 1], q_lens=[0, 1, 0, 1, 0, 1],
                     causal=[False, True, False, False, True, False])
    run_and_check(inp, config=SMALL, window_size=2)


def test_query_longer_than_its_context():
    inp = make_batch(seq_lens=[35, 3], q_lens=[33, 3], causal=[False, True])
    for mode in ("symmetric", "prefix"):
        run_and_check(inp, config=SMALL, window_size=5, bidirectional_window=mode)


@pytest.mark.parametrize("window_size", [0, 29, 30, 31, 1 << 40])
def test_window_zero_and_window_at_or_beyond_length(window_size):
    inp = make_batch(seq_lens=[30, 12], q_lens=[8, 12], causal=[False, True])
    for mode in ("symmetric", "prefix"):
        run_and_check(inp, config=SMALL, window_size=window_size, bidirectional_window=mode)


def test_scale_head_dim_v_and_non_power_of_two_head_dim():
    inp = make_batch(seq_lens=[14, 6], q_lens=[4, 6], causal=[False, True], head_dim=24, head_dim_v=40, num_heads=4,
                     num_kv_heads=2)
    run_and_check(inp, config=SMALL, scale=1.0, window_size=3)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16), scale=0.3)  # V head dim split over programs


@pytest.mark.parametrize("scale", [None, 6.0, -3.0])
def test_lazy_rescaling_matches_reference(scale):
    # large |scale| makes row maxima jump by more than 2^8 between key blocks (the rescale branch)
    inp = make_batch(seq_lens=[40, 13, 30], q_lens=[9, 13, 30], num_causal_q=[0, 13, 11], num_heads=4, num_kv_heads=2)
    for w in (None, 5):
        run_and_check(inp, config=dict(SMALL, LAZY_RESCALE=True), scale=scale, window_size=w)
    run_and_check(inp, config=dict(SMALL, LAZY_RESCALE=True, num_splits=3), scale=scale)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_rescaling_keeps_rows_whose_scores_all_lie_below_minus_1e30(num_splits, dtype):
    # regression: the lazy rescale measured a row's max growth against max(m_i, -1e30), so a row whose scores (log2
    # units) all lay below -1e30 never "grew" (its first key included): p = exp2(s - 0) = 0 or exp2(s - stale max) =
    # inf, a NaN output and lse +inf where the reference gives the one-hot softmax
    # compiled (docs/tuning.md 7.62-7.63), with LAZY_RESCALE on or off: exp2(fma(s, c, -round(max * c))), the one-FMA
    # weight, kept the product's rounding error (2^80 here): the compile tests now require no exp2 fed by an FMA
    inp = very_negative_scores_batch(dtype)
    for w in (None, 5):
        o, lse = run_and_check(inp, config=dict(SMALL, LAZY_RESCALE=True, num_splits=num_splits), scale=1.0,
                               window_size=w)
        ref = attention(**inp, backend="reference", scale=1.0, window_size=w)
        torch.testing.assert_close(o.float(), ref.float(), rtol=0, atol=1e-6)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("scale", [1e-38, -1e-38])
def test_a_tiny_scale_with_raw_scores_near_2e38_keeps_keys_whose_raw_difference_overflows(scale):
    """Raw scores q . k of 3.2e38 and -2e38 at scale +-1e-38 (|scale * log2(e)| a normal fp32, 1.4e-38): scaled
    scores of 3.2 and -2, inside the contract. The raw-score path (RAW_MAX) took this scale and weighed each key
    ``exp2((s - m) * c)``: the raw difference (-5.2e38) overflowed to -inf, so every key but the best weighed 0 where
    their exact weight is e^-5.2 (19 of them: out 1.0, the reference 0.81; lse 3.2 for 3.30). Such scales now run
    the general path (scaled first: ``tma.MIN_RAW_MAX_QK_SCALE``), LAZY_RESCALE and split-KV included."""
    from blockdiff.attention.triton.tma import normal_kernel_scale, positive_kernel_scale

    assert not normal_kernel_scale(scale) and not positive_kernel_scale(abs(scale))
    assert normal_kernel_scale(2.0 ** -120 / 1.4426950408889634) and normal_kernel_scale(-1e-36)
    inp = make_batch(seq_lens=[20, 5], q_lens=[1, 5], num_causal_q=[0, 5], head_dim=16, num_heads=2, num_kv_heads=1,
                     dtype=torch.float32, paged=False, seed=3)
    inp["q"] = torch.full_like(inp["q"], 1e19 if scale > 0 else -1e19)
    k = torch.full_like(inp["k_cache"], -1.25e18)                           # q . k = -2e38 (scale > 0)
    k[0] = k[20] = 2e18                                                     # q . k = 3.2e38: each sequence's best
    inp["k_cache"] = k
    inp["v_cache"] = torch.where(k > 0, 1.0, -1.0).to(inp["v_cache"].dtype)
    for config in (SMALL, dict(SMALL, LAZY_RESCALE=True, num_splits=3)):
        o, lse = run_and_check(inp, config=config, scale=scale)
        assert abs(o[0, 0, 0].item() - 0.8103) < 1e-3 and abs(lse[0, 0].item() - 3.2997) < 1e-3


_NEAR_1000_CASES = [(0.25, {}, {}), (-0.25, {}, {}), (0.25, dict(LAZY_RESCALE=True), {}),
                    (0.25, dict(BLOCK_DV=16), dict(head_dim_v=32))]


@pytest.mark.parametrize("scale,config,shape", _NEAR_1000_CASES)
def test_split_kv_output_at_scores_near_1000_is_within_the_eager_bound(scale, config, shape):
    """fp32, every score 990 plus a spread of about one, computed exactly (:func:`scores_near_1000_batch`), three
    forced splits. Was 2.2e-5 / 1.8e-5 off (seeds 0 / 1) against element bounds of 2.1e-5 / 1.4e-5, where one
    split is 1.5e-7 / 8e-8 off (now 9e-8 / 5e-8 at three splits): each split stored its natural-log LSE, whose fp32 ulp near 993 (6.1e-5) the merge weights
    ``exp(lse_s - max lse)`` inherited (break29a's case, docs/tuning.md 7.63). The splits now store their raw max and
    sum, and the merge weighs ``l_s * exp2((m_s - M) * c)``: the split result is the one-split result up to a few
    fp32 roundings (``NEG_Q``'s negated scale, lazy rescaling's stale max and V head-dim slices included)."""
    for seed in (0, 1):
        inp = scores_near_1000_batch(scale=scale, seed=seed, **shape)
        o, lse = run_and_check(inp, config=dict(SMALL, num_splits=3, **config), scale=scale)
        assert LAST_LAUNCH["num_splits"] == 3
        one, lse1 = attention(**inp, backend="triton", scale=scale, return_lse=True, config=dict(SMALL, **config))
        torch.testing.assert_close(o, one, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, lse1, rtol=0, atol=2.5e-4)  # (4 ulps near 993)


@pytest.mark.gpu
@pytest.mark.parametrize("scale,config,shape", _NEAR_1000_CASES)
def test_gpu_split_kv_output_at_scores_near_1000_is_within_the_eager_bound(scale, config, shape):
    """The CPU regression above compiled (fp32: the portable kernel), at the interpreter's tiles and the automatic
    ones, three forced splits (the merge launched with PDL on sm_90+)."""
    for seed in (0, 1):
        inp = scores_near_1000_batch(scale=scale, seed=seed, device="cuda", **shape)
        for tiles in (SMALL, {}):
            o, lse = run_and_check(inp, config=dict(tiles, num_splits=3, **config), scale=scale)
            assert LAST_LAUNCH["num_splits"] == 3 and LAST_LAUNCH["impl"] == "triton"
            one, lse1 = attention(**inp, backend="triton", scale=scale, return_lse=True,
                                  config=dict(tiles, num_splits=1, **config))
            torch.testing.assert_close(o, one, rtol=0, atol=1e-6)
            torch.testing.assert_close(lse, lse1, rtol=0, atol=2.5e-4)


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_zero_and_negative_scale(scale):
    inp = make_batch(**MIXED)
    run_and_check(inp, config=SMALL, scale=scale, window_size=3)


def test_v_head_dim_split_across_programs():
    inp = make_batch(seq_lens=[19, 8], q_lens=[7, 8], causal=[False, True], head_dim=32, head_dim_v=64, num_heads=4,
                     num_kv_heads=1)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=32))
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16, num_splits=2), window_size=4)


def test_default_configs_and_larger_tiles():
    inp = make_batch(seq_lens=[70, 33], q_lens=[40, 33], causal=[False, True], num_heads=2, num_kv_heads=1,
                     page_size=16)
    run_and_check(inp)  # interpreter defaults
    run_and_check(inp, config=dict(BLOCK_M=32, BLOCK_N=32), window_size=20)
    run_and_check(inp, config=dict(BLOCK_M=64, BLOCK_N=16, num_splits=2))


def test_int64_metadata_is_accepted():
    inp = make_batch(**MIXED)
    inp = {k: (v.to(torch.int64) if k in ("cu_seqlens_q", "block_table") else v) for k, v in inp.items()}
    run_and_check(inp, config=SMALL, window_size=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU test of the interpreted kernel (4 GiB of address space)")
@pytest.mark.parametrize("paged", [True, False])
def test_a_cache_row_stride_past_int32_tile_offsets_reads_the_right_keys(paged):
    # regression: the portable kernel adds offs_n * row_stride + column to an int64 base in int32, so a cache whose
    # row stride makes (BLOCK_N - 1) * stride pass 2^31 - 1 (a page-major storage viewed as [num_blocks, page_size,
    # ...], row stride num_blocks * num_kv_heads * head_dim) wrapped to a negative offset: an out-of-bounds read (a
    # segfault under the interpreter); such a layout now compiles int64 tile offsets (plans.wide_kv_offsets)
    from blockdiff.attention.triton.plans import INT32_MAX, make_plan, wide_kv_offsets
    from blockdiff.attention.validate import check_attention_inputs

    bn = 16
    stride = -(-(INT32_MAX + 1) // (bn - 1))  # the least row stride whose 15th key row is past int32
    assert wide_kv_offsets((stride,), bn, 1) and not wide_kv_offsets((stride - 1,), bn, 1)
    edge = INT32_MAX - (bn - 1) * (stride - 1) + 1  # the width that puts stride - 1's last column at INT32_MAX
    assert not wide_kv_offsets((0, stride - 1), bn, edge) and wide_kv_offsets((0, stride - 1), bn, edge + 1)
    # (contiguous: one sequence of 16 keys, whose one key block reaches the 16th row: (bn - 1) strides)
    inp = make_batch(seq_lens=[20, 9] if paged else [16, 0], q_lens=[4, 9] if paged else [4, 0],
                     causal=[False, True], num_heads=2, num_kv_heads=1, page_size=bn, extra_blocks=0, paged=paged)
    base = torch.empty((bn - 1) * stride + 4 * 16 * 2, dtype=inp["q"].dtype)  # address space only: 4 GiB untouched
    rows = inp["k_cache"].shape[0]  # pages (paged) or key rows (contiguous)
    shape = inp["k_cache"].shape
    if paged:  # page p's row r at p * 16 + r * stride (page-major storage)
        k, v = (base.as_strided(shape, (16, stride, 16, 1), off) for off in (0, rows * 16))
    else:  # key row t at t * stride: a contiguous form whose rows lie one stride apart
        assert rows == bn
        k, v = (base.as_strided(shape, (stride, 16, 1), off) for off in (0, 16))
    k.copy_(inp["k_cache"])
    v.copy_(inp["v_cache"])
    big = dict(inp, k_cache=k, v_cache=v)
    info = check_attention_inputs(**{n: t for n, t in big.items()})
    plan = make_plan(big["q"], k, v, info, big.get("block_table"), None, "symmetric", None, False, None, SMALL, False)
    assert plan.main.kwargs["WIDE_KV_OFFS"] is True  # checked before any launch: the old kernel read out of bounds
    dense = make_plan(inp["q"], inp["k_cache"], inp["v_cache"], info, inp.get("block_table"), None, "symmetric", None,
                      False, None, SMALL, False)
    assert dense.main.kwargs["WIDE_KV_OFFS"] is False  # every ordinary layout keeps the int32 kernel
    out, _ = run_and_check(big, config=SMALL, window_size=5)
    torch.testing.assert_close(out, attention(**inp, backend="triton", config=SMALL, window_size=5), rtol=0, atol=0)


@pytest.mark.parametrize("page_size,num_splits,window,mode", [(3, 64, None, "symmetric"), (5, 7, 4, "prefix"),
                                                             (1, 4, 4, "symmetric")])
def test_split_counts_up_to_64_equal_one_split_for_odd_head_dim_v_into_a_strided_out(page_size, num_splits,
                                                                                     window, mode):
    """End to end through the merge: head_dim_v 40 (not a power of two), GQA 3, (token, head) rows not a multiple
    of the merge's BLOCK_R, pages not dividing BLOCK_N (the vector block-table prefetch), windows in both modes,
    return_lse, and an out view with strided rows; equal to num_splits=1 and to the oracle."""
    inp = make_batch(seq_lens=[61, 0, 9, 23], q_lens=[5, 0, 9, 3], num_causal_q=[2, 0, 9, 0], num_heads=3,
                     num_kv_heads=1, head_dim=24, head_dim_v=40, page_size=page_size, seed=page_size)
    kw = dict(window_size=window, bidirectional_window=mode)
    one, lse1 = attention_triton(**inp, config=dict(SMALL, num_splits=1), return_lse=True, **kw)
    total_q = one.shape[0]
    big = torch.full((total_q, 3, 56), float("nan"), dtype=one.dtype, device=one.device)
    view = big[:, :, 8:48]
    many, lsen = attention_triton(**inp, config=dict(SMALL, num_splits=num_splits), out=view, return_lse=True, **kw)
    assert many.data_ptr() == view.data_ptr() and LAST_LAUNCH["num_splits"] == num_splits
    assert torch.isnan(big[:, :, :8]).all() and torch.isnan(big[:, :, 48:]).all()
    check_close(many.cpu(), **{k: v.cpu() for k, v in inp.items()}, lse=lsen.cpu(), **kw)
    torch.testing.assert_close(many.float(), one.float(), rtol=0, atol=2 ** -7)
    torch.testing.assert_close(lsen, lse1, rtol=0, atol=1e-5)


@pytest.mark.parametrize("page_size,block_n", [(16, 16), (32, 16), (64, 16), (16, 32), (8, 32), (24, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_block_table_prefetch_equals_the_direct_page_reads(page_size, block_n, num_splits):
    """BT_PREFETCH (the default) reads block j + 1's page id during block j; with pages that are whole multiples
    of BLOCK_N (one scalar page id per block) and with pages smaller than / not dividing BLOCK_N (a vector of
    per-key page ids per block) it must give exactly the direct reads' output (same blocks, same order), for split
    ranges, windows and permuted pages."""
    inp = make_batch(seq_lens=[70, 33, 1, 96], q_lens=[6, 33, 1, 20], causal=[False, True, False, False],
                     page_size=page_size, seed=page_size + block_n)
    outs = []
    for pref in (True, False):
        cfg = dict(BLOCK_M=16, BLOCK_N=block_n, num_warps=4, num_stages=1, num_splits=num_splits, BT_PREFETCH=pref)
        o, lse = run_and_check(inp, config=cfg, window_size=11)
        outs.append((o, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _record_loads(monkeypatch):
    """Record every masked-in load address of interpreted kernels: a list of (uint64 addresses, triton dtype)."""
    import numpy as np
    import triton.runtime.interpreter as ti

    reads = []
    orig = ti.InterpreterBuilder.create_masked_load

    def hook(self, ptrs, mask, other, *args):
        p = np.asarray(ptrs.data).ravel()
        # as bool: an integer 0/1 mask array (the interpreter's `&` of int1 values) would index, not select
        m = np.broadcast_to(np.asarray(mask.data).astype(bool), np.asarray(ptrs.data).shape).ravel()
        reads.append(p[m].astype(np.uint64))
        return orig(self, ptrs, mask, other, *args)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_load", hook)
    return reads


def _span(t):
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


@pytest.mark.skipif(torch.cuda.is_available(), reason="records loads through the Triton interpreter")
@pytest.mark.parametrize("page_size,block_n,bt_prefetch,num_splits,window,mode", [
    (16, 16, True, 1, None, "symmetric"), (16, 16, True, 2, 0, "symmetric"), (32, 16, True, 3, 5, "symmetric"),
    (64, 32, True, 7, 3, "prefix"), (48, 16, True, 1, None, "symmetric"), (48, 16, True, 3, 5, "prefix"),
    (4, 16, True, 2, 0, "symmetric"), (16, 16, False, 3, 5, "symmetric"), (64, 32, False, 1, None, "symmetric"),
    (48, 16, False, 7, 3, "prefix"), (8, 32, True, 3, 5, "prefix"), (24, 16, True, 7, 3, "symmetric"),
    (4, 16, False, 2, 0, "symmetric")])
def test_kernel_reads_only_the_used_block_table_entries_and_their_pages(monkeypatch, page_size, block_n,
                                                                       bt_prefetch, num_splits, window, mode):
    """The block-table prefetch (and the direct reads) load only block-table entries of blocks a range uses
    (columns < cdiv(seq_len, page_size) of the row) and only K / V pages those entries name: entries beyond the
    used part hold out-of-range ids here, which must never be read or used as a page (sequences of length
    0 / 1, empty and one-block ranges, splits beyond the block count, pages that are / are not multiples of
    BLOCK_N)."""
    import numpy as np

    seq_lens, q_lens = [0, 1, 37, 64, 5, 96, 17], [0, 1, 6, 64, 5, 20, 1]
    ncq = [0, 1, 2, 64, 0, 7, 0]
    inp = make_batch(seq_lens=seq_lens, q_lens=q_lens, num_causal_q=ncq, page_size=page_size,
                     seed=page_size + num_splits, extra_blocks=3)
    bt = inp["block_table"]
    nblk = inp["k_cache"].shape[0]
    need = [(s + page_size - 1) // page_size for s in seq_lens]
    used = torch.zeros_like(bt, dtype=torch.bool)
    for b, n in enumerate(need):
        used[b, :n] = True
    poison = torch.where(torch.arange(bt.numel()).reshape(bt.shape) % 2 == 0, nblk + 1000, -7).to(bt.dtype)
    bt = torch.where(used, bt, poison)
    inp["block_table"] = bt
    pages = set(bt[used].tolist())

    reads = _record_loads(monkeypatch)
    cfg = dict(BLOCK_M=16, BLOCK_N=block_n, num_warps=4, num_stages=1, num_splits=num_splits,
               BT_PREFETCH=bt_prefetch)
    run_and_check(inp, config=cfg, window_size=window, bidirectional_window=mode)
    monkeypatch.undo()
    addr = np.concatenate(reads)

    b_lo, b_hi = _span(bt)
    in_bt = addr[(addr >= b_lo) & (addr < b_hi)]
    idx = (in_bt - b_lo) // bt.element_size()
    rows, cols = idx // bt.stride(0), idx % bt.stride(0)
    bad = [(int(r), int(c)) for r, c in zip(rows, cols) if not used[r, c]]
    assert not bad, f"block-table entries beyond the used part were read: {sorted(set(bad))[:8]}"
    assert len(in_bt) > 0
    for name in ("k_cache", "v_cache"):
        c = inp[name]
        lo, hi = _span(c)
        in_c = addr[(addr >= lo) & (addr < hi)]
        read_pages = set(((in_c - lo) // (c.stride(0) * c.element_size())).tolist())
        assert read_pages <= pages, f"{name} pages {sorted(read_pages - pages)} not named by a used entry"


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_fuzz_against_reference(case):
    make_kw, call_kw = case
    inp = make_batch(**make_kw)
    run_and_check(inp, **call_kw)


@pytest.mark.parametrize("scale", [-3e-37, 0.0, -65536.0])
def test_split_kv_at_general_path_and_extreme_scales_gives_the_one_split_result_on_every_v_slice(scale):
    """The raw-stats merge at the log2 scale of each path's stored max: scales whose ``|scale| * log2(e)`` is below
    2**-120 (and 0) run the general path, whose splits store maxima already in log2 units (merged at c = 1);
    ``|scale|`` = MAX_SCALE runs the raw-score path at its largest c (negated Q for the negative one). Four forced
    splits, GQA 3 of 6 heads, V head-dim slices (BLOCK_DV 16 of 40: only slice 0 stores the statistics, every slice
    normalises by its own), lazy rescaling, pages of 24 keys over 16-key blocks, a window: out and LSE match the
    reference and the one-split launch (a coverage guard: it passes at the raw-stats merge's landing)."""
    inp = make_batch(seq_lens=[50, 13, 30], q_lens=[9, 13, 30], num_causal_q=[0, 13, 11], num_heads=6,
                     num_kv_heads=2, head_dim=16, head_dim_v=40, page_size=24, dtype=torch.float32, seed=5)
    cfg = dict(SMALL, BLOCK_DV=16, LAZY_RESCALE=True)
    o, lse = run_and_check(inp, config=dict(cfg, num_splits=4), scale=scale, window_size=3)
    assert LAST_LAUNCH["num_splits"] == 4
    one, lse1 = attention(**inp, backend="triton", scale=scale, window_size=3, return_lse=True,
                          config=dict(cfg, num_splits=1))
    torch.testing.assert_close(o, one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse1, rtol=1e-6, atol=1e-6)
