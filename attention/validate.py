"""Input validation shared by every attention backend (one rule set, one set of messages).

Shape, dtype and device rules are checked without touching tensor values (no host sync), so they also run
under CUDA-graph capture. Value rules (``cu_seqlens_q`` starts at 0 and never decreases,
``q_len <= seq_lens <= MAX_SEQ_LEN``, block tables long enough, block ids in range, ``num_causal_q`` within
``[0, q_len]``, ``cu_seqlens_k`` from 0, non-decreasing and within the cache) read the metadata
on the host: they run when ``check_values`` is True (backends default to True except while a CUDA graph is
being captured, where a host read is not allowed).

**Debug switch.** ``BLOCKDIFF_CHECK_VALUES=1`` in the environment (read once, at import, by
:func:`.env.env_flag`: ``0``, empty or unset off; any other value, ``false`` / ``no`` / ``off`` included, is a
``ValueError`` there) or
:func:`set_debug_checks` ``(True)`` makes every call run the value checks, ``check_values=False`` included (the
triton backend's launch plans are bypassed then), except while a CUDA graph is being captured (no host reads
there). :func:`resolve_check_values` is the one place this is decided.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .env import env_flag
from .masks import MAX_SEQ_LEN, check_window

#: The largest softmax scale magnitude accepted: far above any model's (head_dim ** -0.5 <= 1, Gemma's 1.0), and
#: low enough that fp32 scores (q.k) * scale stay finite for every |q.k| < 2**112 (a huge scale overflowed them
#: into NaN rows for ordinary q, k).
MAX_SCALE = float(2 ** 16)
#: log2(e): the kernels take the softmax scale as the fp32 ``scale * LOG2E`` (``exp2`` units).
LOG2E = 1.4426950408889634
#: The least ``|scale| * log2(e)`` at which a kernel may weigh keys ``exp2((s - m) * |scale| * log2(e))`` on raw fp32
#: scores (the exact key weight: docs/ARCHITECTURE.md section 4, "Scores beyond ~2^31 in log2 units"). The raw
#: difference ``s - m`` overflows to ``-inf`` (weight 0) once ``|s - m|`` reaches ~2**128 (two finite scores near
#: +-2**127); from 2**-120 up such a key's exact weight is below ``2**(-2**128 * 2**-120) = 2**-256``, 0 in fp32
#: anyway, while below it (``|scale| * log2(e)`` of 2**-126, a normal fp32) it is up to ``2**-4``. Smaller scales
#: are scaled first (the triton backend's general path) or rescaled (the cute backend runs ``q * 2**-24``), where
#: every scaled score stays below ``2**128 * 2**-120 = 2**8`` in log2 units. Shared by both kernel backends.
MIN_RAW_WEIGHT_SCALE_LOG2 = 2.0 ** -120
#: Most query rows (``q.shape[0]``), contiguous key rows or pages (``k_cache.shape[0]``) a call may hold: the
#: kernels read ``cu_seqlens_q`` / ``cu_seqlens_k`` offsets and block-table page ids as int32.
MAX_ROWS = 2 ** 31 - 1

#: The debug switch's environment variable (:func:`.env.env_flag`: ``1`` on; ``0``, empty or unset off; anything else
#: is a ValueError at import).
CHECK_VALUES_ENV = "BLOCKDIFF_CHECK_VALUES"
_DEBUG_CHECKS = env_flag(CHECK_VALUES_ENV, meaning="value checks on every call")


def set_debug_checks(enabled: bool) -> None:
    """Turn the debug switch on or off: on, every attention call (and :func:`.cache.write_kv_cache`) runs the host
    value checks whatever its ``check_values``, except under CUDA-graph capture. Starts as the environment
    variable ``BLOCKDIFF_CHECK_VALUES`` (``1`` = on) said at import.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _DEBUG_CHECKS
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _DEBUG_CHECKS = enabled


def debug_checks() -> bool:
    """Whether the debug switch (:func:`set_debug_checks`, ``BLOCKDIFF_CHECK_VALUES``) is on."""
    return _DEBUG_CHECKS


def resolve_check_values(check_values) -> bool:
    """Whether a call runs the host value checks: ``check_values`` (None: yes unless a CUDA graph is being
    captured), forced on by the debug switch except under capture.

    Raises:
        TypeError: ``check_values`` is not None, True or False.
    """
    if check_values is not None and not isinstance(check_values, bool):
        raise TypeError(f"check_values must be None, True or False, got {type(check_values).__name__}")
    if check_values is None or (check_values is False and _DEBUG_CHECKS):
        return not capturing()
    return check_values

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)


@dataclass
class CheckedInputs:
    """What validation learned about a call (all tensors on q's device)."""

    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    paged: bool
    page_size: int | None
    seq_lens: torch.Tensor  # [B] int32
    scale: float
    window_size: int | None = None  # the effective window (masks.check_window: None = no bound)
    causal: torch.Tensor | None = None  # [B] bool when the call gave ``causal`` (kernels may read it directly)
    _num_causal_q: torch.Tensor | None = None
    _cu_seqlens_q: torch.Tensor | None = None

    @property
    def num_causal_q(self) -> torch.Tensor:
        """``[B]`` int32 causal row counts (``causal=True`` -> q_len): the call's ``num_causal_q``, or derived from
        ``causal`` on first use (two small device ops, no host sync; a backend that reads ``causal`` in its
        kernel never pays them)."""
        if self._num_causal_q is None:
            self._num_causal_q = causal_row_counts(self.causal, self._cu_seqlens_q)
        return self._num_causal_q


def _need_tensor(name, t, ndim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # sparse / mkldnn: no strides or data pointer (errors from inside torch before)
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _need_int(name, t):
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_flag(name: str, v) -> bool:
    """``v`` if it is a bool (``return_lse``, ``upcast``, ...): no truthiness of strings or ints.

    Raises:
        TypeError: ``v`` is not a bool.
    """
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {type(v).__name__} ({v!r})")
    return v


def check_length_hint(name: str, v):
    """A host hint such as ``max_seqlen_q`` / ``max_seqlen_k``: None, an int >= 0 (bool rejected), or a 0-d integer
    tensor with a value (read on the host by the paths that use it, and by :func:`check_attention_inputs`' value
    checks; its value is not checked here: no sync).

    Raises:
        TypeError: anything else (a str, a float, a numpy scalar, a float or multi-element tensor).
        ValueError: a negative int; a tensor on the meta device (no value to read: torch's RuntimeError from the
            paths that read it before).
    """
    if v is None:
        return v
    if isinstance(v, torch.Tensor):
        if v.dim() != 0 or v.dtype not in INT_DTYPES:
            raise TypeError(f"{name} must be None, an int >= 0 or a 0-d int32 / int64 tensor, got a tensor of "
                            f"shape {tuple(v.shape)} and dtype {v.dtype}")
        check_has_data(name, v)
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be None, an int >= 0 or a 0-d int32 / int64 tensor, got {type(v).__name__} "
                        f"({v!r})")
    if v < 0:
        raise ValueError(f"{name} must be >= 0 (a host hint: an upper bound of the step's lengths), got {v}")
    return v


def length_hint_value(name: str, v) -> int | None:
    """The host int of a hint :func:`check_length_hint` accepted (a 0-d tensor is read on the host here, where a
    path uses its value), checked like the int form.

    Raises:
        ValueError: a negative value (an int is refused earlier, by :func:`check_length_hint`; a tensor here).
    """
    if v is None:
        return None
    n = int(v)
    if n < 0:
        raise ValueError(f"{name} must be >= 0 (a host hint: an upper bound of the step's lengths), got {n}")
    return n


def check_has_data(name: str, t: torch.Tensor) -> None:
    """Tensors on the ``meta`` device hold no values to compute with or check.

    Raises:
        ValueError: ``t`` is on the meta device.
    """
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (no data): pass tensors with values")


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory, from shape and strides only (no host sync). Conservative:
    True whenever the dims, taken by increasing stride, do not each step over all the earlier ones (an
    ``expand()``ed view, a stride 0); a rare interleaved layout that shares no element (shape (3, 2) with strides
    (2, 3)) is reported too. A dense or permuted tensor, and its basic slices, are False."""
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    if any(n == 0 for n in t.shape):
        return False
    extent = 1  # elements spanned by the dims seen so far
    for st, n in dims:
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[start, end)`` a non-empty tensor's elements lie in (host pointer arithmetic, no sync)."""
    start = t.data_ptr()
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans intersect (host pointer arithmetic only, no sync; conservative: spans,
    not elements)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, a1 = memory_span(a)
    b0, b1 = memory_span(b)
    return a0 < b1 and b0 < a1


#: Search nodes :func:`share_elements` visits before it answers True without deciding (conservative).
_SHARE_SEARCH_LIMIT = 4096


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may have an element in common, from shapes, strides and addresses only (no sync).

    Exact where it matters: two views whose memory spans interleave without sharing an element (the head-dim
    halves of one ``[..., 2 * D]`` tensor, the ``[:, 0]`` / ``[:, 1]`` planes of a ``[num_blocks, 2, ...]`` pool)
    are False; views that do share one (``x[..., :D]`` and ``x[..., 1:D + 1]``) are True, whatever their strides.
    Conservative (True) where the spans intersect and the elements differ in size or alignment, or the search
    for a common element (an integer point of the two index boxes, by decreasing stride) passes
    ``_SHARE_SEARCH_LIMIT`` nodes.
    """
    if not memory_overlaps(a, b):
        return False
    size = a.element_size()
    delta = b.data_ptr() - a.data_ptr()
    if b.element_size() != size or delta % size:
        return True
    return _layouts_share_an_element(tuple(a.shape), tuple(a.stride()), tuple(b.shape), tuple(b.stride()),
                                     delta // size)


@functools.lru_cache(maxsize=256)
def _layouts_share_an_element(a_shape: tuple, a_stride: tuple, b_shape: tuple, b_stride: tuple, d: int) -> bool:
    """:func:`share_elements`' search on the layouts alone (``d``: b's start minus a's, in elements), cached: a
    serving step passes the same cache pool every layer and step, so the search runs once per layout (a
    ``[num_blocks, page_size, 2, ...]`` pool's planes took ~80 us of host time per call uncached)."""
    # a common element: a_start + sum_k sa_k i_k = b_start + sum_k sb_k j_k, i.e. sum over the dims of both of
    # stride * t = d, with t in [0, n - 1] for a's dims and in [-(n - 1), 0] for b's (torch strides are
    # >= 0; stride-0 and size-1 dims add nothing; equal strides merge into one range)
    ranges: dict[int, list[int]] = {}
    for shape, stride, side in ((a_shape, a_stride, 1), (b_shape, b_stride, 0)):
        for n, st in zip(shape, stride):
            if n > 1 and st > 0:
                ranges.setdefault(st, [0, 0])[side] += (n - 1) if side else -(n - 1)
    terms = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), reverse=True)
    # rest[k]: the least and greatest sum the terms after k reach
    rest = [(0, 0)] * (len(terms) + 1)
    for k in range(len(terms) - 1, -1, -1):
        st, lo, hi = terms[k]
        rest[k] = (rest[k + 1][0] + st * lo, rest[k + 1][1] + st * hi)
    budget = [_SHARE_SEARCH_LIMIT]

    def reach(k: int, d: int) -> bool:  # whether sum_{m >= k} st_m * t_m == d for some t in the ranges
        budget[0] -= 1
        if budget[0] < 0:
            raise OverflowError
        if k == len(terms):
            return d == 0
        st, lo, hi = terms[k]
        mn, mx = rest[k + 1]
        first = max(lo, -((mx - d) // st))  # ceil((d - mx) / st)
        last = min(hi, (d - mn) // st)
        return any(reach(k + 1, d - st * t) for t in range(first, last + 1))

    try:
        return reach(0, d)
    except OverflowError:
        return True


def causal_row_counts(causal, cu_seqlens_q) -> torch.Tensor:
    """The per-sequence causal flags as causal row counts: ``num_causal_q[b] = q_len[b]`` where ``causal[b]``,
    else 0, as ``[B]`` int32 on the flags' device — two small device ops and no host sync (CUDA-graph safe).

    A caller that attends many layers with the same batch converts once per step and passes ``num_causal_q``;
    :func:`check_attention_inputs` applies the same conversion (and the same checks) to ``causal``.

    Raises:
        TypeError: ``causal`` not a bool tensor, ``cu_seqlens_q`` not an int32 / int64 tensor.
        ValueError: ``causal`` not ``[B]`` with ``B = len(cu_seqlens_q) - 1``, or on another device.
    """
    _need_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    _need_int("cu_seqlens_q", cu_seqlens_q)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have B+1 >= 1 entries")
    _need_tensor("causal", causal, 1)
    if causal.dtype != torch.bool:
        raise TypeError(f"causal must have dtype in {(torch.bool,)}, got {causal.dtype}")
    if causal.shape[0] != batch:
        raise ValueError(f"causal must have B={batch} entries (len(cu_seqlens_q) - 1), got {causal.shape[0]}")
    if causal.device != cu_seqlens_q.device:
        raise ValueError(f"causal is on {causal.device} but cu_seqlens_q is on {cu_seqlens_q.device}")
    return torch.where(causal, cu_seqlens_q[1:] - cu_seqlens_q[:-1], 0).to(torch.int32)


def check_no_autograd(backend: str, q, k_cache, v_cache, out=None) -> None:
    """A kernel backend computes no gradients: refuse a call whose output autograd would need to differentiate.

    Its output is written by a kernel, outside the autograd graph, so with grad mode on and an input that requires
    grad (q, k / v projections of a model being trained) the loss silently got no gradient through attention
    (the reference backend is differentiable; an ``out`` that requires grad would be overwritten behind autograd's
    back). Host attribute reads only: no sync, nothing read under ``torch.no_grad()`` / ``torch.inference_mode()``
    (serving).

    Raises:
        NotImplementedError: grad mode is on and q, k_cache, v_cache or out requires grad (named).
    """
    if not torch.is_grad_enabled():
        return
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out))
    need = [n for n, t in named if isinstance(t, torch.Tensor) and t.requires_grad]
    if need:
        raise NotImplementedError(
            f"backend {backend!r} computes no gradients, but {', '.join(need)} require{'s' if len(need) == 1 else ''} "
            "grad with grad mode on: its output would leave the autograd graph (nothing would flow back through "
            "attention, silently). Call it under torch.no_grad() or torch.inference_mode(), or use "
            "backend='reference' (differentiable)")


def capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (host reads are not allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_attention_inputs(
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
    check_values: bool | None = None,
    allowed_dtypes=FLOAT_DTYPES,
    return_lse=False,
    max_seqlen_q=None,
    max_seqlen_k=None,
) -> CheckedInputs:
    """Validate an attention call against the contract (docs/ARCHITECTURE.md, "The attention contract").

    Returns:
        CheckedInputs with the per-sequence causal row counts ``num_causal_q`` [B] int32 (derived from
        ``causal`` on first use when given; ``causal`` itself is kept for kernels that read the flags) and
        ``seq_lens`` [B] int32 (derived from ``cu_seqlens_k`` in the contiguous form when not given).

    ``check_values``: see :func:`resolve_check_values` (None: unless capturing; the debug switch forces it).
    ``return_lse`` must be a bool, ``max_seqlen_q`` / ``max_seqlen_k`` host hints (:func:`check_length_hint`; a 0-d
    tensor hint is read with the value checks and must be >= 0 there).

    Raises:
        TypeError: a wrong Python or tensor type / dtype, or a tensor that is not dense (strided: a sparse layout).
        ValueError: a shape, device or value rule broken (tensors on the meta device included: they hold no
            values); the message names the argument and the rule.
    """
    check_values = resolve_check_values(check_values)
    check_flag("return_lse", return_lse)
    check_length_hint("max_seqlen_q", max_seqlen_q)
    check_length_hint("max_seqlen_k", max_seqlen_k)
    _need_tensor("q", q, 3)
    if q.dtype not in allowed_dtypes:
        raise TypeError(f"q must be one of {allowed_dtypes}, got {q.dtype}")
    check_has_data("q", q)
    total_q, num_heads, head_dim = q.shape
    paged = block_table is not None
    kdim = 4 if paged else 3
    form = "paged ([num_blocks, page_size, num_kv_heads, head_dim]) because block_table is given" if paged \
        else "contiguous ([total_k, num_kv_heads, head_dim]) because block_table is None"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need_tensor(name, t)
        if t.dim() != kdim:
            raise ValueError(f"{name} must be {form}; got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must equal q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in all but head_dim")
    num_kv_heads, kd = k_cache.shape[-2], k_cache.shape[-1]
    head_dim_v = v_cache.shape[-1]
    # the kernels take cu_seqlens_q / cu_seqlens_k offsets and page ids as int32: more rows or pages would wrap
    for name, n in (("q.shape[0] (total_q)", total_q),
                    ("k_cache.shape[0] (num_blocks)" if paged else "k_cache.shape[0] (total_k)", k_cache.shape[0])):
        if n > MAX_ROWS:
            raise ValueError(f"{name} = {n} exceeds MAX_ROWS = 2**31 - 1: row offsets and page ids are int32")
    if kd != head_dim:
        raise ValueError(f"k_cache head_dim {kd} must equal q head_dim {head_dim}")
    for name, n in (("num_heads (q.shape[1])", num_heads), ("head_dim (q.shape[2])", head_dim),
                    ("head_dim_v (v_cache.shape[-1])", head_dim_v)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}) for GQA")

    _need_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    _need_int("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device} but q is on {q.device}")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must have B+1 >= 1 entries")

    def _check_b(name, t, dtypes=INT_DTYPES):
        _need_tensor(name, t, 1)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have B={batch} entries (len(cu_seqlens_q) - 1), got {t.shape[0]}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")

    if paged:
        _need_tensor("block_table", block_table, 2)
        _need_int("block_table", block_table)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have B={batch} rows, got {block_table.shape[0]}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        if seq_lens is None:
            raise ValueError("seq_lens is required with a paged KV cache (block_table given)")
        if cu_seqlens_k is not None:
            raise ValueError("give block_table (paged KV) or cu_seqlens_k (contiguous KV), not both")
        _check_b("seq_lens", seq_lens)
        page_size = k_cache.shape[1]
        if page_size < 1:
            raise ValueError("page_size (k_cache.shape[1]) must be >= 1")
    else:
        page_size = None
        if cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k is required with a contiguous KV cache (block_table None)")
        _need_tensor("cu_seqlens_k", cu_seqlens_k, 1)
        _need_int("cu_seqlens_k", cu_seqlens_k)
        if cu_seqlens_k.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_k must have B+1={batch + 1} entries, got {cu_seqlens_k.shape[0]}")
        if cu_seqlens_k.device != q.device:
            raise ValueError(f"cu_seqlens_k is on {cu_seqlens_k.device} but q is on {q.device}")
        if seq_lens is None:
            seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        else:
            _check_b("seq_lens", seq_lens)

    if (causal is None) == (num_causal_q is None):
        raise ValueError("give exactly one of causal ([B] bool) or num_causal_q ([B] int32)")
    if causal is not None:
        _check_b("causal", causal, (torch.bool,))
        # num_causal_q is derived lazily (CheckedInputs.num_causal_q): backends that read the flags in their
        # kernel skip the two device ops
        ncq = None
    else:
        _check_b("num_causal_q", num_causal_q)
        ncq = num_causal_q.to(torch.int32)

    window_size = check_window(window_size, bidirectional_window)
    if scale is None:
        scale = head_dim ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"scale must be finite with |scale| <= {MAX_SCALE:g}, got an int of "
                         f"{scale.bit_length()} bits") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"|scale| must be <= MAX_SCALE = {MAX_SCALE:g} (fp32 scores (q.k) * scale would overflow "
                         f"for moderate q.k), got {scale:g}")

    if out is not None:
        _need_tensor("out", out)
        if tuple(out.shape) != (total_q, num_heads, head_dim_v):
            raise ValueError(f"out must have shape {(total_q, num_heads, head_dim_v)}, got {tuple(out.shape)}")
        if out.dtype != q.dtype:  # a dtype is a TypeError, as for k_cache / v_cache (it was a ValueError)
            raise TypeError(f"out dtype {out.dtype} must equal q dtype {q.dtype}")
        if out.device != q.device:
            raise ValueError(f"out is on {out.device} but q is on {q.device}")
        if self_overlapping(out):
            raise ValueError(f"out must not have elements sharing memory (e.g. an expand()ed view), got strides "
                             f"{out.stride()} for shape {tuple(out.shape)}")

    if check_values:
        for name, v in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            length_hint_value(name, v)  # a negative 0-d tensor (an int is refused above), as the paths reading it do
        cq = cu_seqlens_q.to(torch.int64).cpu()
        if cq[0] != 0:
            raise ValueError(f"cu_seqlens_q must start at 0, got {int(cq[0])}")
        if batch > 0 and bool((cq[1:] < cq[:-1]).any()):
            raise ValueError("cu_seqlens_q must be non-decreasing")
        if int(cq[-1]) != total_q:
            raise ValueError(f"cu_seqlens_q[-1] ({int(cq[-1])}) must equal q.shape[0] ({total_q})")
        ql = cq[1:] - cq[:-1]
        if not paged:  # cu_seqlens_k first: a bad one must not be reported as a seq_lens derived from it
            ck = cu_seqlens_k.to(torch.int64).cpu()
            if ck[0] != 0 or (batch > 0 and bool((ck[1:] < ck[:-1]).any())):
                raise ValueError("cu_seqlens_k must start at 0 and be non-decreasing")
            if int(ck[-1]) > k_cache.shape[0]:
                raise ValueError(f"cu_seqlens_k[-1] ({int(ck[-1])}) exceeds k rows ({k_cache.shape[0]})")
        sl = seq_lens.to(torch.int64).cpu()
        if bool((sl > MAX_SEQ_LEN).any()):
            b = int(torch.nonzero(sl > MAX_SEQ_LEN)[0])
            raise ValueError(f"seq_lens[{b}] = {int(sl[b])} exceeds MAX_SEQ_LEN = {MAX_SEQ_LEN} keys per sequence")
        if bool((sl < ql).any()):
            b = int(torch.nonzero(sl < ql)[0])
            raise ValueError(
                f"seq_lens[{b}] = {int(sl[b])} < query length {int(ql[b])}: seq_lens include the query tokens")
        if ncq is not None:  # (causal flags give 0 or q_len: in range by construction)
            # the caller's values, not the int32 copy: an int64 count beyond int32 would wrap into range there
            n = num_causal_q.to(torch.int64).cpu()
            if bool(((n < 0) | (n > ql)).any()):
                b = int(torch.nonzero((n < 0) | (n > ql))[0])
                raise ValueError(f"num_causal_q[{b}] = {int(n[b])} must be in [0, q_len={int(ql[b])}]")
        if paged:
            need = (sl + page_size - 1) // page_size
            if bool((need > block_table.shape[1]).any()):
                b = int(torch.nonzero(need > block_table.shape[1])[0])
                raise ValueError(
                    f"block_table is too short for seq_lens: sequence {b} needs {int(need[b])} blocks of "
                    f"page_size {page_size}, block_table has {block_table.shape[1]} columns")
            bt = block_table.to(torch.int64).cpu()
            cols = torch.arange(bt.shape[1])
            used = cols[None, :] < need[:, None]
            bad = used & ((bt < 0) | (bt >= k_cache.shape[0]))
            if bool(bad.any()):
                b, c = (int(x) for x in torch.nonzero(bad)[0])
                raise ValueError(
                    f"block_table[{b}, {c}] = {int(bt[b, c])} is out of range [0, num_blocks={k_cache.shape[0]})")
        elif not torch.equal(sl, ck[1:] - ck[:-1]):
                raise ValueError("seq_lens must equal cu_seqlens_k[1:] - cu_seqlens_k[:-1]")

    return CheckedInputs(
        batch_size=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        head_dim_v=head_dim_v, paged=paged, page_size=page_size,
        seq_lens=seq_lens.to(torch.int32), scale=scale, window_size=window_size, causal=causal, _num_causal_q=ncq,
        _cu_seqlens_q=cu_seqlens_q,
    )
