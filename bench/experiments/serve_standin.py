"""The serving benchmark with the GPU replaced by a timed stand-in: real vLLM 0.26 (API server, engine core, output
processing), blockdiff's scheduler and ``vllm bench serve`` as the client, with a worker that runs no kernel and
answers each engine step after the time the H200 took for a step of that size (docs/tuning.md 7.15).

What it answers: how much of a served load's time the serving stack costs on its own (the host side: HTTP,
tokenization, scheduling, output processing, streaming, the client) when the GPU's work per step is the measured
one and the model runner's host work is zero. On the CPU it runs anywhere vLLM 0.26's Python side imports; on the
GPU machine (``device/serve_standin.sh``) it separates "the machine's host side is slow" from "the real model
runner is slow" without using the GPU.

    source tests/integration/vllm_cpu_env.sh 0.26.0          # vLLM's Python side on a CPU-only machine
    python3 -m blockdiff.bench.experiments.serve_standin run --platform cpu --out DIR [--concurrency 1,64]
    python3 -m blockdiff.bench.experiments.serve_standin detok --model DIR   # the detokenizer's ms per request

The stand-in worker (:class:`StandinWorker`, ``--worker-cls``) follows vLLM's diffusion accounting as blockdiff's
ModelState reports it (docs/ARCHITECTURE.md "Integration and vLLM accounting"): a prefill chunk samples 0 tokens;
a row scheduled with the canvas as draft tokens is a denoising step (0 tokens, the whole canvas rejected) for
:data:`DENOISING_STEPS` steps, then a commit (``canvas_length`` tokens accepted); a finished or preempted request
starts afresh. Its "GPU" is a queue: a step starts when the previous one ended (or when it is launched, if later)
and lasts ``a + p * prefill_tokens + q * canvas_tokens`` ms (``BLOCKDIFF_STANDIN_STEP_MS="a,p,q"``, default
:data:`STEP_MS`, fitted to the H200's blockdiff-cute FP8 profiles: docs/tuning.md 7.15). The engine core waits
for a step's output as for the real runner's (vLLM's ``AsyncModelRunnerOutput``), so asynchronous scheduling
overlaps the host with the "GPU" as it does there. The KV cache is one layer's (the stand-in holds no tensors):
``--kv-cache-gib`` admits far more tokens than the real 30-layer model's cache, so KV-cache pressure and
preemption for lack of pages are not modelled. ``BLOCKDIFF_STANDIN_HOST_MS="h0,h1"``: Python busy time (holding
the GIL) the worker spends per step (``h0``) and per scheduled request (``h1``) before launching it, to model a
model runner's host work. ``BLOCKDIFF_STANDIN_TOKENS``: what a commit emits (:data:`TOKEN_MODES`). Each step's
(start, end, tokens, canvas tokens, requests) in ``perf_counter`` seconds, then its row widths (:data:`WIDTH_FIELDS`)
go to ``BLOCKDIFF_STANDIN_LOG`` when set.

Fused commits (docs/ARCHITECTURE.md "Integration and vLLM accounting"): ``run --no-async-scheduling --canvas-length
512 --fuse-commit`` serves with vLLM's synchronous scheduler (``BlockdiffDiffusionScheduler``), ``--diffusion-config``
canvas_length 512 (twice the model's 256) and ``BLOCKDIFF_FUSE_COMMIT=1``; the worker then answers like blockdiff's
model state: ``num_nans_in_logits = -1`` on the step whose canvas converges when its commit will not end the request
(``max_tokens``), and a row of ``2 * 256`` tokens is that commit plus the next canvas's first denoising step (timed as
its 512 canvas tokens). The synchronous engine core asks the worker for draft lists after each step
(``take_draft_token_ids``: ``[-1] * num_speculative_tokens`` per scheduled request, as model runner v2's).
``run --canvas-length 512 --fuse-commit`` (asynchronous, ``BlockdiffDiffusionAsyncScheduler``) fuses the commits the
step cap forces, predicted by the scheduler (docs/tuning.md 7.38); the stand-in takes every row wider than a canvas
for a commit (it cannot stall a mispredicted one, which the model state does), which is exact when every canvas
reaches the cap, as the benchmark's do. ``--fuse-policy uniform`` sets ``BLOCKDIFF_FUSE_POLICY=uniform`` (fused rows
only in steps whose canvas rows are all fused, docs/tuning.md 7.40); each load's ``timeline`` counts the steps vLLM
0.26's model runner could not replay as one FULL CUDA graph (``non_uniform_steps``: a prefill row, or canvas rows
of more than one width), of those the steps mixing canvas widths (``mixed_canvas_steps``) and those with a prefill
row (``prefill_steps``), and the fused rows (``wide_rows``, ``2 * CL``) and the rows between CL and ``2 * CL``
(``cut_rows``: fused rows vLLM's token budget cut, which commit plain). The stand-in times a step by its tokens
only: it charges nothing for a PIECEWISE step.

On a machine without a GPU the worker alone is not enough: vLLM finds no platform. ``--platform cpu`` writes a
platform plugin (:class:`StandinPlatform`: vLLM's CPU platform with the executor and asynchronous scheduling the
GPU server has: one process, ``uni``, asynchronous) as a ``vllm.platform_plugins`` entry point into the work
folder and turns it on with ``BLOCKDIFF_STANDIN_PLATFORM=1``; ``--platform auto`` leaves vLLM's own (CUDA on the H200).

Not part of the package's API: an experiment (bench/experiments/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from blockdiff.bench import bench_serve as bs
from blockdiff.bench import common

#: default step-time model ``a,p,q``: ms per step, per prefill token, per canvas token (module docstring)
STEP_MS = "8,0.0114,0.0190"
DENOISING_STEPS = bs.DENOISING_STEPS
CANVAS_LENGTH = bs.CANVAS_LENGTH
PLATFORM_ENV = "BLOCKDIFF_STANDIN_PLATFORM"
STEP_ENV, HOST_ENV, LOG_ENV, TOKENS_ENV = ("BLOCKDIFF_STANDIN_STEP_MS", "BLOCKDIFF_STANDIN_HOST_MS",
                                           "BLOCKDIFF_STANDIN_LOG", "BLOCKDIFF_STANDIN_TOKENS")
#: ``BLOCKDIFF_STANDIN_TOKENS``: what a commit emits (``unused``: ids above the byte tokenizer's, as the 26B
#: geometry's random weights give; ``bytes_high``: byte tokens of 0x80-0xff, mostly invalid UTF-8; ``pad``: the
#: ``<pad>`` id repeated and ``byte_e3``: the byte 0xe3 repeated, both text the incremental detokenizer can never
#: complete, so that ``tokenizers.DecodeStream`` re-decodes a growing window at every token, quadratic in the
#: output length: docs/tuning.md 7.19)
TOKEN_MODES = ("unused", "bytes_high", "pad", "byte_e3")
#: The step log's fields after (start, end, tokens, canvas tokens, requests): 1 when every row of the step is a
#: canvas row and all have one width (the batches vLLM 0.26's model runner can replay as a FULL CUDA graph: one
#: ``uniform_token_count``, and no prefill row, which is no captured width), 1 when its canvas rows had more than one
#: width, its prefill rows (no draft tokens), its ``2 * CL`` rows (fused commits), its rows between CL and ``2 * CL``
#: (fused rows cut by the token budget).
WIDTH_FIELDS = ("uniform", "mixed_canvas", "prefill_rows", "wide_rows", "cut_rows")
WORKER_CLASS = "blockdiff.bench.experiments.serve_standin.StandinWorker"
PLATFORM_CLASS = "blockdiff.bench.experiments.serve_standin.StandinPlatform"


def parse_floats(text: str, n: int, name: str) -> tuple[float, ...]:
    """``n`` comma-separated finite floats >= 0 of the variable ``name``.

    Raises:
        ValueError: not ``n`` values, or one not a finite float >= 0 (the variable named).
    """
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != n:
        raise ValueError(f"{name} must be {n} comma-separated numbers, got {text!r}")
    try:
        vals = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name} must be {n} comma-separated numbers, got {text!r}") from None
    if any(not (v >= 0 and v < float("inf")) for v in vals):
        raise ValueError(f"{name}: every value must be finite and >= 0, got {text!r}")
    return vals


class DiffusionAccounting:
    """Per-request phase of the stand-in: what one engine step samples for each scheduled request.

    ``step(req_id, canvas_row, num_tokens=None)``: ``canvas_row`` True when the request is scheduled with draft
    tokens (its canvas), ``num_tokens`` the row's scheduled tokens (None: one canvas); returns the number of tokens
    the step samples for it: 0 for a prefill chunk and for each of the first ``denoising_steps`` canvas steps,
    ``canvas_length`` for the next (the commit), then a new canvas begins. A row wider than a canvas is a commit
    (whatever the count of steps): with ``2 * canvas_length`` tokens a fused commit, which also takes the next
    canvas's first denoising step, with fewer (a budget cut) a plain commit whose extra tokens are rejected.
    ``commits_next(req_id)``: whether the request's next canvas row is its commit (its canvas converged).
    """

    def __init__(self, denoising_steps: int = DENOISING_STEPS, canvas_length: int = CANVAS_LENGTH):
        bs._check_int("denoising_steps", denoising_steps, 1)
        bs._check_int("canvas_length", canvas_length, 1)
        self.denoising_steps, self.canvas_length = denoising_steps, canvas_length
        self.steps: dict[str, int] = {}

    def step(self, req_id: str, canvas_row: bool, num_tokens: int | None = None) -> int:
        if not canvas_row:
            return 0
        cl = self.canvas_length
        if num_tokens is not None and num_tokens > cl:  # a fused commit (2 * CL) or a cut one
            self.steps[req_id] = 1 if num_tokens >= 2 * cl else 0
            return cl
        n = self.steps.get(req_id, 0) + 1
        if n > self.denoising_steps:
            self.steps[req_id] = 0
            return cl
        self.steps[req_id] = n
        return 0

    def commits_next(self, req_id: str) -> bool:
        return self.steps.get(req_id, 0) >= self.denoising_steps

    def finish(self, req_ids) -> None:
        for r in req_ids:
            self.steps.pop(r, None)


def commit_token(mode: str, rng: random.Random, vocab: int) -> int:
    """One committed token id of the stand-in in token mode ``mode`` (:data:`TOKEN_MODES`; the benchmark's byte
    tokenizer: 0-2 special, 3-258 the bytes 0-255, the rest ``<unused_N>``), ``vocab`` ids in all.

    Raises:
        ValueError: ``mode`` is not one of :data:`TOKEN_MODES`, or ``vocab`` <= 259.
    """
    if mode not in TOKEN_MODES:
        raise ValueError(f"mode must be one of {TOKEN_MODES}, got {mode!r}")
    if vocab <= 259:
        raise ValueError(f"vocab must be > 259 (the byte tokenizer's special and byte ids), got {vocab}")
    if mode == "bytes_high":
        return 3 + rng.randrange(128, 256)
    if mode == "pad":
        return 0
    if mode == "byte_e3":
        return 3 + 0xE3
    return rng.randrange(259, vocab)


def step_seconds(step_ms: tuple[float, float, float], prefill_tokens: int, canvas_tokens: int) -> float:
    """Seconds of "GPU" time of one step under the model ``(a, p, q)`` ms (module docstring)."""
    a, p, q = step_ms
    return (a + p * prefill_tokens + q * canvas_tokens) / 1e3


def _make_worker():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

    class _Pending(AsyncModelRunnerOutput):
        def __init__(self, done: threading.Event, out):
            self.done, self.out = done, out

        def get_output(self):
            self.done.wait()
            return self.out

    class StandinWorker(WorkerBase):
        """vLLM worker that runs no kernel (module docstring)."""

        def init_device(self):
            from blockdiff.integration.vllm_scheduler import (FUSE_NEXT_FLAG, fuse_commit_from_env,
                                                              served_canvas_length)

            self.device = torch.device("cpu")
            cfg = check_environment()
            self.step_ms = parse_floats(cfg["step_ms"], 3, STEP_ENV)
            self.host_ms = parse_floats(cfg["host_ms"], 2, HOST_ENV)
            self.tokens = cfg["tokens"]
            dc = getattr(self.vllm_config, "diffusion_config", None)
            steps = getattr(dc, "max_denoising_steps", None) or DENOISING_STEPS
            # CL as blockdiff's model state takes it (the checkpoint's when the diffusion config is twice that)
            cl, fused_layout = served_canvas_length(self.vllm_config)
            self.accounting = DiffusionAccounting(int(steps), cl)
            self.asynchronous = bool(self.vllm_config.scheduler_config.async_scheduling)
            # fused commits as the model state does them (BLOCKDIFF_FUSE_COMMIT=1 and a 2 * CL diffusion config):
            # FUSE_NEXT_FLAG in num_nans_in_logits before each commit that does not end its request
            self.fuse, self.fuse_flag = fuse_commit_from_env() and fused_layout, FUSE_NEXT_FLAG
            self.num_spec = int(self.vllm_config.num_speculative_tokens)
            self.max_tokens: dict[str, int] = {}
            self.emitted: dict[str, int] = {}
            self.last_req_ids: list[str] = []
            self.gpu_free_at = time.perf_counter()
            self.rng = random.Random(0)
            self.vocab = self.model_config.get_vocab_size()
            path = os.environ.get(LOG_ENV)
            self.log = open(path, "a") if path else None
            self.pending = None

        def load_model(self, *, load_dummy_weights: bool = False):
            return None

        def determine_available_memory(self) -> int:
            return int(self.cache_config.kv_cache_memory_bytes or 40 << 30)

        def get_kv_cache_spec(self):
            hf = self.model_config.hf_text_config
            return {"model.layers.0.self_attn.attn": FullAttentionSpec(
                block_size=self.cache_config.block_size, num_kv_heads=int(getattr(hf, "num_key_value_heads", 8)),
                head_size=int(getattr(hf, "head_dim", 256)), dtype=torch.bfloat16)}

        def initialize_from_config(self, kv_cache_config):
            return None

        def initialize_cache(self, num_gpu_blocks, num_cpu_blocks):
            return None

        def compile_or_warm_up_model(self):
            return CompilationTimes(0.0, 0.0)

        def get_supported_tasks(self):
            return ("generate",)

        def get_cache_block_size_bytes(self) -> int:
            return 0

        def profile(self, is_start: bool = True, profile_prefix=None):
            return None

        def take_draft_token_ids(self):
            # the synchronous engine core asks after each step (model runner v2: ``[-1] * num_spec`` a request);
            # the asynchronous one never does
            if self.asynchronous or not self.last_req_ids:
                return None
            from vllm.v1.outputs import DraftTokenIds

            ids, self.last_req_ids = self.last_req_ids, []
            return DraftTokenIds(ids, [[-1] * self.num_spec for _ in ids])

        def reset_mm_cache(self):
            return None

        def shutdown(self):
            if self.log is not None:
                self.log.close()

        def _token(self) -> int:
            return commit_token(self.tokens, self.rng, self.vocab)

        def execute_model(self, scheduler_output):
            # a finished or preempted request starts afresh (model runner v2 removes both; a resumed one
            # re-prefills and begins a new canvas)
            gone = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids",
                                                                            None) or ())
            self.accounting.finish(gone)
            for rid in gone:
                self.max_tokens.pop(rid, None)
                self.emitted.pop(rid, None)
            for new in scheduler_output.scheduled_new_reqs:
                sp = new.sampling_params
                self.max_tokens[new.req_id] = getattr(sp, "max_tokens", None) or (1 << 62)
                # a resumed request re-prefills prompt + output: what it already emitted counts
                self.emitted[new.req_id] = len(new.prefill_token_ids or ()) - len(new.prompt_token_ids or ()) \
                    if new.prefill_token_ids else 0
            if scheduler_output.total_num_scheduled_tokens == 0:
                return EMPTY_MODEL_RUNNER_OUTPUT
            self.pending = scheduler_output
            return None

        def sample_tokens(self, grammar_output):
            so, self.pending = self.pending, None
            req_ids, sampled, canvas_tokens, flags = [], [], 0, {}
            cl = self.accounting.canvas_length
            canvas_widths, prefill_rows, wide_rows, cut_rows = set(), 0, 0, 0
            for rid, n in so.num_scheduled_tokens.items():
                canvas_row = bool(so.scheduled_spec_decode_tokens.get(rid))
                canvas_tokens += n if canvas_row else 0  # a fused row is timed as its 2 * CL tokens
                if canvas_row:
                    canvas_widths.add(n)
                    wide_rows += n == 2 * cl
                    cut_rows += cl < n < 2 * cl
                else:
                    prefill_rows += 1
                req_ids.append(rid)
                k = self.accounting.step(rid, canvas_row, n if canvas_row else None)
                self.emitted[rid] = self.emitted.get(rid, 0) + k
                sampled.append([self._token() for _ in range(k)])
                # the canvas converged and its commit does not end the request: ask for a fused commit
                if self.fuse and canvas_row and self.accounting.commits_next(rid) and \
                        self.emitted[rid] + cl < self.max_tokens.get(rid, 1 << 62):
                    flags[rid] = self.fuse_flag
            self.last_req_ids = list(req_ids)
            out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=sampled,
                                    num_nans_in_logits={r: flags.get(r, 0) for r in req_ids} if flags else None)
            busy = (self.host_ms[0] + self.host_ms[1] * len(req_ids)) / 1e3
            t_end = time.perf_counter() + busy
            while time.perf_counter() < t_end:  # a model runner's host work: Python, holding the GIL
                pass
            dur = step_seconds(self.step_ms, so.total_num_scheduled_tokens - canvas_tokens, canvas_tokens)
            now = time.perf_counter()
            start = max(now, self.gpu_free_at)
            self.gpu_free_at = end = start + dur
            if self.log is not None:
                uniform = prefill_rows == 0 and len(canvas_widths) == 1
                self.log.write(f"{start:.6f} {end:.6f} {so.total_num_scheduled_tokens} {canvas_tokens} "
                               f"{len(req_ids)} {int(uniform)} {int(len(canvas_widths) > 1)} {prefill_rows} "
                               f"{wide_rows} {cut_rows}\n")
                self.log.flush()
            done = threading.Event()
            timer = threading.Timer(end - now, done.set)
            timer.daemon = True
            timer.start()
            return _Pending(done, out)

    return StandinWorker


def _make_platform():
    from vllm.platforms.cpu import CpuPlatform

    class StandinPlatform(CpuPlatform):
        """vLLM's CPU platform, keeping the GPU server's executor (``uni``) and asynchronous scheduling, and letting
        Model Runner V2's Triton check pass (the stand-in runs no kernel)."""

        @classmethod
        def check_and_update_config(cls, vllm_config):
            import vllm.config.vllm as config_module
            config_module.HAS_TRITON = True
            sc, pc = vllm_config.scheduler_config, vllm_config.parallel_config
            keep = sc.async_scheduling, pc.distributed_executor_backend
            super().check_and_update_config(vllm_config)
            sc.async_scheduling, pc.distributed_executor_backend = keep

    return StandinPlatform


_LAZY = {"StandinWorker": _make_worker, "StandinPlatform": _make_platform}


def __getattr__(name: str):  # vLLM resolves the classes by qualified name; they need vLLM, imported only then
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point: :class:`StandinPlatform` when ``BLOCKDIFF_STANDIN_PLATFORM=1``,
    else None (vLLM's own platform).

    vLLM skips a platform plugin whose module import or call raises an ``Exception`` (it only logs the import's), and
    would then serve on its own platform: so this module imports nothing of ``blockdiff.attention`` at its top (whose
    import reads ``BLOCKDIFF_CHECK_VALUES``), and a bad switch value here is a ``SystemExit`` naming it, which stops
    the start.

    Raises:
        SystemExit: ``BLOCKDIFF_STANDIN_PLATFORM`` (or ``BLOCKDIFF_CHECK_VALUES``) holds a value other than the
            switches' (``attention/env.py``).
    """
    try:
        from blockdiff.attention.env import env_flag

        on = env_flag(PLATFORM_ENV, meaning="the stand-in platform")
    except ValueError as e:
        raise SystemExit(f"serve_standin platform plugin: {e}") from e
    return PLATFORM_CLASS if on else None


def write_plugin_dir(folder: str | os.PathLike) -> Path:
    """Write a ``blockdiff_standin`` dist-info with the ``vllm.platform_plugins`` entry point into ``folder`` (put
    it on ``PYTHONPATH``); returns the dist-info folder."""
    d = Path(folder) / "blockdiff_standin-0.1.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: blockdiff_standin\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nblockdiff_standin = blockdiff.bench.experiments.serve_standin:platform_plugin\n")
    return d


def read_steps(path: str | os.PathLike) -> list[tuple]:
    """The stand-in's step log: (start, end, tokens, canvas tokens, requests) per step, followed by the
    :data:`WIDTH_FIELDS` (ints) where the line has them (logs written before those fields existed have five); [] if
    absent. Lines of any other shape are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        f = line.split()
        if len(f) in (5, 5 + len(WIDTH_FIELDS)):
            try:
                out.append((float(f[0]), float(f[1]), *(int(x) for x in f[2:])))
            except ValueError:
                continue
    return out


def load_timeline(result: dict, steps: list[tuple]) -> dict:
    """Where a load's client time went against the stand-in's "GPU": the client's window (first request sent to
    last output, ``perf_counter`` s of ``vllm bench serve``'s detailed result), the steps inside it, their span and
    busy time, the lead-in (sent -> first step starts) and the tail (last step ends -> last output; < 0: the last
    step in the window produced nothing the client waited for). Where the steps carry :data:`WIDTH_FIELDS`, also
    how many of those steps were not uniform (``non_uniform_steps``), mixed canvas widths, carried a prefill row,
    and their ``2 * CL`` rows (``wide_rows``) and budget-cut ones (``cut_rows``). Empty dict without per-request
    times or steps."""
    windows = bs.request_windows(result, 0.0)
    if not windows:
        return {}
    s0, e1 = windows[0][0], max(w[2] for w in windows)
    inside = [s for s in steps if s[1] >= s0 and s[0] <= e1]
    if not inside:
        return {"window_s": round(e1 - s0, 4), "steps": 0}
    g0, g1 = min(s[0] for s in inside), max(s[1] for s in inside)
    out = {"window_s": round(e1 - s0, 4), "steps": len(inside), "gpu_span_s": round(g1 - g0, 4),
           "gpu_busy_s": round(sum(s[1] - s[0] for s in inside), 4), "lead_in_s": round(g0 - s0, 4),
           "tail_s": round(e1 - g1, 4),
           "ttft_median_s": round(statistics.median(w[1] - w[0] for w in windows), 4),
           "e2e_median_s": round(statistics.median(w[2] - w[0] for w in windows), 4)}
    widths = [s[5:] for s in inside if len(s) == 5 + len(WIDTH_FIELDS)]
    if widths:
        out.update(non_uniform_steps=sum(1 for w in widths if not w[0]),
                   mixed_canvas_steps=sum(1 for w in widths if w[1]),
                   prefill_steps=sum(1 for w in widths if w[2]), wide_rows=sum(w[3] for w in widths),
                   cut_rows=sum(w[4] for w in widths))
    return out


def server_command(*, model: str, port: int, max_num_seqs: int, kv_cache_gib: float, quant: str = "fp8",
                   api_server_count: int = 1, async_scheduling: bool = True, canvas_length: int | None = None,
                   fuse_commit: bool = False, fuse_policy: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The benchmark's blockdiff server command (:func:`blockdiff.bench.bench_serve.server_command`, triton backend
    named, no profiler) with the stand-in worker: (environment, argv).

    Args:
        async_scheduling: False: ``--no-async-scheduling`` and ``BlockdiffDiffusionScheduler``.
        canvas_length: the ``--diffusion-config`` canvas_length (None: the benchmark's, 256); twice the model's
            (512) is the fused-commit layout (``blockdiff.integration.vllm_scheduler.served_canvas_length``).
        fuse_commit: set ``BLOCKDIFF_FUSE_COMMIT=1`` (fused commits need ``canvas_length`` = 2 * 256; either
            scheduler fuses: the asynchronous one the commits the step cap forces).
        fuse_policy: None (the variable left out: ``any``), or a value of ``BLOCKDIFF_FUSE_POLICY``
            (``blockdiff.integration.vllm_scheduler.FUSE_POLICIES``: ``any``, ``uniform``).

    Raises:
        ValueError: ``canvas_length`` not an int >= 1; ``fuse_commit`` / ``async_scheduling`` not a bool;
            ``fuse_policy`` not None nor a fuse policy (the variable and the allowed values named).
    """
    for name, v in (("async_scheduling", async_scheduling), ("fuse_commit", fuse_commit)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    env, argv = bs.server_command("blockdiff-triton", quant, model=model, port=port, max_num_seqs=max_num_seqs,
                                  kv_cache_bytes=int(kv_cache_gib * 2**30), gpu_memory_utilization=0.9,
                                  api_server_count=api_server_count, async_scheduling=async_scheduling)
    if canvas_length is not None:
        bs._check_int("canvas_length", canvas_length, 1)
        i = argv.index("--diffusion-config") + 1
        argv[i] = json.dumps({**json.loads(argv[i]), "canvas_length": canvas_length}, separators=(",", ":"))
    if fuse_commit:
        from blockdiff.integration.vllm_scheduler import FUSE_COMMIT_ENV

        env[FUSE_COMMIT_ENV] = "1"
    if fuse_policy is not None:
        from blockdiff.integration.vllm_scheduler import FUSE_POLICY_ENV, fuse_policy_from_env

        env[FUSE_POLICY_ENV] = fuse_policy_from_env({FUSE_POLICY_ENV: fuse_policy})
    return env, argv + ["--distributed-executor-backend", "uni", "--worker-cls", WORKER_CLASS]


def _healthy(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except OSError:
        return False


def check_environment(environ=os.environ) -> dict:
    """The stand-in's variables as given, checked (by ``run`` before a server starts, and by the worker).

    Raises:
        ValueError: a variable with a bad value (named).
    """
    step = environ.get(STEP_ENV, STEP_MS)
    host = environ.get(HOST_ENV, "0,0")
    parse_floats(step, 3, STEP_ENV)
    parse_floats(host, 2, HOST_ENV)
    tokens = environ.get(TOKENS_ENV, "unused")
    if tokens not in TOKEN_MODES:
        raise ValueError(f"{TOKENS_ENV} must be one of {TOKEN_MODES}, got {tokens!r}")
    return {"step_ms": step, "host_ms": host, "tokens": tokens}


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def run(args) -> dict:
    """The ``run`` subcommand: start the stand-in server, one load per concurrency, stop; returns the summary.

    Raises:
        ValueError: a stand-in variable with a bad value (:func:`check_environment`).
        RuntimeError: the port is taken, or the server did not come up.
    """
    standin = check_environment()
    if not _port_free(args.port):
        raise RuntimeError(f"--port {args.port} is in use (a server left from an earlier run?): stop it or pick "
                           "another port")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("standin.json", "server.pid"):  # never report an earlier run's results as this one's
        (out / stale).unlink(missing_ok=True)
    model = Path(args.model) if args.model else out / "dg26b"
    if not (model / "config.json").exists():
        bs.write_model_folder(model)
    env = dict(os.environ)
    if args.platform == "cpu":
        write_plugin_dir(out / "plugin")
        env[PLATFORM_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(out / "plugin"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    steps_log = out / "steps.log"
    steps_log.unlink(missing_ok=True)
    env[LOG_ENV] = str(steps_log)
    senv, argv = server_command(model=str(model), port=args.port, max_num_seqs=args.max_num_seqs,
                                kv_cache_gib=args.kv_cache_gib, quant=args.quant, api_server_count=args.api_servers,
                                async_scheduling=args.async_scheduling, canvas_length=args.canvas_length,
                                fuse_commit=args.fuse_commit, fuse_policy=args.fuse_policy)
    if args.server_cmd:  # a stand-in for the whole server (CPU tests of this driver), run as CMD PORT TRACE_DIR
        argv = [*args.server_cmd, str(args.port), str(out / "trace")]
    env.update(senv)
    env["VLLM_PLUGINS"] = "blockdiff,blockdiff_standin"
    (out / "server.cmd").write_text(shlex.join(argv) + "\n")
    summary: dict = {"env": bs.environment(), "standin": {
        **standin, "platform": args.platform, "api_servers": args.api_servers,
        "async_scheduling": args.async_scheduling, "canvas_length": args.canvas_length,
        "fuse_commit": args.fuse_commit, "fuse_policy": args.fuse_policy}, "loads": []}
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (out / "server.pid").write_text(f"{server.pid}\n")  # for a profiler attached from outside (serve_standin.sh)
    try:
        t0 = time.time()
        while not (_healthy(args.port) and server.poll() is None):  # healthy, and this run's server
            if server.poll() is not None or time.time() - t0 > args.start_timeout:
                raise RuntimeError(f"the stand-in server did not come up (exit {server.poll()}); see "
                                   f"{out / 'server.log'}")
            time.sleep(2)
        summary["start_s"] = round(time.time() - t0, 1)
        bench_cmd = args.bench_cmd or [sys.executable, *bs.VLLM_CLI, "bench", "serve"]
        for i, c in enumerate(args.concurrency):
            n = args.prompts[i] if args.prompts else max(c, args.min_prompts)
            name = f"standin_c{c}_{i}"
            bargs = bs.bench_serve_args(base_url=f"http://127.0.0.1:{args.port}", model=str(model), concurrency=c,
                                        num_prompts=n, num_warmups=0, result_dir=str(out),
                                        result_filename=f"{name}.json", seed=1000 + i, ready_check_timeout_s=0,
                                        skip_special_tokens=args.skip_special_tokens)
            with bs.HostCpuSampler(server.pid) as cpu:
                result, why = bs.run_bench_serve(bench_cmd, bargs, result_path=out / f"{name}.json",
                                                 log_path=out / f"{name}.log", timeout_s=args.run_timeout)
            if result is None:
                summary["loads"].append({"concurrency": c, "status": "error", "reason": why})
                continue
            row = bs.row_from_result(result, backend="standin", quant=args.quant, max_num_seqs=args.max_num_seqs)
            row["timeline"] = load_timeline(result, read_steps(steps_log))
            row["host_cpu"] = cpu.result()
            row["skip_special_tokens"] = bs.effective_skip_special_tokens(args.skip_special_tokens)
            summary["loads"].append(row)
            t = row["timeline"]
            print(f"c{c} ({n} prompts): {row['output_tok_s']:.0f} tok/s, window {t.get('window_s')} s, GPU span "
                  f"{t.get('gpu_span_s')} s, lead-in {t.get('lead_in_s')} s, tail {t.get('tail_s')} s, TTFT median "
                  f"{t.get('ttft_median_s')} s, failed {row['failed']}, non-uniform steps "
                  f"{t.get('non_uniform_steps')} (mixed canvas widths {t.get('mixed_canvas_steps')}, prefill "
                  f"{t.get('prefill_steps')}), wide rows {t.get('wide_rows')} (cut {t.get('cut_rows')})",
                  flush=True)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    (out / "standin.json").write_text(json.dumps(common.jsonable(summary), indent=1, default=str))
    return summary


def detokenizer_ms(tokenizer_json: str | os.PathLike, *, prompt_len: int = 4096, output_len: int = 512,
                   modes: tuple[str, ...] = TOKEN_MODES, seed: int = 0,
                   skip_special_tokens: bool = True) -> dict[str, float]:
    """Milliseconds vLLM 0.26's fast incremental detokenizer path (``tokenizers.decoders.DecodeStream`` primed with
    the prompt, one ``step`` per token, as ``FastIncrementalDetokenizer``) takes for one request's ``output_len``
    committed tokens of each token mode, after a prompt of ``prompt_len`` byte tokens, with
    ``skip_special_tokens`` as the request asks (vLLM's default: True): the API server's cost per request (one
    thread, the GIL held; docs/tuning.md 7.19).

    Raises:
        ValueError: a mode is not one of :data:`TOKEN_MODES`, or a length is < 1.
        TypeError: ``skip_special_tokens`` is not a bool, or this ``tokenizers`` has no prompt-primed
            ``DecodeStream`` (``ids=``).
    """
    if not isinstance(skip_special_tokens, bool):
        raise TypeError(f"skip_special_tokens must be a bool, got {skip_special_tokens!r}")
    import tokenizers
    from tokenizers.decoders import DecodeStream

    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    tok = tokenizers.Tokenizer.from_file(os.fspath(tokenizer_json))
    vocab = tok.get_vocab_size()
    rng = random.Random(seed)
    prompt = [3 + rng.randrange(32, 127) for _ in range(prompt_len)]
    out = {}
    for mode in modes:
        ids = [commit_token(mode, rng, vocab) for _ in range(output_len)]
        stream = DecodeStream(ids=prompt, skip_special_tokens=skip_special_tokens)
        t0 = time.perf_counter()
        for i in ids:
            stream.step(tok, i)
        out[mode] = 1e3 * (time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    from blockdiff.integration.vllm_scheduler import FUSE_POLICIES  # no vLLM import

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start the stand-in server, one load per concurrency, stop")
    r.add_argument("--out", required=True, help="work folder: model, logs, results, standin.json")
    r.add_argument("--platform", choices=("cpu", "auto"), default="cpu",
                   help="cpu: the stand-in's CPU platform plugin (a machine without a GPU); auto: vLLM's own")
    r.add_argument("--concurrency", type=bs._ints, default=[1, 64], help="loads, in order (default 1,64)")
    r.add_argument("--min-prompts", type=bs._pos_int, default=4, help="prompts of a load: max(concurrency, this)")
    r.add_argument("--prompts", type=bs._ints, default=None,
                   help="prompts of each load instead (as many as --concurrency; the H200 sweep's: 4,8,32,64)")
    r.add_argument("--model", help="model folder (default OUT/dg26b, written if missing)")
    r.add_argument("--port", type=bs._pos_int, default=8190)
    r.add_argument("--max-num-seqs", type=bs._pos_int, default=64)
    r.add_argument("--kv-cache-gib", type=bs._pos_float, default=40.0)
    r.add_argument("--quant", choices=bs.QUANTS, default="fp8")
    r.add_argument("--api-servers", type=bs._pos_int, default=1)
    r.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="vLLM's synchronous scheduler (BlockdiffDiffusionScheduler)")
    r.add_argument("--canvas-length", type=bs._pos_int, default=None,
                   help="--diffusion-config canvas_length (default the benchmark's 256; 512: the fused-commit layout)")
    r.add_argument("--fuse-commit", action="store_true",
                   help="BLOCKDIFF_FUSE_COMMIT=1 (with --canvas-length 512; synchronous or asynchronous)")
    r.add_argument("--fuse-policy", choices=FUSE_POLICIES, default=None,
                   help="BLOCKDIFF_FUSE_POLICY (default: unset, i.e. any): uniform keeps fused rows only in steps "
                        "whose canvas rows are all fused (docs/tuning.md 7.40)")
    r.add_argument("--bench-cmd", type=bs._cmd, help="the client (default: this Python's `vllm bench serve`)")
    r.add_argument("--server-cmd", type=bs._cmd, help=argparse.SUPPRESS)  # CPU tests: a fake server, CMD PORT DIR
    r.add_argument("--start-timeout", type=bs._pos_float, default=300.0, help="seconds the server may take to start")
    r.add_argument("--run-timeout", type=bs._pos_float, default=600.0, help="seconds one load's client may take")
    bs.add_skip_special_tokens_option(r)
    p = sub.add_parser("plugin-dir", help="write the platform plugin's dist-info into a folder")
    p.add_argument("folder")
    d = sub.add_parser("detok", help="ms the incremental detokenizer takes per request for each token mode")
    d.add_argument("--model", required=True, help="model folder with tokenizer.json (bench_serve model)")
    d.add_argument("--prompt-len", type=bs._pos_int, default=bs.INPUT_LEN)
    d.add_argument("--output-len", type=bs._pos_int, default=bs.OUTPUT_LEN)
    a = ap.parse_args(argv)
    if a.command == "plugin-dir":
        print(write_plugin_dir(a.folder))
        return 0
    if a.command == "detok":
        tj = Path(a.model) / "tokenizer.json"
        ms = {("skipped" if skip else "kept"): detokenizer_ms(tj, prompt_len=a.prompt_len, output_len=a.output_len,
                                                               skip_special_tokens=skip) for skip in (True, False)}
        print(json.dumps({"prompt_len": a.prompt_len, "output_len": a.output_len,
                          "ms_per_request_special_tokens": ms}))
        return 0
    if a.prompts is not None and len(a.prompts) != len(a.concurrency):
        ap.error(f"--prompts must give one count per --concurrency value, got {len(a.prompts)} for "
                 f"{len(a.concurrency)}")
    # a SIGTERM (`timeout`'s signal) unwinds run(), whose `finally` stops the server (its own process group)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        run(a)
    except (RuntimeError, ValueError) as e:
        print(f"serve_standin: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
