"""Command line: ``blockdiff demo`` (console script ``blockdiff = blockdiff.integration.cli:main``); see
:mod:`blockdiff.integration.demo` for what it runs."""
from __future__ import annotations

import argparse
import sys

ATTENTION_BACKENDS = ("reference", "triton", "cute")
SAMPLER_BACKENDS = ("reference", "triton")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blockdiff", description="blockdiff: block-diffusion LM kernels and serving")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a small DiffusionGemma (the shipped trained checkpoint) through the harness",
                       description="Run a DiffusionGemma through the model-runner-v2 harness: mixed prefill/denoise/"
                                   "commit batches, a per-step table, totals, tokens committed per forward pass, "
                                   "denoising steps per canvas, the generated text and a PNG of one mixed step's "
                                   "attention pattern. Model: the trained checkpoint shipped in the package "
                                   "(blockdiff/model/checkpoints/stdlib-byte/), --checkpoint FOLDER, or "
                                   "--random-weights. Without a shipped checkpoint and without either flag it "
                                   "runs random weights and prints that it does.")
    m = d.add_mutually_exclusive_group()
    m.add_argument("--checkpoint", metavar="FOLDER", default=None,
                   help="trained checkpoint folder (model.safetensors, config.json, tokenizer.json, as written by "
                        "python3 -m blockdiff.model.train --out FOLDER); default: the shipped one")
    m.add_argument("--random-weights", action="store_true",
                   help="tiny random-weight model with random prompt ids (no checkpoint)")
    d.add_argument("--backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention backend (default reference; no fallback: an unavailable backend is an error)")
    d.add_argument("--sampler-backend", choices=SAMPLER_BACKENDS, default="reference",
                   help="sampler backend (default reference)")
    d.add_argument("--check", action="store_true",
                   help="compare every attention call and sampler step with the references; exit 1 on mismatch")
    d.add_argument("--device", default="cpu", help="torch device (default cpu)")
    d.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    d.add_argument("--out", default="./demo_out", help="folder for attention_pattern.png (default ./demo_out/)")
    d.add_argument("--canvas-length", type=int, default=None,
                   help="tokens per canvas (default: the checkpoint's trained canvas length; 16 for random weights)")
    d.add_argument("--max-denoising-steps", type=int, default=None,
                   help="denoising step cap per canvas (default 16 with a checkpoint, 6 for random weights)")
    d.add_argument("--embedding-scale", type=float, default=None,
                   help="random weights only: scale of the random tied embedding, peaking the toy logits "
                        "(default 30; 1 = raw init)")
    d.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap


def resolve_checkpoint(args, stream=None) -> tuple[str | None, str | None]:
    """The model ``blockdiff demo`` runs: ``(checkpoint folder or None for random weights, error or None)``.

    ``--random-weights``: None. ``--checkpoint FOLDER``: FOLDER, which must exist (else an error naming
    ``--checkpoint``). Neither: the shipped checkpoint when the package has it; otherwise random weights, and a
    line saying so is printed to ``stream`` (default stdout) -- documented behaviour, not a silent fallback.
    """
    import os

    from blockdiff.model.pretrained import shipped_checkpoint_dir

    if args.random_weights:
        return None, None
    if args.checkpoint is not None:
        if not os.path.isdir(args.checkpoint):
            return None, f"--checkpoint {args.checkpoint!r} is not a folder (expected a checkpoint folder written " \
                         "by python3 -m blockdiff.model.train --out FOLDER)"
        return args.checkpoint, None
    shipped = shipped_checkpoint_dir()
    if os.path.isdir(shipped):
        return shipped, None
    print(f"blockdiff demo: no trained checkpoint shipped at {shipped}; running tiny RANDOM weights instead "
          "(choose explicitly with --checkpoint FOLDER or --random-weights)", file=stream or sys.stdout, flush=True)
    return None, None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 check mismatch or every request failed, 2 usage / unavailable
    backend / unusable checkpoint)."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .checks import AttentionMismatch
        from .demo import BackendUnavailable, CheckpointError, run_demo
        from .sampler import SamplerMismatch

        import math
        import os

        problems = []
        if args.canvas_length is not None and not 1 <= args.canvas_length <= 4096:
            problems.append(f"--canvas-length must be in [1, 4096] tokens, got {args.canvas_length}")
        from blockdiff.sampler.rng import MAX_STEPS

        if args.max_denoising_steps is not None and not 1 <= args.max_denoising_steps < MAX_STEPS:
            problems.append(f"--max-denoising-steps must be in [1, {MAX_STEPS}), got {args.max_denoising_steps}")
        if not 0 <= args.seed < 2 ** 63:
            problems.append(f"--seed must be in [0, 2**63), got {args.seed}")
        if args.embedding_scale is not None:
            if not (math.isfinite(args.embedding_scale) and args.embedding_scale > 0):
                problems.append(f"--embedding-scale must be a finite number > 0, got {args.embedding_scale}")
            elif args.checkpoint is not None:
                problems.append("--embedding-scale scales random weights; it cannot be used with --checkpoint")
        try:
            os.makedirs(args.out, exist_ok=True)
            if not os.access(args.out, os.W_OK):
                raise PermissionError("not writable")
        except OSError as e:
            problems.append(f"--out {args.out!r} is not a writable folder ({e})")
        checkpoint = None
        if not problems:
            checkpoint, err = resolve_checkpoint(args)
            if err:
                problems.append(err)
            elif checkpoint is not None and args.embedding_scale is not None:
                problems.append(f"--embedding-scale scales random weights; the demo runs the trained checkpoint "
                                f"{checkpoint} (add --random-weights)")
        if problems:
            for msg in problems:
                print(f"blockdiff demo: error: {msg}", file=sys.stderr)
            return 2
        try:
            result = run_demo(backend=args.backend, sampler_backend=args.sampler_backend, check=args.check,
                              device=args.device, seed=args.seed, out=args.out, checkpoint=checkpoint,
                              canvas_length=args.canvas_length, max_denoising_steps=args.max_denoising_steps,
                              progress=not args.no_progress, embedding_scale=args.embedding_scale)
        except BackendUnavailable as e:
            print(f"blockdiff demo: error: {e}", file=sys.stderr)
            return 2
        except CheckpointError as e:
            what = "--checkpoint" if args.checkpoint is not None else "shipped checkpoint"
            print(f"blockdiff demo: error: {what} {checkpoint!r} cannot be loaded: {e}", file=sys.stderr)
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
