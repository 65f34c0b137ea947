# The roles kernel's fuzz with CuteConfig.k_refill="halves" (docs/tuning.md 7.36 item 1) on the lent H200, in one
# command after the CuTe DSL's first staging run (STAGE2=1 makes this the second, carrying .device/p2). Three
# parallel shards of at most T s each (default 300): the roles fuzz configs 0-3 and 4-6 with halves (each example
# also checks halves against whole bit for bit), and the two shapes the 23 bit-identity tests did not draw (hd 384
# GQA 4 with a window and a one-block tile; GQA 3 at page 32 without LSE). Logs under $OUT.
# Decision rule (written before the run): all pass -> k_refill "auto" becomes halves where the roles kernel runs.
# Since 127d9a5 ("auto" = halves) the fuzz's k_refill ids are k_auto / k_whole: the shards select "k_whole", whose
# examples run whole and check it bit for bit against auto = halves (2026-12-05 audit: "k_halves" selected nothing).
#   [STAGE2=1] [T=...] bash bench/experiments/device/cute_k_halves_fuzz.sh
set -u
[ "${STAGE2:-0}" = 1 ] && source bench/experiments/device/stage2.sh
source bench/experiments/device/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t=${T:-300}; R=tests/attention/cute/test_cute_kernel_roles.py; K=tests/attention/cute/test_cute_k_refill_halves.py
shard() {  # $1 log name, rest: pytest arguments
  local log=$1; shift
  timeout $t python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5 "$@" > /tmp/kf_$log.log 2>&1 < /dev/null
  echo "rc=$?" >> /tmp/kf_$log.log
}
rm -f /tmp/kf_*.log
shard f0123 $R $K -k "fuzz and k_whole and (config0 or config1 or config2 or config3)" &
shard f456 $R $K -k "fuzz and k_whole and (config4 or config5 or config6)" &
shard shapes $R $K -k "head_dim_384_gqa_4 or gqa_3_page_32_without_lse" &
wait
for f in /tmp/kf_*.log; do echo "== $f"; cat $f; done > $OUT/fuzz.log
for f in /tmp/kf_*.log; do
  echo "== $f"; grep -E "passed|failed|error|rc=" $f | tail -2; grep -E "^FAILED|Timeout|Falsifying" $f | head -5
done
