"""Serving benchmark: stock vLLM 0.26 DiffusionGemma against vLLM + blockdiff, driven by vLLM's own client.

Usage (the H200 after staging; ``bench/experiments/device/serve_bench.sh`` runs these in phases):

    python3 -m blockdiff.bench.bench_serve model /tmp/dg26b                      # the benchmark's model folder
    python3 -m blockdiff.bench.bench_serve server-cmd --backend vllm --quant fp8 --model /tmp/dg26b --port 8041 ...
    python3 -m blockdiff.bench.bench_serve sweep --base-url http://127.0.0.1:8041 --model /tmp/dg26b \\
        --backend vllm --quant fp8 --concurrency 1,4,16,64 --max-num-seqs 16 --server-pid PID --rows $OUT/rows.jsonl
    python3 -m blockdiff.bench.bench_serve profile --base-url ... --backend vllm --quant fp8 --trace-dir /tmp/tr_vllm
    python3 -m blockdiff.bench.bench_serve trace TRACE.json.gz --out P.json       # classify a saved trace again
    python3 -m blockdiff.bench.bench_serve record ROWS.jsonl... --profile P.json...  # bench/results/serve-<gpu>.json

The setting, the same on both sides (issue 25): DiffusionGemma-26B-A4B geometry with random weights (``vllm serve
FOLDER --load-format dummy``; the folder from ``model``: config, byte tokenizer padded to the vocabulary with
``<unused_N>`` tokens, no weights), canvas 256 and exactly 16 denoising steps per canvas, vLLM's ``random`` dataset
with 4096 prompt tokens and 512 output tokens (two canvases), EOS ignored. Both sides read the step cap from
``--diffusion-config {"canvas_length": 256, "max_denoising_steps": 16}`` (vLLM's ``DiffusionGemmaModelState`` and
blockdiff's ``DiffusionModelState`` take it before ``generation_config.json``, which says 16 too). Early
convergence is ruled out by ``stability_threshold`` = 16 in ``generation_config.json`` (both read it when they
build the sampler; no request sets a diffusion option: vLLM's sampler reads none per request, and ``vllm bench
serve``'s ``--extra-body`` carries no diffusion option): blockdiff converges early only after ``k`` + 1 = 17
identical argmax canvases, vLLM's compiled step only once its history holds ``k`` + 1 = 17 entries, and both hit
the cap of 16 first. ``diffusion_steps_per_canvas`` of every row is vLLM's own count (``/metrics`` before and after
the run, written by ``vllm bench serve``) and must be 16.

The client asks both sides for ``skip_special_tokens: false`` (:data:`SKIP_SPECIAL_TOKENS`; ``--skip-special-tokens``
gives vLLM's default, the rows before 2026-12-03's 7.19 of docs/tuning.md). With random weights the 26B geometry
commits ``<pad>`` only: vLLM's dummy loader sets every layer's ``layer_scalar`` buffer to the same ~-7e-4, the
residual underflows to zero by the 14th layer, every logit is 0 and the argmax is id 0. vLLM's incremental
detokenizer skips such a token without emitting text and re-decodes the growing window at every step (quadratic:
~0.3 s of the API server's one thread per 512-token request, against ~2 ms for text), which then bounds a served
load (docs/tuning.md 7.19). Kept, ``<pad>`` decodes to text at once, as a checkpoint's text does; both sides get the
same request.

Load format (``--load-format``, :data:`LOAD_FORMATS`): ``dummy`` (default, the issue's setting) or ``dummy_live``
(:mod:`blockdiff.bench.dummy_weights`: the same random draw with every layer's ``layer_scalar`` at 1.0, so the residual
survives the 30 layers, each step's MoE routing spreads over the experts across tokens and the logits differ by
position; with ``dummy`` at least half the MoE layers send every token to the same 8 experts, docs/tuning.md 7.21).
Both sides run the same format; rows record it (``load_format``) and goals never compare rows of two formats.

Subcommands:
  model       write the benchmark's model folder (:func:`write_model_folder`).
  server-cmd  print the ``vllm serve`` command line of one side (:func:`server_command`; what the device script runs).
  sweep       first a warm-up run (max-num-seqs requests at once, ``--warm-output-len`` tokens each, by default
              one canvas: the batch sizes the server will see compile here, not in a timed run; 512, the c64
              load's shape, was no faster and cost stock's side time: docs/tuning.md 7.13), then for
              each concurrency C: ``vllm bench serve``
              (``--max-concurrency C``, ``--num-prompts`` P = max(K * C, M), ``--num-warmups`` min(C, 4) first, a
              seed per C, ``--save-detailed``), its result JSON parsed into one row (:func:`row_from_result`)
              appended to ``--rows`` (JSON lines; the first line of a sweep is the environment record), while
              :class:`MemorySampler` reads the server's GPU memory.
  profile     first an unprofiled warm-up load (``--warm-requests``, default the profiled load's size, another seed:
              first-use JIT compiles of its batch shapes land there, docs/tuning.md 7.10), then vLLM's torch
              profiler (the server started with :func:`profiler_config`): ``/start_profile``, a short load
              (``--requests``, 2), ``/stop_profile``, then the trace's GPU kernel time per forward step and bucket
              (:func:`summarize_trace`).
  trace       the same classification of saved traces.
  record      rows + profiles -> ``serve-<gpu>.json`` (docs/ARCHITECTURE.md "Benchmark records"), a CSV and a PNG of
              output tokens/s against concurrency beside it, the issue's goals evaluated (:func:`evaluate_goals`).

Row fields: ``workload`` (``serve_c{C}_{quant}``), ``backend`` (``vllm`` | ``blockdiff-triton`` |
``blockdiff-cute``), ``quant``, ``concurrency``, ``max_num_seqs``, ``num_prompts``, ``completed``, ``failed``,
``errors`` (the first few), ``output_tokens`` / ``expected_output_tokens``, ``complete`` (every request answered in
full), ``output_tok_s``, ``total_tok_s``, ``request_throughput`` (req/s), ``duration_s``, ``ttft_ms`` (mean),
``ttft_median_ms``, ``ttft_p99_ms``, ``e2e_ms`` / ``e2e_median_ms`` (end-to-end latency per request),
``time_per_canvas_ms`` / ``time_per_canvas_median_ms``, ``diffusion_steps_per_canvas``, ``peak_memory_bytes``
(the server's processes, :class:`MemorySampler`), ``gpu_memory_used_peak_bytes`` (the whole GPU).

Time per canvas: per request, (end-to-end latency - TTFT) / (canvases - 1), with canvases = ceil(output tokens /
256): the time of each canvas after the first (whose time TTFT holds, with the queueing and the prefill). vLLM
streams a canvas's tokens in one chunk when it commits, so end-to-end latency - TTFT is the sum of the request's
inter-chunk latencies (``itls`` of the detailed result). Mean and median over the completed requests.

Sources: vLLM 0.26.0 ``vllm/benchmarks/serve.py`` (arguments, the result JSON and its diffusion metrics),
``vllm/benchmarks/datasets/datasets.py`` (``RandomDataset``), ``vllm/config/profiler.py`` and
``vllm/profiler/wrapper.py`` (the torch profiler, ``execute_context_*`` step annotations of
``vllm/v1/worker/gpu_worker.py``), ``vllm/model_executor/models/diffusion_gemma.py`` (the stock sampler).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Sequence

from blockdiff.bench import common
from blockdiff.bench.dummy_weights import DUMMY, DUMMY_LIVE, LOAD_FORMATS, PLUGIN as DUMMY_LIVE_PLUGIN
from blockdiff.bench.make_tables import finite, show_number

SUITE = "serve"
CANVAS_LENGTH = 256
DENOISING_STEPS = 16
INPUT_LEN = 4096
OUTPUT_LEN = 512
MAX_MODEL_LEN = 8192
GEOMETRY = "diffusiongemma-26b-a4b"
BACKENDS = ("vllm", "blockdiff-triton", "blockdiff-cute")
QUANTS = ("bf16", "fp8")
#: ``generation_config.json`` of the benchmark's folder (see the module docstring): the step cap, and a stability
#: threshold no canvas can reach before it.
BENCH_GENERATION = {"max_denoising_steps": DENOISING_STEPS, "stability_threshold": DENOISING_STEPS}
#: ``vllm bench serve`` as the GPU machine runs it (the staged vLLM has no usable ``vllm`` script).
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
#: ``--num-warmups`` of a run at concurrency C: min(C, WARMUP_CAP) requests before the timed ones (vLLM compiles the
#: stock sampler step on its first call, once for one request and once for more).
WARMUP_CAP = 4
#: Bucket names of the profile (:data:`KERNEL_RULES`).
BUCKETS = ("attention", "sampler", "moe", "gemm", "rest")


# --------------------------------------------------------------------------------------------- the setting
def diffusion_config() -> dict:
    """``--diffusion-config`` of both servers: canvas 256, 16 denoising steps."""
    return {"canvas_length": CANVAS_LENGTH, "max_denoising_steps": DENOISING_STEPS}


def write_model_folder(out: str | os.PathLike, *, overwrite: bool = False) -> dict[str, str]:
    """Write the benchmark's model folder: DiffusionGemma-26B-A4B's config (no weights), the byte tokenizer padded
    to its vocabulary, and ``generation_config.json`` with :data:`BENCH_GENERATION`.

    Returns:
        file name -> path (``blockdiff.model.export.export_hf``).

    Raises:
        FileExistsError: ``out`` holds an earlier export and ``overwrite`` is False.
    """
    from blockdiff.model.config import geometry_config
    from blockdiff.model.export import export_hf

    return export_hf(geometry_config(GEOMETRY), out, overwrite=overwrite, **BENCH_GENERATION)


def profiler_config(trace_dir: str | os.PathLike) -> dict:
    """``--profiler-config`` that lets ``/start_profile`` and ``/stop_profile`` run vLLM 0.26's torch profiler
    (``vllm/config/profiler.py``): worker traces (CPU + CUDA, gzip) to ``trace_dir``, no Python stacks, shapes or
    summary tables (they slow the export), the API server's own profiler off, at most 400 engine steps.

    Raises:
        ValueError: ``trace_dir`` is not an absolute path (vLLM resolves a relative one against the server's
            working directory, which the client may not share).
    """
    trace_dir = os.fspath(trace_dir)
    if not os.path.isabs(trace_dir):
        raise ValueError(f"trace_dir must be an absolute path, got {trace_dir!r}")
    return {"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_with_stack": False,
            "torch_profiler_record_shapes": False, "torch_profiler_dump_cuda_time_total": False,
            "torch_profiler_use_gzip": True, "ignore_frontend": True, "max_iterations": 400}


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_int(name: str, value, lo: int, hi: int | None = None, why: str = "") -> int:
    """``value`` if it is an int in ``[lo, hi)`` (``hi`` None: no upper bound; ``why`` says where it comes from)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    if hi is not None and value >= hi:
        raise ValueError(f"{name} must be below 2**{hi.bit_length() - 1}{why}, got {value}")
    return value


#: Upper bounds of the server's counts: vLLM keeps token and sequence counts in int32 tensors and the KV cache size
#: in an int64 byte count. (A --max-num-seqs of 10**20 made cudagraph_capture_sizes loop for ever.)
_INT32_LIMIT, _INT64_LIMIT = 1 << 31, 1 << 63


#: KV cache page of both sides (``--block-size``): the triton backend's automatic Gluon choice (the hd-512 roles
#: kernel) needs TMA boxes of >= 64 rows, i.e. pages of >= 64 tokens; vLLM's default (16) would leave every
#: blockdiff layer on the portable kernel. Stock vLLM's TRITON_ATTN takes any multiple of 16.
BLOCK_SIZE = 64


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                            canvas_length: int = CANVAS_LENGTH) -> list[int]:
    """CUDA-graph batch sizes (tokens) for a diffusion server: multiples of ``canvas_length`` up to
    ``max_num_seqs`` canvases (every canvas, then every other above 16 and every fourth above 32), capped at
    ``max_num_batched_tokens``. vLLM's default sizes stop at 512 tokens (two canvases), so a step of three or more
    canvases ran without graphs, bound by the host's launch time (stock vLLM's c = 4 below its c = 1 in the first
    H200 serve, docs/tuning.md section 7)."""
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("max_num_batched_tokens", max_num_batched_tokens, canvas_length)
    # only canvas counts within the token budget are kept: the loop runs to the smaller bound (it ran to max_num_seqs)
    top = min(max_num_seqs, max_num_batched_tokens // canvas_length)
    ks = [k for k in range(1, top + 1) if k <= 16 or (k <= 32 and k % 2 == 0) or k % 4 == 0]
    if ks[-1] != max_num_seqs and max_num_seqs <= top:
        ks.append(max_num_seqs)
    return [k * canvas_length for k in ks]


def server_command(backend: str, quant: str, *, model: str, port: int, max_num_seqs: int, kv_cache_bytes: int,
                   gpu_memory_utilization: float, trace_dir: str | None = None,
                   max_num_batched_tokens: int = 16384, max_model_len: int = MAX_MODEL_LEN,
                   enforce_eager: bool = False, async_scheduling: bool = True, api_server_count: int = 1,
                   load_format: str = DUMMY, python: str = sys.executable) -> tuple[dict[str, str], list[str]]:
    """Environment and argv of ``vllm serve`` for one side of the benchmark.

    Both sides: ``--load-format`` ``load_format`` (``dummy_live`` also loads the ``blockdiff_bench`` general plugin
    that registers it, on stock's side too: :mod:`blockdiff.bench.dummy_weights`), ``--language-model-only``,
    :func:`diffusion_config`, ``--no-enable-prefix-caching`` (runs must not reuse each other's prompts),
    ``--block-size`` :data:`BLOCK_SIZE`, CUDA graphs of :func:`cudagraph_capture_sizes` (unless ``enforce_eager``),
    vLLM's asynchronous scheduling (its default; with ``async_scheduling=False`` ``--no-async-scheduling``;
    blockdiff's scheduler class follows: ``BlockdiffDiffusionAsyncScheduler`` / ``BlockdiffDiffusionScheduler``),
    ``--kv-cache-memory-bytes`` (a fixed KV cache: two servers starting together on one GPU would count each
    other's allocations in vLLM's memory profile) and ``--gpu-memory-utilization`` (with a KV size given, vLLM
    uses it only to check the free memory at start-up), ``--quantization fp8`` for ``fp8`` (dynamic FP8 weights;
    the KV cache stays bf16), the torch profiler when ``trace_dir`` is given. ``vllm``: ``VLLM_PLUGINS=none``
    (``blockdiff_bench`` with ``dummy_live``), ``--attention-backend TRITON_ATTN`` (its default on Hopper for this
    model). ``blockdiff-*``:
    ``VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff`` (``blockdiff,blockdiff_bench`` with ``dummy_live``),
    ``BLOCKDIFF_ATTN_BACKEND`` = triton | cute, ``BLOCKDIFF_SAMPLER_BACKEND=triton``, ``--attention-backend CUSTOM``,
    blockdiff's ``--scheduler-cls``, and with ``trace_dir`` ``BLOCKDIFF_PROFILE_COMPILES=1`` (Triton compiles named
    in the trace, :func:`blockdiff.integration.annotate.install_triton_compile_ranges`).

    Args:
        backend: one of :data:`BACKENDS`. quant: ``bf16`` or ``fp8``.
        model: the folder of :func:`write_model_folder`. port: TCP port (1..65535).
        max_num_seqs: in [1, 2**31). kv_cache_bytes: KV cache size in bytes, in [1, 2**63).
            gpu_memory_utilization: in (0, 1].
        trace_dir: absolute folder for profiler traces, or None (no profiler).
        max_num_batched_tokens: token budget of one engine step, in [:data:`CANVAS_LENGTH`, 2**31) (a canvas must fit
            one step; >= canvas_length * max_num_seqs lets every running canvas into one step). max_model_len: tokens per request.
        enforce_eager: no CUDA graphs / torch.compile. async_scheduling: keep vLLM's asynchronous scheduling.
        api_server_count: vLLM's API server processes (``--api-server-count``, >= 1; default 1, vLLM's without data
            parallelism): more spread the requests' input processing (tokenization, rendering) over processes
            (docs/tuning.md 7.12: the ~4 s per 64-request load outside the GPU's span).
        load_format: one of :data:`LOAD_FORMATS` (default ``dummy``, the issue's setting).
        python: the interpreter that runs vLLM.

    Returns:
        (environment variables to set, argv).

    Raises:
        ValueError: an argument out of its range (named).
    """
    _check_choice("backend", backend, BACKENDS)
    _check_choice("quant", quant, QUANTS)
    _check_choice("load_format", load_format, LOAD_FORMATS)
    _check_int("port", port, 1)
    if port > 65535:
        raise ValueError(f"port must be <= 65535, got {port}")
    _check_int("max_num_seqs", max_num_seqs, 1, _INT32_LIMIT, " (vLLM's int32 counts)")
    _check_int("kv_cache_bytes", kv_cache_bytes, 1, _INT64_LIMIT, " (vLLM's int64 byte count)")
    # at least one canvas a step, eager too: a budget below it cuts every canvas row, and blockdiff's scheduler
    # refuses to start (integration.vllm_scheduler.check_canvas_rows_fit) rather than hang every request
    _check_int("max_num_batched_tokens", max_num_batched_tokens, CANVAS_LENGTH, _INT32_LIMIT, " (vLLM's int32 counts)")
    _check_int("api_server_count", api_server_count, 1)
    _check_int("max_model_len", max_model_len, INPUT_LEN + OUTPUT_LEN)
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) or not (
            0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    argv = [python, *VLLM_CLI, "serve", str(model), "--load-format", load_format, "--language-model-only",
            "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--gpu-memory-utilization", f"{gpu_memory_utilization:g}", "--dtype", "bfloat16",
            "--diffusion-config", json.dumps(diffusion_config(), separators=(",", ":")),
            "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE)]
    argv.append("--async-scheduling" if async_scheduling else "--no-async-scheduling")  # explicit: vLLM's default
    if api_server_count != 1:
        argv += ["--api-server-count", str(api_server_count)]
    if quant == "fp8":
        argv += ["--quantization", "fp8"]
    if enforce_eager:
        argv.append("--enforce-eager")
    else:
        sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens)
        argv += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes}, separators=(",", ":"))]
    if trace_dir is not None:
        argv += ["--profiler-config", json.dumps(profiler_config(trace_dir), separators=(",", ":"))]
    # both sides: the caching allocator's expandable segments (the first co-hosted 26B run on the H200 had 13 GiB
    # reserved but unallocated in blockdiff's server when a 15.75 GiB logits buffer did not fit)
    alloc = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    live = load_format == DUMMY_LIVE  # its loader comes from the blockdiff_bench plugin, on both sides
    if backend == "vllm":
        env = {"VLLM_PLUGINS": DUMMY_LIVE_PLUGIN if live else "none", **alloc}
        argv += ["--attention-backend", "TRITON_ATTN"]
    else:
        plugins = f"blockdiff,{DUMMY_LIVE_PLUGIN}" if live else "blockdiff"
        env = {**alloc, "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": plugins,
               "BLOCKDIFF_ATTN_BACKEND": backend.split("-", 1)[1], "BLOCKDIFF_SAMPLER_BACKEND": "triton"}
        if trace_dir is not None:  # a profiled server names Triton's JIT compiles in its trace (annotate.py)
            env["BLOCKDIFF_PROFILE_COMPILES"] = "1"
        sched = "BlockdiffDiffusionAsyncScheduler" if async_scheduling else "BlockdiffDiffusionScheduler"
        argv += ["--attention-backend", "CUSTOM", "--scheduler-cls", f"blockdiff.integration.vllm_scheduler.{sched}"]
    return env, argv


# --------------------------------------------------------------------------------------------- client runs
def num_prompts_for(concurrency: int, per_concurrency: int = 2, minimum: int = 8) -> int:
    """Prompts of a run at ``concurrency``: max(per_concurrency * concurrency, minimum)."""
    return max(per_concurrency * concurrency, minimum)


#: ``skip_special_tokens`` the client asks for (module docstring: False, so the random-weight model's ``<pad>``
#: commits detokenize in linear time); None: the server's default (True).
SKIP_SPECIAL_TOKENS: bool | None = False


def effective_skip_special_tokens(value) -> bool:
    """The ``skip_special_tokens`` a request ran with: ``value`` as asked (a bool), or vLLM's default (True) for
    None, i.e. not asked, as in every row before docs/tuning.md 7.19 (which lack the field).

    Raises:
        TypeError: ``value`` is neither a bool nor None.
    """
    if value is None:
        return True
    if not isinstance(value, bool):
        raise TypeError(f"skip_special_tokens must be a bool or None, got {value!r}")
    return value


def effective_load_format(value) -> str:
    """The load format a row's server ran: ``value`` (one of :data:`LOAD_FORMATS`), or ``dummy`` for None, i.e. a
    row from before docs/tuning.md 7.21 (which lacks the field; every server ran ``dummy`` then).

    Raises:
        ValueError: ``value`` is neither None nor one of :data:`LOAD_FORMATS`.
    """
    if value is None:
        return DUMMY
    _check_choice("load_format", value, LOAD_FORMATS)
    return value


def server_argv(pid: int | None, proc_root: str | os.PathLike = "/proc") -> list[str] | None:
    """The command line of process ``pid`` (``/proc/PID/cmdline``) as a list of strings; None when ``pid`` is None
    or the process cannot be read."""
    if pid is None:
        return None
    try:
        raw = (Path(proc_root) / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _is_vllm_serve(argv: Sequence[str]) -> bool:
    """A ``vllm ... serve`` command line: ``serve`` after an argument naming vllm."""
    return "serve" in argv and any("vllm" in a for a in argv[:argv.index("serve")])


def _last_flag(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last ``--a-b X`` / ``--a-b=X`` / ``--a_b X`` / ``--a_b=X`` in ``argv`` (vLLM's parser takes
    both spellings; the last one wins there too), ``flag`` given as ``--a-b``; None when absent."""
    names = (flag, "--" + flag[2:].replace("-", "_"))
    found = None
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(tuple(n + "=" for n in names)):
            found = a.split("=", 1)[1]
    return found


def server_load_format(pid: int | None, proc_root: str | os.PathLike = "/proc") -> str | None:
    """The load format process ``pid`` serves, read from its command line (``/proc/PID/cmdline``): the last
    ``--load-format X`` / ``--load-format=X`` (vLLM's parser also takes ``--load_format``; the last one wins there
    too); ``auto`` (vLLM's default: real weights) for a vLLM ``serve`` command line without the flag (``serve``
    after an argument naming vllm); None when ``pid`` is None, the process cannot be read, or it is no vLLM
    ``serve`` command (a stand-in, a wrapper). A format given in a ``--config`` file is not seen."""
    argv = server_argv(pid, proc_root)
    if argv is None:
        return None
    found = _last_flag(argv, "--load-format")
    if found is None and _is_vllm_serve(argv):
        return "auto"  # a vllm serve command line without the flag
    return found


def server_max_num_seqs(pid: int | None, proc_root: str | os.PathLike = "/proc") -> int | None:
    """The ``--max-num-seqs`` process ``pid`` serves with, read from its command line as
    :func:`server_load_format` reads the load format; None when ``pid`` is None, the process cannot be read, the
    flag is absent (vLLM's default then depends on its version and the GPU) or its value is no integer."""
    argv = server_argv(pid, proc_root)
    found = None if argv is None else _last_flag(argv, "--max-num-seqs")
    try:
        return None if found is None else int(found)
    except ValueError:
        return None


def check_server_load_format(load_format: str, pid: int | None, proc_root: str | os.PathLike = "/proc") -> None:
    """Refuse to label rows with a load format the server does not run: with ``pid`` given and its command line
    readable as a ``serve`` command, the format it serves (:func:`server_load_format`) must equal ``load_format``.
    Nothing is checked without ``pid`` or where the command line says nothing (the label then stands as given).

    Raises:
        ValueError: the two differ (both named).
    """
    actual = server_load_format(pid, proc_root)
    if actual is not None and actual != load_format:
        raise ValueError(f"--load-format {load_format!r} does not match the server's --load-format {actual!r} "
                         f"(--server-pid {pid}): the rows would be labelled with another setting")


def check_server_max_num_seqs(max_num_seqs: int | None, pid: int | None,
                              proc_root: str | os.PathLike = "/proc") -> None:
    """Refuse to label rows with a ``--max-num-seqs`` the server does not run (docs/tuning.md 7.26: a row was
    recorded with the script's default, 16, against a server started with 64): with ``pid`` given and the flag on
    its command line (:func:`server_max_num_seqs`), it must equal ``max_num_seqs``. Nothing is checked with
    ``max_num_seqs`` None, without ``pid`` or without the flag there.

    Raises:
        ValueError: the two differ (both named).
    """
    actual = server_max_num_seqs(pid, proc_root)
    if max_num_seqs is not None and actual is not None and actual != max_num_seqs:
        raise ValueError(f"--max-num-seqs {max_num_seqs} does not match the server's --max-num-seqs {actual} "
                         f"(--server-pid {pid}): the rows would be labelled with another setting")


def add_load_format_option(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--load-format`` (``args.load_format``, one of :data:`LOAD_FORMATS`, default ``dummy``)."""
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=DUMMY,
                        help=f"{what} (default {DUMMY}, the issue's setting; "
                             f"{DUMMY_LIVE}: blockdiff.bench.dummy_weights)")


def add_skip_special_tokens_option(parser: argparse.ArgumentParser) -> None:
    """``--skip-special-tokens`` (``args.skip_special_tokens``): None, the server's default (vLLM: true; the rows
    before docs/tuning.md 7.19), instead of :data:`SKIP_SPECIAL_TOKENS`."""
    parser.add_argument("--skip-special-tokens", dest="skip_special_tokens", action="store_const", const=None,
                        default=SKIP_SPECIAL_TOKENS,
                        help="leave skip_special_tokens to the server (vLLM: true; the rows before docs/tuning.md "
                             "7.19); default: ask for false, so the random-weight model's <pad> commits detokenize "
                             "in linear time")


def bench_serve_args(*, base_url: str, model: str, concurrency: int, num_prompts: int, num_warmups: int,
                     result_dir: str, result_filename: str, seed: int = 0, metadata: dict | None = None,
                     output_len: int = OUTPUT_LEN, ready_check_timeout_s: int | None = None,
                     skip_special_tokens: bool | None = SKIP_SPECIAL_TOKENS) -> list[str]:
    """Arguments of ``vllm bench serve`` (vLLM 0.26) for one run of the benchmark's setting: the ``random``
    dataset, 4096 prompt and ``output_len`` (512) output tokens (range ratio 0), EOS ignored, no sampling options
    (the servers' defaults), TTFT / TPOT / ITL / end-to-end percentiles 50 and 99, the detailed result saved.
    ``ready_check_timeout_s``: None leaves vLLM's default (0.26.0: 0, no ready check; a later vLLM may send a
    whole untimed first request); 0 says so explicitly (``--ready-check-timeout-sec 0``: a profile's trace holds
    only the load).
    ``skip_special_tokens``: True / False go in ``--extra-body``; None leaves the server's default.

    Raises:
        TypeError: ``skip_special_tokens`` is not a bool or None.
    """
    effective_skip_special_tokens(skip_special_tokens)  # the type check
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--ignore-eos", "--max-concurrency", str(concurrency),
            "--num-prompts", str(num_prompts), "--num-warmups", str(num_warmups), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_filename,
            "--disable-tqdm"]
    if ready_check_timeout_s is not None:
        args += ["--ready-check-timeout-sec", str(int(ready_check_timeout_s))]
    if skip_special_tokens is not None:
        args += ["--extra-body", json.dumps({"skip_special_tokens": skip_special_tokens})]
    if metadata:
        args += ["--metadata", *[f"{k}={v}" for k, v in metadata.items()]]
    return args


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    return (statistics.fmean(xs), statistics.median(xs)) if xs else (None, None)


def output_text_summary(texts: Sequence, *, sample_chars: int = 80, errors: Sequence | None = None) -> dict:
    """What the requests' texts looked like (``generated_texts`` of a ``--save-detailed`` result): the model's
    tokens decide the detokenizer's cost in the API server (docs/tuning.md 7.19: tokens whose text never completes,
    such as a repeated ``<pad>`` or a lone UTF-8 lead byte, make vLLM's incremental detokenizer quadratic).

    Args:
        texts: one str per request. sample_chars: characters of the sample (int >= 0). errors: the result's
            per-request errors (a non-empty one: the request failed, its "" text is not an answer), or None.

    Returns:
        ``requests``, ``chars_median`` (characters a request), ``empty`` (answered requests with no text),
        ``failed``, ``replacement_chars`` (U+FFFD, from invalid UTF-8, over all requests), ``unused_tokens``
        (``<unused_`` pieces, the padded vocabulary's tokens), ``sample`` (the first ``sample_chars`` characters of
        the first non-empty text, as ``ascii()`` writes them).

    Raises:
        TypeError: ``texts`` is not a list or tuple, or an entry is not a str.
        ValueError: ``sample_chars`` is not an int >= 0.
    """
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    if isinstance(sample_chars, bool) or not isinstance(sample_chars, int) or sample_chars < 0:
        raise ValueError(f"sample_chars must be an int >= 0, got {sample_chars!r}")
    failed = [bool(e) for e in errors][:len(texts)] if errors is not None else []
    failed += [False] * (len(texts) - len(failed))
    lens = [len(t) for t in texts]
    first = next((t for t in texts if t), "")
    return {"requests": len(texts), "chars_median": statistics.median(lens) if lens else None,
            "empty": sum(1 for t, f in zip(texts, failed) if not t and not f), "failed": sum(failed),
            "replacement_chars": sum(t.count("\ufffd") for t in texts),
            "unused_tokens": sum(t.count("<unused_") for t in texts), "sample": ascii(first[:sample_chars])}


#: Row fields :func:`row_from_result` takes from the completed requests' latencies (None when none completed).
_LATENCY_FIELDS = ("ttft_ms", "ttft_median_ms", "ttft_p99_ms", "e2e_ms", "e2e_median_ms", "time_per_canvas_ms",
                   "time_per_canvas_median_ms", "tpot_ms")


def row_from_result(result: dict, *, backend: str, quant: str, max_num_seqs: int | None,
                    canvas_length: int = CANVAS_LENGTH, expected_output_len: int = OUTPUT_LEN) -> dict:
    """One benchmark row from a ``vllm bench serve`` result JSON (vLLM 0.26's field names; see the module
    docstring for the row fields and the time-per-canvas definition).

    A run in which no request completed has no latency: vLLM writes its means, medians and percentiles over the
    empty set as 0 (``np.mean(ttfts or 0)``), so the row's latency fields (``ttft_*``, ``e2e_*``, ``tpot_ms``,
    ``time_per_canvas_*``) are None there, not 0 ms; its ``output_tok_s`` stays vLLM's 0.0 (no token in the
    run's duration).

    Raises:
        ValueError: ``result`` lacks a field every 0.26 result has (``completed``, ``failed``, ``num_prompts``,
            ``duration``, ``output_throughput``, ``max_concurrency``), or ``canvas_length`` < 1.
        TypeError: ``result`` is not a dict.
    """
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict (a vllm bench serve result JSON), got {type(result).__name__}")
    _check_int("canvas_length", canvas_length, 1)
    missing = [k for k in ("completed", "failed", "num_prompts", "duration", "output_throughput", "max_concurrency")
               if k not in result]
    if missing:
        raise ValueError(f"result lacks {missing}: not a vllm bench serve (0.26) result")
    c = result["max_concurrency"]
    n = result["num_prompts"]
    ttfts = result.get("ttfts")
    itls = result.get("itls")
    out_lens = result.get("output_lens")
    errors = [e for e in (result.get("errors") or []) if e]
    canvas_ms = []
    if ttfts is not None and itls is not None and out_lens is not None:
        for ttft, itl, n_out, err in zip(ttfts, itls, out_lens, result.get("errors") or [""] * len(ttfts)):
            canvases = math.ceil((n_out or 0) / canvas_length)
            if err or not ttft or canvases < 2:
                continue
            canvas_ms.append(1e3 * sum(itl) / (canvases - 1))
    elif result["completed"] and result.get("mean_e2el_ms") is not None and result.get("mean_ttft_ms") is not None:
        # not --save-detailed: the means of the completed requests (none completed: no latency, below)
        canvases = math.ceil(expected_output_len / canvas_length)
        if canvases >= 2:
            canvas_ms.append((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / (canvases - 1))
    tpc_mean, tpc_median = _stats(canvas_ms)
    expected = n * expected_output_len
    total_out = result.get("total_output_tokens")
    steps = result.get("diffusion_steps_per_canvas")
    row = {
        "workload": f"serve_c{c}_{quant}", "backend": backend, "quant": quant, "status": "ok",
        "concurrency": c, "max_num_seqs": max_num_seqs, "num_prompts": n,
        "completed": result["completed"], "failed": result["failed"], "errors": [str(e)[-300:] for e in errors[:3]],
        "output_tokens": total_out, "expected_output_tokens": expected,
        "complete": bool(result["failed"] == 0 and result["completed"] == n and total_out == expected),
        "output_tok_s": result["output_throughput"], "total_tok_s": result.get("total_token_throughput"),
        "request_throughput": result.get("request_throughput"), "duration_s": result["duration"],
        "ttft_ms": result.get("mean_ttft_ms"), "ttft_median_ms": result.get("median_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "e2e_ms": result.get("mean_e2el_ms"), "e2e_median_ms": result.get("median_e2el_ms"),
        "time_per_canvas_ms": tpc_mean, "time_per_canvas_median_ms": tpc_median,
        "tpot_ms": result.get("mean_tpot_ms"),
        "max_output_tokens_per_s": result.get("max_output_tokens_per_s"),
        "max_concurrent_requests": result.get("max_concurrent_requests"),
        "diffusion_steps_per_canvas": steps,
        "diffusion_denoising_steps": result.get("diffusion_denoising_steps"),
        "diffusion_committed_tokens": result.get("diffusion_committed_tokens"),
        "steps_ok": None if steps is None else abs(steps - DENOISING_STEPS) < 1e-6,
    }
    texts = result.get("generated_texts")
    if isinstance(texts, list):
        row["output_text"] = output_text_summary([t if isinstance(t, str) else "" for t in texts],
                                                 errors=result.get("errors"))
    if not result["completed"]:  # vLLM's 0 ms over no request: no latency was measured
        row.update({k: None for k in _LATENCY_FIELDS})
    if not row["complete"]:
        row["reason"] = (f"{n - result['completed']} of {n} requests lost or failed, {total_out} of {expected} "
                         f"output tokens" + (f": {errors[0][-200:]}" if errors else ""))
    return row


# --------------------------------------------------------------------------------------------- GPU memory
def read_proc_table(proc_root: str | os.PathLike = "/proc") -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process in ``proc_root`` (Linux ``/proc/<pid>/stat`` fields 4 and
    6; a process that exits while being read is left out)."""
    table = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat"), encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        if len(rest) >= 4:
            table[int(entry.name)] = (int(rest[1]), int(rest[3]))
    return table


def process_tree(root: int, table: dict[int, tuple[int, int]]) -> set[int]:
    """``root``, its descendants, and every process in the session ``root`` leads (a server started with
    ``setsid``: vLLM's engine core is a spawned child of the API server, its workers children of that)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in tree:
                tree.add(c)
                todo.append(c)
    tree |= {pid for pid, (_, sid) in table.items() if sid == root}
    return tree


def parse_compute_apps(text: str) -> dict[int, int]:
    """pid -> used GPU memory in bytes from ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,
    nounits`` output (MiB per line; lines without a number, e.g. ``[N/A]``, are skipped; a pid on several GPUs is
    summed)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        try:
            mib = float(parts[1])
        except ValueError:
            continue
        out[int(parts[0])] = out.get(int(parts[0]), 0) + int(mib * 2**20)
    return out


class _PeriodicSampler:
    """A background thread that calls :meth:`sample` every ``interval_s`` seconds while the ``with`` block runs,
    and once more after it (subclasses: :class:`MemorySampler`, :class:`HostCpuSampler`)."""

    interval_s: float

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.sample()  # one last reading after the run


class MemorySampler(_PeriodicSampler):
    """Peak GPU memory of a server's processes while a run goes on, read by ``nvidia-smi`` in a background thread.

    Every ``interval_s`` seconds: ``nvidia-smi --query-compute-apps=pid,used_memory`` (per process) and
    ``--query-gpu=memory.used`` (the whole GPU, first GPU). The server's memory is the sum over the pids of
    :func:`process_tree` of ``root_pid``. In a container whose pid namespace differs from the driver's, nvidia-smi
    reports pids that are not ours: then no pid matches, ``peak_memory_bytes`` stays None and ``pids_seen`` shows
    what the driver reported (the whole-GPU peak is still there).

    Args:
        root_pid: the server's process (``vllm serve``), or None (the whole GPU only).
        interval_s: seconds between samples (> 0).
        smi: the nvidia-smi command (argv prefix).
        proc_root: where the process table is read.
    """

    def __init__(self, root_pid: int | None, *, interval_s: float = 0.5, smi: Sequence[str] = ("nvidia-smi",),
                 proc_root: str | os.PathLike = "/proc"):
        if root_pid is not None:
            _check_int("root_pid", root_pid, 1)
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.root_pid, self.interval_s, self.smi, self.proc_root = root_pid, interval_s, list(smi), proc_root
        self.peak_tree = None
        self.peak_gpu = None
        self.samples = 0
        self.pids_seen: set[int] = set()
        self.pids_matched: set[int] = set()
        self.error: str | None = None

    def _smi(self, *query: str) -> str:
        return subprocess.run(self.smi + list(query) + ["--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=True).stdout

    def sample(self) -> None:
        """Take one sample (also what the thread calls)."""
        try:
            apps = parse_compute_apps(self._smi("--query-compute-apps=pid,used_memory"))
            gpu = self._smi("--query-gpu=memory.used").split()
        except (OSError, subprocess.SubprocessError) as e:
            self.error = f"{type(e).__name__}: {e}"[:300]
            return
        self.samples += 1
        self.pids_seen |= set(apps)
        if gpu:
            try:
                used = int(float(gpu[0].strip(",")) * 2**20)
                self.peak_gpu = used if self.peak_gpu is None else max(self.peak_gpu, used)
            except ValueError:
                pass
        if self.root_pid is not None:
            tree = process_tree(self.root_pid, read_proc_table(self.proc_root))
            mine = {p: b for p, b in apps.items() if p in tree}
            if mine:
                self.pids_matched |= set(mine)
                total = sum(mine.values())
                self.peak_tree = total if self.peak_tree is None else max(self.peak_tree, total)

    def result(self) -> dict:
        """``peak_memory_bytes`` (server tree), ``gpu_memory_used_peak_bytes``, ``memory_samples``,
        ``memory_pids`` (matched / seen) and ``memory_error`` (the last failure of nvidia-smi, if any)."""
        return {"peak_memory_bytes": self.peak_tree, "gpu_memory_used_peak_bytes": self.peak_gpu,
                "memory_samples": self.samples,
                "memory_pids": {"root": self.root_pid, "matched": sorted(self.pids_matched),
                                "seen": sorted(self.pids_seen)},
                "memory_error": self.error}


def read_thread_times(pids: Iterable[int], proc_root: str | os.PathLike = "/proc") -> dict[tuple[int, int], tuple]:
    """(pid, tid) -> (process name, thread name, user + system CPU clock ticks) of every thread of ``pids``
    (Linux ``/proc/<pid>/comm`` and ``/proc/<pid>/task/<tid>/stat`` fields 2, 14 and 15; a process or thread that
    exits while being read is left out)."""
    out = {}
    for pid in pids:
        base = os.path.join(proc_root, str(pid))
        try:
            with open(os.path.join(base, "comm"), encoding="utf-8", errors="replace") as f:
                pname = f.read().strip()
            tids = [e.name for e in os.scandir(os.path.join(base, "task")) if e.name.isdigit()]
        except OSError:
            continue
        for tid in tids:
            try:
                with open(os.path.join(base, "task", tid, "stat"), encoding="utf-8", errors="replace") as f:
                    stat = f.read()
            except OSError:
                continue
            lp, rp = stat.find("("), stat.rfind(")")
            rest = stat[rp + 2:].split()
            if lp < 0 or len(rest) < 13:
                continue
            out[(pid, int(tid))] = (pname, stat[lp + 1:rp], int(rest[11]) + int(rest[12]))
    return out


class HostCpuSampler(_PeriodicSampler):
    """CPU time of a server's processes and threads while a run goes on (which host thread, if any, is saturated:
    docs/tuning.md 7.13), read from ``/proc`` in a background thread every ``interval_s`` seconds.

    Each sample reads every thread of :func:`process_tree` of ``root_pid`` (:func:`read_thread_times`); a thread's
    busy share over an interval is its CPU ticks over the interval's ticks (1.0: one core all the time).

    Args:
        root_pid: the server's process (``vllm serve``), or None (nothing is sampled: :meth:`result` is empty).
        interval_s: seconds between samples (> 0).
        proc_root: where the process table is read.
        clock_ticks: ticks per second of the counters (default ``os.sysconf("SC_CLK_TCK")``).
    """

    def __init__(self, root_pid: int | None, *, interval_s: float = 0.25, proc_root: str | os.PathLike = "/proc",
                 clock_ticks: int | None = None):
        if root_pid is not None:
            _check_int("root_pid", root_pid, 1)
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.root_pid, self.interval_s, self.proc_root = root_pid, interval_s, proc_root
        self.hz = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._first: dict[tuple[int, int], tuple] = {}
        self._prev: dict[tuple[int, int], tuple] | None = None
        self._prev_t = None
        self._last: dict[tuple[int, int], tuple] = {}
        self.t0 = self.t1 = None
        #: per sample: (Unix time at the interval's end, {process name: busiest thread's share, summed share})
        self.series: list[tuple[float, dict[str, tuple[float, float]]]] = []

    def sample(self) -> None:
        """Take one sample (also what the thread calls)."""
        if self.root_pid is None:
            return
        now = time.time()
        cur = read_thread_times(process_tree(self.root_pid, read_proc_table(self.proc_root)), self.proc_root)
        for k, v in cur.items():
            self._first.setdefault(k, v)
        if self._prev is not None and now > self._prev_t:
            ticks = (now - self._prev_t) * self.hz
            per: dict[str, list[float]] = {}
            for k, (pname, _, t) in cur.items():
                d = (t - self._prev[k][2]) / ticks if k in self._prev else 0.0
                ent = per.setdefault(f"{pname}[{k[0]}]", [0.0, 0.0])
                ent[0], ent[1] = max(ent[0], d), ent[1] + d
            self.series.append((now, {p: (round(a, 3), round(b, 3)) for p, (a, b) in per.items()}))
        self._prev, self._prev_t = cur, now
        self.t0 = now if self.t0 is None else self.t0
        self.t1 = now
        self._last = cur

    def result(self, *, top: int = 6, series: bool = False) -> dict:
        """``host_cpu``: ``wall_s`` sampled; per process (``name[pid]``) its CPU seconds and share of the wall time
        (1.0 = one core); the ``top`` threads by CPU seconds with the share of samples in which each was >= 90 %
        busy (``saturated_share``: a thread that holds the GIL or spins); with ``series`` the per-sample busiest
        thread and total share per process (Unix times, for placing against a profile's timeline). Empty without
        a root pid or samples."""
        if self.root_pid is None or not self._last:
            return {}
        wall = max(self.t1 - self.t0, 1e-9)
        procs: dict[str, float] = {}
        threads = []
        for k, (pname, tname, t) in self._last.items():
            d = (t - self._first[k][2]) / self.hz  # every thread read is in _first
            key = f"{pname}[{k[0]}]"
            procs[key] = procs.get(key, 0.0) + d
            threads.append((d, key, tname, k[1]))
        threads.sort(reverse=True)
        n = max(len(self.series), 1)
        out = {"wall_s": round(wall, 3), "samples": len(self.series),
               "processes": {p: {"cpu_s": round(c, 3), "share": round(c / wall, 3)}
                             for p, c in sorted(procs.items(), key=lambda x: -x[1])},
               "top_threads": [{"process": p, "thread": tn, "tid": tid, "cpu_s": round(d, 3),
                                "share": round(d / wall, 3)} for d, p, tn, tid in threads[:top]]}
        for p in out["processes"]:
            hot = sum(1 for _, per in self.series if per.get(p, (0.0, 0.0))[0] >= 0.9)
            out["processes"][p]["saturated_share"] = round(hot / n, 3)
        if series:
            out["series"] = [[round(t, 3), per] for t, per in self.series]
        return out


def host_cpu_between(series: Sequence, start: float, end: float) -> dict:
    """Mean busiest-thread share and mean summed share per process over the samples of a
    :meth:`HostCpuSampler.result` ``series`` whose interval ends in ``[start, end]`` (Unix s): ``{process:
    {"busiest": x, "total": y}}``, plus ``samples``. Empty (``samples`` 0) when none falls there."""
    rows = [per for t, per in series if start <= t <= end]
    out: dict = {"samples": len(rows)}
    for p in sorted({p for per in rows for p in per}):
        vals = [per.get(p, (0.0, 0.0)) for per in rows]
        out[p] = {"busiest": round(sum(v[0] for v in vals) / len(vals), 3),
                  "total": round(sum(v[1] for v in vals) / len(vals), 3)}
    return out


# --------------------------------------------------------------------------------------------- sweep
def _work_dir(args) -> Path:
    """``--work-dir``, else ``$TMPDIR/bench_serve/BACKEND_QUANT`` (created)."""
    default = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_serve" / f"{args.backend}_{args.quant}"
    work = Path(args.work_dir) if args.work_dir else default
    work.mkdir(parents=True, exist_ok=True)
    return work


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


#: How :func:`run_bench_serve` begins its reason when the client ran past its time: the run was cut by the sweep's
#: own budget, so the row is ``timeout`` (not measured), not ``error`` (a failed run, requests possibly lost).
TIMED_OUT = "vllm bench serve ran past"


def run_bench_serve(bench_cmd: Sequence[str], args: Sequence[str], *, result_path: Path, log_path: Path,
                    timeout_s: float) -> tuple[dict | None, str | None]:
    """Run ``bench_cmd + args``; (result JSON, None) or (None, why not)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if result_path.exists():
        result_path.unlink()
    with open(log_path, "w") as log:
        try:
            p = subprocess.run(list(bench_cmd) + list(args), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"{TIMED_OUT} {timeout_s:.0f} s; log tail: {_tail(log_path, 600)}"
        except OSError as e:
            return None, f"cannot run {bench_cmd[0]}: {e}"
    if p.returncode != 0 or not result_path.exists():
        return None, f"vllm bench serve exit {p.returncode}, {'no result' if not result_path.exists() else ''}; " \
                     f"log tail: {_tail(log_path, 600)}"
    try:
        return json.loads(result_path.read_text()), None
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable result {result_path}: {e}"


def environment() -> dict:
    """The environment record of a run (:func:`blockdiff.bench.common.env_record`, with vLLM's version)."""
    return common.env_record()


def append_jsonl(path: Path, obj: dict) -> None:
    """Append ``obj`` as one JSON line to ``path`` (folders created; values made JSON-safe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(common.jsonable(obj)) + "\n")


def sweep(args) -> list[dict]:
    """The ``sweep`` subcommand (see the module docstring); returns the rows."""
    rows_path = Path(args.rows)
    work = _work_dir(args)
    env = environment()
    env.update(kind="env", backend=args.backend, quant=args.quant, max_num_seqs=args.max_num_seqs,
               base_url=args.base_url, model=args.model, server_pid=args.server_pid,
               bench_cmd=" ".join(args.bench_cmd), setting={"input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                                                          "canvas_length": CANVAS_LENGTH,
                                                          "denoising_steps": DENOISING_STEPS, "geometry": GEOMETRY,
                                                          "skip_special_tokens": effective_skip_special_tokens(
                                                              args.skip_special_tokens),
                                                          "load_format": args.load_format})
    t_sweep = time.perf_counter()
    warm_c = args.max_num_seqs if args.warm_concurrency is None else args.warm_concurrency
    if warm_c > 0:  # every batch size up to max-num-seqs once, so no compile lands in a timed run
        name = f"warm_c{warm_c}_{args.quant}-{args.backend}"
        common.log(f"{name}: {warm_c} requests of {args.warm_output_len} tokens at once (not recorded)")
        result, why = run_bench_serve(
            args.bench_cmd, bench_serve_args(base_url=args.base_url, model=args.model, concurrency=warm_c,
                                             num_prompts=warm_c, num_warmups=1, result_dir=str(work),
                                             result_filename=f"{name}.json", seed=args.seed + 999,
                                             output_len=args.warm_output_len,
                                             skip_special_tokens=args.skip_special_tokens),
            result_path=work / f"{name}.json", log_path=work / f"{name}.log", timeout_s=args.run_timeout)
        env["warm_up"] = {"concurrency": warm_c, "output_len": args.warm_output_len,
                          "s": time.perf_counter() - t_sweep, "ok": result is not None,
                          "completed": None if result is None else result.get("completed"), "error": why}
    append_jsonl(rows_path, {"env": env})
    rows = []
    for c in args.concurrency:
        n = num_prompts_for(c, args.num_prompts_per_concurrency, args.min_prompts)
        warm = min(c, args.warmup_cap)
        name = f"serve_c{c}_{args.quant}-{args.backend}"
        timeout_s = args.run_timeout
        if args.deadline_s is not None:
            left = args.deadline_s - (time.perf_counter() - t_sweep)
            if left < args.min_run_s:
                row = {"workload": f"serve_c{c}_{args.quant}", "backend": args.backend, "quant": args.quant,
                       "status": "skipped", "concurrency": c, "max_num_seqs": args.max_num_seqs, "num_prompts": n,
                       "complete": False, "reason": f"past the sweep's deadline ({args.deadline_s:.0f} s)",
                       "load_format": args.load_format,
                       "skip_special_tokens": effective_skip_special_tokens(args.skip_special_tokens)}
                append_jsonl(rows_path, row)
                rows.append(row)
                continue
            timeout_s = min(timeout_s, left)
        bargs = bench_serve_args(base_url=args.base_url, model=args.model, concurrency=c, num_prompts=n,
                                 num_warmups=warm, result_dir=str(work), result_filename=f"{name}.json",
                                 seed=args.seed + c, metadata={"blockdiff_backend": args.backend,
                                                               "blockdiff_quant": args.quant},
                                 skip_special_tokens=args.skip_special_tokens)
        common.log(f"{name}: {n} prompts, {warm} warm-up, concurrency {c}")
        t0 = time.perf_counter()
        with MemorySampler(args.server_pid, interval_s=args.memory_interval, smi=args.nvidia_smi) as mem, \
                HostCpuSampler(args.server_pid) as cpu:
            result, why = run_bench_serve(args.bench_cmd, bargs, result_path=work / f"{name}.json",
                                          log_path=work / f"{name}.log", timeout_s=timeout_s)
        if result is None:
            row = {"workload": f"serve_c{c}_{args.quant}", "backend": args.backend, "quant": args.quant,
                   "status": "timeout" if why.startswith(TIMED_OUT) else "error", "concurrency": c,
                   "max_num_seqs": args.max_num_seqs, "num_prompts": n, "complete": False, "reason": why}
        else:
            row = row_from_result(result, backend=args.backend, quant=args.quant, max_num_seqs=args.max_num_seqs)
        row.update(mem.result(), num_warmups=warm, wall_s=time.perf_counter() - t0, host_cpu=cpu.result(),
                   skip_special_tokens=effective_skip_special_tokens(args.skip_special_tokens),
                   load_format=args.load_format)
        append_jsonl(rows_path, row)
        rows.append(row)
        common.log(f"  {row['status']}: {common.fmt(row.get('output_tok_s'), 1)} tok/s, ttft "
                   f"{common.fmt(row.get('ttft_ms'), 1)} ms, {row.get('completed')}/{n} done, steps/canvas "
                   f"{row.get('diffusion_steps_per_canvas')} {row.get('reason', '')[:200]}")
    return rows


# --------------------------------------------------------------------------------------------- trace classifier
#: Kernel-name rules of the profile, first match wins: (bucket, regular expression, what it catches). Names are
#: those of the torch profiler's chrome trace (Triton kernels by their function name, CUDA kernels demangled).
#: ``rest`` rules name the kernels known to belong there; a name no rule matches counts as rest too and is reported
#: as unknown (:func:`summarize_trace`), so a missing rule shows.
KERNEL_RULES: tuple[tuple[str, str, str], ...] = (
    ("attention", r"^_attn_fwd|^_merge_kernel$", "blockdiff triton attention (portable / Gluon) and its split merge"),
    ("attention", r"FlashAttentionForwardSm90|FlashAttentionForwardCombine|flash_fwd|flash::|FlashAttn|fmha|"
                  r"^_batch_work_order_kernel$",
     "blockdiff cute (FA4-derived: Mixed, its Split / Cluster, the hd-512 WideV and Roles kernels; the work order's "
     "Triton permutation, the hd-512 default), FA4's combine, FlashAttention"),
    ("attention", r"kernel_unified_attention|reduce_segments|unified_attention", "vLLM TRITON_ATTN"),
    ("attention", r"reshape_and_cache", "KV cache write (vLLM's, both sides)"),
    ("sampler", r"^_(stats|stats_merge|step|gather_rows|random_ids|soft_embedding|soft_reduce|prob_chunk|moments|"
                r"shard_stats|shard_ties)_kernel", "blockdiff sampler kernels"),
    ("moe", r"fused_moe|moe|MoE|Moe|expert|Expert|topk|TopK|topKPerRow|GroupProblemShape|grouped_gemm|ep_scatter|"
            r"ep_gather|write_zeros_to_output|compute_identity", "MoE: routing, top-k, align/sort, expert GEMMs"),
    ("gemm", r"nvjet|xmma|gemm|Gemm|GEMM|cutlass|cublas|Cublas|wgmma|scaled_mm|splitKreduce|_mm_|matmul",
     "dense GEMMs (cuBLAS nvjet / sm90_xmma, CUTLASS, FP8 scaled_mm)"),
    ("gemm", r"fp8_quant|quant_fp8|scaled_fp8|per_token.*quant|quantize|dynamic_.*quant",
     "FP8 activation quantisation feeding the FP8 GEMMs"),
    ("rest", r"triton_(poi|red|per|tem)_|elementwise|vectorized|reduce_kernel|Reduce|[Nn]orm|rms|rotary|Rotary|"
             r"act_and_mul|gelu|silu|[Ss]oftmax|Memcpy|Memset|[Cc]opy|fill|cat_|CatArray|index|[Gg]ather|[Ss]catter|"
             r"embedding|Embedding|[Ss]ort|cumsum|[Ss]can|arange|tanh|distribution|philox|[Rr]andom|radix|compare|"
             r"where|post_update|prepare|_expand|bincount|argmax|max_|min_", "elementwise, norms, copies, small ops"),
)
_RULES = tuple((b, re.compile(p)) for b, p, _ in KERNEL_RULES)
_STEP_RE = re.compile(r"^execute_(?:(\d+)_)?context_(\d+)\(\D*?(\d+)[^)]*\)_generation_(\d+)\(\D*?(\d+)")


def classify_kernel(name: str) -> tuple[str, bool]:
    """(bucket, known) of a GPU kernel name by :data:`KERNEL_RULES`; an unmatched name is ``("rest", False)``."""
    for bucket, rx in _RULES:
        if rx.search(name):
            return bucket, True
    return "rest", False


def parse_step_counts(name: str) -> tuple[int, int, int, int] | None:
    """``(A, T, B, U)`` of an engine step from vLLM's profiler annotation (``execute_context_A(T)_generation_B(U)``,
    or the detailed form ``execute_N_context_A(sqT...)_generation_B(sqU...)``): A requests in prefill (context)
    with T tokens, B past their prompt (generation: a diffusion request's canvas rows) with U tokens; None if
    ``name`` is not one."""
    m = _STEP_RE.match(name)
    if not m:
        return None
    return int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))


def parse_step_annotation(name: str) -> int | None:
    """Tokens of an engine step from vLLM's profiler annotation (:func:`parse_step_counts`): T + U; None if
    ``name`` is not one."""
    c = parse_step_counts(name)
    return None if c is None else c[1] + c[3]


def read_trace(path: str | os.PathLike) -> tuple[list[dict], int | None]:
    """The ``traceEvents`` of a chrome trace file (``.json`` or ``.json.gz``) and its ``baseTimeNanoseconds`` (the
    Unix time in ns of the events' ``ts`` origin, which the torch profiler writes; None when absent).

    Raises:
        ValueError: the file holds no ``traceEvents`` list.
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list (not a chrome trace)")
    base = doc.get("baseTimeNanoseconds") if isinstance(doc, dict) else None
    return events, (int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else None)


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The ``traceEvents`` of a chrome trace file (:func:`read_trace` without the base time)."""
    return read_trace(path)[0]


def clock_offset_s(samples: int = 5) -> float:
    """``time.time() - time.perf_counter()`` (s), read where the two reads are closest: maps the client's
    ``perf_counter`` request times (``start_times`` of ``vllm bench serve``'s result; CLOCK_MONOTONIC, shared by the
    machine's processes) to Unix time, the trace's clock."""
    best = None
    for _ in range(max(1, samples)):
        a = time.perf_counter()
        w = time.time()
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) / 2)
    return best[1]


def request_windows(result: dict, offset_s: float) -> list[tuple[float, float, float]]:
    """``(sent, first_output, done)`` Unix times (s) of each completed request of a ``vllm bench serve`` detailed
    result: ``start_times`` (perf_counter) + ``offset_s`` (:func:`clock_offset_s`), + ``ttfts``, + the sum of
    ``itls``. Requests with no output (failed) are left out; a result without the per-request lists gives []."""
    starts, ttfts, itls = result.get("start_times"), result.get("ttfts"), result.get("itls")
    lens = result.get("output_lens")
    if not (isinstance(starts, list) and isinstance(ttfts, list) and isinstance(itls, list)):
        return []
    out = []
    for i, (s0, t, gaps) in enumerate(zip(starts, ttfts, itls)):
        if not isinstance(s0, (int, float)) or not isinstance(t, (int, float)) or t <= 0:
            continue
        if isinstance(lens, list) and i < len(lens) and not lens[i]:
            continue
        first = s0 + offset_s + t
        out.append((s0 + offset_s, first, first + sum(g for g in (gaps or []) if isinstance(g, (int, float)))))
    return sorted(out)


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint ``(start, end)`` intervals (touching ones merge)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def launch_kind(launch_name: str | None) -> str:
    """How a kernel was launched, from the name of its launch event (the CPU runtime / driver call with the same
    ``correlation``): ``"graph"`` (``cudaGraphLaunch`` / ``cuGraphLaunch``: one of a CUDA graph's kernels),
    ``"eager"`` (any other launch: ``cudaLaunchKernel``, ``cuLaunchKernelEx``, a memcpy), ``"no_launch"`` (None: the
    launch is not in the trace)."""
    if launch_name is None:
        return "no_launch"
    return "graph" if "GraphLaunch" in launch_name else "eager"


def gap_sites(kernels: Sequence[dict], labels: dict[int, str], *, steps: int = 0, top: int = 8,
              launches: dict[int, tuple[str, object]] | None = None, name_chars: int = 60) -> dict:
    """Every GPU idle gap between kernels, however short, by where it sits: the label of the kernel whose end
    opens it and of the kernel whose start closes it (``labels``: ``id(kernel event)`` -> ``"phase:bucket"`` as
    :func:`summarize_trace` classifies them, e.g. ``"forward:moe"``, ``"sample:sampler"``; unlabelled: ``"?"``),
    the two kernels' names, and how the closing kernel was launched.
    Short gaps add up: a CUDA graph's kernel-to-kernel gaps (~1-2 us each) over ~1,000 kernels a step, or eagerly
    launched kernels waiting for the host, neither of which ``idle_attribution`` (gaps >= ``min_gap_us``) sees.

    Args:
        kernels: GPU kernel events (``ts``, ``dur`` in us; ``name``). steps: canvas steps in the trace (>= 0; 0: no
            per-step figures). top: how many pairs to list. launches: ``id(kernel event)`` -> ``(kind, launch id)``
            (:func:`launch_kind`; the id is the launch's ``correlation``: every kernel of one graph replay shares
            it); None: every kernel ``"no_launch"``. name_chars: kernel names are cut to this many characters.

    Returns:
        dict: ``total_ms`` (equal to the span minus the busy time), ``gaps`` (count), ``by_phase``:
        ``"before>after"`` phases (e.g. ``"forward>forward"``: inside the forward, ``"sample>forward"``: between a
        step's sampler and the next forward) -> ms; ``per_canvas_step_ms`` (``by_phase`` / ``steps``, None without
        steps); ``pairs``: the ``top`` ``(before, after, ms, count)`` by ms; ``by_launch``: where the gap sits
        against the launches -> ``[ms, count]``: ``"in_graph"`` (both kernels of one graph replay: the graph's own
        kernel-to-kernel gap), ``"graph_start"`` (the closing kernel opens another graph replay), ``"eager"`` (it
        was launched eagerly: the gap is the host's launch pace or a dependency), ``"no_launch"``;
        ``kernel_pairs``: the ``top`` ``(before name, after name, ms, count)`` by ms.
    """
    total, count = 0.0, 0
    by_phase: dict[str, float] = {}
    pairs: dict[tuple[str, str], list] = {}
    named: dict[tuple[str, str], list] = {}
    by_launch: dict[str, list] = {}
    launches = launches or {}
    end, last = None, None
    for k in sorted(kernels, key=lambda e: float(e["ts"])):
        a = float(k["ts"])
        b = a + float(k.get("dur", 0))
        if end is not None and a > end:
            before, after = labels.get(id(last), "?"), labels.get(id(k), "?")
            g = (a - end) / 1e3
            total += g
            count += 1
            key = before.split(":")[0] + ">" + after.split(":")[0]
            by_phase[key] = by_phase.get(key, 0.0) + g
            for table, pk in ((pairs, (before, after)),
                              (named, (str(last.get("name", ""))[:name_chars], str(k.get("name", ""))[:name_chars]))):
                ent = table.setdefault(pk, [0.0, 0])
                ent[0] += g
                ent[1] += 1
            kind, lid = launches.get(id(k), ("no_launch", None))
            if kind == "graph":
                kind = "in_graph" if launches.get(id(last), (None, None)) == ("graph", lid) else "graph_start"
            ent = by_launch.setdefault(kind, [0.0, 0])
            ent[0] += g
            ent[1] += 1
        if end is None or b > end:
            end, last = b, k

    def ranked(table):
        return [(p[0], p[1], v[0], v[1]) for p, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]

    return {
        "total_ms": total, "gaps": count, "by_phase": by_phase,
        "per_canvas_step_ms": {p: v / steps for p, v in by_phase.items()} if steps else None,
        "pairs": ranked(pairs), "by_launch": by_launch, "kernel_pairs": ranked(named),
    }


def summarize_trace(events: Iterable[dict], *, canvas_length: int = CANVAS_LENGTH, max_canvases: int = 2,
                    top: int = 8, min_gap_us: float = 1000.0,
                    requests: Sequence[tuple[float, float, float]] | None = None, base_ns: int | None = None) -> dict:
    """GPU kernel time per forward step and bucket (:data:`BUCKETS`) of a vLLM torch-profiler trace.

    Steps are vLLM's ``execute_*`` annotations (one per engine step, on the worker's CPU timeline). A kernel
    belongs to the step during or after whose annotation it was launched (its launch is the CPU runtime / driver
    event with the kernel's ``correlation`` id; a kernel inside a CUDA graph shares the graph launch's); launched
    inside the annotation it is part of the forward, after it (the runner's ``sample_tokens``: LM head, logits
    softcap, the diffusion sampler, bookkeeping) part of the sample phase; a kernel whose launch is not in the trace
    is placed by its GPU start and classified by name alone (``phase_ms["no_launch"]``). Buckets: by kernel name
    (:func:`classify_kernel`), except in the sample phase, where the first GEMM is the LM head (``gemm``) and
    everything else not attention / MoE by name is ``sampler`` (stock vLLM's sampler is torch.compile'd Triton code
    whose kernel names do not say so; blockdiff's soft-embedding GEMM runs on cuBLAS). A step of at most
    ``canvas_length * max_canvases`` tokens, a multiple of ``canvas_length``, with no request in prefill (the
    annotation's context count 0), is a canvas step (denoise / commit rows only); the others are prefill steps,
    those that also hold canvas rows counted as ``mixed_steps`` too (a 4096-token prompt is a multiple of 256
    within 64 canvases' tokens: the context count, not the size, tells it from canvas rows).

    Args:
        events: chrome trace events (:func:`load_trace`).
        canvas_length: tokens per canvas. max_canvases: the most canvases one step of the profiled load holds (its
            concurrency).
        top: how many kernel names to list per bucket and among the unknown ones (and gaps / CPU labels in
            ``timeline["idle_attribution"]``).
        min_gap_us: the shortest GPU idle gap (us) that :func:`attribute_idle_gaps` attributes.
        requests: ``(sent, first_output, done)`` Unix times (s) of the profiled load's requests
            (:func:`request_windows`), with ``base_ns`` (:func:`read_trace`): adds ``timeline["load"]``
            (:func:`load_window`), the client's view of the load against the GPU's.

    Returns:
        dict: ``steps``, ``canvas_steps``, ``prefill_steps`` (``mixed_steps`` of them also hold canvas rows);
        ``canvas_step_ms`` / ``prefill_step_ms``: bucket ->
        mean kernel ms per step (``total`` too), ``canvas_step_median_ms``; ``canvas_step_share``; ``total_ms``
        per bucket over all steps, ``outside_ms`` (kernels before the first step); ``unknown_ms``,
        ``unknown_share`` and ``unknown_kernels`` (name, ms, count); ``top_kernels`` per bucket;
        ``phase_ms`` (forward / sample); ``timeline``: ``gpu_span_ms`` (first kernel at or after the first step
        to the last kernel's end), ``gpu_busy_ms`` (the union of kernel intervals in it), ``gpu_busy_share``,
        ``idle_gaps_over_1ms`` / ``idle_gaps_over_1ms_total_ms`` / ``idle_gap_max_ms`` (gaps between busy
        intervals), ``canvas_step_cadence_median_ms`` (a canvas step's annotation start to the next step's: the
        host's pace, against ``canvas_step_ms["total"]``), ``idle_attribution`` (:func:`attribute_idle_gaps` of
        the gaps of at least ``min_gap_us``), ``gap_sites`` (:func:`gap_sites`: every gap, short ones included,
        by the kernels on either side and how the closing one was launched), ``forward_launches_per_canvas_step``
        (mean per canvas step of the forward's distinct graph replays, ``graph_replays``, of its eagerly
        launched kernels, ``eager_kernels``, and of the step's kernels whose launch is not in the trace,
        ``kernels_without_launch``; None without canvas steps); ``rules`` (the table used).

    Raises:
        ValueError: the trace has no ``execute_*`` step annotation or no GPU kernel, or an argument < 1.
    """
    _check_int("canvas_length", canvas_length, 1)
    _check_int("max_canvases", max_canvases, 1)
    events = events if isinstance(events, list) else list(events)
    launches: dict[int, float] = {}
    launch_names: dict[int, str] = {}
    steps: list[tuple[float, float, int, int, int]] = []  # start, end, tokens, prefill requests, canvas requests
    gpu: list[dict] = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in _GPU_CATS:
            gpu.append(e)
        elif cat in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = float(e["ts"])
                launch_names[corr] = str(e.get("name", ""))
        elif cat == "user_annotation":
            counts = parse_step_counts(str(e.get("name", "")))
            if counts is not None:
                steps.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), counts[1] + counts[3],
                              counts[0], counts[2]))
    if not steps:
        raise ValueError("the trace has no execute_* step annotation (was the server profiled by vLLM's worker?)")
    if not gpu:
        raise ValueError("the trace has no GPU kernel (profiled without CUDA activity?)")
    steps.sort()
    starts = [s[0] for s in steps]
    per_step = [{b: 0.0 for b in BUCKETS} for _ in steps]
    first_gemm_done = [False] * len(steps)
    totals = {b: 0.0 for b in BUCKETS}
    outside = 0.0
    phase_ms = {"forward": 0.0, "sample": 0.0, "no_launch": 0.0}
    unknown: dict[str, list] = {}
    names: dict[str, dict[str, list]] = {b: {} for b in BUCKETS}
    labels: dict[int, str] = {}  # id(kernel event) -> "phase:bucket", for gap_sites
    how: dict[int, tuple[str, object]] = {}  # id(kernel event) -> (launch kind, correlation), for gap_sites
    step_launches = [{"graph": set(), "eager": 0, "no_launch": 0} for _ in steps]  # forward launches per step
    for k in sorted(gpu, key=lambda e: (launches.get((e.get("args") or {}).get("correlation"), float(e["ts"])),
                                        float(e["ts"]))):
        name = str(k.get("name", ""))
        ms = float(k.get("dur", 0)) / 1e3
        corr = (k.get("args") or {}).get("correlation")
        launch = launches.get(corr)
        kind = launch_kind(launch_names.get(corr) if launch is not None else None)
        how[id(k)] = (kind, corr)
        i = bisect.bisect_right(starts, float(k["ts"]) if launch is None else launch) - 1
        bucket, known = classify_kernel(name)
        if i < 0:
            outside += ms
            labels[id(k)] = "outside"
            continue
        # without its launch event the phase is unknown (GPU time lags the CPU's): the name alone decides
        phase = "no_launch" if launch is None else "forward" if launch <= steps[i][1] else "sample"
        if phase == "sample" and bucket not in ("attention", "moe"):
            if bucket == "gemm" and not first_gemm_done[i]:
                first_gemm_done[i] = True
            else:
                bucket, known = "sampler", True
        labels[id(k)] = f"{phase}:{bucket}"
        if phase == "forward":
            if kind == "graph":
                step_launches[i]["graph"].add(corr)
            else:
                step_launches[i]["eager"] += 1
        elif phase == "no_launch":
            step_launches[i]["no_launch"] += 1
        phase_ms[phase] += ms
        per_step[i][bucket] += ms
        totals[bucket] += ms
        ent = names[bucket].setdefault(name, [0.0, 0])
        ent[0] += ms
        ent[1] += 1
        if not known:
            u = unknown.setdefault(name, [0.0, 0])
            u[0] += ms
            u[1] += 1
    limit = canvas_length * max_canvases
    canvas = [i for i, s in enumerate(steps)
              if s[2] <= limit and s[2] % canvas_length == 0 and s[2] > 0 and s[3] == 0]
    canvas_set = set(canvas)
    prefill = [i for i, s in enumerate(steps) if i not in canvas_set and s[2] > 0]
    mixed = [i for i in prefill if steps[i][3] > 0 and steps[i][4] > 0]

    def mean_of(idx):
        if not idx:
            return None
        out = {b: statistics.fmean(per_step[i][b] for i in idx) for b in BUCKETS}
        out["total"] = statistics.fmean(sum(per_step[i].values()) for i in idx)
        return out

    cmean = mean_of(canvas)
    grand = sum(totals.values())
    # the timeline: how busy the GPU was from the first step's first kernel to the last kernel, and the host's
    # cadence (one step annotation start to the next) against each canvas step's kernel time
    ivs = sorted((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in gpu
                 if float(k["ts"]) >= starts[0])
    merged = merge_intervals(ivs)
    busy = sum(b - a for a, b in merged)
    gap_ivs = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    gaps = [b - a for a, b in gap_ivs]
    span = max(b for _, b in ivs) - ivs[0][0] if ivs else 0.0
    cadence = [(steps[i + 1][0] - steps[i][0]) / 1e3 for i in canvas if i + 1 < len(steps)]
    big = [g / 1e3 for g in gaps if g >= 1000.0]
    timeline = {
        "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_busy_share": busy / span if span else None,
        "idle_gaps_over_1ms": len(big), "idle_gaps_over_1ms_total_ms": sum(big),
        "idle_gap_max_ms": max(gaps, default=0.0) / 1e3,
        "canvas_step_cadence_median_ms": statistics.median(cadence) if cadence else None,
        "idle_attribution": attribute_idle_gaps(events, steps, [g for g in gap_ivs if g[1] - g[0] >= min_gap_us],
                                                span_start=ivs[0][0] if ivs else 0.0, top=top),
        "gap_sites": gap_sites([k for k in gpu if float(k["ts"]) >= starts[0]], labels, steps=len(canvas), top=top,
                               launches=how),
        # how a canvas step's forward reached the GPU: graph replays (1: one full graph; ~1 + layers: piecewise)
        # and eagerly launched kernels (kernels, not launches, of the forward phase)
        "forward_launches_per_canvas_step": {
            "graph_replays": statistics.fmean(len(step_launches[i]["graph"]) for i in canvas),
            "eager_kernels": statistics.fmean(step_launches[i]["eager"] for i in canvas),
            "kernels_without_launch": statistics.fmean(step_launches[i]["no_launch"] for i in canvas)}
        if canvas else None,
    }
    if requests and base_ns is not None:
        last_ev = max((float(e["ts"]) + float(e.get("dur", 0)) for e in events
                       if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e), default=None)
        timeline["load"] = load_window(events, steps, gpu, requests, base_ns, top=top, trace_end_us=last_ev)
    elif requests is not None:
        timeline["load"] = {"reason": "no baseTimeNanoseconds in the trace: the client's window cannot be placed"
                            if base_ns is None else "no completed request with per-request times"}
    unk_ms = sum(v[0] for v in unknown.values())
    return {
        "steps": len(steps), "canvas_steps": len(canvas), "prefill_steps": len(prefill), "mixed_steps": len(mixed),
        "canvas_step_tokens": sorted({steps[i][2] for i in canvas}),
        "canvas_step_ms": cmean,
        "canvas_step_median_ms": ({b: statistics.median(per_step[i][b] for i in canvas) for b in BUCKETS}
                                  | {"total": statistics.median(sum(per_step[i].values()) for i in canvas)}
                                  if canvas else None),
        "canvas_step_share": ({b: cmean[b] / cmean["total"] for b in BUCKETS} if cmean and cmean["total"] else None),
        "prefill_step_ms": mean_of(prefill),
        "total_ms": totals, "outside_ms": outside, "phase_ms": phase_ms, "timeline": timeline,
        "unknown_ms": unk_ms, "unknown_share": unk_ms / grand if grand else None,
        "unknown_kernels": [(n, v[0], v[1]) for n, v in sorted(unknown.items(), key=lambda kv: -kv[1][0])[:top]],
        "top_kernels": {b: [(n, v[0], v[1]) for n, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
                        for b, d in names.items()},
        "rules": [list(r) for r in KERNEL_RULES],
    }


#: CPU-side trace categories :func:`attribute_idle_gaps` reads (the torch profiler's names).
_CPU_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


def _step_kind(prefill_requests: int, canvas_requests: int) -> str:
    if prefill_requests and canvas_requests:
        return "mixed"
    return "prefill" if prefill_requests else "canvas"


def load_window(events: Sequence[dict], steps: Sequence[tuple[float, float, int, int, int]], gpu: Sequence[dict],
                requests: Sequence[tuple[float, float, float]], base_ns: int, *, top: int = 8,
                trace_end_us: float | None = None) -> dict:
    """The profiled load as the client saw it, against the GPU timeline of the same trace.

    The window runs from the first request sent to the last one done (the client's ``duration`` without its own
    start-up), cut at ``trace_end_us`` when the trace stops earlier (``window_cut_ms`` says by how much).
    ``lead_in_ms``: from the window's start to the first GPU activity inside it (0 when a kernel is already
    running); ``tail_ms``: from the last GPU activity inside it to its end; the whole window (lead-in) when no
    kernel overlaps it. ``gpu_busy_ms`` / ``gpu_busy_share``: the union of kernel intervals inside the window.
    ``lead_in`` / ``tail`` hold :func:`attribute_idle_gaps` of those two stretches (the engine's CPU events there).
    ``admission``: the i-th ``blockdiff:add_request`` CPU range (``user_annotation``; Kineto also writes a
    ``gpu_user_annotation`` copy of a range that launches GPU work, not counted) in the window against the i-th
    request sent, a rank match, not per request id (a failed request that reached the engine, or a preempted one
    added again, shifts it): how long a request waited before its first scheduled step (the API server, the
    engine's queue, the token budget of the prefill steps), median and max ms and the first / last pairs;
    ``steps`` in the window and ``first_step_ms`` after the first send.

    Args:
        events: chrome trace events. steps: the step annotations (:func:`summarize_trace`). gpu: GPU events
            (``ts``, ``dur`` in us). requests: ``(sent, first_output, done)`` Unix times (s).
        base_ns: the trace's ``baseTimeNanoseconds``. top: labels per stretch. trace_end_us: the trace's last
            event (us), None: no cut.
    """
    def us(t):  # Unix s -> trace us
        return (t * 1e9 - base_ns) / 1e3

    sent = sorted(us(r[0]) for r in requests)
    ws, we_client = sent[0], max(us(r[2]) for r in requests)
    we = we_client if trace_end_us is None else min(we_client, trace_end_us)
    we = max(we, ws)
    win = sorted((max(a, ws), min(b, we)) for a, b in
                 ((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in gpu) if b > ws and a < we)
    busy = sum(b - a for a, b in merge_intervals(win))
    if win:
        lead = win[0][0] - ws
        tail = we - max(b for _, b in win)
    else:
        lead, tail = we - ws, 0.0
    in_steps = [st for st in steps if ws <= st[0] <= we]
    adds = sorted(float(e["ts"]) for e in events if isinstance(e, dict) and e.get("ph") == "X"
                  and e.get("cat") == "user_annotation" and e.get("name") == "blockdiff:add_request"
                  and ws <= float(e["ts"]) <= we)
    lags = [(a - s0) / 1e3 for s0, a in zip(sent, adds)]
    span = we - ws
    return {
        "requests": len(requests), "window_ms": span / 1e3, "window_cut_ms": (we_client - we) / 1e3,
        "lead_in_ms": lead / 1e3, "tail_ms": tail / 1e3,
        "gpu_busy_ms": busy / 1e3, "gpu_busy_share": busy / span if span > 0 else None,
        "steps": len(in_steps), "first_step_ms": (in_steps[0][0] - ws) / 1e3 if in_steps else None,
        "lead_in": attribute_idle_gaps(events, steps, [(ws, ws + lead)] if lead > 0 else [], span_start=ws, top=top),
        "tail": attribute_idle_gaps(events, steps, [(we - tail, we)] if tail > 0 else [], span_start=ws, top=top),
        "admission": {"matched": len(lags), "median_ms": statistics.median(lags) if lags else None,
                      "max_ms": max(lags) if lags else None, "first_ms": lags[:3], "last_ms": lags[-3:]},
    }


def attribute_idle_gaps(events: Sequence[dict], steps: Sequence[tuple[float, float, int, int, int]],
                        gaps: Sequence[tuple[float, float]], *, span_start: float = 0.0, top: int = 8) -> dict:
    """What the host was doing while the GPU sat idle: each GPU idle gap against the CPU side of the same trace.

    A gap is placed relative to vLLM's step annotations (``execute_*``, the worker's forward): ``in_step`` when it
    starts inside one (the forward's host side ran behind the GPU: launches, Python, a host sync), otherwise
    ``between_steps`` (after a forward's annotation: the runner's sample phase, output processing, the scheduler,
    or no work). The CPU events (:data:`_CPU_CATS`, every thread) that overlap a gap are summed by label, the
    overlap counted once per label (nested events each count for their own label); a step annotation's label is
    ``step:<kind>`` (prefill / mixed / canvas). ``covered_ms`` is the part of the gaps inside at least one CPU event
    of any thread; the rest (``uncovered_ms``) is host time the profiler does not record (pure Python: the
    scheduler, the engine core's loop, input preparation) or waiting for requests.

    Args:
        events: chrome trace events (:func:`load_trace`).
        steps: ``(start_us, end_us, tokens, prefill_requests, canvas_requests)`` of each step annotation, sorted.
        gaps: ``(start_us, end_us)`` GPU idle intervals, sorted and disjoint.
        span_start: the GPU span's start (us), the origin of each listed gap's ``at_ms``.
        top: how many labels and gaps to list.

    Returns:
        dict: ``gaps``, ``total_ms``; ``by_position`` (``in_step`` / ``between_steps`` -> ms); ``after_step_kind``
        (the kind of the step the gap starts in or follows -> ms); ``covered_ms``, ``uncovered_ms``;
        ``cpu_labels`` (label, overlap ms, events) by overlap; ``threads`` (thread name or id -> overlap ms);
        ``longest`` (the ``top`` longest gaps: ``at_ms``, ``ms``, ``position``, ``step``, ``next_step``, ``labels``).
    """
    starts = [s[0] for s in steps]
    gstarts = [g[0] for g in gaps]
    names = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", e.get("tid")))
    per_gap: list[dict[str, float]] = [{} for _ in gaps]
    cover: list[list[tuple[float, float]]] = [[] for _ in gaps]
    labels: dict[str, list] = {}
    threads: dict[str, float] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in _CPU_CATS:
            continue
        a = float(e["ts"])
        b = a + float(e.get("dur", 0))
        j = max(bisect.bisect_right(gstarts, a) - 1, 0)
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation":
            c = parse_step_counts(name)
            if c is not None:
                name = "step:" + _step_kind(c[0], c[2])
        while j < len(gaps) and gaps[j][0] < b:
            lo, hi = max(a, gaps[j][0]), min(b, gaps[j][1])
            if hi > lo:
                d = per_gap[j]
                d[name] = d.get(name, 0.0) + (hi - lo)
                cover[j].append((lo, hi))
                ent = labels.setdefault(name, [0.0, 0])
                ent[0] += hi - lo
                ent[1] += 1
                t = names.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
                threads[t] = threads.get(t, 0.0) + (hi - lo)
            j += 1
    by_position = {"in_step": 0.0, "between_steps": 0.0}
    after_kind: dict[str, float] = {}
    covered = 0.0
    listed = []
    for j, (ga, gb) in enumerate(gaps):
        ms = (gb - ga) / 1e3
        i = bisect.bisect_right(starts, ga) - 1
        pos = "in_step" if i >= 0 and ga < steps[i][1] else "between_steps"
        by_position[pos] += ms
        kind = _step_kind(steps[i][3], steps[i][4]) if i >= 0 else "before_first_step"
        after_kind[kind] = after_kind.get(kind, 0.0) + ms
        c = sum(hi - lo for lo, hi in merge_intervals(cover[j]))
        covered += c / 1e3

        def desc(k):
            if k < 0 or k >= len(steps):
                return None
            s = steps[k]
            return {"kind": _step_kind(s[3], s[4]), "tokens": s[2], "prefill_requests": s[3],
                    "canvas_requests": s[4]}
        listed.append({"at_ms": (ga - span_start) / 1e3, "ms": ms, "position": pos, "step": desc(i),
                       "next_step": desc(i + 1), "covered_ms": c / 1e3,
                       "labels": [(n, v / 1e3) for n, v in sorted(per_gap[j].items(), key=lambda kv: -kv[1])[:top]]})
    total = sum((gb - ga) for ga, gb in gaps) / 1e3
    return {
        "gaps": len(gaps), "total_ms": total, "by_position": by_position, "after_step_kind": after_kind,
        "covered_ms": covered, "uncovered_ms": total - covered,
        "cpu_labels": [(n, v[0] / 1e3, v[1]) for n, v in sorted(labels.items(), key=lambda kv: -kv[1][0])[:3 * top]],
        "threads": {k: v / 1e3 for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        "longest": sorted(listed, key=lambda g: -g["ms"])[:top],
    }


def find_traces(trace_dir: str | os.PathLike, since: float = 0.0) -> list[Path]:
    """Chrome trace files (``*.json`` / ``*.json.gz``) under ``trace_dir`` modified at or after ``since`` (epoch
    seconds), oldest first."""
    d = Path(trace_dir)
    if not d.is_dir():
        return []
    files = [p for p in d.rglob("*") if p.is_file() and (p.name.endswith(".json") or p.name.endswith(".json.gz"))
             and p.stat().st_mtime >= since]
    return sorted(files, key=lambda p: p.stat().st_mtime)


def summarize_traces(paths: Sequence[str | os.PathLike], **kw) -> dict:
    """:func:`summarize_trace` of the one trace among ``paths`` that holds step annotations and GPU kernels (the
    engine core's worker; vLLM writes one per worker, plus the API server's unless ``ignore_frontend``).

    Raises:
        ValueError: no such trace among ``paths`` (each file's problem named).
    """
    problems = []
    for p in paths:
        try:
            events, base_ns = read_trace(p)
            out = summarize_trace(events, base_ns=base_ns, **kw)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            problems.append(f"{p}: {e}")
            continue
        out["trace_file"] = str(p)
        return out
    raise ValueError("no usable trace: " + ("; ".join(problems) if problems else "no files"))


def _post(url: str, timeout: float) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status


def _terminate_as_exit(signum, frame):  # SIGTERM (a `timeout` around the command) unwinds: finally clauses run
    raise SystemExit(128 + signum)


def profile(args) -> dict:
    """The ``profile`` subcommand: returns the summary written to ``--out``. A SIGTERM during the profiled load
    still sends ``/stop_profile`` (the server's profiler is never left on)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return _profile(args)
    previous = signal.signal(signal.SIGTERM, _terminate_as_exit)
    try:
        return _profile(args)
    finally:  # the caller's handler back (bench_serve.main also runs inside other processes, e.g. the tests)
        signal.signal(signal.SIGTERM, previous)


def _profile(args) -> dict:
    """:func:`profile`'s body."""
    base = args.base_url.rstrip("/")
    work = _work_dir(args)
    t0 = time.time()
    warm = args.requests if args.warm_requests is None else args.warm_requests
    summary: dict = {"backend": args.backend, "quant": args.quant, "requests": args.requests,
                     "warm_requests": warm, "trace_dir": str(args.trace_dir), "env": environment(),
                     "skip_special_tokens": effective_skip_special_tokens(args.skip_special_tokens),
                     "load_format": args.load_format}
    if warm > 0:  # the same batch shapes once, unprofiled: first-use JIT compiles land here, not in the trace
        name = f"profile_warm_{args.quant}-{args.backend}"
        t_warm = time.perf_counter()
        bargs = bench_serve_args(base_url=base, model=args.model, concurrency=warm, num_prompts=warm,
                                 num_warmups=0, result_dir=str(work), result_filename=f"{name}.json", seed=54321,
                                 skip_special_tokens=args.skip_special_tokens)
        result, why = run_bench_serve(args.bench_cmd, bargs, result_path=work / f"{name}.json",
                                      log_path=work / f"{name}.log", timeout_s=args.run_timeout)
        summary["warm_up"] = {"requests": warm, "s": round(time.perf_counter() - t_warm, 3), "ok": result is not None}
        if result is None:
            summary["warm_up"]["reason"] = why
    try:
        _post(base + "/start_profile", timeout=120)
    except (OSError, urllib.error.URLError, ValueError) as e:  # nothing started: no /stop_profile to send
        raise _UserError(f"--base-url {args.base_url!r}: POST /start_profile failed ({e}); is the server up with "
                         "the profiler on (server-cmd --trace-dir)?") from None
    try:
        name = f"profile_{args.quant}-{args.backend}"
        bargs = bench_serve_args(base_url=base, model=args.model, concurrency=args.requests, num_prompts=args.requests,
                                 num_warmups=0, result_dir=str(work), result_filename=f"{name}.json", seed=12345,
                                 ready_check_timeout_s=0,  # no untimed test request inside the trace
                                 skip_special_tokens=args.skip_special_tokens)
        offset = clock_offset_s()
        with HostCpuSampler(args.server_pid) as cpu:
            result, why = run_bench_serve(args.bench_cmd, bargs, result_path=work / f"{name}.json",
                                          log_path=work / f"{name}.log", timeout_s=args.run_timeout)
        summary["host_cpu"] = cpu.result(series=True)
    finally:
        try:
            _post(base + "/stop_profile", timeout=args.stop_timeout)  # the worker writes its trace before answering
        except (OSError, urllib.error.URLError) as e:
            summary["stop_error"] = str(e)
    summary["load"] = (row_from_result(result, backend=args.backend, quant=args.quant, max_num_seqs=None)
                       if result is not None else {"status": "error", "reason": why})
    traces = find_traces(args.trace_dir, since=t0 - 1)
    summary["trace_files"] = [str(p) for p in traces]
    windows = request_windows(result, offset) if result is not None else None
    try:
        summary.update(summarize_traces(list(reversed(traces)), max_canvases=args.requests, requests=windows))
        if result is not None and isinstance(summary.get("timeline"), dict) and \
                isinstance(summary["timeline"].get("load"), dict) and result.get("duration") is not None:
            ld = summary["timeline"]["load"]
            ld["client_duration_ms"] = float(result["duration"]) * 1e3
            if windows and ld.get("tail_ms") and (summary.get("host_cpu") or {}).get("series"):
                end = max(w[2] for w in windows)  # the host's threads while the GPU sat idle at the load's end
                ld["tail_host_cpu"] = host_cpu_between(summary["host_cpu"]["series"], end - ld["tail_ms"] / 1e3, end)
        summary["status"] = "ok"
    except ValueError as e:
        summary.update(status="error", reason=str(e))
    return summary


# --------------------------------------------------------------------------------------------- record
#: Row fields that are numbers (or null) in every sweep row; :func:`read_rows` refuses other values.
ROW_NUMBERS = ("concurrency", "max_num_seqs", "num_prompts", "completed", "failed", "output_tok_s", "total_tok_s",
               "ttft_ms", "time_per_canvas_ms", "diffusion_steps_per_canvas", "peak_memory_bytes")
#: Row fields :func:`record` reads as names (grouping keys, labels): a string or null.
ROW_STRINGS = ("backend", "quant", "status")
#: Row fields :func:`record` reads as flags: a JSON bool or null (a string "false" would count as true).
ROW_BOOLS = ("complete", "steps_ok", "enforce_eager", "skip_special_tokens")


def _row_problem(obj: dict) -> str | None:
    """Why a sweep row cannot go into a record (:func:`read_rows`' rules, field named), or None."""
    if not isinstance(obj.get("workload"), str):
        return f"a row needs a 'workload' string (a sweep row), got {obj.get('workload')!r}"
    try:
        effective_load_format(obj.get("load_format"))
    except ValueError as e:
        return f"{e} (or absent)"
    for k in ROW_NUMBERS:
        v = obj.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"{k} must be a number or null, got {v!r}"
        if not finite(v) or v < 0:  # (json reads NaN / Infinity: a goal then compared NaN, met False)
            return f"{k} must be a finite number >= 0 or null, got {show_number(v)}"
    c = obj.get("concurrency")
    if c is not None and (not isinstance(c, int) or c < 1):
        return f"concurrency must be an int >= 1 (requests in flight) or null, got {c!r}"
    if obj.get("status") == "ok" and obj.get("output_tok_s") is not None and c is None:
        return "an ok row with output_tok_s needs its concurrency (the plot's x axis)"
    for k in ROW_STRINGS:
        if obj.get(k) is not None and not isinstance(obj[k], str):
            return f"{k} must be a string or null, got {obj[k]!r}"
    for k in ROW_BOOLS:
        if obj.get(k) is not None and not isinstance(obj[k], bool):
            return f"{k} must be true, false or null, got {obj[k]!r}"
    return None


def _env_problem(env: dict) -> str | None:
    """Why an env record cannot go into a record (its ``setting`` an object with a known ``load_format``), or None."""
    setting = env.get("setting")
    if setting is None:
        return None
    if not isinstance(setting, dict):
        return f"env setting must be a JSON object or null, got {setting!r}"
    try:
        effective_load_format(setting.get("load_format"))
    except ValueError as e:
        return f"env setting: {e} (or absent)"
    return None


def read_rows(paths: Sequence[str | os.PathLike]) -> tuple[list[dict], list[dict]]:
    """(environment records, rows) from sweep JSON-lines files (a line ``{"env": ...}`` is an environment).

    Raises:
        ValueError: a line that is not a JSON object, an ``env`` that is not one (or whose ``setting`` is not an
            object with a known ``load_format``), a row without a ``workload`` string, with a :data:`ROW_NUMBERS`
            field that is not a finite number >= 0 (NaN / Infinity included; ``concurrency`` an int >= 1, required on
            an ok row with ``output_tok_s``), a :data:`ROW_STRINGS` field that is not a string, a :data:`ROW_BOOLS`
            field that is not a bool, or a ``load_format`` outside :data:`LOAD_FORMATS` (file, line and field named).
        OSError: a file that cannot be read.
    """
    envs, rows = [], []
    for p in paths:
        with open(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not JSON ({e})") from e
                if not isinstance(obj, dict):
                    raise ValueError(f"{p}:{n}: not a JSON object")
                if "env" in obj:
                    if not isinstance(obj["env"], dict):
                        raise ValueError(f"{p}:{n}: env must be a JSON object, got {type(obj['env']).__name__}")
                    why = _env_problem(obj["env"])
                    if why:
                        raise ValueError(f"{p}:{n}: {why}")
                    envs.append(obj["env"])
                    continue
                why = _row_problem(obj)
                if why:
                    raise ValueError(f"{p}:{n}: {why}")
                rows.append(obj)
    return envs, rows


def _is_blockdiff(row: dict) -> bool:
    return str(row.get("backend", "")).startswith("blockdiff")


def _tok_s(row: dict) -> float | None:
    """The row's output tokens/s as a throughput goal counts it: an ok row, complete, and of the setting (vLLM's
    count of denoising steps per canvas 16, ``steps_ok``; a row of fewer steps per canvas, or with no count, measured
    another or an unknown workload), else None."""
    v = row.get("output_tok_s")
    ok = row.get("status") == "ok" and row.get("complete") and row.get("steps_ok") is True
    return v if ok and isinstance(v, (int, float)) else None


def _throughput_goals(rows: list[dict], load_format: str) -> list[dict]:
    """:func:`evaluate_goals`' throughput goals on the rows of one load format."""
    goals = []
    suffix = "" if load_format == DUMMY else f"@{load_format}"
    # only measured rows (status ok) have a throughput, so only their client setting counts: a skipped row (past the
    # sweep's deadline: no client ran, and rows before this fix lack the field, read as vLLM's default) was listed
    # as left out for another setting
    setting = [effective_skip_special_tokens(r.get("skip_special_tokens")) for r in rows]
    measured = {v for r, v in zip(rows, setting) if r.get("status") == "ok"}
    mixed = len(measured) > 1
    judged = effective_skip_special_tokens(SKIP_SPECIAL_TOKENS) if mixed else next(iter(measured),
                                                                                   SKIP_SPECIAL_TOKENS)
    tput_rows = [r for r, v in zip(rows, setting) if v == judged]
    left_out = sorted(r.get("workload", "?") + "/" + str(r.get("backend"))
                      for r, v in zip(rows, setting) if v != judged and r.get("status") == "ok")

    def best(pred):
        vals = [_tok_s(r) for r in tput_rows if pred(r)]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    def goal(name, desc, value, target, ok):
        g = {"name": name + suffix, "description": desc, "value": value, "target": target,
             "met": None if value is None else bool(ok), "skip_special_tokens": judged, "load_format": load_format}
        if left_out:
            g["left_out"] = left_out
        goals.append(g)

    bd1 = best(lambda r: _is_blockdiff(r) and r.get("workload") == "serve_c1_fp8")
    v1 = best(lambda r: r.get("backend") == "vllm" and r.get("workload") == "serve_c1_fp8")
    ratio = bd1 / v1 if bd1 is not None and v1 else None
    goal("c1_fp8_vs_vllm", "concurrency 1, FP8: blockdiff output tok/s / stock vLLM's (same run)", ratio, 1.25,
         ratio is not None and ratio >= 1.25)
    goal("c1_fp8_tok_s", "concurrency 1, FP8: blockdiff output tok/s", bd1, 1600.0, bd1 is not None and bd1 >= 1600)
    for quant in sorted({r.get("quant") for r in tput_rows if r.get("quant")}):
        stock = best(lambda r: r.get("backend") == "vllm" and r.get("quant") == quant)
        for c in (16, 64):
            bd = best(lambda r: _is_blockdiff(r) and r.get("workload") == f"serve_c{c}_{quant}")
            ratio = bd / stock if bd is not None and stock else None
            goal(f"c{c}_{quant}", f"concurrency {c}, {quant}: blockdiff output tok/s / stock vLLM's best in {quant} "
                 f"(any concurrency)", ratio, 2.0, ratio is not None and ratio >= 2.0)
    return goals


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """Issue 25's goals on the rows (``met`` None when the rows to judge are missing):

    - ``c1_fp8_vs_vllm``: at concurrency 1, FP8, blockdiff's best output tokens/s >= 1.25x stock vLLM's;
    - ``c1_fp8_tok_s``: the same >= 1600 tokens/s;
    - ``c16_<quant>`` / ``c64_<quant>`` (each quant measured): blockdiff at that concurrency >= 2x stock's best
      output tokens/s over every row stock ran completely in that quant;
    - ``no_request_lost``: every measured row complete (all requests answered in full, none failed); rows with
      status ``skipped`` or ``timeout`` (the sweep's own budget cut them) are listed as ``not_measured``;
    and the setting check ``steps_per_canvas_16``: vLLM's own count of denoising steps per canvas is 16 in every row.
    Only rows whose run was complete and of the setting (``steps_ok``: 16 denoising steps per canvas by vLLM's
    count; a row of 8 steps a canvas runs about twice as fast, and one with no count is of an unknown setting) count
    as throughput. Throughput is compared only between rows of one client
    setting (:func:`effective_skip_special_tokens`): when the measured rows (status ok) hold both, the throughput goals
    use the current one (:data:`SKIP_SPECIAL_TOKENS`) and say which measured rows they left out (``left_out``; rows
    not measured have no throughput and are never listed there); the setting changes what
    bounds a load (docs/tuning.md 7.19). Nor are rows of two load formats (:func:`effective_load_format`) compared:
    the throughput goals are evaluated once per format present, ``dummy`` (the issue's setting) under the names
    above and any other with ``@FORMAT`` appended (e.g. ``c1_fp8_vs_vllm@dummy_live``); each goal names its
    ``load_format``.

    Raises:
        ValueError: a row's ``load_format`` is not one of :data:`LOAD_FORMATS`.
    """
    goals = []
    formats = [effective_load_format(r.get("load_format")) for r in rows]
    for fmt in sorted(set(formats) or {DUMMY}, key=lambda f: (f != DUMMY, f)):
        goals += _throughput_goals([r for r, f in zip(rows, formats) if f == fmt], fmt)

    def key(r):
        return r.get("workload", "?") + "/" + str(r.get("backend"))

    # skipped (past the sweep's deadline) and timeout (the client cut by the sweep's budget) rows were not measured:
    # listed apart, neither lost nor answered; error rows (the client failed) and incomplete ok rows count as lost
    unmeasured = [key(r) for r in rows if r.get("status") in ("skipped", "timeout")]
    lost = [key(r) for r in rows if r.get("status") not in ("skipped", "timeout") and not r.get("complete")]
    measured = len(rows) - len(unmeasured)
    goals.append({"name": "no_request_lost", "description": "every request of every measured run answered in full, "
                  "none failed (rows not measured: listed under not_measured)", "value": len(lost), "target": 0,
                  "met": (not lost) if measured else None, "rows": lost, "not_measured": unmeasured})
    steps = [r.get("diffusion_steps_per_canvas") for r in rows if r.get("status") == "ok"]
    bad = [r.get("workload", "?") + "/" + str(r.get("backend")) for r in rows
           if r.get("status") == "ok" and not r.get("steps_ok")]
    goals.append({"name": "steps_per_canvas_16", "description": "setting check: vLLM's count of denoising steps per "
                  "canvas (diffusion_steps_per_canvas) is 16 in every row", "value": steps, "target": DENOISING_STEPS,
                  "met": (not bad) if steps else None, "rows": bad})
    return goals


def plot_throughput(rows: list[dict], path: Path, gpu: str | None = None) -> Path | None:
    """PNG of output tokens/s against concurrency, one line per (backend, quant, max-num-seqs, eager, load format),
    rows with ``enforce_eager`` labelled eager and a load format other than ``dummy`` named, ``gpu`` (the device
    name) in the title; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series: dict[tuple, list] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("output_tok_s") is not None:
            series.setdefault((r.get("backend"), r.get("quant"), r.get("max_num_seqs"),
                               bool(r.get("enforce_eager")), r.get("load_format") or DUMMY), []).append(
                (r["concurrency"], r["output_tok_s"], bool(r.get("complete"))))
    cs = sorted({c for pts in series.values() for c, _, _ in pts})
    for (backend, quant, seqs, eager, fmt), pts in sorted(series.items(), key=lambda kv: tuple(map(str, kv[0]))):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if fmt == DUMMY else "s",
                linestyle="-" if backend == "vllm" else "--" if quant == "bf16" else "-",
                label=f"{backend} {quant} (max-num-seqs {seqs}{', eager' if eager else ''}"
                      f"{'' if fmt == DUMMY else ', ' + fmt})")
        for c, v, ok in pts:
            if not ok:
                ax.annotate("lost", (c, v), fontsize=7, color="red")
    if cs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
    ax.set_xlabel("max concurrency (requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"DiffusionGemma-26B-A4B (random weights){', ' + gpu if gpu else ''}\n4096 in / 512 out, "
                 "16 denoising steps per canvas", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    common.save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


#: A file-name token that names a GPU model ("h200", "h100", "a100", "l40s") or a kind of one ("pcie", "nvl", "sxm5").
_GPU_TOKEN = re.compile(r"[a-z]\d{2,4}[a-z]?|pcie|nvl|sxm\d*")


def _gpu_tokens(name: str) -> set[str]:
    """The GPU tokens (:data:`_GPU_TOKEN`) among ``name``'s alphanumeric runs, lower case."""
    return {t for t in re.split(r"[^a-z0-9]+", name.lower()) if _GPU_TOKEN.fullmatch(t)}


def record_path(out: str | None, out_dir: str | None, gpu: str | None) -> Path:
    """Where :func:`record` writes: ``out`` when given, else ``OUT_DIR/serve-<gpu slug>.json`` (``out_dir`` default
    bench/results/; :func:`common.gpu_slug`, e.g. ``serve-h100.json`` for "NVIDIA H100 80GB HBM3").

    Raises:
        ValueError: ``out`` is not a ``.json`` file name (a folder, another suffix); its file name names a GPU (a
            token such as ``h200`` or ``pcie``, :data:`_GPU_TOKEN`) other than ``gpu``, the rows' (2026-12-06: an
            H100 lease's rows went to a file named ``serve-h200.json``), or names it only in part (``serve-h100`` for
            an "NVIDIA H100 PCIe", whose slug is ``h100-pcie``); or neither ``out`` nor ``gpu`` is known.
    """
    if out is None:
        if not gpu:
            raise ValueError("the rows name no GPU (no env record with one): give --out")
        return Path(out_dir or common.DEFAULT_RESULTS_DIR) / f"{SUITE}-{common.gpu_slug(gpu)}.json"
    path = Path(out)
    if path.suffix.lower() != ".json" or str(out).endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"--out {out}: a record is a .json file (its CSV and PNG go beside it); for a folder "
                         f"give --out-dir")
    if gpu:
        slug = common.gpu_slug(gpu)
        named, want = _gpu_tokens(path.stem), _gpu_tokens(slug)
        if named and named != want:
            other = sorted(named - want) or sorted(want - named)
            raise ValueError(f"--out {out}: its name says GPU {'-'.join(sorted(named))!r} but the rows come from "
                             f"{gpu!r} ({', '.join(map(repr, other))} differs); name it {SUITE}-{slug}.json (the "
                             f"default with --out-dir)")
    return path


def _record_suite(out: Path, gpu: str | None) -> str:
    """The suite a record at ``out`` holds: its stem less ``-<gpu slug>`` (``serve_first-h200.json`` ->
    ``serve_first``), else less its last ``-`` token (``serve-old.json`` -> ``serve``)."""
    stem = out.stem
    if gpu:
        tail = "-" + common.gpu_slug(gpu)
        if stem.lower().endswith(tail) and len(stem) > len(tail):
            return stem[:-len(tail)]
    return stem.rsplit("-", 1)[0] or SUITE


#: Env fields that say what ran (the checkout and the software): a record's top level names one of each, so when the
#: sweeps' envs disagree :func:`record` names every value there (and each server's in ``servers``) with a note.
_ENV_RUN_FIELDS = ("commit", "vllm", "torch", "triton", "flash_attn_4", "driver", "cuda")


def record(args) -> dict:
    """The ``record`` subcommand: writes the record, its CSV and PNG; returns the record.

    Raises:
        ValueError: no rows; rows from more than one GPU (a record's goals compare its rows, so they come from one
            GPU); ``--out`` naming another GPU than the rows' (:func:`record_path`); the record's file exists and
            ``--force`` is not given (2026-12-06: the default name replaced the committed serve-h100.json, its
            hand-written notes and its profiles); a malformed profile, or one taken on another GPU than the rows
            (its env is dropped, so the record would say it ran on the rows' GPU).

    Rows of sweeps whose envs disagree on what ran (:data:`_ENV_RUN_FIELDS`: commit, vLLM, torch, ...): the top
    level names every value (``"A + B"``, was the first env's alone), each ``servers`` entry its own, and a note
    says so. A profile keeps its env's ``commit``.
    """
    per_file = [read_rows([p]) for p in args.rows]  # each file once; a file without an env record is told apart
    envs = [e for file_envs, _ in per_file for e in file_envs]
    rows = [r for _, file_rows in per_file for r in file_rows]
    if not rows:
        raise ValueError(f"no rows in {', '.join(map(str, args.rows))} (only blank lines or env records)")
    for e in envs:
        if e.get("gpu") is not None and not isinstance(e["gpu"], str):
            raise ValueError(f"an env record's gpu must be a device name (a string), got {e['gpu']!r}")
    gpus = sorted({e["gpu"] for e in envs if e.get("gpu")})
    if len(gpus) > 1:
        raise ValueError(f"rows come from different GPUs ({', '.join(gpus)}): a record's goals compare its rows, so "
                         f"record each GPU's rows apart")
    bare = any(not file_envs for file_envs, _ in per_file)  # a rows file without an env record
    if gpus and (bare or any(not e.get("gpu") for e in envs)):
        raise ValueError(f"some rows name no GPU (a rows file without an env record, or one with no gpu) beside rows "
                         f"from {gpus[0]!r}: record only rows known to come from one GPU")
    out = record_path(getattr(args, "out", None), getattr(args, "out_dir", None), gpus[0] if gpus else None)
    if out.exists() and not getattr(args, "force", False):  # a record holds notes and profiles its rows do not
        raise ValueError(f"{out} exists (a record's notes and profiles are not in its rows): move it to "
                         f"bench/results/history/ first, write elsewhere (--out-dir), or pass --force")
    env = dict(envs[0]) if envs else environment()
    for k in ("kind", "backend", "quant", "max_num_seqs", "base_url", "server_pid", "bench_cmd", "warm_up", "setting",
              "model"):
        env.pop(k, None)
    notes = []
    if not gpus:  # not this machine's device: the rows may come from any
        env["gpu"] = "unknown"
        notes.append("gpu: the rows name none (no env record with a gpu)")
    # what ran (checkout, software): the top level named the first env's, whatever the other sweeps ran
    differ = {}
    for k in _ENV_RUN_FIELDS:
        vals = list(dict.fromkeys(str(e.get(k)) for e in envs if k in e))
        if len(vals) > 1:
            differ[k] = vals
            env[k] = " + ".join(vals)
            notes.append(f"{k}: the rows ran at {len(vals)} values ({', '.join(vals)}); each server's is in servers")
    # no sweep's GPU copy knew its commit: the checkout recording them stands in (one that did know keeps the joined
    # values, 'unknown' among them: was replaced whole when the unknown one came first, and kept when it came later)
    if all(v.startswith("unknown") for v in differ.get("commit") or [str(env.get("commit", "unknown"))]):
        env["commit"] = common.git_commit()
        notes.append("commit: the GPU copy had none; this is the checkout that recorded the rows")
    profiles = []
    for p in args.profile or ():
        with open(p) as f:
            try:
                prof = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"--profile {p}: not JSON ({e})") from None
        if not isinstance(prof, dict):
            raise ValueError(f"--profile {p}: not a JSON object (a profile summary)")
        penv = prof.pop("env", None)
        pgpu = penv.get("gpu") if isinstance(penv, dict) else None
        if gpus and pgpu and pgpu != gpus[0]:  # its env was dropped: the record would say it ran on the rows' GPU
            raise ValueError(f"--profile {p} was taken on {pgpu!r}, the rows on {gpus[0]!r}: a record holds one GPU's "
                             f"measurements (record the profile with that GPU's rows)")
        if isinstance(penv, dict) and penv.get("commit") is not None:
            prof.setdefault("commit", penv["commit"])  # what ran, kept when the env goes
        profiles.append(prof)
    goals = evaluate_goals(rows)
    # one entry per server setting: the sweep writes an env line per command, only a server's first carries its
    # warm-up (was: each later line overwrote it with None), and a side run again at another max-num-seqs gets an
    # entry of its own (was: the last one's max-num-seqs stood for both)
    servers = {}
    for e in envs:
        fmt = effective_load_format((e.get("setting") or {}).get("load_format"))
        key = f"{e.get('backend')}-{e.get('quant')}" + ("" if fmt == DUMMY else f"-{fmt}")
        if key in servers and servers[key]["max_num_seqs"] != e.get("max_num_seqs"):
            key = f"{key}-seqs{e.get('max_num_seqs')}"
        entry = servers.setdefault(key, {"max_num_seqs": e.get("max_num_seqs"), "model": e.get("model"),
                                         "warm_up": None})
        if entry["warm_up"] is None:
            entry["warm_up"] = e.get("warm_up")
        for k in differ:  # the run fields that differ between the sweeps, per server
            v = str(e.get(k))
            entry[k] = v if entry.get(k) in (None, v) else " + ".join(dict.fromkeys([*entry[k].split(" + "), v]))
    setting = dict(envs[0].get("setting") or {}) if envs else None
    if setting is not None:  # a record may hold rows of both load formats (docs/tuning.md 7.21): name every one
        setting.pop("load_format", None)
        setting["load_formats"] = sorted({effective_load_format(r.get("load_format")) for r in rows})
    extra = {"setting": setting, "servers": servers, "goals": goals,
             "profiles": profiles, "notes": notes}
    # the name asked for, written directly (was: <suite>-<gpu>.json first, then renamed: a file of that name beside
    # --out, such as bench/results/serve-h100.json under --out bench/results/serve-old.json, was moved away)
    common.write_records(_record_suite(out, gpus[0] if gpus else None), rows, env=env, extra=extra,
                         out_dir=out.parent, stem=out.stem)
    png = plot_throughput(rows, out.with_suffix(".png"), gpu=gpus[0] if gpus else None)
    doc = json.loads(out.read_text())
    print(f"wrote {out} (+ .csv{', .png' if png else ''})")
    return doc


# --------------------------------------------------------------------------------------------- CLI
def _ints(s: str) -> list[int]:
    """argparse type: comma-separated ints >= 1 (:func:`blockdiff.bench.common.comma_list`: blanks dropped, a value
    that names nothing refused)."""
    try:
        items = common.comma_list(s, "value")
        vals = [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {s!r}")
    return vals


def _concurrencies(s: str) -> list[int]:
    """argparse type of ``sweep --concurrency``: :func:`_ints`, each value once (a run at C writes the row
    ``serve_c{C}_{quant}`` and the client's result file named after it: a repeated C ran the same load again with the
    same seed, overwrote the first run's detailed result and gave the record two rows of one workload)."""
    vals = _ints(s)
    twice = sorted({v for v in vals if vals.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"each concurrency once (one row per concurrency; run the sweep again to "
                                         f"repeat a load), got {s!r}: {', '.join(map(str, twice))} more than once")
    return vals


def _number(kind, lo: float, strict: bool):
    """argparse type: a finite ``kind`` (int / float) >= ``lo`` (> ``lo`` when ``strict``)."""
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, got {s!r}") from None
        if not finite(v) or (v <= lo if strict else v < lo):
            what = "an int" if kind is int else "a finite number"
            if kind is int and not finite(v):  # (math.isfinite raised OverflowError, past argparse: a traceback)
                raise argparse.ArgumentTypeError(f"expected {what} {'>' if strict else '>='} {lo:g} within float's "
                                                 f"range, got an int of {v.bit_length()} bits")
            raise argparse.ArgumentTypeError(f"expected {what} {'>' if strict else '>='} {lo:g}, got {s!r}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


_pos_int, _nonneg_int = _number(int, 0, True), _number(int, 0, False)
_pos_float, _nonneg_float = _number(float, 0, True), _number(float, 0, False)


def _kv_cache_gib(s: str) -> float:
    """argparse type of ``--kv-cache-gib``: a finite number of GiB whose byte count is in [1, 2**63) (vLLM's int64
    byte count; 1e300 overflowed int(gib * 2**30) with a traceback)."""
    v = _pos_float(s)
    if not 1 <= v * 2 ** 30 < _INT64_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a size from 1 byte to below 2**33 GiB (vLLM's int64 byte count), "
                                         f"got {s!r}")
    return v


def _canvas_multiple(s: str) -> int:
    """argparse type: a positive int that is a multiple of the canvas length (whole canvases)."""
    v = _pos_int(s)
    if v % CANVAS_LENGTH:
        raise argparse.ArgumentTypeError(f"expected a multiple of the canvas length {CANVAS_LENGTH}, got {s!r}")
    return v


def _cmd(s: str) -> list[str]:
    parts = shlex.split(s)
    if not parts:
        raise argparse.ArgumentTypeError("empty command")
    return parts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m blockdiff.bench.bench_serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    default_bench = " ".join(shlex.quote(x) for x in (sys.executable, *VLLM_CLI, "bench", "serve"))

    m = sub.add_parser("model", help="write the benchmark's model folder (config + tokenizer, no weights)")
    m.add_argument("out")
    m.add_argument("--overwrite", action="store_true")

    s = sub.add_parser("server-cmd", help="print one side's vllm serve command line")
    s.add_argument("--backend", choices=BACKENDS, required=True)
    s.add_argument("--quant", choices=QUANTS, required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--max-num-seqs", type=_pos_int, required=True)
    s.add_argument("--kv-cache-gib", type=_kv_cache_gib, required=True, help="KV cache size, GiB")
    s.add_argument("--gpu-memory-utilization", type=_pos_float, required=True)
    s.add_argument("--trace-dir", default=None, help="absolute folder for profiler traces (enables the profiler)")
    s.add_argument("--max-num-batched-tokens", type=_pos_int, default=16384)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="vLLM's synchronous scheduling (default: asynchronous, vLLM's default)")
    s.add_argument("--api-server-count", type=_pos_int, default=1, help="vLLM's API server processes (default 1)")
    add_load_format_option(s, what="the server's random weights")

    for name, helptext in (("sweep", "vllm bench serve at each concurrency -> rows"),
                           ("profile", "torch-profile a short load, classify the trace")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--base-url", required=True)
        p.add_argument("--model", required=True, help="the served folder (also the client's tokenizer)")
        p.add_argument("--backend", choices=BACKENDS, required=True)
        p.add_argument("--quant", choices=QUANTS, required=True)
        p.add_argument("--bench-cmd", type=_cmd, default=_cmd(default_bench),
                       help=f"the vllm bench serve command (default: {default_bench})")
        p.add_argument("--work-dir", default=None, help="result JSONs and logs of the client (default "
                                                        "$TMPDIR/bench_serve/BACKEND_QUANT)")
        p.add_argument("--run-timeout", type=_pos_float, default=300.0, help="seconds one client run may take")
        add_skip_special_tokens_option(p)
        add_load_format_option(p, what="the server's --load-format, recorded with the results (checked against the "
                                       "server's command line when --server-pid is given)")
    sw = sub.choices["sweep"]
    sw.add_argument("--concurrency", type=_concurrencies, default=[1, 4, 16, 64],
                    help="comma-separated concurrencies, each once (default 1,4,16,64)")
    sw.add_argument("--max-num-seqs", type=_pos_int, required=True, help="the server's --max-num-seqs (recorded)")
    sw.add_argument("--server-pid", type=_pos_int, default=None, help="the vllm serve process (GPU memory of its tree)")
    sw.add_argument("--num-prompts-per-concurrency", type=_pos_int, default=2, help="K: prompts = max(K * C, M)")
    sw.add_argument("--min-prompts", type=_nonneg_int, default=8, help="M: prompts = max(K * C, M)")
    sw.add_argument("--warmup-cap", type=_nonneg_int, default=WARMUP_CAP, help="warm-up requests per run: min(C, this)")
    sw.add_argument("--warm-concurrency", type=_nonneg_int, default=None,
                    help="before the runs: this many requests at once, not recorded (default --max-num-seqs, so "
                         "every batch size the server runs has compiled; 0: none)")
    sw.add_argument("--warm-output-len", type=_canvas_multiple, default=CANVAS_LENGTH,
                    help=f"output tokens of each warm-up request, a positive multiple of {CANVAS_LENGTH} (default "
                         f"{CANVAS_LENGTH}, one canvas; {OUTPUT_LEN}: the timed runs' shape)")
    sw.add_argument("--seed", type=_nonneg_int, default=0, help="dataset seed base (run at C uses seed + C)")
    sw.add_argument("--rows", required=True, help="JSON-lines file the rows are appended to")
    sw.add_argument("--nvidia-smi", type=_cmd, default=["nvidia-smi"])
    sw.add_argument("--memory-interval", type=_pos_float, default=0.5, help="seconds between memory samples")
    sw.add_argument("--deadline-s", type=_nonneg_float, default=None,
                    help="no run starts later than this many seconds after the sweep began (its rows: skipped); a "
                         "run's timeout is cut to the time left")
    sw.add_argument("--min-run-s", type=_nonneg_float, default=20.0, help="with --deadline-s: the least time a run is "
                                                                   "started with")
    pr = sub.choices["profile"]
    pr.add_argument("--trace-dir", required=True, help="the server's torch_profiler_dir")
    pr.add_argument("--requests", type=_pos_int, default=2, help="requests of the profiled load (all concurrent)")
    pr.add_argument("--warm-requests", type=_nonneg_int, default=None,
                    help="requests of an unprofiled load sent first, all concurrent, another seed (default: "
                         "--requests; 0: none): the profiled load's batch shapes compile there")
    pr.add_argument("--server-pid", type=_pos_int, default=None,
                    help="the vllm serve process: its processes' and threads' CPU time during the profiled load "
                         "(host_cpu; none without it)")
    pr.add_argument("--stop-timeout", type=_pos_float, default=300.0,
                    help="seconds /stop_profile may take (trace export)")
    pr.add_argument("--out", required=True, help="summary JSON")

    t = sub.add_parser("trace", help="classify saved trace files")
    t.add_argument("traces", nargs="+")
    t.add_argument("--max-canvases", type=_pos_int, default=2)
    t.add_argument("--out", default=None)

    r = sub.add_parser("record", help="rows + profiles -> the record, CSV and PNG")
    r.add_argument("rows", nargs="+", help="JSON-lines rows files written by `sweep` (an env line per command, then "
                                           "its rows); all from one GPU")
    r.add_argument("--profile", nargs="*", default=[], help="summary JSONs written by `profile` (kept in the record)")
    r.add_argument("--force", action="store_true", help="replace an existing record of that name (else refused: "
                                                        "move the current one to bench/results/history/ first)")
    where = r.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="the record's path (default: OUT_DIR/serve-<gpu>.json, the GPU "
                                                   "from the rows; a name that says another GPU is refused)")
    where.add_argument("--out-dir", default=None, help="folder of the record named after the rows' GPU "
                                                       "(default bench/results/)")
    return ap


SUMMARY_COLUMNS = ["workload", "backend", "load_format", "max_num_seqs", "output_tok_s", "ttft_ms",
                   "time_per_canvas_ms", "completed", "failed", "diffusion_steps_per_canvas", "peak_memory_bytes"]


def _error(command: str, msg) -> int:
    """One line ``python3 -m blockdiff.bench.bench_serve COMMAND: error: MSG`` on stderr; returns exit code 2."""
    line = "; ".join(part.strip() for part in str(msg).splitlines() if part.strip())
    print(f"python3 -m blockdiff.bench.bench_serve {command}: error: {line}", file=sys.stderr)
    return 2


def main(argv=None):
    """Entry point; returns the exit code (0 ok; 1 a sweep with incomplete rows or a failed profile; 2 a usage
    error: bad arguments, unreadable or malformed input files, an unwritable output, an unreachable server)."""
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except _UserError as e:
        return _error(args.command, e.args[0])


class _UserError(Exception):
    """A problem with the command's arguments or input files (exit 2, one line)."""


def _user(fn, *a, what: str = "", **kw):
    """``fn(*a, **kw)``, its ValueError / OSError (bad input files, unwritable outputs) as a :class:`_UserError`."""
    try:
        return fn(*a, **kw)
    except (ValueError, OSError) as e:
        raise _UserError(f"{what}{e}") from None


def _check_writable(path: str, flag: str, hint: str = "") -> None:
    """``flag``'s file can be created (its folder made if missing): checked before a long run starts. A folder, an
    empty path or one ending in ``/`` names no file (was: the run went through, then writing its result raised
    IsADirectoryError and the result was lost)."""
    if not path.strip() or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise _UserError(f"{flag} {path!r}: a file name is needed (an empty path or a folder names no file){hint}")
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if not os.access(parent, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise _UserError(f"{flag} {path!r}: its folder {str(parent)!r} cannot be written ({e})") from None


def _main(args) -> int:
    if args.command == "model":
        for name, path in _user(write_model_folder, args.out, overwrite=args.overwrite).items():
            print(f"{path}  {os.path.getsize(path)} bytes")
        return 0
    if args.command == "server-cmd":
        env, argv_ = _user(server_command, args.backend, args.quant, model=args.model, port=args.port,
                                    max_num_seqs=args.max_num_seqs, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                                    gpu_memory_utilization=args.gpu_memory_utilization, trace_dir=args.trace_dir,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                                    api_server_count=args.api_server_count, load_format=args.load_format)
        print(shlex.join(["env", *[f"{k}={v}" for k, v in env.items()], *argv_]))
        return 0
    if args.command == "sweep":
        _check_writable(args.rows, "--rows")
        _user(check_server_load_format, args.load_format, args.server_pid)
        _user(check_server_max_num_seqs, args.max_num_seqs, args.server_pid)
        rows = sweep(args)
        print(common.summary_table(rows, SUMMARY_COLUMNS))
        return 0 if all(r.get("complete") for r in rows) else 1
    if args.command == "profile":
        _check_writable(args.out, "--out")
        _user(check_server_load_format, args.load_format, args.server_pid)
        summary = profile(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        common.write_experiment_json(Path(args.out).name, summary, Path(args.out).parent)
        _print_profile(summary)
        return 0 if summary.get("status") == "ok" else 1
    if args.command == "trace":
        if args.out is not None:  # (--out '' is refused, not read as no --out)
            _check_writable(args.out, "--out")
        summary = _user(summarize_traces, args.traces, max_canvases=args.max_canvases)
        if args.out is not None:
            common.write_experiment_json(Path(args.out).name, summary, Path(args.out).parent)
        _print_profile(summary)
        return 0
    if args.command == "record":
        if args.out is not None:  # (--out '' is refused, not read as the default folder)
            _check_writable(args.out, "--out", hint="; a record is a .json file (its CSV and PNG go beside it), for "
                                                    "a folder give --out-dir")
        elif args.out_dir is not None and not args.out_dir.strip():
            raise _UserError("--out-dir must not be empty (leave it out for bench/results/)")
        else:
            _check_writable(str(Path(args.out_dir or common.DEFAULT_RESULTS_DIR) / f"{SUITE}.json"), "--out-dir")
        doc = _user(record, args)
        print(common.summary_table(doc["rows"], SUMMARY_COLUMNS))
        for g in doc["goals"]:
            print(f"goal {g['name']}: value {g['value'] if not isinstance(g['value'], float) else round(g['value'], 3)}"
                  f" target {g['target']} met {g['met']}")
        return 0
    return 2


def _print_profile(s: dict) -> None:
    cm = s.get("canvas_step_ms")
    print(f"{s.get('backend', '')} {s.get('quant', '')}: {s.get('steps')} steps ({s.get('canvas_steps')} canvas, "
          f"{s.get('prefill_steps')} prefill), status {s.get('status', 'ok')} {s.get('reason', '')}")
    if cm:
        print("  per canvas step (kernel ms): " + ", ".join(f"{b} {cm[b]:.3f}" for b in (*BUCKETS, "total")))
    tl = s.get("timeline") or {}
    if tl.get("gpu_busy_share") is not None:
        print(f"  timeline: GPU busy {100 * tl['gpu_busy_share']:.0f} % of {tl['gpu_span_ms']:.1f} ms; "
              f"{tl['idle_gaps_over_1ms']} idle gaps >= 1 ms ({tl['idle_gaps_over_1ms_total_ms']:.1f} ms, max "
              f"{tl['idle_gap_max_ms']:.1f}); canvas step every "
              f"{common.fmt(tl.get('canvas_step_cadence_median_ms'), 2)} ms")
    gs = tl.get("gap_sites") or {}
    if gs.get("gaps"):
        per = gs.get("per_canvas_step_ms") or {}
        print(f"  all idle ({gs['gaps']} gaps, {gs['total_ms']:.1f} ms) by phase before>after: "
              + ", ".join(f"{k} {v:.1f}" + (f" ({per[k]:.2f}/canvas step)" if k in per else "")
                          for k, v in sorted(gs["by_phase"].items(), key=lambda kv: -kv[1]))
              + "; top: " + ", ".join(f"{a}>{b} {ms:.1f} ({n})" for a, b, ms, n in gs["pairs"][:4]))
        if gs.get("by_launch"):
            print("  idle by launch: " + ", ".join(f"{k} {v[0]:.1f} ({v[1]})" for k, v in
                                                 sorted(gs["by_launch"].items(), key=lambda kv: -kv[1][0]))
                  + "; kernels around it: " + ", ".join(f"{a[:40]}>{b[:40]} {ms:.1f} ({n})"
                                                        for a, b, ms, n in gs.get("kernel_pairs", [])[:4]))
    fl = tl.get("forward_launches_per_canvas_step")
    if fl:
        print(f"  a canvas step's forward: {fl['graph_replays']:.1f} graph replays, {fl['eager_kernels']:.1f} "
              f"eager kernels" + (f", {fl['kernels_without_launch']:.1f} kernels without a launch event"
                                  if fl.get("kernels_without_launch") else ""))
    ia = tl.get("idle_attribution") or {}
    if ia.get("gaps"):
        pos = ia["by_position"]
        print(f"  idle gaps: {ia['gaps']} ({ia['total_ms']:.1f} ms): in a step {pos['in_step']:.1f}, between steps "
              f"{pos['between_steps']:.1f}; inside a recorded CPU event {ia['covered_ms']:.1f}, outside "
              f"{ia['uncovered_ms']:.1f}; CPU labels: "
              + ", ".join(f"{n[:40]} {ms:.1f}" for n, ms, _ in ia["cpu_labels"][:6]))
    ld = tl.get("load")
    if ld and "reason" in ld:
        print(f"  load: not placed ({ld['reason']})")
    elif ld:
        adm = ld["admission"]
        lead = ", ".join(f"{n[:32]} {ms:.1f}" for n, ms, _ in (ld["lead_in"].get("cpu_labels") or [])[:4])
        print(f"  load ({ld['requests']} requests, client window {ld['window_ms']:.1f} ms): GPU busy "
              f"{100 * (ld['gpu_busy_share'] or 0):.0f} %; lead-in {ld['lead_in_ms']:.1f} ms "
              f"({lead or 'no CPU event'}),"
              f" tail {ld['tail_ms']:.1f} ms; first step after {common.fmt(ld['first_step_ms'], 1)} ms; sent -> "
              f"add_request median {common.fmt(adm['median_ms'], 1)} ms, max {common.fmt(adm['max_ms'], 1)} ms "
              f"({adm['matched']} matched)")
    hc = s.get("host_cpu") or {}
    if hc.get("processes"):
        print(f"  host CPU over the load ({hc['wall_s']:.1f} s): " + "; ".join(
            f"{p} {v['share']:.2f} cores, a thread >= 90 % busy in {100 * v['saturated_share']:.0f} % of samples"
            for p, v in list(hc["processes"].items())[:3]))
        print("  busiest threads: " + ", ".join(f"{t['process']}/{t['thread']} {t['share']:.2f}"
                                                for t in hc.get("top_threads", [])[:5]))
    if ld and ld.get("tail_host_cpu", {}).get("samples"):
        th = ld["tail_host_cpu"]
        print(f"  host CPU in the tail ({th['samples']} samples): " + ", ".join(
            f"{p} busiest {v['busiest']:.2f} / total {v['total']:.2f}" for p, v in th.items() if p != "samples"))
    if s.get("unknown_share") is not None:
        print(f"  unknown kernel names: {100 * s['unknown_share']:.1f} % of kernel time; top: "
              + ", ".join(f"{n[:40]} {ms:.2f} ms" for n, ms, _ in (s.get("unknown_kernels") or [])[:4]))


if __name__ == "__main__":
    sys.exit(main())
