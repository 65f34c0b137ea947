"""Pins the attention contract: hand-checked masks, edges, validation, and the oracle against SDPA."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from blockdiff.attention import attention, build_mask, count_allowed_pairs
from blockdiff.attention.masks import batch_key_ranges
from blockdiff.attention.reference import attention_reference
from blockdiff.attention.testing import make_batch

# 12 keys, 4 query rows (ctx = 8), W = 2: hand-written, one per row type and mode.
CAUSAL_W2 = [
    "000000111000",
    "000000011100",
    "000000001110",
    "000000000111",
]
SYMMETRIC_W2 = [
    "000000111110",
    "000000011111",
    "000000001111",
    "000000000111",
]
PREFIX_W2 = [
    "000000111111",
    "000000111111",
    "000000111111",
    "000000111111",
]


def _m(rows):
    return torch.tensor([[c == "1" for c in r] for r in rows])


@pytest.mark.parametrize("kw,expected", [
    (dict(causal=True), CAUSAL_W2),
    (dict(causal=False, bidirectional_window="symmetric"), SYMMETRIC_W2),
    (dict(causal=False, bidirectional_window="prefix"), PREFIX_W2),
])
def test_hand_checked_masks_12_keys_window_2(kw, expected):
    assert torch.equal(build_mask(4, 12, window_size=2, **kw), _m(expected))


def test_causal_window_is_one_sided_in_both_modes():
    for mode in ("symmetric", "prefix"):
        assert torch.equal(build_mask(4, 12, causal=True, window_size=2, bidirectional_window=mode), _m(CAUSAL_W2))


def test_no_window_masks():
    assert torch.equal(build_mask(3, 5, causal=True), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                                   [1, 1, 1, 1, 1]]).bool())
    assert build_mask(3, 5, causal=False).all()


def test_window_zero_causal_allows_only_self():
    m = build_mask(3, 5, causal=True, window_size=0)
    assert torch.equal(m, torch.eye(5, dtype=torch.bool)[2:])


def test_prefix_window_zero_sees_only_canvas():
    m = build_mask(3, 7, causal=False, window_size=0, bidirectional_window="prefix")
    assert torch.equal(m, torch.tensor([[0, 0, 0, 0, 1, 1, 1]] * 3).bool())


def test_num_causal_q_mixes_commit_rows_and_canvas_rows():
    # 2 causal rows (commit) then 3 bidirectional rows (next canvas) over ctx 2: seq_len 7.
    m = build_mask(5, 7, num_causal_q=2, window_size=None)
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
    ]).bool()
    assert torch.equal(m, expected)
    # prefix mode: the canvas starts after the causal rows (ctx_bi = 4); W = 1 keeps key 3 only before it
    m = build_mask(5, 7, num_causal_q=2, window_size=1, bidirectional_window="prefix")
    assert torch.equal(m[2:], torch.tensor([[0, 0, 0, 1, 1, 1, 1]] * 3).bool())
    assert torch.equal(build_mask(5, 7, num_causal_q=5), build_mask(5, 7, causal=True))
    assert torch.equal(build_mask(5, 7, num_causal_q=0), build_mask(5, 7, causal=False))


def test_count_allowed_pairs_matches_dense_masks():
    q_lens = torch.tensor([4, 0, 1, 5, 3])
    seq_lens = torch.tensor([12, 3, 1, 9, 3])
    ncq = torch.tensor([4, 0, 0, 2, 0])
    for w in (None, 0, 1, 2, 100):
        for mode in ("symmetric", "prefix"):
            dense = sum(int(build_mask(int(q), int(s), num_causal_q=int(n), window_size=w,
                                       bidirectional_window=mode).sum())
                        for q, s, n in zip(q_lens, seq_lens, ncq))
            assert count_allowed_pairs(q_lens, seq_lens, ncq, w, mode) == dense


def _dense_pairs(q_lens, seq_lens, ncq, **kw):
    return sum(int(build_mask(q, s, num_causal_q=n, **kw).sum()) for q, s, n in zip(q_lens, seq_lens, ncq))


def _t(xs):
    return torch.tensor(xs, dtype=torch.int64)


@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
@pytest.mark.parametrize("window_size", [None, 0, 1, 3, 15, 1000])
def test_count_allowed_pairs_mixed_batch_of_prefill_denoise_commit(mode, window_size):
    q_lens, seq_lens = [64, 16, 16, 16, 1, 0], [64, 144, 144, 144, 9, 5]
    ncq = [64, 0, 0, 16, 0, 0]
    kw = dict(window_size=window_size, bidirectional_window=mode)
    assert count_allowed_pairs(_t(q_lens), _t(seq_lens), _t(ncq), **kw) == _dense_pairs(q_lens, seq_lens, ncq, **kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40), st.integers(0, 24)), min_size=1, max_size=5),
       st.one_of(st.none(), st.integers(0, 30)), st.sampled_from(["symmetric", "prefix"]))
def test_count_allowed_pairs_fuzz_num_causal_q(seqs, window_size, mode):
    q_lens = [q for q, _, _ in seqs]
    seq_lens = [q + ctx for q, ctx, _ in seqs]
    ncq = [min(n, q) for q, _, n in seqs]
    kw = dict(window_size=window_size, bidirectional_window=mode)
    assert count_allowed_pairs(_t(q_lens), _t(seq_lens), _t(ncq), **kw) == _dense_pairs(q_lens, seq_lens, ncq, **kw)


def test_batch_key_ranges_rebuild_the_masks():
    q_lens, seq_lens, ncq = [5, 3], [5, 11], [5, 0]
    seq_id, lo, hi = batch_key_ranges(_t(q_lens), _t(seq_lens), _t(ncq), 2)
    assert seq_id.dtype == lo.dtype == hi.dtype == torch.int64 and lo.shape == (8,)
    start = 0
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        k = torch.arange(s)
        m = (k[None] >= lo[start:start + q, None]) & (k[None] <= hi[start:start + q, None])
        assert torch.equal(m, build_mask(q, s, num_causal_q=ncq[b], window_size=2))
        assert bool((seq_id[start:start + q] == b).all())
        start += q


def test_count_allowed_pairs_32k_context_without_dense_mask():
    # 256 bidirectional rows over 32768 + 256 keys, no window: every row sees every key
    assert count_allowed_pairs(_t([256]), _t([33024]), _t([0]), None) == 256 * 33024
    # causal prefill of 16384: triangle
    assert count_allowed_pairs(_t([16384]), _t([16384]), _t([16384]), None) == 16384 * 16385 // 2


def test_batch_key_ranges_rejects_bad_lengths_and_window():
    with pytest.raises(ValueError, match="q_lens <= seq_lens"):
        batch_key_ranges(_t([4]), _t([3]), _t([4]), None)
    with pytest.raises(ValueError, match="equal length"):
        batch_key_ranges(_t([4, 1]), _t([4]), _t([4, 1]), None)
    with pytest.raises(ValueError, match="window_size"):
        batch_key_ranges(_t([4]), _t([4]), _t([4]), -1)
    with pytest.raises(TypeError, match="integer tensor"):
        batch_key_ranges([4], _t([4]), _t([4]), None)


# ---------------------------------------------------------------- numerics


def sdpa_oracle(inp, window_size=None, mode="symmetric", scale=None):
    """Independent check: per sequence, SDPA (math) with the dense mask of build_mask."""
    q, kc, vc, bt = inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"]
    cu = inp["cu_seqlens_q"].tolist()
    outs = []
    H, Hkv = q.shape[1], kc.shape[2]
    P = kc.shape[1]
    for b, (S, c) in enumerate(zip(inp["seq_lens"].tolist(), inp["causal"].tolist())):
        L = cu[b + 1] - cu[b]
        if L == 0:
            continue
        k = kc[bt[b].long()].reshape(-1, Hkv, kc.shape[-1])[:S].double()
        v = vc[bt[b].long()].reshape(-1, Hkv, vc.shape[-1])[:S].double()
        m = build_mask(L, S, causal=c, window_size=window_size, bidirectional_window=mode)
        o = F.scaled_dot_product_attention(
            q[cu[b]:cu[b + 1]].double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=m, enable_gqa=True, scale=scale)
        o = torch.where(m.any(-1)[None, :, None], o, torch.zeros_like(o))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, H, vc.shape[-1]).double()


@pytest.mark.parametrize("window_size", [None, 0, 1, 3, 50])
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_reference_matches_sdpa_on_mixed_paged_batch(window_size, mode):
    inp = make_batch(seq_lens=[9, 13, 6, 1, 5], q_lens=[9, 4, 6, 1, 0], causal=[True, False, True, False, False],
                     dtype=torch.float64)
    out, lse = attention(**inp, window_size=window_size, bidirectional_window=mode, return_lse=True,
                         backend="reference")
    ref = sdpa_oracle(inp, window_size, mode)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(lse).all()


def test_reference_scale_gqa_and_head_dim_v():
    inp = make_batch(seq_lens=[7, 5], q_lens=[3, 5], causal=[False, True], num_heads=6, num_kv_heads=3, head_dim=8,
                     head_dim_v=12, dtype=torch.float64)
    out = attention(**inp, scale=1.0, backend="reference")
    assert out.shape == (8, 6, 12)
    torch.testing.assert_close(out, sdpa_oracle(inp, scale=1.0), rtol=1e-10, atol=1e-10)


def test_head_dim_512_global_layer_shape():
    inp = make_batch(seq_lens=[20], q_lens=[4], causal=[False], num_heads=4, num_kv_heads=1, head_dim=512,
                     dtype=torch.float64)
    out = attention(**inp, scale=1.0, backend="reference")
    torch.testing.assert_close(out, sdpa_oracle(inp, scale=1.0), rtol=1e-10, atol=1e-10)


def test_paged_equals_contiguous_form():
    inp = make_batch(seq_lens=[7, 5, 3], q_lens=[2, 5, 3], causal=[False, True, False], dtype=torch.float64)
    paged = attention(**inp, window_size=2, backend="reference")
    ks, vs = [], []
    for b, S in enumerate(inp["seq_lens"].tolist()):
        kc, vc, bt = inp["k_cache"], inp["v_cache"], inp["block_table"][b].long()
        ks.append(kc[bt].reshape(-1, *kc.shape[2:])[:S])
        vs.append(vc[bt].reshape(-1, *vc.shape[2:])[:S])
    cu_k = torch.tensor([0, 7, 12, 15], dtype=torch.int32)
    contig = attention(inp["q"], torch.cat(ks), torch.cat(vs), cu_seqlens_q=inp["cu_seqlens_q"], cu_seqlens_k=cu_k,
                       causal=inp["causal"], window_size=2, backend="reference")
    torch.testing.assert_close(paged, contig, rtol=0, atol=0)


def test_zero_length_sequences_and_empty_batch():
    inp = make_batch(seq_lens=[0, 4, 0], q_lens=[0, 2, 0], causal=[True, False, False], dtype=torch.float64)
    out, lse = attention(**inp, return_lse=True, backend="reference")
    assert out.shape == (2, 4, 16) and torch.isfinite(out).all()
    empty = make_batch(seq_lens=[], q_lens=[], causal=[], dtype=torch.float64)
    empty["causal"] = torch.zeros(0, dtype=torch.bool)
    assert attention(**empty, backend="reference").shape == (0, 4, 16)


def test_one_token_query_and_row_with_exactly_one_key():
    inp = make_batch(seq_lens=[5], q_lens=[1], causal=[True], dtype=torch.float64)
    out = attention(**inp, window_size=0, backend="reference")
    # the only allowed key is the query's own position 4 -> output = v at position 4 (expanded over GQA)
    v = inp["v_cache"][inp["block_table"][0].long()].reshape(-1, 2, 16)[4]
    torch.testing.assert_close(out[0], v.repeat_interleave(2, dim=0))


def test_row_with_no_allowed_key_is_zero_not_nan():
    # causal rows with a contract-legal but empty interval cannot occur; a bidirectional row over an
    # empty... use num_causal_q-free construction: a prefix canvas row always sees its canvas, so build
    # an empty row via seq_len == q_len == 0 is trivial. Force emptiness through a tiny custom mask check:
    # the public path produces an empty row only when seq_len == 0, so check the softmax guard directly.
    inp = make_batch(seq_lens=[3], q_lens=[3], causal=[True], dtype=torch.float64)
    from blockdiff.attention import reference as R
    orig = R.key_range
    try:
        R.key_range = lambda rows, *a, **k: (torch.full_like(rows, 5), torch.full_like(rows, 4))  # hi < lo
        out, lse = attention_reference(**inp, return_lse=True)
    finally:
        R.key_range = orig
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


# ---------------------------------------------------------------- validation


def _base():
    return make_batch(seq_lens=[6, 4], q_lens=[2, 4], causal=[False, True], dtype=torch.float32)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda d: d.update(cu_seqlens_q=torch.tensor([1, 3, 6], dtype=torch.int32)), ValueError, "start at 0"),
    (lambda d: d.update(cu_seqlens_q=torch.tensor([0, 4, 2], dtype=torch.int32)), ValueError, "non-decreasing"),
    (lambda d: d.update(seq_lens=torch.tensor([1, 4], dtype=torch.int32)), ValueError, "include the query"),
    (lambda d: d.update(q=torch.randn(6, 3, 16)), ValueError, "divisible"),
    (lambda d: d.update(block_table=d["block_table"][:, :1]), ValueError, "too short"),
    (lambda d: d.update(window_size=-1), ValueError, "window_size"),
    (lambda d: d.update(window_size=1.5), TypeError, "window_size"),
    (lambda d: d.update(bidirectional_window="left"), ValueError, "bidirectional_window"),
    (lambda d: d.update(q=d["q"].half()), TypeError, "dtype"),
    (lambda d: d.update(causal=torch.tensor([1, 0])), TypeError, "causal"),
    (lambda d: d.update(causal=torch.tensor([True])), ValueError, "causal"),
    (lambda d: d.update(num_causal_q=torch.tensor([0, 0], dtype=torch.int32)), ValueError, "exactly one"),
    (lambda d: d.update(k_cache=d["k_cache"][..., :8]), ValueError, "head_dim"),
    (lambda d: d.update(q=d["q"][:, :, None]), ValueError, "dimensions"),
    (lambda d: d.update(block_table=d["block_table"] + 100), ValueError, "out of range"),
    (lambda d: d.update(seq_lens=None), ValueError, "seq_lens is required"),
    # empty head dims / no heads: a clear ValueError, not ZeroDivisionError or a reshape error
    (lambda d: d.update(q=d["q"][:, :, :0], k_cache=d["k_cache"][..., :0]), ValueError, "head_dim .* >= 1"),
    (lambda d: d.update(v_cache=d["v_cache"][..., :0]), ValueError, "head_dim_v .* >= 1"),
    (lambda d: d.update(q=d["q"][:, :0]), ValueError, "num_heads .* >= 1"),
    # an out whose rows share memory (expand): triton wrote it silently (last writer wins)
    (lambda d: d.update(out=torch.zeros(1, *d["q"].shape[1:]).expand(d["q"].shape)), ValueError,
     "out must not have elements sharing memory"),
])
def test_bad_input_raises_clear_error(mutate, exc, match):
    d = _base()
    mutate(d)
    with pytest.raises(exc, match=match):
        attention(**d, backend="reference")


def test_unknown_backend_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match="backend"):
        attention(**_base(), backend="fast")


def test_misspelled_keyword_is_an_error_not_ignored():
    with pytest.raises(TypeError, match="windw_size"):
        attention(**_base(), windw_size=2, backend="reference")


def test_non_finite_scale_is_rejected():
    with pytest.raises(ValueError, match="scale must be finite"):
        attention(**_base(), scale=float("nan"), backend="reference")



@pytest.mark.parametrize("q_lens,seq_lens,ncq,exc", [
    ([2], [1], [0], ValueError),  # query longer than its keys: no contract mask to count
    ([-1], [3], [0], ValueError),
    ([2], [4], [3], ValueError),  # num_causal_q > q_len
    ([2, 1], [4], [0, 0], ValueError),  # lengths of different B
    ([2.0], [4.0], [0.0], TypeError),
])
def test_count_allowed_pairs_rejects_lengths_outside_the_contract(q_lens, seq_lens, ncq, exc):
    """Was a silent count of an undefined mask (e.g. 2 pairs for 2 queries over 1 key)."""
    with pytest.raises(exc):
        count_allowed_pairs(torch.tensor(q_lens), torch.tensor(seq_lens), torch.tensor(ncq), None)
    assert count_allowed_pairs(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                               torch.zeros(0, dtype=torch.int32), 3) == 0


@pytest.mark.parametrize("which", ["q_lens", "seq_lens", "num_causal_q"])
def test_count_allowed_pairs_names_the_length_tensor_that_is_not_one_dimensional(which):
    """A 2-D q_lens was reported as "got q_lens (1, 1) vs q_lens (1, 1)" (the equal-length message); now the
    tensor and the rule."""
    lens = {"q_lens": torch.tensor([1]), "seq_lens": torch.tensor([2]), "num_causal_q": torch.tensor([0])}
    lens[which] = lens[which][None]
    with pytest.raises(ValueError, match=rf"^{which} must be 1-D \[B\], got shape \(1, 1\)$"):
        count_allowed_pairs(lens["q_lens"], lens["seq_lens"], lens["num_causal_q"], None)


# ---------------------------------------------------------------- causal flags -> causal row counts


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_causal_row_counts_convert_flags_like_attention_and_check_them_the_same_way(cu_dtype, monkeypatch):
    """causal_row_counts (what the model and bench_attention build once per step) gives int32 row counts for
    int32 and int64 cu_seqlens_q without reading device values, every backend that takes num_causal_q gives the
    causal-flag result with them, and a bad flag tensor raises the error naming ``causal`` that attention()
    raises (the model had cast any dtype to bool and broadcast through torch.where)."""
    import inspect

    from blockdiff.attention import BACKENDS, causal_row_counts, get_backend

    d = _base()
    cu = d["cu_seqlens_q"].to(cu_dtype)

    def boom(*a, **k):
        raise AssertionError("host read of a device tensor")

    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    ncq = causal_row_counts(d["causal"], cu)
    monkeypatch.undo()
    assert ncq.dtype == torch.int32 and ncq.tolist() == [0, 4]
    ref = attention(**d, backend="reference")
    kw = dict(d, cu_seqlens_q=cu)
    kw.pop("causal")
    torch.testing.assert_close(attention(**kw, num_causal_q=ncq, backend="reference"), ref, rtol=0, atol=0)
    for be in BACKENDS:  # every registered backend (the full keyword set: test_backends_contract.py)
        params = inspect.signature(get_backend(be)).parameters
        assert "causal" in params and "num_causal_q" in params, be
    for bad, exc in ((torch.tensor([1, 0]), TypeError), (torch.tensor([0.0, 1.0]), TypeError),
                     (torch.tensor([True]), ValueError), (torch.tensor([True, False, True]), ValueError),
                     (torch.tensor([[True, False]]), ValueError), (torch.tensor(True), ValueError),
                     ([True, False], TypeError)):
        with pytest.raises(exc, match="causal"):
            causal_row_counts(bad, cu)
        with pytest.raises(exc, match="causal"):
            attention(**dict(d, causal=bad), backend="reference")
