"""A stand-in for ``vllm bench serve`` (tests/bench/test_bench_serve.py runs ``bench_serve sweep --bench-cmd`` with it
where vLLM is not installed): reads the arguments the sweep passes, writes a result JSON shaped as vLLM 0.26's
(``data/vllm_0_26_bench_serve_result.json`` resized to ``--num-prompts``) and exits 0.

Environment: ``FAKE_BENCH_FAILED`` = failed requests per run (default 0); ``FAKE_BENCH_EXIT`` = exit with this status
before writing anything; ``FAKE_BENCH_TOK_S`` = output tokens/s per unit of concurrency (default 100);
``FAKE_BENCH_SLEEP`` = seconds to sleep first (a client that outruns the sweep's budget); ``FAKE_BENCH_PING=1``: first
``GET {--base-url}/fake_bench?seed=S`` (a stand-in server logs the call, so a test sees when each load ran).
"""
import argparse
import json
import os
import sys
import time

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_0_26_bench_serve_result.json")


def main(argv):
    time.sleep(float(os.environ.get("FAKE_BENCH_SLEEP", "0")))
    if os.environ.get("FAKE_BENCH_EXIT"):
        print("fake bench serve: failing as asked")
        return int(os.environ["FAKE_BENCH_EXIT"])
    p = argparse.ArgumentParser()
    for name in ("--num-prompts", "--max-concurrency", "--num-warmups", "--random-output-len", "--seed"):
        p.add_argument(name, type=int)
    for name in ("--result-dir", "--result-filename", "--base-url", "--model"):
        p.add_argument(name)
    a, _ = p.parse_known_args(argv)
    if os.environ.get("FAKE_BENCH_PING") == "1":
        import urllib.error
        import urllib.request
        try:
            urllib.request.urlopen(f"{a.base_url.rstrip('/')}/fake_bench?seed={a.seed}", timeout=10).close()
        except urllib.error.HTTPError:  # the stand-in answers 404 after logging the call
            pass
    with open(FIXTURE) as f:
        r = json.load(f)
    n, c, failed = a.num_prompts, a.max_concurrency, int(os.environ.get("FAKE_BENCH_FAILED", "0"))
    ok = n - failed
    r.update(num_prompts=n, max_concurrency=c, completed=ok, failed=failed,
             total_output_tokens=ok * a.random_output_len,
             output_throughput=float(os.environ.get("FAKE_BENCH_TOK_S", "100")) * c, duration=1.0, model_id=a.model,
             ttfts=[0.5] * ok + [0.0] * failed, itls=[[0.25]] * ok + [[]] * failed,
             output_lens=[a.random_output_len] * ok + [0] * failed,
             errors=[""] * ok + ["Traceback ...\nfake: connection reset"] * failed)
    os.makedirs(a.result_dir, exist_ok=True)
    with open(os.path.join(a.result_dir, a.result_filename), "w") as f:
        json.dump(r, f)
    print(f"fake bench serve: {n} prompts at concurrency {c}, {failed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
