"""Gemma 4 text building blocks as transformers 5.24 defines them for DiffusionGemma, over flat ``[T, ...]``
token batches (no batch dimension: a serving batch is packed by ``cu_seqlens_q``).

Every numerical convention follows ``transformers/models/diffusion_gemma/modeling_diffusion_gemma.py``:
RMSNorm in fp32 with ``x * pow(mean(x^2) + eps, -0.5) * w`` (plain ``w``, not ``1 + w``) cast back to the
input dtype; RoPE cos/sin computed in fp32 and cast to the activation dtype; attention scale 1.0 (QK-norm
replaces it); MoE router on the raw residual, softmax in fp32, renormalised top-k times a per-expert scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiffusionGemmaConfig

MOE_IMPLS = ("loop", "grouped_mm")


#: Dtypes ``torch.nn.functional.grouped_mm`` takes (float64 is a RuntimeError inside it).
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_unsupported(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> str | None:
    """Why the ``"grouped_mm"`` MoE cannot run experts of ``hidden_size`` x ``moe_intermediate_size`` in ``dtype``
    (None: it can): torch's ``grouped_mm`` takes bf16 / fp16 / fp32 operands whose row strides are multiples of 16
    bytes (``hidden_size`` and ``moe_intermediate_size`` elements; else "strides should be multiple of 16 bytes"
    from inside the forward pass)."""
    if not hasattr(F, "grouped_mm"):
        return "this torch has no torch.nn.functional.grouped_mm"
    if dtype not in GROUPED_MM_DTYPES:
        return f"torch.nn.functional.grouped_mm takes bf16 / fp16 / fp32 operands, not {dtype}"
    item = dtype.itemsize
    bad = [f"{name} = {n} ({n * item} bytes)" for name, n in (("hidden_size", hidden_size),
                                                              ("moe_intermediate_size", intermediate_size))
           if (n * item) % 16]
    if bad:
        return (f"torch.nn.functional.grouped_mm needs rows of a multiple of 16 bytes in {dtype}: "
                f"{', '.join(bad)}")
    return None


def default_moe_impl(x: torch.Tensor, intermediate_size: int | None = None) -> str:
    """MoE implementation used when a model is built with ``moe_impl=None`` (the default), chosen per forward
    from the activations ``x``: ``"grouped_mm"`` for bf16 on CUDA devices of compute capability 9.x / 10.x
    (torch's grouped GEMM kernels there read the group offsets on the device: no host sync, CUDA-graph
    capturable) where it can run the experts (``x.shape[-1]`` = hidden_size and ``intermediate_size``:
    :func:`grouped_mm_unsupported`; a hidden size of 60 in bf16 made the automatic choice fail inside the forward
    pass), else ``"loop"`` (CPU, other dtypes / GPUs / shapes: per-expert GEMMs, host syncs)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        if intermediate_size is not None and grouped_mm_unsupported(x.dtype, x.shape[-1], intermediate_size):
            return "loop"
        return "grouped_mm" if torch.cuda.get_device_capability(x.device)[0] in (9, 10) else "loop"
    return "loop"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 islands of transformers (norms, RoPE, router softmax), widened to fp64 for fp64 activations so
    a float64 run is a true oracle (transformers itself keeps them fp32 even in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def activation(name: str):
    """The MLP activation of a config name (transformers' ACT2FN names)."""
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported hidden_activation {name!r}")


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm: ``y = x * (mean(x^2) + eps) ** -0.5 [* weight]`` computed in fp32, cast to x's dtype.

    Args:
        dim: normalised size (last axis).
        eps: added to the mean square.
        with_scale: False for the parameter-free norms (v_norm, router norm, self-conditioning post_norm).
    """

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x.dtype)
        xf = x.to(acc)
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            y = y * self.weight.to(acc)
        return y.type_as(x)


def rope_cos_sin(positions: torch.Tensor, inv_freq: dict, dtype: torch.dtype):
    """cos, sin ``[T, head_dim]`` in ``dtype`` for int positions ``[T]``; ``inv_freq`` maps fp32/fp64 to the
    inverse frequencies (fp32 products as transformers; fp64 for fp64 ``dtype``)."""
    acc = acc_dtype(dtype)
    freqs = positions[:, None].to(acc) * inv_freq[acc][None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, heads, D]`` with cos/sin ``[T, D']``; ``D' < D`` rotates the leading
    ``D'`` dims only (not used by Gemma 4, whose proportional RoPE pads with identity angles)."""
    d = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :d]
    x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if d == x.shape[-1] else torch.cat([out, x[..., d:]], dim=-1)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (Gemma 4 dense MLP and the self-conditioning block)."""

    def __init__(self, hidden: int, inter: int, act: str, device=None, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = activation(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Gemma 4 MoE router. Input: the raw residual ``[T, hidden]``.

    ``s = proj(rmsnorm(x) * scale * hidden^-0.5)``; ``p = softmax(s)`` in fp32; top-k of p, renormalised to
    sum 1, times ``per_expert_scale[expert]``. Returns ``(weights [T, k] fp32 (fp64 for fp64 x),
    index [T, k] int64)``.
    """

    def __init__(self, cfg: DiffusionGemmaConfig, device=None, dtype=None):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.scalar_root_size = cfg.hidden_size ** -0.5
        self.top_k = cfg.top_k_experts
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, device=device, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size, device=device, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts, device=device, dtype=dtype))

    def forward(self, x):
        h = self.norm(x)
        h = h * self.scale * self.scalar_root_size
        probs = F.softmax(self.proj(h), dim=-1, dtype=acc_dtype(x.dtype))
        w, idx = torch.topk(probs, k=self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        w = w * self.per_expert_scale[idx]
        return w, idx


class Experts(nn.Module):
    """Expert weights as 3-D tensors (transformers' layout): ``gate_up_proj [E, 2*I, hidden]`` (gate rows
    first, then up), ``down_proj [E, hidden, I]``.

    ``impl``: ``"loop"`` (per-expert gather / index_add, like transformers' eager experts; host syncs) or
    ``"grouped_mm"`` (tokens sorted by expert, ``torch.nn.functional.grouped_mm``; no host sync, CUDA-graph
    friendly; needs 16-byte aligned strides). Both are deterministic (same inputs, same bits, also on CUDA) and
    add each token's k expert outputs in ascending expert order in the activation dtype.
    """

    def __init__(self, cfg: DiffusionGemmaConfig, device=None, dtype=None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.intermediate = cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.moe_intermediate_size,
                                                     cfg.hidden_size, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                                  device=device, dtype=dtype))
        self.act_fn = activation(cfg.hidden_activation)

    def forward(self, x, weights, index, impl: str = "loop"):
        if impl == "loop":
            return self._loop(x, weights, index)
        if impl == "grouped_mm":
            return self._grouped(x, weights, index)
        raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")

    def _loop(self, x, weights, index):
        out = torch.zeros_like(x)
        hit = torch.unique(index).tolist()
        for e in hit:
            tok, kpos = torch.where(index == e)
            g, u = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(g) * u, self.down_proj[e])
            y = y * weights[tok, kpos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _grouped(self, x, weights, index):
        T, k = index.shape
        # each token's k contributions are summed in ascending expert order, in x's dtype, as the loop impl
        # (and transformers' eager experts) accumulate them; the sum is a fixed-order gather + add, not an
        # index_add_ over the sorted list (atomic adds on CUDA: run-to-run different bf16 roundings, which the
        # near-tied top-k routing of later layers amplifies to O(1) differences in the logits).
        index, perm = torch.sort(index, dim=1, stable=True)
        weights = torch.gather(weights, 1, perm)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount syncs on CUDA
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[tok]
        gu = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        h = (self.act_fn(g) * u).contiguous()
        y = F.grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        y = (y * weights.reshape(-1)[order][:, None]).to(x.dtype)
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=x.device))  # unique: exact
        # [T, k, hidden], slot j = the token's j-th smallest expert (hidden named, not -1: T = 0 leaves -1 undetermined)
        y = y[inv].view(T, k, y.shape[-1])
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
        return out


class Attention(nn.Module):
    """Gemma 4 self-attention projections of one layer (the attention itself is ``blockdiff.attention``).

    Sliding layers: ``q/k/v_proj`` with ``head_dim`` and ``num_key_value_heads``. Full layers:
    ``global_head_dim``, ``num_global_key_value_heads`` and no ``v_proj``: V = v_norm(k_proj x) (unscaled
    RMSNorm, no RoPE) while K = rope(k_norm(k_proj x)). q_norm / k_norm are scaled RMSNorms over head_dim.

    ``attention_bias=True``: each projection has the decoder's ``bias`` and the encoder's own ``encoder_bias``
    (``[out_features]``): transformers ties the encoder's projection weights to the decoder's but not their biases
    (``DiffusionGemmaModel._tied_weights_keys``), so encoder (causal) rows add ``encoder_bias`` and decoder
    (bidirectional) rows ``bias``; :meth:`qkv` and :meth:`out` take the ``[T, 1]`` bool decoder-row mask.
    """

    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.head_dim = cfg.layer_head_dim(layer_idx)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.layer_num_kv_heads(layer_idx)
        self.window_size = cfg.layer_window_size(layer_idx)
        hs, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hs, self.num_heads * self.head_dim, bias=b, device=device, dtype=dtype)
        self.k_proj = nn.Linear(hs, self.num_kv_heads * self.head_dim, bias=b, device=device, dtype=dtype)
        self.v_proj = (nn.Linear(hs, self.num_kv_heads * self.head_dim, bias=b, device=device, dtype=dtype)
                       if self.is_sliding else None)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hs, bias=b, device=device, dtype=dtype)
        self.has_bias = b
        if b:
            for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                if proj is not None:
                    proj.encoder_bias = nn.Parameter(torch.zeros(proj.out_features, device=device, dtype=dtype))
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, device=device, dtype=dtype)
        self.v_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, with_scale=False)

    def _project(self, proj: nn.Linear, x: torch.Tensor, is_dec: torch.Tensor | None) -> torch.Tensor:
        """``proj(x)`` with the decoder's bias on decoder rows and ``encoder_bias`` on encoder rows."""
        if not self.has_bias:
            return proj(x)
        if is_dec is None:
            raise ValueError("is_dec ([T, 1] bool, True on decoder rows) is required with attention_bias=True: the "
                             "encoder and decoder keep separate attention biases")
        return F.linear(x, proj.weight) + torch.where(is_dec, proj.bias, proj.encoder_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_dec: torch.Tensor | None = None):
        """q ``[T, H, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, D]`` (x's dtype) from normed hidden ``x [T, hidden]``;
        ``is_dec [T, 1]`` bool (True on decoder rows) picks each row's biases (required with attention_bias)."""
        T = x.shape[0]
        q = self.q_norm(self._project(self.q_proj, x, is_dec).view(T, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        k_raw = self._project(self.k_proj, x, is_dec).view(T, self.num_kv_heads, self.head_dim)
        v = (self._project(self.v_proj, x, is_dec).view(T, self.num_kv_heads, self.head_dim)
             if self.v_proj is not None else k_raw)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v)
        return q, k, v

    def out(self, o: torch.Tensor, is_dec: torch.Tensor | None = None) -> torch.Tensor:
        """``o_proj`` of the attention output ``o [T, H * D]`` (``is_dec`` as in :meth:`qkv`)."""
        return self._project(self.o_proj, o, is_dec)


class DecoderLayer(nn.Module):
    """One Gemma 4 / DiffusionGemma layer: attention, then dense MLP and MoE in parallel, then
    ``layer_scalar``.

    ``layer_scalar`` (decoder / denoise rows) and ``encoder_layer_scalar`` (encoder / causal rows) are
    separate buffers because transformers keeps them untied (its encoder and decoder stacks tie weights,
    not buffers); in released checkpoints they are equal.
    """

    def __init__(self, cfg: DiffusionGemmaConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        hs, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.self_attn = Attention(cfg, layer_idx, device=device, dtype=dtype)
        self.mlp = GatedMLP(hs, cfg.intermediate_size, cfg.hidden_activation, device=device, dtype=dtype)
        norm = lambda: RMSNorm(hs, eps=eps, device=device, dtype=dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.post_feedforward_layernorm_1 = norm()
        self.post_feedforward_layernorm_2 = norm()
        self.pre_feedforward_layernorm_2 = norm()
        self.router = Router(cfg, device=device, dtype=dtype)
        self.experts = Experts(cfg, device=device, dtype=dtype)
        self.register_buffer("layer_scalar", torch.ones(1, device=device, dtype=dtype))
        self.register_buffer("encoder_layer_scalar", torch.ones(1, device=device, dtype=dtype))

    def feed_forward(self, h: torch.Tensor, moe_impl: str) -> torch.Tensor:
        """Post-attention half: ``h + post_ff_norm(post_ff_norm_1(mlp(pre_ff_norm(h))) +
        post_ff_norm_2(experts(pre_ff_norm_2(h), router(h))))`` (before layer_scalar)."""
        h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        w, idx = self.router(h)
        h2 = self.experts(self.pre_feedforward_layernorm_2(h), w, idx, impl=moe_impl)
        h2 = self.post_feedforward_layernorm_2(h2)
        return h + self.post_feedforward_layernorm(h1 + h2)


def init_weights_(module: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """transformers-like init in place: normal(0, std) for linear / embedding / expert weights, ones for norm
    weights, router scales and layer scalars, zeros for biases (the encoder's too). Draws fp32 on the current
    default device (or ``generator``'s device) and casts to each parameter's dtype; meta tensors are skipped."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.is_meta:
                continue
            if leaf in ("scale", "per_expert_scale") or (leaf == "weight" and p.dim() == 1):
                p.fill_(1.0)
            elif leaf in ("bias", "encoder_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(std).to(p.dtype))
        for name, b in module.named_buffers():
            if name.endswith("layer_scalar") and not b.is_meta:
                b.fill_(1.0)
