"""blockdiff.sampler: the DiffusionGemma denoising sampler step over a batch of requests.

Per forward pass, :func:`sampler_step` turns the canvas logits of every DENOISE row into Gumbel-max samples,
accepts the lowest-entropy positions within an entropy budget, renoises the rest, tracks argmax stability and
mean entropy for convergence, computes the self-conditioning soft embedding, and drives each request's phase
(PREFILL -> DENOISE -> COMMIT -> DENOISE ... -> FINISHED, or FAILED where a canvas position has no softmax: a NaN
or +inf logit, or every logit -inf; a -inf logit alone is p = 0). Semantics and interface: docs/ARCHITECTURE.md
"Sampler semantics".

Backends (explicit; no silent fallback): ``"reference"`` (dense PyTorch, :mod:`.reference`) and ``"triton"``
(streaming fused kernels, :mod:`.triton`). ``"auto"`` picks triton on CUDA, reference elsewhere, and
:func:`resolve_backend` says what it chose.
"""
from __future__ import annotations

import importlib

import torch

from . import rng
from .params import SamplingParams
from .state import (COMMIT, DENOISE, FAILED, FINISHED, NO_MAX_TOKENS, PHASE_NAMES, PREFILL, SamplerState,
                    StepOutput, torch_device)

BACKENDS = ("reference", "triton")
_MODULES = {"reference": ".reference", "triton": ".triton"}


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Map ``"auto"`` to ``"triton"`` on CUDA and ``"reference"`` elsewhere; validate the name.

    ``device`` (read for ``"auto"`` only; whether a CUDA device is there is not checked) is None, a str or a
    ``torch.device``.

    Raises:
        TypeError: ``backend`` not a str; ``device`` neither None, a str nor a ``torch.device``.
        ValueError: unknown backend name; a ``device`` string torch cannot parse (``"bogus"``: torch's RuntimeError
            before).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS + ('auto',)}, got {type(backend).__name__}")
    if backend == "auto":
        return "triton" if device is not None and torch_device(device).type == "cuda" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r}")
    return backend


def get_backend(backend: str):
    """The ``sampler_step`` function of a concrete backend.

    Raises:
        ValueError: unknown backend. ImportError: the backend cannot be imported here (no fallback).
    """
    backend = resolve_backend(backend)
    try:
        mod = importlib.import_module(_MODULES[backend], __name__)
    except ImportError as e:
        raise ImportError(f"sampler backend {backend!r} is not available: {e}") from e
    return mod.sampler_step


def sampler_step(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                 embedding: torch.Tensor, *, backend: str = "reference",
                 check_values: bool | None = None) -> StepOutput:
    """One sampler step for the N rows of a forward pass; mutates ``state`` in place.

    Args:
        state: :class:`SamplerState`.
        slots: int64 [N] distinct slots of the rows, in [0, max_num_reqs).
        logits: float [N, CL, V] final (soft-capped) logits of the canvas tokens; ignored for non-DENOISE rows.
            Converted to float32 by every backend; finite float64 values beyond float32's range saturate to
            +-FLT_MAX (:func:`.common.saturate_logits`), so only NaN / +inf (or an all -inf position) fail a row.
        prefill_done: bool [N]; PREFILL rows with True move to DENOISE with a fresh canvas.
        embedding: E [V, hidden] (tied embedding), for ``soft = softmax(z) @ E * sqrt(hidden)``.
        backend: ``"reference"``, ``"triton"`` or ``"auto"``.
        check_values: check the slot ids on the host (range, distinct: one host read of ``slots``). None
            (default): yes unless a CUDA graph is being captured; False: the caller vouches for them (what the
            backend then does with a bad id: its ``sampler_step``).

    Returns:
        :class:`StepOutput` (shapes/dtypes in its docstring).

    Raises:
        ValueError: unknown backend, bad shapes, bad slot ids. TypeError: bad types/dtypes. ImportError: backend
            unavailable.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    return get_backend(resolve_backend(backend, logits.device))(state, slots, logits, prefill_done, embedding,
                                                                check_values=check_values)


__all__ = [
    "SamplingParams", "SamplerState", "StepOutput", "sampler_step", "resolve_backend", "get_backend", "BACKENDS",
    "PREFILL", "DENOISE", "COMMIT", "FINISHED", "FAILED", "PHASE_NAMES", "NO_MAX_TOKENS", "rng",
]
