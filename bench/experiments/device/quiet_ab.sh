# Two quiet-GPU questions for one command on the lent H200 (no servers running; ~3-4 min), logs and records under $OUT:
#  1. issue 25: the sampler's stats pass at serving batch sizes. The 2026-12-02 serving profile showed ~1.14 ms a
#     stats call for <= 512 all-sampled rows, against ~1.0 ms for 1024 all-sampled rows in sampler_n4
#     (docs/tuning.md 3.2, 7.3): bench_sampler at 1 and 2 all-sampled canvases with the automatic split and
#     split_v 1 / 2 / 4 / 8 (checked rows). Expected if the split rule (2 x SMs programs) leaves a partial second
#     wave: a larger split lowers the 1-canvas time towards a quarter of sampler_n4's stats time.
#  2. issue 26: the cost of config["NAN_SAFE_V"] (docs/tuning.md 1.11; measured 2026-12-02 and on by default since):
#     bench_attention, triton, switch on (the automatic row) against off (the `triton[False]` tile-sweep row).
# Sourced from the repo root:  BLOCKDIFF_COMMIT=<hash> source bench/experiments/device/quiet_ab.sh
# Files under $OUT (at most 8 come back): sampler.log (both sampler runs' logs, one after the other), the two sampler
# records (JSON + CSV each), nan_safe_v.log and its record (JSON + CSV): 7 (2026-12-05 audit: the two sampler logs
# apart made 9).
source bench/device_env.sh
for n in 1 2; do
  timeout 150 python3 -m blockdiff.bench.bench_sampler --canvases $n --all-sampled --split-v 1,2,4,8 \
    --backends fused --no-compare --no-chunked --no-plots --out $OUT > /tmp/sampler_n$n.log 2>&1
  echo "sampler n=$n rc=$?"; tail -12 /tmp/sampler_n$n.log
  { echo "===== sampler_n$n.log"; cat /tmp/sampler_n$n.log; } >> $OUT/sampler.log
done
timeout 200 python3 -m blockdiff.bench.bench_attention --backends triton --tile-sweep \
  --tile-configs '[{"NAN_SAFE_V": false}]' --workloads prefill16k_hd128,canvas_bs1_ctx32k_sliding,mixed_global_ctx8k,canvas_bs1_ctx32k_hd128 \
  --no-plots --suite-name attention-nan_safe_v --out $OUT > $OUT/nan_safe_v.log 2>&1
echo "nan_safe_v rc=$?"; tail -14 $OUT/nan_safe_v.log
