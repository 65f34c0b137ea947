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
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from .annotate import annotated
from .vllm_compat import scheduler_base_classes

#: Canvas widths above this are refused (the sampler's canvas_length < 2**16, blockdiff.sampler.rng.MAX_POSITIONS).
MAX_CANVAS_WIDTH = 1 << 16


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


def finish_stuck_requests(scheduler: Any, num_nans_in_logits: dict[str, int] | None, outputs: dict,
                          *, types: Any) -> list[tuple[str, str]]:
    """Finish the requests vLLM would never finish (see the module docstring) and answer their clients.

    Args:
        scheduler: a vLLM ``Scheduler`` (reads ``requests``, ``running``, ``max_model_len``,
            ``num_spec_tokens``; calls ``finish_requests``).
        num_nans_in_logits: ``ModelRunnerOutput.num_nans_in_logits`` of the step (req_id -> count), or None.
        outputs: what ``update_from_output`` returned: client index -> ``EngineCoreOutputs``; updated in place.
        types: namespace with vLLM's ``RequestStatus``, ``EngineCoreOutput``, ``EngineCoreOutputs``.

    Returns:
        ``[(req_id, "error" | "length")]`` in the order finished.
    """
    RS = types.RequestStatus
    failed: list[str] = []
    for rid, n in sorted((num_nans_in_logits or {}).items()):
        req = scheduler.requests.get(rid)
        if n and req is not None and not req.is_finished():
            failed.append(rid)
    too_long: list[str] = []
    for req in list(scheduler.running):
        if req.request_id in failed or req.is_finished():
            continue
        try:
            width = diffusion_canvas_width(req, scheduler.num_spec_tokens)
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

    def with_finish(base: type, name: str) -> type:
        class Scheduler(base):  # type: ignore[misc, valid-type]
            @annotated("blockdiff:schedule")
            def schedule(self, *args, **kwargs):
                return super().schedule(*args, **kwargs)

            @annotated("blockdiff:update_from_output")
            def update_from_output(self, scheduler_output, model_runner_output):
                outputs = super().update_from_output(scheduler_output, model_runner_output)
                finish_stuck_requests(self, model_runner_output.num_nans_in_logits, outputs, types=_vllm_types())
                return outputs

        Scheduler.__name__ = Scheduler.__qualname__ = name
        Scheduler.__module__ = __name__
        Scheduler.__doc__ = (f"vLLM's {base.__name__} plus :func:`blockdiff.integration.vllm_scheduler."
                             "finish_stuck_requests` after each step; ``schedule`` and ``update_from_output`` "
                             "are named ranges in a profiler trace (:mod:`blockdiff.integration.annotate`).")
        return Scheduler

    return {"BlockdiffDiffusionScheduler": with_finish(sync_base, "BlockdiffDiffusionScheduler"),
            "BlockdiffDiffusionAsyncScheduler": with_finish(async_base, "BlockdiffDiffusionAsyncScheduler")}


_classes: dict[str, type] = {}


def __getattr__(name: str):
    """``BlockdiffDiffusionScheduler`` / ``BlockdiffDiffusionAsyncScheduler``, built on first access (vLLM
    imported then; ImportError with install instructions without it)."""
    if name in ("BlockdiffDiffusionScheduler", "BlockdiffDiffusionAsyncScheduler"):
        if not _classes:
            _classes.update(_make_classes())
        return _classes[name]
    raise AttributeError(name)
