"""End-to-end benchmark: a DiffusionGemma-shaped model served by blockdiff's harness, per denoising step.

Usage (H200; PYTHONPATH must make ``blockdiff.*`` importable; results go to $OUT or bench/results/):

    python3 -m blockdiff.bench.bench_e2e                                   # 6 layers of 26B-A4B shape, bs 1 and 4
    python3 -m blockdiff.bench.bench_e2e --layers 30 --attn-backends triton,cute --sampler-backend triton
    python3 -m blockdiff.bench.bench_e2e --quick                           # CPU: tiny model, reference backends

What runs: ``blockdiff.model.DiffusionGemma`` with random weights (DiffusionGemma-26B-A4B widths: hidden 2816,
16 query heads, sliding layers 8 KV heads x hd 256 with W = 1023, global layers 2 KV heads x hd 512, 128 experts
top-8 of width 704, vocab 262144, 5 sliding : 1 global; ``--layers`` sets the depth, 6 by default to fit the
device-time budget, 30 for the full model) driven by ``blockdiff.integration.HarnessRunner`` in vLLM model
runner v2's call order. Each of ``batch`` requests has a ``--prompt-len`` prompt and one canvas of 256 with
exactly 16 denoising steps (``max_denoising_steps=16``, ``confidence_threshold=0``: as vLLM's published
DiffusionGemma benchmark fixes 16 steps), then its commit. A first identical run warms up (Triton compiles).

Recorded per (batch, attention backend): median denoise step time (ms), its attention and sampler shares (CUDA
events around every ``attention()`` call of the model and every sampler call; perf_counter on the CPU),
tokens/s = batch * 256 / (16 denoise steps + commit), prefill time. Rows follow docs/ARCHITECTURE.md "Benchmark
records" (suite ``e2e``): ``eager_ms`` is the median denoise step. A generation that is not the workload (a request
not finished by length, fewer tokens than batch x 256, other than 16 denoise steps) is status ``incomplete`` with the
reason (:func:`incomplete_reason`), its numbers kept.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from blockdiff.bench import common
from blockdiff.model.config import DIFFUSIONGEMMA_26B_A4B as _GEOMETRY

SUITE = "e2e"
DENOISING_STEPS = 16

#: DiffusionGemma-26B-A4B text widths, without the depth (``--layers``): blockdiff.model.config's named geometry.
DIFFUSIONGEMMA_26B_A4B = {k: v for k, v in _GEOMETRY.items() if k != "num_hidden_layers"}


class Unavailable(RuntimeError):
    """The model or the integration harness is not importable here."""


def _imports():
    try:
        from blockdiff.model import DiffusionGemma, DiffusionGemmaConfig, tiny_config
        from blockdiff.model.layers import init_weights_
    except ImportError as e:
        raise Unavailable(f"blockdiff.model is not in place ({e}); bench_e2e needs DiffusionGemma") from e
    try:
        from blockdiff.integration import HarnessRunner
        from blockdiff.sampler import SamplingParams
    except ImportError as e:
        raise Unavailable(f"blockdiff.integration / blockdiff.sampler not in place ({e}); bench_e2e needs "
                          "HarnessRunner") from e
    return DiffusionGemma, DiffusionGemmaConfig, tiny_config, init_weights_, HarnessRunner, SamplingParams


def model_config(args):
    DiffusionGemma, DiffusionGemmaConfig, tiny_config, *_ = _imports()
    if args.quick:
        return tiny_config()
    n = args.layers
    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    layer_types[-1] = "full_attention"
    return DiffusionGemmaConfig(num_hidden_layers=n, layer_types=layer_types, **DIFFUSIONGEMMA_26B_A4B)


def build_model(cfg, device: torch.device, dtype: torch.dtype, moe_impl: str, seed: int = 0):
    """Random-weight model on ``device``: built on the meta device, then initialised in place on ``device``
    (the model's own init rule; drawing 26B-shaped weights on the host would take minutes)."""
    DiffusionGemma, _, _, init_weights_, *_ = _imports()
    model = DiffusionGemma(cfg, device="meta", dtype=dtype, moe_impl=moe_impl)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.device(device):  # init_weights_ draws with torch.randn: on the device, not on the host
        init_weights_(model, std=cfg.initializer_range)
    return model.eval()


class CallTimer:
    """Accumulates the time of wrapped calls: CUDA events on the GPU (read after the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.ms = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*a, **kw):
            self.calls += 1
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*a, **kw)
                e.record()
                self.pending.append((s, e))
                return out
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.ms += (time.perf_counter() - t0) * 1e3
            return out

        return timed

    def collect(self) -> float:
        """Milliseconds accumulated since the last collect (synchronises on CUDA)."""
        if self.cuda and self.pending:
            torch.cuda.synchronize()
            self.ms += sum(s.elapsed_time(e) for s, e in self.pending)
            self.pending.clear()
        ms, self.ms = self.ms, 0.0
        return ms


class _TimedSampler:
    """Stands in for the harness's sampler object: times ``__call__``, forwards everything else."""

    def __init__(self, inner, timer: CallTimer):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_call", timer.wrap(inner.__call__))

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def run_once(model, args, batch: int, attn_backend: str, device, dtype, seed: int) -> dict:
    """One measured generation: ``batch`` requests, prefill, 16 denoise steps, commit; per-step timings."""
    *_, HarnessRunner, SamplingParams = _imports()

    cfg = model.config
    CL = cfg.canvas_length
    params = SamplingParams(canvas_length=CL, max_denoising_steps=DENOISING_STEPS, confidence_threshold=0.0,
                            max_tokens=CL, seed=seed)
    P = args.prompt_len
    runner = HarnessRunner(model, default_params=params, max_num_reqs=batch,
                           max_num_batched_tokens=batch * max(P, CL), page_size=args.page_size,
                           max_model_len=P + 2 * CL, device=device, kv_dtype=dtype, attn_backend=attn_backend,
                           sampler_backend=args.sampler_backend)
    attn_t, samp_t = CallTimer(device), CallTimer(device)
    runner.sampler = _TimedSampler(runner.sampler, samp_t)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(3, cfg.vocab_size, (P,), generator=g).tolist()
        runner.add_request(f"r{i}", prompt, params)
    # time attention() where the model looks it up: its defining module's globals (a module-level import) or
    # blockdiff.attention (a function-local one)
    import blockdiff.attention as attention_pkg

    hooked = [m for m in (sys.modules[type(model).__module__], attention_pkg) if hasattr(m, "attention")]
    originals = [m.attention for m in hooked]
    for m, fn in zip(hooked, originals):
        m.attention = attn_t.wrap(fn)
    steps = []
    try:
        while runner.has_unfinished:
            if device.type == "cuda":
                torch.cuda.synchronize()
            rec = runner.step()
            phases = sorted({r.phase for r in rec.rows})
            calls = attn_t.calls
            steps.append({"step": rec.step, "phases": phases, "rows": len(rec.rows), "tokens": rec.num_tokens,
                          "wall_ms": rec.wall_ms, "attention_ms": attn_t.collect(), "sampler_ms": samp_t.collect(),
                          "attention_calls": calls, "emitted": rec.tokens_emitted})
            attn_t.calls = 0
            if len(steps) > 8 * DENOISING_STEPS + 8 * batch:
                raise RuntimeError("generation did not finish within the expected number of steps")
    finally:
        for m, fn in zip(hooked, originals):
            m.attention = fn
    return {"steps": steps, "results": runner.results}


def summarise(steps: list[dict], batch: int, canvas_length: int) -> dict:
    den = [s for s in steps if s["phases"] == ["denoise"]]
    com = [s for s in steps if "commit" in s["phases"]]
    pre = [s for s in steps if s["phases"] == ["prefill"]]
    step_ms = statistics.median(s["wall_ms"] for s in den) if den else None
    canvas_ms = sum(s["wall_ms"] for s in den + com)
    emitted = sum(s["emitted"] for s in steps)
    den_ms = sum(s["wall_ms"] for s in den)
    seen = sum(s.get("attention_calls", 0) for s in den)
    return {
        "attention_calls_per_step": (seen / len(den)) if den else None,
        "eager_ms": step_ms, "graph_ms": None, "effective_tflops": None, "extra_memory_bytes": None,
        "denoise_step_ms": step_ms, "denoise_steps": len(den), "commit_ms": sum(s["wall_ms"] for s in com),
        "prefill_ms": sum(s["wall_ms"] for s in pre), "canvas_ms": canvas_ms,
        "tokens_emitted": emitted, "tokens_per_s": (emitted / (canvas_ms / 1e3)) if canvas_ms else None,
        # None when no attention() call was seen: the model looks it up somewhere else
        "attention_share": (sum(s["attention_ms"] for s in den) / den_ms) if den_ms and seen else None,
        "sampler_share": (sum(s["sampler_ms"] for s in den) / den_ms) if den_ms else None,
        "attention_ms_per_step": statistics.median(s["attention_ms"] for s in den) if den else None,
        "sampler_ms_per_step": statistics.median(s["sampler_ms"] for s in den) if den else None,
        "expected_tokens": batch * canvas_length,
    }


def incomplete_reason(summary: dict, finish_reasons: list) -> str | None:
    """Why a measured generation is not the workload (None when it is): every request finished by length, the
    batch emitted ``expected_tokens`` (batch x canvas) and the canvas took ``DENOISING_STEPS`` denoise steps. Such a
    row is status ``incomplete``: its tokens/s and step times count what was served, not the workload's (a request
    that finished with ``error`` after no token, or early, shortened ``canvas_ms``; fewer steps made every canvas
    cheaper)."""
    problems = []
    if any(r != "length" for r in finish_reasons):
        problems.append(f"finish reasons {finish_reasons} (every request should finish by length)")
    if summary.get("tokens_emitted") != summary.get("expected_tokens"):
        problems.append(f"{summary.get('tokens_emitted')} of {summary.get('expected_tokens')} tokens emitted")
    if summary.get("denoise_steps") != DENOISING_STEPS:
        problems.append(f"{summary.get('denoise_steps')} denoise steps, not {DENOISING_STEPS}")
    return "; ".join(problems) or None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU: tiny model, reference backends, small prompt")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--layers", type=int, default=6, help="model depth (30 = full 26B-A4B; default 6)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 1024; quick 24)")
    p.add_argument("--attn-backends", default=None, help="comma-separated (default triton; quick reference)")
    p.add_argument("--sampler-backend", default=None, help="reference or triton (default triton; quick reference)")
    p.add_argument("--moe-impl", default=None, help="loop or grouped_mm (default grouped_mm on CUDA, loop on CPU)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default=None,
                   help="default: cuda (cpu with --quick; without a GPU a full-shape run stops unless --device cpu)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:  # a list naming nothing (',', '') measured nothing and exited 0
        batches = common.comma_list(a.batches, "--batches")
        attn = common.comma_list(a.attn_backends or ("reference" if a.quick else "triton"), "--attn-backends")
    except ValueError as e:
        p.error(str(e))
    if not batches:
        p.error(f"--batches must name at least one batch size, got {a.batches!r}")
    try:
        a.batches = [int(x) for x in batches]
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {a.batches!r}")
    if a.prompt_len is None:
        a.prompt_len = 24 if a.quick else 1024
    a.attn_backends = attn
    a.sampler_backend = a.sampler_backend or ("reference" if a.quick else "triton")
    return a


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe_impl = args.moe_impl or ("grouped_mm" if device.type == "cuda" else "loop")
    try:
        cfg = model_config(args)
    except Unavailable as e:
        print(f"bench_e2e: not run: {e}")
        return []
    if device.type == "cpu" and not args.quick and args.device is None:
        # the full shapes on the host: 5.7 B fp32 parameters at the default 6 layers (21 GiB), 94 GiB at 30
        DiffusionGemma = _imports()[0]
        n = sum(p.numel() for p in DiffusionGemma(cfg, device="meta", dtype=dtype, moe_impl=moe_impl).parameters())
        sys.exit(f"bench_e2e: no CUDA GPU: the {cfg.num_hidden_layers}-layer 26B-A4B-shaped model would need "
                 f"{n * 4 / 2**30:.0f} GiB of float32 weights on the CPU; --quick is the CPU smoke run (--device cpu "
                 "runs the full shapes on the CPU anyway)")
    env = common.env_record(device)
    common.log(f"device {env['gpu']}, commit {env['commit']}; model: {cfg.num_hidden_layers} layers, hidden "
               f"{cfg.hidden_size}, vocab {cfg.vocab_size}, canvas {cfg.canvas_length}; prompt {args.prompt_len}")
    if device.type == "cuda":
        common.warm_up_gpu(device)
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype, moe_impl, args.seed)
    common.log(f"model built in {time.perf_counter() - t0:.1f} s")
    rows = []
    jobs = [(b, ab) for ab in args.attn_backends for b in args.batches]
    for batch, ab in common.progress(jobs, desc="e2e"):
        row = {"workload": f"e2e_bs{batch}_prompt{args.prompt_len}_steps{DENOISING_STEPS}", "backend": ab,
               "sampler_backend": args.sampler_backend, "batch": batch, "prompt_len": args.prompt_len,
               "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
               "canvas_length": cfg.canvas_length, "moe_impl": moe_impl, "dtype": str(dtype).replace("torch.", ""),
               "page_size": args.page_size, "status": "ok"}
        try:
            if not args.no_warmup:
                run_once(model, args, batch, ab, device, dtype, args.seed + 1000)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            res = run_once(model, args, batch, ab, device, dtype, args.seed)
            row.update(summarise(res["steps"], batch, cfg.canvas_length))
            row["finish_reasons"] = sorted({r.finish_reason for r in res["results"].values()})
            row["steps"] = res["steps"]
            why = incomplete_reason(row, row["finish_reasons"])
            if why:  # measured, but not the workload: not an ok row (was: ok, its tokens/s beside the others)
                row.update(status="incomplete", reason=why)
            if device.type == "cuda":
                row["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        except NotImplementedError as e:
            row.update(status="skipped", reason=f"NotImplementedError: {e}")
        except Exception as e:  # noqa: BLE001 - one failing configuration records an error row
            row.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}",
                       traceback=traceback.format_exc(limit=4)[-1500:])
        rows.append(row)
        common.log(f"  bs {batch} {ab}: {row['status']} step {common.fmt(row.get('denoise_step_ms'))} ms, "
                   f"{common.fmt(row.get('tokens_per_s'), 1)} tok/s {row.get('error', '')}")
    suite = SUITE + ("-quick" if args.quick else "")
    out_dir = Path(args.out) if args.out else common.results_dir(local=args.quick or device.type == "cpu")
    path = common.write_records(suite, rows, env=env, out_dir=out_dir,
                                extra={"model_config": cfg.to_dict(), "denoising_steps": DENOISING_STEPS,
                                       "quick": args.quick, "argv": common.script_argv(argv)})
    print(f"\nwrote {path} (+ .csv)")
    print(common.summary_table(rows, ["workload", "backend", "sampler_backend", "status", "denoise_step_ms",
                                      "tokens_per_s", "attention_share", "sampler_share", "prefill_ms"]))
    return rows


if __name__ == "__main__":
    main()
