# Issue 25, the sampler at a serving batch (docs/tuning.md 7.11 / 7.12), one quiet-GPU command (~3 min, no server
# running), logs and records under $OUT:
#  1. the chunked soft embedding per vocabulary chunk at 32 all-sampled canvases (8,192 rows): bench_sampler
#     --soft-chunks 1024..16384 (checked rows; the automatic chunk at this batch is 2,048 tokens, a 32 MiB buffer).
#     Predicted in 7.12: ~25 % less soft-embedding time from 2,048- to 8,192-token chunks, nothing more above.
#  2. where the stats pass loses its bandwidth (7.11: ~560 GB/s of fp32 logits in serving): Nsight Compute on one
#     `_stats_kernel` launch of the same step, if `ncu` is on the machine (speed of light, occupancy, warp stalls).
# Sourced from the repo root:  BLOCKDIFF_COMMIT=<hash> source bench/experiments/device/sampler_batch.sh
source bench/device_env.sh
timeout 170 python3 -m blockdiff.bench.bench_sampler --canvases 32 --all-sampled \
  --soft-chunks 1024,2048,4096,8192,16384 --backends fused --no-compare --no-plots --out $OUT \
  > $OUT/sampler_n32_chunks.log 2>&1
echo "sampler n=32 chunks rc=$?"; tail -16 $OUT/sampler_n32_chunks.log
if command -v ncu > /dev/null; then
  timeout 150 ncu --kernel-name _stats_kernel --launch-skip 2 --launch-count 1 --set full --target-processes all \
    -o $OUT/ncu_stats_n32 python3 -m blockdiff.bench.bench_sampler --canvases 32 --all-sampled --backends fused \
    --no-compare --no-chunked --no-parts --no-plots --out /tmp/ncu_out > $OUT/ncu_stats.log 2>&1
  echo "ncu rc=$?"; tail -5 $OUT/ncu_stats.log
  [ -f $OUT/ncu_stats_n32.ncu-rep ] && ncu --import $OUT/ncu_stats_n32.ncu-rep --page details --csv \
    > $OUT/ncu_stats_n32.csv 2>/dev/null && rm -f $OUT/ncu_stats_n32.ncu-rep && grep -E "Duration|Throughput|Occupancy|Registers" $OUT/ncu_stats_n32.csv | head -20
else
  echo "ncu not on this machine: the stats pass's profile is not taken"
fi
