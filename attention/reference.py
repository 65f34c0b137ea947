"""Dense PyTorch oracle for the blockdiff attention contract (backend ``"reference"``).

Loops over sequences, gathers each sequence's keys from the paged (or contiguous) cache, builds its dense
mask from :func:`blockdiff.attention.masks.key_range` (the rule :func:`~blockdiff.attention.masks.build_mask` uses)
and runs a plain softmax. Readable first, exact always:
every other backend is tested against it. Semantics: docs/ARCHITECTURE.md, "The attention contract";
the algorithm is standard scaled dot-product attention (Vaswani et al., 2017) with a natural-log LSE.
"""
from __future__ import annotations

import torch

from .masks import key_range
from .validate import check_attention_inputs, check_flag, memory_overlaps


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Keys (or values) of one sequence from a paged cache.

    Args:
        cache: ``[num_blocks, page_size, num_kv_heads, head_dim]``.
        block_table_row: ``[max_blocks]`` int block ids of the sequence.
        seq_len: number of keys to return (tokens).

    Returns:
        ``[seq_len, num_kv_heads, head_dim]`` (a copy).
    """
    page_size = cache.shape[1]
    n_blocks = (seq_len + page_size - 1) // page_size
    blocks = block_table_row[:n_blocks].to(torch.int64)
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:seq_len]


def masked_pv(p: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_k p[h, i, k] * v[h, k, :]`` over the allowed keys ``mask[i, k]`` only, exactly: a key outside a row's
    set contributes nothing even when its V row holds NaN / Inf (``p @ v`` would add ``0 * NaN``).

    Finite ``v``: ``p @ v`` itself (bit for bit). Otherwise ``p @ v`` with the non-finite entries zeroed, plus, for
    the keys holding one, ``p * v`` of those entries selected by the mask (IEEE: ``p * NaN = NaN``,
    ``p * Inf = +-Inf``, ``0 * Inf = NaN`` for an allowed key of weight 0), so an allowed non-finite entry reaches
    exactly its column of the rows that allow it.

    Args:
        p: ``[H, L, S]`` weights, 0 where ``mask`` is False. v: ``[H, S, Dv]`` (p's dtype). mask: ``[L, S]`` bool.

    Returns:
        ``[H, L, Dv]`` in p's dtype.
    """
    finite = torch.isfinite(v)
    if bool(finite.all()):
        return p @ v
    out = p @ torch.where(finite, v, torch.zeros_like(v))
    bad = torch.nonzero((~finite).any(dim=2).any(dim=0)).squeeze(1)  # keys with a non-finite V entry
    v_bad = torch.where(finite, torch.zeros_like(v), v)[:, bad]  # [H, nb, Dv]: the non-finite entries only
    terms = p[:, :, bad, None] * v_bad[:, None]  # [H, L, nb, Dv]
    return out + torch.where(mask[None, :, bad, None], terms, torch.zeros_like(terms)).sum(dim=2)


def attention_reference(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    seq_lens=None,
    causal=None,
    num_causal_q=None,
    block_table=None,
    cu_seqlens_k=None,
    window_size=None,
    bidirectional_window="symmetric",
    scale=None,
    out=None,
    return_lse=False,
    upcast=True,
    check_values=True,
    max_seqlen_q=None,
    max_seqlen_k=None,
):
    """Dense reference attention over a mixed causal/bidirectional varlen batch.

    Args:
        q: ``[total_q, num_heads, head_dim]`` bf16/fp16/fp32/fp64, packed by ``cu_seqlens_q``.
        k_cache, v_cache: paged ``[num_blocks, page_size, num_kv_heads, head_dim(_v)]`` with ``block_table``,
            or contiguous ``[total_k, num_kv_heads, head_dim(_v)]`` with ``cu_seqlens_k``.
        cu_seqlens_q: ``[B+1]`` int32, starts at 0, non-decreasing.
        seq_lens: ``[B]`` int32 keys per sequence including its query tokens (optional in the contiguous form).
        causal: ``[B]`` bool per-sequence flag, or ``num_causal_q``: ``[B]`` int32 causal rows per sequence.
        block_table: ``[B, max_blocks]`` int32 (paged form).
        cu_seqlens_k: ``[B+1]`` int32 (contiguous form).
        window_size: None or int W >= 0 (keys per side, excluding the query's own position).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.
        scale: softmax scale, default ``head_dim ** -0.5``; a finite int or float with
            ``|scale| <= MAX_SCALE`` (2**16). Scores are ``(q . k) * scale`` in fp32 (fp64 for fp64 input); a
            score of magnitude ``2**128 / log2(e)`` (about 2.36e38) or more, e.g. K entries near the fp32 maximum,
            is outside the contract: the kernels run the softmax in log2 units (``score * log2(e)`` in fp32), which
            overflow there (measured: NaN rows from the triton backend at 2.4e38 to 2.9e38, where this reference
            is finite). Here an overflowing score (``>= 2**128``) is ``+inf``, which makes its row non-finite, or
            ``-inf``, which weighs 0.
        out: optional preallocated ``[total_q, num_heads, head_dim_v]`` of q's dtype; it may alias an input (an
            overlapping ``out`` is written through a private buffer, then copied).
        return_lse: a bool: also return ``lse [num_heads, total_q]`` fp32 (natural log; ``-inf`` for rows with
            no key).
        upcast: True computes in fp32 (fp64 for fp64 inputs): the oracle. False mimics eager low-precision
            PyTorch (QK^T and PV in the input dtype, softmax in fp32): the baseline whose error sets the
            tolerance of every kernel test.
        check_values: run the host-side value checks (see :mod:`blockdiff.attention.validate`; the debug
            switch forces them). Unchecked, a bad page id or length is an ``IndexError`` / ``RuntimeError`` of
            torch's bounds-checked indexing.
        max_seqlen_q, max_seqlen_k: host hints accepted for interface parity with the kernels (None, an int >= 0
            or a 0-d int tensor: :func:`blockdiff.attention.validate.check_length_hint`); unused.

    Returns:
        ``out`` ``[total_q, num_heads, head_dim_v]`` in q's dtype, or ``(out, lse)``. Rows with no allowed key
        are 0 (lse ``-inf``), never NaN. Keys outside a row's allowed set contribute exactly nothing, NaN / Inf
        in their K or V included (:func:`masked_pv`).

    Raises:
        TypeError, ValueError: see :func:`blockdiff.attention.validate.check_attention_inputs`.
    """
    info = check_attention_inputs(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, causal=causal,
        num_causal_q=num_causal_q, block_table=block_table, cu_seqlens_k=cu_seqlens_k,
        window_size=window_size, bidirectional_window=bidirectional_window, scale=scale, out=out,
        check_values=check_values, return_lse=return_lse, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    check_flag("upcast", upcast)
    total_q, H = q.shape[0], info.num_heads
    group = H // info.num_kv_heads
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    mm_dtype = acc_dtype if upcast else q.dtype
    # an out that overlaps an input (out may alias one: the contract) would overwrite rows a later sequence still
    # reads (e.g. out a view of a cache page): write a private buffer, copied back at the end (a fresh out cannot)
    aliased = out is not None and any(memory_overlaps(out, t) for t in (q, k_cache, v_cache))
    if out is None:
        out = torch.empty(total_q, H, info.head_dim_v, dtype=q.dtype, device=q.device)
    dst = torch.empty_like(out) if aliased else out
    lse = torch.full((H, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.to(torch.int64).tolist()
    sl = info.seq_lens.to(torch.int64).tolist()
    ncq = info.num_causal_q.to(torch.int64).tolist()
    cuk = cu_seqlens_k.to(torch.int64).tolist() if cu_seqlens_k is not None else None
    for b in range(info.batch_size):
        q0, q1, S = cu[b], cu[b + 1], sl[b]
        L = q1 - q0
        if L == 0:
            continue
        if info.paged:
            k = gather_kv(k_cache, block_table[b], S)
            v = gather_kv(v_cache, block_table[b], S)
        else:
            k = k_cache[cuk[b]:cuk[b] + S]
            v = v_cache[cuk[b]:cuk[b] + S]
        qb = q[q0:q1].to(mm_dtype).transpose(0, 1)  # [H, L, D]
        kb = k.to(mm_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vb = v.to(mm_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, Dv]
        scores = (qb @ kb.transpose(1, 2)).to(acc_dtype) * info.scale  # [H, L, S]
        rows = torch.arange(L, device=q.device)
        t = lambda x: torch.tensor(x, device=q.device)  # noqa: E731
        lo, hi = key_range(rows, t(L), t(S), t(ncq[b]), info.window_size, bidirectional_window)
        keys = torch.arange(S, device=q.device)
        mask = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])  # [L, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, L]; -inf where no key
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        p = torch.exp(scores - safe[..., None]).masked_fill(~mask, 0.0)
        ob = masked_pv(p.to(mm_dtype), vb, mask).to(acc_dtype)  # [H, L, Dv]
        dst[q0:q1] = ob.transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = row_lse.to(torch.float32)
    if dst is not out:
        out.copy_(dst)
    return (out, lse) if return_lse else out
