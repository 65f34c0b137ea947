"""Shared helpers for tests/model: metadata builders and a tiny random transformers DiffusionGemma twin."""
from __future__ import annotations

import inspect

import torch

from blockdiff.attention import AttentionMetadata
from blockdiff.model import DiffusionGemma, DiffusionGemmaConfig


def build_meta(q_lens, seq_lens, causal, page_size, *, block_ids=None, num_blocks=None, device="cpu",
               num_causal_q=None):
    """AttentionMetadata for sequences whose query tokens are the last q_len of seq_len keys.

    Sequence b owns pages block_ids[b] (default: consecutive); slot of absolute position p is
    block_ids[b][p // page_size] * page_size + p % page_size.
    Returns (meta, positions [T] int64).
    """
    B = len(q_lens)
    if block_ids is None:
        block_ids, nxt = [], 0
        for s in seq_lens:
            n = (s + page_size - 1) // page_size
            block_ids.append(list(range(nxt, nxt + n)))
            nxt += n
    max_blocks = max(len(ids) for ids in block_ids) or 1
    bt = torch.zeros(B, max_blocks, dtype=torch.int32)
    slots, pos = [], []
    for b in range(B):
        ids = block_ids[b]
        bt[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(seq_lens[b] - q_lens[b], seq_lens[b]):
            slots.append(ids[p // page_size] * page_size + p % page_size)
            pos.append(p)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    meta = AttentionMetadata(
        cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        causal=torch.tensor(causal, dtype=torch.bool, device=device), block_table=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        num_causal_q=None if num_causal_q is None else torch.tensor(num_causal_q, dtype=torch.int32, device=device),
    )
    return meta, torch.tensor(pos, dtype=torch.int64, device=device)


def randomize_(model: DiffusionGemma, seed: int = 0) -> DiffusionGemma:
    """Random weights with O(1) activations (norm weights ~1 +- 0.3, scalars in [0.5, 1.5])."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


# ---- transformers twin ---------------------------------------------------------------------------------
def hf_config_from(cfg: DiffusionGemmaConfig, attn_implementation: str = "eager"):
    # transformers is a dev extra: only the parity tests (which importorskip it) call this
    from transformers import DiffusionGemmaConfig as HFConfig

    tc = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim,
        num_global_key_value_heads=cfg.num_global_key_value_heads, num_experts=cfg.num_experts,
        top_k_experts=cfg.top_k_experts, moe_intermediate_size=cfg.moe_intermediate_size,
        sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types), rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=cfg.rope_parameters, final_logit_softcapping=cfg.final_logit_softcapping,
        hidden_activation=cfg.hidden_activation, max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.attention_bias, use_bidirectional_attention=cfg.use_bidirectional_attention,
    )
    vc = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    hc = HFConfig(text_config=tc, vision_config=vc, canvas_length=cfg.canvas_length)
    hc._attn_implementation = attn_implementation
    hc.text_config._attn_implementation = attn_implementation
    hc.text_config._experts_implementation = "eager"  # runs in float64 too (the oracle)
    return hc


def make_hf_twin(cfg: DiffusionGemmaConfig, seed: int = 0, attn_implementation: str = "eager",
                 dtype=torch.float32):
    """A random transformers DiffusionGemmaForBlockDiffusion and our model loaded from its state dict (every
    untied tensor -- layer scalars, attention biases -- drawn apart for the encoder and the decoder)."""
    # transformers is a dev extra: only the parity tests (which importorskip it) call this
    from transformers import DiffusionGemmaForBlockDiffusion

    hc = hf_config_from(cfg, attn_implementation)
    torch.manual_seed(seed)
    hf = DiffusionGemmaForBlockDiffusion(hc).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # tied params appear once
            if "vision" in name:
                continue
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):  # encoder and decoder copies differ on purpose
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        # transformers ties the encoder's weights to the decoder's but not its attention biases (attention_bias=True
        # only): named_parameters() lists them apart, so the loop above drew the two copies independently.
    hf = hf.to(dtype)
    ours = DiffusionGemma.from_pretrained_state_dict(hf.state_dict(), cfg, dtype=dtype)
    return hf, ours


def hf_cache_kwargs(fn, cache) -> dict:
    """``{name: cache}`` for a transformers DiffusionGemma module (its forward) or method: ``cache=`` from
    transformers 5.24 on, ``past_key_values=`` before (5.17: a ``cache=`` there lands in ``**kwargs`` and is
    ignored, so the encoder's KV never reaches the decoder)."""
    params = inspect.signature(getattr(fn, "forward", fn)).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def hf_softcap_logits(hf, hidden):
    logits = hf.lm_head(hidden).float()
    cap = hf.final_logit_softcapping
    return torch.tanh(logits / cap) * cap
