"""How many thread-block clusters of S CTAs fit the GPU at once, against how many the cute cluster merge launches
(GPU experiment; docs/tuning.md 2.6 / 7.7 step 3).

2.6 measured the one-launch cluster merge faster than FA4's combine at 2 splits on the sliding canvas (64 CTAs)
and 1.6x slower with clusters of 4 on the hd-128 canvas (128 CTAs). Hypothesis: the cute kernels run one CTA per
SM (160-230 KB of shared memory), a cluster must sit in one GPC, and 32 clusters of 4 do not all fit at once, so
part of the grid runs as a second wave. This probe prints, per workload and split count S, the clusters the
launch needs (FA4's varlen grid: query tiles x KV heads, ``config.grid_tiles``, tiles from the automatic cute
config) and ``cuOccupancyMaxActiveClusters`` for clusters of S CTAs at one CTA per SM (FA4's
``cute_dsl_utils.get_max_active_clusters``), and the waves that gives. Usage (GPU, FA4 importable):

    python3 -m blockdiff.bench.experiments.probe_cluster_occupancy 'canvas_bs1_ctx32k_*'

Without a GPU it prints the clusters needed only. Writes ``cluster_occupancy.json`` to ``--out`` (default
``$OUT``, else the git-ignored bench/results/local/).
"""
import argparse
import math

import torch

from blockdiff.bench import workloads as wl
from blockdiff.bench.common import write_experiment_json

SPLITS = (1, 2, 4, 8)


def max_active_clusters(size: int) -> int | None:
    """Clusters of ``size`` CTAs (one per SM) the current GPU holds at once; None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    from flash_attn.cute.cute_dsl_utils import get_max_active_clusters
    # The driver query needs a current context: without torch's primary context it fails with
    # CUDA_ERROR_INVALID_CONTEXT (the first H200 run, docs/tuning.md 2.7).
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return int(get_max_active_clusters(size))


def rows_for(w, num_sms: int) -> list[dict]:
    """One row per split count: the launch's clusters (= query tiles x KV heads), CTAs, what fits, waves."""
    from blockdiff.attention.cute import config as cc

    cfg = cc.resolve_launch_config(
        w.head_dim, w.head_dim_v, w.window_size, None, total_q=w.total_q, num_seqs=w.batch_size,
        num_kv_heads=w.num_kv_heads, qhead_per_kvhead=w.num_heads // w.num_kv_heads, keys_capacity=max(w.seq_lens),
        max_seqlen_q=max(w.q_lens), max_seqlen_k=max(w.seq_lens), num_sms=num_sms)
    tiles = cc.grid_tiles(w.total_q, w.batch_size, w.num_kv_heads, w.num_heads // w.num_kv_heads, cfg.tile_m)
    out = []
    for s in SPLITS:
        fit = max_active_clusters(s)
        out.append(dict(workload=w.name, tile_m=cfg.tile_m, tile_n=cfg.tile_n, automatic_splits=cfg.num_splits,
                        splits=s, clusters=tiles, ctas=tiles * s, max_active_clusters=fit,
                        waves=None if not fit else math.ceil(tiles / fit)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workloads", nargs="?", default="canvas_bs1_ctx32k_*",
                   help="comma-separated globs of named workloads (default: the three batch-1 canvases)")
    p.add_argument("--num-sms", type=int, default=None, help="SM count for the automatic split (default: the GPU's, "
                   "else 132, the H200's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    num_sms = args.num_sms or (torch.cuda.get_device_properties(0).multi_processor_count
                               if torch.cuda.is_available() else 132)
    rows = [r for w in wl.select(wl.named_workloads(), args.workloads) for r in rows_for(w, num_sms)]
    for r in rows:
        print(f"{r['workload']:28s} tile_m {r['tile_m']:3d} auto splits {r['automatic_splits']}  S={r['splits']}: "
              f"{r['clusters']} clusters ({r['ctas']} CTAs), max active {r['max_active_clusters']}, "
              f"waves {r['waves']}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_experiment_json("cluster_occupancy.json", dict(device=device, num_sms=num_sms, rows=rows), args.out)
    return rows


if __name__ == "__main__":
    main()
