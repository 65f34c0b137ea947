# The roles kernel's K refill by all four SM warps (FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS, an experiment
# switch; docs/tuning.md 2.17) on the lent H200 in one command, ~3.5 min, after the CuTe DSL's first staging run (this
# can be the second: STAGE2=1, carrying .device/p2). Logs (6 files) and the A/B record under $OUT.
#  1. in parallel shards of at most T s each (default 100): the roles kernel's GPU tests with the switch on (its fuzz
#     and the rest), and its fuzz with the switch off (the kernel the default now picks at head dim 512);
#  2. bench/experiments/ab_k_refill.py on mixed_global_ctx8k and canvas_bs1_ctx32k_global, alone on the GPU: roles +
#     work and roles + work + halves, each with warp 0's refill and with all four warps' (bit-identical outputs;
#     CUDA-graph medians), and the triton backend in the same rounds (issue 27's goals are ratios to it).
# Prediction, written before the run (docs/tuning.md 2.17, from the ncu pair): SM's chain loses most of warp 0's
# ~940-clk K issue; with one-warp V refill the V chain (~3,900 clk a block) still bounds it (~0-3 %); with halves
# (SM-bound at ~4,050 clk a block) ~-600 clk a block: roles + work + halves ~+10-15 % over roles + work
# (~520-550 TFLOP/s).
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] bash bench/experiments/device/cute_k_refill.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-95}
F=tests/attention/cute/test_cute_kernel_roles.py
run() {  # $1 switch (1 on / 0 off), $2 log name, rest: pytest arguments
  local on=$1 log=$2; shift 2
  timeout $t python3 -c "
import sys, pytest
from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
R._K_REFILL_ALL_WARPS = bool($on)
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', '-rf', '--maxfail=5'] + sys.argv[1:]))
" "$@" > $OUT/$log.log 2>&1 < /dev/null
}
A="fuzz and (config0 or config1 or config2)"; Z="fuzz and not (config0 or config1 or config2)"
run 1 kref_fuzz_on_a $F -k "$A" & run 1 kref_fuzz_on_b $F -k "$Z" & run 1 kref_rest_on $F tests/attention/cute/test_cute_k_refill.py -k "gpu and not fuzz" &
run 0 kref_fuzz_off_a $F -k "$A" & run 0 kref_fuzz_off_b $F -k "$Z" &
wait
for f in kref_fuzz_on_a kref_fuzz_on_b kref_rest_on kref_fuzz_off_a kref_fuzz_off_b; do
  echo "== $f"; grep -E "passed|failed|error" $OUT/$f.log | tail -2; grep -E "^FAILED|Timeout" $OUT/$f.log | head -5
done
timeout ${B:-120} python3 -m blockdiff.bench.experiments.ab_k_refill mixed_global_ctx8k,canvas_bs1_ctx32k_global --triton \
  '{"work": {"wide_design": "roles", "batch_order": "work"}, "work_halves": {"wide_design": "roles", "batch_order": "work", "v_refill": "halves"}}' \
  --rounds 3 --out $OUT > $OUT/ab_k_refill.log 2>&1
echo "ab rc=$?"; tail -22 $OUT/ab_k_refill.log
