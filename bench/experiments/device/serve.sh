# Stock vLLM (TRITON_ATTN) and vLLM + blockdiff (CUSTOM) on the exported stdlib-byte model, then the
# demo prompts through both and the harness (bench/experiments/serve_smoke.py). Servers stay up (setsid) between runs.
source bench/experiments/device/env.sh
V="python3 -m vllm.entrypoints.cli.main"
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" 2>/dev/null; }
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $OUT/export.log 2>&1
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.25 --kv-cache-memory-bytes 1G --no-async-scheduling --max-num-seqs 8 ${EXTRA:-}"
(up 8021 || setsid env VLLM_PLUGINS=none $V serve /tmp/exp $C --attention-backend TRITON_ATTN --enforce-eager --port 8021 > /tmp/stock.log 2>&1 < /dev/null) > /dev/null 2>&1 &
(up 8022 || setsid env VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton $V serve /tmp/exp $C --attention-backend CUSTOM --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler --enforce-eager --port 8022 > /tmp/plugin.log 2>&1 < /dev/null) > /dev/null 2>&1 &
[ -f /tmp/h.json ] || python3 -m blockdiff.bench.experiments.serve_smoke harness --out /tmp/h.json > /tmp/harness.log 2>&1
dead() { grep -q "initialization failed\|Traceback" $1; }
for i in $(seq 90); do (up 8021 || dead /tmp/stock.log) && (up 8022 || dead /tmp/plugin.log) && break; sleep 3; done
M="-m blockdiff.bench.experiments.serve_smoke"
up 8021 && python3 $M client --base-url http://127.0.0.1:8021 --model /tmp/exp --out $OUT/stock.json --sampled
up 8022 && python3 $M client --base-url http://127.0.0.1:8022 --model /tmp/exp --out $OUT/plugin.json
cp /tmp/h.json $OUT/harness.json; tail -3 /tmp/harness.log
[ -f $OUT/plugin.json ] && python3 $M compare /tmp/h.json $OUT/plugin.json
tail -c 200000 /tmp/stock.log > $OUT/stock.log; tail -c 300000 /tmp/plugin.log > $OUT/plugin.log
grep -E "Traceback|Error:|ERROR" /tmp/plugin.log /tmp/stock.log | grep -v ulimit | head -20
