# The cute backend's batch order (config batch_order="work", attention/cute/tile_order.py; docs/tuning.md 2.13, from
# 2.12's remedy 1) on the lent H200 in one command, ~4 min, after the CuTe DSL's first staging run (this can be the
# second: it unpacks part 2 first when STAGE2=1, carrying .device/p2). Logs and records under $OUT.
#  1. its GPU tests (tests/attention/cute/test_cute_tile_order.py: work order bit-identical to the given order on
#     random mixed batches for the hd-128 / hd-256 / hd-512 split-value / roles / split-KV / cluster kernels, the
#     permutation in a CUDA graph, a captured call replayed with changed metadata) in four parallel shards of at
#     most T s each (default 110);
#  2. bench_attention within B s (default 130), cute only, CUDA-graph medians: the default row (split_v, given
#     order) beside cute[{"batch_order": "work"}], cute[{"wide_design": "roles"}] and cute[{"wide_design":
#     "roles", "batch_order": "work"}] on mixed_global_ctx8k and mixed_sliding_ctx8k (named suite; on hd 256 the
#     roles rows are the default kernel again), then canvas_bs16_ctx8k_global (batch ladder: 16 equal canvases, the
#     order is the identity, so only the permutation's own cost shows).
# Prediction, written before the run (docs/tuning.md 2.12's list scheduling of 2.13's order: SM-active / elapsed
# 0.864 -> ~0.99): roles on mixed_global_ctx8k 438 -> ~500 TFLOP/s, split_v ~412 -> ~470 (less the permutation's
# own 12 small kernels inside the graph, ~15-25 us: ~2 % of a ~1 ms call); mixed_sliding_ctx8k (~0.15 ms) slower:
# the window already evens its tiles (~1,150 keys a canvas row against ~900-1,024 causal) and the windowed key's
# 23-25 small kernels (~30-40 us) cost more than the tail they remove; canvas_bs16_ctx8k_global: the identity
# order, only the permutation's cost shows (~1 % slower); one sequence (canvas_bs1_*) resolves to the given order's
# kernel: no change by construction.
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] bash bench/experiments/device/cute_batch_order.sh
# Since docs/tuning.md 2.20 a roles config without v_refill / qk_issue resolves to the V refill by halves with S issued
# ahead: add "v_refill": "one_warp", "qk_issue": "serial" to its roles rows to reproduce them as they ran.
# Files under $OUT (at most 8 come back): tests.log (the four shard logs, one after the other), the two bench logs and
# their records (JSON + CSV each): 7 (2026-12-05 audit: the shard logs apart made 10).
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-110}; b=${B:-130}
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5"
F=tests/attention/cute/test_cute_tile_order.py
# nine kernel cases x two orders (one compile each, 7-10 s on this host) in three shards, the CUDA-graph tests (four
# compiles) in a fourth
L=/tmp/gpu_order; rm -rf $L; mkdir -p $L
timeout $t $P $F -k "bit_identical and (hd128_long or hd128_canvas or hd128_split3)" > $L/gpu_order_hd128.log \
  2>&1 < /dev/null &
timeout $t $P $F -k "bit_identical and (hd256 or hd128_cluster2)" > $L/gpu_order_hd256.log 2>&1 < /dev/null &
timeout $t $P $F -k "bit_identical and hd512" > $L/gpu_order_hd512.log 2>&1 < /dev/null &
timeout $t $P $F -k "gpu and not bit_identical" > $L/gpu_order_graph.log 2>&1 < /dev/null &
wait
for f in $L/gpu_order_hd128.log $L/gpu_order_hd256.log $L/gpu_order_hd512.log $L/gpu_order_graph.log; do
  echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
done
for f in $L/gpu_order_*.log; do echo "===== $(basename $f)"; cat $f; done > $OUT/tests.log
# every switch spelled out: since f4c19a9 the default at hd 512 is the roles kernel in work order
CFGS='[{"wide_design": "split_v", "batch_order": "given"}, {"wide_design": "split_v", "batch_order": "work"}, {"wide_design": "roles", "batch_order": "given"}, {"wide_design": "roles", "batch_order": "work"}]'
timeout $((b * 2 / 3)) python3 -m blockdiff.bench.bench_attention --backends cute \
  --workloads mixed_global_ctx8k,mixed_sliding_ctx8k --cute-configs "$CFGS" \
  --budget-s $((b * 2 / 3 - 20)) --no-plots --suite-name attention-cute_batch_order --out $OUT \
  > $OUT/bench_order.log 2>&1
echo "bench rc=$?"; tail -12 $OUT/bench_order.log
timeout $((b / 3)) python3 -m blockdiff.bench.bench_attention --suite batch_ladder --backends cute \
  --workloads canvas_bs16_ctx8k_global --cute-configs "$CFGS" \
  --budget-s $((b / 3 - 15)) --no-plots --suite-name attention-cute_batch_order_bs16 --out $OUT \
  > $OUT/bench_order_bs16.log 2>&1
echo "bench bs16 rc=$?"; tail -8 $OUT/bench_order_bs16.log
