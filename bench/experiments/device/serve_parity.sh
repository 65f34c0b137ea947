# Issue 25's greedy parity: vLLM + blockdiff (CUSTOM) on the exported stdlib-byte model, in float32 and in bf16,
# against the harness in the same dtype (bench/experiments/serve_smoke.py, greedy, rng_request_id = the harness's
# request ids). float32 must be equal token for token (6 of 6); bf16 reports the agreement (vLLM's Gemma 4 layers
# round differently from blockdiff's). Fresh ports (8031 / 8032): a server left from an older tree is not reused.
# Run from the repo root after staging (bench/experiments/device/stagev.sh), e.g.
#   bash bench/experiments/device/serve_parity.sh
# ATTN=cute (the CuTe DSL staged too): blockdiff's cute backend in the servers instead (bf16 only: the cute kernels
# take bf16 / fp16, so there is no float32 server and the comparison is the bf16 agreement); port 8034.
# Files under $OUT (at most 8 come back): harness32 / harness16 .json and .log, plugin32.json, plugin16.json and the two
# server log tails: 8 (ATTN=cute: 4). The export's log stays in /tmp/export.log (2026-12-05 audit: under $OUT it made 9
# on a fresh machine).
# Harness and client calls run under serve_lib.sh's cap (DEADLINE_S, default 570 s), so the comparisons and log tails
# come back when a server hangs.
source bench/experiments/device/env.sh
source bench/experiments/device/serve_lib.sh
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > /tmp/export.log 2>&1 \
  || tail -20 /tmp/export.log
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.2 --kv-cache-memory-bytes 1G --no-async-scheduling --max-num-seqs 8"
C="$C --enforce-eager --attention-backend CUSTOM --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
ATTN=${ATTN:-triton}; case $ATTN in triton) P32=8031; P16=8032 ;; cute) P32=; P16=8034 ;; *) echo "ATTN must be triton or cute"; exit 2 ;; esac
E="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=$ATTN BLOCKDIFF_SAMPLER_BACKEND=triton"
# each background list's own stdout goes to /dev/null: a list that holds the caller's pipe while its server runs
# keeps `serve_parity.sh | tail` waiting until the command's limit (the sixth lease)
[ -n "$P32" ] && { (up $P32 || setsid env $E $V serve /tmp/exp $C --dtype float32 --port $P32 > /tmp/plugin32_$ATTN.log 2>&1 < /dev/null) > /dev/null 2>&1 & }
(up $P16 || setsid env $E $V serve /tmp/exp $C --dtype bfloat16 --port $P16 > /tmp/plugin16_$ATTN.log 2>&1 < /dev/null) > /dev/null 2>&1 &
M="-m blockdiff.bench.experiments.serve_smoke"
[ -n "$P32" ] && capped python3 $M harness --dtype float32 --out $OUT/harness32.json > $OUT/harness32.log 2>&1
capped python3 $M harness --dtype bfloat16 --out $OUT/harness16.json > $OUT/harness16.log 2>&1
for i in $(seq 100); do ([ -z "$P32" ] || up $P32 || dead /tmp/plugin32_$ATTN.log) && (up $P16 || dead /tmp/plugin16_$ATTN.log) && break
  [ "$(left)" -gt 60 ] || break; sleep 3; done
[ -n "$P32" ] && up $P32 && capped python3 $M client --base-url http://127.0.0.1:$P32 --model /tmp/exp --out $OUT/plugin32.json
up $P16 && capped python3 $M client --base-url http://127.0.0.1:$P16 --model /tmp/exp --out $OUT/plugin16.json
echo "== float32 (must be 6 of 6)"; [ -f $OUT/plugin32.json ] && python3 $M compare $OUT/harness32.json $OUT/plugin32.json | tail -1
echo "== bfloat16 (agreement only)"; [ -f $OUT/plugin16.json ] && python3 $M compare $OUT/harness16.json $OUT/plugin16.json | tail -1
for d in 32 16; do [ -f /tmp/plugin${d}_$ATTN.log ] && tail -c 200000 /tmp/plugin${d}_$ATTN.log > $OUT/plugin${d}_$ATTN.log; done
grep -sE "Traceback|Error:|ERROR|refused" /tmp/plugin32_$ATTN.log /tmp/plugin16_$ATTN.log | grep -v "ulimit\|_warmup_" | head -20
grep -sh "bidirectional window rule\|Mean denoising steps" /tmp/plugin32_$ATTN.log /tmp/plugin16_$ATTN.log | tail -4
