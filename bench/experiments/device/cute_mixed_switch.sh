# An experiment switch of FA4's consumer in the cute backend (a FlashAttentionForwardSm90Mixed class attribute read at
# compile time; default SWITCH=_CLEAN_AT_PV, docs/tuning.md 2.26) on the lent H200 in one command, ~5 min, after the
# CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying .device/p2). Logs and the A/B record
# under $OUT (at most 7 files).
#  1. in parallel shards of at most T s each (default 150): the switch's own GPU tests (TESTS, which set the switch
#     themselves: bit-identity on against off, the hd-256 NaN-safe V cases), and with the switch on the hd-256
#     configurations of the cute fuzz (test_cute_interface.py) and the hd-256 NaN-safe V tests
#     (test_cute_nan_safe_v.py); SHARDS picks them (own fuzz256 nan256; none);
#  2. bench/experiments/ab_roles_switch.py FlashAttentionForwardSm90Mixed.$SWITCH on WORKLOADS (default
#     mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding), alone on the GPU: NaN-safe V on (the default; the switch acts)
#     and off (the switch does not act: the same kernel twice, the rounds' spread and the clean-up's whole cost), each
#     off and on, with the triton backend and FA4's paged launches in the same rounds (issue 27's hd-256 goals are
#     ratios to FA4: mixed_sliding_ctx8k <= 0.9x its time), CUDA-graph medians, at most B s (default 240; B=0 skips).
# _CLEAN_AT_PV (written before any GPU run, 2.26): NaN-safe V costs mixed_sliding_ctx8k 7.2 % and the sliding canvas
# 8-9 % (2.6, 2.7); at the block's end the warpgroup waits for V and scans its 32 KB stage with no GEMM of its own in
# flight (on the tile's first block it waits for a V that FA4's producer loads after the next K). At the P V issue
# the scan runs under the next block's S GEMM. Predicted: the switch's cost falls to 2-4 % on mixed_sliding_ctx8k
# (cute 0.89-0.91x FA4's time, from 0.93x) and to 0.5-1.5 us on the canvas (from ~2.4 us); refuted if mixed moves
# less than 1 %, which would make shared-memory bandwidth or issue slots, not the warpgroup's latency, the cost.
# Keep it (make it the default) if mixed gains >= 2 % in two runs with the canvas not slower, and its tests pass.
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [SWITCH=...] [TESTS=...] bash bench/experiments/device/cute_mixed_switch.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-150}; SWITCH=${SWITCH:-_CLEAN_AT_PV}; TESTS=${TESTS:-tests/attention/cute/test_cute_clean_at_pv.py}
source bench/experiments/device/switch_lib.sh
# run: $1 switch (1 on / 0 off), $2 log name, rest: pytest arguments
run() { switch_run blockdiff.attention.cute.kernel FlashAttentionForwardSm90Mixed "$@"; }
SHARDS=${SHARDS:-own fuzz256 nan256}
for s in $SHARDS; do case $s in
  own) run 0 sw_own $TESTS & ;;
  fuzz256) run 1 sw_fuzz256 tests/attention/cute/test_cute_interface.py -k "fuzz and (256-16 or 256-4-4)" & ;;
  nan256) run 1 sw_nan256 tests/attention/cute/test_cute_nan_safe_v.py -k "hd256 or no_row_sees" & ;;
  none) ;;
  *) echo "unknown shard $s"; exit 2 ;;
esac; done
wait
switch_logs
[ "${B:-240}" = 0 ] && exit 0
timeout ${B:-240} python3 -m blockdiff.bench.experiments.ab_roles_switch FlashAttentionForwardSm90Mixed.$SWITCH \
  ${WORKLOADS:-mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding} --triton --fa4 \
  '{"nan_safe": {"nan_safe_v": true}, "nan_off": {"nan_safe_v": false}}' \
  --rounds 3 --out $OUT > $OUT/ab_mixed_switch.log 2>&1
echo "ab rc=$?"; tail -22 $OUT/ab_mixed_switch.log
