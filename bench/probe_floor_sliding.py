"""Where canvas_bs1_ctx32k_sliding's time goes (H200 probe; record: bench/results/floor_sliding-h200.{json,md}).

Measures, in one process: the CUDA-graph time of an empty one- and two-kernel graph (the floor every backend pays
in bench_attention's graph timing), and for the workload with ``window_size`` W in {1023, 511, 255, 127, 63, 0}
the graph time of the triton backend and each kernel's device time (torch.profiler), for the automatic choice
and forced 1 / 4 splits. Fitting the kernel time against key blocks per program separates the per-block cost
from the fixed cost. Usage (GPU): ``OUT=/tmp python3 bench/probe_floor_sliding.py`` writes
``$OUT/floor_sliding.json``.
"""
import dataclasses, json, os, sys, torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as wl
from common import time_graph_ms, warm_up_gpu
from blockdiff.attention.triton import interface as TA
from torch.profiler import profile, ProfilerActivity

out_rows = []
warm_up_gpu("cuda", 2.0)

@triton.jit
def _empty(x_ptr, n):
    pid = tl.program_id(0)
    if pid == n:
        tl.store(x_ptr, 1.0)

x = torch.zeros(4, device="cuda")
for nk, grid, nw in [(1, 144, 8), (2, 144, 8), (1, 64, 4)]:
    def f():
        for _ in range(nk):
            _empty[(grid,)](x, -1, num_warps=nw)
    ms = time_graph_ms(f)
    print(f"empty graph kernels={nk} grid={grid} warps={nw}: {ms*1e3:.2f} us", flush=True)
    out_rows.append(dict(kind="empty", kernels=nk, grid=grid, num_warps=nw, graph_us=ms * 1e3))

base = {x.name: x for x in wl.named_workloads()}["canvas_bs1_ctx32k_sliding"]
def prof(f):
    for _ in range(5): f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20): f()
        torch.cuda.synchronize()
    ev = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            ev.setdefault(e.name[:20], []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return {k: round(sorted(v)[len(v) // 2], 2) for k, v in ev.items()}

for W in [1023, 511, 255, 127, 63, 0]:
    w = dataclasses.replace(base, window_size=W)
    b = wl.build(w, device=torch.device("cuda"), dtype=torch.bfloat16, page_size=64)
    kw = b.attn_kwargs()
    out = torch.empty(b.q.shape[0], b.q.shape[1], b.v_cache.shape[-1], dtype=b.q.dtype, device="cuda")
    for cfg in [None, {"num_splits": 1}, {"num_splits": 4}]:
        f = lambda: TA.attention_triton(b.q, b.k_cache, b.v_cache, out=out, check_values=False, config=cfg, **kw)
        try:
            f(); torch.cuda.synchronize()
            ms = time_graph_ms(f)
            ll = dict(TA.LAST_LAUNCH)
            k = prof(f)
        except Exception as e:
            print(W, cfg, "ERR", str(e)[:300], flush=True); continue
        row = dict(kind="window", window_size=W, config=cfg, graph_us=ms * 1e3, impl=ll.get("impl"),
                   num_splits=ll.get("num_splits"), grid=str(ll.get("grid")), kernels_us=k)
        out_rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(out_rows, open(os.path.join(os.environ.get("OUT", "."), "floor_sliding.json"), "w"), indent=1)
