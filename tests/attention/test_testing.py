"""The shared tolerance rule (attention/testing.py)."""
import torch

from blockdiff.attention import attention
from blockdiff.attention.testing import check_close


def test_tolerance_defined_when_eager_fp16_scores_overflow():
    """scale 1.0, head_dim 256, large fp16 q/k: eager fp16 QK^T overflows to inf (eager output NaN); an exact
    output must still pass (the bound was NaN, rejecting every backend) and a wrong one must still fail."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(6, 2, 256, generator=g) * 40).half()
    k = (torch.randn(6, 1, 256, generator=g) * 40).half()
    v = torch.randn(6, 1, 256, generator=g).half()
    kw = dict(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32),
              causal=torch.tensor([False]), scale=1.0)
    assert not torch.isfinite(attention(q, k, v, backend="reference", upcast=False, **kw)).all()
    out, lse = attention(q, k, v, backend="reference", return_lse=True, **kw)
    check_close(out, q, k, v, lse=lse, **kw)
    wrong = out.clone()
    wrong[0, 0, 0] += 0.5
    try:
        check_close(wrong, q, k, v, **kw)
    except AssertionError:
        pass
    else:
        raise AssertionError("a wrong output passed")
