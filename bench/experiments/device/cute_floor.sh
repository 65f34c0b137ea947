# Issue 27's floors in one command (docs/tuning.md 2.7), after the CuTe DSL's first staging run (this is the second:
# it unpacks part 2 first when STAGE2=1, carrying .device/p2), on a quiet GPU: the clusters that fit at once
# (probe_cluster_occupancy, seconds), then probe_cute_floor within B s (default 330): the split kernel alone, with
# and without the L2 flush, the window ladder, the hd-512 kernels' own rate, contiguous FA4 beside the bs-4 canvas.
#   BLOCKDIFF_COMMIT=<hash> STAGE2=1 bash bench/experiments/device/cute_floor.sh
set -u
source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
timeout 60 python3 -m blockdiff.bench.experiments.probe_cluster_occupancy 'canvas_bs1_ctx32k_*,canvas_bs4_*' \
  --out $OUT > $OUT/cluster_occupancy.log 2>&1; echo "occupancy rc=$?"; tail -20 $OUT/cluster_occupancy.log
b=${B:-330}
timeout $((b + 60)) python3 -m blockdiff.bench.experiments.probe_cute_floor --budget-s $b --out $OUT \
  > $OUT/cute_floor.log 2>&1; echo "floor rc=$?"; cut -c1-400 $OUT/cute_floor.log | tail -45
