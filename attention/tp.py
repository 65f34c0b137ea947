"""Tensor-parallel attention: heads split across ranks, the same per-sequence metadata on every rank.

Under tensor parallelism (Megatron-LM, Shoeybi et al. 2019; vLLM ``QKVParallelLinear``) rank r of W computes
the query heads ``[r * H / W, (r + 1) * H / W)`` and holds the KV heads those query heads read: with
``Hkv >= W`` the KV heads are partitioned (``Hkv / W`` per rank); with ``Hkv < W`` (e.g. the global layers of
DiffusionGemma-26B-A4B, 2 KV heads, at TP 4) each KV head is replicated on ``W / Hkv`` ranks, exactly as vLLM
does. Attention is independent per head, so a rank runs the ordinary :func:`blockdiff.attention.attention` on
its slice with the unchanged batch metadata (cu_seqlens_q, seq_lens, causal / num_causal_q, block_table,
window_size, ...; the paged cache keeps its block layout, only its head dimension is sliced) and no
communication: the output projection that follows is row-parallel and all-reduces. The concatenation of the
ranks' outputs over the head dimension is the unsharded output (``lse`` likewise over its head dimension).

GQA inside a rank: local query head i reads local KV head ``i // (H_local / Hkv_local)``, which is the global
mapping ``h // (H / Hkv)`` restricted to the rank (checked by the tests).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import attention as _attention

__all__ = ["HeadShard", "head_shard", "shard_heads", "attention_tp", "gather_heads", "attention_head_parallel"]


@dataclass(frozen=True)
class HeadShard:
    """Heads of ``rank`` among ``world_size`` ranks: query heads ``[q_start, q_end)``, KV heads
    ``[kv_start, kv_end)`` of a layer with ``num_heads`` / ``num_kv_heads`` in total."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    def __post_init__(self):
        """Checks the fields against :func:`head_shard`'s rules: a shard built by hand must be the one it returns.

        Raises:
            TypeError: a non-int field. ValueError: fields that are not ``head_shard(num_heads, num_kv_heads,
                world_size, rank)``.
        """
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"HeadShard.{f.name} must be an int, got {type(v).__name__} ({v!r})")
        want = _shard_bounds(self.num_heads, self.num_kv_heads, self.world_size, self.rank)
        if want != (self.q_start, self.q_end, self.kv_start, self.kv_end):
            raise ValueError(f"HeadShard fields are inconsistent: rank {self.rank} of {self.world_size} with "
                             f"{self.num_heads} / {self.num_kv_heads} heads has q heads [{want[0]}, {want[1]}) "
                             f"and KV heads [{want[2]}, {want[3]}), got q_start={self.q_start}, "
                             f"q_end={self.q_end}, kv_start={self.kv_start}, kv_end={self.kv_end} (use head_shard)")

    @property
    def num_heads_local(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads_local(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """The :class:`HeadShard` of ``rank``.

    Rules: ``num_heads % num_kv_heads == 0`` (GQA), ``num_heads % world_size == 0``, and either
    ``num_kv_heads % world_size == 0`` (KV heads partitioned) or ``world_size % num_kv_heads == 0`` (each KV head
    replicated on ``world_size / num_kv_heads`` ranks, as vLLM does when TP > num_kv_heads).

    Raises:
        TypeError: a non-int argument. ValueError: a rule above broken, or rank outside [0, world_size).
    """
    return HeadShard(rank, world_size, num_heads, num_kv_heads, *_shard_bounds(num_heads, num_kv_heads, world_size,
                                                                               rank))


def _shard_bounds(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """``(q_start, q_end, kv_start, kv_end)`` of ``rank`` after checking :func:`head_shard`'s rules."""
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("world_size", world_size),
                    ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if num_heads < 1 or num_kv_heads < 1 or world_size < 1:
        raise ValueError(f"num_heads, num_kv_heads, world_size must be >= 1, got {num_heads}, {num_kv_heads}, "
                         f"{world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) (GQA)")
    if num_heads % world_size:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by world_size ({world_size})")
    hq = num_heads // world_size
    if num_kv_heads % world_size == 0:
        hkv = num_kv_heads // world_size
        kv0 = rank * hkv
    elif world_size % num_kv_heads == 0:
        hkv = 1
        kv0 = rank // (world_size // num_kv_heads)
    else:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) and world_size ({world_size}) must divide one another "
                         "(KV heads are partitioned or replicated across ranks)")
    return rank * hq, (rank + 1) * hq, kv0, kv0 + hkv


def _check_shard(shard) -> None:
    if not isinstance(shard, HeadShard):
        raise TypeError(f"shard must be a HeadShard (blockdiff.attention.tp.head_shard), got {type(shard).__name__}")


def _check_tensors(q, k_cache, v_cache) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def shard_heads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shard: HeadShard, *,
                contiguous: bool = True):
    """This rank's slices ``(q [total_q, H_local, D], k_cache, v_cache [..., Hkv_local, D(v)])``.

    Works for the paged ``[num_blocks, page_size, Hkv, D]`` and the contiguous ``[total_k, Hkv, D]`` cache forms
    (the head dimension is dim -2 in both). ``contiguous=True`` returns copies (a real TP rank owns contiguous
    local tensors); False returns strided views.

    Raises:
        TypeError: ``shard`` is not a :class:`HeadShard`; q / k_cache / v_cache not tensors; ``contiguous`` not a
            bool.
        ValueError: head counts of the tensors disagree with ``shard``.
    """
    _check_shard(shard)
    _check_tensors(q, k_cache, v_cache)
    if not isinstance(contiguous, bool):  # "no" / "False" / None read as truthy / falsy: copies or views silently
        raise TypeError(f"contiguous must be True or False, got {type(contiguous).__name__} ({contiguous!r})")
    if q.dim() != 3 or q.shape[1] != shard.num_heads:
        raise ValueError(f"q must be [total_q, num_heads={shard.num_heads}, head_dim], got {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() not in (3, 4) or c.shape[-2] != shard.num_kv_heads:
            raise ValueError(f"{name} must have num_kv_heads={shard.num_kv_heads} at dim -2, got {tuple(c.shape)}")
    qs = q[:, shard.q_start:shard.q_end]
    ks = k_cache[..., shard.kv_start:shard.kv_end, :]
    vs = v_cache[..., shard.kv_start:shard.kv_end, :]
    if contiguous:
        qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    return qs, ks, vs


def attention_tp(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, shard: HeadShard,
                 backend: str, **kwargs):
    """Attention of one rank's heads: :func:`blockdiff.attention.attention` on the local slices.

    Args:
        q: ``[total_q, shard.num_heads_local, D]``; k_cache / v_cache: the local KV heads
            (``shard.num_kv_heads_local`` at dim -2), paged or contiguous.
        shard: this rank's :class:`HeadShard`. backend: as :func:`blockdiff.attention.attention` (required).
        **kwargs: the batch metadata, identical on every rank (cu_seqlens_q, seq_lens, causal | num_causal_q,
            block_table | cu_seqlens_k, window_size, bidirectional_window, scale, out, return_lse, ...).
            ``scale`` defaults to ``head_dim ** -0.5`` as unsharded (head_dim is not sharded).

    Returns:
        ``out [total_q, H_local, Dv]`` or ``(out, lse [H_local, total_q])``.

    Raises:
        TypeError: ``shard`` is not a :class:`HeadShard`; q / k_cache / v_cache not tensors.
        ValueError: local head counts disagree with ``shard``; plus every error of ``attention``.
    """
    _check_shard(shard)
    _check_tensors(q, k_cache, v_cache)
    if q.dim() != 3 or q.shape[1] != shard.num_heads_local:
        raise ValueError(f"q must have num_heads_local={shard.num_heads_local} heads, got {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() not in (3, 4) or c.shape[-2] != shard.num_kv_heads_local:
            raise ValueError(f"{name} must have num_kv_heads_local={shard.num_kv_heads_local} at dim -2, "
                             f"got {tuple(c.shape)}")
    return _attention(q, k_cache, v_cache, backend=backend, **kwargs)


def gather_heads(outs):
    """Concatenate per-rank results in rank order: outs ``[total_q, H_local, Dv]`` along dim 1, or
    ``(out, lse)`` pairs (lse ``[H_local, total_q]`` along dim 0).

    Raises:
        TypeError: ``outs`` is a single tensor (not one result per rank); it mixes tensors and pairs, or holds
            something else.
        ValueError: ``outs`` is empty; a result is not 3-D; the ranks' results disagree in ``total_q``, ``Dv``,
            dtype or device; a pair's lse is not ``[H_local, total_q]`` float32 of its out (heads, rows, device).
    """
    if isinstance(outs, torch.Tensor):  # list(tensor) split it along dim 0 into "ranks" of 2-D slices
        raise TypeError(f"outs must be a list of the ranks' results (one per rank), got a single tensor of shape "
                        f"{tuple(outs.shape)}")
    outs = list(outs)
    if not outs:
        raise ValueError("outs must hold one result per rank, got none")
    pairs = isinstance(outs[0], tuple)
    for r, o in enumerate(outs):
        ok = (isinstance(o, tuple) and len(o) == 2 and all(isinstance(t, torch.Tensor) for t in o)) if pairs \
            else isinstance(o, torch.Tensor)
        if not ok:
            raise TypeError(f"outs must all be out tensors or all (out, lse) pairs (as attention_tp returns), got "
                            f"{type(o).__name__} at rank {r}")
    for r, o in enumerate(outs):  # each 3-D first: a 2-D rank 0 was reported as disagreeing with itself
        o = o[0] if pairs else o
        if o.dim() != 3:
            raise ValueError(f"outs[{r}] must be [total_q, H_local, Dv], got shape {tuple(o.shape)}")
    o0 = outs[0][0] if pairs else outs[0]
    for r, o in enumerate(outs):
        o = o[0] if pairs else o
        if o.shape[0] != o0.shape[0] or o.shape[2] != o0.shape[2] or o.dtype != o0.dtype \
                or o.device != o0.device:
            raise ValueError(f"outs must be [total_q, H_local, Dv] with one total_q, Dv, dtype and device: rank 0 "
                             f"has {tuple(o0.shape)} {o0.dtype} on {o0.device}, rank {r} {tuple(o.shape)} {o.dtype} "
                             f"on {o.device}")
    if pairs:
        for r, (o, lse) in enumerate(outs):  # each rank's lse must describe its own heads and rows (a rank's lse of
            # another head count concatenated into a total of the right size: every head after it got another's lse)
            if tuple(lse.shape) != (o.shape[1], o.shape[0]) or lse.dtype != torch.float32 or lse.device != o.device:
                raise ValueError(f"outs[{r}]: lse must be [H_local={o.shape[1]}, total_q={o.shape[0]}] float32 on "
                                 f"{o.device} (its out's heads and rows), got {tuple(lse.shape)} {lse.dtype} on "
                                 f"{lse.device}")
        return torch.cat([o for o, _ in outs], dim=1), torch.cat([l for _, l in outs], dim=0)
    return torch.cat(outs, dim=1)


def attention_head_parallel(q, k_cache, v_cache, *, world_size: int, backend: str, **kwargs):
    """Every rank of a head-parallel attention in ONE process, concatenated (tests and debugging).

    Same arguments as :func:`blockdiff.attention.attention` plus ``world_size``; ``out=`` is not supported.

    Raises:
        TypeError: q / k_cache / v_cache not tensors; see :func:`head_shard`.
        ValueError: see :func:`head_shard` (``world_size >= 1`` included); ``out`` given.
    """
    if kwargs.get("out") is not None:
        raise ValueError("attention_head_parallel does not take out=")
    _check_tensors(q, k_cache, v_cache)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.dim() < 2:
            raise ValueError(f"{name} must have its heads at dim {1 if name == 'q' else -2}, got shape "
                             f"{tuple(t.shape)}")
    head_shard(q.shape[1], k_cache.shape[-2], world_size, 0)  # world_size and the head counts, before any rank
    res = []
    for r in range(world_size):
        sh = head_shard(q.shape[1], k_cache.shape[-2], world_size, r)
        qs, ks, vs = shard_heads(q, k_cache, v_cache, sh)
        res.append(attention_tp(qs, ks, vs, shard=sh, backend=backend, **kwargs))
    return gather_heads(res)
