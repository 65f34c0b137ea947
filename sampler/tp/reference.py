"""Reference local pass of the tensor-parallel sampler step (``backend="reference"``): dense PyTorch over one
rank's vocabulary shard, the oracle of :mod:`blockdiff.sampler.tp.triton`.

For the shard's logits, ``z = (float32(logits) - c) / T`` (c = 0, except c = the shard's max logit where the shard's
max z would overflow: :func:`blockdiff.sampler.common.overflow_shift`, status in :mod:`.common`): ``m = max z``,
``s = sum exp(z - m)``,
``u = sum exp(z - m) (z - m)``, the argmax of z and the Gumbel-max candidate ``max(z + g)`` with their GLOBAL ids
(the noise g drawn by :mod:`blockdiff.sampler.rng` at the global token id: bit-identical to the single-GPU
noise), a bad-logit flag (NaN / +inf), and the locally normalised soft-embedding partial
``(exp(z - m) / s) @ E_shard``. A -inf logit is p = 0 (docs/ARCHITECTURE.md "Non-finite logits"); a shard whose
every logit of a position is -inf gives that position the statistics of an empty shard
(:meth:`~blockdiff.sampler.tp.common.LocalStats.empty`), so it takes no part in the combine.
Memory: a few ``[N, CL, shard.size]`` float32 temporaries.
"""
from __future__ import annotations

import torch

from .. import rng
from ..common import overflow_shift
from .common import STATUS_BAD, STATUS_FINITE, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF, LocalStats, VocabShard

__all__ = ["gumbel_noise_shard", "local_statistics", "soft_partial"]


def gumbel_noise_shard(seed, request_id, canvas_index, step, canvas_length: int, vocab_start: int,
                       vocab_end: int) -> torch.Tensor:
    """Gumbel noise of the GUMBEL stream for global token ids ``[vocab_start, vocab_end)``.

    Equals ``rng.gumbel_noise(seed, request_id, canvas_index, step, CL, V)[..., vocab_start:vocab_end]``
    bit for bit (same Philox counters: the group of 4 of the GLOBAL id, word ``id & 3``) without generating
    the other tokens. Returns float32 ``[N, canvas_length, vocab_end - vocab_start]``.

    Raises:
        ValueError: ``vocab_start > vocab_end`` or negative bounds.
        TypeError: ``seed``, ``request_id``, ``canvas_index`` or ``step`` not an integer tensor / int, as
            :func:`blockdiff.sampler.rng.gumbel_noise` (:func:`blockdiff.sampler.rng.as_int_tensor`).
        ValueError: the four coordinates disagree on N (one entry is every row's: :func:`blockdiff.sampler.rng.num_rows`).
    """
    if not 0 <= vocab_start <= vocab_end:
        raise ValueError(f"need 0 <= vocab_start <= vocab_end, got [{vocab_start}, {vocab_end})")
    # (``.to(torch.int64)`` truncated a float seed: 1.9 drew seed 1's noise, where rng.gumbel_noise refuses it)
    seed, request_id, canvas_index, step = rng.as_int_coordinates(seed, request_id, canvas_index, step)
    n = rng.num_rows(seed, request_id, canvas_index, step)  # one entry broadcasts; a mismatch named, as gumbel_noise
    seed = seed.reshape(-1)
    dev = seed.device
    if vocab_end == vocab_start:
        return torch.empty(n, canvas_length, 0, dtype=torch.float32, device=dev)
    g0, g1 = vocab_start >> 2, ((vocab_end - 1) >> 2) + 1
    k0, k1 = rng.make_key(seed)
    pos = torch.arange(canvas_length, device=dev, dtype=torch.int64)
    grp = torch.arange(g0, g1, device=dev, dtype=torch.int64)
    c0, c1, c2, c3 = rng.make_counter(
        torch.as_tensor(request_id, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(canvas_index, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(step, device=dev).reshape(-1, 1, 1),
        pos.view(1, -1, 1), rng.GUMBEL, grp.view(1, 1, -1),
    )
    words = rng.philox4x32_10(c0, c1, c2, c3, k0.view(-1, 1, 1), k1.view(-1, 1, 1))
    w = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(n, canvas_length, (g1 - g0) * 4)
    off = vocab_start - 4 * g0
    return rng.gumbel_from_word(w[..., off:off + vocab_end - vocab_start])


def _divisor(T: torch.Tensor) -> torch.Tensor:
    """T as the divisor of z, float32 [N, 1, 1]: T = 0 (greedy) rows divide by 1, as the reference."""
    return torch.where(T == 0, torch.ones_like(T), T)[:, None, None]


def local_statistics(logits: torch.Tensor, T: torch.Tensor, seed: torch.Tensor, request_id: torch.Tensor,
                     canvas_index: torch.Tensor, step: torch.Tensor, shard: VocabShard) -> LocalStats:
    """Dense torch local pass (backend ``"reference"``) over a shard's logits.

    Args:
        logits: float [N, CL, shard.size] (the shard's logits, already soft-capped). T: float32 [N] (0 = greedy).
        seed, request_id, canvas_index, step: integer [N] RNG coordinates of the rows.
        shard: the :class:`VocabShard` (its ``start`` turns local ids into global ids).

    Returns:
        :class:`LocalStats`. Status BAD where a logit of the position is NaN or +inf; where every logit of the
        position is -inf, the fields of :meth:`LocalStats.empty` (status ZMAX_NEG_INF, max -inf, s = u = 0, ids
        ``vocab_size``, zero normalisers). Memory: a few ``[N, CL, shard.size]`` float32 temporaries (and the
        Philox int64 temporaries of :func:`gumbel_noise_shard`).
    """
    N, CL, Vs = logits.shape
    f64 = torch.float64
    if Vs == 0:
        return LocalStats.empty(N, CL, shard.vocab_size, logits.device)
    x = logits.to(torch.float32)
    xmax = x.amax(-1)                       # NaN where a logit is NaN (amax propagates it)
    # on the logits, as the reference (not on z, which may overflow): NaN / +inf is bad, -inf is p = 0, and a shard
    # whose every logit is -inf holds no probability (an empty shard)
    bad = torch.isnan(xmax) | (xmax == float("inf"))
    empty = xmax == float("-inf")
    tdiv = _divisor(T)
    shift = overflow_shift(x, tdiv)                              # 0 unless the shard's max z overflows
    zmax = xmax / tdiv[..., 0]                                   # the shard's max of x / T
    status = torch.where(bad, STATUS_BAD, torch.where(torch.isinf(zmax), torch.where(
        zmax > 0, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF), STATUS_FINITE))
    z = (x - shift[..., None]) / tdiv
    amax = z.argmax(-1)                                          # first maximum: ties to the lowest id
    m = z.gather(-1, amax[..., None]).squeeze(-1)
    d = z - m[..., None]
    e = torch.exp(d)
    s = e.sum(-1)
    u = torch.where(e == 0, 0.0, e * d).sum(-1)       # p = 0 adds nothing: z = -inf (x / T overflow) gives 0 * -inf
    g = gumbel_noise_shard(seed, request_id, canvas_index, step, CL, shard.start, shard.end)
    y = z + g
    gi = y.argmax(-1)
    gv = y.gather(-1, gi[..., None]).squeeze(-1)
    shifted = (status == STATUS_ZMAX_INF) | (status == STATUS_ZMAX_NEG_INF)
    key = torch.where(shifted, shift, m)                         # shifted: the combine compares the shifts c
    # every logit -inf: LocalStats.empty's fields (z - m = -inf - -inf would put NaN in s, u and the soft partial)
    neg_inf, none = torch.full_like(key, float("-inf")), torch.full_like(amax, shard.vocab_size)
    key, gv = torch.where(empty, neg_inf, key), torch.where(empty, neg_inf, gv)
    s, u, m = torch.where(empty, 0.0, s), torch.where(empty, 0.0, u), torch.where(empty, 0.0, m)
    aid, gid = torch.where(empty, none, amax + shard.start), torch.where(empty, none, gi + shard.start)
    inv_s = torch.where(empty, 0.0, 1.0 / s)
    packed = torch.stack([key.to(f64), s.to(f64), u.to(f64), aid.to(f64), gv.to(f64), gid.to(f64),
                          status.to(f64)], dim=-1)
    return LocalStats(packed, m, inv_s, torch.where(empty, 0, amax), shift)


def soft_partial(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, local: LocalStats) -> torch.Tensor:
    """Locally normalised soft-embedding partial ``q_r = p_r @ E_r``, float32 [N, CL, hidden] (dense torch).

    ``p_r = exp(z - m_r) / s_r`` over the shard (one-hot(local argmax) on T = 0 rows), cast to E's dtype (as
    :func:`blockdiff.sampler.reference.soft_embedding_reference`), products accumulated and returned in fp32.
    Unscaled (no ``sqrt(hidden)``). An empty shard gives zeros.
    """
    N, CL, Vs = logits.shape
    hidden = embedding.shape[-1]
    if Vs == 0:
        return torch.zeros(N, CL, hidden, dtype=torch.float32, device=logits.device)
    z = (logits.to(torch.float32) - local.shift[..., None]) / _divisor(T)
    p = torch.exp(z - local.m[..., None]) * local.inv_s[..., None]
    onehot = torch.nn.functional.one_hot(local.local_argmax, Vs).to(torch.float32)
    p = torch.where((T == 0)[:, None, None], onehot, p)
    return _matmul_fp32_out(p.to(embedding.dtype), embedding)


_MM_OUT_DTYPE_OK: bool | None = None


def _matmul_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with float32 output for a, b of one dtype: products of the (bf16/fp16) values accumulated in fp32,
    never rounded back to the narrow dtype (the shards' partials are summed afterwards, so rounding each one
    would double the reference's single output rounding). CUDA: ``torch.mm(..., out_dtype=torch.float32)``
    (tensor cores) where this torch has it, else the inputs widened to fp32; CPU: inputs widened to fp32."""
    global _MM_OUT_DTYPE_OK
    if b.dtype == torch.float32:
        return torch.matmul(a, b)
    a2 = a.reshape(-1, a.shape[-1])
    if a.is_cuda:
        if _MM_OUT_DTYPE_OK is None:
            try:
                torch.mm(a2[:1], b[:, :1], out_dtype=torch.float32)
                _MM_OUT_DTYPE_OK = True
            except (TypeError, RuntimeError, NotImplementedError):
                _MM_OUT_DTYPE_OK = False
        if _MM_OUT_DTYPE_OK:
            return torch.mm(a2, b, out_dtype=torch.float32).reshape(*a.shape[:-1], b.shape[-1])
    return torch.matmul(a2.to(torch.float32), b.to(torch.float32)).reshape(*a.shape[:-1], b.shape[-1])
