"""Pieces every sampler backend shares: argument checks, the temperature schedule, the overflow shift of z, and
the phase bookkeeping.

Backends (``reference``, ``triton``) never import each other; both import this module, :mod:`.rng` and
:mod:`.state`. Everything here is vectorised over the N rows of a step with ``torch.where`` (no host sync, no
data-dependent shapes), so a step stays capturable in a CUDA graph; the one host read is the slot-id check of
:func:`check_step_args`, which is off while a graph is being captured.

Phase machine per row (docs/ARCHITECTURE.md "Sampler semantics"):
PREFILL --prefill_done--> DENOISE (fresh canvas 0) --converged--> COMMIT --EOS or max_tokens--> FINISHED
                                  \\--undefined softmax--> FAILED   \\--else--> DENOISE (fresh canvas, index + 1)
(undefined softmax: a NaN or +inf logit, or every logit of a position -inf; a -inf logit alone is p = 0.)
(A request resumed after preemption starts at the canvas index ``SamplerState.add_request`` gave it, not 0.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .state import COMMIT, DENOISE, FAILED, FINISHED, PREFILL, SamplerState, StepOutput

__all__ = ["check_step_args", "check_slot_values", "capturing", "saturate_logits", "temperature", "overflow_shift",
           "DenoiseResult",
           "apply_step", "fresh_canvas", "accept_by_entropy", "entropy_order", "entropy_mean", "entropy_decisions"]


def capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (host reads are not allowed then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_slot_values(state: SamplerState, slots: torch.Tensor) -> None:
    """Value rule of ``slots`` (one host read of the ids): distinct slot ids in ``[0, max_num_reqs)``.

    Raises:
        ValueError: an id out of range or repeated (names ``slots``, the id and the rule).
    """
    ids = slots.tolist()
    R = state.max_num_reqs
    for i in ids:
        if not 0 <= i < R:
            raise ValueError(f"slots must hold slot ids in [0, max_num_reqs={R}), got {i}")
    if len(set(ids)) != len(ids):
        seen = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"slots must be distinct (one row per request), got slot {dup} more than once")


def check_step_args(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                    embedding: torch.Tensor, *, vocab_slice: tuple[int, int] | None = None,
                    check_values: bool | None = None) -> bool:
    """Validate ``sampler_step``'s arguments: types, dtypes, shapes and devices from host metadata (no device sync),
    and, when ``check_values`` holds, the slot ids (:func:`check_slot_values`: one host read of ``slots``).

    ``vocab_slice``: ``(start, end)`` of a tensor-parallel rank's vocabulary slice (``blockdiff.sampler.tp``):
    logits then hold the ``end - start`` columns of that slice and embedding its rows, and a tensor need only be
    on the state's device type (None: the full vocabulary, on the state's device).
    ``check_values``: None (default) checks the ids unless a CUDA graph is being captured (:func:`capturing`), as
    the attention contract does; False trusts them (the fast path: a caller that allocates the slots itself).

    Returns:
        Whether the slot ids were checked (False: callers index only with ids they clamp or mask themselves).

    Raises:
        TypeError: wrong types or dtypes, or a tensor that is not dense (a sparse layout) (names the argument).
        ValueError: wrong shapes, devices or slot ids (names the argument and the rule).
    """
    if check_values is None:
        check_values = not capturing()
    elif not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool or None, got {type(check_values).__name__}")
    if not isinstance(state, SamplerState):
        raise TypeError(f"state must be a SamplerState, got {type(state).__name__}")
    for name, t in (("slots", slots), ("logits", logits), ("prefill_done", prefill_done), ("embedding", embedding)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:  # sparse: torch's NotImplementedError / RuntimeError from inside the step
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if vocab_slice is not None:
            same = t.device.type == state.device.type
        else:
            same = t.device == state.device or (
                t.device.type == state.device.type == "cuda"
                and (state.device.index is None or t.device.index == state.device.index))
        if not same:
            raise ValueError(f"{name} is on {t.device}, the state on {state.device}")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise TypeError(f"slots must be a 1-D int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    n = slots.shape[0]
    if vocab_slice is None:
        cols, cols_name, logits_note, rows_note = state.vocab_size, "vocab_size", "", ""
    else:
        lo, hi = vocab_slice
        cols, cols_name = hi - lo, "shard size"
        logits_note, rows_note = f" (this rank's vocabulary slice [{lo}, {hi}))", f" (rows [{lo}, {hi}) of E)"
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() != 3 or tuple(logits.shape) != (n, state.canvas_length, cols):
        raise ValueError(f"logits must have shape [N={n}, canvas_length={state.canvas_length}, "
                         f"{cols_name}={cols}]{logits_note}, got {tuple(logits.shape)}")
    if prefill_done.dtype != torch.bool:  # the docstring's rule: a wrong dtype is a TypeError (was: ValueError)
        raise TypeError(f"prefill_done must be a bool tensor of shape [{n}], got {prefill_done.dtype} "
                        f"{tuple(prefill_done.shape)}")
    if tuple(prefill_done.shape) != (n,):
        raise ValueError(f"prefill_done must be a bool tensor of shape [{n}], got {prefill_done.dtype} "
                         f"{tuple(prefill_done.shape)}")
    if not embedding.is_floating_point():
        raise TypeError(f"embedding must be floating point, got {embedding.dtype}")
    if embedding.dim() != 2 or tuple(embedding.shape) != (cols, state.hidden_size):
        raise ValueError(f"embedding must have shape [{cols_name}={cols}, hidden_size={state.hidden_size}]"
                         f"{rows_note}, got {tuple(embedding.shape)}")
    if check_values:
        check_slot_values(state, slots)
    return check_values


def temperature(state: SamplerState, slots: torch.Tensor) -> torch.Tensor:
    """Temperature of each row's current step, float32 [N] (docs/ARCHITECTURE.md "Sampler semantics", rule 1).

    ``T = t_min + (t_max - t_min) * (S - s) / S`` evaluated in float32 in exactly this order (every backend calls
    this function, so T is bit-identical across backends). Equals transformers'
    ``LinearTemperatureScheduleLogitsProcessor`` with ``cur_step = S - s``. ``t_max == 0`` gives T = 0 (greedy).
    """
    t_min = state.t_min[slots]
    t_max = state.t_max[slots]
    S = state.max_denoising_steps[slots]
    s = state.step[slots]
    return t_min + ((t_max - t_min) * (S - s).to(torch.float32)) / S.to(torch.float32)


#: Largest finite float32: a finite float64 logit beyond it saturates here (:func:`saturate_logits`).
FLOAT32_MAX = 3.4028234663852886e38


def saturate_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits every backend converts to float32 (docs/ARCHITECTURE.md "Sampler semantics" rule 1): ``logits``
    itself unless it is float64, whose finite values beyond float32's range are clamped to +-FLOAT32_MAX (a new
    tensor; NaN and +-inf kept), so that ``float32(x)`` rounds every finite logit to a finite float32: a finite
    logit never fails a request (IEEE conversion would turn 1e39 into +inf, and the request would fail). The order
    of the logits is kept (those beyond the range tie at the bound, as nearby values tie after any rounding).
    bf16 / fp16 / fp32 logits are always within range and pass through (no copy). No host sync: capturable.
    """
    if logits.dtype != torch.float64:
        return logits
    return torch.where(torch.isinf(logits), logits, logits.clamp(-FLOAT32_MAX, FLOAT32_MAX))


def overflow_shift(x: torch.Tensor, tdiv: torch.Tensor) -> torch.Tensor:
    """The shift c of docs/ARCHITECTURE.md "Sampler semantics" rule 1, float32 [...]: ``z = fl((x - c) / T)``.

    c = 0, so ``z = fl(x / T)`` bit for bit (``x - 0.0 == x``), except at a position whose largest logit is finite
    (no NaN or +inf, not every logit -inf; -inf logits beside it are p = 0 and stay -inf in z) and whose largest z
    overflows (``fl(max x / T)`` is +inf, or -inf: every z would be -inf): there c = max x, so z <= 0 with max 0.
    (``max_v fl(x_v / T) = fl(max x / T)``: the division by T > 0 and the rounding are monotone.) Every other z of
    such a position is <= -FLT_MAX * 2**-24 (about -2e31: two distinct float32 values near max x differ by at least
    |max x| * 2**-24 >= T * FLT_MAX * 2**-24), so p is uniform over the tokens tied at max x, exactly, and the
    Gumbel sample is the tie with the largest g. Where the softmax is undefined (a NaN or +inf logit, every logit
    -inf: ``max x`` is not finite, torch's ``amax`` propagates NaN) c = 0; the caller fails such positions.

    Args:
        x: float32 [..., V] logits, V >= 1. tdiv: float32 [..., 1] divisor (T; 1 on greedy rows, where z = x).
    """
    xmax = x.amax(-1)
    ovf = torch.isfinite(xmax) & torch.isinf(xmax / tdiv[..., 0])
    return torch.where(ovf, xmax, 0.0)


def entropy_order(entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sort and running sum that :func:`accept_by_entropy` decides on: ``(sorted_h, order, cum)``.

    ``sorted_h`` float32 [N, CL] (entropies ascending, NaN last), ``order`` int64 [N, CL] (a permutation of the
    positions: stable sort, ties by position), ``cum`` float32 [N, CL] (inclusive cumsum of ``sorted_h``). The
    float32 summation order of ``cum`` defines the decisions, so every backend takes it from here (the Triton
    backend compares ``cum - sorted_h <= bound`` in its step kernel instead of the torch ops below).
    """
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)
    return sorted_h, order, torch.cumsum(sorted_h, dim=-1)


def entropy_mean(cum: torch.Tensor) -> torch.Tensor:
    """``mean(H)`` of docs/ARCHITECTURE.md "Sampler semantics" rule 6, float32 [N], from :func:`entropy_order`'s
    ``cum`` [N, CL]: its last entry (the float32 sum of the entropies in the sorted order) over CL, one IEEE division
    (a tensor divisor: torch on CUDA multiplies by the reciprocal of a scalar one). Every backend takes the mean from
    here (the Triton step kernel divides the same entry with ``div_rn``), so equal entropies give the same bits and
    the same convergence decision; ``entropy.mean(-1)`` summed in torch's own order and the kernel in a tree, an ulp
    apart, and a ``confidence_threshold`` between the two converged one backend and not the other. NaN where an
    entropy is NaN (NaN sorts last).
    """
    total = cum[..., -1]
    return total / torch.full_like(total, cum.shape[-1])


def entropy_decisions(entropy: torch.Tensor, entropy_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted, mean_entropy)`` of one :func:`entropy_order`: :func:`accept_by_entropy`'s bool [N, CL] and
    :func:`entropy_mean`'s float32 [N] (the reference and the tensor-parallel step; the Triton step kernel computes
    both from the same sort and cumsum)."""
    sorted_h, order, cum = entropy_order(entropy)
    return _accept_sorted(sorted_h, order, cum, entropy_bound), entropy_mean(cum)


def _accept_sorted(sorted_h, order, cum, entropy_bound):
    sel = (cum - sorted_h) <= entropy_bound[:, None]
    sel &= ~torch.isnan(sorted_h)
    return torch.zeros_like(sel).scatter(-1, order, sel)


def accept_by_entropy(entropy: torch.Tensor, entropy_bound: torch.Tensor) -> torch.Tensor:
    """Entropy-bound acceptance (docs/ARCHITECTURE.md "Sampler semantics", rule 4; arXiv:2505.24857), bool [N, CL].

    Positions sorted by entropy ascending, ties by position (stable sort); the j-th accepted iff
    ``cumsum_j - H_j <= entropy_bound`` (inclusive, float32 cumsum as in transformers' EntropyBoundSampler).
    The lowest-entropy position always passes (``0 <= bound``). NaN entropies sort last and are never accepted.

    Args:
        entropy: float32 [N, CL] nats. entropy_bound: float32 [N] nats.
    """
    sorted_h, order, cum = entropy_order(entropy)
    return _accept_sorted(sorted_h, order, cum, entropy_bound)


def fresh_canvas(state: SamplerState, slots: torch.Tensor, canvas_index: torch.Tensor,
                 random_ids=rng.random_ids) -> torch.Tensor:
    """Uniform random canvas [N, CL] int64 of the INITIAL stream for canvas ``canvas_index`` [N] (step 0).

    ``random_ids``: a function with :func:`blockdiff.sampler.rng.random_ids`'s signature and results (a backend may
    pass its own kernel: the torch version is ~130 small launches).
    """
    return random_ids(state.seed[slots], state.request_id[slots], canvas_index, torch.zeros_like(canvas_index),
                      state.canvas_length, state.vocab_size, rng.INITIAL)


@dataclass
class DenoiseResult:
    """What a backend computed for the rows of a step (meaningful on DENOISE rows; others are ignored).

    accepted [N, CL] bool, entropy [N, CL] float32, argmax / sampled / next_canvas [N, CL] int64,
    row_failed [N] bool (an undefined softmax: a NaN / +inf logit, or every logit of a position -inf),
    converged [N] bool, stable_count [N] int32 (new value), mean_entropy [N] float32, temperature [N] float32,
    soft [N, CL, hidden] float32 or None (None: the backend already wrote ``state.soft`` for continuing rows itself,
    and zeroed it for fresh canvases).
    """

    accepted: torch.Tensor
    entropy: torch.Tensor
    argmax: torch.Tensor
    sampled: torch.Tensor
    next_canvas: torch.Tensor
    row_failed: torch.Tensor
    converged: torch.Tensor
    stable_count: torch.Tensor
    mean_entropy: torch.Tensor
    temperature: torch.Tensor
    soft: torch.Tensor | None


def convergence(state: SamplerState, slots: torch.Tensor, argmax: torch.Tensor, mean_entropy: torch.Tensor):
    """(converged [N] bool, stable_count [N] int32) of docs/ARCHITECTURE.md "Sampler semantics" rule 6, before
    masking by phase/failure.

    ``stable_count`` counts consecutive steps whose argmax canvas equals the previous one (prev_argmax is -1 at
    step 0, so step 0 never matches); k + 1 identical canvases <=> stable_count >= k. Converged iff
    ``(stable_count >= k and mean_entropy < confidence_threshold) or s + 1 >= S``.
    """
    same = (argmax == state.prev_argmax[slots]).all(dim=-1)
    stable_count = torch.where(same, state.stable_count[slots] + 1, torch.zeros_like(state.stable_count[slots]))
    stable = stable_count >= state.stability_threshold[slots]
    confident = mean_entropy < state.confidence_threshold[slots]
    cap = (state.step[slots] + 1) >= state.max_denoising_steps[slots]
    return (stable & confident) | cap, stable_count


def apply_step(state: SamplerState, slots: torch.Tensor, prefill_done: torch.Tensor, res: DenoiseResult,
               phase: torch.Tensor, random_ids=rng.random_ids) -> StepOutput:
    """Apply one step's transitions to ``state`` in place and build the :class:`StepOutput`.

    Args:
        phase: int32 [N], ``state.phase[slots]`` read at entry (before the backend ran).
        random_ids: generator of the fresh canvases (see :func:`fresh_canvas`).
    """
    N, CL = slots.shape[0], state.canvas_length
    dev = state.device
    is_prefill = phase == PREFILL
    is_den = phase == DENOISE
    is_commit = phase == COMMIT
    failed = is_den & res.row_failed
    ok = is_den & ~res.row_failed
    conv = ok & res.converged
    cont = ok & ~res.converged
    okc = ok[:, None]

    # ---- DENOISE rows
    canvas_old = state.canvas[slots]
    next_canvas = torch.where(okc, res.next_canvas, -1)
    new_canvas = torch.where(cont[:, None], res.next_canvas, canvas_old)
    prev_argmax = torch.where(okc, res.argmax, state.prev_argmax[slots])
    stable_count = torch.where(ok, res.stable_count, state.stable_count[slots])
    step = torch.where(ok, state.step[slots] + 1, state.step[slots])
    commit_canvas = torch.where(conv[:, None], res.argmax, state.commit_canvas[slots])
    new_phase = torch.where(failed, FAILED, torch.where(conv, COMMIT, phase)).to(torch.int32)

    # ---- COMMIT rows: emit the commit canvas trimmed after the first EOS (kept) and at max_tokens
    eos = state.eos_token_ids[slots]                                            # [N, E]
    is_eos = ((commit_canvas[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0)).any(-1)  # [N, CL]
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.to(torch.int32).argmax(-1), CL).to(torch.int64)
    remaining = state.max_tokens[slots] - state.num_emitted[slots]
    n_now = torch.minimum(torch.minimum(first_eos + 1, torch.full_like(first_eos, CL)), remaining)
    n_now = torch.where(is_commit, n_now.clamp(min=0), 0)
    pos = torch.arange(CL, device=dev)
    emitted = torch.where(pos[None, :] < n_now[:, None], commit_canvas, -1)
    eos_emitted = has_eos & (first_eos < remaining)
    num_emitted = state.num_emitted[slots] + n_now
    finished = is_commit & (eos_emitted | (num_emitted >= state.max_tokens[slots]))
    new_phase = torch.where(is_commit, torch.where(finished, FINISHED, DENOISE), new_phase).to(torch.int32)

    # ---- fresh canvases: PREFILL -> DENOISE (canvas 0), COMMIT -> DENOISE (canvas index + 1)
    start0 = is_prefill & prefill_done
    nextc = is_commit & ~finished
    fresh = start0 | nextc
    canvas_index = state.canvas_index[slots]
    # start0 keeps the index add_request set (0, or the canvases a resumed request already committed)
    canvas_index = torch.where(nextc, canvas_index + 1, canvas_index).to(torch.int32)
    new_phase = torch.where(start0, DENOISE, new_phase).to(torch.int32)
    init = fresh_canvas(state, slots, canvas_index, random_ids)
    fc = fresh[:, None]
    new_canvas = torch.where(fc, init, new_canvas)
    prev_argmax = torch.where(fc, -1, prev_argmax)
    stable_count = torch.where(fresh, 0, stable_count).to(torch.int32)
    step = torch.where(fresh, 0, step).to(torch.int32)

    # ---- write back (index_put with the device tensor `slots`: no host sync)
    state.canvas[slots] = new_canvas
    state.prev_argmax[slots] = prev_argmax
    state.stable_count[slots] = stable_count
    state.step[slots] = step
    state.commit_canvas[slots] = commit_canvas
    state.canvas_index[slots] = canvas_index
    state.num_emitted[slots] = num_emitted
    state.phase[slots] = new_phase
    if res.soft is not None:
        old = state.soft[slots]
        state.soft[slots] = torch.where(fc[:, :, None], 0.0, torch.where(cont[:, None, None], res.soft, old))

    zero_i = torch.zeros(N, dtype=torch.int32, device=dev)
    return StepOutput(
        num_sampled=torch.where(is_commit, CL, zero_i).to(torch.int32),
        num_rejected=torch.where(is_den, CL, zero_i).to(torch.int32),
        emitted=emitted,
        num_emitted_now=n_now.to(torch.int32),
        finished=finished,
        failed=failed,
        accepted=res.accepted & okc,
        entropy=torch.where(is_den[:, None], res.entropy, 0.0),
        argmax=torch.where(okc, res.argmax, -1),
        sampled=torch.where(okc, res.sampled, -1),
        next_canvas=next_canvas,
        converged=conv,
        mean_entropy=torch.where(is_den, res.mean_entropy, 0.0),
        temperature=torch.where(is_den, res.temperature, 0.0),
    )
