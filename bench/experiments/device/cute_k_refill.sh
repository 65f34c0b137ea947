# The roles kernel's K stage refilled by head-dim halves (CuteConfig.k_refill "halves", off by default: "auto" =
# "whole" until this run) on the lent H200 in one command (~5 min), after the CuTe DSL's first staging run (STAGE2=1
# makes this the second, carrying .device/p2). Logs and the A/B record under $OUT.
#  1. GPU tests of tests/attention/cute/test_cute_k_refill_halves.py in five parallel shards of at most T s each
#     (default 150; ~8 compiles a shard): halves against whole bit for bit (outputs and LSEs) over pages 64 / 16 / 8
#     and contiguous with S serial (k_serial) and ahead (k_ahead), windows in both modes with both V refills and
#     32-key tiles (k_win), split-KV 2 / 3 (k_split), K / V rows past the end poisoned and a CUDA-graph replay
#     (k_misc); the fp64 reference on each;
#  2. ab_cute_configs on mixed_global_ctx8k and canvas_bs1_ctx32k_global, paged 64, whole against halves (the rest
#     of the config "auto": V refill by halves, S ahead; the canvas at 2 KV splits), the triton backend in the same
#     rounds, 3 rounds, at most B s (default 150; B=0 skips it).
# Prediction (written before any GPU run, from docs/tuning.md 2.21's ncu of the default kernel on the canvas: ~3,590
# clk a key block, of which SM waits ~970 for K): canvas_bs1_ctx32k_global 5-10 % less time with halves (half 0
# requested ~500 clk earlier and S(i + 1) starting on it: ~500-800 clk of that wait gone, about half of that
# realised, as in 2.20, where S's tensor time overlapped the P V wgmma), mixed_global_ctx8k 2-6 %; outputs
# bit-identical. Refuted if the canvas gains under 3 % or either workload loses time.
#   BLOCKDIFF_COMMIT=<hash> [STAGE2=1] [T=...] [B=...] bash bench/experiments/device/cute_k_refill.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-150}; K=tests/attention/cute/test_cute_k_refill_halves.py
shard() {  # $1 log name, rest: pytest arguments
  local log=$1; shift
  timeout $t python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5 "$@" > /tmp/kr_$log.log 2>&1 < /dev/null
  echo "rc=$?" >> /tmp/kr_$log.log
}
rm -f /tmp/kr_*.log
shard k_serial $K -k "one_and_many and serial" & shard k_ahead $K -k "one_and_many and ahead" &
shard k_win $K -k windows & shard k_split $K -k split_kv & shard k_misc $K -k "past_seq_lens or graph" &
wait
for f in /tmp/kr_*.log; do echo "== $f"; cat $f; done > $OUT/tests.log
for f in /tmp/kr_*.log; do
  echo "== $f"; grep -E "passed|failed|error|rc=" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
done
[ "${B:-150}" = 0 ] && exit 0
timeout ${B:-150} python3 -m blockdiff.bench.experiments.ab_cute_configs mixed_global_ctx8k,canvas_bs1_ctx32k_global \
  '{"whole": {"k_refill": "whole"}, "halves": {"k_refill": "halves"}}' --layouts paged --no-fa4 --triton --rounds 3 \
  --out $OUT > $OUT/ab_k_refill.log 2>&1
echo "ab rc=$?"; tail -24 $OUT/ab_k_refill.log
