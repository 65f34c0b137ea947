"""DiffusionGemma over one flat mixed batch: encoder (causal, writes K/V) and decoder (bidirectional over
the canvas, reads the cache) rows in one forward over shared weights.

Source: transformers 5.24 ``DiffusionGemmaForBlockDiffusion`` (``models/diffusion_gemma``) on the Gemma 4
text backbone; Google's DiffusionGemma model card. transformers runs two module stacks (``model.encoder``,
``model.decoder``) with tied weights; here one stack serves both and the per-sequence causal flag of the
attention metadata (``meta.causal`` / ``meta.num_causal_q``) picks each row's mode:

* encoder rows (causal: prefill, commit): ``h0 = E[ids] * sqrt(hidden)``.
* decoder rows (bidirectional: denoise): ``h0 = post_norm(E[ids] * sqrt(hidden) + sc)``, with
  ``sc = down(act(gate(n)) * up(n))``, ``n = pre_norm(soft)`` (transformers'
  ``DiffusionGemmaSelfConditioning``). ``soft`` is the soft embedding of the previous step
  (``softmax(z) @ E * sqrt(hidden)``); a zero row gives ``sc == 0`` exactly (rmsnorm(0) = 0, act(0) = 0),
  but the parameter-free ``post_norm`` is still applied, as transformers does on every decoder pass.

Every row's K/V is written at ``meta.slot_mapping`` before attention (vLLM order); the attention of decoder
rows reads the cached context plus the canvas's own (just written) K/V.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from blockdiff.attention import attention, causal_row_counts, write_kv_cache
from blockdiff.attention.validate import capturing, memory_span, share_elements

from .config import DiffusionGemmaConfig, rope_inv_freq
from .errors import CheckpointError, CheckpointFileNotFoundError
from .generation import generation_defaults, load_generation_config
from .layers import (MOE_IMPLS, DecoderLayer, GatedMLP, RMSNorm, acc_dtype, default_moe_impl, grouped_mm_unsupported,
                     init_weights_, rope_cos_sin)
from .loading import check_device, check_dtype, load_hf_state_dict, read_safetensors


class SelfConditioning(nn.Module):
    """transformers' ``DiffusionGemmaSelfConditioning``: ``post_norm(x + mlp(pre_norm(soft)))``; ``pre_norm``
    scaled, ``post_norm`` unscaled; MLP intermediate size = ``intermediate_size``."""

    def __init__(self, cfg: DiffusionGemmaConfig, device=None, dtype=None):
        super().__init__()
        hs = cfg.hidden_size
        self.pre_norm = RMSNorm(hs, eps=cfg.rms_norm_eps, device=device, dtype=dtype)
        self.post_norm = RMSNorm(hs, eps=cfg.rms_norm_eps, with_scale=False)
        mlp = GatedMLP(hs, cfg.intermediate_size, cfg.hidden_activation, device=device, dtype=dtype)
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def signal(self, soft: torch.Tensor) -> torch.Tensor:
        """``mlp(pre_norm(soft))`` ``[T, hidden]``; exactly 0 on zero rows."""
        n = self.pre_norm(soft)
        return self.down_proj(self.act_fn(self.gate_proj(n)) * self.up_proj(n))

    def forward(self, inputs_embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        """Decoder input ``post_norm(inputs_embeds + signal(soft))`` (transformers' signature)."""
        return self.post_norm(inputs_embeds + self.signal(soft))


#: Cache layouts (per cache: address, shape, strides, element size, device) that
#: :meth:`DiffusionGemma._check_caches_disjoint` found disjoint, oldest first (bounded; no tensors held).
_DISJOINT_CACHE_LAYOUTS: dict = {}
_DISJOINT_CACHE_LAYOUTS_MAX = 64


class DiffusionGemma(nn.Module):
    """DiffusionGemma text model (Gemma 4 backbone, dense MLP + MoE per layer) over a flat mixed batch.

    Args:
        config: :class:`DiffusionGemmaConfig`.
        device, dtype: parameter placement (``device="meta"`` for loading without allocating twice).
        moe_impl: ``"loop"`` (per-expert GEMMs; host syncs), ``"grouped_mm"`` (sort + grouped GEMM, no host
            sync: CUDA-graph capturable; bf16 on CUDA) or None (default): chosen per forward by
            :func:`blockdiff.model.layers.default_moe_impl` (``"grouped_mm"`` for bf16 on sm90 / sm100 GPUs,
            else ``"loop"``). An explicit choice is always honoured.
        seed: seed of the random init (transformers-like: normal(0, initializer_range), norms at 1).

    Attributes:
        embedding_weight: ``E [vocab_size, hidden_size]`` (tied input/output embedding) for the sampler's soft
            embedding ``softmax(z) @ E * sqrt(hidden)``.
        generation_config: the checkpoint's default sampling parameters as
            :class:`blockdiff.sampler.SamplingParams` keywords (:func:`blockdiff.model.load_generation_config`:
            ``canvas_length``, ``max_denoising_steps``, ``t_min``, ``t_max``, ``entropy_bound``,
            ``confidence_threshold``, ``stability_threshold``, ``eos_token_ids``, ``max_tokens``); from the folder's
            ``generation_config.json`` when loaded by :meth:`load_safetensors`, else
            :func:`blockdiff.model.generation.generation_defaults` of ``config``.

    Raises:
        TypeError: ``config`` is not a DiffusionGemmaConfig; a config field of the wrong type; ``dtype`` not one of
            :data:`blockdiff.model.loading.MODEL_DTYPES` (bf16, fp16, fp32, fp64) or None.
        ValueError: ``moe_impl`` unknown; a config field breaking its rule (``config.validate()`` runs here too,
            so a field changed in place after construction is checked).
    """

    def __init__(self, config: DiffusionGemmaConfig, *, device=None, dtype=None, moe_impl: str | None = None,
                 seed: int = 0):
        super().__init__()
        if not isinstance(config, DiffusionGemmaConfig):
            raise TypeError(f"config must be a DiffusionGemmaConfig, got {type(config).__name__}")
        if moe_impl is not None and moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS} or None (auto), got {moe_impl!r}")
        check_dtype(dtype)
        config.validate()
        self.config = config
        self.generation_config = generation_defaults(config)
        self.moe_impl = moe_impl
        hs = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hs, device=device, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(config, i, device=device, dtype=dtype)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hs, eps=config.rms_norm_eps, device=device, dtype=dtype)
        self.self_conditioning = SelfConditioning(config, device=device, dtype=dtype)
        # inverse frequencies kept off the module's buffers so .to(bf16) never rounds them.
        self._inv_freq = {lt: {dt: rope_inv_freq(config.rope_parameters[lt], hd, dt)
                               for dt in (torch.float32, torch.float64)}
                          for lt, hd in (("sliding_attention", config.head_dim),
                                         ("full_attention", config.global_head_dim))
                          if lt in config.layer_types}
        self._inv_freq_dev: dict = {}
        self._embed_scale: dict = {}  # dtype -> sqrt(hidden) rounded to it (Python float)
        if torch.device(device or "cpu").type != "meta":
            g = torch.Generator().manual_seed(seed)
            init_weights_(self, std=config.initializer_range, generator=g)

    # ---- public helpers ---------------------------------------------------------------------------------
    @property
    def embedding_weight(self) -> torch.Tensor:
        """Tied embedding ``E [vocab_size, hidden_size]`` (model dtype)."""
        return self.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Encoder-row input embedding ``E[ids] * sqrt(hidden)`` (scale rounded to E's dtype)."""
        return self.embed_tokens(input_ids) * self.embed_scale

    @property
    def embed_scale(self) -> float:
        """``sqrt(hidden_size)`` rounded to the embedding dtype, as transformers applies it (bf16: 53.0 for
        hidden 2816, not 53.066), as a Python float (no device tensor: CUDA-graph safe)."""
        dt = self.embed_tokens.weight.dtype
        hit = self._embed_scale.get(dt)
        if hit is None:  # computed once per dtype: later forwards read no tensor value (capture-safe)
            hit = float(torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(dt).item())
            self._embed_scale[dt] = hit
        return hit

    def soft_embedding(self, z: torch.Tensor) -> torch.Tensor:
        """Self-conditioning input ``softmax(z) @ E * sqrt(hidden)`` ``[..., hidden]`` fp32 from
        temperature-scaled logits ``z [..., vocab]`` (fp64 for a float64 model; the sampler owns this in serving,
        this is a convenience for tests and demos). transformers computes the same product in the embedding
        dtype, scaled by sqrt(hidden) rounded to that dtype; the scale is immaterial since the
        self-conditioning block starts with an RMSNorm.

        Raises:
            TypeError: ``z`` is not a floating tensor (integer or bool "logits" are not taken as numbers).
            ValueError: ``z``'s last dimension is not ``vocab_size`` (or ``z`` is 0-d), or ``z`` is not on the
                model's device.
        """
        if not torch.is_tensor(z) or not z.is_floating_point():
            raise TypeError(f"z must be a floating tensor of logits, got "
                            f"{z.dtype if torch.is_tensor(z) else type(z).__name__}")
        V = self.config.vocab_size
        if z.dim() < 1 or z.shape[-1] != V:
            raise ValueError(f"z must be [..., vocab_size = {V}] logits, got shape {tuple(z.shape)}")
        w = self.embed_tokens.weight
        if z.device != w.device:
            raise ValueError(f"z is on {z.device}, the model on {w.device}")
        acc = acc_dtype(self.embed_tokens.weight.dtype)
        p = torch.softmax(z.to(acc), dim=-1)
        return (p @ self.embed_tokens.weight.to(acc)) * (self.config.hidden_size ** 0.5)

    def kv_cache_shapes(self, num_blocks: int, page_size: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per layer ``(k_shape, v_shape)``, each ``[num_blocks, page_size, num_kv_heads_l, head_dim_l]``."""
        out = []
        for layer in self.layers:
            a = layer.self_attn
            shape = (num_blocks, page_size, a.num_kv_heads, a.head_dim)
            out.append((shape, shape))
        return out

    def allocate_kv_caches(self, num_blocks: int, page_size: int, device=None, dtype=None):
        """Zeroed paged KV caches, one ``(k_cache, v_cache)`` pair per layer.

        Args:
            num_blocks, page_size: cache geometry (tokens per page = page_size).
            device, dtype: default the model's.

        Returns:
            list (len num_hidden_layers) of ``(k_cache, v_cache)``, each
            ``[num_blocks, page_size, num_kv_heads_l, head_dim_l]``; sliding layers use
            ``num_key_value_heads x head_dim``, full layers ``num_global_key_value_heads x global_head_dim``.

        Raises:
            TypeError: num_blocks / page_size not ints (bool, float and str are refused), dtype not one of
                :data:`blockdiff.model.loading.MODEL_DTYPES` (the attention backends' dtypes), device not a device.
            ValueError: non-positive num_blocks or page_size; a device string torch cannot parse or a CUDA device
                that is not there.
        """
        for name, v in (("num_blocks", num_blocks), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int > 0, got {type(v).__name__} {v!r}")
            if v <= 0:
                raise ValueError(f"{name} must be an int > 0, got {v}")
        check_dtype(dtype)
        w = self.embed_tokens.weight
        device = w.device if device is None else check_device(device)
        dtype = w.dtype if dtype is None else dtype
        return [(torch.zeros(ks, device=device, dtype=dtype), torch.zeros(vs, device=device, dtype=dtype))
                for ks, vs in self.kv_cache_shapes(num_blocks, page_size)]

    # ---- forward ----------------------------------------------------------------------------------------
    def _device_inv_freq(self, layer_type: str, device) -> dict:
        """Inverse frequencies on ``device`` (copied once per device, so graph capture sees no H2D copy)."""
        key = (layer_type, str(device))
        hit = self._inv_freq_dev.get(key)
        if hit is None:
            hit = {dt: t.to(device) for dt, t in self._inv_freq[layer_type].items()}
            self._inv_freq_dev[key] = hit
        return hit

    def decoder_row_mask(self, meta, total_q: int) -> torch.Tensor:
        """``[T]`` bool: True for bidirectional (decoder / denoise) rows, from ``meta.causal`` or
        ``meta.num_causal_q``, without host syncs."""
        cu = meta.cu_seqlens_q
        B = cu.shape[0] - 1
        t = torch.arange(total_q, device=cu.device, dtype=cu.dtype)
        seq = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=max(B - 1, 0))
        ncq = getattr(meta, "num_causal_q", None)
        if ncq is not None:
            return (t - cu[seq]) >= ncq.to(cu.device)[seq]
        return ~meta.causal.to(cu.device, torch.bool)[seq]

    def _validate(self, input_ids, positions, meta, kv_caches, self_cond, attn_backend, bidirectional_window,
                  check_values):
        if not isinstance(attn_backend, str):
            raise TypeError(f"attn_backend must be a str (e.g. 'reference', 'triton'), got {attn_backend!r}")
        if not torch.is_tensor(input_ids) or input_ids.dim() != 1 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be a 1-D int64 tensor [T], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        T = input_ids.shape[0]
        if not torch.is_tensor(positions) or positions.shape != (T,) or positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 [T={T}], got "
                             f"{getattr(positions, 'dtype', type(positions))} {tuple(getattr(positions, 'shape', ()))}")
        for name in ("cu_seqlens_q", "seq_lens", "block_table", "slot_mapping"):
            if not torch.is_tensor(getattr(meta, name, None)):
                raise ValueError(f"meta.{name} must be a tensor")
        if getattr(meta, "causal", None) is None and getattr(meta, "num_causal_q", None) is None:
            raise ValueError("meta.causal (or meta.num_causal_q) must be set: it selects encoder/decoder rows")
        if meta.slot_mapping.shape != (T,):
            raise ValueError(f"meta.slot_mapping must be [T={T}], got {tuple(meta.slot_mapping.shape)}")
        B = meta.cu_seqlens_q.shape[0] - 1
        flags = meta.causal if getattr(meta, "num_causal_q", None) is None else meta.num_causal_q
        if B < 1:
            raise ValueError(f"the batch must hold at least one sequence: meta.cu_seqlens_q has "
                             f"{meta.cu_seqlens_q.shape[0]} entries (B + 1 >= 2 needed)")
        if flags.shape != (B,) or meta.seq_lens.shape != (B,):
            raise ValueError(f"meta.cu_seqlens_q [B+1], seq_lens [B] and causal [B] disagree: "
                             f"{tuple(meta.cu_seqlens_q.shape)}, {tuple(meta.seq_lens.shape)}, {tuple(flags.shape)}")
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches must be a list of {len(self.layers)} (k_cache, v_cache) pairs, got "
                             f"{type(kv_caches).__name__} of length {len(kv_caches) if hasattr(kv_caches, '__len__') else '?'}")
        for i, (pair, layer) in enumerate(zip(kv_caches, self.layers)):
            a = layer.self_attn
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"kv_caches[{i}] must be a (k_cache, v_cache) pair")
            for nm, c in zip(("k_cache", "v_cache"), pair):
                if not torch.is_tensor(c):
                    raise TypeError(f"kv_caches[{i}].{nm} must be a torch.Tensor, got {type(c).__name__}")
                if c.dim() != 4 or tuple(c.shape[2:]) != (a.num_kv_heads, a.head_dim):
                    raise ValueError(f"kv_caches[{i}].{nm} must be [num_blocks, page_size, {a.num_kv_heads}, "
                                     f"{a.head_dim}] ({a.layer_type} layer), got {tuple(c.shape)}")
        if self_cond is not None:
            if not torch.is_tensor(self_cond) or self_cond.shape != (T, self.config.hidden_size) \
                    or not self_cond.is_floating_point():
                raise ValueError(f"self_cond must be a float tensor [T={T}, hidden={self.config.hidden_size}] or "
                                 f"None, got {getattr(self_cond, 'dtype', type(self_cond))} "
                                 f"{tuple(getattr(self_cond, 'shape', ()))}")
        if bidirectional_window not in ("prefix", "symmetric"):
            raise ValueError(f"bidirectional_window must be 'prefix' or 'symmetric', got {bidirectional_window!r}")
        # every per-step tensor on the model's device (else torch's RuntimeError from inside the forward pass, naming
        # neither the argument nor the devices; attention and the KV-cache writer check theirs against q / k_cache)
        dev = self.embed_tokens.weight.device
        on = [("input_ids", input_ids), ("positions", positions), ("self_cond", self_cond)]
        on += [(f"meta.{n}", getattr(meta, n, None)) for n in ("cu_seqlens_q", "seq_lens", "block_table",
                                                               "slot_mapping", "causal", "num_causal_q")]
        for name, t in on:
            if torch.is_tensor(t) and t.device != dev:
                raise ValueError(f"{name} is on {t.device}, the model on {dev}: pass the step's tensors on the "
                                 "model's device")
        if check_values and T:
            # one host read (a sync on a GPU) for the whole check, the row layout's metadata included; skipped under
            # CUDA-graph capture
            V, P = self.config.vocab_size, self.config.max_position_embeddings
            bad = (input_ids < 0) | (input_ids >= V)
            bad_pos = (positions < 0) | (positions >= P)
            layout = self._row_layout_tensors(meta, positions)
            host = torch.cat([torch.stack((bad.any(), bad_pos.any())).to(torch.int64)]
                             + [t.reshape(-1) for t in layout]).cpu()
            any_bad, any_bad_pos = host[:2].tolist()
            if any_bad:
                where = torch.nonzero(bad).flatten()[:8].tolist()
                ids = input_ids[where].tolist()
                raise ValueError(f"input_ids must be in [0, vocab_size = {V}): {int(bad.sum())} are not, e.g. "
                                 f"ids {ids} at rows {where}")
            if any_bad_pos:  # (RoPE of a position past the trained range, or negative, was a silent wrong result;
                # the config's RoPE rule keeps the float32 angles finite only below max_position_embeddings)
                where = torch.nonzero(bad_pos).flatten()[:8].tolist()
                raise ValueError(f"positions must be in [0, max_position_embeddings = {P}): {int(bad_pos.sum())} "
                                 f"are not, e.g. {positions[where].tolist()} at rows {where}")
            if layout:
                host, n = host[2:], [t.numel() for t in layout]
                cu, sl, pos, sm, bt = (h.reshape(t.shape) for h, t in zip(host.split(n), layout))
                self._check_row_layout(cu, sl, pos, sm, bt, sorted({pair[0].shape[1] for pair in kv_caches}))
            self._check_caches_disjoint(kv_caches)

    @staticmethod
    def _check_caches_disjoint(kv_caches) -> None:
        """Raise a ValueError naming two caches of different layers that share an element (host pointer arithmetic
        on shapes, strides and addresses; no device read). Every layer writes its K/V at ``meta.slot_mapping`` and
        reads them back through ``meta.block_table``, so two such layers overwrite each other's context: a silent
        wrong result (``[(k, v)] * num_layers``). Disjoint views of one allocation (per-layer slices of a pool,
        interleaved K / V planes) pass; a layer's own K and V are the KV-cache writer's check.

        A layout that passed (every cache's address, shape, strides, element size and device: all the answer
        depends on) is remembered, so a serving loop pays the sweep once, not every forward (its measured host cost,
        60 layers' separate caches and an interleaved ``[num_blocks, num_layers, 2, ...]`` pool: docs/tuning.md
        7.61, review27c)."""
        key = tuple((c.data_ptr(), c.shape, c.stride(), c.element_size(), c.device)
                    for pair in kv_caches for c in pair)
        if key in _DISJOINT_CACHE_LAYOUTS:
            return
        spans = []
        for i, pair in enumerate(kv_caches):
            for name, c in zip(("k_cache", "v_cache"), pair):
                if c.numel():
                    spans.append((*memory_span(c), i, name, c))
        spans.sort(key=lambda x: (x[0], x[1], x[2]))
        open_spans: list = []  # spans that reach past the current start (candidates for an overlap)
        shared = []
        for start, end, i, name, c in spans:
            open_spans = [o for o in open_spans if o[1] > start]
            for o in open_spans:
                if o[2] != i and share_elements(o[4], c):  # (False across devices)
                    shared.append(tuple(sorted(((o[2], o[3]), (i, name)))))
            open_spans.append((start, end, i, name, c))
        if shared:
            (i0, n0), (i1, n1) = min(shared)
            raise ValueError(f"kv_caches[{i0}].{n0} and kv_caches[{i1}].{n1} share memory ({len(shared)} pairs of "
                             "caches of different layers do): each layer writes its K/V at meta.slot_mapping, so one "
                             "layer would overwrite the other's context (give every layer its own caches, e.g. "
                             "allocate_kv_caches)")
        if len(_DISJOINT_CACHE_LAYOUTS) >= _DISJOINT_CACHE_LAYOUTS_MAX:
            _DISJOINT_CACHE_LAYOUTS.pop(next(iter(_DISJOINT_CACHE_LAYOUTS)), None)  # the oldest
        _DISJOINT_CACHE_LAYOUTS[key] = None

    @staticmethod
    def _row_layout_tensors(meta, positions) -> tuple:
        """The tensors :meth:`_check_row_layout` reads (``cu_seqlens_q``, ``seq_lens``, ``positions``,
        ``slot_mapping``, ``block_table``) as int64 on their device, or ``()`` when one of them is not an integer
        tensor: a dtype the checks downstream refuse by name (attention's, the KV-cache writer's), which a cast
        here would have turned into another message first."""
        ts = (meta.cu_seqlens_q, meta.seq_lens, positions, meta.slot_mapping, meta.block_table)
        if any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in ts):
            return ()
        return tuple(t.to(torch.int64) for t in ts)

    @staticmethod
    def _check_row_layout(cu, sl, pos, sm, bt, page_sizes) -> None:
        """Value check on host copies (int64) of ``meta.cu_seqlens_q``, ``meta.seq_lens``, ``positions``,
        ``meta.slot_mapping`` and ``meta.block_table``: row ``i`` of sequence ``b`` is absolute position
        ``q_abs = seq_lens[b] - q_len_b + i`` (the position attention masks it as), so its RoPE position must be
        ``q_abs`` and its KV slot (when >= 0) the one ``block_table`` gives ``q_abs`` at each cache's page size.
        Either mismatch was a silent wrong result: K/V written where attention does not read it (the row then
        attended to stale cache rows), or a row rotated as another position. Metadata that breaks attention's own
        value rules (cu_seqlens_q, seq_lens, the block table's width) is left to its checks, which name them."""
        T = pos.shape[0]
        ql = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or bool((ql < 0).any()) or int(cu[-1]) != T or bool((sl < ql).any()):
            return
        B = ql.shape[0]
        seq = torch.repeat_interleave(torch.arange(B), ql)
        row = torch.arange(T) - cu[:-1][seq]
        q_abs = (sl - ql)[seq] + row
        bad = torch.nonzero(pos != q_abs).flatten()
        if bad.numel():
            t = int(bad[0])
            raise ValueError(f"positions[{t}] = {int(pos[t])}, but that row (row {int(row[t])} of sequence "
                             f"{int(seq[t])}) is key position {int(q_abs[t])} (seq_lens - query length + row), as "
                             f"attention masks it: RoPE would rotate it as another position ({int(bad.numel())} "
                             "rows disagree)")
        if bt.dim() != 2 or bt.shape[0] != B or bt.shape[1] == 0:
            return
        for ps in page_sizes:
            col = q_abs // ps
            page = bt[seq, col.clamp(max=bt.shape[1] - 1)]
            want = page * ps + q_abs % ps
            bad = torch.nonzero((sm >= 0) & (col < bt.shape[1]) & (sm != want)).flatten()
            if bad.numel():
                t = int(bad[0])
                raise ValueError(
                    f"meta.slot_mapping[{t}] = {int(sm[t])}, but block_table puts that row (row {int(row[t])} of "
                    f"sequence {int(seq[t])}, key position {int(q_abs[t])}) at slot {int(want[t])} (page "
                    f"{int(page[t])}, page_size {ps}): its K/V would be written where attention does not read it "
                    f"({int(bad.numel())} rows disagree; a negative slot skips a row)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches, self_cond=None, *,
                attn_backend: str, bidirectional_window: str | None = None,
                check_values: bool | None = None) -> torch.Tensor:
        """One forward pass over a flat mixed batch.

        Args:
            input_ids: ``[T]`` int64 token ids (prompt chunks, committed canvases, noisy canvases), packed by
                ``meta.cu_seqlens_q``.
            positions: ``[T]`` int64 absolute positions (RoPE), in ``[0, max_position_embeddings)``: each row's key
                position ``seq_lens[b] - q_len_b + i`` (row ``i`` of sequence ``b``, as attention masks it).
            meta: :class:`blockdiff.attention.AttentionMetadata` (``causal [B]`` selects encoder rows).
            kv_caches: from :meth:`allocate_kv_caches`; every row's K/V is written at ``meta.slot_mapping``.
            self_cond: ``[T, hidden]`` float soft embeddings (``softmax(z) @ E * sqrt(hidden)``) or None (all
                zero). Read only on decoder rows; a zero row contributes exactly nothing.
            attn_backend: ``blockdiff.attention`` backend (``"reference"``, ``"triton"``, ``"cute"``); required.
            bidirectional_window: override of ``config.bidirectional_window`` for sliding layers.
            check_values: run the value checks that read tensors on the host (``input_ids`` in
                ``[0, vocab_size)``, ``positions`` in ``[0, max_position_embeddings)``, each row's position and
                non-negative ``meta.slot_mapping`` entry its key position / the slot ``meta.block_table`` gives it, all
                from one host copy; no two layers' ``kv_caches`` sharing memory, from their addresses; and
                attention's / the KV-cache writer's metadata checks, once per cache geometry). None (default): on
                unless a CUDA
                graph is being captured (:func:`blockdiff.attention.validate.capturing`); False trusts the caller
                (an out-of-vocabulary id is then an out-of-bounds embedding read: an IndexError on the CPU, a
                device-side assert on CUDA).

        Returns:
            logits ``[T, vocab_size]`` fp32 (fp64 for a float64 model), softcapped (``cap * tanh(logits / cap)``)
            in fp32.

        Raises:
            TypeError: attn_backend not a str, check_values not a bool / None, a ``kv_caches`` entry not a tensor.
            NotImplementedError: ``moe_impl="grouped_mm"`` where torch's grouped GEMM cannot run the experts (a
                float64 model, rows not a multiple of 16 bytes: :func:`blockdiff.model.layers.grouped_mm_unsupported`);
                a kernel ``attn_backend`` (triton, cute) with grad mode on and parameters that
                require grad (it computes no gradients: run under ``torch.no_grad()`` / ``torch.inference_mode()``,
                or train with ``"reference"``).
            ValueError: a shape/dtype rule of an argument is broken, or a tensor of the step (``input_ids``,
                ``positions``, ``self_cond``, ``meta``'s) is not on the model's device (named in the message); with
                value checks, input ids outside ``[0, vocab_size)`` or positions outside
                ``[0, max_position_embeddings)`` (the values and their rows named), and a row whose position or
                (non-negative) ``meta.slot_mapping`` entry is not its key position ``seq_lens - q_len + row`` / the
                slot ``meta.block_table`` gives it (:meth:`_check_row_layout`); with value checks, caches of two
                layers that share memory (:meth:`_check_caches_disjoint`: one layer would overwrite the other's
                context), both named.
        """
        bw = self.config.bidirectional_window if bidirectional_window is None else bidirectional_window
        if check_values is not None and not isinstance(check_values, bool):
            raise TypeError(f"check_values must be a bool or None, got {check_values!r}")
        values = (not capturing()) if check_values is None else check_values
        self._validate(input_ids, positions, meta, kv_caches, self_cond, attn_backend, bw, values)
        T = input_ids.shape[0]
        dtype = self.embed_tokens.weight.dtype
        is_dec = self.decoder_row_mask(meta, T)[:, None]  # [T, 1]

        h = self.embed_input_ids(input_ids)
        moe_impl = self.moe_impl or default_moe_impl(h, self.config.moe_intermediate_size)
        if moe_impl == "grouped_mm":  # an explicit choice the grouped GEMM cannot run (a RuntimeError inside it)
            why = grouped_mm_unsupported(h.dtype, self.config.hidden_size, self.config.moe_intermediate_size)
            if why is not None:
                raise NotImplementedError(f"moe_impl='grouped_mm': {why}; use moe_impl='loop' (or None, the "
                                          "automatic choice)")
        hd = h
        if self_cond is not None:
            hd = hd + self.self_conditioning.signal(self_cond.to(dtype))
        hd = self.self_conditioning.post_norm(hd)
        h = torch.where(is_dec, hd, h)

        cs = {lt: rope_cos_sin(positions, self._device_inv_freq(lt, positions.device), dtype)
              for lt in self._inv_freq}
        attn_kwargs = meta.attn_kwargs()
        if "causal" in attn_kwargs:
            # the causal flags as row counts once per forward pass, not once per layer inside attention(); the
            # same checks as attention()'s (a non-bool / misplaced meta.causal raises naming it, not a cast)
            attn_kwargs["num_causal_q"] = causal_row_counts(attn_kwargs.pop("causal"), meta.cu_seqlens_q)
        # The per-step metadata are the same for every layer: their host-side value checks (syncs) run once per
        # cache geometry (num_blocks, page_size), not once per layer; shape checks still run on every call.
        checked = set()
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = a.qkv(x, *cs[a.layer_type], is_dec)
            geometry = tuple(k_cache.shape[:2])
            cv = False if geometry in checked else check_values  # None: the default (on unless capturing a graph)
            checked.add(geometry)
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, check_values=cv)
            o = attention(q, k_cache, v_cache, **attn_kwargs, window_size=a.window_size,
                          bidirectional_window=bw, scale=1.0, backend=attn_backend, check_values=cv)
            o = a.out(o.reshape(T, a.num_heads * a.head_dim).to(dtype), is_dec)
            h = h + layer.post_attention_layernorm(o)
            h = layer.feed_forward(h, moe_impl)
            h = h * torch.where(is_dec, layer.layer_scalar, layer.encoder_layer_scalar)

        h = self.norm(h)
        logits = nn.functional.linear(h, self.embed_tokens.weight)
        logits = logits.double() if logits.dtype == torch.float64 else logits.float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- loading ----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained_state_dict(cls, state_dict, config: DiffusionGemmaConfig | None = None, *,
                                   hf_config=None, device=None, dtype=None, moe_impl: str | None = None):
        """Build a model from a transformers ``DiffusionGemmaForBlockDiffusion`` (or ``DiffusionGemmaModel``)
        state dict; see :func:`blockdiff.model.loading.convert_hf_state_dict` for the name mapping and
        errors. ``config`` or ``hf_config`` (anything :meth:`DiffusionGemmaConfig.from_hf` takes) is required.
        """
        if config is None:
            if hf_config is None:
                raise ValueError("pass config= (DiffusionGemmaConfig) or hf_config= (transformers config)")
            config = DiffusionGemmaConfig.from_hf(hf_config)
        model = cls(config, device="meta", dtype=dtype, moe_impl=moe_impl)
        load_hf_state_dict(model, state_dict, device=device, dtype=dtype)
        return model

    @classmethod
    def load_safetensors(cls, path, config: DiffusionGemmaConfig | None = None, *, device=None, dtype=None,
                         moe_impl: str | None = None):
        """Build a model from a safetensors checkpoint: a ``.safetensors`` file, or a folder with
        ``model.safetensors`` or ``model.safetensors.index.json`` shards (and ``config.json`` when ``config``
        is None). Vision-tower tensors are skipped. The folder's (the file's folder's) ``generation_config.json``,
        when there, gives :attr:`generation_config` (:func:`blockdiff.model.load_generation_config`).

        Raises:
            TypeError: ``path`` not a str / os.PathLike, ``config`` not a DiffusionGemmaConfig, ``dtype`` not one of
                :data:`blockdiff.model.loading.MODEL_DTYPES` (bf16, fp16, fp32, fp64).
            ValueError: a bad ``device`` (see :func:`blockdiff.model.loading.check_device`), ``moe_impl``.
            CheckpointFileNotFoundError: no checkpoint at ``path``, or no ``config.json`` beside it (and no
                ``config``); also a ``FileNotFoundError``.
            CheckpointError: a bad ``config.json`` / ``generation_config.json`` field, an unreadable or malformed
                safetensors file or index, missing / unexpected / mis-shaped / wrongly typed tensors (all listed),
                a ``dtype`` that cannot hold a weight (a finite value overflowing to inf), or, without ``dtype``, an
                embedding stored in a dtype outside :data:`~blockdiff.model.loading.MODEL_DTYPES` (float8: pass
                ``dtype=``); the message names the file.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike (a .safetensors file or a checkpoint folder), got "
                            f"{type(path).__name__}")
        if config is not None and not isinstance(config, DiffusionGemmaConfig):
            raise TypeError(f"config must be a DiffusionGemmaConfig or None, got {type(config).__name__}")
        check_dtype(dtype)
        if moe_impl is not None and moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS} or None (auto), got {moe_impl!r}")
        device = check_device(device) if device is not None else None
        path = os.fspath(path)
        if not os.path.exists(path):
            raise CheckpointFileNotFoundError(f"no safetensors checkpoint at {path}")
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if config is None:
            cfg_path = os.path.join(folder, "config.json")
            if not os.path.exists(cfg_path):
                raise CheckpointFileNotFoundError(f"no config.json beside {path}; pass config=")
            config = DiffusionGemmaConfig.from_hf(cfg_path)
        generation = load_generation_config(folder, config)
        tensors = read_safetensors(path, device=device)
        try:
            model = cls.from_pretrained_state_dict(tensors, config, device=device, dtype=dtype, moe_impl=moe_impl)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from e
        model.generation_config = generation
        return model
