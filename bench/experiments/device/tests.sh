# The GPU tests in four parallel shards (T: seconds per shard); logs under $OUT.
source bench/experiments/device/env.sh
t=${T:-540}
P="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=5 -rf"
timeout $t $P tests/attention/triton/test_triton_gluon.py > $OUT/gpu_gluon.log 2>&1 &
timeout $t $P tests/attention/triton --ignore=tests/attention/triton/test_triton_gluon.py > $OUT/gpu_triton.log 2>&1 &
timeout $t $P tests/attention/cute > $OUT/gpu_cute.log 2>&1 &
timeout $t $P tests/sampler tests/model tests/integration tests/bench > $OUT/gpu_rest.log 2>&1 &
wait
for f in $OUT/gpu_*.log; do echo "== $f"; tail -4 $f; done
