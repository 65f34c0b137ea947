# Issue 27 on the lent H200 (CuTe DSL staged in /tmp/site): the GPU tests of the cute backend's split-value
# (hd 512) and split-KV kernels, two parallel shards of at most T_TESTS seconds, then bench_attention on the
# four workloads those kernels serve (triton, FA4 and cute in one run, cute with FA4's 64-key tiles as well),
# at most T_BENCH seconds. Logs and the record under $OUT; the test tails and the bench's table print last.
# Sourced from the repo root:  T_TESTS=140 T_BENCH=100 source bench/experiments/device/cute_issue27.sh
source bench/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=3"
for f in wide split; do
  (timeout ${T_TESTS:-140} $P tests/attention/cute/test_cute_kernel_$f.py > $OUT/gpu_$f.log 2>&1; echo "rc=$?" >> $OUT/gpu_$f.log) &
done
wait
# cute last in each workload and the riskier hd-512 workloads last: a hang leaves the other rows recorded
timeout ${T_BENCH:-100} python3 -m blockdiff.bench.bench_attention --backends triton,fa4,cute \
  --workloads canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding,canvas_bs1_ctx32k_global,mixed_global_ctx8k \
  --cute-configs '[{"tile_n": 64}]' --budget-s $(( ${T_BENCH:-100} - 25 )) --no-plots --out $OUT \
  --suite-name attention-cute_issue27 > $OUT/bench.log 2>&1
echo "bench rc=$?"
for f in $OUT/gpu_wide.log $OUT/gpu_split.log; do echo "== $f"; tail -4 $f; done
tail -24 $OUT/bench.log
