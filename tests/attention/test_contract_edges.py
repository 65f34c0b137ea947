"""Edges of the attention contract that every backend and helper must agree on (issue 26): the one window rule,
keys outside a row's set contributing nothing even with NaN / Inf V, the scale bound, type checks before anything
else, the value checks' order and the debug switch; reference backend and mask helpers here. The argument-error
edges run every backend of ``BACKENDS`` (tests/attention/backend_matrix.py: nothing is computed, so a GPU-only
backend whose checks come first runs them on the CPU too); what every backend computes is
tests/attention/test_backends_contract.py."""
import os
import subprocess
import sys

import pytest
import torch

from blockdiff.attention import (MAX_SCALE, MAX_SEQ_LEN, WINDOW_NO_BOUND, attention, build_mask, count_allowed_pairs,
                                 key_range, set_debug_checks)
from blockdiff.attention.masks import batch_key_ranges, check_window
from blockdiff.attention.reference import masked_pv
from blockdiff.attention.testing import make_batch
from blockdiff.attention.validate import resolve_check_values

from backend_matrix import row, validating_backend_params


def _t(v):
    return torch.tensor(v, dtype=torch.int64)


def _f64(b):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in b.items()}


HUGE_WINDOWS = [WINDOW_NO_BOUND, 2 ** 31, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 + 5, 10 ** 30]


# ---------------------------------------------------------------- one window rule
@pytest.mark.parametrize("W", HUGE_WINDOWS)
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_any_window_of_at_least_window_no_bound_is_no_window_in_every_helper(W, mode):
    """Was an int64 overflow for 2**63-1 / 2**63 (0 allowed pairs, all-zero output) and OverflowError above."""
    assert check_window(W, mode) is None
    assert torch.equal(build_mask(3, 6, causal=False, window_size=W, bidirectional_window=mode),
                       build_mask(3, 6, causal=False, bidirectional_window=mode))
    lens = (_t([3, 2, 4]), _t([5, 6, 9]), _t([3, 0, 2]))
    assert count_allowed_pairs(*lens, W, mode) == count_allowed_pairs(*lens, None, mode) == 55
    for got, want in zip(batch_key_ranges(*lens, W, mode), batch_key_ranges(*lens, None, mode)):
        assert torch.equal(got, want)
    lo, hi = key_range(_t([0, 1]), _t(2), _t(6), _t(0), W, mode)
    assert lo.tolist() == [0, 0] and hi.tolist() == [5, 5]


@pytest.mark.parametrize("W", HUGE_WINDOWS)
def test_reference_with_a_huge_window_equals_no_window(W):
    b = make_batch([6, 9], [3, 2], num_causal_q=[3, 0], dtype=torch.float32)
    assert torch.equal(attention(**b, window_size=W, backend="reference"), attention(**b, backend="reference"))


def test_windows_below_the_bound_are_kept():
    assert check_window(0, "prefix") == 0 and check_window(WINDOW_NO_BOUND - 1, "symmetric") == WINDOW_NO_BOUND - 1
    assert WINDOW_NO_BOUND >= MAX_SEQ_LEN  # so no sequence the contract allows sees a difference


@pytest.mark.parametrize("W,exc", [(True, TypeError), (1.0, TypeError), (float("nan"), TypeError),
                                   (float("inf"), TypeError), ("3", TypeError), (-1, ValueError),
                                   (-2 ** 70, ValueError)])
def test_bad_window_size_is_an_error_naming_window_size_in_every_helper(W, exc):
    b = make_batch([6], [2], causal=[True], dtype=torch.float32)
    for call in (lambda: check_window(W, "symmetric"), lambda: build_mask(2, 6, causal=True, window_size=W),
                 lambda: count_allowed_pairs(_t([2]), _t([6]), _t([2]), W),
                 lambda: key_range(_t([0]), _t(2), _t(6), _t(2), W),
                 lambda: attention(**b, window_size=W, backend="reference")):
        with pytest.raises(exc, match="window_size"):
            call()


# ---------------------------------------------------------------- mask helpers: no coercion
@pytest.mark.parametrize("kw,exc,name", [
    (dict(num_causal_q=1.7), TypeError, "num_causal_q"), (dict(num_causal_q="2"), TypeError, "num_causal_q"),
    (dict(num_causal_q=True), TypeError, "num_causal_q"), (dict(causal="no"), TypeError, "causal"),
    (dict(causal=1), TypeError, "causal"), (dict(causal=True, device="bogus"), ValueError, "device"),
    (dict(causal=True, device=3), TypeError, "device"),
])
def test_build_mask_refuses_coercing_its_arguments(kw, exc, name):
    """Was: 1.7 truncated to 1, '2' parsed, 'no' taken as causal=True, torch's RuntimeError for 'bogus'."""
    with pytest.raises(exc, match=name):
        build_mask(3, 5, **kw)


@pytest.mark.parametrize("args,name", [
    ((torch.tensor([0.5, 1.9]), _t(2), _t(6), _t(0)), "row"), ((0, 2, 6, 0), "row"),
    ((_t([0]), 2, _t(6), _t(0)), "q_len"), ((_t([0]), _t(2), torch.tensor(6.0), _t(0)), "seq_len"),
    ((_t([0]), _t(2), _t(6), torch.tensor([False])), "num_causal_q"),
])
def test_key_range_needs_integer_tensors(args, name):
    """Was: float rows truncated, AttributeError on Python ints."""
    with pytest.raises(TypeError, match=name):
        key_range(*args, None)


# ---------------------------------------------------------------- keys outside a row's set
def _poison(b, seq, key, value, head=0, col=None):
    """b with V of key ``key`` of sequence ``seq`` (kv head ``head``; column ``col`` or all) set to ``value``."""
    v = b["v_cache"].clone()
    P = v.shape[1]
    page = int(b["block_table"][seq, key // P])
    if col is None:
        v[page, key % P, head] = value
    else:
        v[page, key % P, head, col] = value
    return dict(b, v_cache=v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("case", ["future_causal", "outside_window", "outside_symmetric", "outside_prefix"])
def test_keys_outside_a_rows_set_contribute_nothing_even_nan_or_inf_v(dtype, value, case):
    """Was 0 * NaN = NaN through P @ V for every row of the sequence."""
    # seq 0: causal, ctx 2, rows at 2..4; seq 1: bidirectional, ctx 4, rows at 4, 5
    b = make_batch([5, 6], [3, 2], causal=[True, False], dtype=dtype, page_size=4)
    seq, key, W, mode = {"future_causal": (0, 4, None, "symmetric"), "outside_window": (0, 0, 1, "symmetric"),
                         "outside_symmetric": (1, 0, 1, "symmetric"), "outside_prefix": (1, 0, 1, "prefix")}[case]
    kw = dict(window_size=W, bidirectional_window=mode)
    bad = _poison(b, seq, key, value)
    out = attention(**bad, **kw, backend="reference")
    clean = attention(**_poison(b, seq, key, 0.0), **kw, backend="reference")
    mask = torch.zeros(out.shape[0], dtype=torch.bool)  # rows that see the key (head group of kv head 0)
    q0 = [0, 3][seq]
    S, L = [5, 6][seq], [3, 2][seq]
    m = build_mask(L, S, causal=seq == 0, **kw)
    mask[q0:q0 + L] = m[:, key]
    assert mask.sum() < L  # some rows of the sequence do not see the key
    blind = ~mask
    assert torch.equal(out[blind], clean[blind])  # exactly nothing from the key
    assert not torch.isfinite(out[mask][:, :2]).any()  # kv head 0 serves query heads 0, 1
    assert torch.isfinite(out[:, 2:]).all()


def test_visible_nonfinite_v_reaches_exactly_its_column_of_the_rows_that_see_it():
    b = make_batch([5], [3], causal=[True], dtype=torch.float64, page_size=4)
    bad = _poison(_poison(b, 0, 3, float("inf"), col=1), 0, 4, -float("inf"), col=2)
    bad = _poison(bad, 0, 4, float("nan"), col=5)
    out = attention(**bad, backend="reference")
    # rows 0, 1, 2 see keys 0..2, 0..3, 0..4
    assert torch.isfinite(out[0, :2]).all()
    assert out[1, :2, 1].eq(float("inf")).all() and torch.isfinite(out[1, :2, [0, 2, 5]]).all()
    assert out[2, :2, 1].eq(float("inf")).all() and out[2, :2, 2].eq(-float("inf")).all()
    assert torch.isnan(out[2, :2, 5]).all() and torch.isfinite(out[2, :2, [0, 3, 4]]).all()


def test_masked_pv_is_p_at_v_bit_for_bit_for_finite_v():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(2, 5, 7, generator=g)
    v = torch.randn(2, 7, 3, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    p = p * mask
    assert torch.equal(masked_pv(p, v, mask), p @ v)
    v[1, 2, 0] = float("nan")
    got = masked_pv(p, v, mask)
    want = torch.where(mask[None, :, :, None], p[..., None] * v[:, None], 0.0).sum(2)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


# ---------------------------------------------------------------- scale, q, value checks
@pytest.mark.parametrize("scale", [1e38, -1e38, 3.4e38, MAX_SCALE * 2, 10 ** 400, -(10 ** 400)])
def test_scale_beyond_max_scale_is_a_value_error_naming_scale(scale):
    """Was NaN output (fp32 scores overflowing) and OverflowError for ints beyond the float range."""
    with pytest.raises(ValueError, match="scale"):
        attention(**make_batch([5], [3], causal=[True], dtype=torch.float32), scale=scale, backend="reference")


def test_scale_up_to_max_scale_is_accepted():
    b = make_batch([5], [3], causal=[True], dtype=torch.float32)
    out = attention(**b, scale=MAX_SCALE, backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), attention(**_f64(b), scale=MAX_SCALE, backend="reference"),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["auto", *validating_backend_params()])
@pytest.mark.parametrize("q", [None, [[[0.0]]], 3.0])
def test_non_tensor_q_is_a_type_error_naming_q_before_anything_else(backend, q):
    """Was AttributeError ('list' object has no attribute 'device') from resolving the backend."""
    b = make_batch([5], [3], causal=[True], dtype=torch.float32)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention(**dict(b, q=q), backend=backend)


@pytest.mark.parametrize("backend", validating_backend_params())
@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "out"])
def test_a_kernel_backend_under_autograd_raises_instead_of_cutting_the_graph(backend, which):
    """The kernel backends write their output outside the autograd graph: called with grad mode on and q (or K / V,
    as a model being trained computes them) requiring grad, triton returned an output with no grad_fn, so nothing
    flowed back through attention, silently. Now NotImplementedError naming the tensor and the way out; the same
    call under torch.no_grad() runs, and the reference stays differentiable. Which backends are differentiable is
    their row's ``differentiable`` (was: the name "reference" here, so a differentiable backend of eager PyTorch ops,
    which the contract lets be, failed this edge for computing gradients)."""
    b = make_batch([5, 4], [3, 4], causal=[True, False], dtype=torch.bfloat16)
    args = dict(b, out=torch.empty_like(b["q"]) if which == "out" else None)
    args[which] = args[which].clone().requires_grad_(True)
    if row(backend).differentiable:
        if which == "out":
            pytest.skip(f"{backend} writes out in place under autograd as torch does (a leaf refuses it)")
        attention(**args, backend=backend).float().sum().backward()
        assert args[which].grad is not None and torch.isfinite(args[which].grad).all()
        return
    with pytest.raises(NotImplementedError, match=rf"backend '{backend}' computes no gradients, but {which} requires "
                                                  r"grad with grad mode on.*torch.no_grad\(\)"):
        attention(**args, backend=backend)
    if backend == "triton":
        with torch.no_grad():
            assert torch.isfinite(attention(**args, backend=backend)).all()
        with torch.no_grad():
            assert torch.isfinite(attention(**args, backend=backend, check_values=False)).all()  # a launch plan
        with pytest.raises(NotImplementedError, match="computes no gradients"):  # the planned path checks too
            attention(**args, backend=backend, check_values=False)


def test_non_monotone_cu_seqlens_k_is_reported_as_cu_seqlens_k():
    """Was 'seq_lens[1] = -1 < query length' about seq_lens the caller never passed."""
    b = make_batch([4, 3], [2, 2], causal=[True, False], dtype=torch.float32, paged=False)
    bad = dict(b, cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0 and be non-decreasing"):
        attention(**bad, backend="reference")


def test_seq_lens_beyond_max_seq_len_is_a_value_error():
    b = make_batch([5], [3], causal=[True], dtype=torch.float32)
    big = dict(b, seq_lens=torch.tensor([MAX_SEQ_LEN + 1], dtype=torch.int64))
    with pytest.raises(ValueError, match="MAX_SEQ_LEN"):
        attention(**big, backend="reference")


@pytest.mark.parametrize("cv", [0, 1, "no", torch.tensor(True)])
def test_check_values_must_be_none_or_a_bool(cv):
    with pytest.raises(TypeError, match="check_values"):
        attention(**make_batch([5], [3], causal=[True], dtype=torch.float32), check_values=cv, backend="reference")


# ---------------------------------------------------------------- the debug switch
def test_debug_switch_checks_values_of_check_values_false_calls(debug_on):
    b = make_batch([5, 6], [3, 2], causal=[True, False], dtype=torch.float32)
    bt = b["block_table"].clone()
    bt[1, 1] = 10 ** 6
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 1000000 is out of range"):
        attention(**dict(b, block_table=bt), check_values=False, backend="reference")
    assert resolve_check_values(False) is True
    set_debug_checks(False)
    assert resolve_check_values(False) is False and resolve_check_values(None) is True


def test_debug_switch_is_a_bool():
    with pytest.raises(TypeError, match="enabled"):
        set_debug_checks(1)


def test_blockdiff_check_values_env_turns_the_debug_switch_on_at_import():
    code = "import blockdiff.attention as A; print(A.debug_checks())"
    env = dict(os.environ, BLOCKDIFF_CHECK_VALUES="1")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    env["BLOCKDIFF_CHECK_VALUES"] = "0"
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False"), (on.stderr, off.stderr)


# ---------------------------------------------------------------- issue 26, adversarial pass: flags, hints, meta
def _batch():
    return make_batch([9, 13, 5], [9, 4, 5], num_causal_q=[9, 0, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                      page_size=4, dtype=torch.float32, seed=1)


@pytest.mark.parametrize("kw,name", [(dict(return_lse="yes"), "return_lse"), (dict(return_lse=1), "return_lse"),
                                     (dict(upcast="no"), "upcast"), (dict(upcast=0), "upcast")])
def test_return_lse_and_upcast_must_be_bools_not_truthy_values(kw, name):
    """Were taken by truthiness ('yes' returned (out, lse), 'no' upcast)."""
    with pytest.raises(TypeError, match=name):
        attention(**_batch(), backend="reference", **kw)


@pytest.mark.parametrize("hint", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value,exc", [(-5, ValueError), ("100", TypeError), (1.5, TypeError), (True, TypeError),
                                       (torch.tensor(13.5), TypeError), (torch.tensor([13]), TypeError)])
def test_length_hints_must_be_none_a_non_negative_int_or_a_0d_int_tensor(hint, value, exc):
    """Were ignored by the reference and int()-ed by the triton backend ('100' -> 100, 1.5 -> 1, -5 a negative key
    capacity)."""
    with pytest.raises(exc, match=hint):
        attention(**_batch(), backend="reference", **{hint: value})


@pytest.mark.parametrize("backend", validating_backend_params())
@pytest.mark.parametrize("hint", ["max_seqlen_q", "max_seqlen_k"])
def test_a_length_hint_tensor_on_the_meta_device_is_a_value_error_naming_it(backend, hint):
    """Was accepted by the reference and the triton backend's max_seqlen_q, and torch's RuntimeError ('Tensor.item()
    cannot be called on meta tensors') where a backend reads it (triton's max_seqlen_k, cute's both)."""
    with pytest.raises(ValueError, match=f"{hint} is on the meta device"):
        attention(**_batch(), backend=backend, **{hint: torch.tensor(5).to("meta")})


@pytest.mark.parametrize("backend", validating_backend_params())
@pytest.mark.parametrize("hint", ["max_seqlen_q", "max_seqlen_k"])
def test_a_negative_length_hint_tensor_is_a_value_error_naming_it_in_every_backend(backend, hint):
    """Was accepted by the reference (both hints) and the triton backend (max_seqlen_q: it does not read it), refused
    where a backend reads it (triton's max_seqlen_k, cute's both): the value checks read a tensor hint now."""
    with pytest.raises(ValueError, match=f"{hint} must be >= 0"):
        attention(**_batch(), backend=backend, **{hint: torch.tensor(-5)})


def test_length_hints_accept_ints_and_0d_int_tensors():
    b = _batch()
    want = attention(**b, backend="reference")
    for v in (0, 13, 10 ** 12, torch.tensor(13), torch.tensor(7, dtype=torch.int32)):
        assert torch.equal(attention(**b, backend="reference", max_seqlen_q=v, max_seqlen_k=v), want)


@pytest.mark.parametrize("which", ["all", "q", "cu_seqlens_q", "seq_lens", "block_table"])
def test_tensors_on_the_meta_device_are_a_value_error_naming_them(which):
    """Were a NotImplementedError ('Cannot copy out of meta tensor') from inside the value checks."""
    b = _batch()
    if which == "all":
        b = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in b.items()}
    else:
        b[which] = b[which].to("meta")
    with pytest.raises(ValueError, match="meta|is on"):
        attention(**b, backend="reference")


def test_mask_helpers_refuse_tensors_on_the_meta_device():
    m = torch.tensor([2]).to("meta")
    with pytest.raises(ValueError, match="q_lens is on the meta device"):
        count_allowed_pairs(m, m, m, None)
    with pytest.raises(ValueError, match="row is on the meta device"):
        key_range(torch.tensor([0]).to("meta"), m, m, m, None)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_build_mask_on_the_meta_device_is_a_value_error_naming_device(device):
    """Was a ValueError naming 'row', a tensor build_mask makes itself, not the caller's argument."""
    with pytest.raises(ValueError, match="^device must hold data"):
        build_mask(2, 3, causal=True, device=device)


def test_key_range_refuses_shapes_that_do_not_broadcast():
    """Was torch's RuntimeError 'The size of tensor a (2) must match ...', naming no argument."""
    with pytest.raises(ValueError, match=r"must broadcast to one shape, got row \(3,\), q_len \(2,\)"):
        key_range(_t([0, 1, 2]), _t([3, 3]), _t([3, 3]), _t([0, 0]), None)


@pytest.mark.parametrize("q_len,seq_len,ncq,match", [(3, 1, 0, "q_len <= seq_len"), (-1, 2, 0, "0 <= q_len"),
                                                     (2, 5, 3, "num_causal_q"), (2, 5, -1, "num_causal_q"),
                                                     (1, MAX_SEQ_LEN + 1, 0, "MAX_SEQ_LEN")])
def test_key_range_refuses_values_outside_the_contract(q_len, seq_len, ncq, match):
    """Were silently turned into intervals of a mask the contract does not define (seq_len < q_len gave
    bidirectional rows the keys [0, seq_len - 1])."""
    with pytest.raises(ValueError, match=match):
        key_range(_t([0]), _t(q_len), _t(seq_len), _t(ncq), None)


@pytest.mark.parametrize("row", [-1, 4, 10])
def test_key_range_refuses_rows_outside_the_sequence(row):
    """A row outside [0, q_len) has no key interval in the contract; was silently answered (row -1 of a q_len-4
    sequence over 6 keys got [0, 1])."""
    with pytest.raises(ValueError, match=r"row must be in \[0, q_len\)"):
        key_range(_t([0, row]), _t(4), _t(6), _t(0), None)


def test_build_mask_refuses_seq_len_beyond_max_seq_len():
    """Was an attempt to allocate q_len x seq_len bools (8 TB for 2**40: a RuntimeError from the allocator)."""
    with pytest.raises(ValueError, match="seq_len .* MAX_SEQ_LEN"):
        build_mask(1, 2 ** 40, causal=True)
    with pytest.raises(ValueError, match="MAX_SEQ_LEN"):
        count_allowed_pairs(_t([1]), _t([MAX_SEQ_LEN + 1]), _t([0]), None)


@pytest.mark.parametrize("backend", validating_backend_params())
def test_int64_num_causal_q_beyond_int32_is_refused_naming_num_causal_q_not_wrapped_into_range(backend):
    """2**32 + 1 causal rows of a 3-row sequence were checked after the int32 narrowing, as 1: accepted, and the
    sequence attended with one causal row."""
    b = make_batch([5, 4], [3, 2], causal=[True, False], dtype=torch.float32)
    del b["causal"]
    ncq = torch.tensor([2 ** 32 + 1, 0], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"num_causal_q\[0\] = 4294967297 must be in \[0, q_len=3\]"):
        attention(**b, num_causal_q=ncq, backend=backend)


@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
@pytest.mark.parametrize("paged", [True, False])
def test_reference_out_aliasing_a_cache_gives_the_unaliased_result(cache, paged):
    """``out`` may alias an input (the contract): the reference wrote sequence 0's rows into the cache rows a later
    sequence still had to read (out a view of the cache's last rows / of one page), a silently wrong result."""
    b = make_batch([6, 5, 7], [3, 2, 4], causal=[True, False, False], dtype=torch.float32, num_heads=2,
                   num_kv_heads=2, paged=paged, page_size=9, extra_blocks=0)
    want = attention(**{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()}, backend="reference")
    total_q = b["q"].shape[0]
    for where in ([slice(-total_q, None)] if not paged else range(b[cache].shape[0])):  # every page (of 9 rows)
        inp = {k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()}
        out = inp[cache][where]
        got = attention(**inp, out=out, backend="reference")
        assert got is out
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reference_checks_only_a_callers_out_for_overlap(monkeypatch):
    """A fresh ``out`` (``out=None``) cannot overlap an input: no pointer math is spent on it; a caller's is
    checked against q, k_cache and v_cache."""
    from blockdiff.attention import reference

    calls = []
    real = reference.memory_overlaps
    monkeypatch.setattr(reference, "memory_overlaps", lambda a, b: calls.append(1) or real(a, b))
    b = make_batch([6, 5], [3, 2], causal=[True, False], dtype=torch.float32)
    want = attention(**b, backend="reference")
    assert calls == []
    got = attention(**b, out=torch.empty_like(want), backend="reference")
    assert len(calls) == 3 and torch.equal(got, want)


@pytest.mark.parametrize("backend", validating_backend_params())
@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.float64])
def test_attention_refuses_an_out_of_another_dtype_with_a_type_error(backend, dtype):
    """The contract's rule (validate.check_attention_inputs: TypeError for a wrong dtype, as k_cache / v_cache get):
    an ``out`` of another dtype than q was a ValueError ("out must be torch.float32 on cpu, got ...")."""
    b = make_batch([6, 9], [3, 2], causal=[True, False], dtype=torch.float32)
    out = torch.zeros(5, 4, 16, dtype=dtype)
    with pytest.raises(TypeError, match=f"out dtype {dtype} must equal q dtype torch.float32"):
        attention(**b, out=out, backend=backend)


@pytest.mark.parametrize("which", ["q", "k_cache", "cu_seqlens_q", "seq_lens", "block_table", "num_causal_q", "out"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sparse_tensors_are_a_type_error_naming_them(which, backend):
    """Were torch's NotImplementedError / RuntimeError from inside the checks or the launch ("Could not run
    'aten::as_strided' with arguments from the 'SparseCPU' backend", "unsupported memory format option"), or a
    ValueError about a last-dimension stride the tensor does not have; the mask helpers, write_kv_cache and the
    split-KV merge alike."""
    from blockdiff.attention import write_kv_cache
    from blockdiff.attention.split_merge import merge_split_partials
    b = _batch()
    if which == "out":
        b["out"] = torch.zeros_like(b["q"]).to_sparse()
    else:
        b[which] = b[which].to_sparse()
    with pytest.raises(TypeError, match=f"{which} must be a dense"):
        attention(**b, backend=backend)
    sp = torch.tensor([2]).to_sparse()
    with pytest.raises(TypeError, match="q_lens must be a dense"):
        count_allowed_pairs(sp, torch.tensor([2]), torch.tensor([0]), None)
    with pytest.raises(TypeError, match="row must be a dense"):
        key_range(sp, torch.tensor([2]), torch.tensor([2]), torch.tensor([0]), None)
    k = torch.zeros(1, 2, 4)
    with pytest.raises(TypeError, match="slot_mapping must be a dense"):
        write_kv_cache(k, k, torch.zeros(2, 2, 2, 4), torch.zeros(2, 2, 2, 4), torch.tensor([0]).to_sparse())
    with pytest.raises(TypeError, match="o_part must be a dense"):
        merge_split_partials(torch.zeros(2, 1, 1, 16).to_sparse(), torch.zeros(2, 1, 1), torch.zeros(1, 1, 16))


@pytest.mark.parametrize("which", ["q", "k_cache_contiguous", "k_cache_paged"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_more_than_int32_rows_or_pages_are_a_value_error_naming_them(which, backend):
    """The kernels take cu_seqlens_q / cu_seqlens_k offsets and page ids as int32 (plans cast them; the page loads
    clamp an int32 id): a call holding 2**31 query rows, contiguous key rows or pages would have wrapped (a wrong
    row read, silently). Refused from the shapes (zero-stride views here: no memory), for every backend."""
    from blockdiff.attention.validate import MAX_ROWS
    b = _batch()
    n = MAX_ROWS + 1
    if which == "q":
        b["q"] = b["q"][:1].expand(n, *b["q"].shape[1:])
        b["cu_seqlens_q"] = torch.tensor([0, n - 2, n - 1, n])
        name = r"q.shape\[0\] \(total_q\)"
    elif which == "k_cache_paged":
        b["k_cache"] = b["k_cache"][:1].expand(n, *b["k_cache"].shape[1:])
        b["v_cache"] = b["v_cache"][:1].expand(n, *b["v_cache"].shape[1:])
        name = r"k_cache.shape\[0\] \(num_blocks\)"
    else:
        b = make_batch([9, 13, 5], [9, 4, 5], num_causal_q=[9, 0, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                       paged=False, dtype=torch.float32, seed=1)
        b["k_cache"] = b["k_cache"][:1].expand(n, *b["k_cache"].shape[1:])
        b["v_cache"] = b["v_cache"][:1].expand(n, *b["v_cache"].shape[1:])
        name = r"k_cache.shape\[0\] \(total_k\)"
    with pytest.raises(ValueError, match=name + " = 2147483648 exceeds MAX_ROWS"):
        attention(**b, backend=backend)
