"""Host mirror of the ``"cute"`` kernel's per-tile key-block ranges (``kernel.MixedBlockInfo``), for tests and
benchmarks: which key blocks each query tile loads, and which of them run masked.

The per-row key intervals come from :func:`blockdiff.attention.masks.key_range` (the one host implementation of
docs/ARCHITECTURE.md "Which keys a row sees"); the block arithmetic is the device code's integer formulas. Both
``lo(i)`` and ``hi(i)`` are non-decreasing in the row ``i`` for every mix of row types and both window modes, so
a tile's range needs only its first and last rows (see :mod:`blockdiff.attention.cute.kernel`).
"""
from __future__ import annotations

import torch

from ..masks import key_range

__all__ = ["tile_plan"]


def tile_plan(q_len: int, seq_len: int, num_causal_q: int, window_size=None, bidirectional_window="symmetric",
              *, tile_m: int = 128, tile_n: int = 128, qhead_per_kvhead: int = 1) -> list[dict]:
    """The kernel's key-block plan for one sequence.

    For each query tile ``m_block`` (PackGQA: ``tile_m`` packed rows = ``tile_m / qhead_per_kvhead`` query
    rows): ``rows`` (first and last query row of the tile), ``n_block_min``/``n_block_max`` (key blocks loaded by
    the producer and consumed by the MMA warps, ``[min, max)``), ``right_mask_from`` (blocks ``>=`` it are masked
    on the right), ``left_mask_below`` (blocks ``<`` it are masked on the left); blocks in between run unmasked.

    Args:
        q_len, seq_len, num_causal_q: the sequence's query tokens, keys (including the query tokens) and causal
            rows (tokens).
        window_size, bidirectional_window: as :func:`blockdiff.attention.masks.key_range`.
        tile_m, tile_n: the kernel's tile shape (:class:`blockdiff.attention.cute.config.CuteConfig`).
        qhead_per_kvhead: query heads per KV head (PackGQA packs them into a tile's rows).

    Returns:
        One dict per query tile, in ``m_block`` order (empty for ``q_len == 0``).

    Raises:
        TypeError, ValueError: a bad ``window_size`` or ``bidirectional_window`` (from ``key_range``).
    """
    qpk = qhead_per_kvhead
    num_m_blocks = -(-q_len * qpk // tile_m)
    first = [m_block * tile_m // qpk for m_block in range(num_m_blocks)]
    last = [min(-(-(m_block + 1) * tile_m // qpk), q_len) - 1 for m_block in range(num_m_blocks)]
    rows = torch.tensor(first + last, dtype=torch.int64)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    lo, hi = key_range(rows, t(q_len), t(seq_len), t(num_causal_q), window_size, bidirectional_window)
    lo, hi = lo.tolist(), hi.tolist()
    plan = []
    for m_block in range(num_m_blocks):
        lo_first, hi_first = lo[m_block], hi[m_block]
        lo_last, hi_last = lo[num_m_blocks + m_block], hi[num_m_blocks + m_block]
        n_min = lo_first // tile_n
        n_max = max((hi_last + tile_n) // tile_n, n_min + 1)
        right = max(n_min, (hi_first + 1) // tile_n)
        left = n_min if window_size is None else max(n_min, -(-lo_last // tile_n))
        plan.append(dict(m_block=m_block, rows=(first[m_block], last[m_block]), n_block_min=n_min,
                         n_block_max=n_max, right_mask_from=right, left_mask_below=left))
    return plan
