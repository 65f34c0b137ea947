"""The attention contract (docs/ARCHITECTURE.md section 4) against every registered backend: each case is
parametrised over ``blockdiff.attention.BACKENDS`` itself, so a backend registered there is run here without a new
test. How each runs on this machine (CPU, the Triton interpreter, GPU only) is its row of
``tests/attention/backend_matrix.py``; a registered name without a row fails, naming what to add.

Every checked call writes into a NaN-poisoned ``out`` and is compared, output and LSE, with the fp64 oracle by
``attention/testing.py``'s tolerance rule. The cases: mixed prefill / denoise / commit batches (per-sequence causal
flags and ``num_causal_q``), both window modes, paged caches (page sizes that do not divide the tiles, permuted page
ids, garbage block-table padding, NaN in every row no sequence owns) and contiguous K/V, GQA, dtypes, empty
sequences, length 1, the empty batch, extreme scales, sequences of mixed output magnitudes (V x 1000 beside O(1):
each is held to its own eager error), NaN / Inf V inside ``seq_lens`` for keys a row may not see,
the underflow batch (a seen key of weight 0 with non-finite V), a derandomised Hypothesis fuzz and the signature.
Small shapes: the whole file runs in well under a minute on one CPU core under the interpreter. Each backend's own
tests (its configs, kernels, launch plans) stay in its folder."""
from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.attention import BACKENDS, MAX_SCALE, attention, get_backend
from blockdiff.attention.testing import (check_close, check_nonfinite_matches_reference, make_batch,
                                        make_underflow_batch, make_very_negative_scores_batch, poison_v_inside_seq_lens,
                                        scale_v_per_sequence)

from backend_matrix import MATRIX, MISSING_ROW, backend_params, row

BACKEND = pytest.mark.parametrize("backend", backend_params())

#: The keyword arguments of the contract and their defaults (docs/ARCHITECTURE.md section 4, "Arguments"; section 3,
#: "Adding an attention backend", step 1). ``cu_seqlens_q`` has none: it is required.
CONTRACT_KEYWORDS = {
    "cu_seqlens_q": inspect.Parameter.empty, "seq_lens": None, "causal": None, "num_causal_q": None,
    "block_table": None, "cu_seqlens_k": None, "window_size": None, "bidirectional_window": "symmetric",
    "scale": None, "out": None, "return_lse": False, "max_seqlen_q": None, "max_seqlen_k": None,
    "check_values": None, "config": None,
}


def _to(inp: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inp.items()}


def run_and_check(backend: str, inp: dict, *, config_index: int = 0, **kw):
    """One call of ``backend`` on ``inp`` (a CPU batch, moved to the backend's device) into a NaN-poisoned ``out``,
    with the LSE; output and LSE checked against the oracle. Returns ``(out, lse)`` on the CPU."""
    r = row(backend)
    dev = _to(inp, r.device)
    q, vc = dev["q"], dev["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=r.device)
    o, lse = attention(**dev, out=out, return_lse=True, backend=backend, **r.config_kwargs(config_index), **kw)
    assert o.data_ptr() == out.data_ptr() and o.shape == out.shape, "out is not written in place"
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]), (lse.dtype, lse.shape)
    o, lse = o.cpu(), lse.cpu()
    check_close(o, **inp, lse=lse, **kw)
    return o, lse


# ---------------------------------------------------------------- the registry and the matrix agree
def test_every_registered_backend_has_a_row():
    missing = [n for n in BACKENDS if n not in MATRIX]
    assert not missing, "\n".join(MISSING_ROW.format(name=n) for n in missing)


def test_every_row_names_a_registered_backend():
    stale = sorted(set(MATRIX) - set(BACKENDS))
    assert not stale, f"tests/attention/backend_matrix.py has rows for names not in BACKENDS: {stale}"


def test_a_row_with_an_unknown_where_config_or_known_gap_is_refused_naming_what_is_wrong():
    """A mistake in a row is a collection error saying what to fix (was: a bare assert of the value, dropped under
    ``python -O`` as backend_matrix.py is not assertion-rewritten)."""
    from backend_matrix import GAPS, BackendRun

    with pytest.raises(ValueError, match=r"known_gaps names \['underflow_in_a_cleaned_blok'\], not cases of GAPS "
                                         r"\['fma_against_a_rounded_max', 'underflow_in_a_cleaned_block'\]"):
        BackendRun("cpu", "typo", known_gaps={"underflow_in_a_cleaned_blok": "r"})
    with pytest.raises(ValueError, match="where must be 'cpu', 'interpreter' or 'gpu'"):
        BackendRun("cuda", "wrong place")
    with pytest.raises(ValueError, match="no_config=True"):
        BackendRun("cpu", "config without the keyword", configs=({"BLOCK_M": 16},), no_config=True)
    assert BackendRun("cpu", "ok", known_gaps={next(iter(GAPS)): "r"}).known_gaps


def test_every_registered_backend_has_a_module_and_every_module_entry_a_registered_name():
    """``BACKENDS`` and ``_MODULES`` name the same backends: a name only in ``BACKENDS`` failed every case with a
    bare ``KeyError``; an entry only in ``_MODULES`` was unreachable and untested, with nothing red."""
    from blockdiff import attention as attn

    only_registered, only_module = sorted(set(BACKENDS) - set(attn._MODULES)), sorted(set(attn._MODULES) - set(BACKENDS))
    assert not only_registered, (f"{only_registered} in blockdiff.attention.BACKENDS have no (module, function) in "
                                 "_MODULES of attention/__init__.py")
    assert not only_module, (f"{only_module} in _MODULES of attention/__init__.py are not in BACKENDS: register the "
                             "name there (then the contract suite runs it), or remove the entry")


@pytest.mark.parametrize("name", ["no-such-backend", "Triton", ""])
def test_an_unregistered_name_is_refused_saying_where_backends_are_registered(name):
    """A backend written outside the package (or a typo) is a ValueError listing the names and pointing at the
    registry and the steps (was: the list alone, with nothing saying how a new name gets there)."""
    b = make_batch([5], [3], causal=[True], dtype=torch.float32)
    for call in (lambda: attention(**b, backend=name), lambda: get_backend(name)):
        with pytest.raises(ValueError, match=rf"backend must be one of .*got {name!r} \(a new backend is registered in "
                                             r"BACKENDS and _MODULES of attention/__init__.py: docs/ARCHITECTURE.md "
                                             r"section 3, 'Adding an attention backend'\)"):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_the_contracts_keywords(backend):
    """Every keyword of the contract, keyword-only, with the contract's default; the reference's differences
    (no ``config``, ``upcast``, ``check_values=True``) and any other backend's are its row's, stated explicitly.
    Runs for every backend on the CPU: nothing is called."""
    r = row(backend)
    try:
        fn = get_backend(backend)
    except ImportError as e:  # a GPU-only backend whose module needs a GPU stack to import
        if r.where == "gpu" and not torch.cuda.is_available():
            pytest.skip(f"{backend}'s module does not import without its GPU stack: {e}")
        raise
    params = inspect.signature(fn).parameters
    names = list(params)
    assert names[:3] == ["q", "k_cache", "v_cache"], names[:3]
    want = {k: r.default_overrides.get(k, d) for k, d in CONTRACT_KEYWORDS.items()
            if not (r.no_config and k == "config")}
    missing = sorted(set(want) - set(names))
    assert not missing, f"{backend} lacks the contract's keywords {missing}"
    for k, d in want.items():
        assert params[k].kind is inspect.Parameter.KEYWORD_ONLY, f"{backend}: {k} is not keyword-only"
        assert params[k].default == d, f"{backend}: {k} defaults to {params[k].default!r}, the contract's is {d!r}"
    extra = set(names[3:]) - set(want)
    assert extra == set(r.extra_keywords), (
        f"{backend} takes keywords beyond the contract {sorted(extra)}; its row lists {sorted(r.extra_keywords)}")
    if r.no_config:
        assert "config" not in names, f"{backend}'s row says it takes no config, but it does"


# ---------------------------------------------------------------- mixed batches, windows, page and cache forms
MIXED = dict(seq_lens=[9, 13, 6, 1, 5, 30], q_lens=[9, 4, 6, 1, 0, 12],
             causal=[True, False, True, False, False, False])


@BACKEND
@pytest.mark.parametrize("window_size,mode,i", [(None, "symmetric", 0), (3, "symmetric", 1), (None, "prefix", 2),
                                                (3, "prefix", 3)])
def test_mixed_prefill_denoise_commit_batch_with_per_sequence_causal_flags(backend, window_size, mode, i):
    r = row(backend)
    inp = make_batch(**MIXED, head_dim=r.head_dim, page_size=r.page_sizes[i % len(r.page_sizes)], seed=i)
    run_and_check(backend, inp, config_index=i, window_size=window_size, bidirectional_window=mode)


@BACKEND
@pytest.mark.parametrize("mode,i", [("symmetric", 0), ("prefix", 1)])
def test_num_causal_q_mixes_commit_rows_and_the_next_canvas_in_one_sequence(backend, mode, i):
    """Commit rows (causal) then canvas rows (bidirectional) of one sequence; tiles straddle the boundary."""
    r = row(backend)
    inp = make_batch([20, 17, 9, 4], [11, 9, 9, 4], num_causal_q=[5, 9, 0, 1], num_heads=4, num_kv_heads=1,
                     head_dim=r.head_dim, page_size=r.page_sizes[-1], seed=10 + i)
    run_and_check(backend, inp, config_index=i, window_size=2, bidirectional_window=mode)


@BACKEND
@pytest.mark.parametrize("i", range(4))
def test_page_sizes_permuted_pages_garbage_padding_and_poisoned_unused_rows(backend, i):
    """Pages of ``page_sizes[i]`` (some not dividing the tiles), in permuted order, block-table columns past a
    sequence's pages holding random valid ids, NaN in every cache row no sequence owns: reading one fails."""
    r = row(backend)
    page = r.page_sizes[i % len(r.page_sizes)]
    inp = make_batch([37, 20, 3], [5, 20, 3], causal=[False, True, False], head_dim=r.head_dim, page_size=page,
                     extra_blocks=2, extra_columns=2, block_table_pad="garbage", poison_unused=True, seed=20 + i)
    run_and_check(backend, inp, config_index=i, window_size=9, bidirectional_window=("symmetric", "prefix")[i % 2])


@BACKEND
@pytest.mark.parametrize("mode,i", [("symmetric", 0), ("prefix", 1)])
def test_contiguous_kv_form(backend, mode, i):
    r = row(backend)
    inp = make_batch(**MIXED, paged=False, head_dim=r.head_dim, poison_unused=True, seed=30 + i)
    run_and_check(backend, inp, config_index=i, window_size=4, bidirectional_window=mode)


@BACKEND
@pytest.mark.parametrize("H,Hkv", [(4, 1), (6, 2)])
def test_gqa_query_heads_share_a_kv_head(backend, H, Hkv):
    r = row(backend)
    inp = make_batch([12, 9], [5, 9], causal=[False, True], num_heads=H, num_kv_heads=Hkv, head_dim=r.head_dim,
                     page_size=r.page_sizes[0], seed=40 + H)
    run_and_check(backend, inp, window_size=None if H == 4 else 2)


@BACKEND
def test_every_dtype_of_the_row(backend):
    r = row(backend)
    for j, dtype in enumerate(r.dtypes):
        inp = make_batch([11, 6], [4, 6], num_causal_q=[4, 2], dtype=dtype, head_dim=r.head_dim,
                         page_size=r.page_sizes[-1], seed=50 + j)
        run_and_check(backend, inp, config_index=j)


@BACKEND
def test_empty_sequences_length_one_and_the_empty_batch(backend):
    """Sequences with no keys, with keys but no query rows, one query over one key (a causal row that sees only
    itself), one query over a context; then a batch of no sequences."""
    r = row(backend)
    inp = make_batch([0, 1, 5, 1, 7, 0], [0, 1, 0, 1, 1, 0], causal=[True, True, False, False, True, False],
                     head_dim=r.head_dim, page_size=r.page_sizes[0], seed=60)
    o, lse = run_and_check(backend, inp, window_size=0)
    assert o.shape[0] == 3
    empty = make_batch([], [], causal=[], head_dim=r.head_dim, page_size=r.page_sizes[0], seed=61)
    o, lse = run_and_check(backend, empty)
    assert o.shape[0] == 0 and lse.shape[1] == 0


@BACKEND
@pytest.mark.parametrize("scale", [0.0, -0.7, MAX_SCALE])
def test_zero_negative_and_max_scale(backend, scale):
    """At ``|scale| = MAX_SCALE`` the LSE is ~1e5: check_close bounds it with the scores' fp32 rounding."""
    r = row(backend)
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=r.dtypes[-1], head_dim=r.head_dim,
                     page_size=r.page_sizes[-1], seed=70)
    run_and_check(backend, inp, scale=scale, window_size=5)


@BACKEND
@pytest.mark.parametrize("scale", [1e-300, 5e-324, 1e-40, 2.0 ** -127, -1e-300])
def test_a_scale_below_the_fp32_normal_range_gives_the_reference_not_nan(backend, scale):
    """Was NaN in every row with a masked key on the triton backend (scale 1e-300, 5e-324: the kernels' fp32
    ``scale * log2(e)`` is 0 and the positive-scale path, chosen by ``scale > 0`` in double, multiplied a masked
    score's -inf by it), and by FA4's same scaling after the row max on the cute backend; the reference's scores
    round to 0 (or a subnormal) and give the mean of the keys a row sees."""
    r = row(backend)
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=r.dtypes[-1], head_dim=r.head_dim,
                     page_size=r.page_sizes[-1], seed=71)
    o, lse = run_and_check(backend, inp, scale=scale, window_size=5)
    assert not o.isnan().any() and lse.isfinite().all()


@BACKEND
@pytest.mark.parametrize("scale", [1.0, -1.0])
def test_scores_near_2e31_in_magnitude_give_the_one_hot_softmax_not_nan(backend, scale, request):
    """Scores of magnitude ~1e31-1e32 (q = +-1e15, k = -1e15 (1 + u / 2): finite, inside the contract) make each
    row's softmax one-hot on its least negative key. Was a NaN output and a non-finite LSE on the compiled triton
    backend (docs/tuning.md 7.63; the interpreter passed): its one-FMA weight ``exp2(fma(s, c, -round(max * c)))``
    kept the product's rounding error, up to half an ulp of the max (2^80 in log2 units here), so the row's best
    key weighed inf or 0. FA4's one-FFMA weight takes the same FMA; the cute backend's default weight does not
    (``CuteConfig.exact_weight``, on), so no row names the gap ``fma_against_a_rounded_max`` (a row that did would be
    a strict xfail here)."""
    r = row(backend)
    r.expect_gap(request, "fma_against_a_rounded_max")
    # entries of 1e15 need bf16's or fp32's range (fp16 overflows: the cute row, whose last dtype is fp16, failed
    # building its input and so counted as the gap's expected failure without running)
    dtype = next(d for d in reversed(r.dtypes) if torch.finfo(d).max > 1e16)
    inp = make_very_negative_scores_batch([40, 13, 30], [9, 13, 30], num_causal_q=[0, 13, 11], num_heads=4,
                                          num_kv_heads=2, dtype=dtype, head_dim=r.head_dim,
                                          page_size=r.page_sizes[-1], q_sign=int(scale), seed=73)
    for w in (None, 5):
        o, lse = run_and_check(backend, inp, scale=scale, window_size=w)
        assert o.isfinite().all() and lse.isfinite().all()


@BACKEND
@pytest.mark.parametrize("scale", [1.1e-38, -2.0 ** -127])
def test_a_scale_subnormal_in_fp32_with_large_scores_gives_the_reference(backend, scale):
    """bf16 q and K entries scaled so that ``q . k`` reaches toward 2**126: at a scale whose fp32 value is a
    subnormal the contract's scores are of order 0.1-1, not 0. Was the mean of the keys a row sees on the cute
    backend (0.04-0.08 off here: the scale ran as 0; cute's CPU test has the bit-for-bit check); the triton
    backend's general path scales first."""
    r = row(backend)
    if torch.bfloat16 not in r.dtypes:
        pytest.skip("bf16's range is the point")
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=torch.bfloat16, head_dim=r.head_dim,
                     page_size=r.page_sizes[-1], seed=72)
    bound = inp["q"].float().norm(dim=-1).max() * inp["k_cache"].float().norm(dim=-1).max()  # >= every |q . k|
    big = 2.0 ** ((126 - bound.log2().ceil().item()) // 2)  # every |q . k| below 2**126: no fp32 overflow
    inp["q"], inp["k_cache"] = inp["q"] * big, inp["k_cache"] * big
    o, lse = run_and_check(backend, inp, scale=scale, window_size=5)
    assert o.isfinite().all() and lse.isfinite().all()


@BACKEND
@pytest.mark.parametrize("paged,i", [(True, 0), (False, 1)])
def test_mixed_output_magnitudes_each_sequence_within_its_own_eager_error(backend, paged, i):
    """Sequence 0's V x 1000 beside O(1) sequences, at every dtype of the row: check_close bounds each sequence by
    its own eager error, so a backend wrong by 0.1 on a small sequence fails here (checked on the backend's own
    output), which the batch-wide eager error (sequence 0's, ~6 in bf16) let pass."""
    r = row(backend)
    for j, dtype in enumerate(r.dtypes):
        inp = make_batch([21, 9, 14, 1], [7, 9, 5, 1], num_causal_q=[7, 0, 2, 1], dtype=dtype, head_dim=r.head_dim,
                         paged=paged, page_size=r.page_sizes[(i + j) % len(r.page_sizes)], poison_unused=True,
                         seed=90 + 4 * i + j)
        inp = scale_v_per_sequence(inp, [1000.0, 1.0, 1.0, 1.0])
        o, _ = run_and_check(backend, inp, config_index=i + j, window_size=(None, 6)[i])
        wrong = o.clone()
        wrong[7:16] = (o[7:16].double() + 0.1).to(dtype)                   # sequence 1 off by 0.1
        with pytest.raises(AssertionError, match=r"^sequence 1 "):
            check_close(wrong, **inp, window_size=(None, 6)[i])


# ---------------------------------------------------------------- non-finite V
@BACKEND
@pytest.mark.parametrize("paged,mode,i", [(True, "symmetric", 0), (False, "prefix", 1)])
def test_nan_and_inf_v_inside_seq_lens_reach_only_the_rows_that_see_them(backend, paged, mode, i):
    """NaN / +Inf / -Inf V at keys inside ``seq_lens``: a causal row's future keys, keys past the window, keys
    anywhere. A key a row may not see contributes nothing; a seen one gives the reference's non-finite entries."""
    r = row(backend)
    inp = make_batch([23, 17, 9], [9, 6, 9], num_causal_q=[9, 0, 4], head_dim=r.head_dim, paged=paged,
                     page_size=r.page_sizes[-1], seed=80 + i)
    bad = poison_v_inside_seq_lens(inp, seed=81 + i, per_seq=6)[0]
    kw = dict(window_size=3, bidirectional_window=mode)
    dev = _to(bad, r.device)
    q, vc = dev["q"], dev["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=r.device)
    o, lse = attention(**dev, out=out, return_lse=True, backend=backend, **r.config_kwargs(i), **kw)
    assert check_nonfinite_matches_reference(o.cpu(), bad, lse=lse.cpu(), **kw) > 0  # some row saw a poisoned key


@BACKEND
@pytest.mark.parametrize("page_size", [None, 8])
def test_underflow_batch_a_seen_key_of_weight_zero_with_nonfinite_v(backend, page_size, request):
    """Key ``key`` is seen by every row but weighs exp(-512) = 0 in fp32 while its V holds NaN / +Inf / -Inf:
    ``0 * NaN`` is the reference's NaN in those columns (the split merges' case, run with the row's last config).
    The 48 keys are one key block of a kernel's tile: a backend whose NaN-safe V scan cleans that block names the
    known gap ``underflow_in_a_cleaned_block`` in its row (a strict xfail)."""
    r = row(backend)
    r.expect_gap(request, "underflow_in_a_cleaned_block")
    q, k, v, kw = make_underflow_batch(max(r.head_dim, 6), 48, 40, (float("nan"), float("inf"), -float("inf")),
                                       page_size=page_size)
    bad = dict(q=q, k_cache=k, v_cache=v, **kw)
    o, lse = attention(**_to(bad, r.device), return_lse=True, backend=backend,
                       **r.config_kwargs(len(r.configs) - 1))
    assert check_nonfinite_matches_reference(o.cpu(), bad, lse=lse.cpu()) > 0


# ---------------------------------------------------------------- fuzz
@st.composite
def contract_cases(draw, r):
    """A random batch and call for one backend's row: up to 4 sequences of causal, bidirectional or mixed rows,
    contexts up to 23 keys, GQA groups 1-4, the row's dtypes, head dim and page sizes, paged or contiguous, a
    window (or none) in either mode, a scale, and one of the row's configs."""
    B = draw(st.integers(0, 4))
    q_lens, seq_lens, ncq = [], [], []
    for _ in range(B):
        ql = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 17]))
        ctx = draw(st.sampled_from([0, 1, 2, 4, 9, 16, 23]))
        kind = draw(st.sampled_from(["causal", "bidir", "mixed"]))
        q_lens.append(ql)
        seq_lens.append(ql + ctx)
        ncq.append(ql if kind == "causal" else 0 if kind == "bidir" else draw(st.integers(0, ql)))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    batch = dict(seq_lens=seq_lens, q_lens=q_lens, num_causal_q=ncq, num_heads=hkv * group, num_kv_heads=hkv,
                 head_dim=r.head_dim, page_size=draw(st.sampled_from(r.page_sizes)),
                 dtype=draw(st.sampled_from(r.dtypes)), paged=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
                 block_table_pad=draw(st.sampled_from(["garbage", "zeros", "nan_page"])),
                 poison_unused=draw(st.booleans()))
    call = dict(window_size=draw(st.sampled_from([None, 0, 1, 2, 3, 5, 8, 16, 40])),
                bidirectional_window=draw(st.sampled_from(["symmetric", "prefix"])),
                scale=draw(st.sampled_from([None, None, 1.0, -0.5])))
    return batch, call, draw(st.integers(0, len(r.configs) - 1))


@BACKEND
def test_fuzz_against_the_reference(backend):
    """Derandomised (tests/conftest.py's profile); the row's ``fuzz_examples`` keep it cheap on the interpreter."""
    r = row(backend)

    @settings(max_examples=r.fuzz_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(contract_cases(r))
    def fuzz(case):
        batch, call, ci = case
        run_and_check(backend, make_batch(**batch), config_index=ci, **call)

    fuzz()
