"""Host time per eager call of the triton backend (``check_values=False``): the full path (launch plans off)
vs planned calls, two alternating rounds in one process, with the do_bench eager and CUDA-graph times of both
and a bitwise comparison of their outputs (GPU experiment). Record of the H200 run:
bench/results/history/host_plans-h200.{json,md}.

    python3 -m blockdiff.bench.experiments.probe_host_overhead canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k

The plans are switched through the triton backend's ``PLANS_ENABLED`` / ``PLANS``. Writes ``host_ab.json`` to
``--out`` (default ``$OUT``, else the git-ignored bench/results/local/).
"""
import argparse
import json
import statistics
import time

import torch

from blockdiff.attention.triton import attention_triton
from blockdiff.attention.triton import interface as triton_interface
from blockdiff.bench import common
from blockdiff.bench import workloads as wl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workloads", help="comma-separated named workloads")
    p.add_argument("--calls", type=int, default=300, help="host-timed calls per round and mode")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    a = p.parse_args(argv)
    common.warm_up_gpu("cuda", 2.0)
    rows = []
    for name in a.workloads.split(","):
        w = {x.name: x for x in wl.named_workloads()}[name]
        b = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
        kw = b.attn_kwargs()
        out = torch.empty(b.q.shape[0], b.q.shape[1], b.v_cache.shape[-1], dtype=b.q.dtype, device="cuda")

        def f():
            return attention_triton(b.q, b.k_cache, b.v_cache, out=out, check_values=False, **kw)
        res, outs = {}, {}
        try:
            for _ in range(2):
                for mode in ("full", "plan"):
                    triton_interface.PLANS_ENABLED = mode == "plan"
                    triton_interface.PLANS.clear()
                    for _ in range(10):
                        f()
                    torch.cuda.synchronize()
                    ts = []
                    for i in range(a.calls):
                        t0 = time.perf_counter()
                        f()
                        ts.append(time.perf_counter() - t0)
                        if i % 50 == 49:
                            torch.cuda.synchronize()
                    torch.cuda.synchronize()
                    eager = common.time_eager_ms(f, "cuda")
                    graph = common.time_graph_ms(f)
                    f()
                    torch.cuda.synchronize()
                    outs[mode] = out.clone()
                    res.setdefault(mode, []).append(dict(host_us=statistics.median(ts) * 1e6, eager_us=eager * 1e3,
                                                         graph_us=graph * 1e3))
        finally:
            triton_interface.PLANS_ENABLED = True
        last = triton_interface.LAST_LAUNCH
        row = dict(workload=name, impl=last["impl"], num_splits=last["num_splits"],
                   bitwise_equal=bool(torch.equal(outs["full"], outs["plan"])), **res)
        rows.append(row)
        print(json.dumps(row), flush=True)
    common.write_experiment_json("host_ab.json", rows, a.out)
    return rows


if __name__ == "__main__":
    main()
