# Issue 25's stretch A/B in one command (docs/tuning.md 7.52): the unfused asynchronous server, then the fused one
# (serve_fused.sh fused_async), each alone on the GPU, same sizes, one after the other. Run after staging (stagev.sh;
# the CuTe DSL for cute):
#
#   BLOCKDIFF_COMMIT=<hash> LOAD_FORMAT=dummy_live bash bench/experiments/device/serve_fused_ab.sh [fp8|bf16] [triton|cute]
#
# Sizes: SEQS (16), KV_GIB (16), UTIL (0.92): an H100 fits the FP8 26B geometry there (7.52: 58.7 GB unfused, 65.7 GB
# fused). CONC (1,4). Results under $OUT/unfused and $OUT/fused_async (serve_rows_<quant>.jsonl, the server logs).
# Budgets (start + warm-ups + sweep, each server): BUDGET_S (300) for the unfused one, which starts first and compiles
# (7.52: healthy after 174-183 s, then 98 s of warm-ups and the c1 / c4 sweep), BUDGET2_S (200) for the fused one,
# which reuses the compile cache (healthy after 62-81 s): ~520 s in all, inside the run tool's 600 s. The uniform
# policy does not fit beside them: run `FUSE_POLICY=uniform serve_fused.sh fused_async` as a next command.
# Before each server: every server of serve_bench.sh stopped, any small parity server (`serve /tmp/exp`, which
# serve_fused.sh's parity variants leave up) killed, and a wait (<= 120 s) until the GPU holds < 2,000 MiB: in 7.52 a
# parity server left up held 3.5 GiB and two such waits ran out their 120 s.
# PHASES (unfused,fused_async): which servers this call runs, in that order. Under LOAD_FORMAT=dummy_live the two do
# not fit one call (2026-12-06, H100, ce257ef: the unfused server was healthy after 212 s on a cold machine, its
# warm-up took 52 s, and the sweep's c1 was skipped at its 300 s budget): run PHASES=unfused, then PHASES=fused_async
# as the next call on the same machine (the compile cache stays; the second call stops the first's server). A phase
# run alone gets a 570 s budget unless BUDGET_S / BUDGET2_S say otherwise.
# DRY=1: print the plan (the three commands) and exit (CPU check).
set -u
quant=${1:-fp8}; attn=${2:-cute}
case $quant in fp8|bf16) ;; *) echo "quant must be fp8 or bf16"; exit 2 ;; esac
case $attn in triton|cute) ;; *) echo "attention must be triton or cute"; exit 2 ;; esac
export SEQS=${SEQS:-16} KV_GIB=${KV_GIB:-16} UTIL=${UTIL:-0.92} CONC=${CONC:-1,4} LOAD_FORMAT=${LOAD_FORMAT:-dummy}
PHASES=${PHASES:-unfused,fused_async}
case $PHASES in unfused,fused_async) b1=300; b2=200 ;; unfused|fused_async) b1=570; b2=570 ;;
  *) echo "PHASES must be unfused,fused_async, unfused or fused_async, got $PHASES"; exit 2 ;; esac
B=${BUDGET_S:-$b1}; B2=${BUDGET2_S:-$b2}; D=bench/experiments/device; O=${OUT:-/tmp/serve_bench/out}
free_gpu() {
  bash $D/serve_bench.sh stop > /dev/null 2>&1
  pkill -f "serve /tmp/exp" 2>/dev/null
  local m=0
  for _ in $(seq 60); do
    m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    [ -n "$m" ] && [ "$m" -lt 2000 ] && break; sleep 2
  done
  echo "GPU memory before the next server: ${m:-?} MiB"
}
run() {  # label, command...
  local label=$1; shift
  if [ "${DRY:-0}" = 1 ]; then echo "$label: $*"; return 0; fi
  free_gpu; echo "== $label (load format $LOAD_FORMAT, $SEQS seqs, $KV_GIB GiB KV, CONC $CONC)"
  "$@" 2>&1 | grep -E "ok:|healthy|not healthy|start failed|so far|Traceback" | tail -12
}
case ,$PHASES, in *,unfused,*) run unfused env OUT=$O/unfused KEEP=1 BUDGET_S=$B bash $D/serve_alone.sh blockdiff $quant $attn ;; esac
case ,$PHASES, in *,fused_async,*) run fused_async env OUT=$O BUDGET_S=$B2 bash $D/serve_fused.sh fused_async $quant $attn ;; esac
[ "${DRY:-0}" = 1 ] || free_gpu
exit 0
