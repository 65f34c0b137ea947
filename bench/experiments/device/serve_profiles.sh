# Issue 25's batched profiles (docs/tuning.md 7.7 step 1): one side alone on the GPU as serve_alone.sh sizes it
# (64 seqs, 40 GiB of KV), then the profile of a load of R requests at once for each R in REQS (default 16,64),
# each kept as serve_profile_<side>_<quant>_r<R>.json under $OUT, then stop; everything within BUDGET_S (570).
# Each profiled load follows an unprofiled load of the same size (PROFILE_WARM, serve_bench.sh), so first-use JIT
# compiles of its batch shapes stay out of the trace (docs/tuning.md 7.10). KEEP=1 leaves the server up for a next
# command (serve_bench.sh bench / stop).
# They measure how attention, sampler, MoE, GEMMs and the rest of a canvas step grow with the batch, which 7.4's
# 2x floor assumed alike.
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/serve_profiles.sh vllm [fp8|bf16]
#   BLOCKDIFF_COMMIT=<hash> bash bench/experiments/device/serve_profiles.sh blockdiff [fp8|bf16] [triton|cute]
set -u
source bench/experiments/device/alone_up.sh
name=$side; [ $side = blockdiff ] && name=blockdiff-$attn
for r in $(echo ${REQS:-16,64} | tr , ' '); do
  left=$(( BUDGET - ($(date +%s) - T0) - 20 )); [ $left -lt 60 ] && { el "budget left $left s: R=$r skipped"; continue; }
  # the budget goes down to serve_bench.sh's own timeout (a second timeout around it would orphan the inner one)
  PROFILE_REQUESTS=$r PROFILE_TIMEOUT_S=$left bash $S profile $quant $attn $side
  f=$OUT/serve_profile_${name}_$quant.json
  if [ -f $f ]; then mv $f $OUT/serve_profile_${name}_${quant}_r$r.json; el "profile R=$r done"; else el "profile R=$r missing"; fi
done
[ "${KEEP:-0}" = 1 ] && el "server kept (KEEP=1)" || bash $S stop
el end
