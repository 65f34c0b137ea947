# Make vLLM 0.33.0's Python interface importable on a CPU-only machine, for the vLLM-gated tests of
# tests/integration (conformance with the real ModelState, plugin registration, scheduler types):
#
#     source tests/integration/vllm_cpu_env.sh [DIR]     # default DIR /tmp/vllm-cpu; ~350 MB, once
#     python3 -m pytest tests/integration
#
# `pip install vllm==0.33.0` cannot run here: it pins a CUDA torch 2.14.0 (this project tests with the CPU build
# of torch 2.13.0). Installing the wheel and the pure-Python packages its interface imports with --no-deps into
# a separate folder leaves the environment's torch alone; vllm._C (CUDA ops) is absent, which vLLM only logs.
# CI does not do this (a 336 MB download per run): there the vLLM-gated tests skip.
_vdir=${1:-/tmp/vllm-cpu}
if [ ! -d "$_vdir/vllm" ]; then
  pip install -q --no-deps --target "$_vdir" vllm==0.33.0 aiohappyeyeballs aiohttp aiosignal apache-tvm-ffi \
    cachetools cbor2 einops fastapi frozenlist llguidance msgspec multidict openai openai-harmony \
    opentelemetry-api opentelemetry-sdk partial-json-parser prometheus-client propcache psutil pybase64 \
    starlette uvloop xgrammar yarl || { echo "vllm_cpu_env.sh: pip install into $_vdir failed" >&2; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH=$_vdir${PYTHONPATH:+:$PYTHONPATH}
unset _vdir
