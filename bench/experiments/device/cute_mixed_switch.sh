# An experiment switch of FA4's consumer in the cute backend (a FlashAttentionForwardSm90Mixed class attribute read at
# compile time: SWITCH=_SKIP_ALLOWED_FIRST, docs/tuning.md 2.27, the default; the clean-up placements under a GEMM,
# _CLEAN_AT_PV and _CLEAN_IN_OWN_CALL, 2.26 / 2.28, were refuted and removed, 2.30) on the lent H200
# in one command, ~6-9 min, after the CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying
# .device/p2). The shard logs (in one file, shards.log) and the A/B log and record under $OUT (3 files).
#  1. in parallel shards of at most T s each (default 240): the switch's own GPU tests (TESTS, which set the switch
#     themselves: bit-identity on against off, NaN-safe V cases), and with the switch on the cute fuzz's hd-256 /
#     hd-128 configurations (test_cute_interface.py) and the NaN-safe V tests of that head dim (test_cute_nan_safe_v.py);
#     SHARDS picks them (own_skip fuzz256 nan256 fuzz128 nan128; own with TESTS; none; default per switch below);
#  2. bench/experiments/ab_roles_switch.py FlashAttentionForwardSm90Mixed.$SWITCH on WORKLOADS (default per switch),
#     alone on the GPU: NaN-safe V on (the default; the switch acts) and off (the switch does not act: the same kernel
#     twice, the rounds' spread and the clean-up's whole cost), each off and on, with the triton backend and FA4's
#     paged launches in the same rounds (issue 27's hd-256 goal is a ratio to FA4: mixed_sliding_ctx8k <= 0.9x its
#     time), CUDA-graph medians, the record rewritten after each workload, at most B s (default 300; B=0 skips it).
# _SKIP_ALLOWED_FIRST (2.27): the first block of a tile whose rows all see it whole is not scanned. Predicted:
# canvas_bs4_ctx4k_hd128 (every tile's only masked block is such a first block) loses NaN-safe V's whole cost, 2.5-3 %
# (2.6: +3.0 %); canvas_bs1_ctx32k_hd128 no clean-up at all (2.6 measured the switch 4 % faster there, unexplained:
# this tells); the sliding canvas 1-2 us (each split's first block); mixed_sliding_ctx8k <= 0.5 % (8 of 136). Keep it
# if bs4 gains >= 1.5 % in two runs, nothing else is slower and its tests pass.
# SWITCH=all: the same as SWITCH=_SKIP_ALLOWED_FIRST (the one switch left). Tests and A/B do not fit one 10-minute
# run: run them as two,
#   SWITCH=all B=0 STAGE2=1 bash ...     (the shards, <= T = 240 s)
#   SWITCH=all SHARDS=none B=540 bash ...  (the A/B; its record is rewritten after each workload)
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [SWITCH=...] [TESTS=...] bash bench/experiments/device/cute_mixed_switch.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-240}; SWITCH=${SWITCH:-_SKIP_ALLOWED_FIRST}
[ "$SWITCH" = all ] && SWITCH=_SKIP_ALLOWED_FIRST  # the one switch left (2.30)
# the own tests by switch (each GPU test sets its switch)
case $SWITCH in
  _SKIP_ALLOWED_FIRST) shards="own_skip fuzz128 nan128 fuzz256 nan256"
    workloads=canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k ;;
  *) shards=own; workloads= ;;
esac
SHARDS=${SHARDS:-$shards}; WORKLOADS=${WORKLOADS:-$workloads}
M=FlashAttentionForwardSm90Mixed
AB_SWITCH=$M.$SWITCH
[ -n "$WORKLOADS" ] || [ "${B:-300}" = 0 ] || { echo "unknown SWITCH $SWITCH: set TESTS and WORKLOADS"; exit 2; }
source bench/experiments/device/switch_lib.sh
# run: $1 switch (1 on / 0 off), $2 log name, rest: pytest arguments
run() { switch_run blockdiff.attention.cute.kernel FlashAttentionForwardSm90Mixed "$@"; }
for s in $SHARDS; do case $s in
  own) run 0 sw_own ${TESTS:?set TESTS for the own shard} & ;;
  own_skip) run 0 sw_own_skip tests/attention/cute/test_cute_skip_allowed_first.py & ;;
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
