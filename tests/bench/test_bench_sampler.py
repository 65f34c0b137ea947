"""bench/bench_sampler.py --quick on the CPU: runs every backend (Triton through the interpreter), checks them
against the reference, writes the JSON/CSV/PNG records and prints the summary table last."""
import json

import pytest

from blockdiff.bench import bench_sampler as bs


def test_quick_run_writes_records_and_plot(tmp_path, capsys):
    rows = bs.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "sampler-quick-cpu.json").read_text())
    for key in ("gpu", "driver", "torch", "triton", "commit", "date", "anchors_ms", "rows"):
        assert key in doc
    assert doc["argv"] == ["--quick", "--out", str(tmp_path)]  # the command line (was: not recorded)
    by = {r["backend"]: r for r in doc["rows"]}
    assert set(by) == {"reference", "compile", "fused", "fused[triton_gemm]", "fused[stats_overlap]", "fused:stats",
                       "fused:soft_gemm", "fused:soft_chunked", "fused:moments"} and len(rows) == 9
    for b in ("reference", "compile", "fused", "fused[triton_gemm]", "fused[stats_overlap]"):
        assert by[b]["status"] == "ok" and by[b]["correct"] is True and by[b]["eager_ms"] > 0, by[b]
    assert by["compile"]["compile_backend"] == "aot_eager"
    assert (tmp_path / "sampler-quick-cpu.csv").exists() and (tmp_path / "sampler-quick-cpu.png").exists()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-11].startswith("workload") and "graph_ms" in out[-11]
    assert by["fused[triton_gemm]"]["config"] == {"soft_impl": "triton_gemm"}


def test_chunked_part_error_does_not_abort_the_run(tmp_path, monkeypatch):
    """A failure of the chunked soft-embedding path (the CUDA default; here it raises) is an error row; the other
    rows still run."""
    from blockdiff.sampler.triton import soft_embedding as soft_chunked

    def boom(*a, **k):
        raise RuntimeError("chunked path broken")

    monkeypatch.setattr(soft_chunked, "soft_embedding_chunked", boom)
    rows = bs.main(["--quick", "--out", str(tmp_path), "--backends", "reference,fused", "--no-plots"])
    by = {r["backend"]: r for r in rows}
    assert by["fused:soft_chunked"]["status"] == "error" and "chunked path broken" in by["fused:soft_chunked"]["error"]
    assert by["fused[triton_gemm]"]["status"] == "ok"
    assert by["fused"]["status"] == "ok" and by["reference"]["status"] == "ok"


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


def test_tune_discards_a_candidate_that_fails_its_check(monkeypatch):
    """A tune candidate whose output is wrong (here: NaN in the soft-embedding workspace, as a tuned 128 x 256
    GEMM gave on the H200) is recorded as a discarded error row and never chosen, even when it is the fastest."""
    import torch

    good, bad = dict(block_m=16, block_n=16, block_k=64, split_k=1), dict(block_m=16, block_n=32, block_k=64, split_k=2)
    monkeypatch.setattr(bs, "TUNE_STATS", [dict(block_g=16)])
    monkeypatch.setattr(bs, "TUNE_GEMM", [good, bad])
    real = bs.soft_embedding

    def soft_embedding(*a, **k):
        cfg = a[7] if len(a) > 7 else k.get("config")
        ws = real(*a, **k)
        if cfg is not None and cfg.block_n == 32:
            ws[0, 0, 0] = float("nan")   # the broken candidate
        return ws

    monkeypatch.setattr(bs, "soft_embedding", soft_embedding)
    s = bs.SHAPES["quick"]
    x, E, params, slots, pd = bs.make_inputs(s["N"], s["CL"], s["V"], s["H"], torch.device("cpu"))
    best, rows = bs.tune(x, E, params, slots, s, torch.device("cpu"))
    by = {(r["part"], tuple(sorted(r["config"].items()))): r for r in rows}
    assert by[("soft_gemm", tuple(sorted(good.items())))]["status"] == "ok"
    rb = by[("soft_gemm", tuple(sorted(bad.items())))]
    assert rb["status"] == "error" and rb["discarded"] and "non-finite" in rb["error"]
    assert best["block_n"] == 16 and best["block_g"] == 16


def test_a_soft_chunk_sweep_adds_checked_chunked_rows_of_each_vocabulary_chunk(tmp_path):
    """--soft-chunks runs the chunked soft embedding at each chunk as a checked fused[chunk<Vc>] row: at serving
    batches the automatic 32 MiB buffer gives 1-2k-token chunks, whose fp32 accumulator traffic is the question of
    docs/tuning.md 7.11."""
    rows = bs.main(["--quick", "--out", str(tmp_path), "--backends", "reference,fused", "--no-plots", "--no-parts",
                    "--no-chunked", "--soft-chunks", "16,64"])
    ch = {r["backend"]: r for r in rows if r["backend"].startswith("fused[chunk")}
    assert set(ch) == {"fused[chunk16]", "fused[chunk64]"}, [r["backend"] for r in rows]
    assert all(r["status"] == "ok" and r["correct"] for r in ch.values()), ch
    assert ch["fused[chunk16]"]["config"] == {"soft_impl": "chunked", "soft_chunk": 16}


def test_other_canvas_counts_all_sampled_and_a_split_v_sweep_record_their_own_suite(tmp_path):
    """--canvases / --all-sampled name the workload sampler_n{N}[-sampled] and its own record; --split-v adds
    checked fused rows with that stats split (the small-batch question of docs/tuning.md 7.3)."""
    rows = bs.main(["--quick", "--out", str(tmp_path), "--backends", "reference,fused", "--no-plots", "--no-parts",
                    "--no-chunked", "--canvases", "1", "--all-sampled", "--split-v", "1,3"])
    doc = json.loads((tmp_path / "sampler_n1-sampled-quick-cpu.json").read_text())
    assert {r["workload"] for r in doc["rows"]} == {"sampler_n1-sampled-quick"}
    assert doc["workload_spec"]["N"] == 1 and doc["workload_spec"]["rows"].startswith("all sampled")
    sv = {r["backend"]: r for r in rows if r["backend"].startswith("fused[sv")}
    assert set(sv) == {"fused[sv1]", "fused[sv3]"} and all(r["correct"] for r in sv.values())
    assert all(r["accepted_per_row"] and r["N"] == 1 for r in sv.values())
    for bad in (["--canvases", "0"], ["--split-v", "a"], ["--split-v", "0"], ["--soft-chunks", "x"],
                ["--soft-chunks", "0"]):
        with pytest.raises(SystemExit):
            bs.main(["--quick", "--out", str(tmp_path), *bad])


@pytest.mark.parametrize("flags, word", [
    (["--split-k", "abc"], "--split-k must be"), (["--split-k", "0"], "--split-k values"),
    (["--gemm-tiles", "1x2"], "--gemm-tiles must be"), (["--gemm-tiles", "axbxcxdxe"], "--gemm-tiles must be"),
    (["--backends", "bogus"], "--backends: unknown")])
def test_flag_errors_exit_2_with_a_line_naming_the_flag(tmp_path, capsys, flags, word):
    """Were int() / IndexError tracebacks, exit 1 (--backends), or silently automatic (--split-k 0)."""
    with pytest.raises(SystemExit) as e:
        bs.main(["--quick", "--out", str(tmp_path), *flags])
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_vs_compile_compares_graph_with_graph_and_eager_with_eager():
    """vs_compile_same_run was time_ms / compile's time_ms, each the graph median or else the eager one: a row
    without a graph time (every --tune candidate; a failed capture) had its eager median divided by compile's
    graph replay, and a compile row without a graph flattered every graph row."""
    comp = {"backend": "compile", "graph_ms": 8.0, "eager_ms": 10.0}
    assert bs.vs_compile({"graph_ms": 4.0, "eager_ms": 5.0}, comp) == (0.5, "graph_ms")
    assert bs.vs_compile({"graph_ms": None, "eager_ms": 6.0}, comp) == (0.6, "eager_ms")
    assert bs.vs_compile({"graph_ms": 4.0, "eager_ms": 5.0}, dict(comp, graph_ms=None)) == (0.5, "eager_ms")
    assert bs.vs_compile({"graph_ms": 4.0}, {"eager_ms": None, "graph_ms": None}) == (None, None)


def test_vs_compile_anchor_only_for_the_anchors_workload_and_a_graph_time():
    """The anchor (7.35 ms) is torch.compile's CUDA-graph time of sampler_n4 on an H200: sampler_n1-sampled rows
    carried 0.144 'of the anchor' (one canvas against four), and an eager-only row its eager time over it."""
    shape = dict(bs.SHAPES["full"])
    row = {"workload": "sampler_n4", "graph_ms": 3.675, "eager_ms": 4.0}
    bs.add_rates(row, shape)
    assert row["vs_compile_anchor"] == pytest.approx(0.5)
    other = {"workload": "sampler_n1-sampled", "graph_ms": 1.05}
    bs.add_rates(other, dict(shape, N=1))
    assert other["vs_compile_anchor"] is None
    eager = {"workload": "sampler_n4", "eager_ms": 4.0}
    bs.add_rates(eager, shape)
    assert eager["vs_compile_anchor"] is None and eager["time_ms"] == 4.0


@pytest.mark.parametrize("workload, gpu", [("sampler_n4", "NVIDIA H100 80GB HBM3"), ("sampler_n1", "NVIDIA H200")])
def test_sampler_plot_draws_the_h200_anchor_only_where_the_rows_ratio_uses_it(tmp_path, monkeypatch, workload, gpu):
    """Regression: vs_compile_anchor became None off an H200 and for workloads other than sampler_n4, but the plot
    still drew 'compile anchor 7.35 ms' and its 0.5x target line on every run but --quick (sampler-h100.png: an H200
    time among H100 bars; a one-canvas run against the four-canvas anchor)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn = []
    real = Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x, *a, **kw: (drawn.append(x), real(self, x, *a, **kw))[1])
    rows = [{"workload": workload, "backend": "fused", "status": "ok", "time_ms": 3.0}]
    assert bs.plot(rows, tmp_path, "s", gpu=gpu)
    assert drawn == []
    bs.plot([dict(rows[0], workload="sampler_n4")], tmp_path, "s", gpu="NVIDIA H200")
    assert drawn == [bs.ANCHORS_MS["compile"], bs.ANCHORS_MS["compile"] / 2]
