# break28b on a Hopper (2026-12-07), one command (~6-7 min), sourced from the repo root after a fresh start (no
# staging: the triton backend only):
#  1. the triton attention GPU tests at the head (-m gpu, cute rows deselected: the CuTe DSL is not staged), and
#     break28b's CPU-suite rows compiled (BLOCKDIFF_TEST_CUDA=1: the lazy-rescale and wide-stride regressions);
#  2. the cost of the lazy rescale's new growth rule (7df050d: m_new - m_i, the -1e30 clamp gone) and of the int64
#     key-offset switch (89d681d, off for these layouts): bench_attention's triton rows on the sliding workloads
#     (the portable kernel's tuned hd-256 sliding config is the LAZY_RESCALE one) and two others, the attention
#     package of 213aae2 (carried as .device/ab_old/attention: git archive 213aae2 attention) against the head,
#     alternated old/new twice in one run. Expected: no change beyond noise (one fewer max per key block).
#   BLOCKDIFF_COMMIT=<hash> source bench/experiments/device/ab_lazy.sh      # carrying .device/ab_old
# Under $OUT: tests.log, contract.log, ab_<side><round>.log and the records under ab/.
source bench/device_env.sh
timeout 240 python3 -m pytest -m gpu tests/attention -k "not cute" -n 4 -q -p no:cacheprovider > $OUT/tests.log 2>&1
echo "gpu tests rc=$?"; tail -4 $OUT/tests.log
BLOCKDIFF_TEST_CUDA=1 timeout 90 python3 -m pytest tests/attention/triton/test_triton_portable.py \
  -k "lazy_rescaling or row_stride_past_int32" -q -p no:cacheprovider > $OUT/contract.log 2>&1
echo "compiled regressions rc=$?"; tail -3 $OUT/contract.log
mkdir -p /tmp/bdold/blockdiff
for p in sampler model integration bench; do ln -sfn "$PWD/$p" /tmp/bdold/blockdiff/$p; done
ln -sfn "$PWD/.device/ab_old/attention" /tmp/bdold/blockdiff/attention
W=canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k,mixed_sliding_prefix_ctx8k,canvas_bs1_ctx32k_hd128
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then PP=/tmp/bdold:$PWD; else PP=/tmp/bdpath:$PWD; fi
    PYTHONPATH=$PP timeout 100 python3 -m blockdiff.bench.bench_attention --backends triton --workloads $W \
      --no-plots --suite-name ab_${side}$r --out $OUT/ab > $OUT/ab_${side}$r.log 2>&1
    echo "ab $side$r rc=$?"
  done
done
python3 - <<'PY'
import glob, json, os
rows = {}
for f in sorted(glob.glob(os.path.join(os.environ["OUT"], "ab", "*.json"))):
    d = json.load(open(f))
    side = d.get("suite", os.path.basename(f))
    for r in d.get("rows", []):
        if r.get("backend") == "triton" and r.get("status") == "ok":
            rows.setdefault(r["workload"], []).append((side, r["graph_ms"] * 1e3, r["eager_ms"] * 1e3, r.get("impl")))
for w, v in rows.items():
    print(w, " ".join(f"{s}: graph {g:.1f} us eager {e:.1f} us ({i})" for s, g, e, i in v))
PY
