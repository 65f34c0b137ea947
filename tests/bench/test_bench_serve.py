"""bench/bench_serve.py on the CPU: vLLM 0.26's result JSON into rows, the GPU-memory sampler's process tree, the trace
classifier, the record with its goals and PNG, the benchmark's model folder, and the sweep / profile paths end to end
against stand-ins (tests/bench/serve_standins.py, tests/bench/fake_bench_serve.py). Tests marked so run the real
vLLM 0.26 client code where it is importable (``source tests/integration/vllm_cpu_env.sh 0.26.0``)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from blockdiff.bench import bench_serve as bs
from serve_standins import (BLOCKDIFF_CANVAS_STEP, STOCK_CANVAS_STEP, VLLM_CLIENT_CODE, FakeVllmServer,
                            synthetic_trace)

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "vllm_0_26_bench_serve_result.json"
FAKE_BENCH = f"{sys.executable} {HERE / 'fake_bench_serve.py'}"


def _vllm_026():
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return None
    return vllm if vllm.__version__.startswith("0.26.") else None


needs_vllm = pytest.mark.skipif(_vllm_026() is None, reason="vLLM 0.26's Python packages are not importable here")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dg26b")
    bs.write_model_folder(d)
    return d


# ---- vllm bench serve result -> row ----------------------------------------------------------------------------
def test_fixture_holds_the_fields_vllm_0_26_writes_and_the_row_reads_them():
    r = json.loads(FIXTURE.read_text())
    for k in ("completed", "failed", "num_prompts", "duration", "output_throughput", "total_token_throughput",
              "request_throughput", "max_concurrency", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms",
              "p99_ttft_ms", "mean_e2el_ms", "median_e2el_ms", "ttfts", "itls", "output_lens", "errors",
              "diffusion_steps_per_canvas", "diffusion_denoising_steps", "diffusion_committed_tokens"):
        assert k in r, k
    row = bs.row_from_result(r, backend="vllm", quant="fp8", max_num_seqs=16)
    assert row["workload"] == "serve_c4_fp8" and row["backend"] == "vllm" and row["status"] == "ok"
    assert (row["completed"], row["failed"], row["num_prompts"], row["max_num_seqs"]) == (8, 0, 8, 16)
    assert row["complete"] and row["output_tokens"] == row["expected_output_tokens"] == 8 * 512
    assert row["output_tok_s"] == r["output_throughput"] and row["duration_s"] == r["duration"]
    assert (row["ttft_ms"], row["ttft_median_ms"], row["ttft_p99_ms"]) == (r["mean_ttft_ms"], r["median_ttft_ms"],
                                                                           r["p99_ttft_ms"])
    assert row["e2e_ms"] == r["mean_e2el_ms"]
    assert row["diffusion_steps_per_canvas"] == 16 and row["steps_ok"]
    want = [1e3 * sum(itl) for itl in r["itls"]]  # 512 tokens: 2 canvases, one after the first
    assert row["time_per_canvas_ms"] == pytest.approx(sum(want) / len(want))
    # what vLLM's own numbers say: e2e latency = TTFT + the inter-chunk latencies, so the means agree
    assert row["e2e_ms"] - row["ttft_ms"] == pytest.approx(row["time_per_canvas_ms"], abs=0.01)  # two clock reads
    assert "reason" not in row and row["errors"] == []


def test_time_per_canvas_counts_canvases_after_the_first_and_skips_failed_requests():
    r = {"completed": 2, "failed": 1, "num_prompts": 3, "duration": 2.0, "output_throughput": 640.0,
         "max_concurrency": 3, "total_output_tokens": 1280, "mean_ttft_ms": 100.0,
         "ttfts": [0.1, 0.1, 0.0], "itls": [[0.2, 0.2], [0.3], []], "output_lens": [768, 512, 0],
         "errors": ["", "", "boom"]}
    row = bs.row_from_result(r, backend="blockdiff-triton", quant="bf16", max_num_seqs=4)
    assert row["time_per_canvas_ms"] == pytest.approx((200.0 + 300.0) / 2)   # (0.4 s / 2) and (0.3 s / 1)
    assert row["time_per_canvas_median_ms"] == pytest.approx(250.0)
    assert not row["complete"] and "1 of 3 requests lost" in row["reason"] and "boom" in row["reason"]
    assert row["steps_ok"] is None and row["diffusion_steps_per_canvas"] is None
    brief = {k: r[k] for k in ("completed", "failed", "num_prompts", "duration", "output_throughput",
                               "max_concurrency")} | {"mean_e2el_ms": 900.0, "mean_ttft_ms": 100.0}
    assert bs.row_from_result(brief, backend="vllm", quant="fp8", max_num_seqs=1)["time_per_canvas_ms"] == 800.0
    with pytest.raises(ValueError, match=r"lacks \['duration'\]"):
        bs.row_from_result({k: v for k, v in r.items() if k != "duration"}, backend="vllm", quant="fp8",
                           max_num_seqs=1)
    with pytest.raises(TypeError, match="result must be a dict"):
        bs.row_from_result([], backend="vllm", quant="fp8", max_num_seqs=1)


@pytest.mark.parametrize("detailed", [True, False])
def test_a_run_with_no_completed_request_has_no_latency_not_zero_ms(detailed):
    """vLLM 0.26's calculate_metrics writes np.mean(ttfts or 0) = 0 over no request: a run whose every request
    failed was recorded with ttft_ms / e2e_ms / time_per_canvas_ms 0.0 (a latency nobody measured)."""
    n = 8
    r = {"duration": 3.0, "completed": 0, "failed": n, "num_prompts": n, "max_concurrency": 4,
         "total_output_tokens": 0, "request_throughput": 0.0, "output_throughput": 0.0,
         "total_token_throughput": 0.0, "max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0,
         **{f"{s}_{m}_ms": 0.0 for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el")}}
    if detailed:
        r.update(output_lens=[0] * n, ttfts=[0.0] * n, itls=[[]] * n, start_times=[1.0] * n,
                 generated_texts=[""] * n, errors=["Bad Request"] * n)
    row = bs.row_from_result(r, backend="vllm", quant="fp8", max_num_seqs=16)
    for k in bs._LATENCY_FIELDS:
        assert row[k] is None, k
    assert row["output_tok_s"] == 0.0 and not row["complete"] and "8 of 8 requests lost" in row["reason"]
    # one completed request: its latencies are vLLM's, as before
    one = dict(r, completed=1, failed=n - 1, mean_ttft_ms=50.0, mean_e2el_ms=250.0)
    for k in ("ttfts", "itls", "output_lens", "errors", "generated_texts", "start_times"):
        one.pop(k, None)
    row = bs.row_from_result(one, backend="vllm", quant="fp8", max_num_seqs=16)
    assert (row["ttft_ms"], row["e2e_ms"], row["time_per_canvas_ms"]) == (50.0, 250.0, 200.0)


def test_row_summarizes_the_generated_texts_whose_tokens_decide_the_detokenizers_cost():
    """docs/tuning.md 7.19: a row says what the model's text looked like (a repeated <pad> decodes to nothing)."""
    r = {"completed": 3, "failed": 0, "num_prompts": 3, "duration": 1.0, "output_throughput": 1.0,
         "max_concurrency": 3, "generated_texts": ["", "ab\ufffd<unused_7><unused_9>", "\ufffd\ufffd"]}
    t = bs.row_from_result(r, backend="vllm", quant="fp8", max_num_seqs=1)["output_text"]
    assert t == {"requests": 3, "chars_median": 2, "empty": 1, "failed": 0, "replacement_chars": 3,
                 "unused_tokens": 2, "sample": ascii("ab\ufffd<unused_7><unused_9>")}
    # a failed request's text ("" in vLLM's result) is not an empty answer
    failed = bs.row_from_result(dict(r, errors=["boom", "", ""]), backend="vllm", quant="fp8", max_num_seqs=1)
    assert (failed["output_text"]["empty"], failed["output_text"]["failed"]) == (0, 1)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        bs.output_text_summary(["a", None])
    with pytest.raises(ValueError, match="sample_chars must be an int >= 0"):
        bs.output_text_summary(["a"], sample_chars=-1)
    long = bs.output_text_summary(["x" * 500])
    assert long["sample"] == ascii("x" * 80) and long["chars_median"] == 500
    assert "output_text" not in bs.row_from_result({k: v for k, v in r.items() if k != "generated_texts"},
                                                   backend="vllm", quant="fp8", max_num_seqs=1)
    assert bs.output_text_summary([])["chars_median"] is None
    with pytest.raises(TypeError, match="texts must be a list"):
        bs.output_text_summary("abc")


def test_bench_serve_args_are_the_setting():
    a = bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=16, num_prompts=32, num_warmups=4,
                            result_dir="/r", result_filename="x.json", seed=16)
    s = " ".join(a)
    for part in ("--dataset-name random", "--random-input-len 4096", "--random-output-len 512", "--ignore-eos",
                 "--max-concurrency 16", "--num-prompts 32", "--num-warmups 4", "--save-detailed",
                 "--percentile-metrics ttft,tpot,itl,e2el", "--result-dir /r", "--result-filename x.json"):
        assert part in s, part
    assert "--temperature" not in s  # the servers' defaults: generation_config.json
    # docs/tuning.md 7.19: <pad> commits of the random-weight model detokenize in linear time only when kept
    assert json.loads(a[a.index("--extra-body") + 1]) == {"skip_special_tokens": False}
    server_default = bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=1, num_prompts=1,
                                         num_warmups=0, result_dir="/r", result_filename="x.json",
                                         skip_special_tokens=None)
    assert "--extra-body" not in server_default
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool or None"):
        bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=1, num_prompts=1, num_warmups=0,
                            result_dir="/r", result_filename="x.json", skip_special_tokens="no")
    assert [bs.num_prompts_for(c) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert "--ready-check-timeout-sec" not in s
    skip = bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=2, num_prompts=2, num_warmups=0,
                               result_dir="/r", result_filename="x.json", ready_check_timeout_s=0)
    assert skip[skip.index("--ready-check-timeout-sec") + 1] == "0"
    assert bs.num_prompts_for(4, 3, 2) == 12


@needs_vllm
def test_vllm_0_26_parses_the_client_arguments():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=4, num_prompts=8,
                                          num_warmups=1, result_dir="/r", result_filename="x.json",
                                          metadata={"a": "b"}))
    assert (ns.random_input_len, ns.random_output_len, ns.max_concurrency, ns.num_prompts) == (4096, 512, 4, 8)
    assert ns.ignore_eos and ns.save_detailed and ns.backend == "openai" and ns.metadata == ["a=b"]
    assert ns.ready_check_timeout_sec == 0  # vLLM 0.26.0 sends no ready-check request unless asked
    assert ns.extra_body == {"skip_special_tokens": False}  # vLLM parses the JSON itself
    skip = bs.bench_serve_args(base_url="http://h:1", model="/m", concurrency=2, num_prompts=2, num_warmups=0,
                               result_dir="/r", result_filename="x.json", ready_check_timeout_s=0)
    assert p.parse_args(skip).ready_check_timeout_sec == 0  # a profile's trace holds only its load


# ---- server command line ---------------------------------------------------------------------------------------
def test_server_command_of_each_side():
    kw = dict(model="/tmp/dg26b", port=8041, max_num_seqs=16, kv_cache_bytes=8 << 30, gpu_memory_utilization=0.35)
    env, argv = bs.server_command("vllm", "fp8", trace_dir="/tmp/tr", **kw)
    s = " ".join(argv)
    assert env == {"VLLM_PLUGINS": "none", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/tmp/dg26b"]
    for part in ("--load-format dummy", "--language-model-only", "--quantization fp8",
                 "--attention-backend TRITON_ATTN", "--max-num-seqs 16", f"--kv-cache-memory-bytes {8 << 30}",
                 "--gpu-memory-utilization 0.35",
                 '--diffusion-config {"canvas_length":256,"max_denoising_steps":16}', "--block-size 64",
                 "--no-enable-prefix-caching", "--max-model-len 8192"):
        assert part in s, part
    assert "--no-async-scheduling" not in s  # vLLM's default on both sides
    graphs = json.loads(argv[argv.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
    assert graphs == [256 * k for k in range(1, 17)]
    prof = json.loads(argv[argv.index("--profiler-config") + 1])
    assert prof["profiler"] == "torch" and prof["torch_profiler_dir"] == "/tmp/tr" and prof["ignore_frontend"]
    env, argv = bs.server_command("blockdiff-cute", "bf16", enforce_eager=True, **kw)
    s = " ".join(argv)
    assert "--compilation-config" not in s
    _, sync = bs.server_command("blockdiff-triton", "bf16", async_scheduling=False, **kw)
    assert "--no-async-scheduling" in sync and sync[-1].endswith(".BlockdiffDiffusionScheduler")
    assert env["BLOCKDIFF_ATTN_BACKEND"] == "cute" and env["VLLM_PLUGINS"] == "blockdiff"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["BLOCKDIFF_SAMPLER_BACKEND"] == "triton"
    assert "--attention-backend CUSTOM" in s and "BlockdiffDiffusionAsyncScheduler" in s
    assert "--quantization" not in s and "--no-async-scheduling" not in s and "--enforce-eager" in s
    assert "BLOCKDIFF_PROFILE_COMPILES" not in env  # Triton's compile hooks only on a profiled blockdiff server
    assert "--api-server-count" not in argv  # vLLM's default, 1
    _, four = bs.server_command("vllm", "fp8", api_server_count=4, **kw)
    assert four[four.index("--api-server-count") + 1] == "4"
    with pytest.raises(ValueError, match="api_server_count"):
        bs.server_command("vllm", "fp8", api_server_count=0, **kw)
    env, _ = bs.server_command("blockdiff-cute", "fp8", trace_dir="/tmp/tr", **kw)
    assert env["BLOCKDIFF_PROFILE_COMPILES"] == "1"
    assert "--profiler-config" not in s
    for bad, match in ((dict(kw, port=0), "port must be"), (dict(kw, max_num_seqs=0), "max_num_seqs must be"),
                       (dict(kw, gpu_memory_utilization=1.5), "gpu_memory_utilization must be"),
                       (dict(kw, kv_cache_bytes=0), "kv_cache_bytes must be")):
        with pytest.raises(ValueError, match=match):
            bs.server_command("vllm", "fp8", **bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        bs.server_command("sglang", "fp8", **kw)
    with pytest.raises(ValueError, match="quant must be one of"):
        bs.server_command("vllm", "int4", **kw)
    with pytest.raises(ValueError, match="trace_dir must be an absolute path"):
        bs.profiler_config("rel/dir")


def test_the_live_load_format_loads_its_plugin_on_both_sides_and_nothing_else_changes():
    """docs/tuning.md 7.21: dummy_live comes from the blockdiff_bench general plugin, which stock vLLM must load too
    (and nothing else of blockdiff); the default stays the issue's dummy."""
    kw = dict(model="/m", port=8041, max_num_seqs=16, kv_cache_bytes=8 << 30, gpu_memory_utilization=0.35)
    for backend, plugins in (("vllm", "blockdiff_bench"), ("blockdiff-cute", "blockdiff,blockdiff_bench")):
        env, argv = bs.server_command(backend, "fp8", load_format="dummy_live", **kw)
        env0, argv0 = bs.server_command(backend, "fp8", **kw)
        assert argv[argv.index("--load-format") + 1] == "dummy_live" and env["VLLM_PLUGINS"] == plugins
        assert argv0[argv0.index("--load-format") + 1] == "dummy"
        assert [a for a in argv if a != "dummy_live"] == [a for a in argv0 if a != "dummy"]
        assert {k: v for k, v in env.items() if k != "VLLM_PLUGINS"} == {k: v for k, v in env0.items()
                                                                         if k != "VLLM_PLUGINS"}
    with pytest.raises(ValueError, match="load_format must be one of"):
        bs.server_command("vllm", "fp8", load_format="safetensors", **kw)


def test_rows_are_never_labelled_with_a_load_format_the_server_does_not_run(tmp_path):
    proc = tmp_path / "proc"
    for pid, argv in ((11, ["python3", "-m", "vllm", "serve", "/m", "--load-format", "dummy_live"]),
                      (12, ["python3", "serve", "--load-format=dummy"]), (13, ["python3", "stand_in.py", "serve", "8041"]),
                      (15, ["python3", "-m", "vllm", "serve", "/m"]),  # vLLM's default: auto, real weights
                      (16, ["vllm", "serve", "--load-format", "dummy", "--load_format", "dummy_live"]),  # last wins
                      (17, ["vllm", "serve", "--load_format=dummy_live"])):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert [bs.server_load_format(p, proc) for p in (11, 12, 13, 14, None, 15, 16, 17)] == [
        "dummy_live", "dummy", None, None, None, "auto", "dummy_live", "dummy_live"]
    bs.check_server_load_format("dummy_live", 11, proc)
    bs.check_server_load_format("dummy", 13, proc)  # no serve command line to compare with: the label stands
    with pytest.raises(ValueError, match="'dummy' does not match the server's --load-format 'dummy_live'"):
        bs.check_server_load_format("dummy", 11, proc)
    with pytest.raises(ValueError, match="'dummy' does not match the server's --load-format 'auto'"):
        bs.check_server_load_format("dummy", 15, proc)
    assert [bs.effective_load_format(v) for v in (None, "dummy", "dummy_live")] == ["dummy", "dummy", "dummy_live"]
    with pytest.raises(ValueError, match="load_format must be one of"):
        bs.effective_load_format("auto")

def test_rows_are_never_labelled_with_a_max_num_seqs_the_server_does_not_run(tmp_path):
    """docs/tuning.md 7.26: a c64 row was labelled max-num-seqs 16 (the script's default) against a server started
    with 64. sweep reads the server's --max-num-seqs from its command line and refuses a different label."""
    proc = tmp_path / "proc"
    for pid, argv in ((21, ["python3", "-m", "vllm", "serve", "/m", "--max-num-seqs", "64"]),
                      (22, ["vllm", "serve", "--max_num_seqs=8", "--max-num-seqs", "32"]),  # last wins
                      (23, ["vllm", "serve", "/m"]),  # absent: vLLM's default, not known here
                      (24, ["vllm", "serve", "--max-num-seqs", "many"])):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert [bs.server_max_num_seqs(p, proc) for p in (21, 22, 23, 24, 25, None)] == [64, 32, None, None, None, None]
    bs.check_server_max_num_seqs(64, 21, proc)
    bs.check_server_max_num_seqs(16, 23, proc)  # nothing to compare with: the label stands
    bs.check_server_max_num_seqs(None, 21, proc)
    with pytest.raises(ValueError, match="--max-num-seqs 16 does not match the server's --max-num-seqs 64"):
        bs.check_server_max_num_seqs(16, 21, proc)
    assert bs.server_argv(21, proc)[-2:] == ["--max-num-seqs", "64"] and bs.server_argv(99, proc) is None


def test_cudagraph_capture_sizes_cover_every_canvas_count():
    """Regression (first H200 serve): vLLM's default capture sizes stop at 512 tokens, so steps of 3+ canvases ran
    without CUDA graphs. Sizes are canvas multiples up to max_num_seqs canvases, within the token budget."""
    assert bs.cudagraph_capture_sizes(4, 16384) == [256, 512, 768, 1024]
    big = bs.cudagraph_capture_sizes(64, 16384)
    assert big[:16] == [256 * k for k in range(1, 17)] and big[-1] == 16384 and len(big) == 16 + 8 + 8
    assert all(b % 256 == 0 for b in big) and big == sorted(set(big))
    assert bs.cudagraph_capture_sizes(64, 4096)[-1] == 4096
    with pytest.raises(ValueError, match="max_num_seqs"):
        bs.cudagraph_capture_sizes(0, 4096)


def test_server_cmd_prints_a_shell_line(capsys):
    assert bs.main(["server-cmd", "--backend", "blockdiff-triton", "--quant", "fp8", "--model", "/m", "--port", "8042",
                    "--max-num-seqs", "64", "--kv-cache-gib", "28", "--gpu-memory-utilization", "0.6",
                    "--trace-dir", "/tmp/tr"]) == 0
    line = capsys.readouterr().out.strip()
    parts = shlex.split(line)
    assert parts[0] == "env" and "BLOCKDIFF_ATTN_BACKEND=triton" in parts
    assert parts[parts.index("--kv-cache-memory-bytes") + 1] == str(28 << 30)
    assert "--api-server-count" not in parts
    assert bs.main(["server-cmd", "--backend", "vllm", "--quant", "fp8", "--model", "/m", "--port", "8041",
                    "--max-num-seqs", "64", "--kv-cache-gib", "28", "--gpu-memory-utilization", "0.6",
                    "--api-server-count", "4"]) == 0
    parts = shlex.split(capsys.readouterr().out.strip())
    assert parts[parts.index("--api-server-count") + 1] == "4"


@needs_vllm
def test_vllm_0_26_engine_arguments_accept_the_server_flags(monkeypatch):
    """The flags parse with vLLM 0.26's own engine-argument parser (on the CPU platform: the parser's defaults need
    one) into its configs."""
    import vllm.platforms
    from vllm.config import DiffusionConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    p = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    p.add_argument("--port", type=int)
    for backend in ("vllm", "blockdiff-triton"):
        _, argv = bs.server_command(backend, "fp8", model="/tmp/dg26b", port=8041, max_num_seqs=16,
                                    kv_cache_bytes=8 << 30, gpu_memory_utilization=0.35, trace_dir="/tmp/tr")
        rest = argv[argv.index("serve") + 2:]
        ns = p.parse_args(["--model", "/tmp/dg26b", *rest])
        assert ns.load_format == "dummy" and ns.kv_cache_memory_bytes == 8 << 30 and ns.enable_prefix_caching is False
        assert ns.quantization == "fp8" and ns.max_num_seqs == 16 and ns.async_scheduling is True
        assert ns.block_size == 64 and ns.compilation_config.cudagraph_capture_sizes[-1] == 16 * 256
        dc = DiffusionConfig(**ns.diffusion_config)
        assert (dc.max_denoising_steps, dc.canvas_length) == (16, 256)
        assert ns.profiler_config.profiler == "torch" and ns.profiler_config.torch_profiler_dir == "/tmp/tr"
        assert ns.profiler_config.ignore_frontend and not ns.profiler_config.torch_profiler_with_stack
        assert ns.attention_backend == ("TRITON_ATTN" if backend == "vllm" else "CUSTOM")


# ---- the model folder ------------------------------------------------------------------------------------------
def test_model_folder_sets_16_fixed_steps(model_dir):
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["max_denoising_steps"] == 16 and gen["stability_threshold"] == 16
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["canvas_length"] == 256 and cfg["text_config"]["num_hidden_layers"] == 30
    assert not (model_dir / "model.safetensors").exists()
    from blockdiff.model import load_generation_config

    # blockdiff's reading: no canvas converges before step 16 (stable_count <= s < 16 = k at step s < 16)
    assert load_generation_config(str(model_dir))["stability_threshold"] >= bs.DENOISING_STEPS


def test_random_dataset_prompts_round_trip_to_4096_tokens(model_dir):
    """vLLM's random dataset draws consecutive ids of the vocabulary (nearly all ``<unused_N>``), decodes them and
    re-encodes; with the byte tokenizer the text re-encodes byte by byte, so it truncates and converges to exactly
    the asked length (RandomDataset's gen_prompt_decode_to_target_len loop, with transformers' tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.vocab_size == 262144 and sorted(tok.all_special_ids) == [0, 1, 2]
    ids = [(123_457 + i) % (262144 - 3) + 3 for i in range(4096)]
    for _ in range(3):
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == 4096:
            break
        ids = ids[:4096]
    assert len(ids) == 4096 and len(tok.encode(text)) == 4096 and text.startswith("<unused_")


@needs_vllm
def test_vllm_0_26_random_dataset_and_generation_config(model_dir):
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.transformers_utils.config import try_get_generation_config

    tok = get_tokenizer(str(model_dir))
    reqs = RandomDataset(random_seed=3).sample(tok, 3, input_len=4096, output_len=512, range_ratio=0.0)
    assert [r.prompt_len for r in reqs] == [4096] * 3
    assert all(len(tok.encode(r.prompt)) == 4096 and r.expected_output_len == 512 for r in reqs)
    gen = try_get_generation_config(str(model_dir), trust_remote_code=False).to_diff_dict()
    assert gen["max_denoising_steps"] == 16 and gen["stability_threshold"] == 16  # stock reads both at start-up
    assert "EntropyBound" in gen["sampler_config"]["_cls_name"] and gen["sampler_config"]["entropy_bound"] > 0


# ---- GPU memory of the server's process tree -------------------------------------------------------------------
def test_process_tree_follows_children_and_the_session():
    table = {100: (1, 100), 101: (100, 100), 102: (101, 100), 103: (1, 100), 104: (102, 104), 200: (1, 200),
             201: (200, 200)}
    assert bs.process_tree(100, table) == {100, 101, 102, 103, 104}  # 104: a child that made its own session
    assert bs.process_tree(101, table) == {101, 102, 104}  # not a session leader: descendants only
    assert bs.process_tree(999, table) == {999}


def test_read_proc_table_parses_stat_lines(tmp_path):
    for pid, stat in ((7, "7 (python3 (x) y) S 1 7 7 0"), (8, "8 (sh) R 7 7 7 0"), (9, "9 (z")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    (tmp_path / "self").mkdir()
    assert bs.read_proc_table(tmp_path) == {7: (1, 7), 8: (7, 7)}
    me = bs.read_proc_table()
    assert me[os.getpid()][0] == os.getppid()


def test_parse_compute_apps():
    text = "123, 1024\n456, [N/A]\n123, 10\nbogus\n789 , 2.5\n"
    assert bs.parse_compute_apps(text) == {123: 1034 << 20, 789: int(2.5 * 2**20)}


def _fake_smi(tmp_path, lines: str, gpu_mib: int = 4096) -> list[str]:
    script = tmp_path / "fake_smi.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        if any(a.startswith("--query-compute-apps") for a in sys.argv):
            print({lines!r}, end="")
        else:
            print("{gpu_mib}")
    """))
    return [sys.executable, str(script)]


def test_memory_sampler_sums_the_server_tree(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        smi = _fake_smi(tmp_path, f"{os.getpid()}, 1000\n{child.pid}, 24\n{2**22 + 7}, 5\n")
        with bs.MemorySampler(os.getpid(), interval_s=0.05, smi=smi) as m:
            pass
        r = m.result()
        assert r["peak_memory_bytes"] == 1024 << 20 and r["gpu_memory_used_peak_bytes"] == 4096 << 20
        assert r["memory_pids"]["matched"] == sorted([os.getpid(), child.pid]) and r["memory_samples"] >= 1
        # another pid namespace: nothing matches, the whole GPU is still measured
        with bs.MemorySampler(os.getpid(), interval_s=0.05, smi=_fake_smi(tmp_path, "4194311, 5\n")) as m:
            pass
        r = m.result()
        assert r["peak_memory_bytes"] is None and r["memory_pids"]["seen"] == [4194311]
        assert r["gpu_memory_used_peak_bytes"] == 4096 << 20
        with bs.MemorySampler(None, interval_s=0.05, smi=[str(tmp_path / "missing-smi")]) as m:
            pass
        assert m.result()["memory_error"] and m.result()["peak_memory_bytes"] is None
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        bs.MemorySampler(1, interval_s=0)


def _fake_proc(root, procs):
    """A /proc with processes pid -> (ppid, sid, name, {tid: (thread name, utime, stime)})."""
    for pid, (ppid, sid, name, threads) in procs.items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {sid} 0 0\n")
        (d / "comm").write_text(name + "\n")
        for tid, (tname, ut, st) in threads.items():
            (d / "task" / str(tid)).mkdir(exist_ok=True)
            fields = ["S", str(ppid)] + ["0"] * 9 + [str(ut), str(st)] + ["0"] * 5
            (d / "task" / str(tid) / "stat").write_text(f"{tid} ({tname}) " + " ".join(fields) + "\n")


def test_host_cpu_sampler_names_the_saturated_thread(tmp_path, monkeypatch):
    """docs/tuning.md 7.13: the load's end lay 15 s after the GPU's last kernel; which host thread was busy there
    is what the sampler records (per process, per thread, per sample)."""
    api = {10: ("vllm", 0, 0), 11: ("asyncio_0", 0, 0)}
    core = {20: ("VLLM::EngineCor", 0, 0), 21: ("zmq_out", 0, 0)}
    _fake_proc(tmp_path, {10: (1, 10, "vllm", api), 20: (10, 10, "VLLM::EngineCor", core),
                          30: (1, 30, "other", {30: ("other", 0, 0)})})
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(bs.time, "time", lambda: next(clock))
    cpu = bs.HostCpuSampler(10, proc_root=tmp_path, clock_ticks=100)
    cpu.sample()
    _fake_proc(tmp_path, {10: (1, 10, "vllm", {10: ("vllm", 95, 3), 11: ("asyncio_0", 10, 0)}),
                          20: (10, 10, "VLLM::EngineCor", {20: ("VLLM::EngineCor", 40, 0), 21: ("zmq_out", 5, 0)})})
    cpu.sample()
    _fake_proc(tmp_path, {10: (1, 10, "vllm", {10: ("vllm", 150, 3), 11: ("asyncio_0", 20, 0)}),
                          20: (10, 10, "VLLM::EngineCor", {20: ("VLLM::EngineCor", 140, 0), 21: ("zmq_out", 5, 0)})})
    cpu.sample()
    r = cpu.result(series=True)
    assert r["wall_s"] == 2.0 and r["samples"] == 2
    assert r["processes"]["vllm[10]"] == {"cpu_s": 1.73, "share": 0.865, "saturated_share": 0.5}
    assert r["processes"]["VLLM::EngineCor[20]"] == {"cpu_s": 1.45, "share": 0.725, "saturated_share": 0.5}
    assert "other[30]" not in r["processes"]  # not in the server's tree
    assert r["top_threads"][0] == {"process": "vllm[10]", "thread": "vllm", "tid": 10, "cpu_s": 1.53, "share": 0.765}
    assert r["series"][0] == [101.0, {"vllm[10]": (0.98, 1.08), "VLLM::EngineCor[20]": (0.4, 0.45)}]
    tail = bs.host_cpu_between(r["series"], 101.5, 102.0)
    assert tail == {"samples": 1, "VLLM::EngineCor[20]": {"busiest": 1.0, "total": 1.0},
                    "vllm[10]": {"busiest": 0.55, "total": 0.65}}
    assert bs.host_cpu_between(r["series"], 200, 300) == {"samples": 0}
    assert bs.HostCpuSampler(None).result() == {}
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        bs.HostCpuSampler(1, interval_s=0)


def test_host_cpu_sampler_reads_this_process():
    """The real /proc: this process's CPU between two samples taken around a busy loop (explicit samples, so a
    loaded machine's thread scheduling does not decide the count), and the thread runs in a ``with`` block."""
    cpu = bs.HostCpuSampler(os.getpid())
    cpu.sample()
    # busy until this process has used 0.3 s of CPU (not 0.3 s of wall time: with the other pytest-xdist worker
    # and its subprocesses on the same cores, a wall-clock loop may get far less)
    t, deadline = time.process_time(), time.monotonic() + 60
    while time.process_time() - t < 0.3 and time.monotonic() < deadline:
        pass
    cpu.sample()
    r = cpu.result()
    key = next(k for k in r["processes"] if k.endswith(f"[{os.getpid()}]"))
    assert r["processes"][key]["cpu_s"] > 0.1 and r["samples"] == 1
    with bs.HostCpuSampler(os.getpid(), interval_s=0.02) as cpu:
        time.sleep(0.1)
    assert cpu.result()["samples"] >= 1


# ---- profile trace classifier ----------------------------------------------------------------------------------
def test_classify_kernel_names():
    """Every cute kernel (the hd-512 WideV ones too, whose CUTLASS names the GEMM rule would catch) counts as
    attention: 2026-12-02's first cute serving profile put WideVSplit under gemm."""
    cases = {"_attn_fwd_gluon_roles": "attention", "_attn_fwd_kernel": "attention", "_merge_kernel": "attention",
             "kernel_unified_attention": "attention", "reduce_segments": "attention",
             "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "attention",
             "kernel_cutlass_FlashAttentionForwardSm90Mixed_0": "attention",
             "kernel_cutlass_kernel_flash_attncuteflash_fwd_combineFlashAttentionForwardCombine_o": "attention",
             "kernel_cutlass_kernel_blockdiffattentioncutekernel_splitFlashAttentionForwardSm90MixedSplit": "attention",
             "kernel_cutlass_kernel_blockdiffattentioncutekernel_clusterFlashAttentionForwardSm90MixedCluster":
                 "attention",
             "kernel_cutlass_kernel_blockdiffattentioncutekernel_widevFlashAttentionForwardSm90WideV_obj": "attention",
             "kernel_cutlass_kernel_blockdiffattentioncutekernel_splitFlashAttentionForwardSm90WideVSplit": "attention",
             "kernel_cutlass_kernel_blockdiffattentioncutekernel_rolesFlashAttentionForwardSm90Roles_obj": "attention",
             "_batch_work_order_kernel": "attention",  # the cute work order's permutation (hd-512 default)
             "void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t>>": "gemm",
             "_stats_kernel": "sampler", "_step_kernel": "sampler", "_prob_chunk_kernel": "sampler",
             "fused_moe_kernel": "moe", "void vllm::moe::topkGatingSoftmax<4>": "moe",
             "void vllm::moe::moe_align_block_size_kernel<int>": "moe",
             "cutlass::device_kernel<GemmUniversal<GroupProblemShape<>>>": "moe",
             "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
             "void vllm::dynamic_per_token_scaled_fp8_quant_kernel<>": "gemm",
             "triton_red_fused_add_mean_mul_pow_rsqrt_0": "rest", "Memcpy HtoD (Pinned -> Device)": "rest",
             "void at::native::vectorized_elementwise_kernel<4>": "rest"}
    for name, bucket in cases.items():
        assert bs.classify_kernel(name) == (bucket, True), name
    assert bs.classify_kernel("some_new_kernel_nobody_knows") == ("rest", False)
    assert {b for b, _, _ in bs.KERNEL_RULES} == set(bs.BUCKETS)


def test_parse_step_annotation():
    assert bs.parse_step_annotation("execute_context_1(4096)_generation_0(0)") == 4096
    assert bs.parse_step_annotation("execute_context_0(0)_generation_2(512)") == 512
    assert bs.parse_step_annotation("execute_4352_context_1(sq4096sk4096sqsq1sqsk2)_generation_1(sq256sk4352sqsq3"
                                    "sqsk4)") == 4352
    assert bs.parse_step_annotation("aten::mm") is None
    assert bs.parse_step_counts("execute_4352_context_1(sq4096sk4096sqsq1sqsk2)_generation_1(sq256sk4352sqsq3"
                                "sqsk4)") == (1, 4096, 1, 256)
    assert bs.parse_step_counts("aten::mm") is None


def test_a_prompt_step_within_the_canvas_token_limit_is_not_a_canvas_step():
    """A profile of 64 requests allows canvas steps up to 64 x 256 tokens, so a 4096-token prompt step (a multiple
    of 256) fits the size rule: the annotation's prefill count keeps it out of the canvas steps (a prompt step that
    also holds canvases counts as mixed)."""
    def ann(ctx_n, ctx_t, gen_n, gen_t, t):
        return {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": t, "dur": 100.0,
                "name": f"execute_context_{ctx_n}({ctx_t})_generation_{gen_n}({gen_t})"}
    ev = [ann(1, 4096, 0, 0, 0.0), ann(0, 0, 16, 4096, 1000.0), ann(1, 4096, 4, 1024, 2000.0),
          ann(0, 0, 64, 16384, 3000.0)]
    for i in range(4):
        ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "pid": 0, "tid": 7, "ts": 1000.0 * i + 5,
                   "dur": 10.0 * (i + 1), "args": {"correlation": 100 + i}})
    s = bs.summarize_trace(ev, max_canvases=64)
    assert (s["steps"], s["canvas_steps"], s["prefill_steps"], s["mixed_steps"]) == (4, 2, 2, 1)
    assert s["canvas_step_tokens"] == [4096, 16384]
    assert s["canvas_step_ms"]["moe"] == pytest.approx((0.02 + 0.04) / 2)
    assert s["prefill_step_ms"]["moe"] == pytest.approx((0.01 + 0.03) / 2)


@pytest.mark.parametrize("graph_steps", [True, False])
def test_summarize_trace_buckets_per_canvas_step(graph_steps):
    steps = [(None, [("Memset (Device)", 0.5, "forward")]), (8192, [("fused_moe_kernel", 30.0, "forward"),
                                                                     ("nvjet_big", 5.0, "forward")])]
    steps += [(512, STOCK_CANVAS_STEP)] * 4
    s = bs.summarize_trace(synthetic_trace(steps, graph_steps=graph_steps)["traceEvents"], max_canvases=2)
    assert (s["steps"], s["canvas_steps"], s["prefill_steps"], s["canvas_step_tokens"]) == (5, 4, 1, [512])
    cm = s["canvas_step_ms"]
    assert cm["attention"] == pytest.approx(0.32) and cm["moe"] == pytest.approx(4.03)
    assert cm["gemm"] == pytest.approx(0.80 + 0.05 + 0.40)  # dense FP8 GEMM + its quantisation + the LM head
    assert cm["sampler"] == pytest.approx(0.20 + 1.50 + 0.60)  # softcap, compiled step, its soft-embedding matmul
    assert cm["rest"] == pytest.approx(0.11) and cm["total"] == pytest.approx(sum(k[1] for k in STOCK_CANVAS_STEP))
    assert s["prefill_step_ms"]["moe"] == pytest.approx(30.0) and s["outside_ms"] == pytest.approx(0.5)
    assert s["unknown_ms"] == pytest.approx(0.04) and s["unknown_kernels"][0][0] == "some_new_kernel_nobody_knows"
    assert 0 < s["unknown_share"] < 0.01 and sum(s["canvas_step_share"].values()) == pytest.approx(1.0)
    assert s["top_kernels"]["moe"][0][0] == "fused_moe_kernel"
    assert s["phase_ms"]["no_launch"] == 0 and s["phase_ms"]["sample"] == pytest.approx(4 * 2.7)
    b = bs.summarize_trace(synthetic_trace([(256, BLOCKDIFF_CANVAS_STEP)] * 3)["traceEvents"], max_canvases=1)
    bm = b["canvas_step_ms"]
    assert bm["attention"] == pytest.approx(0.12) and bm["sampler"] == pytest.approx(0.2 + 0.4 + 0.2 + 0.3 + 0.05)
    assert bm["gemm"] == pytest.approx(1.2) and b["unknown_ms"] == 0


def test_summarize_trace_timeline_measures_gpu_idle_and_the_hosts_step_cadence():
    """Three 256-token steps 10 ms apart; kernels busy 3 + 6 + 1 ms with gaps of 8.9 and 4 ms (times in us)."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(256)", "ts": t,
           "dur": 1000} for t in (0, 10000, 20000)]
    for ts, dur in ((100, 2000), (2100, 1000), (12000, 6000), (22000, 1000)):
        ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": ts, "dur": dur})
    t = bs.summarize_trace(ev, max_canvases=1)["timeline"]
    assert t["gpu_span_ms"] == pytest.approx(22.9) and t["gpu_busy_ms"] == pytest.approx(10.0)
    assert t["gpu_busy_share"] == pytest.approx(10.0 / 22.9) and t["idle_gaps_over_1ms"] == 2
    assert t["idle_gaps_over_1ms_total_ms"] == pytest.approx(12.9) and t["idle_gap_max_ms"] == pytest.approx(8.9)
    assert t["canvas_step_cadence_median_ms"] == pytest.approx(10.0)


def test_idle_gaps_are_attributed_to_the_cpu_events_and_step_positions_around_them():
    """Kernels busy 0-2 ms, 5-6 ms and 20-21 ms (gaps 2-5 and 6-20 ms); a prefill step annotation 0-3 ms, a canvas
    step 10-12 ms; on the worker thread an aten::item 2.5-4.5 ms (partly inside the first gap) and a scheduler
    annotation 13-15 ms inside the second gap; a thread name from the trace's metadata."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_1(4096)_generation_0(0)", "ts": 0,
           "dur": 3000, "pid": 1, "tid": 2},
          {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(256)", "ts": 10000,
           "dur": 2000, "pid": 1, "tid": 2},
          {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 2500, "dur": 2000, "pid": 1, "tid": 2},
          {"ph": "X", "cat": "user_annotation", "name": "schedule", "ts": 13000, "dur": 2000, "pid": 1, "tid": 3},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "engine"}}]
    for ts, dur in ((0, 2000), (5000, 1000), (20000, 1000)):
        ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": ts, "dur": dur})
    ia = bs.summarize_trace(ev, max_canvases=1)["timeline"]["idle_attribution"]
    assert ia["gaps"] == 2 and ia["total_ms"] == pytest.approx(3.0 + 14.0)
    assert ia["by_position"] == {"in_step": pytest.approx(3.0), "between_steps": pytest.approx(14.0)}
    assert ia["after_step_kind"] == {"prefill": pytest.approx(17.0)}  # the second gap starts before step 2
    labels = {n: ms for n, ms, _ in ia["cpu_labels"]}
    assert labels == {"step:prefill": pytest.approx(1.0), "step:canvas": pytest.approx(2.0),
                      "aten::item": pytest.approx(2.0), "schedule": pytest.approx(2.0)}
    # covered: 2.0-4.5 in gap 1 (2.5 ms), 10-12 and 13-15 in gap 2 (4 ms)
    assert ia["covered_ms"] == pytest.approx(6.5) and ia["uncovered_ms"] == pytest.approx(10.5)
    assert ia["threads"]["engine"] == pytest.approx(2.0) and ia["threads"]["2"] == pytest.approx(5.0)
    longest = ia["longest"][0]
    assert longest["ms"] == pytest.approx(14.0) and longest["at_ms"] == pytest.approx(6.0)
    assert longest["position"] == "between_steps" and longest["step"]["kind"] == "prefill"
    assert longest["next_step"] == {"kind": "canvas", "tokens": 256, "prefill_requests": 0, "canvas_requests": 1}
    assert ia["longest"][1]["position"] == "in_step"
    short = bs.summarize_trace(ev, max_canvases=1, min_gap_us=5000.0)["timeline"]["idle_attribution"]
    assert short["gaps"] == 1 and short["by_position"]["in_step"] == 0.0


def test_kernels_without_their_launch_are_classified_by_name():
    ev = synthetic_trace([(256, [("nvjet_x", 1.0, "sample"), ("nvjet_y", 2.0, "sample"), ("_step_kernel", 0.5,
                                                                                          "sample")])])["traceEvents"]
    ev = [e for e in ev if e.get("cat") not in ("cuda_runtime", "cuda_driver")]  # the launches lost
    s = bs.summarize_trace(ev, max_canvases=1)
    assert s["phase_ms"]["no_launch"] == pytest.approx(3.5) and s["canvas_step_ms"]["gemm"] == pytest.approx(3.0)
    assert s["canvas_step_ms"]["sampler"] == pytest.approx(0.5)


def test_summarize_trace_refuses_traces_without_steps_or_kernels(tmp_path):
    with pytest.raises(ValueError, match="no execute_"):
        bs.summarize_trace([{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1}])
    with pytest.raises(ValueError, match="no GPU kernel"):
        bs.summarize_trace(synthetic_trace([(256, [])])["traceEvents"])
    bad = tmp_path / "a.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="no usable trace"):
        bs.summarize_traces([bad])


# ---- sweep and profile end to end against stand-ins -----------------------------------------------------------
def _read(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_sweep_with_a_stand_in_client(tmp_path, monkeypatch, capsys):
    rows = tmp_path / "rows.jsonl"
    smi = _fake_smi(tmp_path, f"{os.getpid()}, 2000\n")
    argv = ["sweep", "--base-url", "http://127.0.0.1:9", "--model", "/tmp/dg26b", "--backend", "blockdiff-triton",
            "--quant", "fp8", "--concurrency", "1,4", "--max-num-seqs", "64", "--server-pid", str(os.getpid()),
            "--rows", str(rows), "--bench-cmd", FAKE_BENCH, "--nvidia-smi", " ".join(smi),
            "--work-dir", str(tmp_path / "w"), "--memory-interval", "0.05"]
    assert bs.main(argv) == 0
    lines = _read(rows)
    assert "env" in lines[0] and lines[0]["env"]["backend"] == "blockdiff-triton" and "vllm" in lines[0]["env"]
    assert lines[0]["env"]["warm_up"]["concurrency"] == 64 and lines[0]["env"]["warm_up"]["ok"]
    assert lines[0]["env"]["warm_up"]["output_len"] == bs.CANVAS_LENGTH  # one canvas (docs/tuning.md 7.13)
    assert (tmp_path / "w" / "warm_c64_fp8-blockdiff-triton.json").exists()
    r1, r4 = lines[1:]
    assert (r1["workload"], r4["workload"], r1["num_prompts"], r4["num_warmups"]) == ("serve_c1_fp8", "serve_c4_fp8",
                                                                                      8, 4)
    assert r1["complete"] and r1["peak_memory_bytes"] == 2000 << 20 and r1["time_per_canvas_ms"] == 250.0
    assert r1["load_format"] == r4["load_format"] == "dummy" and lines[0]["env"]["setting"]["load_format"] == "dummy"
    assert "serve_c4_fp8" in capsys.readouterr().out  # the summary table
    monkeypatch.setenv("FAKE_BENCH_FAILED", "2")
    assert bs.main(argv[:-2] + ["--concurrency", "16"]) == 1
    lost = _read(rows)[-1]
    assert lost["num_prompts"] == 32 and lost["failed"] == 2 and not lost["complete"] and "fake" in lost["reason"]
    assert bs.main(argv + ["--concurrency", "8", "--deadline-s", "0"]) == 1
    late = _read(rows)[-1]
    assert late["status"] == "skipped" and "deadline" in late["reason"]
    monkeypatch.setenv("FAKE_BENCH_EXIT", "3")
    assert bs.main(argv + ["--concurrency", "2"]) == 1
    err = _read(rows)[-1]
    assert err["status"] == "error" and "exit 3" in err["reason"] and not err["complete"]


@pytest.mark.parametrize("bad", ["0", "100", "-256", "x"])
def test_the_sweep_warm_up_length_must_be_whole_canvases(bad, capsys):
    with pytest.raises(SystemExit):
        bs.main(["sweep", "--base-url", "http://127.0.0.1:9", "--model", "/m", "--backend", "vllm", "--quant", "fp8",
                 "--max-num-seqs", "4", "--rows", "/tmp/r.jsonl", "--warm-output-len", bad])
    assert "--warm-output-len" in capsys.readouterr().err


def test_a_client_cut_by_the_sweep_budget_is_timeout_not_a_lost_request(tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    monkeypatch.setenv("FAKE_BENCH_SLEEP", "5")
    argv = ["sweep", "--base-url", "http://127.0.0.1:9", "--model", "/tmp/dg26b", "--backend", "vllm",
            "--quant", "fp8", "--concurrency", "64", "--max-num-seqs", "16", "--rows", str(rows),
            "--bench-cmd", FAKE_BENCH, "--work-dir", str(tmp_path / "w"), "--warm-concurrency", "0",
            "--deadline-s", "1.5", "--min-run-s", "0.5"]
    assert bs.main(argv) == 1
    row = _read(rows)[-1]
    assert row["status"] == "timeout" and row["reason"].startswith(bs.TIMED_OUT) and not row["complete"]
    g = {x["name"]: x for x in bs.evaluate_goals([row, _row("blockdiff-triton", "fp8", 64, 1000.0)])}
    assert g["no_request_lost"]["met"] is True and g["no_request_lost"]["value"] == 0
    assert g["no_request_lost"]["not_measured"] == ["serve_c64_fp8/vllm"]
    assert g["c64_fp8"]["met"] is None  # stock measured nothing in fp8: no ratio


@needs_vllm
def test_sweep_with_vllm_0_26_client_against_a_fake_server(tmp_path, model_dir):
    rows = tmp_path / "rows.jsonl"
    with FakeVllmServer(canvas_s=0.02) as srv:
        rc = bs.main(["sweep", "--base-url", srv.base_url, "--model", str(model_dir), "--backend", "vllm", "--quant",
                      "fp8", "--concurrency", "2", "--min-prompts", "2", "--num-prompts-per-concurrency", "1",
                      "--max-num-seqs", "4", "--rows", str(rows), "--bench-cmd",
                      shlex.join([sys.executable, "-c", VLLM_CLIENT_CODE]), "--nvidia-smi", "false",
                      "--work-dir", str(tmp_path / "w")])
    row = _read(rows)[-1]
    assert rc == 0, row
    assert row["complete"] and row["num_prompts"] == 2 and row["num_warmups"] == 2 and row["steps_ok"]
    assert row["time_per_canvas_ms"] >= 15 and row["memory_error"]
    assert row["skip_special_tokens"] is False and row["output_text"]["requests"] == 2  # docs/tuning.md 7.19


def test_merge_intervals_is_the_sorted_disjoint_union():
    assert bs.merge_intervals([]) == []
    assert bs.merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6), (7, 7)]
    assert bs.merge_intervals([(0, 10), (2, 3)]) == [(0, 10)]


def _window_case():
    """A synthetic trace (prefill step + a canvas step) with two blockdiff:add_request ranges, each with Kineto's
    gpu_user_annotation copy."""
    trace = synthetic_trace([(4096, [("fused_moe_kernel", 2.0, "forward")]), (256, BLOCKDIFF_CANVAS_STEP)])
    ev = trace["traceEvents"]
    for t in (1010.0, 1500.0):
        ev.append({"ph": "X", "cat": "user_annotation", "name": "blockdiff:add_request", "pid": 1, "tid": 1, "ts": t,
                   "dur": 3.0})
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "blockdiff:add_request", "pid": 0, "tid": 7,
                   "ts": t + 5, "dur": 2.0})
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    last_end = max(e["ts"] + e["dur"] for e in kernels)
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": last_end + 20000,
               "dur": 1.0})  # the trace goes on past the load (until /stop_profile)
    return trace, ev, min(e["ts"] for e in kernels), last_end


BASE_NS = 5_000_000_000_000
OFFSET = BASE_NS / 1e9  # perf_counter 0 is the trace's origin


def _reqs(sent_us, done_us):
    return [(OFFSET + a * 1e-6, OFFSET + a * 1e-6, OFFSET + b * 1e-6) for a, b in zip(sent_us, done_us)]


def test_the_load_window_puts_the_clients_requests_on_the_trace_clock_lead_in_tail_and_admission(tmp_path):
    """7.11: a warmed profile's GPU was busy 96 % of its span, yet the client's load took 4 s longer than the span.
    The client's request times (perf_counter + the wall-clock offset) are placed on the trace's clock
    (baseTimeNanoseconds): the stretch before the first kernel, after the last, and each request's wait until its
    add_request (the CPU range only, not Kineto's GPU copy of it) are measured and attributed to the engine's CPU
    events there."""
    trace, ev, first_k, last_end = _window_case()
    result = {"start_times": [900e-6, 950e-6, 960e-6], "ttfts": [1e-3, 1e-3, 0.0],
              "itls": [[0.5e-3], [(last_end + 300 - 950) * 1e-6 - 1e-3], []], "output_lens": [512, 512, 0]}
    reqs = bs.request_windows(result, OFFSET)
    assert len(reqs) == 2 and reqs[0][0] == pytest.approx(OFFSET + 900e-6)  # the failed request is left out
    assert reqs[1][2] == pytest.approx(OFFSET + (last_end + 300) * 1e-6)
    assert bs.request_windows({"ttfts": [1.0]}, OFFSET) == []
    s = bs.summarize_trace(ev, max_canvases=1, requests=reqs, base_ns=BASE_NS)
    ld = s["timeline"]["load"]
    assert ld["requests"] == 2 and ld["lead_in_ms"] == pytest.approx((first_k - 900) / 1e3, abs=1e-4)
    assert ld["tail_ms"] == pytest.approx(0.3, abs=1e-4) and ld["window_cut_ms"] == 0
    assert ld["window_ms"] == pytest.approx((last_end + 300 - 900) / 1e3, abs=1e-4)
    assert ld["gpu_busy_ms"] == pytest.approx(s["timeline"]["gpu_busy_ms"], abs=1e-4) and 0 < ld["gpu_busy_share"] < 1
    assert ld["steps"] == 2 and ld["first_step_ms"] == pytest.approx(0.1, abs=1e-4)
    labels = {n for n, _, _ in ld["lead_in"]["cpu_labels"]}
    assert "step:prefill" in labels and ld["tail"]["gaps"] == 1  # the step began 100 us into the lead-in
    adm = ld["admission"]
    assert adm["matched"] == 2 and adm["first_ms"] == pytest.approx([0.11, 0.55], abs=1e-4)
    assert adm["median_ms"] == pytest.approx(0.33, abs=1e-4) and adm["max_ms"] == pytest.approx(0.55, abs=1e-4)
    no_base = bs.summarize_trace(ev, max_canvases=1, requests=reqs)["timeline"]["load"]
    assert "baseTimeNanoseconds" in no_base["reason"]
    none_done = bs.summarize_trace(ev, max_canvases=1, requests=[], base_ns=BASE_NS)["timeline"]["load"]
    assert "completed" in none_done["reason"]
    assert "load" not in bs.summarize_trace(ev, max_canvases=1)["timeline"]
    f = tmp_path / "t.json"
    f.write_text(json.dumps(dict(trace, baseTimeNanoseconds=BASE_NS)))
    assert bs.read_trace(f)[1] == BASE_NS and bs.load_trace(f) == bs.read_trace(f)[0]
    assert bs.summarize_traces([f], max_canvases=1, requests=reqs)["timeline"]["load"]["requests"] == 2
    import time
    off = bs.clock_offset_s()
    # the closest of a few reads: a loaded machine may preempt the test between its two clock reads
    assert min(abs(time.time() - (time.perf_counter() + off)) for _ in range(5)) < 0.05


def test_the_load_window_at_its_edges_never_counts_busy_time_as_lead_in_or_gaps_outside_the_window():
    """The review's edge cases: a kernel already running when the first request is sent (lead-in 0), kernels only
    before or only after the window (the whole window is lead-in, no tail; nothing attributed outside it), one
    kernel covering the whole window (busy 100 %), and a trace that stops before the last request is done (the
    window is cut at the trace's end)."""
    _, ev, first_k, last_end = _window_case()
    steps = [(1000.0, 1100.0, 4096, 1, 0)]
    gpu = [e for e in ev if e.get("cat") == "kernel"]

    def lw(sent, done, g=gpu, end=None):
        return bs.load_window(ev, steps, g, _reqs(sent, done), BASE_NS, trace_end_us=end)

    mid = (first_k + last_end) / 2
    a = lw([mid], [last_end + 100])
    assert a["lead_in_ms"] == 0 and a["lead_in"]["gaps"] == 0 and a["tail_ms"] == pytest.approx(0.1, abs=1e-4)
    b = lw([last_end + 1000], [last_end + 11000])  # kernels only before the window
    assert b["lead_in_ms"] == pytest.approx(10.0, abs=1e-4) and b["tail_ms"] == 0 and b["gpu_busy_ms"] == 0
    assert b["lead_in"]["gaps"] == 1 and b["tail"]["gaps"] == 0
    c = lw([first_k - 20000], [first_k - 10000])  # kernels only after the window
    assert c["lead_in_ms"] == pytest.approx(10.0, abs=1e-4) and c["tail_ms"] == 0 and c["gpu_busy_share"] == 0
    whole = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0.0, "dur": 1e9}]
    d = lw([first_k], [last_end], g=whole)
    assert d["lead_in_ms"] == 0 and d["tail_ms"] == 0 and d["gpu_busy_share"] == pytest.approx(1.0)
    e = lw([900.0], [last_end + 5000], end=last_end + 1000)
    assert e["window_cut_ms"] == pytest.approx(4.0, abs=1e-4) and e["tail_ms"] == pytest.approx(1.0, abs=1e-4)
    for r in (a, b, c, d, e):
        assert 0 <= r["lead_in_ms"] <= r["window_ms"] and 0 <= r["tail_ms"] <= r["window_ms"]


def test_a_profile_terminated_during_its_load_still_stops_the_servers_profiler(tmp_path):
    """SIGTERM (the device script's timeout) during the profiled load unwinds bench_serve profile, so
    /stop_profile is still sent: the server's profiler is never left recording."""
    import signal
    import time

    trace_dir = tmp_path / "traces"
    with FakeVllmServer(trace_dir=str(trace_dir)) as srv:
        env = dict(os.environ, FAKE_BENCH_SLEEP="60")
        p = subprocess.Popen([sys.executable, "-m", "blockdiff.bench.bench_serve", "profile", "--base-url",
                              srv.base_url, "--model", "/tmp/dg26b", "--backend", "vllm", "--quant", "fp8",
                              "--trace-dir", str(trace_dir), "--bench-cmd", FAKE_BENCH, "--warm-requests", "0",
                              "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "p.json")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while "POST /start_profile" not in srv.calls and time.time() < deadline and p.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # the client (sleeping) is running
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        calls = list(srv.calls)
    assert "POST /start_profile" in calls and calls[-1] == "POST /stop_profile", (calls, out[-2000:])
    assert p.returncode != 0


def test_profile_warms_up_with_an_unprofiled_load_of_the_same_size_before_the_profiler_starts(tmp_path, monkeypatch):
    """7.10: a profile on a fresh server traced the first-use JIT compiles (26 s idle of 40 s). The profiled load's
    batch shapes now run once first, outside the profiler, with another seed; ``--warm-requests 0`` skips it."""
    monkeypatch.setenv("FAKE_BENCH_PING", "1")
    trace_dir = tmp_path / "traces"
    for warm, expected in ((None, ["GET /fake_bench?seed=54321", "POST /start_profile", "GET /fake_bench?seed=12345",
                                   "POST /stop_profile"]),
                           ("0", ["POST /start_profile", "GET /fake_bench?seed=12345", "POST /stop_profile"])):
        out = tmp_path / f"prof{warm}.json"
        with FakeVllmServer(trace_dir=str(trace_dir)) as srv:
            argv = ["profile", "--base-url", srv.base_url, "--model", "/tmp/dg26b", "--backend", "vllm",
                    "--quant", "fp8", "--trace-dir", str(trace_dir), "--bench-cmd", FAKE_BENCH, "--requests", "3",
                    "--work-dir", str(tmp_path / f"w{warm}"), "--out", str(out)]
            rc = bs.main(argv + (["--warm-requests", warm] if warm else []))
            calls = list(srv.calls)
        s = json.loads(out.read_text())
        assert rc == 0 and s["status"] == "ok", s.get("reason")
        assert calls == expected
        if warm is None:
            assert s["warm_requests"] == 3 and s["warm_up"]["ok"] and s["warm_up"]["requests"] == 3
            warm_result = json.loads((tmp_path / "wNone" / "profile_warm_fp8-vllm.json").read_text())
            assert warm_result["num_prompts"] == 3 and warm_result["max_concurrency"] == 3
        else:
            assert s["warm_requests"] == 0 and "warm_up" not in s


def test_profile_against_a_fake_server(tmp_path):
    import signal

    trace_dir = tmp_path / "traces"
    out = tmp_path / "prof.json"
    handler = signal.getsignal(signal.SIGTERM)
    with FakeVllmServer(trace_dir=str(trace_dir)) as srv:
        rc = bs.main(["profile", "--base-url", srv.base_url, "--model", "/tmp/dg26b", "--backend", "vllm",
                      "--quant", "fp8", "--trace-dir", str(trace_dir), "--bench-cmd", FAKE_BENCH,
                      "--work-dir", str(tmp_path / "w"), "--out", str(out), "--warm-requests", "0",
                      "--server-pid", str(os.getpid())])
        calls = list(srv.calls)
    s = json.loads(out.read_text())
    assert rc == 0 and s["status"] == "ok", s.get("reason")
    assert s["host_cpu"]["samples"] >= 1 and any(p.endswith(f"[{os.getpid()}]") for p in s["host_cpu"]["processes"])
    assert calls == ["POST /start_profile", "POST /stop_profile"]
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's SIGTERM handler is back
    assert s["canvas_steps"] == 4 and s["prefill_steps"] == 1 and s["load"]["complete"]
    assert s["canvas_step_ms"]["sampler"] == pytest.approx(2.3) and s["trace_file"].endswith(".json.gz")
    assert bs.main(["trace", s["trace_file"], "--out", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["canvas_step_ms"] == s["canvas_step_ms"]


# ---- record, goals, PNG ----------------------------------------------------------------------------------------
def _row(backend, quant, c, tok_s, complete=True, seqs=64, steps=16.0):
    return {"workload": f"serve_c{c}_{quant}", "backend": backend, "quant": quant, "status": "ok", "concurrency": c,
            "max_num_seqs": seqs, "output_tok_s": tok_s, "complete": complete, "completed": 8, "failed": 0,
            "diffusion_steps_per_canvas": steps, "steps_ok": steps == 16.0, "ttft_ms": 100.0}


def test_goals():
    rows = [_row("vllm", "fp8", 1, 1200.0, seqs=16), _row("vllm", "fp8", 16, 2000.0, seqs=16),
            _row("vllm", "fp8", 64, 2500.0, seqs=16), _row("blockdiff-triton", "fp8", 1, 1650.0),
            _row("blockdiff-triton", "fp8", 16, 4800.0), _row("blockdiff-triton", "fp8", 64, 5200.0)]
    g = {x["name"]: x for x in bs.evaluate_goals(rows)}
    assert g["c1_fp8_vs_vllm"]["value"] == pytest.approx(1.375) and g["c1_fp8_vs_vllm"]["met"]
    assert g["c1_fp8_tok_s"]["met"] and g["c64_fp8"]["met"] and g["c64_fp8"]["value"] == pytest.approx(2.08)
    assert g["c16_fp8"]["met"] is False and g["no_request_lost"]["met"] and g["steps_per_canvas_16"]["met"]
    rows[2] = _row("vllm", "fp8", 64, 9000.0, complete=False, seqs=16)  # a lossy run is no throughput
    rows.append(_row("blockdiff-cute", "bf16", 1, 10.0, steps=12.0))
    g = {x["name"]: x for x in bs.evaluate_goals(rows)}
    assert g["c64_fp8"]["value"] == pytest.approx(2.6) and g["no_request_lost"]["met"] is False
    assert g["no_request_lost"]["rows"] == ["serve_c64_fp8/vllm"] and g["steps_per_canvas_16"]["met"] is False
    assert g["c16_bf16"]["met"] is None  # nothing measured
    skipped = dict(_row("vllm", "fp8", 4, 1.0, seqs=16), status="skipped", complete=False)
    g = {x["name"]: x for x in bs.evaluate_goals([skipped])}
    assert g["no_request_lost"]["met"] is None and g["no_request_lost"]["not_measured"] == ["serve_c4_fp8/vllm"]
    assert {x["met"] for x in bs.evaluate_goals([])} == {None}


def test_goals_never_compare_rows_of_two_client_settings():
    """docs/tuning.md 7.19: rows taken with the server's default skip_special_tokens (the field absent, or True) are
    bounded by the detokenizer; a goal never divides a new row by one of them. Mixed rows: the current setting's."""
    old_stock = _row("vllm", "fp8", 64, 936.0)  # before 7.19: no field, the server's default (True)
    new_bd = dict(_row("blockdiff-cute", "fp8", 64, 2250.0), skip_special_tokens=False)
    g = {x["name"]: x for x in bs.evaluate_goals([old_stock, new_bd])}
    assert g["c64_fp8"]["met"] is None and g["c64_fp8"]["left_out"] == ["serve_c64_fp8/vllm"]
    assert g["c64_fp8"]["skip_special_tokens"] is False
    new_stock = dict(_row("vllm", "fp8", 16, 1100.0), skip_special_tokens=False)
    g = {x["name"]: x for x in bs.evaluate_goals([old_stock, new_bd, new_stock])}
    assert g["c64_fp8"]["value"] == pytest.approx(2250.0 / 1100.0) and g["c64_fp8"]["met"]
    g = {x["name"]: x for x in bs.evaluate_goals([old_stock, _row("blockdiff-cute", "fp8", 64, 2000.0)])}
    assert g["c64_fp8"]["value"] == pytest.approx(2000.0 / 936.0) and "left_out" not in g["c64_fp8"]
    assert g["c64_fp8"]["skip_special_tokens"] is True
    assert [bs.effective_skip_special_tokens(v) for v in (None, True, False)] == [True, True, False]
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool or None"):
        bs.effective_skip_special_tokens("false")


def test_a_row_the_sweeps_deadline_skipped_is_never_listed_as_left_out_for_another_client_setting(tmp_path,
                                                                                                   monkeypatch):
    """A skipped row (no client ran) had no skip_special_tokens field, read as vLLM's default (True): beside the
    measured rows (False) the record's throughput goals listed it under left_out, a client setting it never ran."""
    def client(cmd, args, *, result_path, log_path, timeout_s):
        c, n = (int(args[args.index(f) + 1]) for f in ("--max-concurrency", "--num-prompts"))
        return {"completed": n, "failed": 0, "num_prompts": n, "duration": 1.0, "output_throughput": 100.0 * c,
                "max_concurrency": c, "total_output_tokens": n * 512, "diffusion_steps_per_canvas": 16.0}, None

    monkeypatch.setattr(bs, "run_bench_serve", client)
    rows_path = tmp_path / "r.jsonl"
    base = ["sweep", "--base-url", "http://x", "--model", "/m", "--backend", "vllm", "--quant", "fp8",
            "--max-num-seqs", "4", "--rows", str(rows_path), "--work-dir", str(tmp_path / "w"),
            "--warm-concurrency", "0"]
    bs.sweep(bs.build_parser().parse_args(base + ["--concurrency", "1"]))
    skipped = bs.sweep(bs.build_parser().parse_args(base + ["--concurrency", "4", "--deadline-s", "0"]))
    assert skipped[0]["status"] == "skipped" and skipped[0]["skip_special_tokens"] is False
    _, rows = bs.read_rows([rows_path])
    goals = bs.evaluate_goals(rows)
    assert all("left_out" not in g for g in goals), goals
    # a record written before the fix: its skipped row lacks the field; still not listed
    old = [r if r["status"] == "ok" else {k: v for k, v in r.items() if k != "skip_special_tokens"} for r in rows]
    assert all("left_out" not in g for g in bs.evaluate_goals(old))
    assert {g["skip_special_tokens"] for g in bs.evaluate_goals(old) if "skip_special_tokens" in g} == {False}


def test_goals_never_compare_rows_of_two_load_formats():
    """docs/tuning.md 7.21: with dummy weights half the MoE layers read 8 experts; a dummy_live row (spread routing)
    is never divided by a dummy one. Each format gets its own goals; the issue's names stay on dummy's."""
    rows = [_row("vllm", "fp8", 1, 600.0), _row("blockdiff-cute", "fp8", 1, 900.0),
            dict(_row("vllm", "fp8", 1, 300.0), load_format="dummy_live"),
            dict(_row("blockdiff-cute", "fp8", 64, 2000.0), load_format="dummy_live")]
    g = {x["name"]: x for x in bs.evaluate_goals(rows)}
    assert g["c1_fp8_vs_vllm"]["value"] == pytest.approx(1.5) and g["c1_fp8_vs_vllm"]["load_format"] == "dummy"
    assert g["c1_fp8_vs_vllm@dummy_live"]["value"] is None  # no blockdiff c1 row in that format
    assert g["c64_fp8@dummy_live"]["value"] == pytest.approx(2000.0 / 300.0)
    assert g["c64_fp8"]["value"] is None and g["no_request_lost"]["met"]
    only_live = {x["name"] for x in bs.evaluate_goals(rows[2:])}
    assert "c1_fp8_vs_vllm@dummy_live" in only_live and "c1_fp8_vs_vllm" not in only_live
    with pytest.raises(ValueError, match="load_format must be one of"):
        bs.evaluate_goals([dict(_row("vllm", "fp8", 1, 1.0), load_format="auto")])


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc here: the server's command line is unread")
def test_a_sweep_against_a_server_of_another_load_format_exits_2_before_any_run(cli, tmp_path):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--load-format", "dummy_live"])
    try:
        # Popen returns once the child's close-on-exec pipe closes, which Linux does before it sets up the new
        # command line: under load /proc/PID/cmdline can still be empty then (a failure seen in a full run)
        deadline = time.monotonic() + 30
        while bs.server_load_format(server.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = tmp_path / "rows.jsonl"
        _one_clear_line(cli("sweep", "--base-url", "http://127.0.0.1:9", "--model", "/m", "--backend", "vllm",
                            "--quant", "fp8", "--max-num-seqs", "4", "--server-pid", server.pid, "--rows", rows,
                            "--bench-cmd", FAKE_BENCH, "--work-dir", tmp_path / "w"), "--load-format", "dummy_live")
        assert not rows.exists()
    finally:
        server.kill()
        server.wait()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc here: the server's command line is unread")
def test_a_sweep_labelled_with_another_max_num_seqs_than_the_servers_exits_2_before_any_run(cli, tmp_path):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--max-num-seqs", "64"])
    try:
        deadline = time.monotonic() + 30  # the command line can be empty just after Popen (as above)
        while bs.server_max_num_seqs(server.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = tmp_path / "rows.jsonl"
        _one_clear_line(cli("sweep", "--base-url", "http://127.0.0.1:9", "--model", "/m", "--backend", "vllm",
                            "--quant", "fp8", "--max-num-seqs", "16", "--server-pid", server.pid, "--rows", rows,
                            "--bench-cmd", FAKE_BENCH, "--work-dir", tmp_path / "w"), "--max-num-seqs 16")
        assert not rows.exists()
    finally:
        server.kill()
        server.wait()

def test_skip_special_tokens_flag_restores_the_servers_default():
    p = bs.build_parser()
    common_args = ["--base-url", "http://h:1", "--model", "/m", "--backend", "vllm", "--quant", "fp8"]
    sweep = common_args + ["--max-num-seqs", "4", "--rows", "/tmp/r.jsonl"]
    assert p.parse_args(["sweep", *sweep]).skip_special_tokens is False
    assert p.parse_args(["sweep", *sweep, "--skip-special-tokens"]).skip_special_tokens is None
    prof = common_args + ["--trace-dir", "/t", "--out", "/o.json"]
    assert p.parse_args(["profile", *prof, "--skip-special-tokens"]).skip_special_tokens is None


def test_record_writes_json_csv_png_and_goals(tmp_path):
    rows = tmp_path / "rows.jsonl"
    env = dict(bs.environment(), kind="env", backend="vllm", quant="fp8", max_num_seqs=16, model="/tmp/dg26b",
               setting={"input_len": 4096}, commit="unknown", gpu="NVIDIA H200")
    with open(rows, "w") as f:
        f.write(json.dumps({"env": env}) + "\n")
        for c, v in ((1, 1000.0), (4, 1800.0), (16, 2000.0), (64, 2100.0)):
            f.write(json.dumps(_row("vllm", "fp8", c, v, seqs=16)) + "\n")
            f.write(json.dumps(_row("blockdiff-triton", "fp8", c, 1.5 * v * (1 + c / 16))) + "\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"backend": "vllm", "canvas_step_ms": {"sampler": 2.0},
                                "env": {"gpu": "NVIDIA H200", "commit": "abc"}}))
    out = tmp_path / "res" / "serve-h200.json"
    assert bs.main(["record", str(rows), "--profile", str(prof), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "serve" and doc["gpu"] == "NVIDIA H200" and len(doc["rows"]) == 8
    assert doc["commit"] != "unknown" and any("commit" in n for n in doc["notes"])
    assert doc["profiles"][0]["canvas_step_ms"]["sampler"] == 2.0 and "env" not in doc["profiles"][0]
    assert doc["profiles"][0]["commit"] == "abc"
    assert doc["servers"]["vllm-fp8"]["max_num_seqs"] == 16
    assert doc["setting"] == {"input_len": 4096, "load_formats": ["dummy"]}
    goals = {g["name"]: g for g in doc["goals"]}
    assert goals["c1_fp8_vs_vllm"]["met"] and goals["c1_fp8_tok_s"]["met"] is False
    assert out.with_suffix(".csv").exists() and out.with_suffix(".png").stat().st_size > 1000
    assert sorted(p.name for p in out.parent.iterdir()) == ["serve-h200.csv", "serve-h200.json", "serve-h200.png"]
    from blockdiff.bench import make_tables

    text = make_tables.render(out.parent)
    assert "serve_c64_fp8" in text and "output tok s" in text


def test_a_record_of_two_load_formats_keeps_both_servers_and_names_both_formats(tmp_path):
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for fmt, v in (("dummy", 600.0), ("dummy_live", 500.0)):
            env = dict(bs.environment(), kind="env", backend="vllm", quant="fp8", max_num_seqs=64 if fmt == "dummy"
                       else 32, setting={"input_len": 4096, "load_format": fmt}, gpu="NVIDIA H200")
            f.write(json.dumps({"env": env}) + "\n" + json.dumps(dict(_row("vllm", "fp8", 1, v), load_format=fmt)) + "\n")
    out = tmp_path / "serve-h200.json"
    assert bs.main(["record", str(rows), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["servers"]["vllm-fp8"]["max_num_seqs"] == 64 and doc["servers"]["vllm-fp8-dummy_live"]["max_num_seqs"] == 32
    assert doc["setting"] == {"input_len": 4096, "load_formats": ["dummy", "dummy_live"]}


def test_read_rows_names_a_bad_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"env": {"gpu": "x"}}\n\n{"workload": "a"}\n[1]\n')
    with pytest.raises(ValueError, match=r"r.jsonl:4: not a JSON object"):
        bs.read_rows([p])
    p.write_text('{"env": {"gpu": "x"}}\n{"workload": "a"}\n')
    assert bs.read_rows([p]) == ([{"gpu": "x"}], [{"workload": "a"}])


@pytest.mark.parametrize("k, want", [(1, 2), (bs.BENCH_GENERATION["stability_threshold"], bs.DENOISING_STEPS)])
def test_stability_threshold_of_the_setting_forces_every_step_in_blockdiff(k, want):
    """A model whose argmax canvas never changes and that is always confident (zero weights: uniform logits, and a
    confidence threshold above log V) converges after 2 steps with transformers' k = 1, and after exactly the cap of
    16 with the setting's k = 16 (blockdiff's rule: k + 1 identical argmax canvases, the first at step 0)."""
    import torch

    from blockdiff.integration import HarnessRunner
    from blockdiff.model import DiffusionGemma, tiny_config
    from blockdiff.sampler import SamplingParams

    model = DiffusionGemma(tiny_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    params = SamplingParams(canvas_length=16, max_denoising_steps=bs.DENOISING_STEPS, stability_threshold=k,
                            confidence_threshold=100.0, max_tokens=16)
    runner = HarnessRunner(model, default_params=params, max_num_reqs=2, max_num_batched_tokens=64)
    runner.add_request("a", [5, 6, 7], params)
    runner.run()
    t = runner.totals()
    assert t["canvases_committed"] == 1 and t["denoise_steps_per_canvas"] == t["max_denoise_steps_per_canvas"] == want


@needs_vllm
def test_stability_threshold_of_the_setting_forces_every_step_in_stock_vllm():
    """The same on vLLM 0.26's own sampler step (``_compiled_sample_step`` run eagerly): uniform logits (a constant
    argmax) and an always-met confidence converge after 2 steps with k = 1 (history of k + 1 = 2), after exactly 16
    with the setting's k = 16 (history of 17: only the step cap can end the canvas)."""
    import torch
    from vllm.model_executor.models.diffusion_gemma import _compiled_sample_step

    step_fn = getattr(_compiled_sample_step, "_torchdynamo_orig_callable", None) or _compiled_sample_step.__wrapped__

    def steps_to_converge(k, S=bs.DENOISING_STEPS, CL=8, V=32, H=4):
        ST = k + 1  # DiffusionGemmaModelState: stability_threshold = generation_config's + 1
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt)  # noqa: E731
        canvas, argmax_canvas, hist, draft = z(1, CL), z(1, CL), z(1, ST, CL), z(1, CL)
        step, hist_len, num_sampled = z(1, dt=torch.int32), z(1, dt=torch.int32), z(1, dt=torch.int32)
        is_enc, conf, sampled = z(1, dt=torch.bool), z(1, dt=torch.bool), z(1, CL, dt=torch.int32)
        slot = torch.tensor([0])
        for n in range(1, 4 * S):
            step_fn(torch.zeros(CL, V), slot, slot, slot, torch.tensor([CL]), canvas, argmax_canvas, step, is_enc, conf,
                    torch.zeros(1, CL, H), torch.zeros(V, H), torch.tensor(1.0), hist, hist_len, sampled, num_sampled,
                    draft, max_denoising_steps=float(S), t_min=0.4, t_max=0.8, confidence_threshold=100.0,
                    vocab_size=V, CL=CL, ST=ST, entropy_bound=0.1, sc_vocab_start=0, sc_vocab_end=V, tp_size=1,
                    tp_group_name="")
            if bool(is_enc[0]):  # converged: the next pass commits
                return n
        return None

    assert steps_to_converge(1) == 2
    assert steps_to_converge(bs.BENCH_GENERATION["stability_threshold"]) == bs.DENOISING_STEPS


#: Builds one side's VllmConfig with vLLM 0.26 on the CPU platform (set before vLLM resolves it: in a fresh process)
#: and prints what the test checks.
_BUILD_CONFIG = """
import json, sys
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()
import vllm.config.vllm
vllm.config.vllm.HAS_TRITON = True  # model runner v2 asks for Triton, which the CPU platform turns off
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from blockdiff.bench import bench_serve as bs
backend, model = sys.argv[1], sys.argv[2]
if backend != "vllm":
    from blockdiff.integration.vllm_plugin import register
    register()  # what VLLM_PLUGINS=blockdiff does in the server
_, argv = bs.server_command(backend, "fp8", model=model, port=8041, max_num_seqs=16, kv_cache_bytes=8 << 30,
                            gpu_memory_utilization=0.35, trace_dir="/tmp/tr")
rest = argv[argv.index("serve") + 2:]
i = rest.index("--port")
del rest[i:i + 2]
ns = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", model, *rest])
c = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
gen = c.model_config.try_get_generation_config()
print("CONFIG " + json.dumps({
    "arch": c.model_config.architectures, "max_model_len": c.model_config.max_model_len,
    "quant": c.model_config.quantization, "vocab": c.model_config.get_vocab_size(),
    "diffusion": [c.diffusion_config.canvas_length, c.diffusion_config.max_denoising_steps],
    "kv_bytes": c.cache_config.kv_cache_memory_bytes, "prefix_caching": c.cache_config.enable_prefix_caching,
    "v2": c.use_v2_model_runner, "async": c.scheduler_config.async_scheduling,
    "hma_off": c.scheduler_config.disable_hybrid_kv_cache_manager, "scheduler": str(c.scheduler_config.scheduler_cls),
    "gen": [gen["max_denoising_steps"], gen["stability_threshold"]], "profiler": c.profiler_config.profiler}))
"""


@needs_vllm
@pytest.mark.parametrize("backend", ["vllm", "blockdiff-triton"])
def test_vllm_0_26_builds_the_server_config(backend, model_dir):
    """The whole ``vllm serve`` configuration of each side from the model folder and the flags (vLLM 0.26's
    ``create_engine_config`` on the CPU platform; needs ``compressed_tensors``, which the staged GPU vLLM ships):
    FP8, the diffusion config, the fixed KV size, model runner v2, the hybrid KV manager, blockdiff's scheduler."""
    pytest.importorskip("compressed_tensors")
    env = dict(os.environ, **bs.server_command(backend, "fp8", model=str(model_dir), port=1, max_num_seqs=1,
                                               kv_cache_bytes=1, gpu_memory_utilization=0.5)[0])
    p = subprocess.run([sys.executable, "-c", _BUILD_CONFIG, backend, str(model_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("CONFIG ")]
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-3000:]
    c = json.loads(line[0][len("CONFIG "):])
    assert c["arch"] == ["DiffusionGemmaForBlockDiffusion"] and c["max_model_len"] == 8192 and c["vocab"] == 262144
    assert c["quant"] == "fp8" and c["diffusion"] == [256, 16] and c["gen"] == [16, 16] and c["profiler"] == "torch"
    # async scheduling: asked for on the command line (test above); vLLM's CPU platform turns it off here, the GPU
    # server logs "Asynchronous scheduling is enabled"
    assert c["kv_bytes"] == 8 << 30 and c["prefix_caching"] is False and c["v2"]
    assert c["hma_off"] is False  # the sliding layers keep their window only (the memory arithmetic assumes it)
    want = "None" if backend == "vllm" else "blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler"
    assert c["scheduler"] == want


@pytest.fixture
def cli(capsys):
    """bs.main in this process (an exception other than argparse's exit fails the test: it would be a traceback);
    returns (exit code, stderr)."""
    def run(*argv):
        try:
            rc = bs.main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code
        return rc, capsys.readouterr().err

    return run


def _one_clear_line(res, *words):
    rc, err = res
    assert rc == 2, (rc, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert "error:" in last and all(w in last for w in words), last


_GOOD_ROW = {"workload": "serve_c1_bf16", "backend": "vllm", "quant": "bf16", "status": "ok", "concurrency": 1,
             "output_tok_s": 10.0, "complete": True, "completed": 8, "failed": 0, "num_prompts": 8}


@pytest.mark.parametrize("rows,profile,words", [
    ("", None, ["no rows"]), ("\n \n", None, ["no rows"]), ('{"env": {"gpu": "x"}}\n', None, ["no rows"]),
    ('{"nope": 1}\n', None, ["r.jsonl:1", "workload"]), ('{"env": 5}\n', None, ["r.jsonl:1", "env"]),
    (json.dumps({**_GOOD_ROW, "output_tok_s": "fast"}) + "\n", None, ["r.jsonl:1", "output_tok_s"]),
    (json.dumps(_GOOD_ROW) + "\n{bad\n", None, ["r.jsonl:2", "not JSON"]),
    (json.dumps({**_GOOD_ROW, "load_format": "auto"}) + "\n", None, ["r.jsonl:1", "load_format"]),
    (json.dumps(_GOOD_ROW) + "\n", "garbage", ["--profile", "p.json", "not JSON"]),
    (json.dumps(_GOOD_ROW) + "\n", "[1]", ["--profile", "p.json", "JSON object"]),
])
def test_record_with_bad_rows_or_profiles_exits_2_with_one_line(cli, tmp_path, rows, profile, words):
    """Was: ValueError / JSONDecodeError / TypeError ('pop expected at most 1 argument') tracebacks with exit 1, and a
    row without any sweep field (or a string throughput) written into the record with exit 0."""
    r = tmp_path / "r.jsonl"
    r.write_text(rows)
    argv = ["record", r, "--out", tmp_path / "rec" / "serve-x.json"]
    if profile is not None:
        (tmp_path / "p.json").write_text(profile)
        argv += ["--profile", tmp_path / "p.json"]
    _one_clear_line(cli(*argv), *words)
    assert not (tmp_path / "rec" / "serve-x.json").exists()


def test_record_with_missing_inputs_or_unwritable_out_exits_2(cli, tmp_path):
    r = tmp_path / "r.jsonl"
    r.write_text(json.dumps(_GOOD_ROW) + "\n")
    _one_clear_line(cli("record", tmp_path / "none.jsonl", "--out", tmp_path / "serve-x.json"), "none.jsonl")
    _one_clear_line(cli("record", r, "--profile", tmp_path / "none.json", "--out", tmp_path / "serve-x.json"),
                    "none.json")
    _one_clear_line(cli("record", r, "--out", "/proc/nope/serve-x.json"), "--out")


@pytest.mark.parametrize("flag,value", [("--max-num-seqs", "0"), ("--max-num-seqs", "-1"), ("--kv-cache-gib", "0"),
                                        ("--kv-cache-gib", "nan"), ("--kv-cache-gib", "inf"),
                                        ("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "0"),
                                        ("--port", "0"), ("--trace-dir", "rel/dir")])
def test_server_cmd_bad_numbers_exit_2_with_one_line(cli, flag, value):
    """Was: server_command's ValueError (and int(nan * 2**30)'s) as a traceback with exit 1."""
    args = {"--backend": "vllm", "--quant": "bf16", "--model": "/m", "--port": "8000", "--max-num-seqs": "4",
            "--kv-cache-gib": "8", "--gpu-memory-utilization": "0.5", flag: value}
    p = cli("server-cmd", *[x for kv in args.items() for x in kv])
    _one_clear_line(p, flag.strip("-").replace("-", "_").split("_")[0])


@pytest.mark.parametrize("flag,value,words", [
    ("--max-num-seqs", "99999999999999999999", ["max_num_seqs", "2**31"]),
    ("--max-num-batched-tokens", "2147483648", ["max_num_batched_tokens", "2**31"]),
    ("--kv-cache-gib", "1e300", ["--kv-cache-gib", "2**33 GiB"]),
    ("--kv-cache-gib", "8589934592", ["--kv-cache-gib", "2**33 GiB"]),
    ("--kv-cache-gib", "1e-12", ["--kv-cache-gib", "1 byte"])])
def test_server_cmd_refuses_counts_past_vllms_integer_limits_with_one_line(cli, flag, value, words):
    """Was: --max-num-seqs 10**20 hung (cudagraph_capture_sizes looped up to it), --kv-cache-gib 1e300 died with
    int(inf)'s OverflowError traceback, and 1e-12 was reported as kv_cache_bytes 0."""
    args = {"--backend": "vllm", "--quant": "bf16", "--model": "/m", "--port": "8000", "--max-num-seqs": "4",
            "--kv-cache-gib": "8", "--gpu-memory-utilization": "0.5", flag: value}
    _one_clear_line(cli("server-cmd", *[x for kv in args.items() for x in kv]), *words)
    with pytest.raises(ValueError, match="kv_cache_bytes must be below 2\\*\\*63"):
        bs.server_command("vllm", "bf16", model="/m", port=8000, max_num_seqs=4, kv_cache_bytes=1 << 63,
                          gpu_memory_utilization=0.5)


def test_cudagraph_capture_sizes_of_a_huge_max_num_seqs_stop_at_the_token_budget():
    """Was an endless loop: the canvas counts were enumerated up to max_num_seqs before the token budget cut them."""
    assert bs.cudagraph_capture_sizes(10 ** 20, 16384) == bs.cudagraph_capture_sizes(64, 16384)
    assert bs.cudagraph_capture_sizes(10 ** 20, 4096, canvas_length=256)[-1] == 4096


@pytest.mark.parametrize("flag,value", [("--deadline-s", "-5"), ("--deadline-s", "nan"), ("--run-timeout", "0"),
                                        ("--min-run-s", "-1"), ("--memory-interval", "0"), ("--max-num-seqs", "0"),
                                        ("--warm-concurrency", "-3"), ("--num-prompts-per-concurrency", "0"),
                                        ("--rows", "/proc/nope/rows.jsonl")])
def test_sweep_bad_numbers_and_paths_exit_2_before_any_run(cli, tmp_path, flag, value):
    """Was: a negative deadline skipped every run (exit 1), a NaN one was ignored, --run-timeout 0 timed every run
    out, --memory-interval 0 a traceback after the env record was written, --rows in a missing folder a traceback."""
    args = {"--base-url": "http://127.0.0.1:9", "--model": "/m", "--backend": "vllm", "--quant": "bf16",
            "--max-num-seqs": "2", "--rows": str(tmp_path / "rows.jsonl"), "--bench-cmd": "false",
            "--concurrency": "1", flag: value}
    _one_clear_line(cli("sweep", *[x for kv in args.items() for x in kv]), flag)
    assert not (tmp_path / "rows.jsonl").exists()


@pytest.mark.parametrize("value,words", [("1,4,1", ["1 more than once"]), ("16,16", ["16 more than once"]),
                                         (",", ["comma-separated ints"]), (" , ", ["comma-separated ints"]),
                                         ("", [">= 1"]), ("1,x", ["comma-separated ints"]), ("0,4", [">= 1"])])
def test_a_concurrency_list_that_repeats_a_value_or_names_nothing_exits_2_before_any_run(cli, tmp_path, value, words):
    """Was: --concurrency 1,4,1 ran the c1 load twice with one seed, the second run overwriting the first's detailed
    result, and gave the record two rows of serve_c1."""
    args = {"--base-url": "http://127.0.0.1:9", "--model": "/m", "--backend": "vllm", "--quant": "bf16",
            "--max-num-seqs": "2", "--rows": str(tmp_path / "rows.jsonl"), "--bench-cmd": "false",
            "--concurrency": value}
    _one_clear_line(cli("sweep", *[x for kv in args.items() for x in kv]), "--concurrency", *words)
    assert not (tmp_path / "rows.jsonl").exists()
    assert bs._concurrencies(" 1, 4,,16 ") == [1, 4, 16]  # blanks dropped, as every bench comma list
    assert bs._ints("64,64") == [64, 64]  # serve_standin --prompts: counts may repeat


def test_profile_against_an_unreachable_server_exits_2_naming_base_url(cli, tmp_path):
    """Was: urllib's URLError traceback (connection refused) from /start_profile."""
    p = cli("profile", "--base-url", "http://127.0.0.1:9", "--model", "/m", "--backend", "vllm", "--quant", "bf16",
             "--trace-dir", tmp_path, "--out", tmp_path / "p.json")
    _one_clear_line(p, "--base-url")


def test_trace_and_model_input_errors_exit_2(cli, tmp_path):
    (tmp_path / "t.json").write_text("nope")
    _one_clear_line(cli("trace", tmp_path / "t.json"), "t.json")
    _one_clear_line(cli("trace", tmp_path / "t.json", "--max-canvases", "0"), "--max-canvases")
    (tmp_path / "afile").write_text("x")
    _one_clear_line(cli("model", tmp_path / "afile"), "afile")


def test_an_output_flag_that_names_a_folder_or_nothing_exits_2_before_any_work(cli, tmp_path):
    """Was: profile / trace --out FOLDER ran the whole load (or classification) and then lost its summary to an
    IsADirectoryError traceback; sweep --rows FOLDER a traceback after the warm-up; record --out '' / --out-dir ''
    wrote to bench/results/ as if the flag were absent."""
    folder = tmp_path / "d"
    folder.mkdir()
    (tmp_path / "t.json").write_text(json.dumps(synthetic_trace([(256, [("_attn_fwd", 0.1, "forward")])])))
    for out in (str(folder), str(tmp_path / "new") + "/", ""):
        _one_clear_line(cli("trace", tmp_path / "t.json", "--out", out), "--out", "a file name is needed")
        _one_clear_line(cli("profile", "--base-url", "http://127.0.0.1:9", "--model", "m", "--backend", "vllm",
                            "--quant", "fp8", "--trace-dir", tmp_path / "tr", "--out", out, "--bench-cmd", "false"),
                        "--out", "a file name is needed")
        _one_clear_line(cli("sweep", "--base-url", "http://127.0.0.1:9", "--model", "m", "--backend", "vllm",
                            "--quant", "fp8", "--max-num-seqs", "1", "--rows", out, "--bench-cmd", "false"),
                        "--rows", "a file name is needed")
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H200")
    _one_clear_line(cli("record", rows, "--out", ""), "--out")
    _one_clear_line(cli("record", rows, "--out-dir", ""), "--out-dir", "must not be empty")
    assert not (tmp_path / "new").exists() and not any(folder.iterdir())
    assert cli("trace", tmp_path / "t.json", "--out", folder / "t_summary.json")[0] == 0  # a file in it: fine


def _rows_from(path, *gpus):
    """A rows file with one env line and one stock c1 row per GPU named."""
    with open(path, "w") as f:
        for gpu in gpus:
            env = dict(bs.environment(), kind="env", backend="vllm", quant="bf16", max_num_seqs=4, gpu=gpu)
            f.write(json.dumps({"env": env}) + "\n" + json.dumps(_row("vllm", "bf16", 1, 600.0, seqs=4)) + "\n")
    return path


def test_record_refuses_a_profile_taken_on_another_gpu_than_the_rows(cli, tmp_path):
    """The profile's env was dropped without a look: an H200 lease's profile went into serve-h100.json, labelled
    with the H100 by the record's top level."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"backend": "vllm", "env": {"gpu": "NVIDIA H200", "commit": "abc"}}))
    _one_clear_line(cli("record", rows, "--profile", prof, "--out", tmp_path / "serve-h100.json"), "--profile",
                    "p.json", "NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert not (tmp_path / "serve-h100.json").exists()
    prof.write_text(json.dumps({"backend": "vllm", "env": {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc"}}))
    assert cli("record", rows, "--profile", prof, "--out", tmp_path / "serve-h100.json")[0] == 0


def test_record_of_sweeps_at_two_commits_names_both_never_the_first_alone(cli, tmp_path):
    """The record's top level took the first env's commit and vLLM version: blockdiff's rows swept at another commit
    (or vLLM) were labelled with stock's."""
    rows = tmp_path / "r.jsonl"
    with open(rows, "w") as f:
        for backend, commit, vllm in (("vllm", "a" * 40, "0.26.0"), ("blockdiff-cute", "b" * 40, "0.26.0"),
                                      ("blockdiff-cute", "c" * 40, "0.26.0")):
            env = dict(bs.environment(), kind="env", backend=backend, quant="fp8", max_num_seqs=4,
                       gpu="NVIDIA H200", commit=commit, vllm=vllm)
            f.write(json.dumps({"env": env}) + "\n" + json.dumps(_row(backend, "fp8", 1, 600.0, seqs=4)) + "\n")
    assert cli("record", rows, "--out", tmp_path / "serve-h200.json")[0] == 0
    doc = json.loads((tmp_path / "serve-h200.json").read_text())
    assert doc["commit"] == " + ".join(("a" * 40, "b" * 40, "c" * 40)) and doc["vllm"] == "0.26.0"
    assert doc["servers"]["vllm-fp8"]["commit"] == "a" * 40
    assert doc["servers"]["blockdiff-cute-fp8"]["commit"] == "b" * 40 + " + " + "c" * 40
    assert any(n.startswith("commit: the rows ran at 3 values") for n in doc["notes"]), doc["notes"]
    assert not any(n.startswith("vllm") for n in doc["notes"])
    # one commit: as before, no note and no per-server field
    one = _rows_from(tmp_path / "one.jsonl", "NVIDIA H200")
    assert cli("record", one, "--out", tmp_path / "one" / "serve-h200.json")[0] == 0
    doc = json.loads((tmp_path / "one" / "serve-h200.json").read_text())
    assert " + " not in doc["commit"] and "commit" not in doc["servers"]["vllm-bf16"]


def test_record_of_sweeps_one_of_unknown_commit_keeps_the_known_commit(cli, tmp_path, monkeypatch):
    """The joined commits 'unknown + <sha>' started with 'unknown', so the top level was replaced whole by the
    recording checkout's commit with the note that the GPU copy had none (the sweep's known commit lost); in the
    other order 'abc + unknown' was kept. Now the known value stays either way; every value unknown: the checkout."""
    monkeypatch.setenv("BLOCKDIFF_COMMIT", "recording-checkout")
    for order in (("unknown", "b" * 40), ("b" * 40, "unknown")):
        rows = tmp_path / f"r{order[0][0]}.jsonl"
        with open(rows, "w") as f:
            for backend, commit in zip(("vllm", "blockdiff-cute"), order):
                env = dict(bs.environment(), kind="env", backend=backend, quant="fp8", max_num_seqs=4,
                           gpu="NVIDIA H200", commit=commit)
                f.write(json.dumps({"env": env}) + "\n" + json.dumps(_row(backend, "fp8", 1, 600.0, seqs=4)) + "\n")
        out = tmp_path / order[0][0] / "serve-h200.json"
        assert cli("record", rows, "--out", out)[0] == 0
        doc = json.loads(out.read_text())
        assert doc["commit"] == " + ".join(order), doc["commit"]
        assert not any("the GPU copy had none" in n for n in doc["notes"]), doc["notes"]
    rows = tmp_path / "all_unknown.jsonl"
    with open(rows, "w") as f:
        for backend in ("vllm", "blockdiff-cute"):
            env = dict(bs.environment(), kind="env", backend=backend, quant="fp8", max_num_seqs=4, gpu="NVIDIA H200",
                       commit="unknown")
            f.write(json.dumps({"env": env}) + "\n" + json.dumps(_row(backend, "fp8", 1, 600.0, seqs=4)) + "\n")
    assert cli("record", rows, "--out", tmp_path / "all" / "serve-h200.json")[0] == 0
    assert json.loads((tmp_path / "all" / "serve-h200.json").read_text())["commit"] == "recording-checkout"


def test_record_refuses_an_out_name_that_says_another_gpu(cli, tmp_path):
    """2026-12-06: serve_bench.sh wrote an H100 lease's rows to a file named serve-h200.json (its --out was fixed)."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    _one_clear_line(cli("record", rows, "--out", tmp_path / "serve-h200.json"), "--out", "'h200'", "H100",
                    "serve-h100.json")
    assert not (tmp_path / "serve-h200.json").exists()
    assert cli("record", rows, "--out", tmp_path / "serve-h100.json")[0] == 0
    assert cli("record", rows, "--out", tmp_path / "serve-x.json")[0] == 0  # a name without a GPU in it: as asked


def test_record_names_its_file_after_the_rows_gpu(cli, tmp_path):
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    assert cli("record", rows, "--out-dir", tmp_path / "rec")[0] == 0
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["serve-h100.csv", "serve-h100.json",
                                                                   "serve-h100.png"]
    doc = json.loads((tmp_path / "rec" / "serve-h100.json").read_text())
    assert doc["gpu"] == "NVIDIA H100 80GB HBM3" and doc["suite"] == "serve"
    rc, err = cli("record", rows, "--out", tmp_path / "a.json", "--out-dir", tmp_path)
    assert rc == 2 and "not allowed with" in err


def test_record_refuses_rows_from_two_gpus(cli, tmp_path):
    """A record's goals divide its rows by each other: rows of an H100 and an H200 lease would give a ratio that
    compares two machines. Was: a note in the record."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H200", "NVIDIA H100 80GB HBM3")
    _one_clear_line(cli("record", rows, "--out-dir", tmp_path / "rec"), "different GPUs", "NVIDIA H200", "H100")
    assert not (tmp_path / "rec").exists() or not any((tmp_path / "rec").iterdir())


def _rows_with_envs(path, *envs):
    """A rows file with the env lines given (dicts merged into bs.environment(), or None: no env line), each followed
    by one stock c1 row."""
    with open(path, "w") as f:
        for e in envs:
            if e is not None:
                env = dict(bs.environment(), kind="env", backend="vllm", quant="bf16", max_num_seqs=4)
                env.update(e)
                f.write(json.dumps({"env": env}) + "\n")
            f.write(json.dumps(_row("vllm", "bf16", 1, 600.0, seqs=4)) + "\n")
    return path


def test_record_to_a_name_without_the_gpu_leaves_the_gpus_own_record_alone(cli, tmp_path):
    """Was: record wrote DIR/serve-<gpu>.json first and then renamed it to --out, so `--out DIR/serve-old.json` moved
    a committed DIR/serve-h100.json (and its CSV) away."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    res = tmp_path / "res"
    res.mkdir()
    (res / "serve-h100.json").write_text("KEEP")
    (res / "serve-h100.csv").write_text("KEEP")
    for name in ("serve-old.json", "serve.json"):
        assert cli("record", rows, "--out", res / name)[0] == 0
        assert json.loads((res / name).read_text())["suite"] == "serve"
    assert (res / "serve-h100.json").read_text() == "KEEP" and (res / "serve-h100.csv").read_text() == "KEEP"
    assert sorted(p.name for p in res.iterdir()) == ["serve-h100.csv", "serve-h100.json", "serve-old.csv",
                                                     "serve-old.json", "serve-old.png", "serve.csv", "serve.json",
                                                     "serve.png"]


def test_record_of_a_gpu_with_a_two_token_slug_keeps_its_suite(cli, tmp_path):
    """Was: the suite came from the file name less its last '-' token, so serve-h100-pcie.json said suite
    'serve-h100'. A name with a suite of its own (serve_first-h200.json) keeps it."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 PCIe")
    assert cli("record", rows, "--out-dir", tmp_path / "rec")[0] == 0
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["serve-h100-pcie.csv", "serve-h100-pcie.json",
                                                                   "serve-h100-pcie.png"]
    assert json.loads((tmp_path / "rec" / "serve-h100-pcie.json").read_text())["suite"] == "serve"
    assert cli("record", rows, "--out", tmp_path / "serve_first-h100-pcie.json")[0] == 0
    assert json.loads((tmp_path / "serve_first-h100-pcie.json").read_text())["suite"] == "serve_first"


@pytest.mark.parametrize("gpu,name", [
    ("NVIDIA H100 80GB HBM3", "serve-h100-pcie.json"),  # an SXM card's rows under the PCIe card's name
    ("NVIDIA H100 PCIe", "serve-h100.json"),  # a PCIe card's rows under the name of the SXM record
    ("NVIDIA H100 80GB HBM3", "serve-h100-nvl.json"),
])
def test_record_refuses_a_name_that_says_another_kind_of_the_same_gpu(cli, tmp_path, gpu, name):
    rows = _rows_from(tmp_path / "r.jsonl", gpu)
    _one_clear_line(cli("record", rows, "--out", tmp_path / name), "--out", name)
    assert not (tmp_path / name).exists()


def test_record_accepts_names_that_say_the_rows_gpu(cli, tmp_path):
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 PCIe")
    for name in ("serve-h100-pcie.json", "serve-h100-pcie-old.json", "SERVE-H100-PCIE.json", "serve_x.json"):
        assert cli("record", rows, "--out", tmp_path / name)[0] == 0, name
    rows = _rows_from(tmp_path / "r2.jsonl", "NVIDIA H100 80GB HBM3")
    assert cli("record", rows, "--out", tmp_path / "h200" / "serve-h100.json")[0] == 0  # the folder does not count


@pytest.mark.parametrize("out,words", [("d/", ["--out", ".json"]), ("serve-h100.txt", ["--out", ".json"])])
def test_record_refuses_an_out_that_is_no_json_file_and_writes_nothing(cli, tmp_path, out, words):
    """Was: `--out d/` wrote serve-h100.json beside d (out.parent) and then failed renaming it onto the folder."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    (tmp_path / "d").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    _one_clear_line(cli("record", rows, "--out", f"{tmp_path}/{out}"), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any((tmp_path / "d").iterdir())


@pytest.mark.parametrize("envs,words", [
    ([{"gpu": 123}], ["gpu", "123"]),
    ([{"gpu": ["NVIDIA H100"]}], ["gpu"]),
    ([{"gpu": "NVIDIA H100 80GB HBM3"}, {"gpu": None}], ["no GPU", "H100"]),
])
def test_record_refuses_bad_or_missing_gpus_beside_others_in_one_line(cli, tmp_path, envs, words):
    rows = _rows_with_envs(tmp_path / "r.jsonl", *envs)
    _one_clear_line(cli("record", rows, "--out", tmp_path / "serve-x.json"), *words)
    _one_clear_line(cli("record", rows, "--out-dir", tmp_path / "rec"), *words)


def test_record_refuses_a_rows_file_without_env_beside_one_with_a_gpu(cli, tmp_path):
    a = _rows_from(tmp_path / "a.jsonl", "NVIDIA H100 80GB HBM3")
    b = _rows_with_envs(tmp_path / "b.jsonl", None)
    _one_clear_line(cli("record", a, b, "--out-dir", tmp_path / "rec"), "no GPU", "H100")
    assert cli("record", a, "--out-dir", tmp_path / "rec")[0] == 0


@pytest.mark.parametrize("envs", [[{"gpu": None}], [None], [{"gpu": ""}]])
def test_record_of_rows_naming_no_gpu_says_unknown_not_this_machine(cli, tmp_path, envs):
    """Was: rows without an env line got this machine's env, so the record said gpu 'cpu' (or the recording host's
    card); an env with gpu null was a traceback."""
    rows = _rows_with_envs(tmp_path / "r.jsonl", *envs)
    _one_clear_line(cli("record", rows, "--out-dir", tmp_path / "rec"), "no GPU", "--out")
    assert cli("record", rows, "--out", tmp_path / "serve-x.json")[0] == 0
    doc = json.loads((tmp_path / "serve-x.json").read_text())
    assert doc["gpu"] == "unknown" and any("gpu" in n for n in doc["notes"])


def test_record_servers_keep_each_warm_up_and_each_max_num_seqs(cli, tmp_path):
    """The sweep writes an env line per command; only a server's first has its warm-up. Was: later lines overwrote
    it with None, and stock run at 4 then 8 seqs (serve-h100.json) showed one server at 8."""
    warm = {"concurrency": 4, "s": 60.0, "ok": True}
    rows = _rows_with_envs(tmp_path / "r.jsonl", {"gpu": "NVIDIA H100 80GB HBM3", "warm_up": warm},
                           {"gpu": "NVIDIA H100 80GB HBM3"},
                           {"gpu": "NVIDIA H100 80GB HBM3", "max_num_seqs": 8, "warm_up": dict(warm, s=70.0)},
                           {"gpu": "NVIDIA H100 80GB HBM3", "max_num_seqs": 8})
    assert cli("record", rows, "--out-dir", tmp_path)[0] == 0
    servers = json.loads((tmp_path / "serve-h100.json").read_text())["servers"]
    assert servers["vllm-bf16"]["max_num_seqs"] == 4 and servers["vllm-bf16"]["warm_up"]["s"] == 60.0
    assert servers["vllm-bf16-seqs8"]["max_num_seqs"] == 8 and servers["vllm-bf16-seqs8"]["warm_up"]["s"] == 70.0


def test_record_refuses_to_replace_an_existing_record_without_force(cli, tmp_path):
    """2026-12-06 (a new user's walk-through): `record ROWS` with the default name replaced the committed
    serve-h100.json, whose notes and profiles are not in its rows, with exit 0."""
    rows = _rows_from(tmp_path / "r.jsonl", "NVIDIA H100 80GB HBM3")
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "serve-h100.json").write_text('{"notes": ["kept"]}')
    _one_clear_line(cli("record", rows, "--out-dir", rec), "serve-h100.json exists", "history", "--force")
    assert json.loads((rec / "serve-h100.json").read_text()) == {"notes": ["kept"]}
    _one_clear_line(cli("record", rows, "--out", rec / "serve-h100.json"), "exists")
    assert cli("record", rows, "--out-dir", rec, "--force")[0] == 0
    assert json.loads((rec / "serve-h100.json").read_text())["gpu"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("row,env,words", [
    ({"output_tok_s": float("nan")}, None, ["output_tok_s", "finite"]),
    ({"output_tok_s": float("inf")}, None, ["output_tok_s", "finite"]),
    ({"ttft_ms": -1.0}, None, ["ttft_ms", ">= 0"]),
    ({"concurrency": 0}, None, ["concurrency", "int >= 1"]),
    ({"concurrency": 1.5}, None, ["concurrency", "int >= 1"]),
    ({"concurrency": None}, None, ["needs its concurrency"]),
    ({"backend": ["vllm"]}, None, ["backend", "string"]),
    ({"quant": 8}, None, ["quant", "string"]),
    ({"complete": "false"}, None, ["complete", "true, false or null"]),
    ({"skip_special_tokens": "yes"}, None, ["skip_special_tokens", "true, false or null"]),
    ({}, {"gpu": "x", "setting": 5}, ["setting", "JSON object"]),
    ({}, {"gpu": "x", "setting": {"load_format": "auto"}}, ["setting", "load_format"]),
])
def test_record_refuses_non_finite_negative_or_mistyped_row_fields_naming_file_line_and_field(
        cli, tmp_path, row, env, words):
    """Was: NaN / Infinity throughput (json reads both) went into the goals (value NaN, written null, met False); a
    row without concurrency, a list backend or quant, a string skip_special_tokens or a non-object env setting died
    in a KeyError / TypeError / AttributeError traceback; concurrency 0 in matplotlib's log scale (ValueError after
    the JSON was written); a string "false" for complete counted as complete."""
    r = tmp_path / "r.jsonl"
    lines = [json.dumps({"env": env})] if env is not None else []
    r.write_text("\n".join(lines + [json.dumps({**_GOOD_ROW, **row})]) + "\n")
    _one_clear_line(cli("record", r, "--out", tmp_path / "rec" / "serve-x.json"), f"r.jsonl:1",
                    *words)
    assert not (tmp_path / "rec" / "serve-x.json").exists()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_server_command_refuses_a_token_budget_below_one_canvas_eager_too(enforce_eager):
    """An eager server took --max-num-batched-tokens 1: every canvas row cut, which blockdiff's scheduler now refuses
    at start (check_canvas_rows_fit); the command is refused when it is built, naming the argument."""
    with pytest.raises(ValueError, match=f"max_num_batched_tokens must be an int >= {bs.CANVAS_LENGTH}"):
        bs.server_command("blockdiff-triton", "bf16", model="/m", port=8000, max_num_seqs=4, kv_cache_bytes=1 << 30,
                          gpu_memory_utilization=0.5, max_num_batched_tokens=bs.CANVAS_LENGTH - 1,
                          enforce_eager=enforce_eager)
    env, argv = bs.server_command("blockdiff-triton", "bf16", model="/m", port=8000, max_num_seqs=4,
                                  kv_cache_bytes=1 << 30, gpu_memory_utilization=0.5,
                                  max_num_batched_tokens=bs.CANVAS_LENGTH, enforce_eager=enforce_eager)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(bs.CANVAS_LENGTH)


def test_an_int_beyond_float_range_is_a_row_problem_and_a_usage_error_not_an_overflow_traceback(tmp_path, capsys):
    """b8898f0's rule (math.isfinite raises OverflowError for an int beyond float's range) in bench_serve: a rows
    file's count of 10**400 and an int flag of 400 digits raised OverflowError past read_rows' / argparse's errors."""
    huge = 10 ** 400
    p = tmp_path / "r.jsonl"
    p.write_text('{"env": {"gpu": "x"}}\n' + json.dumps({"workload": "serve_c1_fp8", "completed": huge}) + "\n")
    with pytest.raises(ValueError, match=r"completed must be a finite number >= 0 or null, got an int of 1329 bits"):
        bs.read_rows([p])
    assert bs.main(["record", str(p), "--out", str(tmp_path / "serve-x.json")]) == 2
    with pytest.raises(SystemExit) as e:
        bs.build_parser().parse_args(["sweep", "--base-url", "http://x", "--model", "/m", "--backend", "vllm",
                                      "--quant", "fp8", "--max-num-seqs", str(huge)])
    assert e.value.code == 2 and "within float's range, got an int of 1329 bits" in capsys.readouterr().err


def test_a_throughput_goal_never_counts_a_row_of_another_step_count():
    """A blockdiff row whose canvases took 8 denoising steps (vLLM's count; ~2x the tokens/s of the setting's 16)
    met c1_fp8_vs_vllm and c1_fp8_tok_s; only the setting check steps_per_canvas_16 said the row was not the
    setting. A row with no count (steps_ok None) is of an unknown setting: not counted either."""
    stock = _row("vllm", "fp8", 1, 1000.0)
    fast = _row("blockdiff-cute", "fp8", 1, 2000.0, steps=8.0)
    g = {x["name"]: x for x in bs.evaluate_goals([stock, fast])}
    assert g["c1_fp8_vs_vllm"]["met"] is None and g["c1_fp8_tok_s"]["met"] is None
    assert g["steps_per_canvas_16"]["met"] is False
    unknown = dict(_row("blockdiff-cute", "fp8", 1, 2000.0), steps_ok=None, diffusion_steps_per_canvas=None)
    assert {x["name"]: x for x in bs.evaluate_goals([stock, unknown])}["c1_fp8_vs_vllm"]["met"] is None
    good = _row("blockdiff-cute", "fp8", 1, 1300.0)
    g = {x["name"]: x for x in bs.evaluate_goals([stock, fast, good])}
    assert g["c1_fp8_vs_vllm"]["value"] == pytest.approx(1.3) and g["c1_fp8_vs_vllm"]["met"]
