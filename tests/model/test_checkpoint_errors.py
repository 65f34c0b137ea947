"""CheckpointError: the one error type of every bad checkpoint (config, weights, shard index, tokenizer, generation
config), naming the file and the rule broken; config validation at load time; the checkpoint's sampling defaults.

The bad checkpoints are the shipped one (weights symlinked) with one file changed.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import blockdiff.model
from blockdiff.model import (CheckpointError, CheckpointFileNotFoundError, DiffusionGemma, DiffusionGemmaConfig,
                             load_generation_config, read_safetensors, tiny_config)
from blockdiff.model import config as config_mod
from blockdiff.model import generation
from blockdiff.model.export import GENERATION_DEFAULTS as EXPORT_GENERATION_DEFAULTS
from blockdiff.model.loading import check_device
from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import hf_state_dict
from blockdiff.sampler import SamplingParams
from blockdiff.sampler.rng import MAX_POSITIONS, MAX_STEPS, MAX_VOCAB

SHIPPED = shipped_checkpoint_dir()


def _shipped_config() -> dict:
    with open(os.path.join(SHIPPED, "config.json")) as f:
        return json.load(f)


def make_ckpt(folder, *, mutate=None, raw_config=None, weights="link", tokenizer=True):
    """A checkpoint folder: the shipped weights (symlinked, or the given bytes) with a changed config.json."""
    os.makedirs(folder, exist_ok=True)
    cfg = _shipped_config()
    if mutate:
        mutate(cfg)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(raw_config if raw_config is not None else json.dumps(cfg))
    dst = os.path.join(folder, "model.safetensors")
    if weights == "link":
        os.symlink(os.path.join(SHIPPED, "model.safetensors"), dst)
    elif isinstance(weights, bytes):
        with open(dst, "wb") as f:
            f.write(weights)
    if tokenizer:
        shutil.copy(os.path.join(SHIPPED, "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    return str(folder)


def _set(*path_and_value):
    *path, value = path_and_value

    def f(cfg):
        d = cfg
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return f


def _pop(*path):
    def f(cfg):
        d = cfg
        for k in path[:-1]:
            d = d[k]
        d.pop(path[-1])
    return f


def test_checkpoint_error_is_a_public_value_error_of_the_model_package():
    assert issubclass(CheckpointError, ValueError)
    assert issubclass(CheckpointFileNotFoundError, CheckpointError)
    assert issubclass(CheckpointFileNotFoundError, FileNotFoundError)
    assert {"CheckpointError", "CheckpointFileNotFoundError", "load_generation_config"} <= set(blockdiff.model.__all__)
    from blockdiff.integration.demo import CheckpointError as demo_error  # the CLI's old import path

    assert demo_error is CheckpointError


# ---- config.json fields --------------------------------------------------------------------------------------------
def test_zero_final_logit_softcapping_is_a_checkpoint_error_naming_the_field(tmp_path):
    """0 made every logit 0 (cap * tanh(x / cap)); None is transformers' and our 'no softcapping'."""
    with pytest.raises(CheckpointError, match=r"config\.json .*final_logit_softcapping must be a finite number > 0"):
        DiffusionGemma.load_safetensors(make_ckpt(tmp_path, mutate=_set("final_logit_softcapping", 0)))
    assert tiny_config(final_logit_softcapping=None).final_logit_softcapping is None


BAD_FIELDS = [  # (id, mutation of config.json, field named in the message, rule named in the message)
    ("softcap-negative", _set("final_logit_softcapping", -30.0), "final_logit_softcapping", "> 0"),
    ("softcap-str", _set("final_logit_softcapping", "thirty"), "final_logit_softcapping", "number"),
    ("softcap-inf", _set("final_logit_softcapping", float("inf")), "final_logit_softcapping", "finite"),
    ("prf-above-1", _set("rope_parameters", "full_attention", "partial_rotary_factor", 1.5), "partial_rotary_factor",
     r"\(0, 1\]"),
    ("prf-negative", _set("rope_parameters", "full_attention", "partial_rotary_factor", -0.25),
     "partial_rotary_factor", "> 0"),
    ("prf-zero", _set("rope_parameters", "sliding_attention", "partial_rotary_factor", 0), "partial_rotary_factor",
     "> 0"),
    ("prf-str", _set("rope_parameters", "full_attention", "partial_rotary_factor", "0.25"), "partial_rotary_factor",
     "number"),
    ("prf-odd-rotation", _set("rope_parameters", "sliding_attention", "partial_rotary_factor", 0.5 + 1 / 64),
     "partial_rotary_factor", "even"),
    ("head_dim-str", _set("head_dim", "64"), "head_dim", "int"),
    ("hidden_size-float", _set("hidden_size", 256.0), "hidden_size", "int"),
    ("num_experts-str", _set("num_experts", "4"), "num_experts", "int"),
    ("num_experts-null", _set("num_experts", None), "num_experts", "int"),
    ("intermediate_size-float", _set("intermediate_size", 256.5), "intermediate_size", "int"),
    ("layers-str", _set("num_hidden_layers", "6"), "num_hidden_layers", "int"),
    ("layers-zero", _set("num_hidden_layers", 0), "num_hidden_layers", ">= 1"),
    ("layers-bool", _set("num_hidden_layers", True), "num_hidden_layers", "int"),
    ("eps-negative", _set("rms_norm_eps", -1e-6), "rms_norm_eps", "> 0"),
    ("eps-str", _set("rms_norm_eps", "1e-6"), "rms_norm_eps", "number"),
    ("eps-nan", _set("rms_norm_eps", float("nan")), "rms_norm_eps", "finite"),
    ("theta-zero", _set("rope_parameters", "sliding_attention", "rope_theta", 0), "rope_theta", "> 0"),
    ("theta-negative", _set("rope_parameters", "full_attention", "rope_theta", -1e6), "rope_theta", "> 0"),
    ("theta-str", _set("rope_parameters", "sliding_attention", "rope_theta", "big"), "rope_theta", "number"),
    ("theta-missing", _pop("rope_parameters", "sliding_attention", "rope_theta"), "rope_theta", "no rope_theta"),
    ("rope-factor-zero", _set("rope_parameters", "full_attention", "factor", 0.0), "factor", "> 0"),
    ("rope-list", _set("rope_parameters", [1, 2]), "rope_parameters", "dict"),
    ("rope-entry-list", _set("rope_parameters", "full_attention", [1]), "rope_parameters", "dict"),
    ("canvas-absurd", _set("canvas_length", 10 ** 9), "canvas_length", "max_position_embeddings"),
    ("canvas-2**16", _set("canvas_length", 1 << 16), "canvas_length", "65535"),
    ("canvas-above-max-pos", _set("canvas_length", 4097), "canvas_length", "max_position_embeddings = 4096"),
    ("canvas-float", _set("canvas_length", 32.5), "canvas_length", "int"),
    ("canvas-zero", _set("canvas_length", 0), "canvas_length", ">= 1"),
    ("max-pos-negative", _set("max_position_embeddings", -1), "max_position_embeddings", ">= 1"),
    ("sliding-window-str", _set("sliding_window", "64"), "sliding_window", "int"),
    ("vocab-float", _set("vocab_size", 259.0), "vocab_size", "int"),
    ("eos-negative", _set("eos_token_id", -5), "eos_token_id", r"\[0, vocab_size = 259\)"),
    ("eos-out-of-vocab", _set("eos_token_id", 10 ** 6), "eos_token_id", "vocab_size"),
    ("eos-list-out-of-vocab", _set("eos_token_id", [1, 259]), "eos_token_id", "vocab_size"),
    ("eos-str", _set("eos_token_id", "1"), "eos_token_id", "int"),
    ("pad-out-of-vocab", _set("pad_token_id", 259), "pad_token_id", "vocab_size"),
    ("bos-float", _set("bos_token_id", 2.0), "bos_token_id", "int"),
    ("tie-str", _set("tie_word_embeddings", "yes"), "tie_word_embeddings", "bool"),
    ("bias-int", _set("attention_bias", 0), "attention_bias", "bool"),
    ("init-range-negative", _set("initializer_range", -0.02), "initializer_range", ">= 0"),
    ("layer_types-str", _set("layer_types", "full_attention"), "layer_types", "list"),
    ("activation-int", _set("hidden_activation", 3), "hidden_activation", "one of"),
    ("per-layer-config-list", _set("per_layer_config", [1]), "per_layer_config", "dict"),
    ("text_config-list", lambda c: c.update(text_config=[1]), "text_config", "dict"),
]


@pytest.mark.parametrize("mutate,field,rule", [b[1:] for b in BAD_FIELDS], ids=[b[0] for b in BAD_FIELDS])
def test_bad_config_field_is_a_checkpoint_error_at_load_naming_the_field_and_rule(tmp_path, mutate, field, rule):
    """Every field type- and range-checked when the checkpoint loads (not at the first forward pass, not a silent
    wrong model); the message names config.json, the field and the rule."""
    folder = make_ckpt(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointError) as e:
        DiffusionGemma.load_safetensors(folder)
    msg = str(e.value)
    assert "config.json" in msg and field in msg, msg
    assert re.search(rule, msg), msg


@pytest.mark.parametrize("raw,what", [("[1, 2, 3]", "JSON list"), ('"hello"', "JSON str"),
                                      ("{not json", "not valid JSON.*line 1 column 2"), ("", "empty"),
                                      ("\xff\xfe", "not valid JSON")])
def test_config_json_that_is_not_an_object_is_a_checkpoint_error_naming_the_file(tmp_path, raw, what):
    folder = make_ckpt(tmp_path, raw_config=raw)
    with pytest.raises(CheckpointError, match=rf"config\.json \(.*config\.json\).*{what}"):
        DiffusionGemma.load_safetensors(folder)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        DiffusionGemmaConfig.from_hf(folder)


def test_config_fields_are_checked_on_construction_with_type_and_value_errors():
    """Constructed in code: TypeError for a wrong type (str / float / bool sizes), ValueError for a broken rule."""
    with pytest.raises(TypeError, match=r"head_dim must be an int >= 1, got str '16'"):
        tiny_config(head_dim="16")
    with pytest.raises(TypeError, match=r"vocab_size must be an int >= 1, got bool True"):
        tiny_config(vocab_size=True)
    with pytest.raises(ValueError, match=r"rope_theta must be a finite number > 0, got 0"):
        tiny_config(rope_parameters={"sliding_attention": {"rope_theta": 0},
                                     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"num_hidden_layers must be an int >= 1, got 0"):
        tiny_config(num_hidden_layers=0)  # was an IndexError building the layer pattern
    with pytest.raises(TypeError, match="hf_config must be a transformers config"):
        DiffusionGemmaConfig.from_hf([("hidden_size", 64)])


FLOAT32_OUT_OF_RANGE = [  # (id, config keywords over tiny_config, field named in the message)
    ("softcap-1e39", dict(final_logit_softcapping=1e39), "final_logit_softcapping"),
    ("softcap-1e-50", dict(final_logit_softcapping=1e-50), "final_logit_softcapping"),
    ("softcap-denormal", dict(final_logit_softcapping=1e-40), "final_logit_softcapping"),
    ("eps-1e300", dict(rms_norm_eps=1e300), "rms_norm_eps"),
    ("eps-1e-50", dict(rms_norm_eps=1e-50), "rms_norm_eps"),
    ("init-range-1e300", dict(initializer_range=1e300), "initializer_range"),
    ("theta-1e-300", dict(rope_parameters={"sliding_attention": {"rope_theta": 1e-300},
                                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}),
     "rope_theta"),
    ("theta-1e300", dict(rope_parameters={"sliding_attention": {"rope_theta": 1e300},
                                          "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}),
     "rope_theta"),
    ("factor-1e-40", dict(rope_parameters={"sliding_attention": {"rope_theta": 1e4},
                                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.25, "factor": 1e-40}}),
     "factor"),
]


@pytest.mark.parametrize("kw,field", [b[1:] for b in FLOAT32_OUT_OF_RANGE], ids=[b[0] for b in FLOAT32_OUT_OF_RANGE])
def test_float_config_field_outside_float32s_normal_range_is_refused_naming_it(kw, field):
    """The model computes norms, RoPE and the softcap in float32: a field that is inf, 0 or a denormal there made
    every logit NaN (each request finished 'error') or 0 (a silent constant output). Was accepted (finite in float64)."""
    with pytest.raises(ValueError, match=rf"{field} must be (0 or )?within float32's normal range"):
        tiny_config(**kw)


def test_float_config_field_outside_float32_is_a_checkpoint_error_at_load(tmp_path):
    folder = make_ckpt(tmp_path, mutate=_set("final_logit_softcapping", 1e300))
    with pytest.raises(CheckpointError, match=r"config\.json .*final_logit_softcapping must be within float32"):
        DiffusionGemma.load_safetensors(folder)


@pytest.mark.parametrize("rope", [
    {"sliding_attention": {"rope_theta": 1e4},
     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                        "factor": 1.2e-38}},
    {"sliding_attention": {"rope_theta": 1.2e-38},
     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
], ids=["factor-near-tiny", "theta-near-tiny"])
def test_rope_angles_that_overflow_float32_below_max_position_embeddings_are_refused(rope):
    """Each field within float32, but position * inv_freq overflows to inf before max_position_embeddings: cos /
    sin NaN, every request finished 'error' (the factor case at position >= 5). The rule depends on the positions."""
    with pytest.raises(ValueError, match=r"RoPE inverse frequencies .* overflows .*max_position_embeddings"):
        tiny_config(rope_parameters=rope, max_position_embeddings=2 ** 30)
    if "factor" in rope["full_attention"]:  # overflows from position 5 on: refused at tiny_config's 4096 too
        with pytest.raises(ValueError, match="RoPE inverse frequencies"):
            tiny_config(rope_parameters=rope)
    else:  # theta 1.2e-38 on head_dim 16: inv_freq up to ~1.5e33, finite angles below 4096 positions
        cfg = tiny_config(rope_parameters=rope)
        torch.manual_seed(0)
        DiffusionGemma(cfg)


def test_config_and_model_build_under_a_meta_default_device():
    """The RoPE-angle rule computes on the CPU whatever the default device: under ``with torch.device("meta")`` (a
    model built without allocating) it read a meta tensor ('Tensor.item() cannot be called on meta tensors')."""
    with torch.device("meta"):
        cfg = tiny_config()
        model = DiffusionGemma(cfg)
    assert model.embed_tokens.weight.is_meta


@pytest.mark.parametrize("P", [2 ** 63, 10 ** 400], ids=["2**63", "10**400"])
def test_max_position_embeddings_beyond_int64_is_a_value_error(P):
    """Positions are int64: a bound past 2**63 - 1 wrapped to a negative int64 in the forward's range check (every
    position refused) or was an OverflowError in the RoPE rule's float conversion."""
    with pytest.raises(ValueError, match=r"max_position_embeddings must be <= 2\*\*63 - 1"):
        tiny_config(max_position_embeddings=P)
    assert tiny_config(max_position_embeddings=2 ** 63 - 1).max_position_embeddings == 2 ** 63 - 1


HUGE_SIZES = [  # (id, config.json field, value, rule in the message); each was torch's error or a killed process
    ("layers-2**40", "num_hidden_layers", 2 ** 40, r"<= 4096 \(MAX_HIDDEN_LAYERS"),  # OOM-killed in __post_init__
    ("head-dim-2**36", "head_dim", 2 ** 36, r"<= 65536 \(MAX_HEAD_DIM"),  # the RoPE rule's tables: 137 GB
    ("hidden-2**62", "hidden_size", 2 ** 62, r"<= 2147483647"),  # 'Storage size calculation overflowed'
    ("vocab-2**62", "vocab_size", 2 ** 62, r"<= 2147483647"),
    ("moe-2**62", "moe_intermediate_size", 2 ** 62, r"<= 2147483647"),  # TypeError 'Overflow when unpacking long'
    ("heads-2**62", "num_attention_heads", 2 ** 62, r"<= 2147483647"),
    ("window-10**400", "sliding_window", 10 ** 400, r"<= 2147483647 .*got an int of 1329 bits"),
]


@pytest.mark.parametrize("field,value,rule", [b[1:] for b in HUGE_SIZES], ids=[b[0] for b in HUGE_SIZES])
def test_config_json_size_beyond_its_bound_is_a_checkpoint_error_naming_it(tmp_path, field, value, rule):
    """A hostile config.json's sizes are refused by name before anything is allocated: they were a RuntimeError /
    TypeError from torch inside the model's construction (a traceback from blockdiff demo and export), or a process
    killed for memory while the config was checked (the default layer_types list, the RoPE rule's tables)."""
    def mutate(cfg):
        cfg[field] = value
        if field == "num_hidden_layers":
            cfg.pop("layer_types")  # transformers' default pattern, built from num_hidden_layers
    folder = make_ckpt(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointError, match=rf"config\.json .*{field} must be an int {rule}"):
        load_pretrained(folder)


@pytest.mark.parametrize("key,value", [("rope_theta", 5.0), ("rope_local_base_freq", 10.0)])
def test_config_json_with_legacy_rope_keys_and_no_rope_parameters_is_refused_naming_them(tmp_path, key, value):
    """A config.json that gives its RoPE in the legacy keys (no rope_parameters) was served with the default RoPE
    (theta 1e4 / 1e6), the file's values ignored: other angles than the file meant, silently other logits.
    (transformers 5.25's DiffusionGemmaConfig ignores these two too, so this refusal is stricter than transformers; a
    file transformers writes always holds rope_parameters: test_transformers_written_config_with_a_legacy_key_loads.
    rope_scaling is not ignored by transformers: test_config_json_with_rope_scaling_is_refused_even_beside_rope_parameters.)"""
    def mutate(cfg):
        cfg.pop("rope_parameters")
        cfg[key] = value
    folder = make_ckpt(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointError, match=rf"config\.json .*{key}: legacy RoPE keys without rope_parameters"):
        load_pretrained(folder)
    cfg = _shipped_config()
    cfg[key] = value  # beside rope_parameters, which is what is read
    assert DiffusionGemmaConfig.from_hf(cfg).rope_parameters == cfg["rope_parameters"]


@pytest.mark.parametrize("with_rope_parameters", [False, True], ids=["alone", "beside-rope_parameters"])
def test_config_json_with_rope_scaling_is_refused_even_beside_rope_parameters(tmp_path, with_rope_parameters):
    """Regression (review26): break26a/b refused rope_scaling only without rope_parameters and read a file holding
    both with rope_parameters' unscaled RoPE, on the premise that transformers ignores the legacy keys. transformers
    5.25 does not ignore rope_scaling: it replaces rope_parameters with it (beside rope_parameters too), so such a
    file meant a scaled RoPE that blockdiff silently did not serve. Now refused, naming rope_scaling and the rule."""
    scaling = {"rope_type": "linear", "factor": 8.0}

    def mutate(cfg):
        if not with_rope_parameters:
            cfg.pop("rope_parameters")
        cfg["rope_scaling"] = scaling
    folder = make_ckpt(tmp_path, mutate=mutate)
    with pytest.raises(CheckpointError, match=r"config\.json .*rope_scaling: blockdiff does not serve RoPE scaling"):
        load_pretrained(folder)
    cfg = _shipped_config()
    cfg["rope_scaling"] = None  # null is no scaling: loads
    assert DiffusionGemmaConfig.from_hf(cfg).rope_parameters == cfg["rope_parameters"]
    hf = pytest.importorskip("transformers.models.diffusion_gemma.configuration_diffusion_gemma")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' FutureWarning on rope_scaling
        text = hf.DiffusionGemmaTextConfig(rope_parameters=config_mod.default_rope_parameters(), rope_scaling=scaling)
    assert text.rope_parameters == scaling  # the premise: transformers takes rope_scaling in rope_parameters' place


def test_transformers_written_config_with_a_legacy_key_loads():
    """What transformers writes for a 26B-A4B-shaped DiffusionGemma (rope_parameters always, a legacy rope_theta
    beside it when one was passed) passes the new legacy-key rule and the size bounds: object and config.json
    alike."""
    hf = pytest.importorskip("transformers.models.diffusion_gemma.configuration_diffusion_gemma")
    geo = {k: v for k, v in config_mod.DIFFUSIONGEMMA_26B_A4B.items() if k not in ("canvas_length",
                                                                                   "global_head_dim")}
    text = hf.DiffusionGemmaTextConfig(**geo, enable_moe_block=True, max_position_embeddings=262_144,
                                       rope_theta=5e5)
    outer = hf.DiffusionGemmaConfig(text_config=text.to_dict())
    assert outer.to_dict()["text_config"]["rope_theta"] == 5e5  # the legacy key is written beside rope_parameters
    for src in (outer, json.loads(outer.to_json_string()), text):
        cfg = DiffusionGemmaConfig.from_hf(src)
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_experts) == \
            (262_144, 2816, 30, 256, 128)
        assert cfg.rope_parameters == text.rope_parameters  # what transformers serves


def test_weight_tensor_beyond_torchs_storage_size_is_a_value_error_naming_it():
    """Each size within 2**31 - 1, but one weight's float64 bytes past int64: torch's 'Storage size calculation
    overflowed' from inside the model's construction (also on the meta device a checkpoint loads into)."""
    with pytest.raises(ValueError, match=r"vocab_size x hidden_size \(embed_tokens\) = \d+ elements"):
        tiny_config(vocab_size=2 ** 31 - 1, hidden_size=2 ** 31 - 1)
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj"):
        tiny_config(num_experts=2 ** 20, moe_intermediate_size=2 ** 20, hidden_size=2 ** 20)
    with pytest.raises(ValueError, match=r"num_hidden_layers must be an int <= 4096"):
        tiny_config(num_hidden_layers=4097)
    cfg = tiny_config(vocab_size=2 ** 31 - 1, num_hidden_layers=4096, head_dim=2 ** 16)  # the bounds themselves
    assert DiffusionGemma(cfg, device="meta").embed_tokens.weight.shape == (2 ** 31 - 1, 64)
    assert DiffusionGemmaConfig(**config_mod.DIFFUSIONGEMMA_26B_A4B).num_hidden_layers == 30


def test_float32_edge_config_values_build_a_model_whose_logits_are_finite():
    """The rule's edges are usable: the extremes it accepts give finite logits on the tiny model."""
    from blockdiff.integration.harness import HarnessRunner
    for kw in (dict(final_logit_softcapping=2.0 ** -126), dict(final_logit_softcapping=3.4e38),
               dict(rms_norm_eps=2.0 ** -126), dict(rms_norm_eps=3.4e38)):
        torch.manual_seed(0)
        model = DiffusionGemma(tiny_config(**kw))
        h = HarnessRunner(model, default_params=SamplingParams(canvas_length=16, max_tokens=16), max_model_len=64,
                          max_num_batched_tokens=64)
        h.add_request("a", [3, 4, 5])
        assert h.run()["a"].finish_reason == "length", kw


def test_config_changed_in_place_is_checked_when_the_model_is_built():
    cfg = tiny_config()
    cfg.canvas_length = 10 ** 9
    with pytest.raises(ValueError, match="canvas_length"):
        DiffusionGemma(cfg)


def test_numpy_integer_sizes_are_accepted_as_ints():
    np = pytest.importorskip("numpy")
    cfg = tiny_config(hidden_size=np.int64(64), canvas_length=np.int32(8))
    assert type(cfg.hidden_size) is int and type(cfg.canvas_length) is int


def test_numpy_float_fields_are_stored_as_python_floats_and_fractions_refused_naming_the_field():
    """Regression: a numpy float32 / float16 / int64 or a fractions.Fraction in a float field (rms_norm_eps,
    initializer_range, final_logit_softcapping, a rope_parameters entry's rope_theta / partial_rotary_factor /
    factor) and a numpy integer token id were stored as they were, so to_dict() was no longer JSON (json.dumps raised
    "Object of type float32 is not JSON serializable"; export_checkpoint writes it) and a Fraction(1, 3) was kept as
    a value no float holds. Now numpy scalars become the Python int / float that holds them exactly, as the integer
    sizes' numpy ints already did, and a Fraction / Decimal / float128 (rounded by float()) is a TypeError naming
    the field, also from validate() after an in-place change."""
    from decimal import Decimal
    from fractions import Fraction

    np = pytest.importorskip("numpy")
    rope = config_mod.default_rope_parameters()
    rope["sliding_attention"]["rope_theta"] = np.float32(10_000.0)
    rope["full_attention"]["partial_rotary_factor"] = np.float16(0.25)
    rope["full_attention"]["factor"] = np.int64(2)
    cfg = tiny_config(rms_norm_eps=np.float32(1e-6), initializer_range=np.float64(0.02),
                      final_logit_softcapping=np.float32(30.0), rope_parameters=rope, pad_token_id=np.int64(0),
                      bos_token_id=np.int32(2), eos_token_id=[np.int16(1), 3])
    assert type(cfg.rms_norm_eps) is float and cfg.rms_norm_eps == float(np.float32(1e-6))
    assert type(cfg.initializer_range) is float and type(cfg.final_logit_softcapping) is float
    rp = cfg.rope_parameters
    assert type(rp["sliding_attention"]["rope_theta"]) is float and type(rp["full_attention"]["factor"]) is int
    assert type(rp["full_attention"]["partial_rotary_factor"]) is float
    assert type(cfg.pad_token_id) is int and type(cfg.bos_token_id) is int and [type(t) for t in cfg.eos_token_id] \
        == [int, int]
    assert DiffusionGemmaConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg  # JSON round trip, exact
    assert type(rope["sliding_attention"]["rope_theta"]) is np.float32  # the caller's dict is not changed
    for bad in (Fraction(1, 3), Fraction(1, 2), Decimal("0.5"), np.longdouble(0.5), torch.tensor(0.5)):
        for name in ("rms_norm_eps", "initializer_range", "final_logit_softcapping"):
            with pytest.raises(TypeError, match=name):
                tiny_config(**{name: bad})
        for lt, key in (("sliding_attention", "rope_theta"), ("full_attention", "partial_rotary_factor"),
                        ("full_attention", "factor")):
            rope = config_mod.default_rope_parameters()
            rope[lt][key] = bad
            with pytest.raises(TypeError, match=re.escape(f"rope_parameters['{lt}'].{key}")):
                tiny_config(rope_parameters=rope)
        cfg = tiny_config()
        cfg.rms_norm_eps = bad
        with pytest.raises(TypeError, match="rms_norm_eps"):
            cfg.validate()


def test_model_package_limits_equal_the_samplers():
    """The model cannot import the sampler (layering), so its copies of the sampler's limits are checked here."""
    assert config_mod.MAX_CANVAS_LENGTH == MAX_POSITIONS - 1
    assert config_mod.MAX_SIZE == MAX_VOCAB - 1  # a config's vocab_size / hidden_size: SamplerState's [1, 2**31)
    assert generation.MAX_DENOISING_STEPS == MAX_STEPS
    assert generation.GENERATION_DEFAULTS == EXPORT_GENERATION_DEFAULTS
    p = SamplingParams()
    assert {k: getattr(p, k) for k in generation.GENERATION_DEFAULTS} == generation.GENERATION_DEFAULTS


# ---- safetensors files and the shard index -------------------------------------------------------------------------
def _shipped_bytes() -> bytes:
    with open(os.path.join(SHIPPED, "model.safetensors"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("kind", ["truncated", "header-cut", "text", "empty", "folder"])
def test_unreadable_safetensors_file_is_a_checkpoint_error_naming_the_file(tmp_path, kind):
    data = _shipped_bytes()
    weights = {"truncated": data[:-1000], "header-cut": data[:100], "text": b"not safetensors\n" * 10,
               "empty": b"", "folder": None}[kind]
    folder = make_ckpt(tmp_path, weights=weights)
    if kind == "folder":
        os.mkdir(os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors (is not a readable safetensors file|is a folder)"):
        DiffusionGemma.load_safetensors(folder)


def _index_ckpt(root, shard_names: dict[str, str] | None = None, *, outside=False):
    """root/ckpt with the shipped weights as one shard; the index maps every tensor to ``shard`` (default
    'model-00001.safetensors')."""
    d = os.path.join(root, "ckpt")
    make_ckpt(d, weights=None)
    shard = os.path.join(root if outside else d, "model-00001.safetensors")
    shutil.copy(os.path.join(SHIPPED, "model.safetensors"), shard)
    with safe_open(shard, "pt") as f:
        keys = list(f.keys())
    name = "model-00001.safetensors"
    wm = {k: (shard_names or {}).get(k, name) for k in keys}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return d, keys, shard


def _write_index(folder, obj):
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))


def test_index_shards_must_resolve_inside_the_checkpoint_folder(tmp_path):
    """'../x' and absolute shard names, and names under a symlinked folder pointing outside, are refused before
    any file is opened."""
    d, keys, shard = _index_ckpt(tmp_path, outside=True)
    for name in ("../model-00001.safetensors", shard):
        _write_index(d, {"weight_map": {k: name for k in keys}})
        with pytest.raises(CheckpointError, match=r"shard .* resolves outside the checkpoint folder"):
            DiffusionGemma.load_safetensors(d)
    os.symlink(str(tmp_path), os.path.join(d, "sub"))
    _write_index(d, {"weight_map": {k: "sub/model-00001.safetensors" for k in keys}})
    with pytest.raises(CheckpointError, match="resolves outside"):
        read_safetensors(d)


def test_index_shard_that_is_a_symlink_inside_the_folder_loads(tmp_path):
    """The Hugging Face cache layout: the snapshot folder's shard entries are symlinks to ../../blobs/<sha>."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copy(os.path.join(SHIPPED, "model.safetensors"), blobs / "sha256-abc")
    snap = tmp_path / "snapshots" / "rev"
    make_ckpt(snap, weights=None)
    os.symlink("../../blobs/sha256-abc", snap / "model-00001-of-00001.safetensors")
    with safe_open(str(blobs / "sha256-abc"), "pt") as f:
        keys = list(f.keys())
    _write_index(snap, {"weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}})
    m = DiffusionGemma.load_safetensors(str(snap), dtype=torch.float32)
    ref = DiffusionGemma.load_safetensors(SHIPPED, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_model_safetensors_beside_an_index_of_other_shards_is_refused_as_ambiguous(tmp_path):
    """Was: the index won silently: a folder holding model.safetensors (these weights) and an index of another shard
    (other weights, e.g. an older export's) loaded the shard, while transformers' from_pretrained loads
    model.safetensors. Now a CheckpointError naming both; an index whose only shard is model.safetensors stays fine."""
    d, keys, shard = _index_ckpt(tmp_path)
    cfg = DiffusionGemmaConfig.from_hf(d)
    other = hf_state_dict(DiffusionGemma(cfg, seed=5), torch.bfloat16)
    save_file(other, os.path.join(d, "model.safetensors"))
    for call in (lambda: read_safetensors(d), lambda: DiffusionGemma.load_safetensors(d), lambda: load_pretrained(d)):
        with pytest.raises(CheckpointError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json, "
                                                  r"whose shards are other files \(model-00001\.safetensors\)"):
            call()
    os.remove(shard)
    _write_index(d, {"weight_map": {k: "./model.safetensors" for k in keys}})
    m = DiffusionGemma.load_safetensors(d)
    assert torch.equal(m.embed_tokens.weight, other["model.decoder.embed_tokens.weight"])


def test_malformed_index_is_a_checkpoint_error_naming_the_index_and_the_rule(tmp_path):
    d, keys, _ = _index_ckpt(tmp_path)
    for obj, what in ((["a"], "must hold a JSON object"), ({"weight_map": ["a"]}, "weight_map must be a JSON object"),
                      ({"metadata": {}}, "no weight_map"), ("{", "not valid JSON"),
                      ({"weight_map": {keys[0]: 3}}, "weight_map values must be shard file names")):
        _write_index(d, obj)
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*" + what):
            DiffusionGemma.load_safetensors(d)
    _write_index(d, {"weight_map": {k: "missing.safetensors" for k in keys}})
    with pytest.raises(CheckpointFileNotFoundError, match=r"names shard 'missing\.safetensors', which is missing"):
        DiffusionGemma.load_safetensors(d)
    # a tensor mapped to a shard that does not hold it; a tensor in two shards
    save_file({"x": torch.zeros(1)}, os.path.join(d, "model-00002.safetensors"))
    _write_index(d, {"weight_map": {**{k: "model-00001.safetensors" for k in keys}, "y": "model-00002.safetensors"}})
    with pytest.raises(CheckpointError, match=r"maps tensors to shard files that do not hold them \(1\): y"):
        read_safetensors(d)
    save_file({keys[0]: torch.zeros(1)}, os.path.join(d, "model-00002.safetensors"))
    wm = {k: "model-00001.safetensors" for k in keys}
    _write_index(d, {"weight_map": {**wm, keys[0]: "model-00002.safetensors"}})
    with pytest.raises(CheckpointError, match=rf"tensor '{keys[0]}' is in two files"):
        read_safetensors(d)


def test_mismatched_tensors_are_a_checkpoint_error_naming_the_file_and_tensor(tmp_path):
    cfg = tiny_config(vocab_size=259)
    t = hf_state_dict(DiffusionGemma(cfg), torch.float32)
    t.pop("model.decoder.norm.weight")
    t["model.decoder.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    t["model.decoder.layers.1.mlp.up_proj.weight"] = t["model.decoder.layers.1.mlp.up_proj.weight"].to(torch.int32)
    t["model.decoder.layers.0.encoder_layer_scalar"] = torch.ones(1)  # our internal name, not transformers'
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(CheckpointError) as e:
        DiffusionGemma.load_safetensors(tmp_path)
    msg = str(e.value)
    for part in (str(tmp_path), "missing tensors (1): model.decoder.norm.weight",
                 "unexpected tensors (1): model.decoder.layers.0.encoder_layer_scalar",
                 "mis-shaped tensors (1): layers.0.mlp.up_proj.weight: got (3, 3)",
                 "wrong kind of dtype (1): layers.1.mlp.up_proj.weight: got torch.int32"):
        assert part in msg, msg


def test_missing_checkpoint_files_are_file_not_found_and_checkpoint_errors(tmp_path):
    for call in (lambda: DiffusionGemma.load_safetensors(tmp_path / "nope"),
                 lambda: DiffusionGemma.load_safetensors(tmp_path),  # no config.json
                 lambda: read_safetensors(tmp_path),  # no model.safetensors
                 lambda: load_pretrained(tmp_path / "nope"),
                 lambda: ByteTokenizer.load(tmp_path)):
        with pytest.raises(CheckpointFileNotFoundError) as e:
            call()
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1", torch.device("cpu", 1)])
def test_an_indexed_cpu_device_is_plain_cpu(device):
    """check_device kept 'cpu:1' while every CPU tensor reports 'cpu': the harness refused it as another device than
    its model's, and a sampler state on 'cpu:0' refused its own slots."""
    assert check_device(device) == torch.device("cpu")


def test_bogus_device_is_a_value_error_naming_device():
    for call in (lambda d: read_safetensors(SHIPPED, device=d),
                 lambda d: DiffusionGemma.load_safetensors(SHIPPED, device=d),
                 lambda d: DiffusionGemma(tiny_config()).allocate_kv_caches(2, 4, device=d)):
        for bad in ("bogus", "", "cuda:x"):
            with pytest.raises(ValueError, match=rf"device {bad!r} is not a torch device"):
                call(bad)
        with pytest.raises(TypeError, match="device must be a torch.device"):
            call(1.5)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match=r"device 'cuda:3': CUDA is not available"):
                call("cuda:3")


def test_load_safetensors_argument_types_are_type_errors_naming_them():
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        DiffusionGemma.load_safetensors(None)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        DiffusionGemma.load_safetensors(SHIPPED, dtype="float32")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        DiffusionGemma.load_safetensors(SHIPPED, dtype=torch.int32)
    with pytest.raises(TypeError, match="config must be a DiffusionGemmaConfig"):
        DiffusionGemma.load_safetensors(SHIPPED, config={"hidden_size": 4})


def test_garbage_tokenizer_json_is_a_checkpoint_error_naming_it(tmp_path):
    folder = make_ckpt(tmp_path)
    for raw, what in (("[]", "must hold a JSON object"), ("{", "not valid JSON"), ('{"type": "byte"}', "describes")):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write(raw)
        with pytest.raises(CheckpointError, match=rf"tokenizer\.json .*{what}"):
            load_pretrained(folder)


@pytest.mark.parametrize("field, value", [("vocab_size", 259.0), ("vocab_size", True), ("pad_token_id", False),
                                          ("pad_token_id", 0.0), ("eos_token_id", True), ("byte_offset", 3.0)])
def test_tokenizer_json_ids_of_another_json_type_are_a_checkpoint_error_not_equal(tmp_path, field, value):
    """The file was compared with ``==``, so ``"eos_token_id": true`` or ``"vocab_size": 259.0`` passed as the ids
    1 and 259 (every other checkpoint file refuses a bool or a float for an int)."""
    folder = make_ckpt(tmp_path)
    d = ByteTokenizer().to_dict()
    d[field] = value
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(d, f)
    with pytest.raises(CheckpointError, match=rf"tokenizer\.json .*describes .*'{field}': {value!r}"):
        load_pretrained(folder)


# ---- generation_config.json: the checkpoint's sampling defaults ----------------------------------------------------
GEN = {"max_denoising_steps": 7, "t_min": 0.3, "t_max": 0.9, "stability_threshold": 2, "confidence_threshold": 0.01,
       "eos_token_id": [5, 1], "max_new_tokens": 64, "bos_token_id": 2, "pad_token_id": 0,
       "transformers_version": "5.24.0",
       "sampler_config": {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"}}
GEN_PARAMS = {"canvas_length": 32, "max_denoising_steps": 7, "t_min": 0.3, "t_max": 0.9, "entropy_bound": 0.2,
              "confidence_threshold": 0.01, "stability_threshold": 2, "eos_token_ids": (1, 5), "max_tokens": 64}


def test_generation_config_json_gives_the_models_sampling_defaults_as_sampling_params_keywords(tmp_path):
    folder = make_ckpt(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(GEN))
    assert load_generation_config(folder) == GEN_PARAMS
    p = SamplingParams(**load_generation_config(folder))
    assert (p.canvas_length, p.max_denoising_steps, p.eos_token_ids, p.entropy_bound) == (32, 7, (1, 5), 0.2)
    assert DiffusionGemma.load_safetensors(folder).generation_config == GEN_PARAMS
    assert load_pretrained(folder)[0].generation_config == GEN_PARAMS
    partial = {"t_min": 0.1, "sampler_config": {"entropy_bound": 1}}  # the rest: transformers' defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(partial))
    want = {"canvas_length": 32, **EXPORT_GENERATION_DEFAULTS, "t_min": 0.1, "entropy_bound": 1.0,
            "eos_token_ids": (), "max_tokens": None}
    assert load_generation_config(folder) == want


def test_without_generation_config_json_the_defaults_are_transformers_and_the_config_canvas_length(tmp_path):
    """transformers then builds an empty DiffusionGemmaGenerationConfig (its from_model_config is not implemented):
    the global defaults and no eos ids."""
    folder = make_ckpt(tmp_path)
    want = {"canvas_length": 32, **EXPORT_GENERATION_DEFAULTS, "eos_token_ids": (), "max_tokens": None}
    assert load_generation_config(folder) == want
    assert DiffusionGemma.load_safetensors(folder).generation_config == want
    assert DiffusionGemma(tiny_config()).generation_config == dict(want, canvas_length=16)
    SamplingParams(**want)


BAD_GENERATION = [
    ("unknown-key", {"tmin": 0.1}, r"unknown keys \['tmin'\]"),
    ("t_max-equal-t_min", {"t_min": 0.5, "t_max": 0.5}, r"t_max must be > t_min"),
    ("t_min-negative", {"t_min": -0.1}, r"t_min must be >= 0"),
    ("t_max-below-default-t_min", {"t_max": 0.2}, r"t_max must be > t_min"),
    ("t_min-str", {"t_min": "0.1"}, r"t_min must be a number"),
    ("t_max-huge", {"t_max": 1e39}, r"t_max must be finite in float32"),
    ("steps-zero", {"max_denoising_steps": 0}, r"max_denoising_steps must be in \[1, 2\*\*14\)"),
    ("steps-2**14", {"max_denoising_steps": 1 << 14}, r"max_denoising_steps must be in"),
    ("steps-float", {"max_denoising_steps": 4.0}, r"max_denoising_steps must be an int"),
    ("stability-negative", {"stability_threshold": -1}, r"stability_threshold must be in \[0, 2\*\*31\)"),
    ("confidence-zero", {"confidence_threshold": 0.0}, r"confidence_threshold must be > 0"),
    ("entropy-bound-zero", {"sampler_config": {"entropy_bound": 0.0}}, r"entropy_bound must be > 0"),
    ("entropy-bound-nan", {"sampler_config": {"entropy_bound": float("nan")}}, r"entropy_bound must be finite"),
    ("sampler-other-class", {"sampler_config": {"entropy_bound": 0.1, "_cls_name": "TopK"}},
     r"sampler_config._cls_name must be"),
    ("sampler-extra-key", {"sampler_config": {"entropy_bound": 0.1, "k": 2}}, r"sampler_config must hold"),
    ("sampler-list", {"sampler_config": [0.1]}, r"sampler_config must be an EntropyBoundSamplerConfig"),
    ("eos-out-of-vocab", {"eos_token_id": [1, 259]}, r"eos_token_id must be in \[0, vocab_size = 259\)"),
    ("eos-str", {"eos_token_id": "1"}, r"eos_token_id must be an int"),
    ("max-new-tokens-zero", {"max_new_tokens": 0}, r"max_new_tokens must be None or an int in \[1, 2\*\*62\]"),
    ("max-length", {"max_length": 100}, r"max_length 100 is not supported"),
    ("pad-out-of-vocab", {"pad_token_id": 300}, r"pad_token_id must be None or an int"),
    # schedules the sampler refuses (was: accepted at load, since t_max > t_min and both are finite in float32, then
    # the first request taking the defaults died in SamplingParams: `blockdiff demo --checkpoint` printed a
    # ValueError traceback naming no file)
    ("schedule-below-min-temperature", {"t_min": 0.0, "t_max": 1e-40},
     r".*temperature 2\.084e-42 at the last step, below MIN_TEMPERATURE"),
    ("schedule-subnormal", {"t_min": 1e-39, "t_max": 2e-39}, r".*below MIN_TEMPERATURE"),
    ("schedule-steps", {"t_min": 0.0, "t_max": 1e-36, "max_denoising_steps": 1000},
     r".*max_denoising_steps=1000 give the temperature"),
    ("schedule-overflow", {"t_min": 0.0, "t_max": 3e38}, r".*overflows float32"),
    # > t_min = 0 in float64, 0 in float32: the sampler would run it greedy (was: refused as "below MIN_TEMPERATURE,
    # the sampler refuses such a request", which it does not)
    ("schedule-t-max-zero-in-float32", {"t_min": 0.0, "t_max": 1e-46}, r"t_max=1e-46 rounds to 0 in float32"),
]


@pytest.mark.parametrize("gen,what", [b[1:] for b in BAD_GENERATION], ids=[b[0] for b in BAD_GENERATION])
def test_bad_generation_config_is_a_checkpoint_error_naming_the_file_and_field(tmp_path, gen, what):
    folder = make_ckpt(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(CheckpointError, match=r"generation_config\.json \(.*\): " + what):
        load_generation_config(folder)
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        DiffusionGemma.load_safetensors(folder)


def test_generation_config_json_that_is_not_an_object_is_a_checkpoint_error(tmp_path):
    folder = make_ckpt(tmp_path)
    for raw in ("[1]", "{", ""):
        (tmp_path / "generation_config.json").write_text(raw)
        with pytest.raises(CheckpointError, match=r"generation_config\.json \("):
            load_generation_config(folder)
    with pytest.raises(CheckpointFileNotFoundError, match="not a folder"):
        load_generation_config(tmp_path / "nope")
    with pytest.raises(TypeError, match="folder must be a str"):
        load_generation_config(None)


def test_loading_in_a_dtype_that_cannot_hold_a_weight_is_a_checkpoint_error_naming_it(tmp_path):
    """A finite float32 weight above float16's range loaded with dtype=torch.float16 silently became inf (every
    request of the model then failed); export_hf already refused to write such a file. A weight that is inf in the
    file stays inf (nothing is lost by the cast), and a cast that does not narrow the range is not checked."""
    torch.manual_seed(0)
    sd = hf_state_dict(DiffusionGemma(tiny_config()), torch.float32)
    name = next(n for n in sd if n.endswith("mlp.down_proj.weight"))
    sd[name] = sd[name].clone()
    sd[name][0, 0] = 1e6
    with pytest.raises(CheckpointError, match=rf"dtype torch.float16 cannot hold the weights: {re.escape(name)} "
                                              r"\(torch.float32\) has 1 finite value\(s\) that overflow it"):
        DiffusionGemma.from_pretrained_state_dict(sd, tiny_config(), dtype=torch.float16)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"ckpt: dtype torch.float16 cannot hold the weights"):  # the path
        DiffusionGemma.load_safetensors(folder, config=tiny_config(), dtype=torch.float16)
    assert DiffusionGemma.from_pretrained_state_dict(sd, tiny_config(), dtype=torch.bfloat16) is not None
    sd[name][0, 0], sd[name][0, 1] = 1.0, float("inf")
    model = DiffusionGemma.from_pretrained_state_dict(sd, tiny_config(), dtype=torch.float16)
    assert int(model.layers[0].mlp.down_proj.weight.isinf().sum()) == 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64])
def test_model_dtype_outside_bf16_fp16_fp32_fp64_is_a_type_error_naming_it(tmp_path, dtype):
    """A float8 (or complex) dtype passed the old "a floating torch.dtype" rule (or no rule: the constructor): the
    constructor then raised NotImplementedError inside its random init, load_safetensors inside its cast check,
    and a float8_e5m2 load succeeded, weights rounded to 2 mantissa bits, to fail only at the first forward pass
    (NotImplementedError in a torch kernel); allocate_kv_caches made float8 caches no attention backend takes."""
    rule = r"dtype must be a floating torch.dtype the model computes in \(torch.bfloat16, torch.float16, " \
           r"torch.float32, torch.float64\) or None, got " + re.escape(str(dtype))
    with pytest.raises(TypeError, match=rule):
        DiffusionGemma(tiny_config(), dtype=dtype)
    with pytest.raises(TypeError, match=rule):
        DiffusionGemma(tiny_config(), device="meta", dtype=dtype)
    with pytest.raises(TypeError, match=rule):
        DiffusionGemma(tiny_config()).allocate_kv_caches(2, 4, dtype=dtype)
    with pytest.raises(TypeError, match=rule):
        DiffusionGemma.load_safetensors(SHIPPED, dtype=dtype)
    with pytest.raises(TypeError, match=rule):
        load_pretrained(SHIPPED, dtype=dtype)
    sd = hf_state_dict(DiffusionGemma(tiny_config()), torch.float32)
    with pytest.raises(TypeError, match=rule):
        DiffusionGemma.from_pretrained_state_dict(sd, tiny_config(), dtype=dtype)


def test_checkpoint_stored_in_float8_needs_a_dtype_to_load(tmp_path):
    """Without dtype= a model takes its checkpoint's dtype; an embedding stored as float8 made a float8 model (a
    NotImplementedError in the load's cast check, or, float8_e5m2, a model that failed at its first forward pass).
    It is a CheckpointError naming the tensor and the dtypes to pass; with dtype= the float8 weights are widened."""
    torch.manual_seed(0)
    sd = hf_state_dict(DiffusionGemma(tiny_config()), torch.float32)
    name = "model.decoder.embed_tokens.weight"
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        sd8 = dict(sd, **{name: sd[name].to(f8)})
        with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is stored as {re.escape(str(f8))}, which the "
                                                  r"model does not compute in: pass dtype="):
            DiffusionGemma.from_pretrained_state_dict(sd8, tiny_config())
        folder = tmp_path / str(f8)
        folder.mkdir()
        save_file(sd8, str(folder / "model.safetensors"))
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder))}: .*is stored as"):
            DiffusionGemma.load_safetensors(folder, config=tiny_config())
        model = DiffusionGemma.load_safetensors(folder, config=tiny_config(), dtype=torch.float32)
        assert model.embed_tokens.weight.dtype == torch.float32
        assert torch.equal(model.embed_tokens.weight, sd8[name].to(torch.float32))


def test_generation_schedule_rule_agrees_with_the_sampler_s():
    """model.generation repeats the sampler's float32 schedule and MIN_TEMPERATURE (independent layers)."""
    from blockdiff.model import generation as G
    from blockdiff.sampler import params as P

    assert G.MIN_TEMPERATURE == P.MIN_TEMPERATURE
    for t_min, t_max, steps in [(0.4, 0.8, 48), (0.0, 1e-36, 1000), (1e-39, 2e-39, 3), (0.0, 3e38, 2), (0.1, 0.3, 1),
                                (0.0, 3.4e38, 1), (2.0 ** -126, 1.0, 16383)]:
        assert G.schedule_extremes(t_min, t_max, steps) == P.schedule_extremes(t_min, t_max, steps)
        ok = True
        try:
            P.SamplingParams(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
        except ValueError:
            ok = False
        try:
            G.parse_generation_config({"t_min": t_min, "t_max": t_max, "max_denoising_steps": steps}, tiny_config())
        except ValueError as e:
            assert not ok or "t_max must be > t_min" in str(e), (t_min, t_max, steps, e)
        else:
            assert ok, (t_min, t_max, steps)


def test_json_ints_beyond_float_range_are_checkpoint_errors_naming_the_field(tmp_path):
    """A JSON integer literal beyond float's range (``1`` and 400 zeros) in generation_config.json / config.json raised
    OverflowError from math.isfinite instead of a CheckpointError naming the file and the field; the export and
    TrainArgs raised it too."""
    from blockdiff.model.export import hf_generation_config_dict
    from blockdiff.model.train import TrainArgs
    folder = make_ckpt(tmp_path)
    big = "1" + "0" * 400
    (tmp_path / "generation_config.json").write_text('{"t_max": ' + big + '}')
    with pytest.raises(CheckpointError, match=r"generation_config\.json .*t_max must be finite in float32, got an int "
                                              r"of 1329 bits"):
        load_generation_config(folder)
    os.remove(tmp_path / "generation_config.json")
    text = (tmp_path / "config.json").read_text()
    d = json.loads(text)
    (d.get("text_config") or d)["rms_norm_eps"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps(d).replace('"rms_norm_eps": 1.0', '"rms_norm_eps": ' + big))
    with pytest.raises(CheckpointError, match=r"config\.json .*rms_norm_eps must be a finite number > 0, got an int of "
                                              r"1329 bits"):
        DiffusionGemmaConfig.from_hf(folder)
    with pytest.raises(ValueError, match="confidence_threshold must be finite, got an int of 1329 bits"):
        hf_generation_config_dict(tiny_config(), confidence_threshold=10 ** 400)
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got an int of 1329 bits"):
        TrainArgs(out=str(tmp_path / "out"), lr=10 ** 400)


@pytest.mark.parametrize("field, value, exc", [
    ("max_new_tokens", "64", TypeError), ("max_new_tokens", 64.0, TypeError), ("max_new_tokens", True, TypeError),
    ("bos_token_id", "2", TypeError), ("pad_token_id", False, TypeError), ("pad_token_id", 1.0, TypeError),
    ("max_new_tokens", 0, ValueError), ("bos_token_id", 259, ValueError), ("eos_token_id", "1", TypeError)])
def test_parse_generation_config_raises_type_error_for_a_wrong_type_as_its_docstring_says(field, value, exc):
    """parse_generation_config's docstring: TypeError for a value of the wrong type, ValueError for one breaking its
    rule. max_new_tokens, bos_token_id and pad_token_id raised ValueError for a str / float / bool (eos_token_id a
    TypeError); now a TypeError naming the field, out-of-range ints stay a ValueError."""
    with pytest.raises(exc, match=f"^{field} must be"):
        generation.parse_generation_config({field: value}, tiny_config(vocab_size=259))


@pytest.mark.parametrize("steps, exc", [(0, ValueError), (-3, ValueError), (1 << 14, ValueError), (2**31, ValueError),
                                        (True, TypeError), (2.5, TypeError), (48.0, TypeError)])
def test_generation_schedule_extremes_refuses_a_step_count_outside_its_range(steps, exc):
    """schedule_extremes (public) took any step count: 0 returned (inf, nan), -3 a lowest temperature (0.267) below
    t_min = 0.4, 2.5 was truncated to 2 and True read as 1; 2**31 was torch's int32 overflow RuntimeError. Now the
    range parse_generation_config checks before calling it, [1, 2**14), named."""
    with pytest.raises(exc, match="max_denoising_steps must be"):
        generation.schedule_extremes(0.4, 0.8, steps)
    assert generation.schedule_extremes(0.4, 0.8, np.int64(2)) == generation.schedule_extremes(0.4, 0.8, 2)
