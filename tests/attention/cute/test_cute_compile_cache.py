"""attention/cute/compile_cache.py: the backend's compile cache is FA4's persistent JIT cache (on disk when
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1), namespaced by a fingerprint of this backend's sources."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from cute_helpers import HAVE_FA4, skip_without_cuda_driver

from blockdiff.attention.cute import compile_cache as cc


def test_the_source_fingerprint_changes_with_any_kernel_source_and_only_with_them(tmp_path, monkeypatch):
    src = tmp_path / "cute"
    shutil.copytree(cc._HERE, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cc, "_HERE", src)
    cc.source_fingerprint.cache_clear()
    try:
        a = cc.source_fingerprint()
        assert len(a) == 64 and a == cc.source_fingerprint()
        (src / "notes.txt").write_text("not a source")
        cc.source_fingerprint.cache_clear()
        assert cc.source_fingerprint() == a
        k = src / "kernel.py"
        k.write_text(k.read_text() + "\n# changed\n")
        cc.source_fingerprint.cache_clear()
        assert cc.source_fingerprint() != a
    finally:
        cc.source_fingerprint.cache_clear()


PERSIST = textwrap.dedent("""
    import pickle, sys
    from blockdiff.attention.cute import compile_cache as cc
    from blockdiff.attention.cute.config import CuteConfig
    import torch
    cache = cc.make_compile_cache()
    print(type(cache).__name__, getattr(cache, "cache_path", ""))
    key = (torch.bfloat16, 512, 512, 8, True, CuteConfig(tile_m=64, tile_n=32, num_stages=2), True, False, 64,
           False, False, False, 90, None)
    pickle.dumps(key)
    print("miss" if key not in cache else "hit")
""")


@pytest.mark.skipif(not HAVE_FA4, reason="needs flash-attn-4 (its cache_utils)")
def test_with_fa4s_variable_the_cache_is_on_disk_under_the_source_fingerprint_and_keys_pickle(tmp_path):
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", PERSIST], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    kind, path = r.stdout.split("\n")[0].split(" ", 1)
    assert kind == "JITPersistentCache" and path.startswith(str(tmp_path))
    assert path.endswith("blockdiff_" + cc.source_fingerprint()[:16]) and "miss" in r.stdout
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    r = subprocess.run([sys.executable, "-c", PERSIST], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.startswith("JITCache"), r.stderr[-2000:]


RESTART = textwrap.dedent("""
    import os, sys
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    from blockdiff.attention.cute import interface as ca
    if sys.argv[1] == "second":
        def compiled_again(*a, **k):
            raise AssertionError("compiled again: the disk cache missed")
        ca._compile = compiled_again
    ca.compile_only(head_dim=512, num_heads=16, num_kv_heads=2, page_size=64, max_seqlen_q=256)
    print(sys.argv[1], type(ca._COMPILE_CACHE).__name__)
""")


@pytest.mark.skipif(not HAVE_FA4, reason="compile-only check needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
def test_a_restarted_process_loads_the_compiled_kernel_from_disk_instead_of_compiling(tmp_path):
    """A server restart (or a second test shard) paid 7-10 s a kernel variant again (docs/tuning.md 7.10): with
    FA4's cache variable the first process exports the compiled kernel and the second loads it, never compiling."""
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(tmp_path))
    for run in ("first", "second"):
        r = subprocess.run([sys.executable, "-c", RESTART, run], capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            skip_without_cuda_driver(r.stderr)
        assert r.returncode == 0 and f"{run} JITPersistentCache" in r.stdout, r.stderr[-3000:]
    assert len(list(tmp_path.rglob(f"blockdiff_{cc.source_fingerprint()[:16]}/*.o"))) == 1
