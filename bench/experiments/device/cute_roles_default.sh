# The roles kernel's default after docs/tuning.md 2.20 (CuteConfig v_refill / qk_issue "auto": the V refill by halves
# and S issued one block ahead at hd 512) on the lent H200 in one command (~7 min), after the CuTe DSL's first staging
# run (STAGE2=1 makes this the second, carrying .device/p2):
#  1. GPU tests in parallel shards of at most T s each (default 200): qk_issue's bit-identity tests (two shards), the
#     roles fuzz with the new default (two), the roles kernel's other GPU tests, the V refill's (halves against the
#     one-warp kernel with S serial); one log, tests.log;
#  2. bench_attention --backends triton,cute on issue 27's hd-512 workloads (eager and CUDA-graph medians, the same
#     run), suite attention-cute_roles_default, at most B s (default 150).
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [T=...] [B=...] bash bench/experiments/device/cute_roles_default.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-200}; R=tests/attention/cute/test_cute_kernel_roles.py; V=tests/attention/cute/test_cute_v_refill.py
Q=tests/attention/cute/test_cute_qk_issue.py; F4="config0 or config1 or config2 or config3"
shard() {  # $1 log name, rest: pytest arguments
  local log=$1; shift
  timeout $t python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5 "$@" > /tmp/sh_$log.log 2>&1 < /dev/null
  echo "rc=$?" >> /tmp/sh_$log.log
}
rm -f /tmp/sh_*.log
shard qk_a $Q -k "not windows" & shard qk_b $Q -k windows &
shard fuzz_a $R -k "fuzz and ($F4)" & shard fuzz_b $R -k "fuzz and not ($F4)" &
shard roles $R -k "not fuzz" & shard v_a $V -k "matches_reference_and" & shard v_b $V -k "not matches_reference_and" &
wait
for f in /tmp/sh_*.log; do echo "== $f"; cat $f; done > $OUT/tests.log
for f in /tmp/sh_*.log; do echo "== $f"; grep -E "passed|failed|error|rc=" $f | tail -2; grep -E "^FAILED" $f | head -5; done
timeout ${B:-150} python3 -m blockdiff.bench.bench_attention --backends triton,cute \
  --workloads mixed_global_ctx8k,canvas_bs1_ctx32k_global --budget-s $(( ${B:-150} - 25 )) --no-plots --out $OUT \
  --suite-name attention-cute_roles_default > $OUT/bench.log 2>&1
echo "bench rc=$?"; tail -14 $OUT/bench.log
