"""HarnessRunner: replays vLLM model runner v2's call order for a block-diffusion model, without vLLM.

Per step (docs/ARCHITECTURE.md "Integration and vLLM accounting"):

1. arrivals: requests whose ``arrival_step`` has come get a free slot -> ``model_state.add_request``;
2. schedule, under a token budget (``max_num_batched_tokens``): every denoise / commit row (a whole canvas of
   ``canvas_length`` tokens each; rows that waited longest first), then prompt chunks (chunked prefill: a long
   prompt is split over several steps); pages of the paged KV cache are allocated as rows grow;
3. ``prepare_inputs_embeds`` -> ``prepare_inputs`` -> ``prepare_attn`` -> model forward -> sampler step
   (the ``DiffusionSampler`` from ``custom_sampler``);
4. accounting: ``num_computed_tokens += query_len - num_rejected`` (a prompt chunk or a commit advances the KV
   position, a denoise row does not), tokens emitted by commit rows appended to the request's output;
5. ``postprocess_state``; finished / failed requests are removed and their slots and pages freed for reuse.

KV pages and preemption (vLLM's scheduler: ``vllm/v1/core/sched/scheduler.py``, FCFS policy). A request's priority
is its arrival (``arrival_step``, then submission order). A waiting request is admitted only when the free pages,
less those the running requests need for their next row, hold its prefill and its first canvas (vLLM admits from
the pages left after the running requests). When a running request's row cannot get its pages, lower-priority
running requests not yet scheduled in the step are preempted, lowest priority first, until it can (vLLM preempts
the lowest-priority running request); a request never preempts a higher-priority one. A preempted request (also
:meth:`HarnessRunner.preempt`, explicitly) is removed (slot and KV pages freed) and queued by its priority; when
readmitted, ``add_request`` gets ``prefill_token_ids`` = prompt + the tokens it already emitted, which are
prefilled again (causally, as their commit wrote them) before the next canvas. ``add_request`` refuses a request
whose largest KV footprint (prompt + every canvas it may commit) exceeds the pool, so every request admitted fits
the pool alone, and the highest-priority running request always progresses: every request finishes.

Fused commit (``fuse_commit=True``, off by default): a converged canvas whose commit does not finish its request
(no stop id in it, ``max_tokens`` not reached) and whose next canvas fits ``max_model_len`` is scheduled with
``2 * canvas_length`` query tokens, its commit (causal) and the next canvas's first denoising step (bidirectional)
in one forward pass (one forward fewer per non-final canvas); only with the token budget and free KV pages left
after every other row of the step (it never preempts nor displaces a row), else it is a plain commit. The step
records it as two rows (``RowRecord.fused``): a commit and a denoise row.

It is a test and demo harness, not a serving engine: no prefix caching, one process. A request is never dropped
silently: it finishes (``eos`` / ``length`` / ``error``), is cancelled by :meth:`HarnessRunner.abort`
(``aborted``), or :meth:`HarnessRunner.run` raises naming it.
"""
from __future__ import annotations

import math
import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from blockdiff.attention import get_backend as get_attention_backend
from blockdiff.attention import resolve_backend as resolve_attention_backend
from blockdiff.model.loading import MODEL_DTYPES, check_device
from blockdiff.sampler import COMMIT, DENOISE, PHASE_NAMES, PREFILL, SamplingParams
from blockdiff.sampler import get_backend as get_sampler_backend
from blockdiff.sampler import resolve_backend as resolve_sampler_backend

from .batch import HarnessInputBatch, NewRequest
from .checks import AttentionChecker
from .kv_alloc import BlockAllocator, OutOfBlocks
from .model_state import DiffusionModelState, to_diffusion_params
from .vllm_params import rng_request_id


def checkpoint_sampling_params(model: torch.nn.Module, **overrides) -> SamplingParams:
    """The default request of ``model``'s checkpoint, as transformers' ``generate`` takes it from the model's
    ``generation_config``: ``SamplingParams(**model.generation_config)`` (a :class:`blockdiff.model.DiffusionGemma`
    reads it from the checkpoint's ``generation_config.json`` and ``config.json``'s ``canvas_length``, see
    :func:`blockdiff.model.load_generation_config`), with ``overrides`` on top. A model without
    ``generation_config`` gives ``SamplingParams(canvas_length=model.config.canvas_length)`` (or
    ``SamplingParams()`` without a canvas length either).

    Raises:
        TypeError / ValueError: an override (or a generation_config value) breaks a SamplingParams rule.
    """
    gen = getattr(model, "generation_config", None)
    if isinstance(gen, Mapping):
        kw = dict(gen)
    else:
        cl = getattr(getattr(model, "config", None), "canvas_length", None)
        kw = {} if cl is None else {"canvas_length": cl}
    kw.update(overrides)
    return SamplingParams(**kw)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _token_ids(prompt_token_ids, req_id: str) -> list[int]:
    """``prompt_token_ids`` as a list of Python ints: a list / tuple of ints, or a 1-D integer tensor / ndarray.
    Nothing is coerced (a str, floats, bools, None or a sparse tensor are a TypeError naming prompt_token_ids, a
    tensor on the meta device a ValueError)."""
    x = prompt_token_ids
    where = f"request {req_id!r}: prompt_token_ids"
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:  # (torch's "Cannot access data pointer" before)
            raise TypeError(f"{where} must be a dense 1-D integer tensor, got layout {x.layout}")
        if x.dim() != 1 or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise TypeError(f"{where} must be a 1-D integer tensor, got {x.dim()}-D {x.dtype}")
        if x.device.type == "meta":  # (torch's NotImplementedError "Cannot copy out of meta tensor" before)
            raise ValueError(f"{where} is on the meta device (no data): pass token ids with values")
        return [int(t) for t in x.tolist()]
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or x.dtype.kind not in "iu":
            raise TypeError(f"{where} must be a 1-D integer array, got {x.ndim}-D {x.dtype}")
        return [int(t) for t in x.tolist()]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{where} must be a list of token ids (ints) or a 1-D integer tensor, got "
                        f"{type(x).__name__} ({x!r:.40})")
    for t in x:
        if not _is_int(t):
            raise TypeError(f"{where} must hold ints, got {type(t).__name__} ({t!r})")
    return [int(t) for t in x]


def _defined(x) -> float | None:
    """``float(x)``, or None where it is NaN (a row's mean entropy when its logits had no softmax: the row failed)."""
    x = float(x)
    return None if math.isnan(x) else x


def _check_req_id(req_id) -> None:
    """Raise TypeError naming ``req_id`` unless it is a str (a list was "unhashable type", an int a ValueError)."""
    if not isinstance(req_id, str):
        raise TypeError(f"req_id must be a str, got {type(req_id).__name__} ({req_id!r})")


def _resolve_device(device, p0: torch.Tensor | None) -> torch.device:
    """``device`` as a torch.device (default: where the model's parameters are), parsed by
    :func:`blockdiff.model.loading.check_device`. Raises TypeError / ValueError naming ``device`` for a value
    torch cannot parse, a CUDA device that is not there, or a device other than the model's."""
    model_dev = p0.device if p0 is not None else torch.device("cpu")
    if device is None:
        return model_dev
    dev = check_device(device, "device")

    def index(d: torch.device) -> int:
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0

    if p0 is not None and (dev.type, index(dev)) != (model_dev.type, index(model_dev)):
        raise ValueError(f"device {str(dev)!r} differs from the model's ({model_dev}): move the model there first")
    return dev


def _resolve_backend(name: str, backend, resolve: Callable, load: Callable, device: torch.device) -> str:
    """The concrete backend name for ``backend`` (``"auto"`` resolved for ``device``), imported once now so a bad
    name fails at construction, not after the first forward pass. Raises TypeError / ValueError naming ``name``;
    ImportError when the backend cannot be imported here."""
    if not isinstance(backend, str):
        raise TypeError(f"{name} must be a str, got {type(backend).__name__} ({backend!r})")
    try:
        backend = resolve(backend, device)
        load(backend)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return backend


@dataclass
class RequestResult:
    """Outcome of one request.

    Attributes:
        req_id, prompt_len (tokens), output_token_ids (emitted tokens, trimmed after the first EOS and at
        max_tokens), finish_reason ("eos", "length" = max_tokens or max_model_len, "error" = failed on NaN / +inf
        logits or a position whose every logit is -inf, as vLLM's finish reason, "aborted" =
        :meth:`HarnessRunner.abort`), num_canvases committed, num_denoise_steps (forward passes in denoise mode),
        arrival_step / admit_step (the last admission; -1 if never admitted) / finish_step, num_preemptions.
    """

    req_id: str
    prompt_len: int
    output_token_ids: list[int]
    finish_reason: str
    num_canvases: int
    num_denoise_steps: int
    arrival_step: int
    admit_step: int
    finish_step: int
    num_preemptions: int = 0


@dataclass
class RowRecord:
    """One row of a step: request, phase at entry (``"prefill"``, ``"denoise"`` or ``"commit"``: the lower-case
    :data:`blockdiff.sampler.PHASE_NAMES`), query tokens, keys (incl. the query), causal flag, and the sampler's
    accounting for it. A fused commit row (``HarnessRunner(fuse_commit=True)``) is recorded as two records with
    ``fused`` True, in the batch row's order: its commit (``"commit"``, CL causal query tokens, ``num_sampled`` CL)
    and its next canvas's first denoising step (``"denoise"``, CL bidirectional query tokens over the context and
    the committed canvas, ``num_rejected`` CL). ``mean_entropy``: a denoise row's mean entropy (nats), None where it
    is undefined (other phases; a row that failed: NaN / +inf logits, or a position whose every logit is -inf)."""

    req_id: str
    slot: int
    phase: str
    q_len: int
    seq_len: int
    causal: bool
    num_sampled: int = 0
    num_rejected: int = 0
    num_emitted: int = 0
    accepted: int = 0  # denoise rows: canvas positions accepted in this step (not newly fixed ones)
    mean_entropy: float | None = None
    converged: bool = False
    fused: bool = False  # one half of a fused commit row (fuse_commit): its commit, or its next canvas's step 0


@dataclass
class StepRecord:
    """What one harness step did (one forward pass, or none when nothing was runnable yet); ``arrived``: the
    requests admitted (given a slot) since the previous step, by this step or by a
    :meth:`HarnessRunner.schedule_batch` before it; ``preempted``: the requests preempted since the previous step
    (by the scheduler for KV pages while this step, or a :meth:`HarnessRunner.schedule_batch` before it, was
    scheduled; or by :meth:`HarnessRunner.preempt`)."""

    step: int
    rows: list[RowRecord] = field(default_factory=list)
    arrived: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    forward: bool = False
    wall_ms: float = 0.0

    def count(self, phase: str) -> int:
        return sum(r.phase == phase for r in self.rows)

    @property
    def positions_accepted(self) -> int:
        """Canvas positions the entropy bound accepted in this step, summed over the denoise rows. Each denoise
        step samples every position again (accepted ones keep their sample, the rest are renoised), so this
        counts acceptances per step, not newly fixed positions."""
        return sum(r.accepted for r in self.rows if r.phase == "denoise")

    @property
    def mean_entropy(self) -> float | None:
        """Mean of the denoise rows' mean entropies (nats), over the rows that have one (a failed row's is None,
        :class:`RowRecord`); None when no row has one."""
        v = [r.mean_entropy for r in self.rows if r.phase == "denoise" and r.mean_entropy is not None]
        return float(np.mean(v)) if v else None

    @property
    def canvases_committed(self) -> int:
        return self.count("commit")

    @property
    def tokens_emitted(self) -> int:
        return sum(r.num_emitted for r in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.q_len for r in self.rows)


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int
    priority: tuple[int, int]  # (arrival_step, submission index): lower is served first (FCFS)
    slot: int | None = None
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    num_canvases: int = 0
    num_denoise_steps: int = 0
    admit_step: int = -1
    last_scheduled: int = -1
    prefill: list[int] = field(default_factory=list)  # tokens to prefill: the prompt, + output after preemption
    num_preemptions: int = 0
    rng_id: str | None = None  # the RNG identity (a vLLM-style request's extra_args rng_request_id; else req_id)

    def __post_init__(self) -> None:
        if not self.prefill:
            self.prefill = list(self.prompt)


class HarnessRunner:
    """Drives a :class:`blockdiff.model.DiffusionGemma` through :class:`DiffusionModelState` and
    :class:`~blockdiff.integration.sampler.DiffusionSampler` in model runner v2's call order.

    Sampling parameters, lowest precedence first (transformers' ``generate``: the model's ``generation_config``,
    replaced by a ``generation_config`` argument, fields overridden by keyword arguments):

    1. the checkpoint's defaults, :func:`checkpoint_sampling_params` (``generation_config.json`` and
       ``config.json``'s ``canvas_length``), when ``default_params`` is None;
    2. ``default_params``, which replaces them whole (its ``canvas_length`` is then the served one, even where it
       differs from the checkpoint's);
    3. per request, a blockdiff ``SamplingParams`` replaces the defaults whole; a vLLM-style ``SamplingParams``
       overrides only the fields it sets (:func:`~blockdiff.integration.model_state.to_diffusion_params`).

    Args:
        model: the model (forward ``model(input_ids, positions, meta, kv_caches, self_cond, *, attn_backend)``,
            ``allocate_kv_caches``, ``embedding_weight``, ``config.vocab_size`` / ``hidden_size``, optional
            ``generation_config``).
        default_params: :class:`blockdiff.sampler.SamplingParams` for requests added without params, or None (the
            checkpoint's, see above); its ``canvas_length`` is the served canvas length.
        max_num_reqs: request slots (>= 1).
        max_num_batched_tokens: token budget of one step (>= canvas_length); the per-token buffers hold
            ``min(max_num_batched_tokens, max_num_reqs * max_model_len)`` tokens, the most a step can schedule.
        page_size: KV page size in tokens. num_blocks: KV pages (default: enough for every slot at
            ``max_model_len``). max_model_len: longest sequence in tokens (prompt + emitted + one canvas).
            Each capacity is an integer >= 1 (a Python or numpy int; bool refused).
        device: torch device (default: the model's; must be where the model's parameters are).
        kv_dtype: cache dtype (default, and the only one accepted: the model's parameter dtype, which the attention
            backends require of K/V).
        attn_backend: ``"reference"``, ``"triton"``, ``"cute"`` or ``"auto"`` (resolved here for ``device``;
            passed to the model; no fallback).
        sampler_backend: ``"reference"``, ``"triton"`` or ``"auto"`` (resolved here).
        check: compare every attention call and every sampler step with the references; a mismatch raises.
        fuse_commit: a bool (default False): commit a converged canvas and take the next canvas's first denoising
            step in one forward pass (see the module docstring and
            :attr:`~blockdiff.integration.model_state.DiffusionModelState.fuse_commit`); the outputs are those of
            the unfused run, with one forward pass fewer per non-final canvas.

    Raises:
        TypeError: ``default_params`` not a SamplingParams; a model whose parameters are not bf16 / fp16 / fp32 /
            fp64 (:data:`blockdiff.model.loading.MODEL_DTYPES`); ``kv_dtype`` not a floating torch.dtype; ``device``,
            a backend, ``check`` or ``fuse_commit`` of the wrong type (``fuse_commit`` must be a bool).
        ValueError: bad capacities (``max_model_len`` above the model config's ``max_position_embeddings``
            included); a device torch cannot parse or other than the model's; ``kv_dtype`` other than the model's
            dtype; an unknown backend name.
        ImportError: a backend that cannot be imported here (no fallback).
    """

    def __init__(self, model: torch.nn.Module, *, default_params: Any = None, max_num_reqs: int = 4,
                 max_num_batched_tokens: int = 256, page_size: int = 16, num_blocks: int | None = None,
                 max_model_len: int = 512, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | None = None, attn_backend: str = "reference",
                 sampler_backend: str = "reference", check: bool = False, fuse_commit: bool = False) -> None:
        if default_params is None:
            default_params = checkpoint_sampling_params(model)
        elif not isinstance(default_params, SamplingParams):
            raise TypeError(f"default_params must be a blockdiff.sampler.SamplingParams or None (the checkpoint's "
                            f"defaults), got {type(default_params).__name__}")
        self.default_params = default_params
        cl = self.default_params.canvas_length
        caps = {"max_num_reqs": max_num_reqs, "max_num_batched_tokens": max_num_batched_tokens,
                "page_size": page_size, "max_model_len": max_model_len}
        if num_blocks is not None:
            caps["num_blocks"] = num_blocks
        for name, v in caps.items():
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
            caps[name] = int(v)  # (a numpy int was refused further in, under another argument's name)
        max_num_reqs, max_num_batched_tokens, page_size, max_model_len = (
            caps[n] for n in ("max_num_reqs", "max_num_batched_tokens", "page_size", "max_model_len"))
        num_blocks = caps.get("num_blocks")
        if max_num_batched_tokens < cl:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= canvas_length ({cl})")
        if max_model_len < cl + 1:
            raise ValueError(f"max_model_len ({max_model_len}) must leave room for a prompt and a canvas ({cl})")
        max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if _is_int(max_pos) and max_model_len > max_pos:  # vLLM refuses it too (its derived max_model_len)
            raise ValueError(f"max_model_len ({max_model_len}) must be <= the model's max_position_embeddings "
                             f"({max_pos}): positions past it were never trained")
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        if not isinstance(fuse_commit, bool):
            raise TypeError(f"fuse_commit must be a bool, got {type(fuse_commit).__name__} ({fuse_commit!r})")
        p0 = next(iter(model.parameters()), None)
        self.device = _resolve_device(device, p0)
        model_dtype = p0.dtype if p0 is not None else torch.float32
        if model_dtype not in MODEL_DTYPES:  # (a model moved to float8 failed inside its first forward pass)
            raise TypeError(f"model: its parameters are {model_dtype}; the harness runs a model in one of "
                            f"{', '.join(map(str, MODEL_DTYPES))} (the dtypes the model and the attention backends "
                            "compute in)")
        if kv_dtype is None:
            kv_dtype = model_dtype
        elif not (isinstance(kv_dtype, torch.dtype) and kv_dtype.is_floating_point):
            raise TypeError(f"kv_dtype must be a floating torch.dtype or None, got {kv_dtype!r}")
        elif kv_dtype != model_dtype:
            raise ValueError(f"kv_dtype {kv_dtype} must equal the model's dtype {model_dtype} (the attention "
                             "backends take K/V in q's dtype)")
        self.attn_backend = _resolve_backend("attn_backend", attn_backend, resolve_attention_backend,
                                             get_attention_backend, self.device)
        self.sampler_backend = _resolve_backend("sampler_backend", sampler_backend, resolve_sampler_backend,
                                                get_sampler_backend, self.device)
        self.model = model
        self.canvas_length = cl
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // page_size)
        if num_blocks is None:
            num_blocks = max_num_reqs * self.max_blocks_per_req
        self.allocator = BlockAllocator(num_blocks, page_size)
        self.check = check
        self.kv_caches = model.allocate_kv_caches(num_blocks, page_size, self.device, kv_dtype)
        # the model state's per-token buffers hold one step's tokens: at most max_num_reqs rows of at most
        # max_model_len tokens (a prompt chunk, a canvas, a fused commit's 2 * CL); a budget above that is never
        # used (was: allocated whole, max_num_batched_tokens=2**31 had the process killed for memory)
        step_tokens = min(max_num_batched_tokens, max_num_reqs * max_model_len)
        self.model_state = DiffusionModelState.for_harness(
            model, max_num_reqs=max_num_reqs, max_num_tokens=step_tokens, canvas_length=cl,
            device=self.device, default_params=self.default_params, fuse_commit=fuse_commit)
        self.fuse_commit = fuse_commit
        self.sampler, rejection = self.model_state.custom_sampler(None, backend=self.sampler_backend)
        assert rejection is None
        self.sampler.check = check
        self.attention_checker = None
        if check:
            self.attention_checker = AttentionChecker()
        self.step_index = 0
        self.num_forward = 0
        self.wall_s = 0.0
        self.history: list[StepRecord] = []
        self.results: dict[str, RequestResult] = {}
        self._waiting: list[_Req] = []
        self._running: dict[str, _Req] = {}
        self._free_slots = list(range(max_num_reqs))
        self._ids: set[str] = set()
        self._num_submitted = 0
        self._preempted: list[str] = []  # preemptions for KV pages not yet reported in a StepRecord
        self._arrived: list[str] = []  # admissions not yet reported (schedule_batch admits ahead of its step)
        self.last_batch: HarnessInputBatch | None = None
        self.last_output = None

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids, params: Any = None, *, arrival_step: int | None = None
                    ) -> None:
        """Queue a request; it is admitted (gets a slot) at step ``arrival_step`` (default: the next step) or
        later, when a slot and its KV pages are free.

        Args:
            req_id: a new, non-empty str.
            prompt_token_ids: a list / tuple of ints or a 1-D integer tensor / ndarray, each id in [0, vocab).
            params: None (``default_params``), a blockdiff ``SamplingParams`` (used as is) or a vLLM-style
                ``SamplingParams`` (converted over ``default_params``, see
                :func:`~blockdiff.integration.model_state.to_diffusion_params`; its ``extra_args``
                ``rng_request_id`` keys the request's noise in place of ``req_id``, as under vLLM).
            arrival_step: an int >= 0, or None.

        Raises:
            TypeError: a ``req_id`` that is not a str; a prompt that is not a sequence of ints (a str, floats,
                bools, None, a sparse tensor), params of another type (a dict), an ``arrival_step`` that is not an
                int, an ``extra_args`` ``rng_request_id`` that is not a str.
            ValueError: duplicate or empty id, empty prompt, a prompt tensor on the meta device, token id outside
                [0, vocab), prompt too long for ``max_model_len``, a canvas length other than the served one, a
                SamplingParams rule broken, an empty ``extra_args`` ``rng_request_id``, a negative ``arrival_step``,
                or a request whose KV footprint exceeds the pool (``num_blocks``): it could never finish.
        """
        _check_req_id(req_id)
        if not req_id:
            raise ValueError(f"req_id must be a non-empty str, got {req_id!r}")
        if req_id in self._ids:
            raise ValueError(f"duplicate req_id {req_id!r}")
        prompt = _token_ids(prompt_token_ids, req_id)
        if not prompt:
            raise ValueError(f"request {req_id!r}: prompt_token_ids must not be empty")
        V = self.model_state.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            i, t = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < V)
            raise ValueError(f"request {req_id!r}: prompt_token_ids: token ids must be in [0, vocab_size={V}), got {t} at "
                             f"position {i}")
        if len(prompt) + self.canvas_length > self.max_model_len:
            raise ValueError(f"request {req_id!r}: prompt ({len(prompt)}) + canvas ({self.canvas_length}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if arrival_step is not None and (not _is_int(arrival_step) or arrival_step < 0):
            kind = TypeError if not _is_int(arrival_step) else ValueError
            raise kind(f"request {req_id!r}: arrival_step must be an int >= 0 or None, got {arrival_step!r}")
        try:  # a vLLM-style request's extra_args rng_request_id: its noise identity (was dropped with the
            rng_id = rng_request_id(params, req_id)  # vLLM object: the noise was keyed by req_id regardless)
            params = to_diffusion_params(params, self.default_params)
        except (TypeError, ValueError) as e:
            raise type(e)(f"request {req_id!r}: params: {e}") from None
        if params.canvas_length != self.canvas_length:
            raise ValueError(f"request {req_id!r}: canvas_length {params.canvas_length} != served "
                             f"{self.canvas_length}")
        try:  # everything the slot's add_request checks (eos ids vs vocab, ...): refuse it now, not at admission,
            self.model_state.check_params(params)  # where the request would be lost mid-step
        except ValueError as e:
            raise ValueError(f"request {req_id!r}: {e}") from None
        tokens, canvases = self._kv_footprint(len(prompt), params)
        pages = -(-tokens // self.page_size)
        if pages > self.allocator.num_blocks:
            raise ValueError(f"request {req_id!r} needs up to {pages} KV pages of {self.page_size} tokens (prompt "
                             f"{len(prompt)} + {canvases} canvas(es) of {self.canvas_length}) but the pool has "
                             f"num_blocks={self.allocator.num_blocks}: it could never finish; enlarge num_blocks or "
                             "lower max_tokens / max_model_len")
        arrival = self.step_index if arrival_step is None else int(arrival_step)
        self._ids.add(req_id)
        self._queue(_Req(req_id, prompt, params, arrival, (arrival, self._num_submitted), rng_id=rng_id))
        self._num_submitted += 1

    def _kv_footprint(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """``(tokens, canvases)``: the most KV a request can hold (prompt + every canvas it may commit: up to
        ``ceil(max_tokens / CL)``, and no canvas past ``max_model_len``, where the harness finishes it)."""
        CL = self.canvas_length
        canvases = (self.max_model_len - prompt_len) // CL
        if params.max_tokens is not None:
            canvases = min(canvases, -(-params.max_tokens // CL))
        return prompt_len + canvases * CL, canvases

    def _queue(self, r: _Req) -> None:
        self._waiting.append(r)
        self._waiting.sort(key=lambda w: w.priority)

    def slot_of(self, req_id: str) -> int | None:
        r = self._running.get(req_id)
        return None if r is None else r.slot

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # ------------------------------------------------------------------ one step
    def _pages_for(self, r: _Req, num_tokens: int) -> int:
        return self.allocator.blocks_needed(r.req_id, num_tokens)

    def _next_row_tokens(self, r: _Req) -> int:
        """KV tokens ``r`` needs for its next row: the rest of its prefill and its first canvas while prefilling,
        else the current canvas."""
        return max(len(r.prefill), r.num_computed) + self.canvas_length

    def _admit(self) -> None:
        """Admit arrived requests in priority order while a slot is free and the KV pool, less what the running
        requests need for their next row, holds the request's prefill and first canvas (FCFS: a request that does
        not fit yet blocks the ones behind it)."""
        while self._waiting and self._waiting[0].arrival_step <= self.step_index and self._free_slots:
            r = self._waiting[0]
            reserved = sum(self._pages_for(x, self._next_row_tokens(x)) for x in self._running.values())
            if self._pages_for(r, self._next_row_tokens(r)) > self.allocator.num_free - reserved:
                break
            self._free_slots.sort()
            slot = self._free_slots[0]
            # claim the slot only once the model state accepted the request: if add_request raises, the request
            # stays queued and the slot free (nothing lost or leaked) and the error reaches the caller
            self.model_state.add_request(slot, NewRequest(r.req_id, r.prompt, r.params, prefill_token_ids=r.prefill,
                                                           rng_request_id=r.rng_id))
            self._waiting.pop(0)
            self._free_slots.pop(0)
            r.slot = slot
            r.admit_step = self.step_index
            self._running[r.req_id] = r
            self._arrived.append(r.req_id)  # reported in the next StepRecord's ``arrived``

    def _grow(self, r: _Req, num_tokens: int, scheduled: set[str]) -> bool:
        """Give ``r`` pages for ``num_tokens`` tokens, preempting lower-priority running requests that hold pages
        and are not yet scheduled in this step (lowest priority first) while the pool is short. Returns whether
        ``r`` got them (nothing is allocated when not)."""
        while True:
            try:
                self.allocator.ensure(r.req_id, num_tokens)
                return True
            except OutOfBlocks:
                victims = [x for x in self._running.values() if x.priority > r.priority
                           and x.req_id not in scheduled and self.allocator.blocks(x.req_id)]
                if not victims:
                    return False
                self._preempt(max(victims, key=lambda x: x.priority))

    def _schedule(self, phases: list[int]) -> list[tuple[_Req, int, int]]:
        """Rows ``(req, phase, q_len)`` within the token budget; allocates KV pages, preempting lower-priority
        requests when the pool is short (see the module docstring)."""
        budget = self.max_num_batched_tokens
        rows: list[tuple[_Req, int, int]] = []
        scheduled: set[str] = set()
        CL = self.canvas_length
        canvas = [r for r in self._running.values() if phases[r.slot] in (DENOISE, COMMIT)]
        canvas.sort(key=lambda r: (r.last_scheduled, r.admit_step, r.slot))
        for r in canvas:
            if budget < CL:
                break
            if r.req_id not in self._running or not self._grow(r, r.num_computed + CL, scheduled):
                continue
            rows.append((r, phases[r.slot], CL))
            scheduled.add(r.req_id)
            budget -= CL
        prefills = [r for r in self._running.values() if phases[r.slot] == PREFILL]
        prefills.sort(key=lambda r: (r.admit_step, r.slot))
        for r in prefills:
            chunk = min(len(r.prefill) - r.num_computed, budget)
            if r.req_id not in self._running or chunk <= 0:
                continue
            if not self._grow(r, r.num_computed + chunk, scheduled):  # a shorter chunk, as the free pages allow
                pages_free = self.allocator.num_free + len(self.allocator.blocks(r.req_id))
                chunk = min(chunk, pages_free * self.page_size - r.num_computed)
                if chunk <= 0:
                    continue
                self.allocator.ensure(r.req_id, r.num_computed + chunk)
            rows.append((r, PREFILL, chunk))
            scheduled.add(r.req_id)
            budget -= chunk
        if self.fuse_commit:
            budget = self._fuse_commits(rows, budget)
        return rows

    def _fuse_commits(self, rows: list[tuple[_Req, int, int]], budget: int) -> int:
        """Turn commit rows into fused commit rows (``2 * canvas_length`` tokens, see the module docstring) in
        place, in row order, while the budget left and the free KV pages (no preemption) allow; only commits that
        do not finish their request and whose next canvas fits ``max_model_len``. Returns the budget left."""
        CL = self.canvas_length
        for i, (r, ph, q) in enumerate(rows):
            if budget < CL:
                break
            if ph != COMMIT or q != CL or r.num_computed + 2 * CL > self.max_model_len:
                continue
            if self.model_state.commit_finishes(r.slot):  # the request's last canvas: a plain commit
                continue
            try:
                self.allocator.ensure(r.req_id, r.num_computed + 2 * CL)
            except OutOfBlocks:
                continue
            rows[i] = (r, COMMIT, 2 * CL)
            budget -= CL
        return budget

    def _schedule_or_preempt(self) -> list[tuple[_Req, int, int]]:
        """:meth:`_schedule`; while it finds no row, preempt the lowest-priority running request and schedule
        again (the highest-priority one fits the pool alone, see :meth:`add_request`)."""
        while True:
            rows = self._schedule(self.model_state.state.phase.tolist())
            if rows or len(self._running) <= 1:
                return rows
            self._preempt(max(self._running.values(), key=lambda x: x.priority))

    def _check_slots(self) -> None:
        """Every running request must still hold its slot in the model state (else: a clear error, not a
        misleading one about the page pool later)."""
        held = self.model_state.req_id_to_index
        lost = [r.req_id for r in self._running.values() if held.get(r.req_id) != r.slot]
        if lost:
            raise RuntimeError(
                f"step {self.step_index}: running request(s) {lost} no longer hold their slot in the model state "
                "(removed with model_state.remove_request behind the harness's back?); cancel a request with "
                "HarnessRunner.abort(req_id)")

    def _build_batch(self, rows) -> HarnessInputBatch:
        dev = self.device
        N = len(rows)
        q_lens = np.array([q for _, _, q in rows], dtype=np.int32)
        ctx = np.array([r.num_computed for r, _, _ in rows], dtype=np.int32)
        qsl = np.zeros(N + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        T = int(qsl[-1])
        seq_lens = ctx + q_lens
        slots = np.array([r.slot for r, _, _ in rows], dtype=np.int64)
        input_ids = np.zeros(T, dtype=np.int64)
        positions = np.zeros(T, dtype=np.int64)
        slot_mapping = np.zeros(T, dtype=np.int64)
        block_table = np.zeros((N, self.max_blocks_per_req), dtype=np.int32)
        is_prefill = np.zeros(N, dtype=bool)
        for i, (r, ph, q) in enumerate(rows):
            s, e = qsl[i], qsl[i + 1]
            pos = np.arange(r.num_computed, r.num_computed + q, dtype=np.int64)
            positions[s:e] = pos
            pages = np.array(self.allocator.blocks(r.req_id), dtype=np.int64)
            block_table[i, : len(pages)] = pages
            slot_mapping[s:e] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
            if ph == PREFILL:
                input_ids[s:e] = r.prefill[r.num_computed: r.num_computed + q]
                is_prefill[i] = True
        t = lambda a, dt: torch.as_tensor(a, dtype=dt).to(dev)  # noqa: E731
        prefill_len = np.array([len(r.prefill) for r, _, _ in rows], dtype=np.int32)
        return HarnessInputBatch(
            req_ids=[r.req_id for r, _, _ in rows], num_reqs=N, num_tokens=T,
            idx_mapping=t(slots, torch.int64), idx_mapping_np=slots, num_scheduled_tokens=q_lens,
            query_start_loc=t(qsl, torch.int32), query_start_loc_np=qsl,
            seq_lens=t(seq_lens, torch.int32), seq_lens_np=seq_lens.astype(np.int32),
            num_computed_tokens_np=ctx, prefill_len_np=prefill_len,
            num_computed_prefill_tokens_np=np.minimum(ctx, prefill_len), is_prefilling_np=is_prefill,
            input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
            slot_mapping=t(slot_mapping, torch.int64), block_table=t(block_table, torch.int32),
            logits_indices=torch.arange(T, device=dev), cu_num_logits_np=qsl.copy(),
            num_draft_tokens=int(q_lens[~is_prefill].sum()), max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()))

    def schedule_batch(self) -> HarnessInputBatch | None:
        """Admit arrivals and build the batch the next :meth:`step` would run, without running it (for tests
        and CUDA-graph capture; :meth:`step` schedules again, to the same rows while nothing changed). Scheduling
        may preempt requests for KV pages (reported in the next step's ``preempted``). Returns None when nothing
        is runnable."""
        self._admit()
        if not self._running:
            return None
        self._check_slots()
        rows = self._schedule_or_preempt()
        return self._build_batch(rows) if rows else None

    def _forward(self, batch: HarnessInputBatch, inputs: dict, meta) -> torch.Tensor:
        kw = dict(attn_backend=self.attn_backend)
        if self.attention_checker is not None:
            with self.attention_checker:
                return self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches,
                                  inputs["self_cond"], **kw)
        return self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches, inputs["self_cond"], **kw)

    def step(self) -> StepRecord:
        """Run one scheduler step (admit, schedule, one forward pass, sampler, accounting, removals).

        Returns:
            the :class:`StepRecord` (also appended to ``history``).

        Raises:
            RuntimeError: a running request lost its model-state slot (``model_state.remove_request`` called
                behind the harness; use :meth:`abort`), or, which :meth:`add_request`'s footprint check rules out,
                a request alone cannot get its KV pages.
            blockdiff.integration.sampler.SamplerMismatch / checks.AttentionMismatch: ``check`` found a
                backend disagreeing with the reference.
        """
        t0 = time.perf_counter()
        rec = StepRecord(step=self.step_index)
        self._admit()
        rec.arrived, self._arrived = self._arrived, []
        ms = self.model_state
        if not self._running:
            rec.preempted, self._preempted = self._preempted, []
            self.step_index += 1
            self.history.append(rec)
            return rec
        self._check_slots()
        rows = self._schedule_or_preempt()
        rec.preempted, self._preempted = self._preempted, []
        if not rows:
            raise RuntimeError(
                f"step {self.step_index}: {len(self._running)} running request(s) but none could be scheduled "
                f"({self.allocator.num_free} free KV pages of {self.page_size} tokens): enlarge num_blocks")
        batch = self._build_batch(rows)
        with torch.inference_mode():
            ms.prepare_inputs_embeds({}, batch, None)
            inputs = ms.prepare_inputs(batch, None)
            meta = ms.prepare_attn(batch, None, (batch.block_table,), batch.slot_mapping, None, None)
            logits = self._forward(batch, inputs, meta)
            out = self.sampler(logits, batch)
        self.num_forward += 1
        rec.forward = True
        self.last_batch, self.last_output = batch, out

        causal = meta.causal.tolist()
        n_s, n_r = out.num_sampled.tolist(), out.num_rejected.tolist()
        n_e = out.num_emitted.tolist()
        emitted = out.sampled_token_ids.tolist()
        so = out.step
        finished, failed = so.finished.tolist(), so.failed.tolist()
        den = [ph == DENOISE for _, ph, _ in rows]
        acc = so.accepted.sum(-1).tolist() if any(den) else [0] * len(rows)
        ment = so.mean_entropy.tolist() if any(den) else [None] * len(rows)
        conv = so.converged.tolist() if any(den) else [False] * len(rows)
        fz = out.fused.tolist() if out.fused is not None else [False] * len(rows)
        if any(fz):
            fs = out.fused_step
            f_acc, f_ment = fs.accepted.sum(-1).tolist(), fs.mean_entropy.tolist()
            f_conv, f_failed = fs.converged.tolist(), fs.failed.tolist()
        num_computed = ms.num_computed_tokens.clone()
        done: list[tuple[_Req, str]] = []
        for i, (r, ph, q) in enumerate(rows):
            r.last_scheduled = self.step_index
            seq_len = r.num_computed + q
            ctx = r.num_computed
            r.num_computed += q - n_r[i]
            num_computed[r.slot] = r.num_computed
            r.output.extend(emitted[i][: n_e[i]])
            if fz[i]:  # fused commit: its commit and its next canvas's first denoising step, as two records
                CL = self.canvas_length
                rec.rows.append(RowRecord(r.req_id, r.slot, "commit", CL, ctx + CL, True, n_s[i], 0, n_e[i],
                                          fused=True))
                row = RowRecord(r.req_id, r.slot, "denoise", q - CL, seq_len, False, 0, n_r[i], 0, fused=True)
                row.accepted, row.mean_entropy = int(f_acc[i]), _defined(f_ment[i])
                row.converged = bool(f_conv[i])
                r.num_canvases += 1
                r.num_denoise_steps += 1
                failed[i] = failed[i] or bool(f_failed[i])
            else:
                row = RowRecord(r.req_id, r.slot, PHASE_NAMES[ph].lower(), q, seq_len, bool(causal[i]), n_s[i],
                                n_r[i], n_e[i])
            if ph == DENOISE:
                r.num_denoise_steps += 1
                row.accepted, row.mean_entropy, row.converged = int(acc[i]), _defined(ment[i]), bool(conv[i])
            if ph == COMMIT and not fz[i]:
                r.num_canvases += 1
            rec.rows.append(row)
            if failed[i]:
                done.append((r, "error"))
            elif finished[i]:
                hit_eos = bool(r.params.eos_token_ids) and bool(r.output) and r.output[-1] in r.params.eos_token_ids
                done.append((r, "eos" if hit_eos else "length"))
            elif ph == COMMIT and r.num_computed + self.canvas_length > self.max_model_len:
                done.append((r, "length"))
        ms.postprocess_state(batch.idx_mapping, out.num_sampled, num_computed)
        for r, reason in done:
            self._finish(r, reason)
            rec.finished.append(r.req_id)
        rec.wall_ms = (time.perf_counter() - t0) * 1e3
        self.wall_s += rec.wall_ms / 1e3
        self.step_index += 1
        self.history.append(rec)
        return rec

    def _record(self, r: _Req, reason: str) -> None:
        self.results[r.req_id] = RequestResult(
            r.req_id, len(r.prompt), list(r.output), reason, r.num_canvases, r.num_denoise_steps, r.arrival_step,
            r.admit_step, self.step_index, r.num_preemptions)

    def _release(self, r: _Req) -> None:
        """Free a running request's model-state slot, KV pages and harness slot."""
        self.model_state.remove_request(r.req_id)
        self.allocator.free(r.req_id)
        self._free_slots.append(r.slot)
        del self._running[r.req_id]
        r.slot = None

    def _finish(self, r: _Req, reason: str) -> None:
        self._record(r, reason)
        self._release(r)

    def _preempt(self, r: _Req) -> None:
        """Preempt running ``r`` (see :meth:`preempt`); recorded in the next StepRecord's ``preempted``."""
        self._release(r)
        r.num_computed = 0
        r.prefill = list(r.prompt) + list(r.output)
        r.num_preemptions += 1
        self._queue(r)
        self._preempted.append(r.req_id)

    def preempt(self, req_id: str) -> None:
        """Preempt a running request as vLLM's scheduler does: ``remove_request``, its slot and KV pages freed,
        and the request queued by its priority (ahead of every request that arrived after it), to be readmitted
        with ``prefill_token_ids`` = prompt + its emitted tokens (re-prefilled; those tokens count toward
        max_tokens and the next canvas continues after them). Call it between steps. The scheduler also preempts
        on its own when the KV pool is short (see the module docstring).

        Raises:
            TypeError: ``req_id`` is not a str. ValueError: ``req_id`` is not running.
        """
        _check_req_id(req_id)
        r = self._running.get(req_id)
        if r is None:
            raise ValueError(f"request {req_id!r} is not running (waiting, finished or unknown)")
        self._preempt(r)

    def abort(self, req_id: str) -> RequestResult:
        """Cancel a waiting or running request (vLLM's ``abort_requests``): a running one is removed from the model
        state and its slot and KV pages are freed; a waiting one leaves the queue. It is recorded in ``results``
        with finish_reason ``"aborted"`` and the tokens it emitted so far. Call it between steps.

        Returns:
            its :class:`RequestResult`.

        Raises:
            TypeError: ``req_id`` is not a str. ValueError: ``req_id`` is unknown or already finished.
        """
        _check_req_id(req_id)
        r = self._running.get(req_id)
        if r is not None:
            self._release(r)
        else:
            r = next((w for w in self._waiting if w.req_id == req_id), None)
            if r is None:
                done = self.results.get(req_id)
                state = f"already finished ({done.finish_reason})" if done is not None else "unknown"
                raise ValueError(f"request {req_id!r} cannot be aborted: {state}")
            self._waiting.remove(r)
        self._record(r, "aborted")
        return self.results[req_id]

    # ------------------------------------------------------------------ whole runs
    def run(self, max_steps: int = 100_000, on_step: Callable[[StepRecord], None] | None = None
            ) -> dict[str, RequestResult]:
        """Step until every request has finished.

        Args:
            max_steps: safety cap on steps (an int >= 1).
            on_step: called with each :class:`StepRecord`, or None.

        Returns:
            ``{req_id: RequestResult}`` for every request added.

        Raises:
            TypeError: ``max_steps`` not an int, ``on_step`` not callable.
            ValueError: ``max_steps`` < 1.
            RuntimeError: unfinished requests after ``max_steps`` steps (none is dropped silently); see :meth:`step`.
        """
        if not _is_int(max_steps):
            raise TypeError(f"max_steps must be an int >= 1, got {type(max_steps).__name__} ({max_steps!r})")
        if max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps}")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be callable or None, got {type(on_step).__name__}")
        start = self.step_index
        while self.has_unfinished:
            if self.step_index - start >= max_steps:
                left = [r.req_id for r in self._waiting] + list(self._running)
                raise RuntimeError(f"{len(left)} request(s) unfinished after {max_steps} steps: {left[:8]}")
            rec = self.step()
            if on_step is not None:
                on_step(rec)
        return dict(self.results)

    def totals(self) -> dict[str, Any]:
        """Run totals (the figures ``blockdiff demo`` and ``blockdiff train``'s evaluation, :mod:`.evaluate`, report).

        Returns:
            dict: ``steps``; ``forward_passes`` (harness steps that ran the model: one pass serves every
            scheduled row); ``tokens_emitted`` (tokens committed, after EOS / max_tokens trimming);
            ``tokens_per_forward`` (tokens emitted / forward passes); ``wall_s``; ``request_rows`` (rows of all
            passes: prefill chunks, denoise and commit rows); ``tokens_per_request_pass`` (tokens emitted /
            request rows); ``denoise_rows``; ``tokens_per_denoise_step`` (tokens emitted / denoise rows);
            ``canvases_committed``; ``fused_commits`` (commits fused with the next canvas's first denoising step,
            ``fuse_commit``; their step counts as a denoise row of that canvas); ``denoise_steps_per_canvas`` (mean
            denoise rows of the committed canvases; a canvas still being denoised, or of a failed request, is not counted, nor are the rows of a canvas
            a preemption interrupted: the resumed request denoises that canvas again from step 0) and
            ``max_denoise_steps_per_canvas`` (0 when none committed). A ratio with a zero denominator is NaN
            (undefined: nothing ran).
        """
        emitted = sum(len(r.output_token_ids) for r in self.results.values()) + sum(
            len(r.output) for r in self._running.values())
        # a fused commit row is one request row (recorded as two RowRecords: its commit and its denoise step)
        rows = sum(len(h.rows) - sum(x.fused and x.phase == "denoise" for x in h.rows) for h in self.history)
        denoise_rows = sum(h.count("denoise") for h in self.history)
        per_canvas: list[int] = []  # denoise rows of each committed canvas, in commit order
        pending: dict[str, int] = {}
        for h in self.history:
            for row in h.rows:
                if row.phase == "prefill":  # (re)admission: a canvas interrupted by preemption restarts at step 0
                    pending.pop(row.req_id, None)
                elif row.phase == "denoise":
                    pending[row.req_id] = pending.get(row.req_id, 0) + 1
                elif row.phase == "commit":
                    per_canvas.append(pending.pop(row.req_id, 0))
        ratio = lambda a, b: a / b if b else math.nan  # noqa: E731
        return {
            "steps": self.step_index, "forward_passes": self.num_forward, "tokens_emitted": emitted,
            "tokens_per_forward": ratio(emitted, self.num_forward),
            "wall_s": self.wall_s,
            "request_rows": rows, "tokens_per_request_pass": ratio(emitted, rows),
            "denoise_rows": denoise_rows, "tokens_per_denoise_step": ratio(emitted, denoise_rows),
            "canvases_committed": sum(h.canvases_committed for h in self.history),
            "fused_commits": sum(x.fused and x.phase == "commit" for h in self.history for x in h.rows),
            "denoise_steps_per_canvas": ratio(sum(per_canvas), len(per_canvas)),
            "max_denoise_steps_per_canvas": max(per_canvas, default=0),
        }
