"""Every GPU-test shard of bench/experiments/device/cute_mixed_switch.sh and cute_triton_merge.sh selects tests: a
``-k`` that matches nothing runs green on the H200 and tests nothing (cute_k_halves_fuzz.sh's ``-k k_halves`` did
so from 127d9a5 until the 2026-12-05 audit). The shards' file / ``-k`` pairs are read from the scripts themselves
and collected here with ``pytest --collect-only -m gpu`` (CPU: collection only)."""
import re
import subprocess
import sys

import pytest

SCRIPT = "bench/experiments/device/cute_mixed_switch.sh"
_SHARD = re.compile(r"^\s*(\w+)\)\s+(?:run [01]|own) sw_\w+ (tests/\S+\.py)(?: -k (\"[^\"]*\"|\S+))?\s*&", re.M)


#: cute_triton_merge.sh's shards: gpu_run / config_run FIELD VALUE, a log name, a test file under $C, an optional -k
MERGE_SCRIPT = "bench/experiments/device/cute_triton_merge.sh"
_MERGE_SHARD = re.compile(r"^(?:gpu_run|config_run \S+ \S+) (sw_\w+) \$C/(\S+\.py)(?: -k (\"[^\"]*\"|\S+))?\s*&",
                          re.M)


def _merge_shards():
    text = open(MERGE_SCRIPT).read()
    return [(f"merge_{m.group(1)}", "tests/attention/cute/" + m.group(2), m.group(3).strip('"') if m.group(3) else None)
            for m in _MERGE_SHARD.finditer(text)]


def _shards():
    text = open(SCRIPT).read()
    shards = [(m.group(1), m.group(2), m.group(3).strip('"') if m.group(3) else None) for m in _SHARD.finditer(text)]
    # the own shard's default TESTS per switch
    shards += [(f"own[{f}]", f, None) for f in re.findall(r"TESTS=\$\{TESTS:-(tests/\S+\.py)\}", text)]
    return shards + _merge_shards()


def test_the_script_has_shards_to_check():
    names = {s[0] for s in _shards()}
    assert {"own_skip", "own_recompute_a", "own_recompute_b", "fuzz256", "nan256", "fuzz128", "nan128"} <= names, names
    assert any(n.startswith("own[") for n in names), names
    assert {"merge_sw_own", "merge_sw_split", "merge_sw_nan"} <= names, names


@pytest.mark.parametrize("name,path,k", _shards(), ids=[s[0] for s in _shards()])
def test_switch_shard_selects_gpu_tests(name, path, k):
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", path]
    if k:
        cmd += ["-k", k]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    n = sum(1 for line in r.stdout.splitlines() if "::" in line)
    assert n > 0, f"shard {name} ({path} -k {k!r}) selects no GPU test:\n{r.stdout[-1000:]}"
