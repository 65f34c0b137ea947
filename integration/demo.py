"""``blockdiff demo``: a tiny random-weight DiffusionGemma served by the harness, with a per-step table, totals
and a picture of one mixed step's attention pattern.

The default workload (embedded) mixes prefill, denoise and commit rows in the same batches: six requests with
prompts of 5-70 tokens arrive at steps 0-12 into four slots, a 64-token step budget chunks the long prompts, and
a 16-token canvas with a step cap of 6 keeps the run to a few seconds on 2 CPU cores. One request is greedy
(T = 0). Random weights give near-uniform logits (entropy ~ log V, one position accepted per step); the tied
embedding is scaled (``embedding_scale``, default 30) so the toy logits are peaked enough for the entropy-bound
acceptance to show.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

# (req_id, prompt_len, arrival_step, max_tokens, greedy)
DEFAULT_REQUESTS: tuple[tuple[str, int, int, int, bool], ...] = (
    ("req-0", 70, 0, 32, False),
    ("req-1", 9, 0, 16, False),
    ("req-2", 23, 2, 32, False),
    ("req-3", 5, 5, 16, True),  # T = 0: every position accepted, converges once the argmax is stable
    ("req-4", 41, 9, 16, False),
    ("req-5", 12, 12, 32, False),
)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no silent fallback)."""


@dataclass
class DemoResult:
    runner: Any
    results: dict
    totals: dict
    png_path: str | None
    table: str
    mixed_step: int | None


def check_attention_backend(backend: str, device) -> None:
    """Run the chosen attention backend once on a tiny mixed batch; raise :class:`BackendUnavailable` with the
    reason if it cannot run on ``device`` (e.g. ``cute`` without CUDA, ``triton`` on CPU without
    ``TRITON_INTERPRET=1``)."""
    import torch

    from blockdiff.attention import attention

    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "triton" and torch.device(device).type == "cpu" and not interp:
        raise BackendUnavailable("attention backend 'triton' on CPU needs TRITON_INTERPRET=1 (Triton interpreter)")
    if backend == "cute" and torch.device(device).type != "cuda":
        raise BackendUnavailable("attention backend 'cute' needs a CUDA GPU (FlashAttention-4 / CuTe DSL)")
    try:
        q = torch.randn(3, 2, 16, device=device)
        k = torch.randn(1, 16, 1, 16, device=device)
        attention(q, k, k.clone(), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
                  seq_lens=torch.tensor([2, 3], dtype=torch.int32, device=device),
                  causal=torch.tensor([True, False], device=device),
                  block_table=torch.zeros(2, 1, dtype=torch.int32, device=device), backend=backend)
    except (ImportError, RuntimeError, NotImplementedError) as e:
        raise BackendUnavailable(f"attention backend {backend!r} is not available on {device}: {e}") from e


def format_table(history) -> str:
    """Per-step table: rows per phase (prefill/denoise/commit), query tokens, positions accepted, mean
    entropy (nats) of the denoise rows, canvases committed, tokens emitted, arrivals and finishes."""
    head = (f"{'step':>4} {'pre':>3} {'den':>3} {'com':>3} {'tok':>4} {'accepted':>8} {'mean H':>7} "
            f"{'commit':>6} {'emit':>4}  events")
    lines = [head, "-" * len(head)]
    for h in history:
        if not h.forward:
            ev = " ".join([f"+{a}" for a in h.arrived]) or "(idle)"
            lines.append(f"{h.step:>4} {'':>3} {'':>3} {'':>3} {'':>4} {'':>8} {'':>7} {'':>6} {'':>4}  {ev}")
            continue
        me = h.mean_entropy
        ev = " ".join([f"+{a}" for a in h.arrived] + [f"done:{f}" for f in h.finished])
        lines.append(f"{h.step:>4} {h.count('prefill'):>3} {h.count('denoise'):>3} {h.count('commit'):>3} "
                     f"{h.num_tokens:>4} {h.positions_accepted:>8} {(f'{me:.3f}' if me is not None else '-'):>7} "
                     f"{h.canvases_committed:>6} {h.tokens_emitted:>4}  {ev}")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from blockdiff.attention import build_mask

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


def run_demo(*, backend: str = "reference", sampler_backend: str = "reference", check: bool = False,
             device: str = "cpu", seed: int = 0, out: str = "./demo_out", canvas_length: int = 16,
             max_denoising_steps: int = 6, progress: bool = True, requests=DEFAULT_REQUESTS,
             stream=None, threads: int | None = 1, embedding_scale: float = 30.0) -> DemoResult:
    """Run the demo and print its report to ``stream`` (default stdout). ``threads``: torch intra-op threads on
    CPU (default 1, fastest for the tiny model; None leaves torch's setting).

    Raises:
        BackendUnavailable: the attention or sampler backend cannot run on ``device``.
        blockdiff.integration.checks.AttentionMismatch, blockdiff.integration.sampler.SamplerMismatch:
            ``check`` found a disagreement with the reference.
    """
    import torch

    from blockdiff.model import DiffusionGemma, tiny_config
    from blockdiff.sampler import SamplingParams

    from .harness import HarnessRunner

    stream = stream or sys.stdout
    p = lambda *a: print(*a, file=stream, flush=True)  # noqa: E731
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("--device cuda but CUDA is not available here")
    check_attention_backend(backend, dev)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if sampler_backend == "triton" and dev.type == "cpu" and not interp:
        raise BackendUnavailable("sampler backend 'triton' on CPU needs TRITON_INTERPRET=1 (Triton interpreter)")
    from blockdiff.sampler import get_backend as sampler_get_backend

    try:
        sampler_get_backend(sampler_backend)
    except (ImportError, ValueError) as e:
        raise BackendUnavailable(f"sampler backend {sampler_backend!r} is not available: {e}") from e

    if dev.type == "cpu" and threads is not None:
        # A tiny model's ops are ~microseconds: intra-op threads cost more than they give (100x slower on a
        # loaded 2-core machine).
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = tiny_config(canvas_length=canvas_length)
    model = DiffusionGemma(cfg).to(dev).eval()
    with torch.no_grad():
        model.embedding_weight.mul_(embedding_scale)  # tied: peaks the toy logits (random weights)
    params = SamplingParams(canvas_length=canvas_length, max_denoising_steps=max_denoising_steps, seed=seed)
    runner = HarnessRunner(model, default_params=params, max_num_reqs=4, max_num_batched_tokens=4 * canvas_length,
                           page_size=8, max_model_len=256, device=dev, attn_backend=backend,
                           sampler_backend=sampler_backend, check=check)
    g = torch.Generator().manual_seed(seed)
    for rid, plen, arrival, max_tokens, greedy in requests:
        prompt = torch.randint(3, cfg.vocab_size, (plen,), generator=g).tolist()
        temps = dict(t_min=0.0, t_max=0.0) if greedy else {}
        rp = SamplingParams(canvas_length=canvas_length, max_denoising_steps=max_denoising_steps, seed=seed,
                            max_tokens=max_tokens, **temps)
        runner.add_request(rid, prompt, rp, arrival_step=arrival)

    p(f"blockdiff demo: tiny random-weight DiffusionGemma ({cfg.num_hidden_layers} layers, hidden "
      f"{cfg.hidden_size}, vocab {cfg.vocab_size}, tied embedding x{embedding_scale:g}), canvas {canvas_length}, "
      f"step cap {max_denoising_steps}")
    p(f"attention backend: {backend} | sampler backend: {sampler_backend} | device: {dev} | seed: {seed} | "
      f"check: {'on' if check else 'off'}")
    p(f"{len(requests)} requests ({sum(r[4] for r in requests)} greedy), {runner.max_num_reqs} slots, step budget {runner.max_num_batched_tokens} tokens, "
      f"KV pages of {runner.page_size} tokens")
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        total_tokens = sum(r[3] for r in requests)
        bar = tqdm(total=total_tokens, unit="tok", desc="generating", file=sys.stderr, leave=False,
                   disable=None)  # None: shown on a terminal only

    def on_step(rec):
        if bar is not None:
            bar.update(rec.tokens_emitted)
            bar.set_postfix(step=rec.step, rows=len(rec.rows), done=len(runner.results))

    try:
        results = runner.run(max_steps=10_000, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    totals = runner.totals()
    totals["wall_s"] = wall
    table = format_table(runner.history)
    p("")
    p(table)
    p("columns: pre/den/com = prefill, denoise, commit rows in the step; tok = query tokens; accepted = canvas "
      "positions accepted; mean H = mean entropy of the denoise rows (nats); commit = canvases committed; "
      "emit = tokens emitted")
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
    if check:
        ac = runner.attention_checker
        p(f"check: {ac.num_checked} attention calls (max abs err {ac.max_err:.2e} vs fp64 oracle) and "
          f"{runner.sampler.num_checked} sampler steps matched the references")
    rec = pick_mixed_step(runner.history)
    png = None
    if rec is not None:
        png = plot_attention_pattern(rec, cfg, os.path.join(out, "attention_pattern.png"))
        p(f"attention pattern of step {rec.step} ({len(rec.rows)} sequences) written to {png}")
    return DemoResult(runner, results, totals, png, table, rec.step if rec is not None else None)
