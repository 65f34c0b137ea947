# Issue 25 on the H200: where a served 64-request load's time goes on the host (docs/tuning.md 7.13: the profiled
# load's client window ended 15 s after the GPU's last kernel, 7.11's 4 s). One side alone, one command (~7 min):
#   BLOCKDIFF_COMMIT=<hash> [API_SERVERS=4] bash bench/experiments/device/serve_host.sh SIDE [fp8|bf16] [triton|cute]
# carrying .device/pyspy (the py-spy 0.4.3 wheel; without it the second load runs without py-spy). After
# alone_up.sh (the server healthy, 64 seqs, 40 GiB KV): the sweep's warm-up and a c64 load (row 1 with host_cpu:
# per process and thread CPU from /proc), then a second c64 load (another seed) while py-spy samples every thread of
# the server's processes (raw stacks gzipped and a text summary by bench/experiments/pyspy_top.py), then stop
# (KEEP=1: left up). py-spy samples idle threads too (PYSPY_IDLE=0: busy ones only). LOAD_FORMAT as serve_bench.sh.
# Rows: $OUT/host_rows_<side>_a<api servers>.jsonl; the server's log tail too.
set -u
source bench/experiments/device/alone_up.sh
set -- $(bash $S info $quant $attn $side | tail -1); be=$1; port=$2; seqs=$3; pid=$(cat $6)
BS="python3 -m blockdiff.bench.bench_serve"; W=${SERVE_BENCH_DIR:-/tmp/serve_bench}; tag=${side}_a${API_SERVERS:-1}
rows=$OUT/host_rows_$tag.jsonl
PYSPY=""; WHEELS=${PYSPY_WHEEL_DIR:-.device/pyspy}  # PYSPY_WHEEL_DIR, PYSPY_S (seconds sampled, 75): CPU tests
if ls $WHEELS/py_spy-*.whl > /dev/null 2>&1; then
  python3 -m zipfile -e $(ls $WHEELS/py_spy-*.whl | tail -1) $W/pyspy \
    && PYSPY=$(ls $W/pyspy/py_spy-*.data/scripts/py-spy) && chmod +x $PYSPY
fi
BC=(); [ -n "${BENCH_CMD:-}" ] && BC=(--bench-cmd "$BENCH_CMD")
c64() {  # $1 run name, $2 warm-up concurrency, $3 seed, $4 timeout s
  timeout $4 $BS sweep --base-url http://127.0.0.1:$port --model $W/dg26b --backend $be --quant $quant \
    --concurrency 64 --max-num-seqs $seqs --server-pid $pid --warm-concurrency $2 --num-prompts-per-concurrency 1 \
    --min-prompts 4 --seed $3 --rows $rows --work-dir $W/host_$1 --load-format ${LOAD_FORMAT:-dummy} \
    ${BC[@]+"${BC[@]}"} 2>&1 \
    | grep -E "ok:|error|timeout|skipped" | tail -3
}
left() { echo $(( BUDGET - ($(date +%s) - T0) - 15 )); }
c64 first $seqs 0 $(( $(left) / 2 ))
el "first c64 done"
if [ -n "$PYSPY" ]; then
  # --idle (PYSPY_IDLE=0 to leave it out): threads off the CPU are sampled too, so the summary says where each one
  # waits as well as where it works (a tail with no busy thread is a wait; host_cpu says which threads are busy)
  IDLE=(); [ "${PYSPY_IDLE:-1}" != 0 ] && IDLE=(--idle)
  $PYSPY record --pid $pid --subprocesses --threads ${IDLE[@]+"${IDLE[@]}"} --rate 40 --nonblocking --format raw \
    --duration ${PYSPY_S:-75} -o $OUT/pyspy_raw_$tag.txt > $OUT/pyspy_$tag.log 2>&1 &
  spy=$!
else
  echo "no py-spy wheel under .device/pyspy: the second load runs without it"
fi
c64 second 0 1000 $(left)
[ -n "$PYSPY" ] && { wait $spy; tail -2 $OUT/pyspy_$tag.log; }
el "second c64 done"
if [ -f $OUT/pyspy_raw_$tag.txt ]; then
  python3 bench/experiments/pyspy_top.py $OUT/pyspy_raw_$tag.txt --top 12 > $OUT/pyspy_top_$tag.txt
  gzip -f $OUT/pyspy_raw_$tag.txt; head -60 $OUT/pyspy_top_$tag.txt
fi
python3 - "$rows" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "env" in r:
        continue
    hc = r.get("host_cpu") or {}
    print(f"{r['workload']} {r['backend']}: {r.get('output_tok_s')} tok/s, duration {r.get('duration_s')} s, "
          f"ttft {r.get('ttft_ms')} ms")
    for p, v in list((hc.get("processes") or {}).items())[:4]:
        print(f"  {p}: {v['share']} cores, a thread >= 90 % busy in {v['saturated_share']} of samples")
    for t in (hc.get("top_threads") or [])[:5]:
        print(f"  thread {t['process']}/{t['thread']}: {t['share']} cores")
PY
tail -c 1500000 $W/$be-$quant.log > $OUT/serve_${be}_$quant.log 2>/dev/null
[ "${KEEP:-0}" = 1 ] && { el "server kept (KEEP=1)"; exit 0; }
bash $S stop; el end
