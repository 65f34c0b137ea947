#!/usr/bin/env python3
"""Experiment: does Triton 3.6's Hopper automatic warp specialization speed up our non-causal attention forward?

Workload ``canvas_bs1_ctx32k_hd128``: one sequence, 256 query tokens, 16 query heads / 8 KV heads (GQA 2, the two
query heads of a KV head packed into one program's rows: row r -> token r // 2, head 2 * kvh + r % 2, 512 rows per
KV head), head_dim 128, bf16, 32768 keys, every query sees every key (no mask). Paged K/V: ``k_cache`` /
``v_cache`` [num_pages, 64, 8, 128] bf16, page 64, block_table [1, 512] int32 = a random subset/permutation of 600
page ids. Split-KV: grid (512 / BLOCK_M, 8, num_splits); each program walks a contiguous range of key blocks and
writes an fp32 partial output [num_splits, 4096, 128] (row = token * 16 + head) and its natural-log LSE
[num_splits, 4096]; a torch merge (not timed) gives the final [256, 16, 128].

Kernel variants (one @triton.jit, constexpr switches):
  ws    K/V through on-device TMA descriptors (``tl.make_tensor_descriptor`` over the cache viewed as
        [num_pages * 64, 8 * 128]), key loop ``tl.range(lo, hi, warp_specialize=True)``;
  desc  the same kernel, ``warp_specialize=False``;
  ptr   plain pointer loads of K/V (reference).
Q modes (config name ``<variant>_q<mode>_m<BLOCK_M>_w<warps>_s<stages>[_r<maxnreg>]``):
  qptr     GQA-interleaved rows gathered with pointer loads (as the production kernel does);
  qrdesc   same rows via a descriptor over q as [256, 16 * 128], box [BLOCK_M / 2, 256], reshaped to [BLOCK_M, 128];
  qpacked  same rows, q repacked on the host (untimed; its own cost is reported as pack_q) to [8 * 512, 128] and
           loaded as a plain [BLOCK_M, 128] box;
  qhead    no GQA packing: a program owns BLOCK_M tokens of ONE query head (grid axis 1 = 16 q heads), plain box at
           (t0, h * 128) of q as [256, 16 * 128]; K/V read count equals the packed tiles' (4 x per KV block).
Offline sm_90a compiles with triton 3.6.0 (``--aot``, CPU) found: Hopper WS compiles only with qpacked / qhead
(qptr asserts in WSLowerToken.cpp processProducerCommitOp, qrdesc fails NVGPUWarpSpecialization); with
num_warps=4 it yields 12 warps (producer + 2 data-partitioned 4-warp consumers, setmaxnreg 40 / 232, 168 regs,
164 KB smem at 2 stages); with num_warps=8 no ttg.warp_specialize is emitted (silently not specialized).

Per (config, num_splits) the probe reports: correctness vs an fp32 torch reference (max abs error, max error /
max |ref|, allclose at atol 2e-2), CUDA-graph timing (median of 200 single-launch graph replays, plus a
10-launch graph for back-to-back time), TFLOP/s = 4 * 4096 * 32768 * 128 / t, registers / spills of the compiled
kernel, shared memory, total warps after WS and whether the TTGIR holds ``ttg.warp_specialize``.
Results: one line per (config, split) on stdout, JSON in ``$OUT/ws_probe.json`` (else in the git-ignored
bench/results/local/).

Robustness: the parent process never touches CUDA. It first compiles every config in parallel worker processes
(``JITFunction.warmup`` fills Triton's on-disk cache), then runs the measurements in a child process; if the child
crashes (illegal address from a WS miscompile, ...) or hangs (mbarrier deadlock), it is killed and a new child
resumes at the next config. Total wall time is bounded by ``--budget`` (default 140 s).

Modes (``P = python3 -m blockdiff.bench.experiments.probe_triton_hopper_ws``):
  P              GPU run (the default)
  P --tiny       CPU check of the math through TRITON_INTERPRET=1 (tiny shapes, all variants)
  P --aot        CPU: compile every config for sm_90a (no GPU), report WS ops / ptxas regs
  P --list       list the configs
  --only a,b,... restrict to named configs
"""
import argparse
import json
import math
import os
import queue
import re
import subprocess
import sys
import threading
import time
import traceback

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from blockdiff.bench.common import LOCAL_RESULTS_DIR  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------- workload
def workload(tiny):
    if tiny:
        return dict(n_tok=16, q_heads=4, kv_heads=2, head_dim=64, page=64, seq_len=256, num_pages=10, q_std=3.0)
    return dict(n_tok=256, q_heads=16, kv_heads=8, head_dim=128, page=64, seq_len=32768, num_pages=600, q_std=3.0)


# ------------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _kv_block(acc, l_i, m_i, q, j, bt_ptr, k_ptr, v_ptr, k_desc, v_desc, kvh, kv_tile, qk_scale,
              KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, KV_DESC: tl.constexpr,
              FP32_DOTS: tl.constexpr):
    """One key block j (= page bt[j]) of the online softmax (base 2, scale folded into qk_scale)."""
    page = tl.load(bt_ptr + j)
    row0 = page * BLOCK_N
    if KV_DESC:
        k = k_desc.load([row0, kvh * HEAD_DIM])
        v = v_desc.load([row0, kvh * HEAD_DIM])
    else:
        base = row0.to(tl.int64) * KV_STRIDE
        k = tl.load(k_ptr + base + kv_tile)
        v = tl.load(v_ptr + base + kv_tile)
    if FP32_DOTS:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, k.T)  # raw scores, fp32
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # running max in log2 units (no mask: always finite)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


# Q_MODE: how a program's Q rows are chosen / loaded
Q_PTR = 0  # GQA-interleaved rows (r -> token r // GP, head kvh * GP + r % GP) gathered with pointer loads
Q_RDESC = 1  # same rows through a descriptor over q as [n_tok, QH * D], box [BLOCK_M / GP, GP * D], reshaped
Q_PACKED = 2  # same rows, q pre-packed on the host into [KVH * n_tok * GP, D]: a plain 2D box [BLOCK_M, D]
Q_HEAD = 3  # no GQA packing: a program = BLOCK_M tokens of ONE query head (grid axis 1 = q head), 2D box at
#             (t0, h * D) of q as [n_tok, QH * D]; same K/V traffic as the packed tiles (128 rows per K/V read)
Q_MODE_NAMES = {Q_PTR: "ptr", Q_RDESC: "rdesc", Q_PACKED: "packed", Q_HEAD: "head"}


@triton.jit
def _probe_attn_fwd(
    q_ptr,  # [n_tok, Q_HEADS, HEAD_DIM] bf16 contiguous (Q_PACKED: [KV_HEADS * n_tok * GP, HEAD_DIM])
    k_ptr,  # [num_pages, PAGE, KV_HEADS, HEAD_DIM] bf16, contiguous
    v_ptr,  # same
    bt_ptr,  # [n_blocks] int32 page ids (row 0 of the block table)
    o_ptr,  # [num_splits, n_tok * Q_HEADS, HEAD_DIM] fp32 partial outputs
    lse_ptr,  # [num_splits, n_tok * Q_HEADS] fp32 natural-log LSE
    n_tok,  # query tokens
    kv_rows,  # num_pages * PAGE
    blocks_per_split,  # key blocks per program
    qk_scale,  # sm_scale * log2(e)
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GP: tl.constexpr,  # query heads per KV head (power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # == page size: key block j is page bt[j]
    KV_DESC: tl.constexpr,  # K/V via on-device TMA descriptors (else pointer loads)
    Q_MODE: tl.constexpr,  # see Q_PTR / Q_RDESC / Q_PACKED / Q_HEAD
    WS: tl.constexpr,  # tl.range(..., warp_specialize=WS)
    FP32_DOTS: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (fp32 copies) and tl.range fails
):
    pid_m = tl.program_id(0)
    split = tl.program_id(2)
    KV_STRIDE: tl.constexpr = KV_HEADS * HEAD_DIM  # elements between consecutive cache rows (row = page*PAGE+slot)
    Q_STRIDE: tl.constexpr = Q_HEADS * HEAD_DIM  # elements between consecutive query tokens
    TOK_PER_TILE: tl.constexpr = BLOCK_M // GP

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    if Q_MODE == 3:
        qh = tl.program_id(1)
        kvh = qh // GP
        tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        head = qh + 0 * tok
    else:
        kvh = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GP
        head = kvh * GP + rows % GP
    row_ok = tok < n_tok

    # ---- Q tile [BLOCK_M, HEAD_DIM]
    if Q_MODE == 0:
        q = tl.load(q_ptr + (tok * Q_STRIDE + head * HEAD_DIM)[:, None] + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0)
    elif Q_MODE == 1:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_tok, Q_STRIDE], strides=[Q_STRIDE, 1],
                                           block_shape=[TOK_PER_TILE, GP * HEAD_DIM])
        # [TOK_PER_TILE, GP * HEAD_DIM] row-major == [TOK_PER_TILE * GP, HEAD_DIM] with row t * GP + g
        q = q_desc.load([pid_m * TOK_PER_TILE, kvh * GP * HEAD_DIM]).reshape([BLOCK_M, HEAD_DIM])
    elif Q_MODE == 2:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[KV_HEADS * n_tok * GP, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q = q_desc.load([kvh * n_tok * GP + pid_m * BLOCK_M, 0])
    else:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_tok, Q_STRIDE], strides=[Q_STRIDE, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q = q_desc.load([pid_m * BLOCK_M, qh * HEAD_DIM])
    if FP32_DOTS:
        q = q.to(tl.float32)

    k_desc = k_ptr  # placeholders for the pointer variant (unused there)
    v_desc = v_ptr
    if KV_DESC:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[kv_rows, KV_STRIDE], strides=[KV_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[kv_rows, KV_STRIDE], strides=[KV_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    # loop-invariant in-page offsets for the pointer variant
    kv_tile = offs_n[:, None] * KV_STRIDE + kvh * HEAD_DIM + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo = split * blocks_per_split
    hi = lo + blocks_per_split
    if FP32_DOTS:
        # interpreter: tl.range over tensor bounds fails under numpy 2 (int() of a 1-element array)
        j = lo
        while j < hi:
            acc, l_i, m_i = _kv_block(acc, l_i, m_i, q, j, bt_ptr, k_ptr, v_ptr, k_desc, v_desc, kvh, kv_tile,
                                      qk_scale, KV_STRIDE, HEAD_DIM, BLOCK_N, KV_DESC, FP32_DOTS)
            j += 1
    else:
        for j in tl.range(lo, hi, warp_specialize=WS):
            acc, l_i, m_i = _kv_block(acc, l_i, m_i, q, j, bt_ptr, k_ptr, v_ptr, k_desc, v_desc, kvh, kv_tile,
                                      qk_scale, KV_STRIDE, HEAD_DIM, BLOCK_N, KV_DESC, FP32_DOTS)

    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
    grow = tok * Q_HEADS + head  # row of the [n_tok * Q_HEADS] output
    n_rows = n_tok * Q_HEADS
    o_base = o_ptr + split.to(tl.int64) * n_rows * HEAD_DIM
    tl.store(o_base + grow[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + split.to(tl.int64) * n_rows + grow, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------------------ configs
def build_configs(tiny):
    """Ordered by priority (the budget may cut the tail)."""
    cfgs = []

    def add(variant, q="ptr", nw=4, ns=2, maxnreg=None, bm=128):
        name = f"{variant}_q{q}_m{bm}_w{nw}_s{ns}" + (f"_r{maxnreg}" if maxnreg else "")
        qmode = {v: k for k, v in Q_MODE_NAMES.items()}[q]
        cfgs.append(dict(name=name, variant=variant, WS=variant == "ws", KV_DESC=variant in ("ws", "desc"),
                         Q_MODE=qmode, q=q, BLOCK_M=bm, num_warps=nw, num_stages=ns, maxnreg=maxnreg))

    if tiny:
        for variant in ("ws", "desc", "ptr"):
            for q in ("ptr", "rdesc", "packed", "head"):
                add(variant, q=q, bm=16)
        return cfgs
    # Offline sm_90a compiles (--aot, triton 3.6.0) showed that Hopper WS (NVGPUWarpSpecialization) only compiles
    # when Q comes from a plain 2D descriptor box: a pointer-loaded Q asserts in WSLowerToken.cpp
    # (processProducerCommitOp), a reshaped / joined descriptor Q fails the pass too. Hence Q_PACKED / Q_HEAD.
    add("ws", q="packed", nw=4, ns=2)
    add("desc", q="packed", nw=4, ns=2)  # exact WS=False twin of the previous (spills at 4 warps, see --aot)
    add("desc", q="packed", nw=8, ns=2)  # the sane non-WS config for 128-row tiles (no spills)
    add("ws", q="packed", nw=4, ns=3)
    add("desc", q="packed", nw=8, ns=3)
    add("desc", q="packed", nw=4, ns=3)
    add("ws", q="head", nw=4, ns=2)
    add("desc", q="head", nw=8, ns=2)
    add("ws", q="head", nw=4, ns=3)
    add("desc", q="head", nw=4, ns=2)
    add("desc", q="head", nw=4, ns=3)
    add("desc", nw=8, ns=3)  # GQA rows gathered by pointers, TMA K/V, no WS
    add("desc", nw=4, ns=2)
    add("desc", nw=4, ns=3)
    add("ws", q="packed", nw=8, ns=2)  # --aot: no ttg.warp_specialize at 8 warps (silently not specialized)
    # register cap: the 06-fused-attention tutorial passes maxnreg (168 fp16 hd128, else 80) with WS on Blackwell
    add("ws", q="packed", nw=4, ns=2, maxnreg=168)
    add("ws", q="packed", nw=4, ns=4)
    add("ptr", nw=8, ns=3)
    add("ptr", nw=4, ns=3)
    add("desc", nw=4, ns=3, bm=64)  # BLOCK_M 64 = the production kernel's tile for this workload
    add("ws", q="packed", nw=4, ns=3, bm=64)
    add("ws", nw=4, ns=2)  # expected compile failure (pointer Q), kept to document it
    add("ws", q="rdesc", nw=4, ns=2)  # expected compile failure (reshaped descriptor Q)
    return cfgs


def splits_for(tiny):
    return [1, 2, 4] if tiny else [4, 8, 16]  # 16: extra (more, shorter programs over 132 SMs)


# ---------------------------------------------------------------------------------------------------- data/ref
def make_data(w, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    nb = w["seq_len"] // w["page"]
    q = (torch.randn(w["n_tok"], w["q_heads"], w["head_dim"], generator=g) * w["q_std"]).to(torch.bfloat16)
    kc = torch.randn(w["num_pages"], w["page"], w["kv_heads"], w["head_dim"], generator=g).to(torch.bfloat16)
    vc = torch.randn(w["num_pages"], w["page"], w["kv_heads"], w["head_dim"], generator=g).to(torch.bfloat16)
    bt = torch.randperm(w["num_pages"], generator=g)[:nb].to(torch.int32).reshape(1, nb)
    d = dict(q=q.to(device), k=kc.to(device), v=vc.to(device), bt=bt.to(device))
    d["q_packed"] = pack_q(w, d["q"])
    return d


def pack_q(w, q):
    """[n_tok, QH, D] -> [KVH * n_tok * GP, D], row kvh * n_tok * GP + t * GP + g = (token t, head kvh * GP + g)."""
    gp = w["q_heads"] // w["kv_heads"]
    return q.view(w["n_tok"], w["kv_heads"], gp, w["head_dim"]).permute(1, 0, 2, 3).reshape(-1, w["head_dim"]) \
        .contiguous()


def reference(w, d):
    """fp32 dense softmax(q k^T * scale) v with K/V gathered through the block table. -> (out [T,H,D], lse [T,H])"""
    gp = w["q_heads"] // w["kv_heads"]
    scale = w["head_dim"] ** -0.5
    ks = d["k"][d["bt"][0].long()].reshape(-1, w["kv_heads"], w["head_dim"]).float()  # [S, KVH, D]
    vs = d["v"][d["bt"][0].long()].reshape(-1, w["kv_heads"], w["head_dim"]).float()
    out = torch.empty(w["n_tok"], w["q_heads"], w["head_dim"], dtype=torch.float32, device=d["q"].device)
    lse = torch.empty(w["n_tok"], w["q_heads"], dtype=torch.float32, device=d["q"].device)
    for h in range(w["kv_heads"]):
        qh = d["q"][:, h * gp:(h + 1) * gp, :].float().reshape(-1, w["head_dim"])  # rows (token, g)
        s = (qh @ ks[:, h, :].T) * scale
        out[:, h * gp:(h + 1) * gp, :] = (torch.softmax(s, dim=-1) @ vs[:, h, :]).reshape(w["n_tok"], gp, -1)
        lse[:, h * gp:(h + 1) * gp] = torch.logsumexp(s, dim=-1).reshape(w["n_tok"], gp)
    return out, lse


def merge(w, o_part, lse_part):
    m = lse_part.max(0).values
    wgt = torch.exp(lse_part - m)  # [S, R]
    den = wgt.sum(0)
    out = (wgt[:, :, None] * o_part).sum(0) / den[:, None]
    lse = m + torch.log(den)
    return out.reshape(w["n_tok"], w["q_heads"], w["head_dim"]), lse.reshape(w["n_tok"], w["q_heads"])


def kernel_args(w, d, o_part, lse_part, num_splits, cfg):
    nb = w["seq_len"] // w["page"]
    assert nb % num_splits == 0
    return (d["q_packed"] if cfg["Q_MODE"] == Q_PACKED else d["q"], d["k"], d["v"], d["bt"], o_part, lse_part, w["n_tok"], w["num_pages"] * w["page"],
            nb // num_splits, w["head_dim"] ** -0.5 * LOG2E)


def kernel_consts(w, cfg):
    return dict(Q_HEADS=w["q_heads"], KV_HEADS=w["kv_heads"], GP=w["q_heads"] // w["kv_heads"],
                HEAD_DIM=w["head_dim"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=w["page"], KV_DESC=cfg["KV_DESC"],
                Q_MODE=cfg["Q_MODE"], WS=cfg["WS"], FP32_DOTS=INTERPRET)


def launch_opts(cfg):
    o = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg["maxnreg"]:
        o["maxnreg"] = cfg["maxnreg"]
    return o


def grid_for(w, cfg, num_splits):
    if cfg["Q_MODE"] == Q_HEAD:
        assert w["n_tok"] % cfg["BLOCK_M"] == 0
        return (w["n_tok"] // cfg["BLOCK_M"], w["q_heads"], num_splits)
    rows = w["n_tok"] * (w["q_heads"] // w["kv_heads"])
    assert rows % cfg["BLOCK_M"] == 0
    return (rows // cfg["BLOCK_M"], w["kv_heads"], num_splits)


def set_allocator(device):
    # on-device tensor descriptors (and WS scratch) need a global-memory workspace per launch
    def alloc_fn(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc_fn)


def ir_facts(ck):
    """Facts from a CompiledKernel's IR: WS ops, warps, shared memory."""
    f = {}
    ttgir = ck.asm.get("ttgir", "")
    ptx = ck.asm.get("ptx", "")
    f["ttgir_warp_specialize"] = "ttg.warp_specialize" in ttgir
    f["ttgir_warp_specialize_count"] = ttgir.count("ttg.warp_specialize")
    f["ttgir_wgmma"] = ttgir.count("warp_group_dot ")
    m = re.search(r'"ttg.total-num-warps"\s*=\s*(\d+)', ttgir)
    f["ttgir_total_num_warps"] = int(m.group(1)) if m else None
    f["ttgir_partition_num_warps"] = [int(x) for x in re.findall(r"\bnum_warps\((\d+)\)", ttgir)]
    f["ttgir_requested_registers"] = [[int(x) for x in g.split(",") if x.strip()]
                                      for g in re.findall(r"requestedRegisters\s*=\s*array<i32:([^>]*)>", ttgir)]
    f["ttgir_tma_copies"] = ttgir.count("async_tma_copy_global_to_local")
    f["ptx_setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    md = ck.metadata
    f["num_warps_launched"] = getattr(md, "num_warps", None)
    f["shared_bytes"] = getattr(md, "shared", None)
    f["global_scratch_bytes"] = getattr(md, "global_scratch_size", None)
    return f


def short_err(e, n=1500):
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= n else s[:300] + " ... " + s[-(n - 300):]


def emit(rec, fh):
    if fh is not None:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()


def fmt_line(r):
    base = f"{r['config']:<24} splits={r.get('num_splits', '-')!s:<2} {r['status']:<13}"
    if r.get("ms_median") is not None:
        base += (f" {r['ms_median']:.4f} ms (b2b {r.get('ms_b2b', float('nan')):.4f})"
                 f" {r['tflops']:6.1f} TF/s")
    if r.get("max_abs_err") is not None:
        base += f" err={r['max_abs_err']:.2e} rel={r['max_rel_err']:.1e} lse_err={r['lse_max_err']:.1e}"
    for k, lab in (("n_regs", "regs"), ("n_spills", "spills"), ("num_warps_launched", "warps"),
                   ("shared_bytes", "smem")):
        if r.get(k) is not None:
            base += f" {lab}={r[k]}"
    if "ttgir_warp_specialize" in r:
        base += f" WS_in_ttgir={r['ttgir_warp_specialize']}"
    if r.get("ptx_setmaxnreg"):
        base += f" setmaxnreg={','.join(r['ptx_setmaxnreg'])}"
    if r.get("error"):
        base += " | " + r["error"].replace("\n", " ")[:300]
    return base


# ------------------------------------------------------------------------------------------- measuring worker
def time_graph(fn, n_launch, warm, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_launch):
            fn()
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) / n_launch for a, b in ev)
    del g
    return ts


def run_config(w, d, ref, cfg, fh, deadline, tiny, precompile_errors):
    dev = d["q"].device
    flops = 4.0 * w["n_tok"] * w["q_heads"] * w["seq_len"] * w["head_dim"]
    meta = {k: cfg[k] for k in ("variant", "WS", "KV_DESC", "q", "BLOCK_M", "num_warps", "num_stages",
                                 "maxnreg")}
    meta["BLOCK_N"] = w["page"]
    ck = None
    facts = {}
    compile_s = None
    for ns in splits_for(tiny):
        rec = dict(config=cfg["name"], num_splits=ns, **meta)
        grid = grid_for(w, cfg, ns)
        rec["grid"] = list(grid)
        rec["programs"] = grid[0] * grid[1] * grid[2]
        if time.time() > deadline:
            rec.update(status="skipped", error="time budget exhausted")
            emit(rec, fh)
            print(fmt_line(rec), flush=True)
            continue
        if cfg["name"] in precompile_errors:
            rec.update(status="compile_error", error=precompile_errors[cfg["name"]])
            emit(rec, fh)
            print(fmt_line(rec), flush=True)
            return
        o_part = torch.empty(ns, w["n_tok"] * w["q_heads"], w["head_dim"], dtype=torch.float32, device=dev)
        lse_part = torch.empty(ns, w["n_tok"] * w["q_heads"], dtype=torch.float32, device=dev)
        args = kernel_args(w, d, o_part, lse_part, ns, cfg)
        consts = kernel_consts(w, cfg)
        opts = launch_opts(cfg)

        def launch():
            return _probe_attn_fwd[grid](*args, **consts, **opts)

        stage = "compile"
        try:
            t0 = time.time()
            if ck is None and not INTERPRET:
                ck = _probe_attn_fwd.warmup(*args, grid=grid, **consts, **opts)
                if hasattr(ck, "result"):
                    ck = ck.result()
                compile_s = time.time() - t0
                facts = ir_facts(ck)
            rec["compile_s"] = compile_s
            rec.update(facts)
            stage = "launch"
            o_part.fill_(float("nan"))
            lse_part.fill_(float("nan"))
            launch()
            if not INTERPRET:
                torch.cuda.synchronize()
                if ck is not None:
                    ck._init_handles()
                    rec["n_regs"] = ck.n_regs
                    rec["n_spills"] = ck.n_spills
            stage = "check"
            out, lse = merge(w, o_part, lse_part)
            ref_out, ref_lse = ref
            err = (out - ref_out).abs()
            rec["max_abs_err"] = float(err.max()) if torch.isfinite(err).all() else float("inf")
            rec["max_rel_err"] = rec["max_abs_err"] / float(ref_out.abs().max())
            rec["ref_max_abs"] = float(ref_out.abs().max())
            lerr = (lse - ref_lse).abs()
            rec["lse_max_err"] = float(lerr.max()) if torch.isfinite(lerr).all() else float("inf")
            rec["allclose_atol2e-2"] = bool(torch.allclose(out, ref_out, atol=2e-2, rtol=0.0))
            ok = rec["allclose_atol2e-2"] and rec["max_rel_err"] < 2e-2 and rec["lse_max_err"] < 2e-2
            rec["status"] = "ok" if ok else "WRONG"
            if not INTERPRET:
                stage = "timing"
                ts = time_graph(launch, 1, 20, 200)
                rec["ms_median"] = ts[len(ts) // 2]
                rec["ms_p10"] = ts[len(ts) // 10]
                rec["ms_p90"] = ts[(9 * len(ts)) // 10]
                ts10 = time_graph(launch, 10, 3, 30)
                rec["ms_b2b"] = ts10[len(ts10) // 2]
                rec["tflops"] = flops / (rec["ms_median"] * 1e-3) / 1e12
                rec["tflops_b2b"] = flops / (rec["ms_b2b"] * 1e-3) / 1e12
        except Exception as e:  # per-config failure must not stop the others
            rec["status"] = f"{stage}_error"
            rec["error"] = short_err(e)
            rec["traceback_tail"] = traceback.format_exc()[-2000:]
            emit(rec, fh)
            print(fmt_line(rec), flush=True)
            msg = str(e).lower()
            if stage != "compile" and any(s in msg for s in ("illegal", "cuda error", "unspecified launch",
                                                                "misaligned", "device-side")):
                print("@@STICKY", flush=True)  # CUDA context is likely dead: let the parent restart us
                sys.stdout.flush()
                os._exit(3)
            if stage == "compile":
                return
            continue
        emit(rec, fh)
        print(fmt_line(rec), flush=True)


def env_record(tiny):
    r = dict(kind="env", triton=triton.__version__, torch=torch.__version__, interpret=INTERPRET, tiny=tiny)
    if torch.cuda.is_available() and not INTERPRET:
        p = torch.cuda.get_device_properties(0)
        r.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)), sms=p.multi_processor_count,
                 torch_cuda=torch.version.cuda)
    return r


def worker_main(args):
    tiny = args.tiny
    w = workload(tiny)
    cfgs = select_configs(args)
    dev = "cpu" if INTERPRET else "cuda"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    set_allocator(dev)
    fh = open(args.results, "a") if args.results else None
    if args.start == 0:
        emit(env_record(tiny), fh)
    precompile_errors = {}
    if args.precompile_results and os.path.exists(args.precompile_results):
        for line in open(args.precompile_results):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("status") == "compile_error":
                precompile_errors[r["config"]] = r["error"]
    d = make_data(w, dev)
    if dev == "cuda" and args.start == 0:
        try:  # what Q_PACKED would cost per step if q is not produced packed
            ts = time_graph(lambda: pack_q(w, d["q"]), 1, 5, 50)
            emit(dict(kind="pack_q", ms_median=ts[len(ts) // 2]), fh)
            print(f"pack_q (host-side Q repack for q=packed, not in kernel times): {ts[len(ts) // 2]:.4f} ms",
                  flush=True)
        except Exception as e:
            print("pack_q timing failed:", short_err(e), flush=True)
    ref = reference(w, d)
    deadline = args.deadline if args.deadline else float("inf")
    for i in range(args.start, len(cfgs)):
        print(f"@@START {i}", flush=True)
        # test hooks for the parent's crash / hang recovery (see --self-test)
        if os.environ.get("WS_PROBE_FAULT") == cfgs[i]["name"]:
            os._exit(7)
        if os.environ.get("WS_PROBE_HANG") == cfgs[i]["name"]:
            time.sleep(3600)
        if time.time() > deadline:
            for ns in splits_for(tiny):
                rec = dict(config=cfgs[i]["name"], num_splits=ns, status="skipped", error="time budget exhausted")
                emit(rec, fh)
                print(fmt_line(rec), flush=True)
        else:
            run_config(w, d, ref, cfgs[i], fh, deadline, tiny, precompile_errors)
        print(f"@@DONE {i}", flush=True)
    print("@@ALLDONE", flush=True)


# ------------------------------------------------------------------------------------------ precompile worker
def precompile_main(args):
    """Compile the named configs through JITFunction.warmup (fills the on-disk cache for the measuring child)."""
    w = workload(False)
    cfgs = {c["name"]: c for c in build_configs(False)}
    fh = open(args.precompile_results, "a")
    d = dict(q=torch.empty(16, dtype=torch.bfloat16, device="cuda"),
             k=torch.empty(16, dtype=torch.bfloat16, device="cuda"),
             v=torch.empty(16, dtype=torch.bfloat16, device="cuda"),
             bt=torch.empty(16, dtype=torch.int32, device="cuda"))
    d["q_packed"] = d["q"]
    o = torch.empty(16, dtype=torch.float32, device="cuda")
    lse = torch.empty(16, dtype=torch.float32, device="cuda")
    for name in args.names.split(","):
        cfg = cfgs[name]
        rec = dict(config=name, kind="precompile")
        t0 = time.time()
        try:
            # the splits only change the (runtime, 16-divisible) blocks_per_split: one compile serves all
            ck = _probe_attn_fwd.warmup(*kernel_args(w, d, o, lse, splits_for(False)[0], cfg), grid=(1, 1, 1),
                                        **kernel_consts(w, cfg), **launch_opts(cfg))
            if hasattr(ck, "result"):
                ck.result()
            rec.update(status="compiled", compile_s=time.time() - t0)
        except Exception as e:
            rec.update(status="compile_error", error=short_err(e), compile_s=time.time() - t0)
        emit(rec, fh)
        print(f"[precompile] {name}: {rec['status']} {rec['compile_s']:.1f}s", flush=True)


# ------------------------------------------------------------------------------------------------ AOT (no GPU)
def aot_main(args):
    """Compile every config for sm_90a on this machine (no GPU) and report IR facts + ptxas registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    w = workload(False)
    fn = _probe_attn_fwd
    results = []
    ptxas = None
    try:
        ptxas = triton.knobs.nvidia.ptxas.path
    except Exception:
        pass
    for cfg in select_configs(args):
        t0 = time.time()
        rec = dict(config=cfg["name"], mode="aot_sm90a", **{k: cfg[k] for k in ("variant", "q", "num_warps",
                                                                                   "num_stages", "maxnreg")})
        sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32",
                   n_tok="i32", kv_rows="i32", blocks_per_split="i32", qk_scale="fp32")
        consts = kernel_consts(w, cfg)
        consts["FP32_DOTS"] = False
        sig.update({k: "constexpr" for k in consts})
        assert list(sig) == list(fn.arg_names), fn.arg_names
        attrs = {(fn.arg_names.index(k), ): [["tt.divisibility", 16]]
                 for k in ("q_ptr", "k_ptr", "v_ptr", "bt_ptr", "o_ptr", "lse_ptr", "n_tok", "kv_rows",
                           "blocks_per_split")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k), ): v
                                                          for k, v in consts.items()}, attrs=attrs)
        try:
            ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_opts(cfg))
            rec.update(status="compiled", compile_s=round(time.time() - t0, 2), **ir_facts(ck))
            if ptxas:
                import tempfile
                with tempfile.TemporaryDirectory() as td:
                    p = os.path.join(td, "k.ptx")
                    open(p, "w").write(ck.asm["ptx"])
                    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", p, "-o", os.path.join(td, "k.cubin")],
                                       capture_output=True, text=True, timeout=300)
                    m = re.search(r"Used (\d+) registers", r.stderr)
                    rec["ptxas_regs"] = int(m.group(1)) if m else None
                    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
                    rec["ptxas_spill_stores"] = int(m.group(1)) if m else None
                    rec["ptxas_spill_loads"] = int(m.group(2)) if m else None
        except Exception as e:
            rec.update(status="compile_error", error=short_err(e), compile_s=round(time.time() - t0, 2))
        results.append(rec)
        keys = ("status", "compile_s", "ttgir_warp_specialize", "num_warps_launched", "ttgir_total_num_warps", "ttgir_partition_num_warps",
                "ttgir_requested_registers", "ttgir_tma_copies", "ttgir_wgmma", "shared_bytes", "ptx_setmaxnreg",
                "ptxas_regs", "ptxas_spill_stores", "ptxas_spill_loads", "error")
        print(cfg["name"], {k: rec[k] for k in keys if rec.get(k) not in (None, [], "")}, flush=True)
    out = os.path.join(aux_dir(), "ws_probe_aot.json")
    json.dump(results, open(out, "w"), indent=1)
    print("wrote", out)


# ------------------------------------------------------------------------------------------------------ parent
def aux_dir():
    """$OUT when set (so the logs come back with the JSON), else a ws_probe_aux/ folder in the system temp dir."""
    import tempfile

    d = os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "ws_probe_aux")
    os.makedirs(d, exist_ok=True)
    return d


def select_configs(args):
    cfgs = build_configs(args.tiny)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {c["name"] for c in cfgs}
        if unknown:
            raise SystemExit(f"unknown configs {sorted(unknown)}; --list shows them")
        cfgs = [c for c in cfgs if c["name"] in keep]
    return cfgs


def _reader(pipe, q):
    for line in iter(pipe.readline, ""):
        q.put(line)
    q.put(None)


def run_child(cmd, on_line, line_timeout_check, hard_deadline, err_fh):
    """Run a child process, stream its stdout; returns (returncode or 'killed', reason)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_fh, text=True, bufsize=1)
    q = queue.Queue()
    th = threading.Thread(target=_reader, args=(p.stdout, q), daemon=True)
    th.start()
    reason = None
    while True:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line:
            on_line(line.rstrip("\n"))
        why = line_timeout_check()
        if why is None and time.time() > hard_deadline:
            why = "global deadline"
        if why:
            reason = why
            p.kill()  # our own child, by handle
            break
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return (p.returncode if reason is None else "killed"), reason


def parent_main(args):
    t_start = time.time()
    json_dir = os.environ.get("OUT") or str(LOCAL_RESULTS_DIR)
    os.makedirs(json_dir, exist_ok=True)
    json_path = os.path.join(json_dir, "ws_probe.json")
    out_dir = aux_dir()  # partial results, precompile records, child stderr logs
    results_path = os.path.join(out_dir, "ws_probe.partial.jsonl")
    pre_path = os.path.join(out_dir, "ws_probe.precompile.jsonl")
    for p in (results_path, pre_path):
        if os.path.exists(p):
            os.remove(p)
    cfgs = select_configs(args)
    budget = args.budget
    me = [sys.executable, os.path.abspath(__file__)]
    common = (["--only", args.only] if args.only else []) + (["--tiny"] if args.tiny else [])
    notes = []

    # 1) parallel compile (the kernels are independent; compile is CPU-bound and single-threaded per kernel)
    pre_t0 = time.time()
    if not args.no_precompile and not args.tiny:
        n_par = max(1, min(args.jobs, len(cfgs)))
        groups = [[c["name"] for c in cfgs[i::n_par]] for i in range(n_par)]
        pre_err = open(os.path.join(out_dir, "ws_probe.precompile.stderr.log"), "w")  # MLIR dumps of WS failures
        procs = [subprocess.Popen(me + ["--precompile-worker", "--names", ",".join(g), "--precompile-results",
                                        pre_path], stderr=pre_err) for g in groups if g]
        pre_deadline = t_start + args.precompile_budget
        for p in procs:
            try:
                p.wait(timeout=max(1.0, pre_deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()  # our own child
                p.wait()
                notes.append("a precompile worker hit the precompile budget and was killed")
    pre_s = time.time() - pre_t0
    print(f"[parent] precompile phase {pre_s:.1f}s", flush=True)

    # 2) measurements in a child; restart after a crash / hang at the next config
    hard_deadline = t_start + budget
    soft_deadline = hard_deadline - args.margin  # the child starts no new measurement after this
    idx = 0
    n_child = 0
    state = {"cur": None, "cur_t": None, "done": set()}
    crashed = {}

    def on_line(line):
        if line.startswith("@@START "):
            state["cur"] = int(line.split()[1])
            state["cur_t"] = time.time()
        elif line.startswith("@@DONE "):
            state["done"].add(int(line.split()[1]))
            state["cur"] = None
        elif line.startswith("@@"):
            pass
        else:
            print(line, flush=True)

    def check():
        if state["cur"] is not None and time.time() - state["cur_t"] > args.config_timeout:
            return f"config {cfgs[state['cur']]['name']} exceeded {args.config_timeout}s (hang?)"
        return None

    while idx < len(cfgs) and time.time() < soft_deadline:
        state["cur"] = None
        cmd = me + ["--worker", "--start", str(idx), "--results", results_path, "--precompile-results", pre_path,
                    "--deadline", str(soft_deadline)] + common
        err_path = os.path.join(out_dir, f"ws_probe.child{n_child}.stderr.log")
        n_child += 1
        with open(err_path, "w") as err_fh:
            rc, reason = run_child(cmd, on_line, check, hard_deadline, err_fh)
        if rc != 0 or reason:
            tail = open(err_path, errors="replace").read()[-1500:]
            print(f"[parent] child stderr tail ({err_path}):\n{tail}", flush=True)
        if rc == 0 and not reason:
            break
        bad = state["cur"]
        if bad is None:
            notes.append(f"measuring child exited rc={rc} reason={reason} outside a config")
            break
        crashed[cfgs[bad]["name"]] = f"child rc={rc} {reason or ''}".strip()
        print(f"[parent] config {cfgs[bad]['name']} killed the child (rc={rc}, {reason}); resuming after it",
              flush=True)
        idx = bad + 1

    # 3) assemble
    env = {}
    recs = []
    if os.path.exists(results_path):
        for line in open(results_path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "env":
                env = r
            elif r.get("kind") == "pack_q":
                env["pack_q_ms"] = r["ms_median"]
            else:
                recs.append(r)
    pre = []
    if os.path.exists(pre_path):
        for line in open(pre_path):
            try:
                pre.append(json.loads(line))
            except ValueError:
                pass
    seen = {(r["config"], r.get("num_splits")) for r in recs}
    for c in cfgs:
        for ns in splits_for(args.tiny):
            if (c["name"], ns) not in seen:
                st = "crashed" if c["name"] in crashed else "not_run"
                r = dict(config=c["name"], num_splits=ns, variant=c["variant"], WS=c["WS"], q=c["q"],
                         BLOCK_M=c["BLOCK_M"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                         maxnreg=c["maxnreg"], status=st,
                         error=crashed.get(c["name"], "time budget / not reached"))
                recs.append(r)
                print(fmt_line(r), flush=True)

    summary = {}
    for ns in splits_for(args.tiny):
        def best(pred):
            ok = [r for r in recs if r.get("num_splits") == ns and r.get("status") == "ok" and pred(r)
                  and r.get("ms_median")]
            return min(ok, key=lambda r: r["ms_median"]) if ok else None
        b_ws = best(lambda r: r.get("WS") and r.get("ttgir_warp_specialize"))
        b_ws_any = best(lambda r: r.get("WS"))
        b_desc = best(lambda r: r.get("variant") == "desc")
        b_ptr = best(lambda r: r.get("variant") == "ptr")
        s = {}
        for lab, b in (("best_ws_really_specialized", b_ws), ("best_ws_flag", b_ws_any), ("best_desc_no_ws", b_desc),
                       ("best_ptr", b_ptr)):
            s[lab] = None if b is None else dict(config=b["config"], ms=b["ms_median"], tflops=b["tflops"])
        if b_ws and b_desc:
            s["ws_speedup_vs_desc"] = b_desc["ms_median"] / b_ws["ms_median"]
        summary[f"splits{ns}"] = s
    # WS vs its exact WS=False twin (same Q mode / tile / warps / stages)
    pairs = []
    by_key = {(r["config"], r.get("num_splits")): r for r in recs}
    for r in recs:
        if r.get("WS") and r.get("status") == "ok" and r.get("ms_median"):
            twin = r["config"].replace("ws_", "desc_", 1)
            twin = re.sub(r"_r\d+$", "", twin)
            t = by_key.get((twin, r.get("num_splits")))
            if t and t.get("status") == "ok" and t.get("ms_median"):
                pairs.append(dict(ws=r["config"], twin=twin, num_splits=r["num_splits"],
                                  ws_specialized=r.get("ttgir_warp_specialize"), ws_ms=r["ms_median"],
                                  twin_ms=t["ms_median"], speedup=t["ms_median"] / r["ms_median"]))
    for pr in pairs:
        print(f"[pair] splits={pr['num_splits']} {pr['ws']} ({'WS' if pr['ws_specialized'] else 'no WS in IR'}) "
              f"{pr['ws_ms']:.4f} ms vs {pr['twin']} {pr['twin_ms']:.4f} ms -> speedup {pr['speedup']:.3f}x",
              flush=True)
    ranked = sorted((r for r in recs if r.get("ms_median")), key=lambda r: r["ms_median"])
    print("[parent] ranking (median ms, CUDA graph, single launch):", flush=True)
    for r in ranked:
        print(f"  {r['ms_median']:.4f} ms {r['tflops']:6.1f} TF/s splits={r['num_splits']} {r['config']:<28} "
              f"{r['status']} WS_in_ir={r.get('ttgir_warp_specialize')} regs={r.get('n_regs')} "
              f"spills={r.get('n_spills')}", flush=True)
    doc = dict(probe="ws_probe", workload="canvas_bs1_ctx32k_hd128", env=env, wall_s=time.time() - t_start,
               precompile_s=pre_s, precompile=pre, budget_s=budget, notes=notes, crashed=crashed,
               summary=summary, ws_vs_twin=pairs, results=recs)
    json.dump(doc, open(json_path, "w"), indent=1)
    print("[parent] summary:", json.dumps(summary, indent=1), flush=True)
    print(f"[parent] wrote {json_path} ({len(recs)} records, {time.time() - t_start:.1f}s)", flush=True)


# -------------------------------------------------------------------------------------------------------- tiny
def tiny_main(args):
    """Interpreter check of the math (CPU): every variant, tiny shapes, several split counts."""
    assert INTERPRET
    w = workload(True)
    set_allocator("cpu")
    d = make_data(w, "cpu")
    ref = reference(w, d)
    out = os.path.join(aux_dir(), "ws_probe_tiny.jsonl")
    if os.path.exists(out):
        os.remove(out)
    fh = open(out, "a")
    n_bad = 0
    for cfg in select_configs(args):
        run_config(w, d, ref, cfg, fh, float("inf"), True, {})
    fh.close()
    for line in open(out):
        r = json.loads(line)
        n_bad += r.get("status") != "ok"
    print(f"tiny: {'ALL OK' if n_bad == 0 else f'{n_bad} BAD'} ({out})")
    return 1 if n_bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter check with tiny shapes")
    ap.add_argument("--aot", action="store_true", help="CPU: compile all configs for sm_90a, no GPU needed")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--budget", type=float, default=140.0, help="total wall-clock budget in seconds")
    ap.add_argument("--margin", type=float, default=12.0, help="no new measurement this close to the budget end")
    ap.add_argument("--precompile-budget", type=float, default=80.0)
    ap.add_argument("--config-timeout", type=float, default=30.0, help="per-config limit (hang detection)")
    ap.add_argument("--jobs", type=int, default=min(6, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--orchestrate", action="store_true", help="with --tiny: run through the parent/child path")
    # internal
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precompile-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--names", default="", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--results", default="", help=argparse.SUPPRESS)
    ap.add_argument("--precompile-results", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.list:
        for c in select_configs(args):
            print(c["name"], {k: c[k] for k in ("variant", "q", "BLOCK_M", "num_warps", "num_stages",
                                                 "maxnreg")})
        return 0
    if args.tiny and args.orchestrate and not args.worker:
        return parent_main(args)  # CPU test of the parent/child machinery (interpreter children, no timing)
    if args.tiny and not args.worker:
        return tiny_main(args)
    if args.aot:
        return aot_main(args)
    if args.precompile_worker:
        return precompile_main(args)
    if args.worker:
        return worker_main(args)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny (interpreter) or --aot (sm_90a compile only) on a CPU box")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main() or 0)
