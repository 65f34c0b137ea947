"""bench/make_tables.py: markdown tables from records, written between the README markers only."""
import json
from pathlib import Path

import pytest

from blockdiff.bench import make_tables


def _record(path, gpu="NVIDIA H200", suite="attention", rows=None, **extra):
    doc = {"gpu": gpu, "driver": "570.1", "torch": "2.11.0", "triton": "3.6.0", "flash_attn_4": "4.0.0b36",
           "commit": "abc", "date": "2026-11-29T15:00:00+00:00", "suite": suite, **extra, "rows": rows or []}
    path.write_text(json.dumps(doc))


def test_tables_between_markers(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _record(res / "attention-h200.json", rows=[
        {"workload": "mixed_sliding_ctx8k", "backend": "fa4", "kv_layout": "paged", "status": "ok", "eager_ms": 0.4,
         "graph_ms": 0.17, "anchor_ms": 0.164, "effective_tflops": 430.2, "share_of_peak": 0.544, "correct": True},
        {"workload": "mixed_global_ctx8k", "backend": "fa4", "status": "skipped", "reason": "hd 512 | unsupported"},
        {"workload": "mixed_sliding_ctx8k", "backend": "triton", "status": "ok", "graph_ms": 0.2,
         "config": {"BLOCK_M": 64, "BLOCK_N": 64}},
    ])
    (res / "attention-h200-mixed_sliding_ctx8k.png").write_bytes(b"png")
    _record(res / "attention-quick-cpu.json", gpu="cpu", rows=[{"workload": "x", "backend": "sdpa"}])
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- BEGIN RESULTS -->\nold\n<!-- END RESULTS -->\noutro\n")
    _record(res / "sampler-h200.json", suite="sampler", rows=[
        {"workload": "sampler_n4", "backend": "fused", "status": "ok", "graph_ms": 3.37, "extra_memory_bytes": 2**20,
         "correct": True},
        {"workload": "sampler_n4", "backend": "compile", "status": "error", "error": "boom | x"}])
    (res / "history").mkdir()
    _record(res / "history" / "attention-old-h200.json", rows=[{"workload": "old_workload", "backend": "sdpa"}])
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- BEGIN RESULTS -->\nold\n<!-- END RESULTS -->\noutro\n")
    make_tables.main(["--results", str(res), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old\n" not in text
    # attention records: one row per workload, one column per backend (graph ms, else the status)
    assert "| workload | fa4 (paged) ms | fa4 ms |" in text
    assert "| mixed_sliding_ctx8k | 0.1700 |  |" in text and "| mixed_global_ctx8k |  | skipped |" in text
    assert "BLOCK_M=64, BLOCK_N=64" in text  # tile sweep summary
    # sampler / e2e records: row by row
    assert "| sampler_n4 | fused | ok | 3.370 |" in text and "1.0 MiB" in text and "boom \\| x" in text
    assert "attention-quick-cpu" not in text  # CPU smoke records left out
    assert "old_workload" not in text  # history/ is never rendered
    assert "(results/attention-h200-mixed_sliding_ctx8k.png)" in text
    # idempotent
    make_tables.main(["--results", str(res), "--readme", str(readme)])
    assert readme.read_text() == text


def test_placeholder_and_missing_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("just text\n")
    make_tables.main(["--results", str(tmp_path), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("just text") and "No GPU records yet" in text
    assert text.count(make_tables.BEGIN) == 1 and text.count(make_tables.END) == 1


def test_repository_readme_has_the_markers():
    text = (Path(make_tables.BENCH_DIR) / "README.md").read_text()
    assert text.count(make_tables.BEGIN) == 1 and text.count(make_tables.END) == 1


def test_pivot_marks_eager_only_and_wrong_results():
    text = make_tables.pivot([
        {"workload": "w", "backend": "triton", "status": "ok", "graph_ms": None, "eager_ms": 0.5},
        {"workload": "w", "backend": "cute", "status": "ok", "graph_ms": 0.25, "correct": False},
        {"workload": "v", "backend": "cute", "status": "error"}])
    assert text.splitlines()[0] == "| workload | triton ms | cute ms |"
    assert "| w | 0.5000 (eager) | 0.2500 **wrong** |" in text and "| v |  | error |" in text


def test_missing_results_folder_exits_2_and_leaves_the_readme(tmp_path, capsys):
    """Was rc 0 with the README's tables replaced by the "No GPU records yet" placeholder (a typo in --results
    wiped the tables)."""
    import pytest
    readme = tmp_path / "README.md"
    readme.write_text("keep\n")
    for results in (tmp_path / "nope", readme):
        with pytest.raises(SystemExit) as e:
            make_tables.main(["--results", str(results), "--readme", str(readme)])
        assert e.value.code == 2 and "--results" in capsys.readouterr().err
    assert readme.read_text() == "keep\n"


def test_record_whose_rows_are_not_objects_is_skipped_with_a_note(tmp_path, capsys):
    """Was a TypeError / AttributeError traceback (rows 5, rows [1, "x"])."""
    for i, rows in enumerate((5, [1, "x"])):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": rows}))
    text = make_tables.main(["--results", str(tmp_path), "--stdout"])
    err = capsys.readouterr().err
    assert "No GPU records yet" in text and err.count("rows must be a list of JSON objects") == 2


def test_commit_header_shortens_only_a_full_hash(tmp_path):
    """A 40-hex commit is shortened (``+dirty`` kept); free text naming several commits (a record merged from two
    leases) is printed as written, not cut at 7 + 40 characters."""
    res = tmp_path / "results"
    res.mkdir()
    full = "0123456789abcdef0123456789abcdef01234567"
    text_commit = "311f4b9 (blockdiff-triton, vllm), ab20295 (blockdiff-cute)"
    rows = [{"workload": "w", "backend": "sdpa", "status": "ok", "graph_ms": 1.0}]
    _record(res / "attention-a-h200.json", suite="attention-a", rows=rows, commit=full + "+dirty")
    _record(res / "attention-b-h200.json", suite="attention-b", rows=rows, commit=text_commit)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- BEGIN RESULTS -->\n<!-- END RESULTS -->\n")
    make_tables.main(["--results", str(res), "--readme", str(readme)])
    out = readme.read_text()
    assert "commit `0123456+dirty`" in out and f"commit `{text_commit}`" in out


def test_serve_rows_of_two_load_formats_name_their_format(tmp_path):
    """docs/tuning.md 7.21: a serve record holding dummy_live rows shows each row's load format; one holding only
    the issue's dummy (or rows from before the field) keeps the usual columns."""
    res = tmp_path / "results"
    res.mkdir()
    row = {"workload": "serve_c1_fp8", "backend": "vllm", "status": "ok", "output_tok_s": 600.0}
    _record(res / "serve-h200.json", suite="serve", rows=[row, dict(row, load_format="dummy_live", output_tok_s=500.0)])
    _record(res / "serve-old-h200.json", suite="serve-old", rows=[row, dict(row, load_format="dummy")])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- BEGIN RESULTS -->\n<!-- END RESULTS -->\n")
    make_tables.main(["--results", str(res), "--readme", str(readme)])
    out = readme.read_text()
    two, one = out.split("### `serve-h200.json`")[1], out.split("### `serve-h200.json`")[0]
    assert "| serve_c1_fp8 | vllm | dummy_live | ok |" in two and "| serve_c1_fp8 | vllm | dummy | ok |" in two
    assert "load" in two.splitlines()[3] and "load" not in one and "dummy" not in one


def test_serving_ab_record_rows_are_named_by_variant_and_run(tmp_path):
    """A serving A/B record (suite ``serve_<name>``, e.g. bench/results/serve_fused_async-h100.json) has rows named by
    variant / run and no backend: it was rendered as an attention pivot, every cell "–"."""
    res = tmp_path / "results"
    res.mkdir()
    row = {"variant": "unfused", "run": 1, "workload": "serve_c1_fp8", "max_num_seqs": 16, "completed": 4,
           "failed": 0, "output_tok_s": 1022.1, "ttft_ms": 286.8, "time_per_canvas_ms": 213.96,
           "diffusion_denoising_steps": 128, "diffusion_steps_per_canvas": 16.0, "peak_memory_bytes": 2**30}
    _record(res / "serve_fused_async-h100.json", suite="serve_fused_async", gpu="NVIDIA H100 80GB HBM3",
            rows=[row, dict(row, variant="fused_any", diffusion_denoising_steps=124)])
    out = make_tables.render(res)
    assert "| workload | variant | run | max num seqs | output tok s | ttft ms | time per canvas ms |" in out
    assert "| serve_c1_fp8 | unfused | 1 | 16 | 1022.1 | 286.8 | 214.0 | 4 | 0 | 128 | 16.000 | 1024.0 MiB |" in out
    assert "| serve_c1_fp8 | fused_any | 1 |" in out and "| 124 |" in out
    assert "| – |" not in out


def test_repository_readme_tables_are_current():
    """bench/README.md holds exactly what make_tables renders from bench/results/ (run
    ``python3 -m blockdiff.bench.make_tables`` after adding or changing a record)."""
    text = (Path(make_tables.BENCH_DIR) / "README.md").read_text()
    current = text[text.index(make_tables.BEGIN) + len(make_tables.BEGIN) + 1:text.index(make_tables.END) - 1]
    assert current == make_tables.render(Path(make_tables.BENCH_DIR) / "results"), \
        "bench/README.md is stale: run python3 -m blockdiff.bench.make_tables"


@pytest.mark.parametrize("doc,words", [
    ({"suite": 5, "rows": []}, ["suite must be a string"]),
    ({"rows": [{"workload": ["a"], "backend": "triton", "status": "ok", "graph_ms": 1.0}]}, ["rows[0].workload"]),
    ({"rows": [{"backend": "triton", "status": "ok", "graph_ms": 1.0, "config": {"BM": 64}}]}, ["rows[0].workload"]),
    ({"rows": [{"workload": "a", "backend": "triton", "status": "ok", "graph_ms": 1.0, "config": "BM=64"}]},
     ["rows[0].config"]),
    ({"rows": [{"workload": "a", "status": "ok", "graph_ms": 1.0, "config": {"BM": 64}},
               {"workload": "a", "status": "ok", "graph_ms": "x", "config": {"BM": 32}}]}, ["rows[1].graph_ms"]),
    ({"rows": [{"workload": "a", "status": "ok", "graph_ms": 1.0, "config": {"BM": 64}},
               {"workload": "a", "status": "ok", "eager_ms": float("nan"), "config": {"BM": 32}}]},
     ["rows[1].eager_ms must be a finite number"]),  # JSON's NaN: it sorted anywhere in the tile sweep
])
def test_malformed_record_is_skipped_naming_the_field_and_the_others_render(tmp_path, capsys, doc, words):
    """Was: one malformed record stopped the whole README with an AttributeError ('int' has no 'split', 'str' has no
    'items'), TypeError (unhashable list, str < float) or KeyError ('workload') traceback."""
    (tmp_path / "attention-h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", **doc}))
    (tmp_path / "sampler-h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "suite": "sampler", "rows": [
        {"workload": "sampler_n4", "backend": "fused", "status": "ok", "graph_ms": 1.5}]}))
    text = make_tables.main(["--results", str(tmp_path), "--stdout"])
    err = capsys.readouterr().err
    assert "sampler-h200.json" in text and "attention-h200.json" not in text
    assert "skipping attention-h200.json" in err and all(w in err for w in words), err


def test_a_share_column_that_is_no_number_is_written_as_is():
    """Was: ValueError ('Unknown format code f for str') from 100 * "n/a" formatted as a percentage."""
    assert make_tables._fmt("attention_share", "n/a") == "n/a"
    assert make_tables._fmt("attention_share", 0.25) == "25.0 %"


def test_record_problem_names_an_int_beyond_float_range():
    """math.isfinite raised OverflowError for a graph_ms of 10**400 (an int JSON reads): a traceback, not the record's
    problem named."""
    doc = {"rows": [{"workload": "w", "graph_ms": 10 ** 400}]}
    assert make_tables.record_problem(doc) == "rows[0].graph_ms must be a finite number or null, got an int of 1329 bits"


def test_sweep_summary_never_ranks_another_backends_config_as_the_sweeps_best():
    """cute_sweep-h200.json's FA4 anchors carry a ``config`` (FA4's own tile choice): the summary ranked them with the
    cute candidates and showed FA4 contiguous's 0.0590 ms / 1.717 ms as the best cute configuration of
    canvas_bs4_ctx4k_hd128 / prefill16k_hd128 (cute's best: 0.0732 / 1.765)."""
    rows = [{"workload": "w", "backend": "fa4", "kv_layout": "contiguous", "status": "ok", "graph_ms": 0.059,
             "config": {"causal": {"tile_m": 128}}, "correct": True},
            {"workload": "w", "backend": "cute", "status": "ok", "graph_ms": 0.0732, "config": {"tile_m": 128},
             "correct": True},
            {"workload": "w", "backend": "cute", "status": "ok", "graph_ms": 0.08, "config": {"tile_m": 192},
             "correct": True}]
    lines = make_tables.sweep_summary(rows).splitlines()
    assert lines[0] == "| workload | backend | config | graph ms | eager ms | effective tflops |"
    assert "| w | fa4 (contiguous) | causal={'tile_m': 128} | 0.0590 |" in lines[2]
    assert lines[3].startswith("| w | cute | tile_m=128 | 0.0732 |") and len(lines) == 4


def test_sweep_summary_never_picks_a_wrong_result_or_an_eager_time_against_graph_times():
    """A config whose output failed the check (status ok, ``correct`` False) was the best when fastest, and a row
    whose graph capture failed was ranked by its eager time against the others' graph times."""
    rows = [{"workload": "w", "backend": "triton", "status": "ok", "graph_ms": 0.01, "config": {"BLOCK_M": 16},
             "correct": False},
            {"workload": "w", "backend": "triton", "status": "ok", "graph_ms": None, "eager_ms": 0.02,
             "config": {"BLOCK_M": 32}, "correct": True},
            {"workload": "w", "backend": "triton", "status": "ok", "graph_ms": 0.05, "config": {"BLOCK_M": 64},
             "correct": True}]
    text = make_tables.sweep_summary(rows)
    assert "| w | BLOCK_M=64 | 0.0500 |" in text and "BLOCK_M=16" not in text and "BLOCK_M=32" not in text
    assert "(1 configs failed/skipped/wrong)" in text
    # no graph time anywhere: eager times rank
    eager = [dict(r, graph_ms=None, eager_ms=0.03 + i / 100) for i, r in enumerate(rows[1:])]
    assert "| w | BLOCK_M=32 | – | 0.0300 |" in make_tables.sweep_summary(eager)


def test_sampler_variant_rows_with_a_config_are_rows_of_the_table(tmp_path):
    """sampler-h200.json's fused[triton_gemm] (8.47 ms) and fused[stats_overlap] rows carry their SamplerConfig: the
    README showed neither row, only the faster one's config as a 'tile sweep'. The --tune candidates stay a sweep."""
    _record(tmp_path / "sampler-h200.json", suite="sampler", rows=[
        {"workload": "sampler_n4", "backend": "fused", "status": "ok", "graph_ms": 3.4, "correct": True},
        {"workload": "sampler_n4", "backend": "fused[triton_gemm]", "status": "ok", "graph_ms": 8.47,
         "config": {"soft_impl": "triton_gemm"}, "correct": True},
        {"workload": "sampler_n4", "backend": "fused:tune:stats", "part": "stats", "status": "ok", "eager_ms": 0.8,
         "config": {"block_g": 256}, "correct": True}])
    text = make_tables.render(tmp_path)
    assert "| sampler_n4 | fused[triton_gemm] | ok | 8.470 |" in text
    assert "| sampler_n4 | block_g=256 | – | 0.8000 |" in text and "fused:tune:stats |" not in text
