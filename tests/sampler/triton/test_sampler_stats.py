"""Stage (a) of the Triton sampler (blockdiff.sampler.triton.stats) against the dense reference: row_stats'
argmax, Gumbel-max sample, entropy, normalisers and bad flags (NaN / +inf, or every logit -inf; a -inf logit alone
is p = 0); the greedy skip; the exact Gumbel prefilter (tiles whose elements cannot reach the row's best ``z + g``
skip the two accurate logs: the sample must be the full computation's, whatever the bound's quality within its
stated error, for whole-tile (unmasked) and masked splits, one or several positions per program); row_moments'
normalisers.

CPU: Triton interpreter. ``PREFILTER_LOG_MODE`` 2 moves the bound by up to +-0.0049 (the error the margin allows);
mode 0 uses the exact logs as the bound. Both must give the reference's Gumbel argmax.
"""
import math

import pytest
import torch

from blockdiff.sampler import rng
from blockdiff.sampler.common import overflow_shift
from blockdiff.sampler.reference import entropy_reference
from blockdiff.sampler.triton import stats
from blockdiff.sampler.triton.config import SamplerConfig
from blockdiff.sampler.triton.stats import row_moments, row_stats
from triton_sampler_helpers import DEV, coords


@pytest.mark.parametrize("V,split_v,dtype", [(37, 1, torch.float32), (130, 3, torch.float32), (64, 2, torch.bfloat16)])
def test_row_stats_match_reference(V, split_v, dtype):
    g = torch.Generator().manual_seed(V)
    N, CL = 3, 8
    x = (torch.randn(N, CL, V, generator=g) * 4).to(dtype)
    x[1, 2, 5:9] = x[1, 2].max() + 1  # argmax tie: lowest id
    T = torch.tensor([0.8, 0.4123, 1.7])
    seed, rid, ci, st = coords(N, g)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool), SamplerConfig(split_v=split_v, block_g=8))
    z = x.float() / T[:, None, None]
    gum = rng.gumbel_noise(seed, rid, ci, st, CL, V)
    assert torch.equal(r["argmax"], z.argmax(-1)) and r["argmax"][1, 2].item() == 5
    assert torch.equal(r["gumbel_argmax"], (z + gum).argmax(-1))
    assert torch.allclose(r["entropy"], entropy_reference(z), rtol=1e-5, atol=1e-5)
    assert torch.equal(r["m"], z.max(-1).values)
    assert torch.allclose(r["inv_s"], 1 / torch.exp(z - z.max(-1, keepdim=True).values).sum(-1), rtol=1e-5)
    assert not r["bad"].any()


@pytest.mark.parametrize("block_p", [1, 8])
def test_greedy_rows_statistics_are_unchanged_by_the_gumbel_skip(block_p):
    """A stats program whose valid rows are all greedy (T = 0) skips Philox, the logs and the division; argmax,
    m, inv_s, entropy and bad stay those of z = x, and the sampling rows of the same launch keep their exact
    Gumbel-max ids (block_p 1 is the GPU layout: one program per position; 8 = one program per request here)."""
    g = torch.Generator().manual_seed(7)
    N, CL, V = 4, 8, 70
    x = torch.randn(N, CL, V, generator=g) * 4
    x[2, 3, 11] = float("nan")               # a greedy row's non-finite logit is still flagged
    T = torch.tensor([0.0, 0.8, 0.0, 1.3])
    seed, rid, ci, st = coords(N, g)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool),
                  SamplerConfig(block_p=block_p, split_v=2, block_g=4))
    z = x / torch.where(T == 0, 1.0, T)[:, None, None]
    gum = rng.gumbel_noise(seed, rid, ci, st, CL, V)
    ok = ~r["bad"]
    assert r["bad"][2, 3] and r["bad"].sum() == 1
    assert torch.equal(r["argmax"][ok], z.argmax(-1)[ok])
    assert torch.equal(r["m"][ok], z.max(-1).values[ok])
    assert torch.allclose(r["entropy"][ok], entropy_reference(z)[ok], rtol=1e-5, atol=1e-5)
    assert torch.equal(r["gumbel_argmax"][T != 0], (z + gum).argmax(-1)[T != 0])


def test_row_stats_flags_non_finite_and_skips_inactive_rows():
    N, CL, V = 3, 4, 40
    x = torch.randn(N, CL, V)
    x[0, 1, 3] = float("nan")
    x[0, 2, 39] = float("inf")
    x[2] = float("nan")  # inactive row: never read
    z = torch.zeros(N, dtype=torch.int64)
    r = row_stats(x, torch.full((N,), 0.5), z, z, z, z, torch.tensor([True, True, False]))
    assert r["bad"][0].tolist() == [False, True, True, False] and not r["bad"][1].any()
    assert torch.isnan(r["entropy"][0, 1]) and torch.isfinite(r["entropy"][1]).all()


# ---------------------------------------------------------------------------------------------- prefilter
def _logits(kind, N, CL, V, g):
    if kind == "dense":
        return torch.randn(N, CL, V, generator=g) * 4
    x = torch.randn(N, CL, V, generator=g)
    if kind == "peaked":                       # LM-like: a few tokens far above the rest (most tiles skipped)
        x[..., 3:7] += 12.0
    elif kind == "late_max":                   # the winning region in the last tile: the running best must move
        x[..., -5:] += 9.0
    elif kind == "ties":                       # many equal logits: the lowest id among equal z + g must win
        x = torch.round(x * 2) / 2
    return x


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("kind", ["dense", "peaked", "late_max", "ties"])
@pytest.mark.parametrize("V,block_g,split_v,block_p", [(256, 16, 1, 1), (256, 8, 2, 4), (300, 16, 1, 2), (517, 8, 3, 1)])
def test_gumbel_prefilter_keeps_the_exact_sample(monkeypatch, mode, kind, V, block_g, split_v, block_p):
    monkeypatch.setattr(stats, "PREFILTER_LOG_MODE", mode)
    g = torch.Generator().manual_seed(V * 31 + block_g)
    N, CL = 3, 4
    x = _logits(kind, N, CL, V, g)
    T = torch.tensor([0.8, 0.4, 1.3])
    seed, rid, ci, st = coords(N, g, 0, 2**40)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool),
                  SamplerConfig(block_g=block_g, split_v=split_v, block_p=block_p))
    z = x / T[:, None, None]
    y = z + rng.gumbel_noise(seed, rid, ci, st, CL, V)
    assert torch.equal(r["gumbel_argmax"], y.argmax(-1))
    assert torch.equal(r["argmax"], z.argmax(-1))
    assert torch.equal(r["m"], z.max(-1).values)
    assert torch.allclose(r["entropy"], entropy_reference(z), rtol=1e-5, atol=1e-5)
    assert not r["bad"].any()


def test_prefilter_bound_is_an_upper_bound_up_to_the_margin():
    """``_gumbel_upper`` mode 2 (the test bound) stays within PREFILTER_ABS / 2 of the exact g, and u above the
    near-one cut takes GUMBEL_MAX_BOUND, which exceeds every g the 2**23 uniforms can give."""
    w = torch.arange(0, 2**23, dtype=torch.int64) << 9
    u = rng.uniform_from_word(w)
    gmax = float((-torch.log(-torch.log(u))).max())
    assert gmax < float(stats.GUMBEL_MAX_BOUND.value)
    assert float(u.max()) == 1 - 2**-24
    # the fast GPU bound's worst case below the cut: -log u >= 4.88e-4, lg2.approx absolute error <= 2**-21 (taken
    # 2x the documented 2**-22): g off by <= 2**-21 * ln 2 / 4.88e-4 + 2**-21 * ln 2 < PREFILTER_ABS / 2
    la_min = -torch.log(torch.tensor(float(stats.GUMBEL_NEAR_ONE.value), dtype=torch.float64)).item()
    err = 2**-21 * 0.6931471805599453 / la_min + 2**-21 * 0.6931471805599453
    assert err < float(stats.PREFILTER_ABS.value) / 2
    assert 3 * 0.00163 < float(stats.PREFILTER_ABS.value) / 2          # mode 2's perturbation


def test_nan_and_plus_inf_logits_still_flagged_with_unmasked_tiles_minus_inf_is_not():
    """Whole-tile splits (no masks) flag +inf / NaN through the (x < 0 ? 0 : x) * 0 accumulator, per position; a
    -inf logit is p = 0, not bad (issue 26), unless every logit of the position is -inf (no softmax)."""
    g = torch.Generator().manual_seed(3)
    N, CL, V = 2, 4, 256
    x = torch.randn(N, CL, V, generator=g)
    x[0, 1, 17] = float("inf")
    x[1, 2, 255] = float("nan")
    x[1, 0, 0] = float("-inf")
    x[0, 2, 5] = float("-inf")
    x[0, 3] = float("-inf")
    x[1, 3] = float("-inf")
    T = torch.tensor([0.7, 0.0])
    seed, rid, ci, st = coords(N, g, 0, 2**40)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool), SamplerConfig(block_g=16, split_v=2))
    expect = torch.zeros(N, CL, dtype=torch.bool)
    expect[0, 1] = expect[1, 2] = expect[0, 3] = expect[1, 3] = True
    assert torch.equal(r["bad"], expect)
    assert torch.equal(torch.isnan(r["entropy"]), expect) and torch.equal(torch.isnan(r["step_entropy"]), expect)


@pytest.mark.parametrize("V,split_v,block_p", [(256, 1, 1), (256, 2, 4), (70, 3, 2), (70, 1, 8)])
def test_minus_inf_logits_mean_probability_zero_in_row_stats(V, split_v, block_p):
    """-inf logits (half the vocabulary, all but one token, a whole split, beside 3e38 or -3.3e38 finite logits whose
    z overflows): argmax, Gumbel-max sample, m and shift bit for bit the reference's (z = (x - c) / T of rule 1),
    entropies to float32 rounding, never bad; a position whose every logit is -inf is bad (H = NaN, greedy rows
    too). row_moments: the same m and shift, 0 on the all -inf position. Masked and whole-tile splits."""
    g = torch.Generator().manual_seed(V + split_v)
    N, CL = 3, 7
    x = torch.randn(N, CL, V, generator=g) * 3
    x[:, 0, : V // 2] = -math.inf
    x[:, 1] = -math.inf
    x[:, 1, 13] = 0.3
    x[:, 2, ::3] = -math.inf
    x[:, 2, 4] = 3e38
    x[:, 3] = -3.3e38 + torch.arange(V, dtype=torch.float32) * 1e31
    x[:, 3, 1::2] = -math.inf
    x[:, 4, : V - V // split_v] = -math.inf      # every split but the last all -inf
    x[:, 5, -8:] = -math.inf
    x[:, 6] = -math.inf                          # no finite logit: bad
    T = torch.tensor([0.4, 0.0, 1.0])
    seed, rid, ci, st = coords(N, g, 0, 2**40)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool),
                  SamplerConfig(block_g=16 if V == 256 else 4, split_v=split_v, block_p=block_p))
    tdiv = torch.where(T == 0, 1.0, T)[:, None, None]
    c = overflow_shift(x, tdiv)
    z = (x - c[..., None]) / tdiv
    ok = torch.ones(N, CL, dtype=torch.bool)
    ok[:, 6] = False
    smp = ok & (T != 0)[:, None]
    assert torch.equal(r["bad"], ~ok) and torch.isnan(r["step_entropy"][:, 6]).all()
    assert torch.equal(r["shift"], c) and (c[0, 2:4] != 0).all()     # T = 0.4: shifted form
    assert torch.equal(r["argmax"][ok], z.argmax(-1)[ok]) and (r["argmax"][:, 1] == 13).all()
    assert torch.equal(r["gumbel_argmax"][smp], (z + rng.gumbel_noise(seed, rid, ci, st, CL, V)).argmax(-1)[smp])
    assert torch.equal(r["m"][ok], z.amax(-1)[ok])
    assert torch.allclose(r["entropy"][ok], entropy_reference(z)[ok], rtol=1e-5, atol=1e-5)
    m2, inv_s2, shift2 = row_moments(x, T, torch.ones(N, dtype=torch.bool))
    assert torch.equal(m2[smp], r["m"][smp]) and torch.equal(shift2[smp], r["shift"][smp])
    torch.testing.assert_close(inv_s2[smp], r["inv_s"][smp], rtol=1e-6, atol=0)
    assert (m2[:, 6] == 0).all() and (inv_s2[:, 6] == 0).all() and (shift2[:, 6] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "peaked", "late_max", "ties"])
@pytest.mark.parametrize("V,split_v", [(262144, 1), (100003, 4)])
def test_gpu_prefilter_with_fast_logs_keeps_the_exact_sample(kind, V, split_v):
    """On the GPU the bound uses lg2.approx (FAST_LOG 1): the sample still equals torch's argmax(z + g) (torch's
    CUDA log and the kernel's libdevice logf are the same function), on whole-tile and masked splits."""
    g = torch.Generator().manual_seed(11)
    N, CL = 3, 64
    x = _logits(kind, N, CL, V, g).cuda()
    T = torch.tensor([0.8, 0.4, 1.3], device="cuda")
    seed, rid, ci, st = (t.cuda() for t in coords(N, g, 0, 2**40))
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool, device="cuda"),
                  SamplerConfig(split_v=split_v))
    z = x / T[:, None, None]
    y = z + rng.gumbel_noise(seed, rid, ci, st, CL, V)
    assert torch.equal(r["gumbel_argmax"], y.argmax(-1))
    assert torch.equal(r["argmax"], z.argmax(-1))


# ---------------------------------------------------------------------------------------------- row_moments
def test_row_moments_normalise_the_sampling_rows_only():
    """row_moments: m = max(x / T) and inv_s = 1 / sum exp(x / T - m) within float32 rounding on active T > 0 rows;
    greedy and inactive rows untouched (0), NaN logits stay in their row."""
    g = torch.Generator().manual_seed(3)
    N, CL, V = 4, 3, 150
    x = (torch.randn(N, CL, V, generator=g) * 5).to(DEV)
    x[1, 0, 7] = float("nan")
    T = torch.tensor([0.7, 1.0, 0.0, 2.5], device=DEV)
    act = torch.tensor([True, True, True, False], device=DEV)
    m, inv_s, shift = row_moments(x, T, act)
    assert (shift == 0).all()                     # rule 1's shift: nothing overflows here
    z = x.double() / T.double().clamp_min(1e-30)[:, None, None]
    zm = z.max(-1).values
    ref_inv = 1 / torch.exp(z - zm[..., None]).sum(-1)
    ok = torch.tensor([True, True, False, False], device=DEV)[:, None].expand(N, CL).clone()
    ok[1, 0] = False
    assert torch.allclose(m[ok].double(), zm[ok], rtol=1e-6)
    assert torch.allclose(inv_s[ok].double(), ref_inv[ok], rtol=1e-5)
    assert (m[2:] == 0).all() and (inv_s[2:] == 0).all()
    assert torch.isnan(m[1, 0]) or torch.isnan(inv_s[1, 0])


@pytest.mark.parametrize("name", ["seed", "request_id", "canvas_index", "step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_row_stats_refuses_a_float_or_bool_coordinate_naming_it(name, dtype):
    """The kernel reads the draw coordinates as int64 (``.to(tl.int64)``): a float seed of 1.9 drew seed 1's noise
    where :mod:`blockdiff.sampler.rng` (break26b) and the TP shard (review26) raise. row_stats now refuses it too,
    naming the coordinate, before any launch."""
    N, CL, V = 2, 4, 16
    args = dict(seed=torch.tensor([3, 4]), request_id=torch.tensor([5, 6]), canvas_index=torch.tensor([0, 1]),
                step=torch.tensor([2, 2]))
    args[name] = torch.full((N,), 1.9) if dtype.is_floating_point else torch.ones(N, dtype=dtype)
    with pytest.raises(TypeError, match=name):
        row_stats(torch.randn(N, CL, V), torch.ones(N), *args.values(), torch.ones(N, dtype=torch.bool))
