"""Mask semantics of the blockdiff attention contract, as allowed key intervals.

Every row type of the contract (docs/ARCHITECTURE.md, "Which keys a row sees") allows one contiguous interval
of keys ``[lo, hi]`` (inclusive; empty when ``hi < lo``). This module computes those intervals, vectorised
(:func:`key_range` for a set of rows, :func:`batch_key_ranges` for every row of a packed batch), and the dense
boolean mask built from them. It is the one host implementation: backends use the same formulas in their
kernels for tile skipping; tests, notebooks and benchmarks (allowed-pair counts for effective TFLOP/s) call it.

For query row ``i`` (0-based within its sequence) of a sequence with ``q_len`` query tokens, ``seq_len`` keys
(including the query tokens) and ``num_causal_q`` causal rows (``causal=True`` is ``num_causal_q = q_len``):

- ``ctx = seq_len - q_len`` (keys before the first query), ``q_abs = ctx + i``.
- causal row (``i < num_causal_q``): ``max(0, q_abs - W) <= k <= q_abs``.
- bidirectional row, ``"symmetric"``: ``max(0, q_abs - W) <= k <= min(seq_len - 1, q_abs + W)``.
- bidirectional row, ``"prefix"``: ``max(0, ctx_bi - W) <= k <= seq_len - 1`` where
  ``ctx_bi = ctx + num_causal_q`` is the position of the first bidirectional row (``= ctx`` when the
  sequence has no causal rows): the last W keys before the canvas plus the whole canvas (HF transformers).
- ``W = None``: no window bound (``W = +inf``).

``W`` counts keys on a side *not counting the query's own position* (FlashAttention's ``window_size_left``;
Gemma's ``sliding_window = 1024`` is ``W = 1023``).

One window rule for every backend and helper (:func:`check_window`): a sequence holds at most
:data:`MAX_SEQ_LEN` = 2**30 keys (the kernels' int32 positions; ``check_attention_inputs`` checks it with the
value checks), so any ``W >= WINDOW_NO_BOUND`` (= 2**30) admits every key of every sequence: it *is* ``None``.
:func:`check_window` returns ``None`` for it, and every backend and helper does its arithmetic with that
effective window, so no huge W reaches int64 (or the kernels' int32) arithmetic.
"""
from __future__ import annotations

import torch

BIDIRECTIONAL_WINDOW_MODES = ("symmetric", "prefix")
#: The most keys a sequence may hold (seq_lens <= MAX_SEQ_LEN): the kernels keep key positions, and position + W,
#: in int32.
MAX_SEQ_LEN = 1 << 30
#: Windows at least this wide bound no key of a sequence of at most MAX_SEQ_LEN keys: they mean "no window".
WINDOW_NO_BOUND = MAX_SEQ_LEN


def check_window(window_size, bidirectional_window) -> int | None:
    """Validate ``window_size`` (None or an int >= 0) and ``bidirectional_window`` (a known mode); return the
    effective window: ``None`` (no bound) for ``None`` and for any ``window_size >= WINDOW_NO_BOUND`` (such a
    window admits every key of every sequence the contract allows), else ``window_size``.

    Raises:
        TypeError: ``window_size`` is not None or an int (bool, float, NaN, numpy and tensor scalars are rejected).
        ValueError: ``window_size < 0`` or an unknown ``bidirectional_window``.
    """
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int):
            raise TypeError(f"window_size must be None or an int >= 0, got {type(window_size).__name__}")
        if window_size < 0:
            raise ValueError(f"window_size must be >= 0 (keys per side, excluding the query), got {window_size}")
    if not isinstance(bidirectional_window, str) or bidirectional_window not in BIDIRECTIONAL_WINDOW_MODES:
        raise ValueError(
            f"bidirectional_window must be one of {BIDIRECTIONAL_WINDOW_MODES}, got {bidirectional_window!r}"
        )
    if window_size is None or window_size >= WINDOW_NO_BOUND:
        return None
    return int(window_size)


def _int_tensor(name: str, t) -> torch.Tensor:
    """``t`` as int64, after checking it is an integer tensor with values (no silent truncation of floats, no
    bools, not on the meta device)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (no data): pass tensors with values")
    return t.to(torch.int64)


def key_range(
    row: torch.Tensor,
    q_len: torch.Tensor,
    seq_len: torch.Tensor,
    num_causal_q: torch.Tensor,
    window_size: int | None,
    bidirectional_window: str = "symmetric",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed key interval ``[lo, hi]`` (inclusive) for query rows, vectorised.

    Args:
        row: integer tensor, query row index within its sequence (0-based, ``< q_len``), any shape.
        q_len, seq_len, num_causal_q: integer tensors broadcastable to ``row`` (tokens).
        window_size: None or int >= 0 (any ``W >= WINDOW_NO_BOUND`` is None: :func:`check_window`).
        bidirectional_window: ``"symmetric"`` or ``"prefix"``.

    Returns:
        ``(lo, hi)`` int64 tensors of the broadcast shape; the row allows no key when ``hi < lo``.

    Raises:
        TypeError: an argument is not an integer tensor (floats are not truncated); a bad ``window_size``.
        ValueError: a bad ``window_size`` or ``bidirectional_window``; shapes that do not broadcast; tensors on
            different devices or on the meta device; values outside the contract (``0 <= q_len <= seq_len <=
            MAX_SEQ_LEN``, ``0 <= num_causal_q <= q_len``, ``0 <= row < q_len``: read on the host).
    """
    w = check_window(window_size, bidirectional_window)
    row, q_len, seq_len, num_causal_q = (_int_tensor(n, t) for n, t in (
        ("row", row), ("q_len", q_len), ("seq_len", seq_len), ("num_causal_q", num_causal_q)))
    named = (("row", row), ("q_len", q_len), ("seq_len", seq_len), ("num_causal_q", num_causal_q))
    if len({t.device for _, t in named}) > 1:
        raise ValueError("row, q_len, seq_len and num_causal_q must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in named))
    try:
        torch.broadcast_shapes(*(t.shape for _, t in named))
    except RuntimeError:
        raise ValueError("row, q_len, seq_len and num_causal_q must broadcast to one shape, got "
                         + ", ".join(f"{n} {tuple(t.shape)}" for n, t in named)) from None
    if bool((q_len < 0).any()) or bool((seq_len < q_len).any()) or bool((seq_len > MAX_SEQ_LEN).any()):
        raise ValueError(f"need 0 <= q_len <= seq_len <= MAX_SEQ_LEN = {MAX_SEQ_LEN} (seq_len includes the query "
                         "tokens)")
    if bool(((num_causal_q < 0) | (num_causal_q > q_len)).any()):
        raise ValueError("num_causal_q must be in [0, q_len]")
    if bool(((row < 0) | (row >= q_len)).any()):  # a row outside the sequence has no defined key interval
        raise ValueError("row must be in [0, q_len) (a query row of its sequence, 0-based)")
    ctx = seq_len - q_len
    q_abs = ctx + row
    is_causal = row < num_causal_q
    zero = torch.zeros_like(q_abs)
    if w is None:
        lo_sliding = zero
        lo_bi, hi_bi = zero, seq_len - 1 + zero
    else:
        lo_sliding = torch.maximum(zero, q_abs - w)
        if bidirectional_window == "symmetric":
            lo_bi = lo_sliding
            hi_bi = torch.minimum(seq_len - 1, q_abs + w)
        else:
            lo_bi = torch.maximum(zero, ctx + num_causal_q - w)
            hi_bi = seq_len - 1 + zero
    lo = torch.where(is_causal, lo_sliding, lo_bi)
    hi = torch.where(is_causal, q_abs, hi_bi)
    return lo, hi


def _parse_device(device, *, check_available: bool = True) -> torch.device | None:
    """``None`` or a ``torch.device`` / device string as a ``torch.device``; with ``check_available``, a CUDA device
    this machine lacks is refused.

    Raises:
        TypeError: neither None, a str nor a ``torch.device``.
        ValueError: a string torch cannot parse (``"bogus"``), or (``check_available``) a CUDA device this machine
            lacks.
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be None, a str or a torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1', ...), got {device!r}") from e
    if check_available and dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index is not None and dev.index >= torch.cuda.device_count())):
        raise ValueError(f"device {device!r} is not available on this machine")
    return dev


def build_mask(
    q_len: int,
    seq_len: int,
    *,
    causal: bool | None = None,
    num_causal_q: int | None = None,
    window_size: int | None = None,
    bidirectional_window: str = "symmetric",
    device=None,
) -> torch.Tensor:
    """Dense boolean mask of one sequence: ``mask[i, k]`` is True iff query row i may attend to key k.

    Args:
        q_len: query tokens of the sequence (>= 0).
        seq_len: keys of the sequence, including its query tokens (>= q_len).
        causal: all rows causal (True) or all bidirectional (False). Give this or ``num_causal_q``.
        num_causal_q: the first ``num_causal_q`` rows are causal, the rest bidirectional (0 <= n <= q_len).
        window_size: None or int W >= 0 (keys per side, excluding the query's own position).
        bidirectional_window: ``"symmetric"`` or ``"prefix"`` (see the module docstring).
        device: torch device of the result.

    Returns:
        bool tensor ``[q_len, seq_len]``.

    Raises:
        TypeError: ``q_len`` / ``seq_len`` / ``num_causal_q`` not ints, ``causal`` not a bool (no truthiness,
            no truncation), a bad ``window_size`` or ``device`` type.
        ValueError: lengths negative, ``seq_len < q_len`` or ``seq_len > MAX_SEQ_LEN``; both or neither of
            causal/num_causal_q;
            ``num_causal_q`` outside [0, q_len]; bad window or mode; a device string torch cannot parse, a CUDA
            device this machine lacks, or the meta device.
    """
    for name, v in (("q_len", q_len), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if seq_len < q_len:
        raise ValueError(f"seq_len ({seq_len}) must be >= q_len ({q_len}): seq_lens include the query tokens")
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"seq_len ({seq_len}) must be <= MAX_SEQ_LEN = {MAX_SEQ_LEN} keys")
    if (causal is None) == (num_causal_q is None):
        raise ValueError("give exactly one of causal (bool) or num_causal_q (int)")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if num_causal_q is not None and (isinstance(num_causal_q, bool) or not isinstance(num_causal_q, int)):
        raise TypeError(f"num_causal_q must be an int, got {type(num_causal_q).__name__}")
    n_causal = (q_len if causal else 0) if causal is not None else num_causal_q
    if not 0 <= n_causal <= q_len:
        raise ValueError(f"num_causal_q must be in [0, q_len={q_len}], got {n_causal}")
    check_window(window_size, bidirectional_window)
    device = _parse_device(device)
    if device is not None and device.type == "meta":  # (was reported as the internal 'row' tensor's device)
        raise ValueError("device must hold data: a mask on the meta device has no values, got 'meta'")
    rows = torch.arange(q_len, device=device)
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    lo, hi = key_range(rows, t(q_len), t(seq_len), t(n_causal), window_size, bidirectional_window)
    keys = torch.arange(seq_len, device=device)
    return (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])


def batch_key_ranges(
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_causal_q: torch.Tensor,
    window_size: int | None,
    bidirectional_window: str = "symmetric",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row of a packed batch: its sequence and allowed key interval ``[lo, hi]`` (inclusive).

    :func:`key_range` applied to every row of a varlen batch (rows in ``cu_seqlens_q`` order), in O(total_q)
    memory (no dense mask: fine for 100k-token contexts). Benchmarks use it for allowed-pair counts and for
    FlexAttention / SDPA masks; backends' host code for per-row bounds.

    Args:
        q_lens, seq_lens, num_causal_q: integer tensors ``[B]`` (tokens; any device, any integer dtype);
            ``seq_lens`` include the query tokens; ``num_causal_q`` = causal rows per sequence (a causal
            sequence has ``num_causal_q = q_len``, a denoise canvas 0).
        window_size: None or int >= 0; bidirectional_window: ``"symmetric"`` or ``"prefix"``.

    Returns:
        ``(seq_id, lo, hi)``: int64 tensors ``[total_q]`` on the CPU; a row with ``hi < lo`` allows no key.

    Raises:
        TypeError: a length tensor is not an integer tensor; ``window_size`` not None or an int.
        ValueError: shapes differ or are not 1-D; tensors on the meta device; ``q_lens < 0``,
            ``seq_lens < q_lens``, ``seq_lens > MAX_SEQ_LEN`` or ``num_causal_q`` outside ``[0, q_len]`` (a mask
            the contract does not define); a bad window or mode.
    """
    for name, t in (("q_lens", q_lens), ("seq_lens", seq_lens), ("num_causal_q", num_causal_q)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor [B], got {getattr(t, 'dtype', type(t).__name__)}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != 1:  # (a 2-D q_lens was reported as "got q_lens (1, 1) vs q_lens (1, 1)")
            raise ValueError(f"{name} must be 1-D [B], got shape {tuple(t.shape)}")
        if t.shape != q_lens.shape:
            raise ValueError(f"q_lens, seq_lens, num_causal_q must be 1-D of equal length, got {name} "
                             f"{tuple(t.shape)} vs q_lens {tuple(q_lens.shape)}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no data): pass tensors with values")
    check_window(window_size, bidirectional_window)
    q_lens = q_lens.to(torch.int64).cpu()
    seq_lens = seq_lens.to(torch.int64).cpu()
    num_causal_q = num_causal_q.to(torch.int64).cpu()
    if bool((q_lens < 0).any()) or bool((seq_lens < q_lens).any()) or bool((seq_lens > MAX_SEQ_LEN).any()):
        raise ValueError(f"need 0 <= q_lens <= seq_lens <= MAX_SEQ_LEN = {MAX_SEQ_LEN} (seq_lens include the "
                         "query tokens)")
    if bool(((num_causal_q < 0) | (num_causal_q > q_lens)).any()):
        raise ValueError("num_causal_q must be in [0, q_len] for every sequence")
    seq_id = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    rows = torch.arange(int(q_lens.sum())) - starts[seq_id]
    lo, hi = key_range(rows, q_lens[seq_id], seq_lens[seq_id], num_causal_q[seq_id], window_size,
                       bidirectional_window)
    return seq_id, lo, hi


def count_allowed_pairs(
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_causal_q: torch.Tensor,
    window_size: int | None,
    bidirectional_window: str = "symmetric",
) -> int:
    """Number of allowed (query, key) pairs of a batch, summed over sequences (per head).

    Exact, in O(total_q) memory (no dense mask; :func:`batch_key_ranges`). Used for effective TFLOP/s:
    ``4 * num_heads * head_dim * pairs / time``; equals ``sum_b build_mask(q_len_b, seq_len_b, ...).sum()``.

    Args:
        q_lens, seq_lens, num_causal_q: int tensors ``[B]`` (tokens).

    Raises:
        TypeError, ValueError: as :func:`batch_key_ranges`.
    """
    _, lo, hi = batch_key_ranges(q_lens, seq_lens, num_causal_q, window_size, bidirectional_window)
    return int((hi - lo + 1).clamp_min(0).sum())
