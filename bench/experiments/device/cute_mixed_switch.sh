# An experiment switch of FA4's consumer in the cute backend (a FlashAttentionForwardSm90Mixed class attribute read at
# compile time: SWITCH=_CLEAN_AT_PV, docs/tuning.md 2.26, the default, _SKIP_ALLOWED_FIRST, 2.27, or
# _CLEAN_IN_OWN_CALL, 2.28) on the lent H200
# in one command, ~6-9 min (SWITCH=all: two, below), after the CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying
# .device/p2). The shard logs (in one file, shards.log) and the A/B log and record under $OUT (3 files).
#  1. in parallel shards of at most T s each (default 240): the switch's own GPU tests (TESTS, which set the switch
#     themselves: bit-identity on against off, NaN-safe V cases), and with the switch on the cute fuzz's hd-256 /
#     hd-128 configurations (test_cute_interface.py) and the NaN-safe V tests of that head dim (test_cute_nan_safe_v.py);
#     SHARDS picks them (own_at_pv own_own_call own_skip fuzz256 nan256 fuzz128 nan128 fuzz256_own_call; own with
#     TESTS; none; default per switch below);
#  2. bench/experiments/ab_roles_switch.py FlashAttentionForwardSm90Mixed.$SWITCH on WORKLOADS (default per switch),
#     alone on the GPU: NaN-safe V on (the default; the switch acts) and off (the switch does not act: the same kernel
#     twice, the rounds' spread and the clean-up's whole cost), each off and on, with the triton backend and FA4's
#     paged launches in the same rounds (issue 27's hd-256 goal is a ratio to FA4: mixed_sliding_ctx8k <= 0.9x its
#     time), CUDA-graph medians, the record rewritten after each workload, at most B s (default 300; B=0 skips it).
# _CLEAN_AT_PV (written before any GPU run, 2.26): NaN-safe V costs mixed_sliding_ctx8k 7.2 % and the sliding canvas
# 8-9 % (2.6, 2.7). At the block's end the warpgroup waits for V and scans its 32 KB stage with no GEMM of its own in
# flight; at the P V issue the scan runs under the next block's S GEMM, except for the tile's last block (the left
# window edge: 60 of mixed_sliding's 136 masked blocks), whose P V has no S after it. Predicted: the switch's cost
# falls to 4-5.5 % on mixed_sliding_ctx8k (cute 0.90-0.92x FA4's time, from 0.93x) and by 0.5-1.5 us on the canvas;
# refuted if mixed moves less than 1 % (then shared-memory bandwidth or issue slots, not the warpgroup's latency, is
# the cost). Keep it (the default) if mixed gains >= 1.5 % in two runs with the canvas not slower and its tests pass.
# _CLEAN_IN_OWN_CALL (2.28; the own tests run both placements): every masked block but the tile's first is scanned in
# its own call under its S and the previous P V, the last (left-edge) block too. Predicted: mixed_sliding_ctx8k's
# NaN-safe cost 1-3 % (0.88-0.90x FA4), if V(j) has landed by its own call's P V issue; refuted if it does no better
# than _CLEAN_AT_PV in the same lease (the early wait for V stalls). Keep the better of the two by the same rule.
# _SKIP_ALLOWED_FIRST (2.27): the first block of a tile whose rows all see it whole is not scanned. Predicted:
# canvas_bs4_ctx4k_hd128 (every tile's only masked block is such a first block) loses NaN-safe V's whole cost, 2.5-3 %
# (2.6: +3.0 %); canvas_bs1_ctx32k_hd128 no clean-up at all (2.6 measured the switch 4 % faster there, unexplained:
# this tells); the sliding canvas 1-2 us (each split's first block); mixed_sliding_ctx8k <= 0.5 % (8 of 136). Keep it
# if bs4 gains >= 1.5 % in two runs, nothing else is slower and its tests pass.
# SWITCH=all (the plan of docs/tuning.md 7.41): the three switches' own tests, the fuzz / NaN-safe shards with
# _CLEAN_AT_PV and _SKIP_ALLOWED_FIRST on (and the hd-256 fuzz with _CLEAN_IN_OWN_CALL), and one A/B of every setting
# and the two combinations (rows nan_safe_off = the default kernel, nan_safe_<setting>, nan_off, triton, fa4 on the four
# workloads: ~7 cute compiles a workload). Tests and A/B do not fit one 10-minute run: run them as two,
#   SWITCH=all B=0 STAGE2=1 bash ...     (the shards, <= T = 240 s)
#   SWITCH=all SHARDS=none B=540 bash ...  (the A/B; its record is rewritten after each workload)
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [SWITCH=...] [TESTS=...] bash bench/experiments/device/cute_mixed_switch.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-240}; SWITCH=${SWITCH:-_CLEAN_AT_PV}
# the own tests by switch (each GPU test sets its switch; test_cute_clean_at_pv.py's are parametrized by the two
# placements, ~20 compiles each, so one shard a placement fits T)
case $SWITCH in
  _CLEAN_AT_PV) shards="own_at_pv fuzz256 nan256"; workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding ;;
  _CLEAN_IN_OWN_CALL) shards="own_own_call fuzz256 nan256"; workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding ;;
  _SKIP_ALLOWED_FIRST) shards="own_skip fuzz128 nan128 fuzz256 nan256"
    workloads=canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k ;;
  all) shards="own_at_pv own_own_call own_skip fuzz128 nan128 fuzz256 nan256 fuzz256_own_call"
    SWITCH=_CLEAN_AT_PV,_SKIP_ALLOWED_FIRST; ab_all=1  # the fuzz / NaN-safe shards' switches
    workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding,canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128 ;;
  *) shards=own; workloads= ;;
esac
SHARDS=${SHARDS:-$shards}; WORKLOADS=${WORKLOADS:-$workloads}
PV=tests/attention/cute/test_cute_clean_at_pv.py
M=FlashAttentionForwardSm90Mixed
if [ "${ab_all:-0}" = 1 ]; then  # every setting in one A/B
  AB_SWITCH="{\"clean_at_pv\": {\"$M._CLEAN_AT_PV\": true}, \"own_call\": {\"$M._CLEAN_IN_OWN_CALL\": true},
 \"skip_first\": {\"$M._SKIP_ALLOWED_FIRST\": true},
 \"clean_at_pv_skip\": {\"$M._CLEAN_AT_PV\": true, \"$M._SKIP_ALLOWED_FIRST\": true},
 \"own_call_skip\": {\"$M._CLEAN_IN_OWN_CALL\": true, \"$M._SKIP_ALLOWED_FIRST\": true}}"
else
  AB_SWITCH=$M.$SWITCH
fi
[ -n "$WORKLOADS" ] || [ "${B:-300}" = 0 ] || { echo "unknown SWITCH $SWITCH: set TESTS and WORKLOADS"; exit 2; }
source bench/experiments/device/switch_lib.sh
# run: $1 switch (1 on / 0 off), $2 log name, rest: pytest arguments
run() { switch_run blockdiff.attention.cute.kernel FlashAttentionForwardSm90Mixed "$@"; }
for s in $SHARDS; do case $s in
  own) run 0 sw_own ${TESTS:?set TESTS for the own shard} & ;;
  own_at_pv) run 0 sw_own_at_pv $PV -k "[_CLEAN_AT_PV-" & ;;
  own_own_call) run 0 sw_own_own_call $PV -k "[_CLEAN_IN_OWN_CALL-" & ;;
  own_skip) run 0 sw_own_skip tests/attention/cute/test_cute_skip_allowed_first.py & ;;
  fuzz256_own_call) SWITCH=_CLEAN_IN_OWN_CALL run 1 sw_fuzz256_own_call tests/attention/cute/test_cute_interface.py \
    -k "fuzz and (256-16 or 256-4-4)" & ;;
  fuzz256) run 1 sw_fuzz256 tests/attention/cute/test_cute_interface.py -k "fuzz and (256-16 or 256-4-4)" & ;;
  nan256) run 1 sw_nan256 tests/attention/cute/test_cute_nan_safe_v.py -k "hd256 or no_row_sees" & ;;
  fuzz128) run 1 sw_fuzz128 tests/attention/cute/test_cute_interface.py -k "fuzz and [128-" & ;;
  nan128) run 1 sw_nan128 tests/attention/cute/test_cute_nan_safe_v.py -k hd128 & ;;
  none) ;;
  *) echo "unknown shard $s"; exit 2 ;;
esac; done
wait
switch_logs
switch_pack  # up to 8 shard logs: one file back
[ "${B:-300}" = 0 ] && exit 0
timeout ${B:-300} python3 -m blockdiff.bench.experiments.ab_roles_switch "$AB_SWITCH" \
  $WORKLOADS --triton --fa4 '{"nan_safe": {"nan_safe_v": true}}' --plain '{"nan_off": {"nan_safe_v": false}}' \
  --rounds 3 --out $OUT > $OUT/ab_mixed_switch.log 2>&1
echo "ab rc=$?"; grep -E "TFLOP/s|bit-identical|skipped" $OUT/ab_mixed_switch.log | tail -60
