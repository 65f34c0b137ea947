"""Triton backend vs the dense reference (attention/testing.py tolerance rule), fuzzed with hypothesis.

On the CPU the kernels run through the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported:
here and in tests/conftest.py, only when CUDA is unavailable) on tiny shapes; ``@pytest.mark.gpu`` tests run
the named workloads' shapes and a CUDA-graph replay on the H200 (``python3 -m pytest -m gpu``).
Every launch writes into an output poisoned with NaN, so an unwritten element fails ``check_close``.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from blockdiff.attention import attention  # noqa: E402
from blockdiff.attention.testing import check_close  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from blockdiff.attention.triton.common import tile_sequence  # noqa: E402
from blockdiff.attention.triton.interface import (  # noqa: E402
    attention_triton, choose_num_splits, default_config,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=16)  # interpreter-sized tiles (tl.dot minimum)


def make_batch(seq_lens, q_lens, *, causal=None, num_causal_q=None, H=4, Hkv=2, D=16, Dv=None, page_size=4,
               dtype=torch.bfloat16, seed=0, paged=True, device=DEV, extra_blocks=1):
    """Random mixed batch; paged with a permuted block table (plus unused blocks) or contiguous varlen."""
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    B = len(seq_lens)
    kw = {}
    if paged:
        blocks = [(s + page_size - 1) // page_size for s in seq_lens]
        nblk = max(1, sum(blocks) + extra_blocks)
        perm = torch.randperm(nblk, generator=g)
        width = max(1, max(blocks, default=1) + 1)
        bt = torch.randint(0, nblk, (B, width), generator=g, dtype=torch.int32)  # garbage beyond the used part
        i = 0
        for b, n in enumerate(blocks):
            bt[b, :n] = perm[i:i + n]
            i += n
        kc = torch.randn(nblk, page_size, Hkv, D, generator=g)
        vc = torch.randn(nblk, page_size, Hkv, Dv, generator=g)
        kw["block_table"] = bt.to(device)
    else:
        total_k = sum(seq_lens) + 3
        kc = torch.randn(total_k, Hkv, D, generator=g)
        vc = torch.randn(total_k, Hkv, Dv, generator=g)
        kw["cu_seqlens_k"] = torch.tensor([0] + torch.tensor(list(seq_lens) or [0]).cumsum(0).tolist()[:B],
                                          dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), H, D, generator=g)
    cu = torch.tensor([0] + (torch.tensor(list(q_lens)).cumsum(0).tolist() if B else []), dtype=torch.int32)
    kw.update(q=q.to(dtype).to(device), k_cache=kc.to(dtype).to(device), v_cache=vc.to(dtype).to(device),
              cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device))
    if num_causal_q is not None:
        kw["num_causal_q"] = torch.tensor(list(num_causal_q), dtype=torch.int32, device=device)
    else:
        kw["causal"] = torch.tensor(list(causal), dtype=torch.bool, device=device)
    return kw


def run_and_check(inp, *, config=None, window_size=None, bidirectional_window="symmetric", scale=None,
                  check_lse=True):
    """Launch into a NaN-poisoned ``out``; compare out and lse with the oracle; return (out, lse)."""
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, window_size=window_size, bidirectional_window=bidirectional_window, scale=scale,
                       out=out, return_lse=True, backend="triton", config=config)
    assert o.data_ptr() == out.data_ptr()
    check_close(o.cpu(), **{k: v.cpu() for k, v in inp.items()}, lse=lse.cpu() if check_lse else None,
                window_size=window_size, bidirectional_window=bidirectional_window, scale=scale)
    return o, lse


MIXED = dict(seq_lens=[9, 13, 6, 1, 5, 30], q_lens=[9, 4, 6, 1, 0, 12],
             causal=[True, False, True, False, False, False])


@pytest.mark.parametrize("window_size", [None, 0, 1, 7, 100])
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_mixed_prefill_denoise_commit_batch_in_one_launch(window_size, mode):
    inp = make_batch(**MIXED)
    run_and_check(inp, config=SMALL, window_size=window_size, bidirectional_window=mode)


@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_num_causal_q_mixes_causal_and_bidirectional_rows_in_one_tile(mode):
    # commit rows then the next canvas in one sequence, tiles straddle the boundary
    inp = make_batch(seq_lens=[20, 17, 9], q_lens=[11, 9, 9], num_causal_q=[5, 9, 0], H=4, Hkv=1)
    for w in (None, 2, 6):
        run_and_check(inp, config=dict(BLOCK_M=16, BLOCK_N=16), window_size=w, bidirectional_window=mode)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_any_split_count_equals_one_split(num_splits):
    inp = make_batch(seq_lens=[40, 7], q_lens=[6, 7], causal=[False, True], H=4, Hkv=1, page_size=8)
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
    inp = make_batch(seq_lens=[12, 9], q_lens=[5, 9], causal=[False, True], H=H, Hkv=Hkv)
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
    inp = make_batch(seq_lens=[14, 6], q_lens=[4, 6], causal=[False, True], D=24, Dv=40, H=4, Hkv=2)
    run_and_check(inp, config=SMALL, scale=1.0, window_size=3)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16), scale=0.3)  # V head dim split over programs


@pytest.mark.parametrize("scale", [None, 6.0, -3.0])
def test_lazy_rescaling_matches_reference(scale):
    # large |scale| makes row maxima jump by more than 2^8 between key blocks (the rescale branch)
    inp = make_batch(seq_lens=[40, 13, 30], q_lens=[9, 13, 30], num_causal_q=[0, 13, 11], H=4, Hkv=2)
    for w in (None, 5):
        run_and_check(inp, config=dict(SMALL, LAZY_RESCALE=True), scale=scale, window_size=w)
    run_and_check(inp, config=dict(SMALL, LAZY_RESCALE=True, num_splits=3), scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_zero_and_negative_scale(scale):
    inp = make_batch(**MIXED)
    run_and_check(inp, config=SMALL, scale=scale, window_size=3)


def test_v_head_dim_split_across_programs():
    inp = make_batch(seq_lens=[19, 8], q_lens=[7, 8], causal=[False, True], D=32, Dv=64, H=4, Hkv=1)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=32))
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16, num_splits=2), window_size=4)


def test_default_configs_and_larger_tiles():
    inp = make_batch(seq_lens=[70, 33], q_lens=[40, 33], causal=[False, True], H=2, Hkv=1, page_size=16)
    run_and_check(inp)  # interpreter defaults
    run_and_check(inp, config=dict(BLOCK_M=32, BLOCK_N=32), window_size=20)
    run_and_check(inp, config=dict(BLOCK_M=64, BLOCK_N=16, num_splits=2))


def test_int64_metadata_is_accepted():
    inp = make_batch(**MIXED)
    inp = {k: (v.to(torch.int64) if k in ("cu_seqlens_q", "block_table") else v) for k, v in inp.items()}
    run_and_check(inp, config=SMALL, window_size=3)


def _strided(t):
    """The same values as a non-contiguous view (every other element of a twice-as-long buffer)."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    buf = torch.zeros(t.shape[0] * 2, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seq_lens", "block_table", "num_causal_q", "cu_seqlens_k"])
def test_non_contiguous_metadata_is_read_by_value_not_by_layout(name):
    """Strided metadata views (cu_seqlens_q, seq_lens, num_causal_q, a column-major block_table,
    cu_seqlens_k) give the same result as dense ones (the kernel indexed them as dense arrays)."""
    kw = dict(MIXED)
    if name == "num_causal_q":
        kw.pop("causal")
        kw["num_causal_q"] = [9, 0, 3, 1, 0, 5]
    inp = make_batch(**kw, paged=name != "cu_seqlens_k")
    inp[name] = _strided(inp[name])
    assert not inp[name].is_contiguous()
    run_and_check(inp, config=SMALL, window_size=3)


@pytest.mark.parametrize("config", [dict(SMALL, BLOCK_DV=16), dict(SMALL, num_splits=2), SMALL])
def test_out_aliasing_q_gives_the_unaliased_result(config):
    """out=q (or any out overlapping an input): V head-dim slices re-read Q after another slice wrote out."""
    inp = make_batch(**MIXED, D=32)
    ref = attention_triton(**inp, config=config, window_size=3)
    o = attention_triton(**inp, config=config, window_size=3, out=inp["q"])
    assert o.data_ptr() == inp["q"].data_ptr()
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_out_with_rows_sharing_memory_is_rejected():
    """An expand()ed out (every row the same memory) was silently written by all rows (last writer wins)."""
    inp = make_batch(**MIXED)
    out = torch.zeros(1, 4, 16, dtype=inp["q"].dtype, device=inp["q"].device).expand(inp["q"].shape[0], 4, 16)
    with pytest.raises(ValueError, match="out must not have elements sharing memory"):
        attention_triton(**inp, config=SMALL, out=out)


def test_out_views_are_written_in_place():
    inp = make_batch(**MIXED)
    total_q = inp["q"].shape[0]
    ref = attention_triton(**inp, config=SMALL, window_size=3)
    big = torch.full((total_q, 4, 40), float("nan"), dtype=ref.dtype, device=ref.device)
    view = big[:, :, 8:24]  # strided rows, unit last stride
    attention_triton(**inp, config=SMALL, window_size=3, out=view)
    torch.testing.assert_close(view, ref, rtol=0, atol=0)
    assert torch.isnan(big[:, :, :8]).all() and torch.isnan(big[:, :, 24:]).all()
    tr = torch.full((16, 4, total_q), float("nan"), dtype=ref.dtype, device=ref.device).permute(2, 1, 0)
    attention_triton(**inp, config=SMALL, window_size=3, out=tr)  # non-unit last stride: written via a copy
    torch.testing.assert_close(tr, ref, rtol=0, atol=0)


def test_no_host_reads_when_check_values_is_false(monkeypatch):
    """The launch path (check_values=False, as under CUDA-graph capture) never reads device values."""
    inp = make_batch(**MIXED)
    ref = attention_triton(**inp, config=SMALL, window_size=3)

    def boom(*a, **k):
        raise AssertionError("host read of a device tensor on the launch path")

    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    out = attention_triton(**inp, config=SMALL, window_size=3, check_values=False, max_seqlen_k=30)
    again = attention_triton(**inp, config=SMALL, window_size=3, check_values=False, max_seqlen_k=30)  # planned
    monkeypatch.undo()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


def _plans():
    from blockdiff.attention.triton import interface as ta
    return ta.PLANS


def test_launch_plan_is_reused_across_new_values_and_matches_the_full_path():
    """check_values=False plans a call once per key (shapes, strides, dtypes, alignment, host scalars, config);
    later calls with new lengths, flags, block tables and K / V values reuse it and equal the full path."""
    _plans().clear()
    first = make_batch(**MIXED, seed=1)
    attention_triton(**first, config=SMALL, window_size=3, check_values=False)
    assert len(_plans()) == 1
    plan = next(iter(_plans().values()))
    for seed, causal in ((2, [False] * 6), (3, [True] * 6)):
        inp = make_batch(seq_lens=[9, 10, 6, 1, 7, 12], q_lens=[9, 4, 6, 1, 0, 12], causal=causal, seed=seed)
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
        o, lse = attention_triton(**inp, config=SMALL, window_size=3, check_values=False, out=out, return_lse=True)
        ref, ref_lse = attention_triton(**inp, config=SMALL, window_size=3, return_lse=True)  # full path
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
        check_close(o, **inp, lse=lse, window_size=3)
    assert next(iter(_plans().values())) is plan  # (out / return_lse gave their own keys)


def test_launch_plan_key_separates_what_the_plan_depends_on():
    """Every input the plan is computed from gives its own plan: window, scale (and its type), lse, config,
    max_seqlen_k, an out that aliases q, and a q view whose address is not 16-byte aligned."""
    _plans().clear()
    inp = make_batch(**MIXED)
    base = dict(config=SMALL, window_size=3, check_values=False)
    variants = [{}, dict(window_size=4), dict(window_size=None), dict(scale=0.5), dict(scale=1), dict(scale=1.0),
                dict(return_lse=True), dict(config=dict(SMALL, num_splits=2)), dict(max_seqlen_k=64),
                dict(bidirectional_window="prefix")]
    for v in variants:
        attention_triton(**inp, **dict(base, **v))
    assert len(_plans()) == len(variants)
    # out aliasing q: the kernel writes a private buffer (a plan of its own), result as if unaliased
    ref = attention_triton(**inp, **base)
    q2 = inp["q"].clone()
    o = attention_triton(**dict(inp, q=q2), **base, out=q2)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    assert len(_plans()) == len(variants) + 1
    # a q view one element into a buffer: same shape / strides / dtype, 2-byte aligned address
    buf = torch.empty(inp["q"].numel() + 1, dtype=inp["q"].dtype, device=inp["q"].device)
    qv = buf[1:].view(inp["q"].shape)
    qv.copy_(inp["q"])
    assert qv.data_ptr() % 16 and qv.stride() == inp["q"].stride()
    torch.testing.assert_close(attention_triton(**dict(inp, q=qv), **base), ref, rtol=0, atol=0)
    assert len(_plans()) == len(variants) + 2


def test_launch_plans_switched_off_store_nothing_and_give_the_same_result(monkeypatch):
    """``PLANS_ENABLED = False`` (the probes' A/B switch): every call takes the full path, no plan is stored."""
    from blockdiff.attention.triton import interface as ta
    _plans().clear()
    inp = make_batch(**MIXED)
    planned = [attention_triton(**inp, config=SMALL, window_size=3, check_values=False) for _ in range(2)]
    monkeypatch.setattr(ta, "PLANS_ENABLED", False)
    _plans().clear()
    full = attention_triton(**inp, config=SMALL, window_size=3, check_values=False)
    assert not _plans()
    torch.testing.assert_close(full, planned[1], rtol=0, atol=0)


def test_planned_launch_grids_have_three_dimensions_for_the_compiled_launcher():
    """A compiled kernel's launcher reads grid[0..2] (the merge's grid is one-dimensional: an IndexError on the
    H200 before this was normalised)."""
    from blockdiff.attention.triton.common import _merge_kernel
    from blockdiff.attention.triton.plans import Launch
    assert Launch(_merge_kernel, (7,), {}).grid == (7, 1, 1)
    assert Launch(_merge_kernel, (7, 2), {}).grid == (7, 2, 1)
    assert Launch(_merge_kernel, (7, 2, 3), {}).grid == (7, 2, 3)


def test_max_seqlen_k_that_is_not_a_python_int_is_never_planned():
    """A 0-d tensor max_seqlen_k changed in place must not keep a stale split count (review finding): only a
    Python int enters a plan key; anything else takes the full path, which reads its value."""
    from blockdiff.attention.triton import interface as ta
    _plans().clear()
    inp = make_batch(seq_lens=[600], q_lens=[8], causal=[False], page_size=16)
    m = torch.tensor(16)
    attention_triton(**inp, config=SMALL, check_values=False, max_seqlen_k=m)
    assert ta.LAST_LAUNCH["num_splits"] == 1 and not _plans()
    m.fill_(600)
    o = attention_triton(**inp, config=SMALL, check_values=False, max_seqlen_k=m)
    ns = ta.LAST_LAUNCH["num_splits"]
    ref = attention_triton(**inp, config=SMALL, max_seqlen_k=600)
    assert ns == ta.LAST_LAUNCH["num_splits"] > 1
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_mutating_last_launch_config_changes_no_later_call():
    """LAST_LAUNCH["config"] is a copy: editing it changes neither planned calls nor the full path's cached
    resolved config (review finding: the two paths disagreed)."""
    from blockdiff.attention.triton import interface as ta
    _plans().clear()
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=SMALL, check_values=False)
    ta.LAST_LAUNCH["config"]["num_splits"] = 3
    attention_triton(**inp, config=SMALL, check_values=False)
    assert ta.LAST_LAUNCH["num_splits"] == 1
    attention_triton(**inp, config=SMALL)
    assert ta.LAST_LAUNCH["num_splits"] == 1


def test_config_cache_tells_numpy_bool_from_bool():
    """The resolved-config cache keys on the value's type, not its name: numpy's bool_ is named "bool", and a
    cached {BT_PREFETCH: True} let {BT_PREFETCH: np.True_} skip the bool check (review finding)."""
    np = pytest.importorskip("numpy")
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=dict(SMALL, BT_PREFETCH=True))
    with pytest.raises(ValueError, match="BT_PREFETCH"):
        attention_triton(**inp, config=dict(SMALL, BT_PREFETCH=np.True_))


def test_launch_plans_never_skip_value_checks_or_type_errors():
    """A plan exists for a shape, yet bad values still raise where values are checked (check_values default),
    and bad types raise the full path's TypeError under check_values=False (no key is formed)."""
    _plans().clear()
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=SMALL, check_values=False)
    bad = dict(inp, seq_lens=inp["seq_lens"] - 1)
    with pytest.raises(ValueError, match="include the query"):
        attention_triton(**bad, config=SMALL)
    with pytest.raises(TypeError, match="causal"):
        attention_triton(**dict(inp, causal=inp["causal"].to(torch.int32)), config=SMALL, check_values=False)
    with pytest.raises(TypeError, match="config must be a dict"):
        attention_triton(**inp, config=[("BLOCK_M", 16)], check_values=False)
    with pytest.raises(TypeError, match="scale"):
        attention_triton(**inp, config=SMALL, scale=True, check_values=False)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        attention_triton(**dict(inp, seq_lens=[9, 13, 6, 1, 5, 30]), config=SMALL, check_values=False)


def test_bad_config_and_dtype_raise_clear_errors():
    inp = make_batch(**MIXED)
    with pytest.raises(ValueError, match="BLOCK_N"):
        attention_triton(**inp, config=dict(BLOCK_N=8))
    with pytest.raises(ValueError, match="unknown keys"):
        attention_triton(**inp, config=dict(BLOCK_K=16))
    with pytest.raises(ValueError, match="num_splits"):
        attention_triton(**inp, config=dict(num_splits=0))
    with pytest.raises(ValueError, match="LAZY_RESCALE"):
        attention_triton(**inp, config=dict(LAZY_RESCALE=1))
    with pytest.raises(ValueError, match="BLOCK_M"):
        attention_triton(**make_batch(**MIXED, H=32, Hkv=1), config=dict(BLOCK_M=16))
    with pytest.raises(TypeError, match="q must be"):
        attention_triton(**make_batch(**MIXED, dtype=torch.float64))
    with pytest.raises(ValueError, match="include the query"):
        bad = make_batch(**MIXED)
        bad["seq_lens"] = bad["seq_lens"] - 1
        attention_triton(**bad)


def test_split_heuristic_uses_only_host_shapes():
    assert choose_num_splits(40, 33000, 64, 132) > 1  # one canvas over 32k: split
    assert choose_num_splits(400, 33000, 64, 132) == 1  # enough programs
    assert choose_num_splits(10, 100, 64, 132) == 1  # too few keys to split
    # resident programs per SM: 64 programs of 4 warps fill 128 of 264 slots -> 4 splits (one wave of 2 per SM)
    assert choose_num_splits(64, 33000, 64, 132, ctas=2) == 4
    assert choose_num_splits(64, 33000, 64, 132, ctas=1) == 2
    assert choose_num_splits(256, 4096, 64, 132, ctas=2) == 1  # canvas_bs4_ctx4k_hd128: a full wave already


def test_resident_programs_per_sm_estimate():
    """Registers (~255 per thread: 8 // num_warps programs) and shared memory (Q + stages x (K + V)) bound it."""
    from blockdiff.attention.triton.interface import ctas_per_sm

    assert ctas_per_sm(64, 64, 4, 3, 128, 128, 2) == 2     # 112 KB, 4 warps
    assert ctas_per_sm(128, 64, 8, 2, 256, 256, 2) == 1    # 8 warps
    assert ctas_per_sm(64, 64, 4, 2, 256, 256, 2) == 1     # 160 KB of shared memory
    assert ctas_per_sm(16, 16, 1, 1, 16, 16, 4) == 8
    cfg = default_config(512, 512, 8, torch.bfloat16)
    assert cfg["BLOCK_M"] >= 8 and cfg["BLOCK_DV"] == 512


def test_resident_program_estimate_sees_the_kernels_tile_widths(monkeypatch):
    """The split count's shared-memory estimate is given the widths the kernel's tiles have: the head dim padded
    to a power of two (24 -> 32) and the V slice of one program (BLOCK_DV 16 of head_dim_v 40), not the raw
    head dims (which under-count padded tiles and over-count V-sliced ones)."""
    from blockdiff.attention.triton import config

    seen = []
    real = config.ctas_per_sm
    monkeypatch.setattr(config, "ctas_per_sm", lambda *a: seen.append(a) or real(*a))
    inp = make_batch(seq_lens=[14, 6], q_lens=[4, 6], causal=[False, True], D=24, Dv=40, H=4, Hkv=2)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16), window_size=3)
    assert seen and all(a[4:6] == (32, 16) for a in seen), seen


def test_many_short_sequences_do_not_split_a_full_grid():
    """The automatic split count counts every non-empty sequence as at least one q tile: 150 one-token rows with a
    4096-key capacity are 150 tiles x 2 KV heads = 300 programs (more than 264 slots: no split); estimating
    cdiv(150, BLOCK_Q) = 19 tiles split them 6 ways."""
    from blockdiff.attention.triton import interface as ta

    n = 150
    inp = make_batch(seq_lens=[40] * n, q_lens=[1] * n, causal=[False] * n, H=4, Hkv=2, D=16, page_size=16)
    bt = inp["block_table"]   # a block table of 256 pages per row (capacity 4096 keys, as a serving cache has)
    inp["block_table"] = torch.cat([bt, torch.zeros(bt.shape[0], 256 - bt.shape[1], dtype=bt.dtype,
                                                    device=bt.device)], 1)
    run_and_check(inp, config=SMALL)
    assert ta.LAST_LAUNCH["num_splits"] == 1
    one = make_batch(seq_lens=[2000], q_lens=[16], causal=[False], H=4, Hkv=2, D=16, page_size=16)
    run_and_check(one, config=SMALL)                      # one sequence over a long context still splits
    assert ta.LAST_LAUNCH["num_splits"] > 1


def test_causal_flags_reach_the_kernel_without_a_conversion_op(monkeypatch):
    """``causal`` [B] bool is read by the kernel itself (q_len if set, else 0): no num_causal_q conversion op per
    call; the result equals the reference (which converts) and the num_causal_q form."""
    from blockdiff.attention import validate

    inp = make_batch(seq_lens=[20, 17, 9, 0], q_lens=[11, 9, 9, 0], causal=[True, False, True, False], H=4, Hkv=2)
    ncq = validate.causal_row_counts(inp["causal"], inp["cu_seqlens_q"])

    def forbidden(*a, **k):
        raise AssertionError("the Triton backend converted causal flags to num_causal_q")

    monkeypatch.setattr(validate, "causal_row_counts", forbidden)
    out = attention(**inp, backend="triton", config=SMALL)
    monkeypatch.undo()
    check_close(out, **inp)
    by_count = dict(inp, num_causal_q=ncq)
    del by_count["causal"]
    torch.testing.assert_close(attention(**by_count, backend="triton", config=SMALL), out, rtol=0, atol=0)


@triton.jit
def _tile_search_probe(CU_Q, OUT, num_seqs, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    t = tl.program_id(0)
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, tl.arange(0, 16), BLOCK_Q, SEARCH_STEPS)
    tl.store(OUT + 2 * t, b)
    tl.store(OUT + 2 * t + 1, tile)


@pytest.mark.parametrize("num_seqs", [1, 2, 15, 16, 17, 255, 256, 300])
def test_tile_to_sequence_search_finds_every_tile_across_16_ary_search_steps(num_seqs):
    """The 16-ary tile -> sequence search (one step per 4 bits of the batch size) against a Python scan, with
    empty sequences and sequences of one tile and of several."""
    g = torch.Generator().manual_seed(num_seqs)
    q_lens = torch.randint(0, 40, (num_seqs,), generator=g)
    q_lens[::7] = 0
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    BQ = 8
    n_tiles = int(cu[-1]) // BQ + num_seqs
    out = torch.full((n_tiles, 2), -7, dtype=torch.int32)
    steps = -(-max(1, num_seqs.bit_length()) // 4)
    _tile_search_probe[(n_tiles,)](cu, out, num_seqs, BLOCK_Q=BQ, SEARCH_STEPS=steps)
    starts = [int(cu[b]) // BQ + b for b in range(num_seqs)]
    for t in range(n_tiles):
        b = max(i for i in range(num_seqs) if starts[i] <= t)
        assert out[t].tolist() == [b, t - starts[b]], t


def test_num_splits_beyond_the_grid_limit_is_a_clear_error():
    """num_splits is the launch grid's third dimension (CUDA: <= 65535): more is a ValueError naming it, not a
    launch failure after allocating num_splits x total_q x H x head_dim_v fp32 partials."""
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16)
    with pytest.raises(ValueError, match=r"num_splits.*65535"):
        attention_triton(**inp, config=dict(SMALL, num_splits=65536))


def test_split_regime_uses_its_tuned_tiles_only_when_the_base_tiles_would_split():
    """A kernel with split-regime tiles (TUNED_SPLIT_CONFIGS; here set on an interpreter kernel) uses them for a
    few q tiles over a long context and keeps the base tiles otherwise or when the caller pins tiles; results
    equal the oracle either way."""
    from blockdiff.attention.triton import interface as ta

    inp = make_batch(seq_lens=[600], q_lens=[8], causal=[False], H=4, Hkv=2, D=16, page_size=16)
    kern = ta.get_kernel(16, 16, 2, torch.bfloat16, True, 16, False, False)
    split_tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    old = kern.split_base
    kern.split_base = split_tiles
    try:
        run_and_check(inp)
        assert {k: ta.LAST_LAUNCH["config"][k] for k in split_tiles} == split_tiles
        assert ta.LAST_LAUNCH["num_splits"] > 1
        run_and_check(inp, config=dict(BLOCK_M=16, BLOCK_N=16))          # pinned tiles win
        assert ta.LAST_LAUNCH["config"]["BLOCK_M"] == 16
        many = make_batch(seq_lens=[20] * 40, q_lens=[20] * 40, causal=[True] * 40, H=4, Hkv=2, D=16,
                          page_size=16)
        run_and_check(many)                                               # enough programs: no split, base tiles
        assert ta.LAST_LAUNCH["num_splits"] == 1 and ta.LAST_LAUNCH["config"]["BLOCK_N"] == kern.base["BLOCK_N"]
    finally:
        kern.split_base = old



def _merge_oracle(opart, lsepart):
    """out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s (rows whose splits are all empty: 0, -inf)."""
    lse = torch.logsumexp(lsepart, 0)                                     # [H, T]
    w = torch.exp(lsepart - torch.where(torch.isinf(lse), 0.0, lse))     # [S, H, T]; 0 for empty splits
    return (opart * w.permute(0, 2, 1)[..., None]).sum(0), lse


@pytest.mark.parametrize("ns,T,H,DV,dtype", [(3, 7, 3, 40, torch.float32), (64, 5, 2, 24, torch.bfloat16),
                                              (2, 33, 1, 16, torch.float16), (5, 3, 1, 600, torch.float32)])
def test_split_merge_equals_a_logsumexp_merge_of_the_partials(ns, T, H, DV, dtype):
    """The split-KV merge (BLOCK_R rows per program, two passes over the splits) against torch.logsumexp: empty
    splits (lse -inf, o 0), rows empty in every split (out 0, lse -inf), a row count that is not a multiple of
    BLOCK_R, head_dim_v not a power of two, an out view with strided rows (columns around it stay untouched)."""
    import triton

    from blockdiff.attention.triton.common import _merge_kernel
    from blockdiff.attention.triton.config import merge_constexprs

    g = torch.Generator().manual_seed(ns * 1000 + DV)
    opart = torch.randn(ns, T, H, DV, generator=g)
    lsepart = torch.randn(ns, H, T, generator=g) * 4
    empty = torch.rand(ns, H, T, generator=g) < 0.4
    empty[:, 0, T - 1] = True                                             # a row with no key in any split
    lsepart[empty] = float("-inf")
    opart[empty.permute(0, 2, 1)] = 0.0
    big = torch.full((T, H, DV + 9), float("nan"), dtype=dtype)
    out = big[:, :, 3:3 + DV]
    lse = torch.full((H, T), float("nan"))
    consts = merge_constexprs(ns, DV, store_lse=True, pdl=False, interpret=True)  # as attention_triton launches it
    block_r = consts["BLOCK_R"]
    assert (T * H) % block_r != 0
    _merge_kernel[(triton.cdiv(T * H, block_r),)](
        opart, lsepart, out, lse, T, H, T * H, out.stride(0), out.stride(1), **consts)
    ref_o, ref_lse = _merge_oracle(opart, lsepart)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref_o, rtol=tol, atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], rtol=0, atol=1e-5)
    assert (out[T - 1, 0] == 0).all()
    assert torch.isnan(big[:, :, :3]).all() and torch.isnan(big[:, :, 3 + DV:]).all()


@pytest.mark.parametrize("page_size,num_splits,window,mode", [(3, 64, None, "symmetric"), (5, 7, 4, "prefix"),
                                                             (1, 4, 4, "symmetric")])
def test_split_counts_up_to_64_equal_one_split_for_odd_head_dim_v_into_a_strided_out(page_size, num_splits,
                                                                                     window, mode):
    """End to end through the merge: head_dim_v 40 (not a power of two), GQA 3, (token, head) rows not a multiple
    of the merge's BLOCK_R, pages not dividing BLOCK_N (the vector block-table prefetch), windows in both modes,
    return_lse, and an out view with strided rows; equal to num_splits=1 and to the oracle."""
    inp = make_batch(seq_lens=[61, 0, 9, 23], q_lens=[5, 0, 9, 3], num_causal_q=[2, 0, 9, 0], H=3, Hkv=1, D=24,
                     Dv=40, page_size=page_size, seed=page_size)
    kw = dict(window_size=window, bidirectional_window=mode)
    one, lse1 = attention_triton(**inp, config=dict(SMALL, num_splits=1), return_lse=True, **kw)
    total_q = one.shape[0]
    big = torch.full((total_q, 3, 56), float("nan"), dtype=one.dtype, device=one.device)
    view = big[:, :, 8:48]
    many, lsen = attention_triton(**inp, config=dict(SMALL, num_splits=num_splits), out=view, return_lse=True, **kw)
    from blockdiff.attention.triton.interface import LAST_LAUNCH

    assert many.data_ptr() == view.data_ptr() and LAST_LAUNCH["num_splits"] == num_splits
    assert torch.isnan(big[:, :, :8]).all() and torch.isnan(big[:, :, 48:]).all()
    check_close(many.cpu(), **{k: v.cpu() for k, v in inp.items()}, lse=lsen.cpu(), **kw)
    torch.testing.assert_close(many.float(), one.float(), rtol=0, atol=2 ** -7)
    torch.testing.assert_close(lsen, lse1, rtol=0, atol=1e-5)

# ---------------------------------------------------------------- fuzzing


@st.composite
def batches(draw):
    B = draw(st.integers(0, 4))
    q_lens, seq_lens, ncq = [], [], []
    for _ in range(B):
        ql = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 17]))
        ctx = draw(st.sampled_from([0, 1, 2, 4, 9, 16, 23]))
        q_lens.append(ql)
        seq_lens.append(ql + ctx)
        kind = draw(st.sampled_from(["causal", "bidir", "mixed"]))
        ncq.append(ql if kind == "causal" else 0 if kind == "bidir" else draw(st.integers(0, ql)))
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(
        seq_lens=seq_lens, q_lens=q_lens, num_causal_q=ncq, H=Hkv * group, Hkv=Hkv,
        D=draw(st.sampled_from([16, 32])), page_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        paged=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
    ), dict(
        window_size=draw(st.sampled_from([None, 0, 1, 2, 3, 5, 8, 16, 40])),
        bidirectional_window=draw(st.sampled_from(["symmetric", "prefix"])),
        config=dict(BLOCK_M=max(16, group) * draw(st.sampled_from([1, 2])),
                    BLOCK_N=draw(st.sampled_from([16, 32])),
                    num_splits=draw(st.sampled_from([None, 1, 2, 3])),
                    LAZY_RESCALE=draw(st.booleans()), BT_PREFETCH=draw(st.booleans())),
    )


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_fuzz_against_reference(case):
    make_kw, call_kw = case
    inp = make_batch(**make_kw)
    run_and_check(inp, **call_kw)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(0, 2 ** 16))
def test_fuzz_planned_calls_equal_the_full_path(case, seed2):
    """Random batches: a second call with the same shapes and new values (K / V / q, block table permutation,
    causal row counts) reuses the first call's plan and gives bitwise the full path's out and lse."""
    from blockdiff.attention.triton import interface as ta
    make_kw, call_kw = case
    ta.PLANS.clear()
    attention_triton(**make_batch(**make_kw), **call_kw, check_values=False, return_lse=True)
    g = torch.Generator().manual_seed(seed2)
    ncq = [int(torch.randint(0, ql + 1, (1,), generator=g)) for ql in make_kw["q_lens"]]
    inp = make_batch(**dict(make_kw, seed=seed2, num_causal_q=ncq))
    plans = dict(ta.PLANS)
    o, lse = attention_triton(**inp, **call_kw, check_values=False, return_lse=True)
    assert ta.PLANS == plans  # reused, no new plan
    ref, ref_lse = attention_triton(**inp, **call_kw, return_lse=True)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


# ---------------------------------------------------------------- GPU (H200)


def _named(name, dtype=torch.bfloat16, page_size=64, seed=0):
    """A named workload of ARCHITECTURE.md as a batch on the GPU."""
    layers = {"sliding": (16, 8, 256, 1023, "symmetric"), "sliding_prefix": (16, 8, 256, 1023, "prefix"),
              "global": (16, 2, 512, None, "symmetric"), "hd128": (16, 8, 128, None, "symmetric")}
    mixed = ([4096, 256, 256, 256], [4096, 8448, 8448, 8448], [True, False, False, True])
    shapes = {
        "mixed_sliding_ctx8k": ("sliding", mixed), "mixed_sliding_prefix_ctx8k": ("sliding_prefix", mixed),
        "mixed_global_ctx8k": ("global", mixed),
        "canvas_bs1_ctx32k_global": ("global", ([256], [33024], [False])),
        "canvas_bs1_ctx32k_sliding": ("sliding", ([256], [33024], [False])),
        "canvas_bs1_ctx32k_hd128": ("hd128", ([256], [33024], [False])),
        "canvas_bs4_ctx4k_hd128": ("hd128", ([256] * 4, [4352] * 4, [False] * 4)),
        "prefill16k_hd128": ("hd128", ([16384], [16384], [True])),
    }
    layer, (ql, sl, c) = shapes[name]
    H, Hkv, D, W, mode = layers[layer]
    inp = make_batch(sl, ql, causal=c, H=H, Hkv=Hkv, D=D, page_size=page_size, dtype=dtype, seed=seed,
                     device="cuda")
    return inp, dict(window_size=W, bidirectional_window=mode, scale=1.0 if D == 512 else None)


NAMED = ["mixed_sliding_ctx8k", "mixed_sliding_prefix_ctx8k", "mixed_global_ctx8k", "canvas_bs1_ctx32k_global",
         "canvas_bs1_ctx32k_sliding", "canvas_bs1_ctx32k_hd128", "canvas_bs4_ctx4k_hd128", "prefill16k_hd128"]


def _check_gpu(inp, tail=None, **kw):
    """Kernel on the whole batch (NaN-poisoned out) vs the fp64 oracle; with ``tail``, the oracle runs on the
    last ``tail`` query rows of each sequence only (same keys, rows and flags: valid for causal sequences and
    the symmetric window; keeps the dense fp64 reference of a 16k prefill in memory)."""
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="triton", **kw)
    kw.pop("config", None)
    if tail is None:
        return check_close(o, **inp, lse=lse, **kw)
    assert kw.get("bidirectional_window", "symmetric") == "symmetric" or bool(inp["causal"].all())
    cu = inp["cu_seqlens_q"].tolist()
    rows = torch.cat([torch.arange(max(cu[b], cu[b + 1] - tail), cu[b + 1]) for b in range(len(cu) - 1)])
    lens = [min(tail, cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    sub = dict(inp, q=q[rows.to(q.device)],
               cu_seqlens_q=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                                         device=q.device),
               causal=inp["causal"])
    return check_close(o[rows.to(q.device)], **sub, lse=lse[:, rows.to(q.device)], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMED)
def test_gpu_named_workloads_bf16(name):
    inp, kw = _named(name)
    _check_gpu(inp, tail=2048 if name.startswith("prefill") else None, **kw)


GPU_BATCH = ([1500, 700, 333, 9], [700, 256, 0, 9], [700, 0, 0, 4])  # seq_lens, q_lens, num_causal_q
GPU_HEADS = {64: (8, 8), 128: (16, 8), 256: (16, 8), 512: (16, 2)}


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims_and_dtypes(D, dtype):
    H, Hkv = GPU_HEADS[D]
    sl, ql, ncq = GPU_BATCH
    inp = make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, dtype=dtype, page_size=64, device="cuda", seed=D)
    _check_gpu(inp)
    _check_gpu(inp, window_size=127)


@pytest.mark.gpu
@pytest.mark.parametrize("D,config", [(128, None), (256, None), (512, None), (512, {"OVERLAP": False}),
                                      (256, {"IMPL": "triton"}), (128, {"num_splits": 3}),
                                      (256, {"num_splits": 2})])
def test_gpu_planned_calls_launch_the_compiled_kernels_and_match_the_reference(D, config):
    """With check_values=False the first call plans and compiles; the later ones (same shapes, new values,
    causal row counts and block tables) launch the compiled kernels directly, and each matches the oracle."""
    from blockdiff.attention.triton import interface as ta
    ta.PLANS.clear()
    H, Hkv = GPU_HEADS[D]
    sl, ql, _ = GPU_BATCH
    for seed, ncq in enumerate(([700, 0, 0, 4], [0, 256, 0, 9], [700, 256, 0, 0])):
        inp = make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=64, device="cuda", seed=seed)
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], H, vc.shape[-1]), float("nan"), dtype=q.dtype, device="cuda")
        o, lse = attention_triton(**inp, out=out, return_lse=True, check_values=False, window_size=127,
                                  config=config)
        check_close(o, **inp, lse=lse, window_size=127)
    (plan,) = ta.PLANS.values()
    assert plan.main.compiled is not None and ta.LAST_LAUNCH["kernel"] is plan.main.compiled
    assert (plan.merge is None) == (plan.num_splits == 1)
    assert plan.merge is None or plan.merge.compiled is not None


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_gpu_prefix_window_and_split(D):
    H, Hkv = GPU_HEADS[D]
    sl, ql, ncq = GPU_BATCH
    inp = make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=16, device="cuda", seed=D)
    _check_gpu(inp, window_size=127, bidirectional_window="prefix")
    _check_gpu(inp, window_size=100, config=dict(num_splits=4))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 128, 256])
def test_gpu_page_sizes_and_splits(page_size):
    inp = make_batch([5000, 300], [256, 300], causal=[False, True], H=16, Hkv=8, D=128, page_size=page_size,
                     device="cuda")
    for ns in (1, 3, 8):
        _check_gpu(inp, window_size=1023, config=dict(num_splits=ns))
    _check_gpu(inp)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_gpu_config_grid_is_correct(D):
    H, Hkv = GPU_HEADS[D]
    inp = make_batch([2000, 600], [512, 600], num_causal_q=[100, 600], H=H, Hkv=Hkv, D=D, device="cuda")
    grid = [(32, 16), (64, 64), (128, 32)] if D < 512 else [(32, 16), (64, 32), (128, 16)]
    for bm, bn in grid:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=2)
        if D == 512 and bm == 128:
            cfg["BLOCK_DV"] = 256
        _check_gpu(inp, window_size=300, config=cfg)


def graph_replay_check(metas, *, page_size, max_k, window_size, config=None, max_q=None, H=16, Hkv=8, D=128):
    """Capture one launch in a CUDA graph over persistent metadata buffers (static capacities: 700 query tokens,
    4 sequences, ``max_k`` keys each), then replay it after rewriting flags, lengths and block tables with each of
    ``metas`` = [(q_lens, seq_lens, num_causal_q), ...]; every replay is checked against the oracle."""
    torch.manual_seed(0)
    P = page_size
    B, total_q = 4, 700
    nblk = B * (max_k // P) + 8
    kc = torch.randn(nblk, P, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(total_q, H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")
    bt = torch.zeros(B, max_k // P, dtype=torch.int32, device="cuda")
    out = torch.empty(total_q, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(H, total_q, device="cuda")

    def set_meta(q_lens, seq_lens, n_causal, seed):
        g = torch.Generator().manual_seed(seed)
        cu.copy_(torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32))
        sl.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        ncq.copy_(torch.tensor(n_causal, dtype=torch.int32))
        bt.copy_(torch.randperm(nblk, generator=g)[:bt.numel()].view_as(bt).to(torch.int32))

    kw = dict(cu_seqlens_q=cu, seq_lens=sl, num_causal_q=ncq, block_table=bt, window_size=window_size)

    def launch():
        o, lv = attention(q, kc, vc, **kw, out=out, return_lse=True, check_values=False, backend="triton",
                          config=config, max_seqlen_q=max_q, max_seqlen_k=max_k)
        lse.copy_(lv)

    set_meta(*metas[0], 1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    for step, meta in enumerate(metas):
        set_meta(*meta, seed=10 + step)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_close(out, q, kc, vc, lse=lse, **kw)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_changed_flags_lengths_and_block_tables():
    graph_replay_check([([300, 256, 100, 44], [300, 1800, 2000, 44], [300, 0, 50, 44]),
                        ([256, 256, 0, 188], [1024, 2000, 7, 188], [0, 256, 0, 100]),
                        ([0, 0, 0, 700], [0, 0, 0, 1999], [0, 0, 0, 0])],
                       page_size=16, max_k=2000, window_size=511, max_q=300)


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


def test_block_table_prefetch_option_must_be_a_bool():
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16)
    with pytest.raises(ValueError, match="BT_PREFETCH"):
        attention(**inp, backend="triton", config=dict(BT_PREFETCH=1))


@pytest.mark.parametrize("good,bad,name", [(dict(BT_PREFETCH=True), dict(BT_PREFETCH=1), "BT_PREFETCH"),
                                           (dict(LAZY_RESCALE=False), dict(LAZY_RESCALE=0), "LAZY_RESCALE"),
                                           (dict(num_splits=1), dict(num_splits=True), "num_splits"),
                                           (dict(BLOCK_N=16), dict(BLOCK_N=16.0), "BLOCK_N")])
def test_a_cached_valid_config_does_not_let_an_equal_value_of_the_wrong_type_through(good, bad, name):
    """The resolved-config cache was keyed by the override's items: True == 1 == 1.0 hash alike, so after a call
    with {BT_PREFETCH: True} a call with {BT_PREFETCH: 1} hit the cache and skipped validation."""
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16, D=32)
    attention(**inp, backend="triton", config=good)
    with pytest.raises(ValueError, match=name):
        attention(**inp, backend="triton", config=bad)
    with pytest.raises(ValueError, match="BLOCK_M"):   # unhashable values are validated, not a cache TypeError
        attention(**inp, backend="triton", config=dict(BLOCK_M=[16]))


# ---------------------------------------------------------------- memory accesses (interpreter only)


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
    # (an out-of-range id could only come from an entry beyond the used part, whose reads are excluded above)


def test_split_merge_uses_pdl_only_where_griddepcontrol_compiles():
    """Regression: the split-KV merge waits with griddepcontrol (programmatic dependent launch), which ptxas rejects
    below sm_90; the wait is a constexpr the host sets only on sm_90+ (an unconditional wait broke every split
    launch on sm_80). Offline compiles for sm_80 without it and sm_90 with it (fresh process, no interpreter)."""
    import json
    import os
    import subprocess
    import sys

    from blockdiff.attention.triton import plans

    assert plans._capability(torch.device("cpu")) == (0, 0)
    # the host's decision: PDL on sm_90+ only, never under the interpreter or with the switch off
    for cap, interp, switch, want in (((9, 0), False, True, True), ((10, 0), False, True, True),
                                      ((8, 0), False, True, False), ((9, 0), True, True, False),
                                      ((9, 0), False, False, False)):
        saved = plans._capability, plans.interpreting
        plans._capability, plans.interpreting = (lambda d, c=cap: c), (lambda i=interp: i)
        try:
            assert plans.merge_pdl(torch.device("cuda", 0), switch) is want, (cap, interp, switch)
        finally:
            plans._capability, plans.interpreting = saved
    code = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.attention.triton.common import _merge_kernel as fn
sig = dict(OPART="*fp32", LSEPART="*fp32", O="*bf16", LSE="*fp32", total_q="i32", num_heads="i32", n_rows="i32",
           stride_ot="i32", stride_oh="i32")
res = {}
for cap, pdl in ((80, False), (90, True)):
    consts = dict(NUM_SPLITS=2, DV=256, BLOCK_DV=256, BLOCK_R=16, STORE_LSE=True, INTERPRET=False, PDL=pdl)
    full = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=full, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=4))
    res[cap] = "griddepcontrol.wait" in ck.asm["ptx"] and ck.asm.get("cubin") is not None
print(json.dumps(res))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"80": False, "90": True}
