"""Tensor-parallel sampler benchmark: one denoising step of ``sampler_n4`` on 2 GPUs (vocabulary shards) vs 1 GPU.

Usage (2-GPU H200 host; ``source bench/device_env.sh`` makes ``blockdiff.*`` importable; results go to $OUT or
bench/results/):

    python3 -m blockdiff.bench.bench_sampler_tp                  # spawns 2 processes (one per GPU, NCCL), sampler_n4
    python3 -m blockdiff.bench.bench_sampler_tp --nproc 2 --backends reference,fused --reps 30
    python3 -m blockdiff.bench.bench_sampler_tp --quick          # CPU smoke run: 2 gloo processes, tiny shapes

Workload ``sampler_n4`` (docs/ARCHITECTURE.md): N = 4 requests x canvas 256 x V = 262144, fp32 logits
``30 tanh(4 randn / 30)`` (as bench/bench_sampler.py), E [V, 2816] bf16; one greedy request, S = 10000 and
confidence 0.005 so no row converges while timed. Rank r holds logits[..., V_r] and E[V_r] (vLLM's even split).

Rows (all from one run): world_size 1 — ``blockdiff.sampler.sampler_step`` on GPU 0 with the ``reference`` and
``fused`` (triton) backends on the full vocabulary; world_size 2 — ``blockdiff.sampler.tp.sampler_step_tp`` with
the ``reference`` (dense torch) and ``fused`` (Triton) local pass; parts: ``tp:<b>:local`` (the local pass of a
rank alone: stats + partial GEMM, no communication) and ``tp:comm`` (the two collectives alone, at the step's
sizes). Per rank, the median over reps of CUDA-event times of one call, every rank starting together (barrier):
``per_rank_ms``; ``eager_ms`` is rank 0's, ``eager_ms_max_rank`` the slowest rank's, which ``speedup_vs_1gpu``
divides the 1-GPU time by. Rows carry ``status`` (``ok``; ``error``; ``wrong``: the backend failed its self-check, no
speedup given; :func:`finish_rows`). No CUDA graphs (the TP step holds NCCL collectives).
The timed TP step is the checked default (``check_values`` None): since 2026-12-07 (break25d) it all_gathers an
88-byte agreement record and reads it on the host before the step's collectives, so its rows include that;
records before then did not (their checked step read only the slot ids).

Self-check before timing: from identical fresh states, one TP step on 2 ranks vs the 1-GPU reference step on
the full vocabulary — accepted, sampled, argmax, renoised canvas, converged/failed, every state tensor exact;
entropies rtol/atol 1e-4; soft embedding max error <= 2 % of its max magnitude. The verdict is printed and
recorded (``check``); a failure makes the exit status 1. A short table is printed last.

NCCL: NVLS / multicast / symmetric memory are disabled in every process before NCCL starts
(``blockdiff.sampler.tp.set_safe_nccl_env``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # CPU smoke run: Triton kernels through the interpreter (before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from blockdiff.bench import common  # noqa: E402

SUITE = "sampler_tp"
WORKLOAD = "sampler_n4"
SHAPES = {"full": dict(N=4, CL=256, V=262144, H=2816), "quick": dict(N=2, CL=16, V=1000, H=64)}
from blockdiff.bench.bench_sampler import DECISIONS, STATE_FIELDS  # noqa: E402,F401  (one definition of what is compared)
from blockdiff.bench.bench_sampler import make_inputs as _make_inputs  # noqa: E402


def make_inputs(N, CL, V, H, device, seed=0):
    """Full logits [N, CL, V] fp32, E [V, H] bf16, per-request params (identical on every rank: seeded); the
    single-GPU benchmark's inputs (bench_sampler.make_inputs)."""
    x, E, params, _slots, _pd = _make_inputs(N, CL, V, H, device, seed)
    return x, E, params


def make_state(params, CL, V, H, device):
    """Requests in slots 0..N-1, moved PREFILL -> DENOISE with the shared phase code (no logits read)."""
    from blockdiff.sampler import SamplerState
    from blockdiff.sampler.common import DenoiseResult, apply_step

    st = SamplerState(len(params), CL, V, H, device=device)
    for i, p in enumerate(params):
        st.add_request(i, 5000 + i, p)
    n = len(params)
    slots = torch.arange(n, device=device)
    zi = torch.zeros(n, CL, dtype=torch.int64, device=device)
    zf = torch.zeros(n, CL, device=device)
    zb = torch.zeros(n, dtype=torch.bool, device=device)
    res = DenoiseResult(zb[:, None].expand(n, CL), zf, zi, zi, zi, zb, zb, zb.int(), zb.float(), zb.float(), None)
    apply_step(st, slots, torch.ones(n, dtype=torch.bool, device=device), res, st.phase[slots].clone())
    return st


def snapshot(st):
    return {k: getattr(st, k).clone() for k in STATE_FIELDS + ("soft",)}


def restore(st, snap):
    for k, v in snap.items():
        getattr(st, k).copy_(v)


def timed(fn, reps, warmup, device, dist=None, before=None):
    """Per-call times in ms (CUDA events; perf_counter on the CPU); ranks start each call together."""
    import time

    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist is not None:
            dist.barrier()
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            t = s.elapsed_time(e)
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(t)
    return times


def finish_rows(rows: list[dict], checks: dict) -> list[dict]:
    """Rank 0's last pass over the rows (in place; returned): each ``tp:<b>`` / ``tp:<b>:local`` row gets its backend's
    self-check (``check``); ``status`` is ``error`` for a row that raised, ``wrong`` for a TP row whose backend failed
    its self-check (its time is kept, and its speedup left out: it timed a step that disagrees with the reference),
    else ``ok`` (make_tables shows a row without a status as '–'); ``speedup_vs_1gpu`` = the 1-GPU row's
    ``eager_ms`` / the TP row's slowest rank (``eager_ms_max_rank``), for ok TP steps (not the local passes)."""
    one = {r["backend"]: r.get("eager_ms") for r in rows if r.get("world_size") == 1 and not r.get("error")}
    for r in rows:
        b = r["backend"].split(":")[1] if r["backend"].startswith("tp:") else None
        if b is not None and r["backend"] != "tp:comm":
            r["check"] = checks.get(b)
        failed_check = r.get("check") is not None and not r["check"].get("ok")
        r["status"] = "error" if r.get("error") else "wrong" if failed_check else "ok"
        if r["status"] == "ok" and b in one and one[b] and r.get("eager_ms_max_rank") \
                and not r["backend"].endswith(":local"):
            r["speedup_vs_1gpu"] = one[b] / r["eager_ms_max_rank"]
    return rows


def compare(o_ref, o_tp, st_ref, st_tp, slots):
    """Max differences of a TP step vs the reference; raises AssertionError on any decision mismatch."""
    for k in DECISIONS:
        a, b = getattr(o_ref, k), getattr(o_tp, k)
        assert torch.equal(a, b), f"StepOutput.{k}: {int((a != b).sum())} mismatches"
    for k in STATE_FIELDS:
        assert torch.equal(getattr(st_ref, k), getattr(st_tp, k)), f"state.{k} differs"
    ok = ~torch.isnan(o_ref.entropy)
    ent = float((o_ref.entropy[ok] - o_tp.entropy[ok]).abs().max()) if ok.any() else 0.0
    assert torch.allclose(o_ref.entropy[ok], o_tp.entropy[ok], rtol=1e-4, atol=1e-4), f"entropy diff {ent}"
    ds = (st_ref.soft[slots] - st_tp.soft[slots]).abs().max().item()
    scale = st_ref.soft[slots].abs().max().item()
    assert ds <= 0.02 * scale + 1e-6, f"soft diff {ds} vs scale {scale}"
    return {"entropy_max_diff": ent, "soft_max_diff": ds, "soft_scale": scale,
            "accepted": int(o_ref.accepted.sum())}


def worker(rank, world, init_file, args, result_file):
    import torch.distributed as dist

    from blockdiff.sampler import sampler_step
    from blockdiff.sampler.tp import (NUM_FIELDS, check_shards_consistent, communication_bytes, local_pass,
                                      make_shards, row_inputs, sampler_step_tp, set_safe_nccl_env,
                                      vocab_shard_bounds)

    set_safe_nccl_env()
    quick = args["quick"]
    if quick:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        common.warm_up_gpu(device, seconds=1.0)
    dist.init_process_group("gloo" if quick else "nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **({} if quick else {"device_id": device}))
    rows, checks, errors = [], {}, []
    try:
        sh = SHAPES["quick" if quick else "full"]
        N, CL, V, H = sh["N"], sh["CL"], sh["V"], sh["H"]
        shard = make_shards(V, vocab_shard_bounds(V, world))[rank]
        check_shards_consistent(shard, device=device)
        x_full, E_full, params = make_inputs(N, CL, V, H, device)
        x = x_full[..., shard.start:shard.end].contiguous()
        E = E_full[shard.start:shard.end].contiguous()
        if rank != 0:
            del x_full, E_full
            x_full = E_full = None
        slots = torch.arange(N, device=device)
        pd = torch.zeros(N, dtype=torch.bool, device=device)
        local_name = {"reference": "reference", "fused": "triton"}
        single_name = {"reference": "reference", "fused": "triton"}

        # ---- self-check: TP step vs the 1-GPU reference from identical states
        for b in args["backends"]:
            st_tp = make_state(params, CL, V, H, device)
            err = None
            try:
                o_tp = sampler_step_tp(st_tp, slots, x, pd, E, shard=shard, backend=local_name[b])
                if rank == 0:
                    st_ref = make_state(params, CL, V, H, device)
                    o_ref = sampler_step(st_ref, slots, x_full, pd, E_full, backend="reference")
                    checks[b] = {"ok": True, **compare(o_ref, o_tp, st_ref, st_tp, slots)}
                    del st_ref, o_ref
            except Exception as e:  # noqa: BLE001 - recorded, the run continues
                err = f"{type(e).__name__}: {e}"
                checks[b] = {"ok": False, "error": err}
                traceback.print_exc()
            del st_tp
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()

        # ---- 1 GPU: the single-GPU sampler step on the full vocabulary (rank 0 only)
        if rank == 0:
            for b in args["backends"]:
                st = make_state(params, CL, V, H, device)
                snap = snapshot(st)
                try:
                    t = timed(lambda: sampler_step(st, slots, x_full, pd, E_full, backend=single_name[b]),
                              args["reps"], args["warmup"], device, before=lambda: restore(st, snap))
                    rows.append(dict(workload=WORKLOAD, backend=b, world_size=1, eager_ms=statistics.median(t),
                                     eager_ms_max_rank=statistics.median(t)))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(workload=WORKLOAD, backend=b, world_size=1, error=f"{type(e).__name__}: {e}"))
                del st, snap
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        dist.barrier()

        # ---- world_size ranks: the TP step, its local pass alone, the collectives alone
        comm = communication_bytes(N, CL, H, world)
        for b in args["backends"]:
            st = make_state(params, CL, V, H, device)
            snap = snapshot(st)
            try:
                t = timed(lambda: sampler_step_tp(st, slots, x, pd, E, shard=shard, backend=local_name[b]),
                          args["reps"], args["warmup"], device, dist, before=lambda: restore(st, snap))
                med = statistics.median(t)
                meds = [None] * world
                dist.all_gather_object(meds, med)
                rows.append(dict(workload=WORKLOAD, backend=f"tp:{b}", world_size=world, eager_ms=meds[0],
                                 eager_ms_max_rank=max(meds), per_rank_ms=meds, **comm))

                def local_only():
                    phase, T, seed, rid, cidx, step, active = row_inputs(st, slots)
                    local, pf = local_pass(local_name[b], x, E, T, seed, rid, cidx, step, active, shard)
                    return local.packed, pf()

                t = timed(local_only, args["reps"], args["warmup"], device, dist, before=lambda: restore(st, snap))
                meds = [None] * world
                dist.all_gather_object(meds, statistics.median(t))
                rows.append(dict(workload=WORKLOAD, backend=f"tp:{b}:local", world_size=world, eager_ms=meds[0],
                                 eager_ms_max_rank=max(meds), per_rank_ms=meds))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(workload=WORKLOAD, backend=f"tp:{b}", world_size=world,
                                 error=f"{type(e).__name__}: {e}"))
            del st, snap
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()

        packed = torch.zeros(N, CL, NUM_FIELDS, dtype=torch.float64, device=device)
        gathered = torch.empty(world * N, CL, NUM_FIELDS, dtype=torch.float64, device=device)
        soft = torch.zeros(N, CL, H, dtype=torch.float32, device=device)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def comm_only():
            ag(gathered, packed)
            dist.all_reduce(soft)

        t = timed(comm_only, args["reps"], args["warmup"], device, dist)
        meds = [None] * world
        dist.all_gather_object(meds, statistics.median(t))
        rows.append(dict(workload=WORKLOAD, backend="tp:comm", world_size=world, eager_ms=meds[0],
                         eager_ms_max_rank=max(meds), per_rank_ms=meds, **comm))
        if rank == 0:
            finish_rows(rows, checks)
            for r in rows:
                r.update(dict(N=N, canvas_length=CL, vocab_size=V, hidden_size=H))
            with open(result_file, "w") as f:
                json.dump({"rows": rows, "checks": checks}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: 2 gloo processes, tiny shapes")
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) of the TP step (default 2)")
    p.add_argument("--backends", default="reference,fused", help="comma-separated subset of reference,fused")
    p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 30; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5; quick 1)")
    p.add_argument("--out", default=None, help="output folder (default $OUT or bench/results)")
    a = p.parse_args(argv)
    from blockdiff.sampler.tp import set_safe_nccl_env
    set_safe_nccl_env()
    try:  # a list naming nothing (',', '') measured nothing and exited 0
        backends = common.comma_list(a.backends, "--backends")
    except ValueError as e:
        p.error(str(e))
    if not backends:
        p.error("--backends must name at least one of reference, fused")
    for b in backends:
        if b not in ("reference", "fused"):
            raise SystemExit(f"unknown backend {b!r} (reference, fused)")
    if not a.quick:
        if not torch.cuda.is_available() or torch.cuda.device_count() < a.nproc:
            raise SystemExit(f"needs {a.nproc} CUDA GPUs (found {torch.cuda.device_count()}); use --quick on a CPU")
    args = dict(quick=a.quick, backends=backends, reps=a.reps or (3 if a.quick else 30),
                warmup=a.warmup if a.warmup is not None else (1 if a.quick else 5))
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "rows.json"
        mp.spawn(worker, args=(a.nproc, str(Path(tmp) / "pg_init"), args, str(res)), nprocs=a.nproc, join=True)
        doc = json.loads(res.read_text())
    rows, checks = doc["rows"], doc["checks"]
    env = common.env_record("cuda:0" if not a.quick else "cpu")
    suite = SUITE if not a.quick else SUITE + "-quick"
    path = common.write_records(suite, rows, env=env,
                                extra={"checks": checks, "nproc": a.nproc, "argv": common.script_argv(argv)},
                                out_dir=a.out or common.results_dir(local=a.quick))
    ok = all(c.get("ok") for c in checks.values())
    print(f"records: {path}")
    for b, c in checks.items():
        print(f"check {b}: {'OK' if c.get('ok') else 'FAIL'} "
              + json.dumps({k: v for k, v in c.items() if k != 'ok'}))
    print(common.summary_table(rows, ["backend", "world_size", "eager_ms", "eager_ms_max_rank", "speedup_vs_1gpu",
                                      "error"]))
    if not ok:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
