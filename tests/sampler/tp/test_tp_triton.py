"""Triton local pass of the tensor-parallel sampler (blockdiff.sampler.tp.triton) against the reference local pass
and, through the sharded step, against the single-GPU reference (CPU: Triton interpreter)."""
import math

import torch

import tp_sampler_workers as W
from blockdiff.sampler.tp import local_statistics, make_shards, sampler_step_sharded
from blockdiff.sampler.tp.triton import local_statistics_triton
from blockdiff.sampler.triton.config import SamplerConfig


def test_triton_shard_stats_match_torch_at_unaligned_shard_start():
    """Shard starting at id 33 (not a multiple of 4): Philox groups straddle the boundary; ids are global."""
    g = torch.Generator().manual_seed(0)
    N, cl, V = 3, 4, 70
    x = torch.randn(N, cl, V, generator=g) * 5
    x[0, 1, [40, 60]] = 100.0                     # tie inside shard 1: lowest id
    x[1, 2, 47] = float("nan")
    T = torch.tensor([0.8, 0.0, 0.41])
    seed, rid = torch.tensor([1, 2**40, 3]), torch.tensor([5, 6, -7])
    ci, st = torch.tensor([0, 3, 1]), torch.tensor([0, 5, 9])
    act = torch.ones(N, dtype=torch.bool)
    for sh in make_shards(V, (0, 33, 70)):
        a = local_statistics(x[..., sh.start:sh.end], T, seed, rid, ci, st, sh).packed
        b = local_statistics_triton(x[..., sh.start:sh.end].contiguous(), T, seed, rid, ci, st, act, sh,
                                    SamplerConfig(block_g=4, split_v=2)).packed
        assert torch.equal(a[..., 6], b[..., 6])
        ok = a[..., 6] == 0
        for f in (0, 3, 5):                        # max, argmax id, Gumbel id: exact
            assert torch.equal(a[..., f][ok], b[..., f][ok]), (sh, f)
        for f in (1, 2, 4):                        # sums; z + g (interpreter log may differ by 1 ulp)
            assert torch.allclose(a[..., f][ok], b[..., f][ok], rtol=1e-5, atol=1e-5), (sh, f)
    assert b[0, 1, 3].item() == 40


def test_triton_shard_stats_match_torch_with_minus_inf_masks():
    """-inf logits are p = 0 (issue 26): the triton local pass equals the torch one on shards holding -inf masks,
    a shard whose every logit of a position is -inf (an empty shard's statistics, not a status BAD), and -inf
    beside logits whose z overflows (the shifted form); only NaN / +inf give status BAD."""
    g = torch.Generator().manual_seed(1)
    N, cl, V = 3, 5, 70
    x = torch.randn(N, cl, V, generator=g) * 5
    x[:, 0, ::2] = -math.inf
    x[:, 1, :33] = -math.inf                      # shard [0, 33) all -inf
    x[:, 2, 33:] = -math.inf
    x[:, 2, 5] = 3e38                             # beside an overflowing max (T 0.41 / 0.8): shifted form
    x[:, 3] = -math.inf                           # every shard all -inf
    x[1, 4, 47] = float("inf")
    x[2, 4, 50] = -math.inf
    T = torch.tensor([0.8, 0.0, 0.41])
    seed, rid = torch.tensor([1, 2**40, 3]), torch.tensor([5, 6, -7])
    ci, st = torch.tensor([0, 3, 1]), torch.tensor([0, 5, 9])
    act = torch.ones(N, dtype=torch.bool)
    for sh in make_shards(V, (0, 33, 70)):
        la = local_statistics(x[..., sh.start:sh.end], T, seed, rid, ci, st, sh)
        lb = local_statistics_triton(x[..., sh.start:sh.end].contiguous(), T, seed, rid, ci, st, act, sh,
                                     SamplerConfig(block_g=4, split_v=2))
        a, b = la.packed, lb.packed
        assert torch.equal(a[..., 6], b[..., 6])
        assert (a[..., 6] == 1).tolist() == [[False] * 4 + [i == 1 and sh.start == 33] for i in range(N)]
        ok = a[..., 6] != 1
        for f in (0, 3, 5):                        # max (shift), argmax id, Gumbel id: exact
            assert torch.equal(a[..., f][ok], b[..., f][ok]), (sh, f)
        for f in (1, 2, 4):
            assert torch.allclose(a[..., f][ok], b[..., f][ok], rtol=1e-5, atol=1e-5), (sh, f)
        for f in ("m", "local_argmax", "shift"):
            assert torch.equal(getattr(la, f)[ok], getattr(lb, f)[ok]), (sh, f)
        assert torch.allclose(la.inv_s[ok], lb.inv_s[ok], rtol=1e-5)
        empty = torch.zeros(N, cl, dtype=torch.bool)
        empty[:, 3] = True
        empty[:, 1] = sh.start == 0
        empty[:, 2] = sh.start == 33
        assert torch.equal(b[..., 0] == -math.inf, empty) and (b[..., 1][empty] == 0).all()
        assert (b[..., 3][empty] == V).all() and (lb.inv_s[empty] == 0).all()


def test_triton_sharded_step_matches_reference():
    cfg = SamplerConfig(block_g=16, split_v=1, block_m=32, block_n=16, block_k=64, split_k=1)
    W.run_scenario(lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=(0, 33, 70),
                                                                backend="triton", config=cfg),
                   V=70, cl=8, hidden=16, steps=4, device="cpu", e_dtype=torch.bfloat16, tie_ids=(32, 33))


def test_triton_shard_stats_refuse_a_float_or_bool_coordinate_naming_it_also_on_an_empty_shard():
    """As the torch local pass (review26's ``gumbel_noise_shard``): a float or bool seed / request_id /
    canvas_index / step is a TypeError naming it, not a truncated draw; on an empty shard too, so every rank of a
    group refuses alike."""
    import pytest
    N, cl, V = 2, 4, 40
    act = torch.ones(N, dtype=torch.bool)
    for name in ("seed", "request_id", "canvas_index", "step"):
        for bad in (torch.full((N,), 1.9), torch.ones(N, dtype=torch.bool)):
            args = dict(seed=torch.tensor([3, 4]), request_id=torch.tensor([5, 6]), canvas_index=torch.tensor([0, 1]),
                        step=torch.tensor([2, 2]))
            args[name] = bad
            for sh in make_shards(V, (0, 40, 40)):  # a full shard and an empty one
                with pytest.raises(TypeError, match=name):
                    local_statistics_triton(torch.randn(N, cl, sh.size), torch.ones(N), *args.values(), act, sh)
