"""serve_smoke's ``record``: several comparisons in one JSON record, required pairs decide the exit status."""
from __future__ import annotations

import json

import pytest

from blockdiff.bench.experiments import serve_smoke


def _write(path, rows, **fields):
    path.write_text(json.dumps({"rows": rows, **fields}))
    return str(path)


def _rows(*texts):
    return {f"req-{i}": {"text": t, "token_ids": [ord(c) for c in t]} for i, t in enumerate(texts)}


def test_record_counts_equal_prompts_and_fails_only_on_a_required_pair_that_differs(tmp_path):
    a = _write(tmp_path / "a.json", _rows("ab", "cd"), sampled=False, dtype="float32")
    b = _write(tmp_path / "b.json", _rows("ab", "cx"), sampled=False, concurrent=True)
    out = tmp_path / "rec.json"
    rec = serve_smoke.record(str(out), [("same", a, a), ("diff", a, b)], required=["same"])
    assert rec["ok"] and rec["pairs"]["same"]["equal"] == 2 and rec["pairs"]["diff"]["equal"] == 1
    assert rec["pairs"]["diff"]["rows"]["req-1"]["first_diff_token"] == 1
    assert rec["pairs"]["diff"]["a_dtype"] == "float32" and rec["pairs"]["diff"]["b_concurrent"] is True
    assert json.loads(out.read_text())["env"]["commit"]
    assert serve_smoke.main(["record", "--out", str(out), "--pair", "diff", a, b, "--require", "diff"]) == 1
    assert serve_smoke.main(["record", "--out", str(out), "--pair", "diff", a, b]) == 0


def test_record_keeps_a_pair_whose_file_is_missing_as_an_error_and_a_required_one_fails(tmp_path):
    a = _write(tmp_path / "a.json", _rows("ab"))
    rec = serve_smoke.record(str(tmp_path / "r.json"), [("ok", a, a), ("gone", a, str(tmp_path / "none.json"))],
                             required=["gone"])
    assert not rec["ok"] and "error" in rec["pairs"]["gone"] and rec["pairs"]["ok"]["equal"] == 1


def test_record_refuses_duplicate_pair_names_and_required_names_of_no_pair(tmp_path):
    a = _write(tmp_path / "a.json", _rows("ab"))
    with pytest.raises(ValueError, match="pairs: names must be unique"):
        serve_smoke.record(str(tmp_path / "r.json"), [("x", a, a), ("x", a, a)])
    with pytest.raises(ValueError, match="required"):
        serve_smoke.record(str(tmp_path / "r.json"), [("x", a, a)], required=["y"])
