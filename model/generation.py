"""A checkpoint's default sampling parameters: ``generation_config.json`` (transformers'
``DiffusionGemmaGenerationConfig``) and ``config.json``'s ``canvas_length``, under the field names of
:class:`blockdiff.sampler.SamplingParams` (so ``SamplingParams(**load_generation_config(folder))`` is the
checkpoint's default request; explicit request parameters override it).

Mapping (transformers -> SamplingParams keyword):

==================================  ===========================================================================
``config.json`` ``canvas_length``   ``canvas_length``
``max_denoising_steps``             ``max_denoising_steps``
``t_min`` / ``t_max``               ``t_min`` / ``t_max``
``sampler_config.entropy_bound``    ``entropy_bound`` (``sampler_config``: an ``EntropyBoundSamplerConfig``)
``confidence_threshold``            ``confidence_threshold``
``stability_threshold``             ``stability_threshold``
``eos_token_id`` (int or list)      ``eos_token_ids`` (tuple; ``()`` when unset: transformers then stops at no eos)
``max_new_tokens``                  ``max_tokens`` (None when unset)
==================================  ===========================================================================

A field the file leaves out takes :data:`GENERATION_DEFAULTS` (transformers'
``DiffusionGemmaGenerationConfig._get_default_generation_params()``, also SamplingParams' defaults); no file at
all means every default and no eos ids (transformers builds an empty ``DiffusionGemmaGenerationConfig``: its
``from_model_config`` is not implemented, so the model config's ``eos_token_id`` is not used).

Source: transformers 5.24 ``models/diffusion_gemma/generation_diffusion_gemma.py``
(``DiffusionGemmaGenerationConfig.__init__`` / ``validate``, ``EntropyBoundSamplerConfig``,
``DiffusionGemmaGenerationMixin._prepare_generation_config``).
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from .config import FLOAT32_MAX, FLOAT32_TINY, DiffusionGemmaConfig, finite_real, read_json_object, show_real
from .errors import CheckpointError, CheckpointFileNotFoundError

__all__ = ["GENERATION_FILE", "GENERATION_DEFAULTS", "MAX_DENOISING_STEPS", "MIN_TEMPERATURE", "generation_defaults",
           "load_generation_config", "parse_generation_config", "schedule_extremes"]

GENERATION_FILE = "generation_config.json"
#: transformers' ``DiffusionGemmaGenerationConfig._get_default_generation_params()`` (SamplingParams' defaults).
GENERATION_DEFAULTS = {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
                       "confidence_threshold": 0.005, "stability_threshold": 1}
#: ``max_denoising_steps`` must be below this: the sampler's RNG counter layout
#: (``blockdiff.sampler.rng.MAX_STEPS``; tests/model checks the two agree).
MAX_DENOISING_STEPS = 1 << 14
#: The lowest temperature of a schedule the sampler takes: float32's smallest normal number, 2**-126
#: (``blockdiff.sampler.params.MIN_TEMPERATURE``, repeated: model and sampler are independent layers; tests/model
#: checks the two agree).
MIN_TEMPERATURE = FLOAT32_TINY
_MAX_TOKENS = 1 << 62  # SamplingParams.max_tokens' upper bound
_ENTROPY_BOUND_SAMPLER = "EntropyBoundSamplerConfig"
#: Keys of transformers' DiffusionGemmaGenerationConfig that do not change the default request: the output format,
#: transformers' own cache choice, the ids transformers pads / starts with, and metadata.
_IGNORED_KEYS = ("return_dict_in_generate", "cache_implementation", "cache_config", "disable_compile",
                 "bos_token_id", "pad_token_id", "_commit_hash", "_from_model_config", "transformers_version")
_KEYS = (*GENERATION_DEFAULTS, "sampler_config", "eos_token_id", "max_new_tokens", "max_length", *_IGNORED_KEYS)
_KEYS = tuple(k for k in _KEYS if k != "entropy_bound")  # entropy_bound lives in sampler_config


def schedule_extremes(t_min: float, t_max: float, max_denoising_steps: int) -> tuple[float, float]:
    """(lowest, highest) temperature of the sampler's schedule ``T = t_min + (t_max - t_min) * (S - s) / S`` over
    s in [0, S), in float32 in that order (docs/ARCHITECTURE.md "Sampler semantics" rule 1): T at s = S - 1 and at
    s = 0. The same values as ``blockdiff.sampler.params.schedule_extremes`` (model and sampler are independent
    layers; tests/model checks the two agree).

    Raises:
        TypeError: ``max_denoising_steps`` not an int (a bool, a float: 2.5 was truncated to 2).
        ValueError: ``max_denoising_steps`` outside [1, 2**14) (0 gave ``(inf, nan)``, -3 a "lowest" temperature
            below ``t_min``).
    """
    if isinstance(max_denoising_steps, bool) or not isinstance(max_denoising_steps, numbers.Integral):
        raise TypeError(f"max_denoising_steps must be an int, got {type(max_denoising_steps).__name__} "
                        f"({max_denoising_steps!r})")
    if not 1 <= max_denoising_steps < MAX_DENOISING_STEPS:
        raise ValueError(f"max_denoising_steps must be in [1, 2**14), got {max_denoising_steps}")
    max_denoising_steps = int(max_denoising_steps)
    f32 = torch.float32
    lo_hi = torch.tensor([t_min, t_max], dtype=f32)
    k = torch.tensor([1, max_denoising_steps], dtype=torch.int32).to(f32)  # S - s at s = S - 1 and at s = 0
    T = lo_hi[0] + ((lo_hi[1] - lo_hi[0]) * k) / torch.tensor(max_denoising_steps, dtype=torch.int32).to(f32)
    return float(T[0]), float(T[1])


def generation_defaults(config: DiffusionGemmaConfig) -> dict:
    """SamplingParams keywords of a checkpoint without ``generation_config.json``: ``config.canvas_length`` and
    :data:`GENERATION_DEFAULTS`, no eos ids, no token cap."""
    if not isinstance(config, DiffusionGemmaConfig):
        raise TypeError(f"config must be a DiffusionGemmaConfig, got {type(config).__name__}")
    return {"canvas_length": config.canvas_length, **GENERATION_DEFAULTS, "eos_token_ids": (), "max_tokens": None}


def load_generation_config(folder, config: DiffusionGemmaConfig | None = None) -> dict:
    """The default sampling parameters of the checkpoint folder ``folder`` (see the module docstring).

    Args:
        folder: a checkpoint folder (str / os.PathLike); ``generation_config.json`` in it is optional.
        config: the checkpoint's :class:`DiffusionGemmaConfig` (gives ``canvas_length`` and the vocabulary the eos
            ids must be in); None reads ``config.json`` of ``folder``.

    Returns:
        dict with the keys ``canvas_length``, ``max_denoising_steps``, ``t_min``, ``t_max``, ``entropy_bound``,
        ``confidence_threshold``, ``stability_threshold`` (as SamplingParams types them: ints, floats),
        ``eos_token_ids`` (tuple of ints) and ``max_tokens`` (int or None).

    Raises:
        TypeError: ``folder`` not a str / os.PathLike, ``config`` not a DiffusionGemmaConfig.
        CheckpointFileNotFoundError: ``folder`` is not a folder, or ``config`` is None and it has no
            ``config.json``.
        CheckpointError: ``generation_config.json`` (or ``config.json``) is not a JSON object, has a key
            transformers' DiffusionGemmaGenerationConfig does not take, or a value breaking its rule (see
            :func:`parse_generation_config`); the message names the file and the field.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a str or os.PathLike (a checkpoint folder), got {type(folder).__name__}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointFileNotFoundError(f"checkpoint folder {folder!r} does not exist or is not a folder")
    if config is None:
        config = DiffusionGemmaConfig.from_hf(folder)
    elif not isinstance(config, DiffusionGemmaConfig):
        raise TypeError(f"config must be a DiffusionGemmaConfig or None, got {type(config).__name__}")
    path = os.path.join(folder, GENERATION_FILE)
    if not os.path.exists(path):
        return generation_defaults(config)
    d = read_json_object(path, GENERATION_FILE)
    try:
        return parse_generation_config(d, config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{GENERATION_FILE} ({path}): {e}") from e


def parse_generation_config(d: dict, config: DiffusionGemmaConfig) -> dict:
    """SamplingParams keywords of a ``generation_config.json`` dict ``d`` (see :func:`load_generation_config`).

    Rules (transformers' ``DiffusionGemmaGenerationConfig.validate`` / ``EntropyBoundSamplerConfig``, checked on
    the values after the defaults fill what ``d`` leaves out, plus the sampler's ranges): only transformers' keys;
    ``max_denoising_steps`` an int in [1, 2**14); ``t_min``, ``t_max`` finite numbers with ``0 <= t_min < t_max``;
    ``t_max`` not 0 in float32 (the sampler's greedy flag); every temperature of the float32 schedule
    (:func:`schedule_extremes`) finite and >= :data:`MIN_TEMPERATURE`
    (2**-126: the sampler refuses a request below it, docs/ARCHITECTURE.md section 7, "Exported sampling defaults");
    ``sampler_config`` an ``EntropyBoundSamplerConfig`` (``{"entropy_bound": x, "_cls_name":
    "EntropyBoundSamplerConfig"}``) with ``entropy_bound > 0``; ``confidence_threshold > 0``; floats finite in
    float32; ``stability_threshold`` an int in [0, 2**31); ``eos_token_id`` None, an int or a list of ints in
    [0, vocab_size); ``max_new_tokens`` None or an int in [1, 2**62]; ``max_length`` None (a total-length cap
    depends on the prompt, which a default request does not know: use ``max_new_tokens``).

    Raises:
        TypeError: a value of the wrong type (named). ValueError: an unknown key or a value breaking its rule.
    """
    if not isinstance(d, dict):
        raise TypeError(f"a generation config must be a dict (a JSON object), got {type(d).__name__}")
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown} (transformers' DiffusionGemmaGenerationConfig takes "
                         f"{sorted(_KEYS)})")
    out = generation_defaults(config)
    for name in ("max_denoising_steps", "t_min", "t_max", "confidence_threshold", "stability_threshold"):
        if d.get(name) is not None:
            out[name] = d[name]
    sc = d.get("sampler_config")
    if sc is not None:
        if not isinstance(sc, dict):
            raise TypeError(f"sampler_config must be an EntropyBoundSamplerConfig object ({{'entropy_bound': x, "
                            f"'_cls_name': '{_ENTROPY_BOUND_SAMPLER}'}}), got {type(sc).__name__}")
        cls_name = sc.get("_cls_name", _ENTROPY_BOUND_SAMPLER)
        if cls_name != _ENTROPY_BOUND_SAMPLER:
            raise ValueError(f"sampler_config._cls_name must be {_ENTROPY_BOUND_SAMPLER!r} (the only sampler), got "
                             f"{cls_name!r}")
        extra = sorted(set(sc) - {"entropy_bound", "_cls_name"})
        if extra or "entropy_bound" not in sc:
            raise ValueError(f"sampler_config must hold entropy_bound (and _cls_name) only, got keys {sorted(sc)}")
        out["entropy_bound"] = sc["entropy_bound"]
    for name in ("max_denoising_steps", "stability_threshold"):
        if isinstance(out[name], bool) or not isinstance(out[name], numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(out[name]).__name__} {out[name]!r}")
        out[name] = int(out[name])
    if not 1 <= out["max_denoising_steps"] < MAX_DENOISING_STEPS:
        raise ValueError(f"max_denoising_steps must be in [1, 2**14), got {out['max_denoising_steps']}")
    if not 0 <= out["stability_threshold"] < (1 << 31):
        raise ValueError(f"stability_threshold must be in [0, 2**31), got {out['stability_threshold']}")
    for name in ("t_min", "t_max", "entropy_bound", "confidence_threshold"):
        v = out[name]
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
        if not finite_real(v) or abs(v) > FLOAT32_MAX:
            raise ValueError(f"{name} must be finite in float32, got {show_real(v)}")
        out[name] = float(v)
    if out["t_min"] < 0:
        raise ValueError(f"t_min must be >= 0, got {out['t_min']}")
    if not out["t_max"] > out["t_min"]:
        raise ValueError(f"t_max must be > t_min (transformers' rule), got t_max={out['t_max']}, "
                         f"t_min={out['t_min']}")
    if float(torch.tensor(out["t_max"], dtype=torch.float32)) == 0.0:  # e.g. 1e-46: > t_min = 0 in float64 only
        raise ValueError(f"t_max={out['t_max']} rounds to 0 in float32, which the sampler reads as greedy "
                         "(t_max == 0), not the sampled schedule the file asks for")
    # the schedule the sampler runs (float32, SamplingParams' rule): a default request it refuses is a bad file, not an
    # error of the first request that takes the defaults (a traceback in blockdiff demo, a refused engine start)
    lo, hi = schedule_extremes(out["t_min"], out["t_max"], out["max_denoising_steps"])
    steps = out["max_denoising_steps"]
    if not math.isfinite(hi):
        raise ValueError(f"t_max={out['t_max']} with t_min={out['t_min']} and max_denoising_steps={steps} gives the "
                         f"temperature {hi} at the first step ((t_max - t_min) * max_denoising_steps overflows "
                         "float32)")
    if lo < MIN_TEMPERATURE:
        raise ValueError(f"t_min={out['t_min']} / t_max={out['t_max']} with max_denoising_steps={steps} give the "
                         f"temperature {lo:.4g} at the last step, below MIN_TEMPERATURE = 2**-126 (float32's smallest "
                         f"normal; the sampler refuses such a request)")
    for name in ("entropy_bound", "confidence_threshold"):
        if not out[name] > 0:
            raise ValueError(f"{name} must be > 0 nats, got {out[name]}")
    eos = d.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
            if not 0 <= t < config.vocab_size:
                raise ValueError(f"eos_token_id must be in [0, vocab_size = {config.vocab_size}), got {eos!r}")
        out["eos_token_ids"] = tuple(sorted({int(t) for t in ids}))
    for name in ("bos_token_id", "pad_token_id"):  # a value of another type is a TypeError, as eos_token_id's is
        v = d.get(name)
        if v is None:
            continue
        rule = f"{name} must be None or an int in [0, vocab_size = {config.vocab_size}), got {v!r}"
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(rule)
        if not 0 <= v < config.vocab_size:
            raise ValueError(rule)
    mnt = d.get("max_new_tokens")
    if mnt is not None:
        rule = f"max_new_tokens must be None or an int in [1, 2**62], got {mnt!r}"
        if isinstance(mnt, bool) or not isinstance(mnt, numbers.Integral):
            raise TypeError(rule)
        if not 1 <= mnt <= _MAX_TOKENS:
            raise ValueError(rule)
        out["max_tokens"] = int(mnt)
    if d.get("max_length") is not None:
        raise ValueError(f"max_length {d['max_length']!r} is not supported: a total-length cap depends on each "
                         "prompt's length; set max_new_tokens instead")
    return out
