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

Fused commits (issue 25's stretch goal; opt-in, synchronous scheduling only; docs/ARCHITECTURE.md "Integration and
vLLM accounting"). vLLM schedules a running diffusion row ``len(request.spec_token_ids)`` draft tokens. Served with
``--diffusion-config '{"canvas_length": 2 * CL}'`` (CL = the checkpoint's ``canvas_length``,
:func:`served_canvas_length`) the worker's draft lists are ``2 * CL`` long, and these schedulers cut every request's
list to CL except where the worker asked for a fused commit: the model state (``BLOCKDIFF_FUSE_COMMIT=1``,
:func:`fuse_commit_from_env`) reports a request whose canvas converged and whose commit will not end it with
``num_nans_in_logits[req_id] = -1`` (values > 0 still mean failure). ``update_from_output`` collects those ids and
passes vLLM a copy with ``max(n, 0)``; the synchronous scheduler's ``update_draft_token_ids`` then leaves such a
request ``2 * CL`` drafts when ``num_tokens + 2 * CL <= max_model_len`` (:func:`cut_draft_widths`), so its next row
is the commit (CL causal rows) plus the next canvas's first denoising step (CL bidirectional rows), accounted by the
worker as CL accepted and CL rejected drafts. The asynchronous scheduler schedules step S before step S - 1's output
is known and never fuses: its ``schedule`` cuts the placeholders to CL first (:func:`cut_spec_tokens`). Served with
CL (no fused layout) neither cut runs: every list is ``num_spec_tokens`` = CL long already.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import Any

from .annotate import annotated
from .vllm_compat import scheduler_base_classes

#: Canvas widths above this are refused (the sampler's canvas_length < 2**16, blockdiff.sampler.rng.MAX_POSITIONS).
MAX_CANVAS_WIDTH = 1 << 16
#: Environment variable that turns fused commits on under vLLM (``1``; ``0`` or unset: off).
FUSE_COMMIT_ENV = "BLOCKDIFF_FUSE_COMMIT"
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
    env = os.environ if environ is None else environ
    v = env.get(FUSE_COMMIT_ENV, "")
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ValueError(f"{FUSE_COMMIT_ENV} must be 1 (fused commits) or 0 / unset (off), got {v!r}")


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
    served = getattr(dcfg, "canvas_length", None) or DEFAULT_CANVAS_LENGTH
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


def cut_spec_tokens(scheduler: Any) -> None:
    """Cut every running request's ``spec_token_ids`` to its canvas width (:func:`diffusion_canvas_width` with the
    scheduler's CL): what the asynchronous scheduler does before each ``schedule`` when served in the fused layout
    (its placeholders are ``num_spec_tokens`` = ``2 * CL`` wide, and it never fuses; served with CL it skips this
    per-request loop). A new list is assigned (vLLM's
    placeholder list is shared between requests)."""
    cl = _canvas_length_of(scheduler)
    for req in scheduler.running:
        try:
            width = diffusion_canvas_width(req, cl)
        except ValueError:
            continue
        if len(req.spec_token_ids) > width:
            req.spec_token_ids = req.spec_token_ids[:width]


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
    """
    RS = types.RequestStatus
    cl = _canvas_length_of(scheduler)
    failed: list[str] = []
    for rid, n in sorted((num_nans_in_logits or {}).items()):
        req = scheduler.requests.get(rid)
        if n is not None and n > 0 and req is not None and not req.is_finished():
            failed.append(rid)
    too_long: list[str] = []
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
    done: list[tuple[str, str]] = []
    for ids, status, reason in ((failed, RS.FINISHED_ERROR, "error"), (too_long, RS.FINISHED_LENGTH_CAPPED,
                                                                         "length")):
        if not ids:
            continue
        for req in scheduler.finish_requests(ids, status):
            out = types.EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
                stop_reason=req.stop_reason, num_nans_in_logits=getattr(req, "num_nans_in_logits", 0),
                trace_headers=getattr(req, "trace_headers", None), events=req.take_events())
            eco = outputs.get(req.client_index)
            if eco is None:
                outputs[req.client_index] = eco = types.EngineCoreOutputs(outputs=[])
            eco.outputs.append(out)
            done.append((req.request_id, reason))
    return done


def _vllm_types():
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # type: ignore
    from vllm.v1.request import RequestStatus  # type: ignore

    return SimpleNamespace(RequestStatus=RequestStatus, EngineCoreOutput=EngineCoreOutput,
                           EngineCoreOutputs=EngineCoreOutputs)


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
                self.blockdiff_fuse_next: set[str] = set()  # sync: the last step's fused-commit requests

            @annotated("blockdiff:schedule")
            def schedule(self, *args, **kwargs):
                if asynchronous and self.blockdiff_fused_layout:  # placeholders of 2 * CL: cut, never fused
                    cut_spec_tokens(self)
                return super().schedule(*args, **kwargs)

            @annotated("blockdiff:update_from_output")
            def update_from_output(self, scheduler_output, model_runner_output):
                fuse, cleaned = split_fuse_flags(model_runner_output.num_nans_in_logits)
                if fuse:  # vLLM sees no flag: its count of failed requests reads n > 0
                    model_runner_output.num_nans_in_logits = cleaned
                self.blockdiff_fuse_next = fuse if (self.blockdiff_fused_layout and not asynchronous) else set()
                outputs = super().update_from_output(scheduler_output, model_runner_output)
                finish_stuck_requests(self, cleaned, outputs, types=_vllm_types())
                return outputs

            def update_draft_token_ids(self, draft_token_ids):
                if self.blockdiff_fused_layout:  # else the lists are num_spec_tokens = CL long already
                    cut_draft_widths(self, draft_token_ids, self.blockdiff_fuse_next)
                return super().update_draft_token_ids(draft_token_ids)

        Scheduler.__name__ = Scheduler.__qualname__ = name
        Scheduler.__module__ = __name__
        Scheduler.__doc__ = (f"vLLM's {base.__name__} plus :func:`blockdiff.integration.vllm_scheduler."
                             "finish_stuck_requests` after each step and, served in the fused layout, per-request "
                             "draft widths (CL, or 2 * CL for a fused commit" + (": never, asynchronous" if
                                                                                asynchronous else "") + "; module "
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
