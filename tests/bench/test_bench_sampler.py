"""bench/bench_sampler.py --quick on the CPU: runs every backend (Triton through the interpreter), checks them
against the reference, writes the JSON/CSV/PNG records and prints the summary table last."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_sampler as bs  # noqa: E402


def test_quick_run_writes_records_and_plot(tmp_path, capsys):
    rows = bs.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "sampler-quick-cpu.json").read_text())
    for key in ("gpu", "driver", "torch", "triton", "commit", "date", "anchors_ms", "rows"):
        assert key in doc
    by = {r["backend"]: r for r in doc["rows"]}
    assert set(by) == {"reference", "compile", "fused", "fused:stats", "fused:soft_gemm"} and len(rows) == 5
    for b in ("reference", "compile", "fused"):
        assert by[b]["status"] == "ok" and by[b]["correct"] is True and by[b]["eager_ms"] > 0, by[b]
    assert by["compile"]["compile_backend"] == "aot_eager"
    assert (tmp_path / "sampler-quick-cpu.csv").exists() and (tmp_path / "sampler-quick-cpu.png").exists()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-7].startswith("workload") and "graph_ms" in out[-7]


def test_check_catches_a_wrong_backend():
    import torch
    from blockdiff.sampler import reference

    def wrong(st, slots, x, pd, E):
        out = reference.sampler_step(st, slots, x, pd, E)
        st.canvas[slots] = (st.canvas[slots] + 1) % st.vocab_size
        return out

    s = bs.SHAPES["quick"]
    x, E, params, slots, pd = bs.make_inputs(s["N"], s["CL"], s["V"], s["H"], torch.device("cpu"))
    row = bs.measure("wrong", wrong, x, E, params, slots, pd, s, torch.device("cpu"), quick=True)
    assert row["status"] == "error" and row["correct"] is False and "canvas" in row["error"]
