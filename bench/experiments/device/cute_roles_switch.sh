# An experiment switch of the roles kernel (a FlashAttentionForwardSm90Roles class attribute read at compile time;
# default SWITCH=_K_REFILL_ALL_WARPS, docs/tuning.md 2.18; _SM_OVERLAP ran through it in 2.20 before it became
# CuteConfig.qk_issue) on the lent H200 in one command,
# ~4 min, after the CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying .device/p2). Logs and the
# A/B record under $OUT (at most 7 files).
#  1. in parallel shards of at most T s each (default 95): the switch's own GPU tests (TESTS; bit-identity with the
#     default kernel) and the roles fuzz's first configurations with the switch on, the rest of the fuzz on / off
#     only with FUZZ_ALL=1 (five shards compiling at once ran out of 95 s in 2.18); SHARDS picks them by name
#     (own, or own_a own_b for it in two; fuzz_on_a fuzz_on_b fuzz_off_b; none; default "own fuzz_on_a");
#  2. bench/experiments/ab_roles_switch.py on WORKLOADS (default mixed_global_ctx8k), alone on the GPU: roles + work
#     (one-warp V, S serial, the whole K stage) and the default roles kernel (V and K halves, S ahead), each off and on (outputs bit-identical;
#     CUDA-graph medians) with the triton backend in the same rounds (issue 27's goals are ratios to it), at most B s (default 120: one hd-512 workload; B=0 skips it).
# The A/B's variants: roles + work with the one-warp V refill, S serial and the whole K stage (2.17's kernel; the
# only one of the two where _K_REFILL_ALL_WARPS acts), and the default roles kernel (auto: V and K refill by halves,
# S issued ahead; 2.20, 2.23). A new switch writes its prediction here before its run.
# _EPILOGUE_LOCAL_WARP (docs/tuning.md 2.25; written before any GPU run): it removes the default kernel's only spill
# on mixed_global_ctx8k (8 B: the entry's warp index held to the epilogue; one STL a masked block in P V warpgroup 1,
# one LDL a tile) and changes nothing on the canvas (split-KV epilogue: identical PTX, the control). Predicted:
# mixed within +-0.5 % (no measurable change; the stores are off every chain), canvas within the rounds' spread;
# refuted if mixed moves more than 1 % either way. Keep it only if mixed gains >= 0.5 % in two runs. Run it with
#   SWITCH=_EPILOGUE_LOCAL_WARP TESTS=tests/attention/cute/test_cute_epilogue_local_warp.py B=240 \
#   WORKLOADS=mixed_global_ctx8k,canvas_bs1_ctx32k_global
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [SWITCH=...] [TESTS=...] bash bench/experiments/device/cute_roles_switch.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-95}; SWITCH=${SWITCH:-_K_REFILL_ALL_WARPS}; TESTS=${TESTS:-tests/attention/cute/test_cute_k_refill.py}
F=tests/attention/cute/test_cute_kernel_roles.py
source bench/experiments/device/switch_lib.sh
# run: $1 switch (1 on / 0 off), $2 log name, rest: pytest arguments
run() { switch_run blockdiff.attention.cute.kernel_roles FlashAttentionForwardSm90Roles "$@"; }
A="fuzz and (config0 or config1 or config2)"; Z="fuzz and not (config0 or config1 or config2)"
SHARDS=${SHARDS:-own fuzz_on_a}; [ "${FUZZ_ALL:-0}" = 1 ] && SHARDS="$SHARDS fuzz_on_b fuzz_off_b"
for s in $SHARDS; do case $s in
  own) run 0 sw_own $TESTS & ;;
  own_a) run 0 sw_own_a $TESTS -k "not windows" & ;;   # the own tests in two shards (~24 compiles in all)
  own_b) run 0 sw_own_b $TESTS -k windows & ;;
  fuzz_on_a) run 1 sw_fuzz_on_a $F -k "$A" & ;;
  fuzz_on_b) run 1 sw_fuzz_on_b $F -k "$Z" & ;;
  fuzz_off_b) run 0 sw_fuzz_off_b $F -k "$Z" & ;;
  none) ;;
  *) echo "unknown shard $s"; exit 2 ;;
esac; done
wait
switch_logs
[ "${B:-120}" = 0 ] && exit 0
timeout ${B:-120} python3 -m blockdiff.bench.experiments.ab_roles_switch $SWITCH ${WORKLOADS:-mixed_global_ctx8k} --triton \
  '{"work": {"wide_design": "roles", "batch_order": "work", "v_refill": "one_warp", "qk_issue": "serial", "k_refill": "whole"}, "default": {"wide_design": "roles"}}' \
  --rounds 3 --out $OUT > $OUT/ab_roles_switch.log 2>&1
echo "ab rc=$?"; tail -22 $OUT/ab_roles_switch.log
