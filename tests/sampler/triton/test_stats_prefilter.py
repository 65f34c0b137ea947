"""The stats kernel's Gumbel prefilter (issue 5): tiles whose elements cannot reach the row's best ``z + g`` skip
the two accurate logs. The sample must be the full computation's, whatever the bound's quality within its
stated error, for whole-tile (unmasked) and masked splits, one or several positions per program.

CPU: Triton interpreter. ``PREFILTER_LOG_MODE`` 2 moves the bound by up to +-0.0049 (the error the margin allows);
mode 0 uses the exact logs as the bound. Both must give the reference's Gumbel argmax.
"""
import pytest
import torch

from blockdiff.sampler import rng
from blockdiff.sampler.triton import kernels as ts
from blockdiff.sampler.reference import entropy_reference
from blockdiff.sampler.triton.kernels import SamplerConfig, row_stats


def _coords(n, g):
    seed = torch.randint(0, 2**62, (n,), generator=g)
    rid = torch.randint(0, 2**40, (n,), generator=g)
    return seed, rid, torch.randint(0, 70000, (n,), generator=g).int(), torch.randint(0, 48, (n,), generator=g).int()


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
    monkeypatch.setattr(ts, "PREFILTER_LOG_MODE", mode)
    g = torch.Generator().manual_seed(V * 31 + block_g)
    N, CL = 3, 4
    x = _logits(kind, N, CL, V, g)
    T = torch.tensor([0.8, 0.4, 1.3])
    seed, rid, ci, st = _coords(N, g)
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
    assert gmax < float(ts.GUMBEL_MAX_BOUND.value)
    assert float(u.max()) == 1 - 2**-24
    # the fast GPU bound's worst case below the cut: -log u >= 4.88e-4, lg2.approx absolute error <= 2**-21 (taken
    # 2x the documented 2**-22): g off by <= 2**-21 * ln 2 / 4.88e-4 + 2**-21 * ln 2 < PREFILTER_ABS / 2
    la_min = -torch.log(torch.tensor(float(ts.GUMBEL_NEAR_ONE.value), dtype=torch.float64)).item()
    err = 2**-21 * 0.6931471805599453 / la_min + 2**-21 * 0.6931471805599453
    assert err < float(ts.PREFILTER_ABS.value) / 2
    assert 3 * 0.00163 < float(ts.PREFILTER_ABS.value) / 2          # mode 2's perturbation


def test_non_finite_logits_still_flagged_with_unmasked_tiles():
    """Whole-tile splits (no masks) flag inf / NaN through the x * 0 accumulator, per position."""
    g = torch.Generator().manual_seed(3)
    N, CL, V = 2, 3, 256
    x = torch.randn(N, CL, V, generator=g)
    x[0, 1, 17] = float("inf")
    x[1, 2, 255] = float("nan")
    x[1, 0, 0] = float("-inf")
    T = torch.tensor([0.7, 0.0])
    seed, rid, ci, st = _coords(N, g)
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool), SamplerConfig(block_g=16, split_v=2))
    expect = torch.zeros(N, CL, dtype=torch.bool)
    expect[0, 1] = expect[1, 2] = expect[1, 0] = True
    assert torch.equal(r["bad"], expect)


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
    seed, rid, ci, st = (t.cuda() for t in _coords(N, g))
    r = row_stats(x, T, seed, rid, ci, st, torch.ones(N, dtype=torch.bool, device="cuda"),
                  SamplerConfig(split_v=split_v))
    z = x / T[:, None, None]
    y = z + rng.gumbel_noise(seed, rid, ci, st, CL, V)
    assert torch.equal(r["gumbel_argmax"], y.argmax(-1))
    assert torch.equal(r["argmax"], z.argmax(-1))
