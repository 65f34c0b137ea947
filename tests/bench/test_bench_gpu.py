"""GPU smoke of the benchmarks (run on the H200 with ``python3 -m pytest -m gpu tests/bench``): every backend
either measures correctly (eager and CUDA-graph times) or says why it was skipped; no installed backend errors
(a backend whose packages are missing here, e.g. flash-attn-4 / nvidia-cutlass-dsl for fa4 and cute, counts as
skipped even where the benchmark records its ImportError as an error row)."""
import importlib.util
import json

import pytest
import torch

from blockdiff.bench import bench_attention as ba
from blockdiff.bench import bench_e2e
from blockdiff.bench import common

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# packages each backend needs (import names); a backend whose packages are not all installed here is not
# measured: its rows count as skipped, whatever status the benchmark gave them. An installed backend's error fails.
BACKEND_PACKAGES = {"sdpa": (), "flex": (), "triton": ("triton",), "fa4": ("flash_attn.cute",),
                    "cute": ("flash_attn.cute", "cutlass")}


def missing_packages(backend: str) -> list[str]:
    out = []
    for name in BACKEND_PACKAGES.get(backend, ()):
        try:
            found = importlib.util.find_spec(name) is not None
        except Exception:  # noqa: BLE001 - a parent package that fails to import: not installed (usable) here
            found = False
        if not found:
            out.append(name)
    return out


def test_attention_small_mixed_batch_all_backends(tmp_path):
    # the named workloads with contexts / 8 (real heads, head dims, window, canvas): quick to run, same kernels
    rows = ba.main(["--suite", "small", "--out", str(tmp_path), "--no-plots", "--suite-name", "attention-gpu-test",
                    "--backends", "sdpa,flex,fa4,triton,cute", "--check-against", "reference",
                    "--workloads", "mixed_sliding_ctx8k,mixed_sliding_prefix_ctx8k,mixed_global_ctx8k"])
    not_installed = [(r["workload"], ba.label_of(r), missing_packages(r["backend"])) for r in rows
                     if r["status"] != "ok" and missing_packages(r["backend"])]
    if not_installed:
        print("not installed here (counted as skipped):", not_installed)
    errors = [(r["workload"], ba.label_of(r), r.get("error")) for r in rows
              if r["status"] == "error" and not missing_packages(r["backend"])]
    assert not errors, errors
    for r in rows:
        if missing_packages(r["backend"]):
            continue
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
