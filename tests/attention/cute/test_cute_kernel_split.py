"""GPU tests of the cute backend's split-KV kernels (blockdiff.attention.cute.kernel_split; merged by FA4's combine,
by name),
on the H200 (``python3 -m pytest -m gpu``): every split count against the fp64 reference and against one split,
empty splits (short sequences beside a long one; tiles narrowed by a window), rows past seq_lens, the automatic
count on a batch-1 canvas, and a CUDA-graph replay with changed metadata. The CPU side (split count from host
shapes, config validation) is in test_cute_config.py.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import interface as ca

from cute_helpers import gpu_batch, graph_replay_check, needs_gpu, rows_past_seq_lens_check, run_and_check

# (head_dim, q heads, KV heads, page or None, window, mode, base config, splits): the hd-128 canvas config (3
# stages; 3 splits: uneven chunks, empty splits of the short sequences), the split-value kernel at hd 512 (by name:
# the hd-512 default is the roles kernel, whose split-KV tests are in test_cute_kernel_roles.py), the sliding
# layers' hd 256 with a prefix window on contiguous K/V. One compile per case and count.
SPLIT_CASES = [
    (128, 16, 8, 64, None, "symmetric", dict(num_stages=3), 3),
    (512, 16, 2, 64, None, "symmetric", dict(wide_design="split_v"), 2),
    (256, 16, 8, None, 1023, "prefix", None, 2),
]


def _long_and_short_batch(hd, H, Hkv, page, seed):
    """A canvas over 6000 keys (many blocks per split), a commit over 700 (short: later splits empty) and a
    one-token causal sequence, one launch."""
    return gpu_batch([256, 256, 1], [6000, 700, 40], [0, 256, 1], H, Hkv, hd, page or 64, seed=seed,
                     contiguous=page is None)


@needs_gpu
@pytest.mark.parametrize("hd,H,Hkv,page,window,mode,base,num_splits", SPLIT_CASES)
def test_gpu_every_split_count_matches_one_split_and_the_reference(hd, H, Hkv, page, window, mode, base,
                                                                   num_splits):
    """Any split count gives the one-split result up to the fp32 rounding of the merge (then bf16): within 2
    bf16 ulps of it, and within the tolerance rule of the reference (output and LSE), NaN-poisoned output."""
    q, k, v, kw = _long_and_short_batch(hd, H, Hkv, page, seed=hd + num_splits)
    one = ca.attention_cute(q, k, v, window_size=window, bidirectional_window=mode, max_seqlen_q=256,
                            return_lse=True, config=dict(base or {}, num_splits=1), **kw)
    # FA4's combine merge by name: "auto" (the default) would take the cluster merge at 2 splits
    cfg = dict(base or {}, num_splits=num_splits, split_merge="combine")
    run_and_check(q, k, v, kw, window, mode, config=cfg, max_seqlen_q=256)
    assert ca.LAST_LAUNCH["config"].num_splits == num_splits and ca.LAST_LAUNCH["kernel"].endswith("Split")
    split = ca.attention_cute(q, k, v, window_size=window, bidirectional_window=mode, max_seqlen_q=256,
                              return_lse=True, config=cfg, **kw)
    torch.testing.assert_close(split[0].float(), one[0].float(), atol=2 ** -6, rtol=2 ** -7)
    torch.testing.assert_close(split[1], one[1], atol=1e-4, rtol=1e-5)


@needs_gpu
def test_gpu_batch_1_canvas_over_a_long_context_splits_automatically():
    """hd 512, one canvas over 20k keys: 64 tiles take 2 splits (config.choose_num_splits), checked (the default
    kernel there: the roles kernel's split-KV variant)."""
    q, k, v, kw = gpu_batch([256], [20000], [0], 16, 2, 512, 64, seed=1)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=256, max_seqlen_k=20256)
    assert ca.LAST_LAUNCH["config"].num_splits == 2
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90RolesSplit"


@needs_gpu
@pytest.mark.parametrize("page", [64, 48])
def test_gpu_split_rows_past_seq_lens_stay_out(page):
    """NaN after each sequence's last key: splits ending there (page boxes; cp.async at 48) keep it out."""
    q, k, v, kw = _long_and_short_batch(128, 16, 8, page, seed=page)
    cfg = dict(num_stages=3, num_splits=3)
    rows_past_seq_lens_check(q, k, v, kw, page, cfg)


@needs_gpu
def test_gpu_split_cuda_graph_replay_with_metadata_changed_in_place():
    """Three splits captured once (workspace and merge inside the graph), replayed with other lengths, causal
    row counts and a permuted block table: every replay matches the reference."""
    steps = [([256, 256], [6000, 100], [0, 256], 1), ([256, 256], [300, 6100], [100, 0], 2)]
    graph_replay_check(steps, H=16, Hkv=8, D=128, page=64, B=2, cap_q=512, max_blocks=100, max_seqlen_q=256,
                       config=dict(num_stages=3, num_splits=3))


@needs_gpu
@pytest.mark.parametrize("merge,num_splits", [("combine", 2), ("cluster", 2), ("triton", 3)])
@pytest.mark.parametrize("hd", [72, 40])
def test_gpu_split_kv_at_a_padded_head_dim_leaves_the_next_heads_columns_alone(hd, merge, num_splits):
    """Head dims that are multiples of 8 but not of 16 (FA4 pads the tile to 80 / 48 columns): the split workspace
    write and the cluster merge write only a row's own ``head_dim_v`` columns. Until 2026-12-05 they wrote the padded
    columns into the next query head's first 8 columns (the last head's past the row), racing with that head's own
    write (found by the review of docs/tuning.md 2.34). Into a NaN-poisoned ``out``, contiguous K / V (FA4's
    cp.async paged path refuses such head dims; paged TMA boxes at them have no GPU test yet): the reference's output
    and LSE."""
    from blockdiff.attention import attention
    from blockdiff.attention.testing import check_close, make_batch
    inp = make_batch([1300, 700], [256, 64], num_causal_q=[0, 64], num_heads=8, num_kv_heads=2, head_dim=hd,
                     paged=False, device="cuda", seed=hd)
    q = inp["q"]
    out = torch.full((q.shape[0], q.shape[1], hd), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="cute",
                       config=dict(num_splits=num_splits, split_merge=merge), max_seqlen_q=256)
    assert ca.LAST_LAUNCH["config"].num_splits == num_splits
    check_close(o, **inp, lse=lse)
