"""The split-KV merge every backend can share: a Triton kernel that merges per-split partial outputs exactly
(flash-decoding's LSE merge: Dao et al., 2023, "Flash-Decoding for long-context inference"), and its host launcher
:func:`merge_split_partials`.

A split's partial is its normalised output ``o_s`` and its softmax statistics, in one of two formats:

* **LSE** (:func:`merge_split_partials` without ``scale_log2``; the cute backend's FA4-format partials): the
  split's natural-log LSE ``lse_s``, ``[num_splits, num_heads, total_q]`` float32.
  ``out = sum_s w_s o_s / sum_s w_s`` with ``w_s = exp(lse_s - max_s lse_s)``, and ``lse = max + log(sum_s w_s)``.
  A fp32 LSE near ``|lse| ~ 1000`` carries an ulp of ~6e-5, which the weights inherit (docs/ARCHITECTURE.md
  section 4, "Known precision limit of split-KV").
* **Raw max and sum** (with ``scale_log2``, the kernel's ``RAW_STATS``; the triton backend's kernels): the
  split's running max ``m_s`` in the units its kernel keeps it (raw scores ``q . k``, or scores already scaled to
  log2 units) and its sum ``l_s = sum_keys exp2((s - m_s) * c)`` relative to it,
  ``[num_splits, 2, num_heads, total_q]`` float32 (plane 0 ``m``, plane 1 ``l``), with ``c`` (``scale_log2``) the
  kernel's log2 scale of that max. ``M = max_s m_s``, ``w_s = l_s * exp2((m_s - M) * c)``,
  ``out = sum_s w_s o_s / sum_s w_s`` and ``lse = (M * c + log2(sum_s w_s)) * ln 2``: the flash-decoding merge on
  the online softmax's own ``(m, l)`` (FlashAttention-2's rescaling, Dao, 2023, arXiv:2307.08691, across splits
  instead of key blocks). ``m_s`` is an exact fp32 score and ``m_s - M`` exact (Sterbenz) or one rounding relative
  to the difference, which only far splits, of tiny weight, see: the weights carry no ulp of a large LSE, and the
  merged LSE is computed as a one-split launch's is. A subtraction, then a multiply, into ``exp2`` (no FMA against
  a rounded max: the kernels' rule, docs/ARCHITECTURE.md section 4).

Every split's partial is multiplied by its weight, a weight of 0 included. A split whose weight underflows to 0
therefore still passes on a non-finite entry, since ``0 * NaN`` and ``0 * Inf`` are NaN. That is what the dense
reference gives for a key the row sees whose softmax weight underflows (docs/ARCHITECTURE.md section 4: a
non-finite V entry of a key the row sees reaches its column as IEEE ``p * v`` gives it), and what one split gives
where the key's block enters P V unscanned (a block the NaN-safe V scan cleaned gets the raw entry back from the
fix-up, which gives +-Inf for an Inf at p = 0: the kernels' documented exception). FA4's combine kernel skips
splits whose weight is 0, so it drops such an entry (docs/tuning.md 2.33). Empty splits and rows with no key in a
split (LSE ``-inf``; raw stats: ``m = -inf``, ``l = 0``) must have partial 0: the backends write 0 there with
NaN-safe V on (the split's blocks are all masked for such a row, so cleaned); their weight is 0; a row whose splits
are all empty gets 0 and LSE ``-inf``.

Used by the triton backend (:mod:`blockdiff.attention.triton`, its plans; raw stats) and by the cute backend's
``split_merge="triton"`` (LSE; what its ``"auto"`` takes where the cluster merge does not, docs/tuning.md 2.35).
Backends never import one another; both import this module, which imports no backend.
"""
import contextlib

import torch
import triton
import triton.language as tl

from .env import triton_interpret
from .validate import check_has_data, self_overlapping, share_elements

_FP32 = torch.finfo(torch.float32)

__all__ = ["cast", "interpreting", "merge_constexprs", "launch_merge", "merge_split_partials"]


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even; the interpreter truncates fp32 -> bf16, so round by hand."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dtype)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


@triton.jit(do_not_specialize=["total_q", "n_rows"])
def _merge_kernel(OPART, STATS, O, LSE, total_q, num_heads, n_rows, stride_ot, stride_oh, scale_log2,
                  NUM_SPLITS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                  STORE_LSE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
                  RAW_STATS: tl.constexpr = False):
    """Exact merge of split-KV partials: out = sum_s w_s o_s / sum_s w_s (the module docstring's two formats).

    ``STATS``: with ``RAW_STATS``, ``[NUM_SPLITS, 2, num_heads, total_q]`` (each split's max ``m_s`` in the units
    whose log2 scale is ``scale_log2``, then its sum ``l_s``): ``w_s = l_s * exp2((m_s - M) * scale_log2)``, M the
    max over splits; else ``[NUM_SPLITS, num_heads, total_q]`` natural-log LSEs: ``w_s = exp(lse_s - max lse)``
    (``scale_log2`` unused).

    One program merges ``BLOCK_R`` (token, head) rows (row = token * num_heads + head, OPART's order): pass 1 takes
    the max over the splits, pass 2 accumulates the weighted partials with ``[BLOCK_R, BLOCK_DV]`` loads (one
    program per row was slower; docs/tuning.md).
    """
    if PDL:
        # launched with programmatic dependent launch (sm_90+): the grid is dispatched while the attention kernel
        # finishes; wait until its writes are visible
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    tq = r // num_heads
    h = r % num_heads
    lse_off = h * total_q + tq
    plane = n_rows.to(tl.int64)  # = num_heads * total_q: one split's rows (int64: splits x rows may pass 2^31)
    STEP: tl.constexpr = 2 if RAW_STATS else 1  # a split's planes: (m, l), or its LSE
    mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        mx = tl.maximum(mx, tl.load(STATS + (s * STEP) * plane + lse_off, mask=rmask, other=float("-inf")))
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    offs = tl.arange(0, BLOCK_DV)
    dmask = offs < DV
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        st_s = tl.load(STATS + (s * STEP) * plane + lse_off, mask=rmask, other=float("-inf"))
        if RAW_STATS:
            l_s = tl.load(STATS + (s * STEP + 1) * plane + lse_off, mask=rmask, other=0.0)
            # a subtraction, then a multiply (no FMA against a rounded max); 0 for empty splits (m -inf, l 0)
            w = l_s * tl.math.exp2((st_s - mx_use) * scale_log2)
        else:
            w = tl.exp(st_s - mx_use)  # 0 for empty splits
        o_s = tl.load(OPART + (s * plane + r)[:, None] * DV + offs[None, :], mask=rmask[:, None] & dmask[None, :],
                      other=0.0)
        den += w
        acc += o_s * w[:, None]
    res = acc * (1.0 / tl.where(den == 0.0, 1.0, den))[:, None]
    tl.store(O + tq[:, None] * stride_ot + h[:, None] * stride_oh + offs[None, :],
             cast(res, O.dtype.element_ty, INTERPRET), mask=rmask[:, None] & dmask[None, :])
    if STORE_LSE:
        if RAW_STATS:
            lse = (mx_use * scale_log2 + tl.math.log2(tl.where(den == 0.0, 1.0, den))) * 0.6931471805599453
        else:
            lse = mx_use + tl.log(den)
        tl.store(LSE + lse_off, tl.where(den == 0.0, float("-inf"), lse), mask=rmask)


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET``, read as Triton reads it:
    :func:`blockdiff.attention.env.triton_interpret`; the CPU tests). The triton backend re-exports it
    (``blockdiff.attention.triton.config.interpreting``)."""
    return triton_interpret()


def merge_constexprs(num_splits: int, head_dim_v: int, store_lse: bool, pdl: bool, interpret: bool,
                     raw_stats: bool = False) -> dict:
    """The merge kernel's constexprs and launch options, with its ``BLOCK_R`` rows per program: <= 4096 fp32
    partial elements per program per split (moved from the triton backend's config; the value dimension's power
    of two is computed here, since this module imports no backend). ``raw_stats``: the partials' statistics are
    each split's raw max and sum (the module docstring), else its LSE."""
    bdv = max(16, 1 << max(0, (int(head_dim_v) - 1).bit_length()))
    block_r = max(1, min(64, 4096 // bdv))
    return dict(NUM_SPLITS=num_splits, DV=head_dim_v, BLOCK_DV=bdv, BLOCK_R=block_r, STORE_LSE=store_lse,
                INTERPRET=interpret, PDL=pdl, RAW_STATS=bool(raw_stats), num_warps=4, launch_pdl=pdl)


def merge_split_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor | None = None, *, pdl: bool = False,
                         scale_log2: float | None = None) -> None:
    """Merge split-KV partials into ``out`` (and ``lse``) in one launch, on ``out``'s device and current stream.

    Args:
        o_part: ``[num_splits, total_q, num_heads, head_dim_v]`` float32, contiguous: each split's normalised
            partial output (0 for a row with no key in the split).
        lse_part: the splits' softmax statistics, float32, contiguous. Without ``scale_log2``
            ``[num_splits, num_heads, total_q]``: each split's natural-log LSE (``-inf`` for a row with no key in
            the split). With it ``[num_splits, 2, num_heads, total_q]``: each split's running max ``m`` (plane 0;
            ``-inf`` for a row with no key in the split) and its sum ``l = sum exp2((s - m) * scale_log2)``
            (plane 1; 0 there): the raw-stats format of the module docstring.
        out: ``[total_q, num_heads, head_dim_v]`` bf16 / fp16 / fp32, its last dimension contiguous and no two
            elements sharing memory, none shared with the partials or ``lse``; written in full.
        lse: None, or ``[num_heads, total_q]`` float32, contiguous, sharing no memory with the partials: written with
            the merged LSE.
        pdl: launch with programmatic dependent launch (sm_90+ only, never under the interpreter; the kernel then
            waits with griddepcontrol for the previous kernel's writes). Off by default.
        scale_log2: None (LSE partials), or a positive float in fp32's normal range: the log2 scale of the
            splits' ``m`` (a score ``s`` weighs ``exp2((s - m) * scale_log2)`` in its split's ``l``); the merged LSE
            is in natural log either way.

    The launch goes to ``out``'s CUDA device (its current stream), whatever the current device is.

    Raises:
        TypeError: a tensor argument that is not a (dense, strided) tensor, a dtype not allowed, ``pdl`` not a
            bool, or ``scale_log2`` not None nor a real number (a bool included).
        ValueError: shapes that disagree, a non-contiguous partial or LSE, ``out``'s last dimension not
            contiguous or an ``out`` whose elements share memory (a stride 0, or strides that make rows overlap:
            :func:`blockdiff.attention.validate.self_overlapping`), ``out`` or ``lse`` sharing memory with
            ``o_part``, ``lse_part`` or each other (:func:`blockdiff.attention.validate.share_elements`), tensors on
            different devices or on the meta device, ``pdl`` under the Triton interpreter, or ``scale_log2`` outside
            fp32's positive normal range (0, negative, NaN, inf).
    """
    for name, t in (("o_part", o_part), ("lse_part", lse_part), ("out", out)) + ((("lse", lse),) if lse is not None
                                                                               else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    for name, t in (("o_part", o_part), ("lse_part", lse_part)) + ((("lse", lse),) if lse is not None else ()):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out must be bfloat16, float16 or float32, got {out.dtype}")
    if not isinstance(pdl, bool):
        raise TypeError(f"pdl must be a bool, got {type(pdl).__name__}")
    if scale_log2 is not None:
        if isinstance(scale_log2, bool) or not isinstance(scale_log2, (int, float)):
            raise TypeError(f"scale_log2 must be None or a real number, got {type(scale_log2).__name__}")
        if not _FP32.tiny <= scale_log2 <= _FP32.max:  # (NaN fails too) a normal, positive fp32: never 0 in
            # the kernel, where an empty split's (-inf - M) * 0 would be NaN
            raise ValueError(f"scale_log2 must be a positive normal fp32 value (2**-126 to ~3.4e38), got {scale_log2}")
    if o_part.dim() != 4 or out.dim() != 3:
        raise ValueError(f"o_part must be [num_splits, total_q, num_heads, head_dim_v] and out [total_q, num_heads, "
                         f"head_dim_v], got {tuple(o_part.shape)} and {tuple(out.shape)}")
    num_splits, total_q, num_heads, dv = o_part.shape
    if tuple(out.shape) != (total_q, num_heads, dv):
        raise ValueError(f"out must be {(total_q, num_heads, dv)} (o_part's last three dims), got {tuple(out.shape)}")
    stats_shape = (num_splits, num_heads, total_q) if scale_log2 is None else (num_splits, 2, num_heads, total_q)
    if tuple(lse_part.shape) != stats_shape:
        raise ValueError(f"lse_part must be {stats_shape}, got {tuple(lse_part.shape)}")
    if lse is not None and tuple(lse.shape) != (num_heads, total_q):
        raise ValueError(f"lse must be {(num_heads, total_q)}, got {tuple(lse.shape)}")
    if num_splits < 1:
        raise ValueError(f"o_part must hold at least one split, got {num_splits}")
    if out.stride(-1) != 1:
        raise ValueError("out's last dimension must be contiguous (stride 1)")
    if self_overlapping(out):  # (a stride 0, or strides that interleave: rows written over each other)
        raise ValueError(f"out's elements must not share memory (an expanded tensor, or overlapping strides), got "
                         f"strides {out.stride()} for shape {tuple(out.shape)}")
    devices = {t.device for t in (o_part, lse_part, out, lse) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"o_part, lse_part, out and lse must be on one device, got {sorted(map(str, devices))}")
    check_has_data("o_part", o_part)  # (one device: all on meta, whose data pointers, 0, read as shared memory)
    # a program writes its rows while later programs still read theirs: an output sharing an element with an input
    # (or with the other output) is overwritten or read back stale (wrong results, silently, before)
    outputs = (("out", out),) + ((("lse", lse),) if lse is not None else ())
    for i, (oname, o) in enumerate(outputs):
        for name, t in (("o_part", o_part), ("lse_part", lse_part)) + outputs[:i]:
            if share_elements(o, t):
                raise ValueError(f"{oname} must not share memory with {name} (the merge reads every split's rows "
                                 "while it writes)")
    if pdl and interpreting():
        raise ValueError("pdl=True needs a GPU launch (sm_90+), not the Triton interpreter")
    launch_merge(o_part, lse_part, out, lse, pdl=pdl, scale_log2=scale_log2)


def launch_merge(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None = None,
                 *, pdl: bool = False, scale_log2: float | None = None) -> None:
    """:func:`merge_split_partials` without its argument checks, for a caller that allocated the workspace itself
    with this module's layout (the cute backend, on every split call, LSE partials); same arguments and
    effect."""
    num_splits, total_q, num_heads, dv = o_part.shape
    n_rows = total_q * num_heads
    if n_rows == 0:
        return
    raw = scale_log2 is not None
    meta = merge_constexprs(num_splits, dv, lse is not None, pdl, interpreting(), raw_stats=raw)
    with torch.cuda.device(out.device) if out.device.type == "cuda" else contextlib.nullcontext():
        _merge_kernel[(triton.cdiv(n_rows, meta["BLOCK_R"]),)](
            o_part, lse_part, out, lse if lse is not None else lse_part, total_q, num_heads, n_rows,
            out.stride(0), out.stride(1), float(scale_log2) if raw else 1.0, **meta)
