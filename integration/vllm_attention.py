"""vLLM attention backend ``CUSTOM`` -> blockdiff's mixed causal/bidirectional attention (needs vLLM).

Metadata, KV layout and the KV write are vLLM's FlashAttention backend's (the builder accepts a per-request
``causal`` int32 tensor, which :class:`~blockdiff.integration.model_state.DiffusionModelState.prepare_attn`
fills in place from the phase). Only the attention call changes: one :func:`blockdiff.attention.attention`
launch over the whole mixed batch, with the backend named by ``BLOCKDIFF_ATTN_BACKEND`` (default ``triton``;
``cute``, ``reference``; no fallback). Sliding windows: vLLM's ``sliding_window`` (Gemma's 1024) is
W = sliding_window - 1 keys; bidirectional (denoise) rows follow the model's rule,
:attr:`BlockdiffAttentionImpl.bidirectional_window`: ``"prefix"`` (transformers' DiffusionGemma decoder: the last W
context keys plus the whole canvas) unless the checkpoint's ``text_config.bidirectional_window`` says
``"symmetric"`` (vLLM's own convention, ``|q - k| <= W``); blockdiff's model class sets it on every layer from the
config (:class:`~blockdiff.integration.vllm_model.BlockdiffDiffusionGemmaForConditionalGeneration`).

Two things are not FlashAttention's (the same in vLLM 0.26.0 and 0.33.0): the metadata builder never computes
FA3's ahead-of-time schedule (:class:`BlockdiffAttentionMetadataBuilder`: vLLM's builder passes the per-request
``causal`` tensor to ``get_scheduler_metadata``, which takes a bool, whenever FA3 is the installed FlashAttention),
and the head sizes and dtypes the backend accepts are blockdiff's (:meth:`BlockdiffAttentionBackend.supports_head_size`:
FlashAttention's own refuses head size 512, DiffusionGemma's global layers, unless FA4 is importable;
:meth:`BlockdiffAttentionBackend.supports_dtype`: float32 too with the triton backend, for ``--dtype float32``).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.flash_attn import (  # type: ignore
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from .vllm_plugin import DEFAULT_BIDIRECTIONAL_WINDOW, attn_backend_from_env


class BlockdiffAttentionImpl(FlashAttentionImpl):
    """FlashAttentionImpl whose forward calls :func:`blockdiff.attention.attention` (one launch, per-request
    causal flags) with ``check_values=False``: vLLM builds the metadata (sequence lengths, block table, flags), so
    the per-call value checks, which read the metadata back to the host once per layer, are skipped, as vLLM's own
    backends do; types, shapes and devices are still checked.

    Attributes:
        bidirectional_window: window rule of the bidirectional rows on a sliding-window layer (``"prefix"`` or
            ``"symmetric"``, see the module docstring); the class default is transformers' ``"prefix"``, and
            blockdiff's model class sets each layer's from the checkpoint's config.
    """

    bidirectional_window: str = DEFAULT_BIDIRECTIONAL_WINDOW

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blockdiff_backend = attn_backend_from_env()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        from blockdiff.attention import attention, causal_row_counts

        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("blockdiff attention: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        # The flags as causal row counts once per metadata object (vLLM builds one per step and attention group,
        # shared by its layers), not once per layer: the first layer stores them on the object.
        ncq = getattr(attn_metadata, "_blockdiff_num_causal_q", None)
        if ncq is None:
            causal = attn_metadata.causal
            B = attn_metadata.seq_lens.shape[0]
            if torch.is_tensor(causal):
                causal = causal[:B].to(torch.bool)
            else:
                causal = torch.full((B,), bool(causal), dtype=torch.bool, device=query.device)
            ncq = causal_row_counts(causal, attn_metadata.query_start_loc)
            try:
                attn_metadata._blockdiff_num_causal_q = ncq
            except (AttributeError, TypeError):  # a frozen / slotted metadata class: convert per layer
                pass
        left = self.sliding_window[0]
        out = output[:n].view(n, self.num_heads, self.head_size)
        attention(query[:n].view(n, self.num_heads, self.head_size), key_cache, value_cache,
                  cu_seqlens_q=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, num_causal_q=ncq,
                  block_table=attn_metadata.block_table, window_size=None if left < 0 else int(left),
                  bidirectional_window=self.bidirectional_window, scale=self.scale, out=out,
                  max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_seq_len,
                  backend=self.blockdiff_backend, check_values=False)
        return output


#: Largest head size per ``BLOCKDIFF_ATTN_BACKEND`` (the Triton kernels are tuned for 128 and 512; the CuTe backend
#: runs FA4's SM90 kernel up to 256 and its wide kernels above (the roles kernel at 512, the split-value kernel
#: elsewhere), multiples of 32 up to 512:
#: attention/cute/config.py ``unsupported_head_dims``).
MAX_HEAD_SIZE = {"triton": 512, "reference": 512, "cute": 512}
#: Model dtypes per ``BLOCKDIFF_ATTN_BACKEND`` (what :func:`blockdiff.attention.attention` runs: the CuTe kernel
#: bf16 / fp16 only, the Triton kernels and the reference float32 too).
DTYPES = {"triton": (torch.float16, torch.bfloat16, torch.float32),
          "reference": (torch.float16, torch.bfloat16, torch.float32),
          "cute": (torch.float16, torch.bfloat16)}


class BlockdiffAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention metadata builder without FA3's ahead-of-time scheduling (``aot_schedule``): blockdiff's
    kernel does not read ``scheduler_metadata``, and FA3's ``get_scheduler_metadata`` takes ``causal`` as a bool
    while a diffusion step's is a per-request tensor."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aot_schedule = False


class BlockdiffAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend (metadata, KV layout, KV write) with blockdiff's attention kernel."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return BlockdiffAttentionImpl

    @staticmethod
    def get_builder_cls():
        return BlockdiffAttentionMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Multiples of 8 up to :data:`MAX_HEAD_SIZE` of the ``BLOCKDIFF_ATTN_BACKEND`` backend, for the CuTe backend
        multiples of 32 above 256 (its wide kernels); vLLM's backend selector reports "head_size not
        supported" otherwise. Raises ValueError when ``BLOCKDIFF_ATTN_BACKEND`` names no backend (was: False for
        every head size, which vLLM reported as an unsupported head size)."""
        backend = attn_backend_from_env()  # an unknown value is a ValueError naming the variable, not "unsupported"
        limit = MAX_HEAD_SIZE[backend]
        if not (head_size % 8 == 0 and 0 < head_size <= limit):
            return False
        if backend == "cute":
            from blockdiff.attention.cute.config import unsupported_head_dims

            return unsupported_head_dims(head_size, head_size) is None
        return True

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """:data:`DTYPES` of the ``BLOCKDIFF_ATTN_BACKEND`` backend (FlashAttention's are bf16 / fp16 only, so
        ``--dtype float32`` would be refused: the float32 run is where a served greedy output can equal the
        harness's token for token, see ``bench/experiments/serve_smoke.py``). Raises ValueError as
        :meth:`supports_head_size`."""
        return dtype in DTYPES[attn_backend_from_env()]
