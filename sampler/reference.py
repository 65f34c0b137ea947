"""Dense PyTorch reference of the denoising sampler step: the oracle every other backend is tested against.

Semantics: docs/ARCHITECTURE.md "Sampler semantics" (HF transformers DiffusionGemma generation:
``EntropyBoundSampler``, ``StableAndConfidentStoppingCriteria``, ``LinearTemperatureScheduleLogitsProcessor``,
self-conditioning in ``DiffusionGemmaDecoder``), with its phase machine (:mod:`blockdiff.sampler.common`).
Readable, vectorised over rows and phases, and memory-hungry on purpose: it materialises [N, CL, V] float32
temporaries (z, Gumbel noise, probabilities) — use the ``triton`` backend for serving.

Per DENOISE row with step s, temperature T (:func:`blockdiff.sampler.common.temperature`):

1. ``z = (float32(logits) - c) / T`` (the logits are the model's final, already soft-capped, logits; float64
   ones beyond float32's range saturate to +-FLT_MAX first, :func:`~blockdiff.sampler.common.saturate_logits`), c = 0
   except where the position's largest z would overflow (:func:`blockdiff.sampler.common.overflow_shift`).
2. ``sampled = argmax(z + g)``, g Gumbel noise of :func:`blockdiff.sampler.rng.gumbel_noise`.
3. ``argmax = argmax(z)`` (ties to the lowest id); ``H = -sum p log p``, ``p = softmax(z)`` (nats); at a shifted
   position (p uniform over the logits tied at max x) H = log(#ties) exactly, rounded to float32.
4. :func:`blockdiff.sampler.common.entropy_decisions` (the acceptance and the mean entropy of one sort); a row with a position whose softmax is undefined (a NaN or
   +inf logit, or every logit -inf) fails (nothing accepted). A -inf logit alone is p = 0 (vLLM's token mask):
   never sampled, never the argmax, nothing in H or soft.
5. next canvas: accepted positions keep ``sampled``, the rest get RENOISE-stream ids.
6. :func:`blockdiff.sampler.common.convergence`.
7. ``soft = (bf16(p) @ E).float() * sqrt(hidden)`` — p cast to E's dtype, the product in E's dtype (fp32
   accumulation), as transformers does; the same-precision eager computation the fused kernel is held to.
8. T = 0: no noise, ``sampled = argmax``, H = 0, p = one-hot(argmax).

Where this (docs/ARCHITECTURE.md) differs from transformers' DiffusionGemma generation (5.x), on purpose:

- Sampling: Gumbel-max with counter-based Philox noise keyed on the request (reproducible, batch invariant) instead
  of ``torch.multinomial`` on the global RNG: the same distribution, different draws.
- T = 0 (t_min = t_max = 0) is greedy here; transformers' config validation requires ``t_max > t_min`` (its error
  message says ``>=``) and a zero temperature would divide by zero.
- Ties: sort by entropy is stable (ties by position); transformers' ``torch.sort`` is unstable.
- NaN / +inf logits (or a position whose every logit is -inf) fail the request; in transformers
  ``Categorical(logits=...)`` raises on NaN (or, without argument validation, NaN entropies are never accepted and
  the step goes on with garbage). -inf logits are p = 0 in both.
- max_tokens trims the emitted canvas; transformers emits whole canvases (``ceil(max_new_tokens / CL)``) and pads
  after the first EOS of a canvas with pad_token_id (the EOS kept, as here).
- Self-conditioning: ``soft = softmax(z) @ E * sqrt(hidden)`` kept in float32 with the float32 scale; transformers
  feeds the processed logits cast to bf16 (z rounded to bf16 before its softmax), rounds the product to bf16 and
  multiplies by ``embed_scale`` cast to bf16 (``sqrt(2816) = 53.07 -> 53.0``).
- Convergence history: an argmax-stability counter per request (k + 1 identical canvases <=> counter >= k)
  instead of transformers' [k, B, CL] history buffer initialised to -1; the same decisions, including the
  earliest convergence at s = 1 for k = 1 and ``stable`` always true for k = 0.
- Temperature schedule: identical (``cur_step = S - s``, so the first step uses t_max and the last
  ``t_min + (t_max - t_min) / S``).
"""
from __future__ import annotations

import math

import torch

from . import rng
from .common import (DenoiseResult, apply_step, check_step_args, convergence, entropy_decisions, overflow_shift,
                     saturate_logits, temperature)
from .state import SamplerState, StepOutput

__all__ = ["sampler_step", "denoise_reference", "soft_embedding_reference", "entropy_reference"]


def entropy_reference(z: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p log p`` with ``p = softmax(z)`` over the last dim, float32 nats.

    Tokens with p = 0 contribute 0 (the limit of p log p), also where ``z = -inf`` (a -inf logit, a masked token,
    or a finite logit such as ``finfo(float32).min`` divided by T < 1): ``0 * -inf`` would be NaN. NaN only where the
    distribution is undefined (some z = +inf, or every z = -inf); the caller fails such rows.
    """
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -torch.where(p == 0, 0.0, p * logp).sum(-1)


def soft_embedding_reference(p: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """Self-conditioning soft embedding ``p @ E * sqrt(hidden)``, float32 [..., hidden].

    Args:
        p: float32 [..., V] probabilities. embedding: E [V, hidden] (bf16/fp16/fp32).

    p is cast to E's dtype and multiplied in that dtype (transformers' DiffusionGemmaDecoder does the same), then
    widened to float32 and scaled by ``sqrt(hidden)`` in float32 (transformers rounds the scale to E's dtype).
    """
    hidden = embedding.shape[-1]
    return torch.matmul(p.to(embedding.dtype), embedding).to(torch.float32) * math.sqrt(hidden)


def denoise_reference(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor,
                      embedding: torch.Tensor) -> DenoiseResult:
    """Steps 1-7 for every row (rows not in DENOISE compute garbage that :func:`apply_step` discards)."""
    CL, V = state.canvas_length, state.vocab_size
    seed, rid = state.seed[slots], state.request_id[slots]
    cidx, step = state.canvas_index[slots], state.step[slots]

    T = temperature(state, slots)                                    # [N] float32
    greedy = T == 0
    x = logits.to(torch.float32)  # float64 beyond float32's range: saturated first (sampler_step, saturate_logits)
    # the softmax is defined iff the largest logit is finite: no NaN (amax propagates it), no +inf, not every
    # logit -inf; a -inf logit beside finite ones is p = 0 (z = -inf: never the argmax or the sample, 0 in H)
    xmax = x.amax(-1)                                                # [N, CL]
    defined = torch.isfinite(xmax)
    row_failed = ~defined.all(-1)
    tdiv = torch.where(greedy, torch.ones_like(T), T)[:, None, None]
    shift = overflow_shift(x, tdiv)                                  # c: 0 unless the position's max z overflows
    z = (x - shift[..., None]) / tdiv                                # = x / T unless max z would overflow

    argmax = z.argmax(-1)                                            # first maximum: ties to the lowest id
    g = rng.gumbel_noise(seed, rid, cidx, step, CL, V)
    sampled = torch.where(greedy[:, None], argmax, (z + g).argmax(-1))
    entropy = torch.where(greedy[:, None], 0.0, entropy_reference(z))
    # rule 1's shifted form (c != 0 exactly there: |max x| > T * FLT_MAX): p is uniform over the ties at max x, so
    # H = log(#ties), correctly rounded to float32 (the TP combine's and triton's float64 log of the count: the same
    # float32 bit for bit); log_softmax's rounding of it varies with where the ties sit, which would order equal tie
    # counts by rounding instead of by position (tests/sampler/test_overflowing_z.py)
    ties = (x == xmax[..., None]).sum(-1)
    entropy = torch.where(shift != 0, torch.log(ties.to(torch.float64)).to(torch.float32), entropy)
    entropy = torch.where(defined, entropy, float("nan"))           # greedy rows too: their entropy is 0

    # a finite z entry can still overflow to -inf (p = 0, the entropy stays finite); a NaN entropy (an undefined
    # softmax) fails the row, never commits garbage
    row_failed = row_failed | torch.isnan(entropy).any(-1)
    accepted, mean_entropy = entropy_decisions(entropy, state.entropy_bound[slots])   # one sort, one cumsum
    accepted = accepted & ~row_failed[:, None]
    renoise = rng.random_ids(seed, rid, cidx, step, CL, V, rng.RENOISE)
    next_canvas = torch.where(accepted, sampled, renoise)

    converged, stable_count = convergence(state, slots, argmax, mean_entropy)

    onehot = torch.zeros_like(z).scatter_(-1, argmax[..., None], 1.0)  # (F.one_hot checks ids: a host sync)
    p = torch.where(greedy[:, None, None], onehot, torch.softmax(z, dim=-1))
    soft = soft_embedding_reference(p, embedding)
    return DenoiseResult(accepted=accepted, entropy=entropy, argmax=argmax, sampled=sampled,
                         next_canvas=next_canvas, row_failed=row_failed, converged=converged,
                         stable_count=stable_count, mean_entropy=mean_entropy, temperature=T, soft=soft)


def sampler_step(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                 embedding: torch.Tensor, *, check_values: bool | None = None) -> StepOutput:
    """One sampler step over N rows, dense PyTorch (see the module docstring).

    Args:
        state: :class:`SamplerState`, mutated in place.
        slots: int64 [N], distinct slot ids in [0, max_num_reqs).
        logits: float [N, CL, V], the model's final logits for the canvas tokens; rows whose phase is not
            DENOISE are ignored (may be garbage).
        prefill_done: bool [N]; a PREFILL row with True starts denoising.
        embedding: E [V, hidden], the tied input embedding.
        check_values: check the slot ids (one host read; None: unless a CUDA graph is being captured). Unchecked
            ids are trusted: this backend indexes the state with them as torch does (an id >= max_num_reqs
            raises, a negative one counts from the end).

    Returns:
        :class:`StepOutput`.

    Raises:
        TypeError / ValueError: bad argument types, shapes or slot ids (see
            :func:`blockdiff.sampler.common.check_step_args`).
    """
    check_step_args(state, slots, logits, prefill_done, embedding, check_values=check_values)
    phase = state.phase[slots].clone()
    res = denoise_reference(state, slots, saturate_logits(logits), embedding)
    return apply_step(state, slots, prefill_done, res, phase)
