"""model/export.py: the shipped stdlib-byte checkpoint exported as a Hugging Face DiffusionGemma folder, loaded back by
transformers 5.24 (``DiffusionGemmaForBlockDiffusion``, ``AutoConfig``, ``AutoTokenizer``, the generation config) and
by blockdiff; logits compared in encoder and decoder modes; the fields vLLM 0.26 reads; errors; ``blockdiff export``.

Logits: blockdiff from the export equals blockdiff from the shipped folder bitwise (same tensors, same math). Against
transformers the rule of test_model_hf_parity.py applies (float64 runs agree to ``F64_AGREE``; our float32 error
against the float64 oracle <= 2 x transformers' + 4 eps), and the float32 logits are also compared directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from blockdiff.integration import cli
from blockdiff.model import CheckpointError, DiffusionGemma, DiffusionGemmaConfig, load_generation_config, tiny_config
from blockdiff.model.export import (ARCHITECTURE, EXPORT_FILES, GENERATION_DEFAULTS, export_hf, hf_config_dict,
                                    hf_generation_config_dict, hf_tokenizer_json)
from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.sampler import SamplingParams

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402  (a transformers dependency)
from tokenizers.decoders import DecodeStream  # noqa: E402
from transformers import (AutoConfig, AutoTokenizer, DiffusionGemmaForBlockDiffusion, DynamicCache,  # noqa: E402
                          GenerationConfig, PreTrainedTokenizerFast)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig, EntropyBoundSamplerConfig)
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig  # noqa: E402
from hf_parity_helpers import (F64_AGREE, _fro, check_tol, hf_denoise, hf_encode, our_denoise,  # noqa: E402
                               our_encode)

SHIPPED = shipped_checkpoint_dir()
STEPS = 16  # blockdiff demo's step cap for the trained checkpoint (TRAINED_MAX_DENOISING_STEPS)

# config.json fields vLLM 0.26.0 reads (transformers_utils/configs/diffusion_gemma.py, model_executor/models/
# diffusion_gemma.py, models/gemma4.py, models/config.py DiffusionGemmaModelForBlockDiffusionConfig,
# transformers_utils/model_arch_config_convertor.py Gemma4ModelArchConfigConvertor, the model registry).
VLLM_TOP_FIELDS = ("architectures", "model_type", "canvas_length", "text_config", "vision_config",
                   "tie_word_embeddings")
VLLM_TEXT_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                    "num_global_key_value_heads", "layer_types", "sliding_window", "rope_parameters", "rms_norm_eps",
                    "hidden_activation", "max_position_embeddings", "attention_bias", "final_logit_softcapping",
                    "num_experts", "top_k_experts", "moe_intermediate_size", "tie_word_embeddings",
                    "use_bidirectional_attention", "eos_token_id", "bos_token_id", "pad_token_id")
# generation_config.json keys vLLM 0.26's DiffusionGemmaModelState / custom_sampler read (gen_config[...] raises
# KeyError on a missing one) and blockdiff's DiffusionModelState reads.
VLLM_GENERATION_KEYS = ("max_denoising_steps", "t_min", "t_max", "sampler_config", "confidence_threshold",
                        "stability_threshold")

TEXTS = ["", "hello world", "import os\nimport sys\n\n\ndef main(argv=None):\n    ", "\tx = {'a': [1, 2]}\r\n",
         "héllo ✓ 𝄞 日本語", "<eos><bos><pad> literal specials", "\x00\x01\x7f\x80", "  leading and trailing  "]


def _tiny_vision():
    return Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=8)


def load_transformers(folder, dtype):
    """transformers' DiffusionGemmaForBlockDiffusion from the folder (offline), with a tiny vision tower in place of
    the default-size one transformers builds for ``vision_config: null`` (the text path never runs it)."""
    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    cfg.vision_config = _tiny_vision()
    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(
        folder, config=cfg, dtype=dtype, attn_implementation="eager", local_files_only=True,
        output_loading_info=True)
    model.config.text_config._experts_implementation = "eager"  # runs in float64 too (the oracle)
    return model.eval(), info


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    assert os.path.isdir(SHIPPED), f"the shipped checkpoint {SHIPPED} is missing"
    out = tmp_path_factory.mktemp("export") / "stdlib-byte-hf"
    written = export_hf(SHIPPED, out, max_denoising_steps=STEPS)
    assert sorted(written) == sorted(EXPORT_FILES)
    return out


# ---- files, weights, blockdiff round trip -----------------------------------------------------------------------
def test_export_writes_the_files_and_the_same_tensors_under_transformers_names(exported):
    assert sorted(os.listdir(exported)) == sorted(EXPORT_FILES)
    with safe_open(os.path.join(SHIPPED, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(exported, "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            ta, tb = a.get_tensor(k), b.get_tensor(k)
            assert ta.dtype == tb.dtype == torch.bfloat16 and torch.equal(ta, tb), k
        assert b.metadata()["format"] == "pt"
    mode = os.stat(exported / "config.json").st_mode & 0o777
    assert os.stat(exported / "model.safetensors").st_mode & 0o777 == mode


def test_blockdiff_loads_the_export_to_the_same_model_and_logits(exported):
    shipped, _ = load_pretrained(SHIPPED, dtype=torch.float32)
    ours = DiffusionGemma.load_safetensors(str(exported), dtype=torch.float32)
    assert ours.config == shipped.config and ours.config.canvas_length == 32
    sa, sb = shipped.state_dict(), ours.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    tok = ByteTokenizer()
    prompt = torch.tensor(tok.encode(TEXTS[2] * 3), dtype=torch.int64)
    canvas = torch.randint(0, 259, (32,), generator=torch.Generator().manual_seed(0))
    P = prompt.shape[0]
    res = []
    for m in (shipped, ours):
        caches = m.allocate_kv_caches(64, 4)
        enc = our_encode(m, caches, prompt, 0)
        dec = our_denoise(m, caches, canvas, P, enc[-32:] / 0.8)
        res.append((enc, dec))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


# ---- transformers ----------------------------------------------------------------------------------------------
def test_transformers_config_describes_the_model(exported):
    cfg = AutoConfig.from_pretrained(exported, local_files_only=True)
    assert type(cfg).__name__ == "DiffusionGemmaConfig" and cfg.canvas_length == 32
    tc = cfg.text_config.to_dict()  # (per-layer attributes such as head_dim are not readable off the object)
    ours = load_pretrained(SHIPPED)[0].config
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "sliding_window", "num_experts",
                 "moe_intermediate_size", "final_logit_softcapping", "layer_types", "rope_parameters"):
        assert tc[name] == getattr(ours, name), name
    full = {str(i): {"head_dim": 128, "num_key_value_heads": 1} for i in (1, 3, 5)}
    assert tc["per_layer_config"] == full  # transformers' form of global_head_dim / num_global_key_value_heads
    assert DiffusionGemmaConfig.from_hf(cfg) == ours  # and back


def test_transformers_loads_every_text_weight(exported):
    hf, info = load_transformers(exported, torch.float32)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert info["missing_keys"] and all(".vision_tower." in k or ".embed_vision." in k for k in info["missing_keys"])
    assert torch.equal(hf.lm_head.weight, hf.model.decoder.embed_tokens.weight)  # tied on load


@torch.no_grad()
@pytest.mark.parametrize("P", [20, 100])  # inside / past the sliding window (W = 63) with the canvas (CL = 32)
def test_transformers_and_blockdiff_logits_agree_in_encoder_and_decoder_modes(exported, P):
    """Prefill P prompt bytes, denoise a canvas without and then with self-conditioning, commit it, denoise the next
    canvas: transformers and blockdiff, both loaded from the export, float32 and float64, same inputs."""
    text = (TEXTS[2] + TEXTS[3]) * 8
    prompt = torch.tensor(ByteTokenizer().encode(text)[:P], dtype=torch.int64)
    g = torch.Generator().manual_seed(P)
    canvases = [torch.randint(0, 259, (32,), generator=g) for _ in range(3)]
    runs = {}
    for name, dt in (("32", torch.float32), ("64", torch.float64)):
        hf, _ = load_transformers(exported, dt)
        ours = DiffusionGemma.load_safetensors(str(exported), dtype=dt)
        cache, caches = DynamicCache(config=hf.config.text_config), ours.allocate_kv_caches(64, 4)
        out = {"hf": [], "ours": []}
        out["hf"].append(hf_encode(hf, cache, prompt, 0))
        out["ours"].append(our_encode(ours, caches, prompt, 0))
        out["hf"].append(hf_denoise(hf, cache, canvases[0], P, None))
        out["ours"].append(our_denoise(ours, caches, canvases[0], P, None))
        z = out["ours"][-1].double() / 0.7  # the same self-conditioning logits for both (from ours, per dtype)
        out["hf"].append(hf_denoise(hf, cache, canvases[1], P, z.to(dt)))
        out["ours"].append(our_denoise(ours, caches, canvases[1], P, z.to(dt)))
        commit = out["ours"][-1].argmax(-1)
        out["hf"].append(hf_encode(hf, cache, commit, P))
        out["ours"].append(our_encode(ours, caches, commit, P))
        out["hf"].append(hf_denoise(hf, cache, canvases[2], P + 32, None))
        out["ours"].append(our_denoise(ours, caches, canvases[2], P + 32, None))
        runs[name] = out
    names = ["prefill", "denoise", "denoise+sc", "commit", "denoise canvas 2"]
    for i, what in enumerate(names):
        hf32, ours32 = runs["32"]["hf"][i], runs["32"]["ours"][i]
        hf64, ours64 = runs["64"]["hf"][i], runs["64"]["ours"][i]
        assert _fro(hf64, ours64) < F64_AGREE, what
        e, e_hf = check_tol(ours32, hf32, ours64, f"P={P} {what}")
        d = (ours32 - hf32).abs().max().item()
        print(f"P={P} {what}: ours fp32 err {e:.2e}, transformers fp32 err {e_hf:.2e}, max |ours - hf| fp32 {d:.2e}")
        assert d < 1e-3, what  # |logits| <= 30 (softcap)


# ---- tokenizer -------------------------------------------------------------------------------------------------
def test_autotokenizer_encodes_and_decodes_exactly_as_the_byte_tokenizer(exported):
    hf = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    bt = ByteTokenizer()
    assert hf.is_fast and len(hf) == 259
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (0, 1, 2)
    with open(os.__file__, encoding="utf-8") as f:
        source = f.read()  # a whole stdlib file, the training distribution
    for text in TEXTS + [source]:
        ids = bt.encode(text)
        assert hf.encode(text) == ids, text[:40]
        assert hf(text)["input_ids"] == ids and hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == text and hf.decode(ids, skip_special_tokens=True) == text
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64, 300):  # any ids: specials dropped, invalid UTF-8 replaced by U+FFFD as ByteTokenizer does
        ids = torch.randint(0, 259, (n,), generator=g).tolist()
        assert hf.decode(ids, skip_special_tokens=True) == bt.decode(ids), ids


def test_tokenizers_backend_and_incremental_decoding_match(exported):
    """What vLLM drives: the Rust tokenizer itself, and ``DecodeStream`` (vLLM's fast incremental detokenizer)."""
    tk = Tokenizer.from_file(str(exported / "tokenizer.json"))
    bt = ByteTokenizer()
    text = TEXTS[4] + TEXTS[2]
    assert tk.encode(TEXTS[2]).ids == bt.encode(TEXTS[2])
    stream, pieces = DecodeStream(skip_special_tokens=True), []
    for i in bt.encode(text):
        piece = stream.step(tk, i)
        if piece is not None:
            pieces.append(piece)
    assert "".join(pieces) == text


def test_tokenizer_padded_to_a_larger_vocabulary_keeps_the_byte_ids(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(hf_tokenizer_json(300)))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), split_special_tokens=True)
    assert len(hf) == 300 and hf.encode(TEXTS[4]) == ByteTokenizer().encode(TEXTS[4])
    assert hf.convert_ids_to_tokens(299) == "<unused_299>"
    with pytest.raises(ValueError, match="vocab_size must be an int >= 259"):
        hf_tokenizer_json(258)


def test_byte_tokenizer_loads_the_hf_tokenizer_json_the_export_writes(exported, tmp_path):
    """So an exported folder serves like a trained one (``blockdiff demo --checkpoint EXPORTED``): the file
    encodes and decodes as ByteTokenizer, padded or not; a tokenizers file that would not is refused, named."""
    tok = ByteTokenizer.load(exported)
    assert tok.vocab_size == 259
    for text in TEXTS:
        assert tok.encode(text) == ByteTokenizer().encode(text) and tok.decode(tok.encode(text)) == text
    (tmp_path / "tokenizer.json").write_text(json.dumps(hf_tokenizer_json(300)))
    padded = ByteTokenizer.load(tmp_path)
    assert padded.vocab_size == 300 and padded.decode([299, 3 + ord("a"), 1]) == "a"  # unused ids dropped
    base = hf_tokenizer_json(259)

    def variant(change):
        d = json.loads(json.dumps(base))
        change(d)
        return d
    vocab = base["model"]["vocab"]
    swapped = {**vocab, "a": vocab["b"], "b": vocab["a"]}
    bad = [(variant(lambda d: d["model"].update(merges=[["a", "b"]])), "merges must be empty"),
           (variant(lambda d: d["pre_tokenizer"].update(add_prefix_space=True)), "pre_tokenizer must be ByteLevel"),
           (variant(lambda d: d["model"].update(vocab=swapped)), "model.vocab differs at 2 ids"),
           (variant(lambda d: d["model"].update(type="WordPiece")), "model.type must be 'BPE'"),
           (variant(lambda d: d["added_tokens"].append({"id": 5, "content": "x"})), "added_tokens"),
           (variant(lambda d: d.update(post_processor={"type": "TemplateProcessing"})), "post_processor"),
           (variant(lambda d: d["model"]["vocab"].update({"extra": 400})), "ids must be 0 .. 259")]
    for d, what in bad:
        (tmp_path / "tokenizer.json").write_text(json.dumps(d))
        with pytest.raises(CheckpointError, match=rf"tokenizer\.json \(.*\) is a Hugging Face tokenizer.*{what}"):
            ByteTokenizer.load(tmp_path)


def test_hf_tokenizer_json_of_wrong_json_types_is_a_checkpoint_error_naming_the_file(tmp_path):
    """A number or a bool for ``model.merges`` raised a bare TypeError (``len(5)``), not the CheckpointError naming
    the file; an added token ``{"id": true, "content": "<eos>"}`` passed as id 1, and ``add_prefix_space: 0`` as
    false (``==`` / truthiness)."""
    base = hf_tokenizer_json(259)

    def variant(change):
        d = json.loads(json.dumps(base))
        change(d)
        return d
    bad = [(variant(lambda d: d["model"].update(merges=5)), "merges must be empty"),
           (variant(lambda d: d["model"].update(merges=True)), "merges must be empty"),
           (variant(lambda d: d["model"].update(merges={"a": "b"})), "merges must be empty"),
           (variant(lambda d: d["added_tokens"][1].update(id=True)), "added_tokens"),
           (variant(lambda d: d["added_tokens"][0].update(id=0.0)), "added_tokens"),
           (variant(lambda d: d["pre_tokenizer"].update(add_prefix_space=0)), "pre_tokenizer must be ByteLevel"),
           (variant(lambda d: d["decoder"].update(add_prefix_space=None)), "decoder must be ByteLevel")]
    for d, what in bad:
        (tmp_path / "tokenizer.json").write_text(json.dumps(d))
        with pytest.raises(CheckpointError, match=rf"tokenizer\.json \(.*\) is a Hugging Face tokenizer.*{what}"):
            ByteTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(variant(lambda d: d["model"].update(merges=None))))
    assert ByteTokenizer.load(tmp_path).vocab_size == 259


def test_load_pretrained_serves_an_exported_folder_with_its_generation_config(exported):
    model, tok = load_pretrained(exported, dtype=torch.float32)
    shipped, _ = load_pretrained(SHIPPED, dtype=torch.float32)
    assert model.config == shipped.config and tok.vocab_size == 259
    sa, sb = shipped.state_dict(), model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    want = {"canvas_length": 32, **GENERATION_DEFAULTS, "max_denoising_steps": STEPS, "eos_token_ids": (1,),
            "max_tokens": None}
    assert model.generation_config == want == load_generation_config(exported)
    assert shipped.generation_config == dict(want, max_denoising_steps=48, eos_token_ids=())  # no file shipped
    SamplingParams(**model.generation_config)


def test_generation_config_saved_by_transformers_loads(tmp_path):
    """What ``DiffusionGemmaGenerationConfig.save_pretrained`` writes (transformers_version and all) is read back
    with the same values."""
    g = DiffusionGemmaGenerationConfig(max_denoising_steps=7, t_min=0.3, t_max=0.9, eos_token_id=[1, 5],
                                       sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.2),
                                       confidence_threshold=0.01, stability_threshold=2, max_new_tokens=40)
    g.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(load_pretrained(SHIPPED)[0].config)))
    assert load_generation_config(tmp_path) == {
        "canvas_length": 32, "max_denoising_steps": 7, "t_min": 0.3, "t_max": 0.9, "entropy_bound": 0.2,
        "confidence_threshold": 0.01, "stability_threshold": 2, "eos_token_ids": (1, 5), "max_tokens": 40}


# ---- generation_config.json ------------------------------------------------------------------------------------
def test_generation_config_holds_the_sampling_defaults(exported):
    g = DiffusionGemmaGenerationConfig.from_pretrained(exported, local_files_only=True)
    assert g.max_denoising_steps == STEPS and (g.t_min, g.t_max) == (0.4, 0.8)
    assert g.sampler_config == EntropyBoundSamplerConfig(entropy_bound=0.1)
    assert (g.confidence_threshold, g.stability_threshold) == (0.005, 1)
    assert (g.eos_token_id, g.bos_token_id, g.pad_token_id) == (1, 2, 0)
    hf, _ = load_transformers(exported, torch.float32)
    assert isinstance(hf.generation_config, DiffusionGemmaGenerationConfig)
    assert hf.generation_config.max_denoising_steps == STEPS
    # vLLM 0.26: model_config.try_get_generation_config() = GenerationConfig.from_pretrained(path).to_diff_dict()
    d = GenerationConfig.from_pretrained(exported, local_files_only=True).to_diff_dict()
    for key in VLLM_GENERATION_KEYS:
        assert key in d, key
    assert "EntropyBound" in d["sampler_config"]["_cls_name"] and d["sampler_config"]["entropy_bound"] == 0.1
    assert d["eos_token_id"] == 1
    # the same values make blockdiff's sampling parameters (what blockdiff's DiffusionModelState builds)
    sp = SamplingParams(canvas_length=32, max_denoising_steps=d["max_denoising_steps"], t_min=d["t_min"],
                        t_max=d["t_max"], entropy_bound=d["sampler_config"]["entropy_bound"],
                        confidence_threshold=d["confidence_threshold"], stability_threshold=d["stability_threshold"])
    assert sp.max_denoising_steps == STEPS and sp.entropy_bound == GENERATION_DEFAULTS["entropy_bound"]


# ---- config.json fields vLLM reads -----------------------------------------------------------------------------
def test_config_json_has_every_field_vllm_0_26_reads(exported):
    with open(exported / "config.json") as f:
        cfg = json.load(f)
    ours = load_pretrained(SHIPPED)[0].config
    for name in VLLM_TOP_FIELDS:
        assert name in cfg, name
    assert cfg["architectures"] == [ARCHITECTURE] == ["DiffusionGemmaForBlockDiffusion"]
    assert cfg["model_type"] == "diffusion_gemma" and cfg["canvas_length"] == ours.canvas_length
    assert cfg["vision_config"] is None  # vLLM builds no vision tower
    tc = cfg["text_config"]
    for name in VLLM_TEXT_FIELDS:
        assert name in tc, name
        if name != "model_type":
            assert tc[name] == getattr(ours, name), name
    assert tc["model_type"] == "diffusion_gemma_text"
    assert "per_layer_config" not in tc  # global_head_dim / num_global_key_value_heads are the one source
    assert cfg["dtype"] == tc["dtype"] == "bfloat16"


def test_vllm_0_26_reads_the_folder(exported):
    """Runs where vLLM 0.26's Python interface is importable (tests/integration/vllm_cpu_env.sh 0.26.0)."""
    vllm = pytest.importorskip("vllm")  # optional: imported here so the rest of the file runs without it
    if not vllm.__version__.startswith("0.26."):
        pytest.skip(f"vLLM {vllm.__version__} (this test reads 0.26's interface)")
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.transformers_utils.config import get_config, try_get_generation_config

    cfg = get_config(str(exported), trust_remote_code=False)
    assert type(cfg).__name__ == "DiffusionGemmaConfig" and cfg.canvas_length == 32 and cfg.vision_config is None
    tc = cfg.text_config
    assert (tc.head_dim, tc.global_head_dim, tc.num_key_value_heads, tc.num_global_key_value_heads) == (64, 128, 2, 1)
    assert tc.final_logit_softcapping == 30.0 and tc.enable_moe_block and tc.attention_k_eq_v
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    gen = try_get_generation_config(str(exported), trust_remote_code=False).to_diff_dict()
    assert all(k in gen for k in VLLM_GENERATION_KEYS)
    tok = get_tokenizer(str(exported))
    assert tok.encode(TEXTS[4]) == ByteTokenizer().encode(TEXTS[4]) and tok.eos_token_id == 1
    # what `vllm serve OUT --language-model-only --dtype bfloat16` builds first (the flag: no vision tower here)
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    mc = ModelConfig(model=str(exported), tokenizer=str(exported), dtype="bfloat16", language_model_only=True)
    assert mc.architectures == [ARCHITECTURE] and mc.max_model_len == 4096 and mc.get_vocab_size() == 259
    assert not MULTIMODAL_REGISTRY.supports_multimodal_inputs(mc)
    assert mc.get_diff_sampling_param() == {}  # no server-wide sampling overrides from generation_config.json
    assert mc.try_get_generation_config()["max_denoising_steps"] == STEPS


# ---- other sources, errors -------------------------------------------------------------------------------------
def test_model_and_config_sources(tmp_path):
    cfg = tiny_config(vocab_size=259, canvas_length=8)
    model = DiffusionGemma(cfg, seed=3)
    w = export_hf(model, tmp_path / "m", dtype="float32")
    assert sorted(w) == sorted(EXPORT_FILES)
    back = DiffusionGemma.load_safetensors(str(tmp_path / "m"))
    assert back.embed_tokens.weight.dtype == torch.float32 and back.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    # a config alone: no weights (vllm serve --load-format dummy); a 256-id vocabulary: no byte tokenizer
    w = export_hf(tiny_config(), tmp_path / "c", write_tokenizer=False)
    assert sorted(w) == ["config.json", "generation_config.json"]
    assert DiffusionGemmaConfig.from_hf(str(tmp_path / "c")) == tiny_config()
    with open(tmp_path / "c" / "generation_config.json") as f:
        assert json.load(f)["max_denoising_steps"] == GENERATION_DEFAULTS["max_denoising_steps"]
    with pytest.raises(FileExistsError, match="config.json, generation_config.json"):
        export_hf(tiny_config(), tmp_path / "c", write_tokenizer=False)
    export_hf(tiny_config(), tmp_path / "c", write_tokenizer=False, overwrite=True)



def test_export_refuses_a_dtype_that_would_turn_finite_weights_into_inf(tmp_path):
    """Was: a weight above float16's 65504 written as inf (NaN logits when served), exit 0."""
    model = DiffusionGemma(tiny_config(vocab_size=259, canvas_length=8), seed=3)
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.weight[0, 0] = 1e5
    with pytest.raises(ValueError, match=r"dtype float16 cannot hold the weights: .*q_proj.weight has 1 finite "):
        export_hf(model, tmp_path / "h", dtype="float16")
    assert not os.path.exists(tmp_path / "h")  # nothing written
    export_hf(model, tmp_path / "b", dtype="bfloat16")  # bfloat16 holds it

def test_errors_name_the_argument(tmp_path, exported):
    cfg = tiny_config(vocab_size=259)
    with pytest.raises(ValueError, match="is the source checkpoint folder"):
        export_hf(exported, exported)  # not a blockdiff checkpoint anyway, but never overwrite the source
    with pytest.raises(FileNotFoundError, match="lacks"):
        export_hf(tmp_path, tmp_path / "o")
    with pytest.raises(TypeError, match="source must be"):
        export_hf({"a": 1}, tmp_path / "o")
    with pytest.raises(TypeError, match="unknown generation keywords"):
        export_hf(cfg, tmp_path / "o", temperature=1.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_hf(cfg, tmp_path / "o", dtype="int8")
    for kw, match in ((dict(t_min=0.8, t_max=0.8), "t_max must be > t_min"), (dict(t_min=-1.0), "t_min must be >= 0"),
                      (dict(entropy_bound=0.0), "entropy_bound must be > 0"),
                      (dict(confidence_threshold=float("nan")), "confidence_threshold must be finite"),
                      (dict(max_denoising_steps=0), "max_denoising_steps must be >= 1"),
                      (dict(stability_threshold=-1), "stability_threshold must be >= 0"),
                      (dict(max_new_tokens=0), "max_new_tokens must be")):
        with pytest.raises(ValueError, match=match):
            export_hf(cfg, tmp_path / "o", **kw)
    with pytest.raises(TypeError, match="max_denoising_steps must be an int"):
        export_hf(cfg, tmp_path / "o", max_denoising_steps=2.0)
    for bad in ("40", 40.0, True):  # export_max_new_tokens_of_the_wrong_type_is_a_type_error (was a ValueError)
        with pytest.raises(TypeError, match="max_new_tokens must be an int >= 1 or None"):
            export_hf(cfg, tmp_path / "o", max_new_tokens=bad)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 259"):
        export_hf(tiny_config(), tmp_path / "o")
    with pytest.raises(ValueError, match="special ids"):
        export_hf(tiny_config(vocab_size=259, eos_token_id=5), tmp_path / "o")
    with pytest.raises(ValueError, match="final_logit_softcapping=None"):
        hf_config_dict(tiny_config(final_logit_softcapping=None))
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        export_hf(tiny_config(vocab_size=259, hidden_activation="silu"), tmp_path / "o")
    export_hf(tiny_config(vocab_size=259, hidden_activation="silu"), tmp_path / "o", check_vllm=False)
    model = DiffusionGemma(cfg, seed=0)
    with torch.no_grad():
        model.layers[2].encoder_layer_scalar.fill_(0.5)
    with pytest.raises(ValueError, match=r"layers \[2\] have encoder and decoder layer_scalar that differ"):
        export_hf(model, tmp_path / "s")
    assert not os.path.exists(tmp_path / "s")  # nothing written on a refused export


# ---- blockdiff export ------------------------------------------------------------------------------------------
def test_cli_export_writes_the_folder_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export", str(out), "--entropy-bound", "0.2"]) == 0
    printed = capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted(EXPORT_FILES)
    assert "vllm serve" in printed and "--language-model-only" in printed
    with open(out / "generation_config.json") as f:
        g = json.load(f)
    assert g["max_denoising_steps"] == STEPS and g["sampler_config"]["entropy_bound"] == 0.2 and g["t_min"] == 0.4
    assert cli.main(["export", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blockdiff export: error:" in err[0] and "already holds" in err[0]
    assert "--overwrite" in err[0] and "overwrite=True" not in err[0]  # the CLI's switch, not the keyword
    assert cli.main(["export", str(out), "--overwrite", "--t-min", "0.9"]) == 2  # t_max (0.8) must exceed it
    assert "--t-max 0.8 (default) must be > --t-min 0.9" in capsys.readouterr().err


def test_cli_export_prints_serve_commands_with_the_plugins_required_flags_and_stock_without_the_plugin(tmp_path,
                                                                                                         capsys):
    """The printed commands work as printed: with blockdiff installed vLLM loads its plugin unless VLLM_PLUGINS says
    otherwise, and the plugin's model state refuses a start without its --scheduler-cls (a bare ``vllm serve OUT
    --language-model-only``, printed before, stopped there); the stock one names no plugin."""
    from blockdiff.integration.vllm_plugin import ASYNC_SCHEDULER_CLASS

    for args, dummy in (([], ""), (["--geometry", "diffusiongemma-26b-a4b"], " --load-format dummy")):
        out = tmp_path / f"o{len(args)}"
        assert cli.main(["export", str(out), *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        plugin = next(x for x in lines if "VLLM_PLUGINS=blockdiff" in x).split()
        assert plugin[:5] == ["VLLM_USE_V2_MODEL_RUNNER=1", "VLLM_PLUGINS=blockdiff", "vllm", "serve", str(out)]
        assert " ".join(plugin).endswith(f"{dummy} --language-model-only --attention-backend CUSTOM "
                                         f"--scheduler-cls {ASYNC_SCHEDULER_CLASS}")
        stock = next(x for x in lines if "VLLM_PLUGINS=none" in x)
        assert stock.endswith(f"VLLM_PLUGINS=none vllm serve {out}{dummy} --language-model-only")


def test_cli_export_prints_serve_commands_whose_folder_is_one_shell_argument(tmp_path, capsys):
    """Was: the folder pasted unquoted, so ``blockdiff export '/tmp/my model'`` printed ``vllm serve /tmp/my model
    ...`` (vLLM would serve /tmp/my) and a folder with ``;`` split the pasted command in two."""
    import shlex

    for name in ("my model", "a;b", "it's"):
        out = tmp_path / name
        assert cli.main(["export", str(out), "--geometry", "diffusiongemma-26b-a4b"]) == 0
        lines = capsys.readouterr().out.splitlines()
        for marker in ("VLLM_PLUGINS=blockdiff", "VLLM_PLUGINS=none"):
            argv = shlex.split(next(x for x in lines if marker in x).split(": ", 1)[-1])
            assert argv[argv.index("serve") + 1] == str(out), argv
            assert argv[argv.index("serve") + 2:][:3] == ["--load-format", "dummy", "--language-model-only"]


def test_cli_export_argument_errors_come_before_torch(tmp_path):
    """Argument errors of ``blockdiff export`` exit 2, one line each, in a process that never imported torch."""
    code = ("import sys; from blockdiff.integration import cli\n"
            f"rc = cli.main(['export', {str(tmp_path / 'o')!r}, '--t-min', '-1', '--entropy-bound', 'nan', "
            "'--max-denoising-steps', '0', '--checkpoint', '/nonexistent/ckpt'])\n"
            "print('exit', rc, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "exit 2 False", p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 4 and all(ln.startswith("blockdiff export: error: ") for ln in lines)
    for flag in ("--t-min", "--entropy-bound", "--max-denoising-steps", "--checkpoint"):
        assert any(flag in ln for ln in lines), flag
    assert not (tmp_path / "o").exists()


def test_cli_export_geometry_writes_the_26b_config_without_weights(tmp_path, capsys):
    from blockdiff.model.config import DIFFUSIONGEMMA_26B_A4B, FLOAT32_MAX, GEOMETRIES, geometry_config

    assert tuple(sorted(GEOMETRIES)) == tuple(sorted(cli.GEOMETRY_NAMES))  # the CLI's torch-free copy of the names
    assert cli._FLOAT32_MAX == FLOAT32_MAX  # and of float32's largest finite value
    out = tmp_path / "g"
    assert cli.main(["export", str(out), "--geometry", "diffusiongemma-26b-a4b", "--stability-threshold", "16"]) == 0
    assert "--load-format dummy" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted(n for n in EXPORT_FILES if n != "model.safetensors")
    cfg = DiffusionGemmaConfig.from_hf(str(out))
    assert cfg == geometry_config("diffusiongemma-26b-a4b")
    assert all(getattr(cfg, k) == v for k, v in DIFFUSIONGEMMA_26B_A4B.items())
    assert cfg.layer_types.count("full_attention") == 5 and cfg.layer_types[-1] == "full_attention"
    with open(out / "generation_config.json") as f:
        g = json.load(f)
    assert (g["max_denoising_steps"], g["stability_threshold"]) == (STEPS, 16)
    with pytest.raises(SystemExit):
        cli.main(["export", str(tmp_path / "x"), "--geometry", "nope"])
    with pytest.raises(SystemExit):  # a geometry has no checkpoint
        cli.main(["export", str(tmp_path / "x"), "--geometry", "diffusiongemma-26b-a4b", "--checkpoint", str(out)])


def test_geometry_config_names_and_depth():
    from blockdiff.model.config import geometry_config

    cfg = geometry_config("diffusiongemma-26b-a4b", num_hidden_layers=8)
    assert cfg.num_hidden_layers == 8 and cfg.layer_types[-1] == "full_attention" and cfg.layer_types[5] == "full_attention"
    with pytest.raises(ValueError, match="unknown geometry 'x'"):
        geometry_config("x")
    with pytest.raises(TypeError, match="name must be a str"):
        geometry_config(3)


@pytest.mark.parametrize("argv,words", [
    (["--max-denoising-steps", "16384"], ["--max-denoising-steps", "16384"]),
    (["--stability-threshold", str(2 ** 31)], ["--stability-threshold"]),
    (["--t-max", "1e39"], ["--t-max", "float32"]),
    (["--confidence-threshold", "1e39"], ["--confidence-threshold"]),
])
def test_cli_export_refuses_values_blockdiff_cannot_load_back(tmp_path, capsys, argv, words):
    """Was: --max-denoising-steps 16384 (the sampler takes < 2**14), --stability-threshold 2**31 and --t-max 1e39
    were written into generation_config.json, which blockdiff's own loader then refused (CheckpointError)."""
    assert cli.main(["export", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not os.path.exists(tmp_path / "o" / "config.json")


@pytest.mark.parametrize("kw,match", [(dict(max_denoising_steps=2 ** 14), "max_denoising_steps"),
                                      (dict(stability_threshold=2 ** 31), "stability_threshold"),
                                      (dict(t_max=1e39), "t_max"), (dict(entropy_bound=1e39), "entropy_bound"),
                                      (dict(t_min=0.0, t_max=1e-40), "below MIN_TEMPERATURE"),
                                      (dict(t_min=0.0, t_max=3e38), "overflows float32")])
def test_generation_config_written_is_one_the_loader_reads_back(kw, match):
    """hf_generation_config_dict checks its result with the loader's parse_generation_config."""
    with pytest.raises(ValueError, match=match):
        hf_generation_config_dict(tiny_config(), **kw)
    ok = hf_generation_config_dict(tiny_config(), max_denoising_steps=2 ** 14 - 1, stability_threshold=2 ** 31 - 1)
    assert ok["max_denoising_steps"] == 2 ** 14 - 1


def test_cli_export_out_errors_name_out_and_checkpoint_errors_do_not(tmp_path, capsys):
    """Was: OUT '' gave "[Errno 2] No such file or directory: ''", OUT below a file "[Errno 20] Not a directory"."""
    (tmp_path / "afile").write_text("x")
    for out, words in (("", ["OUT must not be empty"]), (str(tmp_path / "afile" / "sub"), ["OUT", "afile"])):
        assert cli.main(["export", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    (tmp_path / "ck").mkdir()
    assert cli.main(["export", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint folder" in err and "OUT" not in err, err


def test_cli_export_defaults_agree_with_generation_defaults():
    from blockdiff.model.export import GENERATION_DEFAULTS

    assert all(GENERATION_DEFAULTS[k] == v for k, v in cli._EXPORT_DEFAULTS.items())


@pytest.mark.parametrize("argv, words", [
    (["--t-min", "0.5", "--t-max", "0.5"], ["--t-max 0.5 must be > --t-min 0.5", "transformers"]),
    (["--t-min", "0", "--t-max", "0"], ["--t-max 0.0 must be > --t-min 0.0", "per-request"]),
    (["--t-max", "0.3"], ["--t-max 0.3 must be > --t-min 0.4 (default)"]),
    (["--entropy-bound", "0"], ["--entropy-bound must be a finite number > 0", "transformers"]),
    (["--confidence-threshold", "0"], ["--confidence-threshold must be a finite number > 0", "transformers"]),
    (["--t-min", "0", "--t-max", "1e-37", "--max-denoising-steps", "16"], ["--t-min 0.0 / --t-max 1e-37", "MIN_TEMPERATURE"]),
])
def test_cli_export_refuses_values_transformers_or_the_sampler_would_refuse_naming_the_flags(tmp_path, capsys, argv,
                                                                                            words):
    """The written generation_config.json is transformers' (its DiffusionGemmaGenerationConfig refuses t_max <= t_min,
    entropy_bound <= 0, confidence_threshold <= 0 at construction), and its defaults must be a request SamplingParams
    accepts. Was: the message named the keyword t_max, not the flag; the sampler's schedule rule was not checked (the
    file then failed every default request). Nothing is written."""
    out = tmp_path / "o"
    assert cli.main(["export", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("kw", [dict(t_min=0.5, t_max=0.5), dict(t_min=0.0, t_max=0.0), dict(entropy_bound=0.0),
                                dict(confidence_threshold=0.0)])
def test_sampling_params_take_per_request_values_the_export_refuses(kw):
    """The two rules differ on purpose (docs/ARCHITECTURE.md section 7, "Exported sampling defaults"): a request may
    run a constant or greedy schedule, accept only the lowest-entropy position (entropy_bound 0) or never converge
    early (confidence_threshold 0); transformers' file format cannot hold those."""
    from blockdiff.sampler import SamplingParams

    SamplingParams(**kw)
    with pytest.raises(ValueError):
        hf_generation_config_dict(tiny_config(), **kw)


def test_export_hf_refuses_a_schedule_the_sampler_refuses_and_writes_nothing(tmp_path):
    """Was: written (t_max > t_min, finite), a generation_config.json whose defaults every request refused."""
    for kw in (dict(t_min=0.0, t_max=1e-40), dict(t_min=0.0, t_max=3e38, max_denoising_steps=2)):
        with pytest.raises(ValueError, match="MIN_TEMPERATURE|overflows float32"):
            export_hf(tiny_config(), tmp_path / "o", **kw)
        assert not (tmp_path / "o").exists()


def test_export_hf_argument_errors_name_the_argument_and_write_nothing(tmp_path):
    """Was: a meta-device model died in torch's 'Cannot copy out of meta tensor' (NotImplementedError), out_dir None
    in os.fspath's 'expected str, bytes or os.PathLike object', and a float64 model without dtype= in 'dtype must be
    one of ... got torch.float64' (a dtype the caller never passed)."""
    cfg = tiny_config(vocab_size=259)
    with torch.device("meta"):
        meta = DiffusionGemma(cfg)
    with pytest.raises(ValueError, match="meta device"):
        export_hf(meta, tmp_path / "o")
    with pytest.raises(TypeError, match="out_dir must be a str or os.PathLike"):
        export_hf(cfg, None)
    with pytest.raises(ValueError, match=r"dtype: the source's weights are torch.float64.*pass dtype="):
        export_hf(DiffusionGemma(cfg).double(), tmp_path / "o")
    part = DiffusionGemma(cfg)  # one layer's weights left on the meta device (review20): was torch's error at save
    part.layers[0].mlp.to_empty(device="meta")
    with pytest.raises(ValueError, match=r"on the meta device .*first: layers\.0\.mlp"):
        export_hf(part, tmp_path / "o")
    mixed = DiffusionGemma(cfg).to(torch.bfloat16)  # one float32 layer: was written from embed_tokens' dtype alone
    mixed.layers[0].float()
    with pytest.raises(ValueError, match=r"dtype: the source's weights mix torch.bfloat16 .*torch.float32 \(layers\.0"):
        export_hf(mixed, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert "model.safetensors" in export_hf(mixed, tmp_path / "m", dtype="bfloat16")
    assert "model.safetensors" in export_hf(DiffusionGemma(cfg).double(), tmp_path / "o", dtype="float32")


# ---- writing OUT: never a half-written folder, never through a symlink, never beside other weights --------------
def _tiny_model(seed=0):
    return DiffusionGemma(tiny_config(vocab_size=259), seed=seed)


def _snapshot(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


def test_export_hf_that_fails_mid_write_leaves_out_dir_as_it_was(tmp_path, monkeypatch):
    """Was: files written one by one into OUT, so a write failing after model.safetensors (a full disk) left a missing
    OUT holding the new weights alone and, with overwrite, the new weights and config.json beside the earlier
    export's generation_config.json and tokenizer: a folder that loaded as valid with the wrong defaults."""
    import blockdiff.model.export as export_mod

    real_dump, calls = json.dump, []

    def failing_dump(obj, f, **kw):  # config.json is written; generation_config.json hits a full disk
        calls.append(f.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_dump(obj, f, **kw)

    model = _tiny_model()
    monkeypatch.setattr(export_mod.json, "dump", failing_dump)
    with pytest.raises(OSError, match="No space left"):
        export_hf(model, tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == []  # no OUT, no staging folder left
    monkeypatch.setattr(export_mod.json, "dump", real_dump)
    out = tmp_path / "old"
    export_hf(model, out, dtype="float32", t_min=0.1)
    before = _snapshot(out)
    calls.clear()
    monkeypatch.setattr(export_mod.json, "dump", failing_dump)
    with pytest.raises(OSError, match="No space left"):
        export_hf(_tiny_model(seed=1), out, dtype="bfloat16", overwrite=True)
    assert _snapshot(out) == before  # the earlier export, whole; no staging folder left
    monkeypatch.setattr(export_mod.json, "dump", real_dump)
    written = export_hf(_tiny_model(seed=1), out, dtype="bfloat16", overwrite=True)
    assert sorted(os.listdir(out)) == sorted(written) == sorted(EXPORT_FILES)
    assert load_generation_config(out)["t_min"] == GENERATION_DEFAULTS["t_min"]


def test_export_hf_replaces_a_symlink_in_out_dir_and_never_writes_through_it(tmp_path):
    """Was: a dangling symlink named config.json was not 'present' (os.path.exists follows it), so the export wrote
    config.json wherever it pointed, outside OUT; with overwrite, a symlink to another file was written through,
    replacing that file's contents."""
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.json"
    os.symlink(outside, out / "config.json")
    with pytest.raises(FileExistsError, match="already holds config.json"):
        export_hf(tiny_config(vocab_size=259), out)
    assert not outside.exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, out / "tokenizer.json")
    export_hf(tiny_config(vocab_size=259), out, overwrite=True)
    assert not outside.exists() and victim.read_text() == "precious"
    assert not os.path.islink(out / "config.json") and not os.path.islink(out / "tokenizer.json")
    assert ByteTokenizer.load(out).vocab_size == 259
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")  # OUT itself: named, not the staging folder's rename
    with pytest.raises(FileExistsError, match=r"out_dir .*dangling' is a symlink to .*nowhere', which does not exist"):
        export_hf(tiny_config(vocab_size=259), tmp_path / "dangling")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "out", "victim.txt"]  # no staging folder left


def test_export_hf_refuses_other_weight_files_in_out_dir_even_with_overwrite(tmp_path):
    """Was: an index (model.safetensors.index.json) and its shards in OUT were left beside the new model.safetensors,
    and blockdiff's loader (vLLM's too) follows the index: the folder loaded the old weights under the new config."""
    old, out = _tiny_model(seed=0), tmp_path / "out"
    export_hf(old, out)
    os.rename(out / "model.safetensors", out / "model-00001-of-00001.safetensors")
    names = [n for n in safe_open(str(out / "model-00001-of-00001.safetensors"), "pt").keys()]
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}, f)
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=r"other weight files \(model-00001-of-00001.safetensors, "
                                              r"model.safetensors.index.json\)"):
        export_hf(_tiny_model(seed=1), out, overwrite=True)
    assert _snapshot(out) == before
    os.remove(out / "model.safetensors.index.json")
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "extra.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match=r"other weight files \(extra.safetensors\)"):
        export_hf(_tiny_model(seed=1), tmp_path / "stray")


def test_cli_export_with_overwrite_names_the_other_weight_files(tmp_path, capsys):
    out = tmp_path / "out"
    export_hf(tiny_config(vocab_size=259), out)
    (out / "model.safetensors.index.json").write_text("{}")
    assert cli.main(["export", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors.index.json" in err[0] and "pass --overwrite" not in err[0], err


def test_export_hf_refuses_an_empty_out_dir_and_a_folder_named_as_an_export_file(tmp_path):
    """Was: out_dir '' ended in os.makedirs' "[Errno 2] No such file or directory: ''"; a folder named
    generation_config.json (overwrite) in IsADirectoryError after model.safetensors and config.json were replaced."""
    with pytest.raises(ValueError, match="out_dir must not be empty"):
        export_hf(tiny_config(vocab_size=259), "")
    out = tmp_path / "out"
    export_hf(_tiny_model(), out, dtype="float32")
    os.remove(out / "generation_config.json")
    (out / "generation_config.json").mkdir()
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if n != "generation_config.json"}
    with pytest.raises(IsADirectoryError, match="holds folders named generation_config.json"):
        export_hf(_tiny_model(seed=1), out, dtype="bfloat16", overwrite=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out) if n != "generation_config.json"} == before
    assert sorted(os.listdir(out)) == sorted(EXPORT_FILES)


def test_export_hf_keeps_the_umask_modes(tmp_path):
    """The staged folder and files get the modes a plain os.makedirs / open give (model.safetensors included)."""
    old = os.umask(0o022)
    try:
        export_hf(_tiny_model(), tmp_path / "out")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o755
    assert {os.stat(tmp_path / "out" / n).st_mode & 0o777 for n in EXPORT_FILES} == {0o644}


def test_export_hf_to_a_missing_out_dir_through_a_missing_folder_and_dotdot_writes_it(tmp_path):
    """'x/missing/../y': os.makedirs(OUT) created x/missing and wrote x/y; the staging rewrite staged in the lexical
    parent x (os.path.abspath) and renamed to 'x/missing/../y', whose x/missing did not exist: FileNotFoundError
    naming the staging folder. Now staged in the parent as written; a trailing separator still works."""
    out = tmp_path / "x" / "missing" / ".." / "y"
    written = export_hf(tiny_config(vocab_size=259), str(out))
    assert sorted(os.listdir(tmp_path / "x" / "y")) == sorted(written)
    assert sorted(os.listdir(tmp_path / "x")) == ["missing", "y"]        # no staging folder left
    export_hf(tiny_config(vocab_size=259), str(tmp_path / "slash") + os.sep)
    assert ByteTokenizer.load(tmp_path / "slash").vocab_size == 259
    assert sorted(os.listdir(tmp_path)) == ["slash", "x"]
