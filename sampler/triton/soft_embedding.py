"""Chunked soft embedding of the fused sampler (``SamplerConfig(soft_impl="chunked")``): bf16 probabilities
written once per vocabulary chunk by a Triton kernel, the product on cuBLAS.

``soft = softmax(z) @ E * sqrt(hidden)`` for the M = N * CL rows of a step, z = x / T, as an alternative to the
split-K Triton GEMM of :mod:`blockdiff.sampler.triton.kernels` (whose A operand is recomputed from the logits in
registers per column tile and, after the Triton 3.6 register-A wgmma hazard fix, waits for every wgmma). Here:

for each chunk ``[v0, v0 + Vc)`` of the vocabulary (Vc = 16384 for M = 1024: the buffer is <= 32 MiB):
  1. :func:`_prob_chunk_kernel` writes ``P_c[r, j] = exp2((x / T - m) * log2e) * (1 / s)`` rounded to E's
     dtype into one reusable buffer [M, Vc] (m, 1/s: the row max and sum of the stats pass, the same formula as
     the Triton GEMM's A operand). P is 0 past V, on rows not computed (inactive / converged / failed requests:
     whatever their logits hold, even NaN) and, unless ``greedy_onehot``, on T = 0 rows (their soft row is
     gathered as ``E[argmax]`` exactly by the reduce kernel); with ``greedy_onehot`` T = 0 rows get one-hot(argmax).
  2. ``acc = acc + P_c @ E_c`` with fp32 accumulation and fp32 output on cuBLAS:
     ``torch.addmm(acc, P_c, E_c, out_dtype=torch.float32, out=acc)`` (the ``aten::addmm.dtype`` overload; on the
     H200 with torch 2.11.0+cu130 it runs in place at 676 TFLOP/s for a 1024 x 16384 x 2816 chunk, error vs an
     fp32 product 2.7e-4 on unit-scale data: fp32 accumulation). torch 2.13's CPU build has no CPU kernel for
     ``mm.dtype`` / ``addmm.dtype`` ("Could not run 'aten::addmm.dtype' with arguments from the 'CPU' backend"),
     so on the CPU (tests, Triton interpreter) P is kept in fp32 holding bf16-rounded values and the product is
     an fp32 ``addmm`` of the upcast chunk (the same products, fp32 sums). A bf16-output matmul is never used:
     it would round every chunk's partial sum to bf16.
  3. the caller's reduce kernel writes ``state.soft[slot] = acc * sqrt(hidden)`` in place (``acc`` is returned as a
     [1, M, hidden] workspace, the shape of the split-K workspace with SPLIT_K = 1).

Ordering (default): one stream, one buffer: the P kernel of chunk c + 1 waits for the GEMM of chunk c.
``overlap=True`` (``SamplerConfig.soft_overlap``): two half-size buffers, P of chunk c + 1 on a side stream during
the GEMM of chunk c (fork / join with events; CUDA-graph capture tested). On the H200 it did NOT pay off for the
soft part alone (graph 2.91 ms at Vc 8192, 2.79 ms at Vc 4096, vs 2.49 ms without; eager 3.3-6.3 ms: the
stream / event traffic and the smaller GEMMs cost more than the ~0.3 ms of P writes hidden, since cuBLAS already
fills the SMs), while a full step measured 3.72 vs 3.86 ms graph in the same run (within run-to-run noise), so it
stays off by default. Vc 32768 (64 MiB buffer, over the budget) gave 2.47 ms: chunking costs ~nothing. No host
sync, fixed buffer shapes (all from static shapes): capturable in a CUDA graph.

Cost model for sampler_n4 (M = 1024, V = 262144, hidden 2816, H200 4.3 TB/s, ~790 TFLOP/s bf16):
  - P writes read the 1.07 GB of fp32 logits a second time (+0.25 ms) and write 0.54 GB of bf16 that the GEMM reads
    back (+0.25 ms): ~0.5 ms.
  - GEMM: 2 * 1024 * 262144 * 2816 = 1.51 TFLOP (all rows: cuBLAS cannot skip the greedy / finished requests' rows
    without data-dependent shapes; their P rows are zero) at the measured 676 TFLOP/s -> 2.24 ms (16 chunks, same
    rate as one 2.31 ms full-K product).
  - so the soft part ~2.7-2.8 ms vs ~3.6 ms for the Triton GEMM, and the step ~1.25 (stats) + ~0.15 (decisions)
    + ~2.75 = ~4.1-4.2 ms. That still MISSES the 0.5x target (3.67 ms vs compile 7.35 ms) by ~0.5 ms: the GEMM
    alone at ~2.2 ms plus the compute-bound stats pass at 1.25 ms leave ~0.2 ms for everything else. Closing it
    needs overlapping the P pass with the GEMM (the GEMM is tensor-core bound, the P pass HBM/MUFU bound: ~0.5 ms
    to hide) and the exact Gumbel tile skip in the stats pass (triton_sampler docstring), or fusing the P write
    into the stats pass (needs the final row max: a second pass anyway).

Measured later (H200, same tools, bench/results/sampler-h200.json at 8b669b3 and sampler_overlap-h200.json at
116da61): with the stats kernel's greedy skip (stats 1.03 ms), the default step is 3.683 / 3.644 ms against
torch.compile's 7.350 / 7.321 ms in the same runs: 0.501x / 0.498x. ``SamplerConfig(stats_overlap=True)``
(normalisers from a 0.25 ms memory-bound pre-pass, GEMMs on a high-priority side stream beside the stats pass)
measured 3.88 / 3.87 ms: no overlap happens, since cuBLAS's GEMMs hold every SM (an SM carveout of 16 or 33 SMs
for the GEMMs changed nothing: 3.88 / 3.89 ms), so the pre-pass is pure cost. It stays off.

Latest (H200, bench/results/sampler-h200.json at 857ded9): with the bookkeeping in one Triton step kernel (260 ->
56 kernels per step) and the stats pass's exact Gumbel prefilter (stats 0.80 ms), the default step is 3.335 ms
against torch.compile's 7.352 ms: 0.454x. Of it, the 16 cuBLAS GEMMs take 1.95 ms (~775 TFLOP/s) and the 16 P
chunks 0.42 ms (~3.8 TB/s of logits read + P written): both at their ceilings, so what is left is the second
read of the logits (the P pass needs the final row max) and the stats pass's ALU work.

Measured (H200, torch 2.11.0+cu130, triton 3.6, bench_sampler sampler_n4, CUDA-graph medians, same run):
soft part alone 2.49-2.53 ms (~600 TFLOP/s effective) vs 4.67 ms for the split-K Triton GEMM (after its wgmma-wait fix);
full step fused[chunked] 3.86-3.94 ms vs fused (triton_gemm) 5.86 ms; extra memory 45.2 MB (<= 64 MiB). Against the
historical compile anchor 7.35 ms that is 0.54x: the 0.5x target (3.67 ms) is still missed by ~0.27 ms.

Extra memory: the P buffer (<= 32 MiB; fp32 on the CPU) + acc [M, hidden] fp32 (11.5 MB for sampler_n4).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import _interpret, _round_to

__all__ = ["soft_embedding_chunked", "chunk_size", "MAX_CHUNK_BYTES"]

#: Upper bound of the bf16 probability buffer [M, Vc] in bytes.
MAX_CHUNK_BYTES = 32 * 2**20


@triton.jit
def _prob_chunk_kernel(
    x_ptr, stride_xn, stride_xp, p_ptr,
    t_ptr, active_ptr, m_ptr, inv_s_ptr, amax_ptr,
    M, CL, V, v0, VC,
    GREEDY_ONEHOT: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_R), cdiv(VC, BLOCK_V)): p[r, j] (row-major [M, VC]) for token v0 + j of row r."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < M
    n = rows // CL
    p = rows % CL
    act = tl.load(active_ptr + n, mask=rmask, other=0) != 0
    T = tl.load(t_ptr + n, mask=rmask, other=0.0)
    greedy = T == 0.0
    if GREEDY_ONEHOT:
        rvalid = rmask & act
    else:
        rvalid = rmask & act & ~greedy
    soft_rows = rvalid & ~greedy
    # z = x / T rounded as the stats pass and the reference compute it, then exp(z - m): z - m is exact for
    # the entries that matter (Sterbenz), whatever T. (exp2(x * log2e / T - m log2e) cancels two values of size
    # |x| / T: at T = 1e-5 its exponent was off by ~1, at T <= 1e-8 p overflowed.)
    tdiv = tl.where(soft_rows, T, 1.0)
    mrow = tl.load(m_ptr + rows, mask=soft_rows, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=soft_rows, other=0.0)
    tok = v0 + j
    lmask = soft_rows[:, None] & (tok < V)[None, :]
    xrow = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
    x = tl.load(xrow[:, None] + tok[None, :], mask=lmask, other=0.0).to(tl.float32)
    z = tl.math.div_rn(x, tdiv[:, None])
    prob = tl.exp2((z - mrow[:, None]) * 1.4426950408889634) * inv_s[:, None]
    prob = tl.where(lmask, prob, 0.0)        # 0 past V, on skipped rows (even for NaN logits) and T = 0 rows
    if GREEDY_ONEHOT:
        amax = tl.load(amax_ptr + rows, mask=rvalid, other=-1)
        onehot = (tok[None, :] == amax[:, None]) & (rvalid & greedy)[:, None]
        prob = tl.where(onehot, 1.0, prob)
    if ROUND_TO is not None:                 # CPU: fp32 buffer holding E-dtype-rounded values
        prob = _round_to(prob, ROUND_TO)
    omask = rmask[:, None] & (j < VC)[None, :]
    tl.store(p_ptr + rows[:, None].to(tl.int64) * VC + j[None, :], prob.to(p_ptr.dtype.element_ty), mask=omask)


def chunk_size(M: int, V: int, requested: int | None = None, itemsize: int = 2) -> int:
    """Vocabulary chunk Vc: ``requested`` (clipped to V), else the largest power of two <= 16384... such that the
    [M, Vc] buffer of ``itemsize``-byte elements fits :data:`MAX_CHUNK_BYTES` (at least 64), clipped to V.

    Raises:
        ValueError: ``requested`` < 1.
    """
    if requested is not None:
        if int(requested) < 1:
            raise ValueError(f"soft_chunk must be >= 1 tokens, got {requested}")
        return min(int(requested), V)
    vc = 64
    while vc * 2 * max(M, 1) * itemsize <= MAX_CHUNK_BYTES and vc * 2 <= 65536:
        vc *= 2
    return max(1, min(vc, V))


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, priority: int = 0) -> "torch.cuda.Stream":
    """One cached side stream per (device, priority): priority 0 writes the P chunks here (``overlap``);
    priority -1 (high) runs ``SamplerConfig.stats_overlap``'s soft embedding, so the two never coincide."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=priority)
    return _SIDE_STREAMS[key]


def soft_embedding_chunked(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, m: torch.Tensor,
                           inv_s: torch.Tensor, argmax: torch.Tensor, active: torch.Tensor,
                           chunk: int | None = None, greedy_onehot: bool = True,
                           overlap: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ E`` (unscaled) of the rows of active requests, float32 workspace [1, N * CL, hidden].

    Args:
        logits: float [N, CL, V] (contiguous last dim). embedding: E [V, hidden] bf16/fp16 (P rounded to it, fp32
            accumulation) or fp32. T: float32 [N] (0 = greedy). m, inv_s: float32 [N, CL] row max of z and
            1 / sum exp(z - m) from the stats pass. argmax: int [N, CL]. active: bool/int [N].
        chunk: vocabulary chunk Vc in tokens (None: :func:`chunk_size`). greedy_onehot: T = 0 rows use
            p = one-hot(argmax) (else their rows are 0 and the caller gathers E[argmax]).
        out: optional float32 [1, N * CL, hidden] workspace to accumulate into (zeroed here on the current stream),
            e.g. allocated by a caller's stream when this runs on a side stream; None: allocated here.
        overlap: CUDA only: two P buffers of half the size each (same 32 MiB budget); the P kernel of chunk c + 1
            runs on a side stream while the GEMM of chunk c runs on the current stream (fork / join through
            events: capturable in a CUDA graph; same results, the sums stay in chunk order on one stream).

    Rows of inactive requests are 0 (P is zeroed there whatever their logits hold).
    """
    N, CL, V = logits.shape
    hidden = embedding.shape[1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    M = N * CL
    dev = logits.device
    cuda = dev.type == "cuda"
    lowp = embedding.dtype in (torch.bfloat16, torch.float16)
    overlap = bool(overlap) and cuda
    vc = chunk_size(M, V, chunk, embedding.element_size() * (2 if overlap else 1) if cuda else 4)
    buf_dtype = embedding.dtype if cuda else torch.float32
    if out is not None:
        if out.shape != (1, M, hidden) or out.dtype != torch.float32 or out.device != dev or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 [1, {M}, {hidden}] tensor on {dev}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        acc = out.zero_()
    else:
        acc = torch.zeros(1, M, hidden, dtype=torch.float32, device=dev)
    if M == 0 or V == 0:
        return acc
    pbufs = [torch.empty(M, vc, dtype=buf_dtype, device=dev) for _ in range(2 if overlap else 1)]
    a2 = acc[0]
    block_r, block_v = (4, 1024) if cuda else (min(32, triton.next_power_of_2(M)), min(64, triton.next_power_of_2(vc)))
    round_to = None
    if not cuda and lowp:
        round_to = tl.bfloat16 if embedding.dtype == torch.bfloat16 else tl.float16
    args = (T.contiguous(), active.to(torch.int32).contiguous(), m.contiguous(), inv_s.contiguous(),
            argmax.to(torch.int32).contiguous())
    grid = (triton.cdiv(M, block_r), triton.cdiv(vc, block_v))

    def write_p(pbuf, v0):
        _prob_chunk_kernel[grid](logits, logits.stride(0), logits.stride(1), pbuf, *args, M, CL, V, v0, vc,
                                 GREEDY_ONEHOT=greedy_onehot, ROUND_TO=round_to, BLOCK_R=block_r, BLOCK_V=block_v,
                                 num_warps=4)

    def gemm(pbuf, v0):
        w = min(vc, V - v0)
        pc = pbuf if w == vc else pbuf[:, :w]
        ec = embedding[v0:v0 + w]
        if cuda and lowp:
            torch.addmm(a2, pc, ec, out_dtype=torch.float32, out=a2)
        else:
            torch.addmm(a2, pc, ec.to(torch.float32), out=a2)

    starts = list(range(0, V, vc))
    if not overlap:
        for v0 in starts:
            write_p(pbufs[0], v0)
            gemm(pbufs[0], v0)
        return acc
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev)
    p_ready = [torch.cuda.Event(), torch.cuda.Event()]
    p_free = [torch.cuda.Event(), torch.cuda.Event()]
    side.wait_stream(main)                    # fork: stats, acc = 0 and the logits are ready
    for c, v0 in enumerate(starts):
        b = c & 1
        with torch.cuda.stream(side):
            if c >= 2:
                side.wait_event(p_free[b])    # the GEMM of chunk c - 2 has read this buffer
            write_p(pbufs[b], v0)
            p_ready[b].record(side)
        main.wait_event(p_ready[b])
        gemm(pbufs[b], v0)
        p_free[b].record(main)
    main.wait_stream(side)                    # join (the buffers are freed in the current stream's order)
    return acc
