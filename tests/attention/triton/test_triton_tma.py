"""Host side of the Gluon kernels' TMA loads (attention/triton/tma.py): eligibility rules, box rows, the cached
descriptors."""
import gc
import weakref

import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.triton import tma

from triton_helpers import GLUON, make_batch


def test_gluon_on_a_cpu_tensor_is_a_clear_error_not_a_fallback():
    inp = make_batch([9, 5], [4, 5], causal=[False, True], head_dim=64, page_size=64, device="cpu")
    with pytest.raises(ValueError, match="IMPL.*gluon.*CUDA"):
        attention(**inp, backend="triton", config=GLUON)


def test_layout_rules_name_what_tma_needs():
    kc = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
    assert tma.layout_ineligible(kc, kc, paged=True, page_size=64, block_n=64) is None
    assert tma.layout_ineligible(kc, kc, paged=True, page_size=64, block_n=128) is None  # two pages, two boxes
    assert tma.tma_box_rows(True, 64, 128) == 64 and tma.tma_box_rows(True, 256, 128) == 128
    assert tma.tma_box_rows(False, None, 128) == 128
    for page in (4, 12, 48):  # not a multiple of 8 (swizzle atom), or neither divides the other
        kp = torch.zeros(4, page, 2, 128, dtype=torch.bfloat16)
        assert "BLOCK_N" in tma.layout_ineligible(kp, kp, paged=True, page_size=page, block_n=64)
    both = torch.zeros(4, 2, 64, 2, 128, dtype=torch.bfloat16)  # [blocks, K/V, page, heads, dim]: pages strided
    assert "stride(0)" in tma.layout_ineligible(both[:, 0], both[:, 1], paged=True, page_size=64, block_n=64)
    heads_strided = torch.zeros(4, 64, 128, 4, dtype=torch.bfloat16).transpose(2, 3)[..., :2, :]
    assert "contiguous" in tma.layout_ineligible(heads_strided, heads_strided, paged=True, page_size=64, block_n=64)
    flat = torch.zeros(100, 2, 128, dtype=torch.bfloat16)
    assert tma.layout_ineligible(flat, flat, paged=False, page_size=None, block_n=128) is None


def test_vllm_packed_kv_layout_runs_on_tma_with_a_head_column_stride():
    """vLLM's FlashAttention layout packs a token's K and V of one head into one row [num_kv_heads, 2 * head_dim]
    (K and V are views split off the last dim, stride(-2) = 2 * head_dim). It was refused ("contiguous
    [num_kv_heads, head_dim] rows"), so every serving call ran the portable kernel. KV head h is the column range
    [h * stride(-2), h * stride(-2) + head_dim) of a [rows, row_width] TMA tensor; overlapping heads stay refused."""
    kv = torch.zeros(4, 64, 2, 2 * 128, dtype=torch.bfloat16)  # vLLM NHD: [blocks, page, kv heads, 2 * head_dim]
    k, v = kv.split(128, dim=-1)
    assert tma.layout_ineligible(k, v, paged=True, page_size=64, block_n=64) is None
    assert tma.row_width(k) == 128 + 256 and tma.row_width(torch.zeros(4, 64, 2, 128)) == 256
    kd, vd = tma.make_kv_descriptors(k, v, 64)
    assert kd.shape == [256, 384] and kd.strides == [512, 1] and kd.block_shape == [64, 128]
    assert vd.base.data_ptr() == kv.data_ptr() + 128 * 2 and vd.shape == [256, 384]
    one_head = torch.zeros(4, 64, 1, 2 * 128, dtype=torch.bfloat16).split(128, dim=-1)
    assert tma.layout_ineligible(*one_head, paged=True, page_size=64, block_n=64) is None
    overlap = torch.zeros(4, 64, 384, dtype=torch.bfloat16).as_strided((4, 64, 2, 128), (64 * 384, 384, 64, 1))
    assert "non-overlapping KV heads" in tma.layout_ineligible(overlap, overlap, paged=True, page_size=64,
                                                                block_n=64)
    odd = torch.zeros(4, 64, 2, 128 + 4, dtype=torch.bfloat16)[..., :128]  # head stride 264 bytes: not 16-aligned
    assert "16-byte aligned" in tma.layout_ineligible(odd, odd, paged=True, page_size=64, block_n=64)


def test_cached_kv_descriptors_are_reused_and_do_not_keep_the_cache_alive():
    kc = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    first = tma.make_kv_descriptors(kc, vc, 64)
    assert tma.make_kv_descriptors(kc, vc, 64) is first
    assert tma.make_kv_descriptors(kc, vc, 32) is not first  # the box rows are part of the key
    assert first[0].base.data_ptr() == kc.data_ptr() and first[1].base.data_ptr() == vc.data_ptr()
    assert first[0].shape == [256, 256] and first[0].strides == [256, 1] and first[0].block_shape == [64, 128]
    ref = weakref.ref(kc)
    del kc, vc
    gc.collect()
    assert ref() is None
