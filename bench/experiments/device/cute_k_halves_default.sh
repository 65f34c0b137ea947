# The roles kernel with k_refill "auto" = halves (docs/tuning.md 2.23) on the lent H200 in one command (~4 min), after
# the CuTe DSL's first staging run (STAGE2=1 makes this the second, carrying .device/p2). Logs and records under $OUT.
#  1. GPU tests in parallel shards of at most T s each (default 180): the roles kernel's non-fuzz tests (the default
#     config at hd 512, graph replay, refusals), the V refill's and qk_issue's bit-identity tests, now all on the
#     halves K refill, and the other kernels' rows-past-seq_lens tests (one shared check since 56d8841, not yet run on
#     a GPU); one log, tests.log (the fuzz with halves ran in cute_k_halves_fuzz.sh);
#  2. ab_cute_configs whole against halves on mixed_global_ctx8k and canvas_bs1_ctx32k_global at pages of 16 and
#     contiguous K/V (2.22 timed page 64 only), 2 rounds, at most B s (default 150; B=0 skips it; T=0 skips step 1).
# Prediction (before the run): halves within +-1 % of whole or faster at page 16 and contiguous (fewer spills at 16,
# the same at contiguous; 2.22); refuted if either workload loses more than 1 %.
#   [STAGE2=1] [T=...] [B=...] bash bench/experiments/device/cute_k_halves_default.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-180}; R=tests/attention/cute/test_cute_kernel_roles.py; V=tests/attention/cute/test_cute_v_refill.py
Q=tests/attention/cute/test_cute_qk_issue.py
shard() {  # $1 log name, rest: pytest arguments
  local log=$1; shift
  timeout $t python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5 "$@" > /tmp/kd_$log.log 2>&1 < /dev/null
  echo "rc=$?" >> /tmp/kd_$log.log
}
rm -f /tmp/kd_*.log
if [ "$t" != 0 ]; then  # T=0: the A/B alone
shard roles $R -k "not fuzz" & shard v_a $V -k "matches_reference_and" & shard v_b $V -k "not matches_reference_and" & shard qk_a $Q -k "not windows" & shard qk_b $Q -k windows &
shard rows_past tests/attention/cute/test_cute_k_refill_halves.py tests/attention/cute/test_cute_kernel_cluster.py \
  tests/attention/cute/test_cute_kernel_split.py tests/attention/cute/test_cute_kernel_wide.py -k rows_past_seq_lens &
wait
for f in /tmp/kd_*.log; do echo "== $f"; cat $f; done > $OUT/tests.log
for f in /tmp/kd_*.log; do echo "== $f"; grep -E "passed|failed|error|rc=" $f | tail -2; grep -E "^FAILED" $f | head -5; done
fi
[ "${B:-150}" = 0 ] && exit 0
timeout ${B:-150} python3 -m blockdiff.bench.experiments.ab_cute_configs mixed_global_ctx8k,canvas_bs1_ctx32k_global \
  '{"whole": {"k_refill": "whole"}, "halves": {"k_refill": "halves"}}' --layouts paged,contiguous --page-size 16 \
  --no-fa4 --rounds 2 --out $OUT > $OUT/ab_k_halves_p16.log 2>&1
echo "ab rc=$?"; tail -16 $OUT/ab_k_halves_p16.log
