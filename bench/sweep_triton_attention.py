"""Tile-config sweep of the Triton attention backend on the named workloads (H200; bounded to ~5.5 min).

Usage (GPU; PYTHONPATH must make ``blockdiff.*`` importable, e.g. ``source bench/device_env.sh``):
    python3 -m blockdiff.bench.sweep_triton_attention                      # the target workloads, ~5.5 min budget
    python3 -m blockdiff.bench.sweep_triton_attention --workloads 'canvas_*' --budget-s 200
    python3 -m blockdiff.bench.sweep_triton_attention --quick              # CPU smoke run (interpreter, tiny shapes)
    python3 -m blockdiff.bench.sweep_triton_attention --workloads 'canvas_*' --suite-name gluon_probe \
        --configs '[{}, {"IMPL": "gluon", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}]'
                                                                 # given configs only ({}: the automatic choice)

Per workload, up to three phases: (1) tile shapes (BLOCK_M, BLOCK_N, num_warps, num_stages, BLOCK_DV) with
the automatic split count; (2) for the best tile, explicit split counts; (3) on the target workloads, the best
config with ``LAZY_RESCALE=True`` (skip the accumulator rescale unless a row max grows by > 2^8).
Every config is first checked against the dense reference (isfinite; max abs error <= 2x the same-dtype eager
error + bf16 representation tolerance, as blockdiff.attention.testing) on a NaN-poisoned ``out``; then one
call (``check_values=False``) is captured in a CUDA graph and its replay timed (median of
``triton.testing.do_bench`` over 100 ms, after a GPU warm-up: the same window as bench_attention.py, since shorter
windows run at the boost clock and read faster). Compile errors (e.g. shared memory) are recorded, not fatal.
A global time budget (``--budget-s``) skips the remaining candidates (recorded as skipped) so the run stays
bounded; candidates are ordered best-guess first.

Outputs (to ``$OUT`` if set, else bench/results/): ``triton_sweep-<gpu>.json`` (+ csv) with every row, and
``triton_configs.md`` with the best config per workload, its time, effective TFLOP/s and the target.
Effective TFLOP/s = 4·H·D·(allowed pairs)/time (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from blockdiff.bench import common  # noqa: E402
from blockdiff.bench import workloads as wl  # noqa: E402

SUITE = "triton_sweep"

#: H200 CUDA-graph targets of issue 3: (kind, value) with kind "ms" (<=) or "tflops" (>=).
TARGETS = {
    "mixed_sliding_ctx8k": ("ms", 0.205),
    "mixed_global_ctx8k": ("tflops", 450.0),
    "canvas_bs1_ctx32k_hd128": ("ms", 0.138),
    "canvas_bs1_ctx32k_sliding": ("ms", 0.015),
    "prefill16k_hd128": ("ms", 2.47),
}

#: Phase-1 tile candidates per (head_dim family, workload kind), best guess first:
#: (BLOCK_M, BLOCK_N, num_warps, num_stages, BLOCK_DV or None = whole V head dim). Pre-screened offline by
#: compiling for sm_90a with Triton 3.6 + ptxas -v (bench/results/triton_configs.md): all fit in 227 KB of
#: shared memory; most use 200-255 registers with at most a few hundred bytes of spills.
TILES = {
    "hd128_canvas": [(128, 64, 8, 3, None), (128, 128, 8, 3, None), (64, 64, 4, 3, None), (64, 128, 4, 3, None),
                     (128, 64, 8, 2, None), (128, 32, 8, 3, None)],
    "hd128_prefill": [(128, 64, 8, 3, None), (128, 128, 8, 3, None), (128, 64, 8, 2, None), (64, 64, 4, 3, None),
                      (128, 128, 8, 2, None), (64, 128, 4, 3, None)],
    "hd256": [(64, 64, 8, 2, None), (64, 32, 8, 2, None), (64, 32, 4, 2, None), (128, 32, 8, 2, None),
              (64, 64, 8, 3, None), (128, 64, 8, 2, None)],
    "hd512": [(64, 32, 8, 2, None), (64, 16, 8, 2, None), (64, 32, 8, 2, 256), (128, 32, 8, 2, 256),
              (128, 16, 8, 2, 256), (64, 32, 8, 3, 256)],
}
SPLITS = {"canvas": [1, 2, 4, 8, 16], "other": []}  # many programs already: no split phase

#: Workload order: targets first; the rest only if the budget allows.
ORDER = ["mixed_sliding_ctx8k", "canvas_bs1_ctx32k_sliding", "canvas_bs1_ctx32k_hd128", "prefill16k_hd128",
         "mixed_global_ctx8k", "canvas_bs4_ctx4k_hd128", "mixed_sliding_prefix_ctx8k", "canvas_bs1_ctx32k_global"]


def family(w) -> str:
    if w.head_dim <= 128:
        return "hd128_prefill" if w.name.startswith("prefill") else "hd128_canvas"
    return "hd256" if w.head_dim <= 256 else "hd512"


def tile_config(t) -> dict:
    bm, bn, nw, ns, bdv = t
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
    if bdv is not None:
        cfg["BLOCK_DV"] = bdv
    return cfg


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


#: Above this many score elements (H x total_q x max keys) the oracle checks only the last TAIL_ROWS query rows
#: of each sequence (valid for causal sequences and the symmetric window: same keys, positions and flags).
DENSE_LIMIT = 1 << 31
TAIL_ROWS = 2048


def reference_check(batch, device):
    """(oracle out, checked row indices or None, error bound) of a workload, computed once.

    Oracle: the dense blockdiff reference in fp32 (fp64 on the CPU); bound: 2x the same-dtype eager error plus
    the representation tolerance (blockdiff.attention.testing's rule).
    """
    from blockdiff.attention.reference import attention_reference
    from blockdiff.attention.testing import REPRESENTATION_ATOL

    w = batch.workload
    kw = batch.attn_kwargs()
    kw.pop("max_seqlen_q"), kw.pop("max_seqlen_k")
    q, rows = batch.q, None
    if w.num_heads * w.total_q * max(w.seq_lens) > DENSE_LIMIT and (
            w.bidirectional_window == "symmetric" or all(w.causal)):
        cu = [0]
        for n in w.q_lens:
            cu.append(cu[-1] + n)
        rows = torch.cat([torch.arange(max(cu[b], cu[b + 1] - TAIL_ROWS), cu[b + 1]) for b in range(len(w.q_lens))])
        lens = [min(TAIL_ROWS, n) for n in w.q_lens]
        rows = rows.to(device)
        q = batch.q[rows]
        kw["cu_seqlens_q"] = torch.tensor([0] + list(wl._cumsum(lens)), dtype=torch.int32, device=device)
    if device.type == "cpu":  # quick mode: fp64 oracle
        oracle = attention_reference(q.double(), batch.k_cache.double(), batch.v_cache.double(), **kw)
    else:
        oracle = attention_reference(q, batch.k_cache, batch.v_cache, upcast=True, **kw).float()
    eager = attention_reference(q, batch.k_cache, batch.v_cache, upcast=False, **kw)
    eager_err = (eager.double() - oracle.double()).abs().max().item() if eager.numel() else 0.0
    del eager
    return oracle, rows, 2.0 * eager_err + REPRESENTATION_ATOL[batch.q.dtype]


def run_config(batch, cfg, oracle, rows, bound, device, args) -> dict:
    from blockdiff.attention.triton import interface as TA

    w = batch.workload
    out = torch.full((w.total_q, w.num_heads, w.head_dim_v), float("nan"), dtype=batch.q.dtype, device=device)
    kw = batch.attn_kwargs()
    row = {"workload": w.name, "backend": "triton", "config": dict(cfg)}
    t0 = time.perf_counter()
    try:
        TA.attention_triton(batch.q, batch.k_cache, batch.v_cache, out=out, config=cfg, check_values=False, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - compile errors (shared memory, registers) are data
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    h = TA.LAST_LAUNCH.get("kernel")
    row["n_regs"] = getattr(h, "n_regs", None)
    row["n_spills"] = getattr(h, "n_spills", None)
    row["num_splits"] = TA.LAST_LAUNCH.get("num_splits")
    row["impl"] = TA.LAST_LAUNCH.get("impl")
    finite = bool(torch.isfinite(out).all())
    chk = out if rows is None else out[rows]
    err = (chk.double() - oracle.double()).abs().max().item() if chk.numel() else 0.0
    row.update(err=err, bound=bound, correct=finite and err <= bound)
    if not row["correct"]:
        row["status"] = "wrong"
        return row

    def fn():
        return TA.attention_triton(batch.q, batch.k_cache, batch.v_cache, out=out, config=cfg, check_values=False,
                                   **kw)

    if device.type == "cuda":
        row["graph_ms"] = common.time_graph_ms(fn, warmup=args.warmup_ms, rep=args.rep_ms)
    else:
        row["graph_ms"] = common.time_eager_ms(fn, device, cpu_reps=1)
    row["effective_tflops"] = common.tflops(w_flops(w), row["graph_ms"])
    row["status"] = "ok"
    return row


_FLOPS: dict = {}


def w_flops(w) -> float:
    """Attention FLOPs of workload ``w`` (its allowed pairs), cached per shape: the key is the workload itself (its
    lengths, heads, window), not its name, which the ``--quick`` and the full shapes share."""
    if w not in _FLOPS:
        pairs = w.allowed_pairs()
        _FLOPS[w] = common.attention_flops(w.num_heads, w.head_dim, pairs, w.head_dim_v)
    return _FLOPS[w]


def sweep_workload(w, device, dtype, args, budget, rows) -> dict | None:
    batch = wl.build(w, device=device, dtype=dtype, page_size=args.page_size)
    oracle, check_rows, bound = reference_check(batch, device)
    if args.configs is not None:  # explicit candidates only (no tile / split / lazy phases)
        tiles, splits = [], []
    elif args.quick:
        tiles = [(16, 16, 4, 1, None), (32, 16, 4, 1, None)]
        splits = [1, 2]
    else:
        tiles = TILES[family(w)]
        splits = SPLITS["canvas" if w.batch_size <= 4 and not w.name.startswith(("prefill", "mixed")) else "other"]
    best = None

    def consider(cfg, phase):
        nonlocal best
        if budget.left() < args.reserve_s:
            rows.append({"workload": w.name, "backend": "triton", "config": cfg, "status": "skipped (budget)",
                         "phase": phase})
            return
        r = run_config(batch, cfg, oracle, check_rows, bound, device, args)
        r["phase"] = phase
        rows.append(r)
        msg = f"{w.name:30s} {str(cfg):90s} {r['status']:6s}"
        if r.get("graph_ms") is not None:
            msg += f" {r['graph_ms'] * 1e3:9.1f} us {r['effective_tflops']:7.1f} TF/s"
            if best is None or r["graph_ms"] < best["graph_ms"]:
                best = r
        elif r.get("error"):
            msg += " " + r["error"][:80]
        common.log(msg)

    for cfg in args.configs or []:
        consider(dict(cfg), "given")
    for t in tiles:
        consider(tile_config(t), "tile")
    if best is not None:
        base = {k: v for k, v in best["config"].items() if k != "num_splits"}
        auto = best.get("num_splits")
        for ns in splits:
            if ns != auto:
                consider(dict(base, num_splits=ns), "split")
    if best is not None and (w.name in TARGETS or args.quick) and args.configs is None:
        consider(dict(best["config"], LAZY_RESCALE=True), "lazy")  # phase 3: FA4-style lazy rescaling
    del oracle, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return best


def write_markdown(best_rows, path, env):
    lines = [
        "# Triton attention: best tile configs per workload (sweep)",
        "",
        f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}.",
        "Times: CUDA-graph replay medians (ms). Effective TFLOP/s = 4·H·D·allowed pairs / time. "
        "Produced by `bench/sweep_triton_attention.py`.",
        "",
        "| workload | BLOCK_M | BLOCK_N | warps | stages | BLOCK_DV | splits | lazy | graph ms | eff. TFLOP/s "
        "| regs/spills | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in best_rows.items():
        tgt = TARGETS.get(name)
        if r is None:
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | - | - | {tgt} | no result |")
            continue
        c = r["config"]
        met = "-"
        if tgt:
            met = "yes" if (r["graph_ms"] <= tgt[1] if tgt[0] == "ms" else r["effective_tflops"] >= tgt[1]) else "no"
        tgt_s = "-" if not tgt else (f"<= {tgt[1]} ms" if tgt[0] == "ms" else f">= {tgt[1]} TFLOP/s")
        lines.append(
            f"| {name} | {c.get('BLOCK_M')} | {c.get('BLOCK_N')} | {c.get('num_warps')} | {c.get('num_stages')} | "
            f"{c.get('BLOCK_DV', 'full')} | {r.get('num_splits')} | {bool(c.get('LAZY_RESCALE'))} | "
            f"{r['graph_ms']:.4f} | "
            f"{r['effective_tflops']:.1f} | {r.get('n_regs')}/{r.get('n_spills')} | {tgt_s} | {met} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=None, help="comma-separated globs over the named workloads")
    p.add_argument("--all", action="store_true", help="all named workloads (default: ORDER)")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall budget of the whole sweep (s)")
    p.add_argument("--reserve-s", type=float, default=8.0, help="stop starting candidates when less is left")
    p.add_argument("--page-size", type=int, default=wl.DEFAULT_PAGE_SIZE)
    # bench_attention.py's windows (shorter ones run at the boost clock: docs/tuning.md)
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes through the interpreter")
    p.add_argument("--configs", default=None, type=json.loads,
                   help="JSON list of config dicts to time instead of the phased sweep (e.g. '[{}, "
                        "{\"IMPL\": \"gluon\"}]'; {} is the backend's own choice)")
    p.add_argument("--suite-name", default=SUITE, help=f"results file stem (default {SUITE})")
    args = p.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        # the full shapes (16k prefills, 32k contexts) through the Triton interpreter: the whole budget for nothing
        sys.exit("sweep_triton_attention: no CUDA GPU: the tile sweep times the named workloads' full shapes on a "
                 "GPU; --quick is the CPU smoke run (tiny shapes through the interpreter)")
    budget = Budget(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.page_size = wl.QUICK_PAGE_SIZE
    dtype = torch.bfloat16
    ws = {w.name: w for w in wl.named_workloads(quick=args.quick)}
    names = [n for n in ORDER if n in ws] if not args.all else list(ws)
    if args.workloads:
        names = [w.name for w in wl.select([ws[n] for n in names], args.workloads)]
    env = common.env_record(device)
    common.log(f"device {env['gpu']}, torch {env['torch']}, triton {env['triton']}, budget {args.budget_s:.0f} s")
    if device.type == "cuda":
        common.warm_up_gpu(device, seconds=2.0)
    rows, best_rows = [], {}
    for name in names:
        if budget.left() < args.reserve_s:
            best_rows[name] = None
            rows.append({"workload": name, "backend": "triton", "status": "skipped (budget)"})
            continue
        try:
            best_rows[name] = sweep_workload(ws[name], device, dtype, args, budget, rows)
        except Exception as e:  # noqa: BLE001 - keep sweeping the other workloads
            traceback.print_exc()
            rows.append({"workload": name, "backend": "triton", "status": "error", "error": repr(e)[:300]})
            best_rows[name] = None
    out_dir = common.results_dir(local=args.quick or device.type == "cpu")
    extra = {"targets": TARGETS, "page_size": args.page_size, "elapsed_s": round(args.budget_s - budget.left(), 1),
             "best": {k: (v and {"config": v["config"], "num_splits": v.get("num_splits"),
                                 "graph_ms": v["graph_ms"]}) for k, v in best_rows.items()}}
    path = common.write_records(args.suite_name, rows, env=env, extra=extra, out_dir=out_dir)
    md = out_dir / ("triton_configs.md" if args.suite_name == SUITE else f"{args.suite_name}.md")
    write_markdown(best_rows, md, env)
    cols = ["workload", "status", "config", "num_splits", "graph_ms", "effective_tflops", "n_regs", "n_spills"]
    print(common.summary_table([r for r in best_rows.values() if r], cols))
    common.log(f"wrote {path} and {md} in {args.budget_s - budget.left():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
