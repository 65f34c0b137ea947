"""GPU tests of the cute backend's one-launch split-KV merge (``split_merge="cluster"``,
blockdiff.attention.cute.kernel_cluster: the splits of a query tile as a thread-block cluster reducing through
distributed shared memory), on the H200 (``python3 -m pytest -m gpu``), mirroring test_cute_kernel_split.py:
split counts 2..8 against the fp64 reference, against one split and against FA4's combine merge; empty splits
(short sequences beside a long one, windows); paged and contiguous K/V; LSE returned or not; rows past seq_lens;
the automatic count; a CUDA-graph replay with changed metadata. The CPU side (field validation, the cap at 8, the
shared-memory fit) is in test_cute_config.py.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import interface as ca

from cute_helpers import gpu_batch, graph_replay_check, needs_gpu, rows_past_seq_lens_check, run_and_check

CLUSTER = dict(split_merge="cluster")

# (head_dim, q heads, KV heads, page or None, window, mode, base config, splits): every count 2..8 once, each head
# dim on both KV layouts, both window modes. One compile per case (and one per base config for one split).
CLUSTER_CASES = [
    (128, 16, 8, 64, None, "symmetric", dict(num_stages=3), 2),
    (128, 16, 8, 64, None, "symmetric", dict(num_stages=3), 3),
    (128, 16, 8, 64, None, "symmetric", dict(num_stages=3), 5),
    (128, 16, 8, 64, None, "symmetric", dict(num_stages=3), 8),
    (128, 16, 8, None, None, "symmetric", None, 4),
    (128, 16, 8, None, 300, "symmetric", None, 7),
    (256, 16, 8, None, 1023, "prefix", None, 2),
    (256, 16, 8, 64, 1023, "symmetric", None, 6),
    (512, 16, 2, 64, None, "symmetric", None, 2),
    (512, 16, 2, None, None, "symmetric", None, 3),
    (512, 16, 2, 64, 1023, "symmetric", None, 4),
]


def _long_and_short_batch(hd, H, Hkv, page, seed):
    """A canvas over 6000 keys (many blocks per split), a commit over 700 (short: later splits empty) and a
    one-token causal sequence, one launch."""
    return gpu_batch([256, 256, 1], [6000, 700, 40], [0, 256, 1], H, Hkv, hd, page or 64, seed=seed,
                     contiguous=page is None)


@needs_gpu
@pytest.mark.parametrize("hd,H,Hkv,page,window,mode,base,num_splits", CLUSTER_CASES)
def test_gpu_cluster_merge_matches_one_split_the_combine_merge_and_the_reference(hd, H, Hkv, page, window, mode,
                                                                                base, num_splits):
    """Any split count merged in the cluster gives the one-split result up to the fp32 rounding of the merge
    (then bf16), and FA4's combine result likewise; within the tolerance rule of the reference (output and LSE,
    NaN-poisoned output: every element written)."""
    q, k, v, kw = _long_and_short_batch(hd, H, Hkv, page, seed=hd + num_splits)
    call = dict(window_size=window, bidirectional_window=mode, max_seqlen_q=256, return_lse=True, **kw)
    one = ca.attention_cute(q, k, v, config=dict(base or {}, num_splits=1), **call)
    cfg = dict(base or {}, num_splits=num_splits, **CLUSTER)
    run_and_check(q, k, v, kw, window, mode, config=cfg, max_seqlen_q=256)
    assert ca.LAST_LAUNCH["config"].num_splits == num_splits and ca.LAST_LAUNCH["kernel"].endswith("Cluster")
    cluster = ca.attention_cute(q, k, v, config=cfg, **call)
    combine = ca.attention_cute(q, k, v, config=dict(base or {}, num_splits=num_splits, split_merge="combine"),
                                **call)
    assert ca.LAST_LAUNCH["kernel"].endswith("Split")
    for other in (one, combine):
        torch.testing.assert_close(cluster[0].float(), other[0].float(), atol=2 ** -6, rtol=2 ** -7)
        torch.testing.assert_close(cluster[1], other[1], atol=1e-4, rtol=1e-5)


@needs_gpu
@pytest.mark.parametrize("hd,H,Hkv,page", [(128, 16, 8, 64), (512, 16, 2, None)])
def test_gpu_cluster_merge_without_lse(hd, H, Hkv, page):
    """Built without the LSE output (another compile): the output as with it."""
    q, k, v, kw = _long_and_short_batch(hd, H, Hkv, page, seed=7)
    cfg = dict(num_splits=3, **CLUSTER)
    run_and_check(q, k, v, kw, None, "symmetric", return_lse=False, config=cfg, max_seqlen_q=256)
    with_lse = ca.attention_cute(q, k, v, max_seqlen_q=256, return_lse=True, config=cfg, **kw)[0]
    without = ca.attention_cute(q, k, v, max_seqlen_q=256, config=cfg, **kw)
    assert torch.equal(with_lse, without)


@needs_gpu
def test_gpu_cluster_merge_windows_leave_splits_empty():
    """A symmetric window of 100 keys over a 6000-key canvas: most of the 8 splits of a tile have no block (they
    join the merge with weight 0); the causal and short sequences beside it too."""
    q, k, v, kw = _long_and_short_batch(128, 16, 8, 64, seed=3)
    run_and_check(q, k, v, kw, 100, "symmetric", config=dict(num_splits=8, **CLUSTER), max_seqlen_q=256)
    run_and_check(q, k, v, kw, 100, "prefix", config=dict(num_splits=8, **CLUSTER), max_seqlen_q=256)


@needs_gpu
def test_gpu_cluster_merge_splits_a_batch_1_canvas_automatically():
    """Only the switch set: hd 512, one canvas over 20k keys takes the automatic 2 splits and the cluster
    kernel; hd 128 over 32k keys 4 splits (the cap of 8 not reached)."""
    q, k, v, kw = gpu_batch([256], [20000], [0], 16, 2, 512, 64, seed=1)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=256, max_seqlen_k=20256, config=CLUSTER)
    assert ca.LAST_LAUNCH["config"].num_splits == 2 and ca.LAST_LAUNCH["kernel"].endswith("Cluster")
    q, k, v, kw = gpu_batch([256], [32768], [0], 16, 8, 128, 64, seed=2)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=256, max_seqlen_k=33024, config=CLUSTER)
    assert ca.LAST_LAUNCH["config"].num_splits == 4 and ca.LAST_LAUNCH["kernel"].endswith("Cluster")


@needs_gpu
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_gpu_default_auto_merge_runs_the_cluster_on_a_batch_1_sliding_canvas(mode):
    """No config: hd 256, window 1023, one canvas over 8k keys takes 2 splits and split_merge "auto" resolves to
    the cluster merge (config.auto_split_merge); the hd-512 canvas takes the shared Triton merge (docs/tuning.md
    2.35). Both checked against the reference."""
    q, k, v, kw = gpu_batch([256], [8192], [0], 16, 8, 256, 64, seed=3)
    run_and_check(q, k, v, kw, 1023, mode, max_seqlen_q=256, max_seqlen_k=8448)
    assert ca.LAST_LAUNCH["config"].num_splits == 2 and ca.LAST_LAUNCH["kernel"].endswith("Cluster")
    q, k, v, kw = gpu_batch([256], [20000], [0], 16, 2, 512, 64, seed=4)
    run_and_check(q, k, v, kw, None, mode, max_seqlen_q=256, max_seqlen_k=20256)
    assert ca.LAST_LAUNCH["config"].num_splits == 2 and ca.LAST_LAUNCH["kernel"].endswith("Split")
    assert ca.LAST_LAUNCH["config"].split_merge == "triton"


@needs_gpu
@pytest.mark.parametrize("page", [64, 48])
def test_gpu_cluster_rows_past_seq_lens_stay_out(page):
    """NaN after each sequence's last key: splits ending there (page boxes; cp.async at 48) keep it out."""
    q, k, v, kw = _long_and_short_batch(128, 16, 8, page, seed=page)
    cfg = dict(num_stages=3, num_splits=3, **CLUSTER)
    rows_past_seq_lens_check(q, k, v, kw, page, cfg)


@needs_gpu
@pytest.mark.parametrize("num_splits", [3, 8])
def test_gpu_cluster_cuda_graph_replay_with_metadata_changed_in_place(num_splits):
    """The cluster kernel captured once (no workspace, no second launch), replayed with other lengths, causal
    row counts and a permuted block table: every replay matches the reference."""
    steps = [([256, 256], [6000, 100], [0, 256], 1), ([256, 256], [300, 6100], [100, 0], 2)]
    graph_replay_check(steps, H=16, Hkv=8, D=128, page=64, B=2, cap_q=512, max_blocks=100, max_seqlen_q=256,
                       config=dict(num_stages=3, num_splits=num_splits, **CLUSTER))
