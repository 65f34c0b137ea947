"""Evaluation by generation: a trained DiffusionGemma serves held-out prompts through :class:`HarnessRunner`.

``blockdiff train`` (:func:`blockdiff.integration.cli.main`) hands :func:`evaluate_generation` to
:func:`blockdiff.model.train.train` as its ``evaluate`` callback, which runs it on the saved checkpoint and
records the result under ``"eval"`` in ``train_log.json``. It lives here, not in ``blockdiff.model``, because it
drives the harness and the sampler: the model package imports neither (docs/ARCHITECTURE.md "Packages and data flow").
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from blockdiff.model import DiffusionGemma
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import eval_max_model_len

from .harness import HarnessRunner, checkpoint_sampling_params

__all__ = ["held_out_prompts", "evaluate_generation"]

NEWLINE = 10  # byte value of '\n': prompts start at a line start


def held_out_prompts(tokenizer: ByteTokenizer, held_out: np.ndarray, num_prompts: int, prompt_len: int,
                     seed: int = 0) -> list[list[int]]:
    """Up to ``num_prompts`` windows of ``prompt_len`` byte tokens from ``held_out``, each starting just after a
    newline and holding no special token (bos / eos / pad), at offsets drawn from ``numpy.random.default_rng(seed)``
    (10,000 draws at most).

    Args:
        tokenizer: the :class:`ByteTokenizer` that encoded ``held_out``.
        held_out: 1-D integer token stream (``blockdiff.model.train.load_corpus``'s held-out part).
        num_prompts, prompt_len: prompts wanted and their length in tokens.
        seed: the offsets' seed, an int in [0, 2**63) (the sampling seed's range: evaluate_generation passes it on).

    Returns:
        the prompts, as lists of token ids (fewer than ``num_prompts`` when the stream has too few line starts).

    Raises:
        TypeError: ``held_out`` not a 1-D integer ndarray / tensor; ``num_prompts`` / ``prompt_len`` / ``seed`` not
            ints (bool refused; a None seed drew different prompts on every call).
        ValueError: ``num_prompts`` < 0, ``prompt_len`` < 1 or ``seed`` outside [0, 2**63) (a float, a bool or an
            empty prompt was taken, a 2-D or float stream searched: "no held-out prompt found" named the wrong cause,
            or prompts ran; a negative seed was numpy's "expected non-negative integer").
    """
    held_out = _token_stream(held_out)
    num_prompts = _check_count("num_prompts", num_prompts, 0)
    prompt_len = _check_count("prompt_len", prompt_len, 1)
    seed = _check_count("seed", seed, 0, 1 << 63)
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    tries = 0
    while len(prompts) < num_prompts and tries < 10_000:
        tries += 1
        off = int(rng.integers(0, max(1, len(held_out) - prompt_len - 1)))
        nl = np.nonzero(held_out[off: off + 4 * prompt_len] == tokenizer.byte_offset + NEWLINE)[0]
        if len(nl) == 0:
            continue
        s = off + int(nl[0]) + 1
        w = held_out[s: s + prompt_len]
        if len(w) < prompt_len or (w < tokenizer.byte_offset).any():
            continue
        prompts.append([int(x) for x in w])
    return prompts


def _check_count(name: str, v, lo: int, end: int | None = None) -> int:
    """``v`` as a Python int (a numpy int taken: it was refused further in under another name, or reached the
    returned dict and ``train_log.json``'s json.dump), after checking it is an integer in ``[lo, end)``."""
    rule = f"an int >= {lo}" if end is None else f"an int in [{lo}, 2**{end.bit_length() - 1})"
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be {rule}, got {type(v).__name__} ({v!r})")
    if v < lo or (end is not None and v >= end):
        raise ValueError(f"{name} must be {rule}, got {v}")
    return int(v)


def _token_stream(held_out) -> np.ndarray:
    """``held_out`` as a 1-D integer ndarray (a 1-D integer tensor is converted; nothing else is)."""
    if isinstance(held_out, torch.Tensor) and not (held_out.is_floating_point() or held_out.is_complex()
                                                   or held_out.dtype == torch.bool):
        held_out = held_out.detach().cpu().numpy()
    if not isinstance(held_out, np.ndarray) or held_out.ndim != 1 or held_out.dtype.kind not in "iu":
        what = f"{held_out.ndim}-D {held_out.dtype}" if isinstance(held_out, (np.ndarray, torch.Tensor)) \
            else type(held_out).__name__
        raise TypeError(f"held_out must be a 1-D integer token stream (ndarray or tensor), got {what}")
    return held_out


def evaluate_generation(model: DiffusionGemma, tokenizer: ByteTokenizer, held_out: np.ndarray, *,
                        num_prompts: int = 8, prompt_len: int = 48, canvases: int = 2, max_denoising_steps: int = 16,
                        seed: int = 0, attn_backend: str = "reference", sampler_backend: str = "reference",
                        device=None) -> dict:
    """Generate from held-out prompts with :class:`HarnessRunner` (the project's harness and sampler, the
    checkpoint's sampling parameters, :func:`~blockdiff.integration.harness.checkpoint_sampling_params`, except
    canvas length (``model.config``'s), step cap, seed, eos (the tokenizer's) and max_tokens).

    Prompts: :func:`held_out_prompts` (``num_prompts`` windows of ``prompt_len`` tokens at line starts). Each
    request generates up to ``canvases * canvas_length`` tokens (stops at eos); all run at once, one slot each.

    Args:
        model: the trained model (eval mode). tokenizer: its byte tokenizer. held_out: 1-D token stream.
        max_denoising_steps: step cap per canvas. seed: prompt choice and sampling seed.
        attn_backend / sampler_backend: the harness's backends. device: default the model's.

    Returns:
        dict: ``tokens_per_forward`` (tokens committed / harness forward passes, one pass serving every running
        request; prefill and commit passes included), ``tokens_per_request_pass`` (tokens committed / rows of all
        passes: a request's own prefill, denoise and commit rows), ``tokens_per_denoise_step`` (tokens committed
        / denoise rows), ``denoise_steps_per_canvas`` (mean), ``forward_passes``, ``tokens_emitted``,
        ``canvases``, ``samples`` ([{prompt, completion, finish_reason}] text); the figures of
        :meth:`HarnessRunner.totals`; ``requests_failed``: requests the harness finished as ``"error"`` (NaN / +inf
        logits: a diverged checkpoint), whose completions are empty or cut, so every rate above counts only what
        the others committed (0 for a sound model; ``blockdiff train`` prints it when it is not).

    Raises:
        TypeError: ``held_out`` not a 1-D integer stream; ``num_prompts``, ``prompt_len``, ``canvases`` or ``seed``
            not an int (a Python or numpy int; bool refused).
        ValueError: ``num_prompts``, ``prompt_len`` or ``canvases`` < 1 (named; ``canvases = 0`` was reported as
            ``max_tokens``, ``num_prompts = 0`` as a stream too short); ``seed`` outside [0, 2**63) (named; the
            sampling seed's range); ``prompt_len`` and ``canvases`` needing more positions than the model's
            ``max_position_embeddings`` (a prompt, its canvases and one canvas of room; named); no prompt found
            (held-out stream too short or without line starts);
            ``max_denoising_steps`` breaking its SamplingParams rule (a Python int).
    """
    num_prompts, prompt_len, canvases = (_check_count(name, v, 1) for name, v in (
        ("num_prompts", num_prompts), ("prompt_len", prompt_len), ("canvases", canvases)))
    seed = _check_count("seed", seed, 0, 1 << 63)
    cfg = model.config
    CL = cfg.canvas_length
    need, limit = eval_max_model_len(prompt_len, canvases, CL), getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, numbers.Integral) and need > limit:  # (was the harness's error naming its max_model_len)
        raise ValueError(f"prompt_len ({prompt_len}) + canvases ({canvases}) x canvas_length ({CL}) + one canvas of "
                         f"room = {need} positions, more than the model's max_position_embeddings ({limit}): lower "
                         "prompt_len or canvases")
    prompts = held_out_prompts(tokenizer, held_out, num_prompts, prompt_len, seed)
    if not prompts:
        raise ValueError("no held-out prompt found (held-out stream too short)")
    params = checkpoint_sampling_params(model, canvas_length=CL, max_denoising_steps=max_denoising_steps, seed=seed,
                                        eos_token_ids=(tokenizer.eos_token_id,), max_tokens=canvases * CL)
    dev = device or model.embed_tokens.weight.device
    runner = HarnessRunner(model, default_params=params, max_num_reqs=len(prompts),
                           max_num_batched_tokens=max(len(prompts) * CL, prompt_len * len(prompts)),
                           page_size=16, max_model_len=eval_max_model_len(prompt_len, canvases, CL), device=dev,
                           attn_backend=attn_backend, sampler_backend=sampler_backend)
    for i, p in enumerate(prompts):
        runner.add_request(f"eval-{i}", p, params)
    res = runner.run(max_steps=100_000)
    tot = runner.totals()  # the accounting blockdiff demo prints (HarnessRunner.totals)
    samples = [{"prompt": tokenizer.decode(prompts[i]), "completion": tokenizer.decode(res[f"eval-{i}"].output_token_ids),
                "finish_reason": res[f"eval-{i}"].finish_reason} for i in range(len(prompts))]
    return {
        "num_prompts": len(prompts), "prompt_len": prompt_len, "canvas_length": CL,
        "max_denoising_steps": max_denoising_steps, "forward_passes": tot["forward_passes"],
        "tokens_emitted": tot["tokens_emitted"], "tokens_per_forward": tot["tokens_per_forward"],
        "denoise_passes": tot["denoise_rows"], "canvases": tot["canvases_committed"],
        "request_rows": tot["request_rows"], "tokens_per_request_pass": tot["tokens_per_request_pass"],
        "tokens_per_denoise_step": tot["tokens_per_denoise_step"],
        "denoise_steps_per_canvas": tot["denoise_steps_per_canvas"], "samples": samples,
        "requests_failed": sum(s["finish_reason"] == "error" for s in samples),
    }
