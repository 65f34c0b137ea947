"""Launch plans of the Triton backend: everything a call's launch needs that follows from its host-side key
(shapes, strides, dtypes, devices, host scalars, config), computed once per key by :func:`make_plan`, and the
launch itself, :func:`run_plan`, which reads only per-call tensors and so stays free of host syncs.

:func:`plan_key` is the key; :mod:`.interface` keeps the plans of calls with ``check_values=False`` by it, so
later calls with the same key skip validation and planning and launch the compiled kernels directly
(:class:`Launch`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton

from ..masks import MAX_SEQ_LEN
from ..validate import length_hint_value, memory_overlaps
from .common import _merge_kernel
from .config import (CallShape, KernelShape, TritonConfig, choose_launch_config, get_kernel, interpreting,
                     kernel_constexprs, kernel_variant, merge_constexprs, next_pow2, split_stats_scale, tma_boxes)
from .gluon import KERNELS as GLUON_KERNELS
from .portable import _attn_fwd_kernel
from .tma import LOG2E, gluon_ineligible, make_kv_descriptors, normal_kernel_scale

_DEVICE_PROPS: dict = {}  # per CUDA device index


def _device_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA device, cached per index (host only, no sync)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_PROPS:
        _DEVICE_PROPS[idx] = torch.cuda.get_device_properties(idx)
    return _DEVICE_PROPS[idx]


def _capability(device: torch.device) -> tuple:
    """(major, minor) compute capability of a device ((0, 0) off CUDA)."""
    if device.type != "cuda":
        return (0, 0)
    p = _device_props(device)
    return (p.major, p.minor)


def merge_pdl(device: torch.device, enabled: bool) -> bool:
    """Whether the split-KV merge launches with programmatic dependent launch and waits with griddepcontrol:
    ``enabled`` (the caller's switch), on sm_90+, never interpreted."""
    return bool(enabled) and not interpreting() and _capability(device)[0] >= 9


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200; only the split heuristic uses it
    return _device_props(device).multi_processor_count


def _tensor_key(t):
    """What a plan may depend on of a tensor argument: shape, strides, dtype, device and whether its address is
    16-byte aligned (Triton specialises pointer arguments on that); None for None. Raises for a non-tensor."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0



#: The largest element offset the portable kernel's int32 K / V tile offsets hold.
INT32_MAX = 2 ** 31 - 1


def wide_kv_offsets(row_strides, block_n: int, width: int) -> bool:
    """Whether the portable kernel needs int64 K / V tile offsets: its tiles add ``offs_n * row_stride + column``
    (``offs_n < block_n``, columns below ``width``: the padded head dim, or V's slices) to an int64 base in int32, so
    a cache row stride (``stride(1)`` of pages, ``stride(0)`` of contiguous rows) with ``(block_n - 1) * stride +
    width - 1`` past :data:`INT32_MAX` wrapped into an out-of-bounds read (a page-major storage viewed as
    ``[num_blocks, page_size, ...]``: a row stride of ``num_blocks * num_kv_heads * head_dim``). Host ints only."""
    return any((block_n - 1) * abs(st) + width - 1 > INT32_MAX for st in row_strides)


def plan_key(q, k_cache, v_cache, calls, window_size, bidirectional_window, scale, out, return_lse, max_seqlen_k,
             config, merge_pdl: bool):
    """The key of a call's launch plan, or None (then the call takes the full path, which raises for bad input).

    Everything the plan is computed from: the tensor arguments' :func:`_tensor_key`, the host scalars with their
    types (``True`` and ``1`` differ; ``max_seqlen_k`` must be a Python int), the config items, whether ``out``
    overlaps an input (the kernel then writes a private buffer), the ``merge_pdl`` switch and the interpreter.
    Data pointers are not in it (beyond their alignment): they change every call and only the kernels read them.
    ``max_seqlen_k`` is: a caller passing each step's actual maximum gets one plan per step (reused by the
    step's layers), a static capacity one plan in all.
    """
    if max_seqlen_k is not None and type(max_seqlen_k) is not int:
        return None  # e.g. a 0-d tensor, whose value may change in place: no plan (the full path reads it)
    try:
        aliased = out is not None and any(memory_overlaps(out, t) for t in (q, k_cache, v_cache))
        cfg = None if config is None else tuple(sorted((k, type(v), v) for k, v in config.items()))
        key = (tuple(_tensor_key(t) for t in (q, k_cache, v_cache, out) + tuple(calls)),
               type(window_size), window_size, type(bidirectional_window), bidirectional_window, type(scale), scale,
               type(return_lse), return_lse, type(max_seqlen_k), max_seqlen_k, type(config), cfg, aliased,
               bool(merge_pdl), interpreting())
        hash(key)
        return key
    except Exception:  # not a tensor / dict, unhashable values, ...: no plan
        return None


class Launch:
    """One kernel launch of a plan: the JIT function, its grid and its keyword arguments (constexprs and launch
    options). The first launch goes through Triton's JIT (compiling once); later ones call the compiled kernel
    with the constexpr values appended in parameter order (the launcher skips them), which is what the JIT does
    after binding the arguments, without re-binding them. Not under the interpreter (it has no compiled kernel).
    What the JIT does per launch and this skips: its argument specialisation (every integer argument and pointer
    alignment is fixed by the plan key), its check that the kernel's global variables did not change, its
    pre-run hooks and debug / instrumentation knobs (read at the first launch), and re-selecting the binary for
    the current device (the plan key holds q's device; the compiled kernel is loaded on the device current at the
    first launch, as the JIT would for a call from that device).
    """

    __slots__ = ("fn", "grid", "kwargs", "compiled", "consts")

    def __init__(self, fn, grid, kwargs):
        # (x, y, z): a compiled kernel's launcher reads all three
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.compiled = self.consts = None

    def __call__(self, *args):
        if self.compiled is not None:
            self.compiled[self.grid](*args, *self.consts)
            return self.compiled
        handle = self.fn[self.grid](*args, **self.kwargs)
        if not interpreting() and hasattr(handle, "packed_metadata"):
            consts = []
            for p in self.fn.params[len(args):]:
                if p.name in self.kwargs:
                    consts.append(self.kwargs[p.name])
                elif p.default is not inspect.Parameter.empty:
                    consts.append(p.default)
                else:
                    return handle
            self.compiled, self.consts = handle, tuple(consts)
        return handle


@dataclass
class Plan:
    """The host-side result of planning one call (see :func:`plan_key`)."""

    total_q: int
    num_heads: int
    head_dim_v: int
    empty: bool  # no query token or no sequence: nothing to launch
    return_lse: bool
    private_dst: bool = False  # the kernel writes a private buffer, copied into ``out``
    paged: bool = False
    ncq_flags: bool = True  # the kernel reads the causal flags (else num_causal_q)
    impl: str = "triton"
    cfg: TritonConfig | None = None
    num_splits: int = 1
    grid: tuple = ()
    descriptors: tuple | None = None  # Gluon: (box rows, K chunks, V chunks) of the TMA descriptors
    tail: tuple = ()  # the main kernel's host-int arguments after the tensors
    # Gluon with NAN_SAFE_V: after ``tail`` and the V cache, its TMA view's row stride and rows (empty: the switch
    # off, the three arguments None)
    v_tail: tuple = ()
    main: Launch | None = None
    merge: Launch | None = None
    merge_tail: tuple = ()



def make_plan(q, k_cache, v_cache, info, block_table, window_size, bidirectional_window, out, return_lse,
              max_seqlen_k, config, merge_pdl_enabled: bool) -> Plan:
    """Plan a validated call (``info``: :func:`blockdiff.attention.validate.check_attention_inputs`'s result):
    config, kernel (portable or Gluon) and split count (:func:`.config.choose_launch_config`), grid, host-int
    arguments and the launches. ``merge_pdl_enabled``: launch the split-KV merge with PDL where it compiles
    (:func:`merge_pdl`).

    Raises:
        TypeError: ``config`` not a dict or None.
        ValueError: a bad ``config``, an input the chosen kernel cannot take, a non-unit last-dim stride, or a
            negative ``max_seqlen_k`` (a 0-d tensor, read here).
    """
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got {t.stride()}")
    total_q, H, D = q.shape
    Hkv, DV = info.num_kv_heads, info.head_dim_v
    B = info.batch_size
    group = H // Hkv
    # an out that overlaps an input (e.g. out=q) would be overwritten while other programs still read it (V
    # head-dim slices re-read the Q tile): write a private buffer and copy back (host pointer math, no sync)
    private = out is not None and (not (out.numel() == 0 or out.stride(-1) == 1)
                                   or any(memory_overlaps(out, t) for t in (q, k_cache, v_cache)))
    plan = Plan(total_q=total_q, num_heads=H, head_dim_v=DV, empty=total_q == 0 or B == 0, return_lse=return_lse,
                private_dst=private, paged=info.paged, ncq_flags=info.causal is not None)
    if plan.empty:
        return plan

    # the effective window (masks.check_window): None for None and for any W >= WINDOW_NO_BOUND (no bound), so the
    # kernels' int32 q_abs + W cannot overflow
    window_size = info.window_size
    has_window = window_size is not None
    prefix = bidirectional_window == "prefix"
    kern = get_kernel(D, DV, group, q.dtype, info.paged, info.page_size, has_window, prefix)
    if max_seqlen_k is not None:
        kcap = length_hint_value("max_seqlen_k", max_seqlen_k)  # (a 0-d tensor is read here, checked like an int)
    elif info.paged:
        kcap = block_table.shape[1] * info.page_size
    else:
        kcap = k_cache.shape[0]
    call = CallShape(total_q=total_q, num_seqs=B, num_kv_heads=Hkv, key_capacity=kcap, num_sms=_num_sms(q.device),
                     itemsize=q.element_size())

    def why_not_gluon(block_n: int) -> str | None:  # the first Gluon / TMA rule this input breaks (host only)
        return gluon_ineligible(q, k_cache, v_cache, paged=info.paged, page_size=info.page_size, head_dim_v=DV,
                                scale=info.scale, block_n=block_n)

    cfg, ns = choose_launch_config(kern, config, call, why_not_gluon)
    BQ = cfg.BLOCK_M // next_pow2(group)
    n_dv = -(-max(16, next_pow2(DV)) // cfg.BLOCK_DV)
    n_tiles = total_q // BQ + B

    # strides of what the kernel writes: out, or the private (contiguous) buffer
    st_o = (H * DV, DV) if private or out is None else (out.stride(0), out.stride(1))
    # block_table rows by stride(0), columns densely (a strided view gets a dense copy per call, run_plan)
    if info.paged:
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
        stride_vb, stride_vp, stride_vh = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
        stride_bt = block_table.stride(0) if block_table.stride(1) == 1 else block_table.shape[1]
    else:
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), 0, k_cache.stride(1)
        stride_vb, stride_vp, stride_vh = v_cache.stride(0), 0, v_cache.stride(1)
        stride_bt = 0
    W = window_size if has_window else 0
    qk_scale = info.scale * LOG2E
    # 16-ary tile -> sequence search: ceil(bits(B) / 4) steps, so batches of 1..15 (16..255, ...) sequences
    # share one compiled kernel
    search_steps = -(-max(1, int(B).bit_length()) // 4)
    grid = (n_tiles, Hkv * n_dv, ns)
    plan.impl, plan.cfg, plan.num_splits, plan.grid = cfg.IMPL, cfg, ns, grid
    # (a scale whose fp32 |qk_scale| is below 2**-120 runs the general path: tma.normal_kernel_scale)
    shape = KernelShape(group=group, head_dim=D, head_dim_v=DV, dtype=q.dtype, paged=info.paged,
                        page_size=info.page_size, has_window=has_window, prefix=prefix, causal_flags=plan.ncq_flags,
                        split=ns > 1, store_lse=return_lse, search_steps=search_steps,
                        scale_normal=normal_kernel_scale(info.scale), scale_negative=info.scale < 0,
                        interpret=interpreting(),
                        k_head_stride=k_cache.stride(-2), v_head_stride=v_cache.stride(-2),
                        wide_kv_offsets=wide_kv_offsets(
                            (stride_kp, stride_vp) if info.paged else (stride_kb, stride_vb), cfg.BLOCK_N,
                            max(max(16, next_pow2(D)), n_dv * cfg.BLOCK_DV)))
    consts = kernel_constexprs(cfg, shape)
    common_tail = (total_q, H, B, n_tiles, W, qk_scale, ns)
    variant = kernel_variant(cfg, DV)
    if variant == "portable":
        # the portable kernel's metadata guards: the caches' leading extent (pages, or rows) and the keys a
        # sequence may have (the block table's capacity, <= MAX_SEQ_LEN; 0 without pages)
        kv_rows = k_cache.shape[0]
        if info.paged:
            kv_cap = min(block_table.shape[1] * info.page_size, MAX_SEQ_LEN) if kv_rows else 0
        else:
            kv_cap = MAX_SEQ_LEN
        plan.tail = (q.stride(0), q.stride(1), stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                     st_o[0], st_o[1], stride_bt) + common_tail + (kv_rows, kv_cap)
        plan.main = Launch(_attn_fwd_kernel, grid, consts)
    else:  # the Gluon kernels read K / V through TMA descriptors (made per call from the cached boxes)
        plan.descriptors = tma_boxes(cfg, shape)
        plan.tail = (q.stride(0), q.stride(1), st_o[0], st_o[1], stride_bt) + common_tail
        if cfg.NAN_SAFE_V:
            # and V once more, in a tile's cold NaN / Inf fix-up only (gluon._nonfinite_fixup), as the descriptor's
            # view (tma.make_kv_descriptors: token rows, KV head h at column h * v_cache.stride(-2), the kernel's
            # VS): its row stride and rows
            plan.v_tail = (v_cache.stride(-3), v_cache.shape[0] * v_cache.shape[1] if info.paged
                           else v_cache.shape[0])
        plan.main = Launch(GLUON_KERNELS[variant], grid, consts)
    if ns > 1:
        # the splits store their raw max and sum (not an LSE: split_merge's raw-stats format)
        merge = merge_constexprs(ns, DV, return_lse, merge_pdl(q.device, merge_pdl_enabled), interpreting(),
                                 raw_stats=True)
        n_rows = total_q * H
        plan.merge_tail = (total_q, H, n_rows, st_o[0], st_o[1], split_stats_scale(shape, qk_scale))
        plan.merge = Launch(_merge_kernel, (triton.cdiv(n_rows, merge["BLOCK_R"]),), merge)
    return plan


def run_plan(plan: Plan, q, k_cache, v_cache, calls, out, last_launch: dict, seq_lens=None, causal_rows=None):
    """Launch a planned call on this call's tensors (allocations and dtype / layout conversions of the metadata
    are per call: device ops without a host sync). ``calls``: (cu_seqlens_q, seq_lens, causal, num_causal_q,
    block_table, cu_seqlens_k) as passed; ``seq_lens`` / ``causal_rows``: their validated int32 forms, if any.
    ``last_launch`` is updated with what ran (kernel handle, num_splits, grid, config as a dict, impl); an empty
    call (no query rows) launches nothing and leaves every field None, never the previous call's record.

    Returns:
        ``out`` or ``(out, lse)``.
    """
    cu_seqlens_q, seq_lens_arg, causal, num_causal_q, block_table, cu_seqlens_k = calls
    seq_lens = seq_lens_arg if seq_lens is None else seq_lens
    num_causal_q = num_causal_q if causal_rows is None else causal_rows
    if out is None:
        out = torch.empty(plan.total_q, plan.num_heads, plan.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.num_heads, plan.total_q, dtype=torch.float32, device=q.device) if plan.return_lse \
        else None
    if plan.empty:
        last_launch.clear()
        last_launch.update(kernel=None, num_splits=None, grid=None, config=None, impl=None)
        return (out, lse) if plan.return_lse else out
    dst = torch.empty_like(out, memory_format=torch.contiguous_format) if plan.private_dst else out
    # the kernel indexes metadata as dense 1-D arrays: strided views get a dense copy (a device copy, no host
    # sync; capturable); the causal flags go to the kernel as they are (no conversion op per call)
    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    if seq_lens is None:  # the contiguous form without seq_lens
        seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    sl = seq_lens.to(torch.int32).contiguous()
    ncq = (causal if plan.ncq_flags else num_causal_q.to(torch.int32)).contiguous()
    if plan.paged:
        bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        cu_k = cu_q  # unused
    else:
        bt = cu_q  # unused
        cu_k = cu_seqlens_k.to(torch.int32).contiguous()
    ns = plan.num_splits
    if ns > 1:
        opart = torch.empty(ns, plan.total_q, plan.num_heads, plan.head_dim_v, dtype=torch.float32, device=q.device)
        # each split's running max and sum ([ns, 2, H, total_q]; split_merge's raw-stats format)
        statpart = torch.empty(ns, 2, plan.num_heads, plan.total_q, dtype=torch.float32, device=q.device)
    else:
        opart = statpart = dst  # unused
    lse_arg = lse if lse is not None else dst
    if plan.descriptors is not None:
        k_arg, v_arg = make_kv_descriptors(k_cache, v_cache, *plan.descriptors)
    else:
        k_arg, v_arg = k_cache, v_cache
    v_extra = ()
    if plan.descriptors is not None:  # the Gluon kernels' V, v_row_stride, v_rows: None (constexprs, no kernel
        v_extra = (v_cache,) + plan.v_tail if plan.v_tail else (None, None, None)  # parameters) unless NAN_SAFE_V
    handle = plan.main(q, k_arg, v_arg, dst, lse_arg, opart, statpart, cu_q, sl, ncq, bt, cu_k, *plan.tail, *v_extra)
    # a dict copy: the resolved config is shared by the plan and the config cache
    last_launch.update(kernel=handle, num_splits=ns, grid=plan.grid, config=plan.cfg.as_dict(), impl=plan.impl)
    if plan.merge is not None:
        plan.merge(opart, statpart, dst, lse_arg, *plan.merge_tail)
    if dst is not out:
        out.copy_(dst)
    return (out, lse) if plan.return_lse else out


__all__ = ["Launch", "Plan", "plan_key", "make_plan", "run_plan", "merge_pdl", "wide_kv_offsets"]
