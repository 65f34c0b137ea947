"""Sampler benchmark: one denoising step of ``sampler_n4`` with the reference, torch.compile and fused backends.

Usage (H200; ``source bench/device_env.sh`` makes ``blockdiff.*`` importable; results go to $OUT or bench/results/,
``--quick`` ones to bench/results/local/):

    python3 -m blockdiff.bench.bench_sampler                       # reference, compile, fused (defaults) + comparison tiles
    python3 -m blockdiff.bench.bench_sampler --tune                # + checked config sweep first (~1-2 min more)
    python3 -m blockdiff.bench.bench_sampler --backends fused --split-k 1,2,3,4
    python3 -m blockdiff.bench.bench_sampler --quick               # CPU smoke run (< 60 s, Triton interpreter)

Workload ``sampler_n4`` (docs/ARCHITECTURE.md "Named workloads"): N = 4 requests, canvas CL = 256, vocabulary
V = 262144, fp32 logits [4, 256, 262144] (1.07 GB), tied embedding E [262144, 2816] bf16 (1.48 GB), hidden 2816.
Logits are ``30 * tanh(4 * randn / 30)`` (Gemma's final soft-cap 30 over a wide Gaussian: dense softmax, the
worst case for the soft-embedding GEMM; real LM rows are far more peaked). One request is greedy (T = 0), three
sample at T = 0.8 -> 0.4 (S = 10000 steps so no row converges while being timed: every call is a full denoise step).

Backends (one row each, all measured in the same run):
  reference  blockdiff.sampler.reference.sampler_step, eager: dense [N, CL, V] fp32 temporaries (z, Gumbel noise,
             softmax, int64 Philox words), ``p.bf16() @ E`` on cuBLAS.
  compile    torch.compile of the same reference step (the anchor, ``ANCHORS_MS``). Every row carries
             ``vs_compile_same_run`` = its time / this run's compile time, like for like (:func:`vs_compile`: the
             CUDA-graph medians when both rows have one, else the eager ones; ``vs_compile_same_run_of`` says which).
  fused      blockdiff.sampler.triton.sampler_step with its defaults (SamplerConfig): (a) the streaming stats
             kernel, (b) the decisions, (c) the soft embedding (on CUDA ``soft_impl="chunked"``: bf16 probability
             chunks [N * CL, 16384] written by a Triton kernel from the stats + ``torch.addmm`` on cuBLAS).
             ``fused[triton_gemm]``: the same step with the split-K Triton GEMM for (c); ``fused[stats_overlap]``:
             the stats pass on a side stream beside the GEMMs; ``fused[<tile>]`` (GPU, unless --no-compare): the
             GEMM tiles of ``COMPARE_GEMM``; ``fused:stats`` / ``fused:soft_gemm`` / ``fused:soft_chunked`` /
             ``fused:moments``: one stage alone. --no-chunked skips the chunked rows.
  --tune     sweeps stats and GEMM candidates (``fused:tune:*`` rows). Every candidate is checked before it is timed
             (stats: ids and m exact, inv_s / entropy to rounding; GEMM: finite workspace, 2 % of a bf16 torch
             product); one that fails is recorded (status error, ``discarded``) and never applied. The winner runs
             as a fully checked ``fused[tuned]`` row.

Before timing, every backend's decisions on this big shape are checked against the reference from identical
states (accepted positions, sampled/argmax/renoised ids, convergence, failure flags, every state tensor: exact;
entropies rtol 1e-4; soft embedding within 2 % of its max magnitude — the reference rounds its product to bf16).
A failing check or backend records an error row; the run continues; the exit status is 1 if a (non-tune) row
failed its check. A summary table is printed last.

Metrics: eager_ms (triton.testing.do_bench median, L2 flushed), graph_ms (CUDA-graph replay median),
extra_memory_bytes (peak allocation of one call above the live state), gbps = (logit bytes + E bytes) / time
(the read floor), effective_tflops = 2 * N * CL * V * hidden / time (the soft-embedding GEMM). Measured history
and the per-stage predictions: docs/tuning.md ("bench_sampler.py").
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from blockdiff.bench import common  # noqa: E402
from blockdiff.sampler import DENOISE, SamplerState, SamplingParams, reference  # noqa: E402
from blockdiff.sampler.common import fresh_canvas, temperature  # noqa: E402
from blockdiff.sampler.triton import SamplerConfig  # noqa: E402
from blockdiff.sampler.triton import sampler_step as triton_sampler_step  # noqa: E402
from blockdiff.sampler.triton.soft_embedding import soft_embedding  # noqa: E402
from blockdiff.sampler.triton.stats import row_moments, row_stats  # noqa: E402

SUITE = "sampler"
WORKLOAD = "sampler_n4"
ANCHORS_MS = {"compile": 7.35}  # H200 batch 1 (torch 2.11, CUDA graph); rows also carry vs_compile_same_run
#: The GPU (:func:`common.gpu_slug`) of :data:`ANCHORS_MS`: ``vs_compile_anchor`` (a row's CUDA-graph median over the
#: anchor, on ``sampler_n4`` only) is left None on any other GPU and for other workloads.
ANCHOR_GPU = "h200"
ANCHOR_EXTRA_MEMORY_BYTES = {"compile": int(4.83e9)}
#: The GEMM tile of the previous default (timed beside the new default unless --no-compare).
PREVIOUS_GEMM = dict(block_m=128, block_n=128, block_k=64, gemm_warps=8, gemm_stages=3)
#: GEMM tiles timed beside the default in a plain run: the previous default and a two-CTAs-per-SM tile.
COMPARE_GEMM = [dict(PREVIOUS_GEMM, soft_impl="triton_gemm"),
                dict(block_m=64, block_n=256, block_k=64, gemm_warps=4, gemm_stages=2, soft_impl="triton_gemm")]
ALL_BACKENDS = ("reference", "compile", "fused")


def _chunked_config():
    return SamplerConfig(soft_impl="chunked"), SamplerConfig(soft_impl="triton_gemm")


#: ``CHUNKED``: the default soft embedding on CUDA (bf16 probability chunks + cuBLAS addmm), timed alone as the
#: ``fused:soft_chunked`` part; ``TRITON_GEMM``: the split-K Triton GEMM path, the ``fused[triton_gemm]`` row.
CHUNKED, TRITON_GEMM = _chunked_config()
#: ``fused[stats_overlap]``: the chunked path with the stats pass on a side stream beside the soft-embedding GEMMs
#: (normalisers from the memory-bound ``row_moments`` pre-pass, timed alone as ``fused:moments``).
STATS_OVERLAP = dataclasses.replace(CHUNKED, stats_overlap=True)
SHAPES = {"full": dict(N=4, CL=256, V=262144, H=2816), "quick": dict(N=2, CL=16, V=512, H=64)}
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_sampled", "num_rejected", "temperature")
STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted")


def workload_name(shape: dict, quick: bool) -> str:
    """The workload of a shape: ``sampler_n4`` (the named one, also for the smaller ``--quick`` shape) unless the
    shape says ``named`` False, then ``sampler_n{N}`` (``-sampled`` when every row is sampled); ``-quick`` on the
    CPU shape."""
    name = WORKLOAD if shape.get("named", True) else \
        f"sampler_n{shape['N']}" + ("-sampled" if shape.get("all_sampled") else "")
    return name + ("-quick" if quick else "")


def make_inputs(N, CL, V, H, device, seed=0, all_sampled=False):
    """Logits [N, CL, V] fp32 (soft-capped), E [V, H] bf16, prefill_done, slots and the per-request params (the
    last request greedy unless ``all_sampled``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, CL, V, device=device, generator=g) * 4.0
    x = 30.0 * torch.tanh(x / 30.0)
    E = (torch.randn(V, H, device=device, generator=g) * 0.02).to(torch.bfloat16)
    params = [SamplingParams(canvas_length=CL, seed=100 + i, max_denoising_steps=10000,
                             t_min=0.0 if i == N - 1 and not all_sampled else 0.4,
                             t_max=0.0 if i == N - 1 and not all_sampled else 0.8)
              for i in range(N)]
    slots = torch.arange(N, device=device, dtype=torch.int64)
    pd = torch.ones(N, dtype=torch.bool, device=device)
    return x, E, params, slots, pd


def make_state(params, CL, V, H, device):
    """A state with the requests in slots 0..N-1, moved from PREFILL to DENOISE (fresh canvases).

    The PREFILL -> DENOISE pass reads no logits; it runs the shared phase bookkeeping only (no [N, CL, V] work).
    """
    st = SamplerState(len(params), CL, V, H, device=device)
    for i, p in enumerate(params):
        st.add_request(i, 5000 + i, p)
    slots = torch.arange(len(params), device=device)
    st.canvas[slots] = fresh_canvas(st, slots, st.canvas_index[slots])
    st.phase[slots] = DENOISE
    return st


def step_fn(backend: str, config=None, compile_backend: str = "inductor"):
    """The callable ``f(state, slots, logits, prefill_done, E)`` of a benchmark backend."""
    if backend == "reference":
        return reference.sampler_step
    if backend == "compile":
        return torch.compile(reference.sampler_step, dynamic=False, backend=compile_backend)
    if backend == "fused":
        return lambda st, s, x, pd, E: triton_sampler_step(st, s, x, pd, E, config=config)
    raise ValueError(f"unknown backend {backend!r}")


def check_against_reference(fn, x, E, params, slots, pd, CL, V, H, device) -> dict:
    """Run one step with ``fn`` and the reference from identical states; raise AssertionError on a mismatch."""
    a = make_state(params, CL, V, H, device)
    b = make_state(params, CL, V, H, device)
    oa = reference.sampler_step(a, slots, x, pd, E)
    ob = fn(b, slots, x, pd, E)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for f in DECISIONS:
        if not torch.equal(getattr(oa, f), getattr(ob, f)):
            bad = (getattr(oa, f) != getattr(ob, f)).sum().item()
            raise AssertionError(f"decision {f!r} differs from the reference in {bad} entries")
    for f in STATE_FIELDS:
        if not torch.equal(getattr(a, f), getattr(b, f)):
            raise AssertionError(f"state {f!r} differs from the reference")
    if not torch.allclose(oa.entropy, ob.entropy, rtol=1e-4, atol=1e-5, equal_nan=True):
        raise AssertionError(f"entropy differs: max {(oa.entropy - ob.entropy).abs().max().item():.3g}")
    soft_err = (a.soft - b.soft).abs().max().item()
    scale = a.soft.abs().max().item()
    if not soft_err <= 0.02 * scale + 1e-6:
        raise AssertionError(f"soft embedding differs: max abs {soft_err:.3g} vs magnitude {scale:.3g}")
    info = {"soft_max_abs_diff": soft_err, "soft_max_abs": scale,
            "entropy_max_abs_diff": (oa.entropy - ob.entropy).abs().max().item(),
            "accepted_per_row": ob.accepted.sum(-1).tolist()}
    return info, b


def measure(name, fn, x, E, params, slots, pd, shape, device, quick, graphs=True, check=True) -> dict:
    N, CL, V, H = shape["N"], shape["CL"], shape["V"], shape["H"]
    row = {"workload": workload_name(shape, quick), "backend": name, "N": N,
           "canvas_length": CL, "vocab_size": V, "hidden_size": H, "status": "ok"}
    try:
        t0 = time.perf_counter()
        st = None
        if check:
            info, st = check_against_reference(fn, x, E, params, slots, pd, CL, V, H, device)
            row.update(info)
            row["correct"] = True
        row["check_s"] = time.perf_counter() - t0
        if st is None:  # timing continues on the checked state (torch.compile guards stay valid: no recompile)
            st = make_state(params, CL, V, H, device)
        call = lambda: fn(st, slots, x, pd, E)  # noqa: E731
        call()
        row["extra_memory_bytes"] = common.peak_extra_memory_bytes(call, device)
        row["eager_ms"] = common.time_eager_ms(call, device)
        if graphs and device.type == "cuda":
            try:
                row["graph_ms"] = common.time_graph_ms(call)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - a failing backend is a row, not a crash
        row["status"] = "error"
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        row["correct"] = False if isinstance(e, AssertionError) else row.get("correct")
        traceback.print_exc()
    add_rates(row, shape)
    return row


def add_rates(row, shape):
    N, CL, V, H = shape["N"], shape["CL"], shape["V"], shape["H"]
    ms = row.get("graph_ms") or row.get("eager_ms")
    read_bytes = N * CL * V * 4 + V * H * 2
    flops = 2.0 * N * CL * V * H
    if row.get("part") in ("stats", "moments"):
        read_bytes, flops = N * CL * V * 4, 0.0
    row["time_ms"] = ms
    row["gbps"] = read_bytes / (ms * 1e-3) / 1e9 if ms else None
    row["effective_tflops"] = flops / (ms * 1e-3) / 1e12 if ms and flops else None
    anchor = ANCHORS_MS["compile"]  # a CUDA-graph median of the named workload
    graph = row.get("graph_ms")
    row["vs_compile_anchor"] = graph / anchor if graph and row.get("workload") == WORKLOAD else None


def vs_compile(row: dict, compile_row: dict) -> tuple[float | None, str | None]:
    """``row``'s time over the same run's torch.compile time, like for like: (ratio, "graph_ms") when both rows have a
    CUDA-graph median, else (ratio, "eager_ms") when both have an eager one, else (None, None). (Was ``time_ms`` over
    ``time_ms``: a row without a graph time, such as every ``--tune`` candidate, had its eager median, with the
    launches and the L2 flush, divided by compile's graph replay, and the other way round.)"""
    for key in ("graph_ms", "eager_ms"):
        a, b = row.get(key), compile_row.get(key)
        if a and b:
            return a / b, key
    return None, None


def config_label(cfg) -> str:
    """Short label of a SamplerConfig's explicit fields, e.g. ``128x128x64w8s3`` or ``sk2``."""
    d = {k: v for k, v in cfg.__dict__.items() if v is not None}
    tile = ""
    if "block_m" in d:
        tile = f"{d['block_m']}x{d.get('block_n', '?')}x{d.get('block_k', '?')}w{d.get('gemm_warps', '?')}" \
               f"s{d.get('gemm_stages', '?')}"
    return tile + (f"sk{d['split_k']}" if "split_k" in d else "") + (f"sv{d['split_v']}" if "split_v" in d
                                                                      else "") \
        + (f"chunk{d['soft_chunk']}" if "soft_chunk" in d else "") or "custom"


def measure_parts(x, E, params, slots, shape, device, config, chunked=False) -> list[dict]:
    """Stages (a) and (c) of the fused backend alone (same inputs as one full step); ``chunked``: also (c) of
    the chunked path (``fused:soft_chunked``)."""
    rows = []
    st = make_state(params, shape["CL"], shape["V"], shape["H"], device)
    T = temperature(st, slots)
    act = torch.ones(len(params), dtype=torch.bool, device=device)
    args = (x, T, st.seed[slots], st.request_id[slots], st.canvas_index[slots], st.step[slots], act)
    stats = row_stats(*args, config=config)
    gemm_cfg = dataclasses.replace(config or SamplerConfig(), soft_impl="triton_gemm")
    parts = {
        "stats": lambda: row_stats(*args, config=config),
        "soft_gemm": lambda: soft_embedding(x, E, T, stats["m"], stats["inv_s"], stats["argmax"], act, gemm_cfg),
    }
    if chunked:
        parts["soft_chunked"] = lambda: soft_embedding(x, E, T, stats["m"], stats["inv_s"], stats["argmax"], act,
                                                          CHUNKED)
        parts["moments"] = lambda: row_moments(x, T, act)
    for part, call in parts.items():
        row = {"workload": workload_name(shape, shape is SHAPES["quick"] or bool(shape.get("quick"))),
               "backend": f"fused:{part}",
               "part": part, "status": "ok"}
        try:
            call()
            row["extra_memory_bytes"] = common.peak_extra_memory_bytes(call, device)
            row["eager_ms"] = common.time_eager_ms(call, device)
            if device.type == "cuda":
                row["graph_ms"] = common.time_graph_ms(call)
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        add_rates(row, shape)
        rows.append(row)
    return rows


#: Candidates of the ``--tune`` sweep on the GPU (stage (a) and stage (c) are tuned separately, then combined).
TUNE_STATS = [dict(block_g=g, stats_warps=w, stats_stages=st)
              for g, w, st in ((256, 8, 3), (256, 8, 1), (256, 8, 4), (256, 4, 3), (128, 4, 3), (512, 8, 3))]
TUNE_GEMM = [dict(block_m=bm, block_n=bn, block_k=bk, gemm_warps=w, gemm_stages=st, split_k=sk)
             for (bm, bn, bk, w, st) in ((128, 128, 64, 8, 3), (64, 256, 64, 4, 2), (128, 256, 64, 8, 2),
                                         (128, 256, 64, 8, 3), (64, 256, 32, 4, 4), (64, 256, 64, 4, 3))
             for sk in (2, 3, 4)]


def check_stats_candidate(out: dict, ref: dict) -> None:
    """Stage (a) of a tune candidate against the default config's: ids exact, m exact (a max), inv_s / entropy to
    float32 rounding (summation order). ``m`` is checked too: the step check cannot see it (entropy and p are
    invariant under a consistent shift of (m, s, u)), but the GEMM needs it."""
    for k in ("argmax", "gumbel_argmax", "bad"):
        assert torch.equal(out[k], ref[k]), f"stats {k} depends on the config"
    assert torch.equal(out["m"], ref["m"]), "stats m depends on the config"
    for k in ("inv_s", "entropy"):
        assert torch.allclose(out[k], ref[k], rtol=1e-4, atol=1e-6, equal_nan=True), f"stats {k} depends on the config"


def check_gemm_candidate(ws: torch.Tensor, x, E, T, rows_checked: int = 64) -> None:
    """Stage (c) of a tune candidate: every workspace element finite (all rows are computed while tuning) and the
    first ``rows_checked`` rows of ``sum_k ws[k]`` within 2 % of max |truth| of ``softmax(x / T).bf16() @ E``."""
    assert bool(torch.isfinite(ws).all()), "soft-embedding workspace has non-finite values"
    N, CL, V = x.shape
    r = min(rows_checked, CL)
    z = x[:, :r].float() / torch.where(T == 0, 1.0, T)[:, None, None]
    p = torch.softmax(z, -1)
    greedy = (T == 0)[:, None, None]
    p = torch.where(greedy, torch.zeros_like(p).scatter_(-1, z.argmax(-1, keepdim=True), 1.0), p)
    truth = (p.reshape(-1, V).to(E.dtype) @ E).float().view(N, r, -1)
    ours = ws.sum(0).view(N, CL, -1)[:, :r]
    err = (ours - truth).abs().max().item()
    assert err <= 0.02 * truth.abs().max().item() + 1e-6, f"soft embedding off by {err:.3g}"


def tune(x, E, params, slots, shape, device) -> tuple[dict, list[dict]]:
    """Time stage (a) and stage (c) of the fused backend over candidate configs; return (best kwargs, rows).

    Every candidate is one ``fused:tune:*`` row (eager median). Each is checked before it is timed (stats: against
    the default config's outputs, m included; GEMM: finite workspace and 2 % of a bf16 torch product); a candidate
    that fails or raises is recorded (status "error", ``discarded``) and never chosen. The best of each stage is
    combined into the SamplerConfig of the ``fused[tuned]`` row, which then runs the full step check as well.
    """
    st = make_state(params, shape["CL"], shape["V"], shape["H"], device)
    T = temperature(st, slots)
    act = torch.ones(len(params), dtype=torch.bool, device=device)
    args = (x, T, st.seed[slots], st.request_id[slots], st.canvas_index[slots], st.step[slots], act)
    ref_stats = row_stats(*args)
    rows, best = [], {}
    for stage, cands in (("stats", TUNE_STATS), ("soft_gemm", TUNE_GEMM)):
        best_ms = None
        for kw in cands:
            cfg = SamplerConfig(**kw)
            if stage == "stats":
                call = lambda: row_stats(*args, config=cfg)  # noqa: E731
            else:
                call = lambda: soft_embedding(x, E, T, ref_stats["m"], ref_stats["inv_s"],  # noqa: E731
                                                 ref_stats["argmax"], act, cfg)
            row = {"workload": workload_name(shape, False), "backend": f"fused:tune:{stage}", "part": stage,
                   "config": kw,
                   "status": "ok"}
            try:
                out = call()
                if stage == "stats":
                    check_stats_candidate(out, ref_stats)
                else:
                    check_gemm_candidate(out, x, E, T)
                del out
                row["correct"] = True
                row["eager_ms"] = common.time_eager_ms(call, device)
            except Exception as e:  # noqa: BLE001 - a failing candidate is a row, never the choice
                row["status"] = "error"
                row["discarded"] = True
                row["correct"] = False if isinstance(e, AssertionError) else None
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            add_rates(row, shape)
            rows.append(row)
            common.log(f"tune {stage} {kw}: {common.fmt(row.get('eager_ms'))} ms {row.get('error', '')}")
            if row["status"] == "ok" and row.get("eager_ms") and (best_ms is None or row["eager_ms"] < best_ms):
                best_ms, best[stage] = row["eager_ms"], kw
    merged = {**best.get("stats", {}), **best.get("soft_gemm", {})}
    return merged, rows


def anchor_applies(workload: str, gpu: str | None) -> bool:
    """Whether :data:`ANCHORS_MS` (torch.compile's CUDA-graph time of :data:`WORKLOAD` on :data:`ANCHOR_GPU`) is a
    time to compare ``workload``'s rows with on the device ``gpu`` (its name, as ``env_record`` gives it)."""
    return workload == WORKLOAD and gpu is not None and common.gpu_slug(gpu) == ANCHOR_GPU


def plot(rows, out_dir: Path, stem: str, gpu: str | None = None) -> list[Path]:
    """Bar chart of the step's rows (CUDA-graph median where there is one), with the anchor and its target line
    where :func:`anchor_applies` (``gpu``: the device's name)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib missing: no plots")
        return []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("time_ms") and ":tune:" not in r["backend"]]
    if not ok:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["backend"] + (f" [{r['config']}]" if r.get("config") else "") for r in ok]
    ax.barh(names, [r["time_ms"] for r in ok], color="tab:blue")
    if anchor_applies(ok[0]["workload"], gpu):  # (was: any run but --quick, an H100's or one canvas's too)
        ax.axvline(ANCHORS_MS["compile"], color="tab:red", ls="--", label=f"compile anchor {ANCHORS_MS['compile']} ms")
        ax.axvline(ANCHORS_MS["compile"] / 2, color="tab:green", ls=":", label="target 0.5x anchor")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("ms per step (CUDA-graph median where available)")
    ax.set_title(f"{ok[0]['workload']}: sampler step")
    fig.tight_layout()
    p = out_dir / f"{stem}.png"
    common.save_png(fig, p, dpi=120)
    plt.close(fig)
    return [p]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (Triton interpreter), < 60 s")
    ap.add_argument("--backends", default=",".join(ALL_BACKENDS))
    ap.add_argument("--split-k", default="", help="comma list of fused split_k values to sweep (default: auto)")
    ap.add_argument("--gemm-tiles", default="", help="comma list of BMxBNxBKxWARPSxSTAGES for the fused GEMM")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the compile row (default inductor; aot_eager with --quick, where "
                         "inductor's CPU build takes ~3 min)")
    ap.add_argument("--tune", action="store_true",
                    help="GPU: sweep stats / GEMM configs first (~60 s more); each candidate is checked, failures are "
                         "recorded and discarded, the winner runs as a checked fused[tuned] row")
    ap.add_argument("--no-tune", action="store_true", help="(default) no config sweep; kept for old command lines")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the fused row with the previous default GEMM tile (128x128x64, 8 warps, 3 stages)")
    ap.add_argument("--no-chunked", action="store_true",
                    help="skip the fused[chunked] row (SamplerConfig(soft_impl='chunked'): bf16 probability chunks + "
                         "cuBLAS) and its fused:soft_chunked part row")
    ap.add_argument("--no-parts", action="store_true", help="skip the fused:stats / fused:soft_gemm rows")
    ap.add_argument("--canvases", type=int, default=None,
                    help="N canvases of the step (default: 4 on the GPU, the named sampler_n4; 2 with --quick); "
                         "other N record as suite sampler_n{N}")
    ap.add_argument("--all-sampled", action="store_true",
                    help="every request sampled (default: the last one greedy, as sampler_n4), as in serving")
    ap.add_argument("--split-v", default="", help="comma list of the stats pass's vocabulary splits to run as fused "
                                                   "rows (default: the automatic count only)")
    ap.add_argument("--soft-chunks", default="", help="comma list of the chunked soft embedding's vocabulary chunks "
                                                      "(tokens) to run as checked fused[chunk<Vc>] rows (default: "
                                                      "the automatic chunk only, soft_embedding.chunk_size)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default $OUT or bench/results/)")
    args = ap.parse_args(argv)
    if args.canvases is not None and (isinstance(args.canvases, bool) or args.canvases < 1):
        ap.error(f"--canvases must be >= 1, got {args.canvases}")
    try:
        split_vs = [int(v) for v in args.split_v.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--split-v must be a comma list of ints, got {args.split_v!r}")
    if any(v < 1 for v in split_vs):
        ap.error(f"--split-v values must be >= 1, got {args.split_v!r}")
    try:
        soft_chunks = list(dict.fromkeys(int(v) for v in args.soft_chunks.split(",") if v.strip()))  # unique
    except ValueError:
        ap.error(f"--soft-chunks must be a comma list of ints, got {args.soft_chunks!r}")
    if any(v < 1 for v in soft_chunks):
        ap.error(f"--soft-chunks values must be >= 1, got {args.soft_chunks!r}")
    try:
        split_ks = [int(v) for v in args.split_k.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--split-k must be a comma list of ints, got {args.split_k!r}")
    if any(v < 1 for v in split_ks):
        ap.error(f"--split-k values must be >= 1, got {args.split_k!r}")
    gemm_tiles = []
    for t in (t for t in args.gemm_tiles.split(",") if t.strip()):
        parts = t.strip().split("x")
        if len(parts) != 5 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            ap.error(f"--gemm-tiles must be a comma list of BMxBNxBKxWARPSxSTAGES (5 ints >= 1), got {t!r}")
        gemm_tiles.append([int(p) for p in parts])
    try:  # a list naming nothing (',', '') measured nothing and exited 0
        backends = common.comma_list(args.backends, "--backends")
        for flag in ("split_v", "soft_chunks", "split_k", "gemm_tiles"):
            common.comma_list(getattr(args, flag), "--" + flag.replace("_", "-"))
    except ValueError as e:
        ap.error(str(e))
    if not backends:
        ap.error(f"--backends must name at least one of {ALL_BACKENDS}")
    unknown = [b for b in backends if b not in ALL_BACKENDS]
    if unknown:
        ap.error(f"--backends: unknown backend(s) {unknown}; choose from {ALL_BACKENDS}")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    quick = args.quick or device.type != "cuda"
    shape = dict(SHAPES["quick" if quick else "full"], quick=quick, all_sampled=args.all_sampled)
    if args.canvases is not None:
        shape["N"] = args.canvases
    named = args.canvases is None and not args.all_sampled  # the named workload sampler_n4
    shape["named"] = named
    if device.type == "cuda":
        common.log(f"warm-up {common.warm_up_gpu(device):.1f} s")
    x, E, params, slots, pd = make_inputs(shape["N"], shape["CL"], shape["V"], shape["H"], device,
                                          all_sampled=args.all_sampled)

    configs = [None]
    if args.split_k or args.gemm_tiles:
        configs = []
        tiles = gemm_tiles or [None]
        for sk in (split_ks or [None]):
            for t in tiles:
                kw = {} if t is None else dict(block_m=t[0], block_n=t[1], block_k=t[2], gemm_warps=t[3],
                                                gemm_stages=t[4])
                configs.append(SamplerConfig(split_k=sk, **kw))

    compile_backend = args.compile_backend or ("aot_eager" if quick else "inductor")
    rows = []
    tuned = None
    if "fused" in backends and device.type == "cuda" and args.tune and not args.no_tune and configs == [None]:
        best, tune_rows = tune(x, E, params, slots, shape, device)
        rows += tune_rows
        if best:
            tuned = SamplerConfig(**best)
            configs = [None, tuned]
    if configs == [None] and device.type == "cuda" and not args.no_compare:
        configs = [None] + [SamplerConfig(**kw) for kw in COMPARE_GEMM]
    configs = configs + [SamplerConfig(split_v=v) for v in split_vs]
    configs = configs + [SamplerConfig(soft_impl="chunked", soft_chunk=v) for v in soft_chunks]
    if not args.no_chunked and configs[0] is None:
        configs = configs + [TRITON_GEMM]   # fused[triton_gemm]: the Triton GEMM soft-embedding path, checked too
        configs = configs + [STATS_OVERLAP]  # fused[stats_overlap]: stats on a side stream beside the GEMMs
    for b in backends:
        for cfg in (configs if b == "fused" else [None]):
            t0 = time.perf_counter()
            try:
                fn = step_fn(b, cfg, compile_backend)
            except Exception as e:  # noqa: BLE001
                rows.append({"workload": workload_name(shape, quick), "backend": b, "status": "error",
                             "error": str(e)[:300]})
                continue
            graphs = b != "compile" or device.type == "cuda"
            name = b if cfg is None else (f"{b}[tuned]" if cfg is tuned else
                                          f"{b}[triton_gemm]" if cfg is TRITON_GEMM else
                                          f"{b}[stats_overlap]" if cfg is STATS_OVERLAP else f"{b}[{config_label(cfg)}]")
            row = measure(name, fn, x, E, params, slots, pd, shape, device, quick, graphs=graphs)
            if b == "compile":
                row["compile_backend"] = compile_backend
            if cfg is not None:
                row["config"] = {k: v for k, v in cfg.__dict__.items() if v is not None}
                row["tuned"] = cfg is tuned
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            common.log(f"{b}: {row.get('status')} eager {common.fmt(row.get('eager_ms'))} ms, graph "
                       f"{common.fmt(row.get('graph_ms'))} ms {row.get('error', '')}")
    if "fused" in backends and not args.no_parts:
        good_tuned = tuned is not None and any(r.get("tuned") and r.get("status") == "ok" for r in rows)
        rows += measure_parts(x, E, params, slots, shape, device, tuned if good_tuned else configs[0],
                              chunked=not args.no_chunked)
    compile_row = next((r for r in rows if r["backend"] == "compile" and r.get("status") == "ok"), None)
    for r in rows:  # the same-run torch.compile time is the anchor when there is one
        if compile_row is not None and not quick:
            ratio, key = vs_compile(r, compile_row)
            if ratio is not None:
                r["vs_compile_same_run"], r["vs_compile_same_run_of"] = ratio, key

    env = common.env_record(device)
    if not anchor_applies(WORKLOAD, env["gpu"]):  # the anchor is an H200 time: no ratio across GPUs
        for r in rows:
            r["vs_compile_anchor"] = None
    suite = (SUITE if named else workload_name(shape, False)) + ("-quick" if quick else "")
    extra = {"anchors_ms": ANCHORS_MS, "anchor_extra_memory_bytes": ANCHOR_EXTRA_MEMORY_BYTES,
             "targets": {"fused_vs_compile": 0.5, "fused_extra_memory_bytes": 64 * 2**20},
             "workload_spec": {**shape, "logits": "fp32 30*tanh(4*randn/30)", "embedding": "bf16 0.02*randn",
                               "rows": "all sampled (T 0.8->0.4)" if args.all_sampled else
                               "N-1 sampled (T 0.8->0.4), 1 greedy"},
             "argv": common.script_argv(argv)}
    out_dir = Path(args.out) if args.out else common.results_dir(local=quick)
    path = common.write_records(suite, rows, env=env, extra=extra, out_dir=out_dir)
    pngs = [] if args.no_plots else plot(rows, out_dir, path.stem, gpu=env["gpu"])
    print(f"\nwrote {path} (+ .csv, {len(pngs)} PNG)")
    main_rows = [r for r in rows if ":tune:" not in r["backend"]]
    print(common.summary_table(main_rows, ["workload", "backend", "status", "eager_ms", "graph_ms", "gbps",
                                           "effective_tflops", "extra_memory_bytes", "vs_compile_same_run"]))
    return rows


if __name__ == "__main__":
    _rows = main()
    _bad = [r["backend"] for r in _rows if r.get("correct") is False and ":tune:" not in r["backend"]]
    if _bad:
        print(f"CHECK FAILED: {', '.join(_bad)} disagree with the reference (see the rows' error fields)")
        sys.exit(1)
