# GPU-machine environment once vLLM 0.26.0 (and optionally the CuTe DSL) is staged into /tmp/site by the consecutive runs of stagev.sh.
# Sourced from the repo root. What the first H200 run (2026-12-01) needed beyond the staging notes:
#  - run vLLM as `python3 -m vllm.entrypoints.cli.main` (the staged bin/vllm has no __main__ guard, and the
#    engine core is started with spawn, which re-runs it: "start a new process before ... bootstrapping");
#  - VLLM_USE_FLASHINFER_SAMPLER=0 (model runner v2 imports flashinfer, which is not staged, otherwise);
#  - a dist-info with the vllm.general_plugins entry point, since blockdiff runs from the tree, not installed.
# sourced from the repo root on the GPU machine
source bench/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PATH=/tmp/site/bin:$PATH \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
  FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 VLLM_USE_DEEP_GEMM=0 VLLM_USE_FLASHINFER_SAMPLER=0
d=/tmp/site/blockdiff-0.1.0.dist-info
# blockdiff_bench: the serving benchmark's load format dummy_live (bench/dummy_weights.py)
eps='[vllm.general_plugins]
blockdiff = blockdiff.integration.vllm_plugin:register
blockdiff_bench = blockdiff.bench.dummy_weights:register'
if [ -d /tmp/site ] && [ "$(cat $d/entry_points.txt 2>/dev/null)" != "$eps" ]; then  # new, or an older plugin list
  mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: blockdiff\nVersion: 0.1.0\n' > $d/METADATA
  printf '%s\n' "$eps" > $d/entry_points.txt
fi
