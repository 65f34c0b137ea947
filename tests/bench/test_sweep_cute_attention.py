"""bench/sweep_cute_attention.py on the CPU: the --quick dry run (no CUDA, no FA4), feasibility and summary."""
import subprocess
import sys
from pathlib import Path

from blockdiff.bench import sweep_cute_attention as sw


def test_quick_dry_run_prints_the_plan_and_exits_zero(capsys):
    assert sw.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out
    for c in sw.CANDIDATES:
        assert c.name in out
    for name in sw.DEFAULT_WORKLOADS:
        assert name in out
    assert "SKIP" not in out  # every shipped candidate fits FA4's SM90 shared-memory / register rule
    assert len(sw.CANDIDATES) <= 16


def test_quick_needs_neither_cuda_nor_flash_attn():
    code = ("import sys; from blockdiff.bench import sweep_cute_attention as sw; "
            "assert sw.main(['--quick']) == 0; "
            "assert 'flash_attn' not in sys.modules and 'cutlass' not in sys.modules; "
            "import torch; assert not torch.cuda.is_initialized(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_feasibility_rejects_what_cannot_fit():
    ok, why, _ = sw.feasibility(dict(tile_m=128, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True,
                                     num_stages=2), 256, 256)
    assert not ok and "shared memory" in why
    ok, why, _ = sw.feasibility(dict(tile_m=192, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True,
                                     num_stages=2), 128, 128)
    assert not ok and "registers" in why
    ok, _, smem = sw.feasibility(dict(tile_m=128, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True,
                                      num_stages=2), 128, 128)
    assert ok and smem < sw.SMEM_LIMIT_BYTES


def test_summary_ratio_and_target():
    rows = [
        dict(workload="canvas_bs4_ctx4k_hd128", backend="fa4", kv_layout="paged", status="ok", correct=True,
             graph_ms=0.069),
        dict(workload="canvas_bs4_ctx4k_hd128", backend="fa4", kv_layout="contiguous", status="ok", correct=True,
             graph_ms=0.059),
        dict(workload="canvas_bs4_ctx4k_hd128", backend="cute", candidate="default", label="d", head_dim=128,
             status="ok", correct=True, graph_ms=0.074),
        dict(workload="canvas_bs4_ctx4k_hd128", backend="cute", candidate="x", label="x", head_dim=128,
             status="ok", correct=True, graph_ms=0.058),
        dict(workload="canvas_bs4_ctx4k_hd128", backend="cute", candidate="y", label="y", head_dim=128,
             status="incorrect", correct=False, graph_ms=None),
    ]
    best, lines = sw.summarize(rows, ["canvas_bs4_ctx4k_hd128"])
    b = best[0]
    assert b["best"] == "x" and abs(b["ratio_vs_fa4"] - 0.058 / 0.059) < 1e-9 and b["met"] is True
    assert abs(b["default_ratio"] - 0.074 / 0.059) < 1e-9
    assert lines and lines[0].startswith("hd128") and ": x " in lines[0]


def test_summary_survives_a_candidate_that_resolve_config_refused():
    """measure_cute's row for a config resolve_config refuses (shared memory) had no label: summarize raised
    KeyError after the whole sweep, losing the markdown and the printed verdicts."""
    rows = [dict(workload="w", backend="cute", candidate="default", label="d", head_dim=128, status="ok",
                 correct=True, graph_ms=0.07),
            dict(workload="w", backend="cute", candidate="big", head_dim=128, status="skipped", config=None,
                 graph_ms=None, reason="needs 240 KB")]
    best, lines = sw.summarize(rows, ["w"])
    assert best[0]["best"] == "d" and lines and ": d " in lines[0]
