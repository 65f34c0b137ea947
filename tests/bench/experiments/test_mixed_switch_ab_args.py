"""What bench/experiments/device/cute_mixed_switch.sh hands the A/B (``ab_roles_switch``) for a switch, run on the CPU
in a copy of its folder with stand-ins: ``env.sh`` empty, ``python3`` recording its arguments and environment,
``nvidia-smi`` echoing. For ``SWITCH=_NR_TRIVIAL_COLD_PATH`` (docs/tuning.md 2.37, timing only) the rows must time
the recompute (``nan_safe_v_method`` pinned to ``"recompute"``, not the scan that the generic class-switch case and
``NO_AUTO_RECOMPUTE`` give) with the switch off / on / on without the stash, beside NaN-safe V off, triton and FA4, on
the two hd-256 launches, and no GPU test shard (wrong results on non-finite V)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device"
M = "FlashAttentionForwardSm90Mixed"


def _calls(tmp_path, **env_extra):
    """The script's python3 calls (argv after ``python3``, and NO_AUTO_RECOMPUTE) and its stdout."""
    dev = tmp_path / "tree" / "bench" / "experiments" / "device"
    dev.mkdir(parents=True)
    for name in ("cute_mixed_switch.sh", "switch_lib.sh"):
        shutil.copy(DEVICE / name, dev / name)
    (dev / "env.sh").write_text("")  # no GPU-machine environment (it links /tmp/bdpath)
    out, bin_ = tmp_path / "out", tmp_path / "bin"
    out.mkdir()
    bin_.mkdir()
    record = ("import json, os, sys; open(os.environ['OUT'] + '/calls.jsonl', 'a').write(json.dumps("
              "dict(argv=sys.argv[1:], no_auto=os.environ.get('NO_AUTO_RECOMPUTE'))) + '\\n')")
    (bin_ / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{record}\" \"$@\"\n")
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho '0 %, 1 MiB'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", OUT=str(out), B="5", **env_extra)
    env.pop("NO_AUTO_RECOMPUTE", None)
    r = subprocess.run(["bash", "bench/experiments/device/cute_mixed_switch.sh"], cwd=tmp_path / "tree", env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in (out / "calls.jsonl").read_text().splitlines()]
    return calls, r.stdout


def _ab(calls):
    ab = [c for c in calls if c["argv"][:2] == ["-m", "blockdiff.bench.experiments.ab_roles_switch"]]
    assert len(ab) == 1, calls
    return ab[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("switch", ["_NR_TRIVIAL_COLD_PATH", "_NR_NO_STASH"])
def test_trivial_cold_path_ab_times_the_recompute_with_the_switch_off_and_on(tmp_path, switch):
    calls, _ = _calls(tmp_path, SWITCH=switch)
    # no GPU test shard: only the health check's round trip runs before the A/B
    assert [c["argv"][0] for c in calls if c["argv"][:2] != ["-m", "blockdiff.bench.experiments.ab_roles_switch"]] \
        == ["-c"], calls
    ab = _ab(calls)
    argv = ab["argv"][2:]
    assert ab["no_auto"] is None  # "auto" is not turned into the scan
    settings, workloads, variants = json.loads(argv[0]), argv[1], json.loads(argv[4])
    assert settings == {"trivial": {f"{M}._NR_TRIVIAL_COLD_PATH": True},
                        "nostash": {f"{M}._NR_TRIVIAL_COLD_PATH": True, f"{M}._NR_NO_STASH": True}}
    assert workloads == "mixed_sliding_ctx8k,canvas_bs1_ctx32k_sliding"
    assert argv[2:4] == ["--triton", "--fa4"]
    assert variants == {"recompute": {"nan_safe_v": True, "nan_safe_v_method": "recompute"}}
    assert json.loads(argv[argv.index("--plain") + 1]) == {"nan_off": {"nan_safe_v": False}}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_generic_class_switch_keeps_the_scan(tmp_path):
    """The contrast: any other class switch runs with the scan pinned (the scan's switches, docs/tuning.md 2.35), so
    a switch of the recompute needs its own case in the script."""
    calls, _ = _calls(tmp_path, SWITCH="_CLEAN_SPLIT_ACROSS_WG", SHARDS="none")
    ab = _ab(calls)
    assert ab["no_auto"] == "1"
    assert json.loads(ab["argv"][6]) == {"nan_safe": {"nan_safe_v": True, "nan_safe_v_method": "scan"}}
