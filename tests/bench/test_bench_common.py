"""bench/common.py: FLOP/s arithmetic, timing helpers, result files (allowed-pair counts: tests/attention)."""
import json
import os

import pytest
import torch

from blockdiff.bench import common


def test_flops_and_tflops():
    assert common.attention_flops(16, 128, 10) == 4 * 16 * 128 * 10
    assert common.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert common.tflops(1e12, None) is None
    assert common.share_of_peak(79.0) == pytest.approx(0.1)


def test_write_records_json_and_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDIFF_COMMIT", "abc123")
    rows = [{"workload": "w", "backend": "sdpa", "eager_ms": 1.5, "config": {"BLOCK_M": 64}},
            {"workload": "w", "backend": "fa4", "status": "skipped", "eager_ms": float("nan")}]
    path = common.write_records("attention-test", rows, env=common.env_record("cpu"), out_dir=tmp_path)
    assert path.name == "attention-test-cpu.json"
    doc = json.loads(path.read_text())
    for key in ("gpu", "driver", "torch", "triton", "flash_attn_4", "commit", "date", "rows"):
        assert key in doc
    assert doc["commit"] == "abc123"
    assert doc["rows"][1]["eager_ms"] is None  # NaN is not JSON
    assert (tmp_path / "attention-test-cpu.csv").read_text().splitlines()[0].startswith("workload,backend")


def test_results_dir_honours_OUT(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert common.results_dir() == tmp_path / "o"
    assert (tmp_path / "o").is_dir()


def test_cpu_timing_and_summary():
    ms = common.time_eager_ms(lambda: sum(range(1000)), "cpu", cpu_reps=3)
    assert ms > 0
    assert common.warm_up_gpu("cpu") == 0.0
    table = common.summary_table([{"a": 1.23456, "b": None}], ["a", "b"])
    assert "1.235" in table and "-" in table
    assert common.gpu_slug("NVIDIA H200") == "h200"


@pytest.mark.parametrize("name, slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                        ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200 NVL", "h200-nvl"),
                                        ("NVIDIA A100-SXM4-80GB", "a100-sxm4"), ("cpu", "cpu"), ("", "gpu")])
def test_gpu_slug_names_the_model_and_drops_memory_size_and_kind(name, slug):
    """The H100's device name gave records named `-h100-80gb-hbm3`, renamed `-h100` by hand; the slug is that now."""
    assert common.gpu_slug(name) == slug


def test_write_experiment_json_goes_to_out_or_the_local_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    p = common.write_experiment_json("x.json", {"a": float("nan")}, tmp_path)
    assert p == tmp_path / "x.json" and p.read_text().strip().startswith("{")
    assert common.results_dir(local=True) == common.LOCAL_RESULTS_DIR
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert common.write_experiment_json("y.json", [1]).parent == tmp_path / "o"


def test_save_png_writes_a_palette_png_smaller_than_matplotlibs(tmp_path):
    """Records travel inside the GPU run's 64 MiB working tree: charts are saved as 256-colour palettes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from blockdiff.bench import common

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(range(50), [i * i for i in range(50)], label="x")
    ax.bar(range(10), range(10), color="tab:green")
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=110)
    p = common.save_png(fig, tmp_path / "chart.png", dpi=110)
    plt.close(fig)
    with Image.open(p) as im:
        assert im.mode == "P" and im.size == Image.open(tmp_path / "rgba.png").size
    assert p.stat().st_size < (tmp_path / "rgba.png").stat().st_size


class _Stream:
    """A stderr stand-in that says whether it is a terminal."""

    def __init__(self, tty: bool):
        self.tty, self.parts = tty, []

    def write(self, s):
        self.parts.append(s)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return self.tty

    def text(self):
        return "".join(self.parts)


def test_progress_draws_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    """``bench_attention --quick > log 2>&1``: the logged rows stay whole lines, no tqdm redraws between them."""
    err = _Stream(tty=False)
    monkeypatch.setattr(common.sys, "stderr", err)
    items = [1, 2, 3]
    wrapped = common.progress(items, desc="workloads")
    assert wrapped is items
    for i in wrapped:
        common.log(f"row {i}")
    assert err.text() == "row 1\nrow 2\nrow 3\n"


def test_progress_draws_its_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    err = _Stream(tty=True)
    monkeypatch.setattr(common.sys, "stderr", err)
    assert list(common.progress([1, 2], desc="workloads")) == [1, 2]
    assert "workloads" in err.text() and "\r" in err.text()
    assert common.progress([1], enabled=False) == [1]


def test_script_argv_is_the_scripts_arguments(monkeypatch):
    """A record's ``argv``: what ``main`` got, or the command line after the program, as a list of str."""
    monkeypatch.setattr(common.sys, "argv", ["/x/bench_sampler.py", "--no-compare", "--out", "/o"])
    assert common.script_argv(None) == ["--no-compare", "--out", "/o"]
    assert common.script_argv(("--quick", 3)) == ["--quick", "3"] and common.script_argv([]) == []


def test_every_records_argv_is_the_scripts_arguments():
    """Every record under bench/results/ that has ``argv`` holds the script's arguments (section 9), as
    :func:`common.script_argv` writes them: no interpreter flag, module or script path (sampler-h100.json's, written
    in by hand, began with ``-m blockdiff.bench.bench_sampler``)."""
    found = 0
    for path in sorted(common.DEFAULT_RESULTS_DIR.rglob("*.json")):
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "argv" not in doc:
            continue
        found += 1
        argv = doc["argv"]
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), path.name
        assert not any(a == "-m" or a.startswith("blockdiff.") or a.endswith(".py") for a in argv), (path.name, argv)
    assert found >= 20  # the attention, e2e and sampler records


def test_comma_list_refuses_a_value_that_names_nothing():
    """``--backends ","`` and the like were read as an empty list: a run that selected nothing measured nothing and
    exited 0. ``""`` stays ``[]`` (each flag gives it its meaning); a non-empty value naming nothing is a ValueError
    naming the flag."""
    assert common.comma_list(" triton , cute,", "--backends") == ["triton", "cute"]
    assert common.comma_list("", "--backends") == []
    for text in (",", " ", " , ,"):
        with pytest.raises(ValueError, match="--backends"):
            common.comma_list(text, "--backends")


@pytest.mark.parametrize("script, argv", [
    ("bench_attention", ["--quick", "--backends", ","]),
    ("bench_attention", ["--quick", "--fa4-layouts", " , "]),
    ("bench_attention", ["--quick", "--blockdiff-layouts", ","]),
    ("bench_attention", ["--quick", "--backends", "triton", "--blockdiff-layouts", ""]),  # (review25: exit 0, no row)
    ("bench_attention", ["--quick", "--backends", "fa4", "--fa4-layouts", ""]),
    ("sweep_cute_attention", ["--quick", "--fa4-layouts", ","]),
    ("sweep_cute_attention", ["--quick", "--candidates", ","]),
    ("bench_e2e", ["--quick", "--batches", ","]),
    ("bench_e2e", ["--quick", "--batches", ""]),
    ("bench_e2e", ["--quick", "--batches", "1,x"]),
    ("bench_e2e", ["--quick", "--attn-backends", ","]),
    ("bench_sampler", ["--quick", "--backends", ","]),
    ("bench_sampler", ["--quick", "--backends", ""]),
    ("bench_sampler", ["--quick", "--split-k", ","]),
    ("bench_sampler_tp", ["--quick", "--backends", ","]),
])
def test_bench_cli_lists_that_name_nothing_are_usage_errors_not_empty_runs(script, argv, tmp_path):
    """Every benchmark's comma-list flag: a value naming nothing stops the run with a usage error (exit 2) before any
    work, where it ran nothing (or, for bench_e2e's ``--batches 1,x``, raised a bare int() traceback)."""
    import importlib
    mod = importlib.import_module(f"blockdiff.bench.{script}")
    entry = getattr(mod, "parse_args", None) or mod.main
    with pytest.raises(SystemExit) as e:
        entry(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2


def test_csv_cells_hold_the_jsons_values_for_non_finite_floats(tmp_path):
    """The JSON wrote null for a NaN / inf time and the CSV beside it 'nan' / 'inf': two files of one record that
    disagreed (a spreadsheet read the CSV's as numbers)."""
    rows = [{"workload": "w", "backend": "b", "eager_ms": float("nan"), "graph_ms": float("inf"), "x": 1.5}]
    common.write_records("s", rows, env={"gpu": "cpu"}, out_dir=tmp_path)
    lines = (tmp_path / "s-cpu.csv").read_text().splitlines()
    assert lines == ["workload,backend,eager_ms,graph_ms,x", "w,b,,,1.5"]


def test_a_record_write_cut_short_leaves_the_previous_record_whole(tmp_path, monkeypatch):
    """write_records wrote the record in place: a process ended while writing (sweep_cute_attention's config
    watchdog exits from its thread; a device command's time limit) left a truncated JSON instead of the last whole
    record. Now each file is written beside and renamed over it."""
    import builtins
    import io

    common.write_records("s", [{"workload": "w", "eager_ms": 1.0}], env={"gpu": "cpu"}, out_dir=tmp_path)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    real_open = builtins.open

    class Cut(Exception):
        pass

    def cut_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if "w" in mode:
            def write(text, _w=f.write):
                _w(text[: len(text) // 2])
                f.flush()
                raise Cut()
            f.write = write
        return f

    monkeypatch.setattr(builtins, "open", cut_open)
    monkeypatch.setattr(io, "open", cut_open)
    with pytest.raises(Cut):
        common.write_records("s", [{"workload": "w", "eager_ms": 2.0}] * 50, env={"gpu": "cpu"}, out_dir=tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before
    assert json.loads((tmp_path / "s-cpu.json").read_text())["rows"] == [{"workload": "w", "eager_ms": 1.0}]


def test_a_record_written_over_a_symbolic_link_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    """Regression: the rename of write_records' whole-file write put a regular file in the link's place, so the
    file the link named kept the old record (a write in place, as before the rename, went through the link)."""
    real = tmp_path / "kept" / "s-cpu.json"
    real.parent.mkdir()
    real.write_text("{}\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "s-cpu.json").symlink_to(real)
    common.write_records("s", [{"workload": "w", "eager_ms": 1.0}], env={"gpu": "cpu"}, out_dir=out)
    assert (out / "s-cpu.json").is_symlink()
    assert json.loads(real.read_text())["rows"] == [{"workload": "w", "eager_ms": 1.0}]
    assert sorted(p.name for p in real.parent.iterdir()) == ["s-cpu.json"]  # no temporary file left beside it


def test_a_rewritten_record_keeps_the_permission_bits_of_the_file_it_replaces(tmp_path):
    """Regression: the whole-file write created a new file with the umask's mode, so a record made group-writable
    (0664) or read-only for others (0640) lost its mode on the next run; a write in place kept it."""
    common.write_records("s", [{"workload": "w", "eager_ms": 1.0}], env={"gpu": "cpu"}, out_dir=tmp_path)
    for name in ("s-cpu.json", "s-cpu.csv"):
        os.chmod(tmp_path / name, 0o640)
    common.write_records("s", [{"workload": "w", "eager_ms": 2.0}], env={"gpu": "cpu"}, out_dir=tmp_path)
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"s-cpu.json": 0o640,
                                                                              "s-cpu.csv": 0o640}


def test_csv_cells_hold_the_jsons_text_for_tuple_values(tmp_path):
    """Regression: a tuple value (a shape, a pair of names) is a JSON list in the record's JSON, but its CSV cell was
    Python's repr of the list _jsonable made of it (``['a', 'b']``, not JSON), where a list value's cell is JSON."""
    rows = [{"workload": "w", "pair": ("a", "b"), "names": ["a", "b"]}]
    common.write_records("s", rows, env={"gpu": "cpu"}, out_dir=tmp_path)
    assert json.loads((tmp_path / "s-cpu.json").read_text())["rows"][0]["pair"] == ["a", "b"]
    lines = (tmp_path / "s-cpu.csv").read_text().splitlines()
    assert lines == ["workload,pair,names", 'w,"[""a"", ""b""]","[""a"", ""b""]"']
