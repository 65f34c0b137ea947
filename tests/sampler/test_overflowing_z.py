"""Rule 1 of docs/ARCHITECTURE.md "Sampler semantics": where the largest z = x / T of a position overflows (finite
logits near float32's max at T < 1, every z below -FLT_MAX, a tiny temperature written into the state), the position
takes z = (x - max x) / T instead of failing the request, and every backend (reference, triton with each soft path
and split, tensor-parallel with either local pass) decides exactly as the reference: decisions and state bit for
bit, entropies to float32 rounding, soft rows close. Positions that do not overflow keep z = x / T.

Before: the reference and the TP combine failed such rows (NaN entropy) and the triton stats pass did too, so
every request with such logits ended FAILED. Runs where DEV is: the CPU (the Triton interpreter), or CUDA (the
kernels compiled) on a GPU machine.
"""
import math

import pytest
import torch

from blockdiff.sampler import DENOISE, SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.tp import sampler_step_sharded
from blockdiff.sampler.triton import SamplerConfig
from blockdiff.sampler.triton import sampler_step as triton_sampler_step
from blockdiff.sampler.triton.stats import row_moments, row_stats

CL, V, H = 6, 40, 8
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_emitted_now", "num_sampled", "num_rejected", "temperature")
STATE = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index", "num_emitted")
FMAX = torch.finfo(torch.float32).max
#: where the steps run: CUDA where present (the triton kernels compiled; under the interpreter they take CPU
#: tensors only), else the CPU. Logits and weights are drawn on the CPU (the same numbers either way), then moved.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def overflow_logits(step, g):
    """[4, CL, V] finite logits. Row 0 (T 0.8 -> 0.4): a unique max at 3e38 (z = +inf), a tie at float32's max on
    ids 3 and V - 2 (across every split and shard boundary below), every logit below -3.3e38 with ties by rounding
    (every z = -inf), an ordinary position, finfo.min masks (z = -inf, no shift). Row 1: ordinary. Row 2: greedy
    with the same huge logits (T = 0: z = x, never shifted). Row 3: T = 1e-38 in the state: every z overflows."""
    x = torch.randn(4, CL, V, generator=g) * 3
    x[0, 0, 7 + step] = 3e38
    x[0, 1, [3, V - 2]] = FMAX
    x[0, 1, 5] = -FMAX
    x[0, 2] = -3.3e38 + torch.arange(V, dtype=torch.float32).flip(0) * 1.3e31
    x[0, 4, :10] = torch.finfo(torch.float32).min
    x[0, 5, 11] = 1e38                                # z = 2.5e38 at T = 0.4: finite, no shift
    x[2, 0, 9] = 3e38
    x[2, 1, [4, 30]] = FMAX
    return x


def states():
    st = SamplerState(5, CL, V, H, device=DEV)
    st.add_request(4, 101, SamplingParams(canvas_length=CL, seed=1, t_min=0.4, t_max=0.8, max_denoising_steps=3))
    st.add_request(0, 102, SamplingParams(canvas_length=CL, seed=2, entropy_bound=1.0))
    st.add_request(2, 103, SamplingParams(canvas_length=CL, seed=3, t_min=0.0, t_max=0.0))
    st.add_request(1, 104, SamplingParams(canvas_length=CL, seed=4, entropy_bound=50.0))
    st.t_min[1] = st.t_max[1] = 1e-38                # below the params' floor: the kernels must still cope
    return st


SLOTS = torch.tensor([4, 0, 2, 1], device=DEV)


def run(step_fn, e_dtype=torch.float32, steps=3):
    """Prefill then ``steps`` denoising steps of overflow_logits: (outputs, state)."""
    st = states()
    E = torch.randn(V, H, generator=torch.Generator().manual_seed(7)).to(e_dtype).to(DEV)
    g = torch.Generator().manual_seed(11)
    pd = torch.ones(4, dtype=torch.bool, device=DEV)
    outs = [step_fn(st, SLOTS, torch.zeros(4, CL, V, device=DEV), pd, E)]
    for s in range(steps):
        outs.append(step_fn(st, SLOTS, overflow_logits(s, g).to(DEV), pd, E))
    return outs, st


def assert_same(a, b, soft_tol):
    (oa, sa), (ob, sb) = a, b
    for x, y in zip(oa, ob):
        for f in DECISIONS:
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        torch.testing.assert_close(x.entropy, y.entropy, rtol=1e-5, atol=1e-6, equal_nan=True)
    for f in STATE:
        assert torch.equal(getattr(sa, f), getattr(sb, f)), f
    assert torch.isfinite(sb.soft).all()
    torch.testing.assert_close(sb.soft, sa.soft, rtol=0, atol=soft_tol)


def reference_step(st, sl, x, pd, E):
    return sampler_step(st, sl, x, pd, E, backend="reference")


def test_reference_overflowing_positions_are_the_softmax_limit():
    """The reference on these logits: no failure; one-hot at a unique max (entropy 0), uniform over the exact ties
    (entropy log 2, the first tie as argmax, a tie as the sample), the largest logit where every z is -inf."""
    outs, st = run(reference_step, steps=1)
    o = outs[-1]
    assert not o.failed.any() and (st.phase[SLOTS] == DENOISE).all()
    assert o.argmax[0, 0].item() == 7 and o.sampled[0, 0].item() == 7 and o.entropy[0, 0].item() == 0.0
    assert o.argmax[0, 1].item() == 3 and o.sampled[0, 1].item() in (3, V - 2)
    assert o.entropy[0, 1].item() == pytest.approx(math.log(2), rel=1e-6)
    assert o.argmax[0, 2].item() == 0                  # the ramp's top (its first ties by rounding)
    assert o.argmax[2, 0].item() == 9 and o.argmax[2, 1].item() == 4 and (o.entropy[2] == 0).all()
    assert torch.isfinite(o.entropy).all() and torch.isfinite(st.soft).all()


@pytest.mark.parametrize("config", [
    None,
    SamplerConfig(block_g=4, split_v=3, block_p=2),      # splits; two positions per stats program
    SamplerConfig(block_g=2, split_v=5, block_p=4, soft_impl="triton_gemm"),
    SamplerConfig(soft_impl="chunked", soft_chunk=16),
    SamplerConfig(soft_impl="chunked", stats_overlap=True),
])
def test_triton_overflowing_positions_match_the_reference(config):
    ref = run(reference_step)
    tri = run(lambda st, sl, x, pd, E: triton_sampler_step(st, sl, x, pd, E, config=config))
    assert_same(ref, tri, soft_tol=1e-5)


def test_triton_overflowing_positions_match_the_reference_bf16():
    ref = run(reference_step, torch.bfloat16)
    tri = run(lambda st, sl, x, pd, E: sampler_step(st, sl, x, pd, E, backend="triton"), torch.bfloat16)
    assert_same(ref, tri, soft_tol=0.05)


@pytest.mark.parametrize("backend,bounds", [
    ("reference", (0, V)), ("reference", (0, 3, 4, V)), ("reference", (0, 20, V - 2, V)),
    ("reference", (0, 0, 17, V, V)), ("triton", (0, 3, 4, V)), ("triton", (0, 0, 17, V - 2, V, V)),
])
def test_tensor_parallel_overflowing_positions_match_the_reference(backend, bounds):
    """Ties straddling shards, shards whose own max z is finite beside one whose max overflows, shards holding
    only logits whose z is -inf, empty shards: the combine takes the shifted statistics of the ranks that hold
    the global max logit."""
    ref = run(reference_step)
    tp = run(lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=bounds, backend=backend,
                                                           config=SamplerConfig(block_g=4, split_v=2)))
    assert_same(ref, tp, soft_tol=1e-5)


def test_stats_shift_is_zero_and_m_bit_identical_where_z_does_not_overflow():
    """row_stats / row_moments: shift = max x exactly where the max z overflows (m = 0 there); elsewhere shift = 0
    and m = max(x / T) bit for bit (the accepted fl(x / T))."""
    g = torch.Generator().manual_seed(3)
    x = overflow_logits(0, g).to(DEV)
    T = torch.tensor([0.4, 0.7, 0.5, 1e-38], device=DEV)
    c = torch.zeros(4, dtype=torch.int64, device=DEV)
    act = torch.ones(4, dtype=torch.bool, device=DEV)
    xmax = x.amax(-1)
    ovf = torch.isinf(xmax / T[:, None])
    for cfg in (SamplerConfig(block_g=4, split_v=1, block_p=1), SamplerConfig(block_g=2, split_v=3, block_p=8)):
        r = row_stats(x, T, c, c, c.int(), c.int(), act, cfg)
        assert torch.equal(r["shift"], torch.where(ovf, xmax, 0.0))
        assert torch.equal(r["m"], torch.where(ovf, 0.0, (x / T[:, None, None]).amax(-1)))
        assert not r["bad"].any() and torch.isfinite(r["entropy"]).all()
    m2, inv_s2, shift2 = row_moments(x, T, act)
    assert torch.equal(shift2, r["shift"]) and torch.equal(m2, r["m"])
    torch.testing.assert_close(inv_s2, r["inv_s"], rtol=1e-6, atol=0)


def _tied_rows(k: int, steps: int = 2):
    """[1, 8, 37] logits per step: at every position k random ids at float32's max (z overflows at T 0.8 -> 0.4:
    the shifted form, p uniform over k ties), the rest small."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randn(1, 8, 37, generator=g)
        for p in range(8):
            x[0, p, torch.randperm(37, generator=g)[:k]] = FMAX
        out.append(x.to(DEV))
    return out


@pytest.mark.parametrize("k", [2, 7, 18, 37])
def test_equal_tie_counts_at_shifted_positions_give_equal_entropies_and_accept_by_position(k):
    """Rule 1's shifted form defines H = log(#ties). Was: the reference took log_softmax's rounding of it, which
    varied with where the ties sit (k = 18: 2.8903718 / 2.8903716 / 2.8903713 at three positions), so the stable
    sort ordered equal tie counts by rounding and the reference accepted position 2 where the triton and TP backends
    (log of the count) accepted position 0."""
    def run(step):
        st = SamplerState(2, 8, 37, 8, device=DEV)
        st.add_request(0, 5, SamplingParams(canvas_length=8, seed=1))
        E = torch.randn(37, 8, generator=torch.Generator().manual_seed(0)).to(DEV)
        sl = torch.tensor([0], device=DEV)
        step(st, sl, torch.zeros(1, 8, 37, device=DEV), torch.tensor([True], device=DEV), E)
        return [step(st, sl, x, torch.tensor([False], device=DEV), E) for x in _tied_rows(k)], st

    ref = run(reference_step)
    want = torch.log(torch.tensor(float(k), dtype=torch.float64)).float().to(DEV)
    for o in ref[0]:
        assert (o.entropy == want).all(), o.entropy
        assert o.accepted[0].tolist() == [True] + [False] * 7  # ties by position: the first one
    for other in (run(lambda *a: sampler_step(*a, backend="triton")),
                  run(lambda *a: sampler_step_sharded(*a, bounds=(0, 11, 37), backend="reference",
                                                      config=SamplerConfig()))):
        assert_same(ref, other, soft_tol=1e-5)
        for o, p in zip(ref[0], other[0]):   # log(#ties) bit for bit (float32 logf of 7 or 37 is an ulp off)
            assert torch.equal(o.entropy, p.entropy), (o.entropy, p.entropy)


def _steps_with_ties(backend, ties, bound):
    """One denoise step of one request whose positions all take the shifted form, position p with ties[p] ids at
    float32's max; its entropies and acceptance."""
    cl = len(ties)
    st = SamplerState(2, cl, 37, 8, device=DEV)
    st.add_request(0, 5, SamplingParams(canvas_length=cl, seed=1, entropy_bound=bound))
    E = torch.randn(37, 8, generator=torch.Generator().manual_seed(0)).to(DEV)
    sl = torch.tensor([0], device=DEV)
    sampler_step(st, sl, torch.zeros(1, cl, 37, device=DEV), torch.tensor([True], device=DEV), E, backend=backend)
    x = torch.randn(1, cl, 37, generator=torch.Generator().manual_seed(3))
    for p, k in enumerate(ties):
        x[0, p, :k] = FMAX
    o = sampler_step(st, sl, x.to(DEV), torch.tensor([False], device=DEV), E, backend=backend)
    return o.entropy, o.accepted


@pytest.mark.parametrize("k", [7, 37])
def test_shifted_entropy_at_an_exact_bound_decides_alike_in_every_backend(k):
    """entropy_bound = float32(log k): a position with k ties then k + 1 ties; the second is accepted iff
    H(first) <= bound, which holds with H = log(k) correctly rounded. Was: the triton stats pass took float32 logf
    of the count (log 7 and log 37 an ulp above), so triton rejected the position the reference and TP accepted."""
    bound = float(torch.log(torch.tensor(float(k), dtype=torch.float64)).float())
    ties = [k, k + 1, k + 1]
    h_ref, acc_ref = _steps_with_ties("reference", ties, bound)
    assert acc_ref[0].tolist() == [True, True, False]
    h_tri, acc_tri = _steps_with_ties("triton", ties, bound)
    assert torch.equal(h_tri, h_ref) and torch.equal(acc_tri, acc_ref), (h_tri, acc_tri)
