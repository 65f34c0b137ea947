"""Compile cache of the ``"cute"`` backend: compiled kernels by compile key, in memory, and on disk when
FlashAttention-4's persistent cache is on (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, folder
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, default ``$TMPDIR/$USER/flash_attention_cute_dsl_cache``).

A CuTe DSL compile of one of this backend's kernels takes seconds (docs/tuning.md 7.10); a
server restarted, or a second process (test shards, a second server), loads the exported object from disk
instead. The disk cache is FA4's ``JITPersistentCache`` (ahead-of-time export of the tvm-ffi compiled function,
file locks, an unloadable entry counts as a miss and is recompiled); its folder is namespaced by FA4's own source
fingerprint (FA4's sources, the CuTe DSL and tvm-ffi versions) and, here, by :func:`source_fingerprint` of this
package's kernel sources, so that any change to a kernel, its config or this backend's interface compiles afresh.
Without the variable (or without flash-attn-4) the cache is an in-memory dict.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["source_fingerprint", "make_compile_cache"]

_HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """SHA-256 (hex) over the names and bytes of this backend's ``*.py`` sources (sorted), the compile key's
    meaning and the kernels' code: a cached kernel is reused only by the sources that compiled it."""
    h = hashlib.sha256()
    for src in sorted(_HERE.glob("*.py")):
        h.update(src.name.encode())
        data = src.read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def make_compile_cache():
    """The backend's compile cache: FA4's ``get_jit_cache`` under ``blockdiff_<fingerprint[:16]>`` (on disk when
    ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, else in memory). Supports ``key in cache``, ``cache[key]``
    and ``cache[key] = compiled``; keys must pickle (the disk cache hashes ``pickle.dumps(key)``).

    Raises:
        ImportError: flash-attn-4 is not installed (the backend's callers import it first).
    """
    from flash_attn.cute.cache_utils import get_jit_cache  # optional dependency, imported with the backend

    return get_jit_cache(f"blockdiff_{source_fingerprint()[:16]}")
