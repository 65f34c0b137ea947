"""What differs, for blockdiff's vLLM plugin, between the vLLM versions it is checked against (0.26.0, 0.33.0).

One :class:`VllmProfile` per checked version, chosen from ``vllm.__version__`` (:func:`profile_for`, :func:`current`),
so the rest of the plugin asks this module instead of testing versions itself. Each profile states what the plugin
expects of that version; ``tests/integration/test_vllm_interface.py`` checks every profile against the interface
snapshot recorded from that version's wheel (``tests/integration/vllm_<version>_model_state_interface.json``,
written by ``tests/integration/snapshot_vllm_interface.py``), without vLLM installed.

The differences that matter to the plugin (read from the two wheels):

* ModelState's multimodal-embedding hook (abstract) is ``get_mm_embeddings`` in 0.26.0 and
  ``prepare_inputs_embeds`` in 0.33.0; ``prepare_attn`` gains ``ubatch_idx=0`` in 0.33.0.
  :class:`~blockdiff.integration.model_state.DiffusionModelState` implements both names and both signatures.
* The runner calls ``sampler.add_request(req_idx, prompt_len, sampling_params)`` in 0.26.0 and
  ``sampler.add_request(req_idx, sampling_params)`` in 0.33.0 (the diffusion sampler accepts both).
* 0.26.0 schedules diffusion requests in its main ``Scheduler`` / ``AsyncScheduler``; 0.33.0 picks
  ``vllm.v1.core.sched.diffusion_scheduler.DiffusionScheduler`` / ``DiffusionAsyncScheduler`` (per-request canvas
  widths, async read deferral). The plugin's scheduler subclasses the profile's :attr:`VllmProfile.scheduler_classes`.
* A step that schedules no draft token gives one logit row per request in 0.26.0 and none in 0.33.0 (the
  diffusion sampler ignores logits of prefill rows either way).
* Streaming input (resumable requests, a request continued with a longer prompt) exists in both; 0.33.0's
  ``AsyncLLM`` refuses it for diffusion models at the front, 0.26.0's does not, and the two continue a session
  differently (0.26.0 keeps the first input chunk's ``max_tokens``; 0.33.0 asserts an autoregressive KV count). The
  plugin's schedulers refuse it in both (``vllm_scheduler.StreamingInputRefusals``; a version without
  ``Request.resumable`` is never refused anything), so no profile field is needed.
* A request the plugin's schedulers refuse at ``add_request`` (refused sampling parameters, streaming input) carries
  its reason to the client in 0.33.0 (``EngineCoreOutput.error``: ``vllm.outputs.RequestError(code=
  "validation_error", ...)``, raised by the client as ``VLLMValidationError``); 0.26.0 has neither, so there the
  reason is only logged. Detected by feature (``vllm_scheduler._request_error_type``), no profile field;
  :data:`OPTIONAL_IMPORTS` names the import.

Everything else the plugin imports (``SamplerOutput`` fields, the FlashAttention backend it derives from, the
``CUSTOM`` backend slot, ``ModelRegistry.register_model``, ``build_attn_metadata``'s keywords, the engine output
types) is the same in both. Importing this module never needs vLLM; :func:`current` and
:func:`scheduler_base_classes` do.
"""
from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass

_log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's "vllm" logger: its handler prints INFO to the server log

#: ``module:NAME`` the plugin imports only where vLLM defines it, detected by feature rather than by profile:
#: ``tests/integration/test_vllm_interface.py`` requires each recorded in every version's snapshot and lets it be
#: absent from a version.
OPTIONAL_IMPORTS = ("vllm.outputs:RequestError",)


@dataclass(frozen=True)
class VllmProfile:
    """The interface of one checked vLLM version, as the plugin relies on it.

    Attributes:
        version: the checked release (``"0.26.0"``).
        snapshot: file name of its recorded interface under ``tests/integration``.
        inputs_embeds_hook: name of ModelState's abstract multimodal-embedding hook the runner calls.
        sampler_add_request_params: parameters (without ``self``) the runner passes to ``sampler.add_request``.
        scheduler_classes: ``(sync, async)`` qualified names (``module.Class``) of the vLLM scheduler classes the
            plugin's schedulers derive from (the ones vLLM itself uses for a diffusion model).
        diffusion_scheduler: True when vLLM has a scheduler of its own for diffusion models (0.33.0).
        dual_width_decode_graphs: True when the fused layout (``canvas_length`` = 2 * CL) gets uniform-decode FULL
            CUDA graphs at both widths through :mod:`blockdiff.integration.vllm_graphs` (0.26.0: its model runner
            captures them 2 * CL wide only; docs/tuning.md 7.37).
    """

    version: str
    snapshot: str
    inputs_embeds_hook: str
    sampler_add_request_params: tuple[str, ...]
    scheduler_classes: tuple[str, str]
    diffusion_scheduler: bool
    dual_width_decode_graphs: bool = False


PROFILES: dict[str, VllmProfile] = {
    "0.26.0": VllmProfile(
        version="0.26.0", snapshot="vllm_0_26_0_model_state_interface.json",
        inputs_embeds_hook="get_mm_embeddings",
        sampler_add_request_params=("req_idx", "prompt_len", "sampling_params"),
        scheduler_classes=("vllm.v1.core.sched.scheduler.Scheduler",
                           "vllm.v1.core.sched.async_scheduler.AsyncScheduler"),
        diffusion_scheduler=False, dual_width_decode_graphs=True),
    "0.33.0": VllmProfile(
        version="0.33.0", snapshot="vllm_0_33_0_model_state_interface.json",
        inputs_embeds_hook="prepare_inputs_embeds",
        sampler_add_request_params=("req_idx", "sampling_params"),
        scheduler_classes=("vllm.v1.core.sched.diffusion_scheduler.DiffusionScheduler",
                           "vllm.v1.core.sched.diffusion_scheduler.DiffusionAsyncScheduler"),
        diffusion_scheduler=True, dual_width_decode_graphs=False),
}
"""Checked versions -> profile."""


def profile_for(version: str) -> VllmProfile:
    """The profile for a vLLM version string (``vllm.__version__``, e.g. ``"0.26.0"``, ``"0.33.1.dev3+g..."``).

    0.26.x -> the 0.26.0 profile; 0.33.x -> the 0.33.0 profile; a release newer than 0.33 -> the 0.33.0 profile
    with a logged warning (not checked). Versions between (0.27 .. 0.32) and before 0.26 are refused: which of the
    two interfaces they have was not read, and a wrong guess would go unnoticed in the scheduler.

    Raises:
        TypeError: ``version`` is not a str.
        ValueError: the version cannot be parsed, or is not one the plugin supports (the message names the
            checked versions).
    """
    if not isinstance(version, str):
        raise TypeError(f"version must be a str, got {type(version).__name__}")
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"cannot read a major.minor version from vLLM version {version!r}")
    minor = (int(m.group(1)), int(m.group(2)))
    checked = ", ".join(PROFILES)
    if minor == (0, 26):
        return PROFILES["0.26.0"]
    if minor == (0, 33):
        return PROFILES["0.33.0"]
    if minor > (0, 33):
        _log.warning("blockdiff: vLLM %s is newer than the versions the plugin is checked against (%s); assuming "
                     "0.33.0's interface", version, checked)
        return PROFILES["0.33.0"]
    raise ValueError(f"blockdiff's vLLM plugin supports vLLM 0.26.x and >= 0.33 (checked: {checked}), got vLLM "
                     f"{version}")


_current: VllmProfile | None = None


def current() -> VllmProfile:
    """The profile of the installed vLLM (``vllm.__version__``), computed once.

    Raises:
        ImportError: vLLM is not installed.
        ValueError: as :func:`profile_for`.
    """
    global _current
    if _current is None:
        import vllm  # optional dependency: only the plugin's vLLM paths call this

        _current = profile_for(vllm.__version__)
    return _current


def scheduler_base_classes() -> tuple[type, type]:
    """vLLM's ``(sync, async)`` scheduler classes that serve a diffusion model in the installed version
    (:attr:`VllmProfile.scheduler_classes`), imported.

    Raises:
        ImportError: vLLM (or the class) cannot be imported.
        ValueError: as :func:`profile_for`.
    """
    out = []
    for qualname in current().scheduler_classes:
        module, _, name = qualname.rpartition(".")
        out.append(getattr(importlib.import_module(module), name))
    return out[0], out[1]
