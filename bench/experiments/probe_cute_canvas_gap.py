#!/usr/bin/env python3
"""Where do the cute backend's extra microseconds on canvas_bs4_ctx4k_hd128 go? (GPU experiment)

Not a backend: subclasses of the cute kernel that put FA4's own pieces back one at a time, each right only for
this all-bidirectional batch without a window. Interleaved CUDA-graph rounds as in ab_cute_configs.py, with FA4
(paged, contiguous) in the same process. Variant sets (``--variants``):

  lpt:    base (is_local kernel with FA4's longest-first tile order), nolpt (scheduler lpt forced off),
          nolocal (FA4's non-causal loop structure: first block + interior), nolocal_lpt;
  bisect: base (lpt off), nolocal, famask (+ FA4's seqlen-only mask), faall (+ FA4's non-causal block info and
          no num_causal_q load: FA4's mainloop inside our kernel wrapper).

Record of the H200 run: bench/results/history/cute_lpt_ab-h200.json (docs/tuning.md).

    python3 -m blockdiff.bench.experiments.probe_cute_canvas_gap --variants bisect --rounds 5

Writes ``ab_variants.json`` to ``--out`` (default ``$OUT``, else the git-ignored bench/results/local/).
The kernel-class swap patches private state of the cute backend and of FA4 (no public knob exists for a
different kernel class): all of it is in :func:`_swapped_kernel`.
"""
import argparse
import contextlib
import json
import os
import statistics
import types
from functools import partial

import torch
import triton.testing as tt

from blockdiff.attention.cute import attention_cute
from blockdiff.attention.cute import interface as ca
from blockdiff.bench import bench_attention as ba
from blockdiff.bench import common
from blockdiff.bench import workloads as wl


def _kernel_classes():
    """(Base, NoLocal, FAMask, FAAll): the cute kernel and its FA4-piece variants (needs FA4 + the CuTe DSL)."""
    from flash_attn.cute.block_info import BlockInfo  # optional dependency: FA4
    from flash_attn.cute.mask import AttentionMask  # optional dependency: FA4

    Base = ca._fa4()["Kernel"]

    class NoLocal(Base):  # FA4's non-causal loop structure (first block + interior): right only for bidirectional rows
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.is_local = False

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

    return Base, NoLocal, FAMask, FAAll


@contextlib.contextmanager
def _swapped_kernel(kernel_cls, lpt, cache: dict):
    """PRIVATE PATCHES, in one place: run the cute backend with ``kernel_cls`` (its compile cache swapped for
    ``cache`` so variants never share a compiled kernel) and, when ``lpt`` is not None, FA4's tile scheduler's
    longest-first order forced to ``lpt``."""
    from flash_attn.cute import flash_fwd_sm90 as F  # optional dependency: FA4

    fa = ca._fa4()
    base, saved_cache, orig_args = fa["Kernel"], ca._COMPILE_CACHE, F.TileSchedulerArguments

    def forced(*a, **k):
        k["lpt"] = lpt
        return orig_args(*a, **k)

    ca._COMPILE_CACHE, fa["Kernel"] = cache, kernel_cls
    if lpt is not None:
        F.TileSchedulerArguments = forced
    try:
        yield
    finally:
        ca._COMPILE_CACHE, fa["Kernel"], F.TileSchedulerArguments = saved_cache, base, orig_args


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", choices=("lpt", "bisect"), default="bisect")
    p.add_argument("--workload", default="canvas_bs4_ctx4k_hd128", help="a named workload")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    a = p.parse_args(argv)
    Base, NoLocal, FAMask, FAAll = _kernel_classes()
    variants = {  # name: (kernel class, lpt override, config lpt)
        "lpt": {"base": (Base, None, True), "nolpt": (Base, False, True), "nolocal": (NoLocal, False, True),
                "nolocal_lpt": (NoLocal, None, True)},
        "bisect": {"base": (Base, None, False), "nolocal": (NoLocal, None, False), "famask": (FAMask, None, False),
                   "faall": (FAAll, None, False)},
    }[a.variants]
    w = {x.name: x for x in wl.named_workloads()}[a.workload]
    b = wl.build(w, device="cuda", dtype=torch.bfloat16)
    fns = {}
    for lay in ("paged", "contiguous"):
        f, to_packed, _ = ba.make_fa4(b, types.SimpleNamespace(), lay)
        fns[f"fa4_{lay}"] = (f, to_packed)
    for vn, (K, lpt, cfg_lpt) in variants.items():
        cache: dict = {}
        for lay, (k, v, kwa) in b.layouts().items():
            out = torch.empty(b.q.shape[0], w.num_heads, w.head_dim_v, dtype=b.q.dtype, device="cuda")

            def f(k=k, v=v, kwa=kwa, out=out, K=K, lpt=lpt, cache=cache, cfg_lpt=cfg_lpt):
                with _swapped_kernel(K, lpt, cache):
                    return attention_cute(b.q, k, v, out=out, check_values=False,
                                          config=dict(num_stages=2, lpt=cfg_lpt), **kwa)
            fns[f"cute_{vn}_{lay}"] = (f, lambda o: o)
    ref = None
    for n, (f, to_packed) in list(fns.items()):
        try:
            o = to_packed(f())
            torch.cuda.synchronize()
            ref = o.float() if ref is None else ref
            print(n, "maxdiff", (o.float() - ref).abs().max().item(), "finite", bool(torch.isfinite(o).all()),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report and drop the row
            print(n, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            del fns[n]
    times = {n: [] for n in fns}
    for _ in range(a.rounds):
        for n, (f, _) in fns.items():
            times[n].append(tt.do_bench_cudagraph(f, rep=200) * 1e3)
    for n, t in times.items():
        print(f"{a.workload} {n:28s} median {statistics.median(t):7.2f} us  all {['%.1f' % x for x in t]}",
              flush=True)
    common.write_experiment_json("ab_variants.json", dict(commit=os.environ.get("BLOCKDIFF_COMMIT"),
                                                          gpu=torch.cuda.get_device_name(), workload=a.workload,
                                                          variants=a.variants, res=times), a.out)


if __name__ == "__main__":
    main()
