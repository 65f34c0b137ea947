"""bench/experiments/device/cute_folder.sh runs every GPU test of tests/attention/cute in parallel shards: its shard
list must select each of the folder's GPU tests exactly once (a test in no shard would not run on the lease; one in
two would run twice under contention). The list is read from the script (``--shards``), the folder collected once
(``pytest --collect-only -m gpu``, CPU: collection only) and each shard's node-id prefixes and ``--deselect``
prefixes applied as pytest applies them."""
import subprocess
import sys

SCRIPT = "bench/experiments/device/cute_folder.sh"
FOLDER = "tests/attention/cute"


def _matches(nodeid: str, prefix: str) -> bool:
    """pytest's node-id selection: the file, the function (every parametrization) or one parametrized id."""
    return nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "[")


def _selected(shard: str, nodeids: list[str]) -> set[str]:
    args = shard.split()
    keep, drop = [], []
    j = 0
    while j < len(args):
        if args[j] == "--deselect":
            drop.append(args[j + 1])
            j += 2
        else:
            assert not args[j].startswith("-"), f"unexpected option {args[j]!r} in shard {shard!r}"
            keep.append(args[j])
            j += 1
    return {n for n in nodeids if any(_matches(n, k) for k in keep) and not any(_matches(n, d) for d in drop)}


def test_cute_folder_shards_select_every_gpu_test_of_the_folder_exactly_once():
    shards = subprocess.run(["bash", SCRIPT, "--shards"], capture_output=True, text=True, timeout=60,
                            check=True).stdout.strip().split(";")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        FOLDER], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    nodeids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln]
    assert len(nodeids) > 300, r.stdout[-1000:]
    seen: dict[str, int] = {}
    for sh in shards:
        sel = _selected(sh, nodeids)
        assert sel, f"shard {sh!r} selects no GPU test"
        for n in sel:
            seen[n] = seen.get(n, 0) + 1
    missing = [n for n in nodeids if n not in seen]
    twice = [n for n, k in seen.items() if k > 1]
    assert not missing and not twice, f"in no shard: {missing[:5]} ({len(missing)}); in two: {twice[:5]} ({len(twice)})"


def test_cute_folder_hands_cute_tests_its_shards_without_the_probe(tmp_path):
    """cute_folder.sh exec'd cute_tests.sh with the probe on (PROBE unset: 1): after shards of up to T = 480 s, the
    90-s cluster occupancy probe the folder run does not need took the call to the 600-s limit of one device command.
    A stand-in cute_tests.sh records what it is handed: the 16 shards, T = 480, PROBE = 0 (PROBE=1 keeps the probe)."""
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    dev = tmp_path / "bench" / "experiments" / "device"
    dev.mkdir(parents=True)
    shutil.copy(root / SCRIPT, dev / "cute_folder.sh")
    (dev / "cute_tests.sh").write_text('echo "T=$T PROBE=$PROBE"; IFS=";" read -ra s <<< "$FILES"; '
                                       'echo "shards=${#s[@]}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("T", "PROBE", "FILES")}

    def run(**kw):
        r = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env={**env, **kw}, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()
    assert run() == ["T=480", "PROBE=0", "shards=16"]
    assert run(PROBE="1", T="300") == ["T=300", "PROBE=1", "shards=16"]
