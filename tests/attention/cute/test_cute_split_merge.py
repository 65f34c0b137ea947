"""The cute backend's split-KV merges on the H200 (GPU only): ``split_merge="triton"`` (the shared Triton merge,
:mod:`blockdiff.attention.split_merge`) against the reference and the tolerance rule, every head-dim family and
both KV layouts, and the behaviour FA4's combine kernel misses (docs/tuning.md 2.33): a non-finite V entry of a key
a row sees, in a split whose weight underflows to 0, reaches the output as in the dense reference (``0 * NaN``),
as it does at one split and through the cluster merge. The CPU side (the merge kernel under the interpreter, the
triton backend's whole calls) is tests/attention/test_split_merge.py."""
import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.cute import interface as ca

from cute_helpers import check_nonfinite_v, gpu_batch, needs_gpu, nonfinite_cases, run_and_check


def _underflow_batch(head_dim, paged, S=1024):
    """One bidirectional sequence of 4 query tokens over S keys (2 query heads on 1 KV head): key 5 scores 512 (scale
    8 x 64) and every other key 0, so key 900, which every row sees, has softmax weight exp(-512) = 0 in fp32; its V
    holds NaN at column 3, +Inf at 4 and -Inf at 5. The reference: those three columns NaN in every row (p * v with
    p = 0), the rest finite."""
    H, Hk, Lq = 2, 1, 4
    dev = "cuda"
    q = torch.zeros(Lq, H, head_dim, dtype=torch.bfloat16, device=dev)
    q[:, :, 0] = 1.0
    k = torch.zeros(S, Hk, head_dim, dtype=torch.bfloat16, device=dev)
    k[5, :, 0] = 64.0
    v = torch.randn(S, Hk, head_dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
    v[900, 0, 3], v[900, 0, 4], v[900, 0, 5] = float("nan"), float("inf"), float("-inf")
    kw = dict(cu_seqlens_q=torch.tensor([0, Lq], dtype=torch.int32, device=dev),
              seq_lens=torch.tensor([S], dtype=torch.int32, device=dev), causal=torch.tensor([False], device=dev),
              scale=8.0)
    if paged:
        page = 64
        perm = torch.randperm(S // page, generator=torch.Generator().manual_seed(2))
        kp = torch.empty(S // page, page, Hk, head_dim, dtype=k.dtype, device=dev)
        vp = torch.empty_like(kp)
        kp[perm] = k.view(S // page, page, Hk, head_dim)
        vp[perm] = v.view(S // page, page, Hk, head_dim)
        kw["block_table"] = perm.to(torch.int32).to(dev)[None]
        return q, kp, vp, kw
    kw["cu_seqlens_k"] = torch.tensor([0, S], dtype=torch.int32, device=dev)
    return q, k, v, kw


_FA4_COMBINE_SKIPS = pytest.mark.xfail(
    strict=True, reason="FA4's combine kernel skips a split whose weight is 0 (flash_fwd_combine.py: scale > 0), "
    "dropping its non-finite entries; split_merge='triton' is the fix (docs/tuning.md 2.33)")


@needs_gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("split_merge,num_splits", [
    ("triton", 2), ("triton", 4), ("cluster", 2), (None, 1),
    pytest.param("combine", 2, marks=_FA4_COMBINE_SKIPS), pytest.param("combine", 4, marks=_FA4_COMBINE_SKIPS)])
def test_gpu_cute_nonfinite_v_of_a_seen_key_with_an_underflowing_split_weight_reaches_the_output(
        paged, head_dim, split_merge, num_splits):
    q, k, v, kw = _underflow_batch(head_dim, paged)
    ref = attention(q.cpu(), k.cpu(), v.cpu(), backend="reference",
                    **{n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
    assert ref[..., 3:6].isnan().all() and ref[..., 6:].isfinite().all()
    config = {"num_splits": num_splits} if split_merge is None else {"num_splits": num_splits,
                                                                      "split_merge": split_merge}
    out = torch.full((q.shape[0], q.shape[1], head_dim), float("nan"), dtype=q.dtype, device=q.device)
    out = attention(q, k, v, backend="cute", out=out, config=config, **kw)
    cfg = ca.LAST_LAUNCH["config"]
    assert cfg.num_splits == num_splits and (split_merge is None or cfg.split_merge == split_merge)
    out = out.cpu()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out[ref.isfinite()].float(), ref[ref.isfinite()].float(), atol=2e-2, rtol=2e-2)


@needs_gpu
@pytest.mark.parametrize("contiguous", [False, True], ids=["paged64", "contiguous"])
@pytest.mark.parametrize("D,H,Hkv,num_splits,window", [
    (128, 16, 8, 4, None), (256, 16, 8, 2, 1023), (256, 16, 8, 3, None), (512, 16, 2, 2, None),
    (512, 16, 2, 3, None)])
def test_gpu_cute_triton_merge_matches_the_reference_on_canvases_over_context(contiguous, D, H, Hkv, num_splits,
                                                                               window):
    """Two canvases and a commit over contexts of 3-6k keys (a sequence shorter than a split's share included),
    every head-dim family (hd 512: the roles kernel paged, the split-value kernel contiguous), the output and the
    LSE within the tolerance rule, every element written (NaN-poisoned ``out``)."""
    q, k, v, kw = gpu_batch([256, 256, 256], [6000, 3000, 64], [0, 0, 256], H, Hkv, D, 64, seed=D + num_splits,
                            contiguous=contiguous)
    run_and_check(q, k, v, kw, window, "symmetric", config={"num_splits": num_splits, "split_merge": "triton"})
    assert ca.LAST_LAUNCH["config"].split_merge == "triton"


@needs_gpu
@pytest.mark.parametrize("D,H,Hkv", [(128, 16, 8), (256, 16, 8)])
def test_gpu_cute_triton_merge_keeps_the_nan_safe_v_contract(D, H, Hkv):
    """NaN / +-Inf V entries inside seq_lens (the issue-26 cases) with 3 splits merged by the Triton merge: exactly
    the reference's non-finite entries, the rest within the tolerance rule."""
    inp = nonfinite_cases(D, H, Hkv, 64, seed=7)
    check_nonfinite_v(inp, {"num_splits": 3, "split_merge": "triton"}, seed=7)
    assert ca.LAST_LAUNCH["config"].split_merge == "triton"
