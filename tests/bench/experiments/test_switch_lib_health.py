"""switch_lib.sh's gpu_health (bench/experiments/device): after the GPU shards it writes whether a fresh process
still gets a CUDA round trip, so a kernel left hung by a shard shows as ``FAIL`` in the packed log, and
switch_logs prints that file whole. Run on the CPU with stand-ins for ``nvidia-smi`` and ``python3`` on PATH."""
import os
import subprocess

import pytest

LIB = os.path.abspath("bench/experiments/device/switch_lib.sh")


def _run(tmp_path, python_body):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho '0 %, 1 MiB'\n")
    (bin_ / "python3").write_text("#!/bin/sh\n" + python_body + "\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", OUT=str(out), t="5", SWITCH="X")
    r = subprocess.run(["bash", "-c", f"source {LIB}; gpu_health; switch_logs; switch_pack"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout, (out / "shards.log").read_text()


@pytest.mark.parametrize("body,ok", [("echo 'cuda round trip 4.0'", True), ("exit 1", False)],
                         ids=["round_trip", "cuda_fails"])
def test_gpu_health_reports_whether_cuda_still_answers(tmp_path, body, ok):
    shown, packed = _run(tmp_path, body)
    for text in (shown, packed):
        assert "0 %, 1 MiB" in text
        assert ("cuda round trip 4.0" in text) == ok
        assert ("FAIL: no CUDA round trip (rc 1;" in text) == (not ok)


def test_gpu_health_ends_a_hung_cuda_call(tmp_path):
    """A round trip that never returns (a GPU left wedged) is ended by the 20 s cap, reported as FAIL."""
    shown, _ = _run(tmp_path, "sleep 300")
    assert "FAIL: no CUDA round trip (rc 124; 124: none in 20 s)" in shown
