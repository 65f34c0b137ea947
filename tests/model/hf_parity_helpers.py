"""Parity helpers shared by tests/model's transformers comparisons (test_model_hf_parity.py, test_export.py): the
tolerance rule and one encoder / decoder pass on each side. Tolerance: docs/ARCHITECTURE.md "Test discipline"."""
from __future__ import annotations

import torch

from model_testutils import build_meta, hf_cache_kwargs, hf_softcap_logits

PS = 4


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _rel(a, b):
    return _err(a, b) / b.abs().max().item()


F64_AGREE = 1e-5  # relative Frobenius error of transformers' float64 run vs ours; see the module docstring


def _fro(a, o):
    return ((a.double() - o.double()).norm() / o.double().norm()).item()


def check_tol(ours, hf, oracle, what, eps=torch.finfo(torch.float32).eps):
    """Assert the tolerance rule (docs/ARCHITECTURE.md "Test discipline"); return (our error, eager error) (relative Frobenius)."""
    e_ours, e_hf = _fro(ours, oracle), _fro(hf, oracle)
    rep = 4 * eps
    assert torch.isfinite(ours).all(), what
    assert e_ours <= 2 * e_hf + rep, f"{what}: ours {e_ours:.3e} > 2 * eager {e_hf:.3e} + {rep:.1e}"
    return e_ours, e_hf


# ---- transformers side -----------------------------------------------------------------------------------
@torch.no_grad()
def hf_encode(hf, cache, ids, start):
    """Encoder pass (prefill or commit) of ids at positions start..; returns softcapped logits [L, V]."""
    pos = torch.arange(start, start + ids.shape[0])[None]
    out = hf.model.encoder(input_ids=ids[None], **hf_cache_kwargs(hf.model.encoder, cache), position_ids=pos)
    return hf_softcap_logits(hf, out.last_hidden_state)[0]


@torch.no_grad()
def hf_denoise(hf, cache, canvas, start, sc_logits):
    pos = torch.arange(start, start + canvas.shape[0])[None]
    sc = None if sc_logits is None else sc_logits[None]
    return hf(**hf_cache_kwargs(hf, cache), decoder_input_ids=canvas[None], self_conditioning_logits=sc,
              decoder_position_ids=pos).logits[0]


# ---- our side --------------------------------------------------------------------------------------------
@torch.no_grad()
def our_encode(model, caches, ids, start, bw="prefix"):
    L = ids.shape[0]
    meta, pos = build_meta([L], [start + L], [True], PS)
    return model(ids, pos, meta, caches, attn_backend="reference", bidirectional_window=bw)


@torch.no_grad()
def our_denoise(model, caches, canvas, start, sc_z, bw="prefix"):
    L = canvas.shape[0]
    meta, pos = build_meta([L], [start + L], [False], PS)
    soft = None if sc_z is None else model.soft_embedding(sc_z)
    return model(canvas, pos, meta, caches, soft, attn_backend="reference", bidirectional_window=bw)
