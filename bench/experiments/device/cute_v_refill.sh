# The roles kernel's V refill by halves (config v_refill="halves", attention/cute/kernel_roles.py; docs/tuning.md
# 2.12 remedy 2, 2.15) on the lent H200 in one command, ~4 min, after the CuTe DSL's first staging run (this can be
# the second: it unpacks part 2 first when STAGE2=1, carrying .device/p2). Logs and records under $OUT.
#  1. its GPU tests (tests/attention/cute/test_cute_v_refill.py: halves against the fp64 reference and equal to the
#     default roles kernel, paged 64 / 16 / 8 / 256 and contiguous, windows, NaN-safe V on / off, 32-key tiles, cache
#     rows past the end poisoned, many key blocks, split-KV) in four parallel shards of at most T s each (default 150);
#  2. bench_attention within B s (default 100), cute only, CUDA-graph medians, mixed_global_ctx8k: the default row
#     (since f4c19a9 the roles kernel in work order at hd 512; the named rows spell every switch out)
#     beside cute[{"wide_design": "roles", "batch_order": "work"}] (2.14's measured 464.4 TFLOP/s) and the same with
#     "v_refill": "halves", and roles with halves in the given order.
# Prediction, written before the run (docs/tuning.md 2.15): a 64-key block ~3,500 -> ~3,150 clk (3,050-3,250; each P V
# warpgroup's loader issues 4 boxes, not 8, from its own warpgroup's release, the page index read off the chain), so
# roles + work + halves ~+9 % over roles + work in the same run (+6 to +13 %): ~510 TFLOP/s beside 2.14's 464 with
# the 12-kernel permutation, ~530 beside ~481 with the one-launch permutation; roles + halves in the given order ~+9 %
# over 2.14's 438 (~475). Outputs equal to the default roles kernel's.
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] bash bench/experiments/device/cute_v_refill.sh
# Since docs/tuning.md 2.20 a roles config without v_refill / qk_issue resolves to the V refill by halves with S issued
# ahead: add "v_refill": "one_warp", "qk_issue": "serial" to its roles rows to reproduce them as they ran.
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-150}; b=${B:-100}
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5"
F=tests/attention/cute/test_cute_v_refill.py
# eight configurations x (halves, default) = 16 compiles (7-10 s each on this host) and 7 more cases, in four shards
timeout $t $P $F -k "matches_reference_and_the_default and p64" \
  > $OUT/gpu_vrefill_p64.log 2>&1 < /dev/null &
timeout $t $P $F -k "matches_reference_and_the_default and contig" > $OUT/gpu_vrefill_contig.log 2>&1 < /dev/null &
timeout $t $P $F -k "matches_reference_and_the_default and (p16 or p8 or p256)" > $OUT/gpu_vrefill_pages.log \
  2>&1 < /dev/null &
timeout $t $P $F -k "gpu and not matches_reference_and_the_default" > $OUT/gpu_vrefill_rest.log 2>&1 < /dev/null &
wait
for f in $OUT/gpu_vrefill_p64.log $OUT/gpu_vrefill_contig.log $OUT/gpu_vrefill_pages.log $OUT/gpu_vrefill_rest.log; do
  echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
done
CFGS='[{"wide_design": "roles", "batch_order": "work"}, {"wide_design": "roles", "batch_order": "work", "v_refill": "halves"}, {"wide_design": "roles", "v_refill": "halves", "batch_order": "given"}]'
timeout $b python3 -m blockdiff.bench.bench_attention --backends cute --workloads mixed_global_ctx8k \
  --cute-configs "$CFGS" --budget-s $((b - 20)) --no-plots --suite-name attention-cute_v_refill --out $OUT \
  > $OUT/bench_v_refill.log 2>&1
echo "bench rc=$?"; tail -12 $OUT/bench_v_refill.log
