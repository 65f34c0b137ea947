"""DiffusionGemma text configuration (field names mirror transformers' ``DiffusionGemmaTextConfig``).

Source: transformers 5.24 ``models/diffusion_gemma/configuration_diffusion_gemma.py`` (Gemma 4 text backbone,
``models/gemma4``). Only the text model is described: the vision tower is out of scope.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError, CheckpointFileNotFoundError

LAYER_TYPES = ("sliding_attention", "full_attention")
BIDIRECTIONAL_WINDOWS = ("prefix", "symmetric")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu")
#: Largest canvas_length: the sampler's position counters hold positions < 2**16
#: (``blockdiff.sampler.rng.MAX_POSITIONS``; tests/model checks the two agree).
MAX_CANVAS_LENGTH = (1 << 16) - 1
#: float32's largest finite value and smallest normal number. The model computes its norms, RoPE angles and logit
#: softcap in float32 (bf16 / fp16 / fp32 models alike), so a float field must survive that conversion: above
#: FLOAT32_MAX it becomes inf, below FLOAT32_TINY 0 or a denormal (which a GPU may flush to 0). An rms_norm_eps,
#: final_logit_softcapping, rope_theta or RoPE factor out there made every logit NaN (each request failed) or 0.
FLOAT32_MAX = 3.4028234663852886e38
#: Largest max_position_embeddings: positions are int64 (the model compares them with it; beyond, torch wraps the
#: bound to a negative int64 and refuses every position, or raises OverflowError).
MAX_POSITION_EMBEDDINGS = (1 << 63) - 1
FLOAT32_TINY = 2.0 ** -126
#: Largest value of an integer size field other than ``max_position_embeddings``: 2**31 - 1, the sampler's int32
#: sizes (``SamplerState``: vocab_size, hidden_size < 2**31) and the attention backends' int32 offsets.
MAX_SIZE = (1 << 31) - 1
#: Largest ``num_hidden_layers`` and ``head_dim`` / ``global_head_dim``: far above any model (Gemma 4: 30 to 62 layers,
#: heads of 256 / 512), and what keeps checking a config cheap: the default ``layer_types`` list, the RoPE tables of
#: the angle rule and a model's layer modules (built on the meta device before a checkpoint's weights are compared
#: with it) grow with them; a config.json with 2**40 layers or head_dim 2**36 had the process killed for memory.
MAX_HIDDEN_LAYERS = 1 << 12
MAX_HEAD_DIM = 1 << 16
#: Largest element count of one weight tensor: its bytes in float64 (the widest model dtype) must fit torch's int64
#: storage size ("Storage size calculation overflowed" from inside the model's construction otherwise).
MAX_WEIGHT_NUMEL = ((1 << 63) - 1) // 8
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads",
               "max_position_embeddings", "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size",
               "canvas_length")


def _int_bound(name: str) -> dict:
    """``hi`` / ``why`` keywords of :func:`_check_int` for the integer field ``name`` (see :data:`MAX_SIZE`)."""
    if name == "max_position_embeddings":  # its own rule in validate (int64 positions)
        return {}
    if name == "num_hidden_layers":
        return dict(hi=MAX_HIDDEN_LAYERS, why=" (MAX_HIDDEN_LAYERS: far above any model; checking a config and "
                                              "building a model grow with it)")
    if name in ("head_dim", "global_head_dim"):
        return dict(hi=MAX_HEAD_DIM, why=" (MAX_HEAD_DIM: far above any model; the RoPE tables grow with it)")
    return dict(hi=MAX_SIZE, why=" (2**31 - 1: the sampler's int32 sizes and the attention backends' int32 offsets)")


def _show(v) -> str:
    return f"{type(v).__name__} {show_real(v)}"


def finite_real(v) -> bool:
    """``math.isfinite`` of a real number, False for an int beyond float's range (``math.isfinite`` raises
    OverflowError there: a JSON file's ``1`` followed by 400 zeros is such an int, and must be refused by name)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def show_real(v) -> str:
    """``repr(v)`` for a message; an int beyond float's range by its size (its digits may be too many to print)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and not finite_real(v):
        return f"an int of {int(v).bit_length()} bits"
    return repr(v)


def _check_int(name: str, v, lo: int, *, allow_none: bool = False, hi: int | None = None, why: str = "") -> None:
    """``v`` is an int (not bool / float / str) >= lo (and <= hi unless None); TypeError / ValueError naming ``name``
    otherwise (``why``: the reason for ``hi``, in the message)."""
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {lo}, got {_show(v)}")
    if v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be an int <= {hi}{why}, got {show_real(v)}")


#: The float fields of :class:`DiffusionGemmaConfig` and the float keys of a ``rope_parameters`` entry.
_FLOAT_FIELDS = ("rms_norm_eps", "initializer_range", "final_logit_softcapping")
_ROPE_FLOAT_KEYS = ("rope_theta", "partial_rotary_factor", "factor")


def _is_number(v) -> bool:
    """An int (not bool), a float, or a numpy floating scalar of at most 64 bits: the types a float field takes,
    each held exactly by a Python int / float (a Fraction, a Decimal or a float128 is not: ``float()`` rounds it,
    and JSON has no such type)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, (numbers.Integral, float)):
        return True
    dt = getattr(v, "dtype", None)  # numpy float16 / float32 scalars (numbers.Real, not float)
    return isinstance(v, numbers.Real) and getattr(dt, "kind", None) == "f" and getattr(dt, "itemsize", 16) <= 8


def _as_number(v):
    """``v`` as a plain Python int / float when it is a number of another class that one holds exactly (integer
    scalars such as numpy's -> int, numpy float16 / float32 / float64 scalars -> float); anything else unchanged
    (validate refuses it, naming the field). Keeps the config JSON-serialisable and its values exact."""
    if isinstance(v, bool) or not _is_number(v):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def _check_real(name: str, v, *, positive: bool, none_hint: str = "") -> None:
    """``v`` is a finite real number (an int or a float, or a numpy float scalar of <= 64 bits; not bool / str /
    Fraction / Decimal), > 0 if ``positive`` else >= 0."""
    rule = "> 0" if positive else ">= 0"
    if not _is_number(v):  # (a Fraction was stored as it was: not JSON, and float() of 1/3 rounds)
        raise TypeError(f"{name} must be a finite number {rule}{none_hint} (an int or a float), got {_show(v)}")
    v = _as_number(v)  # (a numpy float16 compared with FLOAT32_MAX overflowed numpy's cast)
    if not finite_real(v) or not (v > 0 if positive else v >= 0):
        raise ValueError(f"{name} must be a finite number {rule}{none_hint}, got {show_real(v)}")
    if v > FLOAT32_MAX or (v != 0 and v < FLOAT32_TINY):  # (0 itself only where the rule allows it)
        raise ValueError(f"{name} must be {'0 or ' if not positive else ''}within float32's normal range "
                         f"[2**-126, {FLOAT32_MAX:.4e}] (the model computes with it in float32, where it would "
                         f"be {'inf' if v > FLOAT32_MAX else '0 or a denormal'}){none_hint}, got {v!r}")


def read_json_object(path: str, what: str | None = None) -> dict:
    """The JSON object (dict) in the file ``path``.

    Raises:
        CheckpointFileNotFoundError: no file at ``path``.
        CheckpointError: the file cannot be read, is not UTF-8 JSON, or holds something other than an object
            (the message names the file, and the line / column of a syntax error).
    """
    what = what or os.path.basename(path)
    if not os.path.exists(path):
        raise CheckpointFileNotFoundError(f"{what}: no file at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} ({path}) cannot be read: {e}") from e
    if not text.strip():
        raise CheckpointError(f"{what} ({path}) is empty: it must hold a JSON object")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} ({path}) is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{what} ({path}) must hold a JSON object, got a JSON {type(d).__name__}")
    return d


def default_rope_parameters() -> dict[str, dict[str, Any]]:
    """transformers' defaults: default RoPE (theta 1e4) on sliding layers, proportional partial RoPE
    (factor 0.25, theta 1e6) on full layers."""
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


def rope_inv_freq(rope_params: dict, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` of one layer type (transformers' rope init functions), computed
    in ``dtype`` (fp32 reproduces transformers bit for bit; fp64 for oracle runs).

    ``default``: ``1 / theta^(2i / d)`` with ``d = head_dim * partial_rotary_factor``.
    ``proportional`` (Gemma 4 full layers): ``1 / theta^(2i / head_dim)`` for the first
    ``partial_rotary_factor * head_dim / 2`` angles, zeros (identity rotation) for the rest, then ``/ factor``.
    """
    theta = float(rope_params["rope_theta"])
    prf = float(rope_params.get("partial_rotary_factor", 1.0))
    if rope_params.get("rope_type", "default") == "proportional":
        angles = int(prf * head_dim // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype) / head_dim))
        nope = head_dim // 2 - angles
        if nope > 0:
            inv = torch.cat([inv, torch.zeros(nope, dtype=dtype)])
        return inv / float(rope_params.get("factor", 1.0))
    dim = int(head_dim * prf)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim))


@dataclass
class DiffusionGemmaConfig:
    """Text configuration of a DiffusionGemma model (Gemma 4 backbone, every layer dense MLP + MoE).

    Field names follow transformers' ``DiffusionGemmaTextConfig`` (plus ``canvas_length`` from the outer
    ``DiffusionGemmaConfig``). Per-layer geometry: sliding layers use ``head_dim`` / ``num_key_value_heads``;
    full layers use ``global_head_dim`` / ``num_global_key_value_heads`` and have no ``v_proj`` (V is the
    un-roped, v-normed K projection).

    Attributes beyond transformers' names:
        bidirectional_window: window rule of bidirectional (denoise) rows on sliding layers:
            ``"prefix"`` (transformers: the last ``window_size`` context keys plus every canvas key; default)
            or ``"symmetric"`` (vLLM / JAX: ``|q - k| <= window_size``).

    Derived:
        window_size: ``sliding_window - 1`` keys per side, not counting the query's own position. transformers'
            causal sliding mask is ``kv > q - sliding_window`` and its sliding cache keeps the last
            ``sliding_window - 1`` tokens, so Gemma's ``sliding_window=1024`` is FlashAttention's ``W = 1023``.

    Raises (in ``__post_init__``, see :meth:`validate` for the rules):
        TypeError: a field of the wrong type (named in the message).
        ValueError: an out-of-range, inconsistent or unsupported field (named in the message, with the rule).
    """

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    use_bidirectional_attention: str | None = None
    num_experts: int = 8
    top_k_experts: int = 2
    moe_intermediate_size: int = 256
    canvas_length: int = 256
    bidirectional_window: str = "prefix"

    def __post_init__(self):
        # normalisation first (defaults that depend on other fields), then every rule in validate()
        _check_int("num_hidden_layers", self.num_hidden_layers, 1, **_int_bound("num_hidden_layers"))  # before its list
        self.num_hidden_layers = int(self.num_hidden_layers)
        if self.layer_types is None:
            # transformers' default pattern: 5 sliding : 1 full
            self.layer_types = [
                "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(self.num_hidden_layers)
            ]
        if not isinstance(self.layer_types, (list, tuple)):
            raise TypeError(f"layer_types must be a list of str, got {type(self.layer_types).__name__}")
        self.layer_types = list(self.layer_types)
        if self.rope_parameters is None:
            self.rope_parameters = default_rope_parameters()
        if not isinstance(self.rope_parameters, dict):
            raise TypeError(f"rope_parameters must be a dict (layer type -> RoPE settings), got "
                            f"{type(self.rope_parameters).__name__}")
        self.rope_parameters = copy.deepcopy(self.rope_parameters)
        if self.num_global_key_value_heads is None:
            self.num_global_key_value_heads = self.num_key_value_heads
        if isinstance(self.eos_token_id, tuple):
            self.eos_token_id = list(self.eos_token_id)
        for name in _INT_FIELDS:  # numpy / torch integer scalars -> int (bool and float stay refused)
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                setattr(self, name, int(v))
        # the float fields and token ids alike: numpy scalars -> int / float, exactly, so that to_dict() is JSON
        # (a numpy float32 / int64 was stored as it was); Fraction / Decimal stay and are refused by validate()
        for name in _FLOAT_FIELDS + ("pad_token_id", "bos_token_id"):
            setattr(self, name, _as_number(getattr(self, name)))
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = [_as_number(t) for t in self.eos_token_id]
        else:
            self.eos_token_id = _as_number(self.eos_token_id)
        for rp in self.rope_parameters.values():
            if isinstance(rp, dict):
                for k in _ROPE_FLOAT_KEYS:
                    if k in rp:
                        rp[k] = _as_number(rp[k])
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (also after a field was changed in place;
        :class:`~blockdiff.model.DiffusionGemma` calls it on construction).

        Rules: the integer sizes are ints (not bool / float / str) >= 1 and <= :data:`MAX_SIZE` (2**31 - 1;
        ``num_hidden_layers`` <= :data:`MAX_HIDDEN_LAYERS`, ``head_dim`` / ``global_head_dim`` <= :data:`MAX_HEAD_DIM`),
        with every weight tensor at most :data:`MAX_WEIGHT_NUMEL` elements; ``num_attention_heads`` a multiple of
        both KV-head counts; ``head_dim`` / ``global_head_dim`` even; ``top_k_experts <= num_experts``;
        ``max_position_embeddings <= 2**63 - 1`` (int64 positions);
        ``1 <= canvas_length <= min(max_position_embeddings, MAX_CANVAS_LENGTH)``; ``rms_norm_eps > 0`` and
        finite; ``initializer_range >= 0`` and finite; ``final_logit_softcapping`` None (off) or > 0 and finite;
        per used layer type ``rope_parameters[type]`` holds ``rope_theta > 0`` (finite), an optional
        ``partial_rotary_factor`` in (0, 1] (``"default"`` RoPE: rotating an even number >= 2 of dims) and an
        optional ``factor > 0``; every float field above also within float32's normal range (0, or
        [:data:`FLOAT32_TINY` = 2**-126, :data:`FLOAT32_MAX`]: the model computes with them in float32), and
        the float32 RoPE angles ``position * inv_freq`` (:func:`rope_inv_freq`) finite for every position below
        ``max_position_embeddings``; token ids (``pad_token_id``, ``bos_token_id``, each ``eos_token_id``) None or
        in [0, vocab_size); booleans are bools; strings are one of their listed values. A float field is an int or
        a float (a numpy float16 / float32 / float64 scalar too, which the constructor stores as the Python float
        that holds it exactly, as it stores numpy integers as ints: ``to_dict()`` stays JSON); a Fraction, a
        Decimal or a float128 is a TypeError (``float()`` would round it).

        Raises:
            TypeError: a field of the wrong type (named, with the value).
            ValueError: a field breaking its rule (named, with the rule and the value).
        """
        for name in _INT_FIELDS:
            _check_int(name, getattr(self, name), 1, allow_none=name == "num_global_key_value_heads",
                       **_int_bound(name))
        if self.num_global_key_value_heads is None:
            raise ValueError("num_global_key_value_heads must be an int >= 1 (None is only a constructor "
                             "default: num_key_value_heads)")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {_show(getattr(self, name))}")
        if not isinstance(self.layer_types, list) or not all(isinstance(t, str) for t in self.layer_types):
            raise TypeError(f"layer_types must be a list of str, got {self.layer_types!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {bad}")
        if self.layer_types[-1] != "full_attention":
            # transformers forces this too (with a warning); we refuse silent rewrites.
            raise ValueError("layer_types[-1] must be 'full_attention' (transformers forces the last layer full)")
        for name, kv in (("num_key_value_heads", self.num_key_value_heads),
                         ("num_global_key_value_heads", self.num_global_key_value_heads)):
            if self.num_attention_heads % kv:
                raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                 f"{name} ({kv})")
        if self.head_dim % 2 or self.global_head_dim % 2:
            raise ValueError("head_dim and global_head_dim must be even (RoPE rotates halves)")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts ({self.top_k_experts}) must be <= num_experts ({self.num_experts})")
        H = self.hidden_size
        weights = (("vocab_size x hidden_size (embed_tokens)", self.vocab_size * H),
                   ("intermediate_size x hidden_size (the dense MLP)", self.intermediate_size * H),
                   ("num_experts x 2 * moe_intermediate_size x hidden_size (experts.gate_up_proj)",
                    self.num_experts * 2 * self.moe_intermediate_size * H),
                   ("num_attention_heads x head_dim x hidden_size (q_proj)",
                    self.num_attention_heads * self.head_dim * H),
                   ("num_attention_heads x global_head_dim x hidden_size (q_proj of full layers)",
                    self.num_attention_heads * self.global_head_dim * H))
        for what, n in weights:
            if n > MAX_WEIGHT_NUMEL:
                raise ValueError(f"{what} = {n} elements: one weight tensor must hold at most (2**63 - 1) // 8 (its "
                                 f"float64 bytes an int64, torch's storage size)")
        if self.max_position_embeddings > MAX_POSITION_EMBEDDINGS:  # positions are int64 tensors
            raise ValueError(f"max_position_embeddings must be <= 2**63 - 1 (positions are int64), got "
                             f"{self.max_position_embeddings}")
        cap = min(self.max_position_embeddings, MAX_CANVAS_LENGTH)
        if self.canvas_length > cap:
            raise ValueError(f"canvas_length must be <= min(max_position_embeddings = {self.max_position_embeddings}"
                             f", {MAX_CANVAS_LENGTH}), got {self.canvas_length}")
        _check_real("rms_norm_eps", self.rms_norm_eps, positive=True)
        _check_real("initializer_range", self.initializer_range, positive=False)
        if self.final_logit_softcapping is not None:
            # 0 would make every logit 0 (cap * tanh(x / cap)); None is "no softcapping"
            _check_real("final_logit_softcapping", self.final_logit_softcapping, positive=True,
                        none_hint=" (or None: no softcapping)")
        self._validate_rope()
        self._validate_token_ids()
        for name, allowed in (("hidden_activation", ACTIVATIONS), ("bidirectional_window", BIDIRECTIONAL_WINDOWS)):
            v = getattr(self, name)
            if not isinstance(v, str) or v not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
        if self.use_bidirectional_attention == "all":
            raise ValueError(
                "use_bidirectional_attention='all' (a bidirectional encoder with transformers' halved sliding "
                "window) is not supported: DiffusionGemma's encoder is causal on text")
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"use_bidirectional_attention must be None or 'vision', got "
                             f"{self.use_bidirectional_attention!r}")
        if not self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=False is not supported (DiffusionGemma ties lm_head to E)")

    def _validate_rope(self) -> None:
        if not isinstance(self.rope_parameters, dict):
            raise TypeError(f"rope_parameters must be a dict, got {type(self.rope_parameters).__name__}")
        for lt in sorted(set(self.layer_types)):
            rp = self.rope_parameters.get(lt)
            where = f"rope_parameters[{lt!r}]"
            if rp is None:
                raise ValueError(f"rope_parameters has no entry for layer type {lt!r}")
            if not isinstance(rp, dict):
                raise TypeError(f"{where} must be a dict, got {type(rp).__name__}")
            rope_type = rp.get("rope_type", "default")
            if rope_type not in ("default", "proportional"):
                raise ValueError(f"{where}.rope_type must be 'default' or 'proportional', got {rope_type!r}")
            if "rope_theta" not in rp:
                raise ValueError(f"{where} has no rope_theta (the RoPE base, > 0)")
            _check_real(f"{where}.rope_theta", rp["rope_theta"], positive=True)
            prf = rp.get("partial_rotary_factor", 1.0)
            _check_real(f"{where}.partial_rotary_factor", prf, positive=True)
            if prf > 1:
                raise ValueError(f"{where}.partial_rotary_factor must be in (0, 1], got {prf}")
            head_dim = self.head_dim if lt == "sliding_attention" else self.global_head_dim
            if rope_type == "default":
                rotated = int(head_dim * prf)
                if rotated < 2 or rotated % 2:
                    raise ValueError(f"{where}.partial_rotary_factor {prf} rotates int({head_dim} * {prf}) = "
                                     f"{rotated} dims of head_dim {head_dim}: must be an even number >= 2")
            if "factor" in rp:
                _check_real(f"{where}.factor", rp["factor"], positive=True)
            # the largest angle position * inv_freq (float32, as rope_cos_sin computes it) of any position the
            # model takes (< max_position_embeddings) must be finite: cos / sin of inf are NaN (a rope_theta or
            # factor near float32's smallest normal has inverse frequencies up to ~2**126)
            # on the CPU whatever the caller's default device: a config built under `with torch.device("meta")`
            # (a model built without allocating) has no values to read, and a CUDA default would sync
            with torch.device("cpu"):
                inv = rope_inv_freq(rp, head_dim, torch.float32)
                last = torch.tensor(float(self.max_position_embeddings - 1), dtype=torch.float32)
                top = (last * inv).abs().max() if inv.numel() else last * 0
            if not bool(torch.isfinite(inv).all()) or not bool(torch.isfinite(top)):
                raise ValueError(f"{where}: the RoPE inverse frequencies of rope_theta {rp['rope_theta']!r}"
                                 f"{', factor ' + repr(rp['factor']) if 'factor' in rp else ''} reach "
                                 f"{float(inv.abs().max()):.4g}, so the float32 angle position * inv_freq overflows "
                                 f"for positions below max_position_embeddings = {self.max_position_embeddings} "
                                 f"(cos / sin of it would be NaN)")

    def _validate_token_ids(self) -> None:
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            ids = v if name == "eos_token_id" and isinstance(v, list) else [v]
            for t in ids:
                if t is None and not isinstance(v, list):
                    continue
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"{name} must be an int{' or a list of ints' if name == 'eos_token_id' else ''}"
                                    f" or None, got {_show(v)}")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{name} must be in [0, vocab_size = {self.vocab_size}), got {v!r}")

    # ---- derived geometry -------------------------------------------------------------------------------
    @property
    def window_size(self) -> int:
        """Sliding-layer window W in FlashAttention's convention (keys per side, excluding the query)."""
        return self.sliding_window - 1

    def layer_head_dim(self, layer_idx: int) -> int:
        return self.head_dim if self.layer_types[layer_idx] == "sliding_attention" else self.global_head_dim

    def layer_num_kv_heads(self, layer_idx: int) -> int:
        if self.layer_types[layer_idx] == "sliding_attention":
            return self.num_key_value_heads
        return self.num_global_key_value_heads

    def layer_window_size(self, layer_idx: int) -> int | None:
        return self.window_size if self.layer_types[layer_idx] == "sliding_attention" else None

    # ---- conversion -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides) -> "DiffusionGemmaConfig":
        """Build from a transformers ``DiffusionGemmaConfig`` / ``DiffusionGemmaTextConfig`` object, a
        ``config.json`` dict of either, or a path to a ``config.json`` file or checkpoint folder.

        Raises:
            CheckpointFileNotFoundError: a path without a ``config.json``.
            CheckpointError: from a path: the file is not a JSON object, or any of the errors below (the message
                names the file and the field).
            TypeError, ValueError: a field of the wrong type or breaking its rule (see :meth:`validate`), a
                ``text_config`` / ``per_layer_config`` that is not a dict, no text config found, legacy RoPE keys
                (``rope_theta``, ``rope_local_base_freq``) without ``rope_parameters`` (they were ignored, as
                transformers' DiffusionGemmaConfig ignores them: the default RoPE served, not the file's), or a
                ``rope_scaling`` that is not null, with or without ``rope_parameters`` (transformers takes it as the
                whole RoPE in their place; blockdiff read the per-layer ``rope_parameters`` and ignored it).
        """
        if isinstance(hf_config, (str, os.PathLike)):
            path = os.fspath(hf_config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            d = read_json_object(path, "config.json")
            try:
                return cls.from_hf(d, **overrides)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"config.json ({path}): {e}") from e
        canvas_length = None
        if not isinstance(hf_config, dict):
            canvas_length = getattr(hf_config, "canvas_length", None)
            text = getattr(hf_config, "text_config", None) or hf_config
            if hasattr(text, "to_dict"):
                d = text.to_dict()
            elif hasattr(text, "__dict__"):
                d = dict(vars(text))
            else:
                raise TypeError(f"hf_config must be a transformers config, a config.json dict or a path, got "
                                f"{type(hf_config).__name__}")
        else:
            canvas_length = hf_config.get("canvas_length")
            text = hf_config.get("text_config")
            if text is not None and not isinstance(text, dict):
                raise TypeError(f"text_config must be a dict (a JSON object), got {type(text).__name__}")
            d = dict(text or hf_config)
        if "hidden_size" not in d:
            raise ValueError("hf_config has no text config (no hidden_size)")
        # rope_scaling: transformers 5.25's DiffusionGemmaConfig does not ignore it: it REPLACES rope_parameters with
        # it (a flat dict, beside rope_parameters too; its model then fails, KeyError 'full_attention'), so a file
        # holding one meant a scaled RoPE that blockdiff, reading rope_parameters, would silently not serve. No file
        # transformers writes holds one (its to_dict has no rope_scaling key): refused wherever it is not null.
        if d.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling: blockdiff does not serve RoPE scaling (transformers takes rope_scaling "
                             f"as the whole RoPE in place of rope_parameters), got {d['rope_scaling']!r}; give the "
                             "RoPE per layer type in rope_parameters and remove rope_scaling")
        legacy = sorted(k for k in ("rope_theta", "rope_local_base_freq") if d.get(k) is not None)
        # transformers' DiffusionGemmaConfig (5.25: "no BC for new models") ignores these two keys as well and serves
        # the default RoPE; a file that gives its RoPE only there meant other angles, which neither would serve:
        # refused (stricter than transformers). Files transformers writes always hold rope_parameters, so they load.
        if legacy and d.get("rope_parameters") is None:
            raise ValueError(f"{', '.join(legacy)}: legacy RoPE keys without rope_parameters; blockdiff reads RoPE "
                             "only from rope_parameters (layer type -> {rope_type, rope_theta, ...}): write them there")
        kwargs = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k in names:
                kwargs[k] = v
        # transformers gates the full-layer KV-head override on `attention_k_eq_v` (absent = True).
        if d.get("attention_k_eq_v", True) is False:
            kwargs.pop("num_global_key_value_heads", None)
        # transformers folds the full-layer geometry into per_layer_config; recover it.
        plc = d.get("per_layer_config") or {}
        if not isinstance(plc, dict):
            raise TypeError(f"per_layer_config must be a dict (layer index -> overrides), got {type(plc).__name__}")
        for layer_idx, lc in plc.items():
            if not isinstance(lc, dict):
                continue
            if "head_dim" in lc and "global_head_dim" not in d:
                kwargs["global_head_dim"] = lc["head_dim"]
            if "num_key_value_heads" in lc and d.get("num_global_key_value_heads") is None:
                kwargs["num_global_key_value_heads"] = lc["num_key_value_heads"]
        if not plc and "global_head_dim" not in d:
            kwargs.setdefault("global_head_dim", 512)  # transformers' default when nothing overrides it
        if canvas_length is not None:
            kwargs["canvas_length"] = canvas_length
        kwargs.update(overrides)
        return cls(**kwargs)


#: DiffusionGemma-26B-A4B text geometry (docs/ARCHITECTURE.md "Named workloads": 16 query heads; sliding layers
#: 8 KV heads x head_dim 256 with sliding_window 1024; full layers 2 KV heads x head_dim 512; 128 experts top-8 of
#: width 704; vocabulary 262144; 30 layers, 5 sliding : 1 full). MoE / MLP widths are the Gemma 4 26B-A4B model
#: card's; verify against the checkpoint's config.json when one is at hand. Keyword arguments of
#: :class:`DiffusionGemmaConfig`; ``bench_e2e`` and ``bench_serve`` build the model from it.
DIFFUSIONGEMMA_26B_A4B: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, sliding_window=1024, canvas_length=256,
)
#: Named geometries (``blockdiff export --geometry NAME``): name -> :class:`DiffusionGemmaConfig` keywords.
GEOMETRIES: dict[str, dict[str, Any]] = {"diffusiongemma-26b-a4b": DIFFUSIONGEMMA_26B_A4B}


def geometry_config(name: str, **overrides) -> DiffusionGemmaConfig:
    """The :class:`DiffusionGemmaConfig` of the named geometry (:data:`GEOMETRIES`), with ``overrides`` applied.

    ``num_hidden_layers`` alone in ``overrides`` keeps transformers' layer pattern (5 sliding : 1 full, the last
    layer full).

    Raises:
        ValueError: ``name`` is not in :data:`GEOMETRIES` (the known names are listed); a field breaking its rule.
        TypeError: ``name`` is not a str; a field of the wrong type.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (one of {sorted(GEOMETRIES)}), got {_show(name)}")
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {sorted(GEOMETRIES)}")
    kw = {**GEOMETRIES[name], **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        _check_int("num_hidden_layers", kw["num_hidden_layers"], 1, **_int_bound("num_hidden_layers"))
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        kw["layer_types"][-1] = "full_attention"
    return DiffusionGemmaConfig(**kw)


def tiny_config(**overrides) -> DiffusionGemmaConfig:
    """A tiny random-weights config for CPU tests: 4 layers (sliding, full, sliding, full), hidden 64,
    4 query heads; sliding layers 2 KV heads x head_dim 16, window W = 7 (sliding_window 8); full layers 1 KV
    head x head_dim 32 with partial RoPE; 4 experts top-2; vocab 256; canvas_length 16.

    Args:
        **overrides: any :class:`DiffusionGemmaConfig` field (``num_hidden_layers`` alone: alternating sliding /
            full layers, the last full).

    Raises:
        TypeError, ValueError: a field breaking its rule (see :meth:`DiffusionGemmaConfig.validate`).
    """
    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        sliding_window=8, max_position_embeddings=4096, canvas_length=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kw["num_hidden_layers"]
        _check_int("num_hidden_layers", n, 1, **_int_bound("num_hidden_layers"))
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        kw["layer_types"][-1] = "full_attention"
    return DiffusionGemmaConfig(**kw)
