"""GPU smoke of the benchmarks (run on the H200 with ``python3 -m pytest -m gpu tests/bench``): every backend
either measures correctly (eager and CUDA-graph times) or says why it was skipped; nothing errors."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_attention as ba  # noqa: E402
import bench_e2e  # noqa: E402
import common  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_attention_small_mixed_batch_all_backends(tmp_path):
    # the named workloads with contexts / 8 (real heads, head dims, window, canvas): quick to run, same kernels
    rows = ba.main(["--suite", "small", "--out", str(tmp_path), "--no-plots", "--suite-name", "attention-gpu-test",
                    "--backends", "sdpa,flex,fa4,triton,cute", "--check-against", "reference",
                    "--workloads", "mixed_sliding_ctx8k,mixed_sliding_prefix_ctx8k,mixed_global_ctx8k"])
    errors = [(r["workload"], ba.label_of(r), r.get("error")) for r in rows if r["status"] == "error"]
    assert not errors, errors
    for r in rows:
        if r["status"] == "ok":
            assert r["correct"] is True, r
            assert r["eager_ms"] > 0 and (r["graph_ms"] or 0) > 0, (r["backend"], r.get("graph_error"))
        else:
            assert r["status"] == "skipped" and r["reason"]
    assert any(r["backend"] == "sdpa" and r["status"] == "ok" for r in rows)
    doc = json.loads((tmp_path / f"attention-gpu-test-{common.gpu_slug(common.gpu_name())}.json").read_text())
    assert doc["gpu"] != "cpu" and doc["driver"]


def test_timing_helpers_on_cuda():
    a = torch.randn(1024, 1024, device="cuda")
    eager = common.time_eager_ms(lambda: a @ a, "cuda", warmup=5, rep=20)
    graph = common.time_graph_ms(lambda: a @ a, warmup=5, rep=20)
    assert 0 < eager < 100 and 0 < graph < 100
    assert common.peak_extra_memory_bytes(lambda: a @ a, "cuda") >= 4 * 1024 * 1024


def test_e2e_tiny_model_on_cuda(tmp_path):
    rows = bench_e2e.main(["--quick", "--device", "cuda", "--batches", "1", "--no-warmup",
                           "--attn-backends", "triton", "--sampler-backend", "triton", "--out", str(tmp_path)])
    assert rows[0]["status"] == "ok", rows[0].get("error")
    assert rows[0]["denoise_steps"] == bench_e2e.DENOISING_STEPS and rows[0]["attention_share"] > 0
