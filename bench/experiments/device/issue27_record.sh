# Issue 27's seven workloads in one record, every backend at its current default, on the lent H200 (~8 min), after
# the CuTe DSL's first staging run (STAGE2=1 makes this the second, carrying .device/p2). No record held the cute
# default (roles kernel with K halves at hd 512, the cluster merge on the sliding canvas, nan_safe_v on) beside
# triton, FA4 (paged and contiguous) and FlexAttention in one run (the 2026-12-04 audit); this makes it.
#  1. the hd-128 / sliding workloads (mixed_sliding_ctx8k, prefill16k_hd128, canvas_bs4_ctx4k_hd128,
#     canvas_bs1_ctx32k_hd128, canvas_bs1_ctx32k_sliding): triton, fa4 (paged, contiguous), flex, cute; at most
#     B1 s (default 260);
#  2. the hd-512 workloads (mixed_global_ctx8k, canvas_bs1_ctx32k_global): triton, flex, cute (FA4 cannot run
#     hd 512: recorded as skipped); at most B2 s (default 220).
# Each row: eager and CUDA-graph medians, both by do_bench with the L2 flushed between calls (bench/common.py's
# time_graph_ms times graph.replay() with the same timer: neither is an unflushed time), checked against the dense
# reference, finite. Records
# attention-issue27_defaults{_hd128,_hd512}-h200.json under $OUT; copy them to bench/results/ with the commit.
# Prediction (before the run, from docs/tuning.md 2.6, 2.7, 2.22, 2.23): mixed_global 1.10-1.13x triton's TFLOP/s;
# canvas_global 0.94-0.97x triton's time; canvas_hd128 0.90-0.94x; sliding 27-33 us graph; bs4 1.00-1.05x
# contiguous FA4; mixed_sliding 0.90-0.95x FA4; prefill16k >= 1.05x paged FA4. A workload outside its range by
# more than 3 % is a regression to explain before anything else.
#   [STAGE2=1] [B1=...] [B2=...] bash bench/experiments/device/issue27_record.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
BA="python3 -m blockdiff.bench.bench_attention --no-plots --out $OUT --fa4-layouts paged,contiguous"
# cute last in each workload and the hd-512 group last: a hang leaves the other rows recorded
timeout ${B1:-260} $BA --backends triton,fa4,flex,cute --budget-s $(( ${B1:-260} - 40 )) \
  --workloads mixed_sliding_ctx8k,prefill16k_hd128,canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding \
  --suite-name attention-issue27_defaults_hd128 > $OUT/issue27_hd128.log 2>&1
echo "hd128 rc=$?"; tail -30 $OUT/issue27_hd128.log
timeout ${B2:-220} $BA --backends triton,fa4,flex,cute --budget-s $(( ${B2:-220} - 40 )) \
  --workloads canvas_bs1_ctx32k_global,mixed_global_ctx8k \
  --suite-name attention-issue27_defaults_hd512 > $OUT/issue27_hd512.log 2>&1
echo "hd512 rc=$?"; tail -16 $OUT/issue27_hd512.log
