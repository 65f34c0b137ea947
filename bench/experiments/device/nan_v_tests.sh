# Issue 26 on the lent H200 (after the CuTe DSL's two staging runs, ../shared/device/README.md): the GPU tests of
# the NaN / Inf V clean-up in both attention backends and of the sampler, three shards at once, each within T s
# (default 280); logs under $OUT.
#   cute: tests/attention/cute/test_cute_nan_safe_v.py (config nan_safe_v, off by default until these passed;
#   on by default since, docs/tuning.md 2.6);
#   triton: the whole Gluon file, where config["NAN_SAFE_V"] is now on by default;
#   sampler: tests/sampler -m gpu (the -inf-as-p = 0 change).
source bench/experiments/device/env.sh
t=${T:-280}
P="python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=5 -rf"
timeout $t $P tests/attention/cute/test_cute_nan_safe_v.py > $OUT/gpu_cute_nan.log 2>&1 &
timeout $t $P tests/attention/triton/test_triton_gluon.py > $OUT/gpu_gluon.log 2>&1 &
timeout $t $P tests/sampler > $OUT/gpu_sampler.log 2>&1 &
wait
for f in $OUT/gpu_*.log; do echo "== $f"; tail -6 $f; done
