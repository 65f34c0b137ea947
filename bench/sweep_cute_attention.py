"""Tile-config sweep of the CuTe attention backend against FA4, on the issue-4 workloads (H200; < 4 min).

Usage (GPU; ``source bench/device_env.sh`` and flash-attn-4 + CuTe DSL importable):

    python3 -m blockdiff.bench.sweep_cute_attention --budget-s 200
    python3 -m blockdiff.bench.sweep_cute_attention --candidates default,hd128_n64_tma --workloads 'canvas_*'
    python3 -m blockdiff.bench.sweep_cute_attention --quick        # CPU dry run: print the plan, exit 0 (no CUDA, no FA4)

What runs, in one process and one GPU warm-up:
  1. Workloads ``mixed_sliding_ctx8k``, ``canvas_bs4_ctx4k_hd128``, ``prefill16k_hd128``,
     ``canvas_bs1_ctx32k_sliding`` built by bench/workloads.py (paged, page 64, permuted block table), and per
     workload the fp32-SDPA ground truth of bench_attention.py (``ground_truth(batch, "sdpa")``).
  2. FA4 anchors: ``flash_attn.cute.flash_attn_varlen_func`` called twice (causal sequences, then bidirectional
     ones; windows (W, 0) / (W, W)), on the same paged cache and on contiguous K/V (bench_attention.make_fa4).
  3. The cute backend's candidates (:data:`CANDIDATES`): ``config=`` of ``attention_cute`` is tile_m, tile_n,
     mma_pv_is_rs, intra_wg_overlap, num_stages (FA4 SM90's kernel knobs; pack_gqa is fixed to FA4's own rule,
     on for GQA). A candidate serves every workload of its head dim with ONE compile (the compile key holds no
     lengths), so candidates are grouped by head dim. Candidates that cannot fit shared memory / registers by
     FA4's own feasibility rule (flash_attn/cute/sm90_config_search.py) are recorded as skipped, not compiled.
     Each candidate/workload: NaN-poisoned ``out``, one checked call (compiles on first use), correctness
     (isfinite; max abs error <= 2x the bf16 SDPA error + bf16 representation tolerance); only a correct
     config is timed: CUDA-graph replay median and eager median (bench/common.py, triton do_bench).
  Every candidate runs inside try/except (the traceback is printed and recorded); a compile failure skips the
  candidate's other workloads; a lost CUDA context ends the sweep with what was measured. No candidate is
  started after ``--budget-s`` seconds (default 200; FA4 and the default config run first, then candidates
  best guess first). A candidate running longer than ``--config-timeout-s`` (a pipeline deadlock) dumps the
  stacks and exits; the records written so far stay.

Outputs (``$OUT`` if set, else bench/results/): ``cute_sweep-<gpu>.json`` (+ .csv: write_records) with env
(gpu, driver, torch, triton, flash_attn_4, commit, date) and one row per (workload, backend, config):
graph_ms, eager_ms, effective_tflops, correct, ...; ``cute_sweep-<gpu>.md`` with every row and the best config
per workload. Printed last: the summary table, best config per workload with its ratio to FA4 (against the
faster FA4 layout, as GPU_RESULTS_1 does, and against FA4 paged) and the issue-4 target verdict, and the
config that would be the best default per head dim.

Issue-4 targets (CUDA-graph ms, same run): mixed_sliding_ctx8k <= 0.9x FA4's two launches; prefill16k_hd128
throughput >= 0.95x FA4 (ms ratio <= 1/0.95); canvas_bs4_ctx4k_hd128 <= 1.0x FA4.
"""
from __future__ import annotations

import argparse
import faulthandler
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockdiff.attention import causal_row_counts
from blockdiff.attention.cute import attention_cute
from blockdiff.attention.cute.blocks import tile_plan
from blockdiff.attention.cute.config import (SMEM_LIMIT_BYTES, CuteConfig, config_smem_bytes, kv_load_path,
                                            resolve_config)
from blockdiff.attention.testing import REPRESENTATION_ATOL
from blockdiff.bench import bench_attention as ba
from blockdiff.bench import common
from blockdiff.bench import workloads as wl

SUITE = "cute_sweep"
DEFAULT_WORKLOADS = ("mixed_sliding_ctx8k", "canvas_bs4_ctx4k_hd128", "prefill16k_hd128", "canvas_bs1_ctx32k_sliding")
#: Issue-4 targets: the largest allowed ratio cute graph_ms / FA4 graph_ms.
TARGETS = {"mixed_sliding_ctx8k": 0.9, "prefill16k_hd128": 1.0 / 0.95, "canvas_bs4_ctx4k_hd128": 1.0}
#: H100/H200 opt-in shared memory per block (227 KB) and FA4's search's per-WG register budget.
REG_LIMIT = {1: 216, 2: 216, 3: 128}
NUM_SMS = 132


@dataclass(frozen=True)
class Candidate:
    """One static configuration of the cute kernel for one head dim (None fields: FA4's SM90 heuristic)."""

    name: str
    head_dim: int
    tile_m: int | None = None
    tile_n: int | None = None
    mma_pv_is_rs: bool | None = None
    intra_wg_overlap: bool | None = None
    num_stages: int = 2
    why: str = field(default="", compare=False)

    @property
    def is_default(self) -> bool:
        return self.tile_m is None and self.tile_n is None and self.mma_pv_is_rs is None \
            and self.intra_wg_overlap is None and self.num_stages == 2

    def config(self) -> dict | None:
        """The ``config=`` argument of attention_cute (None for the default)."""
        if self.is_default:
            return None
        return dict(tile_m=self.tile_m, tile_n=self.tile_n, mma_pv_is_rs=self.mma_pv_is_rs,
                    intra_wg_overlap=self.intra_wg_overlap, num_stages=self.num_stages)


def fa4_sm90_default(head_dim: int, head_dim_v: int, is_causal: bool, is_local: bool) -> dict:
    """FA4 4.0.0b36's SM90 forward tile heuristic (flash_attn/cute/interface.py ``_tile_size_fwd_sm90``), mirrored
    here for the CPU dry run; on the GPU the real function is used (cute_attention.resolve_config)."""
    if head_dim <= 64:
        m, n, rs, ol = 192, 128, True, True
    elif head_dim <= 96:
        m, n, rs, ol = 192, (128 if is_causal or is_local else 144), False, True
    elif head_dim <= 128:
        m, n, rs, ol = 128, 128, True, True
    elif head_dim <= 192:
        m, n, rs, ol = 128, (96 if is_local else (128 if head_dim_v <= 128 else 112)), True, True
    else:
        m, n, rs, ol = 128, (64 if is_local else 80), True, True
    return dict(tile_m=m, tile_n=n, mma_pv_is_rs=rs, intra_wg_overlap=ol, num_stages=2)


#: Candidates, best guess first within each head dim; the run interleaves the head dims in this order.
#: Page size 64 (bench/workloads.py). The ``why`` notes are from the sweep of bench/results/cute_sweep-h200.json,
#: when tile_n == 64 was the only width with TMA paged K/V loads (FA4's producer: TMA only when page_size == tile_n,
#: else cp.async with per-row page lookups). Since the page-box producer (attention.cute.config.kv_load_path) every
#: tile_n that is a multiple of 64 loads by TMA at page 64; 80, 160 and 176 stay cp.async.
CANDIDATES = [
    Candidate("default", 128, why="FA4 SM90 heuristic (hd128: 128x128 RS+overlap, 2 stages); non-TMA paged at page 64"),
    Candidate("default", 256, why="FA4 SM90 heuristic, local (hd256: 128x64 RS+overlap); TMA paged at page 64"),
    Candidate("hd128_n64_tma", 128, 128, 64, True, True, 2,
              why="tile_n = page_size: TMA paged K/V like FA4 on contiguous K/V (0.059 vs 0.069 ms paged)"),
    Candidate("hd256_m64", 256, 64, 64, True, True, 2,
              why="1 MMA warpgroup, half the rows per CTA: 2x the CTAs (canvas_bs1 has 32 CTAs of 128) and a "
                  "finer last wave for mixed"),
    Candidate("hd128_n176", 128, 128, 176, True, True, 2,
              why="FA3 C++ non-causal hd128 width (fewer, larger K/V blocks; 208 KB); non-TMA"),
    Candidate("hd128_n64_tma_s4", 128, 128, 64, True, True, 4,
              why="TMA paged plus a deeper K/V pipeline for the memory-bound canvas (160 KB smem)"),
    Candidate("hd256_noRS", 256, 128, 64, False, True, 2, why="P through shared memory (FA3 C++ style), 208 KB"),
    Candidate("hd128_m192", 128, 192, 128, True, False, 2,
              why="3 MMA warpgroups (FA4 search: feasible without overlap): K/V read by 3 instead of 4 m-blocks"),
    Candidate("hd256_n80", 256, 128, 80, True, True, 2, why="FA4's non-local hd256 tile (224 KB); non-TMA"),
    Candidate("hd128_s3", 128, 128, 128, True, True, 3,
              why="deeper cp.async pipeline for the non-TMA paged path (224 KB)"),
    Candidate("hd256_noOL", 256, 128, 64, True, False, 2, why="no intra-warpgroup overlap (fewer live registers)"),
    Candidate("hd256_m64_s3", 256, 64, 64, True, True, 3, why="1 MMA warpgroup with 3 K/V stages (224 KB)"),
    Candidate("hd128_noRS", 128, 128, 128, False, True, 2, why="P through shared memory (192 KB)"),
    Candidate("hd128_m192_n64_tma", 128, 192, 64, True, False, 3,
              why="3 warpgroups and TMA paged loads, 3 stages (144 KB)"),
    Candidate("hd128_n160", 128, 128, 160, True, True, 2, why="between 128 and 176 (192 KB); non-TMA"),
]


def resolved_static(c: Candidate, window: bool) -> dict:
    """Config with defaults filled by FA4's heuristic mirror (host only)."""
    base = fa4_sm90_default(c.head_dim, c.head_dim, False, window)
    return dict(tile_m=c.tile_m or base["tile_m"], tile_n=c.tile_n or base["tile_n"],
                mma_pv_is_rs=base["mma_pv_is_rs"] if c.mma_pv_is_rs is None else c.mma_pv_is_rs,
                intra_wg_overlap=base["intra_wg_overlap"] if c.intra_wg_overlap is None else c.intra_wg_overlap,
                num_stages=c.num_stages)


def feasibility(cfg: dict, head_dim: int, head_dim_v: int) -> tuple[bool, str, int]:
    """FA4's SM90 forward feasibility rule (sm90_config_search.py) extended to 1 warpgroup and num_stages.

    Returns (ok, reason, smem_bytes). Shared memory: Q (O reuses it) + stages x (K + V) + P when not RS.
    Registers per MMA thread: S + O (+ P when overlapped).
    """
    m, n, s = cfg["tile_m"], cfg["tile_n"], cfg["num_stages"]
    if m % 64 or not 1 <= m // 64 <= 3:
        return False, f"tile_m {m} is not 64, 128 or 192 (one to three MMA warpgroups)", 0
    if n % 16 or n > 256:
        return False, f"tile_n {n} not a multiple of 16 in [16, 256]", 0
    nwg = m // 64
    smem = config_smem_bytes(CuteConfig(**cfg), head_dim, head_dim_v)
    regs_s = m * n // (nwg * 128)
    regs = regs_s + m * head_dim_v // (nwg * 128) + (regs_s // 2 if cfg["intra_wg_overlap"] else 0)
    if smem > SMEM_LIMIT_BYTES:
        return False, f"shared memory {smem / 1024:.0f} KB > {SMEM_LIMIT_BYTES / 1024:.0f} KB", smem
    if regs > REG_LIMIT[nwg]:
        return False, f"accumulator registers {regs} > {REG_LIMIT[nwg]} per thread ({nwg} warpgroups)", smem
    return True, "", smem


def work_estimate(w: wl.Workload, cfg: dict) -> dict:
    """CTAs (work tiles) and K/V block iterations of the kernel for workload ``w`` (host mirror tile_plan)."""

    qpk = w.num_heads // w.num_kv_heads
    heads = w.num_kv_heads if qpk > 1 else w.num_heads  # PackGQA: one tile row block per KV head
    ctas = iters = 0
    for ql, sl, causal in zip(w.q_lens, w.seq_lens, w.causal):
        plan = tile_plan(ql, sl, ql if causal else 0, w.window_size, w.bidirectional_window,
                         tile_m=cfg["tile_m"], tile_n=cfg["tile_n"], qhead_per_kvhead=qpk)
        ctas += len(plan) * heads
        iters += sum(p["n_block_max"] - p["n_block_min"] for p in plan) * heads
    return dict(ctas=ctas, block_iters=iters, waves=round(ctas / NUM_SMS, 2))


def static_label(c: Candidate, w: wl.Workload) -> str:
    """Label with the host-resolved config (rows that never reached resolve_config)."""
    return label(c, resolved_static(c, w.window_size is not None))


def label(c: Candidate, cfg: dict | None = None) -> str:
    cfg = cfg or {}
    s = f"{c.name}"
    if cfg:
        s += (f"[{cfg['tile_m']}x{cfg['tile_n']},{'RS' if cfg['mma_pv_is_rs'] else 'SS'},"
              f"{'OL' if cfg['intra_wg_overlap'] else 'noOL'},s{cfg['num_stages']}]")
    return s


# ----------------------------------------------------------------------------------------------- plan
def plan(args, workloads: list[wl.Workload]) -> list[tuple[Candidate, list[wl.Workload]]]:
    """(candidate, workloads of its head dim), in run order; candidates without a workload are dropped."""
    names = None if args.candidates in ("", "all") else {x.strip() for x in args.candidates.split(",") if x.strip()}
    if names is not None:
        unknown = names - {c.name for c in CANDIDATES}
        if unknown:
            choices = sorted({c.name for c in CANDIDATES})
            raise SystemExit(f"--candidates: unknown {sorted(unknown)}; choose from {choices}")
    out = []
    for c in CANDIDATES:
        if names is not None and c.name not in names:
            continue
        ws = [w for w in workloads if w.head_dim == c.head_dim and w.head_dim_v == c.head_dim]
        if ws:
            out.append((c, ws))
    if args.max_candidates is not None:
        defaults = [x for x in out if x[0].is_default]
        others = [x for x in out if not x[0].is_default][: max(0, args.max_candidates)]
        out = defaults + others
    return out


def print_plan(runs, page_size: int) -> None:
    print(f"cute sweep plan: {len(runs)} candidate compiles (defaults first), page_size {page_size}")
    for c, ws in runs:
        cfg = resolved_static(c, ws[0].window_size is not None)
        ok, why_not, smem = feasibility(cfg, c.head_dim, c.head_dim)
        print(f"- hd{c.head_dim} {label(c, cfg)}  smem~{smem / 1024:.0f}KB  "
              f"{'feasible' if ok else 'SKIP: ' + why_not}\n    {c.why}")
        for w in ws:
            est = work_estimate(w, cfg)
            tma = kv_load_path(page_size, cfg["tile_n"])
            print(f"    {w.name}: {tma} paged K/V, {est['ctas']} CTAs ({est['waves']} waves of {NUM_SMS}), "
                  f"{est['block_iters']} K/V block iterations")


# ----------------------------------------------------------------------------------------------- GPU pieces
class CudaContextLost(RuntimeError):
    pass


def _cuda_ok() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error
        return False


def base_row(w: wl.Workload, batch, backend: str) -> dict:
    pairs = w.allowed_pairs()
    return {"workload": w.name, "backend": backend, "status": "ok", "config": None, "graph_ms": None,
            "eager_ms": None, "effective_tflops": None, "correct": None, "allowed_pairs": pairs,
            "flops": common.attention_flops(w.num_heads, w.head_dim, pairs, w.head_dim_v),
            "page_size": batch.page_size, "head_dim": w.head_dim, "window_size": w.window_size,
            "anchor_ms": w.anchors_ms.get(backend)}


def measure_cute(batch, cand: Candidate, gold, base_err: float, args) -> dict:
    """One candidate on one workload: poisoned checked call (compiles first time), then graph/eager medians."""

    w = batch.workload
    row = base_row(w, batch, "cute")
    try:
        cfg = resolve_config(w.head_dim, w.head_dim_v, w.window_size, cand.config(), page_size=batch.page_size)
    except ValueError as e:  # does not fit SM90 shared memory
        row.update(candidate=cand.name, label=static_label(cand, w), status="skipped", reason=str(e))
        return row
    cfg_d = dict(tile_m=cfg.tile_m, tile_n=cfg.tile_n, mma_pv_is_rs=cfg.mma_pv_is_rs,
                 intra_wg_overlap=cfg.intra_wg_overlap, num_stages=cfg.num_stages)
    row.update(candidate=cand.name, config=cfg_d, label=label(cand, cfg_d), why=cand.why,
               paged_kv_tma=kv_load_path(batch.page_size, cfg.tile_n), **work_estimate(w, cfg_d))
    ok, why_not, smem = feasibility(cfg_d, w.head_dim, w.head_dim_v)
    row["smem_bytes_est"] = smem
    if not ok:
        row.update(status="skipped", reason=f"infeasible by FA4's SM90 rule: {why_not}")
        return row
    out = torch.empty(w.total_q, w.num_heads, w.head_dim_v, dtype=batch.q.dtype, device=batch.q.device)
    kwargs = batch.attn_kwargs()
    kwargs["config"] = cand.config()
    # per-step metadata outside the timing, as bench_attention.make_blockdiff does (the flags as causal row counts)
    kwargs["num_causal_q"] = causal_row_counts(kwargs.pop("causal"), kwargs["cu_seqlens_q"])

    def fn():
        return attention_cute(batch.q, batch.k_cache, batch.v_cache, out=out, check_values=False, **kwargs)

    out.fill_(float("nan"))
    t0 = time.perf_counter()
    attention_cute(batch.q, batch.k_cache, batch.v_cache, out=out, **kwargs)  # value checks on; compiles
    torch.cuda.synchronize()
    row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
    finite = bool(torch.isfinite(out).all())
    err = float((out.to(gold.dtype) - gold).abs().max())
    tol = 2.0 * base_err + _repr_tol(batch.q.dtype)
    row.update(max_abs_err=err if math.isfinite(err) else None, tol=tol, correct=finite and err <= tol)
    if not row["correct"]:
        row.update(status="incorrect", reason=f"finite={finite} max_abs_err={err:.3g} > tol {tol:.3g}: not timed")
        return row
    row["graph_ms"] = common.time_graph_ms(fn)
    if not args.no_eager:
        row["eager_ms"] = common.time_eager_ms(fn, batch.q.device)
    row["effective_tflops"] = common.tflops(row["flops"], row["graph_ms"])
    row["share_of_peak"] = common.share_of_peak(row["effective_tflops"])
    return row


def _repr_tol(dtype) -> float:
    return REPRESENTATION_ATOL.get(dtype, 1e-6)


def measure_fa4(ba, batch, layout: str, gold, base_err: float, args) -> dict:
    """FA4 two-launch anchor through bench_attention.measure (same check and timers as bench_attention)."""
    w = batch.workload
    ns = argparse.Namespace(cpu_reps=0, no_graph=False)
    row = ba.measure(batch, "fa4", lambda: ba.make_fa4(batch, ns, layout), ns, gold, base_err, {"kv_layout": layout})
    try:
        from flash_attn.cute.interface import _tile_size_fwd_sm90

        cfgs = {}
        for flag in sorted(set(w.causal)):
            local = w.window_size is not None
            c = _tile_size_fwd_sm90(w.head_dim, w.head_dim_v, flag and not local, local)
            cfgs["causal" if flag else "bidirectional"] = dict(
                tile_m=c.m_block_size, tile_n=c.n_block_size, mma_pv_is_rs=c.mma_pv_is_rs,
                intra_wg_overlap=c.intra_wg_overlap, num_stages=2,
                paged_kv_tma=layout == "contiguous" or batch.page_size == c.n_block_size)
        row["config"] = cfgs
    except Exception as e:  # noqa: BLE001 - informative only
        row["config_error"] = f"{type(e).__name__}: {e}"
    row["label"] = f"fa4[{layout}]"
    return row


# ----------------------------------------------------------------------------------------------- summary
def _ms(r):
    return r.get("graph_ms") if r.get("status") == "ok" and r.get("correct") else None


def summarize(rows: list[dict], workload_names: list[str]) -> tuple[list[dict], list[str]]:
    """Best config per workload with ratios to FA4; recommended default per head dim (geomean vs default)."""
    best_rows, lines = [], []
    for name in workload_names:
        rs = [r for r in rows if r.get("workload") == name]
        fa4 = {r.get("kv_layout"): _ms(r) for r in rs if r.get("backend") == "fa4"}
        fa4_best = min([v for v in fa4.values() if v], default=None)
        cute = [r for r in rs if r.get("backend") == "cute" and _ms(r)]
        default = next((r for r in cute if r.get("candidate") == "default"), None)
        best = min(cute, key=_ms, default=None)
        target = TARGETS.get(name)
        b = {"workload": name, "best": best["label"] if best else None, "best_ms": _ms(best) if best else None,
             "default_ms": _ms(default) if default else None, "fa4_paged_ms": fa4.get("paged"),
             "fa4_contig_ms": fa4.get("contiguous")}
        b["ratio_vs_fa4"] = b["best_ms"] / fa4_best if b["best_ms"] and fa4_best else None
        b["ratio_vs_fa4_paged"] = b["best_ms"] / fa4["paged"] if b["best_ms"] and fa4.get("paged") else None
        b["default_ratio"] = b["default_ms"] / fa4_best if b["default_ms"] and fa4_best else None
        b["target"] = f"<= {target:.3f}" if target else "-"
        b["met"] = None if target is None or b["ratio_vs_fa4"] is None else b["ratio_vs_fa4"] <= target
        best_rows.append(b)
    # recommended default per head dim: correct on every measured workload of that head dim, lowest geomean
    for hd in sorted({r.get("head_dim") for r in rows if r.get("backend") == "cute" and r.get("head_dim")}):
        cute = [r for r in rows if r.get("backend") == "cute" and r.get("head_dim") == hd]
        wnames = sorted({r["workload"] for r in cute})
        dflt = {r["workload"]: _ms(r) for r in cute if r.get("candidate") == "default"}
        by_cand: dict[str, dict] = {}
        for r in cute:
            by_cand.setdefault(r.get("label") or r.get("candidate"), {})[r["workload"]] = _ms(r)
        scores = []
        for lab, per in by_cand.items():
            if all(per.get(n) for n in wnames) and all(dflt.get(n) for n in wnames):
                g = math.exp(sum(math.log(per[n] / dflt[n]) for n in wnames) / len(wnames))
                scores.append((g, lab))
        scores.sort()
        if scores:
            lines.append(f"hd{hd}: best default over {', '.join(wnames)}: {scores[0][1]} "
                         f"(geomean {scores[0][0]:.3f}x of the current default)"
                         + "".join(f"; {lab} {g:.3f}x" for g, lab in scores[1:4]))
    return best_rows, lines


def write_markdown(path: Path, env: dict, rows: list[dict], best_rows: list[dict], lines: list[str]) -> None:
    def f(x, nd=3):
        return common.fmt(x, nd)

    md = [f"# cute tile sweep on {env.get('gpu')} ({env.get('date')}, commit {env.get('commit')})", "",
          f"torch {env.get('torch')}, triton {env.get('triton')}, flash-attn-4 {env.get('flash_attn_4')}, "
          f"driver {env.get('driver')}. CUDA-graph medians; paged KV page 64.", "",
          "## Best per workload", "",
          "| workload | best cute config | ms | default ms | FA4 paged | FA4 contig | best/FA4 | target | met |",
          "|---|---|---|---|---|---|---|---|---|"]
    for b in best_rows:
        md.append(f"| {b['workload']} | {b['best']} | {f(b['best_ms'])} | {f(b['default_ms'])} | "
                  f"{f(b['fa4_paged_ms'])} | {f(b['fa4_contig_ms'])} | {f(b['ratio_vs_fa4'])} | {b['target']} | "
                  f"{b['met'] if b['met'] is not None else '-'} |")
    md += ["", *[f"- {x}" for x in lines], "", "## All rows", "",
           "| workload | backend/config | status | TMA | CTAs | graph ms | eager ms | TFLOP/s | correct | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = (r.get("reason") or r.get("error") or "")[:80].replace("|", "/").replace("\n", " ")
        md.append(f"| {r.get('workload')} | {r.get('label') or r.get('backend')} | {r.get('status')} | "
                  f"{f(r.get('paged_kv_tma'))} | {f(r.get('ctas'))} | {f(r.get('graph_ms'))} | "
                  f"{f(r.get('eager_ms'))} | {f(r.get('effective_tflops'), 1)} | {f(r.get('correct'))} | {note} |")
    path.write_text("\n".join(md) + "\n")


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU dry run: print the plan and exit 0 (no CUDA, no FA4)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated globs (named workloads)")
    p.add_argument("--candidates", default="all", help="comma-separated candidate names (default all)")
    p.add_argument("--max-candidates", type=int, default=None, help="at most this many non-default candidates")
    p.add_argument("--budget-s", type=float, default=200.0, help="start no candidate after this many seconds")
    p.add_argument("--config-timeout-s", type=float, default=150.0,
                   help="a candidate (compile + all its workloads) running longer dumps stacks and exits")
    p.add_argument("--page-size", type=int, default=wl.DEFAULT_PAGE_SIZE)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--fa4-layouts", default="paged,contiguous")
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--no-eager", action="store_true", help="skip eager timings of cute candidates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default $OUT or bench/results)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests drive the GPU path with stubs
    p.add_argument("--small-shapes", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:  # a value naming nothing (',') is refused: it selected nothing to run
        a.fa4_layouts = common.comma_list(a.fa4_layouts, "--fa4-layouts")
        common.comma_list(a.candidates, "--candidates")
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    workloads = wl.select(wl.named_workloads(quick=args.small_shapes), args.workloads)
    runs = plan(args, workloads)
    print_plan(runs, args.page_size)
    if args.quick:
        print("--quick: dry run, nothing measured")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --quick for the plan)", file=sys.stderr)
        return 2

    dtype = getattr(torch, args.dtype)
    env = common.env_record(device)
    out_dir = Path(args.out) if args.out else common.results_dir(local=device.type == "cpu")
    common.log(f"device {env['gpu']}, torch {env['torch']}, fa4 {env['flash_attn_4']}, commit {env['commit']}")
    common.log(f"warm-up {common.warm_up_gpu(device):.1f} s")
    rows: list[dict] = []
    extra = {"page_size": args.page_size, "dtype": args.dtype, "targets": TARGETS, "budget_s": args.budget_s,
             "argv": sys.argv[1:] if argv is None else argv,
             "candidates": [dict(name=c.name, head_dim=c.head_dim, config=c.config(), why=c.why) for c, _ in runs]}

    def save(complete=False):
        extra["wall_s"] = round(time.perf_counter() - t_start, 1)
        return common.write_records(SUITE, rows, env=env, out_dir=out_dir, extra={**extra, "complete": complete})

    # 1. workloads and ground truth
    data = {}
    for w in workloads:
        try:
            batch = wl.build(w, device, dtype, page_size=args.page_size, seed=args.seed)
            gold, base_err, src = ba.ground_truth(batch, "sdpa")
            data[w.name] = (batch, gold, base_err)
            common.log(f"{w.describe()}  (gold {src}, bf16 SDPA err {base_err:.3g})")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"workload": w.name, "backend": "*", "status": "error",
                         "error": f"building the workload failed: {type(e).__name__}: {e}"})
        torch.cuda.empty_cache()

    # 2. FA4 anchors
    if not args.no_fa4:
        for w in workloads:
            if w.name not in data:
                continue
            batch, gold, base_err = data[w.name]
            for layout in args.fa4_layouts:
                r = measure_fa4(ba, batch, layout, gold, base_err, args)
                rows.append(r)
                common.log(f"  {w.name} fa4[{layout}]: {r['status']} graph {common.fmt(r.get('graph_ms'))} ms "
                           f"correct={r.get('correct')} {r.get('reason') or r.get('error') or ''}")
        save()
        if device.type == "cuda" and not _cuda_ok():
            common.log("CUDA context lost during the FA4 anchors: the cute rows below will record it")

    # 3. cute candidates, one compile each, all workloads of the head dim
    lost = None
    for cand, ws in runs:
        ws = [w for w in ws if w.name in data]
        elapsed = time.perf_counter() - t_start
        reason = None
        if lost:
            reason = f"not run: CUDA context lost after {lost}"
        elif elapsed > args.budget_s and not cand.is_default:
            reason = f"not started: --budget-s {args.budget_s:.0f} spent ({elapsed:.0f} s)"
        if reason:
            for w in ws:
                rows.append({"workload": w.name, "backend": "cute", "candidate": cand.name, "head_dim": w.head_dim,
                             "label": cand.name, "config": cand.config(), "status": "skipped", "reason": reason})
            continue
        common.log(f"[{elapsed:5.0f} s] candidate {cand.name} hd{cand.head_dim}: {cand.why}")
        faulthandler.dump_traceback_later(args.config_timeout_s, exit=True)
        compile_failed = None
        try:
            for w in ws:
                batch, gold, base_err = data[w.name]
                if compile_failed:
                    rows.append({**base_row(w, batch, "cute"), "candidate": cand.name, "label": static_label(cand, w),
                                 "config": cand.config(), "status": "error",
                                 "error": f"same config failed on {compile_failed}; not retried"})
                    continue
                try:
                    r = measure_cute(batch, cand, gold, base_err, args)
                except Exception as e:  # noqa: BLE001 - one failure never kills the run
                    tb = traceback.format_exc()
                    print(f"--- {cand.name} on {w.name} failed:\n{tb}", file=sys.stderr, flush=True)
                    r = {**base_row(w, batch, "cute"), "candidate": cand.name, "label": static_label(cand, w),
                         "config": cand.config(), "status": "error",
                         "error": f"{type(e).__name__}: {str(e)[:800]}", "traceback": tb[-3000:]}
                    if w is ws[0]:
                        compile_failed = w.name  # the first call compiles: the others would fail the same way
                    if not _cuda_ok():
                        rows.append(r)
                        raise CudaContextLost(f"{cand.name} on {w.name}")
                    torch.cuda.empty_cache()
                rows.append(r)
                common.log(f"    {w.name} {r.get('label')}: {r['status']} graph {common.fmt(r.get('graph_ms'))} ms, "
                           f"eager {common.fmt(r.get('eager_ms'))} ms, "
                           f"{common.fmt(r.get('effective_tflops'), 1)} TFLOP/s, correct={r.get('correct')} "
                           f"{(r.get('reason') or r.get('error') or '')[:200]}")
                save()
        except CudaContextLost as e:
            lost = str(e)
            common.log(f"CUDA context lost ({lost}): remaining candidates recorded as not run")
        finally:
            faulthandler.cancel_dump_traceback_later()
        save()

    path = save(complete=True)
    best_rows, lines = summarize(rows, [w.name for w in workloads])
    md = out_dir / f"{path.stem}.md"
    write_markdown(md, env, rows, best_rows, lines)
    print(f"\nwrote {path} (+ .csv) and {md}")
    show = [dict(r, backend=r.get("label") or r.get("backend"),
                 note=(r.get("reason") or r.get("error") or "")[:50]) for r in rows]
    print(common.summary_table(show, ["workload", "backend", "status", "graph_ms", "eager_ms", "effective_tflops",
                                      "correct", "note"]))
    print()
    print(common.summary_table(best_rows, ["workload", "best", "best_ms", "default_ms", "fa4_paged_ms",
                                           "fa4_contig_ms", "ratio_vs_fa4", "ratio_vs_fa4_paged", "target", "met"]))
    for x in lines:
        print(x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
