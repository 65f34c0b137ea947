# Every GPU test of tests/attention/cute (390 at 2026-12-07: 382 passed, 8 xfailed on an H100, every shard done in
# 320 s at T=470) in 16 parallel pytest shards, for a 16-core GPU machine:
# the CuTe DSL compiles on the host, one process per shard, so the folder's ~1 h of serial compiling fits one call.
# Large files are cut by test function (node-id prefixes and --deselect, no spaces: cute_tests.sh splits FILES on ';'
# and each entry on spaces). After the CuTe DSL is staged (stage1.sh PART=a/b, then part 2):
#   T=480 bash bench/experiments/device/cute_folder.sh          # logs $OUT/gpu_shard<i>.log, a summary on stdout
# Each shard is cut at T seconds (a cut shard's log shows how far it got); the shards only (PROBE=0: cute_tests.sh's
# 90-s cluster occupancy probe would push T=480 to the 600-s limit of one device call; PROBE=1 runs it after them).
# `--shards` prints the list and exits (tests/bench/experiments/test_cute_folder_shards.py checks that it covers the
# folder's GPU tests once each, and what the script hands cute_tests.sh).
set -u
c=tests/attention/cute
r=$c/test_cute_kernel_roles.py; i=$c/test_cute_interface.py; n=$c/test_cute_nan_recompute.py; s=$c/test_cute_nan_safe_v.py
F="$r::test_gpu_roles_fuzz_matches_reference"
F="$F;$r --deselect $r::test_gpu_roles_fuzz_matches_reference"
F="$F;$i::test_gpu_fuzz_mixed_batch_matches_reference $i::test_gpu_plain_and_longest_first_tile_orders_match_reference"
F="$F;$i --deselect $i::test_gpu_fuzz_mixed_batch_matches_reference --deselect $i::test_gpu_plain_and_longest_first_tile_orders_match_reference"
F="$F;$n::test_gpu_recompute_keeps_exactly_the_reference_nonfinite_entries $n::test_gpu_recompute_on_a_finite_cache_equals_nan_safe_v_off_and_never_recomputes"
F="$F;$n --deselect $n::test_gpu_recompute_keeps_exactly_the_reference_nonfinite_entries --deselect $n::test_gpu_recompute_on_a_finite_cache_equals_nan_safe_v_off_and_never_recomputes"
F="$F;$s::test_gpu_cute_nan_safe_v_hd128_keys_a_row_may_not_see_contribute_nothing $s::test_gpu_cute_nan_safe_v_hd256_keys_a_row_may_not_see_contribute_nothing"
F="$F;$s --deselect $s::test_gpu_cute_nan_safe_v_hd128_keys_a_row_may_not_see_contribute_nothing --deselect $s::test_gpu_cute_nan_safe_v_hd256_keys_a_row_may_not_see_contribute_nothing"
F="$F;$c/test_cute_split_merge.py"
F="$F;$c/test_cute_tile_order.py $c/test_cute_qk_issue.py $c/test_cute_skip_allowed_first.py"
# test_cute_exact_weight.py (25 GPU tests, 2026-12-07) joins the v-refill shard; its time there is not yet measured
F="$F;$c/test_cute_v_refill.py $c/test_cute_exact_weight.py;$c/test_cute_k_refill_halves.py"
F="$F;$c/test_cute_kernel_cluster.py;$c/test_cute_kernel_wide.py;$c/test_cute_kernel_split.py $c/test_cute_split_clean.py"
# The last shard held four files (33 tests) and was cut at T=480 on 2026-12-07 after 20 of them (alone, -n 8: 105 s);
# two of them moved to the tile-order shard, the lightest (32 tests in 109 s).
F="$F;$c/test_cute_epilogue_local_warp.py $c/test_cute_k_refill.py"
[ "${1:-}" = --shards ] && { echo "$F"; exit 0; }
FILES=$F T=${T:-480} PROBE=${PROBE:-0} exec bash bench/experiments/device/cute_tests.sh
