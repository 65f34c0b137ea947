#!/usr/bin/env python3
"""GPU smoke run of attention backend "cute": PASS/FAIL per case and timings against FA4's two-launch split.

Run on the H200 from the repository root (flash-attn-4 + CuTe DSL importable):

    source bench/device_env.sh && python3 -m blockdiff.bench.experiments.cute_smoke   # ~1-3 min with compiles

Cases (each in its own try/except; a failure prints the full traceback and the run goes on):
  correctness, small bf16 mixed batches against the fp64 reference with the check_close rule
  (hd 128/256, paged page sizes 16/64/128/256, contiguous KV, symmetric and prefix windows, a split
  causal/bidirectional sequence, GQA 16/8 and 16/2); then the named workloads of docs/ARCHITECTURE.md
  ``mixed_sliding_ctx8k``, ``prefill16k_hd128``, ``canvas_bs4_ctx4k_hd128`` (paged, page 64, permuted
  block table): correctness (reference where it fits, else FA4), eager and CUDA-graph medians of the
  one-launch cute kernel and of FA4 ``flash_attn.cute.flash_attn_varlen_func`` called twice (causal
  sequences, then bidirectional ones, on pre-split inputs), effective TFLOP/s
  (4 * heads * head_dim * allowed pairs / time).
Batches come from :func:`blockdiff.attention.testing.make_batch_from_rows`. Writes ``cute_smoke.json`` to
``--out`` (default ``$OUT``, else ``cute_smoke-<gpu>.json`` in the git-ignored bench/results/local/) after every
case. Stops starting new cases after ``--budget`` seconds (default 165); a case running longer than
``--case-timeout`` (default 90 s; a pipeline deadlock would hang) dumps all stacks and ends the run.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from blockdiff.attention.cute import attention_cute
from blockdiff.attention.cute.config import kv_load_path, resolve_config
from blockdiff.attention.masks import count_allowed_pairs
from blockdiff.attention.testing import check_close, make_batch_from_rows
from blockdiff.bench.common import results_dir, time_eager_ms, time_graph_ms

T0 = time.time()
DEVICE = "cuda"  # tests may point this elsewhere for a dry run
RESULTS: dict = {"cases": []}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def make_case_batch(q_lens, ctxs, ncqs, H, Hkv, D, page_size=64, seed=0, contiguous=False, dtype=torch.bfloat16):
    """Random paged (permuted block table, garbage past each row's pages) or contiguous batch on ``DEVICE``: the
    keyword arguments of ``attention`` (make_batch_from_rows); K/V of the query tokens already cached."""
    return make_batch_from_rows(list(zip(ctxs, q_lens, ncqs)), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                page_size=page_size, paged=not contiguous, dtype=dtype, device=DEVICE, seed=seed,
                                extra_blocks=2)


def host_lengths(b):
    """(q_lens, seq_lens, num_causal_q) of a batch as Python lists."""
    return (b["cu_seqlens_q"].diff().tolist(), b["seq_lens"].tolist(), b["num_causal_q"].tolist())


def attn_kwargs(b, window, mode):
    kw = {k: b[k] for k in ("cu_seqlens_q", "seq_lens", "num_causal_q", "block_table", "cu_seqlens_k") if k in b}
    return dict(kw, window_size=window, bidirectional_window=mode)


def fa4_two_launch(b, window, scale):
    """Closure running FA4 varlen twice (causal sequences, bidirectional sequences) on pre-split inputs."""
    from flash_attn.cute import flash_attn_varlen_func  # optional dependency: FA4

    q_lens, seq_lens, ncqs = host_lengths(b)
    assert all(n in (0, ql) for n, ql in zip(ncqs, q_lens)), "FA4 split needs whole-sequence flags"
    groups = []
    for is_causal in (True, False):
        idx = [i for i, (n, ql) in enumerate(zip(ncqs, q_lens)) if (n == ql and ql > 0) == is_causal and ql > 0]
        if not idx:
            continue
        cu = torch.tensor([0] + list(torch.tensor([q_lens[i] for i in idx]).cumsum(0).tolist()),
                          dtype=torch.int32, device=DEVICE)
        starts = b["cu_seqlens_q"].tolist()
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in idx]).to(DEVICE)
        q = b["q"].index_select(0, rows).contiguous()
        g = dict(q=q, cu=cu, rows=rows, seqused_k=b["seq_lens"][idx].contiguous(),
                 page_table=b["block_table"][idx].contiguous(), causal=is_causal,
                 max_q=max(q_lens[i] for i in idx), max_k=max(seq_lens[i] for i in idx))
        g["window"] = (None, None) if window is None else ((window, 0) if is_causal else (window, window))
        groups.append(g)

    outs = [None] * len(groups)

    def run():
        for j, g in enumerate(groups):
            r = flash_attn_varlen_func(g["q"], b["k_cache"], b["v_cache"], cu_seqlens_q=g["cu"], seqused_k=g["seqused_k"],
                                       page_table=g["page_table"], max_seqlen_q=g["max_q"],
                                       max_seqlen_k=g["max_k"], softmax_scale=scale, causal=g["causal"],
                                       window_size=g["window"])
            outs[j] = r[0] if isinstance(r, tuple) else r

    def gather(total_q, H, D):
        o = torch.empty(total_q, H, D, dtype=b["q"].dtype, device=DEVICE)
        for g, out in zip(groups, outs):
            o.index_copy_(0, g["rows"], out)
        return o

    return run, gather


def record(name, **fields):
    row = dict(case=name, **fields)
    RESULTS["cases"].append(row)
    return row


def correctness_case(name, q_lens, ctxs, ncqs, H, Hkv, D, page_size, window, mode, contiguous=False):
    t = time.time()
    b = make_case_batch(q_lens, ctxs, ncqs, H, Hkv, D, page_size, seed=len(RESULTS["cases"]), contiguous=contiguous)
    kw = attn_kwargs(b, window, mode)
    out = torch.full((b["q"].shape[0], H, D), float("nan"), dtype=b["q"].dtype, device=DEVICE)
    o, lse = attention_cute(b["q"], b["k_cache"], b["v_cache"], out=out, return_lse=True, **kw)
    torch.cuda.synchronize()
    res = check_close(o, b["q"], b["k_cache"], b["v_cache"], lse=lse, **kw)
    log(f"PASS {name}: err {res['err']:.3e} (bound {res['bound']:.3e}), lse err {res.get('lse_err', 0):.2e}, "
        f"{time.time() - t:.1f}s incl. compile")
    record(name, status="PASS", **res, seconds=time.time() - t)


def workload_case(name, q_lens, ctxs, causal, H, Hkv, D, window, mode, check="reference", rep_ms=50):
    """Correctness and eager / CUDA-graph medians (``common`` timers over ``rep_ms`` ms windows) of one workload."""
    t = time.time()
    ncqs = [ql if c else 0 for ql, c in zip(q_lens, causal)]
    b = make_case_batch(q_lens, ctxs, ncqs, H, Hkv, D, 64, seed=1)
    kw = attn_kwargs(b, window, mode)
    scale = D ** -0.5
    out = torch.full((b["q"].shape[0], H, D), float("nan"), dtype=b["q"].dtype, device=DEVICE)
    attention_cute(b["q"], b["k_cache"], b["v_cache"], out=out, scale=scale, **kw)  # compile + validate once
    torch.cuda.synchronize()
    row = dict(workload=name, batch=f"q_lens={q_lens} ctx={ctxs} causal={causal}", H=H, Hkv=Hkv, D=D,
               window=window, mode=mode)
    pairs = count_allowed_pairs(b["cu_seqlens_q"].diff(), b["seq_lens"], b["num_causal_q"], window, mode)
    row["allowed_pairs"] = pairs
    cfg = resolve_config(D, D, window)
    row["cute_tile_mn"] = (cfg.tile_m, cfg.tile_n)
    row["cute_kv_load_path"] = kv_load_path(64, cfg.tile_n)  # page size 64 here

    status = "PASS"
    fa_run = fa_gather = None
    try:
        fa_run, fa_gather = fa4_two_launch(b, window, scale)
        fa_run()
        torch.cuda.synchronize()
        fa_out = fa_gather(b["q"].shape[0], H, D)
        diff = (out.float() - fa_out.float()).abs().max().item()
        row["max_abs_diff_vs_fa4"] = diff
        log(f"{name}: max |cute - fa4| = {diff:.3e}")
    except Exception:
        traceback.print_exc()
        row["fa4_error"] = traceback.format_exc()[-2000:]
    if not torch.isfinite(out).all():
        status = "FAIL"
        row["error"] = "non-finite output"
    if check == "reference":
        try:
            res = check_close(out, b["q"], b["k_cache"], b["v_cache"], scale=scale, **kw)
            row.update(res)
        except AssertionError as e:
            status = "FAIL"
            row["error"] = str(e)
    elif "max_abs_diff_vs_fa4" in row and row["max_abs_diff_vs_fa4"] > 3e-2:
        status = "FAIL"
        row["error"] = f"differs from FA4 by {row['max_abs_diff_vs_fa4']:.3e}"

    def cute_call():
        attention_cute(b["q"], b["k_cache"], b["v_cache"], out=out, scale=scale, check_values=False, **kw)

    for label, fn in (("cute", cute_call), ("fa4", fa_run)):
        if fn is None:
            continue
        try:
            eager = time_eager_ms(fn, DEVICE, warmup=5, rep=rep_ms)
            graph = time_graph_ms(fn, warmup=5, rep=rep_ms)
            row[f"{label}_eager_ms"] = eager
            row[f"{label}_graph_ms"] = graph
            row[f"{label}_graph_tflops"] = 4 * H * D * pairs / (graph * 1e-3) / 1e12
        except Exception:
            traceback.print_exc()
            row[f"{label}_timing_error"] = traceback.format_exc()[-2000:]
    log(f"{status} {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items() if k.endswith(("_ms", "tflops", "err"))),
        f"({time.time() - t:.1f}s)")
    record(name, status=status, seconds=time.time() - t, **row)


def env_info():
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F %T")}
    for mod, key in (("flash_attn", "flash_attn_4"), ("cutlass", "cutlass_dsl")):
        try:
            m = __import__(mod)
            info[key] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            info[key] = f"not importable: {e}"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        info["commit"] = "unknown"
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=165.0, help="seconds after which no new case starts")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names to run")
    ap.add_argument("--case-timeout", type=float, default=90.0,
                    help="seconds before a hung case dumps all stacks and ends the run (exit code 1)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 2
    RESULTS["env"] = env_info()
    log("env", RESULTS["env"])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < 1.5:  # GPU warm-up (clocks)
        a @ a
    torch.cuda.synchronize()

    W = 1023
    cases = [
        ("corr_hd128_page64_mixed", correctness_case,
         ([300, 256, 1, 0, 77], [0, 2000, 50, 10, 0], [300, 0, 1, 0, 40], 16, 8, 128, 64, None, "symmetric")),
        ("mixed_sliding_ctx8k", workload_case,
         ([4096, 256, 256, 256], [0, 8192, 8192, 8192], [True, False, False, True], 16, 8, 256, W, "symmetric")),
        ("canvas_bs4_ctx4k_hd128", workload_case,
         ([256] * 4, [4096] * 4, [False] * 4, 16, 8, 128, None, "symmetric")),
        ("prefill16k_hd128", workload_case,
         ([16384], [0], [True], 16, 8, 128, None, "symmetric"), {"check": "fa4", "rep_ms": 30}),
        ("corr_hd128_page128_tma_gqa8", correctness_case,
         ([256, 130, 5], [1000, 0, 129], [0, 130, 2], 16, 2, 128, 128, 100, "symmetric")),
        ("corr_hd128_page16_prefix", correctness_case,
         ([256, 200], [3000, 10], [0, 100], 16, 8, 128, 16, 63, "prefix")),
        ("corr_hd128_page256", correctness_case,
         ([256, 512], [4000, 0], [256, 512], 16, 8, 128, 256, None, "symmetric")),
        ("corr_hd128_contiguous", correctness_case,
         ([256, 64], [2048, 7], [0, 64], 16, 8, 128, 64, W, "symmetric", True)),
        ("corr_hd256_page64_sym_w1023", correctness_case,
         ([1024, 256, 256], [0, 3000, 3000], [1024, 0, 256], 16, 8, 256, 64, W, "symmetric")),
        ("corr_hd256_page64_prefix_w1023", correctness_case,
         ([1024, 256, 256], [0, 3000, 3000], [1024, 0, 128], 16, 8, 256, 64, W, "prefix")),
        ("corr_hd256_page16_nowindow", correctness_case,
         ([256, 100], [1500, 0], [0, 100], 16, 8, 256, 16, None, "symmetric")),
    ]
    only = [s for s in args.only.split(",") if s]
    out_path = _json_path(args.out)
    for case in cases:
        name, fn, cargs = case[:3]
        ckw = case[3] if len(case) > 3 else {}
        if only and not any(s in name for s in only):
            continue
        if time.time() - T0 > args.budget:
            log(f"SKIP {name}: time budget of {args.budget:.0f}s spent")
            record(name, status="SKIP")
            continue
        # A kernel hang (e.g. producer and consumer disagreeing on a tile's key blocks deadlocks the pipeline)
        # would block in a CUDA sync: the C-level watchdog dumps every thread's stack and exits instead.
        log(f"START {name} (watchdog {args.case_timeout:.0f}s)")
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        try:
            fn(name, *cargs, **ckw)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            log(f"FAIL {name}: {type(e).__name__}: {e}")
            record(name, status="FAIL", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        _write_json(out_path)  # after every case: a later hang keeps what was measured

    n_fail = sum(c["status"] == "FAIL" for c in RESULTS["cases"])
    log(f"SUMMARY: {sum(c['status'] == 'PASS' for c in RESULTS['cases'])} PASS, {n_fail} FAIL, "
        f"{sum(c['status'] == 'SKIP' for c in RESULTS['cases'])} SKIP")
    for c in RESULTS["cases"]:
        if "cute_graph_ms" in c or "fa4_graph_ms" in c:
            log(f"  {c['case']}: cute graph {c.get('cute_graph_ms', float('nan')):.4f} ms "
                f"(eager {c.get('cute_eager_ms', float('nan')):.4f}) | fa4 two-launch graph "
                f"{c.get('fa4_graph_ms', float('nan')):.4f} ms (eager {c.get('fa4_eager_ms', float('nan')):.4f})")
    _write_json(out_path)
    log("wrote", out_path)
    return 1 if n_fail else 0


def _json_path(out=None):
    if out or os.environ.get("OUT"):
        return os.path.join(out or os.environ["OUT"], "cute_smoke.json")
    gpu = RESULTS.get("env", {}).get("gpu", "gpu").replace(" ", "_")
    return str(results_dir(local=True) / f"cute_smoke-{gpu}.json")


def _write_json(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
