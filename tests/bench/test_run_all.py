"""bench/run_all.sh on the CPU without running it (it sources bench/device_env.sh, which relinks the machine-wide
/tmp/bdpath): every ``$BA ...`` stage command parses with bench_attention's own argument parser, and the hd-512
ladders time the cute backend (its roles kernel is the hd-512 default, docs/tuning.md 2.17-2.23)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from blockdiff.bench import bench_attention

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "run_all.sh"


def _stage_commands() -> dict[str, list[list[str]]]:
    """stage -> the argv of each ``$BA`` command in its case arm (line continuations joined, comments dropped)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    sweep = re.search(r"SWEEP_WORKLOADS=\$\{SWEEP_WORKLOADS:-([^}]*)\}", text).group(1)
    budget = re.search(r"BUDGET_S:-(\d+)", text).group(1)
    body = text.split("for stage in $stages; do", 1)[1]
    stages: dict[str, list[list[str]]] = {}
    current = None
    for line in body.splitlines():
        m = re.match(r"\s*([a-z-]+)\)\s*(.*)", line)
        if m:
            current, line = m.group(1), m.group(2)
        line = re.sub(r"\s#.*$", "", line)
        for cmd in re.findall(r"\$BA\s+([^;]*)", line):
            cmd = cmd.replace('"$SWEEP_WORKLOADS"', sweep)
            stages.setdefault(current, []).append(["--budget-s", budget, *shlex.split(cmd)])
    return stages


def test_every_stage_command_parses():
    stages = _stage_commands()
    assert {"attention-mixed", "attention-single", "sweep", "ladder-batch", "ladder-ctx", "ladder-global"} <= set(stages)
    for stage, cmds in stages.items():
        for argv in cmds:
            bench_attention.parse_args(argv)  # exits (SystemExit) on a bad flag, backend or workload pattern


def test_the_hd512_ladders_time_cute_and_not_fa4():
    cmds = _stage_commands()["ladder-global"]
    assert len(cmds) == 2
    for argv in cmds:
        args = bench_attention.parse_args(argv)
        backends = args.backends.split(",")
        assert backends[-1] == "cute" and "fa4" not in backends  # cute last: a hang leaves the other rows written
        assert args.suite in ("batch_ladder", "ctx_ladder") and args.workloads == "*global"
