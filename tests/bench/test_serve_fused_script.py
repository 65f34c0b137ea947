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


def _dry(variant, tmp_path, *extra):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
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
    assert ("BLOCKDIFF_FUSE_COMMIT=1" in cmd) is fuse
    if not (variant.startswith("parity") and Path("/tmp/exp/config.json").exists()):  # else that export's 2 * CL
        assert f'"canvas_length":{canvas}' in cmd
    if variant.startswith("parity"):  # both parity servers as before: float32, eager
        assert "--enforce-eager" in cmd and "--dtype float32" in cmd


def test_serve_fused_refuses_an_unknown_variant(tmp_path):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    r = subprocess.run(["bash", SCRIPT, "fused_sync"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "fused_async" in r.stdout
