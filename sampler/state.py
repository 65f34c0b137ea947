"""Device state of the sampler over preallocated request slots, phase constants and the step's output record.

One :class:`SamplerState` holds every running request of a serving engine in fixed-size device tensors
(``max_num_reqs`` slots), updated in place by ``sampler_step`` so that a step is capturable in a CUDA graph.
A slot's RNG identity is its ``request_id`` (not the slot number), so a request draws the same noise alone or in
any batch (docs/ARCHITECTURE.md "Sampler semantics").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams
from .rng import MAX_POSITIONS, MAX_VOCAB

__all__ = ["PREFILL", "DENOISE", "COMMIT", "FINISHED", "FAILED", "PHASE_NAMES", "NO_MAX_TOKENS",
           "SamplerState", "StepOutput", "check_resume", "parse_device"]

PREFILL = 0
DENOISE = 1
COMMIT = 2
FINISHED = 3
FAILED = 4
PHASE_NAMES = {PREFILL: "PREFILL", DENOISE: "DENOISE", COMMIT: "COMMIT", FINISHED: "FINISHED", FAILED: "FAILED"}

#: ``max_tokens`` stored for a request without a cap.
NO_MAX_TOKENS = 1 << 62


def check_resume(params, num_emitted: int) -> None:
    """Refuse to (re)start a request that already emitted ``params.max_tokens`` tokens: it is finished, and adding it
    would denoise a whole canvas to emit nothing (the caller finishes it instead: the harness does; under vLLM the
    model state fails it with the reason, see :meth:`blockdiff.integration.model_state.DiffusionModelState.add_request`).

    Raises:
        ValueError: ``num_emitted >= params.max_tokens`` (both named).
    """
    cap = getattr(params, "max_tokens", None)
    if cap is not None and num_emitted >= cap:
        raise ValueError(f"num_emitted ({num_emitted}) must be < params.max_tokens ({cap}): the request already "
                         "emitted all its tokens and is finished")


def torch_device(device) -> torch.device:
    """``torch.device(device)`` of a ``torch.device`` or a device string, syntax only (no availability check).

    Raises:
        TypeError: neither a ``torch.device`` nor a str. ValueError: a string torch cannot parse (names ``device``).
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:0', ...), got {device!r}") from e


def parse_device(device) -> torch.device:
    """``torch.device(device)`` for a ``torch.device`` or a device string, checked against this machine. A CPU device
    is returned as plain ``cpu`` (``cpu:0``, ``cpu:1`` included): torch puts every CPU tensor there, and the step's
    device checks compare the tensors' device with this one.

    Raises:
        TypeError: neither a ``torch.device`` nor a str. ValueError: a string torch cannot parse (``"bogus"``), a
            CUDA device this machine does not have, ``meta`` (shapes only: it cannot hold the state's values), or
            another device type torch cannot allocate on here (names ``device``).
    """
    dev = torch_device(device)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index is not None and dev.index >= n):
            raise ValueError(f"device {device!r} is not available here ({n} CUDA device{'s' if n != 1 else ''})")
    if dev.type == "cpu":
        return torch.device("cpu")  # (a "cpu:0" state refused every step: its tensors report "cpu")
    if dev.type == "meta":  # (accepted before: a state of meta tensors, no values, every step's read an error)
        raise ValueError(f"device must hold data (the sampler state's values), got {device!r}: meta tensors are "
                         "shapes only; use 'cpu' or 'cuda'")
    if dev.type != "cuda":  # mps, xpu, ...: is it here? (torch's RuntimeError from the first allocation otherwise)
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError, ImportError, NotImplementedError) as e:  # (hpu: ModuleNotFoundError)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ValueError(f"device {device!r} is not available here ({why})") from e
    return dev


class SamplerState:
    """Per-slot sampler state in preallocated device tensors (R = max_num_reqs, CL = canvas_length).

    Tensors (all on ``device``; every slot starts, and returns after :meth:`remove_request`, as FINISHED):

    - ``phase`` [R] int32: PREFILL=0, DENOISE=1, COMMIT=2, FINISHED=3, FAILED=4.
    - ``canvas`` [R, CL] int64: next denoise input. ``commit_canvas`` [R, CL] int64: the canvas a COMMIT pass
      writes. ``prev_argmax`` [R, CL] int64: last step's argmax canvas (-1 before the first step of a canvas).
    - ``stable_count`` [R] int32: consecutive steps whose argmax canvas equalled the previous one; k + 1
      identical canvases <=> ``stable_count >= k``. ``step`` [R] int32 (step s of the current canvas),
      ``canvas_index`` [R] int32, ``num_emitted`` [R] int64 (tokens emitted so far).
    - ``soft`` [R, CL, hidden_size] float32: self-conditioning input (soft embedding), zero at step 0.
    - ``request_id``, ``seed`` [R] int64 (RNG key, see :mod:`.rng`).
    - Per-request params: ``t_min``, ``t_max``, ``entropy_bound``, ``confidence_threshold`` [R] float32;
      ``max_denoising_steps``, ``stability_threshold`` [R] int32; ``eos_token_ids`` [R, max_eos] int64 padded -1;
      ``max_tokens`` [R] int64 (:data:`NO_MAX_TOKENS` when None).

    Args:
        max_num_reqs: R, the number of slots, an int in [1, 2**31). canvas_length: CL, an int in [1, 2**16).
        vocab_size: V, an int in [1, 2**31). hidden_size: an int in [1, 2**31). max_eos: eos ids per slot, an int
            in [0, 2**31) (:meth:`reserve_eos` grows it). device: a ``torch.device`` or a device string (``"cpu"``,
            ``"cuda:0"``).

    Raises:
        TypeError: a size that is not an int (bool, float, str: no coercion), or a device that is neither a
            ``torch.device`` nor a str.
        ValueError: a size out of range, or a device string torch cannot parse or this machine does not have.
    """

    def __init__(self, max_num_reqs: int, canvas_length: int, vocab_size: int, hidden_size: int,
                 device: torch.device | str = "cpu", max_eos: int = 8):
        lim = 1 << 31                                                # int32 grids and counters on the device
        sizes = (("max_num_reqs", max_num_reqs, 1, lim), ("canvas_length", canvas_length, 1, MAX_POSITIONS),
                 ("vocab_size", vocab_size, 1, MAX_VOCAB), ("hidden_size", hidden_size, 1, lim),
                 ("max_eos", max_eos, 0, lim))
        for name, v, lo, hi in sizes:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
            if not lo <= v < hi:
                raise ValueError(f"{name} must be in [{lo}, {'2**31' if hi == lim else hi}), got {v}")
        R, CL = max_num_reqs, canvas_length
        self.max_num_reqs, self.canvas_length = R, CL
        self.vocab_size, self.hidden_size, self.max_eos = vocab_size, hidden_size, max_eos
        self.device = parse_device(device)
        dev = self.device
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        self.phase = torch.full((R,), FINISHED, dtype=i32, device=dev)
        self.canvas = torch.zeros(R, CL, dtype=i64, device=dev)
        self.commit_canvas = torch.zeros(R, CL, dtype=i64, device=dev)
        self.prev_argmax = torch.full((R, CL), -1, dtype=i64, device=dev)
        self.stable_count = torch.zeros(R, dtype=i32, device=dev)
        self.step = torch.zeros(R, dtype=i32, device=dev)
        self.canvas_index = torch.zeros(R, dtype=i32, device=dev)
        self.num_emitted = torch.zeros(R, dtype=i64, device=dev)
        self.soft = torch.zeros(R, CL, self.hidden_size, dtype=f32, device=dev)
        self.request_id = torch.zeros(R, dtype=i64, device=dev)
        self.seed = torch.zeros(R, dtype=i64, device=dev)
        self.t_min = torch.zeros(R, dtype=f32, device=dev)
        self.t_max = torch.zeros(R, dtype=f32, device=dev)
        self.entropy_bound = torch.zeros(R, dtype=f32, device=dev)
        self.confidence_threshold = torch.zeros(R, dtype=f32, device=dev)
        self.max_denoising_steps = torch.ones(R, dtype=i32, device=dev)
        self.stability_threshold = torch.zeros(R, dtype=i32, device=dev)
        self.eos_token_ids = torch.full((R, max(self.max_eos, 1)), -1, dtype=i64, device=dev)
        self.max_tokens = torch.full((R,), NO_MAX_TOKENS, dtype=i64, device=dev)
        self.params: list[SamplingParams | None] = [None] * R

    # ------------------------------------------------------------------------------------------ slots
    def _check_slot(self, slot) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_num_reqs:
            raise ValueError(f"slot must be in [0, {self.max_num_reqs}), got {slot}")
        return slot

    def check_params(self, params: SamplingParams) -> None:
        """Raise unless :meth:`add_request` would accept ``params`` in this state (no state is touched).

        Callers that queue requests (a scheduler, the harness) run this when the request is submitted, so a
        request that cannot fit is refused up front instead of failing later, at admission into a slot.

        Raises:
            TypeError: params is not a :class:`SamplingParams`.
            ValueError: a field breaks its rule, canvas_length differs from the state's, more eos_token_ids
                than ``max_eos``, or an eos id >= vocab_size.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.canvas_length != self.canvas_length:
            raise ValueError(f"params.canvas_length ({params.canvas_length}) must equal the state's canvas_length "
                             f"({self.canvas_length})")
        if len(params.eos_token_ids) > self.max_eos:
            raise ValueError(f"params.eos_token_ids has {len(params.eos_token_ids)} ids, more than max_eos={self.max_eos} "
                             "(SamplerState.reserve_eos grows it)")
        for t in params.eos_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"eos_token_ids must be < vocab_size={self.vocab_size}, got {t}")

    def reserve_eos(self, n: int) -> None:
        """Make room for ``n`` eos ids per slot: grows ``eos_token_ids`` to ``[R, max(n, 2 * max_eos)]`` when
        ``n > max_eos`` (existing rows kept, new columns -1); no-op otherwise.

        Growing reallocates ``eos_token_ids`` (host-side, like :meth:`add_request`): a CUDA graph that captured a
        sampler step before the growth still reads the old tensor and must be recaptured. Size ``max_eos`` at
        construction when steps are captured.

        Raises:
            TypeError: ``n`` is not an int (a bool, a float, a str: no coercion).
            ValueError: ``n`` outside [0, 2**31) (the constructor's rule for ``max_eos``).
        """
        if isinstance(n, bool) or not isinstance(n, int):  # (was a ValueError, as a negative n is)
            raise TypeError(f"n must be an int in [0, 2**31), got {type(n).__name__} ({n!r})")
        if not 0 <= n < (1 << 31):  # (2**40 was the allocator's RuntimeError, 17 TB for one slot)
            raise ValueError(f"n must be an int in [0, 2**31) (max_eos' range), got {n}")
        if n <= self.max_eos:
            return
        width = min(max(n, 2 * self.max_eos), (1 << 31) - 1)  # doubling stays in max_eos' range
        grown = torch.full((self.max_num_reqs, width), -1, dtype=torch.int64, device=self.device)
        old = self.eos_token_ids
        grown[:, : old.shape[1]] = old
        self.eos_token_ids = grown
        self.max_eos = width

    def add_request(self, slot: int, request_id: int, params: SamplingParams, *, num_emitted: int = 0,
                    canvas_index: int = 0) -> None:
        """Start a request in ``slot`` in phase PREFILL (host-side writes; not meant for graph capture).

        Args:
            slot: slot index in [0, max_num_reqs).
            request_id: int in [-2**63, 2**63): the RNG identity of the request (low 48 bits used, see :mod:`.rng`).
            params: :class:`SamplingParams` (canvas_length must equal this state's).
            num_emitted: tokens the request already emitted (a request resumed after preemption; they count
                toward ``max_tokens``), >= 0 and below ``params.max_tokens`` (a request that emitted all its
                tokens is finished: adding it would denoise a whole canvas and emit nothing).
            canvas_index: index of the first canvas it will denoise (a resumed request continues its RNG stream
                after the canvases it committed), >= 0.

        Raises:
            TypeError / ValueError: bad slot, request_id, params type, canvas_length mismatch, more
                eos_token_ids than ``max_eos`` (see :meth:`reserve_eos`), a negative num_emitted / canvas_index,
                or ``num_emitted >= params.max_tokens`` (:func:`check_resume`).
        """
        slot = self._check_slot(slot)
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        if not -(1 << 63) <= request_id < (1 << 63):
            raise ValueError(f"request_id must fit in int64, got {request_id}")
        for name, v, hi in (("num_emitted", num_emitted, 1 << 62), ("canvas_index", canvas_index, 1 << 31)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if not 0 <= v < hi:
                raise ValueError(f"{name} must be in [0, {hi}), got {v}")
        self.check_params(params)
        check_resume(params, num_emitted)
        s = slot
        self.phase[s] = PREFILL
        self.canvas[s] = 0
        self.commit_canvas[s] = 0
        self.prev_argmax[s] = -1
        self.stable_count[s] = 0
        self.step[s] = 0
        self.canvas_index[s] = canvas_index
        self.num_emitted[s] = num_emitted
        self.soft[s] = 0
        self.request_id[s] = request_id
        self.seed[s] = params.seed
        self.t_min[s] = params.t_min
        self.t_max[s] = params.t_max
        self.entropy_bound[s] = params.entropy_bound
        self.confidence_threshold[s] = params.confidence_threshold
        self.max_denoising_steps[s] = params.max_denoising_steps
        self.stability_threshold[s] = params.stability_threshold
        self.eos_token_ids[s] = -1
        if params.eos_token_ids:
            self.eos_token_ids[s, : len(params.eos_token_ids)] = torch.tensor(params.eos_token_ids, dtype=torch.int64)
        self.max_tokens[s] = NO_MAX_TOKENS if params.max_tokens is None else params.max_tokens
        self.params[s] = params

    def remove_request(self, slot: int) -> None:
        """Free ``slot``: phase FINISHED, self-conditioning zeroed. Raises ValueError/TypeError for a bad slot."""
        slot = self._check_slot(slot)
        self.phase[slot] = FINISHED
        self.soft[slot] = 0
        self.prev_argmax[slot] = -1
        self.params[slot] = None

    def __repr__(self) -> str:
        return (f"SamplerState(max_num_reqs={self.max_num_reqs}, canvas_length={self.canvas_length}, "
                f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, device={self.device})")


@dataclass
class StepOutput:
    """Result of one ``sampler_step`` over N rows (all tensors [N]-leading, on the state's device).

    vLLM accounting: ``num_sampled`` int32 (COMMIT rows: CL, else 0), ``num_rejected`` int32 (DENOISE rows:
    CL, else 0). Emission: ``emitted`` [N, CL] int64 padded -1 (COMMIT rows: the commit canvas trimmed after the
    first EOS, kept, and at max_tokens), ``num_emitted_now`` int32, ``finished`` bool, ``failed`` bool (a
    DENOISE row with a position whose softmax is undefined: a NaN or +inf logit, or every logit -inf; -inf logits
    beside finite ones are p = 0).

    Diagnostics of DENOISE rows (other rows: False / 0 / -1): ``accepted`` [N, CL] bool, ``entropy`` [N, CL]
    float32 nats (NaN at positions whose softmax is undefined), ``argmax`` / ``sampled`` / ``next_canvas``
    [N, CL] int64 (next_canvas: the renoised canvas, the next denoise input unless the row converged or
    failed), ``converged`` bool, ``mean_entropy`` float32 nats, ``temperature`` float32.
    """

    num_sampled: torch.Tensor
    num_rejected: torch.Tensor
    emitted: torch.Tensor
    num_emitted_now: torch.Tensor
    finished: torch.Tensor
    failed: torch.Tensor
    accepted: torch.Tensor
    entropy: torch.Tensor
    argmax: torch.Tensor
    sampled: torch.Tensor
    next_canvas: torch.Tensor
    converged: torch.Tensor
    mean_entropy: torch.Tensor
    temperature: torch.Tensor
