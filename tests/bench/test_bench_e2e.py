"""bench/bench_e2e.py --quick on the CPU: a tiny DiffusionGemma through the harness, 16 denoise steps."""
import json

from blockdiff.bench import bench_e2e


def test_quick_e2e_runs_16_denoise_steps_and_records_shares(tmp_path):
    rows = bench_e2e.main(["--quick", "--batches", "2", "--no-warmup", "--out", str(tmp_path)])
    assert len(rows) == 1
    r = rows[0]
    assert r["status"] == "ok", r.get("error")
    assert r["denoise_steps"] == bench_e2e.DENOISING_STEPS
    assert r["tokens_emitted"] == r["expected_tokens"] == 2 * 16  # tiny canvas of 16, max_tokens = canvas
    assert r["denoise_step_ms"] > 0 and r["tokens_per_s"] > 0
    assert 0 < r["attention_share"] < 1 and 0 < r["sampler_share"] < 1
    assert r["attention_share"] + r["sampler_share"] < 1
    assert r["attention_calls_per_step"] == 4  # one per layer of the tiny model
    doc = json.loads((tmp_path / "e2e-quick-cpu.json").read_text())
    assert doc["denoising_steps"] == 16 and doc["rows"][0]["workload"] == "e2e_bs2_prompt24_steps16"
    assert {"gpu", "torch", "commit", "date"} <= set(doc)


def test_failing_backend_records_error_row(tmp_path):
    rows = bench_e2e.main(["--quick", "--batches", "1", "--no-warmup", "--attn-backends", "nope",
                           "--out", str(tmp_path)])
    assert rows[0]["status"] == "error" and "nope" in rows[0]["error"]


def test_missing_model_gives_a_clear_message(monkeypatch, capsys):
    def unavailable():
        raise bench_e2e.Unavailable("blockdiff.model is not in place (test)")

    monkeypatch.setattr(bench_e2e, "_imports", unavailable)
    assert bench_e2e.main(["--quick"]) == []
    assert "not run: blockdiff.model is not in place" in capsys.readouterr().out


def test_full_shape_config_is_diffusiongemma_26b_a4b():
    args = bench_e2e.parse_args(["--layers", "6"])
    cfg = bench_e2e.model_config(args)
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim, cfg.global_head_dim) == (
        2816, 262144, 16, 256, 512)
    assert cfg.window_size == 1023
    assert args.attn_backends == ["triton"] and args.sampler_backend == "triton" and args.prompt_len == 1024


def test_full_shape_run_without_a_gpu_stops_with_a_message_instead_of_filling_the_host(tmp_path, monkeypatch):
    """Regression: without CUDA and without ``--quick`` (e.g. the module docstring's plain
    ``python3 -m blockdiff.bench.bench_e2e``) the 26B-A4B-shaped model was initialised in float32 on the host:
    21 GiB at the default 6 layers, 94 GiB at 30, enough to exhaust a CPU machine. It now stops naming ``--quick``."""
    import pytest
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(["--out", str(tmp_path)])
    msg = str(e.value.code)
    assert "no CUDA GPU" in msg and "--quick" in msg and "21 GiB" in msg, msg
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_a_generation_that_is_not_the_workload_is_no_ok_row(tmp_path, monkeypatch):
    """A request that finished with 'error' (or early), fewer emitted tokens than batch x canvas, or other than 16
    denoise steps gave an ok row whose tokens/s counted only what was served."""
    ok = {"tokens_emitted": 512, "expected_tokens": 512, "denoise_steps": 16}
    assert bench_e2e.incomplete_reason(ok, ["length"]) is None
    assert "finish reasons ['error', 'length']" in bench_e2e.incomplete_reason(ok, ["error", "length"])
    assert "256 of 512 tokens" in bench_e2e.incomplete_reason(dict(ok, tokens_emitted=256), ["length"])
    assert "12 denoise steps" in bench_e2e.incomplete_reason(dict(ok, denoise_steps=12), ["length"])
    real = bench_e2e.summarise

    def short(steps, batch, canvas_length):  # as if one request of the batch emitted nothing
        out = real(steps, batch, canvas_length)
        return dict(out, tokens_emitted=out["tokens_emitted"] - canvas_length)

    monkeypatch.setattr(bench_e2e, "summarise", short)
    rows = bench_e2e.main(["--quick", "--batches", "2", "--no-warmup", "--out", str(tmp_path)])
    assert rows[0]["status"] == "incomplete" and "16 of 32 tokens emitted" in rows[0]["reason"]
