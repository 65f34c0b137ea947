#!/usr/bin/env bash
# Regenerate the benchmark records on the H200, from the repository root:
#     bash bench/run_all.sh                 # every stage below, in order
#     bash bench/run_all.sh attention e2e   # chosen stages
# Stages: attention (= attention-mixed + attention-single: the named workloads, all backends, in two runs that
# each fit the lent machine's 10-minute limit), sweep (Triton tile configs), ladders (batch and context ladders
# = ladder-batch + ladder-ctx for the sliding and hd-128 layers, ladder-global for the hd-512 layers),
# sampler (bench_sampler.py), e2e (bench_e2e.py), tables (bench/README.md from the records).
# Results go to $OUT when set, else bench/results/, written after every workload; each attention run stops
# starting workloads after $BUDGET_S seconds (default 540; the rest are recorded as skipped). A failing stage is
# reported and the next one runs.
# For FA4 / CuTe, make flash_attn.cute importable first (staged on the GPU machine), e.g. by exporting
# PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages before calling this script.
# On the lent machine (600 s a command, at most 8 files back from $OUT): one expanded stage a command (attention,
# ladders, the default "all" and any two stages together run past 600 s; ladder-global is two runs of BUDGET_S each:
# give it BUDGET_S=250). When a command leaves more than 8 files under $OUT, its PNGs are packed into plots.tgz (the
# ladders write one PNG a workload: 14-20 files). (2026-12-05 audit.)
set -u
cd "$(dirname "$0")/.."
source bench/device_env.sh
export BLOCKDIFF_COMMIT=${BLOCKDIFF_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
RESULTS=${OUT:-bench/results}
SWEEP_WORKLOADS=${SWEEP_WORKLOADS:-mixed_sliding_ctx8k,mixed_global_ctx8k,canvas_bs1_ctx32k_hd128,prefill16k_hd128}
stages=${*:-attention sweep ladders sampler e2e tables}
expanded=""
for s in $stages; do
  case $s in
    attention) expanded="$expanded attention-mixed attention-single" ;;
    ladders)   expanded="$expanded ladder-batch ladder-ctx ladder-global" ;;
    *)         expanded="$expanded $s" ;;
  esac
done
stages=$expanded
BA="python3 -m blockdiff.bench.bench_attention --budget-s ${BUDGET_S:-540}"
status=0
for stage in $stages; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    attention-mixed)  $BA --workloads 'mixed_*' --suite-name attention-mixed ;;
    attention-single) $BA --workloads 'canvas_*,prefill*' --suite-name attention-single ;;
    sweep)     $BA --backends triton --tile-sweep --workloads "$SWEEP_WORKLOADS" --suite-name attention-tile-sweep \
                 --no-plots ;;
    ladder-batch) $BA --suite batch_ladder --workloads '*sliding,*hd128' --backends sdpa,fa4,triton,cute \
                    --fa4-layouts paged ;;
    ladder-ctx)   $BA --suite ctx_ladder --workloads '*sliding,*hd128' --backends sdpa,fa4,triton,cute \
                    --fa4-layouts paged ;;
    ladder-global)  # hd 512 global layers: FA4 cannot run them (head dim <= 256); cute runs its roles kernel
      # (the hd-512 default, docs/tuning.md 2.17-2.23), last in each workload; FlexAttention with its BlockMask build
      $BA --suite batch_ladder --workloads '*global' --backends sdpa,flex,triton,cute \
        --suite-name attention-batch_ladder_global
      $BA --suite ctx_ladder --workloads '*global' --backends sdpa,flex,triton,cute \
        --suite-name attention-ctx_ladder_global ;;
    sampler)   python3 -m blockdiff.bench.bench_sampler ;;
    e2e)       python3 -m blockdiff.bench.bench_e2e --attn-backends triton,cute --sampler-backend triton ;;
    tables)    python3 -m blockdiff.bench.make_tables --results "$RESULTS" ;;
    *) echo "unknown stage $stage (attention[-mixed|-single] sweep ladders ladder-batch ladder-ctx ladder-global sampler e2e tables)"; status=2; continue ;;
  esac || { echo "stage $stage failed"; status=1; }
done
# at most 8 files come back from the lent machine's $OUT: the PNGs in one archive when there are more
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$(ls "$OUT" | wc -l)" -gt 8 ] && ls "$OUT"/*.png > /dev/null 2>&1; then
  (cd "$OUT" && tar czf plots.tgz *.png && rm -f *.png && echo "PNGs packed into $OUT/plots.tgz")
fi
exit $status
