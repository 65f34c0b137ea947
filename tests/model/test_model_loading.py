"""Loading transformers DiffusionGemma weights: names, safetensors, configs, and clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from blockdiff.model import CheckpointError, DiffusionGemma, DiffusionGemmaConfig, convert_hf_state_dict, tiny_config
from blockdiff.model.train import hf_state_dict
from model_testutils import build_meta, make_hf_twin

transformers = pytest.importorskip("transformers")
from transformers import DiffusionGemmaConfig as HFConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

PS = 4


@pytest.fixture(scope="module")
def twin():
    cfg = tiny_config()
    hf, ours = make_hf_twin(cfg, seed=11)
    return cfg, hf, ours


def _logits(model, ids):
    caches = model.allocate_kv_caches(8, PS)
    meta, pos = build_meta([ids.shape[0]], [ids.shape[0]], [True], PS)
    with torch.no_grad():
        return model(ids, pos, meta, caches, attn_backend="reference")


def test_config_from_transformers(twin, tmp_path):
    cfg, hf, _ = twin
    assert DiffusionGemmaConfig.from_hf(hf.config) == cfg
    assert DiffusionGemmaConfig.from_hf(hf.config.text_config, canvas_length=cfg.canvas_length) == cfg
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    assert DiffusionGemmaConfig.from_hf(tmp_path) == cfg
    d = hf.config.to_dict()
    d["text_config"].pop("per_layer_config")
    d["text_config"].update(global_head_dim=cfg.global_head_dim, num_global_key_value_heads=1)
    assert DiffusionGemmaConfig.from_hf(d) == cfg
    d["text_config"]["attention_k_eq_v"] = False  # transformers then ignores num_global_key_value_heads
    assert DiffusionGemmaConfig.from_hf(d).num_global_key_value_heads == cfg.num_key_value_heads
    with pytest.raises(ValueError, match="text config"):
        DiffusionGemmaConfig.from_hf({"foo": 1})


def test_state_dict_and_safetensors_load_identically(twin, tmp_path):
    cfg, hf, ours = twin
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # what transformers saves: the decoder stack, the encoder's layer_scalar buffers, the vision tower
    assert any(k.startswith("model.decoder.layers.0.") for k in keys)
    assert not any(k.startswith("model.encoder.language_model.layers.0.self_attn") for k in keys)
    loaded = DiffusionGemma.load_safetensors(tmp_path)
    assert loaded.config == cfg
    ids = torch.randint(0, cfg.vocab_size, (10,))
    assert torch.equal(_logits(loaded, ids), _logits(ours, ids))
    for layer, ref in zip(loaded.layers, ours.layers):  # encoder/decoder layer_scalar kept apart
        assert torch.equal(layer.encoder_layer_scalar, ref.encoder_layer_scalar)
        assert torch.equal(layer.layer_scalar, ref.layer_scalar)
        assert not torch.equal(layer.layer_scalar, layer.encoder_layer_scalar)
    bf = DiffusionGemma.load_safetensors(tmp_path / "model.safetensors", dtype=torch.bfloat16)
    assert bf.embedding_weight.dtype == torch.bfloat16


def test_load_errors_are_clear(twin):
    cfg, hf, _ = twin
    sd = dict(hf.state_dict())

    def load(d):
        return DiffusionGemma.from_pretrained_state_dict(d, cfg)

    bad = dict(sd)
    del bad["model.decoder.layers.2.router.per_expert_scale"]
    del bad["model.encoder.language_model.layers.2.router.per_expert_scale"]
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.decoder\.layers\.2\.router\.per_expert_scale"):
        load(bad)
    bad = dict(sd)
    del bad["model.encoder.language_model.layers.1.layer_scalar"]
    with pytest.raises(ValueError, match=r"missing.*model\.encoder\.language_model\.layers\.1\.layer_scalar"):
        load(bad)
    bad = dict(sd, **{"model.decoder.layers.0.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): model\.decoder\.layers\.0\.self_attn\.extra"):
        load(bad)
    bad = dict(sd)
    bad["model.decoder.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, cfg.hidden_size)
    bad["model.encoder.language_model.layers.1.self_attn.k_proj.weight"] = bad["model.decoder.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"mis-shaped tensors \(1\): layers\.1\.self_attn\.k_proj\.weight: got \(3, 64\)"):
        load(bad)
    bad = dict(sd)
    bad["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"tied tensors that differ.*lm_head\.weight"):
        load(bad)
    with pytest.raises(ValueError, match="config"):
        DiffusionGemma.from_pretrained_state_dict(sd)
    with pytest.raises(FileNotFoundError):
        DiffusionGemma.load_safetensors("/nonexistent/ckpt")


def test_model_prefix_variants_load(twin):
    """A DiffusionGemmaModel state dict (no 'model.' prefix, no lm_head) and a decoder-only dict load too."""
    cfg, hf, ours = twin
    sd = hf.model.state_dict()
    m = DiffusionGemma.from_pretrained_state_dict(sd, cfg)
    ids = torch.randint(0, cfg.vocab_size, (6,))
    assert torch.equal(_logits(m, ids), _logits(ours, ids))


def test_real_26b_a4b_geometry_names_and_shapes():
    """transformers' DiffusionGemma-26B-A4B (on the meta device: no memory) maps onto ours without a single
    missing, unexpected or mis-shaped tensor (geometry from the released config: hidden 2816, 30 layers,
    16 heads, sliding 8 KV x 256, full 2 KV x 512, 128 experts top-8, vocab 262144)."""
    tc = dict(hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
              num_global_key_value_heads=2, head_dim=256, global_head_dim=512, intermediate_size=2112,
              moe_intermediate_size=704, num_experts=128, top_k_experts=8, vocab_size=262144, sliding_window=1024,
              final_logit_softcapping=30.0, max_position_embeddings=262144, use_bidirectional_attention="vision")
    hc = HFConfig(text_config=tc, canvas_length=256)
    with torch.device("meta"):
        hf = DiffusionGemmaForBlockDiffusion(hc)
    cfg = DiffusionGemmaConfig.from_hf(hc.to_dict())
    assert cfg.window_size == 1023 and cfg.layer_types.count("full_attention") == 5
    ours = DiffusionGemma(cfg, device="meta", dtype=torch.bfloat16)
    expected = {n: (p.shape, p.dtype) for n, p in ours.state_dict().items()}
    tensors, skipped = convert_hf_state_dict(hf.state_dict(), expected)
    assert set(tensors) == set(expected)
    assert skipped and all("vision" in k for k in skipped)
    shapes = ours.kv_cache_shapes(1, 16)
    assert shapes[0][0] == (1, 16, 8, 256) and shapes[5][0] == (1, 16, 2, 512)


def test_lazy_state_dict_entries_load_like_tensors(twin):
    """Entries given as zero-argument callables returning the tensor (as documented) load identically."""
    cfg, hf, ours = twin
    lazy = {k: (lambda v=v: v) for k, v in hf.state_dict().items()}
    m = DiffusionGemma.from_pretrained_state_dict(lazy, cfg)
    ids = torch.randint(0, cfg.vocab_size, (5,))
    assert torch.equal(_logits(m, ids), _logits(ours, ids))


def test_integer_tensor_or_non_tensor_value_is_a_listed_load_error(twin):
    """An integer tensor for a float weight, or a value that is not a tensor, is a ValueError naming it (was a
    RuntimeError from load_state_dict / an AttributeError)."""
    cfg, hf, _ = twin
    sd = dict(hf.state_dict())
    dec, enc = "model.decoder.layers.0.mlp.gate_proj.weight", "model.encoder.language_model.layers.0.mlp.gate_proj.weight"
    bad = dict(sd, **{dec: sd[dec].to(torch.int64), enc: sd[dec].to(torch.int64)})
    with pytest.raises(ValueError, match=r"wrong kind of dtype \(1\): layers\.0\.mlp\.gate_proj\.weight: got torch\.int64"):
        DiffusionGemma.from_pretrained_state_dict(bad, cfg)
    bad = dict(sd, **{dec: sd[dec].numpy()})
    with pytest.raises(ValueError, match=r"not tensors \(1\): model\.decoder\.layers\.0\.mlp\.gate_proj\.weight: ndarray"):
        DiffusionGemma.from_pretrained_state_dict(bad, cfg)


def test_checkpoint_with_untied_encoder_attention_biases_loads_as_transformers_saves_it(tmp_path):
    """transformers saves the encoder's attention biases beside the decoder's (they are not tied); such a folder
    loads (it was refused as 'tied tensors that differ'), each mode keeps its own copy, and our writer
    (train.hf_state_dict, used by export) writes both back under transformers' names."""
    cfg = tiny_config(attention_bias=True)
    hf, ours = make_hf_twin(cfg, seed=12)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    enc = sorted(k for k in saved if k.startswith("model.encoder.language_model.") and k.endswith(".bias"))
    assert len(enc) == 14
    loaded = DiffusionGemma.load_safetensors(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (10,))
    assert torch.equal(_logits(loaded, ids), _logits(ours, ids))
    ours_sd = loaded.state_dict()
    for k in enc:
        ours_name = k[len("model.encoder.language_model."):].replace(".bias", ".encoder_bias")
        assert torch.equal(ours_sd[ours_name], saved[k]), k
    written = hf_state_dict(loaded, torch.float32)
    for k in enc + [k.replace("model.encoder.language_model.", "model.decoder.") for k in enc]:
        assert torch.equal(written[k], saved[k]), k
    again = DiffusionGemma.from_pretrained_state_dict(written, cfg)
    assert torch.equal(_logits(again, ids), _logits(ours, ids))


def test_checkpoint_missing_the_encoders_attention_biases_is_refused_naming_them():
    """A missing encoder bias is a missing tensor (transformers would report it missing and initialise it to
    zero), not silently the decoder's copy."""
    cfg = tiny_config(attention_bias=True)
    hf, _ = make_hf_twin(cfg, seed=13)
    sd = {k: v for k, v in hf.state_dict().items()
          if not (k.startswith("model.encoder.language_model.") and k.endswith("k_proj.bias"))}
    with pytest.raises(CheckpointError, match=r"missing tensors \(4\) \(transformers keeps the encoder's attention "
                                              r"biases apart.*model\.encoder\.language_model\.layers\.0\.self_attn\."
                                              r"k_proj\.bias"):
        DiffusionGemma.from_pretrained_state_dict(sd, cfg)


def test_transformers_default_text_config_with_experts_converts():
    """transformers' own defaults (26B-like geometry; our validation must accept every valid HF config)."""
    hc = HFConfig(text_config=dict(num_experts=8, top_k_experts=2, moe_intermediate_size=256))
    cfg = DiffusionGemmaConfig.from_hf(hc)
    assert cfg.canvas_length == 256 and cfg.final_logit_softcapping == 30.0 and cfg.num_hidden_layers == 30
    assert DiffusionGemmaConfig.from_hf(hc.to_dict()) == cfg
