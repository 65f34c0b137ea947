"""CUDA-graph times with and without the L2 flush between replays, triton vs FA4 (GPU experiment; record of the
H200 run: bench/results/history/warm_l2-h200.{json,md}).

The benchmarks time each replay after ``do_bench`` zeroes a 256 MB buffer, so metadata, Q and K / V come from
HBM. A serving step's attention finds Q and the metadata just written by the kernels before it, in L2. This
probe times both: ``cold_us`` = ``common.time_graph_ms`` (flush before every replay), ``warm_us`` = the mean of
200 back-to-back replays of the same graph between two CUDA events. Usage (GPU, FA4 importable):

    python3 -m blockdiff.bench.experiments.probe_warm_l2 canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k

Writes ``warm_l2.json`` to ``--out`` (default ``$OUT``, else the git-ignored bench/results/local/).
"""
import argparse
import json
import types

import torch

from blockdiff.bench import bench_attention as ba
from blockdiff.bench import workloads as wl
from blockdiff.bench.common import capture_cuda_graph, time_graph_ms, warm_up_gpu, write_experiment_json


def warm_graph_us(fn, n=200):
    g = capture_cuda_graph(fn)
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workloads", help="comma-separated named workloads")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    a = p.parse_args(argv)
    names = a.workloads.split(",")
    warm_up_gpu("cuda", 2.0)
    args = types.SimpleNamespace()
    rows = []
    for name in names:
        w = {x.name: x for x in wl.named_workloads()}[name]
        b = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
        makers = [("triton", lambda: ba.make_blockdiff(b, args, "triton")[0])]
        for layout in ("paged", "contiguous"):
            makers.append((f"fa4[{layout}]", lambda layout=layout: ba.make_fa4(b, args, layout)[0]))
        for label, mk in makers:
            try:
                fn = mk()
                fn()
                torch.cuda.synchronize()
                cold = time_graph_ms(fn) * 1e3
                warm = warm_graph_us(fn)
                cold2 = time_graph_ms(fn) * 1e3
                warm2 = warm_graph_us(fn)
            except Exception as ex:  # noqa: BLE001
                print(name, label, "ERR", type(ex).__name__, str(ex)[:200], flush=True)
                continue
            row = dict(workload=name, backend=label, cold_us=[cold, cold2], warm_us=[warm, warm2])
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_experiment_json("warm_l2.json", rows, a.out)
    return rows


if __name__ == "__main__":
    main()
