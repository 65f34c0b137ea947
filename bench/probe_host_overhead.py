"""Host time per eager call of the triton backend (``check_values=False``): the full path (launch plans off:
``triton_attention._PLANS_ENABLED = False``) vs planned calls (``triton_attention._PLANS``), two alternating
rounds in one process, with the do_bench eager and CUDA-graph times of both and a bitwise comparison of their
outputs (H200 probe; record:
bench/results/host_plans-h200.{json,md}). Usage (GPU): ``OUT=/tmp python3 bench/probe_host_overhead.py
canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k`` writes ``$OUT/host_ab.json``.
"""
import json, os, statistics, sys, time, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as wl
from common import time_eager_ms, time_graph_ms, warm_up_gpu
from blockdiff.attention.triton import interface as TA

names = sys.argv[1].split(",")
warm_up_gpu("cuda", 2.0)
rows = []
for name in names:
    w = {x.name: x for x in wl.named_workloads()}[name]
    b = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
    kw = b.attn_kwargs()
    out = torch.empty(b.q.shape[0], b.q.shape[1], b.v_cache.shape[-1], dtype=b.q.dtype, device="cuda")
    f = lambda: TA.attention_triton(b.q, b.k_cache, b.v_cache, out=out, check_values=False, **kw)
    res = {}
    outs = {}
    for rnd in range(2):
        for mode in ("full", "plan"):
            TA._PLANS_ENABLED = mode == "plan"
            TA._PLANS.clear()
            for _ in range(10): f()
            torch.cuda.synchronize()
            ts = []
            for i in range(300):
                t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
                if i % 50 == 49: torch.cuda.synchronize()
            torch.cuda.synchronize()
            eager = time_eager_ms(f, "cuda")
            graph = time_graph_ms(f)
            f(); torch.cuda.synchronize(); outs[mode] = out.clone()
            res.setdefault(mode, []).append(dict(host_us=statistics.median(ts) * 1e6, eager_us=eager * 1e3,
                                                 graph_us=graph * 1e3))
    same = bool(torch.equal(outs["full"], outs["plan"]))
    row = dict(workload=name, impl=TA.LAST_LAUNCH["impl"], num_splits=TA.LAST_LAUNCH["num_splits"],
               bitwise_equal=same, **res)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "host_ab.json"), "w"), indent=1)
