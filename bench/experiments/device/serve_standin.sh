# Issue 25 on the GPU machine, without using its GPU: the serving stand-in (bench/experiments/serve_standin.py;
# docs/tuning.md 7.15) on this machine's host. The real vLLM 0.26 server, blockdiff's scheduler and `vllm bench
# serve`, with a worker that answers each step after the H200's measured time for its size. On the CPU of the
# development machine a 64-request load ends with the stand-in's last step (no tail); the served H200 loads end up
# to 15 s later (7.13). A tail here puts the cause in this machine's host side (Python 3.12, its packages, the VM);
# none puts it in the real model runner. ~2 min after vLLM's staging (stagev.sh):
#   [STANDIN_CONC=1,64,64] [API_SERVERS=N] bash bench/experiments/device/serve_standin.sh
# Writes $OUT/standin.json (rows with host_cpu and the timeline), the server's log tail and `pip list`.
set -u
source bench/experiments/device/env.sh
W=${SERVE_BENCH_DIR:-/tmp/serve_bench}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
python3 -m pip list 2>/dev/null > $OUT/pip_list.txt
run() {  # $1 platform (auto: vLLM's own, CUDA here; cpu: the stand-in's), $2 folder
  timeout ${STANDIN_TIMEOUT_S:-300} python3 -m blockdiff.bench.experiments.serve_standin run --platform $1 --out $2 \
    --model $W/dg26b --concurrency ${STANDIN_CONC:-1,64,64} --api-servers ${API_SERVERS:-1} --start-timeout 240
}
[ -f $W/dg26b/config.json ] || python3 -m blockdiff.bench.bench_serve model $W/dg26b > /dev/null
run auto $W/standin || { echo "the stand-in on vLLM's own platform failed; tail of its log:";
  tail -c 1500 $W/standin/server.log; echo "== again on the stand-in's CPU platform"; run cpu $W/standin; }
cp $W/standin/standin.json $OUT/ 2>/dev/null
tail -c 400000 $W/standin/server.log > $OUT/standin_server.log 2>/dev/null
true
