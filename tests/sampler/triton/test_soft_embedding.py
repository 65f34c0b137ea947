"""Chunked soft embedding (SamplerConfig(soft_impl="chunked"), blockdiff.sampler.triton.soft_embedding) vs the reference.

CPU: Triton interpreter for the probability-chunk kernel, fp32 matmul of the bf16-rounded chunk. Chunk sizes that
divide V, that do not, of 1 token and larger than V; T = 0 rows; skipped (converged / failed / inactive) rows with
NaN logits; NaN-poisoned state.soft; batch invariance; decisions identical to the default triton path.
"""
import math

import pytest
import torch

from blockdiff.sampler import FAILED, SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.triton import kernels as ts
from blockdiff.sampler.triton.soft_embedding import MAX_CHUNK_BYTES, chunk_size, soft_embedding_chunked
from blockdiff.sampler.triton.kernels import SamplerConfig, row_stats, soft_embedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted")
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_emitted_now", "num_sampled", "num_rejected", "temperature")


def _mk_state(specs, CL, V, H, R=6, device=DEV):
    st = SamplerState(R, CL, V, H, device=device)
    for slot, rid, p in specs:
        st.add_request(slot, rid, p)
    return st


def test_chunk_size_fits_the_buffer_budget():
    assert chunk_size(1024, 262144) == 16384 and 1024 * 16384 * 2 <= MAX_CHUNK_BYTES
    assert chunk_size(1024, 1000) == 1000 and chunk_size(8, 262144) == 65536
    assert chunk_size(1024, 262144, itemsize=4) == 8192
    assert chunk_size(16, 100, requested=37) == 37 and chunk_size(16, 100, requested=500) == 100
    with pytest.raises(ValueError, match="soft_chunk"):
        chunk_size(16, 100, requested=0)
    with pytest.raises(ValueError, match="soft_impl"):
        SamplerConfig(soft_impl="cublas")
    with pytest.raises(ValueError, match="soft_chunk"):
        SamplerConfig(soft_impl="chunked", soft_chunk=0)


@pytest.mark.parametrize("chunk", [None, 1, 37, 50, 64, 1000])
@pytest.mark.parametrize("edtype", [torch.bfloat16, torch.float32])
def test_chunked_soft_embedding_within_twice_eager_error(chunk, edtype):
    """T > 0 rows: error vs a float64 truth <= 2x that of the eager same-precision product; T = 0 rows: one-hot
    (greedy_onehot) exact; inactive rows (NaN logits) exactly 0."""
    g = torch.Generator().manual_seed(3)
    N, CL, V, H = 3, 8, 200, 48
    x = torch.randn(N, CL, V, generator=g) * 3
    x[2] = float("nan")
    E = torch.randn(V, H, generator=g).to(edtype)
    T = torch.tensor([0.7, 0.0, 0.45])
    act = torch.tensor([True, True, False])
    z = torch.zeros(N, dtype=torch.int64)
    r = row_stats(x, T, z, z, z, z, act)
    ws = soft_embedding(x, E, T, r["m"], r["inv_s"], r["argmax"], act,
                        SamplerConfig(soft_impl="chunked", soft_chunk=chunk))
    assert ws.shape == (1, N * CL, H) and torch.isfinite(ws).all()
    ours = ws[0].view(N, CL, H) * math.sqrt(H)
    p = torch.softmax(x[0].double() / 0.7, -1)
    truth = p @ E.double() * math.sqrt(H)
    eager = (p.float().to(edtype) @ E).float() * math.sqrt(H)
    err, err_eager = (ours[0] - truth).abs().max().item(), (eager - truth).abs().max().item()
    assert err <= 2 * err_eager + 1e-5 * truth.abs().max().item(), (err, err_eager)
    assert torch.equal(ws[0, CL:2 * CL], E[r["argmax"][1]].float())                # one-hot rows: exact
    assert (ws[0, 2 * CL:] == 0).all()
    # greedy_onehot=False (the step's mode): T = 0 rows are left 0 for the reduce kernel's E[argmax] gather
    ws2 = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=chunk, greedy_onehot=False)
    assert (ws2[0, CL:] == 0).all() and torch.equal(ws2[0, :CL], ws[0, :CL])


def test_chunked_soft_embedding_finite_with_very_negative_logits_past_the_last_chunk():
    """Rows whose max z is far below -88 (exp(-m) overflows): the tail of the last chunk past V must give p = 0,
    not inf * 0 = NaN."""
    N, CL, V, H = 1, 4, 100, 16
    x = torch.full((N, CL, V), -500.0)
    x[..., 3] = -400.0
    E = torch.randn(V, H).bfloat16()
    T = torch.tensor([0.5])
    z = torch.zeros(N, dtype=torch.int64)
    act = torch.ones(N, dtype=torch.bool)
    r = row_stats(x, T, z, z, z, z, act)
    ws = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=64)
    assert torch.isfinite(ws).all()
    assert torch.allclose(ws[0], E[3].float().expand(CL, H), atol=1e-6)


def _specs(CL):
    return [(0, 1, SamplingParams(canvas_length=CL, seed=1)),                       # continuing, T > 0
            (1, 2, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0)),         # continuing, T = 0
            (2, 3, SamplingParams(canvas_length=CL, max_denoising_steps=1)),        # converges (cap)
            (3, 4, SamplingParams(canvas_length=CL)),                               # fails (NaN)
            (4, 5, SamplingParams(canvas_length=CL))]                               # prefill -> fresh


@pytest.mark.parametrize("chunk", [16, 37, None])
def test_chunked_step_decisions_equal_default_and_soft_rows_written_where_due(chunk):
    """state.soft NaN-poisoned: the chunked step's decisions and state equal the default triton step's and the
    reference's exactly; continuing rows within tolerance of the reference (T = 0: E[argmax] exact), fresh
    canvases 0, converged / failed / untouched rows keep their poison."""
    CL, V, H = 8, 64, 16
    states = [_mk_state(_specs(CL), CL, V, H) for _ in range(3)]
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.arange(5, device=DEV)
    pd = torch.tensor([True, True, True, True, False], device=DEV)
    for st in states:
        sampler_step(st, slots, torch.zeros(5, CL, V, device=DEV), pd, E, backend="reference")
    x = torch.randn(5, CL, V, device=DEV) * 3
    x[3, 0, 0] = float("nan")
    x[4] = float("nan")    # PREFILL row: logits ignored
    pd = torch.ones(5, dtype=torch.bool, device=DEV)
    for st in states:
        st.soft.fill_(float("nan"))
    a, b, c = states
    oa = sampler_step(a, slots, x, pd, E, backend="reference")
    ob = ts.sampler_step(b, slots, x, pd, E)
    oc = ts.sampler_step(c, slots, x, pd, E, config=SamplerConfig(soft_impl="chunked", soft_chunk=chunk))
    for f in DECISIONS:
        assert torch.equal(getattr(oc, f), getattr(ob, f)) and torch.equal(getattr(oc, f), getattr(oa, f)), f
    assert torch.allclose(oc.entropy, ob.entropy, rtol=0, atol=0, equal_nan=True)
    for f in STATE_FIELDS:
        assert torch.equal(getattr(c, f), getattr(a, f)), f
    assert oc.converged.tolist() == [False, False, True, False, False] and oc.failed[3].item()
    assert c.phase[3].item() == FAILED
    for s in (0, 1, 4):
        assert torch.isfinite(c.soft[s]).all(), s
    assert (c.soft[4] == 0).all()
    assert torch.equal(c.soft[1], a.soft[1])
    assert torch.allclose(c.soft[0], a.soft[0], atol=0.05 * a.soft[0].abs().max().item())
    assert torch.allclose(c.soft[0], b.soft[0], atol=1e-5 * b.soft[0].abs().max().item() + 1e-6)
    for s in (2, 3, 5):
        assert torch.isnan(c.soft[s]).all(), s


def test_chunked_batch_invariance():
    """A request's soft embedding and decisions do not depend on its slot or on the other rows of the batch."""
    CL, V, H = 8, 50, 16
    cfg = SamplerConfig(soft_impl="chunked", soft_chunk=24)
    pa = SamplingParams(canvas_length=CL, seed=9, max_denoising_steps=3)
    a = _mk_state([(0, 777, pa)], CL, V, H)
    b = _mk_state([(2, 1, SamplingParams(canvas_length=CL, seed=1)), (4, 777, pa),
                   (0, 3, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0))], CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    sa, sb = torch.tensor([0], device=DEV), torch.tensor([2, 4, 0], device=DEV)
    g = torch.Generator().manual_seed(5)
    for it in range(3):
        x = (torch.randn(3, CL, V, generator=g) * 2).to(DEV)
        oa = ts.sampler_step(a, sa, x[1:2], torch.ones(1, dtype=torch.bool, device=DEV), E, config=cfg)
        ob = ts.sampler_step(b, sb, x, torch.ones(3, dtype=torch.bool, device=DEV), E, config=cfg)
        for f in DECISIONS + ("entropy", "mean_entropy"):
            assert torch.equal(getattr(oa, f)[0], getattr(ob, f)[1]), f
        for f in STATE_FIELDS:
            assert torch.equal(getattr(a, f)[0], getattr(b, f)[4]), f
        assert torch.allclose(a.soft[0], b.soft[4], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("overlap,stats_overlap", [(False, False), (True, False), (False, True)])
def test_gpu_chunked_sampler_n4_finite_close_to_default_and_graph_capturable(overlap, stats_overlap):
    """sampler_n4 (4 x 256 x 262144 fp32 logits, E bf16 [262144, 2816], one greedy request): the chunked step's
    decisions equal the default path's, its NaN-poisoned soft rows are all written, finite and within 2 % (of the
    max magnitude) of the default path's; a CUDA-graph replay equals the eager step; extra memory <= 64 MiB."""
    N, CL, V, H = 4, 256, 262144, 2816
    g = torch.Generator(device="cuda").manual_seed(0)
    x = 30.0 * torch.tanh(torch.randn(N, CL, V, device="cuda", generator=g) * 4.0 / 30.0)
    E = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    specs = [(i, 1000 + i, SamplingParams(canvas_length=CL, seed=i, max_denoising_steps=10000,
                                          t_min=0.0 if i == 3 else 0.4, t_max=0.0 if i == 3 else 0.8))
             for i in range(N)]
    cfg = SamplerConfig(soft_impl="chunked", soft_overlap=overlap, stats_overlap=stats_overlap)
    slots = torch.arange(N, device="cuda")
    pd = torch.ones(N, dtype=torch.bool, device="cuda")
    a, b = _mk_state(specs, CL, V, H, R=N, device="cuda"), _mk_state(specs, CL, V, H, R=N, device="cuda")
    for st in (a, b):
        ts.sampler_step(st, slots, x, pd, E)          # PREFILL -> DENOISE
        st.soft.fill_(float("nan"))
    oa = ts.sampler_step(a, slots, x, pd, E)
    ob = ts.sampler_step(b, slots, x, pd, E, config=cfg)
    torch.cuda.synchronize()
    for f in DECISIONS:
        assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    assert torch.isfinite(b.soft).all()
    scale = a.soft.abs().max().item()
    assert (a.soft - b.soft).abs().max().item() <= 0.02 * scale
    assert torch.equal(a.soft[3], b.soft[3])          # greedy: E[argmax] * sqrt(hidden)
    # CUDA graph: capture one step on a copy of the state, replay, compare with eager from the same state
    c = _mk_state(specs, CL, V, H, R=N, device="cuda")
    d = _mk_state(specs, CL, V, H, R=N, device="cuda")
    for st in (c, d):
        ts.sampler_step(st, slots, x, pd, E)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ts.sampler_step(SamplerState(N, CL, V, H, device="cuda"), slots, x, pd, E, config=cfg)  # compile
    torch.cuda.current_stream().wait_stream(s)
    snap = {k: getattr(c, k).clone() for k in STATE_FIELDS + ("soft",)}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ts.sampler_step(c, slots, x, pd, E, config=cfg)
    for k, v in snap.items():
        getattr(c, k).copy_(v)
    graph.replay()
    ts.sampler_step(d, slots, x, pd, E, config=cfg)
    torch.cuda.synchronize()
    for f in STATE_FIELDS + ("soft",):
        assert torch.equal(getattr(c, f), getattr(d, f)), f
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ts.sampler_step(d, slots, x, pd, E, config=cfg)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 64 * 2**20


def test_overlap_flag_gives_identical_sums():
    """soft_overlap only changes the streams (CUDA) and the chunk size, never the per-chunk products: equal to
    the serial path with the same chunk (on the CPU the flag is ignored)."""
    g = torch.Generator().manual_seed(7)
    N, CL, V, H = 2, 4, 90, 16
    x = (torch.randn(N, CL, V, generator=g) * 2).to(DEV)
    E = torch.randn(V, H, generator=g).bfloat16().to(DEV)
    T = torch.tensor([0.6, 1.3], device=DEV)
    z = torch.zeros(N, dtype=torch.int64, device=DEV)
    act = torch.ones(N, dtype=torch.bool, device=DEV)
    r = row_stats(x, T, z, z, z, z, act)
    a = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=32, overlap=False)
    b = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=32, overlap=True)
    assert torch.equal(a, b)


def test_row_moments_normalise_the_sampling_rows_only():
    """row_moments: m = max(x / T) and inv_s = 1 / sum exp(x / T - m) within float32 rounding on active T > 0 rows;
    greedy and inactive rows untouched (0), NaN logits stay in their row."""
    from blockdiff.sampler.triton.kernels import row_moments

    g = torch.Generator().manual_seed(3)
    N, CL, V = 4, 3, 150
    x = (torch.randn(N, CL, V, generator=g) * 5).to(DEV)
    x[1, 0, 7] = float("nan")
    T = torch.tensor([0.7, 1.0, 0.0, 2.5], device=DEV)
    act = torch.tensor([True, True, True, False], device=DEV)
    m, inv_s = row_moments(x, T, act)
    z = x.double() / T.double().clamp_min(1e-30)[:, None, None]
    zm = z.max(-1).values
    ref_inv = 1 / torch.exp(z - zm[..., None]).sum(-1)
    ok = torch.tensor([True, True, False, False], device=DEV)[:, None].expand(N, CL).clone()
    ok[1, 0] = False
    assert torch.allclose(m[ok].double(), zm[ok], rtol=1e-6)
    assert torch.allclose(inv_s[ok].double(), ref_inv[ok], rtol=1e-5)
    assert (m[2:] == 0).all() and (inv_s[2:] == 0).all()
    assert torch.isnan(m[1, 0]) or torch.isnan(inv_s[1, 0])


@pytest.mark.parametrize("soft_overlap", [False, True])
def test_stats_overlap_same_decisions_and_soft_within_rounding(soft_overlap):
    """SamplerConfig(stats_overlap=True) (normalisers from row_moments, GEMM over every denoising row, stats on a
    side stream on CUDA) gives exactly the default chunked step's decisions and state, and soft rows within float
    rounding of it — also for greedy, NaN-failed and converging rows (never written from the extra GEMM rows)."""
    g = torch.Generator().manual_seed(11)
    CL_, V_, H_ = 8, 70, 16
    specs = [(0, 10, SamplingParams(canvas_length=CL_, seed=1, t_min=0.4, t_max=0.9, max_denoising_steps=6)),
             (1, 11, SamplingParams(canvas_length=CL_, seed=2, t_min=0.0, t_max=0.0, max_denoising_steps=6)),
             (2, 12, SamplingParams(canvas_length=CL_, seed=3, t_min=1.0, t_max=1.0, max_denoising_steps=2)),
             (3, 13, SamplingParams(canvas_length=CL_, seed=4, t_min=0.5, t_max=0.5, max_denoising_steps=6))]
    E = (torch.randn(V_, H_, generator=g) * 0.3).bfloat16().to(DEV)
    slots = torch.arange(4, device=DEV)
    pd = torch.ones(4, dtype=torch.bool, device=DEV)
    a = _mk_state(specs, CL_, V_, H_, R=4, device=DEV)
    b = _mk_state(specs, CL_, V_, H_, R=4, device=DEV)
    base = SamplerConfig(soft_impl="chunked", soft_chunk=32, soft_overlap=soft_overlap)
    ovl = SamplerConfig(soft_impl="chunked", soft_chunk=32, soft_overlap=soft_overlap, stats_overlap=True)
    for it in range(4):
        x = (torch.randn(4, CL_, V_, generator=g) * 3).to(DEV)
        if it == 2:
            x[3, 5, 9] = float("nan")        # request 3 fails
        oa = ts.sampler_step(a, slots, x, pd, E, config=base)
        ob = ts.sampler_step(b, slots, x, pd, E, config=ovl)
        for f in DECISIONS + ("entropy", "mean_entropy"):   # exact (NaN where the failed row has NaN)
            torch.testing.assert_close(getattr(oa, f), getattr(ob, f), rtol=0, atol=0, equal_nan=True, msg=f"{it} {f}")
        for f in STATE_FIELDS:
            assert torch.equal(getattr(a, f), getattr(b, f)), (it, f)
        assert torch.isfinite(b.soft).all() == torch.isfinite(a.soft).all()
        assert torch.allclose(a.soft, b.soft, rtol=1e-3, atol=1e-3), (it, (a.soft - b.soft).abs().max())


def test_default_soft_impl_is_chunked_on_cuda_for_half_embeddings_regression():
    """Regression: the default was once decided on the unresolved config and never picked the chunked path."""
    import torch
    from blockdiff.sampler.triton.kernels import default_soft_impl

    assert default_soft_impl(torch.device("cuda"), torch.bfloat16) == "chunked"
    assert default_soft_impl(torch.device("cuda"), torch.float16) == "chunked"
    assert default_soft_impl(torch.device("cuda"), torch.float32) == "triton_gemm"
    assert default_soft_impl(torch.device("cpu"), torch.bfloat16) == "triton_gemm"


@pytest.mark.parametrize("T", [1e-4, 1e-6, 1e-8])
def test_soft_embedding_at_tiny_temperature_matches_the_reference_without_cancellation(T):
    """Regression: p was exp2(x * log2e / T - m log2e), two values of size |x| / T whose difference cancelled
    (soft rows off by 0.07 at T = 1e-4, 4.5 at 1e-6, inf at 1e-8: the next step's logits turned NaN and the request
    FAILED). Now z = x / T (IEEE, as the reference) and exp(z - m): every soft path equals the reference, and a
    request at T = 1e-8 runs to its step cap instead of failing."""
    CL_, V_, H_ = 8, 120, 8
    E = torch.randn(V_, H_, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, CL_, V_, generator=torch.Generator().manual_seed(2)) * 5
    x[:, :, 7] = x[:, :, 3]                                   # ties at the max of some rows
    pd = torch.ones(2, dtype=torch.bool)
    slots = torch.arange(2)
    specs = [(0, 5, SamplingParams(canvas_length=CL_, seed=1, t_min=T, t_max=T, max_denoising_steps=3,
                                   confidence_threshold=0.0)),
             (1, 6, SamplingParams(canvas_length=CL_, seed=2, t_min=0.7, t_max=0.7, max_denoising_steps=3,
                                   confidence_threshold=0.0))]
    configs = {"triton_gemm": SamplerConfig(soft_impl="triton_gemm"), "chunked": SamplerConfig(soft_impl="chunked"),
               "stats_overlap": SamplerConfig(soft_impl="chunked", stats_overlap=True)}
    ref = _mk_state(specs, CL_, V_, H_, R=2, device="cpu")
    states = {k: _mk_state(specs, CL_, V_, H_, R=2, device="cpu") for k in configs}
    for _ in range(4):                                        # prefill, 3 denoising steps (cap) -> commit
        sampler_step(ref, slots, x, pd, E, backend="reference")
        for k, cfg in configs.items():
            ts.sampler_step(states[k], slots, x, pd, E, config=cfg)
            assert torch.isfinite(states[k].soft).all(), k
            assert torch.allclose(states[k].soft, ref.soft, rtol=1e-5, atol=1e-5), \
                (k, (states[k].soft - ref.soft).abs().max())
            assert torch.equal(states[k].phase, ref.phase), k
    assert ref.phase[0].item() != FAILED
    for k in configs:
        assert states[k].phase[0].item() != FAILED, k


def test_chunked_out_workspace_is_zeroed_and_checked():
    """soft_embedding_chunked(out=...) accumulates into the caller's workspace (zeroed first, so a reused
    workspace holding garbage gives the same sums) and rejects a workspace of the wrong shape / dtype."""
    g = torch.Generator().manual_seed(5)
    N, CL_, V_, H_ = 2, 3, 50, 8
    x = (torch.randn(N, CL_, V_, generator=g) * 2).to(DEV)
    E = torch.randn(V_, H_, generator=g).to(DEV)
    T = torch.tensor([0.6, 1.3], device=DEV)
    z = torch.zeros(N, dtype=torch.int64, device=DEV)
    act = torch.ones(N, dtype=torch.bool, device=DEV)
    r = row_stats(x, T, z, z, z, z, act)
    a = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=16)
    ws = torch.full((1, N * CL_, H_), float("nan"), device=DEV)
    b = soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, chunk=16, out=ws)
    assert b.data_ptr() == ws.data_ptr() and torch.equal(a, b)
    with pytest.raises(ValueError, match="out"):
        soft_embedding_chunked(x, E, T, r["m"], r["inv_s"], r["argmax"], act, out=torch.zeros(1, N * CL_, H_ + 1))
