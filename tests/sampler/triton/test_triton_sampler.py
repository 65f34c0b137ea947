"""Fused Triton sampler vs the dense reference (CPU: Triton interpreter on small shapes; GPU: @pytest.mark.gpu).

Decisions (accepted positions, sampled / argmax / renoised ids, convergence, failure, committed canvases and every
state tensor) must be EXACTLY equal; entropies within float32 rounding; the soft embedding's error against a
float64 ground truth at most 2x the eager same-precision error plus a representation tolerance.
"""
import math

import pytest
import torch

from blockdiff.sampler import DENOISE, FAILED, SamplerState, SamplingParams, rng, sampler_step
from blockdiff.sampler.reference import entropy_reference
from blockdiff.sampler.triton.kernels import SamplerConfig, row_stats, soft_embedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted")
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_emitted_now", "num_sampled", "num_rejected", "temperature")


def _coords(n, g):
    seed = torch.randint(0, 2**62, (n,), generator=g)
    rid = torch.randint(-2**62, 2**62, (n,), generator=g)
    return seed, rid, torch.randint(0, 70000, (n,), generator=g).int(), torch.randint(0, 48, (n,), generator=g).int()


@pytest.mark.parametrize("V,split_v,dtype", [(37, 1, torch.float32), (130, 3, torch.float32), (64, 2, torch.bfloat16)])
def test_row_stats_match_reference(V, split_v, dtype):
    g = torch.Generator().manual_seed(V)
    N, CL = 3, 8
    x = (torch.randn(N, CL, V, generator=g) * 4).to(dtype)
    x[1, 2, 5:9] = x[1, 2].max() + 1  # argmax tie: lowest id
    T = torch.tensor([0.8, 0.4123, 1.7])
    seed, rid, ci, st = _coords(N, g)
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
    seed, rid, ci, st = _coords(N, g)
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


def _truth(x, T, E, greedy_ids=None):
    z = x.double() / T[:, None, None]
    p = torch.softmax(z, -1)
    if greedy_ids is not None:
        p = torch.nn.functional.one_hot(greedy_ids, x.shape[-1]).double()
    return p @ E.double() * math.sqrt(E.shape[1])


@pytest.mark.parametrize("edtype,split_k,use_tma", [(torch.bfloat16, 1, True), (torch.bfloat16, 3, False),
                                                    (torch.bfloat16, 3, True), (torch.float32, 2, None)])
def test_soft_embedding_within_twice_eager_error(edtype, split_k, use_tma):
    g = torch.Generator().manual_seed(split_k)
    N, CL, V, H = 2, 8, 200, 48
    x = torch.randn(N, CL, V, generator=g) * 3
    E = torch.randn(V, H, generator=g).to(edtype)
    T = torch.tensor([0.7, 0.45])
    z = torch.zeros(N, dtype=torch.int64)
    act = torch.ones(N, dtype=torch.bool)
    r = row_stats(x, T, z, z, z, z, act)
    cfg = SamplerConfig(split_k=split_k, block_k=32, use_tma=use_tma)
    ws = soft_embedding(x, E, T, r["m"], r["inv_s"], r["argmax"], act, cfg)
    assert ws.shape[0] == split_k
    ours = ws.sum(0).view(N, CL, H) * math.sqrt(H)
    truth = _truth(x, T, E)
    p = torch.softmax(x / T[:, None, None], -1)
    eager = (p.to(edtype) @ E).float() * math.sqrt(H)
    err, err_eager = (ours - truth).abs().max().item(), (eager - truth).abs().max().item()
    tol = 1e-5 * truth.abs().max().item()
    assert err <= 2 * err_eager + tol, (err, err_eager)


def _mk_state(specs, CL, V, H, R=6):
    st = SamplerState(R, CL, V, H, device=DEV)
    for slot, rid, p in specs:
        st.add_request(slot, rid, p)
    return st


def _check_same(oa, ob, a, b, soft_tol):
    for f in DECISIONS:
        assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    assert torch.allclose(oa.entropy, ob.entropy, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert torch.allclose(oa.mean_entropy, ob.mean_entropy, rtol=1e-4, atol=1e-5, equal_nan=True)
    for f in STATE_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.allclose(a.soft, b.soft, rtol=0, atol=soft_tol)


def test_full_steps_match_reference_exactly():
    """T > 0 and T = 0 rows, prefill, NaN -> FAILED, convergence, commit with EOS / max_tokens, fresh canvases."""
    CL, V, H = 16, 100, 32
    def specs():
        return [(3, 11, SamplingParams(canvas_length=CL, seed=1, max_denoising_steps=4, eos_token_ids=(3,))),
                (0, 12, SamplingParams(canvas_length=CL, seed=2, t_min=0.0, t_max=0.0, max_denoising_steps=5,
                                       max_tokens=40)),
                (1, 13, SamplingParams(canvas_length=CL, seed=3, max_denoising_steps=3, entropy_bound=1.0)),
                (5, 14, SamplingParams(canvas_length=CL, seed=4, max_denoising_steps=6, t_min=0.1, t_max=2.0))]
    a, b = _mk_state(specs(), CL, V, H), _mk_state(specs(), CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.tensor([3, 0, 1, 5], device=DEV)
    g = torch.Generator().manual_seed(0)
    seen_phases = set()
    for it in range(9):
        x = (torch.randn(4, CL, V, generator=g) * 3).to(DEV)
        x[1, :, 7] += 20.0 * (it > 3)  # greedy row becomes stable -> converges before its cap
        if it == 4:
            x[3, 2, 9] = float("nan")
        pd = torch.tensor([True, True, it > 0, True], device=DEV)
        seen_phases.update(a.phase[slots].tolist())
        oa = sampler_step(a, slots, x, pd, E, backend="reference")
        ob = sampler_step(b, slots, x, pd, E, backend="triton")
        _check_same(oa, ob, a, b, soft_tol=0.1)
        if it == 4:
            assert ob.failed.tolist() == [False, False, False, True]
    assert b.phase[5].item() == FAILED
    assert seen_phases >= {0, 1, 2}


def test_overflowing_z_matches_reference_masked_min_finite_plus_inf_fails():
    """z = x / T overflowing: finfo.min logits (-inf z, p = 0) keep entropies finite and decisions equal to the
    reference; a +inf z fails the row in both backends."""
    CL, V, H = 8, 64, 16
    def specs():
        return [(0, 21, SamplingParams(canvas_length=CL, seed=5)),
                (2, 22, SamplingParams(canvas_length=CL, seed=6)),
                (3, 23, SamplingParams(canvas_length=CL, seed=7, t_min=0.0, t_max=0.0))]
    a, b = _mk_state(specs(), CL, V, H), _mk_state(specs(), CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.tensor([0, 2, 3], device=DEV)
    g = torch.Generator().manual_seed(3)
    pd = torch.ones(3, dtype=torch.bool, device=DEV)
    for it in range(3):
        x = (torch.randn(3, CL, V, generator=g) * 3)
        x[:, :, 10:13] = torch.finfo(torch.float32).min
        if it == 1:
            x[1, 4, 40] = 3e38
        x = x.to(DEV)
        oa = sampler_step(a, slots, x, pd, E, backend="reference")
        ob = sampler_step(b, slots, x, pd, E, backend="triton")
        _check_same(oa, ob, a, b, soft_tol=0.1)
        if it >= 1:
            assert torch.isfinite(ob.entropy[0]).all() and torch.isfinite(ob.entropy[2]).all()
    assert oa.failed.tolist() == [False, False, False] and a.phase[2].item() == FAILED
    assert torch.isfinite(b.soft).all()


def test_soft_state_close_to_truth_after_a_step():
    CL, V, H = 8, 64, 32
    st = _mk_state([(0, 1, SamplingParams(canvas_length=CL))], CL, V, H)
    E = torch.randn(V, H, device=DEV)
    slots = torch.tensor([0], device=DEV)
    sampler_step(st, slots, torch.zeros(1, CL, V, device=DEV), torch.ones(1, dtype=torch.bool, device=DEV), E,
                 backend="triton")
    x = torch.randn(1, CL, V, device=DEV)
    sampler_step(st, slots, x, torch.ones(1, dtype=torch.bool, device=DEV), E, backend="triton")
    truth = _truth(x.cpu(), torch.tensor([0.8]), E.cpu())
    assert torch.allclose(st.soft[0].cpu().double(), truth[0], atol=1e-4)


def test_triton_batch_invariance():
    CL, V, H = 8, 50, 16
    pa = SamplingParams(canvas_length=CL, seed=9, max_denoising_steps=3)
    a = _mk_state([(0, 777, pa)], CL, V, H)
    b = _mk_state([(2, 1, SamplingParams(canvas_length=CL, seed=1)), (4, 777, pa),
                   (0, 3, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0))], CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    sa, sb = torch.tensor([0], device=DEV), torch.tensor([2, 4, 0], device=DEV)
    g = torch.Generator().manual_seed(5)
    for it in range(5):
        x = (torch.randn(3, CL, V, generator=g) * 2).to(DEV)
        oa = sampler_step(a, sa, x[1:2], torch.ones(1, dtype=torch.bool, device=DEV), E, backend="triton")
        ob = sampler_step(b, sb, x, torch.ones(3, dtype=torch.bool, device=DEV), E, backend="triton")
        for f in DECISIONS + ("entropy", "mean_entropy"):
            assert torch.equal(getattr(oa, f)[0], getattr(ob, f)[1]), f
        for f in STATE_FIELDS:
            assert torch.equal(getattr(a, f)[0], getattr(b, f)[4]), f
        assert torch.allclose(a.soft[0], b.soft[4], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GPU
def _big_case(N=4, CL=256, V=262144, H=2816, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, CL, V, device="cuda", generator=g) * 4.0
    x = 30.0 * torch.tanh(x / 30.0)
    E = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    specs = [(i, 1000 + i, SamplingParams(canvas_length=CL, seed=i, t_min=0.0 if i == 3 else 0.4,
                                          t_max=0.0 if i == 3 else 0.8)) for i in range(N)]
    return x, E, specs


@pytest.mark.gpu
def test_gpu_large_shape_matches_reference():
    torch.manual_seed(0)
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, specs = _big_case(N, CL, V, H)
    a, b = _mk_state(specs, CL, V, H, R=N), _mk_state(specs, CL, V, H, R=N)
    slots = torch.arange(N, device="cuda")
    pd = torch.ones(N, dtype=torch.bool, device="cuda")
    for st, be in ((a, "reference"), (b, "triton")):
        sampler_step(st, slots, x, pd, E, backend=be)
    oa = sampler_step(a, slots, x, pd, E, backend="reference")
    ob = sampler_step(b, slots, x, pd, E, backend="triton")
    torch.cuda.synchronize()
    _check_same(oa, ob, a, b, soft_tol=0.05 * a.soft.abs().max().item())


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager_and_memory_is_small():
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, specs = _big_case(N, CL, V, H, seed=1)
    a, b = _mk_state(specs, CL, V, H, R=N), _mk_state(specs, CL, V, H, R=N)
    slots = torch.arange(N, device="cuda")
    pd = torch.ones(N, dtype=torch.bool, device="cuda")
    for st in (a, b):
        sampler_step(st, slots, x, pd, E, backend="triton")  # prefill -> denoise, compiles the kernels
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    oa = sampler_step(a, slots, x, pd, E, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 64 * 2**20, f"extra memory {extra / 2**20:.1f} MiB"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            ob = sampler_step(b, slots, x, pd, E, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    for f in DECISIONS:
        assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    for f in STATE_FIELDS + ("soft",):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 2),
                                  (64, 256, 32, 4, 4)])
def test_gpu_soft_embedding_tiles_finite_and_close(tile):
    """Every GEMM tile the benchmark times or tunes, on the full sampler_n4 shape: workspace finite everywhere
    (poisoned with NaN first: unwritten rows show) and the first 64 positions of every request within 2 % of
    ``softmax(z).bf16() @ E`` (one-hot for the greedy request). Regression for the 128 x 256 NaN (RAW hazard)."""
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, _ = _big_case(N, CL, V, H, seed=2)
    T = torch.tensor([0.8, 0.6, 0.4, 0.0], device="cuda")
    act = torch.ones(N, dtype=torch.bool, device="cuda")
    z = torch.zeros(N, dtype=torch.int64, device="cuda")
    r = row_stats(x, T, z, z, z, z, act)
    kw = {} if tile is None else dict(zip(("block_m", "block_n", "block_k", "gemm_warps", "gemm_stages"), tile))
    cfg = SamplerConfig(split_k=3, **kw)
    torch.cuda.empty_cache()
    filler = torch.full((3 * N * CL * H,), float("nan"), device="cuda")  # the workspace reuses this memory
    del filler
    ws = soft_embedding(x, E, T, r["m"], r["inv_s"], r["argmax"], act, cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(ws).all()
    rows = 64
    zz = x[:, :rows] / torch.where(T == 0, 1.0, T)[:, None, None]
    p = torch.softmax(zz, -1)
    p[3] = torch.zeros_like(p[3]).scatter_(-1, zz[3].argmax(-1, keepdim=True), 1.0)
    truth = (p.reshape(-1, V).bfloat16() @ E).float().view(N, rows, H)
    ours = ws.sum(0).view(N, CL, H)[:, :rows]
    assert (ours - truth).abs().max().item() <= 0.02 * truth.abs().max().item()


# ---------------------------------------------------------------------------------------------- fuzz
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hst.data())
def test_fuzz_random_batches_match_reference(data):
    """Random batch compositions: sizes 1..3 rows, canvas 1..9, vocab 1..70 (not multiples of the tiles),
    random params (greedy, temperatures 1e-8..50, bound 0, k 0..2, tiny caps), random phases, NaN rows, bf16 or
    fp32 logits; soft rows to fp32 rounding with an fp32 embedding."""
    N = data.draw(hst.integers(1, 3))
    CL = data.draw(hst.integers(1, 9))
    V = data.draw(hst.integers(1, 70))
    H = data.draw(hst.sampled_from([16, 24]))
    slots = data.draw(hst.permutations(list(range(N + 1))))[:N]
    specs = []
    for i, slot in enumerate(slots):
        greedy = data.draw(hst.booleans())
        # temperatures from 1e-8 (cancellation in the soft embedding's exponent was once an inf there) to 50
        t_min = 0.0 if greedy else data.draw(hst.sampled_from([0.05, 0.3, 0.77, 1e-8, 1e-6, 1e-4, 5.0, 50.0]))
        t_max = 0.0 if greedy else t_min * data.draw(hst.sampled_from([1.0, 1.5])) + data.draw(hst.floats(0.0, 1.0))
        p = SamplingParams(canvas_length=CL, seed=data.draw(hst.integers(0, 2**63 - 1)), t_min=t_min, t_max=t_max,
                           max_denoising_steps=data.draw(hst.integers(1, 4)),
                           entropy_bound=data.draw(hst.sampled_from([0.0, 0.1, 1.0, 50.0])),
                           confidence_threshold=data.draw(hst.sampled_from([0.0, 0.005, 10.0])),
                           stability_threshold=data.draw(hst.integers(0, 2)),
                           eos_token_ids=tuple(data.draw(hst.lists(hst.integers(0, V - 1), max_size=2))),
                           max_tokens=data.draw(hst.one_of(hst.none(), hst.integers(1, 20))))
        specs.append((slot, data.draw(hst.integers(-2**63, 2**63 - 1)), p))
    a, b = _mk_state(specs, CL, V, H, R=N + 1), _mk_state(specs, CL, V, H, R=N + 1)
    edtype = data.draw(hst.sampled_from([torch.float32, torch.bfloat16]))
    E = torch.randn(V, H, device=DEV).to(edtype)
    dtype = data.draw(hst.sampled_from([torch.float32, torch.bfloat16]))
    sl = torch.tensor(slots, device=DEV, dtype=torch.int64)
    g = torch.Generator().manual_seed(data.draw(hst.integers(0, 1000)))
    for it in range(4):
        x = (torch.randn(N, CL, V, generator=g) * data.draw(hst.sampled_from([0.5, 3.0, 30.0]))).to(dtype)
        if data.draw(hst.booleans()) and it == 2:
            x[data.draw(hst.integers(0, N - 1)), data.draw(hst.integers(0, CL - 1)), 0] = float("nan")
        pd = torch.tensor([data.draw(hst.booleans()) or it > 0 for _ in range(N)], device=DEV)
        x = x.to(DEV)
        oa = sampler_step(a, sl, x, pd, E, backend="reference")
        ob = sampler_step(b, sl, x, pd, E, backend="triton")
        # fp32 E: exact fp32 products, so the soft rows agree to fp32 rounding; bf16 E: p is rounded to bf16
        rel = 1e-4 if edtype == torch.float32 else 0.05
        _check_same(oa, ob, a, b, soft_tol=rel * max(1.0, a.soft[torch.isfinite(a.soft)].abs().max().item()
                                                      if torch.isfinite(a.soft).any() else 1.0))


@pytest.mark.parametrize("stream", [rng.RENOISE, rng.INITIAL])
@pytest.mark.parametrize("V", [1, 7, 262144, 2**31 - 1])
def test_random_ids_kernel_equals_torch_rng(stream, V):
    from blockdiff.sampler.triton.kernels import random_ids

    g = torch.Generator().manual_seed(V)
    seed, rid, ci, st = _coords(5, g)
    a = rng.random_ids(seed, rid, ci, st, 37, V, stream)
    b = random_ids(seed.to(DEV), rid.to(DEV), ci.to(DEV), st.to(DEV), 37, V, stream)
    assert torch.equal(a, b.cpu())
    with pytest.raises(ValueError, match="stream"):
        random_ids(seed, rid, ci, st, 4, V, rng.GUMBEL)


def test_soft_rows_written_exactly_where_due_poisoned_state():
    """state.soft NaN-poisoned before the step: continuing (T > 0 and T = 0) rows and fresh canvases are fully
    written (and equal the reference); rows that converged, failed or are untouched keep their poison."""
    CL, V, H = 8, 64, 16
    def specs():
        return [(0, 1, SamplingParams(canvas_length=CL, seed=1)),                       # continuing, T > 0
                (1, 2, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0)),         # continuing, T = 0
                (2, 3, SamplingParams(canvas_length=CL, max_denoising_steps=1)),        # converges (cap)
                (3, 4, SamplingParams(canvas_length=CL)),                               # fails (NaN)
                (4, 5, SamplingParams(canvas_length=CL))]                               # prefill -> fresh
    a, b = _mk_state(specs(), CL, V, H, R=6), _mk_state(specs(), CL, V, H, R=6)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.arange(5, device=DEV)
    pd = torch.tensor([True, True, True, True, False], device=DEV)
    for st in (a, b):
        sampler_step(st, slots, torch.zeros(5, CL, V, device=DEV), pd, E, backend="reference")
    x = torch.randn(5, CL, V, device=DEV)
    x[3, 0, 0] = float("nan")
    pd = torch.ones(5, dtype=torch.bool, device=DEV)
    for st in (a, b):
        st.soft.fill_(float("nan"))
    oa = sampler_step(a, slots, x, pd, E, backend="reference")
    ob = sampler_step(b, slots, x, pd, E, backend="triton")
    assert ob.converged.tolist() == [False, False, True, False, False] and ob.failed[3].item()
    for s in (0, 1, 4):
        assert torch.isfinite(b.soft[s]).all(), s
    assert (b.soft[4] == 0).all()
    assert torch.equal(b.soft[1], a.soft[1])  # T = 0: E[argmax] * sqrt(hidden), exact
    assert torch.allclose(b.soft[0], a.soft[0], atol=0.05)
    for s in (2, 3, 5):
        assert torch.isnan(b.soft[s]).all(), s


@pytest.mark.parametrize("use_tma", [True, False])
def test_soft_embedding_finite_when_split_tail_runs_past_vocab_with_very_negative_logits(use_tma):
    """Regression (H200 NaN): the last split-K range runs past V (K_PER_SPLIT * SPLIT_K > V, here 3 x 96 > 200); the
    zero-filled logits there gave p = exp(0 / T - m) / s = inf for rows whose max z is below -88 (inf * E's zero
    fill = NaN). Rows of skipped requests hold non-finite logits and share a tile with computed rows."""
    g = torch.Generator().manual_seed(7)
    N, CL, V, H = 3, 8, 200, 48
    x = torch.randn(N, CL, V, generator=g) * 2 - 80.0     # all logits ~ -80: m = -800 at T = 0.1
    x[1] = float("nan")                                   # a skipped (inactive) request's garbage row
    E = torch.randn(V, H, generator=g).bfloat16()
    T = torch.tensor([0.1, 0.5, 0.7])
    act = torch.tensor([True, False, True])
    z = torch.zeros(N, dtype=torch.int64)
    r = row_stats(x, T, z, z, z, z, act)
    cfg = SamplerConfig(split_k=3, block_k=32, block_m=16, use_tma=use_tma)
    ws = soft_embedding(x, E, T, r["m"], r["inv_s"], r["argmax"], act, cfg)
    assert ws.shape[0] == 3
    assert torch.isfinite(ws).all()
    ours = ws.sum(0).view(N, CL, H) * math.sqrt(H)
    for n in (0, 2):
        truth = _truth(x[n:n + 1], T[n:n + 1], E)[0]
        assert (ours[n] - truth).abs().max().item() <= 0.02 * truth.abs().max().item()


_COMPILE_SOFT_GEMM_SM90 = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.sampler.triton import kernels as ts

fn = ts._soft_embedding_kernel
bm, bn, bk = 128, 256, 64
sig = {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "e_ptr": "*bf16", "stride_ev": "i32",
       "stride_eh": "i32", "x_desc": f"tensordesc<fp32[{bm},{bk}]>", "e_desc": f"tensordesc<bf16[{bk},{bn}]>",
       "ws_ptr": "*fp32", "t_ptr": "*fp32", "active_ptr": "*i32", "m_ptr": "*fp32", "inv_s_ptr": "*fp32",
       "amax_ptr": "*i32", "M": "i32", "CL": "i32", "V": "i32", "HID": "i32", "UNIT": "fp32"}
consts = dict(K_PER_SPLIT=87424, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EXACT_FP32=False, INTERPRET=False,
              USE_TMA=True, GREEDY_ONEHOT=False)
sig.update({k: "constexpr" for k in consts})
assert list(sig) == list(fn.arg_names), ("test signature out of date with the kernel", fn.arg_names)
src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
ttgir = k.asm["ttgir"]
assert "warp_group_dot " in ttgir, "no wgmma in the sm_90a code"
print("PENDINGS", [int(p) for p in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)])
"""


def test_soft_gemm_register_a_wgmma_is_waited_before_the_next_iteration_writes_its_registers():
    """Regression (H200 NaN at 128 x 256 tiles): compiled for sm_90a on the CPU (no GPU needed; a subprocess
    without TRITON_INTERPRET), the soft-embedding loop must not leave register-A wgmmas in flight across
    iterations. Triton 3.6 split the dot into K = 16 wgmmas and waited with pendings = 3, so the next iteration's
    loads / exp2 overwrote A registers that in-flight wgmmas still read (SASS: LDS into them before any
    WARPGROUP.DEPBAR; triton-lang/triton#9433)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_SOFT_GEMM_SM90], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    pendings = eval(r.stdout.split("PENDINGS", 1)[1].strip())
    assert pendings and max(pendings) == 0, pendings


def test_sampler_config_flags_must_be_bools_and_stats_overlap_refuses_the_triton_gemm_path():
    """Regression: SamplerConfig(stats_overlap="no") silently meant True, and stats_overlap with the Triton GEMM
    soft embedding (explicit, or soft_impl=None resolving to it: CPU / fp32 E) silently did nothing. Now a
    TypeError / ValueError names the field, and sampler_step refuses before touching the state."""
    from blockdiff.sampler.triton import kernels as ts

    for name in ("use_tma", "soft_overlap", "stats_overlap"):
        with pytest.raises(TypeError, match=name):
            SamplerConfig(**{name: "no"})
        SamplerConfig(**{name: False})
    with pytest.raises(ValueError, match="stats_overlap"):
        SamplerConfig(soft_impl="triton_gemm", stats_overlap=True)
    st = SamplerState(1, 4, 30, 8)
    st.add_request(0, 3, SamplingParams(canvas_length=4))
    before = st.phase.clone()
    with pytest.raises(ValueError, match="stats_overlap"):   # CPU: soft_impl=None resolves to triton_gemm
        ts.sampler_step(st, torch.tensor([0]), torch.zeros(1, 4, 30), torch.tensor([True]), torch.zeros(30, 8),
                        config=SamplerConfig(stats_overlap=True))
    assert torch.equal(st.phase, before)


_COMPILE_STREAMING_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.sampler.triton import kernels as ts
from blockdiff.sampler.triton import soft_embedding as sc


def build(fn, sig, consts, **opts):
    sig = dict(sig)
    sig.update({k: "constexpr" for k in consts})
    assert list(sig) == list(fn.arg_names), ("test signature out of date with the kernel", fn.arg_names)
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert "ptx" in k.asm and len(k.asm["ptx"]) > 1000, fn.__name__
    return k


V = 262144
build(ts._stats_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "seed_ptr": "*i64",
       "rid_ptr": "*i64", "cidx_ptr": "*i64", "step_ptr": "*i64", "active_ptr": "*i32", "stats_f_ptr": "*fp32",
       "stats_i_ptr": "*i32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(CHUNK=V, SPLIT_V=1, BLOCK_P=1, BLOCK_G=256, LOAD_STAGES=3, MASKED=False, FAST_LOG=1),
      num_warps=4, num_stages=3)
build(ts._stats_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "seed_ptr": "*i64",
       "rid_ptr": "*i64", "cidx_ptr": "*i64", "step_ptr": "*i64", "active_ptr": "*i32", "stats_f_ptr": "*fp32",
       "stats_i_ptr": "*i32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(CHUNK=33792, SPLIT_V=3, BLOCK_P=1, BLOCK_G=256, LOAD_STAGES=3, MASKED=True, FAST_LOG=1),
      num_warps=4, num_stages=3)
build(sc._prob_chunk_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "p_ptr": "*bf16", "t_ptr": "*fp32",
       "active_ptr": "*i32", "m_ptr": "*fp32", "inv_s_ptr": "*fp32", "amax_ptr": "*i32", "M": "i32", "CL": "i32",
       "V": "i32", "v0": "i32", "VC": "i32"},
      dict(GREEDY_ONEHOT=False, ROUND_TO=None, BLOCK_R=4, BLOCK_V=1024), num_warps=4)
build(ts._moments_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "active_ptr": "*i32",
       "m_ptr": "*fp32", "inv_s_ptr": "*fp32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(NUM_TILES=V // 2048, BLOCK_V=2048), num_warps=4)
merge_sig = {"stats_f_ptr": "*fp32", "stats_i_ptr": "*i32", "t_ptr": "*fp32", "active_ptr": "*i32", "m_ptr": "*fp32",
             "inv_s_ptr": "*fp32", "h_ptr": "*fp32", "hstep_ptr": "*fp32", "amax_ptr": "*i64", "gamax_ptr": "*i64",
             "sampled_ptr": "*i64", "bad_ptr": "*u8", "R": "i32", "CL": "i32"}
for split_v in (1, 3, 8):
    build(ts._stats_merge_kernel, merge_sig,
          dict(SPLIT_V=split_v, BLOCK_S=triton.next_power_of_2(split_v), BLOCK_R=128), num_warps=4)
step_sig = {"slots_ptr": "*i64", "pd_ptr": "*u8", "t_ptr": "*fp32", "h_ptr": "*fp32", "amax_ptr": "*i64",
            "sampled_ptr": "*i64", "sorted_h_ptr": "*fp32", "order_ptr": "*i64", "cum_ptr": "*fp32",
            "phase_ptr": "*i32", "canvas_ptr": "*i64", "commit_ptr": "*i64", "prev_ptr": "*i64", "stable_ptr": "*i32",
            "step_ptr": "*i32", "cidx_ptr": "*i32", "nemit_ptr": "*i64", "seed_ptr": "*i64", "rid_ptr": "*i64",
            "bound_ptr": "*fp32", "conf_ptr": "*fp32", "max_steps_ptr": "*i32", "k_ptr": "*i32", "eos_ptr": "*i64",
            "stride_eos": "i32", "max_tok_ptr": "*i64", "o_emitted": "*i64", "o_argmax": "*i64", "o_sampled": "*i64",
            "o_next": "*i64", "o_accepted": "*u8", "o_entropy": "*fp32", "o_num_sampled": "*i32",
            "o_num_rejected": "*i32", "o_num_now": "*i32", "o_finished": "*u8", "o_failed": "*u8",
            "o_converged": "*u8", "o_mean": "*fp32", "o_temp": "*fp32", "o_cont": "*i32", "o_mode": "*i32",
            "CL": "i32", "CLF": "fp32", "V": "i32", "E": "i32"}
build(ts._step_kernel, step_sig, dict(BLOCK=256, BLOCK_E=8), num_warps=4)
build(ts._gather_rows_kernel,
      {"slots_ptr": "*i64", "phase_ptr": "*i32", "seed_ptr": "*i64", "rid_ptr": "*i64", "cidx_ptr": "*i32",
       "step_ptr": "*i32", "o_active": "*i32", "o_seed": "*i64", "o_rid": "*i64", "o_cidx": "*i32", "o_step": "*i32",
       "N": "i32"}, dict(BLOCK=4), num_warps=1)
# CL = V = E = stride = 1: Triton specialises int arguments equal to 1 into constants (the kernel must compile so)
build(ts._step_kernel, step_sig, dict(stride_eos=1, CL=1, V=1, E=1, BLOCK=1, BLOCK_E=1), num_warps=1)
print("COMPILED")
"""


def test_streaming_sampler_kernels_compile_for_sm90a_on_the_cpu():
    """The stats kernel (with its greedy branch), its row gather and split merge, the step kernel (also with the
    arguments Triton specialises to constants), the chunked soft embedding's P kernel and row_moments' kernel
    compile to PTX for sm_90a with the H200 launch parameters (no GPU needed; a subprocess without
    TRITON_INTERPRET): code the interpreter runs but the GPU compiler might reject is caught in CI."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_STREAMING_SM90], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "COMPILED" in r.stdout, r.stderr[-3000:]
