# break28b on a Hopper (2026-12-07), one command (~6-7 min), sourced from the repo root after a fresh start (no
# staging: the triton backend only):
#  1. the triton attention GPU tests at the head (-m gpu, cute rows deselected: the CuTe DSL is not staged), and
#     break28b's CPU-suite rows compiled (BLOCKDIFF_TEST_CUDA=1: the lazy-rescale and wide-stride regressions);
#  2. the cost of the lazy rescale's new growth rule (7df050d: m_new - m_i, the -1e30 clamp gone) and of the int64
#     key-offset switch (89d681d, off for these layouts): bench_attention's triton rows on the sliding workloads
#     (the portable kernel's tuned hd-256 sliding config is the LAZY_RESCALE one) and two others, the attention
#     package of 213aae2 (carried as .device/ab_old/attention: git archive 213aae2 attention) against the head,
#     alternated old/new twice in one run. Expected: no change beyond noise (one fewer max per key block).
#   BLOCKDIFF_COMMIT=<hash> source bench/experiments/device/ab_lazy.sh      # carrying .device/ab_old
# Under $OUT: tests.log, contract.log, ab_<side><round>.log and the records under ab/.
source bench/device_env.sh
timeout 240 python3 -m pytest -m gpu tests/attention -k "not cute" -n 4 -q -p no:cacheprovider > $OUT/tests.log 2>&1
echo "gpu tests rc=$?"; tail -4 $OUT/tests.log
BLOCKDIFF_TEST_CUDA=1 timeout 90 python3 -m pytest tests/attention/triton/test_triton_portable.py \
  -k "lazy_rescaling or row_stride_past_int32" -q -p no:cacheprovider > $OUT/contract.log 2>&1
echo "compiled regressions rc=$?"; tail -3 $OUT/contract.log
W=canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k,mixed_sliding_prefix_ctx8k,canvas_bs1_ctx32k_hd128 T=100 source bench/experiments/device/ab_triton.sh
