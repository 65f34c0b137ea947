"""Render the current benchmark records (bench/results/*.json) as markdown tables into bench/README.md.

    python3 -m blockdiff.bench.make_tables               # bench/results -> bench/README.md (between the markers)
    python3 -m blockdiff.bench.make_tables --results $OUT --stdout

Only the JSON files directly in ``--results`` are read: bench/results/ holds one current record per suite;
superseded and exploratory records live in bench/results/history/ and are never rendered. The tables replace
whatever stands between ``<!-- BEGIN RESULTS -->`` and ``<!-- END RESULTS -->`` in the README; the rest of the
file is left as it is. One section per JSON file (suite and GPU), with the environment line (GPU, driver, torch,
triton, flash_attn_4, vllm, commit, date) and links to the PNG plots beside it. Attention records (every suite but
sampler / sampler_tp / e2e / serve) are shown as one row per workload and one column per backend (CUDA-graph median in ms, the
eager median when there is no graph); sampler, sampler_tp, e2e and serve records row by row, as are serving A/B records (a suite
``serve_<name>``, e.g. serve_fused_async: one row per variant and run, no backend). CPU records (``--quick`` smoke runs)
are left out unless ``--include-cpu``. Tile-sweep rows (a ``config`` per row; in the row-by-row records only the
sampler's ``--tune`` candidates, its configured variants such as ``fused[triton_gemm]`` being rows of their own) are
summarised as the best configuration per workload and backend, among the rows not found wrong, by CUDA-graph time
(eager only where no row of the group has one). Every other field is in the record's JSON / CSV.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
BEGIN, END = "<!-- BEGIN RESULTS -->", "<!-- END RESULTS -->"

#: Columns per suite family, in order; only columns present in some row are shown.
COLUMNS = {
    "sampler": ["workload", "backend", "status", "graph_ms", "eager_ms", "anchor_ms", "gbps", "effective_tflops",
                "extra_memory_bytes", "correct", "note"],
    "sampler_tp": ["workload", "backend", "world_size", "status", "eager_ms", "eager_ms_max_rank", "speedup_vs_1gpu",
                   "note"],
    "e2e": ["workload", "backend", "sampler_backend", "status", "denoise_step_ms", "tokens_per_s",
            "attention_share", "sampler_share", "prefill_ms", "layers", "note"],
    "serve": ["workload", "backend", "status", "max_num_seqs", "output_tok_s", "ttft_ms", "time_per_canvas_ms",
              "completed", "failed", "diffusion_steps_per_canvas", "peak_memory_bytes", "note"],
    # serving A/B records (suite serve_<name>, e.g. serve_fused_async): rows named by variant / policy / run
    "serve_ab": ["workload", "variant", "policy", "run", "status", "max_num_seqs", "output_tok_s", "ttft_ms",
                 "time_per_canvas_ms", "completed", "failed", "diffusion_denoising_steps",
                 "diffusion_steps_per_canvas", "peak_memory_bytes", "note"],
}
DEFAULT_COLUMNS = ["workload", "backend", "status", "graph_ms", "eager_ms", "effective_tflops", "note"]


def finite(v) -> bool:
    """``math.isfinite`` of an int or float, False for an int beyond float's range (where it raises OverflowError:
    a records or rows file's ``1`` followed by 400 zeros, or such a flag value)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def show_number(v) -> str:
    """``repr(v)`` for a message; an int beyond float's range by its size (its digits may be too many to print)."""
    return f"an int of {v.bit_length()} bits" if isinstance(v, int) and not finite(v) else repr(v)


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if key.endswith("_bytes") and isinstance(v, (int, float)):
        return f"{v / 2**20:.1f} MiB"
    if (key.endswith("share") or key == "share_of_peak") and isinstance(v, (int, float)):
        return f"{100 * v:.1f} %"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1 else (f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}" if abs(v) < 1e4 else f"{v:.0f}")
    return str(v).replace("|", "\\|")


def _label(row: dict) -> str:
    s = str(row.get("backend", ""))
    if row.get("kv_layout"):
        s += f" ({row['kv_layout']})"
    return s


def _note(row: dict) -> str:
    text = row.get("reason") or row.get("error") or row.get("graph_error") or row.get("check_error") or ""
    text = " ".join(str(text).split())
    return text[:90] + ("…" if len(text) > 90 else "")


def table(rows: list[dict], columns: list[str]) -> str:
    """Markdown table of ``rows`` over ``columns`` (those present in some row; ``note`` from reason/error)."""
    shown = [c for c in columns if c == "note" and any(_note(r) for r in rows) or any(c in r for r in rows)]
    lines = ["| " + " | ".join(c.replace("_", " ") for c in shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        cells = []
        for c in shown:
            if c == "backend":
                cells.append(_label(r))
            elif c == "note":
                cells.append(_note(r).replace("|", "\\|"))
            else:
                cells.append(_fmt(c, r.get(c)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Suite families rendered row by row (all others: one row per workload, one column per backend).
ROW_FAMILIES = ("sampler", "sampler_tp", "e2e", "serve", "serve_ab")


def _cell(row: dict) -> str:
    if row.get("status") != "ok":
        return str(row.get("status") or "–")
    ms = row.get("graph_ms") if row.get("graph_ms") is not None else row.get("eager_ms")
    text = _fmt("graph_ms", ms)
    if row.get("graph_ms") is None and ms is not None:
        text += " (eager)"
    return text + (" **wrong**" if row.get("correct") is False else "")


def pivot(rows: list[dict]) -> str:
    """Markdown table: one row per workload, one column per backend label (:func:`_cell`: ms or the status)."""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    cells: dict = {}
    for r in rows:
        cells.setdefault(r.get("workload"), {})[_label(r)] = _cell(r)
    lines = ["| workload | " + " | ".join(f"{lab} ms" for lab in labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for w, by in cells.items():
        lines.append(f"| {w} | " + " | ".join(by.get(lab, "") for lab in labels) + " |")
    return "\n".join(lines)


def _sweep_ms(r: dict, graph: bool):
    return r.get("graph_ms") if graph else r.get("eager_ms")


def sweep_summary(rows: list[dict], top: int = 1) -> str:
    """Best ``top`` configurations per workload and backend label (:func:`_label`: the configs of two backends, such
    as a cute sweep's candidates and FA4's anchors, whose ``config`` is FA4's own tile choice, are never ranked
    against each other) among rows carrying a ``config``. Only ok rows whose result was not found wrong
    (``correct`` False) are ranked, by ``graph_ms`` when a row of the group has one (rows without a graph time are
    then left out: an eager time is not a graph time), else by ``eager_ms``; the others are counted as
    failed / skipped / wrong."""
    out = []
    workloads = dict.fromkeys(r["workload"] for r in rows)
    groups = [(w, lab) for w in workloads for lab in dict.fromkeys(_label(r) for r in rows if r["workload"] == w)]
    several = len({lab for _, lab in groups}) > 1
    for name, lab in groups:
        mine = [r for r in rows if r["workload"] == name and _label(r) == lab]
        ok = [r for r in mine if r.get("status") == "ok" and r.get("correct") is not False]
        graph = any(r.get("graph_ms") is not None for r in ok)
        timed = [r for r in ok if _sweep_ms(r, graph) is not None]
        for r in sorted(timed, key=lambda r: _sweep_ms(r, graph))[:top]:
            cfg = ", ".join(f"{k}={v}" for k, v in (r.get("config") or {}).items())
            out.append({"workload": name, "backend": lab, "config": cfg, "graph_ms": r.get("graph_ms"),
                        "eager_ms": r.get("eager_ms"), "effective_tflops": r.get("effective_tflops")})
        failed = sum(1 for r in mine if r not in ok)
        if failed:
            out.append({"workload": name, "backend": lab, "config": f"({failed} configs failed/skipped/wrong)"})
    cols = ["workload"] + (["backend"] if several else []) + ["config", "graph_ms", "eager_ms", "effective_tflops"]
    return table(out, cols) if out else ""


def _is_sweep_row(row: dict, family: str) -> bool:
    """Whether ``row`` goes to the tile-sweep summary: a row with a ``config``, except in a row-by-row family, whose
    configured rows name their variant in the backend (the sampler's ``fused[triton_gemm]``, ``fused[stats_overlap]``:
    measured, checked rows of their own, which the summary hid behind the best of them); there only the sampler's
    ``--tune`` candidates (``fused:tune:*``) are a sweep."""
    if not row.get("config"):
        return False
    return family not in ROW_FAMILIES or ":tune:" in str(row.get("backend", ""))


def section(path: Path, link_base: Path = BENCH_DIR) -> str:
    doc = json.loads(path.read_text())
    rows = doc.get("rows", [])
    suite = doc.get("suite", path.stem)
    family = suite.split("-")[0]
    if family.startswith("serve_") and family not in COLUMNS:  # a serving A/B record (serve_fused_async, ...)
        family = "serve_ab"
    env = ", ".join(f"{k} {doc.get(k)}" for k in ("driver", "torch", "triton", "flash_attn_4", "vllm")
                   if doc.get(k))
    commit = str(doc.get("commit", "?"))
    if re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit):  # a full hash: short, "+dirty" kept; free text as written
        commit = commit[:7] + commit[40:]
    head = [f"### `{path.name}`",
            f"{doc.get('gpu', '?')}, commit `{commit}`, {str(doc.get('date', '?'))[:16]}; {env}"
            + ("" if doc.get("complete", True) else " — **incomplete run**"),
            ""]
    sweep_rows = [r for r in rows if _is_sweep_row(r, family)]
    main_rows = [r for r in rows if not _is_sweep_row(r, family)]
    if not main_rows:
        body = []
    elif family in ROW_FAMILIES:
        cols = list(COLUMNS.get(family, DEFAULT_COLUMNS))
        if family == "serve" and any(r.get("load_format") not in (None, "dummy") for r in main_rows):
            cols.insert(cols.index("backend") + 1, "load_format")  # rows of two load formats (docs/tuning.md 7.21)
            main_rows = [dict(r, load_format=r.get("load_format") or "dummy") for r in main_rows]  # absent: dummy
        body = [table(main_rows, cols)]
    else:
        body = [pivot(main_rows)]
    if sweep_rows:
        body += ["", "Tile sweep (best configuration per workload and backend):", "", sweep_summary(sweep_rows)]
    pngs = sorted(p.name for p in path.parent.glob(f"{path.stem}*.png"))
    if pngs:
        rel = os.path.relpath(path.parent.resolve(), Path(link_base).resolve())
        body += ["", "Plots: " + " · ".join(f"[{p[len(path.stem) + 1:-4] or p}]({rel}/{p})" for p in pngs)]
    return "\n".join(head + body)


def record_problem(doc: dict) -> str | None:
    """Why a record (a JSON object with ``rows``) cannot be rendered, naming the field, or None: ``suite`` a string
    when given; ``rows`` a list of objects, each with a ``workload`` string, a ``config`` object or null (tile-sweep
    rows), ``graph_ms`` / ``eager_ms`` finite numbers or null (NaN / Infinity, which JSON reads, would sort
    anywhere) (:func:`sweep_summary` sorts by them)."""
    if "suite" in doc and not isinstance(doc["suite"], str):
        return f"suite must be a string, got {doc['suite']!r}"
    if not isinstance(doc["rows"], list) or not all(isinstance(r, dict) for r in doc["rows"]):
        return "rows must be a list of JSON objects"
    for i, r in enumerate(doc["rows"]):
        if not isinstance(r.get("workload"), str):
            return f"rows[{i}].workload must be a string, got {r.get('workload')!r}"
        if r.get("config") is not None and not isinstance(r["config"], dict):
            return f"rows[{i}].config must be a JSON object or null, got {r['config']!r}"
        for k in ("graph_ms", "eager_ms"):
            v = r.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not finite(v)):
                return f"rows[{i}].{k} must be a finite number or null, got {show_number(v)}"
    return None


def render(results: Path, include_cpu: bool = False, link_base: Path = BENCH_DIR) -> str:
    """One section per record file (sorted by name; plot links relative to ``link_base``), or a placeholder
    when there is no GPU record. A file that is not JSON, or a record :func:`record_problem` refuses, is skipped
    with a line on stderr naming the file and the problem."""
    parts = []
    for path in sorted(results.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"make_tables: skipping {path.name}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict) or "rows" not in doc:
            continue
        why = record_problem(doc)
        if why:  # one malformed record is left out, named; it does not stop the others (was: a traceback)
            print(f"make_tables: skipping {path.name}: {why}", file=sys.stderr)
            continue
        if doc.get("gpu") == "cpu" and not include_cpu:
            continue
        parts.append(section(path, link_base))
    if not parts:
        return "_No GPU records yet: run the commands above on the H200, then `python3 -m blockdiff.bench.make_tables`._"
    return "\n\n".join(parts)


def update_readme(readme: Path, text: str) -> bool:
    """Replace the text between the markers of ``readme`` (appending the markers when missing); True if it changed."""
    old = readme.read_text() if readme.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        a, b = old.index(BEGIN), old.index(END) + len(END)
        new = old[:a] + block + old[b:]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    if new == old:
        return False
    readme.write_text(new)
    return True


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(BENCH_DIR / "results"), help="folder of JSON records")
    p.add_argument("--readme", default=str(BENCH_DIR / "README.md"))
    p.add_argument("--include-cpu", action="store_true", help="also render CPU (--quick) records")
    p.add_argument("--stdout", action="store_true", help="print instead of writing the README")
    a = p.parse_args(argv)
    if not Path(a.results).is_dir():
        p.error(f"--results {a.results!r} is not a folder (of JSON records)")
    text = render(Path(a.results), include_cpu=a.include_cpu, link_base=Path(a.readme).parent)
    if a.stdout:
        print(text)
    else:
        try:
            changed = update_readme(Path(a.readme), text)
        except OSError as e:
            p.error(f"--readme {a.readme!r} cannot be written: {e}")
        print(f"updated {a.readme}" if changed else f"{a.readme}: tables already current, not rewritten")
    return text


if __name__ == "__main__":
    main()
