# The cute backend's split_merge="triton" (the shared Triton merge, docs/tuning.md 2.33) on the lent H200 in one
# command, <= ~8 min after the CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying .device/p2).
# What comes back under $OUT: shards.log (every shard's log and the GPU health line) and the A/B's log and record.
#  1. in parallel shards of at most T s each (default 200):
#     - own: tests/attention/cute/test_cute_split_merge.py (the underflow case against every merge, FA4's
#       combine an xfail(strict); the Triton merge against the reference on canvases, every head-dim family, both
#       layouts; the NaN-safe V cases at 3 splits);
#     - split / nan: test_cute_kernel_split.py and the split and no-row-sees cases of test_cute_nan_safe_v.py
#       with split_merge "triton" forced into every call's config (switch_lib.sh config_run; one split resolves to
#       the plain kernel; their own "combine" / "cluster" is overridden, so they run the two-launch path with the
#       Triton merge; the cluster tests, which assert the cluster kernel, are not run this way);
#  2. bench/experiments/ab_cute_configs.py on the split launches (WORKLOADS, default the hd-128 canvas at 4 splits,
#     the sliding canvas at 2 and the hd-512 canvas at 2): "combine" against "triton" and the default ("auto":
#     the cluster at 2 splits <= hd 256, else the combine until 2.35, the Triton merge since), with the triton
#     backend, CUDA-graph medians, paged,
#     at most B s (default 240; B=0 skips it). Prediction (2.33): the Triton merge within +-1 us of FA4's combine
#     (both read S x total_q x H x Dv x 4 bytes once; FA4's launch was measured at ~5.5 us on the sliding canvas,
#     triton's merge at ~3.5 us in its own floor). Decision rule: "auto" takes "triton" in place of "combine" when
#     every test passes and it is not slower by more than 2 % on any split launch (a correctness fix, so a small
#     measured cost is accepted and recorded, as with nan_safe_v).
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [T=200] [B=240] [WORKLOADS=...] bash bench/experiments/device/cute_triton_merge.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-200}; SWITCH=split_merge
source bench/experiments/device/switch_lib.sh
C=tests/attention/cute
gpu_run sw_own $C/test_cute_split_merge.py &
config_run split_merge "'triton'" sw_split $C/test_cute_kernel_split.py &
config_run split_merge "'triton'" sw_nan $C/test_cute_nan_safe_v.py -k "split or no_row_sees" &
wait
gpu_health
switch_logs
switch_pack
[ "${B:-240}" = 0 ] && exit 0
timeout ${B:-240} python3 -m blockdiff.bench.experiments.ab_cute_configs \
  ${WORKLOADS:-canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding,canvas_bs1_ctx32k_global} \
  '{"combine": {"split_merge": "combine"}, "triton": {"split_merge": "triton"}, "auto": {}}' \
  --layouts paged --no-fa4 --triton --rounds 3 --out $OUT > $OUT/ab_triton_merge.log 2>&1
echo "ab rc=$?"; tail -24 $OUT/ab_triton_merge.log
