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


def test_step_cap_reaches_both_sides_and_records_of_different_caps_are_not_compared(tmp_path, capsys):
    """serve_smoke's --step-cap (parity_async runs at 3, where the canvases reach the cap and fuse): the client's
    vllm_xargs and the harness's SamplingParams carry it, the records say it, and two records of different caps
    (whose tokens are not comparable) are refused by ``compare`` (exit 2, one line) and kept as an error by
    ``record``. A record without the field ran at the old fixed cap (16)."""
    assert serve_smoke.vllm_xargs("req-0", False, 3)["diffusion_max_steps"] == 3
    assert serve_smoke.vllm_xargs("req-0", False)["diffusion_max_steps"] == serve_smoke.STEP_CAP == 16
    assert serve_smoke.diffusion_params(True, 2)["max_denoising_steps"] == 2
    for bad, err in ((0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("3", TypeError)):
        with pytest.raises(err, match="step_cap"):
            serve_smoke.diffusion_params(False, bad)
    a = _write(tmp_path / "a.json", _rows("ab"), step_cap=3)
    b = _write(tmp_path / "b.json", _rows("ab"))  # an older record: cap 16
    c = _write(tmp_path / "c.json", _rows("ab"), step_cap=16)
    assert serve_smoke.main(["compare", a, b]) == 2 and "different step caps (3 and 16)" in capsys.readouterr().err
    assert serve_smoke.main(["compare", b, c]) == 0
    rec = serve_smoke.record(str(tmp_path / "r.json"), [("caps", a, b), ("same", a, a)], required=["caps"])
    assert not rec["ok"] and "step caps" in rec["pairs"]["caps"]["error"] and rec["pairs"]["same"]["ok"]
    with pytest.raises(SystemExit):
        serve_smoke.main(["client", "--base-url", "http://127.0.0.1:1", "--model", "m", "--out", "o.json",
                          "--step-cap", "0"])
    assert "--step-cap: must be an int >= 1" in capsys.readouterr().err


def test_harness_runs_every_request_at_the_step_cap(tmp_path, monkeypatch):
    from blockdiff.integration.harness import HarnessRunner

    caps = []
    real_add = HarnessRunner.add_request

    def add_request(self, req_id, prompt, params=None, **kw):
        caps.append(params.max_denoising_steps)
        return real_add(self, req_id, prompt, params, **kw)
    monkeypatch.setattr(HarnessRunner, "add_request", add_request)
    rec = serve_smoke.run_harness(str(tmp_path / "h.json"), "cpu", "reference", "reference", False, "float32",
                                  step_cap=2)
    assert rec["step_cap"] == 2 and json.loads((tmp_path / "h.json").read_text())["step_cap"] == 2
    assert caps == [2] * len(rec["rows"]) and all(len(r["token_ids"]) > 0 for r in rec["rows"].values())


def test_step_cap_above_the_samplers_limit_is_refused_before_any_work(capsys):
    """Was: --step-cap 16384 passed serve_smoke's check (int >= 1), so the harness loaded the model and died in
    SamplingParams (max_denoising_steps must be in [1, 2**14)) and the client sent six requests the server refused.
    The cap is now checked against the sampler's limit, which serve_smoke mirrors without importing the sampler."""
    from blockdiff.sampler.params import MAX_STEPS

    assert serve_smoke.MAX_STEP_CAP == MAX_STEPS == 1 << 14
    assert serve_smoke.check_step_cap(MAX_STEPS - 1) == MAX_STEPS - 1
    with pytest.raises(ValueError, match=r"step_cap must be in \[1, 16384\)"):
        serve_smoke.check_step_cap(MAX_STEPS)
    with pytest.raises(SystemExit):
        serve_smoke.main(["harness", "--out", "h.json", "--step-cap", str(MAX_STEPS)])
    assert "--step-cap: must be an int >= 1 and below 16384" in capsys.readouterr().err


def test_a_prompt_only_one_side_has_is_compared_so_a_failed_server_request_never_passes(tmp_path):
    """compare_rows walked the first record's prompts only: a server request the first side lacked (here failed)
    was never looked at, and a required pair passed."""
    a = _write(tmp_path / "a.json", _rows("ab"))
    b_rows = {**_rows("ab"), "req-1": {"prompt": "x", "error": "HTTPError: 500"}}
    b = _write(tmp_path / "b.json", b_rows)
    rec = serve_smoke.record(str(tmp_path / "r.json"), [("p", a, b), ("q", b, a)], required=["p", "q"])
    assert not rec["ok"] and (rec["pairs"]["p"]["equal"], rec["pairs"]["p"]["of"]) == (1, 2)
    assert rec["pairs"]["p"]["rows"]["req-1"] == {"equal": False, "error": "HTTPError: 500"}
    assert (rec["pairs"]["q"]["equal"], rec["pairs"]["q"]["of"]) == (1, 2)
    rows = serve_smoke.compare_rows(_rows("ab"), {**_rows("ab"), "req-9": _rows("z")["req-0"]})
    assert list(rows) == ["req-0", "req-9"] and rows["req-9"] == {"equal": False, "error": "missing"}


@pytest.mark.parametrize("content", ["[1, 2]", "{bad", '{"rows": [1]}', '{"rows": {"req-0": "ab"}}', '{"x": 1}'])
def test_compare_and_record_of_a_file_that_is_no_record_exit_2_or_keep_it_as_the_pairs_error(tmp_path, capsys,
                                                                                             content):
    """Was: an AttributeError / KeyError traceback (exit 1) from compare, and from record, which lost every pair."""
    a = _write(tmp_path / "a.json", _rows("ab"))
    x = tmp_path / "x.json"
    x.write_text(content)
    assert serve_smoke.main(["compare", a, str(x)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serve_smoke compare:" in err[0] and "x.json" in err[0]
    assert serve_smoke.main(["compare", a, str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    rec = serve_smoke.record(str(tmp_path / "r.json"), [("ok", a, a), ("bad", a, str(x))], required=["ok"])
    assert rec["ok"] and rec["pairs"]["ok"]["equal"] == 1 and "x.json" in rec["pairs"]["bad"]["error"]


@pytest.mark.parametrize("cmd", ["client", "refusals"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "soon"])
def test_a_timeout_that_is_not_a_finite_positive_number_of_seconds_exits_2_before_any_request(tmp_path, capsys, cmd,
                                                                                               value):
    """Was: --timeout nan / 0 / -1 reached every request's socket, each recorded as a failed request, exit 0."""
    out = tmp_path / "o.json"
    with pytest.raises(SystemExit) as e:
        serve_smoke.main([cmd, "--base-url", "http://127.0.0.1:9", "--model", "m", "--out", str(out),
                          "--timeout", value])
    assert e.value.code == 2 and "--timeout" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("flag,value", [("--attn-backend", "trition"), ("--sampler-backend", "cute"),
                                        ("--attn-backend", "")])
def test_harness_backend_that_is_no_backend_exits_2_before_the_model_loads(tmp_path, capsys, flag, value):
    """Was: any string, refused by the attention / sampler registry only after the checkpoint loaded (a traceback,
    exit 1)."""
    with pytest.raises(SystemExit) as e:
        serve_smoke.main(["harness", "--out", str(tmp_path / "h.json"), flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err and not (tmp_path / "h.json").exists()


@pytest.mark.parametrize("cmd", [["harness"], ["client", "--base-url", "http://127.0.0.1:9", "--model", "m"],
                                 ["refusals", "--base-url", "http://127.0.0.1:9", "--model", "m"],
                                 ["record", "--pair", "p", "a.json", "b.json"]])
def test_an_out_that_names_a_folder_or_a_missing_folder_exits_2_before_any_work(tmp_path, capsys, cmd):
    """Was: the harness ran (or the server answered every request), then open(out, "w") raised IsADirectoryError /
    FileNotFoundError and the record was lost."""
    for out in (str(tmp_path), str(tmp_path / "new") + "/", "", str(tmp_path / "missing" / "o.json")):
        with pytest.raises(SystemExit) as e:
            serve_smoke.main([*cmd, "--out", out])
        assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
