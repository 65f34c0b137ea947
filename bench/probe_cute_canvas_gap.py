#!/usr/bin/env python3
"""probe_cute_canvas_gap.py: where do the cute backend's extra microseconds on canvas_bs4_ctx4k_hd128 go? (GPU)

An experiment, not a backend: subclasses of the cute kernel that put FA4's own pieces back one at a time, each
right only for this all-bidirectional batch without a window. Interleaved CUDA-graph rounds as in
ab_cute_configs.py, with FA4 (paged, contiguous) in the same process. Variants (``PROBE`` env: "lpt" or "bisect"):

  lpt:    base (is_local kernel with FA4's longest-first tile order, as before 4c857ab), nolpt (scheduler lpt
          forced off), nolocal (FA4's non-causal loop structure: first block + interior), nolocal_lpt;
  bisect: base (lpt off), nolocal, famask (+ FA4's seqlen-only mask), faall (+ FA4's non-causal block info and
          no num_causal_q load: FA4's mainloop inside our kernel wrapper).

H200 results (bench/results/cute_lpt_ab-h200.json): the longest-first order cost 3.3 us of 65; with it off the
rest of our per-tile logic costs <= 0.5 us (faall is no faster than base).
"""
import json, os, sys, statistics, types, contextlib, torch
import triton.testing as tt
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as wl
import bench_attention as ba
from blockdiff.attention import causal_row_counts
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.cute import kernel as ck
from flash_attn.cute import flash_fwd_sm90 as F
OUT = os.environ.get("OUT", ".")
fa = ca._fa4()
Base = fa["Kernel"]

from functools import partial
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.block_info import BlockInfo

class NoLocal(Base):  # FA4's non-causal loop structure (first block + interior): right only for bidirectional rows
    def __init__(self, *a, **k):
        super().__init__(*a, **k); self.is_local = False

class FAMask(NoLocal):  # + FA4's seqlen-only mask in the first block
    def _mixed_mask_cls(self, block_info):
        return partial(AttentionMask, self.tile_m, self.tile_n, window_size_left=None, window_size_right=None,
                       qhead_per_kvhead_packgqa=self.qhead_per_kvhead if self.pack_gqa else 1)

class FAAll(FAMask):  # + FA4's non-causal block info, no num_causal_q load
    def _mixed_block_info(self, block_info):
        return BlockInfo(self.tile_m, self.tile_n, False, False, False, None, None,
                         qhead_per_kvhead_packgqa=self.qhead_per_kvhead if self.pack_gqa else 1)
    def _mixed_seqlen_cls(self, SeqlenInfoCls):
        return SeqlenInfoCls

@contextlib.contextmanager
def lpt_forced(val):
    if val is None:
        yield; return
    orig = F.TileSchedulerArguments
    def patched(*a, **k):
        k["lpt"] = val; return orig(*a, **k)
    F.TileSchedulerArguments = patched
    try: yield
    finally: F.TileSchedulerArguments = orig

VARIANTS = {  # name: (kernel class, lpt override, config lpt)
    "lpt": {"base": (Base, None, True), "nolpt": (Base, False, True), "nolocal": (NoLocal, False, True),
            "nolocal_lpt": (NoLocal, None, True)},
    "bisect": {"base": (Base, None, False), "nolocal": (NoLocal, None, False), "famask": (FAMask, None, False),
               "faall": (FAAll, None, False)},
}
variants = VARIANTS[os.environ.get("PROBE", "bisect")]
name = os.environ.get("AB_W", "canvas_bs4_ctx4k_hd128")
w = [x for x in wl.named_workloads() if x.name == name][0]
b = wl.build(w, device="cuda", dtype=torch.bfloat16)
kw = b.attn_kwargs(); kw["num_causal_q"] = causal_row_counts(kw.pop("causal"), kw["cu_seqlens_q"])
kwc = dict(kw); kwc.pop("block_table"); kc, vc, cuk = b.contiguous_kv(); kwc["cu_seqlens_k"] = cuk
fns = {}
for lay in ("paged", "contiguous"):
    f, tp, _ = ba.make_fa4(b, types.SimpleNamespace(), lay); fns[f"fa4_{lay}"] = (f, tp)
for vn, (K, lpt, cfg_lpt) in variants.items():
    cache = {}
    for lay, (k, v, a) in (("paged", (b.k_cache, b.v_cache, kw)), ("contiguous", (kc, vc, kwc))):
        out = torch.empty(b.q.shape[0], w.num_heads, w.head_dim_v, dtype=b.q.dtype, device="cuda")
        def f(k=k, v=v, a=a, out=out, K=K, lpt=lpt, cache=cache, cfg_lpt=cfg_lpt):
            saved = ca._COMPILE_CACHE; ca._COMPILE_CACHE = cache; fa["Kernel"] = K
            try:
                with lpt_forced(lpt):
                    return ca.attention_cute(b.q, k, v, out=out, check_values=False, config=dict(num_stages=2, lpt=cfg_lpt), **a)
            finally:
                ca._COMPILE_CACHE = saved; fa["Kernel"] = Base
        fns[f"cute_{vn}_{lay}"] = (f, lambda o: o)
ref = None
for n, (f, tp) in list(fns.items()):
    try:
        o = tp(f()); torch.cuda.synchronize()
        if ref is None: ref = o.float()
        print(n, "maxdiff", (o.float() - ref).abs().max().item(), "finite", bool(torch.isfinite(o).all()), flush=True)
    except Exception as e:
        print(n, "FAILED", type(e).__name__, str(e)[:300], flush=True); del fns[n]
times = {n: [] for n in fns}
for r in range(int(os.environ.get("ROUNDS", "5"))):
    for n, (f, _) in fns.items():
        times[n].append(tt.do_bench_cudagraph(f, rep=200) * 1e3)
for n, t in times.items():
    print(f"{name} {n:28s} median {statistics.median(t):7.2f} us  all {['%.1f' % x for x in t]}", flush=True)
json.dump(dict(commit=os.environ.get("BLOCKDIFF_COMMIT"), gpu=torch.cuda.get_device_name(), workload=name, res=times),
          open(os.path.join(OUT, "ab_variants.json"), "w"), indent=1)
