# The cute GPU tests named in docs/tuning.md 7.9 step 1 in parallel shards (one pytest per FILES entry, T seconds
# each, default 420), then the cluster occupancy probe; logs under $OUT. Doubles as the CuTe DSL's second staging
# run (STAGE2=1, carry .device/p2):
#   STAGE2=1 bash bench/experiments/device/cute_tests.sh
# FILES overrides the shard list: entries separated by ';', each a pytest argument string. PROBE=0 leaves the probe out.
source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-420}
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf"
FILES=${FILES:-tests/attention/cute/test_cute_nan_safe_v.py;tests/attention/cute/test_cute_kernel_cluster.py;tests/attention/cute/test_cute_kernel_split.py}
i=0
IFS=';' read -ra shards <<< "$FILES"
for s in "${shards[@]}"; do
  i=$((i + 1)); timeout $t $P $s > $OUT/gpu_shard$i.log 2>&1 < /dev/null &
done
wait
for f in $OUT/gpu_shard*.log; do echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED" $f | head -5; done
[ "${PROBE:-1}" = 1 ] || exit 0  # PROBE=0: the shards only
timeout 90 python3 -m blockdiff.bench.experiments.probe_cluster_occupancy 'canvas_bs1_ctx32k_*' --out $OUT 2>&1 | tail -15
