"""``blockdiff demo``: a DiffusionGemma served by the harness, with a per-step table, totals, the generation
metrics (tokens committed per forward pass, denoising steps per canvas), generated text and a picture of one
mixed step's attention pattern.

Two models:

* a trained checkpoint (default: the one shipped in the package, ``blockdiff/model/checkpoints/stdlib-byte/``,
  trained by ``model/train.py`` on the Python standard library's sources; or ``checkpoint=`` a folder): loaded
  with :func:`blockdiff.model.pretrained.load_pretrained` (``DiffusionGemma.load_safetensors`` +
  ``ByteTokenizer.load``), weights as trained. The prompts are short Python snippets (:data:`TEXT_REQUESTS`),
  encoded by the checkpoint's tokenizer. Sampling parameters are the checkpoint's (its ``generation_config.json``
  and trained canvas length, as transformers takes them); without a ``generation_config.json`` the step cap is 16
  (``blockdiff train``'s evaluation cap), and the tokenizer's eos id ends a request unless the generation config
  names eos ids. ``canvas_length`` / ``max_denoising_steps`` override them, and the header says so.
* tiny random weights (``checkpoint=None``; ``blockdiff demo --random-weights``): random prompt ids
  (:data:`DEFAULT_REQUESTS`), a 16-token canvas and a step cap of 6. Random weights give near-uniform logits
  (entropy ~ log V, one position accepted per step); the tied embedding is scaled (``embedding_scale``, default
  30) so the toy logits are peaked enough for the entropy-bound acceptance to show.

Either workload mixes prefill, denoise and commit rows in the same batches: six requests arrive at steps 0-12
into four slots, under a step budget of four canvases (long prompts are chunked). One request is greedy (T = 0).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from blockdiff.attention import attention, build_mask, get_backend, resolve_backend
from blockdiff.attention.env import triton_interpret
from blockdiff.model import CheckpointError, DiffusionGemma, tiny_config  # CheckpointError: re-exported here
from blockdiff.model.config import FLOAT32_MAX  # the random weights embedding_scale multiplies are float32
from blockdiff.model.generation import GENERATION_FILE
from blockdiff.model.loading import check_device
from blockdiff.model.pretrained import load_pretrained
from blockdiff.sampler import SamplingParams
from blockdiff.sampler import get_backend as sampler_get_backend

from .harness import HarnessRunner, checkpoint_sampling_params

# Random weights: (req_id, prompt_len, arrival_step, max_tokens, greedy); prompts are random ids.
DEFAULT_REQUESTS: tuple[tuple[str, int, int, int, bool], ...] = (
    ("req-0", 70, 0, 32, False),
    ("req-1", 9, 0, 16, False),
    ("req-2", 23, 2, 32, False),
    ("req-3", 5, 5, 16, True),  # T = 0: every position accepted, converges once the argmax is stable
    ("req-4", 41, 9, 16, False),
    ("req-5", 12, 12, 32, False),
)

# Trained checkpoint: (req_id, prompt text, arrival_step, canvases, greedy); max_tokens = canvases x canvas
# length. Short Python snippets written for the demo (not from the training corpus), 16-64 bytes: the prefix
# lengths model/train.py trains on.
TEXT_REQUESTS: tuple[tuple[str, str, int, int, bool], ...] = (
    ("req-0", "def read_lines(path):\n    with open(path) as f:\n        return ", 0, 2, False),
    ("req-1", "import os\nimport sys\n\n\ndef main(argv=None):\n    ", 0, 1, False),
    ("req-2", "class Stack:\n    def __init__(self):\n        self.", 2, 2, False),
    ("req-3", "    for i, line in enumerate(lines):\n        if ", 5, 1, True),
    ("req-4", "        if not isinstance(name, str):\n            raise ", 9, 1, False),
    ("req-5", "    def __repr__(self):\n        return ", 12, 2, False),
)
TRAINED_MAX_DENOISING_STEPS = 16  # blockdiff train's evaluation cap (its --eval-steps default)
RANDOM_CANVAS_LENGTH, RANDOM_MAX_DENOISING_STEPS, RANDOM_EMBEDDING_SCALE = 16, 6, 30.0
#: The demo's run stops after this many steps (a request arriving at or after it is never served).
DEMO_MAX_STEPS = 10_000
#: Most positions a random-weights workload may need (longest prompt + largest max_tokens + one canvas): the tiny
#: model is built with that many (a prompt length of 2**40 was an 8 TB allocation of its random ids).
RANDOM_MAX_POSITIONS = 1 << 16


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no silent fallback)."""


class DemoInputError(ValueError):
    """A demo option the model cannot serve (e.g. a canvas length whose requests reach past the checkpoint's
    ``max_position_embeddings``); the message names the option."""


class DeviceUnavailable(BackendUnavailable):
    """The requested device cannot run the demo (not a torch device, not present here, or ``meta``)."""


def resolve_device(device) -> torch.device:
    """``device`` as a torch.device the demo can compute on.

    Raises:
        DeviceUnavailable: a string torch cannot parse, a CUDA device that is not there
            (:func:`blockdiff.model.loading.check_device`), or ``meta`` (shapes only, no data to compute with).
    """
    try:
        dev = check_device(device, "device")
    except (TypeError, ValueError) as e:
        raise DeviceUnavailable(str(e)) from None
    if dev.type == "meta":
        raise DeviceUnavailable("device 'meta' holds no data (shapes only): the demo computes; use cpu or cuda")
    return dev


@dataclass
class DemoResult:
    runner: Any
    results: dict
    totals: dict
    png_path: str | None
    table: str
    mixed_step: int | None
    samples: list = field(default_factory=list)  # [{req_id, prompt, completion}] text (trained checkpoint)


def check_attention_backend(backend: str, device, dtype: torch.dtype | None = torch.float32) -> None:
    """Run the chosen attention backend once on a tiny mixed batch of ``dtype`` (the dtype the model runs in; None:
    only the device rules, the name and the backend's import, no probe); raise :class:`BackendUnavailable` with the
    reason if it cannot run on ``device`` in ``dtype`` (e.g. ``cute`` without CUDA or in float32, ``triton`` on CPU
    without ``TRITON_INTERPRET=1``, a backend whose module cannot be imported here). ValueError: an unknown name."""
    interp = triton_interpret()  # as Triton reads it
    if backend == "triton" and torch.device(device).type == "cpu" and not interp:
        raise BackendUnavailable("attention backend 'triton' on CPU needs TRITON_INTERPRET=1 (Triton interpreter)")
    if backend == "cute" and torch.device(device).type != "cuda":
        raise BackendUnavailable("attention backend 'cute' needs a CUDA GPU (FlashAttention-4 / CuTe DSL)")
    try:  # the name (ValueError) and the backend's import, before any work (dtype None included)
        get_backend(resolve_backend(backend, device))
    except ImportError as e:
        raise BackendUnavailable(f"attention backend {backend!r} is not available on {device}: {e}") from e
    if dtype is None:
        return
    try:
        q = torch.randn(3, 2, 16, device=device, dtype=dtype)
        k = torch.randn(1, 16, 1, 16, device=device, dtype=dtype)
        attention(q, k, k.clone(), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
                  seq_lens=torch.tensor([2, 3], dtype=torch.int32, device=device),
                  causal=torch.tensor([True, False], device=device),
                  block_table=torch.zeros(2, 1, dtype=torch.int32, device=device), backend=backend)
    except (ImportError, RuntimeError, NotImplementedError) as e:
        raise BackendUnavailable(f"attention backend {backend!r} is not available on {device}: {e}") from e


#: What each column of :func:`format_table` counts (printed under the table).
TABLE_LEGEND = (
    "columns: pre / den / com = prefill, denoise and commit rows in the step (a commit row commits one canvas); "
    "q_tok = query tokens of the step; acc_this_step = canvas positions the entropy bound accepted in this step, "
    "summed over the denoise rows (each denoise step samples every canvas position again and keeps the accepted "
    "ones' samples, renoising the rest: a count per step, not of newly fixed positions); mean_H = mean entropy of "
    "the denoise rows (nats); emitted = tokens emitted (commit rows, after EOS / max_tokens trimming); events: "
    "+id admitted, preempt:id preempted for KV pages (re-prefilled later), done:id finished")


def format_table(history) -> str:
    """Per-step table (:data:`TABLE_LEGEND` says what each column counts): rows per phase (prefill / denoise /
    commit), query tokens, canvas positions accepted in the step (:attr:`StepRecord.positions_accepted`), mean
    entropy (nats) of the denoise rows, tokens emitted, arrivals, preemptions and finishes."""
    head = (f"{'step':>4} {'pre':>3} {'den':>3} {'com':>3} {'q_tok':>5} {'acc_this_step':>13} {'mean_H':>7} "
            f"{'emitted':>7}  events")
    lines = [head, "-" * len(head)]
    for h in history:
        if not h.forward:
            ev = " ".join([f"+{a}" for a in h.arrived]) or "(idle)"
            lines.append(f"{h.step:>4} {'':>3} {'':>3} {'':>3} {'':>5} {'':>13} {'':>7} {'':>7}  {ev}")
            continue
        me = h.mean_entropy
        ev = " ".join([f"+{a}" for a in h.arrived] + [f"preempt:{x}" for x in h.preempted] +
                      [f"done:{f}" for f in h.finished])
        lines.append(f"{h.step:>4} {h.count('prefill'):>3} {h.count('denoise'):>3} {h.count('commit'):>3} "
                     f"{h.num_tokens:>5} {h.positions_accepted:>13} {(f'{me:.3f}' if me is not None else '-'):>7} "
                     f"{h.tokens_emitted:>7}  {ev}")
    return "\n".join(lines)


def pick_mixed_step(history):
    """The step with the most distinct phases (then most rows): the batch to draw."""
    best, key = None, None
    for h in history:
        if not h.forward:
            continue
        k = (len({r.phase for r in h.rows}), len(h.rows), -h.step)
        if key is None or k > key:
            best, key = h, k
    return best


def plot_attention_pattern(rec, config, path: str) -> str:
    """PNG of one step's attention masks, one panel per sequence and layer kind (sliding window / full),
    from :func:`blockdiff.attention.build_mask`: causal rows for prefill/commit, bidirectional for denoise.

    Returns:
        the path written.
    """
    # matplotlib only to draw: the Agg backend must be chosen before pyplot is imported (no display needed)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = []
    if "sliding_attention" in config.layer_types:
        kinds.append(("sliding", config.window_size))
    if "full_attention" in config.layer_types:
        kinds.append(("full", None))
    n = len(rec.rows)
    fig, axes = plt.subplots(len(kinds), n, figsize=(3.2 * n, 2.6 * len(kinds) + 0.6), squeeze=False)
    colors = {"prefill": "Blues", "denoise": "Oranges", "commit": "Greens"}
    for j, (kind, W) in enumerate(kinds):
        for i, r in enumerate(rec.rows):
            ax = axes[j][i]
            m = build_mask(r.q_len, r.seq_len, causal=r.causal, window_size=W,
                           bidirectional_window=config.bidirectional_window)
            ax.imshow(m.numpy(), cmap=colors.get(r.phase, "Greys"), aspect="auto", interpolation="nearest",
                      vmin=0, vmax=1.3)
            ctx = r.seq_len - r.q_len
            ax.axvline(ctx - 0.5, color="k", lw=0.6, ls=":")
            wtxt = "no window" if W is None else f"W={W}" + ("" if r.causal else f" {config.bidirectional_window}")
            ax.set_title(f"{r.req_id} {r.phase} ({'causal' if r.causal else 'bidirectional'})\n{kind}, {wtxt}",
                         fontsize=8)
            ax.set_xlabel(f"key (seq_len {r.seq_len}, ctx {ctx})", fontsize=7)
            ax.set_ylabel(f"query ({r.q_len})", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"blockdiff demo: attention pattern of step {rec.step} "
                 f"({rec.count('prefill')} prefill, {rec.count('denoise')} denoise, {rec.count('commit')} commit)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.text(0.5, 0.01, "dark = allowed key, light = masked; dotted line = first query token (context | queries); "
             "W = keys allowed on a side, not counting the query's own position; 'prefix' = the last W context "
             "keys + the whole canvas", ha="center", fontsize=7)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_requests(requests) -> None:
    """Raise unless ``requests`` is a demo workload: a non-empty tuple / list of ``(req_id, prompt, arrival_step, n,
    greedy)`` tuples (see :func:`run_demo`): ``req_id`` a str; ``prompt`` a str (text) or an int >= 1 (a random
    prompt's length); ``arrival_step`` an int in ``[0, DEMO_MAX_STEPS)`` (the run's last step); ``n`` an int >= 1
    (canvases of a text prompt, tokens of a random one); ``greedy`` a bool. No coercion: a prompt length of 2.7 was
    read as 2, ``True`` as 1. (Whether the prompts and outputs fit the model's positions is checked by
    :func:`run_demo` once the model is known, before any prompt is drawn.)

    Raises:
        TypeError: a value of the wrong type (bools are not ints). ValueError: an empty workload, an entry that is not
            five values, or a value out of its range. Both name ``requests[i]`` and the field.
    """
    if not isinstance(requests, (tuple, list)):
        raise TypeError(f"requests must be a tuple or list of (req_id, prompt, arrival_step, n, greedy) tuples, got "
                        f"{type(requests).__name__}")
    if not requests:
        raise ValueError("requests must hold at least one request (req_id, prompt, arrival_step, n, greedy)")
    for i, r in enumerate(requests):
        where = f"requests[{i}]"
        if not isinstance(r, (tuple, list)) or len(r) != 5:
            raise ValueError(f"{where} must be a tuple (req_id, prompt, arrival_step, n, greedy), got {r!r}")
        rid, prompt, arrival, n, greedy = r
        if not isinstance(rid, str):
            raise TypeError(f"{where}: req_id must be a str, got {type(rid).__name__} ({rid!r})")
        for name, v, lo in (("prompt", prompt, 1), ("arrival_step", arrival, 0), ("n", n, 1)):
            if name == "prompt" and isinstance(v, str):
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                what = "a str or an int >= 1 (a random prompt's length)" if name == "prompt" else f"an int >= {lo}"
                raise TypeError(f"{where}: {name} must be {what}, got {type(v).__name__} ({v!r})")
            if v < lo:
                raise ValueError(f"{where}: {name} must be >= {lo}, got {v}")
            if name == "arrival_step" and v >= DEMO_MAX_STEPS:  # (ran 10000 empty steps, then a RuntimeError)
                raise ValueError(f"{where}: arrival_step must be < DEMO_MAX_STEPS = {DEMO_MAX_STEPS} (the demo "
                                 f"runs that many steps), got {v}")
        if not isinstance(greedy, bool):
            raise TypeError(f"{where}: greedy must be a bool, got {type(greedy).__name__} ({greedy!r})")


def run_demo(*, backend: str = "reference", sampler_backend: str = "reference", check: bool = False,
             device: str = "cpu", seed: int = 0, out: str = "./demo_out", checkpoint: str | None = None,
             canvas_length: int | None = None, max_denoising_steps: int | None = None, progress: bool = True,
             requests=None, stream=None, threads: int | None = 1,
             embedding_scale: float | None = None, fuse_commit: bool = False) -> DemoResult:
    """Run the demo and print its report to ``stream`` (default stdout).

    Args:
        checkpoint: a trained checkpoint folder (``model.safetensors``, ``config.json``, ``tokenizer.json``, as
            ``model/train.py`` writes), or None for tiny random weights. Choosing the shipped checkpoint is the
            caller's job (``blockdiff demo`` does it).
        device: a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:N"``; not ``"meta"``).
        canvas_length: tokens per canvas (default: the checkpoint's trained ``canvas_length``; 16 for random
            weights). max_denoising_steps: step cap per canvas (default: the checkpoint's
            ``generation_config.json``, else 16; 6 for random weights). With a checkpoint, every other sampling
            parameter (temperatures, entropy bound, thresholds, eos ids: else the tokenizer's) is the
            checkpoint's (:func:`~blockdiff.integration.harness.checkpoint_sampling_params`); the header says
            where an argument overrides the checkpoint.
        requests: the workload (default :data:`TEXT_REQUESTS` with a checkpoint, :data:`DEFAULT_REQUESTS`
            without): tuples ``(req_id, prompt, arrival_step, n, greedy)``; a prompt is a str (encoded by the
            checkpoint's tokenizer; ``n`` canvases) or an int length (random ids; ``n`` tokens).
            ``blockdiff demo --prompt TEXT [--canvases N]`` builds one (:func:`blockdiff.integration.cli.prompt_requests`).
        embedding_scale: random weights only: factor on the tied embedding (default 30).
        fuse_commit: a bool: fuse each non-final commit with the next canvas's first denoising step
            (:class:`~blockdiff.integration.harness.HarnessRunner`'s ``fuse_commit``; TypeError for a non-bool).
        threads: torch intra-op threads on CPU (default 1, fastest for the small models; None leaves torch's
            setting).

    Returns:
        :class:`DemoResult`; ``totals`` is :meth:`HarnessRunner.totals` plus ``wall_s`` and
        ``max_denoising_steps``; ``samples`` the decoded text (empty for random weights).

    Raises:
        DeviceUnavailable: ``device`` cannot be parsed, is not here, or is ``meta``.
        BackendUnavailable: the attention or sampler backend cannot run on ``device``.
        CheckpointError: ``checkpoint`` cannot be loaded (the message names the folder and the problem).
        ValueError: ``embedding_scale`` with a checkpoint, or not a finite number in ``(0, float32 max]``; a text
            prompt with random weights; ``requests`` empty or an entry out of range (:func:`check_requests`), or
            with random weights needing more than :data:`RANDOM_MAX_POSITIONS` positions;
            ``threads`` < 1.
        TypeError: ``embedding_scale`` not a number (a bool included); a ``requests`` entry of the wrong type
            (:func:`check_requests`); ``threads`` not an int or None.
        DemoInputError: the requests need more positions than the checkpoint's ``max_position_embeddings`` (a
            ValueError naming ``--canvas-length``), or a ``max_denoising_steps`` that puts the checkpoint's
            temperature schedule below the sampler's 2**-126 (naming ``--max-denoising-steps``).
        blockdiff.integration.checks.AttentionMismatch, blockdiff.integration.sampler.SamplerMismatch:
            ``check`` found a disagreement with the reference.
    """
    stream = stream or sys.stdout
    p = lambda *a: print(*a, file=stream, flush=True)  # noqa: E731
    if checkpoint is not None and embedding_scale is not None:
        raise ValueError("embedding_scale scales random weights; it cannot be used with a trained checkpoint")
    if embedding_scale is not None:
        if isinstance(embedding_scale, bool) or not isinstance(embedding_scale, (int, float)):
            raise TypeError(f"embedding_scale must be a number, got {type(embedding_scale).__name__}")
        if not (math.isfinite(embedding_scale) and 0 < embedding_scale <= FLOAT32_MAX):
            # the float32 weights it scales: beyond float32 they are inf and every request fails; NaN / <= 0 no peak
            raise ValueError(f"embedding_scale must be a finite number in (0, {FLOAT32_MAX:.4e}] (it scales the "
                             f"float32 tied embedding), got {embedding_scale!r}")
    if requests is not None:  # before the model is loaded or built
        check_requests(requests)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise TypeError(f"threads must be an int >= 1 or None, got {type(threads).__name__} ({threads!r})")
    if threads is not None and threads < 1:  # (torch's RuntimeError from set_num_threads)
        raise ValueError(f"threads must be an int >= 1 or None, got {threads}")
    dev = resolve_device(device)
    check_attention_backend(backend, dev, dtype=None)  # the device rules now; the probe once the dtype is known
    interp = triton_interpret()  # as Triton reads it
    if sampler_backend == "triton" and dev.type == "cpu" and not interp:
        raise BackendUnavailable("sampler backend 'triton' on CPU needs TRITON_INTERPRET=1 (Triton interpreter)")
    try:
        sampler_get_backend(sampler_backend)
    except (ImportError, ValueError) as e:
        raise BackendUnavailable(f"sampler backend {sampler_backend!r} is not available: {e}") from e

    if dev.type == "cpu" and threads is not None:
        # A small model's ops are ~microseconds: intra-op threads cost more than they give (100x slower on a
        # loaded 2-core machine).
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = None
    if checkpoint is not None:
        try:  # fp32 on the CPU (the reference path); the stored bf16 on a GPU
            model, tokenizer = load_pretrained(checkpoint, device=dev,
                                               dtype=torch.float32 if dev.type == "cpu" else None)
        except CheckpointError:
            raise
        except (OSError, ValueError, TypeError) as e:  # what loading a folder's files can raise besides
            raise CheckpointError(str(e)) from e
        cfg = model.config
        base, notes = _checkpoint_defaults(model, checkpoint, tokenizer, canvas_length, max_denoising_steps)
        requests = TEXT_REQUESTS if requests is None else requests
    else:
        canvas_length = RANDOM_CANVAS_LENGTH if canvas_length is None else canvas_length
        max_denoising_steps = RANDOM_MAX_DENOISING_STEPS if max_denoising_steps is None else max_denoising_steps
        embedding_scale = RANDOM_EMBEDDING_SCALE if embedding_scale is None else embedding_scale
        requests = DEFAULT_REQUESTS if requests is None else requests
        # positions for every request of the workload (random weights: no trained length to respect)
        longest = max((0 if isinstance(p, str) else int(p)) for _, p, _, _, _ in requests)
        need = max(256, longest + max(n for *_, n, _ in requests) + canvas_length)
        if need > RANDOM_MAX_POSITIONS:  # before the model and the random prompts are allocated
            raise ValueError(f"requests need {need} positions (the longest random prompt, {longest} tokens, + the "
                             f"largest n, {max(n for *_, n, _ in requests)} tokens, + one canvas of {canvas_length}),"
                             f" more than RANDOM_MAX_POSITIONS = {RANDOM_MAX_POSITIONS} of the random-weights demo")
        cfg = tiny_config(canvas_length=canvas_length, max_position_embeddings=max(4096, need))
        model = DiffusionGemma(cfg).to(dev).eval()
        with torch.no_grad():
            model.embedding_weight.mul_(embedding_scale)  # tied: peaks the toy logits (random weights)
        base = checkpoint_sampling_params(model, max_denoising_steps=max_denoising_steps)
        notes = {}
    # the probe in the dtype the model runs in (a bf16 checkpoint on a GPU: a float32 probe refused 'cute', which
    # runs bf16 / fp16 only)
    check_attention_backend(backend, dev, dtype=model.embedding_weight.dtype)
    base = dataclasses.replace(base, seed=seed)
    canvas_length, max_denoising_steps = base.canvas_length, base.max_denoising_steps
    g = torch.Generator().manual_seed(seed)
    prompts, max_tokens = [], []
    for rid, prompt, _, n, _ in requests:  # text encoded; random prompts drawn once their lengths are known to fit
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"request {rid}: a text prompt needs a checkpoint with a tokenizer (random weights "
                                 "take prompt lengths)")
            prompts.append(tokenizer.encode(prompt))
            max_tokens.append(n * canvas_length)  # text workloads give canvases
        else:
            prompts.append(prompt)
            max_tokens.append(n)
    longest = max(x if isinstance(x, int) else len(x) for x in prompts)
    need = longest + max(max_tokens) + canvas_length
    if need > cfg.max_position_embeddings:  # (a random prompt of 2**40 ids was drawn before this check)
        raise DemoInputError(f"--canvas-length {canvas_length}: the demo's requests need {need} positions "
                             f"(the longest prompt, {longest} tokens, + {max(max_tokens)} "
                             f"generated + one canvas), more than the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}); lower --canvas-length or --canvases, or shorten "
                             f"--prompt")
    prompts = [torch.randint(3, cfg.vocab_size, (x,), generator=g).tolist() if isinstance(x, int) else x
               for x in prompts]
    # at least 256 positions where the model has them (the harness's page pool is sized from it)
    max_model_len = max(256, need) if max(256, need) <= cfg.max_position_embeddings else need
    runner = HarnessRunner(model, default_params=base, max_num_reqs=4, max_num_batched_tokens=4 * canvas_length,
                           page_size=8, max_model_len=max_model_len, device=dev, attn_backend=backend,
                           sampler_backend=sampler_backend, check=check, fuse_commit=fuse_commit)
    for (rid, _, arrival, _, greedy), ids, mt in zip(requests, prompts, max_tokens):
        temps = dict(t_min=0.0, t_max=0.0) if greedy else {}
        runner.add_request(rid, ids, dataclasses.replace(base, max_tokens=mt, **temps), arrival_step=arrival)

    shape = (f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
             f"{sum(t.numel() for t in model.parameters()):,} parameters")
    if checkpoint is not None:
        eos = ", ".join(str(t) for t in base.eos_token_ids) or "none"
        p(f"blockdiff demo: trained DiffusionGemma from {checkpoint} ({shape}, "
          f"run in {str(model.embed_tokens.weight.dtype).replace('torch.', '')}){_train_summary(checkpoint)}, "
          f"canvas {canvas_length}{notes.get('canvas_length', '')}, step cap {max_denoising_steps}"
          f"{notes.get('max_denoising_steps', '')}, eos id {eos}")
    else:
        p(f"blockdiff demo: tiny random-weight DiffusionGemma ({shape}, tied embedding x{embedding_scale:g}), "
          f"canvas {canvas_length}, step cap {max_denoising_steps}")
    p(f"attention backend: {backend} | sampler backend: {sampler_backend} | device: {dev} | seed: {seed} | "
      f"check: {'on' if check else 'off'}" + (" | fused commits: on" if fuse_commit else ""))
    p(f"{len(requests)} requests ({sum(r[4] for r in requests)} greedy), {runner.max_num_reqs} slots, step budget "
      f"{runner.max_num_batched_tokens} tokens, KV pages of {runner.page_size} tokens")
    t0 = time.perf_counter()
    bar = None
    if progress:
        bar = tqdm(total=sum(max_tokens), unit="tok", desc="generating", file=sys.stderr, leave=False,
                   disable=None)  # None: shown on a terminal only

    def on_step(rec):
        if bar is not None:
            bar.update(rec.tokens_emitted)
            bar.set_postfix(step=rec.step, rows=len(rec.rows), done=len(runner.results))

    try:
        results = runner.run(max_steps=DEMO_MAX_STEPS, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    totals = runner.totals()
    totals["wall_s"] = wall
    totals["max_denoising_steps"] = max_denoising_steps
    table = format_table(runner.history)
    p("")
    p(table)
    p(TABLE_LEGEND)
    p("")
    p("requests:")
    greedy_ids = {r[0] for r in requests if r[4]}
    for rid, r in sorted(results.items()):
        p(f"  {rid}{'*' if rid in greedy_ids else ' '}: prompt {r.prompt_len:>3} tok, arrived step {r.arrival_step:>2}, admitted {r.admit_step:>2}, "
          f"finished {r.finish_step:>3} ({r.finish_reason}), {r.num_canvases} canvas(es), "
          f"{r.num_denoise_steps} denoise steps, {len(r.output_token_ids)} tokens emitted")
    if greedy_ids:
        p("  (* greedy, T = 0)")
    p("")
    p(f"totals: {totals['forward_passes']} forward passes over {totals['steps']} steps, "
      f"{totals['tokens_emitted']} tokens emitted, {totals['tokens_per_forward']:.3f} tokens/forward, "
      f"{totals['denoise_rows']} denoise rows, {totals['canvases_committed']} canvases committed, "
      f"wall {wall:.2f} s")
    p(format_generation_metrics(totals))
    samples = []
    if tokenizer is not None:
        p("generated text (prompt | completion, decoded by the checkpoint's tokenizer):")
        for (rid, *_), ids in zip(requests, prompts):
            comp = tokenizer.decode(results[rid].output_token_ids, stop_at_eos=True)
            samples.append({"req_id": rid, "prompt": tokenizer.decode(ids), "completion": comp})
            p(f"  {rid}: {tokenizer.decode(ids)!r} | {comp!r}")
    else:
        p("generated text: none (random weights emit random ids; no tokenizer)")
    if check:
        ac = runner.attention_checker
        p(f"check: {ac.num_checked} attention calls (max abs err {ac.max_err:.2e} vs fp64 oracle) and "
          f"{runner.sampler.num_checked} sampler steps matched the references")
    rec = pick_mixed_step(runner.history)
    png = None
    if rec is not None:
        png = plot_attention_pattern(rec, cfg, os.path.join(out, "attention_pattern.png"))
        p(f"attention pattern of step {rec.step} ({len(rec.rows)} sequences) written to {png}")
    return DemoResult(runner, results, totals, png, table, rec.step if rec is not None else None, samples)


def _checkpoint_defaults(model, folder: str, tokenizer, canvas_length: int | None,
                         max_denoising_steps: int | None) -> tuple[SamplingParams, dict[str, str]]:
    """The demo's base request for a trained checkpoint, and header notes where a value is not the checkpoint's.

    Base: :func:`~blockdiff.integration.harness.checkpoint_sampling_params` (the checkpoint's
    ``generation_config.json`` and ``config.json`` ``canvas_length``; transformers' defaults for what the file
    leaves out). Then: without a ``generation_config.json`` the step cap is :data:`TRAINED_MAX_DENOISING_STEPS`
    (``blockdiff train``'s evaluation cap) and, when the generation config names no eos id, the tokenizer's eos
    id ends a request; explicit ``canvas_length`` / ``max_denoising_steps`` win over both, and the note says
    which value they override.
    """
    has_file = os.path.isfile(os.path.join(folder, GENERATION_FILE))
    ckpt = checkpoint_sampling_params(model)
    default_steps = ckpt.max_denoising_steps if has_file else TRAINED_MAX_DENOISING_STEPS
    steps_src = f"the checkpoint's {default_steps}" if has_file else \
        f"the default {default_steps}, blockdiff train's evaluation cap"
    kw: dict[str, Any] = {"max_denoising_steps": default_steps}
    notes: dict[str, str] = {}
    if max_denoising_steps is not None and max_denoising_steps != default_steps:
        kw["max_denoising_steps"] = max_denoising_steps
        notes["max_denoising_steps"] = f" (overrides {steps_src})"
    if canvas_length is not None and canvas_length != ckpt.canvas_length:
        kw["canvas_length"] = canvas_length
        notes["canvas_length"] = f" (overrides the checkpoint's trained canvas length {ckpt.canvas_length})"
    if not ckpt.eos_token_ids:
        kw["eos_token_ids"] = (tokenizer.eos_token_id,)
    try:  # a step cap the checkpoint's schedule cannot take (a temperature below 2**-126 at the last step)
        return dataclasses.replace(ckpt, **kw), notes
    except ValueError as e:
        raise DemoInputError(f"--max-denoising-steps {kw['max_denoising_steps']} with the checkpoint's t_min "
                             f"{ckpt.t_min} / t_max {ckpt.t_max}: the sampler refuses this request ({e})") from None


def format_generation_metrics(totals: dict) -> str:
    """Two lines from :meth:`HarnessRunner.totals` (plus ``max_denoising_steps``): tokens committed per forward
    pass (also per request row and per denoise row) and denoising steps per committed canvas (mean, max, cap)."""
    return (f"tokens committed per forward pass: {totals['tokens_per_forward']:.3f} "
            f"({totals['tokens_emitted']} tokens in {totals['forward_passes']} forward passes; "
            f"{totals['tokens_per_request_pass']:.3f} per request row, "
            f"{totals['tokens_per_denoise_step']:.3f} per denoise row)\n"
            f"denoising steps per canvas: mean {totals['denoise_steps_per_canvas']:.2f}, max "
            f"{totals['max_denoise_steps_per_canvas']} over {totals['canvases_committed']} committed canvases "
            f"(step cap {totals['max_denoising_steps']})")


def _train_summary(folder: str) -> str:
    """``", trained N steps, held-out loss L nats per canvas byte"`` from the folder's ``train_log.json`` (model/train.py's
    record), or ``""`` when the folder has no readable log (the log is optional)."""
    try:
        with open(os.path.join(folder, "train_log.json")) as f:
            log = json.load(f)
        return f", trained {int(log['steps'])} steps, held-out loss {float(log['final_held_out_loss']):.3f} nats per canvas byte"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):  # (OverflowError: "steps": Infinity)
        return ""
