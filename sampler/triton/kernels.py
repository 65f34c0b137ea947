"""Fused Triton backend of the sampler step (``backend="triton"``): streaming logits, no [N, CL, V] temporaries.

Same semantics as :mod:`blockdiff.sampler.reference` (ARCHITECTURE.md "Sampler semantics"); three stages, none
of which syncs with the host, so a whole step is capturable in a CUDA graph (grids are sized from shapes only):

(a) :func:`_stats_kernel` — one program per (BLOCK_P canvas positions, vocabulary split) streams the logits once in
    ``[BLOCK_P, BLOCK_G, 4]`` tiles (GPU: 1 x 256 x 4 = 1024 tokens per iteration, loads pipelined 3 deep through
    cp.async, 4 warps; ptxas sm_90a (Triton 3.6, CPU compile with the GPU launch's 16-byte divisibility): 141
    registers, no spills, no local memory): one Philox4x32-10 call per (position, group of 4
    tokens), word ``t & 3`` for token ``t``, exactly :mod:`blockdiff.sampler.rng` (``tl.umulhi`` + wrapping uint32
    products). Every tile element (lane) keeps its own float32 online softmax of ``z = x / T`` (IEEE division,
    ``div_rn``, as the reference): max ``m``, ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)`` with one exp
    per element (``d = z - m``; d > 0: ``u = e^-d (u - d s)``, ``s = e^-d s + 1``, ``m = z``; else ``s += e^d``,
    ``u += e^d d``), its first argmax of z and of ``z + g`` (Gumbel-max), and a non-finite flag (a float
    accumulator of ``x * 0``: NaN iff inf / NaN). Splits made of whole tiles (V % CHUNK == 0, e.g. 262144) run
    without token masks. Gumbel prefilter (exact): the accurate logs of ``g = -log(-log u)`` (libdevice logf, as
    torch on CUDA: ~20 instructions each) are taken only for tiles holding a *candidate*, an element with
    ``z + g_up + 0.01 + 1e-5 |z| >= `` the row's best ``z + g`` so far, where ``g_up`` comes from two
    ``lg2.approx`` (within ~1e-3 of g; 16.7 >= max g for u > 1 - 2**-11); one block-wide max of the flag per
    tile decides. Elements of other tiles cannot be, or tie with, the maximum, so the sample is the full
    computation's (the records of the running best, ~ln(#tiles) tiles per row on random logits, and far fewer on
    peaked ones). H200 sampler_n4 stats 0.966 -> 0.763 ms (all rows sampled: 1.196 -> 0.999; peaked logits
    1.196 -> 0.916), results equal to the previous kernel's on 12 logit families (.device run of 2026-11-29).
    Lanes are merged once at the end (``s = sum_l e^(m_l - M) s_l``, ``u = sum_l e^(m_l - M)
    (u_l + (m_l - M) s_l)``, argmax = lowest id among the lanes holding the maximum), vocabulary splits (small
    batches) the same way in :func:`_stats_merge_kernel` (grid over positions); ``H = log s - u / s`` nats
    (= ``-sum p log p``). Rows not in DENOISE are never read. A program whose rows are all greedy (T = 0; on the
    GPU a program is one position) runs the loop without Philox, the logs and the division (its Gumbel sample is
    never used; z = x / 1 = x): H200 sampler_n4 (one greedy request of four) stats 1.03 ms, was 1.24 ms. The row
    coordinates it reads (active, seed, request id, canvas index, step) come from :func:`_gather_rows_kernel`.
(b) Decisions and bookkeeping — the stable sort by entropy and its float32 cumsum in torch
    (:func:`blockdiff.sampler.common.entropy_order`, shared with the reference: its summation order defines the
    decisions), then ONE :func:`_step_kernel` launch, grid (N,): the inclusive bound, renoise / fresh-canvas ids
    (Philox, bit for bit :mod:`blockdiff.sampler.rng`), argmax stability, convergence and every transition of
    :func:`blockdiff.sampler.common.apply_step` (EOS trimming, max_tokens, counters, phases), written in place into
    the state rows and into preallocated StepOutput buffers. With the merge and gather kernels this replaces ~170
    small torch ops per step (CPU profiler count, N = 4; H200 sampler_n4: 260 -> 56 kernels, 3.78 -> 3.47 ms per
    graphed step in same-day runs); ~14 remain: the 11
    of :func:`~blockdiff.sampler.common.temperature` (kept in torch: bit-identical across backends), the sort, the
    cumsum and the soft embedding's int32 cast of argmax. The reference still runs the torch code, and the tests
    compare every decision and state field with it, so given equal entropies the decisions are identical.
(c) :func:`_soft_embedding_kernel` — ``soft = softmax(z) @ E * sqrt(hidden)`` as a split-K GEMM over the
    vocabulary, M = N * CL positions, N = hidden. Its A operand ``exp2((x / T - m) * log2e) / s`` is computed
    on the fly from the fp32 logits with the row stats of (a) (an IEEE division, a subtraction, ex2 and a mul per
    element, recomputed once per column tile; z = x / T as in (a), so z - m does not cancel at small T) and
    rounded to E's dtype (bf16 wgmma, fp32 accumulation). Logits ([N * CL, V] view) and E
    are read through TMA tensor descriptors when their rows are 16-byte aligned (pointer loads otherwise). No
    [CL, V] probability buffer: partial sums go to a ``[SPLIT_K, N * CL, hidden]`` fp32 workspace and
    :func:`_soft_reduce_kernel` adds them in a fixed order (deterministic, batch invariant) and writes
    ``state.soft`` rows in place (continuing rows: the sum; T = 0 rows: ``E[argmax]``, exact; fresh canvases: 0;
    others untouched). M tiles with no continuing row return at once. Default tiles 128 x 256 x 64, 8 warps, 3
    stages (H200 sweep; ptxas sm_90a: 255 registers, ~1.4 KB spill outside the loop), SPLIT_K chosen to fill
    whole waves of the SMs (3 for sampler_n4: 88 tiles x 3 = 2 waves of 132). p is zeroed outside the split's
    vocabulary range and on skipped rows (TMA zero-fills x past V, and exp(0 - m) overflows for m < -88).
    Each iteration waits for its wgmma (the accumulator is used in the loop, so Triton makes the dot synchronous
    and stages the bf16 A tile in shared memory, an "SS" wgmma): left to itself, Triton 3.6 kept A in registers,
    split the dot into K = 16 wgmmas and left 3 in flight while the next iteration's loads / exp2 overwrote
    their A registers (a RAW hazard, NaN at 128 x 256 on the H200; triton-lang/triton#9433). TMA loads stay
    multi-buffered; the MMA of one CTA / warpgroup overlaps the exp2 of the others only.

Extra memory of a step (N rows): the (a) stats, ``N * CL * SPLIT_V * 32`` bytes, the workspace
``SPLIT_K * N * CL * hidden * 4`` bytes (34.6 MB for sampler_n4 at SPLIT_K = 3) and [N, CL] decision tensors.

Exactness: Philox words, ``u`` and the float32 ``z`` are bit-identical to the reference; ``g = -log(-log u)``
uses the platform's float32 log (torch's SLEEF on CPU vs numpy in the Triton interpreter differ by <= 1 ulp on
~1/3 of the 2**23 possible ``u``; on CUDA both call libdevice ``logf``), so a sampled id can differ only where
two candidates of ``z + g`` lie within an ulp. Entropies differ from the reference at float32 rounding level
(summation order); decisions follow from them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import rng
from ..common import check_step_args, entropy_order, temperature
from ..state import COMMIT, DENOISE, FAILED, FINISHED, PREFILL, SamplerState, StepOutput

__all__ = ["sampler_step", "SamplerConfig", "SOFT_IMPLS", "row_stats", "soft_embedding", "random_ids"]

# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors (Random123); same words as blockdiff.sampler.rng.philox4x32_10."""
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _position_ids(seed, rid, cidx, step, p, V, STREAM: tl.constexpr):
    """Random ids of a per-position stream (blockdiff.sampler.rng.random_ids) of one row at positions ``p``.

    seed, rid, cidx, step: int64 scalars of the row; p: int64 [B] positions (any order); returns int64 [B]: words
    0, 1 of Philox(key(seed), (0, p | stream << 16 | step << 18, rid lo, rid hi16 | cidx << 16)),
    id = floor((w0 | w1 << 32) * V / 2**64) exactly, in 32-bit limbs (umulhi + carry).
    """
    zero = (p * 0).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32) + zero
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) + zero
    c1 = ((p & 0xFFFF) | (STREAM << 16) | ((step & 16383) << 18)).to(tl.uint32)
    c2 = (rid & 0xFFFFFFFF).to(tl.uint32) + zero
    c3 = (((rid >> 32) & 0xFFFF) | ((cidx & 0xFFFF) << 16)).to(tl.uint32) + zero
    w0, w1, _, _ = _philox4x32_10(zero, c1, c2, c3, k0, k1)
    v = (zero + V).to(tl.uint32)
    a_hi = tl.umulhi(w0, v)                      # (w0 * V) >> 32
    b_lo = w1 * v                                # (w1 * V) mod 2**32
    b_hi = tl.umulhi(w1, v)
    lo = b_lo + a_hi
    ids = b_hi + (lo < b_lo).to(tl.uint32)       # carry of the low word
    return ids.to(tl.int64)


@triton.jit
def _random_ids_kernel(seed_ptr, rid_ptr, cidx_ptr, step_ptr, out_ptr, CL, V,
                       STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (N, cdiv(CL, BLOCK)): out[n, p] = blockdiff.sampler.rng.random_ids(...)[n, p] for a per-position
    stream (:func:`_position_ids`)."""
    n = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pmask = p < CL
    seed = tl.load(seed_ptr + n).to(tl.int64)
    rid = tl.load(rid_ptr + n).to(tl.int64)
    cidx = tl.load(cidx_ptr + n).to(tl.int64)
    step = tl.load(step_ptr + n).to(tl.int64)
    ids = _position_ids(seed, rid, cidx, step, p.to(tl.int64), V, STREAM)
    tl.store(out_ptr + n.to(tl.int64) * CL + p, ids, mask=pmask)


#: The lowest finite float32 (-3.4028235e38): the online softmax's initial max, <= every finite z (a larger start
#: such as -3e38 would leave z below it out of the sums: s = 0, a NaN entropy on a valid row).
_FLT_LOWEST = tl.constexpr(-3.4028234663852886e38)

#: Gumbel prefilter constants (see :func:`_stats_tile`): ``u > 1 - 2**-11`` takes the bound GUMBEL_MAX_BOUND
#: (>= the largest g, -log(-log(1 - 2**-24)) = 16.635); below it the fast bound is within ~1e-3 of g.
GUMBEL_MAX_BOUND = tl.constexpr(16.7)
GUMBEL_NEAR_ONE = tl.constexpr(1.0 - 2.0 ** -11)
#: Prefilter slack: an element is a candidate iff ``z + g_up + (PREFILTER_ABS + PREFILTER_REL |z|) >= best``.
PREFILTER_ABS = tl.constexpr(0.01)
PREFILTER_REL = tl.constexpr(1e-5)
#: Tests only: force the prefilter's log mode of :func:`_gumbel_upper` (None: 1 on the GPU, 0 in the interpreter).
PREFILTER_LOG_MODE: int | None = None


@triton.jit
def _gumbel_upper(uni, FAST_LOG: tl.constexpr):
    """Cheap stand-in for ``g = -log(-log u)`` (float32, same shape as ``uni``), within PREFILTER_ABS / 2 of g
    where ``u <= 1 - 2**-11`` and GUMBEL_MAX_BOUND (>= every g) above, for the prefilter of :func:`_stats_tile`.

    FAST_LOG 1 (GPU): two ``lg2.approx.ftz.f32`` (libdevice ``fast_log2f``, absolute error ~2**-22): ``-log u``
    >= 4.9e-4 below the cut, so g is off by <= ~7e-4. 0 (the Triton interpreter, which has no libdevice): the
    exact logs. 2 (tests only): the exact g moved by up to +-0.0049, the error the margin allows, to show that
    the result does not depend on how good the bound is.
    """
    if FAST_LOG == 1:
        la = libdevice.fast_log2f(uni) * -0.6931471805599453                  # -ln u
        g = libdevice.fast_log2f(la) * -0.6931471805599453
    elif FAST_LOG == 2:
        g = -tl.log(-tl.log(uni)) + (((uni * 8388608.0).to(tl.int32) % 7) - 3).to(tl.float32) * 0.00163
    else:
        g = -tl.log(-tl.log(uni))
    return tl.where(uni > GUMBEL_NEAR_ONE, GUMBEL_MAX_BOUND, g)


@triton.jit
def _stats_tile(x, tok, mask, tdiv3, grp, c1, c2, c3, k0, k1,
                m, s, u, best, best_i, gbest, gbest_i, bad, rbest,
                BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr, GUMBEL: tl.constexpr,
                FAST_LOG: tl.constexpr):
    """One ``[BLOCK_P, BLOCK_G, 4]`` tile of :func:`_stats_loop`: updates the per-lane accumulators and the
    per-row best Gumbel score ``rbest`` [P] (float32; the exact max of z + g over the elements taken so far).

    ``bad`` is a float32 accumulator of ``x * 0`` (NaN iff a logit was inf or NaN: one FMA per element instead of
    two compares). ``MASKED`` False: every element of the tile is a real token (no masks, no selects).
    """
    j3 = tl.arange(0, 4)[None, None, :]
    bad = bad + x * 0.0
    if GUMBEL:
        z = tl.math.div_rn(x, tdiv3)
    else:                                                            # every valid row has T = 0: x / 1 = x
        z = x
    if MASKED:
        z = tl.where(mask, z, -float("inf"))
    # online softmax per lane: d > 0 moves the lane's max to z (rescale by exp(-d)), else add exp(d)
    d = z - m                                                        # masked: -inf
    up = d > 0
    e = tl.exp(-tl.abs(d))
    # e == 0 contributes nothing, in both directions (p log p -> 0): z = -inf (a -inf logit, a masked token or
    # x / T overflowing) has d = -inf; a finite z far above m has d = +inf (every z > 0 against the initial max
    # -FLT_MAX, and z - m > FLT_MAX later), where e * d * s would be 0 * inf = NaN and fail a valid row.
    # ed = e d (0 where e = 0); up: u = e (u - d s) = e u - ed s.
    ed = tl.where(e > 0.0, e * d, 0.0)
    u = tl.where(up, e * u - ed * s, u + ed)
    s = tl.where(up, e * s + 1.0, s + e)
    m = tl.where(up, z, m)
    take = z > best
    best_i = tl.where(take, tok, best_i)
    best = tl.where(take, z, best)
    if GUMBEL:
        # Gumbel-max sample: one Philox call per (position, group of 4 tokens), word t & 3 for token t
        cg = grp.to(tl.uint32)[None, :]                              # [1, G]
        zero = tl.zeros((BLOCK_P, BLOCK_G), tl.uint32)
        w0, w1, w2, w3 = _philox4x32_10(cg + zero, c1 + zero, c2 + zero, c3 + zero, k0 + zero, k1 + zero)
        w = tl.where(j3 == 0, w0[:, :, None], tl.where(j3 == 1, w1[:, :, None],
                     tl.where(j3 == 2, w2[:, :, None], w3[:, :, None])))
        uni = ((w >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07          # ((w >> 9) + 0.5) * 2**-23
        # Prefilter (exact): an element can only become the sample if z + g >= rbest. With the cheap bound
        # g_up >= g - PREFILTER_ABS / 2, a non-candidate has z + g < rbest with room for the float32 rounding of
        # the sums (PREFILTER_REL |z|). Only a tile holding a candidate takes the two accurate logs (libdevice
        # logf, as torch on CUDA) and updates the lanes; every element that can be the maximum, and the lowest id
        # among equal maxima, passes through that path, so the sample equals the full computation. NaN / -inf z:
        # never a candidate (their z + g never wins either); +inf: always.
        gup = _gumbel_upper(uni, FAST_LOG)
        cand = (z + gup + (PREFILTER_ABS + PREFILTER_REL * tl.abs(z))) >= rbest[:, None, None]
        if tl.max(tl.max(tl.max(cand.to(tl.int32), 2), 1), 0) > 0:
            gum = -tl.log(-tl.log(uni))
            y = z + gum
            if MASKED:
                y = tl.where(mask, y, -float("inf"))
            gtake = y > gbest
            gbest_i = tl.where(gtake, tok, gbest_i)
            gbest = tl.where(gtake, y, gbest)
            rbest = tl.maximum(rbest, tl.max(tl.max(tl.where(y == y, y, -float("inf")), 2), 1))
    return m, s, u, best, best_i, gbest, gbest_i, bad, rbest


@triton.jit
def _stats_loop(base, tdiv3, start, end, c1, c2, c3, k0, k1,
                CHUNK: tl.constexpr, MASKED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                LOAD_STAGES: tl.constexpr, GUMBEL: tl.constexpr, FAST_LOG: tl.constexpr):
    """The streaming loop of :func:`_stats_kernel` over one vocabulary split; ``GUMBEL`` False: no Gumbel-max
    (greedy rows), z = x (T = 0 divides by 1). Returns the per-lane accumulators [P, G, 4] (``bad`` float32)."""
    g_off = tl.arange(0, BLOCK_G)
    j3 = tl.arange(0, 4)[None, None, :]                               # [1, 1, 4]
    # Per-lane accumulators ([P, G, 4]: one slot per tile element, merged across lanes once at the end), so the
    # loop body has no block-wide reduction besides the prefilter's flag: each lane keeps its own online softmax
    # (m, s, u) with one exp per element, its first argmax of z and of z + g (a lane sees increasing token ids, so
    # strict > keeps the first).
    m = tl.full((BLOCK_P, BLOCK_G, 4), _FLT_LOWEST, tl.float32)      # every finite z >= it
    s = tl.zeros((BLOCK_P, BLOCK_G, 4), tl.float32)
    u = tl.zeros((BLOCK_P, BLOCK_G, 4), tl.float32)
    best = tl.full((BLOCK_P, BLOCK_G, 4), -float("inf"), tl.float32)
    best_i = tl.zeros((BLOCK_P, BLOCK_G, 4), tl.int32)
    gbest = tl.full((BLOCK_P, BLOCK_G, 4), -float("inf"), tl.float32)
    gbest_i = tl.zeros((BLOCK_P, BLOCK_G, 4), tl.int32)
    bad = tl.zeros((BLOCK_P, BLOCK_G, 4), tl.float32)
    rbest = tl.full((BLOCK_P,), -float("inf"), tl.float32)
    for i in tl.range(0, CHUNK, 4 * BLOCK_G, num_stages=LOAD_STAGES):
        grp = (start + i) // 4 + g_off                               # [G] token-group ids
        tok = grp[None, :, None] * 4 + j3                            # [1, G, 4]
        if MASKED:                                                   # a split is not whole tiles (host decides)
            mask = tok < end
            x = tl.load(base + tok, mask=mask, other=0.0).to(tl.float32)
        else:
            mask = tok                                               # placeholder: read only when MASKED
            x = tl.load(base + tok).to(tl.float32)
        m, s, u, best, best_i, gbest, gbest_i, bad, rbest = _stats_tile(
            x, tok, mask, tdiv3, grp, c1, c2, c3, k0, k1, m, s, u, best, best_i, gbest, gbest_i, bad, rbest,
            BLOCK_P, BLOCK_G, MASKED, GUMBEL, FAST_LOG)
    return m, s, u, best, best_i, gbest, gbest_i, bad


@triton.jit
def _stats_kernel(
    x_ptr, stride_xn, stride_xp,
    t_ptr, seed_ptr, rid_ptr, cidx_ptr, step_ptr, active_ptr,
    stats_f_ptr, stats_i_ptr,
    R, CL, V,
    CHUNK: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
    LOAD_STAGES: tl.constexpr, MASKED: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Grid (cdiv(N * CL, BLOCK_P), SPLIT_V); tile [BLOCK_P positions, BLOCK_G groups, 4 tokens].

    Writes per (position, split): f32 [m, s, u, best_z, best_y], i32 [argmax, gumbel_argmax, bad].
    ``MASKED`` False (the host's choice when every split is whole tiles: V % CHUNK == 0): no token masks.
    ``FAST_LOG``: the prefilter's logs (:func:`_gumbel_upper`; 1 on the GPU, 0 in the interpreter).
    """
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    r = pid * BLOCK_P + tl.arange(0, BLOCK_P)                       # [P] flat positions
    rmask = r < R
    n = r // CL
    p = r % CL
    active = tl.load(active_ptr + n, mask=rmask, other=0) != 0
    if tl.max(active.to(tl.int32), 0) == 0:
        return
    pvalid = rmask & active
    T = tl.load(t_ptr + n, mask=rmask, other=1.0)
    tdiv = tl.where(T == 0.0, 1.0, T)
    seed = tl.load(seed_ptr + n, mask=rmask, other=0).to(tl.int64)
    rid = tl.load(rid_ptr + n, mask=rmask, other=0).to(tl.int64)
    cidx = tl.load(cidx_ptr + n, mask=rmask, other=0).to(tl.int64)
    step = tl.load(step_ptr + n, mask=rmask, other=0).to(tl.int64)
    # key / counter of blockdiff.sampler.rng (stream GUMBEL = 0), as [P, 1] uint32
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)[:, None]
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c1 = ((p.to(tl.int64) & 0xFFFF) | ((step & 16383) << 18)).to(tl.uint32)[:, None]
    c2 = (rid & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c3 = (((rid >> 32) & 0xFFFF) | ((cidx & 0xFFFF) << 16)).to(tl.uint32)[:, None]

    # Rows are not masked in the loop: a row past R (a partial last block) reads row R - 1, an inactive row its own
    # logits; neither is stored.
    ra = tl.minimum(r, R - 1)
    base = (x_ptr + (ra // CL).to(tl.int64) * stride_xn + (ra % CL).to(tl.int64) * stride_xp)[:, None, None]
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, V)
    tdiv3 = tdiv[:, None, None]
    # Greedy rows (T = 0) take the argmax: their Gumbel sample is never used, so a program whose valid rows are all
    # greedy skips Philox, both logs and the division (T = 0 divides by 1: z = x exactly). Exact: every value the
    # step reads is the same. (On the GPU a program is one position, so the branch is per row.)
    need_g = tl.max(((T != 0.0) & pvalid).to(tl.int32), 0) != 0
    if need_g:
        m, s, u, best, best_i, gbest, gbest_i, bad = _stats_loop(
            base, tdiv3, start, end, c1, c2, c3, k0, k1, CHUNK, MASKED, BLOCK_P, BLOCK_G, LOAD_STAGES, True,
            FAST_LOG)
    else:
        m, s, u, best, best_i, gbest, gbest_i, bad = _stats_loop(
            base, tdiv3, start, end, c1, c2, c3, k0, k1, CHUNK, MASKED, BLOCK_P, BLOCK_G, LOAD_STAGES, False,
            FAST_LOG)

    # merge the lanes: exact online-softmax merge, and the lowest id among the lanes holding the maximum
    mrow = tl.max(tl.max(m, 2), 1)                                   # [P]
    a = tl.exp(m - mrow[:, None, None])
    srow = tl.sum(tl.sum(a * s, 2), 1)
    # a = 0: the lane adds nothing (m - mrow may overflow to -inf: -inf * s would be NaN); a NaN lane (m = +inf)
    # keeps srow NaN, so H stays NaN there
    urow = tl.sum(tl.sum(tl.where(a > 0.0, a * (u + (m - mrow[:, None, None]) * s), 0.0), 2), 1)
    bmax = tl.max(tl.max(best, 2), 1)
    bidx = tl.min(tl.min(tl.where(best == bmax[:, None, None], best_i, 2147483647), 2), 1)
    gmax = tl.max(tl.max(gbest, 2), 1)
    gidx = tl.min(tl.min(tl.where(gbest == gmax[:, None, None], gbest_i, 2147483647), 2), 1)
    badrow = tl.max(tl.max((bad != bad).to(tl.int32), 2), 1)

    o = r * SPLIT_V + sp
    tl.store(stats_f_ptr + o * 5 + 0, mrow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 1, srow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 2, urow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 3, bmax, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 4, gmax, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 0, bidx, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 1, gidx, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 2, badrow, mask=pvalid)


@triton.jit
def _stats_merge_kernel(
    stats_f_ptr, stats_i_ptr, t_ptr, active_ptr,
    m_ptr, inv_s_ptr, h_ptr, hstep_ptr, amax_ptr, gamax_ptr, sampled_ptr, bad_ptr,
    R, CL,
    SPLIT_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (cdiv(N * CL, BLOCK_R),): merge the SPLIT_V vocabulary splits of :func:`_stats_kernel` per position
    (tile [BLOCK_R positions, BLOCK_S >= SPLIT_V splits]) and write the [N, CL] results of :func:`row_stats`.

    ``M = max_k m_k``, ``a_k = exp(m_k - M)``, ``s = sum_k a_k s_k``, ``u = sum_k a_k (u_k + (m_k - M) s_k)`` (the
    formula of the former torch merge; the sum over splits is a tree here, float32 rounding level),
    ``H = log s - u / s`` (NaN where a logit is non-finite), ``inv_s = 1 / s`` (IEEE divisions, as torch); argmax
    and Gumbel argmax: the id of the first split holding the maximum (splits are in increasing id order; the
    maxima are never NaN: a lane only takes ``z > best``), exact. Step inputs besides: ``hstep`` = H, except
    greedy rows (T = 0): 0, NaN where bad (ARCHITECTURE.md step 8); ``sampled`` = Gumbel argmax, greedy rows:
    argmax. Rows of inactive requests (their stats were never written) get zeros.
    """
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)                       # [R] flat positions
    rmask = r < R
    n = r // CL
    act = tl.load(active_ptr + n, mask=rmask, other=0) != 0
    valid = rmask & act
    T = tl.load(t_ptr + n, mask=rmask, other=1.0)
    k = tl.arange(0, BLOCK_S)
    v2 = valid[:, None] & (k < SPLIT_V)[None, :]                    # [R, S]
    o = r.to(tl.int64)[:, None] * SPLIT_V + k[None, :]
    m_k = tl.load(stats_f_ptr + o * 5 + 0, mask=v2, other=-float("inf"))
    s_k = tl.load(stats_f_ptr + o * 5 + 1, mask=v2, other=0.0)
    u_k = tl.load(stats_f_ptr + o * 5 + 2, mask=v2, other=0.0)
    best_k = tl.load(stats_f_ptr + o * 5 + 3, mask=v2, other=-float("inf"))
    gbest_k = tl.load(stats_f_ptr + o * 5 + 4, mask=v2, other=-float("inf"))
    i_k = tl.load(stats_i_ptr + o * 3 + 0, mask=v2, other=0)
    gi_k = tl.load(stats_i_ptr + o * 3 + 1, mask=v2, other=0)
    bad_k = tl.load(stats_i_ptr + o * 3 + 2, mask=v2, other=0)

    m = tl.max(m_k, 1)
    d = m_k - m[:, None]
    a = tl.exp(d)
    s = tl.sum(tl.where(v2, a * s_k, 0.0), 1)
    u = tl.sum(tl.where(v2 & (a > 0.0), a * (u_k + d * s_k), 0.0), 1)   # a = 0: nothing (d = -inf: -inf * s_k)
    s = tl.where(valid, s, 1.0)                                     # rows not computed: no log(0) / 0 / 0
    h = tl.log(s) - tl.math.div_rn(u, s)
    bmax = tl.max(best_k, 1)
    ksel = tl.min(tl.where(v2 & (best_k == bmax[:, None]), k[None, :], BLOCK_S), 1)
    amax = tl.sum(tl.where(k[None, :] == ksel[:, None], i_k, 0), 1).to(tl.int64)
    gmax = tl.max(gbest_k, 1)
    gsel = tl.min(tl.where(v2 & (gbest_k == gmax[:, None]), k[None, :], BLOCK_S), 1)
    gamax = tl.sum(tl.where(k[None, :] == gsel[:, None], gi_k, 0), 1).to(tl.int64)
    bad = tl.max(bad_k, 1) != 0
    h = tl.where(bad, float("nan"), h)
    greedy = T == 0.0
    hstep = tl.where(greedy, tl.where(bad, float("nan"), 0.0), h)
    sampled = tl.where(greedy, amax, gamax)

    tl.store(m_ptr + r, tl.where(valid, m, 0.0), mask=rmask)
    tl.store(inv_s_ptr + r, tl.where(valid, tl.math.div_rn(1.0, s), 0.0), mask=rmask)
    tl.store(h_ptr + r, tl.where(valid, h, 0.0), mask=rmask)
    tl.store(hstep_ptr + r, tl.where(valid, hstep, 0.0), mask=rmask)
    tl.store(amax_ptr + r, tl.where(valid, amax, 0), mask=rmask)
    tl.store(gamax_ptr + r, tl.where(valid, gamax, 0), mask=rmask)
    tl.store(sampled_ptr + r, tl.where(valid, sampled, 0), mask=rmask)
    tl.store(bad_ptr + r, (valid & bad).to(tl.uint8), mask=rmask)


# phase codes of blockdiff.sampler.state, as compile-time constants of the step kernel
_PREFILL = tl.constexpr(PREFILL)
_DENOISE = tl.constexpr(DENOISE)
_COMMIT = tl.constexpr(COMMIT)
_FINISHED = tl.constexpr(FINISHED)
_FAILED = tl.constexpr(FAILED)


@triton.jit
def _gather_rows_kernel(slots_ptr, phase_ptr, seed_ptr, rid_ptr, cidx_ptr, step_ptr,
                        o_active, o_seed, o_rid, o_cidx, o_step, N, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK),): the per-row inputs of the stats pass from the state rows ``slots`` in one launch
    (were five index ops, a compare and a cast): active = (phase == DENOISE) int32, seed / request_id int64,
    canvas_index / step int32."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    msk = i < N
    slot = tl.load(slots_ptr + i, mask=msk, other=0)
    tl.store(o_active + i, (tl.load(phase_ptr + slot, mask=msk, other=0) == _DENOISE).to(tl.int32), mask=msk)
    tl.store(o_seed + i, tl.load(seed_ptr + slot, mask=msk, other=0), mask=msk)
    tl.store(o_rid + i, tl.load(rid_ptr + slot, mask=msk, other=0), mask=msk)
    tl.store(o_cidx + i, tl.load(cidx_ptr + slot, mask=msk, other=0), mask=msk)
    tl.store(o_step + i, tl.load(step_ptr + slot, mask=msk, other=0), mask=msk)


@triton.jit
def _step_kernel(
    slots_ptr, pd_ptr, t_ptr,
    h_ptr, amax_ptr, sampled_ptr, sorted_h_ptr, order_ptr, cum_ptr,
    phase_ptr, canvas_ptr, commit_ptr, prev_ptr, stable_ptr, step_ptr, cidx_ptr, nemit_ptr,
    seed_ptr, rid_ptr, bound_ptr, conf_ptr, max_steps_ptr, k_ptr, eos_ptr, stride_eos, max_tok_ptr,
    o_emitted, o_argmax, o_sampled, o_next, o_accepted, o_entropy,
    o_num_sampled, o_num_rejected, o_num_now, o_finished, o_failed, o_converged, o_mean, o_temp,
    o_cont, o_mode,
    CL, CLF, V, E,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Grid (N,): the bookkeeping of one request per program after the stats pass and the entropy sort (stage b).

    Exactly :func:`blockdiff.sampler.common.apply_step` with :func:`~blockdiff.sampler.common.convergence` and the
    decisions of the former torch code (``accept_by_entropy``'s comparison, renoise ids, next canvas): reads the
    state row ``slots[n]`` at entry, writes its new canvas / commit canvas / prev_argmax / counters / phase in
    place and the StepOutput row n; ``cont`` (int32: the row continues denoising, the soft embedding's rows) and
    ``mode`` (int32: :func:`_soft_reduce_kernel`'s write mode). No host sync, shapes from N and CL only.

    Inputs [N, CL]: ``h`` the step entropies (greedy rows: 0 / NaN), ``amax`` / ``sampled`` int64, and
    ``sorted_h`` / ``order`` / ``cum`` of :func:`~blockdiff.sampler.common.entropy_order` (torch: its float32 cumsum
    defines the decisions). Lane j of the BLOCK >= CL lanes works on position ``q = order[n, j]`` (the j-th lowest
    entropy): it owns that position's acceptance ``cum_j - H_j <= bound`` and every load / store of position q, so
    the sorted decision needs no cross-lane scatter (no barrier, no shared memory); row reductions (failure,
    argmax stability, mean entropy, first EOS as the minimum EOS position) do not depend on the lane order.
    Random ids: RENOISE stream with the row's step, INITIAL with step 0 and the new canvas index (fresh canvases),
    bit for bit :mod:`blockdiff.sampler.rng` (:func:`_position_ids`). ``mean_entropy`` is a tl.sum / CL.
    """
    n = tl.program_id(0)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    j = tl.arange(0, BLOCK)
    jm = j < CL
    row = n.to(tl.int64) * CL
    srow = slot * CL
    q = tl.load(order_ptr + row + j, mask=jm, other=0).to(tl.int64)     # position of the j-th lowest entropy

    # ---- the row at entry
    phase = tl.load(phase_ptr + slot)
    pd = tl.load(pd_ptr + n) != 0
    T = tl.load(t_ptr + n)
    step = tl.load(step_ptr + slot)
    cidx = tl.load(cidx_ptr + slot)
    sc = tl.load(stable_ptr + slot)
    nem = tl.load(nemit_ptr + slot)
    max_tok = tl.load(max_tok_ptr + slot)
    seed = tl.load(seed_ptr + slot)
    rid = tl.load(rid_ptr + slot)
    bound = tl.load(bound_ptr + slot)
    conf = tl.load(conf_ptr + slot)
    S = tl.load(max_steps_ptr + slot)
    k = tl.load(k_ptr + slot)
    is_prefill = phase == _PREFILL
    is_den = phase == _DENOISE
    is_commit = phase == _COMMIT
    h = tl.load(h_ptr + row + q, mask=jm, other=0.0)
    amax = tl.load(amax_ptr + row + q, mask=jm, other=0)
    smp = tl.load(sampled_ptr + row + q, mask=jm, other=0)
    sh = tl.load(sorted_h_ptr + row + j, mask=jm, other=0.0)
    cum = tl.load(cum_ptr + row + j, mask=jm, other=0.0)
    canvas_old = tl.load(canvas_ptr + srow + q, mask=jm, other=0)
    cc_old = tl.load(commit_ptr + srow + q, mask=jm, other=0)
    prev_old = tl.load(prev_ptr + srow + q, mask=jm, other=0)

    # ---- decisions of a DENOISE row (entropy bound, renoise, convergence)
    row_failed = tl.max((jm & (h != h)).to(tl.int32), 0) != 0     # a NaN entropy: non-finite logit / softmax
    sel = ((cum - sh) <= bound) & (sh == sh)                         # accept_by_entropy, inclusive, NaN never
    accepted = sel & ~row_failed
    renoise = _position_ids(seed, rid, cidx.to(tl.int64), step.to(tl.int64), q, V, 1)     # rng.RENOISE
    nc = tl.where(accepted, smp, renoise)
    mean = tl.math.div_rn(tl.sum(tl.where(jm, h, 0.0), 0), CLF)        # CLF = float(CL): CL = 1 is a constexpr
    same = tl.max((jm & (amax != prev_old)).to(tl.int32), 0) == 0
    sc_res = tl.where(same, sc + 1, 0)
    converged = ((sc_res >= k) & (mean < conf)) | ((step + 1) >= S)

    # ---- apply_step: DENOISE rows
    failed = is_den & row_failed
    ok = is_den & ~row_failed
    conv = ok & converged
    cont = ok & ~converged
    new_canvas = tl.where(cont, nc, canvas_old)
    prev_new = tl.where(ok, amax, prev_old)
    sc_new = tl.where(ok, sc_res, sc)
    step_new = tl.where(ok, step + 1, step)
    cc_new = tl.where(conv, amax, cc_old)
    new_phase = tl.where(failed, _FAILED, tl.where(conv, _COMMIT, phase))

    # ---- COMMIT rows: emit the commit canvas trimmed after the first EOS (kept) and at max_tokens
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ptr + slot * stride_eos + e, mask=e < E, other=-1)
    is_eos = tl.max(((cc_new[:, None] == eos[None, :]) & (eos[None, :] >= 0)).to(tl.int32), 1) != 0
    first_eos = tl.min(tl.where(jm & is_eos, q, CL), 0).to(tl.int64)     # CL: none
    has_eos = first_eos < CL
    remaining = max_tok - nem
    n_now = tl.minimum(tl.minimum(first_eos + 1, CL), remaining)
    n_now = tl.where(is_commit, tl.maximum(n_now, 0), 0)
    emitted = tl.where(q < n_now, cc_new, -1)
    eos_emitted = has_eos & (first_eos < remaining)
    nem_new = nem + n_now
    finished = is_commit & (eos_emitted | (nem_new >= max_tok))
    new_phase = tl.where(is_commit, tl.where(finished, _FINISHED, _DENOISE), new_phase)

    # ---- fresh canvases: PREFILL -> DENOISE (the index add_request set), COMMIT -> DENOISE (index + 1)
    start0 = is_prefill & pd
    nextc = is_commit & ~finished
    fresh = start0 | nextc
    cidx_new = tl.where(nextc, cidx + 1, cidx)
    new_phase = tl.where(start0, _DENOISE, new_phase)
    init = _position_ids(seed, rid, cidx_new.to(tl.int64), 0, q, V, 2)          # rng.INITIAL, step 0
    new_canvas = tl.where(fresh, init, new_canvas)
    prev_new = tl.where(fresh, -1, prev_new)
    sc_new = tl.where(fresh, 0, sc_new)
    step_new = tl.where(fresh, 0, step_new)

    # every load of the state row precedes its writes (a lane's loads and stores share addresses; the barrier
    # keeps that true whatever thread a layout gives an element)
    tl.debug_barrier()
    tl.store(canvas_ptr + srow + q, new_canvas, mask=jm)
    tl.store(prev_ptr + srow + q, prev_new, mask=jm)
    tl.store(commit_ptr + srow + q, cc_new, mask=jm)
    tl.store(stable_ptr + slot, sc_new.to(tl.int32))
    tl.store(step_ptr + slot, step_new.to(tl.int32))
    tl.store(cidx_ptr + slot, cidx_new.to(tl.int32))
    tl.store(nemit_ptr + slot, nem_new.to(tl.int64))
    tl.store(phase_ptr + slot, new_phase.to(tl.int32))

    # ---- StepOutput row n (apply_step's masks: diagnostics only on DENOISE rows, -1 / 0 / False elsewhere)
    tl.store(o_emitted + row + q, emitted, mask=jm)
    tl.store(o_argmax + row + q, tl.where(ok, amax, -1), mask=jm)
    tl.store(o_sampled + row + q, tl.where(ok, smp, -1), mask=jm)
    tl.store(o_next + row + q, tl.where(ok, nc, -1), mask=jm)
    tl.store(o_accepted + row + q, (accepted & ok).to(tl.uint8), mask=jm)
    tl.store(o_entropy + row + q, tl.where(is_den, h, 0.0), mask=jm)
    tl.store(o_num_sampled + n, tl.where(is_commit, CL, 0).to(tl.int32))
    tl.store(o_num_rejected + n, tl.where(is_den, CL, 0).to(tl.int32))
    tl.store(o_num_now + n, n_now.to(tl.int32))
    tl.store(o_finished + n, finished.to(tl.uint8))
    tl.store(o_failed + n, failed.to(tl.uint8))
    tl.store(o_converged + n, conv.to(tl.uint8))
    tl.store(o_mean + n, tl.where(is_den, mean, 0.0))
    tl.store(o_temp + n, tl.where(is_den, T, 0.0))
    tl.store(o_cont + n, cont.to(tl.int32))
    # _soft_reduce_kernel: 1 = the GEMM sum, 3 = E[argmax] (T = 0), 2 = zeros (fresh canvas), 0 = untouched
    tl.store(o_mode + n, tl.where(cont, tl.where(T == 0.0, 3, 1), tl.where(fresh, 2, 0)).to(tl.int32))


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 values of ``x.to(dtype)`` with round-to-nearest-even (by hand for bf16; used under the interpreter)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _soft_embedding_kernel(
    x_ptr, stride_xn, stride_xp,
    e_ptr, stride_ev, stride_eh,
    x_desc, e_desc,
    ws_ptr,
    t_ptr, active_ptr, m_ptr, inv_s_ptr, amax_ptr,
    M, CL, V, HID, UNIT,
    K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXACT_FP32: tl.constexpr, INTERPRET: tl.constexpr, USE_TMA: tl.constexpr, GREEDY_ONEHOT: tl.constexpr,
):
    """Grid (cdiv(M, BM), cdiv(HID, BN), SPLIT_K). ws[split, row, col] = sum_{v in split} p[row, v] E[v, col].

    USE_TMA: logits viewed as [M, V] and E [V, HID] are read through tensor descriptors (TMA on Hopper; no
    per-element 64-bit address registers, which spill at 128 x 256 tiles); else masked pointer loads.
    GREEDY_ONEHOT: T = 0 rows use p = one-hot(argmax) here; else they are skipped (the reduce kernel gathers
    E[argmax] for them, cheaper and exact).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    n = rows // CL
    p = rows % CL
    act = tl.load(active_ptr + n, mask=rmask, other=0)
    T = tl.load(t_ptr + n, mask=rmask, other=0.0)
    greedy = T == 0.0
    if GREEDY_ONEHOT:
        rvalid = rmask & (act != 0)
    else:
        rvalid = rmask & (act != 0) & (T != 0.0)       # T = 0 rows: E[argmax] gathered by the reduce kernel
    if tl.max(rvalid.to(tl.int32), 0) == 0:
        return
    # p = exp(z - m) / s = exp2((z - m) * log2e) * inv_s with z = x / T rounded as in the stats pass and the
    # reference (IEEE division): z - m is exact for the entries that matter, whatever T (the former
    # exp2(x * log2e / T - m log2e) cancelled two values of size |x| / T: wrong p at T <= 1e-4, inf at 1e-8).
    # Rows not computed: T -> 1, m = inv_s = 0, and p is zeroed below.
    tdiv = tl.where(rvalid & ~greedy, T, 1.0)
    mrow = tl.load(m_ptr + rows, mask=rvalid, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=rvalid, other=0.0)
    amax = tl.load(amax_ptr + rows, mask=rvalid, other=-1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    kk = tl.arange(0, BLOCK_K)
    xrow = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp      # [BM] row bases
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(V, k_start + K_PER_SPLIT)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if USE_TMA:
            # no masks: K_PER_SPLIT is a multiple of BLOCK_K, so a tile never straddles two splits, and past V
            # both x (-> finite p) and E (-> 0) come back as zeros
            x = x_desc.load([pid_m * BLOCK_M, k_start + k]).to(tl.float32)
            prob = tl.exp2((tl.math.div_rn(x, tdiv[:, None]) - mrow[:, None]) * 1.4426950408889634) * inv_s[:, None]
            ev = e_desc.load([k_start + k, pid_n * BLOCK_N])
            if GREEDY_ONEHOT:
                onehot = ((k_start + k + kk)[None, :] == amax[:, None]).to(tl.float32)
                prob = tl.where(greedy[:, None], onehot, prob)
            # p = 0 outside [k_start, k_end) and on rows not computed, whatever x is there: past V the zero-filled
            # x gives p = exp(-m) / s, which overflows to inf for rows with m < -88 (inf * 0 = NaN in the dot),
            # and garbage / non-finite logits of skipped rows would put NaN in their workspace rows
            prob = tl.where(rvalid[:, None] & ((k_start + k + kk) < k_end)[None, :], prob, 0.0)
        else:
            tok = k_start + k + kk
            kmask = tok < k_end
            lmask = rvalid[:, None] & kmask[None, :]
            x = tl.load(xrow[:, None] + tok[None, :], mask=lmask, other=0.0).to(tl.float32)
            prob = tl.exp2((tl.math.div_rn(x, tdiv[:, None]) - mrow[:, None]) * 1.4426950408889634) * inv_s[:, None]
            if GREEDY_ONEHOT:
                prob = tl.where(greedy[:, None], (tok[None, :] == amax[:, None]).to(tl.float32), prob)
            prob = tl.where(lmask, prob, 0.0)
            ev = tl.load(e_ptr + tok[:, None].to(tl.int64) * stride_ev + cols[None, :] * stride_eh,
                         mask=kmask[:, None] & cmask[None, :], other=0.0)
        if EXACT_FP32:
            acc += tl.dot(prob, ev.to(tl.float32), input_precision="ieee")
        elif INTERPRET:  # the interpreter truncates fp32 -> bf16 and multiplies bf16 as raw bits: round by hand
            acc += tl.dot(_round_to(prob, ev.dtype), ev.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(prob.to(ev.dtype), ev)
            # UNIT = 1.0 at run time (exact). Using the accumulator inside the loop makes Triton's pipeliner wait
            # for this wgmma (wait_group 0; A then goes through shared memory) before the next iteration writes
            # the next A operand: Triton 3.6 otherwise splits the register-A dot into K = 16 wgmmas with 3 left in
            # flight, and the next iteration's loads/exp2 overwrite their A registers while they still read them
            # (a RAW hazard: garbage A fragments, NaN soft embeddings at 128 x 256 tiles; triton-lang/triton#9433).
            acc = acc * UNIT
    out = ws_ptr + (pid_k.to(tl.int64) * M + rows[:, None].to(tl.int64)) * HID + cols[None, :]
    tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _soft_reduce_kernel(
    ws_ptr, soft_ptr, slots_ptr, mode_ptr, amax_ptr, e_ptr, stride_ev, stride_eh,
    M, CL, HID, SCALE,
    SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (M, cdiv(HID, BH)). Per row n, mode[n]: 1 -> soft[slot] = SCALE * sum_k ws[k] (fixed order),
    3 -> soft[slot] = SCALE * E[argmax] (T = 0: p is one-hot), 2 -> 0 (fresh canvas), 0 -> untouched."""
    row = tl.program_id(0)
    hb = tl.program_id(1)
    n = row // CL
    p = row % CL
    mode = tl.load(mode_ptr + n)
    if mode == 0:
        return
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < HID
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if mode == 1:
        for k in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + (k * M + row).to(tl.int64) * HID + cols, mask=cmask, other=0.0)
        acc = acc * SCALE
    if mode == 3:
        tok = tl.load(amax_ptr + row).to(tl.int64)
        acc = tl.load(e_ptr + tok * stride_ev + cols * stride_eh, mask=cmask, other=0.0).to(tl.float32) * SCALE
    slot = tl.load(slots_ptr + n)
    tl.store(soft_ptr + (slot * CL + p).to(tl.int64) * HID + cols, acc, mask=cmask)


@triton.jit
def _moments_kernel(x_ptr, stride_xn, stride_xp, t_ptr, active_ptr, m_ptr, inv_s_ptr, R, CL, V,
                    NUM_TILES: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (R,): row max m = max(z) and inv_s = 1 / sum exp(z - m) of z = x / T (IEEE division, as the stats pass)
    for one position whose request is active and samples (T > 0); other rows are not written. Per-lane online
    max / sum (one exp2 per logit), merged once: the normaliser of the chunked soft embedding's probabilities,
    so its GEMM can start before the stats pass ends (``SamplerConfig.stats_overlap``). Memory-bound: one read
    of the logits."""
    r = tl.program_id(0)
    n = r // CL
    p = r % CL
    act = tl.load(active_ptr + n) != 0
    T = tl.load(t_ptr + n)
    if act & (T > 0.0):
        base = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
        offs = tl.arange(0, BLOCK_V)
        mx = tl.full((BLOCK_V,), _FLT_LOWEST, tl.float32)
        sm = tl.zeros((BLOCK_V,), tl.float32)
        for i in tl.range(0, NUM_TILES):          # NUM_TILES = cdiv(V, BLOCK_V) (a runtime bound fails the interpreter)
            tok = i * BLOCK_V + offs
            x = tl.load(base + tok, mask=tok < V, other=0.0).to(tl.float32)
            z = tl.where(tok < V, tl.math.div_rn(x, T), -float("inf"))
            d = z - mx
            up = d > 0
            e = tl.exp2(-tl.abs(d) * 1.4426950408889634)
            sm = tl.where(up, e * sm + 1.0, sm + e)
            mx = tl.where(up, z, mx)
        mrow = tl.max(mx, 0)
        srow = tl.sum(sm * tl.exp2((mx - mrow) * 1.4426950408889634), 0)
        tl.store(m_ptr + r, mrow)
        tl.store(inv_s_ptr + r, 1.0 / srow)


# ---------------------------------------------------------------------------------------------- launchers
def random_ids(seed: torch.Tensor, request_id: torch.Tensor, canvas_index: torch.Tensor, step: torch.Tensor,
               canvas_length: int, vocab_size: int, stream: int) -> torch.Tensor:
    """:func:`blockdiff.sampler.rng.random_ids` in one Triton launch (same ids, bit for bit): int64 [N, CL].

    Raises:
        ValueError: a stream other than RENOISE / INITIAL, or vocab_size outside [1, 2**31).
    """
    if stream not in (rng.RENOISE, rng.INITIAL):
        raise ValueError(f"stream must be RENOISE ({rng.RENOISE}) or INITIAL ({rng.INITIAL}), got {stream}")
    if not 1 <= int(vocab_size) < rng.MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, 2**31), got {vocab_size}")
    n = seed.shape[0]
    out = torch.empty(n, canvas_length, dtype=torch.int64, device=seed.device)
    if n > 0 and canvas_length > 0:
        block = min(1024, triton.next_power_of_2(canvas_length))
        _random_ids_kernel[(n, triton.cdiv(canvas_length, block))](
            seed.contiguous(), request_id.contiguous(), canvas_index.contiguous(), step.contiguous(), out,
            canvas_length, int(vocab_size), STREAM=stream, BLOCK=block, num_warps=4)
    return out


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Soft-embedding implementations selectable by ``SamplerConfig.soft_impl``.
SOFT_IMPLS = ("triton_gemm", "chunked")


def default_soft_impl(device: torch.device, embedding_dtype: torch.dtype) -> str:
    """The soft-embedding path used when ``SamplerConfig.soft_impl`` is None: ``"chunked"`` (bf16 probability
    chunks + cuBLAS, fp32 accumulation) on CUDA with a bf16/fp16 embedding (H200 sampler_n4: 2.48 vs 4.72 ms for
    the Triton GEMM), else ``"triton_gemm"``."""
    cuda = torch.device(device).type == "cuda"
    return "chunked" if cuda and embedding_dtype in (torch.bfloat16, torch.float16) else "triton_gemm"


@dataclass(frozen=True)
class SamplerConfig:
    """Static launch parameters (compile-cache keys). ``None`` = chosen from the shapes by :meth:`resolve`.

    block_p: canvas positions per stats program (1 on the GPU; many under the interpreter, whose cost is per op).
    block_g: token groups of 4 per stats tile (tile = block_p x 4 * block_g tokens). split_v: vocabulary splits of the
    stats pass. block_m/n/k, split_k, num_warps/num_stages: the soft-embedding GEMM.
    soft_impl: the soft-embedding path, ``"chunked"`` (default on CUDA with a bf16/fp16 embedding:
    :mod:`blockdiff.sampler.triton.soft_embedding`, bf16 probabilities per vocabulary chunk + cuBLAS with fp32
    accumulation; H200 sampler_n4 soft part 2.48 ms vs 4.72 ms, whole step 3.93 vs 5.86 ms) or ``"triton_gemm"``
    (default otherwise: the split-K Triton GEMM of this module);
    soft_chunk: its vocabulary chunk in tokens (None: the buffer [N * CL, chunk] stays <= 32 MiB);
    soft_overlap: chunked path on CUDA: write the next chunk's probabilities on a side stream during the GEMM.
    stats_overlap: chunked path: take the soft embedding's normalisers from a memory-bound pre-pass
    (:func:`row_moments`) and run the soft embedding's GEMMs on a high-priority side stream while the
    compute-bound stats pass (Philox, logs) runs beside them (CUDA; on the CPU the same computation runs in order). Decisions are unchanged (exact);
    the soft rows differ from the default path by float rounding of the normalisers. None: off (H200 sampler_n4:
    3.87 ms with it vs 3.64 ms without: cuBLAS's GEMMs hold every SM, so nothing overlaps and the pre-pass is
    pure cost; kept as a measured option for GEMMs that leave SMs free). With the Triton GEMM it is an error
    (ValueError here for an explicit ``soft_impl="triton_gemm"``, in :func:`sampler_step` where None resolves to it).
    use_tma / soft_overlap / stats_overlap: bool or None (TypeError otherwise).
    """

    block_p: int | None = None
    block_g: int | None = None
    split_v: int | None = None
    stats_warps: int | None = None
    stats_stages: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    gemm_warps: int | None = None
    gemm_stages: int | None = None
    use_tma: bool | None = None
    soft_impl: str | None = None
    soft_chunk: int | None = None
    soft_overlap: bool | None = None
    stats_overlap: bool | None = None

    def __post_init__(self):
        if self.soft_impl not in SOFT_IMPLS + (None,):
            raise ValueError(f"SamplerConfig.soft_impl must be one of {SOFT_IMPLS}, got {self.soft_impl!r}")
        if self.soft_chunk is not None and int(self.soft_chunk) < 1:
            raise ValueError(f"SamplerConfig.soft_chunk must be >= 1 tokens, got {self.soft_chunk}")
        for name in ("use_tma", "soft_overlap", "stats_overlap"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"SamplerConfig.{name} must be a bool or None, got {type(v).__name__} ({v!r})")
        if self.stats_overlap and self.soft_impl == "triton_gemm":
            raise ValueError("SamplerConfig.stats_overlap=True needs the chunked soft embedding (soft_impl='chunked' "
                             "or None where that is the default), got soft_impl='triton_gemm'")

    def resolve(self, rows: int, V: int, hidden: int, device: torch.device) -> "SamplerConfig":
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        block_p = self.block_p or (1 if cuda else min(64, triton.next_power_of_2(max(rows, 1))))
        block_g = self.block_g or (256 if cuda else min(64, triton.next_power_of_2(max(1, (V + 3) // 4))))
        split_v = self.split_v or max(1, min(8, (2 * sms * block_p + rows - 1) // max(rows, 1)))
        if cuda:
            # H200 sweep (bench_sampler --tune, sampler_n4): 128 x 256 x 64, 8 warps, 3 stages, split-K 3 = 3.58 ms
            # vs 5.17 ms at 128 x 128 (the A operand's exp2 is recomputed once per column tile: half as often)
            bm, bn, bk = self.block_m or 128, self.block_n or 256, self.block_k or 64
        else:
            bm = self.block_m or max(16, min(64, triton.next_power_of_2(max(rows, 1))))
            bn = self.block_n or max(16, min(64, triton.next_power_of_2(hidden)))
            bk = self.block_k or 64
        tiles = triton.cdiv(rows, bm) * triton.cdiv(hidden, bn)
        if self.split_k:
            split_k = self.split_k
        elif not cuda:
            split_k = 1
        else:  # the split count (<= 4: workspace) whose CTA count best fills whole waves over the SMs
            def eff(k):
                return tiles * k / (triton.cdiv(tiles * k, sms) * sms)
            split_k = max(range(1, 5), key=lambda k: (round(eff(k), 3), -k))
        split_k = max(1, min(split_k, triton.cdiv(V, bk)))
        # stats: 256 x 4-token tiles, 4 warps, 3-deep loads = 1.249 ms on the H200 (8 warps: 1.293 ms)
        return SamplerConfig(block_p, block_g, split_v, self.stats_warps or 4,
                             self.stats_stages or (3 if cuda else 1), bm, bn, bk, split_k,
                             self.gemm_warps or (8 if cuda else 4), self.gemm_stages or (3 if cuda else 1),
                             self.use_tma, self.soft_impl, self.soft_chunk, self.soft_overlap, self.stats_overlap)


def row_stats(logits: torch.Tensor, T: torch.Tensor, seed: torch.Tensor, request_id: torch.Tensor,
              canvas_index: torch.Tensor, step: torch.Tensor, active: torch.Tensor,
              config: SamplerConfig | None = None) -> dict:
    """Stage (a): per-position streaming statistics of ``z = logits / T``.

    Args:
        logits: float [N, CL, V] (last dim contiguous). T: float32 [N] (0 = greedy). seed, request_id,
            canvas_index, step: [N] integer RNG coordinates. active: int32/bool [N] (0 rows are skipped).

    Returns:
        dict of [N, CL] tensors: ``m`` (max z) and ``inv_s`` (1 / sum exp(z - m)) float32, ``entropy`` float32
        nats (NaN where a logit is non-finite), ``argmax``/``gumbel_argmax`` int64, ``bad`` bool. Values of
        inactive rows are undefined (zeros today), and so is ``gumbel_argmax`` of greedy rows (T = 0: a program
        whose rows are all greedy skips the Gumbel pass; the step uses ``argmax`` there). What the step decides
        on besides: ``step_entropy`` float32 (``entropy``; greedy rows: 0, NaN where bad) and ``sampled`` int64
        (``gumbel_argmax``; greedy rows: ``argmax``).

    Two launches: :func:`_stats_kernel` (per position and vocabulary split) and :func:`_stats_merge_kernel` (the
    splits merged per position; was ~25 small torch ops).
    """
    N, CL, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = (config or SamplerConfig()).resolve(N * CL, V, 1, logits.device)
    tile = 4 * cfg.block_g
    chunk = triton.cdiv(triton.cdiv(V, cfg.split_v), tile) * tile
    split_v = triton.cdiv(V, chunk)
    dev = logits.device
    sf = torch.empty(N * CL * split_v * 5, dtype=torch.float32, device=dev)
    si = torch.empty(N * CL * split_v * 3, dtype=torch.int32, device=dev)
    act = active.to(torch.int32).contiguous()
    if N * CL > 0:
        _stats_kernel[(triton.cdiv(N * CL, cfg.block_p), split_v)](
            logits, logits.stride(0), logits.stride(1),
            T.contiguous(), seed.contiguous(), request_id.contiguous(), canvas_index.contiguous(),
            step.contiguous(), act, sf, si, N * CL, CL, V,
            CHUNK=chunk, SPLIT_V=split_v, BLOCK_P=cfg.block_p, BLOCK_G=cfg.block_g, LOAD_STAGES=cfg.stats_stages,
            MASKED=V % chunk != 0,
            FAST_LOG=PREFILTER_LOG_MODE if PREFILTER_LOG_MODE is not None else (0 if _interpret() else 1),
            num_warps=cfg.stats_warps,
        )
    # the [N, CL] results in two buffers (one allocation per dtype): f32 m, inv_s, entropy, step_entropy;
    # i64 argmax, gumbel_argmax, sampled
    f = torch.empty(4, N, CL, dtype=torch.float32, device=dev)
    i = torch.empty(3, N, CL, dtype=torch.int64, device=dev)
    bad = torch.empty(N, CL, dtype=torch.bool, device=dev)
    if N * CL > 0:
        block_r = 128 if logits.is_cuda else min(256, triton.next_power_of_2(N * CL))
        _stats_merge_kernel[(triton.cdiv(N * CL, block_r),)](
            sf, si, T.contiguous(), act, f[0], f[1], f[2], f[3], i[0], i[1], i[2], bad.view(torch.uint8),
            N * CL, CL, SPLIT_V=split_v, BLOCK_S=triton.next_power_of_2(split_v), BLOCK_R=block_r, num_warps=4)
    return dict(m=f[0], inv_s=f[1], entropy=f[2], argmax=i[0], gumbel_argmax=i[1], bad=bad, step_entropy=f[3],
                sampled=i[2])


def row_moments(logits: torch.Tensor, T: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax normalisers of ``z = logits / T`` for the soft embedding only: ``(m, inv_s)`` float32 [N, CL], the
    row max of z (bit-equal to :func:`row_stats`' m: the same IEEE z) and 1 / sum exp(z - m) (within float32
    rounding of row_stats' value: lane order), on rows of active requests with T > 0; other rows are 0. One
    memory-bound pass over the logits.

    Args: logits float [N, CL, V] (contiguous last dim); T float32 [N]; active bool/int [N].
    """
    N, CL, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    m = torch.zeros(N, CL, dtype=torch.float32, device=logits.device)
    inv_s = torch.zeros(N, CL, dtype=torch.float32, device=logits.device)
    if N * CL > 0 and V > 0:
        block_v = 2048 if logits.is_cuda else min(64, triton.next_power_of_2(V))
        _moments_kernel[(N * CL,)](logits, logits.stride(0), logits.stride(1), T.contiguous(),
                                   active.to(torch.int32).contiguous(), m, inv_s, N * CL, CL, V,
                                   NUM_TILES=triton.cdiv(V, block_v), BLOCK_V=block_v, num_warps=4)
    return m, inv_s


def soft_embedding(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, m: torch.Tensor,
                   inv_s: torch.Tensor, argmax: torch.Tensor, active: torch.Tensor,
                   config: SamplerConfig | None = None, greedy_onehot: bool = True) -> torch.Tensor:
    """Stage (c) partial sums: fp32 workspace ``[SPLIT_K, N * CL, hidden]`` of ``p @ E`` (unscaled).

    ``config.soft_impl == "chunked"``: :func:`blockdiff.sampler.triton.soft_embedding.soft_embedding_chunked` instead
    (workspace [1, N * CL, hidden]; inactive rows 0).

    ``p = exp(logits / T - m) * inv_s`` (one-hot(argmax) where T = 0), rows of inactive requests skipped (their
    workspace rows are left unwritten). Args: logits [N, CL, V]; embedding [V, hidden] (bf16/fp16: p is rounded
    to it, fp32 accumulation; fp32: exact fp32 products); T [N] float32; m, inv_s float32 [N, CL]; argmax int
    [N, CL]; active [N] bool/int32.
    """
    N, CL, V = logits.shape
    hidden = embedding.shape[1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = config or SamplerConfig()
    impl = cfg.soft_impl or default_soft_impl(logits.device, embedding.dtype)
    if impl == "chunked":
        from .soft_embedding import soft_embedding_chunked

        return soft_embedding_chunked(logits, embedding, T, m, inv_s, argmax, active, chunk=cfg.soft_chunk,
                                      greedy_onehot=greedy_onehot, overlap=bool(cfg.soft_overlap))
    if embedding.dtype == torch.float32 and logits.is_cuda:
        # exact fp32 products (input_precision="ieee") run on the FMA units: small tiles, or the
        # accumulators spill (128 x 128 x 64: 10 KB of spill stores per thread, ptxas sm_90a)
        cfg = dataclasses.replace(cfg, block_m=cfg.block_m or 64, block_n=cfg.block_n or 64,
                                  block_k=cfg.block_k or 16, gemm_warps=cfg.gemm_warps or 4)
    cfg = cfg.resolve(N * CL, V, hidden, logits.device)
    M = N * CL
    k_per = triton.cdiv(triton.cdiv(V, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(V, k_per)
    ws = torch.empty(split_k, M, hidden, dtype=torch.float32, device=logits.device)
    if M > 0:
        grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(hidden, cfg.block_n), split_k)
        x_desc = e_desc = None
        use_tma = _tma_ok(logits, embedding, cfg)
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_desc = TensorDescriptor.from_tensor(logits.view(M, V), [cfg.block_m, cfg.block_k])
            e_desc = TensorDescriptor.from_tensor(embedding, [cfg.block_k, cfg.block_n])
        args = (logits, logits.stride(0), logits.stride(1), embedding, embedding.stride(0), embedding.stride(1),
                x_desc, e_desc, ws,
                T.contiguous(), active.to(torch.int32).contiguous(), m.contiguous(), inv_s.contiguous(),
                argmax.to(torch.int32).contiguous(), M, CL, V, hidden, 1.0)
        meta = dict(K_PER_SPLIT=k_per, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    EXACT_FP32=embedding.dtype == torch.float32, INTERPRET=_interpret(), USE_TMA=use_tma,
                    GREEDY_ONEHOT=greedy_onehot,
                    num_warps=cfg.gemm_warps)
        key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.gemm_warps, cfg.gemm_stages, embedding.dtype, use_tma,
               greedy_onehot)
        stages = _STAGES_THAT_FIT.get(key, cfg.gemm_stages)
        while True:
            try:
                _soft_embedding_kernel[grid](*args, **meta, num_stages=stages)
                break
            except triton.runtime.errors.OutOfResources:
                # shared memory of the software pipeline: same kernel with one buffer less (same results)
                if stages <= 1:
                    raise
                stages -= 1
        _STAGES_THAT_FIT[key] = stages
    return ws


def _tma_ok(logits: torch.Tensor, embedding: torch.Tensor, cfg: SamplerConfig) -> bool:
    """Tensor descriptors apply: logits viewable as a row-major [N*CL, V], E row-major, 16-byte aligned rows and
    bases (TMA's rules), and the config allows it (``use_tma`` None = wherever it applies, the interpreter too)."""
    if cfg.use_tma is False:
        return False
    N, CL, V = logits.shape
    ok = (logits.stride(2) == 1 and logits.stride(1) == V and logits.stride(0) == CL * V
          and embedding.stride(1) == 1 and embedding.stride(0) == embedding.shape[1]
          and (V * logits.element_size()) % 16 == 0 and (embedding.shape[1] * embedding.element_size()) % 16 == 0
          and logits.data_ptr() % 16 == 0 and embedding.data_ptr() % 16 == 0)
    if cfg.use_tma and not ok:
        raise ValueError("SamplerConfig(use_tma=True) needs row-major logits/E with 16-byte aligned rows")
    return ok


#: Pipeline depth that fitted in shared memory per GEMM tile configuration (filled at the first launch).
_STAGES_THAT_FIT: dict = {}


def _write_soft(state: SamplerState, slots: torch.Tensor, ws: torch.Tensor, mode: torch.Tensor,
                argmax: torch.Tensor, embedding: torch.Tensor) -> None:
    """Write ``state.soft[slots]`` in place (mode per row: see :func:`_soft_reduce_kernel`)."""
    split_k, M, hidden = ws.shape
    CL = state.canvas_length
    block_h = min(1024, triton.next_power_of_2(hidden))
    if M > 0:
        _soft_reduce_kernel[(M, triton.cdiv(hidden, block_h))](
            ws, state.soft, slots.contiguous(), mode.to(torch.int32).contiguous(), argmax.contiguous(),
            embedding, embedding.stride(0), embedding.stride(1), M, CL, hidden,
            math.sqrt(hidden), SPLIT_K=split_k, BLOCK_H=block_h, num_warps=4,
        )


def _gather_rows(state: SamplerState, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(active, seed, request_id, canvas_index, step)`` of the rows ``slots`` ([N]; active = phase is DENOISE,
    int32; seed / request_id int64; canvas_index / step int32) in one launch of :func:`_gather_rows_kernel`."""
    N = slots.shape[0]
    i64 = torch.empty(2, N, dtype=torch.int64, device=state.device)
    i32 = torch.empty(3, N, dtype=torch.int32, device=state.device)
    if N > 0:
        block = min(1024, triton.next_power_of_2(N))
        _gather_rows_kernel[(triton.cdiv(N, block),)](
            slots.contiguous(), state.phase, state.seed, state.request_id, state.canvas_index, state.step,
            i32[0], i64[0], i64[1], i32[1], i32[2], N, BLOCK=block, num_warps=1)
    return i32[0], i64[0], i64[1], i32[1], i32[2]


def _apply_step(state: SamplerState, slots: torch.Tensor, prefill_done: torch.Tensor, T: torch.Tensor,
                st: dict) -> tuple[StepOutput, torch.Tensor, torch.Tensor]:
    """Stage (b): the entropy sort (torch) and :func:`_step_kernel` (one launch, grid (N,)).

    Writes the state rows of ``slots`` in place (not ``soft``) and returns ``(StepOutput, cont, mode)``: cont int32
    [N] (rows that continue denoising: the soft embedding's rows), mode int32 [N] (:func:`_write_soft`).
    StepOutput tensors are views of four buffers (one allocation per dtype), dtypes / shapes as
    :func:`blockdiff.sampler.common.apply_step` returns them.
    """
    N, CL = slots.shape[0], state.canvas_length
    dev = state.device
    sorted_h, order, cum = entropy_order(st["step_entropy"])   # torch: the float32 cumsum defines the decisions
    i64 = torch.empty(4, N, CL, dtype=torch.int64, device=dev)      # emitted, argmax, sampled, next_canvas
    f32 = torch.empty(N * CL + 2 * N, dtype=torch.float32, device=dev)   # entropy, mean_entropy, temperature
    i32 = torch.empty(5, N, dtype=torch.int32, device=dev)          # num_sampled, num_rejected, num_now, cont, mode
    b = torch.empty(N * CL + 3 * N, dtype=torch.bool, device=dev)   # accepted, finished, failed, converged
    entropy, mean_entropy, temp = f32[:N * CL].view(N, CL), f32[N * CL:N * CL + N], f32[N * CL + N:]
    R0 = N * CL
    accepted, finished, failed, converged = b[:R0].view(N, CL), b[R0:R0 + N], b[R0 + N:R0 + 2 * N], b[R0 + 2 * N:]
    if N > 0:
        u8 = b.view(torch.uint8)
        eos = state.eos_token_ids
        _step_kernel[(N,)](
            slots.contiguous(), prefill_done.contiguous().view(torch.uint8), T.contiguous(),   # read at stride 1
            st["step_entropy"], st["argmax"], st["sampled"], sorted_h, order, cum,
            state.phase, state.canvas, state.commit_canvas, state.prev_argmax, state.stable_count, state.step,
            state.canvas_index, state.num_emitted, state.seed, state.request_id, state.entropy_bound,
            state.confidence_threshold, state.max_denoising_steps, state.stability_threshold, eos, eos.stride(0),
            state.max_tokens,
            i64[0], i64[1], i64[2], i64[3], u8[:R0], entropy,
            i32[0], i32[1], i32[2], u8[R0:R0 + N], u8[R0 + N:R0 + 2 * N], u8[R0 + 2 * N:],
            mean_entropy, temp, i32[3], i32[4],
            CL, float(CL), state.vocab_size, eos.shape[1],
            BLOCK=triton.next_power_of_2(CL), BLOCK_E=triton.next_power_of_2(eos.shape[1]),
            num_warps=4 if CL >= 128 else 1,
        )
    out = StepOutput(num_sampled=i32[0], num_rejected=i32[1], emitted=i64[0], num_emitted_now=i32[2],
                     finished=finished, failed=failed, accepted=accepted, entropy=entropy, argmax=i64[1],
                     sampled=i64[2], next_canvas=i64[3], converged=converged, mean_entropy=mean_entropy,
                     temperature=temp)
    return out, i32[3], i32[4]


def sampler_step(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                 embedding: torch.Tensor, config: SamplerConfig | None = None) -> StepOutput:
    """One sampler step with the fused Triton kernels (same contract as ``reference.sampler_step``).

    Args:
        state, slots, logits, prefill_done, embedding: see :func:`blockdiff.sampler.sampler_step`. logits may be
            fp32/bf16/fp16 with a contiguous last dim; E bf16/fp16 (tensor cores) or fp32 (exact products).
        config: optional :class:`SamplerConfig` (tile shapes, splits).

    Returns:
        :class:`blockdiff.sampler.StepOutput`. ``state.soft`` is written in place by the reduce kernel.

    Raises:
        TypeError / ValueError: bad arguments (as the reference).
        ValueError: ``config.stats_overlap`` where the soft embedding resolves to the Triton GEMM path.
    """
    check_step_args(state, slots, logits, prefill_done, embedding)
    is_den, seed, rid, cidx, step = _gather_rows(state, slots)      # is_den: int32 (1 = DENOISE)
    T = temperature(state, slots)

    cfg = config or SamplerConfig()
    overlap = bool(cfg.stats_overlap)
    if overlap and (cfg.soft_impl or default_soft_impl(logits.device, embedding.dtype)) != "chunked":
        # no silent fallback: the option would do nothing on the Triton GEMM path
        raise ValueError("config.stats_overlap=True needs the chunked soft embedding; soft_impl=None resolves to "
                         f"'triton_gemm' for {logits.device.type} logits and a {embedding.dtype} embedding "
                         "(set soft_impl='chunked')")
    if overlap:
        # (c) beside (a): normalisers from a memory-bound pre-pass, then the GEMMs over every denoising row on a
        # high-priority side stream (rows that turn out converged / failed are computed and never written: the
        # reduce kernel's mode skips them; NaN logits stay in their own rows) while the stats pass runs on this
        # stream and fills the SMs the GEMMs leave free. Every tensor used on both streams (the workspace, the
        # normalisers, T) is allocated on this stream; the side stream's own buffers (the P chunks) are used and
        # freed there only.
        from .soft_embedding import _side_stream, soft_embedding_chunked

        m2, inv_s2 = row_moments(logits, T, is_den)
        amax0 = torch.zeros_like(m2, dtype=torch.int32)
        ws = torch.empty(1, m2.numel(), embedding.shape[1], dtype=torch.float32, device=logits.device)
        cuda = logits.is_cuda
        if cuda:
            main = torch.cuda.current_stream(logits.device)
            side = _side_stream(logits.device, priority=-1)   # GEMMs first on freed SMs
            side.wait_stream(main)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            soft_embedding_chunked(logits, embedding, T, m2, inv_s2, amax0, is_den, chunk=cfg.soft_chunk,
                                   greedy_onehot=False, overlap=bool(cfg.soft_overlap), out=ws)   # (c)
        st = row_stats(logits, T, seed, rid, cidx, step, is_den, config)                      # (a)
        if cuda:
            main.wait_stream(side)
    else:
        st = row_stats(logits, T, seed, rid, cidx, step, is_den, config)                  # (a)
    # (b) decisions and phase bookkeeping: the state rows (not soft) are written here; the soft embedding reads
    # only logits and the stats, so it may run after
    out, cont, mode = _apply_step(state, slots, prefill_done, T, st)
    argmax = st["argmax"]
    if not overlap:
        ws = soft_embedding(logits, embedding, T, st["m"], st["inv_s"], argmax, cont, config,
                            greedy_onehot=False)                                                 # (c)
    _write_soft(state, slots, ws, mode, argmax, embedding)
    return out
