"""PTX-identity check of a refactor: snapshot the sm_90a PTX of every Triton kernel configuration the offline
compile checks cover, before and after, and compare the instructions.

    python3 -m blockdiff.bench.experiments.ptx_snapshot snapshot /tmp/ptx_before     # on the old tree
    python3 -m blockdiff.bench.experiments.ptx_snapshot snapshot /tmp/ptx_after      # on the new tree
    python3 -m blockdiff.bench.experiments.ptx_snapshot compare /tmp/ptx_before /tmp/ptx_after

CPU only (no GPU: ``triton.compile`` for an sm_90a target), a few minutes. What is compiled:

* the Gluon attention kernels, through :func:`blockdiff.attention.triton.compile_check.compile_for_sm90`, for
  :data:`GLUON_CONFIGS` (the configurations of tests/attention/triton/test_triton_compile_check.py);
* the streaming sampler kernels, by running the compile program ``_COMPILE_STREAMING_SM90`` of
  tests/sampler/triton/test_triton_sampler.py.

Every ``triton.compile`` call is captured; its PTX is stored without ``.loc`` / ``.file`` lines, comments and
``.debug_*`` sections (line-number debug info may change in a refactor; instructions must not). ``snapshot``
writes one ``.ptx`` file per kernel and ``summary.json`` (config -> kernel name and sha256 of the stripped PTX);
``compare`` matches two summaries by configuration and exits 1 when any instruction stream differs or a
configuration is missing on one side. TRITON_INTERPRET is cleared (the interpreter compiles nothing).
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
SAMPLER_TEST = REPO_DIR / "tests" / "sampler" / "triton" / "test_triton_sampler.py"

#: compile_for_sm90 keyword sets: (block_m, block_n, num_warps, num_stages, head_dim, paged, split, window,
#: overlap, extra) as in test_triton_compile_check.py; then the chained hd-128 tile, the wide hd-512 kernel and
#: the roles kernel (num_warps from config.roles_pv_warpgroups, added in :func:`gluon_configs`).
_GLUON_ROWS = [
    (64, 128, 4, 2, 128, True, True, False, False, dict(page_size=64, v_stages=1)),
    (64, 128, 4, 2, 128, True, False, False, False, dict(page_size=64, v_stages=1, causal_flags=True)),
    (64, 64, 4, 2, 128, True, True, False, True, {}),
    (128, 128, 8, 2, 128, True, True, False, False, {}),
    (64, 64, 4, 3, 128, False, False, True, True, {}),
    (64, 64, 4, 2, 256, True, False, True, False, {}),
    (64, 64, 4, 2, 64, True, True, True, True, dict(lazy=True)),
    (64, 32, 8, 2, 512, True, True, True, False, dict(group=8, num_kv_heads=2, page_size=64)),
    (64, 64, 4, 2, 256, True, True, True, "chain", dict(page_size=64)),
    (64, 128, 4, 2, 128, False, False, True, "chain", dict(v_stages=1)),
]
_ROLES = [  # test_roles_kernel_compiles_for_sm90
    dict(block_n=64, num_stages=1, head_dim=512, group=8, num_kv_heads=2, page_size=64, causal_flags=True),
    dict(block_n=64, num_stages=1, head_dim=512, group=8, num_kv_heads=2, window=True),
    dict(block_n=32, num_stages=2, v_stages=2, head_dim=512, group=8, num_kv_heads=2, page_size=32),
    dict(block_n=64, num_stages=2, head_dim=256, page_size=64, causal_flags=True, window=True),
    dict(block_n=128, num_stages=2, v_stages=1, head_dim=128, paged=False),
]


def gluon_configs() -> list[dict]:
    """The compile_for_sm90 keyword sets, in a fixed order (file names number them)."""
    from blockdiff.attention.triton import config as tc

    cfgs = [dict(block_m=a, block_n=b, num_warps=c, num_stages=d, head_dim=e, paged=f, split=g, window=h,
                 overlap=i, **x) for a, b, c, d, e, f, g, h, i, x in _GLUON_ROWS]
    for split in (False, True):  # the automatic chained hd-128 tile
        cfgs.append(dict(block_m=64, block_n=128, num_warps=4, num_stages=2, v_stages=1, head_dim=128, paged=True,
                         split=split, window=False, overlap="chain", page_size=64, causal_flags=True))
    for lazy in (False, True):  # the wide hd-512 kernel at the automatic tile
        cfgs.append(dict(block_m=64, block_n=64, num_warps=8, num_stages=1, head_dim=512, paged=True, split=True,
                         window=False, overlap=False, group=8, num_kv_heads=2, page_size=64, lazy=lazy))
    for split in (False, True):  # the roles kernel at the automatic hd-512 choice
        cfgs.append(dict(block_m=64, block_n=64, num_warps=12, num_stages=1, head_dim=512, paged=True, split=split,
                         window=False, overlap="roles", group=8, num_kv_heads=2, page_size=64))
    for kw in _ROLES:
        kw = dict(dict(block_m=64, paged=True, split=True, window=False, overlap="roles"), **kw)
        kw["num_warps"] = 4 * (1 + tc.roles_pv_warpgroups(kw["head_dim"]))
        cfgs.append(kw)
    return cfgs


def strip_ptx(ptx: str) -> str:
    """PTX without debug info: no ``.loc`` / ``.file`` lines, comments, blank lines or ``.debug_*`` sections."""
    keep = [line for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith((".loc", ".file", "//"))]
    return re.sub(r"\.section\s+\.debug_\w+\s*\{.*?\n\s*\}", "", "\n".join(keep), flags=re.S)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def snapshot(out: Path) -> dict:
    """Compile everything, write ``<out>/*.ptx`` and ``<out>/summary.json``; return the summary."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from blockdiff.attention.triton.compile_check import compile_for_sm90

    captured = []
    original = triton.compile

    def capture(src, *a, **k):
        compiled = original(src, *a, **k)
        captured.append((getattr(getattr(src, "fn", None), "__name__", "?"), compiled.asm["ptx"]))
        return compiled

    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    triton.compile = capture  # every compile of this process, Gluon and sampler alike, passes through here
    try:
        for i, kw in enumerate(gluon_configs()):
            key = "gluon " + json.dumps(kw, sort_keys=True)
            captured.clear()
            try:
                compile_for_sm90(**kw)
            except Exception as e:  # noqa: BLE001 - recorded; compare reports it
                summary[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            name, ptx = captured[-1]
            text = strip_ptx(ptx)
            (out / f"gluon{i:02d}_{name}.ptx").write_text(text)
            summary[key] = {"file": f"gluon{i:02d}_{name}.ptx", "kernel": name, "sha256": _sha(text)}
        m = re.search(r'_COMPILE_STREAMING_SM90 = r"""(.*?)"""', SAMPLER_TEST.read_text(), re.S)
        if m is None:
            raise RuntimeError(f"no _COMPILE_STREAMING_SM90 program in {SAMPLER_TEST}")
        captured.clear()
        exec(compile(m.group(1), "sampler_compile_check", "exec"), {})  # the test's own compile program
        for j, (name, ptx) in enumerate(captured):
            text = strip_ptx(ptx)
            (out / f"sampler{j:02d}_{name}.ptx").write_text(text)
            summary[f"sampler {j:02d} {name}"] = {"file": f"sampler{j:02d}_{name}.ptx", "kernel": name,
                                                  "sha256": _sha(text)}
    finally:
        triton.compile = original
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def compare_specs(a: Path, b: Path, sa: dict, sb: dict, file_key: str, show_identical: bool = False) -> int:
    """Compare two snapshots' entries (name -> ``{"sha256", "kernel", file_key}`` or ``{"error"}``) whose PTX files
    lie under ``a`` and ``b``: print the missing, failed and differing ones (with the first diff lines) and, with
    ``show_identical``, the equal ones too. Returns the count of entries that are not identical (0: all equal).
    Shared with ``cute_ptx_snapshot.py``."""
    bad = 0
    for key in sorted(set(sa) | set(sb)):
        x, y = sa.get(key), sb.get(key)
        if x is None or y is None:
            print(f"MISSING on {'before' if x is None else 'after'}: {key}")
            bad += 1
        elif "error" in x or "error" in y:
            print(f"ERROR {key}: {str(x.get('error', ''))[-300:]} | {str(y.get('error', ''))[-300:]}")
            bad += 1
        elif x["sha256"] != y["sha256"]:
            bad += 1
            print(f"DIFFERS {key} ({x['kernel']})")
            diff = difflib.unified_diff((a / x[file_key]).read_text().splitlines(),
                                        (b / y[file_key]).read_text().splitlines(), lineterm="", n=1)
            print("\n".join(list(diff)[:40]))
        elif show_identical:
            print(f"identical {key} ({x['kernel']}, {x['sha256'][:16]})")
    total = len(set(sa) | set(sb))
    print(f"{total - bad} of {total} identical, {bad} different / missing / failed")
    return bad


def compare(a: Path, b: Path) -> int:
    """Print the configurations whose stripped PTX differs (with the first diff lines); 0 when all are equal."""
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    return 1 if compare_specs(a, b, sa, sb, "file") else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="compile and store the stripped PTX")
    s.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="compare two snapshots")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "snapshot":
        summary = snapshot(a.out)
        errors = [k for k, v in summary.items() if "error" in v]
        print(f"{len(summary)} kernels in {a.out}" + (f", {len(errors)} errors: {errors}" if errors else ""))
        return 1 if errors else 0
    return compare(a.before, a.after)


if __name__ == "__main__":
    sys.exit(main())
