# Issue 25 item 4 on the lent H200: stock vLLM 0.26 DiffusionGemma (TRITON_ATTN, its sampler) against vLLM +
# blockdiff (CUSTOM attention, blockdiff's sampler and scheduler), DiffusionGemma-26B-A4B geometry with random weights,
# 4096 prompt / 512 output tokens, canvas 256, 16 fixed denoising steps (blockdiff.bench.bench_serve has the setting).
# Run from the repo root after staging vLLM (stagev.sh), in phases, each one command (the machine goes back 30 s
# after a command ends, so start the next within 30 s; servers started with setsid live on between commands):
#
#   bash bench/experiments/device/serve_bench.sh start   [fp8|bf16] [triton|cute]  # both servers, returns at once
#   bash bench/experiments/device/serve_bench.sh wait    [fp8|bf16] [triton|cute]  # until both answer /health
#   bash bench/experiments/device/serve_bench.sh bench   [fp8|bf16] [triton|cute] [both|blockdiff|vllm]  # sweeps
#   bash bench/experiments/device/serve_bench.sh profile [fp8|bf16] [triton|cute] [both|blockdiff|vllm]
#   bash bench/experiments/device/serve_bench.sh stop                               # ends the servers started here
#   bash bench/experiments/device/serve_bench.sh status  [fp8|bf16] [triton|cute]   # health, pids, KV lines of the logs
#   bash bench/experiments/device/serve_bench.sh info    [fp8|bf16] [triton|cute] [sides]  # backend port seqs kv util pidfile
#
# Defaults: fp8, triton, both. Outputs under $OUT (few files: at most 8 come back): serve_rows_<quant>.jsonl (the
# environment line, then one row per side and concurrency), serve_<side>_<quant>.log (each server's log tail),
# serve_profile_<side>_<quant>.json. Then, here: python3 -m blockdiff.bench.bench_serve record ROWS... --profile
# PROFILES... --out-dir bench/results (serve-<gpu>.json)
#
# Expected times: `start` ~15 s (model folder + launch). Each server then loads dummy weights (~10-30 s for 26B),
# torch.compiles the model (Dynamo + Inductor on a cold cache, both servers at once on 16 cores: ~2-4 min), captures
# CUDA graphs (~50 sizes up to 512 tokens, ~1 min) and, on blockdiff's side, JIT-compiles its Triton kernels: `wait`
# should see both healthy after ~4-7 min (it gives up at WAIT_S, 560 s; run it again if both are still starting).
# `bench`: per side first a warm-up (max-num-seqs one-canvas requests at once: every batch size compiles there,
# not in a timed run; the stock sampler's torch.compile runs there and in c1's warm-up request), then ~10-15 s per
# `vllm bench serve` start (imports) and ~2-40 s per concurrency (c64: 128 prompts); blockdiff first, then stock,
# each side's runs started within SIDE_S (250 s): expected ~2 min for blockdiff, ~3-4 min for stock. `profile`: ~1-2 min per side (2 requests, trace export, parse).
#
# Memory (GiB of the H200's ~139.8; vLLM's --kv-cache-memory-bytes fixes each KV cache, because two servers starting
# together would count each other's allocations in vLLM's memory profile; --gpu-memory-utilization then only sets
# the free memory each needs at start-up, its share):
#   weights, FP8: experts 30 x 128 x 3 x 704 x 2816 x 1 B = 21.3; other linears 1.67e9 params = 1.6; tied embedding
#     262144 x 2816 bf16 = 1.4  -> ~24.3, counted 26. BF16: ~47.
#   per server besides: CUDA context, cuBLAS workspace, compile / CUDA-graph pools, activations of a 16384-token step
#     (MoE caches [16384 x 8, 2816] bf16 ...) -> ~4.
#   logits of N canvases: LM head out [N*256, 262144] bf16 (N x 0.125) + softcapped fp32 (N x 0.25) = N x 0.375.
#   sampler: stock's compiled step keeps ~10 fp32 [256, 262144] per request of a tile = 2.5 per request, tiles sized to
#     half the free memory (so it takes what is left, at least one request = 2.5); blockdiff's fused step ~0.011 per
#     canvas (45 MB at 4, bench/results/sampler-h200.json).
#   KV per request (4608 tokens; vLLM 0.26's kv_cache_utils on these layer specs, run on a CPU: 6 groups of 5 layers,
#     640 KiB per block; its hybrid KV manager keeps only the window of the 25 sliding layers: 5 groups x ~81 blocks
#     of 16 tokens, the 5 full layers 144 blocks of 32) 549 blocks = 0.34; 1408 blocks = 0.86 during its prefill
#     step, while all 4096 prompt tokens sit in the sliding layers (16384-token steps hold 4 prompts). vLLM's start-up
#     line "Maximum concurrency for 8,192 tokens per request" assumes 8192-token requests and a whole 16384-token step
#     in every window: 4.65x for 8 GiB, 16.3x for 28 GiB; 4608-token requests fit ~23 and ~80.
#   Measured (H200, 2026-12-02, docs/tuning.md 7.2): at 64 seqs blockdiff's server ran out of memory in vLLM's
#     warm-up (a [16384, 262144] fp32 logits buffer, 15.75 GiB, with 80.75 GiB in use: 66.7 allocated, 13.1
#     reserved-unallocated) beside stock's 50.5 GiB: the default is now 32 seqs with 16 GiB of KV, and both servers
#     run with expandable segments. The estimate below for 64 seqs was ~15 GiB short.
#   FP8: blockdiff 64 seqs: 26 + 4 + KV 28 (64 x 0.35 + 4 x 0.5 prefill, 2.5 spare) + 64 x 0.375 + 0.7 = 82.7;
#        stock 16 seqs: 26 + 4 + KV 8 (16 x 0.35 + 2.4 spare) + 16 x 0.375 + 2.5 = 46.5   -> 129 of 139.8, the rest
#        for stock's sampler tiles (it sizes them to what is free). Stock at 64 seqs would need 26 + 4 + 24 + 24 + 2.5
#        = 80.5 beside blockdiff's 82.7: no. Stock's published recipe caps at 4 (its sampler without tiling needed 10
#        fp32 [canvas, vocab] per request: 4 x 256 x 262144 x 4 x 10 B = 10.7 GB); 0.26 tiles, so 16 fits here.
#   BF16: blockdiff 16 seqs: 47 + 4 + KV 8 + 6 + 0.2 = 65.2; stock 4 seqs: 47 + 4 + KV 3 + 1.5 + 2.5 = 58 -> 123.
#   Sweep order: blockdiff first (fixed transients, kept by its caching allocator), then stock (tiles to what is free).
#   Overrides: BD_SEQS, BD_KV_GIB, BD_UTIL, STOCK_SEQS, STOCK_KV_GIB, STOCK_UTIL.
# blockdiff-cute (second argument cute): BLOCKDIFF_ATTN_BACKEND=cute serves every layer since head size 512 runs its
#   split-value kernel (integration/vllm_attention.py MAX_HEAD_SIZE, 2026-12-02; served on the H200 in the fifth
#   lease, docs/tuning.md 7.6); it runs on port +4 in place of blockdiff-triton.
# Both sides run vLLM's asynchronous scheduling (its default; blockdiff's BlockdiffDiffusionAsyncScheduler), pages of
#   64 tokens and CUDA graphs for every canvas count (bench_serve.server_command).
# PROFILE_REQUESTS: requests of the profiled load (default 1: the concurrency-1 goal's step; 2026-12-02 profiled 2).
#   PROFILE_WARM: requests of the unprofiled warm-up load sent just before it (default PROFILE_REQUESTS, 0: none;
#   7.10's cold profile traced first-use JIT compiles); PROFILE_TIMEOUT_S: both loads and the trace export, a side
#   (400; 280 with both sides, so the two fit one 600-s command: 2026-12-05 audit, 2 x 400 did not).
# API_SERVERS=N: vLLM's --api-server-count N on the servers started (docs/tuning.md 7.12).
# LOAD_FORMAT: dummy (default, the setting) or dummy_live (bench/dummy_weights.py: every layer_scalar at 1.0,
#   so the MoE routing spreads as a checkpoint's; docs/tuning.md 7.21): the servers started and the rows / profiles
#   recorded (sweep / profile check it against a running server's command line; stop the servers to change it).
# Other switches: ENFORCE_EAGER=1 (both servers without CUDA graphs / compile), ASYNC=0 (both with
#   --no-async-scheduling), WAIT_S, SIDE_S, CONC (default 1,4,16,64), INTERLEAVE=1 (bench: one concurrency at a
#   time on both sides, the whole phase within TOTAL_S, default 400 s).
# CPU dry runs (tests/bench/experiments/test_serve_bench_sh.py): SERVE_BENCH_ENV=0 (do not source env.sh),
#   SERVE_BENCH_DIR (work folder, default /tmp/serve_bench), PORT0 (first port), BENCH_CMD (stand-in client),
#   SERVER_CMD (stand-in server, run as `$SERVER_CMD PORT TRACE_DIR`; `start` skips the model folder then).
set -u
[ "${SERVE_BENCH_ENV:-1}" = 1 ] && source bench/experiments/device/env.sh
phase=${1:-status}; quant=${2:-fp8}; attn=${3:-triton}; sides=${4:-both}
case $quant in fp8|bf16) ;; *) echo "quant must be fp8 or bf16, got $quant"; exit 2 ;; esac
case $attn in triton|cute) ;; *) echo "attention must be triton or cute, got $attn"; exit 2 ;; esac
case $sides in both|blockdiff|vllm) ;; *) echo "sides must be both, blockdiff or vllm, got $sides"; exit 2 ;; esac
W=${SERVE_BENCH_DIR:-/tmp/serve_bench}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
MODEL=$W/dg26b; BS="python3 -m blockdiff.bench.bench_serve"; LF=(--load-format ${LOAD_FORMAT:-dummy})
if [ $quant = fp8 ]; then
  BD_SEQS=${BD_SEQS:-32} BD_KV_GIB=${BD_KV_GIB:-16} BD_UTIL=${BD_UTIL:-0.55} STOCK_SEQS=${STOCK_SEQS:-16}
  STOCK_KV_GIB=${STOCK_KV_GIB:-8} STOCK_UTIL=${STOCK_UTIL:-0.35} PORT0=${PORT0:-8041}
else
  BD_SEQS=${BD_SEQS:-16} BD_KV_GIB=${BD_KV_GIB:-8} BD_UTIL=${BD_UTIL:-0.47} STOCK_SEQS=${STOCK_SEQS:-4}
  STOCK_KV_GIB=${STOCK_KV_GIB:-3} STOCK_UTIL=${STOCK_UTIL:-0.42} PORT0=${PORT0:-8043}
fi
BD=blockdiff-$attn; BC=(); [ -n "${BENCH_CMD:-}" ] && BC=(--bench-cmd "$BENCH_CMD")
STOCK_PORT=$PORT0; BD_PORT=$((PORT0 + 1)); [ $attn = cute ] && BD_PORT=$((PORT0 + 5))
# side -> backend name, port, max-num-seqs, kv GiB, utilization; a running server's own max-num-seqs (written by
# `start` beside its pid) wins over this command's default, so a later command (KEEP=1's next bench or profile)
# need not repeat SEQS and its rows carry what the server runs (docs/tuning.md 7.26)
info() { local r; if [ $1 = vllm ]; then r=(vllm $STOCK_PORT $STOCK_SEQS $STOCK_KV_GIB $STOCK_UTIL); else
           r=($BD $BD_PORT $BD_SEQS $BD_KV_GIB $BD_UTIL); fi
         if alive ${r[0]}-$quant && [ -s $W/${r[0]}-$quant.seqs ]; then r[2]=$(cat $W/${r[0]}-$quant.seqs); fi
         echo "${r[@]}"; }
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=5)" 2>/dev/null; }
alive() { [ -f $W/$1.pid ] && kill -0 $(cat $W/$1.pid) 2>/dev/null; }
failed() { ! alive $1 || grep -qE "Engine core initialization failed|EngineCore failed|CUDA out of memory" \
             $W/$1.log 2>/dev/null; }
pidarg() { [ -f $W/$1.pid ] && echo "--server-pid $(cat $W/$1.pid)"; }
order() { case $sides in both) echo "$BD vllm" ;; blockdiff) echo $BD ;; vllm) echo vllm ;; esac; }
logtail() { for s in $(order); do if [ -f $W/$s-$quant.log ]; then
             tail -c 1500000 $W/$s-$quant.log > $OUT/serve_${s}_$quant.log; fi; done; }
KV_RE="KV cache size|Maximum concurrency|Available KV cache|reserved .* KV Cache|Model loading took|weights took"
KV_RE="$KV_RE|Graph capturing finished|init engine|Traceback|Error"
kvlines() { grep -hE "$KV_RE" $W/$1.log 2>/dev/null | grep -v ulimit | tail -${2:-8}; true; }

case $phase in
start)
  [ -n "${SERVER_CMD:-}" ] || [ -f $MODEL/config.json ] || $BS model $MODEL > $W/model.log 2>&1 \
    || { cat $W/model.log; exit 1; }
  for s in $(order); do
    set -- $(info $s); name=$s-$quant
    if alive $name; then echo "$name already running (pid $(cat $W/$name.pid))"; continue; fi
    extra=""; [ "${ENFORCE_EAGER:-0}" = 1 ] && extra="$extra --enforce-eager"
    [ "${ASYNC:-1}" = 0 ] && extra="$extra --no-async-scheduling"
    [ -n "${API_SERVERS:-}" ] && extra="$extra --api-server-count $API_SERVERS"
    if [ -n "${SERVER_CMD:-}" ]; then cmd="$SERVER_CMD $2 $W/trace_$name"  # a stand-in server (CPU tests)
    else cmd=$($BS server-cmd --backend $1 --quant $quant --model $MODEL --port $2 --max-num-seqs $3 --kv-cache-gib $4 \
          --gpu-memory-utilization $5 --trace-dir $W/trace_$name $extra "${LF[@]}") || exit 1; fi
    echo "$cmd" > $W/$name.cmd; echo $3 > $W/$name.seqs
    rm -rf $W/trace_$name
    # the inner shell writes its own pid, then becomes the server (exec): the pid of vllm serve, session leader
    setsid bash -c "echo \$\$ > $W/$name.pid; exec $cmd" > $W/$name.log 2>&1 < /dev/null &
    sleep 1; echo "started $name (pid $(cat $W/$name.pid), port $2, max-num-seqs $3, KV $4 GiB)"
  done ;;
wait)
  t0=$(date +%s); rc=0
  while :; do
    pending=""
    for s in $(order); do set -- $(info $s); up $2 || failed $s-$quant || pending="$pending $s"; done
    [ -z "$pending" ] && break
    [ $(( $(date +%s) - t0 )) -ge ${WAIT_S:-560} ] && { echo "still starting after ${WAIT_S:-560} s:$pending"; break; }
    sleep 5
  done
  for s in $(order); do set -- $(info $s)
    if up $2; then echo "== $s-$quant healthy ($(( $(date +%s) - t0 )) s into wait)"
    else echo "== $s-$quant NOT up"; rc=1; fi
    kvlines $s-$quant; done
  logtail; exit $rc ;;
bench)
  if [ "${INTERLEAVE:-0}" = 1 ]; then
    # one concurrency at a time, both sides (so a lease that ends early still holds same-run pairs); each side's
    # warm-up once, before its first run; prompts max(2C, 4) up to C = 16, C at 64; the whole phase within TOTAL_S
    t0=$(date +%s); warmed="${WARMED:-}"  # WARMED: sides already warmed by an earlier bench phase
    for c in $(echo ${CONC:-1,4,16,64} | tr , ' '); do
      for s in $(order); do
        set -- $(info $s); name=$s-$quant
        if ! up $2; then echo "== $name not healthy: skipped c$c"; continue; fi
        left=$(( ${TOTAL_S:-400} - ($(date +%s) - t0) )); [ $left -lt 25 ] && { echo "== out of time before $name c$c"; continue; }
        warm=0; case " $warmed " in *" $s "*) ;; *) warm=$3; warmed="$warmed $s" ;; esac
        k=2; [ $c -ge 64 ] && k=1
        timeout $left $BS sweep --base-url http://127.0.0.1:$2 --model $MODEL --backend $1 --quant $quant \
          --concurrency $c --max-num-seqs $3 $(pidarg $name) ${BC[@]+"${BC[@]}"} --warm-concurrency $warm \
          --num-prompts-per-concurrency $k --min-prompts 4 --deadline-s $(( left - 10 )) "${LF[@]}" \
          --rows $OUT/serve_rows_$quant.jsonl --work-dir $W/runs_$name 2>&1 | grep -vE "^\s*$" | tail -4
      done
    done
  else
  for s in $(order); do
    set -- $(info $s); name=$s-$quant
    if ! up $2; then echo "== $name not healthy: skipped"; kvlines $name 20; continue; fi
    timeout $(( ${SIDE_S:-250} + 20 )) $BS sweep --base-url http://127.0.0.1:$2 --model $MODEL --backend $1 \
      --quant $quant --concurrency ${CONC:-1,4,16,64} --max-num-seqs $3 $(pidarg $name) ${BC[@]+"${BC[@]}"} \
      --deadline-s ${SIDE_S:-250} "${LF[@]}" --rows $OUT/serve_rows_$quant.jsonl --work-dir $W/runs_$name 2>&1 | tail -30
  done
  fi
  logtail
  [ -s $OUT/serve_rows_$quant.jsonl ] && $BS record $OUT/serve_rows_$quant.jsonl --out-dir $W/record --force 2>&1 \
    | tail -20 ;;
profile)
  for s in $(order); do
    set -- $(info $s); name=$s-$quant
    if ! up $2; then echo "== $name not healthy: skipped"; continue; fi
    timeout ${PROFILE_TIMEOUT_S:-$([ $sides = both ] && echo 280 || echo 400)} $BS profile --base-url http://127.0.0.1:$2 --model $MODEL --backend $1 \
      --quant $quant --requests ${PROFILE_REQUESTS:-1} --warm-requests ${PROFILE_WARM:-${PROFILE_REQUESTS:-1}} \
      --trace-dir $W/trace_$name --work-dir $W/runs_$name --out $OUT/serve_profile_${s}_$quant.json $(pidarg $name) "${LF[@]}" \
      ${BC[@]+"${BC[@]}"} 2>&1 | tail -8
  done ;;
stop)
  for f in $W/*.pid; do [ -f $f ] || continue; p=$(cat $f)
    kill -- -$p 2>/dev/null && echo "stopped $(basename $f .pid) (pid $p)"; rm -f $f; done ;;
info)  # one line per side: backend port max-num-seqs kv-GiB utilization pid-file (device scripts read it)
  for s in $(order); do echo "$(info $s) $W/$s-$quant.pid"; done ;;
status)
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  for s in $(order); do set -- $(info $s); name=$s-$quant
    echo "== $name pid $(cat $W/$name.pid 2>/dev/null) alive $(alive $name && echo yes || echo no)" \
         "health $(up $2 && echo ok || echo no)"
    kvlines $name; done ;;
*) echo "phase must be start, wait, bench, profile, stop, status or info"; exit 2 ;;
esac
exit 0
