# Issue 25 on the H200 in one command after stagev.sh, within a device budget (BUDGET_S seconds, default 540):
#  1. serve_bench.sh start fp8: stock vLLM 0.26 and vLLM + blockdiff (triton) on the 26B-A4B geometry, FP8,
#     both with asynchronous scheduling, pages of 64 tokens, CUDA graphs for every canvas count;
#  2. beside their start: the GPU tests of this session's changes (GPU_TESTS: pytest -k expression; with the CuTe
#     DSL staged also the cute backend's hd-512 and split-KV kernel tests, CUTE_TESTS=0 to skip) and the
#     asynchronous-scheduling parity check: vLLM + blockdiff with BlockdiffDiffusionAsyncScheduler (CUDA graphs,
#     float32) on the exported stdlib-byte model against the harness, greedy, one at a time and all at once
#     (must be 6 of 6, as the synchronous server was on 2026-12-02);
#  3. serve_bench.sh wait, then bench with INTERLEAVE=1 (one concurrency at a time on both sides) in what is left.
# Outputs under $OUT: serve_rows_fp8.jsonl, the servers' log tails, checks.tgz (tests, parity).
source bench/experiments/device/env.sh
T0=$(date +%s); BUDGET=${BUDGET_S:-540}; el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=bench/experiments/device/serve_bench.sh
V="python3 -m vllm.entrypoints.cli.main"
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" 2>/dev/null; }
bash $S start fp8
L=/tmp/checks; mkdir -p $L
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/integration/test_sampler.py \
  tests/attention/triton/test_triton_gluon.py \
  -k "${GPU_TESTS:-never_synchronizes or packed_kv_layout or may_not_see or disallowed_keys}" \
  > $L/gpu_tests.log 2>&1 & TP=$!
# the cute backend's hd-512 and split-KV GPU tests (issue 27), when the CuTe DSL is staged too (stage-cutlass runs)
CP=""
if [ -d /tmp/site/nvidia_cutlass_dsl ] && [ "${CUTE_TESTS:-1}" = 1 ]; then
  for f in wide split; do
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=3 \
      tests/attention/cute/test_cute_kernel_$f.py > $L/gpu_cute_$f.log 2>&1 & CP="$CP $!"
  done
fi
(
  [ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $L/export.log 2>&1
  B="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton"
  setsid env $B $V serve /tmp/exp --language-model-only --max-model-len 512 --gpu-memory-utilization 0.04 \
    --kv-cache-memory-bytes 1G --max-num-seqs 8 --attention-backend CUSTOM --dtype float32 --async-scheduling \
    --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler --port 8035 \
    > $L/async32.log 2>&1 < /dev/null &
  M="-m blockdiff.bench.experiments.serve_smoke"
  python3 $M harness --dtype float32 --out $L/h32.json > $L/h32.log 2>&1
  for i in $(seq 60); do up 8035 && break; sleep 3; done
  for mode in "" --concurrent; do
    python3 $M client --base-url http://127.0.0.1:8035 --model /tmp/exp --out $L/a32$mode.json $mode > /dev/null 2>&1
    echo "harness vs async-scheduling fp32 ${mode:-sequential} (must be 6 of 6): $(python3 $M compare $L/h32.json \
      $L/a32$mode.json | tail -1)"
  done
  grep -m1 "Asynchronous scheduling is" $L/async32.log
  pkill -f "port 8035"
) > $L/async.log 2>&1 &
WAIT_S=$(( BUDGET / 2 )) bash $S wait fp8
el "servers up"; wait $TP $CP; for f in $L/gpu_*.log; do echo "== $f"; tail -3 $f; done
INTERLEAVE=1 TOTAL_S=$(( BUDGET - ($(date +%s) - T0) - 25 )) bash $S bench fp8
el "bench done"; cat $L/async.log
grep -hE "Asynchronous scheduling is|Graph capturing finished|init engine" /tmp/serve_bench/*-fp8.log | head -6
cd $L && tar czf $OUT/checks.tgz *.log *.json 2>/dev/null
el end
