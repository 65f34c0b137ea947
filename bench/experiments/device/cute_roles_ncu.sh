# Issue 27: what bounds the cute roles kernel (docs/tuning.md 2.9: 430 TFLOP/s on mixed_global_ctx8k against
# 2.8's predicted 520-600; no profile yet). After the CuTe DSL's staging (p1; this can be the p2 run with STAGE2=1),
# one command, ~4 min: Nsight Compute's full set with source correlation (CUTE_DSL_LINEINFO=1, a fresh compile)
# of one launch each of the roles kernel and of the default split-value kernel on mixed_global_ctx8k, then each
# report's details and source pages as text: warp stall reasons by source line of the softmax and P V
# warpgroups, pipe utilisation, shared-memory and L2 throughput. ncu leaves the clocks alone (METHOD.md).
#   [STAGE2=1] [CASES=roles,split_v] [WORKLOAD=mixed_global_ctx8k] bash bench/experiments/device/cute_roles_ncu.sh
# (WORKLOAD=canvas_bs1_ctx32k_global: the split canvas, docs/tuning.md 7.33; the kernel regex then also matches the
# split-KV subclass, and --launch-skip 2 skips the warm-up launches as before)
# Writes $OUT/ncu_roles.ncu-rep, $OUT/ncu_split_v.ncu-rep and per kernel ncu_<name>_text.tar.gz: the details page,
# the source page as CSV (SASS alone, and with the Python lines), and the bench's own log.
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
command -v ncu > /dev/null || { echo "no ncu on this machine"; exit 3; }
export CUTE_DSL_LINEINFO=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0  # line info needs a compile, not a cached cubin
one() {  # $1 name, $2 kernel-name regex, $3 cute config JSON list
  timeout ${NCU_S:-110} ncu --clock-control none --set full --import-source yes --kernel-name "regex:$2" \
    --launch-skip 2 --launch-count 1 --target-processes all -f -o $OUT/ncu_$1 \
    python3 -m blockdiff.bench.bench_attention --backends cute --workloads ${WORKLOAD:-mixed_global_ctx8k} --no-graph --no-plots \
      --cute-configs "$3" --suite-name ncu_$1 --out /tmp/ncu_bench_$1 > $OUT/ncu_$1.log 2>&1 < /dev/null
  echo "== $1: exit $?"; tail -3 $OUT/ncu_$1.log
  if [ -f $OUT/ncu_$1.ncu-rep ]; then
    ncu --import $OUT/ncu_$1.ncu-rep --page details > $OUT/ncu_$1_details.txt 2>&1
    ncu --import $OUT/ncu_$1.ncu-rep --page source --csv --print-source sass > $OUT/ncu_$1_sass.csv 2>&1
    # the Python lines of the CuTe DSL source beside the SASS (line info); kept apart in case this ncu lacks the mode
    ncu --import $OUT/ncu_$1.ncu-rep --page source --csv --print-source cuda,sass > $OUT/ncu_$1_source.csv 2>&1
    # docs/tuning.md 2.11: is the K / V traffic into the SMs (~6.8 TB/s at 430 TFLOP/s) at the L2's ceiling?
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L2 Hit Rate|DRAM Throughput|L1/TEX Cache Throughput|Registers Per|Achieved Occ" \
      $OUT/ncu_$1_details.txt | head -16
  fi
  # at most 8 files come back from a run: the text of each kernel in one archive
  (cd $OUT && tar -czf ncu_$1_text.tar.gz ncu_$1.log ncu_$1_*.txt ncu_$1_*.csv 2>/dev/null \
    && rm -f ncu_$1.log ncu_$1_*.txt ncu_$1_*.csv)
}
# CASES (comma-separated, default roles,split_v): which launches to profile. roles / roles_work: 2.17's roles kernel
# (one-warp V refill, S serial) in the given / work order; halves_work: with the V refill by halves, S serial
# (docs/tuning.md 2.17: halves measured 4 % slower than its prediction of +9 %); default: the default dispatch at
# hd 512 since 2.20 (roles, work order, halves, S issued ahead).
P1='"v_refill": "one_warp", "qk_issue": "serial"'
for c in $(echo ${CASES:-roles,split_v} | tr , ' '); do
  case $c in
    roles) one roles 'FlashAttentionForwardSm90Roles' "[{\"wide_design\": \"roles\", \"batch_order\": \"given\", $P1}]" ;;
    split_v) one split_v 'FlashAttentionForwardSm90WideV' '[{"wide_design": "split_v"}]' ;;
    roles_work) one roles_work 'FlashAttentionForwardSm90Roles' \
      "[{\"wide_design\": \"roles\", \"batch_order\": \"work\", $P1}]" ;;
    halves_work) one halves_work 'FlashAttentionForwardSm90Roles' \
      '[{"wide_design": "roles", "batch_order": "work", "v_refill": "halves", "qk_issue": "serial"}]' ;;
    default) one default 'FlashAttentionForwardSm90Roles' '[{}]' ;;
    *) echo "unknown case $c"; exit 2 ;;
  esac
done
