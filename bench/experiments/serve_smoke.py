"""Serving smoke check of issue 25: send the demo's text prompts to an OpenAI-compatible server (``vllm serve``)
and compare its completions with blockdiff's harness on the same checkpoint, token for token.

    # the harness side (GPU or CPU), greedy, writes JSON
    python3 -m blockdiff.bench.experiments.serve_smoke harness --out harness.json [--device cuda]
    # a server side: one completion per prompt, greedy through vllm_xargs (t_min = t_max = 0)
    python3 -m blockdiff.bench.experiments.serve_smoke client --base-url http://127.0.0.1:8022 --model MODEL --out srv.json
    # agreement of two sides (exit 0 always; prints per-prompt equality and the common prefix length)
    python3 -m blockdiff.bench.experiments.serve_smoke compare harness.json srv.json

Greedy under vLLM is ``vllm_xargs {"t_min": 0, "t_max": 0}`` (vLLM refuses temperature != 1 and seeds for diffusion
models); the step cap rides in ``diffusion_max_steps``. ``--sampled`` sends the checkpoint's schedule instead and
reports agreement only as a rate. Uses only the standard library on the client side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from blockdiff.integration.demo import TEXT_REQUESTS

MAX_TOKENS = 64
STEP_CAP = 16


def _prompts():
    return [(rid, text) for rid, text, *_ in TEXT_REQUESTS]


def run_harness(out: str, device: str, attn_backend: str, sampler_backend: str, sampled: bool) -> dict:
    """Greedy (or sampled) completions of the demo prompts through HarnessRunner on the shipped checkpoint."""
    import torch  # heavy; the client side needs none of it

    from blockdiff.integration import HarnessRunner
    from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
    from blockdiff.sampler import SamplingParams

    dev = torch.device(device)
    model, tok = load_pretrained(shipped_checkpoint_dir(), device=dev)
    cl = model.config.canvas_length
    temps = {} if sampled else dict(t_min=0.0, t_max=0.0)
    params = SamplingParams(canvas_length=cl, max_denoising_steps=STEP_CAP, eos_token_ids=(tok.eos_token_id,),
                            max_tokens=MAX_TOKENS, **temps)
    prompts = _prompts()
    runner = HarnessRunner(model, default_params=params, max_num_reqs=len(prompts),
                           max_num_batched_tokens=len(prompts) * max(cl, 64), page_size=16,
                           max_model_len=256 + MAX_TOKENS + cl, device=dev, attn_backend=attn_backend,
                           sampler_backend=sampler_backend)
    for rid, text in prompts:
        runner.add_request(rid, tok.encode(text), params)
    res = runner.run()
    rows = {rid: {"prompt": text, "token_ids": list(res[rid].output_token_ids),
                  "text": tok.decode(list(res[rid].output_token_ids)), "finish_reason": res[rid].finish_reason}
            for rid, text in prompts}
    rec = {"side": "harness", "device": device, "attn_backend": attn_backend, "sampler_backend": sampler_backend,
           "sampled": sampled, "rows": rows}
    json.dump(rec, open(out, "w"), indent=1)
    return rec


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_client(base_url: str, model: str, out: str, sampled: bool, timeout: float) -> dict:
    """One completion per demo prompt from the server; records text, token ids (via ``return_token_ids``) and
    errors."""
    xargs = {"diffusion_max_steps": STEP_CAP}
    if not sampled:
        xargs.update(t_min=0.0, t_max=0.0)
    rows = {}
    for rid, text in _prompts():
        body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "vllm_xargs": xargs,
                "return_token_ids": True}
        t0 = time.perf_counter()
        try:
            r = _post(base_url.rstrip("/") + "/v1/completions", body, timeout)
            ch = r["choices"][0]
            rows[rid] = {"prompt": text, "text": ch.get("text"), "token_ids": ch.get("token_ids"),
                         "finish_reason": ch.get("finish_reason"), "seconds": time.perf_counter() - t0}
        except Exception as e:  # recorded, never lost: a failed request is a row with its error
            detail = getattr(e, "read", lambda: b"")()
            rows[rid] = {"prompt": text, "error": f"{type(e).__name__}: {e} {detail[:500]!r}"}
    rec = {"side": base_url, "model": model, "sampled": sampled, "rows": rows}
    json.dump(rec, open(out, "w"), indent=1)
    return rec


def compare(a: str, b: str) -> dict:
    """Per-prompt agreement of two records: equal text, common prefix length in characters."""
    ra, rb = json.load(open(a))["rows"], json.load(open(b))["rows"]
    out = {}
    for rid in ra:
        ta, tb = ra[rid].get("text"), rb.get(rid, {}).get("text")
        if ta is None or tb is None:
            out[rid] = {"equal": False, "error": ra[rid].get("error") or rb.get(rid, {}).get("error")}
            continue
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        out[rid] = {"equal": ta == tb, "common_prefix_chars": n, "len": [len(ta), len(tb)]}
    eq = sum(v["equal"] for v in out.values())
    print(json.dumps(out, indent=1))
    print(f"equal: {eq} of {len(out)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("harness")
    h.add_argument("--out", required=True)
    h.add_argument("--device", default="cuda")
    h.add_argument("--attn-backend", default="triton")
    h.add_argument("--sampler-backend", default="triton")
    h.add_argument("--sampled", action="store_true")
    c = sub.add_parser("client")
    c.add_argument("--base-url", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--sampled", action="store_true")
    c.add_argument("--timeout", type=float, default=120.0)
    m = sub.add_parser("compare")
    m.add_argument("a")
    m.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "harness":
        run_harness(args.out, args.device, args.attn_backend, args.sampler_backend, args.sampled)
    elif args.cmd == "client":
        run_client(args.base_url, args.model, args.out, args.sampled, args.timeout)
    else:
        compare(args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
