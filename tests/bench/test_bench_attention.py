"""bench/bench_attention.py --quick on the CPU: runs, checks every backend, records rows, never crashes."""
import json

import pytest
import torch

from blockdiff.bench import bench_attention as ba
from blockdiff.bench import workloads as wl


def test_quick_run_writes_records_and_plots(tmp_path, capsys):
    rows = ba.main(["--quick", "--out", str(tmp_path), 
                    "--workloads", "mixed_sliding_ctx8k,mixed_sliding_prefix_ctx8k,canvas_bs4_ctx4k_hd128"])
    doc = json.loads((tmp_path / "attention-quick-cpu.json").read_text())
    assert doc["rows"] == json.loads(json.dumps(doc["rows"])) and len(doc["rows"]) == len(rows) == 9
    for key in ("gpu", "torch", "triton", "commit", "date", "anchors_ms"):
        assert key in doc
    by = {(r["workload"], r["backend"]): r for r in rows}
    for name in ("mixed_sliding_ctx8k", "mixed_sliding_prefix_ctx8k", "canvas_bs4_ctx4k_hd128"):
        for be in ("reference", "sdpa"):
            r = by[(name, be)]
            assert r["status"] == "ok" and r["correct"] is True and r["eager_ms"] > 0, r
            assert r["effective_tflops"] > 0 and r["allowed_pairs"] > 0
        # the Triton backend runs through the interpreter when it exists, else is skipped with a reason; its
        # own failures are recorded as an error row (its correctness is tests/attention's job)
        t = by[(name, "triton")]
        assert (t["status"] == "ok" and t["correct"] is not None) or t.get("reason") or t.get("error"), t
    assert (tmp_path / "attention-quick-cpu.csv").exists()
    assert (tmp_path / "attention-quick-cpu-mixed_sliding_ctx8k.png").exists()
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-11].startswith("workload") and "effective_tflops" in last[-11]  # summary table printed last


def test_failing_backend_records_error_row_and_run_continues(tmp_path, monkeypatch):
    def boom(batch, args):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ba, "make_sdpa", boom)
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", 
                    "--workloads", "canvas_bs4_ctx4k_hd128", "--backends", "sdpa,reference,fa4"])
    status = {r["backend"]: r for r in rows}
    assert status["sdpa"]["status"] == "error" and "kernel exploded" in status["sdpa"]["error"]
    assert status["reference"]["status"] == "ok"
    assert all(r["status"] == "skipped" and r["reason"] for r in rows if r["backend"] == "fa4")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager flex on the CPU
@pytest.mark.parametrize("name", ["mixed_sliding_ctx8k", "mixed_sliding_prefix_ctx8k", "mixed_global_ctx8k"])
def test_sdpa_and_flex_match_the_reference(name):
    w = wl.select(wl.named_workloads(quick=True), name)[0]
    b = wl.build(w, "cpu", torch.float32, page_size=5, seed=1)  # page size dividing nothing
    gold, base, src = ba.ground_truth(b, "reference")
    assert src == "reference-fp64"
    for maker in (ba.make_sdpa, ba.make_flex):
        fn, to_packed, info = maker(b, None)
        out = to_packed(fn())
        assert out.shape == gold.shape
        assert float((out.double() - gold).abs().max()) < 1e-4, maker.__name__
    sd_gold, sd_base, _ = ba.ground_truth(b, "sdpa")
    assert float((sd_gold.double() - gold).abs().max()) < 1e-4


def test_tile_sweep_is_a_no_op_with_message_when_unsupported(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ba, "triton_config_kwarg", lambda: None)
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots",  "--tile-sweep",
                    "--workloads", "canvas_bs4_ctx4k_hd128", "--backends", "triton"])
    assert len(rows) == 1 and "config" not in rows[0]
    assert "sweep skipped" in capsys.readouterr().err


def test_unknown_backend_is_rejected():
    with pytest.raises(SystemExit):
        ba.main(["--quick", "--backends", "nope"])


def test_budget_stops_new_workloads_and_records_them(tmp_path):
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", "--backends", "sdpa", "--budget-s", "-1",
                    "--workloads", "canvas_bs4_ctx4k_hd128,prefill16k_hd128"])
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    doc = json.loads((tmp_path / "attention-quick-cpu.json").read_text())
    assert doc["complete"] is True and doc["rows"][0]["reason"] == "time budget spent"


def test_tile_sweep_passes_configs_to_the_triton_backend(tmp_path):
    if ba.triton_config_kwarg() is None:
        pytest.skip("the triton backend takes no tile config here")
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", "--tile-sweep", "--backends", "triton",
                    "--tile-configs", json.dumps([cfg]), "--workloads", "canvas_bs4_ctx4k_hd128"])
    assert len(rows) == 2 and rows[1]["config"] == cfg
    assert rows[1]["status"] == "ok" and rows[1]["correct"] is True, rows[1]
    assert ba.label_of(rows[1]) == "triton[32,16,4,2]"
    # each triton row names the kernel that ran and its resolved tiles (the automatic choice's row included)
    for r in rows:
        assert r["impl"] == "triton" and r["num_splits"] >= 1, r
    assert {k: rows[1]["launch_config"][k] for k in cfg} == cfg
    assert set(rows[0]["launch_config"]) >= {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}


def test_tile_sweep_gives_cute_only_dicts_to_cute_alone(tmp_path):
    """--tile-configs dicts made of CuteConfig fields only ({"split_merge": ...}, {"nan_safe_v": ...}) time the cute
    backend, not the triton backend's tile sweep; a triton dict is the triton backend's alone."""
    assert ba._cute_only({"split_merge": "cluster"}) and ba._cute_only({"split_merge": "cluster", "num_splits": 4})
    assert ba._cute_only({"nan_safe_v": True}) and not ba._cute_only({"NAN_SAFE_V": True})
    assert not ba._cute_only({"num_splits": 2}) and not ba._cute_only({"BLOCK_M": 64})
    cfgs = [{"split_merge": "cluster"}, {"NAN_SAFE_V": False}]
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", "--tile-sweep", "--backends", "triton,cute",
                    "--tile-configs", json.dumps(cfgs), "--workloads", "canvas_bs4_ctx4k_hd128"])
    by = [(r["backend"], r.get("config")) for r in rows]
    assert ("cute", {"split_merge": "cluster"}) in by and ("triton", {"split_merge": "cluster"}) not in by
    if ba.triton_config_kwarg() is not None:
        assert ("triton", {"NAN_SAFE_V": False}) in by
    assert ("cute", {"NAN_SAFE_V": False}) not in by


def test_ladder_plot_one_png_per_layer_with_a_line_per_backend(tmp_path):
    """plot_ladder: batch ladder rows -> one PNG per layer type; context names with and without the k suffix
    parse; rows that are not ok, or a set that varies neither / both axes, give no ladder plot."""
    rows = []
    for layer in ("sliding", "hd128"):
        for n in (1, 2, 4):
            for be, ms in (("fa4", 0.1 * n), ("triton", 0.08 * n)):
                rows.append({"workload": f"canvas_bs{n}_ctx8k_{layer}", "backend": be, "status": "ok",
                             "graph_ms": ms, "effective_tflops": 100.0 * n})
    rows.append({"workload": "canvas_bs8_ctx8k_sliding", "backend": "cute", "status": "error", "graph_ms": None})
    paths = ba.plot_ladder(rows, tmp_path, "lad")
    assert sorted(p.name for p in paths) == ["lad-hd128.png", "lad-sliding.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    ctx = [{"workload": f"canvas_bs1_ctx{c}_hd128", "backend": "triton", "status": "ok", "graph_ms": 0.1,
            "effective_tflops": 1.0} for c in ("512", "1k", "2k")]
    assert [p.name for p in ba.plot_ladder(ctx, tmp_path, "c")] == ["c-hd128.png"]
    assert ba.plot_ladder([{"workload": "mixed_sliding_ctx8k", "backend": "triton", "status": "ok",
                            "graph_ms": 0.2}], tmp_path, "m") == []
    assert ba.plot_ladder(rows[:2], tmp_path, "one") == []   # a single batch size: not a ladder


@pytest.mark.parametrize("layouts,expect", [("contiguous", ["contiguous"]), ("paged", [None]),
                                            ("paged,contiguous", [None, "contiguous"])])
def test_blockdiff_layouts_time_exactly_the_requested_kv_layouts(tmp_path, layouts, expect):
    """--blockdiff-layouts contiguous timed the paged triton row too (it was yielded unconditionally); the
    reference (the --quick oracle) stays on the paged cache; every row is checked against the ground truth."""
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", "--backends", "reference,triton",
                    "--blockdiff-layouts", layouts, "--workloads", "canvas_bs4_ctx4k_hd128"])
    assert [r.get("kv_layout") for r in rows if r["backend"] == "triton"] == expect
    assert [r.get("kv_layout") for r in rows if r["backend"] == "reference"] == [None]
    assert all(r["status"] == "ok" and r["correct"] is True for r in rows), rows


def test_cute_configs_add_cute_rows_with_their_config(tmp_path):
    """--cute-configs: one extra cute row per CuteConfig dict (label names it); on the CPU the cute rows do not
    run (no GPU / CuTe DSL) and are recorded, the run goes on."""
    rows = ba.main(["--quick", "--out", str(tmp_path), "--no-plots", "--backends", "cute",
                    "--cute-configs", json.dumps([{"tile_n": 64}]), "--workloads", "canvas_bs4_ctx4k_hd128"])
    assert len(rows) == 2 and "config" not in rows[0] and rows[1]["config"] == {"tile_n": 64}
    assert ba.label_of(rows[1]) == "cute[64]"
    assert all(r["status"] in ("skipped", "error") for r in rows)
    with pytest.raises(SystemExit):
        ba.main(["--quick", "--cute-configs", '{"tile_n": 64}'])


@pytest.mark.parametrize("flags, word", [
    (["--tile-configs", "{bad"], "--tile-configs: not JSON"), (["--tile-configs", "5"], "--tile-configs: a JSON list"),
    (["--cute-configs", "[{"], "--cute-configs: not JSON"), (["--backends", "bogus"], "--backends: unknown"),
    (["--page-size", "0"], "--page-size must be"), (["--cpu-reps", "-1"], "--cpu-reps must be"),
    (["--budget-s", "nan"], "--budget-s must be"), (["--device", "bogus"], "--device must name"),
    (["--workloads", "no-such-workload"], "--workloads pattern")])
def test_flag_errors_exit_2_with_a_line_naming_the_flag(capsys, flags, word):
    """Were a JSONDecodeError / ValueError / RuntimeError traceback, exit 1 (--backends), or silently the default
    (--page-size 0)."""
    with pytest.raises(SystemExit) as e:
        ba.main(["--quick", "--no-plots", *flags])
    assert e.value.code == 2 and word in capsys.readouterr().err


@pytest.mark.parametrize("flags, word", [
    (["--page-size", str(10 ** 20)], "--page-size must be at most"), (["--seed", str(10 ** 20)], "--seed must be in"),
    (["--seed", "-1"], "--seed must be in"), (["--suite-name", "../../x"], "--suite-name must be"),
    (["--suite-name", ""], "--suite-name must be"), (["--suite-name", ".."], "--suite-name must be"),
    (["--device", "cuda:7"], "--device 'cuda:7' is not available"),
    (["--out", "/proc/no-such-folder"], "--out '/proc/no-such-folder' cannot be written")])
def test_flags_that_would_fail_every_workload_or_write_elsewhere_exit_2_before_the_run(tmp_path, capsys, monkeypatch,
                                                                                       flags, word):
    """Were: --page-size / --seed 10**20 an error row per workload with exit 0; --suite-name ../../x wrote the records
    outside the output folder ('' took the default silently); --device cuda without CUDA torch's AssertionError
    traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if "--out" not in flags:  # (a regression writes under tmp_path, '../../x' included)
        flags = [*flags, "--out", str(tmp_path / "a" / "b")]
    with pytest.raises(SystemExit) as e:
        ba.main(["--quick", "--no-plots", *flags])
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_an_out_that_is_a_file_exits_2_before_the_run(tmp_path, capsys):
    """Was: the run measured its first workload, then died writing the record with FileExistsError (exit 1)."""
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(SystemExit) as e:
            ba.main(["--quick", "--no-plots", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out {str(out)!r}" in err and "afile" in err


def test_full_shape_run_without_a_gpu_stops_with_a_message_naming_quick(tmp_path, monkeypatch):
    """Regression: without CUDA and without ``--quick`` the named workloads' full shapes (16k prefills, 32k
    contexts) ran on the CPU, the triton rows through the interpreter, for hours. It now stops naming ``--quick``;
    ``--device cpu`` still asks for it explicitly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        ba.main(["--workloads", "canvas_bs4_ctx4k_hd128", "--backends", "sdpa", "--out", str(tmp_path)])
    msg = str(e.value.code)
    assert "no CUDA GPU" in msg and "--quick" in msg, msg
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("exact", [True, "auto", False])
def test_cute_launch_records_the_key_weight(monkeypatch, exact):
    """A cute row's ``launch_config`` names its key weight (``exact_weight``: True, "auto" or False): a row without
    a config takes CuteConfig's default, which the record did not say (it listed the tiles and the other switches)."""
    from blockdiff.attention.cute import config as cc
    from blockdiff.attention.cute import interface as CA

    cfg = cc.CuteConfig(tile_m=128, tile_n=128, num_splits=1, lpt=False, exact_weight=exact)
    monkeypatch.setattr(CA, "LAST_LAUNCH", dict(kernel="FlashAttentionForwardSm90Mixed", config=cfg, kv_path="tma"))
    got = ba.cute_launch()
    assert got["launch_config"]["exact_weight"] == exact and got["num_splits"] == 1
    assert json.loads(json.dumps(got))["launch_config"]["exact_weight"] == exact
