"""Paged KV cache helpers and per-step attention metadata (backend-independent)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .validate import self_overlapping, capturing, memory_overlaps, resolve_check_values, share_elements


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, check_values: bool | None = None) -> None:
    """Write new keys/values into a paged cache in place, as vLLM does before attention.

    Args:
        k: ``[T, num_kv_heads, head_dim]``; v: ``[T, num_kv_heads, head_dim_v]``: floating point, rounded to the
            cache dtype (e.g. a bf16 model writing an fp16 cache); they may be views of the caches (copied first).
        k_cache: ``[num_blocks, page_size, num_kv_heads, head_dim]``; v_cache likewise with head_dim_v; floating
            point, sharing no element (the same tensor, or views with an element in common whatever their strides,
            are refused; interleaved views that share none, such as the head-dim halves of one tensor, pass); any
            strides (pages that are not one row stride apart are written by page and row index).
        slot_mapping: ``[T]`` int64 flat slot ``block_id * page_size + offset``; a negative slot skips
            its token (padding).
        check_values: run the host-side slot checks (default: yes unless a CUDA graph is being captured; the
            debug switch, :func:`blockdiff.attention.set_debug_checks`, forces them); a caller writing the same
            ``slot_mapping`` into many layers' caches checks it once. Unchecked, a slot beyond the cache is an
            ``IndexError`` of torch's bounds-checked ``index_copy_``.

    Raises:
        TypeError: a tensor argument that is not a dense (strided) tensor (sparse); ``slot_mapping`` is not an
            int32/int64 tensor (a float or bool mapping would be truncated);
            k, v, k_cache or v_cache not floating point (integer K/V would be cast silently).
        ValueError: shapes disagree (k/v vs caches, k_cache vs v_cache pages), a tensor on another device than
            k_cache or on the meta device, k_cache and v_cache share memory (one write would overwrite the other),
            k_cache or v_cache has elements sharing memory (an ``expand()``ed view: a write would land in other slots),
            a slot is out of range, or two tokens share a slot (the
            surviving write would be unspecified). Value rules are checked on the host unless a CUDA graph is
            being captured (under capture every slot must be >= 0).
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:  # sparse: no strides / data pointer (torch's errors from inside before)
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if k.dim() != 3 or v.dim() != 3 or k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must be [T, num_kv_heads, head_dim] with equal T, got {k.shape}, {v.shape}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            f"k_cache and v_cache must be [num_blocks, page_size, num_kv_heads, head_dim] with equal num_blocks "
            f"and page_size, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape[2:] != v.shape[1:]:
        raise ValueError(
            f"cache head shapes {tuple(k_cache.shape[2:])}/{tuple(v_cache.shape[2:])} must match "
            f"k/v {tuple(k.shape[1:])}/{tuple(v.shape[1:])}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no data): pass tensors with values")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    if share_elements(k_cache, v_cache):  # (exact for strided views: interleaved ones that share none pass)
        raise ValueError("k_cache and v_cache must not share memory (writing v would overwrite k)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if self_overlapping(t):  # e.g. an expand()ed page pool: a write to one slot would land in others
            raise ValueError(f"{name} must not have elements sharing memory (e.g. an expand()ed view), got strides "
                             f"{t.stride()} for shape {tuple(t.shape)}")
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    check_values = resolve_check_values(check_values)
    if check_values and slot_mapping.numel():
        if int(slot_mapping.max()) >= n_slots:
            raise ValueError(f"slot_mapping has a slot >= num_blocks * page_size = {n_slots}")
        used = slot_mapping[slot_mapping >= 0]
        if torch.unique(used).numel() != used.numel():
            raise ValueError("slot_mapping has a slot used by two tokens (duplicate non-negative slots)")
    slots = slot_mapping.to(torch.int64)
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    # k / v that are views of a cache (e.g. rows re-written to other slots): torch refuses to copy a tensor into
    # memory it reads from, so such a source is copied first (host pointer arithmetic, no sync)
    k, v = (x.clone() if any(memory_overlaps(x, c) for c in (k_cache, v_cache)) else x for x in (k, v))
    if not capturing():
        valid = slots >= 0
        if not bool(valid.all()):
            slots, k, v = slots[valid], k[valid], v[valid]
    # (under graph capture: no host reads, so padding (negative slots) is not supported there)
    for cache, x in ((k_cache, k), (v_cache, v)):
        _write_rows(cache, slots, x)


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[slot // page_size, slot % page_size] = x`` for each slot: one ``index_copy_`` into the cache viewed as
    ``[num_blocks * page_size, ...]`` rows where its strides allow that view, else (pages not one row stride apart:
    a transposed or reversed storage) an ``index_put_`` on page and row indices."""
    nb, ps = cache.shape[:2]
    try:
        rows = cache.view(nb * ps, *cache.shape[2:])
    except RuntimeError:
        cache.index_put_((slots // ps, slots % ps), x)
        return
    rows.index_copy_(0, slots, x)


@dataclass
class AttentionMetadata:
    """Per-step attention metadata of a flat mixed batch (all tensors on the model's device).

    Attributes:
        cu_seqlens_q: ``[B+1]`` int32 query offsets.
        seq_lens: ``[B]`` int32 keys per sequence, including its query tokens.
        causal: ``[B]`` bool per-sequence causal flag (prefill/commit True, denoise False).
        block_table: ``[B, max_blocks]`` int32.
        slot_mapping: ``[total_q]`` int64 cache slot of each query token's K/V.
        max_seqlen_q, max_seqlen_k: host ints. Any upper bound (a static capacity) gives correct results; the
            true maximum query length lets the cute backend pick canvas tiles and tile order (resolve_config).
        num_causal_q: optional ``[B]`` int32 replacing ``causal`` (first n rows causal).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    causal: torch.Tensor | None
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    num_causal_q: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def attn_kwargs(self) -> dict:
        """Keyword arguments for :func:`blockdiff.attention.attention` (everything but q/k/v and options)."""
        kw = dict(cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, block_table=self.block_table,
                  max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)
        if self.num_causal_q is not None:
            kw["num_causal_q"] = self.num_causal_q
        else:
            kw["causal"] = self.causal
        return kw
