"""Stage (a) of the Triton sampler step: per-position streaming statistics of ``z = logits / T`` in one read of
the logits, and the softmax normalisers of the soft embedding's pre-pass.

:func:`row_stats` launches :func:`_stats_kernel`, one program per (BLOCK_P canvas positions, vocabulary split),
streaming the logits in ``[BLOCK_P, BLOCK_G, 4]`` tiles (GPU: 1 x 256 x 4 = 1024 tokens per iteration, loads
pipelined 3 deep through cp.async, 4 warps; :class:`~blockdiff.sampler.triton.config.SamplerConfig`), then
:func:`_stats_merge_kernel` over the splits. Rows not in DENOISE are never read.

- Gumbel noise: one Philox4x32-10 call per (position, group of 4 tokens), word ``t & 3`` for token ``t``, exactly
  :mod:`blockdiff.sampler.rng` (:func:`~blockdiff.sampler.triton.common.philox4x32_10`).
- Online softmax per tile element (lane), float32, of ``z = x / T`` (IEEE division, ``div_rn``, as the
  reference): max ``m``, ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)`` with one exp per element
  (``d = z - m``; d > 0: ``u = e^-d (u - d s)``, ``s = e^-d s + 1``, ``m = z``; else ``s += e^d``,
  ``u += e^d d``) (Milakov & Gimelshein 2018, arXiv:1805.02867); the lane's first argmax of z and of ``z + g``
  (Gumbel-max), and a bad-logit flag (a float accumulator of ``(x < 0 ? 0 : x) * 0``: NaN iff a logit is NaN or
  +inf; a -inf logit is p = 0, docs/ARCHITECTURE.md "Non-finite logits": z = -inf adds nothing to the sums and is
  never the argmax or a Gumbel candidate). Splits made of whole tiles (V % CHUNK == 0, e.g. 262144) run without
  token masks.
- Gumbel prefilter (exact; docs/ARCHITECTURE.md "Sampler semantics", rule 2): the accurate logs of
  ``g = -log(-log u)`` (libdevice logf, as torch on CUDA: ~20 instructions each) are taken only for tiles holding
  a *candidate*, an element with ``z + g_up + 0.01 + 1e-5 |z| >= `` the row's best ``z + g`` so far, where
  ``g_up`` comes from two ``lg2.approx`` (within ~1e-3 of g; 16.7 >= max g for u > 1 - 2**-11); one block-wide
  max of the flag per tile decides. Elements of other tiles cannot be, or tie with, the maximum, so the sample
  is the full computation's; only the tiles that move the running best (~ln(#tiles) per row on random logits,
  fewer on peaked ones) pay.
- Greedy rows (T = 0; rule 8): a program whose rows are all greedy (on the GPU a program is one position) runs
  the loop without Philox, the logs and the division (its Gumbel sample is never used; z = x / 1 = x).
- Overflow (docs/ARCHITECTURE.md "Sampler semantics", rule 1): the streaming loop is unchanged; the split merge
  (:func:`_stats_merge_kernel`) recognises a position without NaN / +inf logits whose max z is +inf or whose
  every z is -inf, and recomputes it from its logits in the shifted form z = (x - max x) / T
  (:func:`tie_statistics`: p uniform over the logits tied at the max, exactly), so finite logits never fail a
  request; every other position keeps z = x / T bit for bit. Its ``shift`` output is the soft embedding's c of
  z = (x - c) / T. A position whose every logit is -inf (max x = -inf: no softmax) is flagged bad instead.
- Lanes are merged once at the end (``s = sum_l e^(m_l - M) s_l``, ``u = sum_l e^(m_l - M) (u_l + (m_l - M)
  s_l)``, argmax = lowest id among the lanes holding the maximum), vocabulary splits (small batches) the same way
  in :func:`_stats_merge_kernel`; ``H = log s - u / s`` nats (= ``-sum p log p``).

The row coordinates the kernel reads (active, seed, request id, canvas index, step) come from the step's row
gather (:mod:`blockdiff.sampler.triton.step`). :func:`row_moments` is the memory-bound normaliser pre-pass of
``SamplerConfig.stats_overlap``.

Exactness: Philox words, ``u`` and the float32 ``z`` are bit-identical to the reference; ``g`` uses the
platform's float32 log (torch's SLEEF on CPU vs numpy in the Triton interpreter differ by <= 1 ulp on ~1/3 of the
2**23 possible ``u``; on CUDA both call libdevice ``logf``), so a sampled id can differ only where two candidates
of ``z + g`` lie within an ulp. Entropies differ from the reference at float32 rounding level (summation order).
Extra memory: ``N * CL * SPLIT_V * 32`` bytes of split statistics.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..rng import check_int_coordinates
from .common import FLT_LOWEST, check_int32_index, interpret_mode, philox4x32_10
from .config import SamplerConfig, check_config, plan_key

__all__ = ["row_stats", "row_moments", "stats_plan", "check_moments_indices", "tie_statistics", "GUMBEL_MAX_BOUND",
           "GUMBEL_NEAR_ONE", "PREFILTER_ABS", "PREFILTER_REL", "PREFILTER_LOG_MODE"]

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

    ``bad`` is a float32 accumulator of ``(x < 0 ? 0 : x) * 0`` (NaN iff a logit was NaN or +inf; -inf is p = 0,
    not bad: one compare, one select and one FMA per element). ``MASKED`` False: every element of the tile is a
    real token (no masks, no selects).
    """
    j3 = tl.arange(0, 4)[None, None, :]
    bad = bad + tl.where(x < 0.0, 0.0, x) * 0.0                    # NaN < 0 is false: NaN and +inf stay NaN
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
        w0, w1, w2, w3 = philox4x32_10(cg + zero, c1 + zero, c2 + zero, c3 + zero, k0 + zero, k1 + zero)
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
    m = tl.full((BLOCK_P, BLOCK_G, 4), FLT_LOWEST, tl.float32)      # every finite z >= it
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

    o = r.to(tl.int64) * SPLIT_V + sp       # int64: N * CL * SPLIT_V * 5 may pass 2**31 (the merge reads it so too)
    tl.store(stats_f_ptr + o * 5 + 0, mrow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 1, srow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 2, urow, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 3, bmax, mask=pvalid)
    tl.store(stats_f_ptr + o * 5 + 4, gmax, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 0, bidx, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 1, gidx, mask=pvalid)
    tl.store(stats_i_ptr + o * 3 + 2, badrow, mask=pvalid)



@triton.jit
def tie_statistics(base, lo, hi, vs, seed, rid, cidx, step, p, NUM_TILES: tl.constexpr, BLOCK: tl.constexpr,
                   GUMBEL: tl.constexpr):
    """Statistics of one position in the shifted form of docs/ARCHITECTURE.md "Sampler semantics" rule 1, for a
    position whose largest z = x / T overflows (no NaN / +inf logits): z = (x - c) / T with c = max x is 0 on the
    tokens tied at c and <= -2e31 elsewhere, -inf at -inf logits (:func:`blockdiff.sampler.common.overflow_shift`),
    so p is uniform over the ties, exactly, and the Gumbel-max sample is the tie with the largest g. Where every
    logit is -inf, c = -inf (and every token counts as a tie): the callers flag that position instead.

    Reads the logits of global token ids t in ``[lo, hi)`` at ``base + (t - vs)`` (scalar pointer, any float
    dtype) in ``NUM_TILES >= cdiv(hi - lo, BLOCK)`` tiles, twice: the max, then the ties. Returns scalars
    ``(c, ties, first, g_best, g_id)``: c float32 (max x), ties int32 (tokens equal to c), first int32 (the lowest
    tied id: argmax z), and with ``GUMBEL`` the largest g among the ties and its lowest id (the Gumbel noise of
    :mod:`blockdiff.sampler.rng` at the global id of the row's coordinates seed, rid, cidx, step, position p: the
    stats kernel's Philox words, u and logs); without it g_best = -inf, g_id = 2**31 - 1. Only tiles holding a
    tie draw the noise. Cold path (a program whose positions do not overflow never calls it).
    """
    f = tl.arange(0, BLOCK)
    c = -float("inf")
    for i in range(0, NUM_TILES):
        tok = lo + i * BLOCK + f
        x = tl.load(base + (tok - vs), mask=tok < hi, other=-float("inf")).to(tl.float32)
        c = tl.maximum(c, tl.max(x, 0))
    if GUMBEL:                                    # key / counter of blockdiff.sampler.rng (stream GUMBEL = 0)
        seed = seed.to(tl.int64)
        rid = rid.to(tl.int64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c1 = ((p.to(tl.int64) & 0xFFFF) | ((step.to(tl.int64) & 16383) << 18)).to(tl.uint32)
        c2 = (rid & 0xFFFFFFFF).to(tl.uint32)
        c3 = (((rid >> 32) & 0xFFFF) | ((cidx.to(tl.int64) & 0xFFFF) << 16)).to(tl.uint32)
    ties = 0
    first = 2147483647
    g_best = -float("inf")
    g_id = 2147483647
    for i in range(0, NUM_TILES):
        tok = lo + i * BLOCK + f
        msk = tok < hi
        x = tl.load(base + (tok - vs), mask=msk, other=-float("inf")).to(tl.float32)
        tie = msk & (x == c)
        nt = tl.sum(tie.to(tl.int32), 0)
        if nt > 0:
            ties += nt
            first = tl.minimum(first, tl.min(tl.where(tie, tok, 2147483647), 0))
            if GUMBEL:
                zero = tl.zeros((BLOCK,), tl.uint32)
                w0, w1, w2, w3 = philox4x32_10((tok >> 2).to(tl.uint32), c1 + zero, c2 + zero, c3 + zero, k0 + zero,
                                               k1 + zero)
                j = tok & 3
                w = tl.where(j == 0, w0, tl.where(j == 1, w1, tl.where(j == 2, w2, w3)))
                uni = ((w >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07          # ((w >> 9) + 0.5) * 2**-23
                g = tl.where(tie, -tl.log(-tl.log(uni)), -float("inf"))
                gm = tl.max(g, 0)
                gi = tl.min(tl.where(tie & (g == gm), tok, 2147483647), 0)
                take = gm > g_best
                g_id = tl.where(take, gi, g_id)
                g_best = tl.where(take, gm, g_best)
    return c, ties, first, g_best, g_id


@triton.jit
def _stats_merge_kernel(
    stats_f_ptr, stats_i_ptr, t_ptr, active_ptr,
    x_ptr, stride_xn, stride_xp, seed_ptr, rid_ptr, cidx_ptr, step_ptr,
    m_ptr, inv_s_ptr, h_ptr, hstep_ptr, amax_ptr, gamax_ptr, sampled_ptr, bad_ptr, shift_ptr,
    R, CL, V,
    SPLIT_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, TIE_TILES: tl.constexpr,
    TIE_BLOCK: tl.constexpr,
):
    """Grid (cdiv(N * CL, BLOCK_R),): merge the SPLIT_V vocabulary splits of :func:`_stats_kernel` per position
    (tile [BLOCK_R positions, BLOCK_S >= SPLIT_V splits]) and write the [N, CL] results of :func:`row_stats`.

    ``M = max_k m_k``, ``a_k = exp(m_k - M)``, ``s = sum_k a_k s_k``, ``u = sum_k a_k (u_k + (m_k - M) s_k)`` (the
    sum over splits is a tree, float32 rounding level),
    ``H = log s - u / s`` (NaN where the softmax is undefined), ``inv_s = 1 / s`` (IEEE divisions, as torch); argmax
    and Gumbel argmax: the id of the first split holding the maximum (splits are in increasing id order; the
    maxima are never NaN: a lane only takes ``z > best``), exact. Step inputs besides: ``hstep`` = H, except
    greedy rows (T = 0): 0, NaN where bad (docs/ARCHITECTURE.md "Sampler semantics", rule 8); ``sampled`` =
    Gumbel argmax, greedy rows: argmax. Rows of inactive requests (their stats were never written) get zeros.

    Overflow (rule 1): a position without NaN / +inf logits whose merged max z is +inf, or whose every z is -inf
    (s = 0), is recomputed from its logits in the shifted form z = (x - c) / T, c = max x (:func:`tie_statistics`,
    reading the row's logits ``x_ptr`` and RNG coordinates; ``TIE_TILES`` tiles of ``TIE_BLOCK`` tokens cover V):
    m = 0, s = the ties at c, u = 0 (H = log ties, a float64 log rounded to float32 as in the reference), the first
    tie and the Gumbel-max tie; ``shift`` = c there, 0 elsewhere (the soft embedding's z = (x - shift) / T). Where
    c = -inf (every logit -inf: no softmax, the request fails) the position is flagged ``bad`` with H = NaN and
    shift 0 instead. Only a program holding such a position runs it.
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
    shift = tl.zeros((BLOCK_R,), tl.float32)
    ovf = valid & ~bad & ((m == float("inf")) | (s == 0.0))     # max z = +inf, or every z = -inf (finite x)
    if tl.max(ovf.to(tl.int32), 0) != 0:
        idx = tl.arange(0, BLOCK_R)
        for i in range(0, BLOCK_R):
            if tl.sum(tl.where(idx == i, ovf.to(tl.int32), 0), 0) != 0:
                ri = pid * BLOCK_R + i
                ni = ri // CL
                pi = ri % CL
                base = x_ptr + ni.to(tl.int64) * stride_xn + pi.to(tl.int64) * stride_xp
                c, ties, first, _, g_id = tie_statistics(
                    base, 0, V, 0, tl.load(seed_ptr + ni), tl.load(rid_ptr + ni), tl.load(cidx_ptr + ni),
                    tl.load(step_ptr + ni), pi, TIE_TILES, TIE_BLOCK, True)
                sel = idx == i
                cv = tl.zeros((BLOCK_R,), tl.float32) + c
                und = sel & (cv == -float("inf"))     # every logit -inf: the softmax is undefined (fails)
                shift = tl.where(sel & ~und, cv, shift)
                m = tl.where(sel, 0.0, m)
                s = tl.where(sel, ties.to(tl.float32), s)
                # u = 0: H = log(ties) in float64, rounded to float32: the reference's and the TP combine's value
                # bit for bit (float32 logf is not correctly rounded, which moves decisions at an exact
                # entropy_bound: tests/sampler/test_overflowing_z.py)
                h = tl.where(sel, tl.where(und, float("nan"), tl.log(ties.to(tl.float64)).to(tl.float32)), h)
                bad = bad | und
                amax = tl.where(sel, first.to(tl.int64), amax)
                gamax = tl.where(sel, g_id.to(tl.int64), gamax)
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
    tl.store(shift_ptr + r, shift, mask=rmask)


def row_stats(logits: torch.Tensor, T: torch.Tensor, seed: torch.Tensor, request_id: torch.Tensor,
              canvas_index: torch.Tensor, step: torch.Tensor, active: torch.Tensor,
              config: SamplerConfig | None = None) -> dict:
    """Stage (a): per-position streaming statistics of ``z = logits / T``.

    Args:
        logits: float [N, CL, V] (last dim contiguous). T: float32 [N] (0 = greedy). seed, request_id,
            canvas_index, step: [N] integer RNG coordinates. active: int32/bool [N] (0 rows are skipped).

    Returns:
        dict of [N, CL] tensors: ``m`` (max z) and ``inv_s`` (1 / sum exp(z - m)) float32, ``entropy`` float32
        nats (NaN where ``bad``), ``argmax``/``gumbel_argmax`` int64, ``bad`` bool (the position's softmax is
        undefined: a NaN or +inf logit, or every logit -inf; a -inf logit beside finite ones is p = 0). Values of
        inactive rows are undefined (zeros today), and so is ``gumbel_argmax`` of greedy rows (T = 0: a program
        whose rows are all greedy skips the Gumbel pass; the step uses ``argmax`` there). What the step decides
        on besides: ``step_entropy`` float32 (``entropy``; greedy rows: 0, NaN where bad) and ``sampled`` int64
        (``gumbel_argmax``; greedy rows: ``argmax``). ``shift`` float32: c of z = (x - c) / T (0, except where the
        position's max z = x / T overflows: docs/ARCHITECTURE.md "Sampler semantics" rule 1; ``m`` is then 0).

    Two launches: :func:`_stats_kernel` (per position and vocabulary split) and :func:`_stats_merge_kernel` (the
    splits merged per position, and the shifted form where z overflows).

    Raises:
        TypeError: a float, complex or bool ``seed`` / ``request_id`` / ``canvas_index`` / ``step`` (named; the kernel
            reads them as int64 and would truncate, as :mod:`blockdiff.sampler.rng` refuses to).
        ValueError: an int32 index of the launches would pass 2**31 - 1 (:func:`stats_plan`: V within the splits'
            padding of 2**31, or N * CL positions as many).
    """
    check_int_coordinates(seed, request_id, canvas_index, step)
    N, CL, V = logits.shape
    # before a copy of the logits; a tensor's shape is ints and its device indexed: already stats_plan's key
    cfg, chunk, split_v = _stats_plan(N, CL, V, check_config(config), logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
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
            FAST_LOG=PREFILTER_LOG_MODE if PREFILTER_LOG_MODE is not None else (0 if interpret_mode() else 1),
            num_warps=cfg.stats_warps,
        )
    # the [N, CL] results in two buffers (one allocation per dtype): f32 m, inv_s, entropy, step_entropy, shift;
    # i64 argmax, gumbel_argmax, sampled
    f = torch.empty(5, N, CL, dtype=torch.float32, device=dev)
    i = torch.empty(3, N, CL, dtype=torch.int64, device=dev)
    bad = torch.empty(N, CL, dtype=torch.bool, device=dev)
    if N * CL > 0:
        block_r, tie_block = _merge_tiles(N * CL, V, logits.is_cuda)
        _stats_merge_kernel[(triton.cdiv(N * CL, block_r),)](
            sf, si, T.contiguous(), act, logits, logits.stride(0), logits.stride(1), seed.contiguous(),
            request_id.contiguous(), canvas_index.contiguous(), step.contiguous(),
            f[0], f[1], f[2], f[3], i[0], i[1], i[2], bad.view(torch.uint8), f[4],
            N * CL, CL, V, SPLIT_V=split_v, BLOCK_S=triton.next_power_of_2(split_v), BLOCK_R=block_r,
            TIE_TILES=triton.cdiv(V, tie_block), TIE_BLOCK=tie_block, num_warps=4)
    return dict(m=f[0], inv_s=f[1], entropy=f[2], argmax=i[0], gumbel_argmax=i[1], bad=bad, step_entropy=f[3],
                sampled=i[2], shift=f[4])


def _tie_block(V: int, cuda: bool) -> int:
    """Tokens per tile of :func:`tie_statistics` (GPU: 1024; the interpreter: sized to V)."""
    return 1024 if cuda else min(64, triton.next_power_of_2(V))


def _merge_tiles(R: int, V: int, cuda: bool) -> tuple[int, int]:
    """(positions per program, tokens per :func:`tie_statistics` tile) of :func:`_stats_merge_kernel`."""
    return (128 if cuda else min(256, triton.next_power_of_2(R))), _tie_block(V, cuda)


def stats_plan(N: int, CL: int, V: int, config: SamplerConfig | None,
               device: torch.device) -> tuple[SamplerConfig, int, int]:
    """``(resolved config, CHUNK, SPLIT_V)`` of :func:`row_stats`' launches for logits [N, CL, V] on ``device``:
    vocabulary splits of CHUNK tokens (whole ``4 * block_g``-token tiles), SPLIT_V of them. Cached per shapes,
    (frozen, hashable) config and device: a pure function of them, whose ``resolve`` and ``triton.cdiv`` calls
    cost host time on every step uncached (docs/tuning.md 7.62); a refusal is not cached. The key is
    :func:`~.config.plan_key`'s: Python ints, and ``device`` (a str or ``torch.device``) with an index-less
    ``"cuda"`` pinned to the current device (the SM count ``resolve`` reads).

    Raises:
        ValueError: an int32 index of the launches would pass 2**31 - 1 (:func:`~.common.check_int32_index`): the
            end of the last split (``SPLIT_V * CHUNK``: the splits' padded cover of V, > V by up to SPLIT_V tiles;
            the kernel forms ``start + CHUNK`` and token ids below it in int32) where V is within that padding of
            2**31 (the state allows V < 2**31), or the flat positions of N * CL rows padded to whole programs.
    """
    cfg = check_config(config)
    (N, CL, V), device = plan_key((N, CL, V), device)  # ints and an indexed device: the cache's key
    return _stats_plan(N, CL, V, cfg, device)


@functools.lru_cache(maxsize=4096)  # (a key per batch size N: vLLM's N runs over 1..max_num_seqs)
def _stats_plan(N: int, CL: int, V: int, config: SamplerConfig,
                device: torch.device) -> tuple[SamplerConfig, int, int]:
    """:func:`stats_plan` after its config check."""
    cfg = config.resolve(N * CL, V, 1, device)
    tile = 4 * cfg.block_g
    chunk = triton.cdiv(triton.cdiv(V, cfg.split_v), tile) * tile
    split_v = triton.cdiv(V, chunk)
    cuda = torch.device(device).type == "cuda"
    check_int32_index(split_v * chunk, f"vocab_size={V} in {split_v} vocabulary split(s) of {chunk} tokens "
                      f"(SamplerConfig split_v={cfg.split_v}, block_g={cfg.block_g})",
                      "use fewer splits (split_v) or smaller tiles (block_g), or the reference backend")
    R = N * CL
    block_r, tie_block = _merge_tiles(R, V, cuda)
    check_int32_index(triton.cdiv(V, tie_block) * tie_block - 1, f"vocab_size={V}", "use the reference backend")
    for block in (cfg.block_p, block_r):
        check_int32_index(triton.cdiv(R, block) * block - 1, f"N * canvas_length = {N} * {CL} positions",
                          "step fewer rows at a time")
    return cfg, chunk, split_v


@functools.lru_cache(maxsize=4096)
def check_moments_indices(N: int, CL: int, V: int, device: torch.device) -> None:
    """The int32 index checks of :func:`row_moments` (one program per position, ``BLOCK_V``-token tiles).

    Raises:
        ValueError: as :func:`stats_plan`.
    """
    block_v = _moments_block(V, torch.device(device).type == "cuda")
    check_int32_index(N * CL - 1, f"N * canvas_length = {N} * {CL} positions", "step fewer rows at a time")
    check_int32_index(triton.cdiv(V, block_v) * block_v - 1, f"vocab_size={V}", "use the reference backend")


def _moments_block(V: int, cuda: bool) -> int:
    """Tokens per tile of :func:`_moments_kernel` (GPU: 2048; the interpreter: sized to V)."""
    return 2048 if cuda else min(64, triton.next_power_of_2(V))


@triton.jit
def _moments_kernel(x_ptr, stride_xn, stride_xp, t_ptr, active_ptr, m_ptr, inv_s_ptr, shift_ptr, R, CL, V,
                    NUM_TILES: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (R,): row max m = max(z) and inv_s = 1 / sum exp(z - m) of z = x / T (IEEE division, as the stats pass)
    for one position whose request is active and samples (T > 0); other rows are not written. Per-lane online
    max / sum (one exp2 per logit), merged once: the normaliser of the chunked soft embedding's probabilities,
    so its GEMM can start before the stats pass ends (``SamplerConfig.stats_overlap``). Memory-bound: one read
    of the logits. Where the max z overflows (+inf, or every z -inf: rule 1), the shifted form of
    :func:`tie_statistics` instead: m = 0, inv_s = 1 / ties, shift = c (two more reads of that position only);
    where every logit is -inf (no softmax: the request fails) m = inv_s = shift = 0, so p = 0 there."""
    r = tl.program_id(0)
    n = r // CL
    p = r % CL
    act = tl.load(active_ptr + n) != 0
    T = tl.load(t_ptr + n)
    if act & (T > 0.0):
        base = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
        offs = tl.arange(0, BLOCK_V)
        mx = tl.full((BLOCK_V,), FLT_LOWEST, tl.float32)
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
        if (mrow == float("inf")) | (srow == 0.0):
            c, ties, _, _, _ = tie_statistics(base, 0, V, 0, None, None, None, None, p, NUM_TILES, BLOCK_V, False)
            und = c == -float("inf")                  # every logit -inf: no softmax (the step fails the row)
            tl.store(shift_ptr + r, tl.where(und, 0.0, c))
            tl.store(m_ptr + r, 0.0)
            tl.store(inv_s_ptr + r, tl.where(und, 0.0, 1.0 / ties.to(tl.float32)))
        else:
            tl.store(m_ptr + r, mrow)
            tl.store(inv_s_ptr + r, 1.0 / srow)


def row_moments(logits: torch.Tensor, T: torch.Tensor,
                active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax normalisers of ``z = (logits - shift) / T`` for the soft embedding only: ``(m, inv_s, shift)``
    float32 [N, CL], the row max of z (bit-equal to :func:`row_stats`' m: the same IEEE z), 1 / sum exp(z - m)
    (within float32 rounding of row_stats' value: lane order) and the shift of rule 1 (0 unless the position's max
    z = logits / T overflows: then row_stats' shift, m = 0), on rows of active requests with T > 0; other rows,
    and positions whose every logit is -inf (no softmax: row_stats flags them bad), are 0. One memory-bound pass
    over the logits.

    Args: logits float [N, CL, V] (contiguous last dim); T float32 [N]; active bool/int [N].

    Raises:
        ValueError: an int32 index of the launch would pass 2**31 - 1 (:func:`check_moments_indices`).
    """
    N, CL, V = logits.shape
    check_moments_indices(N, CL, V, logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    m = torch.zeros(N, CL, dtype=torch.float32, device=logits.device)
    inv_s = torch.zeros(N, CL, dtype=torch.float32, device=logits.device)
    shift = torch.zeros(N, CL, dtype=torch.float32, device=logits.device)
    if N * CL > 0 and V > 0:
        block_v = _moments_block(V, logits.is_cuda)
        _moments_kernel[(N * CL,)](logits, logits.stride(0), logits.stride(1), T.contiguous(),
                                   active.to(torch.int32).contiguous(), m, inv_s, shift, N * CL, CL, V,
                                   NUM_TILES=triton.cdiv(V, block_v), BLOCK_V=block_v, num_warps=4)
    return m, inv_s, shift
