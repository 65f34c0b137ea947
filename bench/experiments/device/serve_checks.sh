# Issue 25 item 3 on the H200 in one command (after stagev.sh): what must hold before the serving benchmark.
#  1. greedy parity of vLLM + blockdiff (CUSTOM, triton) with the harness on the exported stdlib-byte model: float32
#     must be 6 of 6 token for token; bfloat16 reports the agreement (serve_parity.sh's check);
#  2. CUDA graphs against --enforce-eager (float32, greedy and sampled, all prompts at once, so batches mix prefill,
#     denoise and commit rows and the per-request causal flags change between graph replays): equal outputs;
#  3. the DiffusionGemma-26B-A4B geometry (--load-format dummy, --quantization fp8, 16 fixed denoising steps,
#     generation_config confidence_threshold 0): stock vLLM 0.26 (TRITON_ATTN, its sampler) and vLLM + blockdiff
#     start (startup seconds logged) and answer a 4096-token prompt with 512 tokens (`vllm bench serve`, c = 1);
#  4. the GPU tests of the sampler, model, integration and the portable Triton attention in the background.
# Memory: 26B servers ~27 GB fp8 weights + 16 GB KV + sampler / activations each; small ones 1 GB KV each.
# Servers start with setsid and keep running until the machine goes back; logs and JSON under $OUT (<= 8 files).
# Time: the 26B wait ends by 470 s; each c = 1 run then gets at most 90 s and no more than is left before 575 s
# (2026-12-05 audit: 470 + 2 x 90 overran the 600-s command limit).
source bench/experiments/device/env.sh
source bench/experiments/device/serve_lib.sh
python3 -c "import vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch; print('vllm', vllm.__version__)" || exit 3
L=/tmp/logs; mkdir -p $L
# -- 3. the 26B servers first: their start (dummy weights, fp8, torch.compile, CUDA graphs) is the longest part
[ -d /tmp/dg26 ] || python3 -c "
from blockdiff.model import DiffusionGemmaConfig
from blockdiff.model.export import export_hf
from blockdiff.bench.bench_e2e import DIFFUSIONGEMMA_26B_A4B
export_hf(DiffusionGemmaConfig(num_hidden_layers=30, **DIFFUSIONGEMMA_26B_A4B), '/tmp/dg26', max_denoising_steps=16,
          confidence_threshold=1e-9)" > $L/export26.log 2>&1
D='{"canvas_length":256,"max_denoising_steps":16}'
C26="--load-format dummy --quantization fp8 --language-model-only --max-model-len 8192 --gpu-memory-utilization 0.42 --kv-cache-memory-bytes 16G"
B="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton"
(up 8041 || setsid env VLLM_PLUGINS=none $V serve /tmp/dg26 $C26 --diffusion-config "$D" --attention-backend TRITON_ATTN \
  --max-num-seqs 4 --port 8041 > $L/stock26.log 2>&1 < /dev/null) > /dev/null 2>&1 &
(up 8042 || setsid env $B $V serve /tmp/dg26 $C26 --diffusion-config "$D" --attention-backend CUSTOM --no-async-scheduling \
  --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler --max-num-seqs 16 --port 8042 \
  > $L/bd26.log 2>&1 < /dev/null) > /dev/null 2>&1 &
# -- 1, 2. small servers: float32 eager, bfloat16 eager, float32 with CUDA graphs
[ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $L/export.log 2>&1
C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 1G --max-num-seqs 8 --attention-backend CUSTOM"
C="$C --no-async-scheduling --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
(up 8031 || setsid env $B $V serve /tmp/exp $C --enforce-eager --dtype float32 --port 8031 > $L/p32.log 2>&1 < /dev/null) > /dev/null 2>&1 &
(up 8032 || setsid env $B $V serve /tmp/exp $C --enforce-eager --dtype bfloat16 --port 8032 > $L/p16.log 2>&1 < /dev/null) > /dev/null 2>&1 &
(up 8033 || setsid env $B $V serve /tmp/exp $C --dtype float32 --port 8033 > $L/g32.log 2>&1 < /dev/null) > /dev/null 2>&1 &
# -- 4. GPU tests (not the Gluon or cute ones) beside it
P="timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rf"
$P tests/sampler tests/model tests/integration tests/bench > $L/gpu_tests_rest.log 2>&1 & T1=$!
$P tests/attention --ignore=tests/attention/triton/test_triton_gluon.py --ignore=tests/attention/cute > $L/gpu_tests_attn.log 2>&1 & T2=$!
M="-m blockdiff.bench.experiments.serve_smoke"
python3 $M harness --dtype float32 --out $L/h32.json > $L/h32.log 2>&1
python3 $M harness --dtype bfloat16 --out $L/h16.json > $L/h16.log 2>&1
el harness done
for i in $(seq 100); do (up 8031 || dead $L/p32.log) && (up 8032 || dead $L/p16.log) && (up 8033 || dead $L/g32.log) && break; sleep 3; done
el small servers: $(for p in 8031 8032 8033; do up $p && echo "$p up" || echo "$p DOWN"; done)
cl() { python3 $M client --base-url http://127.0.0.1:$1 --model /tmp/exp --out $L/$2.json ${@:3} > /dev/null 2>&1; }
cl 8031 e32; cl 8032 e16; cl 8031 e32c --concurrent; cl 8033 g32c --concurrent; cl 8033 g32
cl 8031 e32s --concurrent --sampled; cl 8033 g32s --concurrent --sampled
cmp() { echo "$1: $(python3 $M compare $L/$2.json $L/$3.json | tail -1)"; }
cmp "harness vs eager fp32 (must be 6 of 6)" h32 e32
cmp "harness vs eager bf16 (agreement)" h16 e16
cmp "harness vs eager fp32, concurrent" h32 e32c
cmp "eager vs CUDA graphs fp32, concurrent greedy (must be 6 of 6)" e32c g32c
cmp "eager vs CUDA graphs fp32, sequential greedy" e32 g32
cmp "eager vs CUDA graphs fp32, concurrent sampled" e32s g32s
el checks done
# -- 3. wait for the 26B servers (startup logged), then one c = 1 run each
for i in $(seq 200); do (up 8041 || dead $L/stock26.log) && (up 8042 || dead $L/bd26.log) && break; [ $(( $(date +%s) - T0 )) -gt 470 ] && break; sleep 3; done
el 26B servers: $(for p in 8041 8042; do up $p && echo "$p up" || echo "$p DOWN"; done)
for p in 8041 8042; do
  lim=$(( 575 - ($(date +%s) - T0) )); [ $lim -gt 90 ] && lim=90
  [ $lim -lt 20 ] && { echo "$p: no time left for its c = 1 run"; continue; }
  up $p && timeout $lim $V bench serve --model /tmp/dg26 --base-url http://127.0.0.1:$p --dataset-name random \
    --random-input-len 4096 --random-output-len 512 --ignore-eos --max-concurrency 1 --num-prompts 2 \
    --save-result --result-dir $L --result-filename bench$p.json 2>&1 | grep -E "throughput|TTFT|Successful|Failed" | sed "s/^/$p /"
done
wait $T1 $T2; for f in $L/gpu_tests_*.log; do echo "== $f"; tail -3 $f; done
grep -hE "Traceback|Error|ERROR" $L/*.log | grep -v "ulimit\|_warmup_" | sort | uniq -c | sort -rn | head -12
grep -hE "init engine|Graph capturing finished|torch.compile takes|Loading weights took|Available KV cache|Maximum concurrency" $L/stock26.log $L/bd26.log | head -12
cd $L && tar czf $OUT/logs.tgz --exclude=*.json *.log && tar czf $OUT/json.tgz *.json
el end
