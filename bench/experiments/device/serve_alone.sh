# Issue 25 on the H200, one side alone on the GPU per command (after stagev.sh; the CuTe DSL staged too for cute):
# each side at the largest --max-num-seqs the sweep needs (64, the top concurrency) with the whole GPU's memory, as
# the issue asks ("each side at the largest --max-num-seqs it serves without running out of memory"); 2026-12-02's
# run shared the GPU between both servers (blockdiff 32 seqs / 16 GiB KV, stock 16 / 8), which capped both.
#
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/serve_alone.sh blockdiff [fp8|bf16] [triton|cute]
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/serve_alone.sh vllm [fp8|bf16]
#
# One command each (~8-10 min): start, wait until healthy, the sweep (CONC, default 1,4,16,64; warm-up first), a
# one-request profile, stop; everything within BUDGET_S (default 570). Rows and the profile under $OUT
# (serve_rows_<quant>.jsonl, serve_profile_<side>_<quant>.json, the server's log tail). Sizes (GiB; serve_bench.sh has
# the arithmetic): fp8 weights ~26 + ~4 + KV 40 + logits 64 x 0.375 = 24 (+ vLLM's 15.75 GiB fp32 warm-up logits
# buffer on blockdiff's side; stock's sampler tiles take what is left) -> well inside 139.8. Overrides: SEQS, KV_GIB,
# UTIL; PROFILE_S (seconds kept for the profile, 100); KEEP=1: the sweep only, the server left up for a next command
# (e.g. a 64-request profile, `PROFILE_REQUESTS=64 bash serve_bench.sh profile ...; bash serve_bench.sh stop`).
set -u
source bench/experiments/device/alone_up.sh
[ "${KEEP:-0}" = 1 ] && PROFILE_S=10  # KEEP=1: the sweep only; the server stays up for the next command
INTERLEAVE=1 TOTAL_S=$(( BUDGET - ($(date +%s) - T0) - ${PROFILE_S:-100} )) bash $S bench $quant $attn $side
el "bench done"
if [ "${KEEP:-0}" = 1 ]; then el "server kept (KEEP=1): serve_bench.sh profile / stop next"; exit 0; fi
PROFILE_TIMEOUT_S=$(( BUDGET - ($(date +%s) - T0) - 15 )) bash $S profile $quant $attn $side  # one timeout, inside
bash $S stop
el end
