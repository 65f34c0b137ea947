"""What bounds the cute backend's missed issue-27 goals (GPU experiment; docs/tuning.md 2.7).

For each case (a named or ``canvas_bs{n}_ctx{c}_{layer}`` workload, a backend, a config) one row with:
``cold_us`` (CUDA-graph median with the L2 flushed before every replay, bench_attention's timing), ``warm_us``
(200 back-to-back replays, no flush), ``kernels_us`` (median device time of each kernel of one call,
torch.profiler: the split kernel alone, the combine alone), what the cute backend launched, and the largest
difference from the triton backend's output on the same inputs (``max_abs_diff_vs_triton``; both backends are
checked against the dense reference by the tests). Also the empty CUDA-graph floor. The cases:

- ``canvas_bs1_ctx32k_sliding``: combine and cluster (the automatic 2 splits), one split, cluster without
  ``nan_safe_v``, and the window ladder (511 / 255 / 63; the workload has 1023): the automatic choice (one split
  while a row's key bound stays below 2048) and the cluster at 2 splits, the fixed cost against the per-key-block
  cost of the 15 us goal. (At b89fc42 the default merge was the combine; ``"auto"`` takes the cluster since, and
  the shared Triton merge where the cluster does not act since docs/tuning.md 2.35.)
- ``canvas_bs1_ctx32k_hd128`` / ``_global``: combine, cluster at 2, one split, the triton backend.
- ``canvas_bs4_ctx4k_hd128``: cute paged and contiguous against FA4 contiguous, the 0.95x goal's anchor.
- ``canvas_bs16_ctx8k_global``: a batch that fills the GPU without splits, so each backend's hd-512 kernel runs
  at its own best rate: the floor of the two global-layer goals.

Usage (GPU, CuTe DSL + flash-attn-4 importable; ``--plan`` prints the cases without a GPU):

    python3 -m blockdiff.bench.experiments.probe_cute_floor [--budget-s 300] [--only PATTERN]

Writes ``cute_floor.json`` to ``--out`` (default ``$OUT``, else the git-ignored bench/results/local/).
"""
import argparse
import dataclasses
import fnmatch
import json
import time
import types

import torch

from blockdiff.bench import bench_attention as ba
from blockdiff.bench import common
from blockdiff.bench import workloads as wl
from blockdiff.bench.experiments.probe_floor_sliding import _empty, _kernel_times_us
from blockdiff.bench.experiments.probe_warm_l2 import warm_graph_us

CLUSTER = {"split_merge": "cluster"}
COMBINE = {"split_merge": "combine"}
SPLIT1 = {"num_splits": 1}


def cases() -> list[tuple]:
    """``(workload name, window override or None, backend, config, layout)`` in the order they run."""
    s, b4, g16 = "canvas_bs1_ctx32k_sliding", "canvas_bs4_ctx4k_hd128", "canvas_bs16_ctx8k_global"
    out = [(s, None, "triton", None, "paged"), (s, None, "cute", COMBINE, "paged"),
           (s, None, "cute", CLUSTER, "paged"), (s, None, "cute", SPLIT1, "paged"),
           (s, None, "cute", dict(CLUSTER, nan_safe_v=False), "paged"), (s, None, "fa4", None, "contiguous")]
    for name in ("canvas_bs1_ctx32k_hd128", "canvas_bs1_ctx32k_global"):
        out += [(name, None, "triton", None, "paged"), (name, None, "cute", None, "paged"),
                (name, None, "cute", dict(CLUSTER, num_splits=2), "paged"),
                (name, None, "cute", dict(COMBINE, num_splits=2), "paged"), (name, None, "cute", SPLIT1, "paged")]
    out += [(b4, None, "triton", None, "paged"), (b4, None, "cute", None, "paged"),
            (b4, None, "cute", None, "contiguous"), (b4, None, "fa4", None, "contiguous"),
            (b4, None, "fa4", None, "paged")]
    out += [(g16, None, "triton", None, "paged"), (g16, None, "cute", None, "paged")]
    for w in (511, 255, 63):
        out += [(s, w, "triton", None, "paged"), (s, w, "cute", None, "paged"),
                (s, w, "cute", dict(CLUSTER, num_splits=2), "paged")]
    return out


def _workload(name: str):
    named = {w.name: w for w in wl.named_workloads()}
    if name in named:
        return named[name]
    n, ctx, layer = wl.parse_canvas_name(name)
    return next(w for w in wl.batch_ladder((layer,), ctx=ctx, sizes=(n,)) if w.name == name)


def _maker(b, backend, cfg, layout):
    args = types.SimpleNamespace()
    if backend == "fa4":
        return ba.make_fa4(b, args, layout)[0]
    return ba.make_blockdiff(b, args, backend, cfg, layout=layout)[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no case after this many seconds")
    p.add_argument("--only", default="*", help="glob over '<workload> <backend>' of the cases to run")
    p.add_argument("--plan", action="store_true", help="print the cases and exit (no GPU)")
    a = p.parse_args(argv)
    todo = [c for c in cases() if fnmatch.fnmatchcase(f"{c[0]} {c[2]}", a.only)]
    if a.plan:
        for c in todo:
            print(c)
        return todo
    t0 = time.time()
    common.warm_up_gpu("cuda", 2.0)
    rows = []
    x = torch.zeros(4, device="cuda")
    for nk in (1, 2):
        def f(nk=nk):
            for _ in range(nk):
                _empty[(132,)](x, -1, num_warps=4)
        rows.append(dict(kind="empty", kernels=nk, cold_us=common.time_graph_ms(f) * 1e3, warm_us=warm_graph_us(f)))
        print(json.dumps(rows[-1]), flush=True)
    built, ref = {}, {}
    for name, window, backend, cfg, layout in todo:
        if time.time() - t0 > a.budget_s:
            print("budget spent: stop before", name, window, backend, cfg, layout, flush=True)
            break
        key = (name, window)
        try:
            if key not in built:
                w = _workload(name)
                if window is not None:
                    w = dataclasses.replace(w, window_size=window)
                built[key] = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
            b = built[key]
            fn = _maker(b, backend, cfg, layout)
            o = fn()
            torch.cuda.synchronize()
            if backend == "triton" and layout == "paged" and cfg is None:
                ref[key] = o.clone()
            launch = ba.cute_launch() if backend == "cute" else {}
            row = dict(kind="case", workload=name,
                       window_size=window if window is not None else b.workload.window_size, backend=backend,
                       config=cfg, kv_layout=layout, launch=launch, cold_us=common.time_graph_ms(fn) * 1e3,
                       warm_us=warm_graph_us(fn), kernels_us=_kernel_times_us(fn, width=200))
            if key in ref and backend != "fa4":
                row["max_abs_diff_vs_triton"] = float((o.float() - ref[key].float()).abs().max())
                row["isfinite"] = bool(torch.isfinite(o).all())
        except Exception as e:  # noqa: BLE001 - report and go on
            row = dict(kind="case", workload=name, window_size=window, backend=backend, config=cfg, kv_layout=layout,
                       error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(common.jsonable(row)), flush=True)
    common.write_experiment_json("cute_floor.json", dict(env=common.env_record("cuda"), rows=rows), a.out)
    return rows


if __name__ == "__main__":
    main()
