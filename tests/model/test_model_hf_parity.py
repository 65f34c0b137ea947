"""Parity with transformers 5.24 DiffusionGemmaForBlockDiffusion (tiny random configs, CPU).

Tolerance (docs/ARCHITECTURE.md "Test discipline"): err(ours) <= 2 * err(transformers, same dtype) + representation tolerance, with
err = relative Frobenius error against an oracle. The oracle is our model in float64 (every op in float64):
transformers keeps fp32 islands even in float64 (RMSNorm's ``.float()``, the attention softmax's
``dtype=float32``, fp32 RoPE and router softmax), so its float64 run is only ~1e-6-accurate; we check that
it agrees with our float64 run to that level (``F64_AGREE``), which makes ours a valid oracle.
"""
from __future__ import annotations

import copy

import pytest
import torch

from blockdiff.model import DiffusionGemma, tiny_config
from hf_parity_helpers import (F64_AGREE, PS, _err, _fro, _rel, check_tol, hf_denoise, hf_encode, our_denoise,
                               our_encode)
from model_testutils import build_meta, hf_cache_kwargs, hf_softcap_logits, make_hf_twin

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, StaticCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402
from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402

from blockdiff.attention import build_mask  # noqa: E402

class Twins:
    """transformers model + ours in fp32, and both in fp64 (oracle)."""

    def __init__(self, cfg, seed=0):
        self.cfg = cfg
        self.hf, self.ours = make_hf_twin(cfg, seed=seed)
        self.hf64 = copy.deepcopy(self.hf).double()
        self.ours64 = DiffusionGemma.from_pretrained_state_dict(self.hf64.state_dict(), cfg, dtype=torch.float64)


@pytest.fixture(scope="module")
def twins():
    return Twins(tiny_config())


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- (a) encoder -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [5, 21])  # inside and well past the window (W = 7)
def test_encoder_logits_match_transformers(twins, P):
    cfg = twins.cfg
    prompt = _ids(P, cfg.vocab_size, P)
    res = {}
    for name, hf, ours in (("32", twins.hf, twins.ours), ("64", twins.hf64, twins.ours64)):
        cache = DynamicCache(config=hf.config.text_config)
        res["hf" + name] = hf_encode(hf, cache, prompt, 0)
        res["ours" + name] = our_encode(ours, ours.allocate_kv_caches(32, PS), prompt, 0)
    assert _fro(res["hf64"], res["ours64"]) < F64_AGREE
    e, e_hf = check_tol(res["ours32"], res["hf32"], res["ours64"], f"encoder P={P}")
    print(f"encoder P={P}: ours fp32 err {e:.2e}, transformers fp32 err {e_hf:.2e}, "
          f"ours-vs-transformers fp32 rel {_rel(res['ours32'], res['hf32']):.2e}")


# ---- (b) decoder -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,with_sc", [(3, False), (21, True), (40, True)])
def test_decoder_logits_match_transformers_prefix(twins, P, with_sc):
    cfg = twins.cfg
    prompt, canvas = _ids(P, cfg.vocab_size, 1), _ids(cfg.canvas_length, cfg.vocab_size, 2)
    z = torch.randn(cfg.canvas_length, cfg.vocab_size, generator=torch.Generator().manual_seed(3)) * 4
    res = {}
    for name, hf, ours in (("32", twins.hf, twins.ours), ("64", twins.hf64, twins.ours64)):
        cache = DynamicCache(config=hf.config.text_config)
        hf_encode(hf, cache, prompt, 0)
        res["hf" + name] = hf_denoise(hf, cache, canvas, P, z.to(hf.dtype) if with_sc else None)
        caches = ours.allocate_kv_caches(32, PS)
        our_encode(ours, caches, prompt, 0)
        res["ours" + name] = our_denoise(ours, caches, canvas, P, z if with_sc else None)
    assert _fro(res["hf64"], res["ours64"]) < F64_AGREE
    e, e_hf = check_tol(res["ours32"], res["hf32"], res["ours64"], f"decoder P={P}")
    print(f"decoder P={P} sc={with_sc}: ours fp32 err {e:.2e}, transformers fp32 err {e_hf:.2e}, "
          f"ours-vs-transformers fp32 rel {_rel(res['ours32'], res['hf32']):.2e}")


def test_symmetric_window_equals_prefix_only_inside_window():
    """'symmetric' equals transformers' 'prefix' iff every canvas row sees every key (ctx + CL - 1 <= W);
    past that it departs (the amount is printed for the report)."""
    cfg = tiny_config(canvas_length=4)  # W = 7
    hf, ours = make_hf_twin(cfg, seed=4)
    canvas = _ids(4, cfg.vocab_size, 5)
    for P, same in ((4, True), (5, False), (12, False), (40, False)):
        prompt = _ids(P, cfg.vocab_size, 6)
        cache = DynamicCache(config=hf.config.text_config)
        hf_encode(hf, cache, prompt, 0)
        ref = hf_denoise(hf, cache, canvas, P, None)
        caches = ours.allocate_kv_caches(32, PS)
        our_encode(ours, caches, prompt, 0)
        pre = our_denoise(ours, caches, canvas, P, None, bw="prefix")
        sym = our_denoise(ours, caches, canvas, P, None, bw="symmetric")
        assert _err(pre, ref) < 1e-4
        d = _err(sym, ref)
        print(f"ctx={P} CL=4 W=7: max |symmetric - transformers| = {d:.3e} (|logits| <= {ref.abs().max():.2f})")
        assert (d < 1e-4) == same


# ---- (c) multi-canvas generation under teacher forcing ------------------------------------------------------
@torch.no_grad()
def test_multi_canvas_teacher_forced_generation(twins):
    """Prefill, then per canvas: denoise passes with self-conditioning, then a commit (encoder pass writing the
    canvas's KV over the denoise scratch); 2 canvases. All four models (transformers / ours, fp32 / fp64) run in
    lockstep on identical inputs: canvases drawn up front, self-conditioning logits = the oracle's previous
    temperature-scaled logits (transformers' schedule T = t_min + (t_max - t_min) * cur_step / N)."""
    cfg, tw = twins.cfg, twins
    g = torch.Generator().manual_seed(7)
    P, CL, V, n_canvases, n_steps, N = 9, cfg.canvas_length, cfg.vocab_size, 2, 3, 8
    t_min, t_max = 0.4, 0.8
    prompt = torch.randint(0, V, (P,), generator=g)
    hf_caches = {k: DynamicCache(config=tw.hf.config.text_config) for k in ("32", "64")}
    our_caches = {"32": tw.ours.allocate_kv_caches(64, PS), "64": tw.ours64.allocate_kv_caches(64, PS)}
    models = {"32": (tw.hf, tw.ours), "64": (tw.hf64, tw.ours64)}

    def run(kind, ids, start, sc_z=None):
        out = {}
        for k, (hf, ours) in models.items():
            if kind == "encode":
                out["hf" + k] = hf_encode(hf, hf_caches[k], ids, start)
                out["ours" + k] = our_encode(ours, our_caches[k], ids, start)
            else:
                out["hf" + k] = hf_denoise(hf, hf_caches[k], ids, start, None if sc_z is None else sc_z.to(hf.dtype))
                out["ours" + k] = our_denoise(ours, our_caches[k], ids, start, sc_z)
        return out

    def check(out, what):
        assert _fro(out["hf64"], out["ours64"]) < F64_AGREE, what
        e, e_hf = check_tol(out["ours32"], out["hf32"], out["ours64"], what)
        print(f"{what}: ours fp32 err {e:.2e}, transformers fp32 err {e_hf:.2e}")

    check(run("encode", prompt, 0), "prefill")
    start = P
    for c in range(n_canvases):
        sc_z = None
        for s in range(n_steps):
            canvas = torch.randint(0, V, (CL,), generator=g)
            out = run("denoise", canvas, start, sc_z)
            check(out, f"canvas {c} step {s}")
            T = t_min + (t_max - t_min) * (N - s) / N
            sc_z = out["ours64"] / T
        commit = out["ours64"].argmax(-1)
        check(run("encode", commit, start), f"canvas {c} commit")
        start += CL


# ---- conventions -----------------------------------------------------------------------------------------
def test_window_convention_matches_transformers_masks():
    """transformers' sliding causal mask is kv > q - sliding_window and its sliding cache keeps the last
    sliding_window - 1 keys: FlashAttention's W = sliding_window - 1 (Gemma 1024 -> 1023)."""
    sw = 8
    fn = sliding_window_causal_mask_function(sw)
    n = 20
    t = torch.tensor
    hf_mask = torch.tensor([[bool(fn(t(0), t(0), t(q), t(k))) for k in range(n)] for q in range(n)])
    ours = build_mask(n, n, causal=True, window_size=tiny_config(sliding_window=sw).window_size)
    assert torch.equal(hf_mask, ours)
    layer = DynamicSlidingWindowLayer(sliding_window=sw)
    k = torch.randn(1, 1, n, 4)
    layer.update(k, k)
    assert layer.keys.shape[2] == sw - 1  # the prefix window of a later decoder pass: W context keys


@pytest.mark.xfail(strict=False, reason="transformers 5.24 StaticCache decoder path: sliding layers keep "
                   "sliding_window (= W + 1) context keys and the 2-D padding mask drops the last canvas key once "
                   "ctx >= sliding_window, so compiled generate disagrees with eager (DynamicCache) generate; we match "
                   "the DynamicCache path")
@torch.no_grad()
def test_transformers_static_cache_path_agrees_with_dynamic():
    cfg = tiny_config(canvas_length=4)
    hf, _ = make_hf_twin(cfg, seed=4)
    canvas, P = _ids(4, cfg.vocab_size, 5), 12
    prompt = _ids(P, cfg.vocab_size, 6)
    res = {}
    for name in ("dynamic", "static"):
        cache = (DynamicCache(config=hf.config.text_config) if name == "dynamic"
                 else StaticCache(config=hf.config.text_config, max_cache_len=64))
        hf_encode(hf, cache, prompt, 0)
        mask = hf.model.decoder.create_diffusion_decoder_attention_mask(  # as generate() prepares it
            config=hf.config, inputs_embeds=torch.zeros(1, 4, 1),
            **hf_cache_kwargs(hf.model.decoder.create_diffusion_decoder_attention_mask, cache),
            decoder_attention_mask=torch.ones(1, P + 4, dtype=torch.bool))
        res[name] = hf(**hf_cache_kwargs(hf, cache), decoder_input_ids=canvas[None], decoder_attention_mask=mask,
                       decoder_position_ids=torch.arange(P, P + 4)[None]).logits[0]
    assert _rel(res["static"], res["dynamic"]) < 1e-4


@torch.no_grad()
def test_variant_config_bias_and_vision_flag():
    """attention_bias=True and use_bidirectional_attention='vision' (the released config; text stays causal),
    with the encoder mask built as generate() builds it."""
    cfg = tiny_config(attention_bias=True, use_bidirectional_attention="vision", num_hidden_layers=3)
    hf, ours = make_hf_twin(cfg, seed=8)
    P = 13
    prompt, canvas = _ids(P, cfg.vocab_size, 1), _ids(cfg.canvas_length, cfg.vocab_size, 2)
    cache = DynamicCache(config=hf.config.text_config)
    mask = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.zeros(1, P, 1), attention_mask=torch.ones(1, P, dtype=torch.bool),
        **hf_cache_kwargs(hf.model.encoder.create_masks_for_generate, cache), position_ids=torch.arange(P)[None])
    out = hf.model.encoder(input_ids=prompt[None], attention_mask=mask, **hf_cache_kwargs(hf.model.encoder, cache),
                           position_ids=torch.arange(P)[None])
    hf_enc = hf_softcap_logits(hf, out.last_hidden_state)[0]
    hf_dec = hf_denoise(hf, cache, canvas, P, None)
    caches = ours.allocate_kv_caches(32, PS)
    assert _rel(our_encode(ours, caches, prompt, 0), hf_enc) < 2e-5
    assert _rel(our_denoise(ours, caches, canvas, P, None), hf_dec) < 2e-5


@torch.no_grad()
def test_untied_encoder_and_decoder_attention_biases_load_and_match_transformers_in_both_modes():
    """transformers keeps the encoder's attention biases apart from the decoder's (only weights are tied): a
    checkpoint whose copies differ loads, each mode uses its own, and the logits match transformers for encoder
    rows, for decoder rows reading the encoder's cache, and for both kinds of rows in one flat mixed batch."""
    cfg = tiny_config(attention_bias=True)
    hf, ours = make_hf_twin(cfg, seed=9)
    sd = hf.state_dict()
    enc = [k for k in sd if k.startswith("model.encoder.language_model.") and k.endswith("_proj.bias")]
    assert len(enc) == 14  # q, k, o on every layer and v on the 2 sliding ones
    for k in enc:
        ours_name = k[len("model.encoder.language_model."):].replace(".bias", ".encoder_bias")
        dec = sd["model.decoder." + k[len("model.encoder.language_model."):]]
        assert not torch.equal(sd[k], dec), k  # really untied
        assert torch.equal(ours.state_dict()[ours_name], sd[k]), k
    P, CL = 11, cfg.canvas_length
    prompt, canvas = _ids(P, cfg.vocab_size, 1), _ids(CL, cfg.vocab_size, 2)
    cache = DynamicCache(config=hf.config.text_config)
    hf_enc = hf_encode(hf, cache, prompt, 0)
    hf_dec = hf_denoise(hf, cache, canvas, P, None)
    caches = ours.allocate_kv_caches(32, PS)
    assert _rel(our_encode(ours, caches, prompt, 0), hf_enc) < 2e-5
    assert _rel(our_denoise(ours, caches, canvas, P, None), hf_dec) < 2e-5
    # one flat batch: sequence 0 prefills the prompt (encoder rows), sequence 1 denoises a canvas over the same
    # prompt already in its own pages (decoder rows)
    caches = ours.allocate_kv_caches(32, PS)
    meta1, pos1 = build_meta([P], [P], [True], PS, block_ids=[[8, 9, 10]])
    ours(prompt, pos1, meta1, caches, attn_backend="reference")
    meta, pos = build_meta([P, CL], [P, P + CL], [True, False], PS,
                           block_ids=[[0, 1, 2], [8, 9, 10, 11, 12, 13, 14]])
    out = ours(torch.cat([prompt, canvas]), pos, meta, caches, attn_backend="reference")
    assert _rel(out[:P], hf_enc) < 2e-5
    assert _rel(out[P:], hf_dec) < 2e-5
