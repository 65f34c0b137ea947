"""Tensor-parallel sampler step (blockdiff.sampler.tp.step): the combine of the ranks' statistics and the sharded
step equal the single-GPU decisions.

CPU: in-process shards (every split, incl. uneven and empty shards) and 2 gloo processes (torch.multiprocessing
spawn). GPU (@pytest.mark.gpu): 2 processes on 2 GPUs over NCCL, vocab 262144, canvas 256.
"""
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawn children import the workers module by name

import tp_sampler_workers as W  # noqa: E402
from blockdiff.sampler import sampler_step  # noqa: E402
from blockdiff.sampler.tp import (combine_statistics, local_statistics, make_shards, sampler_step_sharded,  # noqa: E402
                                  sampler_step_tp, set_safe_nccl_env, vocab_shard_bounds)
from blockdiff.sampler.tp.step import _check_tp_args  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as hst  # noqa: E402


# ------------------------------------------------------------------------------------------------ combine
def _stats_for(x, T, bounds, V):
    n, cl, _ = x.shape
    z0 = torch.zeros(n, dtype=torch.int64)
    return torch.stack([local_statistics(x[..., sh.start:sh.end], T, z0, z0, z0, z0, sh).packed
                        for sh in make_shards(V, bounds)])


def test_argmax_tie_across_shards_goes_to_lowest_global_id():
    V = 10
    x = torch.zeros(1, 3, V)
    x[0, 0, [4, 5]] = 3.0          # tie straddling the boundary 5
    x[0, 1, [7, 2]] = 3.0          # tie: 2 on rank 0 wins
    x[0, 2, [6, 9]] = 3.0          # both on rank 1: first one
    for T in (torch.tensor([0.5]), torch.tensor([0.0])):
        c = combine_statistics(_stats_for(x, T, (0, 5, 10), V), T, V)
        assert c.argmax.tolist() == [[4, 2, 6]]
        assert c.argmax.tolist() == x.argmax(-1).tolist()


def test_entropy_combination_is_exact_log_z_minus_mean_z():
    g = torch.Generator().manual_seed(3)
    V = 301
    x = torch.randn(2, 5, V, generator=g, dtype=torch.float64).float() * torch.tensor([0.1, 30.0])[:, None, None]
    T = torch.tensor([0.7, 0.4])
    z = (x / T[:, None, None]).double()
    p = torch.softmax(z, -1)
    H64 = -(p * torch.log_softmax(z, -1)).sum(-1)
    for bounds in [(0, V), (0, 1, V), (0, 150, 151, V), (0, 0, 100, V, V)]:
        c = combine_statistics(_stats_for(x, T, bounds, V), T, V)
        assert torch.allclose(c.entropy.double(), H64, atol=2e-6, rtol=2e-6), bounds
        assert (c.entropy >= 0).all()
        # soft weights: locally normalised partials rescale to the global softmax
        assert torch.allclose(c.soft_weight.sum(0), torch.ones(2, 5), atol=1e-6)


def test_nonfinite_logit_on_one_shard_fails_the_position():
    V = 12
    x = torch.randn(1, 2, V)
    x[0, 1, 9] = float("inf")
    T = torch.tensor([0.5])
    c = combine_statistics(_stats_for(x, T, (0, 6, V), V), T, V)
    assert c.bad.tolist() == [[False, True]]
    assert torch.isnan(c.entropy[0, 1]) and torch.isfinite(c.entropy[0, 0])


# ------------------------------------------------------------------------------------------------ full step
CL, HID = 8, 16


@settings(max_examples=8, deadline=None)
@given(V=hst.integers(8, 300), cuts=hst.lists(hst.floats(0, 1), min_size=0, max_size=4),
       e_bf16=hst.booleans())
def test_sharded_step_matches_reference_any_split(V, cuts, e_bf16):
    """In-process shards (uneven, empty, single-token): identical decisions/state, close entropies and soft."""
    bounds = (0, *sorted(int(c * V) for c in cuts), V)
    tie = (bounds[1] - 1, bounds[1]) if 0 < bounds[1] < V else (0, min(1, V - 1))
    if tie[0] == tie[1]:
        tie = (0, 0)
    W.run_scenario(lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=bounds),
                   V=V, cl=CL, hidden=HID, steps=6, device="cpu",
                   e_dtype=torch.bfloat16 if e_bf16 else torch.float32, tie_ids=tie)


def test_sharded_step_single_shard_is_the_reference():
    W.run_scenario(lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=(0, 1000)),
                   V=1000, cl=16, hidden=HID, steps=6, device="cpu", e_dtype=torch.bfloat16, tie_ids=(3, 4))


def _denoising_pair(V=50):
    """Two identical states of the TP scenario's four requests (slots 1-4) moved PREFILL -> DENOISE by a
    reference step: ``(st_ref, st_tp, slots, prefill_done, E)``, vocabulary V, fp32 E."""
    params = W.scenario_params(CL)
    st_ref, st_tp = W.make_states(params, CL, V, HID, "cpu")
    slots = torch.arange(1, 5)
    pd = torch.ones(4, dtype=torch.bool)
    E = torch.randn(V, HID)
    for st in (st_ref, st_tp):
        sampler_step(st, slots, torch.zeros(4, CL, V), pd, E)
    return st_ref, st_tp, slots, pd, E


def test_overflowing_z_takes_the_shifted_form_as_in_the_reference():
    """A finite logit whose z = x / T overflows to +inf used to fail the row in the reference and here (NaN
    entropy). Rule 1: the position takes z = (x - max x) / T; the shard holding the max logit sends its shifted
    statistics, the others (finite max z) take no part, and the decisions equal the reference's."""
    st_ref, st_tp, slots, pd, E = _denoising_pair()
    x = torch.randn(4, CL, 50)
    x[0, 2, 30] = 3e38                                                   # / T (0.8) -> inf, on shard [20, 50)
    x[3, 1, [19, 20]] = 3.4e38                                           # a tie across the shard boundary
    o_ref = sampler_step(st_ref, slots, x, pd, E)
    o_tp = sampler_step_sharded(st_tp, slots, x, pd, E, bounds=(0, 20, 50))
    assert not o_ref.failed.any() and not o_tp.failed.any()
    assert o_tp.argmax[0, 2].item() == 30 and o_tp.argmax[3, 1].item() == 19
    for k in W.INT_OUT_FIELDS:
        assert torch.equal(getattr(o_ref, k), getattr(o_tp, k)), k
    torch.testing.assert_close(o_tp.entropy, o_ref.entropy, rtol=1e-5, atol=1e-6)
    assert o_tp.entropy[3, 1].item() == pytest.approx(math.log(2), rel=1e-6)
    torch.testing.assert_close(st_tp.soft, st_ref.soft, rtol=1e-5, atol=1e-5)


def test_combine_of_shifted_ranks_uses_only_the_ranks_holding_the_max_logit():
    """combine_statistics on the ranks' F_STATUS: a rank whose max z overflows (+inf) beside ranks whose max is
    finite; every rank's z all -inf (each shifted by its own max); a rank holding only -inf z beside finite ones
    (p = 0 there, no shift)."""
    V = 12
    T = torch.tensor([0.5])
    x = torch.randn(1, 3, V)
    x[0, 0, 8] = 3e38
    x[0, 1] = -3.3e38
    x[0, 1, 2] = -3.2e38
    x[0, 1, 9] = -3.1e38
    x[0, 2, :6] = -3.3e38
    c = combine_statistics(_stats_for(x, T, (0, 6, V), V), T, V)
    assert c.argmax.tolist() == [[8, 9, int(x[0, 2, 6:].argmax()) + 6]]
    assert not c.bad.any() and torch.isfinite(c.entropy).all()
    assert c.entropy[0, :2].tolist() == [0.0, 0.0]
    assert c.soft_weight[:, 0, :2].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    z = x[0, 2, 6:] / T
    torch.testing.assert_close(c.entropy[0, 2], -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(),
                               rtol=1e-5, atol=1e-6)


def test_masked_logit_at_float32_min_keeps_entropy_finite_as_in_the_reference():
    """finfo(float32).min logits (a common mask) / T < 1 overflow to z = -inf: p = 0 there, entropies stay finite,
    nothing fails, and the sharded step matches the reference."""
    st_ref, st_tp, slots, pd, E = _denoising_pair()
    x = torch.randn(4, CL, 50)
    x[:, :, 7] = torch.finfo(torch.float32).min
    x[:, :, 33] = torch.finfo(torch.float32).min
    o_ref = sampler_step(st_ref, slots, x, pd, E)
    o_tp = sampler_step_sharded(st_tp, slots, x, pd, E, bounds=(0, 20, 50))
    assert not o_ref.failed.any() and not o_tp.failed.any()
    assert torch.isfinite(o_ref.entropy).all() and torch.isfinite(o_tp.entropy).all()
    for k in W.INT_OUT_FIELDS:
        assert torch.equal(getattr(o_ref, k), getattr(o_tp, k)), k
    torch.testing.assert_close(o_tp.entropy, o_ref.entropy, rtol=1e-5, atol=1e-5)


def test_minus_inf_logits_mean_probability_zero_in_the_combine():
    """-inf logits are p = 0 (issue 26): a rank whose logits of a position are all -inf sends an empty shard's
    statistics and takes no part (beside a finite rank, beside a rank whose max z overflows, beside ranks whose z
    are all -inf); the entropy is the unmasked logits'. Every logit -inf on every rank: bad, NaN entropy, greedy
    rows too."""
    V = 12
    x = torch.randn(2, 5, V)
    x[:, 0, :6] = -math.inf                       # rank 0 all -inf, rank 1 finite
    x[:, 1, 6:] = -math.inf
    x[:, 1, 2] = 3e38                             # rank 1 all -inf, rank 0's max z overflows (T 0.5)
    x[:, 2, :6] = -math.inf
    x[:, 2, 6:] = -3.3e38                         # rank 0 all -inf, rank 1's z all -inf (T 0.5): shifted
    x[:, 2, 10] = -3.2e38
    x[:, 3, ::2] = -math.inf                      # half of each rank
    x[:, 4] = -math.inf                           # no softmax
    for T in (torch.tensor([0.5, 0.5]), torch.tensor([0.0, 0.0])):
        loc = _stats_for(x, T, (0, 6, V), V)
        assert loc[0, :, 0, 0].eq(-math.inf).all() and loc[0, :, 0, 1].eq(0).all() and loc[0, :, 0, 3].eq(V).all()
        c = combine_statistics(loc, T, V)
        assert c.bad[:, :4].logical_not().all() and c.bad[:, 4].all()
        assert torch.isfinite(c.entropy[:, :4]).all() and torch.isnan(c.entropy[:, 4]).all()
        assert torch.equal(c.argmax[:, :4], x[:, :4].argmax(-1))
        assert c.argmax[0, 1].item() == 2 and c.argmax[0, 2].item() == 10
        if T[0] > 0:
            assert c.entropy[0, 1].item() == 0.0 and c.entropy[0, 2].item() == 0.0
            for p in (0, 3):
                keep = x[0, p] != -math.inf
                z = x[0, p, keep] / T[0]
                torch.testing.assert_close(c.entropy[0, p], -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(),
                                           rtol=1e-5, atol=1e-6)
            assert torch.allclose(c.soft_weight[:, :, :4].sum(0), torch.ones(2, 4), atol=1e-6)
            assert (c.soft_weight[0, :, 0] == 0).all() and (c.soft_weight[1, :, 1] == 0).all()


def test_sharded_step_rejects_wrong_shapes():
    params = W.scenario_params(CL)
    st, _ = W.make_states(params, CL, 100, HID, "cpu", copies=1)[0], None
    slots = torch.arange(1, 5)
    sh = make_shards(100, (0, 40, 100))[1]
    pd = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="logits must have shape"):
        _check_tp_args(st, slots, torch.zeros(4, CL, 100), pd, torch.zeros(60, HID), sh)
    with pytest.raises(ValueError, match="embedding must have shape"):
        _check_tp_args(st, slots, torch.zeros(4, CL, 60), pd, torch.zeros(100, HID), sh)
    with pytest.raises(ValueError, match="vocab_size"):
        _check_tp_args(st, slots, torch.zeros(4, CL, 60), pd, torch.zeros(60, HID), make_shards(99, (0, 39, 99))[1])
    with pytest.raises(TypeError, match="shard"):
        _check_tp_args(st, slots, torch.zeros(4, CL, 60), pd, torch.zeros(60, HID), (40, 100))


def test_tp_step_without_process_group_raises():
    params = W.scenario_params(CL)
    st = W.make_states(params, CL, 100, HID, "cpu", copies=1)[0]
    sh = make_shards(100, (0, 100))[0]
    with pytest.raises(RuntimeError, match="process group"):
        sampler_step_tp(st, torch.arange(1, 5), torch.zeros(4, CL, 100), torch.ones(4, dtype=torch.bool),
                        torch.zeros(100, HID), shard=sh)


# ------------------------------------------------------------------------------------------------ 2 processes
def _spawn(world, tmp_path, dist_backend, device_kind, V, cl, hidden, steps, bounds, stats_backend, e_dtype):
    import torch.multiprocessing as mp
    result = tmp_path / "rows.json"
    mp.spawn(W.worker, nprocs=world, join=True,
             args=(world, str(tmp_path / "pg_init"), dist_backend, device_kind, V, cl, hidden, steps, tuple(bounds),
                   stats_backend, e_dtype, str(result)))
    return json.loads(result.read_text())


def test_two_processes_gloo_match_single_process_reference(tmp_path):
    """2 gloo ranks, V = 1000 split unevenly (437 / 563): every pass identical to the 1-process reference."""
    rows = _spawn(2, tmp_path, "gloo", "cpu", 1000, 16, 32, 6, (0, 437, 1000), "reference", "bfloat16")
    assert len(rows) == 6 and any(r["accepted"] > 4 for r in rows)


def test_ranks_refusing_or_disagreeing_raise_on_every_rank_instead_of_waiting_in_a_collective(tmp_path):
    """A rank whose arguments were refused raised alone, before the all_gather, and the other ranks waited in it (a
    deadlock until the group's timeout; check_shards_consistent too); ranks disagreeing on N aborted the gloo process
    (SIGABRT: received data size mismatch); ranks disagreeing on a request's parameters, on the slots or on the
    shards' tiling (a token on no rank) ran on silently, their decisions / states diverging. Now every rank raises a
    ValueError naming the refusing rank or the field, and the group stays usable (a barrier after every case)."""
    import torch.multiprocessing as mp
    out = tmp_path / "agree"
    mp.spawn(W.agreement_worker, nprocs=2, join=True, args=(2, str(tmp_path / "pg_init"), str(out)))
    r0, r1 = (json.loads((tmp_path / f"agree.{r}").read_text()) for r in (0, 1))
    assert r0["ok"] == r1["ok"] == "ok" and r0["unchecked_ok"] == r1["unchecked_ok"] == "ok"
    assert r1["bad_embedding"].startswith("ValueError: embedding must have shape")
    assert r0["bad_embedding"].startswith("ValueError: sampler_step_tp: rank 1 of 2 refused its arguments")
    assert r0["backend"].startswith("ValueError: backend must be one of")
    assert r1["backend"].startswith("ValueError: sampler_step_tp: rank 0 of 2 refused its arguments")
    assert r1["shard_rank"].startswith("ValueError: shard is rank 0 of 2, the group says rank 1 of 2")
    assert r0["shard_rank"].startswith("ValueError: check_shards_consistent: rank 1 of 2 refused")
    for case, text in (("rows", "disagree on the number of rows N (len(slots)): [2, 1]"),
                       ("params", "rank 1 disagrees with rank 0 on the replicated SamplerState rows"),
                       ("slots", "rank 1 disagrees with rank 0 on slots / prefill_done"),
                       ("gap", "shards must tile [0, 10) in rank order, got [(0, 5), (6, 10)]"),
                       ("vocab", "disagree on state.vocab_size: [10, 11]")):
        assert r0[case] == r1[case] and text in r0[case], (case, r0[case])


def test_agreement_record_device_is_the_backend_s_whatever_the_rank_s_own_arguments(monkeypatch):
    """The record went to the refusing rank's logits' device: under NCCL a rank whose logits were a CPU tensor (the
    very error it refuses) put a CPU record into NCCL's all_gather, which raised on that rank alone and left the
    others waiting in it (the deadlock the record is there to prevent). Now: NCCL, a CUDA device always (the logits',
    else the state's, else the current one); any other backend (gloo), the CPU, whatever the arguments."""
    from blockdiff.sampler import SamplerState
    from blockdiff.sampler.tp import step as tp_step

    st = SamplerState(2, 4, 10, 8)                                       # a CPU state
    cpu_logits, meta_logits = torch.zeros(1, 4, 5), torch.empty(1, 4, 5, device="meta")
    monkeypatch.setattr(tp_step.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(tp_step.torch.cuda, "current_device", lambda: 3)
    for state, logits in ((st, cpu_logits), (None, cpu_logits), (st, None), ("no state", meta_logits)):
        assert tp_step._record_device(None, state, logits) == torch.device("cuda", 3), (state, logits)
    monkeypatch.setattr(tp_step.dist, "get_backend", lambda group=None: "gloo")
    for state, logits in ((st, meta_logits), (None, meta_logits), (None, None)):
        assert tp_step._record_device(None, state, logits) == torch.device("cpu")


def test_agreement_digest_tells_apart_one_changed_small_value_at_any_position():
    """_digest's docstring: one changed value in (-2**29, 2**29) always changes the digest. The 32-bit halves entered
    with equal weights at position 0, where -1 and 2 (int64 or int32) digested alike."""
    from blockdiff.sampler.tp.step import _digest

    vals = list(range(-600, 600)) + [-2**29 + 1, 2**29 - 1, -2**28, 2**28]
    for dtype in (torch.int64, torch.int32):
        for pos in (0, 1, 9):
            base = torch.arange(10, dtype=dtype) * 3 - 7
            seen = {}
            for v in vals:
                t = base.clone()
                t[pos] = v
                seen.setdefault(int(_digest([t], "cpu")), []).append(v)
            clash = {k: vs for k, vs in seen.items() if len(vs) > 1}
            assert not clash, (dtype, pos, list(clash.values())[:3])
    assert int(_digest([torch.tensor([-1])], "cpu")) != int(_digest([torch.tensor([2])], "cpu"))
    assert int(_digest([], "cpu")) == 0 and int(_digest([torch.zeros(0, 4)], "cpu")) == 0    # N = 0 rows
    # no int64 overflow: extreme halves everywhere stay below the prime per term
    big = torch.tensor([-1, -2**63, 2**63 - 1, 2**62] * 1000)
    assert 0 <= int(_digest([big, big.view(torch.float64)], "cpu")) < 8000 * (2**31 - 1)


@pytest.mark.gpu
def test_two_gpus_nccl_match_single_gpu_reference(tmp_path):
    """2 NCCL ranks (one per GPU), V = 262144 split evenly, canvas 256, bf16 E hidden 2816."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    set_safe_nccl_env()
    V = 262144
    for stats_backend in ("reference", "triton"):
        d = tmp_path / stats_backend   # a fresh FileStore per process group
        d.mkdir()
        rows = _spawn(2, d, "nccl", "cuda", V, 256, 2816, 6, vocab_shard_bounds(V, 2), stats_backend, "bfloat16")
        assert len(rows) == 6
        print(f"\n{stats_backend}: " + "; ".join(
            f"pass {r['step']} accepted {r['accepted']} dH {r['entropy_diff']:.1e} soft err tp/ref "
            f"{r['soft_err_tp']:.1e}/{r['soft_err_ref']:.1e}" for r in rows))
