"""vLLM scheduler for blockdiff's DiffusionModelState: the scheduler vLLM itself runs a diffusion model with, plus
the two ways a block-diffusion request ends that vLLM's own stop checks never see.

The base classes depend on the vLLM version (:func:`blockdiff.integration.vllm_compat.scheduler_base_classes`):
vLLM 0.33.0's ``DiffusionScheduler`` / ``DiffusionAsyncScheduler`` (``vllm/v1/core/sched/diffusion_scheduler.py``);
vLLM 0.26.0 schedules diffusion in its main ``Scheduler`` / ``AsyncScheduler``.

Select it with ``--scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler`` (or
``BlockdiffDiffusionAsyncScheduler`` with ``--async-scheduling``); importing the classes needs vLLM, the helper
:func:`finish_stuck_requests` does not.

After every step (``update_from_output``) it finishes:

* a request the worker reported with NaN / +inf logits or a position whose every logit is -inf
  (``ModelRunnerOutput.num_nans_in_logits[req_id] > 0``,
  which :class:`~blockdiff.integration.sampler.DiffusionSampler` sets for a request in phase FAILED): status
  ``FINISHED_ERROR`` (finish reason ``error``), no further tokens. vLLM's own scheduler only records that count,
  so the request would be scheduled forever and never freed; likewise a request whose
  ``extra_args["diffusion_canvas_length"]`` is no canvas width (:func:`diffusion_canvas_width` raises: the model
  state refuses it too);
* a request whose next canvas no longer fits in ``max_model_len`` (``num_tokens + canvas_length >
  max_model_len``): status ``FINISHED_LENGTH_CAPPED`` (finish reason ``length``), as the harness does. vLLM would
  schedule it truncated canvases, which the blockdiff sampler skips (a canvas is denoised whole), so it would never
  emit a token again.

Finishing goes through vLLM's ``Scheduler.finish_requests`` (the path a client abort takes): the request leaves
the queues, its KV blocks are freed, and its id reaches the worker in the next ``finished_req_ids``, where model
runner v2 calls ``DiffusionModelState.remove_request`` and frees the slot. Each gets an ``EngineCoreOutput`` with
its finish reason, so the client is answered (no lost request). Interface read from vLLM 0.26.0 and 0.33.0
(``vllm/v1/core/sched/scheduler.py``; 0.33.0's ``diffusion_scheduler.py``): the same in both.

A request whose sampling parameters blockdiff refuses (a vLLM option the sampler cannot honour such as ``top_k`` or
``logprobs``, an unknown ``extra_args`` key, a temperature other than 0 or 1, another canvas length, an
``extra_args`` value breaking a sampler rule against the served defaults) is refused in ``add_request``
(:class:`ParamsRefusals`, the model state's own checks and defaults): it fails alone with finish reason ``error``
before it is scheduled (no forward pass, no KV block), and its client learns why: under vLLM 0.33.0 its
``EngineCoreOutput.error`` is ``RequestError(code="validation_error", message=...)`` (the ``ValueError`` /
``TypeError`` text, naming the option and the rule), which ``AsyncLLM`` raises in the caller as
``VLLMValidationError`` (vLLM's OpenAI server: HTTP 400 for a non-streaming request; a streamed one has had its
HTTP 200 already and gets the error as an event in its stream); vLLM 0.26.0 has no such field, so there the message is
only logged (WARNING, once per request; logged under 0.33.0 too) and its OpenAI server answers HTTP 500, or a streamed
request with an empty stream (docs/ARCHITECTURE.md section 7). The model state's check in the worker stays as the
backstop (:func:`finish_stuck_requests` then finishes the request, the reason in the worker's log only).

Streaming input (vLLM's resumable requests: a request continued with a longer prompt; both checked versions) is
refused in ``add_request`` (its outputs carry the same kind of ``RequestError`` under 0.33.0, with
:data:`STREAMING_INPUT_REFUSED`): each input chunk fails alone with finish reason ``error`` before it is scheduled, the
session's end-of-input request is dropped, and other requests are untouched (:class:`StreamingInputRefusals`, which
says what vLLM would do with such a request through the plugin's hooks: 0.33.0 kills the engine on an assert, 0.26.0
may never finish the request, and the request's RNG stream restarts at canvas 0 in both).

Fused commits (issue 25's stretch goal; opt-in; docs/ARCHITECTURE.md "Integration and vLLM accounting",
docs/tuning.md 7.35 / 7.38). vLLM schedules a running diffusion row ``len(request.spec_token_ids)`` draft tokens.
Served with ``--diffusion-config '{"canvas_length": 2 * CL}'`` (CL = the checkpoint's ``canvas_length``,
:func:`served_canvas_length`) the worker's draft lists and the asynchronous scheduler's placeholders are ``2 * CL``
long, and these schedulers cut every request's list to CL except for a fused commit (the commit, CL causal rows,
plus the next canvas's first denoising step, CL bidirectional rows, accounted by the worker as CL accepted and CL
rejected drafts). With ``BLOCKDIFF_FUSE_COMMIT=1`` (:func:`fuse_commit_from_env`) the model state reports a request
whose canvas converged and whose commit will not end it with ``num_nans_in_logits[req_id] = -1`` (values > 0 still
mean failure); ``update_from_output`` collects those ids and passes vLLM a copy with ``max(n, 0)``.

* Synchronous (``BlockdiffDiffusionScheduler``, ``--no-async-scheduling``): ``update_draft_token_ids`` leaves a
  flagged request ``2 * CL`` drafts when ``num_tokens + 2 * CL <= max_model_len`` (:func:`cut_draft_widths`).
  Every converged canvas but a request's last is fused.
* Asynchronous (``BlockdiffDiffusionAsyncScheduler``, vLLM's default): step S is scheduled while S - 1 runs, before
  its flag is known. ``schedule`` keeps ``2 * CL`` placeholders (:func:`cut_spec_tokens` with the predictor) where
  :class:`FusedCommitPredictor` predicts that the row in flight is its canvas's ``max_denoising_steps``-th denoising
  step: the step cap forces the commit after it, so that prediction is exact. The predictor counts each request's
  steps from its own scheduled rows and the outputs known so far (tokens returned = a commit; the -1 flag = a
  canvas that converged early; a preempted request restarts at step 0). Canvases that converge before the cap are
  learnt one step late and commit plain; a predicted commit that ends the request (a stop id inside) runs its tail
  for nothing (the worker's fused step is a no-op on a finished request). Checked with vLLM 0.26.0's
  ``AsyncScheduler`` and 0.33.0's ``DiffusionAsyncScheduler``.
* Without the switch in the two-canvas layout, the asynchronous ``schedule`` cuts every placeholder list to CL
  (:func:`cut_spec_tokens`) and the synchronous one cuts every draft list to CL: nothing fuses.
* Fuse policy (``BLOCKDIFF_FUSE_POLICY``, :func:`fuse_policy_from_env`; docs/tuning.md 7.40), both schedulers:
  ``any`` (the default) keeps every fused row above; ``uniform`` keeps them only when every canvas row of the step
  is fused (:func:`keep_uniform_widths`, which says what vLLM needs to replay a FULL CUDA graph), else cuts them all
  to CL: plain commits, exact as without fusion. A bad value stops the start (ValueError).
* Budget guard (:func:`wide_rows_fit`): when ``2 * CL`` exceeds the step's token budget
  (``max_num_scheduled_tokens``, or a ``long_prefill_token_threshold`` below it), nothing is fused (a warning at
  start): every wide row would be cut and pay for discarded tokens.
* Start check (:func:`check_canvas_rows_fit`), both schedulers, any layout: a ``long_prefill_token_threshold`` in
  ``[1, CL)`` or a token budget below CL would cut every canvas row (vLLM applies both to running rows), so every
  request would hang; the start stops with a ValueError naming the limit.
* Coverage (:class:`FusedCommitCounts`, ``blockdiff_commit_counts``), both schedulers while fused commits are
  served: commits done fused and plain, wide rows that committed nothing, rows the fuse policy cut; the server log
  gets ``blockdiff: fused commits so far: F of C commits fused (...)`` at INFO when the commit count reaches a new
  power of two, when no request is left, and at ``shutdown``.

Served with CL (no fused layout, the default) none of this runs: every list is ``num_spec_tokens`` = CL long already,
and no per-request loop is added to a step.
"""
from __future__ import annotations

import logging
import numbers
import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import Any

from ..attention.env import env_flag
from .annotate import annotated
from .vllm_compat import scheduler_base_classes
from .vllm_params import is_vllm_warmup_request_id, vllm_request_params

_log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's "vllm" logger: its handler prints INFO to the server log

#: Canvas widths above this are refused (the sampler's canvas_length < 2**16, blockdiff.sampler.rng.MAX_POSITIONS).
MAX_CANVAS_WIDTH = 1 << 16
#: Environment variable that turns fused commits on under vLLM (``1``; ``0`` or unset: off).
FUSE_COMMIT_ENV = "BLOCKDIFF_FUSE_COMMIT"
#: Environment variable choosing which fused rows the plugin's schedulers keep (:func:`fuse_policy_from_env`).
FUSE_POLICY_ENV = "BLOCKDIFF_FUSE_POLICY"
#: The fuse policies: ``any`` (the default) keeps every fused row; ``uniform`` keeps them only in a step whose
#: canvas rows are all fused (:func:`keep_uniform_widths`).
FUSE_POLICIES = ("any", "uniform")
#: ``num_nans_in_logits`` value by which the worker asks for a fused commit (values > 0 mean the request failed).
FUSE_NEXT_FLAG = -1
#: Canvas length when neither the diffusion config nor the checkpoint names one (DiffusionGemma's).
DEFAULT_CANVAS_LENGTH = 256


def fuse_commit_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``BLOCKDIFF_FUSE_COMMIT`` asks for fused commits under vLLM: ``"1"`` True, unset / ``""`` / ``"0"``
    False.

    Raises:
        ValueError: any other value (the variable named).
    """
    return env_flag(FUSE_COMMIT_ENV, environ, meaning="fused commits")


def fuse_policy_from_env(environ: Mapping[str, str] | None = None) -> str:
    """Which fused rows the plugin's schedulers keep, from ``BLOCKDIFF_FUSE_POLICY``: ``"any"`` (also when unset or
    ``""``: every fused commit, as before the variable existed) or ``"uniform"`` (only in a step whose canvas rows
    are all fused: :func:`keep_uniform_widths`). Both schedulers read it at start, served fused or not, so a typo
    stops the start rather than being ignored.

    Raises:
        ValueError: any other value (the variable and the allowed values named).
    """
    env = os.environ if environ is None else environ
    v = env.get(FUSE_POLICY_ENV, "")
    if v == "":
        return FUSE_POLICIES[0]
    if v in FUSE_POLICIES:
        return v
    raise ValueError(f"{FUSE_POLICY_ENV} must be one of {', '.join(FUSE_POLICIES)} (unset: any), got {v!r}")


def served_canvas_length(vllm_config: Any) -> tuple[int, bool]:
    """``(CL, fused_layout)``: the canvas length the model state serves and whether the diffusion config leaves
    room for fused commits.

    vLLM schedules ``diffusion_config.canvas_length`` draft tokens a row at most (its ``num_speculative_tokens``).
    When that is exactly twice the checkpoint's ``hf_config.canvas_length`` (``--diffusion-config
    '{"canvas_length": 512}'`` for a 256-token checkpoint), CL is the checkpoint's and ``fused_layout`` is True: a
    row may carry a commit and the next canvas's first step. Otherwise CL is the diffusion config's (256 when unset)
    and ``fused_layout`` is False, as before fused commits existed.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (reads ``diffusion_config.canvas_length`` and
            ``model_config.hf_config.canvas_length``; a missing attribute counts as unset).
    """
    dcfg = getattr(vllm_config, "diffusion_config", None)
    served = getattr(dcfg, "canvas_length", None)
    if served is None:  # only None is unset (a 0 is refused downstream, never served as the default 256)
        served = DEFAULT_CANVAS_LENGTH
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    ckpt = getattr(hf, "canvas_length", None)
    if isinstance(ckpt, numbers.Integral) and not isinstance(ckpt, bool) and ckpt >= 1 and served == 2 * ckpt:
        return int(ckpt), True
    return int(served), False


def diffusion_canvas_width(request: Any, canvas_length: int) -> int:
    """Canvas tokens the request schedules: ``extra_args["diffusion_canvas_length"]`` or the served one (vLLM's
    ``diffusion_scheduler.diffusion_canvas_width``).

    Raises:
        ValueError: ``extra_args["diffusion_canvas_length"]`` is set to something other than an int in
            ``[1, 2**16)`` (a str, a float, a bool, 0 or a negative count: never truncated, never read as unset);
            :func:`finish_stuck_requests` finishes such a request with an error.
    """
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
    width = extra.get("diffusion_canvas_length") if isinstance(extra, Mapping) else None
    if width is None:
        return int(canvas_length)
    if isinstance(width, bool) or not isinstance(width, numbers.Integral) or not 1 <= width < MAX_CANVAS_WIDTH:
        raise ValueError(f"sampling_params.extra_args['diffusion_canvas_length'] must be an int in [1, 2**16) "
                         f"(canvas tokens), got {width!r}")
    return int(width)


def _canvas_length_of(scheduler: Any) -> int:
    """CL of a scheduler: ``blockdiff_canvas_length`` (set by the plugin's schedulers, :func:`served_canvas_length`),
    else ``num_spec_tokens`` (a scheduler without it: vLLM's canvas length)."""
    cl = getattr(scheduler, "blockdiff_canvas_length", None)
    return int(cl) if cl else int(scheduler.num_spec_tokens)


#: Step caps above this are refused (``blockdiff.sampler.rng.MAX_STEPS``: the sampler's step counter layout).
MAX_DENOISING_STEPS = 1 << 14


def served_max_denoising_steps(vllm_config: Any, generation_config: Mapping | None = None) -> int | None:
    """The served step cap per canvas: ``diffusion_config.max_denoising_steps`` (``--diffusion-config``), else the
    generation config's ``max_denoising_steps``, else None (:class:`blockdiff.sampler.SamplingParams`' default
    applies); only None (or a missing attribute / key) is unset, a 0 is refused. The model state's default
    parameters and the asynchronous scheduler's fused-commit prediction both read it here, so they agree.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (reads ``diffusion_config`` and, without ``generation_config``,
            ``model_config.try_get_generation_config()``; missing attributes count as unset).
        generation_config: the generation config dict when the caller has read it already.

    Raises:
        ValueError: the cap found is not an int in ``[1, 2**14)`` (a bool, a float, 0 or a negative count).
        TypeError: ``generation_config`` is neither None nor a mapping.
    """
    if generation_config is not None and not isinstance(generation_config, Mapping):
        raise TypeError(f"generation_config must be a mapping or None, got {type(generation_config).__name__} "
                        f"({generation_config!r})")
    # only None is unset: a 0 / False cap is a bad value, refused below (was: read as unset, so
    # --diffusion-config '{"max_denoising_steps": 0}', which vLLM's DiffusionConfig accepts, silently served the
    # generation config's cap or the default)
    steps = getattr(getattr(vllm_config, "diffusion_config", None), "max_denoising_steps", None)
    if steps is None:
        gen = generation_config
        if gen is None:
            mc = getattr(vllm_config, "model_config", None)
            getter = getattr(mc, "try_get_generation_config", None)
            gen = (getter() if callable(getter) else None) or {}
        steps = gen.get("max_denoising_steps") if isinstance(gen, Mapping) else None
    if steps is None:
        return None
    whole = isinstance(steps, float) and steps.is_integer()  # a JSON config may write 16.0
    if isinstance(steps, bool) or not (isinstance(steps, numbers.Integral) or whole) or \
            not 1 <= steps < MAX_DENOISING_STEPS:
        raise ValueError(f"max_denoising_steps (diffusion config / generation config) must be an int in [1, 2**14), "
                         f"got {steps!r}")
    return int(steps)


def served_default_params(vllm_config: Any, generation_config: Mapping | None = None) -> Any:
    """The :class:`blockdiff.sampler.SamplingParams` a vLLM request starts from (the fields it leaves unset):
    ``canvas_length`` = :func:`served_canvas_length`'s CL; ``t_min``, ``t_max``, ``confidence_threshold``,
    ``stability_threshold`` and ``sampler_config.entropy_bound`` of the checkpoint's generation config;
    ``max_denoising_steps`` = :func:`served_max_denoising_steps`; the rest ``SamplingParams``' defaults. The model
    state (in the worker) and the plugin's scheduler (in the engine core, to refuse a request at ``add_request``:
    :func:`blockdiff.integration.vllm_params.vllm_request_params`) both build them here from the same
    ``VllmConfig``, so both refuse the same requests.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (reads ``diffusion_config``, ``model_config.hf_config`` and, without
            ``generation_config``, ``model_config.try_get_generation_config()``; missing attributes count as unset).
        generation_config: the generation config dict when the caller has read it already.

    Raises:
        ValueError / TypeError: the served values break a ``SamplingParams`` rule (:func:`served_max_denoising_steps`;
            the model state stops the start on the same error); TypeError: ``sampler_config`` is not a mapping;
            ValueError: its ``_cls_name`` names no EntropyBound sampler (vLLM's own DiffusionGemma's rule; an absent
            ``_cls_name``, which vLLM refuses, is read as the entropy-bound sampler, and keys other than
            ``entropy_bound`` / ``_cls_name`` are ignored, as vLLM ignores them).
    """
    from blockdiff.sampler.params import SamplingParams

    gen = generation_config
    if gen is None:
        getter = getattr(getattr(vllm_config, "model_config", None), "try_get_generation_config", None)
        gen = (getter() if callable(getter) else None) or {}
    sc = gen.get("sampler_config")
    sc = {} if sc is None else sc
    if not isinstance(sc, Mapping):  # (was: AttributeError from sc.get, no name, no rule)
        raise TypeError(f"the generation config's sampler_config must be an object (a dict: {{'entropy_bound': x, "
                        f"'_cls_name': 'EntropyBoundSamplerConfig'}}) or null, got {type(sc).__name__} ({sc!r:.60})")
    cls_name = sc.get("_cls_name")
    if cls_name is not None and not (isinstance(cls_name, str) and "EntropyBound" in cls_name):
        # vLLM's own DiffusionGemma refuses the same ("requires an EntropyBound sampler_config"): another sampler
        # class is not served as the entropy-bound one
        raise ValueError(f"the generation config's sampler_config._cls_name must name an EntropyBound sampler "
                         f"(e.g. 'EntropyBoundSamplerConfig'; blockdiff serves no other), got {cls_name!r:.60}")
    kw = {k: gen[k] for k in ("t_min", "t_max", "confidence_threshold", "stability_threshold") if k in gen}
    if sc.get("entropy_bound") is not None:
        kw["entropy_bound"] = sc["entropy_bound"]
    steps = served_max_denoising_steps(vllm_config, gen)  # the async scheduler predicts commits from the same cap
    if steps:
        kw["max_denoising_steps"] = steps
    return SamplingParams(canvas_length=served_canvas_length(vllm_config)[0], **kw)


def default_max_denoising_steps() -> int:
    """:class:`blockdiff.sampler.SamplingParams`' default step cap (what a server with no configured cap serves)."""
    from blockdiff.sampler.params import SamplingParams

    return int(SamplingParams.__dataclass_fields__["max_denoising_steps"].default)


def _is_cap(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and 1 <= v < MAX_DENOISING_STEPS


def _check_cap(name: str, v: Any) -> None:
    if not _is_cap(v):
        raise ValueError(f"{name} must be an int in [1, 2**14) (a step cap), got {v!r}")


def request_max_denoising_steps(request: Any, default: int) -> int | None:
    """The step cap a request runs with: ``extra_args["diffusion_max_steps"]`` (as the model state reads it,
    ``model_state.VLLM_EXTRA_ARGS``) or ``default``; None when the value is no valid cap (not an int in
    ``[1, 2**14)``: the model state fails such a request, so nothing is predicted for it).

    Raises:
        ValueError: ``default`` is not an int in ``[1, 2**14)`` (the served cap is checked, a request's is not).
    """
    _check_cap("default", default)
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
    steps = extra.get("diffusion_max_steps") if isinstance(extra, Mapping) else None
    if steps is None:
        return int(default)
    return int(steps) if _is_cap(steps) else None


class FusedCommitCounts:
    """Fused-commit coverage of one plugin scheduler, and its line in the server log.

    The plugin's schedulers count, while fused commits are served (the fused layout, ``BLOCKDIFF_FUSE_COMMIT=1`` and
    a token budget that holds a fused row), each canvas row's outcome from the worker's output: the synchronous one
    in :meth:`count_step`, the asynchronous one in :meth:`FusedCommitPredictor.observe` (which reads those outputs
    anyway). Per step that is a pass over the step's rows with integer increments; nothing is logged per step.
    :meth:`after_step` logs :meth:`summary` at INFO (``blockdiff: fused commits so far: F of C commits fused (...)``)
    when the commit count reaches a new power of two and when the scheduler has no unfinished request left; the
    scheduler's ``shutdown`` logs it once more.

    Attributes (counts since the scheduler started):
        num_fused: commits done fused: canvas rows scheduled ``2 * CL`` tokens wide that committed (returned
            tokens; a predicted fused row whose commit ended the request included).
        num_plain: commits done plain: canvas rows narrower than ``2 * CL`` that committed (CL rows, and a fused
            row vLLM's budget cut to ``CL < q < 2 * CL``).
        num_missed: canvas rows wider than CL that committed nothing (rows; under the asynchronous scheduler a
            misprediction, :class:`FusedCommitPredictor`).
        num_policy_cuts: ``2 * CL`` draft lists the ``uniform`` fuse policy cut to CL before vLLM scheduled them
            (rows; :func:`keep_uniform_widths`); those rows commit plain and count in :attr:`num_plain` too.
        num_lines: summary lines logged so far.

    Args:
        canvas_length: CL, the checkpoint's canvas length (tokens, an int >= 1).
        scheduler: the scheduler named in the line (``"synchronous"`` / ``"asynchronous"``).
        policy: the fuse policy named in the line (:data:`FUSE_POLICIES`).
    """

    def __init__(self, canvas_length: int, scheduler: str = "synchronous", policy: str = "any") -> None:
        self.canvas_length = int(canvas_length)
        self.scheduler = scheduler
        self.policy = policy
        self.num_fused = 0
        self.num_plain = 0
        self.num_missed = 0
        self.num_policy_cuts = 0
        self.num_lines = 0
        # rate: each new power of two of the commits (log2(C) lines a server's life) + each idle (a load's exact sum)
        self._logged = 0    # commit count of the last line
        self._next_log = 1  # the next power of two of the commit count that logs

    @property
    def num_commits(self) -> int:
        """Commits counted: :attr:`num_fused` + :attr:`num_plain` (canvases)."""
        return self.num_fused + self.num_plain

    def count_step(self, scheduler_output: Any, model_runner_output: Any) -> None:
        """Count one step's canvas rows (the synchronous scheduler, before vLLM's ``update_from_output``): a row that
        returned tokens (``model_runner_output.sampled_token_ids``) is a commit, fused when vLLM scheduled it
        ``2 * CL`` tokens (``scheduler_output.num_scheduled_tokens``), else plain; a canvas row
        (``scheduled_spec_decode_tokens``) wider than CL that returned none is a miss. Prefill rows return no
        tokens and are not counted."""
        n = scheduler_output.num_scheduled_tokens
        spec = None
        for rid, toks in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            if len(toks):
                self.count_row(n.get(rid) or 0, True)
            elif (n.get(rid) or 0) > self.canvas_length:  # a prefill chunk, or a canvas row that committed nothing
                if spec is None:
                    spec = scheduler_output.scheduled_spec_decode_tokens
                if rid in spec:
                    self.count_row(n[rid], False)

    def count_row(self, q: int, committed: bool) -> bool:
        """Count one canvas row of ``q`` scheduled tokens: committed, a fused commit when ``q == 2 * CL``, else a
        plain one; not committed and wider than CL, a miss. The one rule both schedulers count by
        (:meth:`count_step`, :meth:`FusedCommitPredictor.observe`). Returns whether the row was a miss."""
        if committed:
            if q == 2 * self.canvas_length:
                self.num_fused += 1
            else:
                self.num_plain += 1
            return False
        if q > self.canvas_length:
            self.num_missed += 1
            return True
        return False

    def after_step(self, has_unfinished_requests: Any) -> bool:
        """After a step's counts: if the commit count changed since the last line, log :meth:`summary` at INFO when
        it reached a new power of two or when ``has_unfinished_requests()`` (the scheduler's; called only when the
        count changed) is False (then the line ends ``, no request left``). Returns whether it logged."""
        c = self.num_fused + self.num_plain
        if c == self._logged:
            return False
        idle = not has_unfinished_requests()
        if idle or c >= self._next_log:
            self.log("no request left" if idle else "")
            return True
        return False

    def summary(self, when: str = "") -> str:
        """The line: ``blockdiff: fused commits so far: F of C commits fused (P plain, M wide rows missed, K fused
        rows cut by fuse policy <policy>); <scheduler> scheduler`` plus ``, <when>`` when given."""
        return (f"blockdiff: fused commits so far: {self.num_fused} of {self.num_commits} commits fused "
                f"({self.num_plain} plain, {self.num_missed} wide rows missed, {self.num_policy_cuts} fused rows cut "
                f"by fuse policy {self.policy}); {self.scheduler} scheduler" + (f", {when}" if when else ""))

    def log(self, when: str = "") -> None:
        """Log :meth:`summary` at INFO now (the scheduler's ``shutdown`` calls it with ``when="at shutdown"``) and
        move the next power-of-two line past the current commit count."""
        c = self.num_commits
        self._logged = c
        self._next_log = 1 << c.bit_length()  # the smallest power of two above c
        self.num_lines += 1
        _log.info("%s", self.summary(when))


_DENOISE, _COMMIT = 0, 1


class FusedCommitPredictor:
    """The asynchronous scheduler's count of each request's denoising steps, which says when a row must be a commit.

    The asynchronous scheduler schedules step S while step S - 1 runs (vLLM's batch queue of two), so it cannot wait
    for the worker's -1 flag (:data:`FUSE_NEXT_FLAG`) as the synchronous one does. But a canvas that has taken
    ``max_denoising_steps`` denoising steps commits next whatever its entropy (the sampler's step cap,
    ``blockdiff.sampler.common.convergence``), so a scheduler that counts the worker's steps knows it in advance.
    Per request this class mirrors the worker's ``(phase, step)`` of the current canvas (phase DENOISE or COMMIT;
    ``step`` = denoising steps taken, as ``SamplerState.step``):

    * the *known* state, after the last row whose output the scheduler has seen (:meth:`observe`): a row that
      returned tokens was a commit (the next canvas starts at step 0, or at step 1 after a fused row of
      ``2 * CL`` tokens, which took that step); a DENOISE row of CL tokens took one step; a row narrower than CL,
      or a DENOISE row wider than CL, was stalled by the worker (no step); a -1 flag means COMMIT now (a canvas that
      converged early, or after the cap); reaching the cap means COMMIT;
    * plus the rows scheduled since and still in flight (:meth:`record`), each applied as the worker will run it
      if no canvas converges early.

    :meth:`width` gives a request ``2 * CL`` (a fused commit: the commit and the next canvas's first denoising
    step) when that predicted state is COMMIT, the commit will not end the request by ``max_tokens``
    (``num_output_tokens`` + CL for each predicted commit in flight + CL < ``max_tokens``), and the whole row fits
    ``max_model_len`` (``num_computed_tokens`` + 2 * CL: vLLM cuts a row at ``max_model_len -
    num_computed_tokens``, and under asynchronous scheduling ``num_computed_tokens`` still counts the row in
    flight); else CL. A canvas that converges before its cap is learnt one step late (its flag or its commit) and
    commits plain, as without fusion. A request vLLM preempts restarts at step 0 of a fresh canvas after its
    re-prefill, as the model state does (:meth:`reset`); the outputs of its rows from before are not counted.
    A wide row that committed nothing (a misprediction, or a worker that does not fuse) turns fusion off for that
    request (liveness: it is never scheduled wide again).

    Args:
        canvas_length: CL, the checkpoint's canvas length (an int >= 1).
        default_max_denoising_steps: the served step cap (an int in ``[1, 2**14)``), used when a request sets no
            ``extra_args["diffusion_max_steps"]``.
        counts: where :meth:`observe` counts each observed row's outcome (fused / plain commit, miss): the
            scheduler's :class:`FusedCommitCounts`; None: a new one (:attr:`counts`).

    Attributes:
        num_wide: rows scheduled ``2 * CL`` wide (rows, counted by :meth:`record`: a row a fuse policy cut is not).
        counts: the :class:`FusedCommitCounts` :meth:`observe` adds to.

    Raises:
        ValueError: an argument out of range or not an int.
    """

    def __init__(self, canvas_length: int, default_max_denoising_steps: int,
                 counts: FusedCommitCounts | None = None) -> None:
        for name, v, hi in (("canvas_length", canvas_length, MAX_CANVAS_WIDTH),
                            ("default_max_denoising_steps", default_max_denoising_steps, MAX_DENOISING_STEPS)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v < hi:
                raise ValueError(f"{name} must be an int in [1, {hi}), got {v!r}")
        self.canvas_length = int(canvas_length)
        self.default_max_denoising_steps = int(default_max_denoising_steps)
        self._known: dict[str, tuple[int, int]] = {}    # req_id -> (phase, step) after the last observed row
        self._pending: dict[str, deque] = {}            # req_id -> rows in flight: (scheduler output, tokens)
        self._caps: dict[str, int | None] = {}
        self._no_fuse: set[str] = set()
        self.num_wide = 0    # rows scheduled 2 * CL wide (counted by record: a row a fuse policy cut is not)
        self.counts = counts if counts is not None else FusedCommitCounts(self.canvas_length, "asynchronous")

    @property
    def num_missed(self) -> int:
        """Rows scheduled wider than CL that committed nothing (rows; ``counts.num_missed``): each turned fusion
        off for its request."""
        return self.counts.num_missed

    def _cap(self, request: Any) -> int | None:
        rid = request.request_id
        if rid not in self._caps:
            self._caps[rid] = request_max_denoising_steps(request, self.default_max_denoising_steps)
        return self._caps[rid]

    def _advance(self, phase: int, step: int, q: int, cap: int, n_tokens: int | None,
                 flag: bool) -> tuple[int, int, bool]:
        """One row of ``q`` tokens from ``(phase, step)``: predicted (``n_tokens`` None: no early convergence) or
        observed (``n_tokens`` the tokens it returned, ``flag`` its -1). Returns ``(phase, step, committed)``."""
        cl = self.canvas_length
        commit = (phase == _COMMIT and q >= cl) if n_tokens is None else n_tokens > 0
        if commit:
            if q == 2 * cl:  # fused: the next canvas's step 0 ran in the same row
                phase, step = (_COMMIT if cap <= 1 else _DENOISE), 1
            else:
                phase, step = _DENOISE, 0
        elif phase == _DENOISE and q == cl:
            step += 1
            if step >= cap:
                phase = _COMMIT
        if flag:
            phase = _COMMIT
        return phase, step, commit

    def width(self, request: Any, max_model_len: int) -> int:
        """Draft tokens the request's next canvas row gets: ``2 * CL`` (a fused commit) or CL (class docstring).

        Args:
            request: vLLM's ``Request`` (reads ``request_id``, ``sampling_params.extra_args``,
                ``num_output_tokens``, ``max_tokens``, ``num_computed_tokens``).
            max_model_len: the scheduler's ``max_model_len`` (an int >= 1).

        Raises:
            ValueError: ``max_model_len`` is not an int >= 1.
        """
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, numbers.Integral) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        cl = self.canvas_length
        rid = request.request_id
        cap = self._cap(request)
        if cap is None or rid in self._no_fuse:
            return cl
        phase, step = self._known.get(rid, (_DENOISE, 0))
        emitted = request.num_output_tokens
        for _, q in self._pending.get(rid, ()):
            phase, step, committed = self._advance(phase, step, q, cap, None, False)
            emitted += cl if committed else 0
        if phase != _COMMIT:
            return cl
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is not None and emitted + cl >= max_tokens:  # the commit ends the request: nothing to fuse
            return cl
        if request.num_computed_tokens + 2 * cl > max_model_len:
            return cl
        return 2 * cl

    def record(self, scheduler_output: Any) -> None:
        """Count the canvas rows of a step just scheduled (``scheduled_spec_decode_tokens``: rows with draft
        tokens; their widths from ``num_scheduled_tokens``) as in flight, and forget the requests in
        ``finished_req_ids``. The widths are the ones vLLM scheduled, so a row :meth:`width` gave ``2 * CL`` but a
        fuse policy (:func:`keep_uniform_widths`) or vLLM's budget cut is counted at its real width: a CL row of a
        COMMIT is a plain commit, never a miss, and :attr:`num_wide` counts only rows scheduled ``2 * CL``."""
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.drop(rid)
        n = scheduler_output.num_scheduled_tokens
        wide = 2 * self.canvas_length
        for rid in scheduler_output.scheduled_spec_decode_tokens:
            dq = self._pending.get(rid)
            if dq is None:
                self._pending[rid] = dq = deque()
            q = int(n[rid])
            self.num_wide += q == wide
            dq.append((scheduler_output, q))

    def observe(self, scheduler_output: Any, model_runner_output: Any, flagged: Iterable[str],
                requests: Mapping[str, Any]) -> None:
        """Move each request's known state over its row of ``scheduler_output`` (class docstring), from the
        worker's output of that step: tokens returned (``sampled_token_ids``) and -1 flags (``flagged``, from
        :func:`split_fuse_flags`). Rows recorded before a :meth:`reset` (a preemption) are not counted. Each row's
        outcome goes to :attr:`counts`: a row that returned tokens is a fused commit when it was ``2 * CL`` wide,
        else a plain one; a row wider than CL that returned none is a miss."""
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        flagged = flagged if isinstance(flagged, (set, frozenset)) else set(flagged)
        counts = self.counts
        for rid in scheduler_output.scheduled_spec_decode_tokens:
            dq = self._pending.get(rid)
            if not dq or dq[0][0] is not scheduler_output:
                continue
            _, q = dq.popleft()
            if not dq:
                del self._pending[rid]
            req = requests.get(rid)
            cap = self._cap(req) if req is not None else None
            if cap is None:
                continue
            i = index.get(rid)
            n_tokens = len(sampled[i]) if sampled and i is not None and i < len(sampled) else 0
            phase, step = self._known.get(rid, (_DENOISE, 0))
            phase, step, committed = self._advance(phase, step, q, cap, n_tokens, rid in flagged)
            if counts.count_row(q, committed):  # a wide row that committed nothing: never fuse it again
                self._no_fuse.add(rid)
                if counts.num_missed == 1:
                    _log.warning("blockdiff: a %d-token row of request %s committed nothing (a step count that "
                                 "disagrees with the worker's, or a worker that does not fuse: BLOCKDIFF_FUSE_COMMIT "
                                 "unset there?); that request is no longer fused (logged once)", q, rid)
            self._known[rid] = (phase, step)

    def reset(self, req_id: str) -> None:
        """The request was preempted: it restarts from a fresh canvas at step 0 after its re-prefill (the model
        state's ``add_request``); its rows in flight no longer count."""
        self._known.pop(req_id, None)
        self._pending.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        """Forget a finished request."""
        self.reset(req_id)
        self._caps.pop(req_id, None)
        self._no_fuse.discard(req_id)

    def state(self, req_id: str) -> tuple[str, int, int]:
        """``(phase, step, rows in flight)`` of a request's known state (``"DENOISE"`` / ``"COMMIT"``), for tests and
        logs."""
        phase, step = self._known.get(req_id, (_DENOISE, 0))
        return ("COMMIT" if phase == _COMMIT else "DENOISE"), step, len(self._pending.get(req_id, ()))


def split_fuse_flags(num_nans_in_logits: Mapping[str, int] | None) -> tuple[set[str], Mapping[str, int] | None]:
    """Split the worker's ``num_nans_in_logits`` into the fused-commit requests and what vLLM may see.

    Returns:
        ``(fuse_next, cleaned)``: the ids whose value is < 0 (:data:`FUSE_NEXT_FLAG`: the next row may be a fused
        commit), and the mapping with every value ``max(n, 0)`` (the input itself when nothing was negative, None
        stays None), so vLLM's own count of failed requests never sees a flag.

    Raises:
        TypeError: ``num_nans_in_logits`` is neither a mapping nor None, or a value is not an int.
    """
    if num_nans_in_logits is None:
        return set(), None
    if not isinstance(num_nans_in_logits, Mapping):
        raise TypeError(f"num_nans_in_logits must be a dict (req_id -> int) or None, got "
                        f"{type(num_nans_in_logits).__name__}")
    fuse = set()
    for rid, n in num_nans_in_logits.items():
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):  # int: fast path
            raise TypeError(f"num_nans_in_logits[{rid!r}] must be an int, got {type(n).__name__} ({n!r})")
        if n < 0:
            fuse.add(rid)
    if not fuse:
        return fuse, num_nans_in_logits
    return fuse, {rid: max(int(n), 0) for rid, n in num_nans_in_logits.items()}


def cut_draft_widths(scheduler: Any, draft_token_ids: Any, fuse_next: set[str] | frozenset[str]) -> None:
    """Cut each request's draft list (vLLM's ``DraftTokenIds``, in place) to the width its next row schedules:
    ``2 * w`` for a request in ``fuse_next`` whose committed canvas plus the next one fit
    (``num_tokens + 2 * w <= max_model_len``), else ``w`` (``w``: :func:`diffusion_canvas_width` with the
    scheduler's CL). Lists already shorter stay as they are; unknown ids and requests with a bad canvas width (which
    :func:`finish_stuck_requests` fails) are left alone.

    Args:
        scheduler: reads ``requests``, ``max_model_len`` and CL (``blockdiff_canvas_length`` /
            ``num_spec_tokens``).
        draft_token_ids: has ``req_ids`` (list of str) and ``draft_token_ids`` (list of lists, changed in place).
        fuse_next: the ids :func:`split_fuse_flags` collected from the step that produced these drafts.
    """
    cl = _canvas_length_of(scheduler)
    lists = draft_token_ids.draft_token_ids
    for i, rid in enumerate(draft_token_ids.req_ids):
        req = scheduler.requests.get(rid)
        if req is None:
            continue
        try:
            width = diffusion_canvas_width(req, cl)
        except ValueError:
            continue
        if rid in fuse_next and req.num_tokens + 2 * width <= scheduler.max_model_len:
            width *= 2
        if len(lists[i]) > width:
            lists[i] = lists[i][:width]


def cut_spec_tokens(scheduler: Any, predictor: "FusedCommitPredictor | None" = None) -> list:
    """Cut every running request's ``spec_token_ids`` (vLLM's placeholders, ``num_spec_tokens`` = ``2 * CL`` wide
    in the fused layout) to the width its next row schedules: what the asynchronous scheduler does before each
    ``schedule`` when served in the fused layout (served with CL it skips this per-request loop). A new list is
    assigned (vLLM's placeholder list is shared between requests).

    Args:
        scheduler: reads ``running``, ``max_model_len`` and CL (``blockdiff_canvas_length`` / ``num_spec_tokens``).
        predictor: None (fused commits off): every list is cut to the request's canvas width
            (:func:`diffusion_canvas_width` with the scheduler's CL). A :class:`FusedCommitPredictor` (fused commits
            on): a request of width CL whose placeholders are wider than CL gets the width the predictor gives it
            (CL, or ``2 * CL`` for a predicted fused commit); lists of at most CL stay as they are, and a request with
            another canvas width (``extra_args["diffusion_canvas_length"]``, which the model state refuses) gets
            that width.

    Returns:
        The requests whose lists the predictor left ``2 * CL`` wide, in ``running`` order ([] without a
        predictor): what :func:`keep_uniform_widths` may cut.
    """
    cl = _canvas_length_of(scheduler)
    mml = scheduler.max_model_len
    wide: list[Any] = []
    for req in scheduler.running:
        spec = req.spec_token_ids
        if predictor is not None and len(spec) <= cl:
            continue
        try:
            width = diffusion_canvas_width(req, cl)
        except ValueError:
            continue
        if predictor is not None and width == cl:
            width = predictor.width(req, mml)
            if width > cl:
                wide.append(req)
        if len(spec) > width:
            req.spec_token_ids = spec[:width]
    return wide


def _row_limits(scheduler: Any) -> tuple[int | None, int]:
    """``(max_num_scheduled_tokens or None, long_prefill_token_threshold or 0)``: the two limits vLLM (0.26.0 /
    0.33.0 ``Scheduler.schedule``) cuts a running row to; a missing attribute (or None) is no limit."""
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    threshold = getattr(getattr(scheduler, "scheduler_config", None), "long_prefill_token_threshold", None) or 0
    return budget, threshold


def wide_rows_fit(scheduler: Any) -> bool:
    """Whether vLLM can schedule a fused row's ``2 * CL`` tokens whole in one step: ``2 * CL <=`` the scheduler's
    ``max_num_scheduled_tokens`` (the step's token budget) and ``scheduler_config.long_prefill_token_threshold``
    (which vLLM 0.26.0 / 0.33.0 apply to running rows too, ``Scheduler.schedule``) is 0 (off) or ``>= 2 * CL``.
    When it is False the plugin's schedulers never keep a wide row (no fused commits): every one would be cut to
    ``CL < q < 2 * CL`` tokens, commit plain and pay for ``q - CL`` discarded tokens (docs/tuning.md 7.38, review,
    "Left open"). Both limits are fixed at start.

    Args:
        scheduler: reads ``max_num_scheduled_tokens``, ``scheduler_config.long_prefill_token_threshold`` and CL
            (``blockdiff_canvas_length`` / ``num_spec_tokens``); a missing attribute (or None) is no limit.
    """
    wide = 2 * _canvas_length_of(scheduler)
    budget, threshold = _row_limits(scheduler)
    return (budget is None or wide <= budget) and (threshold <= 0 or wide <= threshold)


def check_canvas_rows_fit(scheduler: Any) -> None:
    """Refuse a scheduler that could never schedule a canvas row whole: vLLM (0.26.0 / 0.33.0 ``Scheduler.schedule``)
    cuts every running row to ``scheduler_config.long_prefill_token_threshold`` tokens when that is above 0, and to
    the step's token budget (``max_num_scheduled_tokens``), canvas rows included. Below CL every canvas row would be
    cut, the sampler can only stall a cut canvas, and every request would run forever without a token (0.33.0 lifts
    the threshold while a single request is eligible, so there with two or more). vLLM 0.26.0 sets such a threshold
    itself: ``--max-num-partial-prefills`` above 1 with the threshold unset gives 4 % of ``max_model_len``.

    Args:
        scheduler: reads CL (``blockdiff_canvas_length`` / ``num_spec_tokens``), ``max_num_scheduled_tokens`` and
            ``scheduler_config.long_prefill_token_threshold`` (a missing attribute, or None, is no limit).

    Raises:
        ValueError: the threshold is in ``[1, CL)`` or the token budget is below CL (naming the limit, its value
            and the canvas length).
    """
    cl = _canvas_length_of(scheduler)
    budget, threshold = _row_limits(scheduler)
    if 0 < threshold < cl:
        raise ValueError(f"long_prefill_token_threshold ({threshold}) is below the served canvas_length {cl}: vLLM cuts "
                         f"every running row to it, so no canvas could be denoised whole and every request would hang "
                         f"(--long-prefill-token-threshold 0 or >= {cl}; with --max-num-partial-prefills > 1 vLLM "
                         f"0.26's default is 4 % of max_model_len)")
    if budget is not None and budget < cl:
        raise ValueError(f"the token budget max_num_scheduled_tokens ({budget}) is below the served canvas_length {cl}: "
                         f"no canvas could be scheduled whole and every request would hang "
                         f"(--max-num-batched-tokens >= {cl})")


def _schedule_skips(req: Any, next_step: int | None) -> bool:
    """Whether vLLM's next ``Scheduler.schedule`` call (0.26.0 / 0.33.0, running loop) passes over a running
    request before sizing its row: not yet decode-eligible (``current_step`` is advanced first, then
    ``current_step < next_decode_eligible_step`` skips), or, asynchronous, its rows in flight already reach
    ``max_tokens`` (``num_computed_tokens + 2 - num_output_placeholders >= num_prompt_tokens + max_tokens``)."""
    if next_step is not None and next_step < (getattr(req, "next_decode_eligible_step", 0) or 0):
        return True
    placeholders = getattr(req, "num_output_placeholders", 0) or 0
    max_tokens = getattr(req, "max_tokens", None)
    return placeholders > 0 and max_tokens is not None and \
        req.num_computed_tokens + 2 - placeholders >= req.num_prompt_tokens + max_tokens


def keep_uniform_widths(scheduler: Any, wide: list | None = None) -> int:
    """The ``uniform`` fuse policy (:data:`FUSE_POLICY_ENV`), run just before vLLM's ``schedule``: keep the
    ``2 * CL`` lists (fused commits) only if every canvas row that call will schedule is a whole ``2 * CL`` row;
    otherwise cut each of them to CL. A cut request's row is then a plain commit of its converged canvas, exactly
    as without fusion (the worker commits a CL row in phase COMMIT; :class:`FusedCommitPredictor` records the
    width vLLM scheduled, so the cut row counts as a plain commit and never as a miss).

    Why (vLLM 0.26.0 model runner v2; docs/tuning.md 7.37 (a), 7.40): ``GPUModelRunner.execute_model`` sizes a step
    by ``get_uniform_token_count(num_reqs, num_tokens, max_query_len)`` over ``scheduler_output.
    num_scheduled_tokens``: every scheduled request, prefill chunks included; the step is uniform when every
    request's count equals the largest. ``CudaGraphManager.dispatch`` replays a FULL graph only for a descriptor
    whose ``uniform_token_count`` equals that count exactly (``_is_compatible``), i.e. ``decode_query_len`` = 2 * CL
    or, with :mod:`blockdiff.integration.vllm_graphs`, CL, and whose size was captured; any other step runs
    PIECEWISE. So a fused row beside plain canvas rows makes a step PIECEWISE that would have been FULL, and this
    policy keeps such steps uniform: canvas rows all CL, or all ``2 * CL`` (also one request alone). A step with a
    prefill row (a new or resumed request, or a prompt chunk) is not uniform whatever the canvas widths (0.33.0's
    runner also checks ``decode_graph_eligible = not has_prefill``); the policy does not look at those rows (a
    waiting request is admitted only after the running ones are sized), so in such a step it may cut fused rows
    that would have cost no graph.

    Which rows (mirroring vLLM's running loop, ``Scheduler.schedule`` in 0.26.0 / 0.33.0): the running requests
    vLLM will size (:func:`_schedule_skips`); a canvas row is one with draft tokens (``spec_token_ids`` not empty).
    The ``2 * CL`` lists are kept when every such canvas row is ``2 * CL`` and its row is whole
    (``num_tokens + len(spec_token_ids) + num_output_placeholders - num_computed_tokens``, which vLLM schedules, is
    ``2 * CL`` and within ``max_model_len - num_computed_tokens``), and the rows of all those requests together,
    counted whole, fit ``max_num_scheduled_tokens`` (so vLLM's budget cuts none of them; waiting requests are
    sized after them). Lists of requests vLLM passes over are left alone (they are judged again when they run).

    Args:
        scheduler: a vLLM ``Scheduler`` served in the fused layout (reads ``running``, ``max_model_len``,
            ``max_num_scheduled_tokens``, ``current_step``, CL; sets ``spec_token_ids`` to new lists, never
            changing vLLM's shared placeholder list).
        wide: the running requests whose lists are ``2 * CL`` when the caller knows them (the asynchronous
            scheduler, from :func:`cut_spec_tokens`): the scan then stops at the first plain canvas row. None: found
            in the scan (the synchronous scheduler, whose lists come from the worker's flags).

    Returns:
        How many ``2 * CL`` lists it cut to CL (0 when the step stays uniform, or has no fused row).
    """
    cl = _canvas_length_of(scheduler)
    wide_len = 2 * cl
    mml = scheduler.max_model_len
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    step = getattr(scheduler, "current_step", None)
    next_step = None if step is None else step + 1
    known = wide is not None
    if known:
        wide = [req for req in wide if not _schedule_skips(req, next_step)]
        if not wide:
            return 0
    else:
        wide = []
    uniform = True
    demand = 0
    for req in scheduler.running:
        if _schedule_skips(req, next_step):
            continue
        spec = req.spec_token_ids
        computed = req.num_computed_tokens
        row = min(req.num_tokens + len(spec) + (getattr(req, "num_output_placeholders", 0) or 0) - computed,
                  mml - computed)
        if row <= 0:
            continue
        demand += row
        if not spec:  # a prefill chunk: not a canvas row (only its tokens count, against the budget)
            continue
        if len(spec) == wide_len:
            if not known:
                wide.append(req)
            uniform = uniform and row == wide_len
        else:
            uniform = False
            if known:  # decided: a plain canvas row beside the fused ones
                break
    if not wide or (uniform and (budget is None or demand <= budget)):
        return 0
    for req in wide:
        req.spec_token_ids = req.spec_token_ids[:cl]
    return len(wide)


def finish_stuck_requests(scheduler: Any, num_nans_in_logits: Mapping[str, int] | None, outputs: dict,
                          *, types: Any) -> list[tuple[str, str]]:
    """Finish the requests vLLM would never finish (see the module docstring) and answer their clients.

    Args:
        scheduler: a vLLM ``Scheduler`` (reads ``requests``, ``running``, ``max_model_len`` and CL:
            ``blockdiff_canvas_length``, else ``num_spec_tokens``; calls ``finish_requests``).
        num_nans_in_logits: ``ModelRunnerOutput.num_nans_in_logits`` of the step (req_id -> count), or None; a
            value > 0 is a failed request, <= 0 is not (-1: :data:`FUSE_NEXT_FLAG`).
        outputs: what ``update_from_output`` returned: client index -> ``EngineCoreOutputs``; updated in place.
        types: namespace with vLLM's ``RequestStatus``, ``EngineCoreOutput``, ``EngineCoreOutputs``.

    Returns:
        ``[(req_id, "error" | "length")]`` in the order finished. "length": the next canvas (CL tokens, not a fused
        row's ``2 * CL``) no longer fits ``max_model_len``.

    Also, under asynchronous scheduling, a running request whose next canvas fits but whose next row vLLM would cut
    below a canvas (``num_computed_tokens``, which counts the row in flight, + the canvas > ``max_model_len``) is
    skipped by the next ``schedule`` call (``next_decode_eligible_step``; docs/tuning.md 7.38 "Review"): the worker
    would stall such a row, so near ``max_model_len`` every other row was a wasted forward pass. Same tokens.
    """
    RS = types.RequestStatus
    cl = _canvas_length_of(scheduler)
    failed: list[str] = []
    for rid in sorted(r for r, n in (num_nans_in_logits or {}).items() if n is not None and n > 0):
        req = scheduler.requests.get(rid)
        if req is not None and not req.is_finished():
            failed.append(rid)
    too_long: list[str] = []
    step = getattr(scheduler, "current_step", None)  # async deferral below; vLLM versions without it: none
    for req in list(scheduler.running):
        if req.request_id in failed or req.is_finished():
            continue
        try:
            width = diffusion_canvas_width(req, cl)
        except ValueError:  # a canvas width no model state serves: the request can only fail (answered, not lost)
            failed.append(req.request_id)
            continue
        if req.num_tokens + width > scheduler.max_model_len:
            too_long.append(req.request_id)
        elif step is not None and req.num_computed_tokens > req.num_tokens and \
                req.num_computed_tokens + width > scheduler.max_model_len:
            # asynchronous: a row in flight (vLLM's num_computed_tokens counts it) and vLLM would cut the next row
            # at max_model_len - num_computed_tokens, below a canvas: the worker would stall it. Skip the request
            # in the next schedule call instead (vLLM's own decode-eligibility step, as 0.33.0's read-only
            # diffusion requests use it); once that row's output is in, the canvas fits again.
            req.next_decode_eligible_step = max(getattr(req, "next_decode_eligible_step", 0) or 0, step + 2)
    done: list[tuple[str, str]] = []
    for ids, status, reason in ((failed, RS.FINISHED_ERROR, "error"), (too_long, RS.FINISHED_LENGTH_CAPPED,
                                                                         "length")):
        if not ids:
            continue
        for req in scheduler.finish_requests(ids, status):
            _answer(outputs, req, types)
            done.append((req.request_id, reason))
    return done


def _answer(outputs: dict, req: Any, types: Any, error: str | None = None) -> None:
    """Append a finished request's ``EngineCoreOutput`` (no new tokens, its finish reason) to ``outputs`` (client
    index -> ``EngineCoreOutputs``, created when missing), so its client is answered. ``error``: why the request was
    refused; where vLLM's output carries a request error (``types.RequestError`` set: vLLM 0.33.0's
    ``EngineCoreOutput.error``) it goes there as ``RequestError(code="validation_error", message=error)``, which
    vLLM's client raises as ``VLLMValidationError`` (:data:`VALIDATION_ERROR`); elsewhere it is not sent (0.26.0:
    the caller logs it)."""
    request_type = getattr(types, "RequestError", None)  # a stand-in namespace without it: none
    request_error = None if error is None or request_type is None else request_type(code=VALIDATION_ERROR,
                                                                                     message=error)
    if request_error is None:
        out = types.EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
            stop_reason=req.stop_reason, num_nans_in_logits=getattr(req, "num_nans_in_logits", 0),
            trace_headers=getattr(req, "trace_headers", None), events=req.take_events())
    else:  # vLLM >= 0.33 (feature-detected: _vllm_types)
        out = types.EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
            stop_reason=req.stop_reason, num_nans_in_logits=getattr(req, "num_nans_in_logits", 0),
            trace_headers=getattr(req, "trace_headers", None), events=req.take_events(), error=request_error)
    eco = outputs.get(req.client_index)
    if eco is None:
        outputs[req.client_index] = eco = types.EngineCoreOutputs(outputs=[])
    eco.outputs.append(out)


#: ``RequestError.code`` of a request the plugin's schedulers refuse (vLLM 0.33.0: the client raises
#: ``VLLMValidationError`` with the message, which vLLM's API server answers with HTTP 400 (a non-streaming request;
#: a streamed one gets an error event in its stream), as its own request validation does:
#: ``EngineCore._handle_request_validation_error``).
VALIDATION_ERROR = "validation_error"


def _fail_at_add(scheduler: Any, request: Any, add: Any, types: Any) -> list:
    """Hand ``request`` to vLLM's own ``add_request`` (its queues, KV connector hooks, stats; skipped when its id is
    live) and finish it at once with ``FINISHED_ERROR`` (``finish_requests``, as vLLM's ``abort_immediately`` path
    does), before any ``schedule``: no KV block is allocated, nothing reaches the worker but the id in
    ``finished_req_ids``. Returns the finished requests, whose clients :meth:`_Refusals.flush` answers."""
    error = types.RequestStatus.FINISHED_ERROR
    rid = request.request_id
    if rid not in scheduler.requests:
        add(request)
    finished = scheduler.finish_requests([rid], error)
    if not finished:  # the id is a request vLLM finished already but still holds (a KV connector's delayed free)
        request.status = error
        finished = [request]
    return finished


class _Refusals:
    """Requests refused in ``add_request`` whose clients the next ``update_from_output`` answers (:meth:`flush`)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, str]] = []  # (refused request, why) for the next flush
        self.num_refused = 0

    def _refuse(self, scheduler: Any, request: Any, add: Any, types: Any, why: str) -> None:
        self._pending.extend((r, why) for r in _fail_at_add(scheduler, request, add, types))
        self.num_refused += 1

    def flush(self, outputs: dict, types: Any) -> int:
        """Answer the clients of the requests refused since the last call: one ``EngineCoreOutput`` each (no token,
        finish reason ``error``; under vLLM 0.33.0 also ``error`` = ``RequestError(code="validation_error",
        message=<why>)``, :func:`_answer`) appended to ``outputs`` (client index -> ``EngineCoreOutputs``, what
        ``update_from_output`` returns; updated in place). Returns how many.

        Args:
            outputs: as ``update_from_output`` returns them.
            types: namespace with vLLM's ``EngineCoreOutput``, ``EngineCoreOutputs`` and ``RequestError`` (None
                where ``EngineCoreOutput`` has no ``error``).
        """
        pending, self._pending = self._pending, []
        for req, why in pending:
            _answer(outputs, req, types, why)
        return len(pending)


#: Why a request with an empty prompt is refused. vLLM's input processor refuses one ("The decoder prompt cannot be
#: empty"), but an ``EngineCoreRequest`` passed to ``LLMEngine`` / ``AsyncLLM.add_request`` reaches the scheduler, whose
#: ``schedule`` then fails its ``assert num_new_tokens > 0`` in the engine core (0.26.0 and 0.33.0): the engine died.
EMPTY_PROMPT_REFUSED = ("the prompt is empty (prompt_token_ids holds no token): a block-diffusion request needs at "
                        "least one prompt token")


class ParamsRefusals(_Refusals):
    """The plugin's schedulers refuse, at ``add_request``, a new request whose sampling parameters blockdiff cannot
    honour: it fails alone, finish reason ``error``, before it is ever scheduled (no forward pass, no KV block, no
    worker slot), and its client learns why.

    The rules are the model state's, applied by the same function with the same inputs:
    :func:`blockdiff.integration.vllm_params.vllm_request_params` with the served defaults and canvas length
    (:func:`served_default_params`, :func:`served_canvas_length`: built from the scheduler's ``VllmConfig``, as the
    model state builds its own) and the model's vocabulary size (``model_config.get_vocab_size()``). So a vLLM
    option the sampler does not implement (``top_k``, ``logprobs``, ...), an unknown ``extra_args`` key,
    a temperature other than 0 or 1, an ``extra_args`` value breaking a :class:`blockdiff.sampler.SamplingParams`
    rule (against the served defaults: e.g. ``t_max`` below the served ``t_min``), a canvas length other than the
    served one, a bad ``rng_request_id``, more than ``MAX_STOP_TOKEN_IDS`` stop ids or a stop id outside the
    vocabulary is refused here; so is an empty prompt (:data:`EMPTY_PROMPT_REFUSED`: vLLM's front end refuses one, a
    hand-built ``EngineCoreRequest`` got past it and took the engine down in vLLM's ``schedule``). The model state's
    check stays as the backstop (a request reaching the worker another way fails there, the reason in the worker's
    log). ``n`` > 1 is refused only on a request that reaches
    the engine with it (an ``EngineCoreRequest`` built by hand): vLLM's ``LLMEngine`` and ``AsyncLLM`` (0.26.0 and
    0.33.0, ``parallel_sampling.ParentRequest``) fan it out first into ``n`` requests of ``n`` = 1 with their own ids,
    which are served as any others.

    What the client gets: vLLM 0.33.0 (``EngineCoreOutput.error``, ``vllm.outputs.RequestError``, detected by
    feature): the refused request's output carries ``RequestError(code="validation_error", message=...)``, the
    ``ValueError`` / ``TypeError`` text naming the option and the rule; ``AsyncLLM`` (the API server) raises it in
    the caller as ``VLLMValidationError`` (from the OpenAI server: HTTP 400 for a non-streaming request; a
    streamed one, past its HTTP 200, gets an error event with code 400 in its stream, and vLLM logs the exception
    with its traceback), while ``LLMEngine`` (offline) drops the
    message and gives a finished output with finish reason ``error``. vLLM 0.26.0 has no such field: finish reason
    ``error`` only. In both the message is logged at WARNING once per request (``blockdiff: request <id>
    refused: ...``).

    Not checked here (vLLM's rules, or none to check): vLLM's start-up warm-up ids (the model state serves them
    with the defaults), a request without ``sampling_params`` (pooling), vLLM 0.33's ``abort_immediately``
    requests, and a request whose id is live (vLLM's own ``add_request`` decides, as before).

    Args:
        defaults: the served blockdiff ``SamplingParams`` (:func:`served_default_params`).
        canvas_length: the served CL.
        vocab_size: the model's vocabulary size (None: stop ids not checked against it).

    Attributes:
        num_refused: requests refused so far.
    """

    def __init__(self, defaults: Any, canvas_length: int, vocab_size: int | None = None) -> None:
        super().__init__()
        self.defaults = defaults
        self.canvas_length = int(canvas_length)
        self.vocab_size = vocab_size

    def reason(self, request: Any) -> str | None:
        """Why ``request`` is refused (the ``ValueError`` / ``TypeError`` text), or None when it is not."""
        if getattr(request, "abort_immediately", False):
            return None
        if getattr(request, "num_prompt_tokens", None) == 0:  # (vLLM's scheduler asserted on it: the engine died)
            return EMPTY_PROMPT_REFUSED
        sp = getattr(request, "sampling_params", None)
        if sp is None or is_vllm_warmup_request_id(request.request_id):
            return None
        try:
            vllm_request_params(sp, request.request_id, self.defaults, canvas_length=self.canvas_length,
                                vocab_size=self.vocab_size)
        except (TypeError, ValueError) as e:
            return str(e)
        return None

    def intercept(self, scheduler: Any, request: Any, add: Any, *, types: Any) -> bool:
        """Refuse ``request`` when :meth:`reason` says so (added to vLLM, finished with ``FINISHED_ERROR`` at once,
        its client answered by the next :meth:`flush`); the scheduler's ``add_request`` hands it to vLLM only when
        this returns False.

        Args:
            scheduler: a vLLM ``Scheduler`` (reads ``requests``; calls ``finish_requests``).
            request: vLLM's ``Request``.
            add: vLLM's own ``add_request`` (the base class's).
            types: namespace with vLLM's ``RequestStatus`` (``FINISHED_ERROR``).
        """
        if request.request_id in scheduler.requests:  # a live id: vLLM's own add_request decides, as before
            return False
        why = self.reason(request)
        if why is None:
            return False
        self._refuse(scheduler, request, add, types, why)
        _log.warning("blockdiff: request %s refused: %s; it fails (finish reason 'error')", request.request_id, why)
        return True


#: Why a streaming-input request is refused (logged at WARNING; the request's finish reason is ``error``).
STREAMING_INPUT_REFUSED = (
    "streaming input (a resumable request: vLLM's streaming-input session, which continues a request with a longer "
    "prompt) is not supported for block-diffusion models (vLLM 0.33 refuses it for diffusion models too)")
#: Refused streaming-input sessions a scheduler remembers, to refuse their later input chunks quietly and drop their
#: end-of-input request (:class:`StreamingInputRefusals`); beyond this the least recently active is forgotten (a
#: forgotten session's later end-of-input then runs as a new request of prompt ``[0]`` that its client, finished
#: already, no longer reads: compute spent, no answer lost). A session vLLM 0.33's client aborted stays until then.
#: The memory is per engine: vLLM 0.26's load-balancing data-parallel client routes each request of a session on its
#: own, so an end-of-input sent to an engine that refused none of the session's chunks runs the same way.
MAX_REFUSED_SESSIONS = 4096


def is_end_of_input(request: Any, since: float | None) -> bool:
    """Whether a non-resumable ``request`` whose id is a refused streaming-input session is that session's
    end-of-input request (to be dropped) rather than a new request that reuses the id (to be served).

    vLLM's ``AsyncLLM._add_streaming_input_request`` (0.26.0 and 0.33.0) builds the end-of-input request before any
    input chunk: prompt ``[0]`` and an ``arrival_time`` no later than the chunks'. A new request reusing the
    id (possible where request ids are not randomised: ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, or an engine-core
    client that names its own ids; a session vLLM 0.33's client aborted sends no end-of-input) arrives after the
    session's chunks, or has another prompt. ``since`` is the latest chunk's arrival, so that the end-of-input of a
    new session reusing an abandoned session's id (built after the old chunks, before its own) is still dropped.

    Args:
        request: vLLM's ``Request`` (reads ``prompt_token_ids`` and ``arrival_time``).
        since: the latest ``arrival_time`` of the session's refused chunks (None: unknown, only the prompt decides).
    """
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None or len(ids) != 1 or int(ids[0]) != 0:
        return False
    arrival = getattr(request, "arrival_time", None)
    return since is None or arrival is None or arrival <= since


class StreamingInputRefusals(_Refusals):
    """The plugin's schedulers refuse vLLM's streaming-input requests: each fails alone, finish reason ``error``.

    What vLLM does with one (both checked versions have the feature: ``EngineCoreRequest.resumable``,
    ``Request.resumable``, the scheduler's ``WAITING_FOR_STREAMING_REQ`` sessions; ``AsyncLLM.generate`` with an
    async generator of ``StreamingInput`` sends each input chunk as a request with ``resumable=True`` and one id, then
    a request with ``resumable=False`` and prompt ``[0]`` that ends the input). The first chunk runs as a normal
    request; where it stops (``max_tokens``, a stop id) vLLM keeps it, its KV blocks and its worker slot, and the next
    chunk continues it (``Scheduler._update_request_as_session``): prompt = old prompt + the output kept + the new
    chunk, ``sampling_params`` (0.33.0 also ``max_tokens``) from the chunk, the output count back to 0, and the worker
    re-adds it (``add_requests``: ``_remove_request`` then the model state's ``add_request`` with the longer prompt as
    ``prompt_token_ids``). Through the plugin's hooks that goes wrong in each version (reproduced on the CPU with
    vLLM's own schedulers, ``tests/integration/test_vllm_streaming_input.py``):

    * 0.33.0: ``AsyncLLM`` refuses such a session for a diffusion model at the front
      (``_validate_resumable_request``), but an ``EngineCoreRequest(resumable=True)`` passed to
      ``LLMEngine.add_request`` / ``AsyncLLM.add_request`` (deprecated, accepted) or sent by another engine-core
      client reaches the scheduler. The continuation drops the last output token, for a token-by-token model the
      one without KV, and asserts ``num_tokens - 1 >= num_computed_tokens``; a diffusion commit writes the KV of all
      its tokens (``num_computed_tokens == num_tokens``), so the assert fails in the engine core's loop and the
      engine dies with every request; under ``python -O`` the next chunk's first token is taken as computed (the
      dropped token's KV) instead;
    * 0.26.0: ``AsyncLLM`` accepts the session for a diffusion model. The continuation keeps every output token but
      not the chunk's ``max_tokens``: the scheduler counts the continuation's output against the first chunk's, the
      model state against the chunk's, so a chunk asking for fewer tokens than the first is scheduled on after the
      model state's last canvas and never finishes (one asking for more is cut at the first chunk's count);
    * both: the model state sees a new request whose prompt holds the old output, so its next canvas restarts the
      request's RNG stream at canvas index 0: the first chunk's noise again, where vLLM's own sampler keys a seeded
      request's noise by position, so that a continuation draws new noise.

    So the plugin refuses the feature, as vLLM 0.33 does for diffusion models. Supporting it would mean replacing
    vLLM's continuation rule inside its scheduler (which tokens are kept, where the KV frontier is, whose
    ``max_tokens`` counts) for a feature vLLM declares unsupported for diffusion models, with no vLLM semantics to
    follow for a diffusion request's RNG stream. A request with ``resumable=True``
    (:meth:`intercept`, from the scheduler's ``add_request``) is handed to vLLM's ``add_request`` (its queues, KV
    connector hooks, stats) and finished at once with ``FINISHED_ERROR`` (``finish_requests``, as vLLM's
    ``abort_immediately`` path does), before it is ever scheduled, and its client is answered in the next
    ``update_from_output`` (:meth:`flush`). The session id is remembered (at most :data:`MAX_REFUSED_SESSIONS`): a
    later input chunk (``resumable=True``) is refused the same way (each chunk gets its ``error``: vLLM 0.26's client
    ends a chunk at each finish reason), and the end-of-input request (``resumable=False``, the same id, prompt
    ``[0]``, built before the first chunk, so arriving no later than the chunks: :func:`is_end_of_input`) is dropped
    (no request is created; vLLM's client answers it itself), where vLLM would otherwise run it as a new request of
    prompt ``[0]``. Any other non-resumable request of that id (a new request reusing it: a session vLLM 0.33's
    client aborted never sends an end-of-input) is served as usual and the session forgotten. A streaming chunk whose
    id names a live request that is not a session (vLLM asserts "duplicate request id" there) fails that request
    too. Other requests are never touched.

    Args:
        capacity: sessions remembered (an int >= 1; default :data:`MAX_REFUSED_SESSIONS`).

    Attributes:
        num_refused: streaming-input requests refused (input chunks; a session of three chunks counts 3).
        num_dropped: end-of-input requests of refused sessions dropped.

    Raises:
        ValueError: ``capacity`` is not an int >= 1.
    """

    def __init__(self, capacity: int = MAX_REFUSED_SESSIONS) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (sessions), got {capacity!r}")
        super().__init__()
        self.capacity = int(capacity)
        # refused session ids, oldest first -> the latest arrival_time of the session's refused chunks
        self._sessions: OrderedDict[str, float | None] = OrderedDict()
        self.num_dropped = 0

    def __contains__(self, req_id: object) -> bool:
        """Whether ``req_id`` is a remembered refused session."""
        return req_id in self._sessions

    def intercept(self, scheduler: Any, request: Any, add: Any, *, types: Any) -> bool:
        """Handle ``request`` here when it belongs to vLLM's streaming input; the scheduler's ``add_request``
        calls this first and hands the request to vLLM only when it returns False.

        Args:
            scheduler: a vLLM ``Scheduler`` (reads ``requests``; calls ``finish_requests``).
            request: vLLM's ``Request`` (reads ``request_id`` and ``resumable``, False when the attribute is
                missing; a refused one gets ``status`` ``FINISHED_ERROR``).
            add: vLLM's own ``add_request`` (the base class's), called for a refused chunk whose id is not live.
            types: namespace with vLLM's ``RequestStatus`` (``FINISHED_ERROR``).

        Returns:
            True when handled (a streaming-input chunk, refused; an end-of-input request of a refused session,
            dropped), False for any other request (and for vLLM 0.33's ``abort_immediately`` requests, which vLLM
            adds and aborts at once itself).
        """
        rid = request.request_id
        if getattr(request, "abort_immediately", False):  # vLLM 0.33's cleanup marker: added and aborted at once
            return False
        if not getattr(request, "resumable", False):
            if rid not in self._sessions:
                return False
            # forgotten either way: the session's input has ended, or the id now names a new request
            since = self._sessions.pop(rid)
            if not is_end_of_input(request, since):
                _log.debug("blockdiff: request %s reuses the id of a refused streaming-input session: served as a new "
                           "request", rid)
                return False
            self.num_dropped += 1
            return True
        first = rid not in self._sessions
        arrival = getattr(request, "arrival_time", None)
        if first:
            self._sessions[rid] = arrival
        else:  # the latest chunk's arrival: a new session reusing an abandoned one's id ends after its own chunks
            self._sessions.move_to_end(rid)
            since = self._sessions[rid]
            if arrival is not None and (since is None or arrival > since):
                self._sessions[rid] = arrival
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
        self._refuse(scheduler, request, add, types, STREAMING_INPUT_REFUSED)  # vLLM's bookkeeping, then finished
        if first:
            _log.warning("blockdiff: request %s refused: %s; it fails (finish reason 'error'), and so does any further "
                         "input chunk of it", rid, STREAMING_INPUT_REFUSED)
        else:
            _log.debug("blockdiff: request %s: another streaming input chunk refused (finish reason 'error')", rid)
        return True


_NO_FLAGS: frozenset[str] = frozenset()


def _request_error_type(engine_core_output: type) -> type | None:
    """vLLM's ``RequestError`` when ``engine_core_output`` (vLLM's ``EngineCoreOutput``) carries one in its
    ``error`` field (vLLM 0.33.0), else None (0.26.0: a refused request's reason can only be logged). Detected by
    feature, not by version."""
    fields = getattr(engine_core_output, "__struct_fields__", None) or getattr(
        engine_core_output, "__dataclass_fields__", None) or ()
    if "error" not in fields:
        return None
    try:
        from vllm.outputs import RequestError  # type: ignore  # vLLM >= 0.33 (vllm_compat.OPTIONAL_IMPORTS)
    except ImportError:
        return None
    return RequestError


def _vllm_types():
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # type: ignore
    from vllm.v1.request import RequestStatus  # type: ignore

    return SimpleNamespace(RequestStatus=RequestStatus, EngineCoreOutput=EngineCoreOutput,
                           EngineCoreOutputs=EngineCoreOutputs, RequestError=_request_error_type(EngineCoreOutput))


def _make_classes() -> dict[str, type]:
    try:
        sync_base, async_base = scheduler_base_classes()
    except ImportError as e:
        raise ImportError(
            "blockdiff.integration.vllm_scheduler's scheduler classes need vLLM (pip install -e '.[vllm]'; "
            f"checked with vLLM 0.26.0 and 0.33.0): {e}") from e

    def with_finish(base: type, name: str, asynchronous: bool) -> type:
        class Scheduler(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                # CL and whether the diffusion config leaves room for fused commits (2 * CL drafts a row)
                self.blockdiff_canvas_length, self.blockdiff_fused_layout = served_canvas_length(self.vllm_config)
                check_canvas_rows_fit(self)  # a limit below CL cuts every canvas row: every request would hang
                self.blockdiff_fuse_next: set[str] | frozenset[str] = frozenset()  # sync: last step's fused ids
                # which fused rows are kept (BLOCKDIFF_FUSE_POLICY, read even when nothing fuses: a typo stops the
                # start)
                self.blockdiff_fuse_policy = fuse_policy_from_env()
                # a 2 * CL row fits the token budget whole (else nothing is fused: wide_rows_fit)
                self.blockdiff_wide_fits = wide_rows_fit(self)
                # async, fused layout, BLOCKDIFF_FUSE_COMMIT=1: the step counts that predict commits (else None)
                self.blockdiff_predictor: FusedCommitPredictor | None = None
                # fused / plain commits, misses and policy cuts, and their server log line (FusedCommitCounts),
                # counted only while fused commits are served (_blockdiff_counting)
                self.blockdiff_commit_counts = FusedCommitCounts(
                    self.blockdiff_canvas_length, "asynchronous" if asynchronous else "synchronous",
                    self.blockdiff_fuse_policy)
                fusing = self.blockdiff_fused_layout and fuse_commit_from_env()
                self._blockdiff_counting = fusing and self.blockdiff_wide_fits
                if fusing and not self.blockdiff_wide_fits:
                    _log.warning("blockdiff: a fused row (%d tokens) does not fit the token budget "
                                 "(max_num_scheduled_tokens %s, long_prefill_token_threshold %s): no fused commits",
                                 2 * self.blockdiff_canvas_length, getattr(self, "max_num_scheduled_tokens", None),
                                 getattr(self.scheduler_config, "long_prefill_token_threshold", None))
                elif fusing:
                    _log.info("blockdiff: fused commits, %s scheduler, fuse policy %s (%s)",
                              "asynchronous" if asynchronous else "synchronous", self.blockdiff_fuse_policy,
                              FUSE_POLICY_ENV)
                    if asynchronous:
                        steps = served_max_denoising_steps(self.vllm_config)
                        self.blockdiff_predictor = FusedCommitPredictor(
                            self.blockdiff_canvas_length,
                            steps if steps is not None else default_max_denoising_steps(),
                            self.blockdiff_commit_counts)
                # the uniform policy's pass before each schedule call, only where rows may be 2 * CL wide: fused
                # commits served (without the switch every list is cut to CL first, so the pass would find none)
                self._blockdiff_uniform = (self.blockdiff_fuse_policy == "uniform" and fusing
                                           and self.blockdiff_wide_fits)
                # vLLM's streaming-input requests (resumable) fail alone with an error (StreamingInputRefusals)
                self.blockdiff_streaming_refusals = StreamingInputRefusals()
                # a request whose sampling parameters blockdiff refuses fails at add_request (ParamsRefusals), by the
                # model state's rules and defaults, built from the same VllmConfig
                mc = getattr(self.vllm_config, "model_config", None)
                vocab = getattr(mc, "get_vocab_size", None)
                self.blockdiff_params_refusals = ParamsRefusals(
                    served_default_params(self.vllm_config), self.blockdiff_canvas_length,
                    vocab() if callable(vocab) else None)
                # vLLM's RequestStatus and engine output types (RequestError: None where outputs carry no error)
                self._blockdiff_types = _vllm_types()

            def add_request(self, request, *args, **kwargs):
                """vLLM's ``add_request``, except for two kinds of request, which fail at once with finish reason
                ``error`` before they are scheduled (the reason in the output's ``error`` under vLLM 0.33.0, in the
                log under 0.26.0): vLLM's streaming input (a ``resumable`` request; a refused session's
                end-of-input request is dropped: :class:`blockdiff.integration.vllm_scheduler.StreamingInputRefusals`)
                and a request whose sampling parameters blockdiff refuses, or whose prompt is empty
                (:class:`blockdiff.integration.vllm_scheduler.ParamsRefusals`)."""
                add = super().add_request
                base = lambda r: add(r, *args, **kwargs)  # noqa: E731
                types = self._blockdiff_types
                if self.blockdiff_streaming_refusals.intercept(self, request, base, types=types) or \
                        self.blockdiff_params_refusals.intercept(self, request, base, types=types):
                    return None
                return add(request, *args, **kwargs)

            @annotated("blockdiff:schedule")
            def schedule(self, *args, **kwargs):
                predictor = self.blockdiff_predictor
                if asynchronous and self.blockdiff_fused_layout:  # placeholders of 2 * CL: cut to CL, or kept
                    wide = cut_spec_tokens(self, predictor)       # where the step cap forces a commit (predictor)
                    if wide and self._blockdiff_uniform:
                        self.blockdiff_commit_counts.num_policy_cuts += keep_uniform_widths(self, wide)
                elif self._blockdiff_uniform:  # sync: the flagged requests' 2 * CL drafts (cut_draft_widths)
                    self.blockdiff_commit_counts.num_policy_cuts += keep_uniform_widths(self)
                out = super().schedule(*args, **kwargs)
                if predictor is not None:
                    predictor.record(out)
                return out

            def _preempt_request(self, request, *args, **kwargs):
                super()._preempt_request(request, *args, **kwargs)
                if self.blockdiff_predictor is not None:  # re-prefilled later: a fresh canvas at step 0
                    self.blockdiff_predictor.reset(request.request_id)

            @annotated("blockdiff:update_from_output")
            def update_from_output(self, scheduler_output, model_runner_output):
                if self.blockdiff_fused_layout:
                    fuse, cleaned = split_fuse_flags(model_runner_output.num_nans_in_logits)
                else:  # the worker never flags (its fuse_commit needs this layout): no per-request scan
                    fuse, cleaned = _NO_FLAGS, model_runner_output.num_nans_in_logits
                if self.blockdiff_predictor is not None:  # counts the rows' commits too (blockdiff_commit_counts)
                    self.blockdiff_predictor.observe(scheduler_output, model_runner_output, fuse, self.requests)
                elif self._blockdiff_counting:  # sync
                    self.blockdiff_commit_counts.count_step(scheduler_output, model_runner_output)
                if fuse:  # vLLM sees no flag: its count of failed requests reads n > 0
                    model_runner_output.num_nans_in_logits = cleaned
                self.blockdiff_fuse_next = fuse if (self.blockdiff_fused_layout and not asynchronous and
                                                    self.blockdiff_wide_fits) else _NO_FLAGS
                outputs = super().update_from_output(scheduler_output, model_runner_output)
                types = self._blockdiff_types
                finish_stuck_requests(self, cleaned, outputs, types=types)
                self.blockdiff_streaming_refusals.flush(outputs, types)  # refused streaming-input requests' errors
                self.blockdiff_params_refusals.flush(outputs, types)     # and those of refused sampling parameters
                if self._blockdiff_counting:  # the coverage line, at its bounded rate (FusedCommitCounts)
                    self.blockdiff_commit_counts.after_step(self.has_unfinished_requests)
                return outputs

            @property
            def blockdiff_num_policy_cuts(self) -> int:
                """Fused rows (``2 * CL`` lists) the ``uniform`` fuse policy cut to CL so far (rows;
                ``blockdiff_commit_counts.num_policy_cuts``)."""
                return self.blockdiff_commit_counts.num_policy_cuts

            def shutdown(self, *args, **kwargs):
                """vLLM's ``Scheduler.shutdown`` (the engine core's teardown), after the fused-commit coverage line
                once more (``at shutdown``) when fused commits were served."""
                if getattr(self, "_blockdiff_counting", False):  # False: a start stopped before it was set
                    self.blockdiff_commit_counts.log("at shutdown")
                return super().shutdown(*args, **kwargs)

            def update_draft_token_ids(self, draft_token_ids):
                if self.blockdiff_fused_layout:  # else the lists are num_spec_tokens = CL long already
                    cut_draft_widths(self, draft_token_ids, self.blockdiff_fuse_next)
                return super().update_draft_token_ids(draft_token_ids)

        Scheduler.__name__ = Scheduler.__qualname__ = name
        Scheduler.__module__ = __name__
        Scheduler.__doc__ = (f"vLLM's {base.__name__} plus :func:`blockdiff.integration.vllm_scheduler."
                             "finish_stuck_requests` after each step and, served in the fused layout, per-request "
                             "draft widths (CL, or 2 * CL for a fused commit" + (", predicted from the step cap: "
                                                                                ":class:`blockdiff.integration."
                                                                                "vllm_scheduler.FusedCommitPredictor`"
                                                                                if asynchronous else "") + "; module "
                             "docstring); ``schedule`` and ``update_from_output`` are named ranges in a profiler "
                             "trace (:mod:`blockdiff.integration.annotate`).")
        return Scheduler

    return {"BlockdiffDiffusionScheduler": with_finish(sync_base, "BlockdiffDiffusionScheduler", False),
            "BlockdiffDiffusionAsyncScheduler": with_finish(async_base, "BlockdiffDiffusionAsyncScheduler", True)}


_classes: dict[str, type] = {}


def __getattr__(name: str):
    """``BlockdiffDiffusionScheduler`` / ``BlockdiffDiffusionAsyncScheduler``, built on first access (vLLM
    imported then; ImportError with install instructions without it)."""
    if name in ("BlockdiffDiffusionScheduler", "BlockdiffDiffusionAsyncScheduler"):
        if not _classes:
            _classes.update(_make_classes())
        return _classes[name]
    raise AttributeError(name)
