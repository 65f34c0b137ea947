"""The CPU simulation of cute's NaN-safe V by recompute (docs/tuning.md 2.32;
``blockdiff.bench.experiments.sim_cute_nan_recompute``): the design against the dense reference's contract
(docs/ARCHITECTURE.md section 4) on small shapes (head dim 16 / 32, 128-row tiles, 64- or 128-key blocks), and the
variants that would break it. Hypothesis runs under the repo's derandomized profile (tests/conftest.py)."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blockdiff.attention.testing import make_batch, make_underflow_batch
from blockdiff.bench.experiments import sim_cute_nan_recompute as sim
from blockdiff.bench.experiments import sim_cute_nan_v_race as race

NAN, INF = float("nan"), float("inf")
VALUES = (NAN, INF, -INF)
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _nonfinite_kind(val):
    return torch.isnan if val != val else (torch.isposinf if val > 0 else torch.isneginf)


def _check(res, inp, **kw):
    rep = sim.compare(res, inp, **kw)
    assert rep["ok"], {k: v for k, v in rep.items() if k != "tol_msg" or v}
    return rep


@st.composite
def scenarios(draw, poisoned=True, scales=(None,), max_splits=4):
    """A small mixed batch, a window, a tile / split geometry and (``poisoned``) up to 3 NaN / +-Inf V entries at
    positions of the kinds of :func:`sim.poison_candidates` (or none). ``scales``: softmax scales to draw from (None:
    head_dim ** -0.5; large ones make weights underflow)."""
    qpk = draw(st.sampled_from([1, 2, 3]))
    hk = draw(st.sampled_from([1, 1, 2]))
    tn = draw(st.sampled_from([64, 128]))
    ns = draw(st.integers(1, max_splits))
    n_seq = draw(st.integers(1, 3))
    q_lens, seq_lens, ncqs = [], [], []
    for _ in range(n_seq):
        # query lengths at PackGQA tile edges (128 / qpk tokens) and block edges; the context may be < L, or 0
        L = draw(st.one_of(st.sampled_from([1, 2, 42, 43, 63, 64, 65, 100, 128, 129, 150]), st.integers(1, 150)))
        ctx = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 200, 260]), st.integers(0, 260)))
        q_lens.append(L)
        seq_lens.append(ctx + L)
        ncqs.append(draw(st.one_of(st.just(0), st.just(L), st.integers(0, L))))
    W = draw(st.sampled_from([None, 0, 1, 7, tn - 1, tn, tn + 1, 127, 2 ** 30]))
    prefix = draw(st.booleans())
    paged = draw(st.booleans())
    hd = draw(st.sampled_from([16, 32]))
    inp = make_batch(seq_lens, q_lens, num_causal_q=ncqs, num_heads=qpk * hk, num_kv_heads=hk, head_dim=hd,
                     page_size=draw(st.sampled_from([8, 16, 64])), paged=paged, seed=draw(st.integers(0, 1000)),
                     poison_unused=draw(st.booleans()))
    scale = draw(st.sampled_from(scales))
    if scale is not None:
        inp["scale"] = scale
    kw = dict(window_size=W, bidirectional_window="prefix" if prefix else "symmetric")
    geo = dict(tile_n=tn, num_splits=ns)
    poisons, kinds = [], []
    if poisoned:
        specs = draw(st.lists(st.tuples(st.sampled_from(sim.POISON_KINDS + ("none",)), st.sampled_from(VALUES),
                                        st.integers(0, 10 ** 6)), min_size=1, max_size=3))
        for kind, val, r in specs:
            if kind == "none":
                continue
            cands = sim.poison_candidates(inp, kind, **kw, **geo)
            if not cands:
                event(f"no position of kind {kind}")
                continue
            b, pos = cands[r % len(cands)]
            poisons.append((b, pos, (r // 7) % hk, (r // 11) % hd, val))
            kinds.append(kind)
    event(f"qpk {qpk}, splits {ns}, tile_n {tn}")
    return inp, kw, geo, poisons, kinds


# ------------------------------------------------------------------------------------------------ the model itself
def test_split_ranges_keep_the_tile_model_the_h200_counts_checked():
    """The tile / split / block-order model (``split_ranges``, which ``sim_cute_nan_v_race.tile_masked_blocks`` now
    calls) gives, over this grid at qpk 2 and 128-key blocks, exactly what the race simulation's own model gave when
    the two were separate implementations (checked equal at e65e694; the race simulation's counts match the H200
    log): a digest of the 3,120 results."""
    import hashlib
    assert (race.TM, race.TN, race.QPK) == (sim.TM, 128, 2)
    out = []
    for Lq, ctx, W, prefix, ns in itertools.product([1, 63, 64, 65, 200], [0, 5, 300], [None, 0, 40, 127, 128],
                                                    [False, True], [1, 2, 3, 4]):
        S = ctx + Lq
        for ncq in sorted({0, Lq // 2, Lq}):
            for m in range(-(-(Lq * 2) // sim.TM)):
                out.append(sim.split_ranges(m, Lq, S, ncq, W, prefix and W is not None, ns, 2, 128))
    assert len(out) == 3120
    assert hashlib.sha256(repr(out).encode()).hexdigest() == (
        "3b2fe66c95774380c56ef9d98f9579edfb404519858833a4211a519dc813060c")


# ------------------------------------------------------------------------------------------------ the design
@settings(max_examples=120, deadline=None, suppress_health_check=SLOW_OK)
@given(scenarios())
def test_recompute_matches_reference_nonfinite_pattern(sc):
    """NaN / +-Inf positions equal the reference's, finite entries and the LSE within the tolerance rule, for NaN /
    +-Inf V at keys some rows may not see in later masked blocks, allowed keys of the last block, keys every row
    sees and rows past seq_len, over batch mixes, windows, PackGQA 1-3 and 1-4 splits; and no warp recomputes when
    every poison lies past seq_len (the producer zeroes those V rows)."""
    inp, kw, geo, poisons, kinds = sc
    for k in set(kinds):
        event(f"poison {k}")
    bad = sim.apply_poisons(inp, poisons)
    res = sim.simulate(bad, **kw, **geo)
    _check(res, bad, **kw)
    if res.zero_rows:
        event("a contaminated split row with no allowed key got 0")
    if res.entries_made_finite:
        event("the recompute made entries finite (keys the row may not see)")
    if res.empty_splits:
        event("an empty split")
    if all(k == "past_seq_len" for k in kinds):
        assert res.warps_recomputed == 0


@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OK)
@given(scenarios(scales=(4.0, 16.0, 64.0), max_splits=1))
def test_recompute_matches_reference_nonfinite_pattern_with_underflowing_weights_at_one_split(sc):
    """Scales 4-64 spread a row's scores over hundreds of nats, so seen keys weigh 0 or a subnormal in fp32: at one
    split the recompute (fp32 P from the final lse, with subnormals) gives the reference's p * v, including 0 * Inf =
    NaN where the online softmax alone had left +-Inf (a key met before the row's max)."""
    inp, kw, geo, poisons, kinds = sc
    bad = sim.apply_poisons(inp, poisons)
    base = sim.simulate(bad, recompute=False, **kw, **geo)
    res = sim.simulate(bad, **kw, **geo)
    rep = _check(res, bad, **kw)
    if rep["ref_nonfinite"]:
        event("the reference has non-finite entries")
    if bool((torch.isinf(base.out) & torch.isnan(res.out)).any()):
        event("the recompute turned the mainloop's +-Inf into the reference's NaN")


@settings(max_examples=30, deadline=None, suppress_health_check=SLOW_OK)
@given(scenarios(poisoned=False))
def test_no_recompute_on_finite_caches(sc):
    """A cache finite inside seq_lens (NaN past it, where drawn): no warp recomputes, the output is the
    reference's."""
    inp, kw, geo, _, _ = sc
    res = sim.simulate(inp, **kw, **geo)
    assert res.warps_recomputed == 0 and res.entries_recomputed == 0
    _check(res, inp, **kw)


def test_no_recompute_on_finite_cache_with_padded_packgqa_rows():
    """3 query heads per KV head (128 % 3 != 0) and 10 tokens: rows 30-127 of the tile are padding with stale (NaN)
    Q. Their accumulator is NaN, but the test counts real rows only, so no warp recomputes; counting the padding rows
    (2.32 F4) would recompute on a finite cache."""
    inp = make_batch([50, 9], [10, 9], num_causal_q=[4, 9], num_heads=3, num_kv_heads=1, head_dim=16, page_size=16,
                     poison_unused=True, seed=3)
    res = sim.simulate(inp, tile_n=64, num_splits=2)
    assert res.warps_recomputed == 0
    _check(res, inp)
    padded = sim.simulate(inp, tile_n=64, num_splits=2, detect_padded_rows=True)
    assert padded.warps_recomputed > 0


def _masked_later_batch():
    """One causal sequence of 128 queries over 328 keys, 64-key blocks: the tile's first block is 5, blocks 4 and 3
    are right-masked, and key 230 (block 3) lies past the interval of rows 0-29 (hi = 200 + row)."""
    inp = make_batch([328], [128], num_causal_q=[128], num_heads=1, num_kv_heads=1, head_dim=16, page_size=16,
                     poison_unused=True, seed=5)
    assert (0, 230) in sim.poison_candidates(inp, "masked_later", tile_n=64)
    return inp


@pytest.mark.parametrize("val", VALUES, ids=["nan", "posinf", "neginf"])
def test_nonfinite_v_at_a_key_some_rows_may_not_see_in_a_later_masked_block(val):
    """The mainloop alone gives NaN in the column of every row (0 * NaN, 0 * Inf); the recompute makes rows 0-29,
    which may not see the key, finite again and leaves the value of the rows that see it."""
    bad = sim.apply_poisons(_masked_later_batch(), [(0, 230, 0, 5, val)])
    base = sim.simulate(bad, tile_n=64, recompute=False)
    assert torch.isnan(base.out[:30, 0, 5]).all()
    res = sim.simulate(bad, tile_n=64)
    _check(res, bad)
    assert torch.isfinite(res.out[:30, 0, 5]).all()
    assert _nonfinite_kind(val)(res.out[30:, 0, 5]).all()
    assert res.warps_recomputed == 8 and res.warpgroups_flagged == 2  # the whole tile multiplied the block


@pytest.mark.parametrize("val", VALUES, ids=["nan", "posinf", "neginf"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nonfinite_v_at_an_allowed_key_in_the_last_block(val, num_splits):
    """The last key (block 5 of 64 keys) is seen by every bidirectional row and the last causal row: exactly
    those rows get it, with its sign."""
    inp = make_batch([328], [128], num_causal_q=[40], num_heads=2, num_kv_heads=1, head_dim=32, page_size=8,
                     poison_unused=True, seed=6)
    bad = sim.apply_poisons(inp, [(0, 327, 0, 9, val)])
    res = sim.simulate(bad, tile_n=64, num_splits=num_splits)
    _check(res, bad)
    assert _nonfinite_kind(val)(res.out[40:, :, 9]).all() and torch.isfinite(res.out[:40, :, 9]).all()


@pytest.mark.parametrize("val", VALUES, ids=["nan", "posinf", "neginf"])
def test_nonfinite_v_at_a_key_every_row_sees(val):
    inp = make_batch([300, 70], [90, 70], num_causal_q=[30, 0], num_heads=6, num_kv_heads=2, head_dim=16,
                     paged=False, seed=7)
    bad = sim.apply_poisons(inp, [(0, 3, 1, 2, val)])
    res = sim.simulate(bad, tile_n=128, num_splits=4)
    _check(res, bad)
    assert _nonfinite_kind(val)(res.out[:90, 3:, 2]).all() and torch.isfinite(res.out[90:]).all()


def test_windowed_split_row_with_no_allowed_key_gets_zero_and_merges_to_the_reference():
    """Window 10, 128 bidirectional rows, 64-key blocks, 2 splits: row 0 ([0, 10]) has no key in split 1 (keys
    64-127), which holds a NaN at key 100. Its split-1 row sum is 0, so lse = -inf and the accumulator is left
    unscaled with 0 * NaN in column 3; the recompute gives 0 there, which keeps it out of the merge. Without the
    recompute the merge multiplies that NaN by weight 0 and passes it on."""
    inp = make_batch([128], [128], num_causal_q=[0], num_heads=1, num_kv_heads=1, head_dim=16, page_size=16, seed=8)
    bad = sim.apply_poisons(inp, [(0, 100, 0, 3, NAN)])
    kw = dict(window_size=10)
    base = sim.simulate(bad, tile_n=64, num_splits=2, recompute=False, keep_partials=True, **kw)
    assert torch.isnan(base.partials[(0, 0, 0)][0][1, 0, 3]) and torch.isnan(base.out[0, 0, 3])
    res = sim.simulate(bad, tile_n=64, num_splits=2, keep_partials=True, **kw)
    Os, Ls = res.partials[(0, 0, 0)]
    assert Ls[1, 0] == -INF and bool((Os[1, 0] == 0).all())
    assert (0, 0, 0, 1, 0, 0) in res.zero_rows
    _check(res, bad, **kw)
    assert torch.isnan(res.out[90:111, 0, 3]).all()
    assert torch.isfinite(res.out[:90, 0, 3]).all() and torch.isfinite(res.out[111:, 0, 3]).all()


def test_causal_row_with_no_key_in_a_later_split_gets_zero_without_any_window():
    """Not only windows: with 3 splits of the causal tile's 6 blocks, split 2 holds keys 256-327, past the diagonal of
    rows 0-55 (hi = 200 + row). A NaN at key 300 leaves their split-2 accumulator NaN with lse = -inf; the recompute
    gives 0 there and the merge matches the reference."""
    bad = sim.apply_poisons(_masked_later_batch(), [(0, 300, 0, 1, NAN)])
    res = sim.simulate(bad, tile_n=64, num_splits=3, keep_partials=True)
    Os, Ls = res.partials[(0, 0, 0)]
    assert bool((Ls[2, :56] == -INF).all()) and bool((Os[2, :56] == 0).all())
    assert {(0, 0, 0, 2, r, 0) for r in range(56)} <= set(res.zero_rows)
    _check(res, bad)
    assert torch.isfinite(res.out[:100, 0, 1]).all() and torch.isnan(res.out[100:, 0, 1]).all()


def test_rows_past_seq_lens_recompute_on_every_step_without_the_producers_zeroing():
    """The design's assumption: the producer zeroes V rows past seq_len. Without it a NaN there (a freed page's tail)
    makes the recompute run on a finite cache (the slow path every step), though the output is still right."""
    inp = make_batch([50, 9], [10, 9], num_causal_q=[4, 9], num_heads=2, num_kv_heads=1, head_dim=16, page_size=16,
                     poison_unused=True, seed=3)
    assert sim.simulate(inp, tile_n=64).warps_recomputed == 0
    res = sim.simulate(inp, tile_n=64, producer_zeroes_tail=False)
    assert res.warps_recomputed > 0
    _check(res, inp)


# ------------------------------------------------------------------------------------------------ variants
def test_recompute_multiplying_masked_keys_by_zero_gives_nan_where_the_reference_is_finite():
    """The recompute must select out keys the row may not see: adding P = 0 times their V (as the first
    draft of ``_recompute_key`` did, fixed before its first GPU run) gives back 0 * NaN in rows 0-29."""
    bad = sim.apply_poisons(_masked_later_batch(), [(0, 230, 0, 5, NAN)])
    res = sim.simulate(bad, tile_n=64, masked_terms="multiply")
    rep = sim.compare(res, bad)
    assert not rep["ok"] and rep["nan"] == (30, 0)
    assert torch.isnan(res.out[:30, 0, 5]).all()


def _subnormal_weight_batch(val):
    """make_underflow_batch with key 5 at score 95 instead of 512: every other key weighs exp(-95) ~ 5.5e-42, a
    subnormal fp32 (bf16's smallest subnormal is 2^-133 ~ 9.2e-41, so P rounds to 0 in the mainloop); key 40 holds
    ``val`` in column 3."""
    q, k, v, kw = make_underflow_batch(16, 64, 40, values=(val,))
    k[5, 0, 0] = 11.875  # x scale 8 = 95
    return dict(q=q, k_cache=k, v_cache=v, **kw)


@pytest.mark.parametrize("val", [INF, -INF], ids=["posinf", "neginf"])
def test_inf_at_an_allowed_key_with_subnormal_weight_keeps_its_sign(val):
    """The reference gives +-Inf (p * Inf, p subnormal > 0). The mainloop alone gives NaN (bf16 P = 0); the fp32
    recompute with subnormals gives the reference's +-Inf."""
    inp = _subnormal_weight_batch(val)
    assert torch.isnan(sim.simulate(inp, tile_n=64, recompute=False).out[..., 3]).all()
    res = sim.simulate(inp, tile_n=64)
    _check(res, inp)
    assert _nonfinite_kind(val)(res.out[..., 3]).all()


@pytest.mark.xfail(strict=True, reason="counterexample (docs/tuning.md 2.32's P = exp2(...) with a flush-to-zero "
                   "exp2, e.g. fastmath ex2.approx.ftz.f32): an Inf V entry of an allowed key whose weight exp(-95) is "
                   "subnormal gives 0 * Inf = NaN where the reference's p * Inf is +-Inf")
@pytest.mark.parametrize("val", [INF, -INF], ids=["posinf", "neginf"])
def test_inf_at_an_allowed_key_with_subnormal_weight_keeps_its_sign_with_a_ftz_exp2(val):
    inp = _subnormal_weight_batch(val)
    res = sim.simulate(inp, tile_n=64, exp2_ftz=True)
    _check(res, inp)


def test_inf_of_a_seen_key_whose_weight_underflows_gives_nan_at_one_split():
    """sim.split_product_underflow_batch: key 100's weight exp(-120) is 0 in fp32, its V = +Inf, so the reference
    has 0 * Inf = NaN. At one split the mainloop alone gives +Inf (block 1 runs first, before block 0's max:
    P = exp(-60)); the recompute from the final lse gives the reference's NaN."""
    inp = sim.split_product_underflow_batch()
    assert torch.isposinf(sim.simulate(inp, tile_n=64, recompute=False).out[0, 0, 3])
    res = sim.simulate(inp, tile_n=64)
    _check(res, inp)
    assert torch.isnan(res.out[0, 0, 3])


@pytest.mark.xfail(strict=True, reason="counterexample: split-KV factors a seen key's weight into (its weight in the "
                   "split) x (the split's merge weight); each is representable in fp32 (~1.6e-28, ~5e-25) but their "
                   "product exp(-120) is not, so an Inf V entry gives +Inf where the reference's p * Inf with p = 0 "
                   "is NaN (2 splits of 64-key blocks: column 3 = +Inf). The triton backend's split path gives +Inf "
                   "too (CPU interpreter, 2 splits), NaN at 1")
def test_inf_of_a_seen_key_whose_weight_underflows_gives_nan_at_two_splits():
    inp = sim.split_product_underflow_batch()
    _check(sim.simulate(inp, tile_n=64, num_splits=2), inp)
