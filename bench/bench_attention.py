"""Attention benchmark: blockdiff's backends against SDPA, FlexAttention and FlashAttention-4 on the named workloads.

Usage (H200; PYTHONPATH must make ``blockdiff.*`` importable, results go to $OUT or bench/results/):

    python3 -m blockdiff.bench.bench_attention                               # named workloads, all backends
    python3 -m blockdiff.bench.bench_attention --suite batch_ladder --backends triton,fa4
    python3 -m blockdiff.bench.bench_attention --workloads 'canvas_*' --tile-sweep
    python3 -m blockdiff.bench.bench_attention --quick                       # CPU smoke run (< 60 s)

Backends (one row per workload, backend and configuration; all measured in the same run):
  sdpa       torch SDPA, one call per sequence with a dense boolean mask built per batch (outside the timing)
             and K/V gathered from the paged cache into contiguous tensors, KV heads repeated per GQA group
             (outside the timing).
  flex       torch.compile'd FlexAttention over the packed batch (q [1, H, total_q, D], contiguous K/V), with a
             BlockMask built per batch from the mask semantics; its build time is reported as ``build_ms``.
  fa4        flash_attn.cute.flash_attn_varlen_func, two launches split by causal flag (q pre-split outside the
             timing); window (W, 0) for causal and (W, W) for bidirectional rows. ``--fa4-layouts`` picks the
             paged cache (page_table + seqused_k) and/or contiguous K/V (cu_seqlens_k). Skipped with a reason
             when not importable, for hd > 256, and for the prefix window (not expressible as a FA window).
  triton,    blockdiff.attention.attention(backend=...) on the paged cache and/or, with ``--blockdiff-layouts``,
  cute       the packed varlen K/V (cu_seqlens_k; rows labelled ``kv_layout=contiguous``); skipped with a reason
             when the backend is missing or raises NotImplementedError. The per-sequence flags are passed as
             ``num_causal_q`` built once outside the timing (a step's metadata, shared by all layers).
             ``--tile-sweep`` rows use the paged cache; ``--cute-configs`` adds cute rows with other CuteConfig
             dicts (paged cache), e.g. the split-value kernel's 64-key tiles at hd 512. With ``--tile-sweep``,
             ``--tile-configs`` dicts made of CuteConfig fields also time cute on each ``--blockdiff-layouts``
             layout, e.g. ``--backends cute --tile-sweep --tile-configs '[{"split_merge": "cluster"}]'``.
  reference  blockdiff.attention's dense reference (``--quick`` only).

Before timing, each backend's output is checked (isfinite; max abs error <= 2x that of the same-dtype eager
computation plus a representation tolerance, blockdiff.attention.testing's rule) against a high-precision
ground truth: the fp64 blockdiff reference in ``--quick`` runs, fp32 SDPA on the big shapes. Outputs of blockdiff backends are NaN-poisoned before the checked call.
Effective TFLOP/s = 4·H·D·(allowed pairs)/time, allowed pairs counted exactly from the mask semantics.
A failing backend records an error row; the run continues. A summary table is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from blockdiff.attention import BACKENDS, MAX_SEQ_LEN, causal_row_counts, get_backend
from blockdiff.attention.testing import REPRESENTATION_ATOL, reference_pair
from blockdiff.bench import common
from blockdiff.bench import workloads as wl

SUITE = "attention"
#: The benchmark's own baselines (per-sequence SDPA, FlexAttention, FlashAttention-4), not blockdiff backends. Records'
#: ``backend`` field holds both kinds, so a baseline's name is never a name of ``blockdiff.attention.BACKENDS``
#: (tests/test_backend_lists.py).
BASELINES = ("sdpa", "flex", "fa4")
#: What ``--backends`` takes: the baselines and every registered blockdiff backend (read from the registry).
BACKEND_CHOICES = BASELINES + BACKENDS
#: The default GPU run: the baselines and the kernel backends; a registered backend is left out only for a reason
#: tests/test_backend_lists.py states (the reference: the dense oracle, --quick's).
ALL_BACKENDS = ("sdpa", "flex", "fa4", "triton", "cute")
QUICK_BACKENDS = ("reference", "sdpa", "triton")
DEFAULT_TILE_SWEEP = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
    for bm, bn, nw, ns in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
]


class Skip(Exception):
    """A backend does not apply to a workload; the message is recorded as the row's ``reason``."""


# ----------------------------------------------------------------------------------------------- ground truth
def row_masks(batch: wl.Batch) -> list[torch.Tensor]:
    """Dense boolean masks [q_len_b, seq_len_b] per sequence, on the batch's device (from the row bounds)."""
    w = batch.workload
    seq_id, lo, hi = w.key_ranges()
    dev = batch.q.device
    masks, start = [], 0
    for b, (ql, sl) in enumerate(zip(w.q_lens, w.seq_lens)):
        k = torch.arange(sl, device=dev)
        lo_b = lo[start: start + ql].to(dev)[:, None]
        hi_b = hi[start: start + ql].to(dev)[:, None]
        masks.append((k[None, :] >= lo_b) & (k[None, :] <= hi_b))
        start += ql
    return masks


def _sdpa_operands(batch: wl.Batch, b: int, dtype: torch.dtype):
    """q [1, H, q_len, D], k/v [1, H, seq_len, D(v)] of sequence ``b`` in ``dtype``, contiguous, with K/V heads
    repeated per GQA group (SDPA's fused kernels take masks but not always ``enable_gqa``; expanding keeps
    them in play instead of the math fallback)."""
    w = batch.workload
    g = w.num_heads // w.num_kv_heads
    k, v = batch.kv_of(b)
    q = batch.q_of(b).to(dtype).transpose(0, 1)[None].contiguous()
    k = k.to(dtype).repeat_interleave(g, dim=1).transpose(0, 1)[None].contiguous()
    v = v.to(dtype).repeat_interleave(g, dim=1).transpose(0, 1)[None].contiguous()
    return q, k, v


def dense_attention(batch: wl.Batch, dtype: torch.dtype, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Masked SDPA per sequence with q/k/v cast to ``dtype``; packed [total_q, H, Dv] in ``dtype``.

    Rows without an allowed key give 0 (the contract), not SDPA's NaN.
    """
    masks = row_masks(batch) if masks is None else masks
    w = batch.workload
    outs = []
    for b in range(w.batch_size):
        q, k, v = _sdpa_operands(batch, b, dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[b], scale=batch.scale)
        o = o[0].transpose(0, 1)
        empty = ~masks[b].any(dim=1)
        if bool(empty.any()):
            o = o.masked_fill(empty[:, None, None], 0.0)
        outs.append(o)
    return torch.cat(outs)


def ground_truth(batch: wl.Batch, against: str) -> tuple[torch.Tensor, float, str]:
    """(gold [total_q, H, Dv], baseline max abs error, source) for the correctness check.

    ``against="reference"``: the project's tolerance rule in its batch-wide form (blockdiff.attention.testing's
    reference_pair): the fp64 reference as gold and the same-precision eager reference's largest error over the whole
    batch as baseline (small shapes only; the workloads' V has one scale, where the batch-wide and the per-sequence
    bound of ``check_close`` agree to within the sequences' spread of eager errors).
    ``against="sdpa"``: fp32 SDPA as gold and SDPA in the batch dtype as baseline (big shapes on the GPU).
    """
    if against == "reference":
        o64, _, eager = reference_pair(batch.q, batch.k_cache, batch.v_cache, **batch.attn_kwargs())
        return o64, float((eager.to(torch.float64) - o64).abs().max()), "reference-fp64"
    masks = row_masks(batch)
    gold = dense_attention(batch, torch.float32, masks)
    base = float((dense_attention(batch, batch.q.dtype, masks).float() - gold).abs().max())
    return gold, base, "sdpa-fp32"


def representation_tol(dtype: torch.dtype) -> float:
    return REPRESENTATION_ATOL.get(dtype, 1e-6)


# ----------------------------------------------------------------------------------------------- backends
# Each maker returns (fn, to_packed, info): fn() runs the timed call and returns its raw output; to_packed(raw)
# gives [total_q, H, Dv] for the check (not timed); info is a dict merged into the row.

def make_sdpa(batch: wl.Batch, args) -> tuple:
    masks = row_masks(batch)
    w = batch.workload
    ops = [_sdpa_operands(batch, b, batch.q.dtype) for b in range(w.batch_size)]
    scale = batch.scale

    def fn():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale) for (q, k, v), m in zip(ops, masks)]

    def to_packed(outs):
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    return fn, to_packed, {"mask_bytes": sum(m.numel() for m in masks)}


def make_flex(batch: wl.Batch, args) -> tuple:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    w = batch.workload
    dev = batch.q.device
    k, v, _ = batch.contiguous_kv()
    blk = 128
    tq, tk = w.total_q, k.shape[0]
    pq, pk = math.ceil(tq / blk) * blk, math.ceil(tk / blk) * blk
    seq_id, lo, hi = w.key_ranges()
    q_doc = torch.full((pq,), -1, dtype=torch.int32)
    q_doc[:tq] = seq_id.to(torch.int32)
    q_lo = torch.zeros(pq, dtype=torch.int32)
    q_hi = torch.full((pq,), -1, dtype=torch.int32)
    q_lo[:tq], q_hi[:tq] = lo.to(torch.int32), hi.to(torch.int32)
    k_doc = torch.full((pk,), -2, dtype=torch.int32)
    k_pos = torch.zeros(pk, dtype=torch.int32)
    kl = torch.tensor(w.seq_lens)
    k_seq = torch.repeat_interleave(torch.arange(w.batch_size), kl)
    k_doc[:tk] = k_seq.to(torch.int32)
    k_pos[:tk] = (torch.arange(tk) - (torch.cumsum(kl, 0) - kl)[k_seq]).to(torch.int32)
    q_doc, q_lo, q_hi, k_doc, k_pos = (t.to(dev) for t in (q_doc, q_lo, q_hi, k_doc, k_pos))

    def mask_mod(b, h, q_idx, kv_idx):
        kp = k_pos[kv_idx]
        return (q_doc[q_idx] == k_doc[kv_idx]) & (kp >= q_lo[q_idx]) & (kp <= q_hi[q_idx])

    def pad(t, n):  # [T, Hx, D] -> [1, Hx, n, D]
        out = t.new_zeros(n, *t.shape[1:])
        out[: t.shape[0]] = t
        return out.transpose(0, 1)[None].contiguous()

    qp, kp_, vp = pad(batch.q, pq), pad(k, pk), pad(v, pk)
    on_cuda = dev.type == "cuda"

    def build_mask():
        return create_block_mask(mask_mod, None, None, pq, pk, device=dev, BLOCK_SIZE=blk, _compile=on_cuda)

    build_times = []
    for _ in range(3 if on_cuda else 1):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        bm = build_mask()
        if on_cuda:
            torch.cuda.synchronize()
        build_times.append((time.perf_counter() - t0) * 1e3)
    flex = torch.compile(flex_attention, dynamic=False) if on_cuda else flex_attention
    scale = batch.scale

    # hd 512 (Gemma 4 global layers): flex's default tiles need ~263 KB of shared memory on an H200 (232 KB
    # available: "No valid triton configs", batch 1). Smaller tiles that divide the BlockMask's 128 fit.
    kopts = dict(BLOCK_M=64, BLOCK_N=32, num_stages=1, num_warps=8) if (on_cuda and batch.q.shape[-1] > 256) \
        else None
    info_kopts = kopts

    def fn():
        return flex(qp, kp_, vp, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=kopts)

    def to_packed(o):
        return o[0].transpose(0, 1)[:tq]

    info = {"build_ms": sorted(build_times)[len(build_times) // 2], "build_ms_first": build_times[0],
            "build_anchor_ms": list(wl.FLEX_BUILD_ANCHOR_MS), "compiled": on_cuda,
            "kernel_options": info_kopts}
    return fn, to_packed, info


def make_fa4(batch: wl.Batch, args, layout: str) -> tuple:
    w = batch.workload
    if batch.q.device.type != "cuda":
        raise Skip("fa4 needs a CUDA device")
    if w.head_dim > 256 or w.head_dim_v > 256:
        raise Skip(f"FA4 (flash_attn.cute) supports head_dim <= 256, workload has {w.head_dim}")
    if w.window_size is not None and w.bidirectional_window == "prefix" and not all(w.causal):
        raise Skip("prefix bidirectional window is not expressible as a FlashAttention window (W_left, W_right)")
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        raise Skip(f"flash_attn.cute not importable: {type(e).__name__}: {e}") from None
    W = w.window_size
    launches = []
    k_all = v_all = None
    if layout == "contiguous":
        k_all, v_all, _ = batch.contiguous_kv()
    for flag in (True, False):
        idx = [b for b in range(w.batch_size) if w.causal[b] == flag]
        if not idx:
            continue
        dev = batch.q.device
        q_g = torch.cat([batch.q_of(b) for b in idx]).contiguous()
        ql = [w.q_lens[b] for b in idx]
        sl = [w.seq_lens[b] for b in idx]
        cu_q = torch.tensor([0] + list(itertools.accumulate(ql)), dtype=torch.int32, device=dev)
        kw = dict(cu_seqlens_q=cu_q, max_seqlen_q=max(ql), max_seqlen_k=max(sl), softmax_scale=batch.scale,
                  causal=flag)
        if W is not None:
            kw["window_size"] = (W, 0) if flag else (W, W)
        if layout == "paged":
            kw.update(seqused_k=torch.tensor(sl, dtype=torch.int32, device=dev),
                      page_table=batch.block_table[idx].contiguous())
            k_g, v_g = batch.k_cache, batch.v_cache
        else:
            kv = [batch.kv_of(b) for b in idx]
            k_g = torch.cat([x[0] for x in kv]).contiguous()
            v_g = torch.cat([x[1] for x in kv]).contiguous()
            kw["cu_seqlens_k"] = torch.tensor([0] + list(itertools.accumulate(sl)), dtype=torch.int32, device=dev)
        launches.append((idx, q_g, k_g, v_g, kw))
    del k_all, v_all

    def fn():
        outs = []
        for _, q_g, k_g, v_g, kw in launches:
            o = flash_attn_varlen_func(q_g, k_g, v_g, **kw)
            outs.append(o[0] if isinstance(o, tuple) else o)
        return outs

    def to_packed(outs):
        pieces = {}
        for (idx, *_), o in zip(launches, outs):
            start = 0
            for b in idx:
                pieces[b] = o[start: start + w.q_lens[b]]
                start += w.q_lens[b]
        return torch.cat([pieces[b] for b in range(w.batch_size)])

    return fn, to_packed, {"kv_layout": layout, "launches": len(launches)}


def _blockdiff_backend(backend: str):
    """The backend's attention function; Skip (with the reason) when it is missing here."""
    try:
        return get_backend(backend)
    except ImportError as e:
        raise Skip(str(e)) from None


def triton_config_kwarg() -> str | None:
    """Keyword through which the Triton backend takes a tile config (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    try:
        fn = _blockdiff_backend("triton")
    except Skip:
        return None
    params = inspect.signature(fn).parameters
    return next((n for n in ("config", "tile_config", "kernel_config") if n in params), None)


def cute_config_fields() -> tuple:
    """Field names of the cute backend's CuteConfig (its config module imports without flash-attn-4)."""
    from blockdiff.attention.cute.config import CuteConfig
    return tuple(f.name for f in dataclasses.fields(CuteConfig))


def make_blockdiff(batch: wl.Batch, args, backend: str, config: dict | None = None, layout: str = "paged") -> tuple:
    attention = _blockdiff_backend(backend)
    w = batch.workload
    out = torch.empty(w.total_q, w.num_heads, w.head_dim_v, dtype=batch.q.dtype, device=batch.q.device)
    kwargs = batch.attn_kwargs()
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if layout == "contiguous":
        # the varlen form (packed K/V + cu_seqlens_k), as fa4[contiguous]
        k_cache, v_cache, cu_k = batch.contiguous_kv()
        kwargs.pop("block_table")
        kwargs["cu_seqlens_k"] = cu_k
    if "causal" in kwargs:
        # per-step metadata built once outside the timing, as a serving engine builds it once per step for all
        # layers (and as FA4's q is pre-split by flag outside its timing): the flags as causal row counts
        kwargs["num_causal_q"] = causal_row_counts(kwargs.pop("causal"), kwargs["cu_seqlens_q"])
    if config is not None:
        kwargs[triton_config_kwarg() if backend == "triton" else "config"] = config
    info = {"config": config} if config else {}
    if layout != "paged":
        info["kv_layout"] = layout
    if "check_values" in inspect.signature(attention).parameters:
        kwargs["check_values"] = False  # host-side value checks sync; the launch path is what we time
        info["check_values"] = False

    def fn():
        return attention(batch.q, k_cache, v_cache, out=out, **kwargs)

    def poison():
        out.fill_(float("nan"))

    return fn, (lambda o: o), info, poison


# ----------------------------------------------------------------------------------------------- one measurement
def triton_launch() -> dict:
    """What the triton backend's last call ran (its ``LAST_LAUNCH``): the kernel (``impl``: "triton" portable or
    "gluon"), the split count and the resolved tile config, so that a row of the automatic choice names its
    kernel."""
    # imported at first use: on the CPU, main() sets TRITON_INTERPRET before triton loads
    from blockdiff.attention.triton import interface as TA

    ll = TA.LAST_LAUNCH
    cfg = ll.get("config") or {}
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "V_STAGES", "OVERLAP", "LAZY_RESCALE")
    return {"impl": ll.get("impl"), "num_splits": ll.get("num_splits"),
            "launch_config": {k: cfg[k] for k in keys if k in cfg}}


def cute_launch() -> dict:
    """What the cute backend's last call ran (its ``LAST_LAUNCH``): the kernel class, the split count, the
    resolved tiles, batch order, the roles kernel's schedule switches (``v_refill``, ``qk_issue``, ``k_refill``) and
    the resolved merge and NaN-safe V choices (``split_merge``, ``nan_safe_v``, ``nan_safe_v_method``,
    ``skip_allowed_first``, which vary per launch) and the key weight (``exact_weight``: True, ``"auto"`` or
    False, which a row without a config takes from ``CuteConfig``'s default), so that a row names its kernel (at
    hd 512 the roles or the split-value kernel, which ``wide_design="auto"`` picks per call; split-KV), whether the
    scheduler took the sequences by work, how the roles kernel ran, and which weight it used."""
    from blockdiff.attention.cute import interface as CA  # the cute backend module (imports no CuTe DSL itself)

    ll = CA.LAST_LAUNCH
    cfg = ll.get("config")
    return {"impl": ll.get("kernel"), "num_splits": None if cfg is None else cfg.num_splits,
            "kv_path": ll.get("kv_path"),
            "launch_config": None if cfg is None else {k: getattr(cfg, k) for k in
                                                       ("tile_m", "tile_n", "num_stages", "lpt", "batch_order",
                                                        "v_refill", "qk_issue", "k_refill", "split_merge",
                                                        "nan_safe_v", "nan_safe_v_method", "skip_allowed_first",
                                                        "exact_weight")}}


def measure(batch: wl.Batch, backend: str, maker: Callable, args, gold: torch.Tensor, base_err: float,
            extra: dict | None = None) -> dict:
    w = batch.workload
    dev = batch.q.device
    pairs = w.allowed_pairs()
    flops = common.attention_flops(w.num_heads, w.head_dim, pairs, w.head_dim_v)
    row = {"workload": w.name, "backend": backend, "status": "ok", "eager_ms": None, "graph_ms": None,
           "effective_tflops": None, "share_of_peak": None, "extra_memory_bytes": None,
           "anchor_ms": w.anchors_ms.get(backend), "allowed_pairs": pairs, "flops": flops,
           "total_q": w.total_q, "batch": w.batch_size, "num_heads": w.num_heads, "num_kv_heads": w.num_kv_heads,
           "head_dim": w.head_dim, "window_size": w.window_size, "bidirectional_window": w.bidirectional_window,
           "page_size": batch.page_size, "dtype": str(batch.q.dtype).replace("torch.", ""), **(extra or {})}
    try:
        made = maker()
        fn, to_packed, info = made[:3]
        poison = made[3] if len(made) > 3 else None
        row.update(info)
        if poison is not None:
            poison()
        t0 = time.perf_counter()
        raw = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        if backend == "triton":
            row.update(triton_launch())
        elif backend == "cute":
            row.update(cute_launch())
        out = to_packed(raw)
        del raw
        finite = bool(torch.isfinite(out).all())
        err = float((out.to(gold.dtype) - gold).abs().max()) if out.shape == gold.shape else float("inf")
        tol = 2.0 * base_err + representation_tol(batch.q.dtype)
        row.update(max_abs_err=err if math.isfinite(err) else None, tol=tol, correct=finite and err <= tol)
        if out.shape != gold.shape:
            row["check_error"] = f"output shape {tuple(out.shape)} != expected {tuple(gold.shape)}"
        del out
        row["first_call_ms"] = first_ms  # includes compilation / autotuning
        row["extra_memory_bytes"] = common.peak_extra_memory_bytes(fn, dev)
        if dev.type == "cuda" or args.cpu_reps > 0:
            row["eager_ms"] = common.time_eager_ms(fn, dev, cpu_reps=args.cpu_reps)
        else:  # CPU smoke run: the checked call is the only timing (interpreted Triton is slow)
            row["eager_ms"] = first_ms
        if dev.type == "cuda" and not args.no_graph:
            try:
                row["graph_ms"] = common.time_graph_ms(fn)
            except Exception as e:  # noqa: BLE001 - graph capture failure is a result, not a crash
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
        best = row["graph_ms"] if row["graph_ms"] is not None else row["eager_ms"]
        row["effective_tflops"] = common.tflops(flops, best)
        row["effective_tflops_eager"] = common.tflops(flops, row["eager_ms"])
        row["share_of_peak"] = common.share_of_peak(row["effective_tflops"])
    except Skip as e:
        row.update(status="skipped", reason=str(e))
    except NotImplementedError as e:
        row.update(status="skipped", reason=f"NotImplementedError: {e}")
    except Exception as e:  # noqa: BLE001 - one failing backend must not kill the run
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}",
                   traceback=traceback.format_exc(limit=4)[-1500:])
        if dev.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # after an out-of-memory error the next backend starts clean
            except Exception:  # noqa: BLE001 - a sticky CUDA error; later rows will record it too
                pass
    return row


def jobs_for(batch: wl.Batch, backends, args):
    """(backend, maker, extra) for every measurement of one workload."""
    for be in backends:
        if be == "sdpa":
            yield be, (lambda: make_sdpa(batch, args)), None
        elif be == "flex":
            yield be, (lambda: make_flex(batch, args)), None
        elif be == "fa4":
            for layout in args.fa4_layouts:
                yield be, (lambda layout=layout: make_fa4(batch, args, layout)), {"kv_layout": layout}
        elif be in BACKENDS:
            # the reference (the --quick oracle) always runs on the paged cache; triton / cute per requested layout
            if be == "reference" or "paged" in args.blockdiff_layouts:
                yield be, (lambda be=be: make_blockdiff(batch, args, be)), None
            if be != "reference" and "contiguous" in args.blockdiff_layouts:
                yield be, (lambda be=be: make_blockdiff(batch, args, be, layout="contiguous")), \
                    {"kv_layout": "contiguous"}
            if be == "cute":
                for cfg in args.cute_configs:  # extra rows: cute with a CuteConfig dict, on the paged cache
                    yield be, (lambda cfg=cfg: make_blockdiff(batch, args, "cute", cfg)), {"config": cfg}
                if args.tile_sweep:
                    # --tile-configs dicts made of CuteConfig fields (e.g. {"split_merge": "cluster"}) also time
                    # cute, on each requested layout; the triton tile dicts (the default sweep) are not cute's
                    for cfg in (c for c in args.tile_configs if c and set(c) <= set(cute_config_fields())):
                        for layout in args.blockdiff_layouts:
                            yield be, (lambda cfg=cfg, layout=layout: make_blockdiff(
                                batch, args, "cute", cfg, layout=layout)), \
                                {"config": cfg, **({"kv_layout": layout} if layout != "paged" else {})}
            if be == "triton" and args.tile_sweep:
                if triton_config_kwarg() is None:
                    continue  # message printed once in main()
                for cfg in args.tile_configs:
                    if cfg and _cute_only(cfg):
                        continue  # a dict of CuteConfig fields only (e.g. {"split_merge": "cluster"}): cute's
                    yield be, (lambda cfg=cfg, be=be: make_blockdiff(batch, args, be, cfg)), {"config": cfg}
        else:
            raise ValueError(f"unknown backend {be!r}; choose from {BACKEND_CHOICES}")


# ----------------------------------------------------------------------------------------------- plots
def _cute_only(cfg: dict) -> bool:
    """Whether a --tile-configs dict names CuteConfig fields only and not one field of the triton backend's
    config (``num_splits`` is both: a dict with other cute fields beside it is cute's)."""
    from blockdiff.attention.triton.config import TritonConfig

    triton_fields = {f.name for f in dataclasses.fields(TritonConfig)}
    return set(cfg) <= set(cute_config_fields()) and not (set(cfg) - {"num_splits"}) <= triton_fields


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib missing: no plots")
        return None
    return plt


def plot(rows: list[dict], out_dir: Path, stem: str) -> list[Path]:
    """One PNG per workload: ms (eager, graph, anchor) and effective TFLOP/s per backend/configuration."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == name and r["status"] == "ok"]
        if not rs:
            continue
        labels = [label_of(r) for r in rs]
        x = range(len(rs))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(rs) + 4), 4))
        eager = [r["eager_ms"] or 0 for r in rs]
        graph = [r["graph_ms"] or 0 for r in rs]
        a1.bar([i - 0.2 for i in x], eager, 0.4, label="eager")
        a1.bar([i + 0.2 for i in x], graph, 0.4, label="CUDA graph")
        for i, r in zip(x, rs):
            if r.get("anchor_ms"):
                a1.plot([i - 0.4, i + 0.4], [r["anchor_ms"]] * 2, "k--", lw=1)
        a1.set_ylabel("ms (median; dashed = anchor)")
        a1.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        a1.legend(fontsize=8)
        a2.bar(list(x), [r["effective_tflops"] or 0 for r in rs], color="tab:green")
        a2.axhline(common.PEAK_TFLOPS, color="gray", ls=":", lw=1)
        a2.set_ylabel("effective TFLOP/s")
        a2.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        fig.suptitle(name)
        fig.tight_layout()
        p = out_dir / f"{stem}-{name}.png"
        common.save_png(fig, p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_ladder(rows: list[dict], out_dir: Path, stem: str) -> list[Path]:
    """Ladder suites (workloads ``canvas_bs{n}_ctx{c}_{layer}``): one PNG per layer type, CUDA-graph ms and
    effective TFLOP/s against the varying axis (canvases, or context in tokens), one line per backend/layout.
    Returns [] when the rows are not a ladder (fewer than two values on the axis) or matplotlib is missing."""
    pts = []
    for r in rows:
        parsed = wl.parse_canvas_name(r.get("workload", ""))
        if parsed and r.get("status") == "ok" and r.get("graph_ms"):
            bs, ctx, layer = parsed
            pts.append((layer, bs, ctx, label_of(r), r["graph_ms"], r.get("effective_tflops")))
    if not pts:
        return []
    bs_vals, ctx_vals = {p[1] for p in pts}, {p[2] for p in pts}
    if len(bs_vals) > 1 and len(ctx_vals) == 1:
        axis, xi, xlabel = "batch", 1, f"canvases of 256 (context {next(iter(ctx_vals)) // 1024} k each)"
    elif len(ctx_vals) > 1 and len(bs_vals) == 1:
        axis, xi, xlabel = "context", 2, f"context tokens ({next(iter(bs_vals))} canvas(es) of 256)"
    else:
        return []
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for layer in dict.fromkeys(p[0] for p in pts):
        lp = [p for p in pts if p[0] == layer]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for lab in dict.fromkeys(p[3] for p in lp):
            q = sorted((p for p in lp if p[3] == lab), key=lambda p: p[xi])
            a1.plot([p[xi] for p in q], [p[4] for p in q], "o-", label=lab)
            a2.plot([p[xi] for p in q], [p[5] or 0 for p in q], "o-", label=lab)
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xlabel(xlabel)
            a.grid(alpha=0.3)
        a1.set_yscale("log")
        a1.set_ylabel("ms (CUDA-graph median)")
        a2.axhline(common.PEAK_TFLOPS, color="gray", ls=":", lw=1)
        a2.set_ylabel("effective TFLOP/s (dotted: bf16 ceiling)")
        a1.legend(fontsize=8)
        fig.suptitle(f"{stem}: {layer} layer, {axis} ladder")
        fig.tight_layout()
        p = out_dir / f"{stem}-{layer}.png"
        common.save_png(fig, p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def label_of(r: dict) -> str:
    s = r["backend"]
    if r.get("kv_layout"):
        s += f"[{r['kv_layout']}]"
    cfg = r.get("config")
    if cfg:
        s += "[" + ",".join(f"{v}" for v in cfg.values()) + "]"
    return s


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, reference+sdpa+triton")
    p.add_argument("--suite", default="named", choices=sorted(wl.SUITES),
                   help="workload set: named, small (contexts / 8, GPU smoke), batch_ladder, ctx_ladder")
    p.add_argument("--workloads", default="", help="comma-separated globs of workload names (default: all)")
    p.add_argument("--backends", default="", help=f"comma-separated subset of {BACKEND_CHOICES}")
    p.add_argument("--page-size", type=int, default=None,
                   help=f"tokens per KV page (default {wl.DEFAULT_PAGE_SIZE}; --quick {wl.QUICK_PAGE_SIZE})")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --quick; without a GPU a "
                   "full-shape run stops unless --device cpu)")
    p.add_argument("--fa4-layouts", default="paged,contiguous", help="fa4 KV layouts: paged and/or contiguous")
    p.add_argument("--blockdiff-layouts", default="paged",
                   help="KV layouts of the triton / cute rows: paged (default) and/or contiguous (packed varlen K/V)")
    p.add_argument("--tile-sweep", action="store_true", help="also time the triton backend per tile config (and cute per --tile-configs dict of CuteConfig fields)")
    p.add_argument("--tile-configs", default="", help="JSON list of tile config dicts for --tile-sweep")
    p.add_argument("--cute-configs", default="",
                   help='JSON list of CuteConfig dicts timed as extra cute rows, e.g. \'[{"tile_n": 64}]\'')
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--check-against", choices=["auto", "reference", "sdpa"], default="auto",
                   help="ground truth: fp64 blockdiff reference or fp32 SDPA; auto = reference if --quick")
    p.add_argument("--cpu-reps", type=int, default=0,
                   help="extra timing repetitions on the CPU (0: time the checked call only)")
    p.add_argument("--suite-name", default=None, help="results file stem (default attention / attention-quick)")
    p.add_argument("--out", default=None, help="output folder (default $OUT or bench/results)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new workloads after this many seconds (the rest are recorded as skipped)")
    a = p.parse_args(argv)
    try:  # a value naming nothing (',') is refused: it selected no row and measured nothing
        a.fa4_layouts = common.comma_list(a.fa4_layouts, "--fa4-layouts")
        a.blockdiff_layouts = common.comma_list(a.blockdiff_layouts, "--blockdiff-layouts")
        backends = common.comma_list(a.backends, "--backends")
    except ValueError as e:
        p.error(str(e))
    for flag, v in (("--fa4-layouts", a.fa4_layouts), ("--blockdiff-layouts", a.blockdiff_layouts)):
        if not v:  # '' has no "all" meaning here: it yielded no fa4 / triton / cute row, a run that measured nothing
            p.error(f"{flag} must name paged and/or contiguous, got ''")
    if [x for x in a.blockdiff_layouts if x not in ("paged", "contiguous")]:
        p.error(f"--blockdiff-layouts: use paged and/or contiguous, got {a.blockdiff_layouts}")
    bad = [x for x in a.fa4_layouts if x not in ("paged", "contiguous")]
    if bad:
        p.error(f"--fa4-layouts: unknown layout(s) {bad}; use paged and/or contiguous")
    for flag in ("tile_configs", "cute_configs"):
        text = getattr(a, flag)
        try:
            v = json.loads(text) if text else (DEFAULT_TILE_SWEEP if flag == "tile_configs" else [])
        except json.JSONDecodeError as e:
            p.error(f"--{flag.replace('_', '-')}: not JSON ({e.msg} at column {e.colno}): {text!r}")
        if not isinstance(v, list) or not all(isinstance(c, dict) for c in v):
            p.error(f"--{flag.replace('_', '-')}: a JSON list of dicts, got {text!r}")
        setattr(a, flag, v)
    unknown = [b for b in backends if b not in BACKEND_CHOICES]
    if unknown:
        p.error(f"--backends: unknown backend(s) {unknown}; choose from {BACKEND_CHOICES}")
    if a.page_size is not None and a.page_size < 1:
        p.error(f"--page-size must be an int >= 1 (tokens per KV page), got {a.page_size}")
    if a.cpu_reps < 0:
        p.error(f"--cpu-reps must be >= 0, got {a.cpu_reps}")
    if a.budget_s is not None and math.isnan(a.budget_s):  # (NaN would never stop; <= 0 skips every workload)
        p.error(f"--budget-s must be a number of seconds, got {a.budget_s}")
    if a.page_size is not None and a.page_size > MAX_SEQ_LEN:  # (10**20 failed every workload's build, exit 0)
        p.error(f"--page-size must be at most MAX_SEQ_LEN = 2**30 tokens (a sequence's most keys), got {a.page_size}")
    if not 0 <= a.seed < 2 ** 63:  # (10**20 failed every workload's build with exit 0; make_batch seeds seed + 1)
        p.error(f"--seed must be in [0, 2**63), got {a.seed}")
    if a.suite_name is not None and (not a.suite_name.strip() or a.suite_name in (".", "..")
                                     or any(c in a.suite_name for c in ("/", os.sep))):
        # a file stem inside the output folder ('../../x' wrote bench/x-cpu.json; '' silently took the default)
        p.error(f"--suite-name must be a non-empty file name stem without path separators, got {a.suite_name!r}")
    if a.device is not None:
        try:
            dev = torch.device(a.device)
        except (RuntimeError, ValueError):
            p.error(f"--device must name a torch device (cpu, cuda, cuda:N), got {a.device!r}")
        if dev.type == "cuda" and (not torch.cuda.is_available()
                                   or (dev.index is not None and dev.index >= torch.cuda.device_count())):
            # (was torch's AssertionError traceback, 'Torch not compiled with CUDA enabled')
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            p.error(f"--device {a.device!r} is not available here ({n} CUDA device{'' if n == 1 else 's'})")
    try:  # a pattern matching no workload is a usage error (typos must not silently measure nothing)
        wl.select(wl.SUITES[a.suite](quick=a.quick), a.workloads)
    except ValueError as e:
        p.error(str(e))
    if a.out is not None:  # before the run (a file there failed at the first write, after a workload ran); the
        # folder is created by the run, not here: its nearest existing ancestor must be a writable folder
        out = Path(a.out).absolute()
        if out.exists() and not out.is_dir():
            p.error(f"--out {a.out!r} is a file, not a folder")
        near = next(d for d in (out, *out.parents) if d.exists())
        if not near.is_dir() or not os.access(near, os.W_OK):
            p.error(f"--out {a.out!r} cannot be written ({str(near)!r} is not a writable folder)")
        try:  # os.access trusts the mode bits (root passes it on /proc): try a folder there, removed at once
            os.rmdir(tempfile.mkdtemp(prefix=".bench-probe-", dir=near))
        except OSError as e:
            p.error(f"--out {a.out!r} cannot be written ({str(near)!r}: {e.strerror or e})")
    return a


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    if device.type == "cpu" and not args.quick and args.device is None:
        # the named workloads' full shapes (16k prefills, 32k contexts) through the Triton interpreter run for hours
        sys.exit("bench_attention: no CUDA GPU: the named workloads' full shapes are a GPU benchmark; --quick is the "
                 "CPU smoke run (--device cpu runs the full shapes on the CPU anyway)")
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:
            common.log("note: triton was imported before TRITON_INTERPRET could be set; the triton backend may "
                       "fail on the CPU (run with TRITON_INTERPRET=1)")
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run through the interpreter on the CPU
    dtype = getattr(torch, args.dtype)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] or \
        list(QUICK_BACKENDS if args.quick else ALL_BACKENDS)
    if "reference" in backends and not args.quick:
        common.log("note: the reference backend is meant for --quick runs (dense, slow on big shapes)")
    if args.tile_sweep and triton_config_kwarg() is None:
        common.log("--tile-sweep: blockdiff.attention.attention takes no tile config keyword "
                   "(config/tile_config/kernel_config); sweep skipped (no-op)")
    page_size = args.page_size if args.page_size is not None else (
        wl.QUICK_PAGE_SIZE if args.quick else wl.DEFAULT_PAGE_SIZE)
    suite_fn = wl.SUITES[args.suite]
    workloads = wl.select(suite_fn(quick=args.quick), args.workloads)
    check_against = args.check_against if args.check_against != "auto" else ("reference" if args.quick else "sdpa")

    env = common.env_record(device)
    common.log(f"device {env['gpu']}, torch {env['torch']}, triton {env['triton']}, fa4 {env['flash_attn_4']}, "
               f"commit {env['commit']}")
    if device.type == "cuda":
        common.log(f"warm-up {common.warm_up_gpu(device):.1f} s")
    rows: list[dict] = []
    t_start = time.perf_counter()
    suite = args.suite_name or (SUITE + ("-quick" if args.quick else "") +
                                ("" if args.suite == "named" else f"-{args.suite}"))
    out_dir = Path(args.out) if args.out else common.results_dir(local=args.quick or device.type == "cpu")
    extra = {"page_size": page_size, "dtype": args.dtype, "quick": args.quick, "suite_workloads": args.suite,
             "peak_tflops": common.PEAK_TFLOPS, "anchors_ms": wl.ANCHORS_MS,
             "flex_build_anchor_ms": list(wl.FLEX_BUILD_ANCHOR_MS), "argv": common.script_argv(argv)}
    for w in common.progress(workloads, desc="workloads"):
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            common.log(f"--budget-s {args.budget_s} spent: not starting {w.name} (recorded as skipped)")
            rows.append({"workload": w.name, "backend": "*", "status": "skipped", "reason": "time budget spent"})
            continue
        common.log(w.describe())
        try:
            batch = wl.build(w, device, dtype, page_size=page_size, seed=args.seed)
            gold, base_err, gold_src = ground_truth(batch, check_against)
        except Exception as e:  # noqa: BLE001
            rows.append({"workload": w.name, "backend": "*", "status": "error",
                         "error": f"building the workload failed: {type(e).__name__}: {e}"})
            continue
        for be, maker, job_extra in jobs_for(batch, backends, args):
            row = measure(batch, be, maker, args, gold, base_err, job_extra)
            row.update(checked_against=gold_src, eager_same_dtype_err=base_err)
            rows.append(row)
            msg = row["status"] if row["status"] != "ok" else (
                f"eager {common.fmt(row['eager_ms'])} ms, graph {common.fmt(row['graph_ms'])} ms, "
                f"{common.fmt(row['effective_tflops'], 1)} TFLOP/s, correct={row.get('correct')}")
            common.log(f"  {label_of(row)}: {msg} {row.get('reason') or row.get('error') or ''}")
        del batch, gold
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # written after every workload: a run cut short by a time limit still leaves its rows under $OUT
        common.write_records(suite, rows, env=env, out_dir=out_dir,
                             extra={**extra, "wall_s": round(time.perf_counter() - t_start, 1), "complete": False})

    extra["wall_s"] = round(time.perf_counter() - t_start, 1)
    path = common.write_records(suite, rows, env=env, extra={**extra, "complete": True}, out_dir=out_dir)
    pngs = [] if args.no_plots else plot(rows, out_dir, path.stem) + plot_ladder(rows, out_dir, path.stem)
    print(f"\nwrote {path} (+ .csv, {len(pngs)} PNG)")
    show = [dict(r, backend=label_of(r), note=(r.get("reason") or r.get("error") or "")[:60]) for r in rows]
    print(common.summary_table(show, ["workload", "backend", "status", "eager_ms", "graph_ms", "anchor_ms",
                                      "effective_tflops", "correct", "note"]))
    return rows


if __name__ == "__main__":
    main()
