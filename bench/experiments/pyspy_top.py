"""Summarize a ``py-spy record --format raw --subprocesses --threads`` file: per process and thread, the samples,
the top leaf frames (where the thread was) and the top inclusive frames (what it was inside), as text.

    python3 bench/experiments/pyspy_top.py RAW [--top 15] [--min-share 0.02] > top.txt

An experiment's tool (docs/tuning.md 7.13: which host thread holds a served load's tail), not part of the package.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

_RECORD = re.compile(r'^process (\d+):"(.*?)";(thread \((\d+)\): ?([^;]*));?(.*) (\d+)$', re.S)


def parse(text: str):
    """Yield (pid, command, thread, frames, count) from a raw py-spy file (records start with ``process N:"``; a
    command line may hold newlines)."""
    for rec in re.split(r"\n(?=process \d+:\")", text.strip()):
        m = _RECORD.match(rec.strip())
        if not m:
            continue
        pid, cmd, _, tid, tname, stack, count = m.groups()
        yield int(pid), " ".join(cmd.split()), f"{tname or 'thread'} ({tid})", [f for f in stack.split(";") if f], \
            int(count)


def summarize(records, top: int = 15, min_share: float = 0.02) -> str:
    groups: dict = collections.defaultdict(lambda: [0, collections.Counter(), collections.Counter(), ""])
    total = 0
    for pid, cmd, thread, frames, n in records:
        g = groups[(pid, thread)]
        g[0] += n
        g[3] = cmd
        total += n
        if frames:
            g[1][frames[-1]] += n
            for f in set(frames):
                g[2][f] += n
    out = [f"{total} samples in {len(groups)} threads"]
    for (pid, thread), (n, leaves, incl, cmd) in sorted(groups.items(), key=lambda x: -x[1][0]):
        if total and n / total < min_share:
            continue
        out.append(f"\n== pid {pid} {thread}: {n} samples ({100 * n / max(total, 1):.1f} %) -- {cmd[:90]}")
        out.append("  leaf frames:")
        out += [f"    {100 * c / n:5.1f} %  {f[:150]}" for f, c in leaves.most_common(top)]
        out.append("  inclusive frames:")
        out += [f"    {100 * c / n:5.1f} %  {f[:150]}" for f, c in incl.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--min-share", type=float, default=0.02, help="threads below this share of samples are left out")
    a = ap.parse_args(argv)
    with open(a.raw, encoding="utf-8", errors="replace") as f:
        print(summarize(parse(f.read()), a.top, a.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
