# Sourced by serve_alone.sh and serve_profiles.sh with their arguments (SIDE [fp8|bf16] [triton|cute]): one side
# alone on the GPU at the sizes the issue asks for (64 seqs, 40 GiB of KV, the whole GPU's memory; overrides SEQS,
# KV_GIB, UTIL), started and healthy; defines side, quant, attn, S (serve_bench.sh), T0, BUDGET (BUDGET_S, default
# 570 s) and el (elapsed-time echo). Exits 2 on a bad side, 1 (server stopped) if it does not become healthy.
export OUT=${OUT:-${SERVE_BENCH_DIR:-/tmp/serve_bench}/out}; mkdir -p $OUT
side=${1:?side: blockdiff or vllm}; quant=${2:-fp8}; attn=${3:-triton}
case $side in blockdiff|vllm) ;; *) echo "side must be blockdiff or vllm"; exit 2 ;; esac
T0=$(date +%s); BUDGET=${BUDGET_S:-570}; el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=bench/experiments/device/serve_bench.sh
export BD_SEQS=${SEQS:-64} BD_KV_GIB=${KV_GIB:-40} BD_UTIL=${UTIL:-0.9} STOCK_SEQS=${SEQS:-64} \
  STOCK_KV_GIB=${KV_GIB:-40} STOCK_UTIL=${UTIL:-0.9}
bash $S start $quant $attn $side || { el "start failed"; bash $S stop; exit 1; }
WAIT_S=${WAIT_S:-330} bash $S wait $quant $attn $side || { el "not healthy"; bash $S stop; exit 1; }
el "healthy"
