"""bench/experiments/device/cute_exact_auto.sh, on the CPU: its shell parses, its sed makes ``"auto"`` the default
of a copy of attention/cute/config.py (both places: the CuteConfig field and ``_SWITCHES``), and its summary reads
bench_attention records (cute rows with exact_weight true / "auto" / false, FA4's rows by KV layout; a row whose
graph capture failed, ``graph_ms`` null with status ok, is named, not a crash)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path("bench/experiments/device/cute_exact_auto.sh")


def _script() -> str:
    return SCRIPT.read_text()


def test_cute_exact_auto_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_cute_exact_auto_sed_makes_auto_the_default_of_a_config_copy(tmp_path):
    expr = re.search(r"sed -i '([^']*)'", _script()).group(1)
    pkg = tmp_path / "blockdiff"
    shutil.copytree("attention", pkg / "attention", ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "__init__.py").write_text("")
    config = pkg / "attention" / "cute" / "config.py"
    before = config.read_text().splitlines()
    subprocess.run(["sed", "-i", expr, str(config)], check=True, timeout=30)
    after = config.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 2, changed
    check = re.search(r'python3 -c "([^"]*)"', _script()).group(1)
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode == 0 and "exact_weight auto by default in this copy" in r.stdout, r.stdout + r.stderr


def _row(workload, backend, graph_ms, config=None, **kw):
    r = dict(workload=workload, backend=backend, status="ok", graph_ms=graph_ms, eager_ms=0.2, correct=True, **kw)
    return dict(r, config=config) if config is not None else r


def test_cute_exact_auto_summary_reads_bench_attention_records(tmp_path):
    for rnd, scale in ((1, 1.0), (2, 1.02)):
        rows = []
        for w in ("canvas_bs1_ctx32k_hd128", "mixed_sliding_ctx8k"):
            rows += [_row(w, "cute", 0.118),  # the default row: no config, left out
                     _row(w, "cute", 0.1225 * scale, {"exact_weight": True}),
                     _row(w, "cute", 0.119 * scale, {"exact_weight": "auto"}),
                     _row(w, "cute", 0.118 * scale, {"exact_weight": False}),
                     _row(w, "fa4", 0.110, kv_layout="paged"), _row(w, "fa4", 0.090, kv_layout="contiguous")]
        rows += [{"workload": "canvas_bs1_ctx32k_sliding", "backend": "*", "status": "skipped",
                  "reason": "time budget spent"},
                 _row("canvas_bs4_ctx4k_hd128", "cute", None, {"exact_weight": "auto"}, graph_error="RuntimeError: x")]
        (tmp_path / f"attention-cute_exact_auto_{rnd}-h100.json").write_text(json.dumps({"rows": rows}))
    code = re.search(r"python3 - <<'PY'\n(.*?)\nPY\n", _script(), re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OUT=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert "canvas_bs4_ctx4k_hd128" in r.stdout and "no graph time" in r.stdout
    for w in ("canvas_bs1_ctx32k_hd128", "mixed_sliding_ctx8k"):
        ln = lines[w]
        assert "true: 122.5 / 125.0 us" in ln and "auto/false +0.85%" in ln and "true/false +3.81%" in ln, ln
        assert "fa4[paged]: 110.0 us" in ln and "fa4[contiguous]: 90.0 us" in ln, ln
