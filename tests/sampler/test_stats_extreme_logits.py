"""Finite logits of extreme magnitude (|z| up to float32's max) are valid inputs: the streaming softmax of the stats
kernels must give the reference's finite entropy and max there, not a NaN that fails the request.

Found in review: the lane / split merges and the online update computed ``0 * inf`` when ``z - m`` overflowed
(a finite z far above the lane's max, a split or lane whose max is far below the row's), and the running max
started at -3e38, above finite z in [-3.4e38, -3e38) (dropped from the sums: s = 0, H = NaN).
CPU: Triton interpreter.
"""
import pytest
import torch

from blockdiff.sampler import sampler_step
from blockdiff.sampler.reference import entropy_reference
from blockdiff.sampler.tp import local_statistics, make_shards
from blockdiff.sampler.tp.triton import local_statistics_triton
from blockdiff.sampler.triton.config import SamplerConfig
from blockdiff.sampler.triton.stats import row_stats

from sampler_helpers import P, make_state, start_denoise


def _extreme(V, g):
    """[1, 5, V] finite logits: each position breaks one overflow path (T = 1 keeps z = x)."""
    x = torch.randn(5, V, generator=g)
    x[0] = x[0] * 1e36 + 5e37                    # d = z - m overflows for a lane's first element
    x[1] = -3.1e38 - torch.rand(V, generator=g) * 3e37      # every z below -3e38 (the former initial max)
    x[2, : V // 2] = -3.4e38                     # the first half / split far below the rest: m_k - M = -inf
    x[2, V // 2:] = 1e38 + torch.rand(V - V // 2, generator=g) * 1e37
    x[3, :5] = 2e38                              # lanes whose max is -2e38: m_l - M overflows
    x[3, 5:] = -2e38
    x[4] = torch.randn(V, generator=g)           # an ordinary row beside them
    return x[None]


@pytest.mark.parametrize("split_v,block_p", [(1, 1), (2, 2), (3, 8)])
def test_extreme_finite_logits_keep_the_reference_entropy_and_max(split_v, block_p):
    g = torch.Generator().manual_seed(split_v)
    V = 64
    x = _extreme(V, g)
    T = torch.tensor([1.0])
    z = x / T
    c = torch.zeros(1, dtype=torch.int64)
    r = row_stats(x, T, c, c, c.int(), c.int(), torch.ones(1, dtype=torch.bool),
                  SamplerConfig(block_g=4, split_v=split_v, block_p=block_p))
    assert not r["bad"].any()
    assert torch.equal(r["m"], z.max(-1).values)
    assert torch.equal(r["argmax"], z.argmax(-1))
    assert torch.isfinite(r["entropy"]).all(), r["entropy"]
    assert torch.allclose(r["entropy"], entropy_reference(z), rtol=1e-5, atol=1e-5)


def test_extreme_finite_logits_do_not_fail_the_request():
    """End to end: the Triton backend neither fails the row nor decides differently from the reference."""
    V, CL = 64, 5
    g = torch.Generator().manual_seed(7)
    x = _extreme(V, g)
    outs = []
    for backend in ("reference", "triton"):
        st, slots = make_state([P(canvas_length=CL, t_min=1.0, t_max=1.0)], cl=CL, v=V)
        start_denoise(st, slots)
        o = sampler_step(st, slots, x, torch.zeros(1, dtype=torch.bool), torch.zeros(V, st.hidden_size),
                         backend=backend)
        outs.append(o)
    ref, tri = outs
    assert not ref.failed.any() and not tri.failed.any()
    for f in ("accepted", "argmax", "sampled", "next_canvas", "converged"):
        assert torch.equal(getattr(ref, f), getattr(tri, f)), f


def test_extreme_finite_logits_keep_the_reference_entropy_in_the_tp_shard_pass():
    """The tensor-parallel shard kernel (blockdiff.sampler.tp.triton) runs the same streaming softmax."""
    g = torch.Generator().manual_seed(3)
    V = 64
    x = _extreme(V, g)
    T = torch.tensor([1.0])
    c = torch.zeros(1, dtype=torch.int64)
    for sh in make_shards(V, (0, 33, V)):
        lg = x[..., sh.start:sh.end].contiguous()
        a = local_statistics(lg, T, c, c, c, c, sh).packed
        b = local_statistics_triton(lg, T, c, c, c, c, torch.ones(1, dtype=torch.bool), sh,
                                    SamplerConfig(block_g=4, split_v=2)).packed
        assert torch.equal(a[..., 0], b[..., 0])                    # max
        assert torch.isfinite(b[..., 1:3]).all(), b[..., 1:3]        # s, u
        assert torch.allclose(a[..., 1:3], b[..., 1:3], rtol=1e-5, atol=1e-5)


def _float64_beyond_float32(V, g):
    """[1, 5, V] float64 logits: finite values beyond float32's range (1e39, 1e300, -1e300) beside ordinary ones."""
    x = torch.randn(5, V, generator=g, dtype=torch.float64)
    x[0, 7] = 1e300                               # one token far beyond float32: the argmax
    x[1, 3], x[1, 9] = 1e39, 2e39                 # two beyond it: they tie at FLT_MAX (the lowest id first)
    x[2, :] = -1e300                              # every logit far below float32's range: uniform
    x[3, : V // 2] = -1e300                       # half beyond the range below: p = 0 there
    return x[None]


@pytest.mark.parametrize("tp", [None, "reference", "triton"])
def test_float64_logits_beyond_float32_range_saturate_and_never_fail_the_request(tp):
    """Was: float32(1e300) = +inf failed the request, though the docs said finite logits never do. Finite float64
    logits saturate to +-FLT_MAX (sampler.common.saturate_logits), in every backend, bit for bit as the reference
    on the saturated float32 tensor; NaN / +inf still fail."""
    from blockdiff.sampler.common import FLOAT32_MAX
    from blockdiff.sampler.tp import sampler_step_sharded

    V, CL = 64, 5
    x = _float64_beyond_float32(V, torch.Generator().manual_seed(11))
    x32 = x.clamp(-FLOAT32_MAX, FLOAT32_MAX).to(torch.float32)     # the definition
    assert torch.isfinite(x32).all()
    outs = []
    for backend, logits in (("reference", x32), ("reference", x), ("triton", x), ("tp", x)):
        st, slots = make_state([P(canvas_length=CL, t_min=0.5, t_max=1.0)], cl=CL, v=V)
        start_denoise(st, slots)
        args = (st, slots, logits, torch.zeros(1, dtype=torch.bool), torch.zeros(V, st.hidden_size))
        if backend == "tp":
            if tp is None:
                continue
            outs.append(sampler_step_sharded(*args, bounds=(0, 29, V), backend=tp))
        else:
            outs.append(sampler_step(*args, backend=backend))
    ref = outs[0]
    assert not ref.failed.any()
    assert ref.argmax[0, 0].item() == 7 and ref.argmax[0, 1].item() == 3
    for o in outs[1:]:
        assert not o.failed.any()
        for f in ("accepted", "argmax", "sampled", "next_canvas", "converged"):
            assert torch.equal(getattr(ref, f), getattr(o, f)), f
        assert torch.allclose(ref.entropy, o.entropy, rtol=1e-5, atol=1e-6)
    assert torch.equal(ref.entropy, outs[1].entropy)                 # the reference: bit for bit


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_float64_nan_or_inf_logits_still_fail_the_request(bad, backend):
    V, CL = 64, 5
    x = _float64_beyond_float32(V, torch.Generator().manual_seed(12))
    x[0, 4, 1] = bad
    st, slots = make_state([P(canvas_length=CL)], cl=CL, v=V)
    start_denoise(st, slots)
    o = sampler_step(st, slots, x, torch.zeros(1, dtype=torch.bool), torch.zeros(V, st.hidden_size), backend=backend)
    assert o.failed.all()
