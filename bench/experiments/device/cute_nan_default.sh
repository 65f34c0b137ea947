# Historical (ran in the fifth lease, docs/tuning.md 2.6): since 774a866 the default is on in the tree, so the sed
# below matches nothing and DEFAULT_ON=0 no longer turns it off. After cute_next.sh's nan_safe_v shard passed
# (docs/tuning.md 2.4): the whole cute GPU suite with CuteConfig
# nan_safe_v switched on by default in this run's copy of the tree only (DEFAULT_ON=1, the default; 0 keeps the
# tree as committed), three shards at once within T s (default 240); then, on a quiet GPU, the switch's cost on the
# workloads of docs/tuning.md 1.11 and the issue-27 goal rows (cute with the switch off and on, FA4 beside them)
# within B s (default 220). Logs and the record under $OUT. Needs the CuTe DSL staged (both runs).
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/cute_nan_default.sh
set -u
source bench/experiments/device/env.sh
t=${T:-240}; b=${B:-220}
if [ "${DEFAULT_ON:-1}" = 1 ]; then
  sed -i 's/^    nan_safe_v: bool = False/    nan_safe_v: bool = True/; s/^_SWITCHES = dict(nan_safe_v=False,/_SWITCHES = dict(nan_safe_v=True,/' \
    attention/cute/config.py
  python3 -c "from blockdiff.attention.cute.config import CuteConfig as C; assert C().nan_safe_v; print('nan_safe_v on by default in this copy')" || exit 3
fi
P="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=5 -rfX"
C=tests/attention/cute
timeout $t $P $C/test_cute_interface.py $C/test_cute_blocks.py > $OUT/gpu_cute_on_interface.log 2>&1 &
timeout $t $P $C/test_cute_kernel_wide.py $C/test_cute_nan_safe_v.py > $OUT/gpu_cute_on_wide.log 2>&1 &
timeout $t $P $C/test_cute_kernel_split.py $C/test_cute_kernel_cluster.py > $OUT/gpu_cute_on_split.log 2>&1 &
wait
for f in $OUT/gpu_cute_on_*.log; do echo "== $f"; tail -4 $f; done
timeout $b python3 -m blockdiff.bench.bench_attention --backends cute,fa4 \
  --workloads 'prefill16k_hd128,mixed_global_ctx8k,mixed_sliding_ctx8k,canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_sliding,canvas_bs1_ctx32k_hd128' \
  --cute-configs '[{"nan_safe_v": false}, {"nan_safe_v": true}]' --fa4-layouts paged \
  --no-plots --suite-name attention-cute_nan_default --out $OUT > $OUT/bench_cute_nan_default.log 2>&1
echo "bench rc=$?"; tail -24 $OUT/bench_cute_nan_default.log
