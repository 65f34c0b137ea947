"""Per-request sampling parameters of the DiffusionGemma denoising sampler (host side).

Defaults are those of transformers' ``DiffusionGemmaGenerationConfig._get_default_generation_params`` (HF
DiffusionGemma generation): canvas 256, 48 denoising steps, linear temperature 0.8 -> 0.4, entropy bound 0.1
nats, confidence threshold 0.005 nats, stability threshold 1. Semantics: docs/ARCHITECTURE.md
"Sampler semantics".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .rng import MAX_POSITIONS, MAX_STEPS

__all__ = ["SamplingParams", "MIN_TEMPERATURE", "schedule_extremes"]

#: Smallest nonzero temperature of a schedule: float32's smallest normal number, 2**-126 (1.18e-38). Below it T would
#: be a denormal divisor (a GPU may flush it to zero) or 0 (silently greedy). Tiny temperatures above it are well
#: defined: where z = x / T overflows, the shifted form of docs/ARCHITECTURE.md "Sampler semantics" rule 1 gives the
#: greedy limit.
MIN_TEMPERATURE = 2.0 ** -126
#: Largest finite float32 (the float fields are stored as float32 tensors in :class:`SamplerState`).
_FLOAT32_MAX = 3.4028234663852886e38
#: Upper bound of ``max_tokens`` (int64 counters on the device; 2**62 is SamplerState's "no cap" value).
_MAX_TOKENS_LIMIT = 1 << 62


def schedule_extremes(t_min: float, t_max: float, max_denoising_steps: int) -> tuple[float, float]:
    """(lowest, highest) temperature of rule 1's schedule ``T = t_min + (t_max - t_min) * (S - s) / S`` over
    s in [0, S), evaluated in float32 in that order, as :func:`blockdiff.sampler.common.temperature` does: T is
    non-increasing in s (every float32 operation is monotone), so they are T at s = S - 1 and at s = 0.

    Raises:
        TypeError: ``max_denoising_steps`` not an int (a bool, a float: 2.5 was truncated to 2).
        ValueError: ``max_denoising_steps`` outside [1, 2**14) (:data:`.rng.MAX_STEPS`; 0 gave ``(inf, nan)``, -3 a
            "lowest" temperature below ``t_min``).
    """
    if not _is_int(max_denoising_steps):
        raise TypeError(f"max_denoising_steps must be an int, got {type(max_denoising_steps).__name__} "
                        f"({max_denoising_steps!r})")
    if not 1 <= max_denoising_steps < MAX_STEPS:
        raise ValueError(f"max_denoising_steps must be in [1, {MAX_STEPS}), got {max_denoising_steps}")
    t = torch.tensor([t_min, t_max], dtype=torch.float32)
    S = torch.tensor(max_denoising_steps, dtype=torch.int32)
    k = torch.tensor([1, max_denoising_steps], dtype=torch.int32)       # S - s at s = S - 1 and s = 0
    T = t[0] + ((t[1] - t[0]) * k.to(torch.float32)) / S.to(torch.float32)
    return float(T[0]), float(T[1])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x) -> bool:
    """``math.isfinite`` of an int or float, False for an int beyond float's range (where ``math.isfinite`` raises
    OverflowError: a request's ``t_max = 10**400``, as a JSON client may send, must be refused, not raise)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _show_real(x) -> str:
    """``x`` for a message: an int beyond float's range by its size (its decimal digits may be too many to print)."""
    return f"an int of {x.bit_length()} bits" if isinstance(x, int) and not _finite(x) else f"{x}"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request; validated on construction.

    Attributes:
        canvas_length: tokens per canvas (CL), 1 <= CL < 2**16; must equal the SamplerState's.
        max_denoising_steps: step cap S per canvas, 1 <= S < 2**14 (counter layout of :mod:`.rng`).
        t_min, t_max: temperature at the last / first step; 0 <= t_min <= t_max, finite. ``t_max == 0`` is greedy
            (T = 0: no noise, all entropies 0); otherwise every temperature of the float32 schedule (rule 1,
            :func:`schedule_extremes`) must be finite and >= :data:`MIN_TEMPERATURE` (2**-126, float32's smallest
            normal): e.g. t_min = t_max = 1e-38 is refused, (0, 1e-30) accepted. (transformers requires
            t_max > t_min strictly; docs/ARCHITECTURE.md allows t_min == t_max, which T = 0 needs. A checkpoint's
            exported defaults keep transformers' rules: docs/ARCHITECTURE.md section 7, "Exported sampling
            defaults".)
        entropy_bound: acceptance budget in nats, >= 0 and finite (the lowest-entropy position is always accepted).
        confidence_threshold: mean-entropy threshold in nats for convergence (strict ``<``), >= 0 and finite.
        stability_threshold: k in [0, 2**31); convergence needs the last k + 1 argmax canvases identical.
        seed: RNG seed, 0 <= seed < 2**63 (Philox key, see :mod:`.rng`).
        eos_token_ids: token ids that end the request (the first one emitted is kept); each >= 0.
        max_tokens: cap on emitted tokens of the request (None = no cap), in [1, 2**62].
        Float fields must also be finite in float32 (the device state's dtype).

    Raises:
        TypeError: a field has the wrong type (names the field).
        ValueError: a field breaks its rule above (names the field and the rule).
    """

    canvas_length: int = 256
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    confidence_threshold: float = 0.005
    stability_threshold: int = 1
    seed: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.eos_token_ids, tuple):
            if isinstance(self.eos_token_ids, (list, set, frozenset)) or _is_int(self.eos_token_ids):
                if isinstance(self.eos_token_ids, (set, frozenset)):  # sorted below: check the items first
                    for t in self.eos_token_ids:
                        if not _is_int(t):
                            raise TypeError(f"eos_token_ids must hold ints, got {type(t).__name__} ({t!r})")
                ids = (self.eos_token_ids,) if _is_int(self.eos_token_ids) else tuple(sorted(self.eos_token_ids))
                object.__setattr__(self, "eos_token_ids", ids)
            else:
                raise TypeError(f"eos_token_ids must be a tuple/list of ints, got {type(self.eos_token_ids).__name__}")
        self.validate()

    def validate(self) -> None:
        """Check every field; raise TypeError/ValueError naming the first bad one."""
        for name in ("canvas_length", "max_denoising_steps", "stability_threshold", "seed"):
            v = getattr(self, name)
            if not _is_int(v):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
        for name in ("t_min", "t_max", "entropy_bound", "confidence_threshold"):
            v = getattr(self, name)
            if not _is_real(v):
                raise TypeError(f"{name} must be a float, got {type(v).__name__} ({v!r})")
            if not _finite(v):
                raise ValueError(f"{name} must be finite, got {_show_real(v)}")
            if abs(v) > _FLOAT32_MAX:  # stored as float32 on the device: would be inf there (inf - inf = NaN T)
                raise ValueError(f"{name} must be representable in float32 (|{name}| <= {_FLOAT32_MAX:.4e}), got {v}")
        if not 1 <= self.canvas_length < MAX_POSITIONS:
            raise ValueError(f"canvas_length must be in [1, {MAX_POSITIONS}), got {self.canvas_length}")
        if not 1 <= self.max_denoising_steps < MAX_STEPS:
            raise ValueError(f"max_denoising_steps must be in [1, {MAX_STEPS}), got {self.max_denoising_steps}")
        for name in ("t_min", "t_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.t_max < self.t_min:
            raise ValueError(f"t_max must be >= t_min, got t_max={self.t_max} < t_min={self.t_min}")
        if self.t_max != 0:
            lo, hi = schedule_extremes(self.t_min, self.t_max, self.max_denoising_steps)
            if not math.isfinite(hi):
                raise ValueError(f"t_max={self.t_max} with t_min={self.t_min} gives the temperature {hi} at step 0 "
                                 f"((t_max - t_min) * max_denoising_steps overflows float32)")
            if lo < MIN_TEMPERATURE:
                raise ValueError(f"t_min={self.t_min} / t_max={self.t_max} give the temperature {lo:.4g} at the last "
                                 f"step, below MIN_TEMPERATURE = 2**-126 (float32's smallest normal); use "
                                 f"t_min = t_max = 0 for greedy")
        if self.entropy_bound < 0:
            raise ValueError(f"entropy_bound must be >= 0 nats, got {self.entropy_bound}")
        if self.confidence_threshold < 0:
            raise ValueError(f"confidence_threshold must be >= 0 nats, got {self.confidence_threshold}")
        if not 0 <= self.stability_threshold < (1 << 31):
            raise ValueError(f"stability_threshold must be in [0, 2**31) (int32 on the device), got "
                             f"{self.stability_threshold}")
        if not 0 <= self.seed < (1 << 63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for t in self.eos_token_ids:
            if not _is_int(t):
                raise TypeError(f"eos_token_ids must hold ints, got {type(t).__name__} ({t!r})")
            if t < 0:
                raise ValueError(f"eos_token_ids must be >= 0, got {t}")
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise TypeError(f"max_tokens must be an int or None, got {type(self.max_tokens).__name__}")
            if not 1 <= self.max_tokens <= _MAX_TOKENS_LIMIT:
                raise ValueError(f"max_tokens must be in [1, 2**62] or None, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """True when every step has T = 0 (t_max == 0)."""
        return self.t_max == 0.0
