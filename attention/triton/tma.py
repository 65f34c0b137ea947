"""Host side of the Gluon kernels' TMA loads: which inputs they can read (eligibility), the box geometry, and the
cached 2-D TMA descriptors over the K / V caches.

Eligibility (:func:`gluon_ineligible` names the first rule an input breaks; ``IMPL="gluon"`` on an ineligible
input raises ``ValueError``, it never falls back silently):

* a CUDA device of compute capability 9.x, bf16 or fp16, ``head_dim == head_dim_v`` in :data:`GLUON_HEAD_DIMS`;
* ``scale > 0``, with the fp32 ``scale * log2(e)`` at least 2**-120 (:func:`positive_kernel_scale`);
* K / V rows addressable as one 2-D TMA tensor ``[rows, (num_kv_heads - 1) * head_stride + head_dim]``
  (``head_stride = stride(-2)``: a dense head dim, heads that do not overlap, 16-byte aligned rows and heads; head
  ``h`` is the column range ``[h * head_stride, h * head_stride + head_dim)``, so separate caches, ``head_stride ==
  head_dim``, and vLLM's FlashAttention layout, which packs a token's K and V of one head into one row of ``2 *
  head_dim`` (``kv_cache.transpose(1, 2).split(head_dim, -1)``), both qualify): paged caches with ``stride(0) ==
  page_size * stride(1)`` and either ``page_size % BLOCK_N == 0`` (one page holds whole key blocks) or a
  ``page_size`` that is a multiple of 8 dividing ``BLOCK_N`` (one box per page), or the contiguous varlen form.
"""
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..validate import LOG2E, MIN_RAW_WEIGHT_SCALE_LOG2

GLUON_HEAD_DIMS = (64, 128, 256, 512)
#: The least ``|scale| * LOG2E`` the kernels' raw-score paths take (2**-120;
#: :data:`..validate.MIN_RAW_WEIGHT_SCALE_LOG2` says why). Scales below it are scaled first.
MIN_RAW_MAX_QK_SCALE = MIN_RAW_WEIGHT_SCALE_LOG2


def positive_kernel_scale(scale: float) -> bool:
    """Whether the Gluon kernels may run ``scale`` (their only path): ``scale > 0`` with the fp32
    ``qk_scale = scale * LOG2E`` at least :data:`MIN_RAW_MAX_QK_SCALE` (2**-120), so that the row max of raw scores
    is the row max of scaled ones, a masked score's ``-inf`` stays ``-inf`` once scaled, and a raw difference
    ``s - m`` that overflows to ``-inf`` weighs what the key's exact weight rounds to (0). A positive scale below
    ``2**-126 / LOG2E`` (the least normal fp32) rounds to 0 in fp32 (``-inf * 0`` was NaN in every row with a masked
    key: scale 1e-300) or to a subnormal a flush-to-zero multiply takes for 0; one below
    ``MIN_RAW_MAX_QK_SCALE / LOG2E`` drops keys of weight up to 2**-4 (:data:`MIN_RAW_MAX_QK_SCALE`): such scales, 0
    and negative ones run the portable kernel."""
    return scale > 0 and normal_kernel_scale(scale)


def normal_kernel_scale(scale: float) -> bool:
    """Whether the portable kernel runs ``scale`` on its raw-score path (``RAW_MAX``): ``|scale| * LOG2E`` at least
    :data:`MIN_RAW_MAX_QK_SCALE` (2**-120, a normal fp32). The kernel negates the Q tile for a negative scale
    (exact) and takes ``|qk_scale|``, so the row max of its raw scores is the row max of the scaled ones, and weighs
    each key ``exp2((s - m) * |qk_scale|)``. Other scales (0, below the normal range, or so small that a raw
    difference ``s - m`` overflowing to ``-inf`` would drop a key of weight up to 2**-4) are scaled first
    (:func:`positive_kernel_scale` says why), where every scaled score is below 2^8 in magnitude."""
    return abs(scale) * LOG2E >= MIN_RAW_MAX_QK_SCALE


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def gluon_ineligible(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool,
                     page_size: int | None, head_dim_v: int, scale: float, block_n: int) -> str | None:
    """Why this input cannot run the Gluon kernel (the first rule it breaks), or None when it can.

    Host attributes only (device capability, dtypes, shapes, strides, alignment); no device sync.
    """
    if q.device.type != "cuda":
        return f"q is on {q.device}, the Gluon kernel needs a CUDA device"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        cc = "".join(map(str, torch.cuda.get_device_capability(q.device)))
        return f"the Gluon kernel is written for sm_90 (Hopper); this device is sm_{cc}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon kernel takes bf16/fp16, got {q.dtype}"
    D = q.shape[-1]
    if D != head_dim_v or D not in GLUON_HEAD_DIMS:
        return f"the Gluon kernel needs head_dim == head_dim_v in {GLUON_HEAD_DIMS}, got {D}/{head_dim_v}"
    if not positive_kernel_scale(scale):
        return f"the Gluon kernel needs scale * log2(e) >= 2**-120 (MIN_RAW_MAX_QK_SCALE), got scale {scale}"
    return layout_ineligible(k_cache, v_cache, paged=paged, page_size=page_size, block_n=block_n)


def layout_ineligible(k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool, page_size: int | None,
                      block_n: int) -> str | None:
    """The TMA rules of :func:`gluon_ineligible` on the caches' shapes and strides (any device)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        hkv, d = t.shape[-2], t.shape[-1]
        head_stride, row_stride, esize = t.stride(-2), t.stride(-3), t.element_size()
        if t.stride(-1) != 1 or (hkv > 1 and head_stride < d) or (head_stride * esize) % 16:
            return (f"{name} must have a contiguous head dim and 16-byte aligned, non-overlapping KV heads in a token row "
                    f"for TMA, got strides {t.stride()}")
        if paged and t.stride(0) != page_size * row_stride:
            return f"{name}: pages must be evenly strided rows (stride(0) == page_size * stride(1)) for TMA"
        if row_stride < row_width(t) or (row_stride * esize) % 16 or t.data_ptr() % 16:
            return f"{name} rows must be 16-byte aligned and not overlap for TMA, got strides {t.stride()}"
    if paged and page_size % block_n and (block_n % page_size or page_size % 8):
        return (f"page_size {page_size} must hold whole key blocks of BLOCK_N = {block_n}, or be a multiple of 8 "
                f"that divides BLOCK_N (a block of several pages, one TMA box each)")
    return None


def row_width(t: torch.Tensor) -> int:
    """Columns of a token row of a K / V cache that its KV heads span: ``(num_kv_heads - 1) * stride(-2) +
    head_dim`` (the TMA tensor's inner dimension; :func:`layout_ineligible` checks the rest)."""
    return (t.shape[-2] - 1) * t.stride(-2) + t.shape[-1]


def tma_box_rows(paged: bool, page_size: int | None, block_n: int) -> int:
    """Rows of one K / V TMA box: ``BLOCK_N``, or the page when a key block spans several pages."""
    return min(block_n, page_size) if paged else block_n


class _CacheAddress:
    """What a TMA descriptor and Triton's launcher read of a cache tensor (``dtype``, ``data_ptr()``), without
    holding the tensor: a cached descriptor must not keep a freed cache alive."""

    __slots__ = ("dtype", "_ptr")

    def __init__(self, t: torch.Tensor):
        self.dtype, self._ptr = t.dtype, t.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


_DESCRIPTORS: dict = {}
_MAX_DESCRIPTORS = 64


def make_kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, box_rows: int, k_chunks: int = 1,
                        v_chunks: int = 1):
    """2-D TMA descriptors ``[rows, row_width]`` (:func:`row_width`: KV head ``h`` at column ``h * stride(-2)``) over
    the K and V caches, boxes of ``box_rows`` rows
    (:func:`tma_box_rows`) and ``head_dim // k_chunks`` / ``head_dim_v // v_chunks`` columns (the wide and roles
    kernels load head-dim chunks; a box is at most 256 columns wide).

    Cached by (address, shape, strides, dtype, device, box_rows, chunks): a serving loop reuses the same caches
    every step, and building descriptors per call is host time on every launch. An entry depends only on its key
    (it holds no tensor), so a new tensor at a freed address with the same key gets a correct descriptor.

    Raises:
        ValueError: a head dim that does not split into ``chunks`` boxes of <= 256 columns.
    """
    key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in (k_cache, v_cache)) + (
        box_rows, k_chunks, v_chunks)
    descs = _DESCRIPTORS.get(key)
    if descs is None:
        descs = []
        for t, chunks in ((k_cache, k_chunks), (v_cache, v_chunks)):
            d = t.shape[-1]
            if d % chunks or d // chunks > 256:
                raise ValueError(f"head dim {d} must split into {chunks} TMA box columns of <= 256")
            rows = t.shape[0] * t.shape[1] if t.dim() == 4 else t.shape[0]
            box = [box_rows, d // chunks]
            layout = gl.NVMMASharedLayout.get_default_for(box, _gl_dtype(t.dtype))
            descs.append(TensorDescriptor(_CacheAddress(t), [rows, row_width(t)], [t.stride(-3), 1], box, layout))
        if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
            _DESCRIPTORS.clear()
        descs = _DESCRIPTORS[key] = tuple(descs)
    return descs



__all__ = ["GLUON_HEAD_DIMS", "gluon_ineligible", "layout_ineligible", "make_kv_descriptors", "row_width",
           "tma_box_rows"]
