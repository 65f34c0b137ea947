"""CPU stand-ins for the serving benchmark's tests (tests/bench/test_bench_serve.py): a fake vLLM OpenAI server and a
synthetic torch-profiler trace.

:class:`FakeVllmServer` answers what ``vllm bench serve`` (vLLM 0.26) and ``bench_serve profile`` ask of a server:
``/health``, ``/v1/models``, streamed ``/v1/completions`` (one SSE chunk per committed canvas, then the usage chunk
and ``[DONE]``, as vLLM streams a diffusion model), ``/metrics`` with the ``vllm:diffusion_*_total`` counters
(``steps_per_canvas`` denoising steps + 1 commit per canvas), ``/tokenize`` answering 404 (the client then skips its
prompt alignment) and ``/start_profile`` / ``/stop_profile`` (the latter writes :func:`synthetic_trace` into
``trace_dir``). It never models timing beyond ``canvas_s`` of sleep per canvas.

``python3 tests/bench/serve_standins.py serve PORT TRACE_DIR`` runs the server alone (the shell script's test).
``python3 tests/bench/serve_standins.py fixture OUT.json MODEL`` regenerates ``data/vllm_0_26_bench_serve_result.json``
with vLLM 0.26's own client code against this server (needs vLLM 0.26's Python packages importable:
``source tests/integration/vllm_cpu_env.sh 0.26.0``; the model folder from ``bench_serve model``).
"""
from __future__ import annotations

import gzip
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CANVAS_LENGTH = 256


def synthetic_trace(steps, *, t0: float = 1000.0, graph_steps: bool = True) -> dict:
    """A chrome trace as vLLM 0.26's worker profiler writes it, from ``steps`` = [(tokens, [(kernel name, ms,
    phase)])] with phase ``"forward"`` (launched inside the step's ``execute_context_..`` annotation; with
    ``graph_steps`` all of a step's forward kernels come from one ``cudaGraphLaunch``) or ``"sample"`` (launched
    after it, one ``cudaLaunchKernel`` / ``cuLaunchKernelEx`` each). A kernel launched before the first step can be
    given as step tokens None. Times in microseconds."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": t0 - 50, "dur": 1}]
    corr = 1
    t = t0
    for tokens, kernels in steps:
        fwd = [k for k in kernels if k[2] == "forward"]
        smp = [k for k in kernels if k[2] == "sample"]
        start = t
        if tokens is not None:
            ctx = tokens if tokens > 2 * CANVAS_LENGTH else 0
            gen = tokens - ctx
            ev.append({"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": start, "dur": 100.0,
                       "name": f"execute_context_{1 if ctx else 0}({ctx})_generation_{1 if gen else 0}({gen})"})
        gpu_t = start + 5
        if graph_steps and fwd:
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1,
                       "ts": start + 10, "dur": 5, "args": {"correlation": corr}})
            for name, ms, _ in fwd:
                ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": gpu_t,
                           "dur": ms * 1e3, "args": {"correlation": corr, "device": 0, "stream": 7}})
                gpu_t += ms * 1e3 + 1
            corr += 1
        else:
            for i, (name, ms, _) in enumerate(fwd):
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": start + 10 + i, "dur": 0.5, "args": {"correlation": corr}})
                ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": gpu_t,
                           "dur": ms * 1e3, "args": {"correlation": corr}})
                gpu_t += ms * 1e3 + 1
                corr += 1
        for i, (name, ms, _) in enumerate(smp):  # after the annotation's end (start + 100)
            ev.append({"ph": "X", "cat": "cuda_driver" if i % 2 else "cuda_runtime",
                       "name": "cuLaunchKernelEx" if i % 2 else "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": start + 120 + i, "dur": 0.5, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": gpu_t,
                       "dur": ms * 1e3, "args": {"correlation": corr}})
            gpu_t += ms * 1e3 + 1
            corr += 1
        t = max(gpu_t, start + 200) + 50
    ev.append({"ph": "i", "cat": "instant", "name": "marker", "pid": 1, "tid": 1, "ts": t, "s": "t"})
    return {"schemaVersion": 1, "traceEvents": ev}


#: A canvas step of two canvases under each side's names (what the profile test classifies).
STOCK_CANVAS_STEP = [
    ("kernel_unified_attention", 0.30, "forward"), ("void vllm::reshape_and_cache_flash_kernel<>", 0.02, "forward"),
    ("fused_moe_kernel", 4.00, "forward"), ("void vllm::moe::topkGatingSoftmax<>", 0.03, "forward"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", 0.80, "forward"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<>", 0.05, "forward"),
    ("triton_red_fused_add_mean_mul_pow_rsqrt_0", 0.10, "forward"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_TNT", 0.40, "sample"),       # LM head
    ("triton_poi_fused_div_mul_tanh_0", 0.20, "sample"),                  # softcap
    ("triton_red_fused__log_softmax_argmax_1", 1.50, "sample"),           # compiled sampler step
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_TNN", 0.60, "sample"),              # its soft-embedding matmul
    ("some_new_kernel_nobody_knows", 0.01, "forward"),
]
BLOCKDIFF_CANVAS_STEP = [
    ("_attn_fwd_gluon_roles", 0.10, "forward"), ("void vllm::reshape_and_cache_flash_kernel<>", 0.02, "forward"),
    ("fused_moe_kernel", 4.00, "forward"), ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", 0.80, "forward"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_TNT", 0.40, "sample"),
    ("triton_poi_fused_div_mul_tanh_0", 0.20, "sample"),
    ("_stats_kernel", 0.40, "sample"), ("_prob_chunk_kernel", 0.20, "sample"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_TNN", 0.30, "sample"), ("_step_kernel", 0.05, "sample"),
]


class FakeVllmServer:
    """A thread serving the endpoints above on ``127.0.0.1`` (``.base_url`` once entered).

    Args:
        steps_per_canvas: denoising steps per canvas the ``/metrics`` counters report.
        canvas_s: seconds of sleep per canvas of a request.
        trace_dir: where ``/stop_profile`` writes a trace (``fake.pt.trace.json.gz``); None: no profiler endpoints.
        fail_every: every n-th completion request (1-based) answers 500 (0: none).
        trace_steps: the steps of that trace (:func:`synthetic_trace`).
        port: TCP port (0: any free one).
    """

    def __init__(self, *, steps_per_canvas: int = 16, canvas_s: float = 0.0, trace_dir: str | None = None,
                 fail_every: int = 0, trace_steps=None, port: int = 0):
        self.steps_per_canvas, self.canvas_s, self.trace_dir, self.fail_every = (steps_per_canvas, canvas_s,
                                                                                 trace_dir, fail_every)
        self.trace_steps = trace_steps or [(4096 * 2, [("fused_moe_kernel", 30.0, "forward")])] + [
            (2 * CANVAS_LENGTH, STOCK_CANVAS_STEP)] * 4
        self.lock = threading.Lock()
        self.counters = {"num_denoising_steps": 0, "num_canvas_positions": 0, "num_committed_tokens": 0}
        self.requests = 0
        self.profiling = False
        self.calls: list[str] = []
        self.httpd: ThreadingHTTPServer | None = None
        self.port = port

    def __enter__(self) -> "FakeVllmServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # each SSE chunk leaves when written

            def log_message(self, *a):  # quiet
                pass

            def _send(self, code, body: bytes, ctype="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}") if n else {}

            def do_GET(self):
                server.calls.append("GET " + self.path)
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    models = {"object": "list", "data": [{"id": "fake", "object": "model"}]}
                    self._send(200, json.dumps(models).encode())
                elif self.path == "/metrics":
                    with server.lock:
                        c = dict(server.counters)
                    lines = ["# HELP vllm:diffusion_num_denoising_steps_total Number of denoising steps."]
                    for k, v in c.items():
                        lines.append(f'vllm:diffusion_{k}_total{{engine="0",model_name="fake"}} {float(v)}')
                    self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                server.calls.append("POST " + self.path)
                if self.path == "/v1/completions":
                    return self._complete(self._body())
                if self.path in ("/start_profile", "/stop_profile") and server.trace_dir is not None:
                    self._body()
                    if self.path == "/stop_profile" and server.profiling:
                        os.makedirs(server.trace_dir, exist_ok=True)
                        with gzip.open(os.path.join(server.trace_dir, "fake_worker.pt.trace.json.gz"), "wt") as f:
                            json.dump(synthetic_trace(server.trace_steps), f)
                    server.profiling = self.path == "/start_profile"
                    return self._send(200, b"")
                self._body()
                self._send(404, b'{"detail": "Not Found"}')

            def _complete(self, req):
                with server.lock:
                    server.requests += 1
                    n = server.requests
                if server.fail_every and n % server.fail_every == 0:
                    return self._send(500, b'{"error": "fake failure"}')
                max_tokens = int(req.get("max_tokens") or CANVAS_LENGTH)
                canvases = -(-max_tokens // CANVAS_LENGTH)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(obj):
                    data = (f"data: {obj}\n\n" if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                for i in range(canvases):
                    time.sleep(server.canvas_s)
                    n_tok = min(CANVAS_LENGTH, max_tokens - i * CANVAS_LENGTH)
                    with server.lock:
                        server.counters["num_denoising_steps"] += server.steps_per_canvas + 1
                        server.counters["num_canvas_positions"] += (server.steps_per_canvas + 1) * CANVAS_LENGTH
                        server.counters["num_committed_tokens"] += n_tok
                    chunk({"id": "cmpl-fake", "object": "text_completion", "model": req.get("model"),
                           "choices": [{"index": 0, "text": "x" * 8, "logprobs": None,
                                        "finish_reason": "length" if i == canvases - 1 else None}]})
                prompt = req.get("prompt")
                chunk({"id": "cmpl-fake", "object": "text_completion", "model": req.get("model"), "choices": [],
                       "usage": {"prompt_tokens": len(prompt) if isinstance(prompt, str) else 0,
                                 "completion_tokens": max_tokens, "total_tokens": max_tokens}})
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


#: ``vllm bench serve`` in-process (vLLM 0.26's own client code; ``python3 -c`` this with the bench arguments).
VLLM_CLIENT_CODE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
                    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _fixture(out: str, model: str) -> None:
    """Write the fixture: vLLM 0.26's client, 8 prompts at concurrency 4 against :class:`FakeVllmServer`."""
    import subprocess
    import tempfile

    from blockdiff.bench import bench_serve

    with tempfile.TemporaryDirectory() as d, FakeVllmServer(canvas_s=0.01) as srv:
        args = bench_serve.bench_serve_args(base_url=srv.base_url, model=model, concurrency=4, num_prompts=8,
                                            num_warmups=1, result_dir=d, result_filename="r.json", seed=4,
                                            metadata={"blockdiff_backend": "vllm", "blockdiff_quant": "fp8"})
        subprocess.run([sys.executable, "-c", VLLM_CLIENT_CODE, *args], check=True)
        with open(os.path.join(d, "r.json")) as f:
            result = json.load(f)
    result["model_id"] = result["tokenizer_id"] = "/tmp/dg26b"  # the GPU machine's folder, not this one's
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def _serve(port: int, trace_dir: str) -> None:
    """Serve :class:`FakeVllmServer` on ``port`` until killed (prints ``ready`` once listening)."""
    with FakeVllmServer(port=port, trace_dir=trace_dir):
        print("ready", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "fixture":
        _fixture(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve":
        _serve(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: python3 tests/bench/serve_standins.py fixture OUT.json MODEL_FOLDER | serve PORT TRACE_DIR")
