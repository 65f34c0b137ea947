"""Triton local pass of the tensor-parallel sampler step (``backend="triton"``; the driver is
:mod:`blockdiff.sampler.tp.step`, the oracle :mod:`blockdiff.sampler.tp.reference`).

A rank's statistics over its vocabulary shard ``[vocab_start, vocab_end)`` need two things the single-GPU
statistics kernel of :mod:`blockdiff.sampler.triton.stats` does not expose: the Gumbel noise and the ids at the
GLOBAL token id (a vocabulary offset), and the raw online-softmax accumulators ``(m, s, u)`` rather than the
finished entropy. :func:`_shard_stats_kernel` is that kernel: one program per (canvas position, split of the
shard) streams the shard once in ``[BLOCK_G, 4]`` tiles aligned to the global Philox token groups (group
``id >> 2``, word ``id & 3``, the Philox rounds of :func:`blockdiff.sampler.triton.common.philox4x32_10`, so the
noise equals :func:`blockdiff.sampler.rng.gumbel_noise` bit for bit on CUDA) and keeps in float32 registers
``m = max z``, ``s = sum exp(z - m)``, ``u = sum exp(z - m)(z - m)`` (rescaled when the max moves), the first
argmax of z, the Gumbel-max candidate and a bad-logit flag (NaN / +inf; a -inf logit is p = 0); splits are merged
exactly in torch. Where the shard's
max z overflows (+inf, or every z -inf: docs/ARCHITECTURE.md "Sampler semantics" rule 1), one more launch,
:func:`_shard_ties_kernel`, gives the shard's shifted statistics (status in
:mod:`blockdiff.sampler.tp.common`); its programs return at once elsewhere.

The soft-embedding partial is :func:`blockdiff.sampler.triton.soft_embedding.soft_embedding` (the path
``SamplerConfig.soft_impl`` selects: the split-K Triton GEMM or the chunked cuBLAS product) run on the shard with
the shard's own ``(m, 1 / s)`` and local argmax (locally normalised partial; the TP combine rescales it per
position). Memory: ``N * CL * SPLIT_V * 32`` bytes of split stats and the soft-embedding workspace; no [N, CL, V]
temporary. No host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import check_int_coordinates
from ..triton.common import FLT_LOWEST, philox4x32_10
from ..triton.config import SamplerConfig, check_config
from ..triton.soft_embedding import soft_embedding
from ..triton.stats import tie_statistics
from .common import STATUS_BAD, STATUS_FINITE, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF, LocalStats, VocabShard

__all__ = ["local_statistics_triton", "soft_partial_triton"]


@triton.jit
def _shard_stats_kernel(
    x_ptr, stride_xn, stride_xp,
    t_ptr, seed_ptr, rid_ptr, cidx_ptr, step_ptr, active_ptr,
    stats_f_ptr, stats_i_ptr,
    CL, VS, VE, BASE,
    CHUNK: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Grid (N * CL, SPLIT_V). Split sp covers global ids [BASE + sp*CHUNK, BASE + (sp+1)*CHUNK) within [VS, VE)
    (BASE = VS rounded down to a multiple of 4, so tiles align with Philox groups). Logit of global id t is at
    x[n, p, t - VS]. Writes f32 [m, s, u, best_z, best_y] and i32 [argmax, sample, bad] (global ids)."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    n = r // CL
    p = r % CL
    active = tl.load(active_ptr + n)
    if active == 0:
        return
    T = tl.load(t_ptr + n)
    tdiv = tl.where(T == 0.0, 1.0, T)
    seed = tl.load(seed_ptr + n).to(tl.int64)
    rid = tl.load(rid_ptr + n).to(tl.int64)
    cidx = tl.load(cidx_ptr + n).to(tl.int64)
    step = tl.load(step_ptr + n).to(tl.int64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((p & 0xFFFF) | ((step & 16383) << 18)).to(tl.int64).to(tl.uint32)      # stream GUMBEL = 0
    c2 = (rid & 0xFFFFFFFF).to(tl.uint32)
    c3 = (((rid >> 32) & 0xFFFF) | ((cidx & 0xFFFF) << 16)).to(tl.uint32)

    base = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
    g_off = tl.arange(0, BLOCK_G)
    j = tl.arange(0, 4)
    start = BASE + sp * CHUNK
    lo = tl.maximum(start, VS)
    hi = tl.minimum(VE, start + CHUNK)

    m = FLT_LOWEST                                              # lowest finite float32: <= every finite z
    s = 0.0
    u = 0.0
    best = -float("inf")
    best_i = 0
    gbest = -float("inf")
    gbest_i = 0
    bad = 0
    for i in range(0, CHUNK, 4 * BLOCK_G):
        grp = (start + i) // 4 + g_off                            # [G] global Philox groups
        tok = grp[:, None] * 4 + j[None, :]                       # [G, 4] global ids
        mask = (tok >= lo) & (tok < hi)
        x = tl.load(base + (tok - VS), mask=mask, other=0.0).to(tl.float32)
        nanpinf = (x != x) | (x == float("inf"))                   # -inf is p = 0 (z = -inf adds nothing), not bad
        bad = tl.maximum(bad, tl.max(tl.max((mask & nanpinf).to(tl.int32), 1), 0))
        z = tl.where(mask, tl.math.div_rn(x, tdiv), -float("inf"))
        tmax = tl.max(tl.max(z, 1), 0)
        m_new = tl.maximum(m, tmax)
        a = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        ez = tl.where(e > 0.0, e * (z - m_new), 0.0)              # p = 0 adds nothing (z = -inf: 0 * -inf)
        # a = 0 adds nothing (m - m_new may overflow to -inf for finite m: -inf * s would be NaN)
        u = tl.where(a > 0.0, a * (u + (m - m_new) * s), 0.0) + tl.sum(tl.sum(ez, 1), 0)
        s = a * s + tl.sum(tl.sum(e, 1), 0)
        m = m_new
        ti = tl.min(tl.min(tl.where(z == tmax, tok, 2147483647), 1), 0)
        take = tmax > best
        best_i = tl.where(take, ti, best_i)
        best = tl.where(take, tmax, best)
        w0, w1, w2, w3 = philox4x32_10(grp.to(tl.uint32), tl.zeros_like(grp).to(tl.uint32) + c1,
                                        tl.zeros_like(grp).to(tl.uint32) + c2, tl.zeros_like(grp).to(tl.uint32) + c3,
                                        k0, k1)
        jj = j[None, :]
        w = tl.where(jj == 0, w0[:, None], tl.where(jj == 1, w1[:, None], tl.where(jj == 2, w2[:, None], w3[:, None])))
        uni = ((w >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07          # 2**-23
        gum = -tl.log(-tl.log(uni))
        y = tl.where(mask, z + gum, -float("inf"))
        ymax = tl.max(tl.max(y, 1), 0)
        yi = tl.min(tl.min(tl.where(y == ymax, tok, 2147483647), 1), 0)
        gtake = ymax > gbest
        gbest_i = tl.where(gtake, yi, gbest_i)
        gbest = tl.where(gtake, ymax, gbest)

    o = r * SPLIT_V + sp
    tl.store(stats_f_ptr + o * 5 + 0, m)
    tl.store(stats_f_ptr + o * 5 + 1, s)
    tl.store(stats_f_ptr + o * 5 + 2, u)
    tl.store(stats_f_ptr + o * 5 + 3, best)
    tl.store(stats_f_ptr + o * 5 + 4, gbest)
    tl.store(stats_i_ptr + o * 3 + 0, best_i)
    tl.store(stats_i_ptr + o * 3 + 1, gbest_i)
    tl.store(stats_i_ptr + o * 3 + 2, bad)


@triton.jit
def _shard_ties_kernel(x_ptr, stride_xn, stride_xp, flag_ptr, seed_ptr, rid_ptr, cidx_ptr, step_ptr,
                       out_f_ptr, out_i_ptr, CL, VS, VE, NUM_TILES: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (N * CL,): the shard's statistics in the shifted form of rule 1 (:func:`tie_statistics` over the global
    ids [VS, VE)) at the positions whose flag is set (the shard's max z overflows); others return at once. Writes
    f32 [c, g_best] and i32 [ties, first, g_id] (global ids) per position."""
    r = tl.program_id(0)
    if tl.load(flag_ptr + r) == 0:
        return
    n = r // CL
    p = r % CL
    base = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
    c, ties, first, g_best, g_id = tie_statistics(base, VS, VE, VS, tl.load(seed_ptr + n), tl.load(rid_ptr + n),
                                                  tl.load(cidx_ptr + n), tl.load(step_ptr + n), p, NUM_TILES, BLOCK,
                                                  True)
    tl.store(out_f_ptr + r * 2 + 0, c)
    tl.store(out_f_ptr + r * 2 + 1, g_best)
    tl.store(out_i_ptr + r * 3 + 0, ties)
    tl.store(out_i_ptr + r * 3 + 1, first)
    tl.store(out_i_ptr + r * 3 + 2, g_id)


def local_statistics_triton(logits: torch.Tensor, T: torch.Tensor, seed: torch.Tensor, request_id: torch.Tensor,
                            canvas_index: torch.Tensor, step: torch.Tensor, active: torch.Tensor,
                            shard: VocabShard, config: SamplerConfig | None = None) -> LocalStats:
    """Streaming local pass of one shard: :class:`blockdiff.sampler.tp.common.LocalStats` (same fields as the torch
    :func:`blockdiff.sampler.tp.reference.local_statistics`: status BAD on a NaN / +inf logit; a position whose
    every logit in the shard is -inf gets :meth:`LocalStats.empty`'s fields).

    Args:
        logits: float [N, CL, shard.size] (last dim contiguous; fp32/bf16/fp16). T: float32 [N] (0 = greedy).
        seed, request_id, canvas_index, step: integer [N]. active: bool [N] — rows computed (others: zeros,
            meaningless). shard: :class:`VocabShard`. config: ``block_g`` / ``split_v`` / ``stats_warps`` used.

    Raises:
        TypeError: a float, complex or bool ``seed`` / ``request_id`` / ``canvas_index`` / ``step`` (named; the kernel
            reads them as int64 and would truncate, as the torch pass's :func:`gumbel_noise_shard` refuses to), also
            on an empty shard (every rank refuses alike).
    """
    check_int_coordinates(seed, request_id, canvas_index, step)
    N, CL, Vs = logits.shape
    dev = logits.device
    cfg = check_config(config)  # (an empty shard too: every rank refuses a bad config alike)
    if Vs == 0 or N * CL == 0:
        return LocalStats.empty(N, CL, shard.vocab_size, dev)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = cfg.resolve(N * CL, Vs, 1, dev)
    tile = 4 * cfg.block_g
    base = shard.start - shard.start % 4
    span = shard.end - base
    chunk = triton.cdiv(triton.cdiv(span, cfg.split_v), tile) * tile
    split_v = triton.cdiv(span, chunk)
    sf = torch.zeros(N * CL * split_v * 5, dtype=torch.float32, device=dev)
    si = torch.zeros(N * CL * split_v * 3, dtype=torch.int32, device=dev)
    _shard_stats_kernel[(N * CL, split_v)](
        logits, logits.stride(0), logits.stride(1),
        T.contiguous(), seed.contiguous(), request_id.contiguous(), canvas_index.contiguous(), step.contiguous(),
        active.to(torch.int32).contiguous(), sf, si, CL, shard.start, shard.end, base,
        CHUNK=chunk, SPLIT_V=split_v, BLOCK_G=cfg.block_g, num_warps=cfg.stats_warps,
    )
    sf = sf.view(N, CL, split_v, 5)
    si = si.view(N, CL, split_v, 3)
    m_k, s_k, u_k, best_k, gbest_k = sf.unbind(-1)
    m = m_k.max(-1).values
    a = torch.exp(m_k - m[..., None])
    s = (a * s_k).sum(-1)
    u = torch.where(a > 0, a * (u_k + (m_k - m[..., None]) * s_k), 0.0).sum(-1)   # a = 0: nothing (-inf * 0)
    ksel = best_k.argmax(-1, keepdim=True)                        # first split holding the max: lowest id
    argmax = si[..., 0].gather(-1, ksel).squeeze(-1).to(torch.int64)
    gsel = gbest_k.argmax(-1, keepdim=True)
    gid = si[..., 1].gather(-1, gsel).squeeze(-1).to(torch.int64)
    gval = gbest_k.gather(-1, gsel).squeeze(-1)
    bad = si[..., 2].amax(-1) != 0
    # rule 1: where the shard's max z = x / T is +inf, or every z is -inf (s = 0), the shifted form (one launch;
    # positions without overflow return at once)
    flag = active.to(torch.bool)[:, None] & ~bad & (torch.isinf(m) | (s == 0))
    tf = torch.zeros(N * CL, 2, dtype=torch.float32, device=dev)
    ti = torch.zeros(N * CL, 3, dtype=torch.int32, device=dev)
    block = 1024 if logits.is_cuda else min(64, triton.next_power_of_2(Vs))
    _shard_ties_kernel[(N * CL,)](
        logits, logits.stride(0), logits.stride(1), flag.to(torch.int32).contiguous(), seed.contiguous(),
        request_id.contiguous(), canvas_index.contiguous(), step.contiguous(), tf, ti, CL, shard.start, shard.end,
        NUM_TILES=triton.cdiv(Vs, block), BLOCK=block, num_warps=4)
    c, g_best = tf.view(N, CL, 2).unbind(-1)
    ties, first, g_id = ti.view(N, CL, 3).to(torch.int64).unbind(-1)
    status = torch.where(bad, STATUS_BAD, torch.where(flag, torch.where(m > 0, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF),
                                                      STATUS_FINITE))
    key = torch.where(flag, c, m)                                 # shifted: the combine compares the shifts c
    m = torch.where(flag, 0.0, m)
    s = torch.where(flag, ties.to(torch.float32), s)
    u = torch.where(flag, 0.0, u)
    argmax = torch.where(flag, first, argmax)
    gval = torch.where(flag, g_best, gval)
    gid = torch.where(flag, g_id, gid)
    # every logit of the shard -inf (c = -inf, every token a "tie"): LocalStats.empty's fields, no part in the combine
    empty = flag & (c == float("-inf"))
    s = torch.where(empty, 0.0, s)
    gval = torch.where(empty, float("-inf"), gval)
    argmax = torch.where(empty, shard.vocab_size, argmax)
    gid = torch.where(empty, shard.vocab_size, gid)
    f64 = torch.float64
    packed = torch.stack([key.to(f64), s.to(f64), u.to(f64), argmax.to(f64), gval.to(f64), gid.to(f64),
                          status.to(f64)], dim=-1)
    return LocalStats(packed, m, torch.where(empty, 0.0, 1.0 / s), torch.where(empty, 0, argmax - shard.start),
                      torch.where(flag & ~empty, c, 0.0))


def soft_partial_triton(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, local: LocalStats,
                        active: torch.Tensor, config: SamplerConfig | None = None) -> torch.Tensor:
    """Locally normalised soft partial ``p_r @ E_r`` float32 [N, CL, hidden] with
    :func:`blockdiff.sampler.triton.soft_embedding.soft_embedding` (p rounded to E's dtype, fp32 accumulation);
    inactive rows 0."""
    N, CL, Vs = logits.shape
    hidden = embedding.shape[-1]
    check_config(config)
    if Vs == 0 or N * CL == 0:
        return torch.zeros(N, CL, hidden, dtype=torch.float32, device=logits.device)
    ws = soft_embedding(logits, embedding, T, local.m.contiguous(), local.inv_s.contiguous(),
                        local.local_argmax, active, config, shift=local.shift)
    part = ws.sum(0).view(N, CL, hidden) if ws.shape[0] > 1 else ws[0].view(N, CL, hidden)
    return torch.where(active[:, None, None], part, 0.0)
