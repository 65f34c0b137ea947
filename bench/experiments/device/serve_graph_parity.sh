# Issue 25 item 3's checks on the exported stdlib-byte model, kept as a record (serve_checks.sh ran them once, at tree
# 078a81c, and kept no record; docs/tuning.md 7.41), in one command (~5 min) after stagev.sh (and the CuTe DSL staged
# for the cute pair; CUTE=0 leaves it out):
#  - greedy parity, float32, triton: harness vs vLLM + blockdiff --enforce-eager (must be 6 of 6);
#  - CUDA graphs vs --enforce-eager, float32, triton, all prompts at once (batches mix prefill, denoise and commit
#    rows; the per-request causal flags change between graph replays): greedy must be 6 of 6, sampled reported;
#  - sampled agreement: the harness's sampled run against the eager server's (a rate; the issue's "sampled runs
#    report their agreement");
#  - the cute backend, bfloat16 (it refuses float32): CUDA graphs vs --enforce-eager, all at once, greedy (reported:
#    bf16 rounding follows the batch's composition, which two runs of concurrent requests need not share).
# Every harness and client call runs under serve_lib.sh's cap (DEADLINE_S, default 570 s: a hung one is stopped and its
# pairs are recorded as errors, so the record and the logs still come back).
# Writes $OUT/serve_graph_parity.json (serve_smoke.py record: per pair the equal prompts, the first differing token,
# the environment); exit 1 when a required pair differs. The current record: bench/results/serve_graph_parity-<gpu>.json
# (add suite / gpu / commit / result at its top, as the 2026-12-06 one); the one it replaces goes to history/.
#   BLOCKDIFF_COMMIT=<hash> [CUTE=0] bash bench/experiments/device/serve_graph_parity.sh
set -u
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
[ "${CUTE:-1}" = 1 ] && export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
source bench/experiments/device/serve_lib.sh
python3 -c "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__)" || exit 3
L=/tmp/gp_logs; mkdir -p $L
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $L/export.log 2>&1
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 1G --max-num-seqs 8"
C="$C --attention-backend CUSTOM --no-async-scheduling"
C="$C --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
B="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_SAMPLER_BACKEND=triton"
srv() {  # port, attention backend, log, vllm flags
  local port=$1 attn=$2 log=$3; shift 3
  (up $port || setsid env $B BLOCKDIFF_ATTN_BACKEND=$attn $V serve /tmp/exp $C "$@" --port $port > $L/$log.log 2>&1 \
    < /dev/null) > /dev/null 2>&1 &
}
srv 8031 triton e32 --enforce-eager --dtype float32
srv 8033 triton g32 --dtype float32
SERVERS="8031:e32 8033:g32"  # port:log
if [ "${CUTE:-1}" = 1 ]; then
  srv 8034 cute e16cute --enforce-eager --dtype bfloat16; srv 8035 cute g16cute --dtype bfloat16
  SERVERS="$SERVERS 8034:e16cute 8035:g16cute"
fi
M="-m blockdiff.bench.experiments.serve_smoke"
capped python3 $M harness --dtype float32 --out $L/h32.json > $L/h32.log 2>&1
capped python3 $M harness --dtype float32 --sampled --out $L/h32s.json > $L/h32s.log 2>&1
el harness done
for i in $(seq 120); do  # until every server is up or has died (a dead one's pairs are recorded as errors)
  n=0; for s in $SERVERS; do (up ${s%:*} || dead $L/${s#*:}.log) && n=$((n + 1)); done
  [ $n = $(echo $SERVERS | wc -w) ] && break; [ "$(left)" -gt 60 ] || break; sleep 3
done
el servers: $(for s in $SERVERS; do up ${s%:*} && echo "${s#*:} up" || echo "${s#*:} DOWN"; done)
cl() { capped python3 $M client --base-url http://127.0.0.1:$1 --model /tmp/exp --out $L/$2.json ${@:3} > $L/cl_$2.log 2>&1; }
cl 8031 e32; cl 8031 e32c --concurrent; cl 8033 g32c --concurrent
cl 8031 e32s --concurrent --sampled; cl 8033 g32s --concurrent --sampled
P="--pair harness_vs_eager_fp32 $L/h32.json $L/e32.json --pair harness_vs_eager_fp32_concurrent $L/h32.json $L/e32c.json"
P="$P --pair eager_vs_graphs_fp32_concurrent_greedy $L/e32c.json $L/g32c.json"
P="$P --pair eager_vs_graphs_fp32_concurrent_sampled $L/e32s.json $L/g32s.json"
P="$P --pair harness_sampled_vs_eager_sampled_fp32 $L/h32s.json $L/e32s.json"
if [ "${CUTE:-1}" = 1 ]; then
  cl 8034 e16cute --concurrent; cl 8035 g16cute --concurrent
  P="$P --pair cute_eager_vs_graphs_bf16_concurrent_greedy $L/e16cute.json $L/g16cute.json"
fi
python3 $M record --out $OUT/serve_graph_parity.json $P --require harness_vs_eager_fp32 \
  --require eager_vs_graphs_fp32_concurrent_greedy; rc=$?
grep -hE "Traceback|Error|ERROR" $L/*.log | grep -v "ulimit\|_warmup_" | sort | uniq -c | sort -rn | head -8
grep -hE "Capturing CUDA graphs|Graph capturing finished" $L/g32.log $L/g16cute.log 2>/dev/null | head -6
cd $L && tar czf $OUT/graph_parity_logs.tgz *.log *.json
el "end (record rc=$rc)"
exit $rc
