# The triton backend's exact key weight (2026-12-07, tuning 7.63) on a Hopper, one command (~5-6 min), sourced from
# the repo root after a fresh start (no staging: the triton backend only):
#  1. the compiled regressions: the very-negative-scores batch (scores ~-2e31, NaN rows before: the one-FMA weight
#     exp2(fma(s, c, -round(max * c)))) in the portable kernel (BLOCKDIFF_TEST_CUDA=1, LAZY_RESCALE on / off, 1 / 3
#     splits, fp32 / bf16, scale 0 / -0.7), break29a's tiny scale (+-1e-38, raw scores near +-3e38: the general
#     path below |scale * log2(e)| = 2**-120), the Gluon kernels' GPU twin, the contract case for triton, the probe;
#  2. the cost of the exact weight (exp2((s - m) * c): a subtraction then a multiply, one FP32 op per score more than
#     the FFMA): bench_attention's triton rows, the attention package of 9e1e22d (carried as .device/ab_old/attention:
#     git archive 9e1e22d attention) against the head, alternated old/new twice in one run. Expected: <= 2 % slower
#     where the softmax limits (hd 128 / 256 canvases and sliding), no change at hd 512 (mixed_global_ctx8k).
#   BLOCKDIFF_COMMIT=<hash> source bench/experiments/device/ab_exact_weight.sh   # carrying .device/ab_old, .device/probe
# Worst case (every timeout) is 770 s, past the run tool's 600 s; the H100 run took 199 s (tuning 7.63).
# Under $OUT: tests.log, probe.log, ab_<side><round>.log and the records under ab/.
source bench/device_env.sh
BLOCKDIFF_TEST_CUDA=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/attention/triton/test_triton_portable.py -k "minus_1e30 or zero_and_negative_scale or lazy_rescaling_matches or tiny_scale" \
  tests/attention/test_backends_contract.py::test_scores_near_2e31_in_magnitude_give_the_one_hot_softmax_not_nan \
  > $OUT/tests.log 2>&1
echo "compiled regressions rc=$?"; tail -3 $OUT/tests.log
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/attention/triton/test_triton_gluon.py \
  -k "minus_1e30" >> $OUT/tests.log 2>&1
echo "gluon twin rc=$?"; tail -2 $OUT/tests.log
timeout 60 python3 .device/probe/lazy_probe.py > $OUT/probe.log 2>&1; echo "probe rc=$?"; cat $OUT/probe.log | tail -8
W=canvas_bs1_ctx32k_hd128,canvas_bs4_ctx4k_hd128,canvas_bs1_ctx32k_sliding,mixed_sliding_ctx8k,mixed_global_ctx8k T=110 source bench/experiments/device/ab_triton.sh
