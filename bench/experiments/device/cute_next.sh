# Ran in the fifth lease (docs/tuning.md 2.6; the xfail marks it mentions are gone since, nan_safe_v is on by
# default). The next lease's cute / Gluon work in one command (docs/tuning.md 7.5 steps 1-2), after the CuTe DSL's
# first staging run (this is the second: it unpacks part 2 first when STAGE2=1, carrying .device/p2). Logs and
# records under $OUT; each test shard within T s (default 240), the timing within B s (default 200).
#  1. GPU tests, four shards at once: cute nan_safe_v after the race fix (xfail until they pass: XPASS expected),
#     the cluster merge, the whole Gluon file (NAN_SAFE_V on by default), the cute interface file;
#  2. on a quiet GPU: the cluster merge against the combine path (and the triton backend) on the three batch-1
#     canvases, and the cute nan_safe_v cost on the workloads of docs/tuning.md 1.11.
#   BLOCKDIFF_COMMIT=<hash> STAGE2=1 bash bench/experiments/device/cute_next.sh
set -u
source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
t=${T:-240}; b=${B:-200}
P="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=5 -rfX"
timeout $t $P tests/attention/cute/test_cute_nan_safe_v.py > $OUT/gpu_cute_nan.log 2>&1 &
timeout $t $P tests/attention/cute/test_cute_kernel_cluster.py > $OUT/gpu_cute_cluster.log 2>&1 &
timeout $t $P tests/attention/triton/test_triton_gluon.py > $OUT/gpu_gluon.log 2>&1 &
timeout $t $P tests/attention/cute/test_cute_interface.py > $OUT/gpu_cute_interface.log 2>&1 &
wait
for f in $OUT/gpu_*.log; do echo "== $f"; tail -5 $f; done
timeout $b python3 -m blockdiff.bench.bench_attention --backends cute,triton --workloads 'canvas_bs1_ctx32k_*' \
  --tile-sweep --tile-configs '[{"split_merge": "cluster"}, {"split_merge": "cluster", "num_splits": 4}, {"nan_safe_v": true}]' \
  --no-plots --suite-name attention-cute_next --out $OUT > $OUT/bench_cute_next.log 2>&1
echo "bench rc=$?"; tail -16 $OUT/bench_cute_next.log
