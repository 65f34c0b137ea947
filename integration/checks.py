"""``--check`` support: compare every attention call of a forward pass with the dense reference.

:class:`AttentionChecker` is a context manager. Inside it, every call that goes through
:func:`blockdiff.attention.attention` (the dispatcher the model uses) runs the chosen backend and then
:func:`blockdiff.attention.testing.check_close` on the same inputs (fp64 oracle; tolerance 2x the
same-precision eager error of the element's sequence plus a representation tolerance, FlashAttention-4's rule). A
mismatch raises :class:`AttentionMismatch`. Implementation: the dispatcher resolves its backend through the
module-level ``blockdiff.attention.get_backend``; the checker wraps that function for the duration of the ``with``
block and restores it afterwards.

A call whose ``out`` aliases one of its inputs (the contract allows it: docs/ARCHITECTURE.md section 4, "Arguments")
is checked against copies of the inputs taken before the backend overwrote them. Checkers nest (one thread at a time:
another thread's ``with`` waits): each active checker checks and counts every call; entering a checker that is
already active is a ``RuntimeError``.
"""
from __future__ import annotations

import threading

import torch

import blockdiff.attention as A
from blockdiff.attention.testing import check_close
from blockdiff.attention.validate import memory_overlaps


class AttentionMismatch(AssertionError):
    """An attention backend disagreed with the reference (``--check``)."""


_lock = threading.RLock()  # re-entrant: a checker inside another's ``with`` (e.g. around a check=True harness)


class AttentionChecker:
    """Counts and checks attention calls made while active.

    Attributes:
        num_checked: attention calls compared so far.
        max_err: largest max-abs error seen (against the fp64 oracle).
    """

    def __init__(self) -> None:
        self.num_checked = 0
        self.max_err = 0.0
        self._saved = None

    def _wrap(self, get_backend):
        checker = self

        def checked_get_backend(backend):
            fn = get_backend(backend)

            def checked(q, k_cache, v_cache, **kw):
                given = (q, k_cache, v_cache)
                out_arg = kw.get("out")
                if isinstance(out_arg, torch.Tensor):  # out may alias an input (the contract allows it): keep a
                    # copy of each input it overlaps, as given, for the reference
                    given = tuple(x.clone() if isinstance(x, torch.Tensor) and memory_overlaps(out_arg, x) else x
                                  for x in given)
                res = fn(q, k_cache, v_cache, **kw)
                out, lse = (res if isinstance(res, tuple) else (res, None))
                ckw = {k: v for k, v in kw.items() if k not in ("out", "return_lse", "config", "check_values")}
                try:
                    stats = check_close(out, *given, lse=lse, **ckw)
                except AssertionError as e:
                    raise AttentionMismatch(
                        f"attention check failed (backend {backend!r}, call {checker.num_checked + 1}, "
                        f"q {tuple(q.shape)}, window_size={kw.get('window_size')}): {e}") from e
                checker.num_checked += 1
                checker.max_err = max(checker.max_err, stats["err"])
                return res

            return checked

        return checked_get_backend

    def __enter__(self) -> "AttentionChecker":
        _lock.acquire()
        if self._saved is not None:  # (re-entering one checker would check every call twice and, on the inner
            _lock.release()          # exit, restore its own wrapper instead of the original get_backend)
            raise RuntimeError("this AttentionChecker is already active: use a new one to nest")
        self._saved = A.get_backend
        A.get_backend = self._wrap(self._saved)
        return self

    def __exit__(self, *exc) -> None:
        A.get_backend = self._saved
        self._saved = None
        _lock.release()
