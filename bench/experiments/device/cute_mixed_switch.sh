# A switch of FA4's consumer in the cute backend (head dims <= 256) on the lent H200 in one command, ~6-9 min, after
# the CuTe DSL's first staging run (this can be the second: STAGE2=1, carrying .device/p2). Two such switches:
# SWITCH=_CLEAN_SPLIT_ACROSS_WG (a class attribute, 2.31, below) and a config field, SWITCH=skip_allowed_first (the
# default; _SKIP_ALLOWED_FIRST and all, the
# names of 2.30's run, mean the same now), CuteConfig.skip_allowed_first (2.27: no NaN-safe V scan of a tile's first
# key block every row sees whole; "auto", its default, is on where the launch splits KV). The clean-up placements
# under a GEMM (the class attributes of 2.26 / 2.28) were refuted and removed (2.30). Any other SWITCH names
# an experiment class attribute of FlashAttentionForwardSm90Mixed (read at compile time), with TESTS and WORKLOADS.
# The shard logs (one file, shards.log) and the A/B log and record under $OUT (3 files).
#  1. in parallel shards of at most T s each (default 240): the switch's own GPU tests (skip_allowed_first:
#     test_cute_skip_allowed_first.py, which sets the config itself: True against False bit for bit, the reference's
#     exact non-finite entries), and with the switch on in every call's config (switch_lib.sh's config_run; "auto"
#     would leave the unsplit launches without it) the cute fuzz's hd-256 / hd-128 configurations
#     (test_cute_interface.py) and the NaN-safe V tests of that head dim (test_cute_nan_safe_v.py); SHARDS picks them
#     (own_skip fuzz128 nan128 fuzz256 nan256; own with TESTS; none; default: all five);
#  2. bench/experiments/ab_roles_switch.py skip_allowed_first on WORKLOADS (default: 2.30's four), alone on the GPU:
#     NaN-safe V on with the field False and True (rows nan_safe_off, nan_safe_on: bit-identical outputs), the
#     default "auto" (row auto: the same kernel as one of the two), NaN-safe V off (row nan_off, where the field does
#     not act), with the triton backend and FA4's paged launches in the same rounds (issue 27's hd-256 goal is a
#     ratio to FA4: mixed_sliding_ctx8k <= 0.9x its time), CUDA-graph medians, the record rewritten after each
#     workload, at most B s (default 300; B=0 skips it). What to read: the auto row beside the faster of the two on
#     each workload (2.30: the skip gained on the split launches, lost on the unsplit windowed one).
# SWITCH=_CLEAN_SPLIT_ACROSS_WG (2.31: the consumer warpgroups scan a masked block's V stage once between them, at
# hd 256 without FA4's ping-pong): its own tests (test_cute_split_clean.py) and the hd-256 fuzz / NaN-safe V shards
# with it on, then the A/B on mixed_sliding_ctx8k and the sliding canvas (rows nan_safe_off = the default kernel,
# nan_safe_on = the switch, nan_off, triton, fa4). Prediction and refutation rule in 2.31; keep it (the default)
# if mixed_sliding gains >= 1.5 % in two runs, the canvas is not slower and its tests pass.
# SWITCH=nan_safe_v_method (2.34: NaN-safe V by an epilogue test and recompute instead of the mainloop scan, hd <= 256):
# its own tests (test_cute_nan_recompute.py: finite caches bit for bit against nan_safe_v=False with a recompute
# counter of 0, the reference's exact non-finite entries), then the NaN-safe V and fuzz shards of hd 128 and 256 with
# "recompute" forced in every call's config; the A/B rows nan_safe_off ("scan"), nan_safe_on ("recompute"), default
# ("auto": the recompute at hd 256, the scan at hd 128, since 2.35), nan_off, triton and fa4 on the four workloads.
# Prediction and refutation rule in 2.34.
# SWITCH=_NR_TRIVIAL_COLD_PATH (2.37, timing only: the recompute's cold path replaced by a counter increment, WRONG
# results on non-finite V, so no GPU test shard runs with it; default SHARDS=none): the A/B on mixed_sliding_ctx8k and
# the sliding canvas with nan_safe_v_method "recompute" pinned, rows recompute_off (the full recompute, the default
# kernel at hd 256), recompute_trivial (_NR_TRIVIAL_COLD_PATH), recompute_nostash (it and _NR_NO_STASH: no stash
# writes at the consumers' entry), nan_off, triton, fa4; finite caches, so every row bit-identical to recompute_off.
# Prediction, written before any GPU run: trivial ~ recompute_off (within 0.5 %) -> the cost is the epilogue test +
# vote (or the stash: nostash tells); trivial ~ nan_off -> the cold path's presence (code size, ptxas's choices
# around it) costs it; in between -> both; nostash below trivial by more than 0.5 % -> the stash writes cost.
# (Since 2.39 the recompute_off row's epilogue test, the default's, is 2.38's FFMA test; 2.38's two exact switches
# and their case here left: the FFMA test became the only one, the out-of-line cold path was refuted.)
# Since 2.35 the scan's switches (skip_allowed_first, _CLEAN_SPLIT_ACROSS_WG) run with nan_safe_v_method "scan"
# pinned (shards and A/B), since at hd 256 "auto" takes the recompute, where they do not act.
# Tests and A/B do not fit one 10-minute run: run them as two,
#   B=0 STAGE2=1 bash ...        (the shards, <= T = 240 s)
#   SHARDS=none B=540 bash ...   (the A/B; its record is rewritten after each workload)
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [SWITCH=...] [TESTS=...] bash bench/experiments/device/cute_mixed_switch.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0; mkdir -p $OUT
t=${T:-240}; SWITCH=${SWITCH:-skip_allowed_first}; ON=True; OFF=False  # a config field's values (Python literals)
M=FlashAttentionForwardSm90Mixed
# the scan's switches keep the scan (its "auto" is the recompute at hd 256 since docs/tuning.md 2.35, where they do
# not act): "auto" means the scan in every shard (switch_lib.sh NO_AUTO_RECOMPUTE), the A/B's rows name it
VARIANT='{"nan_safe": {"nan_safe_v": true, "nan_safe_v_method": "scan"}}'
case $SWITCH in
  skip_allowed_first|_SKIP_ALLOWED_FIRST|all) SWITCH=skip_allowed_first; field=1
    shards="own_skip fuzz128 nan128 fuzz256 nan256"
    workloads=canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128,canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k
    AB_SWITCH=skip_allowed_first; PLAIN='{"auto": {"nan_safe_v_method": "scan"}, "nan_off": {"nan_safe_v": false}}'
    export NO_AUTO_RECOMPUTE=1 ;;
  nan_safe_v_method|recompute) SWITCH=nan_safe_v_method; field=1; ON='"recompute"'; OFF='"scan"'  # 2.34
    shards="own_recompute_a own_recompute_b nan128 nan256 fuzz128 fuzz256"
    workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding,canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_hd128
    AB_SWITCH=nan_safe_v_method; PLAIN='{"default": {}, "nan_off": {"nan_safe_v": false}}'
    VARIANT='{"nan_safe": {"nan_safe_v": true}}' ;;
  _CLEAN_SPLIT_ACROSS_WG) field=0; shards="own fuzz256 nan256"  # 2.31: the hd-256 launches only
    TESTS=${TESTS:-tests/attention/cute/test_cute_split_clean.py}
    workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding
    AB_SWITCH=$M.$SWITCH; PLAIN='{"default": {}, "nan_off": {"nan_safe_v": false}}'
    export NO_AUTO_RECOMPUTE=1 ;;
  _NR_TRIVIAL_COLD_PATH|_NR_NO_STASH) SWITCH=_NR_TRIVIAL_COLD_PATH; field=0; shards=none  # 2.37, timing only
    workloads=mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding
    AB_SWITCH='{"trivial": {"'$M'._NR_TRIVIAL_COLD_PATH": true}, "nostash": {"'$M'._NR_TRIVIAL_COLD_PATH": true, "'$M'._NR_NO_STASH": true}}'
    VARIANT='{"recompute": {"nan_safe_v": true, "nan_safe_v_method": "recompute"}}'
    PLAIN='{"nan_off": {"nan_safe_v": false}}' ;;
  *) field=0; shards=own; workloads=; AB_SWITCH=$M.$SWITCH; PLAIN='{"nan_off": {"nan_safe_v": false}}' ;;
esac
SHARDS=${SHARDS:-$shards}; WORKLOADS=${WORKLOADS:-$workloads}
[ -n "$WORKLOADS" ] || [ "${B:-300}" = 0 ] || { echo "unknown SWITCH $SWITCH: set TESTS and WORKLOADS"; exit 2; }
source bench/experiments/device/switch_lib.sh
# run: $1 the switch on (1) / off (0) in every call (the config field in every call's config, or the class
# attribute), $2 log name, rest: pytest arguments; own: the tests that set the switch themselves
run() {
  if [ $field = 1 ]; then local on=$1; shift; config_run $SWITCH "$([ $on = 1 ] && echo "$ON" || echo "$OFF")" "$@"
  else switch_run blockdiff.attention.cute.kernel $M "$@"; fi
}
own() { if [ $field = 1 ]; then gpu_run "$@"; else run 0 "$@"; fi; }
for s in $SHARDS; do case $s in
  own) own sw_own ${TESTS:?set TESTS for the own shard} & ;;
  own_skip) own sw_own_skip tests/attention/cute/test_cute_skip_allowed_first.py & ;;
  # the recompute's own file in halves: whole it ran past the default T (142 + 136 s, docs/tuning.md 2.41)
  own_recompute_a) own sw_own_recompute_a tests/attention/cute/test_cute_nan_recompute.py -k "finite_cache or reference_nonfinite" & ;;
  own_recompute_b) own sw_own_recompute_b tests/attention/cute/test_cute_nan_recompute.py -k "not finite_cache and not reference_nonfinite" & ;;
  fuzz256) run 1 sw_fuzz256 tests/attention/cute/test_cute_interface.py -k "fuzz and (256-16 or 256-4-4)" & ;;
  nan256) run 1 sw_nan256 tests/attention/cute/test_cute_nan_safe_v.py -k "hd256 or no_row_sees" & ;;
  fuzz128) run 1 sw_fuzz128 tests/attention/cute/test_cute_interface.py -k "fuzz and [128-" & ;;
  nan128) run 1 sw_nan128 tests/attention/cute/test_cute_nan_safe_v.py -k hd128 & ;;
  none) ;;
  *) echo "unknown shard $s"; exit 2 ;;
esac; done
wait
gpu_health
switch_logs
switch_pack  # up to 8 shard logs: one file back
[ "${B:-300}" = 0 ] && exit 0
timeout ${B:-300} python3 -m blockdiff.bench.experiments.ab_roles_switch "$AB_SWITCH" \
  $WORKLOADS --triton --fa4 "$VARIANT" --plain "$PLAIN" \
  --rounds 3 --out $OUT > $OUT/ab_mixed_switch.log 2>&1
echo "ab rc=$?"; grep -E "TFLOP/s|bit-identical|skipped|: launch " $OUT/ab_mixed_switch.log | tail -60
