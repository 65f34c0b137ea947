"""Command line: ``blockdiff demo`` (console script ``blockdiff = blockdiff.integration.cli:main``)."""
from __future__ import annotations

import argparse
import sys

ATTENTION_BACKENDS = ("reference", "triton", "cute")
SAMPLER_BACKENDS = ("reference", "triton")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blockdiff", description="blockdiff: block-diffusion LM kernels and serving")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a tiny random-weight DiffusionGemma through the harness",
                       description="Run a tiny random-weight DiffusionGemma through the model-runner-v2 harness: "
                                   "mixed prefill/denoise/commit batches, a per-step table, totals and a PNG of "
                                   "one mixed step's attention pattern.")
    d.add_argument("--backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention backend (default reference; no fallback: an unavailable backend is an error)")
    d.add_argument("--sampler-backend", choices=SAMPLER_BACKENDS, default="reference",
                   help="sampler backend (default reference)")
    d.add_argument("--check", action="store_true",
                   help="compare every attention call and sampler step with the references; exit 1 on mismatch")
    d.add_argument("--device", default="cpu", help="torch device (default cpu)")
    d.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    d.add_argument("--out", default="./demo_out", help="folder for attention_pattern.png (default ./demo_out/)")
    d.add_argument("--canvas-length", type=int, default=16, help="tokens per canvas (default 16)")
    d.add_argument("--max-denoising-steps", type=int, default=6, help="denoising step cap per canvas (default 6)")
    d.add_argument("--embedding-scale", type=float, default=30.0,
                   help="scale of the random tied embedding, peaking the toy logits (default 30; 1 = raw init)")
    d.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 check mismatch or every request failed, 2 usage / unavailable
    backend)."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .checks import AttentionMismatch
        from .demo import BackendUnavailable, run_demo
        from .sampler import SamplerMismatch

        import math
        import os

        problems = []
        if not 1 <= args.canvas_length <= 4096:
            problems.append(f"--canvas-length must be in [1, 4096] tokens, got {args.canvas_length}")
        if args.max_denoising_steps < 1:
            problems.append(f"--max-denoising-steps must be >= 1, got {args.max_denoising_steps}")
        if not (math.isfinite(args.embedding_scale) and args.embedding_scale > 0):
            problems.append(f"--embedding-scale must be a finite number > 0, got {args.embedding_scale}")
        try:
            os.makedirs(args.out, exist_ok=True)
            if not os.access(args.out, os.W_OK):
                raise PermissionError("not writable")
        except OSError as e:
            problems.append(f"--out {args.out!r} is not a writable folder ({e})")
        if problems:
            for msg in problems:
                print(f"blockdiff demo: error: {msg}", file=sys.stderr)
            return 2
        try:
            result = run_demo(backend=args.backend, sampler_backend=args.sampler_backend, check=args.check,
                     device=args.device, seed=args.seed, out=args.out, canvas_length=args.canvas_length,
                     max_denoising_steps=args.max_denoising_steps, progress=not args.no_progress,
                     embedding_scale=args.embedding_scale)
        except BackendUnavailable as e:
            print(f"blockdiff demo: error: {e}", file=sys.stderr)
            return 2
        except (AttentionMismatch, SamplerMismatch) as e:
            print(f"blockdiff demo: CHECK FAILED: {e}", file=sys.stderr)
            return 1
        reasons = [r.finish_reason for r in result.results.values()]
        if reasons and all(str(x).startswith("fail") for x in reasons):
            print(f"blockdiff demo: error: all {len(reasons)} requests failed (non-finite logits)", file=sys.stderr)
            return 1
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
