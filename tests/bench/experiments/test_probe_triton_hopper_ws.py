"""bench/experiments/probe_triton_hopper_ws.py on the CPU: the --tiny interpreter check of every kernel variant's
math (run as ``python3 -m``, as on the GPU machine)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_tiny_interpreter_run_matches_the_reference_for_every_variant(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "blockdiff.bench.experiments.probe_triton_hopper_ws", "--tiny"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny: ALL OK" in r.stdout, r.stdout[-3000:]
    assert not (ROOT / "bench" / "ws_probe_aux").exists()
    assert not (ROOT / "bench" / "experiments" / "ws_probe_aux").exists()
