"""The batch order of the ``"cute"`` kernels' tile scheduler (config ``batch_order="work"``): a permutation of the
sequences, computed on the device, longest tiles first.

FA4's varlen tile scheduler (``flash_attn.cute.tile_scheduler.VarlenDecoder`` / ``SingleTileVarlenScheduler``,
flash-attn-4 4.0.0b36) hands out a launch's tiles sequence by sequence in batch order, longest-first only within a
sequence (``lpt``). In a mixed serving batch (a 4,096-token causal prefill, then canvases over an 8k context) the
canvases' long tiles then start last and leave SMs idle at the end (measured in docs/tuning.md 2.12). Its decoder
takes ``virtual_batch_idx_ptr``, a batch permutation: it walks the batches in that order, reads each one's length
through it and maps a tile back to its real batch index. FA3's ``hopper/flash_prepare_scheduler.cu``
(``prepare_varlen_num_blocks`` with ``sort``) fills it with an LPT batch sort; FA4's port
(``flash_attn/cute/prepare_scheduler.py``) leaves that sort unimplemented and its SM90 forward passes no permutation.
:func:`batch_work_order` computes one; the kernel takes it as its last aux tensor
(:mod:`blockdiff.attention.cute.kernel`, "The batch order").

The key is a sequence's mean keys per query row, a proxy of its mean keys per tile: a tile visits the union of its
rows' key intervals, at most one tile height more than its rows' mean. Rationale for the mean and not the longest
tile: a causal sequence's tiles run longest-first from its longest down to a few keys (mean about half the
longest), so ordering by the mean puts it after the sequences whose tiles are all about as long (canvases over the
whole context), and the launch ends on the causal sequences' short tiles instead of on canvas tiles. Closed forms,
``[B]``-sized ops only (no per-row work): exact for the causal rows (a sum of ``min(q_abs, W) + 1``) and for
bidirectional rows without a window or with the prefix window (one span for all); symmetric-window bidirectional
rows take the span at their midpoint (exact where the span is linear in the row, e.g. a canvas within ``W`` keys
of its sequence's end).

Pure torch on the tensors' device: no host read (``.item()``, ``.tolist()``, data-dependent shapes), so a CUDA
graph captures it and replays it with new metadata. Its cost is per call (the cute launch path has no plan shared
by a step's layers, and the order depends on the layer's window): a dozen or two small kernels on ``B`` elements
(counted in docs/tuning.md 2.13), which ``bench_attention``'s CUDA-graph rows include (``canvas_bs16_ctx8k_global``:
equal canvases, the identity order, the cost alone). Any permutation gives the same
outputs, so sharing one order between layers (a per-step cache) could only cost balance, never correctness; one
launch computing keys and ranks together is the other remedy. The next step if the cost shows.
"""
from __future__ import annotations

import torch

from ..masks import check_window

__all__ = ["sequence_work_key", "batch_work_order"]


def sequence_work_key(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                      window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """Each sequence's mean keys per query row (docs/ARCHITECTURE.md "Which keys a row sees"; the module docstring).

    For a sequence of ``L`` query rows, ``S`` keys (``ctx = S - L``), ``n`` causal rows, ``m = L - n``
    bidirectional rows and window ``W`` (``inf`` without one): ``(sum_{q_abs in [ctx, ctx + n)} (min(q_abs, W) + 1)
    + m * span_b) / max(L, 1)``, where ``span_b`` is ``S`` without a window, ``S - max(0, ctx + n - W)`` with the
    prefix window, and with the symmetric window ``min(S - 1, a + W) - max(0, a - W) + 1`` at the bidirectional
    rows' midpoint ``a = ctx + n + m / 2``. A sequence with no query rows has key 0. Computed in float64 (exact
    while the sums stay below 2^53).

    Args:
        cu_seqlens_q: ``[B + 1]`` integer tensor (query offsets).
        seq_lens: ``[B]`` integer tensor (keys, including the query tokens).
        num_causal_q: ``[B]`` integer tensor (leading causal rows; ``q_len`` for a causal sequence).
        window_size: None or a host int >= 0 (:func:`blockdiff.attention.masks.check_window`: ``W >= 2^30`` is
            no bound).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.

    Returns:
        float64 ``[B]`` on ``seq_lens``' device.

    Raises:
        TypeError, ValueError: a bad ``window_size`` or ``bidirectional_window`` (``check_window``). The tensors'
            values are the caller's (the contract's fast path: nothing is read on the host).
    """
    w = check_window(window_size, bidirectional_window)
    # float64 throughout (exact below 2^53; every call's op count is a kernel count on the GPU, so few ops)
    cu = cu_seqlens_q.double()
    q_len = cu[1:] - cu[:-1]
    s = seq_lens.double()
    n = num_causal_q.double()
    if w is None:
        # causal rows see q_abs + 1 keys, bidirectional rows all S: sum = L S - n (L - (n + 1) / 2)
        total = torch.addcmul(q_len * s, n, torch.add(q_len, n, alpha=-0.5) - 0.5, value=-1)
    else:
        a0 = s - q_len  # ctx: the first row's q_abs
        a1 = a0 + n  # the first bidirectional row's q_abs

        def g(x):  # sum_{a < x} min(a, W) = x W - g(x), with c = min(x, W + 1): g = c (W + 1/2 - c / 2)
            c = torch.clamp(x, max=w + 1)
            return torch.addcmul(c * (w + 0.5), c, c, value=-0.5)

        causal = torch.add(g(a0) - g(a1), n, alpha=w + 1)  # sum of min(q_abs, W) + 1 over the causal rows
        m = q_len - n
        if bidirectional_window == "symmetric":
            a_b = torch.add(a1, m, alpha=0.5)  # the bidirectional rows' midpoint
            span_b = torch.clamp(s - a_b, max=w + 1) + torch.clamp(a_b, max=w)  # min(S-1-a, W) + 1 + min(a, W)
        else:
            span_b = s - torch.clamp(a1 - w, min=0)
        total = torch.addcmul(causal, m, span_b)
    return total / q_len.clamp(min=1)


def batch_work_order(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_causal_q: torch.Tensor,
                     window_size=None, bidirectional_window: str = "symmetric") -> torch.Tensor:
    """The sequences by :func:`sequence_work_key`, descending; ties (and sequences with no query rows, key 0, last)
    keep their batch order (a stable sort).

    Args: as :func:`sequence_work_key`.

    Returns:
        int32 ``[B]`` on ``seq_lens``' device, a permutation of ``0 .. B - 1``: position ``v`` holds the batch index
        FA4's varlen scheduler takes ``v``-th (its ``virtual_batch_idx_ptr``).

    Raises:
        As :func:`sequence_work_key`.
    """
    key = sequence_work_key(cu_seqlens_q, seq_lens, num_causal_q, window_size, bidirectional_window)
    return torch.sort(key, descending=True, stable=True).indices.to(torch.int32)
