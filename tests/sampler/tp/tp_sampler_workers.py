"""Scenario and per-rank worker of the tensor-parallel sampler tests (CPU gloo and 2-GPU NCCL).

Kept out of the test module so that ``torch.multiprocessing.spawn`` children import it by a unique name. The
scenario drives every phase: mixed-entropy canvases, a greedy request, exact argmax ties across the shard
boundary, a request that converges (-> COMMIT -> emission -> a fresh canvas) and one that fails on a NaN logit.
"""
from __future__ import annotations

import math

import torch

from blockdiff.sampler import SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.tp import VocabShard, make_shards, sampler_step_sharded, sampler_step_tp

STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted")
INT_OUT_FIELDS = ("num_sampled", "num_rejected", "emitted", "num_emitted_now", "finished", "failed", "accepted",
                  "argmax", "sampled", "next_canvas", "converged", "temperature")


def scenario_params(cl: int) -> list[SamplingParams]:
    """Four requests: sampled (bound 0.5 nats), greedy, converging (eos + max_tokens), failing on NaN."""
    return [
        SamplingParams(canvas_length=cl, seed=11, entropy_bound=0.5, max_denoising_steps=12),
        SamplingParams(canvas_length=cl, seed=12, t_min=0.0, t_max=0.0, max_denoising_steps=12),
        SamplingParams(canvas_length=cl, seed=13, entropy_bound=2.0, eos_token_ids=(5,), max_tokens=3 * cl,
                       max_denoising_steps=12),
        SamplingParams(canvas_length=cl, seed=14, entropy_bound=1.0, max_denoising_steps=12),
    ]


def make_states(params, cl, V, hidden, device, copies=2):
    out = []
    for _ in range(copies):
        st = SamplerState(len(params) + 2, cl, V, hidden, device=device)
        for i, p in enumerate(params):
            st.add_request(i + 1, 1000 + 7 * i, p)  # slots 1..n: slot ids differ from row ids on purpose
        out.append(st)
    return out


def step_logits(step: int, N: int, cl: int, V: int, tie_ids: tuple[int, int], device) -> torch.Tensor:
    """Deterministic logits of pass ``step`` (same on every rank): float32 [N, CL, V].

    Row 0/3: Gaussian logits with a per-position scale in [0, 40) (entropies from ~0 to ~log V), row 0 position
    0 with an exact tie of the maximum at ``tie_ids`` (one id per side of a shard boundary); row 1 (greedy): ties
    at ``tie_ids`` on every 3rd position; row 2: peaked (one-hot softmax) at fixed ids from step 1 on, so it
    converges at step 2; row 3: a NaN at step 2 (fails). -inf masks (p = 0) from step 1 on: row 0's odd positions
    on ids [V/4, 3V/4) (whole shards of some splits), row 1's (greedy) position 1 on its first half, row 3's
    position 0 on every id but V - 1.
    """
    g = torch.Generator(device=device).manual_seed(1234 + step)
    x = torch.randn(N, cl, V, generator=g, device=device)
    scale = torch.rand(N, cl, 1, generator=g, device=device) * 40.0
    x = x * scale
    a, b = tie_ids
    big = float(x.abs().max()) + 10.0
    x[0, 0, a] = big
    x[0, 0, b] = big
    x[1, ::3, a] = big
    x[1, ::3, b] = big
    if step >= 1:
        ids = (torch.arange(cl, device=device) * 7919 + 5) % V
        ids[ids == 5] = 6   # no EOS in the converged canvas
        x[2] = 0.0
        x[2].scatter_(-1, ids[:, None], 1000.0)
    if step >= 1:
        x[0, 1::2, V // 4: 3 * V // 4] = float("-inf")
        if cl > 1:
            x[1, 1, : V // 2] = float("-inf")
        x[3, 0, : V - 1] = float("-inf")
    if step == 2:
        x[3, cl // 2, V // 3] = float("nan")
    return x


def make_embedding(V, hidden, dtype, device):
    g = torch.Generator(device=device).manual_seed(99)
    return torch.randn(V, hidden, generator=g, device=device).to(dtype)


def exact_soft(logits, T, embedding):
    """float64 ``softmax(z) @ E * sqrt(hidden)`` (one-hot for T = 0): the oracle of the soft-embedding error."""
    z = logits.double() / torch.where(T == 0, 1.0, T).double()[:, None, None]
    p = torch.softmax(z, -1)
    oh = torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).double()
    p = torch.where((T == 0)[:, None, None], oh, p)
    return (p @ embedding.double()) * math.sqrt(embedding.shape[-1])


def compare_step(o_ref, o_tp, st_ref, st_tp, *, soft_oracle=None, slots=None, ent_tol=2e-5, what=""):
    """Assert identical decisions/state and close floats; return (max entropy diff, soft errors)."""
    for k in INT_OUT_FIELDS:
        a, b = getattr(o_ref, k), getattr(o_tp, k)
        assert torch.equal(a, b), f"{what}: StepOutput.{k} differs at {(a != b).nonzero()[:5].tolist()}"
    for k in ("entropy", "mean_entropy"):
        a, b = getattr(o_ref, k), getattr(o_tp, k)
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: NaN pattern of {k} differs"
        ok = ~torch.isnan(a)
        assert torch.allclose(a[ok], b[ok], atol=ent_tol, rtol=ent_tol), \
            f"{what}: {k} max diff {(a[ok] - b[ok]).abs().max().item()}"
    for k in STATE_FIELDS:
        a, b = getattr(st_ref, k), getattr(st_tp, k)
        assert torch.equal(a, b), f"{what}: state.{k} differs"
    ent_diff = float((o_ref.entropy - o_tp.entropy).nan_to_num(0.0).abs().max())
    err_ref = err_tp = float((st_ref.soft - st_tp.soft).abs().max())
    if soft_oracle is not None:
        cont = (o_ref.num_rejected > 0) & ~o_ref.converged & ~o_ref.failed
        if bool(cont.any()):
            sl = slots[cont]
            ora = soft_oracle[cont]
            err_ref = float((st_ref.soft[sl].double() - ora).abs().max())
            err_tp = float((st_tp.soft[sl].double() - ora).abs().max())
            scale = float(ora.abs().max())
            # docs/ARCHITECTURE.md "Test discipline": error <= 2x that of the same-precision eager computation
            # + representation tolerance
            assert err_tp <= 2 * err_ref + 1e-6 * scale + 1e-7, f"{what}: soft error {err_tp} vs reference {err_ref}"
    return ent_diff, err_ref, err_tp


def run_scenario(step_fn, *, V, cl, hidden, steps, device, e_dtype, tie_ids, check_soft=True, log=None,
                 ent_tol=2e-5):
    """Run ``steps`` passes of the reference and of ``step_fn(state, slots, logits, prefill_done, E)``
    side by side from identical states; assert after every pass. Returns a list of per-pass summaries."""
    params = scenario_params(cl)
    N = len(params)
    st_ref, st_tp = make_states(params, cl, V, hidden, device)
    slots = torch.arange(1, N + 1, dtype=torch.int64, device=device)
    E = make_embedding(V, hidden, e_dtype, device)
    pd = torch.ones(N, dtype=torch.bool, device=device)
    rows = []
    seen_phases = set()
    for s in range(steps):
        x = step_logits(s, N, cl, V, tie_ids, device)
        from blockdiff.sampler.common import temperature
        T = temperature(st_ref, slots)
        oracle = exact_soft(x, T, E) if check_soft else None
        seen_phases.update(st_ref.phase[slots].tolist())
        o_ref = sampler_step(st_ref, slots, x, pd, E, backend="reference")
        o_tp = step_fn(st_tp, slots, x, pd, E)
        ent, er, et = compare_step(o_ref, o_tp, st_ref, st_tp, soft_oracle=oracle, slots=slots, what=f"pass {s}",
                                   ent_tol=ent_tol)
        rows.append(dict(step=s, phases=st_ref.phase[slots].tolist(), accepted=int(o_ref.accepted.sum()),
                         entropy_diff=ent, soft_err_ref=er, soft_err_tp=et))
        if log:
            log(rows[-1])
    assert {0, 1, 2}.issubset(seen_phases), f"scenario did not reach PREFILL/DENOISE/COMMIT: {seen_phases}"
    assert int(st_ref.phase[slots[3]]) == 4, "request 3 should have failed on its NaN logit"
    return rows


def shard_of(logits_or_E, sh: VocabShard, dim):
    return logits_or_E.narrow(dim, sh.start, sh.size)


def worker(rank: int, world: int, init_file: str, dist_backend: str, device_kind: str, V: int, cl: int,
           hidden: int, steps: int, bounds, stats_backend: str, e_dtype_name: str, result_file: str | None):
    """One rank: TP step on its shard vs the single-process reference on the full vocabulary, every pass."""
    import json

    import torch.distributed as dist

    from blockdiff.sampler.tp import check_shards_consistent, set_safe_nccl_env

    set_safe_nccl_env()
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(dist_backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
    try:
        shard = make_shards(V, bounds)[rank]
        check_shards_consistent(shard, device=device)
        e_dtype = getattr(torch, e_dtype_name)

        def tp_step(st, slots, x, pd, E):
            out = sampler_step_tp(st, slots, x[..., shard.start:shard.end].contiguous(), pd,
                                  E[shard.start:shard.end].contiguous(), shard=shard, backend=stats_backend)
            # every rank holds identical state and outputs: compare with rank 0 bit for bit
            for name in ("soft", "canvas", "phase", "prev_argmax"):
                t = getattr(st, name).clone()
                dist.broadcast(t, 0)
                assert torch.equal(t, getattr(st, name)), f"rank {rank}: state.{name} differs from rank 0"
            return out

        tie = (bounds[1] - 1, bounds[1]) if 0 < bounds[1] < V else (1, 2)
        # float32 sums over 131072 tokens per shard vs the reference's over 262144: ~1e-5 relative at H ~ 12 nats
        rows = run_scenario(tp_step, V=V, cl=cl, hidden=hidden, steps=steps, device=device, e_dtype=e_dtype,
                            tie_ids=tie, ent_tol=1e-4 if V >= 65536 else 2e-5)
        if rank == 0 and result_file:
            with open(result_file, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


#: Cases of :func:`agreement_worker`: what rank 1 (or rank 0) gets wrong, and the error every rank must raise.
AGREEMENT_CASES = ("ok", "bad_embedding", "rows", "params", "slots", "backend", "gap", "vocab", "shard_rank",
                   "unchecked_ok")


def agreement_worker(rank: int, world: int, init_file: str, result_file: str):
    """One rank of 2 (gloo, CPU): each case of :data:`AGREEMENT_CASES` runs two TP steps where one rank's arguments
    are refused or the ranks disagree; records ``{case: "ok" | "<Error>: <message>"}`` per rank, after a barrier
    per case (a rank left waiting in a collective would fail the barrier at the group's timeout instead)."""
    import datetime
    import json

    import torch.distributed as dist

    from blockdiff.sampler.tp import VocabShard, check_shards_consistent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    V, cl, H = 10, 4, 8
    res = {}
    try:
        for case in AGREEMENT_CASES:
            one = rank == 1
            Vc = 11 if case == "vocab" and one else V
            sh = make_shards(V, (0, 5, V))[rank]
            if case == "gap" and one:
                sh = VocabShard(V, 6, V, 1, 2)                       # token 5 on no rank
            if case == "vocab" and one:
                sh = VocabShard(Vc, 5, Vc, 1, 2)
            st = SamplerState(3, cl, Vc, H)
            for i in range(2):
                t_max = 0.5 if case == "params" and one and i == 1 else 0.8
                st.add_request(i, 7 + i, SamplingParams(canvas_length=cl, seed=i, t_max=t_max))
            n = 1 if case == "rows" and one else 2
            slots = torch.tensor([1, 0]) if case == "slots" and one else torch.arange(n)
            pd = torch.ones(n, dtype=torch.bool)
            x = torch.randn(n, cl, sh.size, generator=torch.Generator().manual_seed(rank))
            E = torch.randn(sh.size + (1 if case == "bad_embedding" and one else 0), H)
            kw = {"backend": "bogus"} if case == "backend" and rank == 0 else {}
            if case == "unchecked_ok":
                kw["check_values"] = False
            try:
                if case == "shard_rank":
                    check_shards_consistent(VocabShard(V, 0, 5, 0, 2) if rank == 0 else VocabShard(V, 5, V, 0, 2))
                else:
                    for _ in range(2):
                        sampler_step_tp(st, slots, x, pd, E, shard=sh, **kw)
                res[case] = "ok"
            except (TypeError, ValueError) as e:
                res[case] = f"{type(e).__name__}: {e}"
            dist.barrier()
        with open(f"{result_file}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


__all__ = ["run_scenario", "worker", "agreement_worker", "AGREEMENT_CASES", "sampler_step_sharded", "scenario_params", "step_logits", "exact_soft"]
