"""DiffusionGemma text configuration (field names mirror transformers' ``DiffusionGemmaTextConfig``).

Source: transformers 5.24 ``models/diffusion_gemma/configuration_diffusion_gemma.py`` (Gemma 4 text backbone,
``models/gemma4``). Only the text model is described: the vision tower is out of scope.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
BIDIRECTIONAL_WINDOWS = ("prefix", "symmetric")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu")


def default_rope_parameters() -> dict[str, dict[str, Any]]:
    """transformers' defaults: default RoPE (theta 1e4) on sliding layers, proportional partial RoPE
    (factor 0.25, theta 1e6) on full layers."""
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


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

    Raises (in ``__post_init__``):
        ValueError: an inconsistent or unsupported field (named in the message).
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
        if self.layer_types is None:
            # transformers' default pattern: 5 sliding : 1 full
            self.layer_types = [
                "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {bad}")
        if self.layer_types and self.layer_types[-1] != "full_attention":
            # transformers forces this too (with a warning); we refuse silent rewrites.
            raise ValueError("layer_types[-1] must be 'full_attention' (transformers forces the last layer full)")
        if self.rope_parameters is None:
            self.rope_parameters = default_rope_parameters()
        self.rope_parameters = copy.deepcopy(self.rope_parameters)
        for lt in set(self.layer_types):
            rp = self.rope_parameters.get(lt)
            if rp is None:
                raise ValueError(f"rope_parameters has no entry for layer type {lt!r}")
            if rp.get("rope_type", "default") not in ("default", "proportional"):
                raise ValueError(f"rope_parameters[{lt!r}].rope_type must be 'default' or 'proportional', "
                                 f"got {rp.get('rope_type')!r}")
        if self.num_global_key_value_heads is None:
            self.num_global_key_value_heads = self.num_key_value_heads
        for name in ("num_key_value_heads", "num_global_key_value_heads"):
            kv = getattr(self, name)
            if kv <= 0 or self.num_attention_heads % kv:
                raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                 f"{name} ({kv})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                     "global_head_dim", "num_experts", "top_k_experts", "moe_intermediate_size", "canvas_length",
                     "sliding_window"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim % 2 or self.global_head_dim % 2:
            raise ValueError("head_dim and global_head_dim must be even (RoPE rotates halves)")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts ({self.top_k_experts}) must be <= num_experts ({self.num_experts})")
        if self.use_bidirectional_attention == "all":
            raise ValueError(
                "use_bidirectional_attention='all' (a bidirectional encoder with transformers' halved sliding "
                "window) is not supported: DiffusionGemma's encoder is causal on text")
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"use_bidirectional_attention must be None or 'vision', got "
                             f"{self.use_bidirectional_attention!r}")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation must be one of {ACTIVATIONS}, got {self.hidden_activation!r}")
        if self.bidirectional_window not in BIDIRECTIONAL_WINDOWS:
            raise ValueError(f"bidirectional_window must be one of {BIDIRECTIONAL_WINDOWS}, got "
                             f"{self.bidirectional_window!r}")
        if not self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=False is not supported (DiffusionGemma ties lm_head to E)")

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
            ValueError: unsupported values (see ``__post_init__``), or no text config found.
        """
        if isinstance(hf_config, (str, os.PathLike)):
            path = os.fspath(hf_config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                hf_config = json.load(f)
        canvas_length = None
        if not isinstance(hf_config, dict):
            canvas_length = getattr(hf_config, "canvas_length", None)
            text = getattr(hf_config, "text_config", None) or hf_config
            d = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
        else:
            canvas_length = hf_config.get("canvas_length")
            d = dict(hf_config.get("text_config") or hf_config)
        if "hidden_size" not in d:
            raise ValueError("hf_config has no text config (no hidden_size)")
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


def tiny_config(**overrides) -> DiffusionGemmaConfig:
    """A tiny random-weights config for CPU tests: 4 layers (sliding, full, sliding, full), hidden 64,
    4 query heads; sliding layers 2 KV heads x head_dim 16, window W = 7 (sliding_window 8); full layers 1 KV
    head x head_dim 32 with partial RoPE; 4 experts top-2; vocab 256; canvas_length 16.

    Args:
        **overrides: any :class:`DiffusionGemmaConfig` field.
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
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        kw["layer_types"][-1] = "full_attention"
    return DiffusionGemmaConfig(**kw)
