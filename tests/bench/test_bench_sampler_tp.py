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
