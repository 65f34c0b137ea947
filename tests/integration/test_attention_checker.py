"""integration.checks.AttentionChecker (``--check``): an ``out`` that aliases an input, nested checkers."""
from __future__ import annotations

import threading

import pytest
import torch

import blockdiff.attention as A
from blockdiff.integration.checks import AttentionChecker, AttentionMismatch


def _batch(T=6, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    kw = dict(cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, T], dtype=torch.int32), causal=torch.tensor([True]))
    return q, k, v, kw


def test_checker_checks_an_out_that_aliases_q_against_q_as_given():
    """The contract lets ``out`` alias an input; the checker compared the result with the reference of q after the
    backend overwrote it, a false AttentionMismatch for a right result."""
    q, k, v, kw = _batch()
    want = A.attention(q.clone(), k, v, backend="reference", **kw)
    with AttentionChecker() as c:
        o = A.attention(q, k, v, backend="reference", out=q, **kw)
    assert o.data_ptr() == q.data_ptr() and torch.allclose(o, want) and c.num_checked == 1


def test_checker_still_catches_a_wrong_result_written_into_an_aliased_out():
    q, k, v, kw = _batch()
    real = A.get_backend

    def wrong(name):
        fn = real(name)

        def run(q, k_cache, v_cache, **kw):
            res = fn(q, k_cache, v_cache, **kw)
            res.add_(1.0)
            return res
        return run

    A.get_backend = wrong
    try:
        with pytest.raises(AttentionMismatch), AttentionChecker():
            A.attention(q, k, v, backend="reference", out=q, **kw)
    finally:
        A.get_backend = real


def test_nested_attention_checkers_both_check_and_do_not_hang():
    """A checker inside another's ``with`` (e.g. around a check=True harness step) waited forever on the
    module's lock."""
    q, k, v, kw = _batch()
    real = A.get_backend
    done = []

    def nest():
        with AttentionChecker() as outer:
            with AttentionChecker() as inner:
                A.attention(q, k, v, backend="reference", **kw)
            A.attention(q, k, v, backend="reference", **kw)
        done.append((outer.num_checked, inner.num_checked))

    t = threading.Thread(target=nest, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "nested AttentionCheckers deadlocked"
    assert done == [(2, 1)] and A.get_backend is real


def test_entering_an_active_checker_again_is_an_error_and_restores_nothing_wrong():
    real = A.get_backend
    c = AttentionChecker()
    with c:
        with pytest.raises(RuntimeError, match="already active"):
            c.__enter__()
        assert A.get_backend is not real
    assert A.get_backend is real
