# The cute backend's roles kernel (wide_design="roles", attention/cute/kernel_roles.py; issue 27 item 1 follow-up)
# on the lent H200 in one command, within ~560 s, after the CuTe DSL's first staging run (this is the second: it
# unpacks part 2 first when STAGE2=1, carrying .device/p2). Logs and records under $OUT.
#  1. its GPU tests (tests/attention/cute/test_cute_kernel_roles.py) in four parallel shards of at most T s each
#     (default 200): the fuzz against the reference (two shards), the rest, and the split-value kernel's file;
#  2. bench_attention within B s (default 320): the triton backend, cute split_v (the default) and cute roles at
#     64-key (its default) and 32-key tiles, on mixed_global_ctx8k and canvas_bs1_ctx32k_global (named suite),
#     then canvas_bs16_ctx8k_global (batch ladder: a grid that fills the GPU without splits, each kernel's own
#     rate). Roles rows are cute[{"wide_design": "roles"...}] beside the default cute row.
#   BLOCKDIFF_COMMIT=<hash> STAGE2=1 bash bench/experiments/device/cute_roles.sh
# Since docs/tuning.md 2.20 a roles config without v_refill / qk_issue resolves to the V refill by halves with S issued
# ahead: add "v_refill": "one_warp", "qk_issue": "serial" to its roles rows to reproduce them as they ran.
# Files under $OUT (at most 8 come back): tests.log (the four shard logs, one after the other), the two bench logs and
# their records (JSON + CSV each): 7 (2026-12-05 audit: the shard logs apart made 10).
set -u
source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-200}; b=${B:-320}
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5"
F=tests/attention/cute/test_cute_kernel_roles.py
# the fuzz's seven configurations (one compile each, more with split-KV) in two shards
L=/tmp/gpu_roles; rm -rf $L; mkdir -p $L
timeout $t $P $F -k "fuzz and (config0 or config1 or config2 or config3)" > $L/gpu_roles_fuzz1.log 2>&1 < /dev/null &
timeout $t $P $F -k "fuzz and (config4 or config5 or config6)" > $L/gpu_roles_fuzz2.log 2>&1 < /dev/null &
timeout $t $P $F -k "not fuzz" > $L/gpu_roles_rest.log 2>&1 < /dev/null &
timeout $t $P tests/attention/cute/test_cute_kernel_wide.py > $L/gpu_wide.log 2>&1 < /dev/null &
wait
for f in $L/gpu_roles_fuzz1.log $L/gpu_roles_fuzz2.log $L/gpu_roles_rest.log $L/gpu_wide.log; do
  echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
done
for f in $L/gpu_roles_fuzz1.log $L/gpu_roles_fuzz2.log $L/gpu_roles_rest.log $L/gpu_wide.log; do
  echo "===== $(basename $f)"; cat $f; done > $OUT/tests.log
CFGS='[{"wide_design": "roles"}, {"wide_design": "roles", "tile_n": 32}]'
# the riskier roles rows come last in each workload (cute's extra rows follow its default row): a hang leaves the
# triton and split_v rows recorded
timeout $((b * 2 / 3)) python3 -m blockdiff.bench.bench_attention --backends triton,cute \
  --workloads mixed_global_ctx8k,canvas_bs1_ctx32k_global --cute-configs "$CFGS" \
  --budget-s $((b * 2 / 3 - 25)) --no-plots --suite-name attention-cute_roles --out $OUT \
  > $OUT/bench_roles.log 2>&1
echo "bench rc=$?"; tail -14 $OUT/bench_roles.log
timeout $((b / 3)) python3 -m blockdiff.bench.bench_attention --suite batch_ladder --backends triton,cute \
  --workloads canvas_bs16_ctx8k_global --cute-configs "$CFGS" \
  --budget-s $((b / 3 - 20)) --no-plots --suite-name attention-cute_roles_bs16 --out $OUT \
  > $OUT/bench_roles_bs16.log 2>&1
echo "bench bs16 rc=$?"; tail -8 $OUT/bench_roles_bs16.log
