"""Named ranges of the plugin's host work in a torch-profiler trace (``blockdiff:<hook>``), so that a serving
profile can attribute the GPU's idle time to the hook the host was in (``blockdiff.bench.bench_serve``'s
``attribute_idle_gaps``). With no profiler running, a decorated call costs one flag check.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def profiling() -> bool:
    """True while a torch profiler records (the autograd profiler's flag; a C call, no allocation)."""
    return torch.autograd.profiler._is_profiler_enabled


def annotated(label: str) -> Callable[[F], F]:
    """Decorator: run the function inside ``torch.profiler.record_function(label)`` while a profiler records.

    Args:
        label: the range's name in the trace, ``blockdiff:<hook>`` by convention.

    Raises:
        TypeError: ``label`` is not a non-empty str.
    """
    if not isinstance(label, str) or not label:
        raise TypeError(f"label must be a non-empty str, got {label!r}")

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not torch.autograd.profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
