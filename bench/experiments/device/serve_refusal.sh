# Issue 25: requests the plugin refuses, under the real server (vLLM 0.26.0 after stagev.sh; ~2-3 min). The exported
# stdlib-byte model (float32, triton) on two servers, the synchronous scheduler (BlockdiffDiffusionScheduler,
# --no-async-scheduling) and the asynchronous one (BlockdiffDiffusionAsyncScheduler, vLLM's default scheduling); to
# each, serve_smoke.py refusals: top_k, logprobs, an unknown vllm_xargs key, temperature 0.5 and a streamed top_k
# request at once beside one plain greedy request. Each refused request must fail (the plugin's scheduler finishes it at add_request with
# finish reason error; vLLM 0.26.0 has no field for its reason, so the reason is in the server log, one WARNING
# "request <id> refused: ..." each) and the plain one be served; then the servers must still be healthy.
# Measured 2026-12-07 (H200, fe9a5ae): unstreamed refusals HTTP 500 "Internal server error", temperature 0.5 refused
# by vLLM's own front end (400), the streamed top_k HTTP 200 with only "data: [DONE]" (vLLM 0.26.0), which
# serve_smoke.classify_refusal counts as failed since (STREAM_WITHOUT_END).
# Writes $OUT/refusals_{sync,async}.json and the servers' logs; exit 1 when a check fails.
#   bash bench/experiments/device/serve_refusal.sh
set -u
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source bench/experiments/device/serve_lib.sh
python3 -c "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__)" || exit 3
L=/tmp/rf_logs; mkdir -p $L
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $L/export.log 2>&1
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 1G --max-num-seqs 8"
C="$C --attention-backend CUSTOM --dtype float32"
B="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_SAMPLER_BACKEND=triton BLOCKDIFF_ATTN_BACKEND=triton"
S=blockdiff.integration.vllm_scheduler
(up 8041 || setsid env $B $V serve /tmp/exp $C --no-async-scheduling --scheduler-cls $S.BlockdiffDiffusionScheduler \
  --port 8041 > $L/sync.log 2>&1 < /dev/null) > /dev/null 2>&1 &
(up 8042 || setsid env $B $V serve /tmp/exp $C --async-scheduling --scheduler-cls $S.BlockdiffDiffusionAsyncScheduler \
  --port 8042 > $L/async.log 2>&1 < /dev/null) > /dev/null 2>&1 &
for i in $(seq 120); do
  (up 8041 || dead $L/sync.log) && (up 8042 || dead $L/async.log) && break; [ "$(left)" -gt 30 ] || break; sleep 3
done
el servers: $(up 8041 && echo sync up || echo sync DOWN) $(up 8042 && echo async up || echo async DOWN)
rc=0
for s in 8041:sync 8042:async; do
  capped python3 -m blockdiff.bench.experiments.serve_smoke refusals --base-url http://127.0.0.1:${s%:*} \
    --model /tmp/exp --out $OUT/refusals_${s#*:}.json || rc=1
  up ${s%:*} && el "${s#*:} healthy after" || { el "${s#*:} NOT healthy after"; rc=1; }
  n=$(grep -c "refused: " $L/${s#*:}.log); el "${s#*:}: $n refused-log lines (5 when vLLM's front end passes all five on)"
  grep -h "refused: " $L/${s#*:}.log | cut -c1-300 | head -4
done
grep -hE "Traceback|ERROR" $L/*.log | grep -v "ulimit\|_warmup_" | sort | uniq -c | sort -rn | head -8
cd $L && tar czf $OUT/refusal_logs.tgz *.log
el "end rc=$rc"
exit $rc
