"""Serving smoke check of issue 25: send the demo's text prompts to an OpenAI-compatible server (``vllm serve``)
and compare its completions with blockdiff's harness on the same checkpoint, token for token.

    # the harness side (GPU or CPU), greedy, writes JSON; --dtype float32 for the token-for-token check (below)
    python3 -m blockdiff.bench.experiments.serve_smoke harness --out harness.json [--device cuda] [--dtype float32]
    # a server side: one completion per prompt, greedy through vllm_xargs (t_min = t_max = 0)
    python3 -m blockdiff.bench.experiments.serve_smoke client --base-url http://127.0.0.1:8022 --model MODEL --out srv.json
    # (harness and client: --step-cap N runs every request at max_denoising_steps N, default 16; both sides alike)
    # agreement of two sides (prints per-prompt equality of the prompt and output token ids and the index of the
    # first differing output token; exit 0 whatever the agreement, 2 when the two ran at different step caps or a
    # file is no record)
    python3 -m blockdiff.bench.experiments.serve_smoke compare harness.json srv.json
    # one JSON record of several comparisons (exit 1 when a --require'd pair differs anywhere)
    python3 -m blockdiff.bench.experiments.serve_smoke record --out rec.json --pair NAME a.json b.json [--require NAME]
    # requests the plugin refuses (REFUSED: top_k, logprobs, an unknown vllm_xargs key, temperature 0.5, top_k streamed)
    # at once beside one plain greedy request: each refused one must fail (HTTP 4xx / 5xx, finish reason "error", or
    # for the streamed one an error event), the
    # plain one must be served (exit 1 otherwise); records every status, finish reason and error text
    python3 -m blockdiff.bench.experiments.serve_smoke refusals --base-url URL --model MODEL --out refusals.json

What makes the two sides comparable:

* Greedy under vLLM is ``vllm_xargs {"t_min": 0, "t_max": 0}`` (vLLM refuses temperature != 1 and seeds for
  diffusion models). Every other diffusion parameter (:data:`PARAMS`: step cap, entropy bound, confidence and
  stability thresholds) is sent explicitly too, so the server's ``generation_config.json`` does not matter.
* Greedy still starts each canvas from random tokens, keyed by the request's RNG identity: the client sends
  ``vllm_xargs["rng_request_id"]`` = the harness's request id (``req-0`` ...), since vLLM's own request ids end in
  random characters (:data:`blockdiff.integration.model_state.VLLM_RNG_REQUEST_ID`).
* The plugin's CUSTOM attention applies the checkpoint's bidirectional window rule (``"prefix"``), as the harness.
* The two sides run different implementations of the model (vLLM's Gemma 4 layers vs blockdiff's), which round
  differently in bf16; on this small checkpoint a 1-ulp change (RMSNorm's rounding order alone) changes greedy
  outputs from the second token on. Token-for-token equality is the check in float32 (``vllm serve --dtype
  float32`` and ``harness --dtype float32``); in bf16 ``compare`` reports the agreement only.

``--sampled`` sends the :data:`PARAMS` schedule instead of greedy and reports agreement only as a rate. The client
side uses only the standard library.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request

from blockdiff.integration.cli import ATTENTION_BACKENDS, SAMPLER_BACKENDS  # the backend names, no torch import
from blockdiff.integration.demo import TEXT_REQUESTS

MAX_TOKENS = 64
STEP_CAP = 16
#: The step caps a request may set: below the sampler's limit (blockdiff.sampler.params' MAX_STEPS, 2**14: its
#: counter layout; a test checks the two agree, so the client side need not import the sampler).
MAX_STEP_CAP = 1 << 14
#: Diffusion parameters both sides set explicitly (blockdiff SamplingParams field -> value); greedy overrides
#: t_min / t_max with 0. The values are SamplingParams' defaults with the demo's step cap for the trained checkpoint.
PARAMS = {"max_denoising_steps": STEP_CAP, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
          "confidence_threshold": 0.005, "stability_threshold": 1}
GREEDY = {"t_min": 0.0, "t_max": 0.0}
#: SamplingParams field -> vllm_xargs key (blockdiff.integration.model_state.VLLM_EXTRA_ARGS, inverted; a test
#: checks the two agree: the client imports no blockdiff module that needs torch).
XARGS_KEYS = {"max_denoising_steps": "diffusion_max_steps", "t_min": "t_min", "t_max": "t_max",
              "entropy_bound": "entropy_bound", "confidence_threshold": "confidence_threshold",
              "stability_threshold": "stability_threshold"}
#: vllm_xargs key of the request's RNG identity (blockdiff.integration.model_state.VLLM_RNG_REQUEST_ID).
RNG_REQUEST_ID = "rng_request_id"
DTYPES = ("bfloat16", "float32")


def _prompts():
    return [(rid, text) for rid, text, *_ in TEXT_REQUESTS]


def check_step_cap(step_cap) -> int:
    """``step_cap`` (the requests' ``max_denoising_steps``) checked: an int in ``[1, MAX_STEP_CAP)``.

    Raises:
        TypeError: not an int (a bool included). ValueError: below 1, or at or above :data:`MAX_STEP_CAP`.
    """
    if isinstance(step_cap, bool) or not isinstance(step_cap, int):
        raise TypeError(f"step_cap must be an int, got {type(step_cap).__name__}")
    if not 1 <= step_cap < MAX_STEP_CAP:
        raise ValueError(f"step_cap must be in [1, {MAX_STEP_CAP}), got {step_cap}")
    return step_cap


def diffusion_params(sampled: bool, step_cap: int = STEP_CAP) -> dict:
    """The SamplingParams fields both sides set: :data:`PARAMS` with ``max_denoising_steps = step_cap`` (a low cap
    makes canvases reach it: the asynchronous fused commit fuses only those, docs/tuning.md 7.38), with
    :data:`GREEDY` unless ``sampled``."""
    return {**PARAMS, "max_denoising_steps": check_step_cap(step_cap), **({} if sampled else GREEDY)}


def vllm_xargs(rid: str, sampled: bool, step_cap: int = STEP_CAP) -> dict:
    """The ``vllm_xargs`` of the request for harness request ``rid``: :func:`diffusion_params` under vLLM's keys and
    the RNG identity ``rid``."""
    out = {XARGS_KEYS[k]: v for k, v in diffusion_params(sampled, step_cap).items()}
    out[RNG_REQUEST_ID] = rid
    return out


def run_harness(out: str, device: str, attn_backend: str, sampler_backend: str, sampled: bool,
                dtype: str = "bfloat16", step_cap: int = STEP_CAP) -> dict:
    """Greedy (or sampled) completions of the demo prompts through HarnessRunner on the shipped checkpoint, in
    ``dtype`` (``"bfloat16"``: as stored; ``"float32"``: for the token-for-token check against a float32 server),
    every request at ``max_denoising_steps = step_cap``."""
    import torch  # heavy; the client side needs none of it

    from blockdiff.integration import HarnessRunner
    from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
    from blockdiff.sampler import SamplingParams

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    check_step_cap(step_cap)
    dev = torch.device(device)
    model, tok = load_pretrained(shipped_checkpoint_dir(), device=dev, dtype=getattr(torch, dtype))
    cl = model.config.canvas_length
    params = SamplingParams(canvas_length=cl, eos_token_ids=(tok.eos_token_id,), max_tokens=MAX_TOKENS,
                            **diffusion_params(sampled, step_cap))
    prompts = _prompts()
    runner = HarnessRunner(model, default_params=params, max_num_reqs=len(prompts),
                           max_num_batched_tokens=len(prompts) * max(cl, 64), page_size=16,
                           max_model_len=256 + MAX_TOKENS + cl, device=dev, attn_backend=attn_backend,
                           sampler_backend=sampler_backend)
    ids = {rid: tok.encode(text) for rid, text in prompts}
    for rid, _ in prompts:
        runner.add_request(rid, ids[rid], params)
    res = runner.run()
    rows = {rid: {"prompt": text, "prompt_token_ids": ids[rid], "token_ids": list(res[rid].output_token_ids),
                  "text": tok.decode(list(res[rid].output_token_ids)), "finish_reason": res[rid].finish_reason}
            for rid, text in prompts}
    rec = {"side": "harness", "device": device, "dtype": dtype, "attn_backend": attn_backend,
           "sampler_backend": sampler_backend, "sampled": sampled, "step_cap": step_cap, "rows": rows}
    json.dump(rec, open(out, "w"), indent=1)
    return rec


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_client(base_url: str, model: str, out: str, sampled: bool, timeout: float, concurrent: bool = False,
               step_cap: int = STEP_CAP) -> dict:
    """One completion per demo prompt from the server (:func:`vllm_xargs` per request); records text, prompt and
    output token ids (via ``return_token_ids``) and errors. ``concurrent``: all prompts at once (one thread each), so
    the server's batches mix prefill, denoise and commit rows (per-request causal flags that change from step to
    step); otherwise one request at a time. Every request at ``max_denoising_steps = step_cap``."""
    check_step_cap(step_cap)
    rows = {}

    def one(rid, text):
        body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "vllm_xargs": vllm_xargs(rid, sampled, step_cap),
                "return_token_ids": True}
        t0 = time.perf_counter()
        try:
            r = _post(base_url.rstrip("/") + "/v1/completions", body, timeout)
            ch = r["choices"][0]
            rows[rid] = {"prompt": text, "prompt_token_ids": ch.get("prompt_token_ids"), "text": ch.get("text"),
                         "token_ids": ch.get("token_ids"), "finish_reason": ch.get("finish_reason"),
                         "seconds": time.perf_counter() - t0}
        except Exception as e:  # recorded, never lost: a failed request is a row with its error
            detail = getattr(e, "read", lambda: b"")()
            rows[rid] = {"prompt": text, "error": f"{type(e).__name__}: {e} {detail[:500]!r}"}

    if concurrent:
        threads = [threading.Thread(target=one, args=p) for p in _prompts()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows = {rid: rows[rid] for rid, _ in _prompts()}
    else:
        for rid, text in _prompts():
            one(rid, text)
    rec = {"side": base_url, "model": model, "sampled": sampled, "concurrent": concurrent, "step_cap": step_cap,
           "rows": rows}
    json.dump(rec, open(out, "w"), indent=1)
    return rec


#: Requests the plugin's scheduler refuses at add_request (blockdiff.integration.vllm_params.vllm_request_params):
#: name -> completion body fields on top of the plain greedy request's.
REFUSED = {"top_k": {"top_k": 5}, "logprobs": {"logprobs": 1},
           "unknown_xarg": {"vllm_xargs": {"not_a_blockdiff_key": 1}}, "temperature": {"temperature": 0.5},
           "top_k_streamed": {"top_k": 5, "stream": True}}


def _post_status(url: str, body: dict, timeout: float) -> tuple[int, dict | str]:
    """POST ``body`` as JSON: ``(HTTP status, parsed JSON body or its text)``; an HTTP error status is a result,
    not an exception (a connection failure still raises)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")[:2000]


#: A streamed answer that ended with neither a finish reason nor an error event: the request did not complete.
#: Measured on vLLM 0.26.0 (H200, 2026-12-07) for a request the plugin refuses at ``add_request``.
STREAM_WITHOUT_END = ("the stream ended with no finish reason and no error event (vLLM 0.26.0 sends only "
                      "'data: [DONE]' for a request that fails before its first token)")


def classify_refusal(status: int, body) -> dict:
    """What a client saw for one request: ``{"status", "finish_reason", "text", "error"}``; ``"failed"`` True when
    the request failed (an HTTP status >= 400, finish reason ``error``, or in a streamed answer (``body`` the
    server-sent events' text) an ``error`` event, a choice finishing with ``error``, or no finish reason at all:
    :data:`STREAM_WITHOUT_END`), False when it was served."""
    row = {"status": status, "finish_reason": None, "text": None, "error": None}
    no_end = False
    if isinstance(body, dict):
        ch = (body.get("choices") or [{}])[0]
        row["finish_reason"], row["text"] = ch.get("finish_reason"), ch.get("text")
        err = body.get("error")
        if err is not None:
            row["error"] = err.get("message", err) if isinstance(err, dict) else err
        elif body.get("message") is not None:
            row["error"] = body["message"]
    else:  # a streamed answer (server-sent events, "data: {...}" lines): its error event or finish reason
        row["error"] = None if "data: " in body else body
        for line in body.splitlines():
            if not line.startswith("data: {"):
                continue
            try:
                ev = json.loads(line[6:])
            except ValueError:
                continue
            if ev.get("error") is not None:
                err = ev["error"]
                row["error"] = err.get("message", err) if isinstance(err, dict) else err
                row["finish_reason"] = row["finish_reason"] or "error"
            for ch in ev.get("choices") or ():
                row["finish_reason"] = ch.get("finish_reason") or row["finish_reason"]
        if status < 400 and row["finish_reason"] is None:
            # vLLM 0.26.0's completion stream skips empty chunks before it checks for finish reason "error", so a
            # request refused before its first token gets HTTP 200 and only "data: [DONE]" (0.33.0 checks first);
            # an empty body or one with no event at all ended no request either (its text, if any, kept as the error)
            no_end = True
            row["error"] = row["error"] or STREAM_WITHOUT_END
    row["failed"] = status >= 400 or row["finish_reason"] == "error" or no_end
    return row


def run_refusals(base_url: str, model: str, out: str, timeout: float) -> dict:
    """Send every :data:`REFUSED` request and one plain greedy request (the first demo prompt), all at once, to the
    server; ``ok`` when each refused request failed and the plain one was served (a finish reason other than
    ``error``, some text). Writes and returns the record ``{"side", "model", "ok", "rows"}`` (rows: name ->
    :func:`classify_refusal`)."""
    rid, text = _prompts()[0]
    base = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "vllm_xargs": vllm_xargs(rid, False)}
    bodies = {"plain": base}
    for name, extra in REFUSED.items():
        body = dict(base, **{k: v for k, v in extra.items() if k != "vllm_xargs"})
        body["vllm_xargs"] = dict(base["vllm_xargs"], **extra.get("vllm_xargs", {}))
        bodies[name] = body
    rows: dict = {}

    def one(name):
        try:
            rows[name] = classify_refusal(*_post_status(base_url.rstrip("/") + "/v1/completions", bodies[name],
                                                        timeout))
        except Exception as e:  # recorded, never lost
            rows[name] = {"status": None, "failed": True, "error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=one, args=(n,)) for n in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plain = rows["plain"]
    ok = not plain["failed"] and bool(plain.get("text")) and all(rows[n]["failed"] for n in REFUSED)
    rec = {"side": base_url, "model": model, "ok": ok, "rows": {n: rows[n] for n in bodies}}
    json.dump(rec, open(out, "w"), indent=1)
    for n in bodies:
        r = rows[n]
        print(f"{n}: status {r.get('status')} finish_reason {r.get('finish_reason')!r} failed {r['failed']} "
              f"error {str(r.get('error'))[:160]!r}")
    print("refusals", "ok" if ok else "NOT ok")
    return rec


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_rows(ra: dict, rb: dict) -> dict:
    """Per-prompt agreement of two records' rows: ``equal`` (output token ids when both sides have them, else the
    text), ``first_diff_token`` (index of the first differing output token, None when equal), the common text
    prefix in characters, and ``prompt_equal`` (the prompt token ids agree: a server that added a BOS would not);
    a row missing or failed on either side is ``equal: False`` with its error. Every prompt of either side is
    compared (``ra``'s order, then those only ``rb`` has: a failed server request was dropped when the other side
    lacked its prompt)."""
    out = {}
    for rid in [*ra, *(r for r in rb if r not in ra)]:
        a, b = ra.get(rid, {}), rb.get(rid, {})
        ta, tb = a.get("text"), b.get("text")
        if ta is None or tb is None:
            out[rid] = {"equal": False, "error": a.get("error") or b.get("error") or "missing"}
            continue
        row = {"common_prefix_chars": _common_prefix(ta, tb), "len": [len(ta), len(tb)]}
        ia, ib = a.get("token_ids"), b.get("token_ids")
        if ia is not None and ib is not None:
            n = _common_prefix(ia, ib)
            row.update(equal=ia == ib, first_diff_token=None if ia == ib else n, num_tokens=[len(ia), len(ib)])
        else:
            row["equal"] = ta == tb
        pa, pb = a.get("prompt_token_ids"), b.get("prompt_token_ids")
        if pa is not None and pb is not None:
            row["prompt_equal"] = pa == pb
        out[rid] = row
    return out


def load_record(path: str) -> dict:
    """A record file of ``harness`` / ``client`` (a JSON object whose ``rows`` maps request ids to objects).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or not such a record (the file named).
    """
    with open(path) as f:
        try:
            rec = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    rows = rec.get("rows") if isinstance(rec, dict) else None
    if not isinstance(rows, dict) or not all(isinstance(v, dict) for v in rows.values()):
        raise ValueError(f"{path}: not a serve_smoke harness / client record (a JSON object whose 'rows' maps request "
                         f"ids to objects)")
    return rec


def check_same_step_cap(ra: dict, rb: dict) -> None:
    """Two records ran their requests at the same step cap (a record without ``step_cap`` ran at
    :data:`STEP_CAP`, as every record did before the field).

    Raises:
        ValueError: the caps differ (their tokens are not comparable).
    """
    ca, cb = ra.get("step_cap", STEP_CAP), rb.get("step_cap", STEP_CAP)
    if ca != cb:
        raise ValueError(f"the two records ran at different step caps ({ca} and {cb}): their tokens are not "
                         "comparable")


def compare(a: str, b: str) -> dict:
    """:func:`compare_rows` of two record files, printed with the count of equal prompts.

    Raises:
        ValueError: a file is no record (:func:`load_record`), or the records ran at different step caps
            (:func:`check_same_step_cap`).
        OSError: a file cannot be read.
    """
    ra, rb = load_record(a), load_record(b)
    check_same_step_cap(ra, rb)
    out = compare_rows(ra["rows"], rb["rows"])
    eq = sum(v["equal"] for v in out.values())
    print(json.dumps(out, indent=1))
    print(f"equal: {eq} of {len(out)}")
    return out


def record(out: str, pairs: list[tuple[str, str, str]], required: list[str] = ()) -> dict:
    """One JSON record of several comparisons, the evidence a run keeps (``serve_graph_parity.sh``): for each pair
    ``(name, a, b)`` of record files, :func:`compare_rows` of their rows with the count of equal prompts, and
    ``must_equal`` (the name is in ``required``: every prompt must be equal) with ``ok``; plus the environment
    (:func:`blockdiff.bench.common.env_record`) and each side's ``sampled`` / ``dtype`` / ``concurrent`` fields as
    written.

    Args:
        out: the JSON file written.
        pairs: ``(name, a, b)``; ``name`` unique, ``a`` / ``b`` record files of ``harness`` / ``client``. A missing
            file, or one that is no record (:func:`load_record`), is recorded as the error of that pair (a server
            that never came up), not raised, so the other pairs are kept.
        required: names of pairs that must be equal on every prompt.

    Returns:
        The record, with ``ok``: every required pair equal on every prompt (and present).

    Raises:
        ValueError: a duplicate pair name, or a required name that is no pair's.
    """
    from blockdiff.bench import common

    names = [n for n, _, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"pairs: names must be unique, got {names}")
    unknown = sorted(set(required) - set(names))
    if unknown:
        raise ValueError(f"required: {unknown} name no pair (pairs: {names})")
    res = {}
    for name, a, b in pairs:
        entry = {"a": a, "b": b, "must_equal": name in required}
        try:
            ra, rb = load_record(a), load_record(b)
            check_same_step_cap(ra, rb)
        except (OSError, ValueError) as e:
            entry.update(error=f"{type(e).__name__}: {e}"[:300], equal=0, of=0, ok=False)
            res[name] = entry
            continue
        rows = compare_rows(ra["rows"], rb["rows"])
        eq = sum(bool(v["equal"]) for v in rows.values())
        entry.update({f"{side}_{k}": r.get(k) for side, r in (("a", ra), ("b", rb))
                      for k in ("sampled", "dtype", "concurrent", "step_cap")})
        entry.update(equal=eq, of=len(rows), ok=(eq == len(rows) and len(rows) > 0) or name not in required,
                     rows=rows)
        res[name] = entry
    rec = {"suite": "serve_graph_parity", "env": common.env_record(), "pairs": res,
           "ok": all(v["ok"] for v in res.values() if v["must_equal"])}
    with open(out, "w") as f:
        json.dump(common.jsonable(rec), f, indent=1)
    for name, v in res.items():
        print(f"{name}: {v['equal']} of {v['of']}" + (" (must be equal)" if v["must_equal"] else "")
              + (f" [{v['error']}]" if "error" in v else ""))
    print(f"ok: {rec['ok']}")
    return rec


def _timeout_arg(text: str) -> float:
    """argparse type of ``--timeout``: seconds, a finite number > 0 (``nan``, 0 or a negative value reached every
    request's socket, each recorded as a failed request, exit 0)."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def _out_arg(text: str) -> str:
    """argparse type of ``--out``: a JSON file that can be written, checked before any work (a folder, an empty path,
    a missing or unwritable folder: the harness or the server's requests ran, then ``open(out, "w")`` raised and the
    record was lost)."""
    import os

    if not text.strip() or text.endswith(("/", os.sep)) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"a file name is needed (an empty path or a folder names no file), got "
                                         f"{text!r}")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"its folder {parent!r} is not a writable folder, got {text!r}")
    return text


def _step_cap_arg(text: str) -> int:
    try:
        return check_step_cap(int(text))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an int >= 1 and below {MAX_STEP_CAP}, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("harness")
    h.add_argument("--out", type=_out_arg, required=True)
    h.add_argument("--device", default="cuda")
    h.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="model dtype (float32 for the token-for-token check against vllm serve --dtype float32)")
    h.add_argument("--attn-backend", choices=ATTENTION_BACKENDS, default="triton")
    h.add_argument("--sampler-backend", choices=SAMPLER_BACKENDS, default="triton")
    h.add_argument("--sampled", action="store_true")
    h.add_argument("--step-cap", type=_step_cap_arg, default=STEP_CAP, help="max_denoising_steps of every request")
    c = sub.add_parser("client")
    c.add_argument("--base-url", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--out", type=_out_arg, required=True)
    c.add_argument("--sampled", action="store_true")
    c.add_argument("--timeout", type=_timeout_arg, default=120.0, help="seconds a request may take (default 120)")
    c.add_argument("--concurrent", action="store_true", help="send every prompt at once (mixed batches)")
    c.add_argument("--step-cap", type=_step_cap_arg, default=STEP_CAP, help="max_denoising_steps of every request")
    m = sub.add_parser("compare")
    m.add_argument("a")
    m.add_argument("b")
    r = sub.add_parser("record", help="write one JSON record of several comparisons (exit 1 when a required one "
                        "is not equal on every prompt)")
    r.add_argument("--out", type=_out_arg, required=True)
    r.add_argument("--pair", nargs=3, action="append", required=True, metavar=("NAME", "A", "B"))
    r.add_argument("--require", action="append", default=[], metavar="NAME",
                   help="a pair that must be equal on every prompt")
    f = sub.add_parser("refusals", help="refused requests beside a plain one (exit 1 unless each refused one fails "
                       "and the plain one is served)")
    f.add_argument("--base-url", required=True)
    f.add_argument("--model", required=True)
    f.add_argument("--out", type=_out_arg, required=True)
    f.add_argument("--timeout", type=_timeout_arg, default=120.0, help="seconds a request may take (default 120)")
    args = ap.parse_args(argv)
    if args.cmd == "refusals":
        return 0 if run_refusals(args.base_url, args.model, args.out, args.timeout)["ok"] else 1
    if args.cmd == "record":
        return 0 if record(args.out, [tuple(p) for p in args.pair], args.require)["ok"] else 1
    if args.cmd == "harness":
        run_harness(args.out, args.device, args.attn_backend, args.sampler_backend, args.sampled, args.dtype,
                    args.step_cap)
    elif args.cmd == "client":
        run_client(args.base_url, args.model, args.out, args.sampled, args.timeout, args.concurrent, args.step_cap)
    else:
        try:
            compare(args.a, args.b)
        except (ValueError, OSError) as e:
            print(f"serve_smoke compare: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
