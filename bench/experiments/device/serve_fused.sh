# Issue 25's stretch goal on the H200: the fused commit under vLLM 0.26 (integration/README.md "Fused commits under
# vLLM"; docs/tuning.md 7.34). Run from the repo root after staging (stagev.sh; the CuTe DSL too for cute), one
# command each:
#
#   bash bench/experiments/device/serve_fused.sh parity
#       the exported stdlib-byte model (CL 32) in float32, synchronous scheduler, --diffusion-config canvas_length 64
#       and BLOCKDIFF_FUSE_COMMIT=1, greedy against the harness (serve_smoke.py): must be 6 of 6 token for token,
#       one request at a time and all at once (mixed fused / plain rows); the server log's fused-commit lines, with
#       the scheduler's count "fused commits so far: F of C commits fused (P plain, M wide rows missed, ...)".
#   bash bench/experiments/device/serve_fused.sh parity_async
#       the same with vLLM's asynchronous scheduling (BlockdiffDiffusionAsyncScheduler: fused commits predicted from
#       the step cap, docs/tuning.md 7.38); only canvases that reach the cap fuse, early-converged ones commit plain;
#       must be 6 of 6 as well. Both sides run every request at a step cap of 3 (STEP_CAP; the synchronous parity
#       keeps 16): at 16 this model's canvases converge after 3-4.5 steps and none fused (7.52: "0 of 24 commits
#       fused"); at 3 every canvas reaches the cap on the CPU harness, so each request's first canvas fuses (6 of 12
#       commits one at a time, and again all at once).
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/serve_fused.sh VARIANT [fp8|bf16] [triton|cute]
#       the benchmark's 26B geometry alone on the GPU (alone_up.sh's sizes: 64 seqs, 40 GiB KV), one variant:
#         fused   --no-async-scheduling, --diffusion-config canvas_length 512, BLOCKDIFF_FUSE_COMMIT=1
#         fused_async  the same with asynchronous scheduling (vLLM's default; BlockdiffDiffusionAsyncScheduler
#                 predicts the fused rows from the step cap: docs/tuning.md 7.38); compare with the async rows of
#                 serve_alone.sh (canvas 256, unfused)
#         layout  the same without the switch (num_speculative_tokens 512 and its CUDA graphs, every row 256 wide:
#                 the A/B's baseline)
#         sync    --no-async-scheduling at canvas_length 256 (today's synchronous server)
#       start, wait, the interleaved sweep (CONC, default 1,4,16,64), stop, within BUDGET_S (570). Rows under
#       $OUT/<variant>/serve_rows_<quant>.jsonl (the row's backend names the kernels, the folder the variant), vLLM's
#       own diffusion counters in each row (diffusion_denoising_steps / committed tokens), the server's log tail.
#       Compare the three with the async rows of serve_alone.sh (bench/results/serve-h200.json).
#   FUSE_POLICY=any|uniform (unset: the server's default, any) passes BLOCKDIFF_FUSE_POLICY to the fusing servers
#       (parity, parity_async, fused, fused_async; docs/tuning.md 7.40): uniform keeps a fused row only in a step
#       whose canvas rows are all fused, so mixed-width steps (PIECEWISE graphs) never happen. Results go to a folder
#       and files named with the policy (e.g. $OUT/fused_async_uniform, fused32_async_uniform.json); layout and sync
#       fuse nothing and ignore it. E.g. CONC=4 FUSE_POLICY=uniform bash ... serve_fused.sh fused_async fp8 cute
# What to expect (CPU stand-in, serve_standin.py run --concurrency 1,16 --prompts 4,32, 2026-12-04): one engine step
# fewer per non-final canvas (c1: 140 -> 136 steps for 4 answers of 512 tokens, 868 -> 922 tok/s synchronous; the
# asynchronous server 989), the same tokens; on the GPU the saved step's fixed cost is set against a 512-row step's
# extra canvas work and the uniform-decode CUDA graphs being 512 wide (plain 256-row batches lose them).
# DRY=1: print the variant's server command and exit (CPU check; SERVE_BENCH_ENV=0 skips env.sh as serve_bench.sh).
set -u
[ "${SERVE_BENCH_ENV:-1}" = 1 ] && source bench/experiments/device/env.sh
variant=${1:?variant: parity, parity_async, fused, fused_async, layout or sync}
policy=${FUSE_POLICY:-}
case $policy in ""|any|uniform) ;; *) echo "FUSE_POLICY must be any or uniform (or unset), got $policy"; exit 2 ;; esac
psfx=${policy:+_$policy}  # results of a policy run never overwrite the default's
source bench/experiments/device/serve_lib.sh  # el, up, dead, V; the parity variants' cap (capped, DEADLINE_S)

if [ "$variant" = parity ] || [ "$variant" = parity_async ]; then
  if [ "${DRY:-0}" = 1 ] && [ ! -f /tmp/exp/config.json ]; then CL=32  # the shipped checkpoint's, not exported here
  else
    [ -d /tmp/exp ] || python3 -m blockdiff.integration.cli export /tmp/exp --overwrite > $OUT/export.log 2>&1
    CL=$(python3 -c "import json; print(json.load(open('/tmp/exp/config.json'))['canvas_length'])")
  fi
  if [ "$variant" = parity ]; then  # synchronous: fuses after the worker's -1 flag
    P=8036; tag=fused32; sfx=""; sched="--no-async-scheduling --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
    cap=${STEP_CAP:-16}
  else  # asynchronous: fuses the rows the step cap makes commits (predicted), so a cap the canvases reach
    P=8037; tag=fused32_async; sfx=_async; sched="--async-scheduling --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler"
    cap=${STEP_CAP:-3}
  fi
  # an int in [1, 2**14) (the sampler's limit; serve_smoke refuses the rest after the server started)
  case $cap in ""|*[!0-9]*|0*|??????*) cap_ok=0 ;; *) cap_ok=$(( cap < 16384 )) ;; esac
  [ "$cap_ok" = 1 ] || { echo "STEP_CAP must be an int >= 1 and below 16384, got $cap"; exit 2; }
  tag=$tag$psfx; sfx=$sfx$psfx
  LOG=/tmp/plugin32_fused$sfx.log
  C="--language-model-only --max-model-len 512 --gpu-memory-utilization 0.2 --kv-cache-memory-bytes 1G --max-num-seqs 8"
  C="$C --enforce-eager --attention-backend CUSTOM $sched"
  E="VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton BLOCKDIFF_FUSE_COMMIT=1"
  [ -n "$policy" ] && E="$E BLOCKDIFF_FUSE_POLICY=$policy"
  D="{\"canvas_length\":$((2 * CL))}"  # twice the checkpoint's canvas: the fused layout
  [ "${DRY:-0}" = 1 ] && { echo "step cap $cap"; echo "env $E $V serve /tmp/exp $C --dtype float32 --port $P --diffusion-config '$D'"; exit 0; }
  (up $P || setsid env $E $V serve /tmp/exp $C --dtype float32 --port $P --diffusion-config "$D" > $LOG 2>&1 < /dev/null) > /dev/null 2>&1 &
  M="-m blockdiff.bench.experiments.serve_smoke"
  H=harness32; [ "$cap" = 16 ] || H=harness32_cap$cap  # the harness at the clients' cap
  [ -f $OUT/$H.json ] || capped python3 $M harness --dtype float32 --step-cap $cap --out $OUT/$H.json > $OUT/$H.log 2>&1
  for i in $(seq 100); do up $P || dead $LOG && break; [ "$(left)" -gt 60 ] || break; sleep 3; done
  rm -f $OUT/$tag.json $OUT/${tag}_all.json  # a client that does not run now leaves no earlier run's record to compare
  up $P && capped python3 $M client --base-url http://127.0.0.1:$P --model /tmp/exp --step-cap $cap --out $OUT/$tag.json
  up $P && capped python3 $M client --base-url http://127.0.0.1:$P --model /tmp/exp --step-cap $cap --out $OUT/${tag}_all.json --concurrent
  echo "== float32, $variant${policy:+ (policy $policy)}, step cap $cap, one at a time (must be 6 of 6)"; [ -f $OUT/$tag.json ] && python3 $M compare $OUT/$H.json $OUT/$tag.json | tail -1
  echo "== float32, $variant${policy:+ (policy $policy)}, step cap $cap, all at once (must be 6 of 6)"; [ -f $OUT/${tag}_all.json ] && python3 $M compare $OUT/$H.json $OUT/${tag}_all.json | tail -1
  tail -c 200000 $LOG > $OUT/plugin32_fused$sfx.log
  grep -sE "Traceback|Error:|ERROR|refused|fused commits" $LOG | grep -v "ulimit\|_warmup_\|fused commits so far" | head -20
  # the schedulers' coverage lines (vllm_scheduler.FusedCommitCounts: at powers of two of the commit count and when
  # no request is left): the last is the count after the all-at-once client, since the server started
  grep -s "fused commits so far" $LOG | tail -3
  grep -sh "Mean denoising steps\|num_speculative\|canvas_length" $LOG | tail -4
  el end; exit 0
fi

quant=${2:-fp8}; attn=${3:-triton}
sync_flag=--no-async-scheduling
case $variant in
  fused)  canvas=512; fuse=1 ;;
  fused_async) canvas=512; fuse=1; sync_flag= ;;
  layout) canvas=512; fuse=0 ;;
  sync)   canvas=256; fuse=0 ;;
  *) echo "variant must be parity, parity_async, fused, fused_async, layout or sync, got $variant"; exit 2 ;;
esac
case $quant in fp8|bf16) ;; *) echo "quant must be fp8 or bf16"; exit 2 ;; esac
case $attn in triton|cute) ;; *) echo "attention must be triton or cute"; exit 2 ;; esac
if [ "$fuse" = 0 ] && [ -n "$policy" ]; then echo "FUSE_POLICY=$policy ignored: $variant fuses nothing"; policy=; psfx=; fi
BUDGET=${BUDGET_S:-570}
export OUT=${OUT:-/tmp/serve_bench/out}/$variant$psfx; mkdir -p $OUT
export SERVE_BENCH_DIR=${SERVE_BENCH_DIR:-/tmp/serve_bench} BD_SEQS=${SEQS:-64} BD_KV_GIB=${KV_GIB:-40} \
  BD_UTIL=${UTIL:-0.9} ASYNC=$([ -n "$sync_flag" ] && echo 0 || echo 1)
W=$SERVE_BENCH_DIR; MODEL=$W/dg26b; S=bench/experiments/device/serve_bench.sh; BS="python3 -m blockdiff.bench.bench_serve"
mkdir -p $W; [ -f $MODEL/config.json ] || $BS model $MODEL > $W/model.log 2>&1 || { cat $W/model.log; exit 1; }
set -- $(bash $S info $quant $attn blockdiff); backend=$1; port=$2; seqs=$3; kv=$4; util=$5; name=$backend-$quant
if [ -f $W/$name.pid ] && kill -0 $(cat $W/$name.pid) 2>/dev/null; then
  echo "$name already running (pid $(cat $W/$name.pid)): stop it first (serve_bench.sh stop)"; exit 2; fi
# the benchmark's command (bench_serve.server_command; synchronous unless fused_async), then this variant's diffusion
# config and switch
cmd=$($BS server-cmd --backend $backend --quant $quant --model $MODEL --port $port --max-num-seqs $seqs \
      --kv-cache-gib $kv --gpu-memory-utilization $util --trace-dir $W/trace_$name $sync_flag \
      --load-format ${LOAD_FORMAT:-dummy}) || exit 1
cmd=$(python3 -c "
import shlex, sys, json
argv = shlex.split(sys.argv[1]); i = argv.index('--diffusion-config') + 1
argv[i] = json.dumps({**json.loads(argv[i]), 'canvas_length': $canvas}, separators=(',', ':'))
if $fuse: argv.insert(1, 'BLOCKDIFF_FUSE_COMMIT=1')  # after 'env'
if $fuse and sys.argv[2]: argv.insert(2, 'BLOCKDIFF_FUSE_POLICY=' + sys.argv[2])
print(shlex.join(argv))" "$cmd" "$policy") || exit 1
[ "${DRY:-0}" = 1 ] && { echo "$cmd"; exit 0; }
echo "$cmd" > $W/$name.cmd; echo $seqs > $W/$name.seqs; echo "$variant${policy:+ (fuse policy $policy)}" > $OUT/variant
rm -rf $W/trace_$name
setsid bash -c "echo \$\$ > $W/$name.pid; exec $cmd" > $W/$name.log 2>&1 < /dev/null &
sleep 1; el "started $name ($variant: canvas_length $canvas, fuse $fuse${policy:+, policy $policy}; pid $(cat $W/$name.pid), port $port)"
WAIT_S=${WAIT_S:-330} bash $S wait $quant $attn blockdiff || { el "not healthy"; bash $S stop; exit 1; }
el healthy
INTERLEAVE=1 TOTAL_S=$(( BUDGET - ($(date +%s) - T0) - 20 )) bash $S bench $quant $attn blockdiff
grep -hE "fused commits|num_speculative_tokens|Traceback" $W/$name.log | grep -v "ulimit\|fused commits so far" | tail -5
grep -h "fused commits so far" $W/$name.log | tail -2  # the coverage lines (FusedCommitCounts), the last sweep's
bash $S stop
el end
