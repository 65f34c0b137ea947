# Sourced by the triton A/B device scripts (ab_lazy.sh, ab_exact_weight.sh) from the repo root, after
# bench/device_env.sh: bench_attention's triton rows on the workloads $W, the attention package carried as
# .device/ab_old/attention (`git archive <old> attention` unpacked there) against the checkout's, alternated
# old / new for two rounds in one run (T seconds a run, default 110), then one summary line a workload (graph and
# eager medians in us, the implementation). Logs ab_<side><round>.log and the records' JSON under $OUT/ab.
mkdir -p /tmp/bdold/blockdiff $OUT/ab
for p in sampler model integration bench; do ln -sfn "$PWD/$p" /tmp/bdold/blockdiff/$p; done
ln -sfn "$PWD/.device/ab_old/attention" /tmp/bdold/blockdiff/attention
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then PP=/tmp/bdold:$PWD; else PP=/tmp/bdpath:$PWD; fi
    PYTHONPATH=$PP timeout ${T:-110} python3 -m blockdiff.bench.bench_attention --backends triton --workloads $W \
      --no-plots --suite-name ab_${side}$r --out /tmp/ab_records > $OUT/ab_${side}$r.log 2>&1
    echo "ab $side$r rc=$?"
  done
done
cp /tmp/ab_records/*.json $OUT/ab/ 2>/dev/null
python3 - <<'PY'
import glob, json, os
rows = {}
for f in sorted(glob.glob("/tmp/ab_records/*.json")):
    side = os.path.basename(f).rsplit(".", 1)[0]
    for r in json.load(open(f)).get("rows", []):
        if r.get("backend") == "triton" and r.get("status") == "ok":
            rows.setdefault(r["workload"], []).append((side, r["graph_ms"] * 1e3, r["eager_ms"] * 1e3, r.get("impl")))
for w, v in rows.items():
    print(w, " ".join(f"{s}: graph {g:.1f} us eager {e:.1f} us ({i})" for s, g, e, i in v))
PY
