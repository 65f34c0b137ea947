#!/usr/bin/env python3
"""Interleaved A/B of cute backend configs against FA4, both KV layouts, one process (GPU experiment).

For each named workload: FA4 (``flash_attn.cute.flash_attn_varlen_func`` as in bench_attention.py, paged and
contiguous) and the cute backend under every config variant (paged and contiguous K/V) are compiled and checked
first (max difference to the first row, isfinite), then ``--rounds`` rounds time every row in turn with
``triton.testing.do_bench_cudagraph(rep=200)`` (single-launch CUDA-graph replays, microseconds); the medians
of the rounds are printed and written to ``ab_<workloads>.json`` in ``--out`` (default ``$OUT``, else the
git-ignored bench/results/local/). Interleaving the rows puts clock and thermal drift on every row alike.
Record of an H200 run: bench/results/history/cute_lpt_ab-h200.json.

    python3 -m blockdiff.bench.experiments.ab_cute_configs canvas_bs4_ctx4k_hd128 \
        '{"s2": {"num_stages": 2}, "s3": {"num_stages": 3}}'

Variants are ``config`` dicts of ``attention_cute`` (CuteConfig fields: tile_m, tile_n, mma_pv_is_rs,
intra_wg_overlap, num_stages, lpt, the switches such as qk_issue); a given dict replaces the default config (unset
fields take the automatic choices). ``--page-size`` builds the paged layout with other pages than the bench's 64;
``--layouts`` keeps one layout; ``--no-fa4`` drops FA4's rows (it cannot run head dims above 256; they would fail
and be dropped anyway); ``--triton`` adds the triton backend's default dispatch on the same inputs.

    python3 -m blockdiff.bench.experiments.ab_cute_configs mixed_global_ctx8k \
        '{"serial": {"qk_issue": "serial"}, "ahead": {"qk_issue": "ahead"}}' --page-size 16 --layouts paged \
        --no-fa4 --triton
"""
import argparse
import json
import os
import types

import torch

from blockdiff.attention.cute import attention_cute
from blockdiff.bench import bench_attention as ba
from blockdiff.bench import common
from blockdiff.bench import workloads as wl


def rows_for(name: str, variants: dict, page_size: int = wl.DEFAULT_PAGE_SIZE,
             layouts: tuple[str, ...] = ("paged", "contiguous"), fa4: bool = True,
             triton: bool = False) -> tuple[dict, dict]:
    """(row name -> callable, row name -> to_packed) for one workload, K/V in ``page_size``-token pages."""
    w = next(x for x in wl.named_workloads() if x.name == name)
    b = wl.build(w, device="cuda", dtype=torch.bfloat16, page_size=page_size)
    fns, packs = {}, {}
    for lay in layouts if fa4 else ():
        fns[f"fa4_{lay}"], packs[f"fa4_{lay}"], _ = ba.make_fa4(b, types.SimpleNamespace(), lay)
    for lay in layouts if triton else ():  # bench_attention's triton row (its default dispatch)
        fns[f"triton_{lay}"], packs[f"triton_{lay}"], _, _ = ba.make_blockdiff(b, types.SimpleNamespace(), "triton",
                                                                              layout=lay)
    for vn, cfg in variants.items():
        for lay, (k, v, a) in b.layouts().items():
            if lay not in layouts:
                continue
            out = torch.empty(b.q.shape[0], w.num_heads, w.head_dim_v, dtype=b.q.dtype, device="cuda")

            def f(k=k, v=v, a=a, out=out, cfg=cfg):
                return attention_cute(b.q, k, v, out=out, check_values=False, config=cfg, **a)
            fns[f"cute_{vn}_{lay}"], packs[f"cute_{vn}_{lay}"] = f, (lambda o: o)
    return fns, packs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workloads", help="comma-separated named workloads")
    p.add_argument("variants", help='JSON {"name": config dict, ...}')
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    p.add_argument("--page-size", type=int, default=wl.DEFAULT_PAGE_SIZE, help="tokens a K/V page (default 64)")
    p.add_argument("--layouts", default="paged,contiguous", help="comma-separated: paged, contiguous")
    p.add_argument("--no-fa4", action="store_true", help="no FA4 rows")
    p.add_argument("--triton", action="store_true", help="the triton backend's rows too")
    a = p.parse_args(argv)
    names, variants = a.workloads.split(","), json.loads(a.variants)
    layouts = tuple(a.layouts.split(","))
    if a.page_size < 1 or not set(layouts) <= {"paged", "contiguous"} or not layouts:
        raise SystemExit(f"--page-size must be >= 1 and --layouts paged and / or contiguous, got {a.page_size}, "
                         f"{a.layouts!r}")
    res = {}
    for name in names:
        fns, packs = rows_for(name, variants, a.page_size, layouts, not a.no_fa4, a.triton)
        ref = None
        for n in list(fns):
            try:
                o = packs[n](fns[n]())
                torch.cuda.synchronize()
                ref = o.float() if ref is None else ref
                print(n, "max diff vs first row", (o.float() - ref).abs().max().item(),
                      "finite", bool(torch.isfinite(o).all()), flush=True)
            except Exception as e:  # noqa: BLE001 - report and drop the row
                print(n, "FAILED", type(e).__name__, str(e)[:300], flush=True)
                del fns[n]
        res[name] = common.interleaved_graph_medians(fns, a.rounds, name)
    common.write_experiment_json("ab_" + "_".join(names) + ".json",
                                 dict(commit=os.environ.get("BLOCKDIFF_COMMIT"), gpu=torch.cuda.get_device_name(),
                                      variants=variants, page_size=a.page_size, layouts=list(layouts),
                                      res=res), a.out)


if __name__ == "__main__":
    main()
