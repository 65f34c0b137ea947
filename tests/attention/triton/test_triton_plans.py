"""Launch plans (attention/triton/plans.py, kept by attention/triton/interface.py): calls with
``check_values=False`` plan once per key, reuse the plan with new values and equal the full path; the key, the
``PLANS_ENABLED`` switch, no host reads, the compiled launcher's grid."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from blockdiff.attention.testing import check_close
from blockdiff.attention.triton import interface as ta
from blockdiff.attention.triton.common import _merge_kernel
from blockdiff.attention.triton.interface import attention_triton
from blockdiff.attention.triton.plans import Launch

from triton_helpers import GPU_BATCH, GPU_HEADS, MIXED, SMALL, batches, make_batch


def _plans():
    return ta.PLANS


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


@pytest.mark.parametrize("scale,want", [(0.7, 0.7 * 1.4426950408889634), (-0.7, 0.7 * 1.4426950408889634),
                                        (0.0, 1.0), (-1e-38, 1.0)])
def test_split_plans_merge_each_splits_raw_max_and_sum_at_the_kernels_log2_scale(scale, want):
    """A split launch's merge takes the raw-stats format (split_merge's: each split's running max and its sum, not
    its LSE) at the log2 scale of the kernel's max: ``|scale| * log2(e)`` on the raw-score path (a negative scale
    negates Q there), 1 on the general path (0 and tiny scales: the max of scores already in log2 units);
    planned and full path alike."""
    _plans().clear()
    inp = make_batch(**MIXED, seed=4)
    for check_values in (False, None):
        o, lse = attention_triton(**inp, config=dict(SMALL, num_splits=3), scale=scale, return_lse=True,
                                  check_values=check_values)
        check_close(o, **inp, lse=lse, scale=scale)
    (plan,) = _plans().values()
    assert plan.num_splits == 3 and plan.merge.kwargs["RAW_STATS"] is True
    assert plan.merge_tail[-1] == pytest.approx(want, rel=1e-15)


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
    assert Launch(_merge_kernel, (7,), {}).grid == (7, 1, 1)
    assert Launch(_merge_kernel, (7, 2), {}).grid == (7, 2, 1)
    assert Launch(_merge_kernel, (7, 2, 3), {}).grid == (7, 2, 3)


def test_max_seqlen_k_that_is_not_a_python_int_is_never_planned():
    """A 0-d tensor max_seqlen_k changed in place must not keep a stale split count (review finding): only a
    Python int enters a plan key; anything else takes the full path, which reads its value."""
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
    _plans().clear()
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=SMALL, check_values=False)
    ta.LAST_LAUNCH["config"]["num_splits"] = 3
    attention_triton(**inp, config=SMALL, check_values=False)
    assert ta.LAST_LAUNCH["num_splits"] == 1
    attention_triton(**inp, config=SMALL)
    assert ta.LAST_LAUNCH["num_splits"] == 1


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


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(0, 2 ** 16))
def test_fuzz_planned_calls_equal_the_full_path(case, seed2):
    """Random batches: a second call with the same shapes and new values (K / V / q, block table permutation,
    causal row counts) reuses the first call's plan and gives bitwise the full path's out and lse."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("D,config", [(128, None), (256, None), (512, None), (512, {"OVERLAP": False}),
                                      (256, {"IMPL": "triton"}), (128, {"num_splits": 3}),
                                      (256, {"num_splits": 2})])
def test_gpu_planned_calls_launch_the_compiled_kernels_and_match_the_reference(D, config):
    """With check_values=False the first call plans and compiles; the later ones (same shapes, new values,
    causal row counts and block tables) launch the compiled kernels directly, and each matches the oracle."""
    ta.PLANS.clear()
    H, Hkv = GPU_HEADS[D]
    sl, ql, _ = GPU_BATCH
    for seed, ncq in enumerate(([700, 0, 0, 4], [0, 256, 0, 9], [700, 256, 0, 0])):
        inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=64,
                         device="cuda", seed=seed)
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], H, vc.shape[-1]), float("nan"), dtype=q.dtype, device="cuda")
        o, lse = attention_triton(**inp, out=out, return_lse=True, check_values=False, window_size=127,
                                  config=config)
        check_close(o, **inp, lse=lse, window_size=127)
    (plan,) = ta.PLANS.values()
    assert plan.main.compiled is not None and ta.LAST_LAUNCH["kernel"] is plan.main.compiled
    assert (plan.merge is None) == (plan.num_splits == 1)
    assert plan.merge is None or plan.merge.compiled is not None


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("nan_safe", [False, True])
def test_gluon_launch_passes_the_fixups_v_view_only_with_nan_safe_v(monkeypatch, nan_safe, paged, packed):
    """The Gluon kernels' last three arguments (V, v_row_stride, v_rows): None with config["NAN_SAFE_V"] off
    (constexprs, so no kernel parameter: the kernels compile as without the switch), else the V cache as its TMA
    descriptor views it, so the cold fix-up's address ``row * v_row_stride + kvh * VS + col`` of a key is the
    entry the TMA loads read of it: separate caches and vLLM's packed layout (V starts head_dim elements into a
    token row, VS = 2 * head_dim). CPU: the launch is recorded, not run."""
    from blockdiff.attention.triton import plans

    launches = []

    class Recorder:  # stands in for the Gluon kernel: fn[grid](*args, **constexprs)
        def __getitem__(self, grid):
            return lambda *args, **consts: launches.append((args, consts))

    monkeypatch.setattr(plans, "gluon_ineligible", lambda *a, **k: None)  # TMA rules need a CUDA device
    monkeypatch.setitem(plans.GLUON_KERNELS, "gluon", Recorder())
    D, Hkv, P = 64, 4, 64
    inp = make_batch([150, 70, 9], [64, 70, 9], num_causal_q=[0, 70, 4], num_heads=8, num_kv_heads=Hkv, head_dim=D,
                     page_size=P, paged=paged, device="cpu", seed=3)
    if packed:
        inp["k_cache"], inp["v_cache"] = torch.cat([inp["k_cache"], inp["v_cache"]], -1).split(D, -1)
    cfg = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, num_splits=1, NAN_SAFE_V=nan_safe)
    attention_triton(**inp, config=cfg)
    (args, consts), = launches
    assert consts["NAN_SAFE_V"] is nan_safe and consts["VS"] == (2 * D if packed else D)
    V, v_row_stride, v_rows = args[-3:]
    if not nan_safe:
        assert (V, v_row_stride, v_rows) == (None, None, None)
        return
    vc = inp["v_cache"]
    v_desc = args[2]
    assert V is vc and list(v_desc.shape) == [v_rows, (Hkv - 1) * consts["VS"] + D]
    assert v_desc.strides[0] == v_row_stride and v_desc.base.data_ptr() == V.data_ptr()
    # the last entry the fix-up may read (rows clamped to v_rows - 1) lies inside the cache's storage
    assert V.storage_offset() + (v_rows - 1) * v_row_stride + (Hkv - 1) * consts["VS"] + D <= \
        V.untyped_storage().nbytes() // V.element_size()
    g = torch.Generator().manual_seed(0)
    for b, S in enumerate(inp["seq_lens"].tolist()):
        for _ in range(20):
            key, kvh, col = (int(torch.randint(0, n, (1,), generator=g)) for n in (S, Hkv, D))
            if paged:
                page, slot = int(inp["block_table"][b, key // P]), key % P
                row, want = page * P + slot, vc[page, slot, kvh, col]
            else:
                row = int(inp["cu_seqlens_k"][b]) + key
                want = vc[row, kvh, col]
            off = V.storage_offset() + row * v_row_stride + kvh * consts["VS"] + col
            assert torch.equal(torch.as_strided(V, (), (), off), want)


@pytest.mark.parametrize("check_values", [None, False])
def test_negative_max_seqlen_k_tensor_is_refused_like_the_int(check_values):
    """A 0-d tensor hint is read on the host where the plan uses it: a negative one is the int form's ValueError
    (was accepted silently)."""
    inp = make_batch(**MIXED)
    for hint in (-5, torch.tensor(-5)):
        with pytest.raises(ValueError, match="max_seqlen_k must be >= 0"):
            attention_triton(**inp, config=SMALL, max_seqlen_k=hint, check_values=check_values)


@pytest.mark.parametrize("hint, err", [(-5, ValueError), ("8", TypeError), (3.5, TypeError), (True, TypeError),
                                       (torch.zeros(3, dtype=torch.int32), TypeError)])
def test_a_planned_call_refuses_a_bad_max_seqlen_q_as_the_full_path_does(hint, err):
    """``max_seqlen_q`` is in no plan key (the kernels never read it), so once a call had planned, the same call with
    ``max_seqlen_q=-5``, a str, a float or a 1-D tensor returned a result where the first (unplanned) one raised:
    the planned path skipped the hint's type rule. It is checked on the planned path too."""
    _plans().clear()
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=SMALL, check_values=False, max_seqlen_q=4)
    assert len(_plans()) == 1
    for _ in range(2):  # planned, then (a plan existing) again
        with pytest.raises(err, match="max_seqlen_q"):
            attention_triton(**inp, config=SMALL, check_values=False, max_seqlen_q=hint)
    attention_triton(**inp, config=SMALL, check_values=False, max_seqlen_q=torch.tensor(9))  # a 0-d tensor: fine
