"""Command line: ``blockdiff demo``, ``blockdiff train`` and ``blockdiff export`` (console script ``blockdiff =
blockdiff.integration.cli:main``; from a checkout without it: ``python3 -m blockdiff.integration.cli``). See
:mod:`blockdiff.integration.demo`, :mod:`blockdiff.model.train` and :mod:`blockdiff.model.export` for what they run.

Argument errors come first and fast: this module imports only the standard library at its top; each command
imports its torch-heavy modules once the arguments that need no torch are checked, and no command creates its
output folder before every flag passed (:func:`out_folder_problem` checks it without creating it).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import types

#: ``--backend`` / ``--attn-backend`` choices: the names of ``blockdiff.attention.BACKENDS`` and
#: ``blockdiff.sampler.BACKENDS``, repeated so argument errors need no torch (tests/test_backend_lists.py checks they
#: agree).
ATTENTION_BACKENDS = ("reference", "triton", "cute")
SAMPLER_BACKENDS = ("reference", "triton")
#: ``--max-denoising-steps`` must be below this: the sampler's RNG counter layout (``blockdiff.sampler.rng.MAX_STEPS``;
#: a constant here so the check needs no torch; tests/integration/test_cli.py checks the two agree).
MAX_DENOISING_STEPS = 1 << 14
#: ``blockdiff export --geometry`` names: the keys of ``blockdiff.model.config.GEOMETRIES`` (repeated here so
#: argument errors need no torch; tests/model/test_export.py checks the two agree).
GEOMETRY_NAMES = ("diffusiongemma-26b-a4b",)
#: Largest finite float32: the sampler keeps the float sampling parameters in float32 (blockdiff.model.config's
#: FLOAT32_MAX, repeated so argument errors need no torch; tests/model/test_export.py checks the two agree).
_FLOAT32_MAX = 3.4028234663852886e38
#: ``blockdiff export``'s sampling defaults when a flag is not given (blockdiff.model.export.GENERATION_DEFAULTS;
#: repeated so argument errors need no torch; tests/model/test_export.py checks the two agree).
_EXPORT_DEFAULTS = {"t_min": 0.4, "t_max": 0.8}
#: Why ``blockdiff export`` is stricter than SamplingParams: the file is transformers'.
_TRANSFORMERS_RULE = ("generation_config.json must load in transformers, whose DiffusionGemmaGenerationConfig "
                      "refuses t_max <= t_min, entropy_bound <= 0 and confidence_threshold <= 0")
#: Devices the commands compute on: ``cpu`` or ``cuda``, optionally with an index (torch's ``TYPE[:INDEX]``).
_DEVICE_RE = re.compile(r"(cpu|cuda)(:\d+)?")


def device_problem(flag: str, device: str) -> str | None:
    """Why ``device`` is not a device the commands can run on (``cpu``, ``cuda``, ``cuda:N``), or None; checked
    without torch, so the error comes before the heavy imports (whether a CUDA device is there is checked later)."""
    if _DEVICE_RE.fullmatch(device):
        return None
    what = "must not be empty" if not device.strip() else f"must be cpu, cuda or cuda:N, got {device!r}"
    if device == "meta":
        what += " (meta holds shapes only, no data to compute with)"
    return f"{flag} {what}"


def out_folder_problem(flag: str, path: str) -> str | None:
    """Why the output folder ``path`` (given as ``flag``: ``--out``, ``OUT``) could not be written, or None; checked
    without creating anything (the command creates it only once every flag passed): not empty, not a file, and the
    folder itself or, when missing, its nearest existing ancestor a writable folder."""
    if not path.strip():
        return f"{flag} must not be empty"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path!r} is a file, not a folder"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:  # the nearest folder that exists
        parent = os.path.dirname(parent)
    target = path if os.path.isdir(path) else parent
    if not os.path.isdir(target) or not os.access(target, os.W_OK):
        return f"{flag} {path!r} cannot be written ({target!r} is not a writable folder)"
    try:  # os.access trusts the mode bits (root passes it on /proc, a read-only mount): try a folder, gone at once
        os.rmdir(tempfile.mkdtemp(prefix=".blockdiff-probe-", dir=target))
    except OSError as e:
        return f"{flag} {path!r} cannot be written ({target!r}: {e.strerror or e})"
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blockdiff", description="blockdiff: block-diffusion LM kernels and serving")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a small DiffusionGemma (the shipped trained checkpoint) through the harness",
                       description="Run a DiffusionGemma through the model-runner-v2 harness: mixed prefill/denoise/"
                                   "commit batches, a per-step table, totals, tokens committed per forward pass, "
                                   "denoising steps per canvas, the generated text and a PNG of one mixed step's "
                                   "attention pattern. Model: the trained checkpoint shipped in the package "
                                   "(blockdiff/model/checkpoints/stdlib-byte/; model/checkpoints/stdlib-byte/ in a "
                                   "checkout), --checkpoint FOLDER, or "
                                   "--random-weights. Without a shipped checkpoint and without either flag it "
                                   "runs random weights and prints that it does.")
    m = d.add_mutually_exclusive_group()
    m.add_argument("--checkpoint", metavar="FOLDER", default=None,
                   help="trained checkpoint folder (model.safetensors, config.json, tokenizer.json, as written by "
                        "blockdiff train --out FOLDER); default: the shipped one")
    m.add_argument("--random-weights", action="store_true",
                   help="tiny random-weight model with random prompt ids (no checkpoint)")
    d.add_argument("--backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention backend (default reference; no fallback: an unavailable backend is an error)")
    d.add_argument("--sampler-backend", choices=SAMPLER_BACKENDS, default="reference",
                   help="sampler backend (default reference)")
    d.add_argument("--check", action="store_true",
                   help="compare every attention call and sampler step with the references; exit 1 on mismatch")
    d.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default cpu)")
    d.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling (default 0)")
    d.add_argument("--out", default="./demo_out", help="folder for attention_pattern.png (default ./demo_out/)")
    d.add_argument("--canvas-length", type=int, default=None,
                   help="tokens per canvas (default: the checkpoint's trained canvas length, which this overrides; "
                        "16 for random weights)")
    d.add_argument("--max-denoising-steps", type=int, default=None,
                   help="denoising step cap per canvas (default: the checkpoint's generation_config.json, else 16; "
                        "6 for random weights)")
    d.add_argument("--embedding-scale", type=float, default=None,
                   help="with --random-weights: scale of the random tied embedding, peaking the toy logits "
                        "(default 30; 1 = raw init)")
    d.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    d.add_argument("--prompt", action="append", metavar="TEXT", default=None,
                   help="a prompt of your own (repeatable): replaces the demo's six built-in Python snippets; every "
                        "such request arrives at step 0 and samples with the checkpoint's parameters. Needs a trained "
                        "checkpoint (its tokenizer), so not with --random-weights")
    d.add_argument("--canvases", type=int, default=None, metavar="N",
                   help=f"with --prompt: canvases generated per prompt (max_tokens = N x canvas length; default 1, "
                        f"at most {MAX_DEMO_CANVASES})")
    d.add_argument("--fuse-commit", action="store_true",
                   help="commit a converged canvas and take the next canvas's first denoising step in one forward "
                        "pass (HarnessRunner fuse_commit; same tokens, one forward fewer per non-final canvas)")

    t = sub.add_parser("train", help="train a small byte-level DiffusionGemma on the Python standard library",
                       description="Train a small DiffusionGemma (blockdiff.model.train) on the Python standard "
                                   "library's sources, save the checkpoint folder (model.safetensors, config.json, "
                                   "tokenizer.json, loss.png, train_log.json) and evaluate it by generation "
                                   "through the harness (blockdiff.integration.evaluate).")
    t.add_argument("--out", required=True, help="output folder (checkpoint, config, tokenizer, loss.png, log; the "
                                                "files of an earlier run there are replaced)")
    t.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (default 8)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --minutes)")
    t.add_argument("--batch-size", type=int, default=1024, help="sequences per step (default 1024)")
    t.add_argument("--prefix", type=int, default=64, help="longest clean prefix P (tokens; default 64)")
    t.add_argument("--prefix-min", type=int, default=16, help="shortest clean prefix (P drawn per batch; default 16)")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    t.add_argument("--warmup-steps", type=int, default=200, help="linear warm-up steps (default 200)")
    t.add_argument("--self-cond-prob", type=float, default=0.5,
                   help="probability per example of self-conditioning input in training (default 0.5)")
    t.add_argument("--log-every", type=int, default=50, help="steps between log lines (default 50)")
    t.add_argument("--seed", type=int, default=0, help="seed of weights, batches and evaluation (default 0)")
    t.add_argument("--device", default=None, help="torch device (default cuda when available, else cpu)")
    t.add_argument("--corpus", default=None, help="folder of .py files or one text file (default: the stdlib)")
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of the evaluation (0: none; default 8)")
    t.add_argument("--eval-steps", type=int, default=16, help="max_denoising_steps of the evaluation (default 16)")
    t.add_argument("--attn-backend", default="reference", choices=ATTENTION_BACKENDS,
                   help="attention backend of the evaluation harness (default reference)")
    t.add_argument("--smoke", action="store_true",
                   help="tiny config, 20 steps on the CPU (--max-steps sets another count); it sets --device cpu, "
                        "--lr 3e-3 and --warmup-steps 2, caps --batch-size at 8, --prefix at 16, --prefix-min at 8, "
                        "--eval-prompts at 2 and --eval-steps at 4, defaults --corpus to the stdlib's json "
                        "package, and logs every step (a line printed every 5; --log-every is not used)")

    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face DiffusionGemma folder (transformers, vLLM)",
                       description="Write a trained checkpoint (default: the shipped stdlib-byte one) as a Hugging "
                                   "Face DiffusionGemma folder that transformers and vLLM load by path: config.json, "
                                   "model.safetensors, generation_config.json (the sampling defaults), tokenizer.json "
                                   "and tokenizer_config.json (the byte tokenizer). See blockdiff.model.export. "
                                   "It prints the vllm serve commands for the folder: with blockdiff's plugin "
                                   "(VLLM_PLUGINS=blockdiff, --attention-backend CUSTOM and the plugin's "
                                   "--scheduler-cls, which its model state requires; integration/README.md) and "
                                   "stock vLLM (VLLM_PLUGINS=none: with blockdiff installed, vLLM loads the plugin "
                                   "otherwise). With --geometry NAME: a named geometry's config and tokenizer "
                                   "without weights (served with --load-format dummy).")
    e.add_argument("out", metavar="OUT", help="folder to write (created if missing)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="FOLDER", default=None,
                     help="trained checkpoint folder (as blockdiff train --out writes it); default: the shipped one")
    src.add_argument("--geometry", choices=GEOMETRY_NAMES, default=None,
                     help="write a named model geometry's config alone, no weights (blockdiff.model.config.GEOMETRIES; "
                          "served with vllm serve OUT --load-format dummy --language-model-only ...)")
    e.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                   help="dtype of the written weights (default: as stored, bfloat16)")
    e.add_argument("--max-denoising-steps", type=int, default=None,
                   help="step cap per canvas in generation_config.json (default 16, blockdiff demo's for a trained "
                        "checkpoint)")
    e.add_argument("--t-min", type=float, default=None, help="temperature of the last denoising step, >= 0 (default "
                                                              "0.4)")
    e.add_argument("--t-max", type=float, default=None,
                   help="temperature of the first denoising step, > --t-min (transformers' rule for the file; default "
                        "0.8)")
    e.add_argument("--entropy-bound", type=float, default=None,
                   help="acceptance budget, nats, > 0 (transformers' rule for the file; default 0.1)")
    e.add_argument("--confidence-threshold", type=float, default=None,
                   help="mean-entropy convergence threshold, nats, > 0 (transformers' rule for the file; default "
                        "0.005)")
    e.add_argument("--stability-threshold", type=int, default=None, help="stable steps to converge (default 1)")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    return ap


def resolve_checkpoint(args, shipped: str, stream=None) -> tuple[str | None, str | None]:
    """The model ``blockdiff demo`` runs: ``(checkpoint folder or None for random weights, error or None)``.

    ``--random-weights``: None. ``--checkpoint FOLDER``: FOLDER, which must exist (else an error naming
    ``--checkpoint``). Neither: ``shipped`` (the package's checkpoint folder,
    :func:`blockdiff.model.pretrained.shipped_checkpoint_dir`) when it exists; otherwise random weights, and a
    line saying so is printed to ``stream`` (default stdout) -- documented behaviour, not a silent fallback.
    """
    if args.random_weights:
        return None, None
    if args.checkpoint is not None:
        if not os.path.isdir(args.checkpoint):
            return None, f"--checkpoint {args.checkpoint!r} is not a folder (expected a checkpoint folder written " \
                         "by blockdiff train --out FOLDER)"
        return args.checkpoint, None
    if os.path.isdir(shipped):
        return shipped, None
    print(f"blockdiff demo: no trained checkpoint shipped at {shipped}; running tiny RANDOM weights instead "
          "(choose explicitly with --checkpoint FOLDER or --random-weights)", file=stream or sys.stdout, flush=True)
    return None, None


MAX_DEMO_CANVASES = 64  # --canvases: a bound on the demo's run time; positions are checked against the model too


def prompt_problems(args) -> list[str]:
    """What is wrong with ``blockdiff demo``'s ``--prompt`` / ``--canvases`` (one message per problem, naming the flag).

    Rules: a prompt is non-empty text that encodes as UTF-8 (an argument with undecodable bytes does not); prompts
    need a trained checkpoint's tokenizer (not ``--random-weights``); ``--canvases`` is an int in
    ``[1, MAX_DEMO_CANVASES]`` and only goes with ``--prompt``. Whether the prompts plus canvases fit the model's
    positions is checked once the model is loaded (:func:`blockdiff.integration.demo.run_demo`).
    """
    problems = []
    prompts = args.prompt or []
    if prompts and args.random_weights:
        problems.append("--prompt needs a trained checkpoint's tokenizer; random weights take random prompt ids "
                        "(drop --random-weights)")
    for i, text in enumerate(prompts):
        if text == "":
            problems.append(f"--prompt number {i + 1} is empty (a request needs at least one prompt token)")
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            problems.append(f"--prompt number {i + 1} is not valid UTF-8 text")
    if args.canvases is not None:
        if not prompts:
            problems.append("--canvases sets the canvases generated per --prompt; give at least one --prompt")
        if not 1 <= args.canvases <= MAX_DEMO_CANVASES:
            problems.append(f"--canvases must be in [1, {MAX_DEMO_CANVASES}], got {args.canvases}")
    return problems


def prompt_requests(args):
    """``blockdiff demo``'s workload from ``--prompt`` (None: the demo's built-in one).

    Returns:
        None without ``--prompt``; else one request ``(f"prompt-{i}", text, 0, canvases, False)`` per prompt, in the
        :data:`blockdiff.integration.demo.TEXT_REQUESTS` form (id, text, arrival step, canvases, greedy).
    """
    if not args.prompt:
        return None
    n = 1 if args.canvases is None else args.canvases
    return tuple((f"prompt-{i}", text, 0, n, False) for i, text in enumerate(args.prompt))


def _errors(command: str, problems: list[str]) -> int:
    """Print each problem as one line ``blockdiff COMMAND: error: ...`` on stderr; returns exit code 2."""
    for msg in problems:
        line = "; ".join(part.strip() for part in str(msg).splitlines() if part.strip())
        print(f"blockdiff {command}: error: {line}", file=sys.stderr)
    return 2


def _demo(args) -> int:
    problems = []
    if args.canvas_length is not None and not 1 <= args.canvas_length <= 4096:
        problems.append(f"--canvas-length must be in [1, 4096] tokens, got {args.canvas_length}")
    if args.max_denoising_steps is not None and not 1 <= args.max_denoising_steps < MAX_DENOISING_STEPS:
        problems.append(f"--max-denoising-steps must be in [1, {MAX_DENOISING_STEPS}), got {args.max_denoising_steps}")
    if not 0 <= args.seed < 2 ** 63:
        problems.append(f"--seed must be in [0, 2**63), got {args.seed}")
    dev = device_problem("--device", args.device)
    if dev:
        problems.append(dev)
    if args.embedding_scale is not None:
        if not (math.isfinite(args.embedding_scale) and args.embedding_scale > 0):
            problems.append(f"--embedding-scale must be a finite number > 0, got {args.embedding_scale}")
        elif args.embedding_scale > _FLOAT32_MAX:  # the weights are float32: they would be inf, every request failed
            problems.append(f"--embedding-scale must be at most {_FLOAT32_MAX:.4e} (the float32 weights it scales), "
                            f"got {args.embedding_scale:g}")
        elif args.checkpoint is not None:
            problems.append("--embedding-scale scales random weights; it cannot be used with --checkpoint")
        elif not args.random_weights:
            problems.append("--embedding-scale scales random weights: add --random-weights (without it the demo "
                            "runs the shipped trained checkpoint)")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        problems.append(f"--checkpoint {args.checkpoint!r} is not a folder (expected a checkpoint folder written by "
                        "blockdiff train --out FOLDER)")
    problems += prompt_problems(args)
    out = out_folder_problem("--out", args.out)  # nothing is created before every flag passed
    if out:
        problems.append(out)
    if problems:
        return _errors("demo", problems)
    # torch-heavy modules only now, after the checks above: argument errors stay fast
    from blockdiff.model import CheckpointError
    from blockdiff.model.pretrained import shipped_checkpoint_dir

    from .checks import AttentionMismatch
    from .demo import BackendUnavailable, DemoInputError, DeviceUnavailable, run_demo
    from .sampler import SamplerMismatch

    checkpoint, err = resolve_checkpoint(args, shipped_checkpoint_dir())
    if err:
        return _errors("demo", [err])
    try:
        result = run_demo(backend=args.backend, sampler_backend=args.sampler_backend, check=args.check,
                          device=args.device, seed=args.seed, out=args.out, checkpoint=checkpoint,
                          canvas_length=args.canvas_length, max_denoising_steps=args.max_denoising_steps,
                          progress=not args.no_progress, embedding_scale=args.embedding_scale,
                          fuse_commit=args.fuse_commit, requests=prompt_requests(args))
    except DeviceUnavailable as e:  # its message starts "device 'X' ...": name the option
        msg = str(e)
        return _errors("demo", ["--" + msg if msg.startswith("device ") else f"--device {args.device!r}: {msg}"])
    except (BackendUnavailable, DemoInputError) as e:
        return _errors("demo", [str(e)])
    except CheckpointError as e:
        what = "--checkpoint" if args.checkpoint is not None else "shipped checkpoint"
        return _errors("demo", [f"{what} {checkpoint!r} cannot be loaded: {e}"])
    except (AttentionMismatch, SamplerMismatch) as e:
        print(f"blockdiff demo: CHECK FAILED: {e}", file=sys.stderr)
        return 1
    reasons = [r.finish_reason for r in result.results.values()]
    if reasons and all(x == "error" for x in reasons):
        print(f"blockdiff demo: error: all {len(reasons)} requests failed (NaN / +inf logits, or a position whose "
              "every logit is -inf)", file=sys.stderr)
        return 1
    return 0


def _train(a) -> int:
    problems = [p for p in (device_problem("--device", a.device) if a.device is not None else None,
                            out_folder_problem("--out", a.out)) if p]
    if problems:  # the checkpoint folder is written after training: an unwritable --out must fail now
        return _errors("train", problems)
    # torch-heavy modules only now, after argument parsing: argument errors stay fast
    import torch

    from blockdiff.model.train import (CorpusError, TrainArgs, position_problems, smoke_args, train, train_args_problems,
                                       train_config)

    from .evaluate import evaluate_generation

    device = a.device if a.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    fields = dict(out=a.out, minutes=a.minutes, max_steps=a.max_steps, batch_size=a.batch_size, prefix=a.prefix,
                  prefix_min=a.prefix_min, lr=a.lr, warmup_steps=a.warmup_steps, self_cond_prob=a.self_cond_prob,
                  log_every=a.log_every, seed=a.seed, device=device, corpus=a.corpus, eval_prompts=a.eval_prompts,
                  eval_steps=a.eval_steps, attn_backend=a.attn_backend, smoke=a.smoke)
    # the user's values are checked before --smoke caps them (a bad flag is an error, not silently replaced)
    given = types.SimpleNamespace(**{**vars(TrainArgs(out=".")), **fields})
    problems = [f"--{name.replace('_', '-')}: {msg}" for _, name, msg in train_args_problems(given, paths=True)]
    if problems:
        return _errors("train", problems)
    args = TrainArgs(**fields)
    if a.smoke:
        args = smoke_args(args)
        # one intra-op thread, as blockdiff demo: the tiny config's ops take microseconds, and two threads on a
        # loaded 2-core machine made the 20 steps 7x slower (0.4 -> 2.9 s beside two busy processes; 111 s once)
        torch.set_num_threads(1)
    problems = [f"--{name.replace('_', '-')}: {msg}" for _, name, msg in position_problems(args, train_config(args))]
    if problems:  # (positions past the config's range: refused before the corpus loads, not after training)
        return _errors("train", problems)
    if args.eval_prompts > 0:  # the evaluation runs after training: an attention backend it cannot run fails now
        from .demo import BackendUnavailable, check_attention_backend

        # the evaluation's dtype (model.train: bf16 on CUDA, fp32 on the CPU)
        ev_dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        try:
            check_attention_backend(args.attn_backend, args.device, dtype=ev_dtype)
        except BackendUnavailable as e:
            return _errors("train", [f"--attn-backend: {e} (it runs the evaluation after training; --eval-prompts 0 "
                                     "skips it)"])
    try:
        train(args, evaluate=evaluate_generation)
    except CorpusError as e:
        return _errors("train", [f"--corpus: {e}"])
    return 0


def _export(a) -> int:
    problems = []
    for flag, v in (("--t-min", a.t_min), ("--t-max", a.t_max)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            problems.append(f"{flag} must be a finite number >= 0, got {v}")
    for flag, v in (("--entropy-bound", a.entropy_bound), ("--confidence-threshold", a.confidence_threshold)):
        if v is not None and not (math.isfinite(v) and v > 0):
            problems.append(f"{flag} must be a finite number > 0 (nats), got {v}: {_TRANSFORMERS_RULE} (0 is a "
                            "per-request value: SamplingParams / vLLM extra_args take it)")
    t_min = _EXPORT_DEFAULTS["t_min"] if a.t_min is None else a.t_min
    t_max = _EXPORT_DEFAULTS["t_max"] if a.t_max is None else a.t_max
    if (a.t_min is not None or a.t_max is not None) and all(math.isfinite(t) and t >= 0 for t in (t_min, t_max)) \
            and not t_max > t_min:
        hi, lo = (f"{flag} {v}" + ("" if own is not None else " (default)")
                  for flag, v, own in (("--t-max", t_max, a.t_max), ("--t-min", t_min, a.t_min)))
        problems.append(f"{hi} must be > {lo}: "
                        f"{_TRANSFORMERS_RULE} (a constant or greedy schedule, t_min == t_max, is a per-request "
                        "value: SamplingParams / vLLM extra_args take it)")
    for flag, v in (("--t-min", a.t_min), ("--t-max", a.t_max), ("--entropy-bound", a.entropy_bound),
                    ("--confidence-threshold", a.confidence_threshold)):
        if v is not None and math.isfinite(v) and abs(v) > _FLOAT32_MAX:  # the sampler's float32 state
            problems.append(f"{flag} must be at most {_FLOAT32_MAX:.4e} (float32), got {v}")
    if a.max_denoising_steps is not None and not 1 <= a.max_denoising_steps < MAX_DENOISING_STEPS:
        problems.append(f"--max-denoising-steps must be in [1, {MAX_DENOISING_STEPS}), got {a.max_denoising_steps}")
    if a.stability_threshold is not None and not 0 <= a.stability_threshold < 2 ** 31:
        problems.append(f"--stability-threshold must be in [0, 2**31), got {a.stability_threshold}")
    if a.checkpoint is not None and not os.path.isdir(a.checkpoint):
        problems.append(f"--checkpoint {a.checkpoint!r} is not a folder")
    out = out_folder_problem("OUT", a.out)
    if out:
        problems.append(out)
    if problems:
        return _errors("export", problems)
    # torch-heavy modules only now, after the checks above: argument errors stay fast
    from blockdiff.model import CheckpointError
    from blockdiff.model.export import EXPORT_FILES, export_hf
    from blockdiff.model.pretrained import shipped_checkpoint_dir
    from blockdiff.sampler import SamplingParams

    from .demo import TRAINED_MAX_DENOISING_STEPS

    if a.geometry is not None:
        from blockdiff.model.config import geometry_config

        source = geometry_config(a.geometry)
    else:
        source = a.checkpoint if a.checkpoint is not None else shipped_checkpoint_dir()
    steps = TRAINED_MAX_DENOISING_STEPS if a.max_denoising_steps is None else a.max_denoising_steps
    gen = {k: v for k, v in (("t_min", a.t_min), ("t_max", a.t_max), ("entropy_bound", a.entropy_bound),
                             ("confidence_threshold", a.confidence_threshold),
                             ("stability_threshold", a.stability_threshold)) if v is not None}
    try:  # the defaults written must be a request the sampler accepts (e.g. every temperature a normal float32)
        SamplingParams(max_denoising_steps=steps, **gen)
    except ValueError as e:
        return _errors("export", [f"--t-min {t_min} / --t-max {t_max} with --max-denoising-steps {steps}: the sampler "
                                  f"refuses this default request ({e})"])
    try:
        written = export_hf(source, a.out, dtype=a.dtype, overwrite=a.overwrite, max_denoising_steps=steps, **gen)
    except CheckpointError as e:  # the source (also a FileNotFoundError when a file is missing): not OUT's fault
        return _errors("export", [str(e)])
    except FileExistsError as e:  # OUT already holds an export: named with the CLI's switch, not the keyword
        present = [n for n in EXPORT_FILES if os.path.lexists(os.path.join(a.out, n))]
        if not present or a.overwrite:  # (with --overwrite: what it does not replace, e.g. other weight files)
            return _errors("export", [f"OUT {a.out!r}: {e}"])
        return _errors("export", [f"OUT {a.out!r} already holds {', '.join(present)} (pass --overwrite to replace "
                                  "them)"])
    except OSError as e:  # writing OUT
        return _errors("export", [f"OUT {a.out!r}: {e}"])
    except ValueError as e:
        return _errors("export", [str(e)])
    for name, path in written.items():
        print(f"{path}  {os.path.getsize(path)} bytes")
    print(serve_commands(a.out, dummy=a.geometry is not None))
    return 0


def serve_commands(out: str, *, dummy: bool = False) -> str:
    """The ``vllm serve`` lines ``blockdiff export`` prints for the folder ``out``: with blockdiff's plugin (the
    environment and flags its model state requires: without the plugin's ``--scheduler-cls`` it stops the start) and
    stock vLLM (``VLLM_PLUGINS=none``: with VLLM_PLUGINS unset vLLM loads every installed plugin, blockdiff's
    included, which then replaces vLLM's DiffusionGemma class and refuses the stock command). ``dummy``: a geometry
    exported without weights (``--load-format dummy``). The folder is shell-quoted (:func:`shlex.quote`): a path
    with a space or a shell character is one argument of the command as pasted."""
    import shlex

    from .vllm_plugin import ASYNC_SCHEDULER_CLASS

    folder = f"{shlex.quote(out)}{' --load-format dummy' if dummy else ''} --language-model-only"
    return (f"serve with vLLM + blockdiff (the flags its plugin requires; sizes such as --max-model-len and --dtype: "
            f"integration/README.md \"vLLM\"):\n"
            f"  VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff vllm serve {folder} --attention-backend CUSTOM "
            f"--scheduler-cls {ASYNC_SCHEDULER_CLASS}\n"
            f"stock vLLM: VLLM_PLUGINS=none vllm serve {folder}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok; 1 check mismatch or every request failed; 2 usage, unavailable
    backend or unusable checkpoint; 141, a shell's SIGPIPE code, when the reader of stdout closed it early, as
    ``blockdiff demo | head`` does: quietly, not a BrokenPipeError traceback)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
    except BrokenPipeError:
        # Python flushes stdout again at exit, which would raise (and print) once more: point it at /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    return 2


if __name__ == "__main__":
    sys.exit(main())
