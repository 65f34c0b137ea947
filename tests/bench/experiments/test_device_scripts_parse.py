"""Every GPU-machine script parses (``bash -n``): they run only on a lent GPU, so a syntax error would cost a lease."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_device_script_parses_with_bash_n(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_device_script_runs_only_blockdiff_modules_that_exist(script):
    """``python3 -m blockdiff.<pkg>.<module>`` in a script names a module file of this repository."""
    root = DEVICE.parents[2]
    for mod in set(re.findall(r"-m blockdiff\.([\w.]+)", script.read_text())):
        path = root.joinpath(*mod.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{script.name}: {mod}"
