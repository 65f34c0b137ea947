"""bench/experiments/device/serve_fused.sh with DRY=1 (the server command only, no GPU, no env.sh): each variant's
scheduling mode, scheduler class, canvas length and fused-commit switch."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "bench/experiments/device/serve_fused.sh"
PKG = "blockdiff.integration.vllm_scheduler."


def _dry(variant, tmp_path, *extra, policy=None):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    env.pop("FUSE_POLICY", None)
    if policy is not None:
        env["FUSE_POLICY"] = policy
    r = subprocess.run(["bash", SCRIPT, variant, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, asynchronous, canvas, fuse", [
    ("parity", False, 64, True), ("parity_async", True, 64, True), ("fused", False, 512, True),
    ("fused_async", True, 512, True), ("layout", False, 512, False), ("sync", False, 256, False)])
def test_serve_fused_variants(tmp_path, variant, asynchronous, canvas, fuse):
    cmd = _dry(variant, tmp_path, "fp8", "cute") if not variant.startswith("parity") else _dry(variant, tmp_path)
    sched = "BlockdiffDiffusionAsyncScheduler" if asynchronous else "BlockdiffDiffusionScheduler"
    assert f"--scheduler-cls {PKG}{sched}" in cmd
    assert ("--no-async-scheduling" in cmd) is not asynchronous
    assert ("BLOCKDIFF_FUSE_COMMIT=1" in cmd) is fuse and "BLOCKDIFF_FUSE_POLICY" not in cmd
    if not (variant.startswith("parity") and Path("/tmp/exp/config.json").exists()):  # else that export's 2 * CL
        assert f'"canvas_length":{canvas}' in cmd
    if variant.startswith("parity"):  # both parity servers as before: float32, eager
        assert "--enforce-eager" in cmd and "--dtype float32" in cmd
        assert "--kv-cache-memory-bytes 1G" in cmd  # no memory profiling: the harness frees memory beside it


def test_serve_fused_refuses_an_unknown_variant(tmp_path):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    r = subprocess.run(["bash", SCRIPT, "fused_sync"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "fused_async" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, fuse", [("parity", True), ("parity_async", True), ("fused", True),
                                           ("fused_async", True), ("layout", False), ("sync", False)])
def test_serve_fused_passes_the_fuse_policy_to_the_fusing_servers(tmp_path, variant, fuse):
    """FUSE_POLICY=uniform / any reaches the fusing servers' environment as BLOCKDIFF_FUSE_POLICY (the rest of the
    command as without it); layout and sync fuse nothing and leave it out."""
    extra = () if variant.startswith("parity") else ("fp8", "cute")
    plain = _dry(variant, tmp_path, *extra)
    for policy in ("uniform", "any"):
        cmd = _dry(variant, tmp_path, *extra, policy=policy)
        assert (f"BLOCKDIFF_FUSE_POLICY={policy}" in cmd) is fuse
        assert cmd.replace(f" BLOCKDIFF_FUSE_POLICY={policy}", "") == plain


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_serve_fused_refuses_an_unknown_fuse_policy(tmp_path):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path),
           "FUSE_POLICY": "uniformly"}
    r = subprocess.run(["bash", SCRIPT, "fused_async", "fp8", "cute"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "FUSE_POLICY must be any or uniform" in r.stdout
