"""vLLM general plugin (entry point ``vllm.general_plugins: blockdiff = blockdiff.integration.vllm_plugin:register``).

``register()`` runs in every vLLM process (API server, engine core, workers) and

1. registers :class:`blockdiff.integration.vllm_model.BlockdiffDiffusionGemmaForConditionalGeneration` for the
   checkpoint architectures ``DiffusionGemmaForBlockDiffusion`` and ``DiffusionGemmaForConditionalGeneration``
   (vLLM logs that it overrides its own class). Its ``get_model_state_cls()`` returns
   :class:`~blockdiff.integration.model_state.DiffusionModelState`, whose ``custom_sampler`` returns the
   :class:`~blockdiff.integration.sampler.DiffusionSampler` and no rejection sampler;
2. registers :class:`blockdiff.integration.vllm_attention.BlockdiffAttentionBackend` as vLLM's ``CUSTOM``
   attention backend (select it with ``--attention-backend CUSTOM``); it runs
   :func:`blockdiff.attention.attention` with the per-request causal flags in one launch, on the backend named
   by ``BLOCKDIFF_ATTN_BACKEND`` (``triton`` default, ``cute`` or ``reference``: :data:`ATTN_BACKENDS`; no
   fallback), with the model's bidirectional window rule (:func:`bidirectional_window_of`: transformers'
   ``"prefix"`` unless the checkpoint says otherwise).

The scheduler is chosen on the command line, not here: ``--scheduler-cls`` :data:`SCHEDULER_CLASS`
(:mod:`blockdiff.integration.vllm_scheduler`) finishes the requests vLLM's own scheduler never would: a
request whose logits went NaN / +inf or all -inf at a position (reported by the sampler through ``num_nans``;
-inf token masks alone are p = 0, not a failure; finish reason ``error``) and
one whose next canvas no longer fits in ``max_model_len`` (finish reason ``length``). Without it such requests
would be scheduled forever, so the model state stops the start (ValueError naming ``--scheduler-cls``). It also
refuses vLLM's streaming input (resumable requests; finish reason ``error``:
:class:`blockdiff.integration.vllm_scheduler.StreamingInputRefusals`).

vLLM is imported lazily: importing this module never needs vLLM; calling :func:`register` without vLLM raises
ImportError. Checked with vLLM 0.26.0 and 0.33.0: what differs between them (ModelState hook names, the sampler's
``add_request``, the scheduler classes) is in :mod:`blockdiff.integration.vllm_compat`; :func:`register` refuses
a version it has no profile for. Serving command (the same for both): see :data:`SERVE_COMMAND`.
"""
from __future__ import annotations

import os

from . import vllm_compat
from .annotate import install_triton_compile_ranges

ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion", "DiffusionGemmaForConditionalGeneration")
MODEL_CLASS = "blockdiff.integration.vllm_model:BlockdiffDiffusionGemmaForConditionalGeneration"
ATTENTION_BACKEND_CLASS = "blockdiff.integration.vllm_attention.BlockdiffAttentionBackend"
SCHEDULER_CLASS = "blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler"
ASYNC_SCHEDULER_CLASS = "blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler"
ATTN_BACKEND_ENV = "BLOCKDIFF_ATTN_BACKEND"
SAMPLER_BACKEND_ENV = "BLOCKDIFF_SAMPLER_BACKEND"

SERVE_COMMAND = (
    "pip install -e '.[vllm]' 'vllm==0.26.0'   # the vllm.general_plugins entry point; cute: integration/README.md\n"
    "VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=blockdiff \\\n"
    "BLOCKDIFF_ATTN_BACKEND=triton BLOCKDIFF_SAMPLER_BACKEND=triton \\\n"
    "vllm serve $DIFFUSIONGEMMA_CHECKPOINT --language-model-only \\\n"
    "    --attention-backend CUSTOM \\\n"
    "    --scheduler-cls blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler \\\n"
    "    --diffusion-config '{\"canvas_length\": 256, \"max_denoising_steps\": 48}' --block-size 64 \\\n"
    "    --max-num-seqs 32 --max-num-batched-tokens 16384 --max-model-len 32768 --dtype bfloat16"
)
"""The ``vllm serve`` command for the README. ``$DIFFUSIONGEMMA_CHECKPOINT``: a DiffusionGemma checkpoint
(architecture ``DiffusionGemmaForBlockDiffusion``; ``blockdiff export`` writes one), served as a language model
only (vLLM registers the architecture as multimodal: ``--language-model-only``); vLLM serves a checkpoint whose
config has ``canvas_length`` on its diffusion path (canvas scheduled as draft tokens), and ``--diffusion-config``
overrides its canvas length and step cap (the sizes here are a 256-token canvas's with a long context, e.g. the
26B-A4B geometry; integration/README.md gives the shipped stdlib-byte model's); ``--scheduler-cls`` picks :data:`ASYNC_SCHEDULER_CLASS` (vLLM's asynchronous
scheduling, its default; with ``--no-async-scheduling``: :data:`SCHEDULER_CLASS`); ``--block-size 64`` gives the
triton backend's Gluon kernels pages they can read with TMA; ``VLLM_PLUGINS=blockdiff`` loads only this plugin."""

#: ``BLOCKDIFF_ATTN_BACKEND`` / ``BLOCKDIFF_SAMPLER_BACKEND`` values (exact, lower case; unset: ``triton``). The
#: attention ones are blockdiff.attention's registry, as a literal: the module must import without
#: blockdiff.attention, whose environment switches raise at import (a bad BLOCKDIFF_CHECK_VALUES must reach
#: register(), which vLLM does not catch, not the import, whose failure vLLM's loader only logs: tests/attention/
#: test_env.py). tests/test_backend_lists.py checks it equals the registry; each name needs its rows in
#: vllm_attention.py's MAX_HEAD_SIZE and DTYPES.
ATTN_BACKENDS = ("triton", "cute", "reference")
SAMPLER_BACKENDS = ("triton", "reference")


#: Environment variable (a boolean switch, :func:`blockdiff.attention.env.env_flag`): "1" installs
#: :func:`.annotate.install_triton_compile_ranges` at registration (the serving
#: benchmark sets it on profiled servers, ``bench_serve server-cmd --trace-dir``).
PROFILE_COMPILES_ENV = "BLOCKDIFF_PROFILE_COMPILES"


def attn_backend_from_env() -> str:
    """``BLOCKDIFF_ATTN_BACKEND`` (default ``triton``). Raises ValueError naming the variable for another value
    (``Triton``, ``" triton"``, ``""``, ``auto``: no normalisation, no fallback)."""
    attn = os.environ.get(ATTN_BACKEND_ENV, "triton")
    if attn not in ATTN_BACKENDS:
        raise ValueError(f"{ATTN_BACKEND_ENV} must be one of {', '.join(map(repr, ATTN_BACKENDS))}, got {attn!r}")
    return attn


#: Window rule of bidirectional (denoise) rows on sliding-window layers when the checkpoint names none: ``"prefix"``,
#: transformers' DiffusionGemma decoder (the last W context keys plus every canvas key, W = sliding_window - 1), the
#: rule the model was trained with. vLLM's own convention (its Triton attention) is symmetric, ``|q - k| <= W``.
DEFAULT_BIDIRECTIONAL_WINDOW = "prefix"
BIDIRECTIONAL_WINDOWS = ("prefix", "symmetric")


def bidirectional_window_of(text_config) -> str:
    """The bidirectional window rule the CUSTOM backend applies for a model: ``text_config.bidirectional_window``
    (blockdiff's key, which :func:`blockdiff.model.export.export_hf` writes into ``config.json``'s
    ``text_config``), else :data:`DEFAULT_BIDIRECTIONAL_WINDOW`.

    Args:
        text_config: vLLM's ``model_config.hf_text_config`` (a transformers config: the key is an attribute), a
            ``text_config`` dict, or None (the default).

    Raises:
        ValueError: the key is set to something other than ``"prefix"`` / ``"symmetric"``.
    """
    if text_config is None:
        return DEFAULT_BIDIRECTIONAL_WINDOW
    if isinstance(text_config, dict):
        bw = text_config.get("bidirectional_window")
    else:
        bw = getattr(text_config, "bidirectional_window", None)
    if bw is None:
        return DEFAULT_BIDIRECTIONAL_WINDOW
    if bw not in BIDIRECTIONAL_WINDOWS:
        raise ValueError(f"text_config.bidirectional_window must be one of {BIDIRECTIONAL_WINDOWS} (or unset: "
                         f"{DEFAULT_BIDIRECTIONAL_WINDOW!r}), got {bw!r}")
    return bw


_registered = False


def _require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "blockdiff's vLLM plugin needs vLLM (pip install -e '.[vllm]'; checked with vLLM 0.26.0 and 0.33.0); "
            f"vLLM could not be imported: {e}") from e


def register() -> None:
    """Register the DiffusionGemma model class (with ``get_model_state_cls``) and the ``CUSTOM`` attention
    backend with vLLM, and with ``BLOCKDIFF_PROFILE_COMPILES=1`` name Triton's JIT compiles in profiler traces
    (:func:`.annotate.install_triton_compile_ranges`; off by default: with a hook set, Triton serializes every
    compile's specialization to JSON first, which fails for a kernel taking a ``@triton.jit`` function as a
    constexpr). Idempotent.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
        ValueError: ``BLOCKDIFF_ATTN_BACKEND`` / ``BLOCKDIFF_SAMPLER_BACKEND`` name an unknown backend;
            ``BLOCKDIFF_PROFILE_COMPILES`` or ``BLOCKDIFF_CHECK_VALUES`` is not ``1`` / ``0`` / empty / unset
            (:func:`blockdiff.attention.env.env_flag`); the
            installed vLLM is a version the plugin has no profile for (:func:`.vllm_compat.profile_for`).
    """
    global _registered
    _require_vllm()
    # imported here, not at the top: importing blockdiff.attention reads BLOCKDIFF_CHECK_VALUES and raises on a bad
    # value, and vLLM's plugin loader only logs a module that fails to import and serves without the plugin; raised
    # from register() the error stops the start
    from ..attention.env import env_flag
    vllm_compat.current()  # refuses an unsupported vLLM version here, at plugin load, with the checked ones named
    attn_backend_from_env()
    smp = os.environ.get(SAMPLER_BACKEND_ENV, "triton")
    if smp not in SAMPLER_BACKENDS:
        raise ValueError(f"{SAMPLER_BACKEND_ENV} must be 'triton' or 'reference', got {smp!r}")
    profile_compiles = env_flag(PROFILE_COMPILES_ENV, meaning="Triton compile ranges")  # checked before registering
    if _registered:
        return
    from vllm import ModelRegistry  # type: ignore
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # type: ignore

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
    register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND_CLASS)
    if profile_compiles:  # profiled servers only: the hooks change Triton's compile path
        install_triton_compile_ranges()
    _registered = True
