"""Named ranges of the plugin's host work in a torch-profiler trace (``blockdiff:<hook>``), so that a serving
profile can attribute the GPU's idle time to the hook the host was in (``blockdiff.bench.bench_serve``'s
``attribute_idle_gaps``). With no profiler running, a decorated call costs one flag check.
"""
from __future__ import annotations

import functools
import threading
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


#: Profiler ranges of Triton compiles in flight, per thread (record_function ranges are thread-local): the
#: pre-compile hook opens one, the post-compile hook closes it.
_LOCAL = threading.local()


def _open_compiles() -> list:
    if not hasattr(_LOCAL, "open"):
        _LOCAL.open = []
    return _LOCAL.open


def _close_open_compiles() -> None:
    stack = _open_compiles()
    while stack:
        rf = stack.pop()
        if rf is not None:
            rf.__exit__(None, None, None)


def install_triton_compile_ranges() -> bool:
    """Name every Triton JIT compile of this process in a torch-profiler trace: ``triton_compile:<kernel>``.

    A serving profile's GPU idle gaps were first-use compiles that only their length told apart (docs/tuning.md
    7.10). Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles a kernel missing from its in-memory
    cache and ``jit_post_compile_hook`` after; the two open and close the range while a profiler records, so a
    launch of an already compiled kernel pays nothing. Hooks installed before are kept and called first (pre) /
    last (post); a pre-hook that answers True (skip the compile) is honoured. Idempotent. Ranges are per thread.

    Limits: a compile that raises (or fails inside an autotuner's benchmark loop) gets no post-hook, so its range
    stays open until the thread's next compile (it then also covers the work between); Triton's asynchronous
    compile mode calls the post-hook later (neither torch nor vLLM uses it); a hook installed later without
    chaining (torch's NVSHMEM helpers replace ``jit_post_compile_hook``) leaves ranges open until the next compile.
    With any hook set, Triton serializes each compile's specialization to JSON before calling it, which fails for
    a kernel taking a ``@triton.jit`` function as a constexpr: install only in processes that are profiled.

    Returns:
        True when the hooks are installed (now or before), False without Triton (``triton.knobs``, Triton >= 3.4).
    """
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = knobs.runtime
    if getattr(rt.jit_cache_hook, "_blockdiff_compile_range", False):
        return True
    prev_pre, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook

    def pre(*, fn, **kw):
        if prev_pre is not None and prev_pre(fn=fn, **kw):
            return True  # an earlier hook skips this compile: no range
        _close_open_compiles()
        rf = None
        if torch.autograd.profiler._is_profiler_enabled:
            rf = torch.profiler.record_function(f"triton_compile:{getattr(fn, 'name', fn)}")
            rf.__enter__()
        _open_compiles().append(rf)
        return None

    def post(*, fn, **kw):
        _close_open_compiles()
        if prev_post is not None:
            return prev_post(fn=fn, **kw)
        return None

    pre._blockdiff_compile_range = True  # type: ignore[attr-defined]
    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
    return True
