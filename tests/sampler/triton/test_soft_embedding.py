"""Stage (c) of the Triton sampler (blockdiff.sampler.triton.soft_embedding) vs the reference: the split-K Triton
GEMM (``soft_impl="triton_gemm"``) and the chunked path (``soft_impl="chunked"``).

CPU: Triton interpreter for the GEMM and the probability-chunk kernel, fp32 matmul of the bf16-rounded chunk.
Split-K counts, TMA and pointer loads, split tails past V; chunk sizes that divide V, that do not, of 1 token and
larger than V; T = 0 rows; skipped (converged / failed / inactive) rows with NaN logits; NaN-poisoned state.soft;
decisions identical to the default triton path; the GEMM's sm_90a wgmma wait (offline compile). Batch invariance
of both paths: test_triton_sampler.py.
"""
import math

import pytest
import torch

from blockdiff.sampler import FAILED, SamplerState, SamplingParams, sampler_step
from blockdiff.sampler import triton as ts
from blockdiff.sampler.triton.config import SamplerConfig
from blockdiff.sampler.triton.soft_embedding import (LARGE_BATCH_CHUNK, LARGE_BATCH_CHUNK_BYTES, MAX_CHUNK_BYTES,
                                                     _p_buffer_plan, chunk_size, soft_embedding, soft_embedding_chunked)
from blockdiff.sampler.triton.stats import row_stats
from triton_sampler_helpers import DECISIONS, DEV, STATE_FIELDS, big_case, mk_state, soft_truth


# ---------------------------------------------------------------------------------------------- split-K GEMM
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
    truth = soft_truth(x, T, E)
    p = torch.softmax(x / T[:, None, None], -1)
    eager = (p.to(edtype) @ E).float() * math.sqrt(H)
    err, err_eager = (ours - truth).abs().max().item(), (eager - truth).abs().max().item()
    tol = 1e-5 * truth.abs().max().item()
    assert err <= 2 * err_eager + tol, (err, err_eager)


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
        truth = soft_truth(x[n:n + 1], T[n:n + 1], E)[0]
        assert (ours[n] - truth).abs().max().item() <= 0.02 * truth.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 2),
                                  (64, 256, 32, 4, 4)])
def test_gpu_soft_embedding_tiles_finite_and_close(tile):
    """Every GEMM tile the benchmark times or tunes, on the full sampler_n4 shape: workspace finite everywhere
    (poisoned with NaN first: unwritten rows show) and the first 64 positions of every request within 2 % of
    ``softmax(z).bf16() @ E`` (one-hot for the greedy request). Regression for the 128 x 256 NaN (RAW hazard)."""
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, _ = big_case(N, CL, V, H, seed=2)
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


_COMPILE_SOFT_GEMM_SM90 = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.sampler.triton import soft_embedding as se

fn = se._soft_embedding_kernel
bm, bn, bk = 128, 256, 64
sig = {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "e_ptr": "*bf16", "stride_ev": "i32",
       "stride_eh": "i32", "x_desc": f"tensordesc<fp32[{bm},{bk}]>", "e_desc": f"tensordesc<bf16[{bk},{bn}]>",
       "ws_ptr": "*fp32", "t_ptr": "*fp32", "active_ptr": "*i32", "m_ptr": "*fp32", "inv_s_ptr": "*fp32",
       "shift_ptr": "*fp32", "amax_ptr": "*i32", "M": "i32", "CL": "i32", "V": "i32", "HID": "i32", "UNIT": "fp32"}
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


# ---------------------------------------------------------------------------------------------- chunked
def test_chunk_size_fits_the_buffer_budget():
    assert chunk_size(1024, 262144) == 16384 and 1024 * 16384 * 2 <= MAX_CHUNK_BYTES
    assert chunk_size(1024, 1000) == 1000 and chunk_size(8, 262144) == 65536
    assert chunk_size(512, 262144, itemsize=4) == 16384 and chunk_size(1024, 262144, itemsize=4) == 16384
    # large batches (H200, 2026-12-03: at 8,192 rows 16,384-token chunks took 15 % less step time than 2,048)
    assert chunk_size(8192, 262144) == 16384 and 8192 * 16384 * 2 <= LARGE_BATCH_CHUNK_BYTES
    assert chunk_size(16384, 262144) == 8192 and chunk_size(6656, 262144) == 16384
    assert chunk_size(8192, 262144, itemsize=4) == 8192 and chunk_size(1 << 20, 262144) == 128
    assert chunk_size(16, 100, requested=37) == 37 and chunk_size(16, 100, requested=500) == 100
    with pytest.raises(ValueError, match="soft_chunk"):
        chunk_size(16, 100, requested=0)
    with pytest.raises(ValueError, match="buffers"):
        chunk_size(16, 100, buffers=0)
    with pytest.raises(ValueError, match="soft_impl"):
        SamplerConfig(soft_impl="cublas")
    with pytest.raises(ValueError, match="soft_chunk"):
        SamplerConfig(soft_impl="chunked", soft_chunk=0)


def test_the_p_buffer_plan_allocates_no_tensor_on_the_launch_path(monkeypatch):
    """soft_embedding_chunked plans its P buffers on every call (the default GPU path, each step): the plan
    allocated a 0-d tensor for its dtype's element size (~1.5 of its ~4 us of host time). It reads
    ``dtype.itemsize`` now; the plan is unchanged (the test below)."""
    def no_alloc(*a, **k):
        raise AssertionError("torch.empty on the plan path")
    monkeypatch.setattr(torch, "empty", no_alloc)
    for dev in (torch.device("cuda"), "cuda", torch.device("cpu")):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            vc, nbuf, buf = _p_buffer_plan(1024, 262144, None, dtype, dev, False)
            want = dtype if torch.device(dev).type == "cuda" else torch.float32
            assert buf == want and vc == chunk_size(1024, 262144, None, want.itemsize) and nbuf == 1


def test_overlapped_p_buffers_together_stay_within_the_serial_paths_budget():
    """Regression (H200, 5d27a11: the sampler_n4 step with soft_overlap peaked at 75.1 MiB over its base, test bound
    64 MiB): the overlapped path's two P buffers were sized as one buffer of twice the element size, which the
    large-batch rule (2066620) took for a large batch's chunk and raised back to 16,384 tokens: 2 x 32 MiB at
    1,024 bf16 rows. The plan soft_embedding_chunked allocates from (no GPU needed: nothing is allocated): both
    buffers together within the budget the serial path has at the same rows, whether a batch is large decided by
    the rows alone."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    V = 262144
    assert _p_buffer_plan(1024, V, None, torch.bfloat16, cuda, False) == (16384, 1, torch.bfloat16)
    assert _p_buffer_plan(1024, V, None, torch.bfloat16, cuda, True) == (8192, 2, torch.bfloat16)   # as at 4103fef
    assert _p_buffer_plan(8192, V, None, torch.bfloat16, cuda, True) == (8192, 2, torch.bfloat16)   # 2 x 128 MiB
    assert _p_buffer_plan(1024, V, 4096, torch.bfloat16, cuda, True) == (4096, 2, torch.bfloat16)   # explicit chunk
    assert _p_buffer_plan(1024, V, None, torch.bfloat16, cpu, True) == (16384, 1, torch.float32)    # CPU: no overlap
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.empty((), dtype=dtype).element_size()
        for M in (1, 8, 512, 513, 1000, 1024, 1025, 2048, 6656, 8192, 16384, 1 << 18):
            serial, _, _ = _p_buffer_plan(M, V, None, dtype, cuda, False)
            vc, nbuf, _ = _p_buffer_plan(M, V, None, dtype, cuda, True)
            budget = MAX_CHUNK_BYTES if M * LARGE_BATCH_CHUNK * size <= MAX_CHUNK_BYTES else LARGE_BATCH_CHUNK_BYTES
            assert nbuf == 2 and vc <= serial, (dtype, M, vc, serial)
            assert nbuf * M * vc * size <= max(budget, nbuf * M * 64 * size), (dtype, M, vc)   # 64: the floor
            assert M * serial * size <= max(budget, M * 64 * size), (dtype, M, serial)


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
    states = [mk_state(_specs(CL), CL, V, H) for _ in range(3)]
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


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,stats_overlap", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_chunked_sampler_n4_finite_close_to_default_and_graph_capturable(overlap, stats_overlap):
    """sampler_n4 (4 x 256 x 262144 fp32 logits, E bf16 [262144, 2816], one greedy request): the chunked step's
    decisions equal the default path's, its NaN-poisoned soft rows are all written, finite and within 2 % (of the
    max magnitude) of the default path's; a CUDA-graph replay equals the eager step; extra memory <= 64 MiB (the
    documented working memory: the P buffers, together 32 MiB with or without overlap, + the 11 MiB accumulator +
    small vectors; 45.2 MB measured for the serial path; the overlapped path's 75.1 MiB failed it at 5d27a11)."""
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
    a, b = mk_state(specs, CL, V, H, R=N, device="cuda"), mk_state(specs, CL, V, H, R=N, device="cuda")
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
    c = mk_state(specs, CL, V, H, R=N, device="cuda")
    d = mk_state(specs, CL, V, H, R=N, device="cuda")
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
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 64 * 2**20, f"extra memory {extra / 2**20:.1f} MiB"


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
    a = mk_state(specs, CL_, V_, H_, R=4, device=DEV)
    b = mk_state(specs, CL_, V_, H_, R=4, device=DEV)
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
    ref = mk_state(specs, CL_, V_, H_, R=2, device="cpu")
    states = {k: mk_state(specs, CL_, V_, H_, R=2, device="cpu") for k in configs}
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
