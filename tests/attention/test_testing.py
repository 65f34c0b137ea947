"""attention/testing.py: the shared tolerance rule and the one batch builder."""
import pytest
import torch

from blockdiff.attention import MAX_SCALE, attention
from blockdiff.attention.testing import (LSE_ATOL, REPRESENTATION_ATOL, check_close, lse_magnitude, make_batch,
                                        make_batch_from_rows, scale_v_per_sequence)


def test_tolerance_defined_when_eager_fp16_scores_overflow():
    """scale 1.0, head_dim 256, large fp16 q/k: eager fp16 QK^T overflows to inf (eager output NaN); an exact
    output must still pass (the bound was NaN, rejecting every backend) and a wrong one must still fail."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(6, 2, 256, generator=g) * 40).half()
    k = (torch.randn(6, 1, 256, generator=g) * 40).half()
    v = torch.randn(6, 1, 256, generator=g).half()
    kw = dict(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32),
              causal=torch.tensor([False]), scale=1.0)
    assert not torch.isfinite(attention(q, k, v, backend="reference", upcast=False, **kw)).all()
    out, lse = attention(q, k, v, backend="reference", return_lse=True, **kw)
    check_close(out, q, k, v, lse=lse, **kw)
    wrong = out.clone()
    wrong[0, 0, 0] += 0.5
    try:
        check_close(wrong, q, k, v, **kw)
    except AssertionError:
        pass
    else:
        raise AssertionError("a wrong output passed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [MAX_SCALE, -MAX_SCALE, MAX_SCALE / 3])
def test_check_close_lse_bound_holds_the_fp32_reference_at_max_scale(dtype, scale):
    """The reference's own fp32 LSE at ``|scale|`` up to MAX_SCALE (LSE ~1e5, fp32 spacing 1/32-1/16) was 0.0625 off
    the fp64 oracle and failed the absolute 1e-4 bound (maint20's report). A bound relative to ``|lse|`` alone would
    still fail it: at a negative scale the scores cancel (``|lse|`` small, their rounding ~1e5 * eps), which the
    scores' magnitude ``M`` covers. The bound stays tight: an LSE a few ulps further off fails."""
    for seed, head_dim in ((0, 16), (1, 32), (2, 64)):
        b = make_batch([9, 13, 6, 30], [9, 4, 6, 12], num_causal_q=[9, 0, 3, 5], dtype=dtype, seed=seed,
                       head_dim=head_dim)
        out, lse = attention(**b, scale=scale, backend="reference", return_lse=True)
        res = check_close(out, **b, lse=lse, scale=scale)
        assert res["lse_err"] > LSE_ATOL[dtype]  # the absolute floor alone would have failed
        m = lse_magnitude(**b, scale=scale)
        off = lse + (4 * head_dim ** 0.5 * torch.finfo(torch.float32).eps * m).float()
        with pytest.raises(AssertionError, match="lse error"):
            check_close(out, **b, lse=off, scale=scale)


@pytest.mark.parametrize("head_dim", [16, 128, 512])
def test_check_close_lse_bound_at_the_default_scale_is_the_absolute_floor_within_a_fraction(head_dim):
    """The scores' rounding term adds little at the usual scale (what every other test checks at): at most the floor
    again at head dim 512 (about 5e-5), 3e-6 at 16; an LSE off by ``2 * LSE_ATOL`` still fails at fp32, as with the
    absolute bound alone."""
    b = make_batch([40, 13], [8, 13], causal=[False, True], dtype=torch.float32, head_dim=head_dim, num_heads=2,
                   num_kv_heads=1)
    out, lse = attention(**b, backend="reference", return_lse=True)
    m = lse_magnitude(**b)
    term = (head_dim ** 0.5 * torch.finfo(torch.float32).eps * m[torch.isfinite(m)]).max().item()
    assert term < (0.05 if head_dim == 16 else 0.75) * LSE_ATOL[torch.float32], term
    check_close(out, **b, lse=lse)
    with pytest.raises(AssertionError, match="lse error"):
        check_close(out, **b, lse=lse + 2 * LSE_ATOL[torch.float32])


def test_lse_magnitude_bounds_the_largest_score_magnitude_a_row_sees():
    b = make_batch([7], [3], causal=[True], dtype=torch.float32, num_heads=1, num_kv_heads=1, page_size=8,
                   extra_blocks=0, permute=False)
    q, k = b["q"][:, 0].double(), b["k_cache"][0, :7, 0].double()
    m = lse_magnitude(**b, scale=-2.0)[0]
    for r in range(3):  # row r sees keys 0 .. 4 + r
        mag = 2.0 * (q[r].abs() @ k[:5 + r].abs().T)
        assert mag.max() * (1 - 1e-6) <= m[r] <= (mag.max() + torch.log(torch.tensor(5.0 + r))) * (1 + 1e-6)
        assert torch.allclose(m[r].double(), torch.logsumexp(mag, 0), rtol=1e-6, atol=0)


def _mixed_magnitudes(dtype, **kw):
    """Sequence 0's V x 1000 beside two O(1) sequences (the last one query over one key: eager exact there)."""
    b = make_batch([21, 9, 1], [7, 9, 1], num_causal_q=[7, 0, 1], dtype=dtype, page_size=5, seed=90, **kw)
    return scale_v_per_sequence(b, [1000.0, 1.0, 1.0])


@pytest.mark.parametrize("dtype,delta", [(torch.bfloat16, 0.05), (torch.float16, 0.05), (torch.float32, 1e-4)])
def test_check_close_bounds_each_sequence_by_its_own_eager_error(dtype, delta):
    """The mutation the batch-wide eager term let through: the small sequence 1 off by ``delta`` (0.05 in bf16 /
    fp16) beside sequence 0's V x 1000 was within ``2 x`` the batch's eager error (that of sequence 0's outputs,
    ~6 in bf16); it is not within its own sequence's, which now bounds it. The exact output still passes."""
    b = _mixed_magnitudes(dtype)
    exact = attention(**b, backend="reference")
    res = check_close(exact, **b)
    seq_eager = res["seq_eager_err"]
    assert seq_eager[0] == res["eager_err"] and res["seq_bound"][1] < 0.75 * delta
    wrong = exact.clone()
    wrong[7:16] = (exact[7:16].double() + delta).to(dtype)                    # sequence 1's rows, every element
    d = (wrong.double() - exact.double()).abs().max().item()
    assert res["err"] + d <= 2 * res["eager_err"], "the batch-wide rule (2 x eager_err + rep) let it pass"
    with pytest.raises(AssertionError, match=rf"^sequence 1 \(rows 7:16\): error [0-9.e+-]+ at row \d+, head \d+, "
                                             rf"column \d+ .* > 2.0 x the sequence's eager error "
                                             rf"{seq_eager[1]:.3e} \+ representation"):
        check_close(wrong, **b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_close_keeps_the_representation_term_for_a_sequence_whose_eager_error_is_zero(dtype):
    """Sequence 2 is one query over one key: eager returns V exactly (eager error exactly 0), so its bound is the
    representation term alone, not 0: one unit in the last place passes (no flaky failure of an exact kernel that
    rounds once); four representation terms fail, which the batch-wide rule (~2 x 6 in bf16) let through."""
    b = _mixed_magnitudes(dtype)
    exact = attention(**b, backend="reference")
    res = check_close(exact, **b)
    assert res["seq_eager_err"][2] == 0.0 and res["seq_err"][2] == 0.0
    rep = torch.clamp(exact[16:].double().abs() * torch.finfo(dtype).eps, min=REPRESENTATION_ATOL[dtype])
    assert res["seq_bound"][2] == rep.max().item()
    ulp = exact.clone()
    ulp[16:] = torch.nextafter(exact[16:], torch.full_like(exact[16:], float("inf")))
    assert check_close(ulp, **b)["seq_err"][2] > 0
    far = exact.clone()
    far[16:] = (exact[16:].double() + 4 * rep).to(dtype)
    assert ((far.double() - exact.double()).abs() <= 2 * res["eager_err"]).all()
    with pytest.raises(AssertionError, match=r"^sequence 2 \(rows 16:17\): .* eager error 0\.000e\+00 "):
        check_close(far, **b)


def test_check_close_per_sequence_numbers_and_empty_sequences():
    """``seq_*`` have one entry per sequence (a sequence of no rows: 0, 0 and the atol bound); the batch numbers
    are their maxima; no element's bound exceeds the batch-wide ``2 x eager_err + rep`` of before."""
    b = make_batch([0, 9, 5, 13], [0, 4, 0, 13], causal=[True, False, False, True], seed=3)
    b = scale_v_per_sequence(b, [1.0, 1.0, 1.0, 50.0])
    out = attention(**b, backend="reference")
    res = check_close(out, **b)
    atol = REPRESENTATION_ATOL[torch.bfloat16]
    assert len(res["seq_err"]) == len(res["seq_eager_err"]) == len(res["seq_bound"]) == 4
    assert res["seq_err"][0::2] == [0.0, 0.0] and res["seq_eager_err"][0::2] == [0.0, 0.0]
    assert res["seq_bound"][0::2] == [atol, atol]
    assert max(res["seq_err"]) == res["err"] and max(res["seq_eager_err"]) == res["eager_err"]
    assert max(res["seq_bound"]) == res["bound"] and 0 < res["excess"] <= 1
    assert res["seq_eager_err"][1] < res["eager_err"] / 10
    rep_max = (out.double().abs() * torch.finfo(torch.bfloat16).eps).clamp(min=atol).max().item()
    assert res["bound"] <= 2 * res["eager_err"] + rep_max
    empty = make_batch([], [], causal=[])
    assert check_close(attention(**empty, backend="reference"), **empty) == {
        "err": 0.0, "eager_err": 0.0, "bound": atol, "seq_err": [], "seq_eager_err": [], "seq_bound": [],
        "excess": 0.0}


@pytest.mark.parametrize("paged", [True, False])
def test_scale_v_per_sequence_scales_only_that_sequences_values(paged):
    """Attention is linear in V: the scaled sequence's output is the factor times the original, the others' are
    unchanged bit for bit (their pages / rows untouched); the input batch is not modified."""
    b = make_batch([9, 13, 6], [9, 4, 6], causal=[True, False, True], dtype=torch.float64, paged=paged, page_size=4)
    v0 = b["v_cache"].clone()
    s = scale_v_per_sequence(b, [1.0, 1000.0, 1.0])
    assert torch.equal(b["v_cache"], v0) and s["k_cache"] is b["k_cache"]
    o, o_s = attention(**b, backend="reference"), attention(**s, backend="reference")
    assert torch.equal(o_s[:9], o[:9]) and torch.equal(o_s[13:], o[13:])
    torch.testing.assert_close(o_s[9:13], 1000 * o[9:13], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="one per sequence"):
        scale_v_per_sequence(b, [1.0, 2.0])


# ---------------------------------------------------------------- the batch builder
MIXED = dict(seq_lens=[9, 13, 6, 1, 5, 30], q_lens=[9, 4, 6, 1, 0, 12],
             causal=[True, False, True, False, False, False])


def _pages_of(batch, b):
    n = -(-int(batch["seq_lens"][b]) // batch["k_cache"].shape[1])
    return batch["block_table"][b, :n].tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_close_allows_one_rounding_at_large_outputs_where_eager_is_exact(dtype):
    """At |scale| = MAX_SCALE the softmax is one-hot and eager PyTorch exact (eager error 0), so the bound was the
    flat atol, half a unit in the last place at outputs of 1-2: the cute backend, whose P of the top key is exp2 of an
    fp32 rounding residual rounded to fp16, was one unit off at outputs of 2-4 (H100, 2026-12-06) and failed. Now
    one rounding relative to the oracle passes (eps(dtype) |oracle|); three units do not."""
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=dtype, head_dim=32, page_size=16, seed=70)
    kw = dict(scale=MAX_SCALE, window_size=5, **{k: v for k, v in inp.items() if k not in ("q", "k_cache", "v_cache")})
    exact = attention(inp["q"], inp["k_cache"], inp["v_cache"], backend="reference", **kw)
    big = exact.abs() >= 2
    assert big.any()
    ulp = torch.finfo(dtype).eps * 2                               # the spacing of [2, 4)
    one = torch.where(big & (exact.abs() < 4), exact + ulp * exact.sign(), exact).to(dtype)
    assert check_close(one, inp["q"], inp["k_cache"], inp["v_cache"], **kw)["eager_err"] == 0.0
    three = torch.where(big & (exact.abs() < 4), exact + 3 * ulp * exact.sign(), exact).to(dtype)
    with pytest.raises(AssertionError, match="representation"):
        check_close(three, inp["q"], inp["k_cache"], inp["v_cache"], **kw)


def test_paged_batch_shapes_dtypes_and_metadata():
    b = make_batch(**MIXED, num_heads=6, num_kv_heads=3, head_dim=8, head_dim_v=12, page_size=4)
    assert set(b) == {"q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens", "causal"}
    assert b["q"].shape == (32, 6, 8) and b["q"].dtype == torch.bfloat16
    pages = [3, 4, 2, 1, 2, 8]
    assert b["k_cache"].shape == (sum(pages) + 1, 4, 3, 8) and b["v_cache"].shape == (sum(pages) + 1, 4, 3, 12)
    assert b["block_table"].shape == (6, 9) and b["block_table"].dtype == torch.int32
    assert b["cu_seqlens_q"].tolist() == [0, 9, 13, 19, 20, 20, 32] and b["cu_seqlens_q"].dtype == torch.int32
    assert b["seq_lens"].tolist() == MIXED["seq_lens"] and b["causal"].tolist() == MIXED["causal"]
    used = [p for s in range(6) for p in _pages_of(b, s)]
    assert len(set(used)) == len(used) == sum(pages), "every sequence owns distinct pages"
    assert used != sorted(used), "page ids are permuted"
    assert int(b["block_table"].max()) < b["k_cache"].shape[0], "garbage past the used part is a valid page id"


def test_same_seed_same_tensors_other_seed_other_tensors():
    a, b, c = make_batch(**MIXED), make_batch(**MIXED), make_batch(**MIXED, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["q"], c["q"]) and not torch.equal(a["block_table"], c["block_table"])


def test_contiguous_form_and_num_causal_q():
    b = make_batch(**{**MIXED, "causal": None}, num_causal_q=[5, 0, 6, 1, 0, 3], paged=False, page_size=4,
                   dtype=torch.float32)
    assert "block_table" not in b and "causal" not in b
    assert b["cu_seqlens_k"].tolist() == [0, 9, 22, 28, 29, 34, 64] and b["cu_seqlens_k"].dtype == torch.int32
    assert b["k_cache"].shape == (64 + 4, 2, 16) and b["k_cache"].dtype == torch.float32
    assert b["num_causal_q"].tolist() == [5, 0, 6, 1, 0, 3] and b["num_causal_q"].dtype == torch.int32


def test_batch_runs_through_every_cpu_backend_path_and_matches_the_oracle():
    for paged in (True, False):
        inp = make_batch(**MIXED, paged=paged, dtype=torch.float32)
        out = attention(**inp, backend="reference", window_size=3)
        check_close(out, **inp, window_size=3)


def test_paged_and_contiguous_forms_agree_on_the_same_keys():
    """The paged cache gathered through the block table is a valid contiguous batch of the same keys."""
    inp = make_batch(**MIXED, dtype=torch.float64, page_size=3)
    ks, vs = [], []
    for s, n in enumerate(inp["seq_lens"].tolist()):
        pages = torch.tensor(_pages_of(inp, s), dtype=torch.long)
        ks.append(inp["k_cache"][pages].flatten(0, 1)[:n])
        vs.append(inp["v_cache"][pages].flatten(0, 1)[:n])
    cu_k = torch.tensor([0] + torch.tensor(inp["seq_lens"].tolist()).cumsum(0).tolist(), dtype=torch.int32)
    contig = dict(inp, k_cache=torch.cat(ks), v_cache=torch.cat(vs), cu_seqlens_k=cu_k)
    del contig["block_table"]
    torch.testing.assert_close(attention(**contig, backend="reference"), attention(**inp, backend="reference"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("pad", ["zeros", "nan_page"])
def test_block_table_padding_modes(pad):
    b = make_batch([5, 9], [5, 1], causal=False, page_size=4, block_table_pad=pad, extra_columns=2,
                   dtype=torch.float32)
    assert b["block_table"].shape == (2, 5)
    if pad == "zeros":
        assert b["block_table"][0, 2:].tolist() == [0, 0, 0]
    else:
        nan_page = b["k_cache"].shape[0] - 1
        assert b["block_table"][0, 2:].tolist() == [nan_page] * 3 and b["block_table"][1, 3:].tolist() == [nan_page] * 2
        assert torch.isnan(b["k_cache"][nan_page]).all() and torch.isnan(b["v_cache"][nan_page]).all()
        assert torch.isfinite(b["k_cache"][:nan_page]).all()


def test_unpermuted_pages_are_consecutive_and_no_extra_columns():
    b = make_batch([5, 9], [5, 1], causal=[True, False], page_size=4, permute=False, extra_columns=0,
                   extra_blocks=0, block_table_pad="zeros")
    assert b["block_table"].tolist() == [[0, 1, 0], [2, 3, 4]] and b["k_cache"].shape[0] == 5


@pytest.mark.parametrize("paged", [True, False])
def test_poison_unused_marks_exactly_the_rows_no_sequence_owns(paged):
    b = make_batch([5, 9], [5, 2], causal=[True, False], page_size=4, poison_unused=True, paged=paged,
                   dtype=torch.float32, extra_blocks=2)
    k = b["k_cache"].reshape(-1, *b["k_cache"].shape[-2:])
    assert int(torch.isnan(k[:, 0, 0]).sum()) == k.shape[0] - 14  # 14 keys owned, the rest poisoned
    assert torch.isfinite(attention(**b, backend="reference")).all()


def test_make_batch_from_rows_matches_make_batch():
    rows = [(0, 9, 9), (4, 4, 0), (3, 3, 1)]
    a = make_batch_from_rows(rows, page_size=8, seed=3)
    b = make_batch([9, 8, 6], [9, 4, 3], num_causal_q=[9, 0, 1], page_size=8, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_empty_batch_and_empty_sequences():
    for paged in (True, False):
        e = make_batch([], [], causal=[], paged=paged)
        assert e["q"].shape == (0, 4, 16) and e["cu_seqlens_q"].tolist() == [0] and e["seq_lens"].numel() == 0
        z = make_batch([0, 4, 0], [0, 2, 0], causal=True, paged=paged, dtype=torch.float32)
        assert attention(**z, backend="reference").shape == (2, 4, 16)


def test_scalar_causal_spec_applies_to_every_sequence():
    assert make_batch([3, 4], [1, 2], causal=True)["causal"].tolist() == [True, True]
    assert make_batch([3, 4], [1, 2], num_causal_q=1)["num_causal_q"].tolist() == [1, 1]


@pytest.mark.parametrize("kw,exc,match", [
    (dict(seq_lens=[3, 4], q_lens=[1]), ValueError, "one per sequence"),
    (dict(seq_lens=[3], q_lens=[4]), ValueError, "q_len <= seq_len"),
    (dict(seq_lens=[3], q_lens=[-1]), ValueError, "0 <= q_len"),
    (dict(seq_lens=[3.0], q_lens=[1]), TypeError, "seq_lens must hold ints"),
    (dict(seq_lens=[True], q_lens=[1]), TypeError, "seq_lens must hold ints"),
    (dict(seq_lens=3, q_lens=[1]), TypeError, "seq_lens must be a sequence"),
    (dict(seq_lens=[3], q_lens=[1], causal=None), ValueError, "exactly one"),
    (dict(seq_lens=[3], q_lens=[1], num_causal_q=[1]), ValueError, "exactly one"),
    (dict(seq_lens=[3], q_lens=[1], causal=[True, False]), ValueError, "causal has 2"),
    (dict(seq_lens=[3], q_lens=[1], causal=[1]), TypeError, "causal must be a bool"),
    (dict(seq_lens=[3], q_lens=[2], causal=None, num_causal_q=[3]), ValueError, r"num_causal_q\[0\]"),
    (dict(seq_lens=[3], q_lens=[1], page_size=0), ValueError, "page_size must be >= 1"),
    (dict(seq_lens=[3], q_lens=[1], head_dim=16.0), TypeError, "head_dim must be an int"),
    (dict(seq_lens=[3], q_lens=[1], head_dim_v=0), ValueError, "head_dim_v"),
    (dict(seq_lens=[3], q_lens=[1], extra_blocks=-1), ValueError, "extra_blocks"),
    (dict(seq_lens=[3], q_lens=[1], extra_columns=-1), ValueError, "extra_columns"),
    (dict(seq_lens=[3], q_lens=[1], block_table_pad="nan"), ValueError, "block_table_pad"),
    (dict(seq_lens=[3], q_lens=[1], dtype="bf16"), TypeError, "dtype"),
])
def test_bad_arguments_are_clear_errors(kw, exc, match):
    kw.setdefault("causal", [False] * len(kw["q_lens"]) if isinstance(kw["q_lens"], list) else False)
    with pytest.raises(exc, match=match):
        make_batch(**kw)


@pytest.mark.parametrize("rows,exc,match", [
    ([(0, 1)], TypeError, "triple"),
    ([(-1, 1, 0)], ValueError, "context_len"),
    ([(0, 2, 3)], ValueError, "num_causal_q"),
])
def test_make_batch_from_rows_bad_rows(rows, exc, match):
    with pytest.raises(exc, match=match):
        make_batch_from_rows(rows)
    with pytest.raises(TypeError, match="rows only"):
        make_batch_from_rows([(0, 1, 1)], causal=True)


def test_poison_v_inside_seq_lens_puts_nonfinite_values_only_at_the_positions_it_reports():
    """The NaN / +-Inf V poisoning of the contract checks: a copy (the batch's cache untouched), per_seq entries
    per non-empty sequence at keys inside seq_lens, paged and contiguous, the same for a seed."""
    from blockdiff.attention.testing import poison_v_inside_seq_lens

    for paged in (True, False):
        b = make_batch([0, 5, 40], [0, 5, 3], num_causal_q=[0, 5, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                       page_size=8, paged=paged, seed=1)
        bad, pos = poison_v_inside_seq_lens(b, seed=3, per_seq=4)
        assert torch.isfinite(b["v_cache"]).all() and bad["k_cache"] is b["k_cache"]
        seq_lens = b["seq_lens"].tolist()
        assert len(pos) == 4 * sum(1 for S in seq_lens if S > 0)
        assert int((~torch.isfinite(bad["v_cache"])).sum()) == len({p[:4] for p in pos})
        for s, key, head, col, val in pos:
            assert 0 <= key < seq_lens[s]
            if paged:
                P = b["v_cache"].shape[1]
                got = bad["v_cache"][int(b["block_table"][s, key // P]), key % P, head, col]
            else:
                got = bad["v_cache"][int(b["cu_seqlens_k"][s]) + key, head, col]
            assert (torch.isnan(got) and val != val) or float(got) == val
        again, pos2 = poison_v_inside_seq_lens(b, seed=3, per_seq=4)
        assert [(*p[:4], str(p[4])) for p in pos2] == [(*p[:4], str(p[4])) for p in pos]


def test_very_negative_scores_batch_gives_scores_near_minus_2e31_and_refuses_fp16():
    """The one builder of the scores-near--2e31 batch (three test files had their own; the contract's copy built its
    1e15 entries in the cute row's fp16, overflowed, and so passed a strict xfail without running the kernel)."""
    from blockdiff.attention.testing import make_very_negative_scores_batch

    for sign in (1, -1):
        inp = make_very_negative_scores_batch([9, 5], [3, 5], num_causal_q=[0, 5], dtype=torch.float32, q_sign=sign,
                                              paged=False, seed=3)
        s = torch.einsum("qhd,khd->qkh", inp["q"][:, :1].double(), inp["k_cache"][:, :1].double()) * sign
        assert bool(((s < -1e31) & (s > -1e32)).all()) and torch.isfinite(inp["k_cache"]).all()
    again = make_very_negative_scores_batch([9, 5], [3, 5], num_causal_q=[0, 5], dtype=torch.float32, seed=3,
                                            paged=False)
    assert torch.equal(again["k_cache"], inp["k_cache"])
    with pytest.raises(ValueError, match="dtype must hold entries of 1e15"):
        make_very_negative_scores_batch([4], [4], dtype=torch.float16)
    with pytest.raises(ValueError, match="q_sign must be 1 or -1"):
        make_very_negative_scores_batch([4], [4], q_sign=2)
