# Issue 25 on the GPU machine, without using its GPU: the serving stand-in (bench/experiments/serve_standin.py;
# docs/tuning.md 7.15) on this machine's host. The real vLLM 0.26 server, blockdiff's scheduler and `vllm bench
# serve`, with a worker that answers each step after the H200's measured time for its size. On the CPU of the
# development machine a 64-request load ends with the stand-in's last step (no tail); the served H200 loads end up
# to 15 s later (7.13). A tail here puts the cause in this machine's host side (Python 3.12, its packages, the VM);
# none puts it in the real model runner. ~3 min after vLLM's staging (stagev.sh), carrying .device/pyspy:
#   [STANDIN_CONC=1,64,64] [API_SERVERS=N] bash bench/experiments/device/serve_standin.sh
# Writes $OUT/standin.json (rows with host_cpu and the timeline), the server's log tail, `pip list`, and with
# .device/pyspy carried a py-spy summary of the server's threads (pyspy_top_standin.txt).
set -u
source bench/experiments/device/env.sh
W=${SERVE_BENCH_DIR:-/tmp/serve_bench}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
python3 -m pip list 2>/dev/null > $OUT/pip_list.txt
run() {  # $1 platform (auto: vLLM's own, CUDA here; cpu: the stand-in's), $2 folder. Each run within 270 s (a
  # SIGTERM stops its server), so both fit the device's 600 s a command
  timeout ${STANDIN_TIMEOUT_S:-270} python3 -m blockdiff.bench.experiments.serve_standin run --platform $1 --out $2 \
    --model $W/dg26b --concurrency ${STANDIN_CONC:-1,64,64} --api-servers ${API_SERVERS:-1} --start-timeout 150 \
    --run-timeout 100
}
[ -f $W/dg26b/config.json ] || python3 -m blockdiff.bench.bench_serve model $W/dg26b > /dev/null
# py-spy (the wheel carried in .device/pyspy, as serve_host.sh) over each stand-in server's processes while it runs
# (the one that serves: a server that fails to start is followed by the next one's pid)
WHEELS=${PYSPY_WHEEL_DIR:-.device/pyspy}; mkdir -p $W/standin; rm -f $W/standin/server.pid $W/standin/standin.json
spy=""
if ls $WHEELS/py_spy-*.whl > /dev/null 2>&1; then
  python3 -m zipfile -e $(ls $WHEELS/py_spy-*.whl | tail -1) $W/pyspy
  PYSPY=$(ls $W/pyspy/py_spy-*.data/scripts/py-spy); chmod +x $PYSPY; touch $W/standin/.running
  ( last=""; while [ -f $W/standin/.running ]; do
      p=$(cat $W/standin/server.pid 2>/dev/null)
      if [ -n "$p" ] && [ "$p" != "$last" ] && kill -0 $p 2>/dev/null; then
        last=$p
        # --idle as serve_host.sh (PYSPY_IDLE=0: busy threads only; without it the stand-in's idle servers gave
        # py-spy no samples during the loads, docs/tuning.md 7.17)
        IDLE=(); [ "${PYSPY_IDLE:-1}" != 0 ] && IDLE=(--idle)
        $PYSPY record --pid $p --subprocesses --threads ${IDLE[@]+"${IDLE[@]}"} --rate 40 --nonblocking --format raw --duration 600 \
          -o $OUT/pyspy_raw_standin.txt > $OUT/pyspy_standin.log 2>&1 &
        echo $! > $W/standin/pyspy.pid; wait $!
      fi
      sleep 1
    done ) &
  spy=$!
fi
run auto $W/standin || { echo "the stand-in on vLLM's own platform failed; tail of its log:";
  tail -c 1500 $W/standin/server.log; echo "== again on the stand-in's CPU platform"; run cpu $W/standin; }
cp $W/standin/standin.json $OUT/ 2>/dev/null
rm -f $W/standin/.running
[ -n "$spy" ] && { kill -INT $(cat $W/standin/pyspy.pid 2>/dev/null) 2>/dev/null; wait $spy; }
if [ -f $OUT/pyspy_raw_standin.txt ]; then
  python3 bench/experiments/pyspy_top.py $OUT/pyspy_raw_standin.txt --top 12 > $OUT/pyspy_top_standin.txt
  gzip -f $OUT/pyspy_raw_standin.txt; head -40 $OUT/pyspy_top_standin.txt
fi
tail -c 400000 $W/standin/server.log > $OUT/standin_server.log 2>/dev/null
true
