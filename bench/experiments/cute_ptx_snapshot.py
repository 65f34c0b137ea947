"""PTX-identity check of a refactor of the ``"cute"`` kernels: compile a list of sm_90a specs at one tree (a
commit, or a directory such as the working tree), store each attention kernel's PTX, and compare two snapshots.

    python3 -m blockdiff.bench.experiments.cute_ptx_snapshot snapshot /tmp/ptx_before --commit HEAD -j 2
    python3 -m blockdiff.bench.experiments.cute_ptx_snapshot snapshot /tmp/ptx_after --tree /work/main -j 2
    python3 -m blockdiff.bench.experiments.cute_ptx_snapshot compare /tmp/ptx_before /tmp/ptx_after

The Triton counterpart is ``ptx_snapshot.py``. CPU only (FA4's fake-tensor compile for sm_90a; flash-attn-4 and
nvidia-cutlass-dsl installed, e.g. the CuTe DSL venv), ~30-90 s a spec on 2 cores. What it does:

* ``--commit C`` exports ``git archive C`` of this repository into a temporary tree; ``--tree DIR`` uses a directory
  as it is (default: the tree this file is in). Either way ``blockdiff.*`` is imported from that tree (a
  ``blockdiff`` link to it on ``PYTHONPATH``, ahead of the editable install); each report records the
  ``kernel_roles.py`` it compiled, so a snapshot of the wrong tree shows.
* each spec compiles in a fresh interpreter through :func:`blockdiff.attention.cute.compile_check._child` (the
  offline compile check's own child, ``ptx_dir`` set), after setting the spec's class attributes (``switches``:
  e.g. ``_K_REFILL_ALL_WARPS``, not config fields) on ``FlashAttentionForwardSm90Roles`` (the split-KV subclass
  inherits them);
* the PTX is stored as :func:`compile_check.strip_ptx` leaves it: without ``.loc`` / ``.file`` lines, ``//``
  comments and ``.debug_*`` sections (source lines move with any edit; instructions must not). Nothing else is
  stripped. ``summary.json`` holds per spec name the spec, the kernel, the PTX file and its sha256, registers and
  spills.

``compare`` exits 1 when any spec's PTX differs, is missing or failed on either side (the first diff lines shown).
``SPECS`` is the set of the K-part-loader refactor (docs/tuning.md 2.24): both K refills, both S orders, both V
refills, pages 64 / 16 / 8 / 32 and contiguous, head dims 512 / 384, GQA 8 / 4 / 3, the split-KV subclass and the
all-warps K experiment, plus the bench's two hd-512 launches at page 64 and the epilogue-warp experiment
(docs/tuning.md 2.25), and FA4's consumer on the bench's two sliding launches and two hd-128 controls with NaN-safe V
off (``nanoff_``), on (the defaults: ``skip_allowed_first`` "auto", ``nan_safe_v_method`` "auto", which since 2.35 is
the recompute at hd 256 and the scan at hd 128), on by the scan (``scan_``, ``nan_safe_v_method="scan"``: the
default before 2.35), and by the scan with the config's ``skip_allowed_first`` True (``skipfirst_``, 2.27; until 2.30
the class attribute ``_SKIP_ALLOWED_FIRST``, same PTX) or False (``noskip_``), and with the experiment class attribute
``_CLEAN_SPLIT_ACROSS_WG`` (``splitscan_``, 2.31), and with ``nan_safe_v_method="recompute"`` (``recompute_``, 2.34:
its key-block loops must equal ``nanoff_``'s; its epilogue test is the FFMA chains since 2.39, before that the mask
test), the recompute with the timing-only trivial cold path (``trivialcold_``, ``_NR_TRIVIAL_COLD_PATH``, 2.37) and
also without the stash writes (``nostash_``, ``_NR_NO_STASH``; both switches exist from 2.37 on); 2.38's two
switches (the FFMA test, now the only one, and the out-of-line cold path, refuted) left with their specs
``ffmatest_``, ``ffmatrivial_``, ``noinline_`` and ``ffmanoinline_`` (2.39: ``ffmatest_`` / ``ffmatrivial_`` of a
tree before it compile what ``recompute_`` / ``trivialcold_`` compile after); the scan variants name
``nan_safe_v_method``, so a tree from before 2.34 compiles only ``nanoff_`` and the defaults;
the clean-up placements under a GEMM that ``cleanpv_`` / ``owncall_`` / ``both_`` compiled were removed (2.30). A
switch ``"Class.ATTR"`` names a class of ``kernel.py``, a bare ``"ATTR"`` the roles kernel's. ``snapshot --only
SUBSTR`` picks specs by name, ``list`` prints them. ``summary.json`` also keeps each kernel's spills by role, its
key-block loops (``compile_check.sass_loops``) and the recompute's epilogue test (``compile_check.sass_epilogue_test``,
None without one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]

_BASE = dict(head_dim=512, num_heads=16, num_kv_heads=2, return_lse=True, max_seqlen_q=256, window_size=None)


def _spec(page, switches=None, **kw):
    """A roles-kernel spec (hd 512, 16 q / 2 KV heads, LSE, canvas hint 256 unless ``kw`` says otherwise);
    ``config`` entries other than compile_only's keywords go into the config dict (``wide_design="roles"``)."""
    cfg = dict(wide_design="roles")
    spec = dict(_BASE, page_size=page)
    for k, v in kw.items():
        (spec if k in _BASE or k in ("bidirectional_window", "max_seqlen_k") else cfg)[k] = v
    spec["config"] = cfg
    return dict(spec=spec, switches=switches or {})


ALL_WARPS = {"_K_REFILL_ALL_WARPS": True}
EPI_LOCAL = {"_EPILOGUE_LOCAL_WARP": True}
_BENCH_TILES = dict(tile_m=64, tile_n=64, mma_pv_is_rs=False, intra_wg_overlap=True, num_stages=1, nan_safe_v=True,
                    split_merge="combine", v_refill="halves", qk_issue="ahead", k_refill="halves", return_lse=False)
#: ``mixed_global_ctx8k`` (max_seqlen_q 4096, max_seqlen_k 8448: one split, longest-first, the work order)
_BENCH_MIXED = dict(_BENCH_TILES, max_seqlen_q=4096, max_seqlen_k=8448, lpt=True, num_splits=1, batch_order="work")
#: ``canvas_bs1_ctx32k_global`` (one sequence of 256 over 33,024 keys: 2 splits, the given order)
_BENCH_CANVAS = dict(_BENCH_TILES, max_seqlen_q=256, max_seqlen_k=33024, lpt=False, num_splits=2,
                     batch_order="given")

SPLIT_SCAN = {"FlashAttentionForwardSm90Mixed._CLEAN_SPLIT_ACROSS_WG": True}  # docs/tuning.md 2.31
#: the recompute with a trivial cold path (timing only: wrong on non-finite V), and also without the stash (2.37)
TRIVIAL_COLD = {"FlashAttentionForwardSm90Mixed._NR_TRIVIAL_COLD_PATH": True}
TRIVIAL_NO_STASH = dict(TRIVIAL_COLD, **{"FlashAttentionForwardSm90Mixed._NR_NO_STASH": True})

#: FA4-consumer launches as ``config.resolve_launch_config`` resolves them for the bench's workloads (page 64, no LSE)
_SLIDING = dict(head_dim=256, num_heads=16, num_kv_heads=8, page_size=64, window_size=1023,
                bidirectional_window="symmetric", return_lse=False)
_HD128 = dict(head_dim=128, num_heads=16, num_kv_heads=8, page_size=64, window_size=None, return_lse=False)
#: hd 256's launch: 128 x 64, 2 stages, P in registers, FA4's overlap (no scheduler barrier at hd 256)
_TILES_256 = dict(tile_m=128, tile_n=64, mma_pv_is_rs=True, intra_wg_overlap=True, num_stages=2)
_MIXED_SPECS = {
    # mixed_sliding_ctx8k: one split, longest-first
    "sliding_bench_mixed_ctx8k": dict(_SLIDING, max_seqlen_q=4096, max_seqlen_k=8448, config=dict(
        _TILES_256, lpt=True, num_splits=1, split_merge="combine")),
    # canvas_bs1_ctx32k_sliding: the same tiles, 2 splits merged in a cluster
    "sliding_bench_canvas_ctx32k": dict(_SLIDING, max_seqlen_q=256, max_seqlen_k=33024, config=dict(
        _TILES_256, lpt=False, num_splits=2, split_merge="cluster")),
    # canvas_bs4_ctx4k_hd128: 128 x 128, 3 stages, overlap with FA4's scheduler barrier
    "hd128_bench_canvas_bs4_ctx4k": dict(_HD128, max_seqlen_q=256, max_seqlen_k=4352, config=dict(
        tile_m=128, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True, num_stages=3, lpt=False, num_splits=1,
        split_merge="combine")),
    # prefill16k_hd128: 192 x 128 without overlap
    "hd128_bench_prefill16k": dict(_HD128, max_seqlen_q=16384, max_seqlen_k=16384, config=dict(
        tile_m=192, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=False, num_stages=2, lpt=True, num_splits=1,
        split_merge="combine")),
}


def _mixed_spec(spec: dict, nan_safe_v: bool, switches: dict | None = None, **config) -> dict:
    """``spec`` with ``nan_safe_v`` and ``config`` (more CuteConfig fields) in its config, and ``switches`` (experiment
    class attributes, ``"Class.ATTR": value``; none by default)."""
    return dict(spec=dict(spec, config=dict(spec["config"], nan_safe_v=nan_safe_v, **config)), switches=switches or {})


#: name -> {"spec": compile_only keywords, "switches": class attributes}
SPECS = {
    # k_refill="halves" (the default at hd 384 / 512): both S orders, both V refills, every box count
    "halves_p64_ahead_vhalves": _spec(64, k_refill="halves", qk_issue="ahead", v_refill="halves"),
    "halves_p64_serial_onewarp": _spec(64, k_refill="halves", qk_issue="serial", v_refill="one_warp"),
    "halves_p16_ahead_prefixwin": _spec(16, k_refill="halves", qk_issue="ahead", window_size=1023,
                                        bidirectional_window="prefix"),
    "halves_p16_serial": _spec(16, k_refill="halves", qk_issue="serial"),
    "halves_p8_ahead": _spec(8, k_refill="halves", qk_issue="ahead"),
    "halves_p8_serial_onewarp": _spec(8, k_refill="halves", qk_issue="serial", v_refill="one_warp"),
    "halves_p32_gqa3_nolse": _spec(32, k_refill="halves", num_heads=12, num_kv_heads=4, return_lse=False,
                                   max_seqlen_q=4096),
    "halves_p16_tile32_serial": _spec(16, k_refill="halves", qk_issue="serial", tile_n=32),
    "halves_contig_ahead": _spec(None, k_refill="halves", qk_issue="ahead"),
    "halves_contig_serial_onewarp": _spec(None, k_refill="halves", qk_issue="serial", v_refill="one_warp"),
    "halves_hd384_p64_gqa4_win": _spec(64, k_refill="halves", head_dim=384, num_kv_heads=4, window_size=1023),
    "halves_hd384_contig_gqa4": _spec(None, k_refill="halves", head_dim=384, num_kv_heads=4),
    # the split-KV subclass with halves
    "halves_split2_p64_ahead": _spec(64, k_refill="halves", qk_issue="ahead", num_splits=2),
    "halves_split2_p8_serial": _spec(8, k_refill="halves", qk_issue="serial", num_splits=2),
    "halves_split2_contig_ahead": _spec(None, k_refill="halves", qk_issue="ahead", num_splits=2),
    # the whole-stage refill (controls: neither part loader runs)
    "whole_p64_ahead": _spec(64, k_refill="whole", qk_issue="ahead"),
    "whole_p16_serial": _spec(16, k_refill="whole", qk_issue="serial"),
    "whole_contig_ahead": _spec(None, k_refill="whole", qk_issue="ahead"),
    "whole_split2_p64": _spec(64, k_refill="whole", num_splits=2),
    # the all-warps K experiment (quarters; whole stage only)
    "allwarps_p64_serial": _spec(64, ALL_WARPS, k_refill="whole", qk_issue="serial"),
    "allwarps_p64_ahead": _spec(64, ALL_WARPS, k_refill="whole", qk_issue="ahead"),
    "allwarps_contig": _spec(None, ALL_WARPS, k_refill="whole"),
    "allwarps_p16": _spec(16, ALL_WARPS, k_refill="whole"),
    "allwarps_split2_p64": _spec(64, ALL_WARPS, k_refill="whole", num_splits=2),
    # the bench's launches at page 64 (docs/tuning.md 2.25: config.resolve_launch_config of the workload's host
    # shapes, whole; no LSE) and the epilogue's local warp index (_EPILOGUE_LOCAL_WARP) on them and on the LSE spec
    # that spilled 16 B
    "bench_mixed_ctx8k": _spec(64, **_BENCH_MIXED),
    "bench_canvas_ctx32k": _spec(64, **_BENCH_CANVAS),
    "epilocal_bench_mixed_ctx8k": _spec(64, EPI_LOCAL, **_BENCH_MIXED),
    "epilocal_bench_canvas_ctx32k": _spec(64, EPI_LOCAL, **_BENCH_CANVAS),
    "epilocal_p64_lse_q4096_work": _spec(64, EPI_LOCAL, max_seqlen_q=4096, batch_order="work"),
    # FA4's consumer (hd <= 256): the bench's sliding launches and hd-128 controls, NaN-safe V off / on (the
    # default: skip_allowed_first "auto", on for the split canvas only) / on with the scan of a first block every row
    # sees whole skipped (skip_allowed_first True, docs/tuning.md 2.27) / on with it scanned (False) / on with the
    # stage scanned once between the consumer warpgroups (_CLEAN_SPLIT_ACROSS_WG, 2.31) / on by the epilogue test and
    # recompute (nan_safe_v_method "recompute", 2.34: its key-block loops must equal nanoff_'s) / the recompute with a
    # trivial cold path (_NR_TRIVIAL_COLD_PATH, timing only, 2.37) and also without the stash writes (_NR_NO_STASH)
    **{f"{prefix}{name}": _mixed_spec(spec, nan, **extra)
       for prefix, nan, extra in (("nanoff_", False, {}), ("", True, {}), ("scan_", True, dict(
           nan_safe_v_method="scan")), ("skipfirst_", True, dict(skip_allowed_first=True, nan_safe_v_method="scan")),
           ("noskip_", True, dict(skip_allowed_first=False, nan_safe_v_method="scan")),
           ("splitscan_", True, dict(switches=SPLIT_SCAN, nan_safe_v_method="scan")),
           ("recompute_", True, dict(nan_safe_v_method="recompute")),
           ("trivialcold_", True, dict(switches=TRIVIAL_COLD, nan_safe_v_method="recompute")),
           ("nostash_", True, dict(switches=TRIVIAL_NO_STASH, nan_safe_v_method="recompute")))
       for name, spec in _MIXED_SPECS.items()},
}

_CHILD = r"""
import json, os, sys, tempfile
spec, ptx_dir, switches = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dump = tempfile.mkdtemp(prefix="cute_ptx_snapshot_")
# the DSL may read its artifact switches when it is imported (below, before _child runs): set them first, and
# hand _child the same dump directory
os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                  CUTE_DSL_KEEP="cubin,ptx", CUTE_DSL_DUMP_DIR=dump)
tempfile.mkdtemp = lambda *a, **k: dump
import inspect
from blockdiff.attention.cute import compile_check, kernel_roles
# "ATTR": the roles kernel's class attribute; "Class.ATTR": compile_check.set_switches' (kernel.py's classes too)
switches = {n if "." in n else "FlashAttentionForwardSm90Roles." + n: v for n, v in switches.items()}
if "switches" in inspect.signature(compile_check._child).parameters:
    report = compile_check._child(spec, ptx_dir, switches)
else:  # a tree from before compile_check.set_switches: the roles kernel's attributes only
    for name, value in switches.items():
        cls_name, _, attr = name.rpartition(".")
        assert cls_name == "FlashAttentionForwardSm90Roles" and hasattr(kernel_roles.FlashAttentionForwardSm90Roles, attr), name
        setattr(kernel_roles.FlashAttentionForwardSm90Roles, attr, value)
    report = compile_check._child(spec, ptx_dir)
report["kernel_roles_file"] = kernel_roles.__file__
print(json.dumps(report))
"""


def _tree_root(tree: Path) -> Path:
    """A directory holding only ``blockdiff`` -> ``tree``, for ``PYTHONPATH``."""
    root = Path(tempfile.mkdtemp(prefix="cute_ptx_root_"))
    (root / "blockdiff").symlink_to(tree.resolve(), target_is_directory=True)
    return root


def _compile(name: str, entry: dict, root: Path, out: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    ptx_dir = out / "ptx" / name
    argv = [sys.executable, "-c", _CHILD, json.dumps(entry["spec"]), str(ptx_dir), json.dumps(entry["switches"])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(root))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return dict(entry, error=f"rc {r.returncode}: {r.stderr[-2000:]}")
    rep = json.loads(lines[-1])
    ptx_file = Path(rep["ptx_file"])
    return dict(entry, kernel=rep["kernel"], ptx_file=str(ptx_file.relative_to(out)), sha256=rep["ptx_sha256"],
                registers=rep["registers"], spill_store_bytes=rep["spill_store_bytes"],
                spill_load_bytes=rep.get("spill_load_bytes"), sass_spills=rep.get("sass_spills"),
                loops=rep.get("loops"), epilogue_test=rep.get("epilogue_test"),
                kernel_roles_file=rep["kernel_roles_file"], config=rep["config"])


def snapshot(out: Path, tree: Path | None = None, commit: str | None = None, names=None, jobs: int = 2,
             timeout: float = 900) -> dict:
    """Compile ``names`` (default: every spec of :data:`SPECS`) at ``commit`` or ``tree``; write
    ``out/summary.json`` and ``out/ptx/<name>/*.ptx``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    if commit is not None:
        tree = Path(tempfile.mkdtemp(prefix="cute_ptx_tree_"))
        archive = subprocess.run(["git", "-C", str(REPO_DIR), "archive", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        sha = subprocess.run(["git", "-C", str(REPO_DIR), "rev-parse", commit], capture_output=True, text=True,
                             check=True).stdout.strip()
    else:
        tree, sha = Path(tree or REPO_DIR), None
    root = _tree_root(tree)
    names = list(names or SPECS)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(names, pool.map(lambda n: _compile(n, SPECS[n], root, out, timeout), names)))
    for n, res in results.items():
        print(f"{n:32s} {res.get('sha256', 'ERROR ' + res.get('error', '')[-300:])[:16]} {res.get('kernel', '')}")
    summary = dict(tree=str(tree), commit=sha, specs=results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def compare(a: Path, b: Path) -> int:
    """Print the specs whose PTX differs (with the first diff lines); 0 when all are equal."""
    from blockdiff.bench.experiments.ptx_snapshot import compare_specs

    sa, sb = (json.loads((d / "summary.json").read_text())["specs"] for d in (a, b))
    return 1 if compare_specs(a, b, sa, sb, "ptx_file", show_identical=True) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="compile the specs and store their stripped PTX")
    s.add_argument("out", type=Path)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--commit", help="compile this commit of the repository (git archive)")
    g.add_argument("--tree", type=Path, help="compile this directory (default: the tree of this file)")
    s.add_argument("--only", action="append", help="specs whose name contains this (repeatable)")
    s.add_argument("-j", "--jobs", type=int, default=2)
    s.add_argument("--timeout", type=float, default=900)
    c = sub.add_parser("compare", help="compare two snapshots")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    sub.add_parser("list", help="print the specs")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for n, e in SPECS.items():
            print(n, json.dumps(e))
        return 0
    if a.cmd == "compare":
        return compare(a.before, a.after)
    names = [n for n in SPECS if not a.only or any(o in n for o in a.only)]
    summary = snapshot(a.out, a.tree, a.commit, names, a.jobs, a.timeout)
    errors = [n for n, r in summary["specs"].items() if "error" in r]
    print(f"{len(names)} specs in {a.out}" + (f", {len(errors)} failed: {errors}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
