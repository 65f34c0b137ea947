"""vLLM request parameters -> :class:`blockdiff.sampler.SamplingParams`, and the rules by which a vLLM request is
refused: one set of functions for the two places that apply them, the plugin's scheduler (``add_request``, in the
scheduler process, before the request is scheduled: :mod:`blockdiff.integration.vllm_scheduler`) and the model
state (``add_request`` in the worker, the backstop: :mod:`blockdiff.integration.model_state`). Imports nothing of
vLLM, so the rules run and are tested without it. Semantics: docs/ARCHITECTURE.md "Integration and vLLM accounting"
("SamplingParams")."""
from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Mapping
from typing import Any

from blockdiff.sampler import SamplingParams

#: Most stop ids one request may carry (its eos id plus ``stop_token_ids``, distinct). A request's count widens every
#: slot's stop-id buffer for the server's life, and each step compares every committed canvas with it ([rows,
#: canvas_length, width] booleans in the torch path: 64 MiB at 64 rows of 256 and this width). More is refused: under
#: vLLM the request fails with finish reason ``error`` (it was served: a vocabulary-sized list, ~262k ids, would need
#: ~4.3 GB of booleans in that compare at 64 rows, enough to stop the engine on a GPU its KV cache fills; computed,
#: not run).
MAX_STOP_TOKEN_IDS = 4096


def check_stop_token_count(n: int) -> None:
    """Refuse a request with more than :data:`MAX_STOP_TOKEN_IDS` distinct stop ids (``n``: its eos id plus
    ``stop_token_ids``).

    Raises:
        ValueError: ``n`` above :data:`MAX_STOP_TOKEN_IDS` (the count and the limit named).
    """
    if not isinstance(n, bool) and isinstance(n, int) and n > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"a request has {n} stop token ids (eos_token_id + stop_token_ids), more than the "
                         f"{MAX_STOP_TOKEN_IDS} blockdiff serves per request (MAX_STOP_TOKEN_IDS: each widens "
                         f"every slot's stop-id buffer and its per-step compare)")


#: vLLM ``SamplingParams.extra_args`` key naming the request's RNG identity: a non-empty str that
#: :func:`request_key` hashes in place of the id vLLM gives the request. vLLM's ids end in 8 random characters
#: (``InputProcessor.assign_request_id``), so without the key a served request's noise (its initial canvases,
#: renoise and Gumbel draws) differs from run to run; with it, the request draws the noise of the harness request
#: with that ``req_id`` (and the same seed), so a greedy served request can equal the harness's token for token.
VLLM_RNG_REQUEST_ID = "rng_request_id"

#: The whole ids of the dummy requests vLLM's model runner v2 sends at start-up (``v1/worker/gpu/warmup.py``, 0.26.0
#: and 0.33.0: ``_warmup_<i>_`` with ``SamplingParams.for_sampler_warmup()``, which sets penalties, top-k / top-p,
#: logprobs and a logit bias to warm vLLM's sampler kernels; ``_v2_mixed_warmup_decode_`` / ``_prefill_``). Under
#: vLLM such a request runs with the served default parameters, so the start-up warm-up runs blockdiff's sampler on
#: real rows (instead of failing every request on options a user request may not set). Only whole ids count: a user
#: request's id may start the same way, and never equals one, since vLLM appends ``-`` and 8 random characters to
#: every external id (``InputProcessor.assign_request_id``).
_VLLM_WARMUP_REQ_ID = re.compile(r"_warmup_\d+_|_v2_mixed_warmup_(?:decode|prefill)_")


def is_vllm_warmup_request_id(req_id: Any) -> bool:
    """Whether ``req_id`` is one of vLLM's start-up warm-up ids, whole (``_warmup_<i>_``,
    ``_v2_mixed_warmup_decode_``, ``_v2_mixed_warmup_prefill_``); a user id that only starts like one
    (``_warmup_0_-1a2b3c4d``) is not, and keeps its own sampling parameters."""
    return isinstance(req_id, str) and _VLLM_WARMUP_REQ_ID.fullmatch(req_id) is not None


def rng_request_id(sampling_params: Any, req_id: str) -> str:
    """The id whose :func:`request_key` keys a request's noise: ``extra_args["rng_request_id"]`` of a vLLM
    ``SamplingParams`` when set (:data:`VLLM_RNG_REQUEST_ID`), else ``req_id``.

    Raises:
        TypeError: the extra_args value is not a str. ValueError: it is the empty string.
    """
    extra = getattr(sampling_params, "extra_args", None)
    v = extra.get(VLLM_RNG_REQUEST_ID) if isinstance(extra, Mapping) else None
    if v is None:
        return req_id
    if not isinstance(v, str):
        raise TypeError(f"sampling_params.extra_args[{VLLM_RNG_REQUEST_ID!r}] must be a str (the request's RNG "
                        f"identity), got {type(v).__name__} ({v!r})")
    if not v:
        raise ValueError(f"sampling_params.extra_args[{VLLM_RNG_REQUEST_ID!r}] must not be empty")
    return v


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def stop_token_ids_of(sampling_params: Any) -> tuple[int, ...]:
    """The token ids that end a request under vLLM's rules, sorted: vLLM's ``check_stop``
    (``vllm/v1/core/sched/utils.py``, 0.33.0) stops on ``sampling_params.eos_token_id`` (None when ``ignore_eos``)
    or on any id in ``sampling_params.stop_token_ids`` (the user's ids, plus the generation config's extra EOS ids
    that ``update_from_generation_config`` adds unless ``ignore_eos``). ``ignore_eos`` drops only the EOS token:
    explicit ``stop_token_ids`` still stop. ``all_stop_token_ids`` is not the stop set (it keeps the EOS ids even
    with ``ignore_eos``, for ``min_tokens``) and is not read.

    Raises:
        TypeError: ``stop_token_ids`` is not a list / tuple / set (or None); a stop id is not an int (numpy
            integers count as ints; bools, floats and strings do not).
    """
    ids = []
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None and not getattr(sampling_params, "ignore_eos", False):
        ids.append(eos)
    stops = getattr(sampling_params, "stop_token_ids", None)
    if stops is not None and not isinstance(stops, (list, tuple, set, frozenset)):
        raise TypeError(f"stop_token_ids must be a list of ints or None, got {type(stops).__name__} ({stops!r:.40})")
    ids.extend(stops or ())
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"stop_token_ids must hold ints, got {type(t).__name__} ({t!r})")
    return tuple(sorted({int(t) for t in ids}))


#: vLLM ``SamplingParams`` options blockdiff's diffusion sampler does not implement, with their no-op values
#: (vLLM 0.33.0 defaults): a request setting any other value is refused (ValueError naming the option; under
#: vLLM the request fails with finish reason ``error``) instead of being served with the option silently ignored.
#: vLLM 0.33.0's own ``Sampler`` (which ``custom_sampler`` replaces) also applies ``thinking_token_budget`` (with
#: ``--reasoning-parser``) and ``trace_decode_token_ids`` (with ``--enable-trace-replay``), and its prompt-logprobs
#: worker scores ``prompt_logprob_token_ids`` as ``prompt_logprobs``: refused as well.
UNSUPPORTED_VLLM_OPTIONS: dict[str, tuple] = {
    "n": (1,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
    "top_k": (0, -1, None), "min_p": (0.0,), "min_tokens": (0,), "logprobs": (None,), "prompt_logprobs": (None,),
    "logit_bias": (None,), "allowed_token_ids": (None,), "bad_words": (None,), "structured_outputs": (None,),
    "logprob_token_ids": (None,), "prompt_logprob_token_ids": (None,), "thinking_token_budget": (None,),
    "trace_decode_token_ids": (None,),
}


def _short_repr(v: Any, limit: int = 60) -> str:
    """``repr(v)``, cut to ``limit`` characters (a 10,000-id trace or bias table would flood the log)."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({type(v).__name__})"


def unsupported_vllm_options(sampling_params: Any) -> list[str]:
    """``"name=value"`` for every option of a vLLM ``SamplingParams`` that blockdiff cannot honour and that is set
    to something other than its no-op value (:data:`UNSUPPORTED_VLLM_OPTIONS`; empty containers count as unset;
    ``top_p`` must be 1 unless the request is greedy, where vLLM resets it). Attributes a stand-in object lacks
    are treated as unset."""
    bad = []
    for name, ok in UNSUPPORTED_VLLM_OPTIONS.items():
        v = getattr(sampling_params, name, ok[0])
        if isinstance(v, (list, tuple, dict, set)):
            if not v and None in ok:
                continue
        elif (v is None and None in ok) or (v is not None and any(o is not None and v == o for o in ok)):
            continue
        bad.append(f"{name}={_short_repr(v)}")
    temperature = getattr(sampling_params, "temperature", 1.0)
    top_p = getattr(sampling_params, "top_p", 1.0)
    greedy = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and temperature < 1e-5
    if top_p is not None and top_p != 1.0 and not greedy:  # (a temperature that is no number: not greedy)
        bad.append(f"top_p={top_p!r}")
    return bad


#: vLLM ``SamplingParams.extra_args`` keys blockdiff reads, and the :class:`blockdiff.sampler.SamplingParams` field
#: each sets. Any other key is refused (a misspelled key would otherwise be ignored silently).
VLLM_EXTRA_ARGS: dict[str, str] = {
    "diffusion_max_steps": "max_denoising_steps", "t_min": "t_min", "t_max": "t_max",
    "entropy_bound": "entropy_bound", "confidence_threshold": "confidence_threshold",
    "stability_threshold": "stability_threshold", "diffusion_canvas_length": "canvas_length",
}
#: Attributes of a vLLM ``SamplingParams`` that :func:`to_diffusion_params` reads: an object with none of them is
#: not taken for one.
_VLLM_PARAM_ATTRS = ("temperature", "seed", "max_tokens", "eos_token_id", "stop_token_ids", "ignore_eos", "extra_args")
#: vLLM's greedy threshold (``vllm.sampling_params._SAMPLING_EPS``): a temperature below it samples greedily.
_VLLM_SAMPLING_EPS = 1e-5


def _vllm_int(sp: Any, name: str) -> int | None:
    """``sp.<name>`` as an int, or None when unset; TypeError for a bool, float or str (no truncation)."""
    v = getattr(sp, name, None)
    if v is None:
        return None
    if not _is_int(v):
        raise TypeError(f"sampling_params.{name} must be an int or None, got {type(v).__name__} ({v!r})")
    return int(v)


def to_diffusion_params(sampling_params: Any, defaults: Any = None, *, canvas_length: int | None = None):
    """Convert request sampling parameters to :class:`blockdiff.sampler.SamplingParams`.

    Accepts a blockdiff ``SamplingParams`` (returned as is, after checking its canvas length), None (``defaults``),
    or a vLLM ``SamplingParams`` (any object with at least one of its attributes ``temperature``, ``seed``,
    ``max_tokens``, ``eos_token_id``, ``stop_token_ids``, ``ignore_eos``, ``extra_args``; a dict, str or number is
    not one): ``seed`` -> seed (None -> the default's), ``max_tokens``, EOS ids = vLLM's stop set
    (:func:`stop_token_ids_of`: ``eos_token_id`` unless ``ignore_eos``, plus every ``stop_token_ids`` entry), and
    the ``extra_args`` keys of :data:`VLLM_EXTRA_ARGS` (``diffusion_max_steps`` -> max_denoising_steps, ``t_min``,
    ``t_max``, ``entropy_bound``, ``confidence_threshold``, ``stability_threshold``, ``diffusion_canvas_length``;
    ``rng_request_id`` is accepted too and read by :func:`rng_request_id`, not here); every other field from
    ``defaults``. Temperature: the sampler follows a per-step schedule from ``t_max``
    down to ``t_min`` (``extra_args``); vLLM's ``temperature`` = 0 (below vLLM's 1e-5) means greedy
    (t_min = t_max = 0), its default 1.0 leaves the schedule alone, and any other value, negative ones included,
    is refused (it has no single meaning for a schedule). Options the sampler does not implement
    (:func:`unsupported_vllm_options`: penalties, top-k / top-p / min-p, min_tokens, logprobs, logit_bias,
    allowed / bad words, structured outputs, n > 1, and vLLM 0.33.0's prompt_logprob_token_ids,
    thinking_token_budget, trace_decode_token_ids) are refused when set. Stop strings (``stop``) are applied by
    vLLM's output processor and work. Nothing is coerced: ints must be ints (not bools, floats or strings).

    Args:
        sampling_params: see above.
        defaults: a blockdiff ``SamplingParams`` (default ``SamplingParams()``): the fields a vLLM request leaves
            unset.
        canvas_length: the served canvas length (None: not checked).

    Raises:
        ValueError: ``canvas_length`` of the request differs from the served canvas length; a field breaks a
            :class:`~blockdiff.sampler.SamplingParams` rule; an unsupported vLLM option is set; ``extra_args``
            holds a key outside :data:`VLLM_EXTRA_ARGS`; ``temperature`` is neither 0 nor 1 (negative, NaN, 0.5),
            or 0 together with a nonzero ``extra_args`` t_min / t_max.
        TypeError: ``sampling_params`` / ``defaults`` is neither kind of SamplingParams; ``extra_args`` is not a
            dict; ``seed`` / ``max_tokens`` not an int; ``temperature`` not a number; a field has the wrong type.
    """
    if isinstance(sampling_params, SamplingParams):
        p = sampling_params
    else:
        base = defaults if defaults is not None else SamplingParams()
        if not isinstance(base, SamplingParams):
            raise TypeError(f"defaults must be a blockdiff.sampler.SamplingParams or None, got {type(base).__name__}")
        kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        sp = sampling_params
        if sp is not None:
            if isinstance(sp, (Mapping, str, bytes, numbers.Number, list, tuple)) or not any(
                    hasattr(sp, a) for a in _VLLM_PARAM_ATTRS):
                raise TypeError(f"sampling_params must be a blockdiff.sampler.SamplingParams, a vLLM SamplingParams "
                                f"or None, got {type(sp).__name__}")
            seed = _vllm_int(sp, "seed")
            if seed is not None:
                kw["seed"] = seed
            max_tokens = _vllm_int(sp, "max_tokens")
            if max_tokens is not None:
                kw["max_tokens"] = max_tokens
            kw["eos_token_ids"] = stop_token_ids_of(sp)
            extra = getattr(sp, "extra_args", None)
            if extra is None:
                extra = {}
            elif not isinstance(extra, Mapping):
                raise TypeError(f"sampling_params.extra_args must be a dict (keys {sorted(VLLM_EXTRA_ARGS)}) or None, "
                                f"got {type(extra).__name__}")
            unknown = sorted(repr(k) for k in extra if k not in VLLM_EXTRA_ARGS and k != VLLM_RNG_REQUEST_ID)
            if unknown:
                raise ValueError(f"sampling_params.extra_args has unknown key(s) {', '.join(unknown)}: blockdiff reads "
                                 f"{sorted([*VLLM_EXTRA_ARGS, VLLM_RNG_REQUEST_ID])}")
            temperature = getattr(sp, "temperature", 1.0)
            temperature = 1.0 if temperature is None else temperature
            if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
                raise TypeError(f"sampling_params.temperature must be a number (0 greedy, 1.0 the schedule), got "
                                f"{type(temperature).__name__} ({temperature!r})")
            bad = unsupported_vllm_options(sp)
            if bad:
                raise ValueError(f"sampling_params sets options blockdiff's diffusion sampler does not implement: "
                                 f"{', '.join(bad)} (leave them at vLLM's defaults)")
            if 0 <= temperature < _VLLM_SAMPLING_EPS:  # greedy, as vLLM takes it
                if any(extra.get(k) not in (None, 0, 0.0) for k in ("t_min", "t_max")):
                    raise ValueError(f"sampling_params.temperature = {temperature} (greedy) conflicts with "
                                     f"extra_args t_min = {extra.get('t_min')!r}, t_max = {extra.get('t_max')!r}")
                kw["t_min"], kw["t_max"] = 0.0, 0.0
            elif temperature != 1.0:
                raise ValueError(f"sampling_params.temperature must be 0 (greedy) or 1.0 (vLLM's default: the "
                                 f"diffusion temperature schedule applies), got {temperature}; set the schedule "
                                 f"with extra_args t_min / t_max")
            renamed = {}  # blockdiff field -> the extra_args key that set it under another name
            for k, f in VLLM_EXTRA_ARGS.items():
                if extra.get(k) is not None:
                    kw[f] = extra[k]
                    if f != k:
                        renamed[f] = k
            try:
                p = SamplingParams(**kw)
            except (TypeError, ValueError) as e:
                # the rule names blockdiff's field ("max_denoising_steps must be ..."): name the key the request set
                f = next((f for f in renamed if str(e).startswith(f"{f} ")), None)
                if f is None:
                    raise
                raise type(e)(f"sampling_params.extra_args[{renamed[f]!r}] (blockdiff's {f}): {e}") from e
        else:
            p = SamplingParams(**kw)
    if canvas_length is not None and p.canvas_length != canvas_length:
        raise ValueError(
            f"sampling_params.canvas_length (extra_args['diffusion_canvas_length'] of a vLLM request: "
            f"{p.canvas_length}) must equal the served canvas_length ({canvas_length}): one canvas length per model "
            f"state")
    return p


def vllm_request_params(sampling_params: Any, req_id: str, defaults: Any, *, canvas_length: int,
                        vocab_size: int | None = None) -> tuple[SamplingParams, str]:
    """A request's blockdiff parameters and RNG identity, or why it is refused: every check of a request's
    parameters that needs no slot, in the order the model state's ``add_request`` runs them. The plugin's scheduler
    runs it at ``add_request`` (the scheduler process, before the request is scheduled), the model state again in
    the worker (the backstop); both pass the defaults and canvas length built from the same ``VllmConfig``
    (:func:`blockdiff.integration.vllm_scheduler.served_default_params`, ``served_canvas_length``), so they refuse
    the same requests.

    Args:
        sampling_params: a vLLM ``SamplingParams`` (or a blockdiff one, or None: :func:`to_diffusion_params`).
        req_id: the request's id (its RNG identity unless ``extra_args["rng_request_id"]`` names one).
        defaults: the served blockdiff ``SamplingParams`` (the fields a request leaves unset).
        canvas_length: the served canvas length.
        vocab_size: the model's vocabulary size (None: stop ids not checked against it).

    Returns:
        ``(params, rng_id)``: the blockdiff ``SamplingParams`` and the id :func:`request_key
        <blockdiff.integration.model_state.request_key>` hashes.

    Raises:
        ValueError / TypeError: a refused request, the message naming the option and the rule it breaks
            (:func:`to_diffusion_params`, :func:`rng_request_id`, :func:`check_stop_token_count`; a stop id at or
            above ``vocab_size``).
    """
    params = to_diffusion_params(sampling_params, defaults, canvas_length=canvas_length)
    rng_id = rng_request_id(sampling_params, req_id)
    check_stop_token_count(len(params.eos_token_ids))
    if vocab_size is not None:
        bad = [t for t in params.eos_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids must be < vocab_size={vocab_size}, got {bad[0]} (a vLLM request's "
                             f"eos_token_id / stop_token_ids)")
    return params, rng_id
