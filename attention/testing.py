"""Tolerance rule shared by every backend's tests and by ``blockdiff demo --check``.

A backend output is accepted when its error against the high-precision oracle (fp64 on the same inputs) is at
most ``2 x`` the error of the same-precision eager PyTorch computation plus a representation tolerance
(FlashAttention-4's test rule). Non-finite values never pass. Elements where the eager baseline itself overflows
(fp16 scores beyond 65504) are compared as if eager had returned the oracle rounded to the dtype.
"""
from __future__ import annotations

import torch

from .reference import attention_reference

REPRESENTATION_ATOL = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6,
                       torch.float64: 1e-12}


def _to64(x):
    return None if x is None else x.to(torch.float64)


def reference_pair(q, k_cache, v_cache, **kw):
    """``(oracle_out, oracle_lse, eager_out)``: fp64 oracle and same-precision eager reference."""
    kw = {k: v for k, v in kw.items() if k not in ("out", "return_lse", "upcast")}
    o64, lse64 = attention_reference(_to64(q), _to64(k_cache), _to64(v_cache), return_lse=True, **kw)
    eager = attention_reference(q, k_cache, v_cache, upcast=False, **kw)
    return o64, lse64, eager


def check_close(out, q, k_cache, v_cache, *, lse=None, factor: float = 2.0, **kw) -> dict:
    """Assert ``out`` (and ``lse``) match the oracle within the tolerance rule; return the error numbers.

    Raises:
        AssertionError: non-finite output, or error above ``factor * eager_err + representation atol``.
    """
    assert torch.isfinite(out).all(), "output has non-finite values (unwritten or NaN)"
    o64, lse64, eager = reference_pair(q, k_cache, v_cache, **kw)
    atol = REPRESENTATION_ATOL[q.dtype]
    err = (out.to(torch.float64) - o64).abs().max().item() if out.numel() else 0.0
    # Where the eager baseline overflows (fp16 QK^T beyond 65504, e.g. scale 1.0 with large head_dim) its error
    # is undefined (NaN would reject every backend): count those elements as the oracle rounded to the dtype.
    eager = torch.where(torch.isfinite(eager), eager, o64.to(eager.dtype))
    eager_err = (eager.to(torch.float64) - o64).abs().max().item() if out.numel() else 0.0
    bound = factor * eager_err + atol
    assert err <= bound, f"max abs error {err:.3e} > {factor} x eager {eager_err:.3e} + atol {atol:.1e}"
    res = {"err": err, "eager_err": eager_err, "bound": bound}
    if lse is not None:
        l64 = lse64.to(torch.float64)
        fin = torch.isfinite(l64)
        assert torch.equal(torch.isfinite(lse), fin), "lse finiteness differs from the oracle (-inf = no key)"
        lerr = (lse.to(torch.float64)[fin] - l64[fin]).abs().max().item() if fin.any() else 0.0
        assert lerr <= 1e-2 if q.dtype in (torch.bfloat16, torch.float16) else lerr <= 1e-4, f"lse error {lerr}"
        res["lse_err"] = lerr
    return res
