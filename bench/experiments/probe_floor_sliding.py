"""Where canvas_bs1_ctx32k_sliding's time goes (GPU experiment).

Measures, in one process: the CUDA-graph time of an empty one- and two-kernel graph (the floor every backend pays
in bench_attention's graph timing), and for the workload with ``window_size`` W in {1023, 511, 255, 127, 63, 0}
the graph time of the triton backend and each kernel's device time (torch.profiler), for the automatic choice
and forced 1 / 4 splits. Fitting the kernel time against key blocks per program separates the per-block cost
from the fixed cost. Record of the H200 run: bench/results/history/floor_sliding-h200.{json,md}.

    python3 -m blockdiff.bench.experiments.probe_floor_sliding [--out DIR]

Writes ``floor_sliding.json`` to ``--out`` (default ``$OUT``, else the git-ignored bench/results/local/).
"""
import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from blockdiff.attention.triton import attention_triton
from blockdiff.attention.triton import interface as triton_interface
from blockdiff.bench import common
from blockdiff.bench import workloads as wl

WINDOWS = (1023, 511, 255, 127, 63, 0)


@triton.jit
def _empty(x_ptr, n):
    pid = tl.program_id(0)
    if pid == n:
        tl.store(x_ptr, 1.0)


def _kernel_times_us(f, width: int = 20) -> dict:
    """Median device time (us) per kernel name (first ``width`` characters) over 20 profiled calls."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
    ev = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            ev.setdefault(e.name[:width], []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return {k: round(sorted(v)[len(v) // 2], 2) for k, v in ev.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    a = p.parse_args(argv)
    rows = []
    common.warm_up_gpu("cuda", 2.0)
    x = torch.zeros(4, device="cuda")
    for nk, grid, nw in [(1, 144, 8), (2, 144, 8), (1, 64, 4)]:
        def f(nk=nk, grid=grid, nw=nw):
            for _ in range(nk):
                _empty[(grid,)](x, -1, num_warps=nw)
        ms = common.time_graph_ms(f)
        print(f"empty graph kernels={nk} grid={grid} warps={nw}: {ms * 1e3:.2f} us", flush=True)
        rows.append(dict(kind="empty", kernels=nk, grid=grid, num_warps=nw, graph_us=ms * 1e3))

    base = {w.name: w for w in wl.named_workloads()}["canvas_bs1_ctx32k_sliding"]
    for W in WINDOWS:
        w = dataclasses.replace(base, window_size=W)
        b = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
        kw = b.attn_kwargs()
        out = torch.empty(b.q.shape[0], b.q.shape[1], b.v_cache.shape[-1], dtype=b.q.dtype, device="cuda")
        for cfg in [None, {"num_splits": 1}, {"num_splits": 4}]:
            def f(cfg=cfg):
                return attention_triton(b.q, b.k_cache, b.v_cache, out=out, check_values=False, config=cfg, **kw)
            try:
                f()
                torch.cuda.synchronize()
                ms = common.time_graph_ms(f)
                ll = dict(triton_interface.LAST_LAUNCH)
                k = _kernel_times_us(f)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(W, cfg, "ERR", str(e)[:300], flush=True)
                continue
            row = dict(kind="window", window_size=W, config=cfg, graph_us=ms * 1e3, impl=ll.get("impl"),
                       num_splits=ll.get("num_splits"), grid=str(ll.get("grid")), kernels_us=k)
            rows.append(row)
            print(json.dumps(row), flush=True)
    common.write_experiment_json("floor_sliding.json", rows, a.out)
    return rows


if __name__ == "__main__":
    main()
