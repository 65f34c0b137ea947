"""bench/bench_sampler_tp.py --quick on the CPU: 2 gloo ranks, tiny shapes; runs, self-checks, records rows."""
import json

from blockdiff.bench import bench_sampler_tp as bst


def test_quick_run_checks_and_writes_records(tmp_path, capsys):
    argv = ["--quick", "--backends", "reference", "--reps", "1", "--warmup", "0", "--out", str(tmp_path)]
    rows = bst.main(argv)
    doc = json.loads((tmp_path / "sampler_tp-quick-cpu.json").read_text())
    assert doc["argv"] == argv  # the command line (was: not recorded, so a record did not say how it was made)
    assert doc["checks"]["reference"]["ok"] is True
    by = {r["backend"]: r for r in doc["rows"]}
    assert set(by) == {"reference", "tp:reference", "tp:reference:local", "tp:comm"} and len(rows) == 4
    assert by["tp:reference"]["world_size"] == 2 and by["tp:reference"]["eager_ms"] > 0
    assert by["tp:comm"]["all_reduce_bytes"] == 2 * 16 * 64 * 4
    out = capsys.readouterr().out
    assert "check reference: OK" in out and out.rstrip().splitlines()[-1].startswith("tp:comm")


def test_rows_carry_a_status_and_a_failed_check_gives_no_speedup(tmp_path):
    """The rows had no status, so make_tables (which had no sampler_tp family either) rendered every cell of a
    sampler_tp record as '–'; and a TP step whose self-check failed still carried its speedup over 1 GPU."""
    from blockdiff.bench import make_tables

    def rows():
        return [dict(workload="sampler_n4", backend="fused", world_size=1, eager_ms=4.0),
                dict(workload="sampler_n4", backend="tp:fused", world_size=2, eager_ms=2.4, eager_ms_max_rank=2.5),
                dict(workload="sampler_n4", backend="tp:fused:local", world_size=2, eager_ms=2.0,
                     eager_ms_max_rank=2.1),
                dict(workload="sampler_n4", backend="tp:comm", world_size=2, eager_ms=0.2, eager_ms_max_rank=0.2),
                dict(workload="sampler_n4", backend="tp:reference", world_size=2, error="RuntimeError: x")]
    ok = bst.finish_rows(rows(), {"fused": {"ok": True}, "reference": {"ok": True}})
    assert [r["status"] for r in ok] == ["ok", "ok", "ok", "ok", "error"]
    assert ok[1]["speedup_vs_1gpu"] == 4.0 / 2.5 and "speedup_vs_1gpu" not in ok[2]
    bad = bst.finish_rows(rows(), {"fused": {"ok": False, "error": "AssertionError"}, "reference": {"ok": True}})
    assert bad[1]["status"] == "wrong" and "speedup_vs_1gpu" not in bad[1] and bad[2]["status"] == "wrong"
    (tmp_path / "sampler_tp-h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "suite": "sampler_tp",
                                                              "rows": ok}))
    text = make_tables.render(tmp_path)
    assert "| sampler_n4 | tp:fused | 2 | ok | 2.400 | 2.500 | 1.600 |" in text
