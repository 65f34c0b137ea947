# Issue 25's greedy parity: vLLM + blockdiff (CUSTOM) on the exported stdlib-byte model, in float32 and in bf16,
# against the harness in the same dtype (bench/experiments/serve_smoke.py, greedy, rng_request_id = the harness's
# request ids). float32 must be equal token for token (6 of 6); bf16 reports the agreement (vLLM's Gemma 4 layers
# round differently from blockdiff's). Fresh ports (8031 / 8032): a server left from an older tree is not reused.
# Run from the repo root after staging (bench/experiments/device/stagev.sh), e.g.
#   bash bench/experiments/device/serve_parity.sh
source bench/experiments/device/env.sh
V="python3 -m vllm.entrypoints.cli.main"
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" 2>/dev/null; }
dead() { grep -q "initialization failed\|Traceback" $1; }
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $OUT/export.log 2>&1
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.2 --no-async-scheduling --max-num-seqs 8"
C="$C --enforce-eager --attention-backend CUSTOM --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
E="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton"
up 8031 || setsid env $E $V serve /tmp/exp $C --dtype float32 --port 8031 > /tmp/plugin32.log 2>&1 < /dev/null &
up 8032 || setsid env $E $V serve /tmp/exp $C --dtype bfloat16 --port 8032 > /tmp/plugin16.log 2>&1 < /dev/null &
M="-m blockdiff.bench.experiments.serve_smoke"
python3 $M harness --dtype float32 --out $OUT/harness32.json > $OUT/harness32.log 2>&1
python3 $M harness --dtype bfloat16 --out $OUT/harness16.json > $OUT/harness16.log 2>&1
for i in $(seq 100); do (up 8031 || dead /tmp/plugin32.log) && (up 8032 || dead /tmp/plugin16.log) && break; sleep 3; done
up 8031 && python3 $M client --base-url http://127.0.0.1:8031 --model /tmp/exp --out $OUT/plugin32.json
up 8032 && python3 $M client --base-url http://127.0.0.1:8032 --model /tmp/exp --out $OUT/plugin16.json
echo "== float32 (must be 6 of 6)"; [ -f $OUT/plugin32.json ] && python3 $M compare $OUT/harness32.json $OUT/plugin32.json | tail -1
echo "== bfloat16 (agreement only)"; [ -f $OUT/plugin16.json ] && python3 $M compare $OUT/harness16.json $OUT/plugin16.json | tail -1
for d in 32 16; do tail -c 200000 /tmp/plugin$d.log > $OUT/plugin$d.log; done
grep -E "Traceback|Error:|ERROR|refused" /tmp/plugin32.log /tmp/plugin16.log | grep -v "ulimit\|_warmup_" | head -20
grep -h "bidirectional window rule\|Mean denoising steps" /tmp/plugin32.log /tmp/plugin16.log | tail -4
