"""Head-parallel attention (blockdiff.attention.tp): the concatenation over ranks equals the unsharded output.

Reference backend on the CPU, a mixed batch (causal prefill, bidirectional canvases, a commit, an empty
sequence), paged cache with permuted pages, GQA with partitioned and replicated KV heads, windows.
"""
import pytest
import torch

from blockdiff.attention import attention, write_kv_cache
from blockdiff.attention.reference import gather_kv
from blockdiff.attention.tp import (attention_head_parallel, attention_tp, gather_heads, head_shard,
                                    shard_heads)


def mixed_batch(H, Hkv, D=16, page_size=5, seed=0, dtype=torch.float32):
    """Prefill 11 causal (ctx 0), canvas 8 over ctx 9, canvas 8 over ctx 0, commit 8 over ctx 13, empty seq."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [11, 8, 8, 8, 0]
    seq_lens = [11, 17, 8, 21, 4]
    causal = [True, False, False, True, False]
    blocks = [(s + page_size - 1) // page_size for s in seq_lens]
    nblk = sum(blocks) + 3
    perm = torch.randperm(nblk, generator=g)
    bt = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32)
    i = 0
    for b, n in enumerate(blocks):
        bt[b, :n] = perm[i:i + n]
        i += n
    kc = torch.zeros(nblk, page_size, Hkv, D, dtype=dtype)
    vc = torch.zeros(nblk, page_size, Hkv, D, dtype=dtype)
    for b, S in enumerate(seq_lens):
        pos = torch.arange(S)
        slots = bt[b, pos // page_size].to(torch.int64) * page_size + pos % page_size
        write_kv_cache(torch.randn(S, Hkv, D, generator=g).to(dtype), torch.randn(S, Hkv, D, generator=g).to(dtype),
                       kc, vc, slots)
    q = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)
    meta = dict(cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), causal=torch.tensor(causal),
                block_table=bt)
    return q, kc, vc, meta


def test_head_shard_partition_and_replication():
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in (head_shard(16, 8, 2, r) for r in range(2))] == \
        [(0, 8, 0, 4), (8, 16, 4, 8)]
    # DiffusionGemma global layers: 16 q / 2 KV heads at TP 4: each KV head on 2 ranks
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in (head_shard(16, 2, 4, r) for r in range(4))] == \
        [(0, 4, 0, 1), (4, 8, 0, 1), (8, 12, 1, 2), (12, 16, 1, 2)]
    for H, Hkv, W in [(16, 8, 2), (16, 8, 8), (16, 2, 2), (16, 2, 4), (16, 2, 8), (16, 16, 4), (16, 1, 4)]:
        group = H // Hkv
        for r in range(W):
            s = head_shard(H, Hkv, W, r)
            lg = s.num_heads_local // s.num_kv_heads_local
            for i in range(s.num_heads_local):  # the local GQA mapping is the global one restricted to the rank
                assert s.kv_start + i // lg == (s.q_start + i) // group


@pytest.mark.parametrize("args,exc,match", [
    ((16, 8, 3, 0), ValueError, "divisible by world_size"),
    ((12, 3, 4, 0), ValueError, "divide one another"),
    ((16, 6, 2, 0), ValueError, "multiple of num_kv_heads"),
    ((16, 8, 2, 2), ValueError, "rank must be"),
    ((16, 8, 2.0, 0), TypeError, "world_size"),
])
def test_head_shard_rejects_bad_layouts(args, exc, match):
    with pytest.raises(exc, match=match):
        head_shard(*args)


@pytest.mark.parametrize("H,Hkv,W", [(8, 4, 2), (8, 4, 4), (16, 2, 2), (16, 2, 4), (16, 2, 8), (4, 4, 1)])
@pytest.mark.parametrize("window_size,mode", [(None, "symmetric"), (3, "symmetric"), (3, "prefix")])
def test_concatenated_ranks_equal_unsharded(H, Hkv, W, window_size, mode):
    q, kc, vc, meta = mixed_batch(H, Hkv, seed=H * 10 + W)
    kw = dict(meta, window_size=window_size, bidirectional_window=mode, return_lse=True)
    full_out, full_lse = attention(q, kc, vc, backend="reference", **kw)
    out, lse = attention_head_parallel(q, kc, vc, world_size=W, backend="reference", **kw)
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)


def test_contiguous_kv_form_and_bf16():
    q, kc, vc, meta = mixed_batch(8, 2, dtype=torch.bfloat16)
    # contiguous varlen form of the same keys
    ks, vs, cuk = [], [], [0]
    for b, S in enumerate(meta["seq_lens"].tolist()):
        ks.append(gather_kv(kc, meta["block_table"][b], S))
        vs.append(gather_kv(vc, meta["block_table"][b], S))
        cuk.append(cuk[-1] + S)
    k, v = torch.cat(ks), torch.cat(vs)
    kw = dict(cu_seqlens_q=meta["cu_seqlens_q"], seq_lens=meta["seq_lens"], causal=meta["causal"],
              cu_seqlens_k=torch.tensor(cuk, dtype=torch.int32))
    full = attention(q, k, v, backend="reference", **kw)
    sharded = attention_head_parallel(q, k, v, world_size=2, backend="reference", **kw)
    torch.testing.assert_close(sharded, full, atol=0, rtol=0)


def test_rank_slices_are_consistent_and_errors_name_the_argument():
    q, kc, vc, meta = mixed_batch(8, 4)
    sh = head_shard(8, 4, 2, 1)
    qs, ks, vs = shard_heads(q, kc, vc, sh)
    assert qs.shape[1] == 4 and ks.shape[-2] == 2 and qs.is_contiguous()
    assert torch.equal(qs, q[:, 4:]) and torch.equal(ks, kc[..., 2:, :])
    out = attention_tp(qs, ks, vs, shard=sh, backend="reference", **meta)
    assert torch.equal(gather_heads([attention_tp(*shard_heads(q, kc, vc, head_shard(8, 4, 2, 0)),
                                                  shard=head_shard(8, 4, 2, 0), backend="reference", **meta), out]),
                       attention(q, kc, vc, backend="reference", **meta))
    with pytest.raises(ValueError, match="q must have num_heads_local"):
        attention_tp(q, ks, vs, shard=sh, backend="reference", **meta)
    with pytest.raises(ValueError, match="k_cache must have num_kv_heads_local"):
        attention_tp(qs, kc, vs, shard=sh, backend="reference", **meta)
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        shard_heads(q, kc[..., :2, :], vc, sh)


def test_num_causal_q_and_window_edges_per_rank():
    """Stretch metadata (first n query rows causal) and windows 0 / 1 are passed through unchanged to every rank."""
    q, kc, vc, meta = mixed_batch(16, 2, seed=5)
    ncq = torch.tensor([11, 0, 3, 8, 0], dtype=torch.int32)
    base = {k: v for k, v in meta.items() if k != "causal"}
    for W_ in (0, 1):
        kw = dict(base, num_causal_q=ncq, window_size=W_, return_lse=True)
        full = attention(q, kc, vc, backend="reference", **kw)
        for world in (2, 4, 8):
            out, lse = attention_head_parallel(q, kc, vc, world_size=world, backend="reference", **kw)
            torch.testing.assert_close(out, full[0], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lse, full[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("world_size, exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_head_parallel_refuses_a_bad_world_size_naming_it(world_size, exc):
    q, kc, vc, meta = mixed_batch(8, 2)
    with pytest.raises(exc, match="world_size"):
        attention_head_parallel(q, kc, vc, world_size=world_size, backend="reference", **meta)


def test_tp_helpers_refuse_non_tensors_and_non_shards():
    q, kc, vc, meta = mixed_batch(8, 2)
    sh = head_shard(8, 2, 2, 0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention_head_parallel([q], kc, vc, world_size=2, backend="reference", **meta)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        shard_heads(None, kc, vc, sh)
    with pytest.raises(TypeError, match="shard must be a HeadShard"):
        shard_heads(q, kc, vc, "rank0")
    with pytest.raises(TypeError, match="shard must be a HeadShard"):
        attention_tp(q, kc, vc, shard=None, backend="reference", **meta)


def test_head_shard_built_by_hand_must_match_head_shard():
    from blockdiff.attention.tp import HeadShard
    assert HeadShard(1, 2, 8, 2, 4, 8, 1, 2) == head_shard(8, 2, 2, 1)
    with pytest.raises(ValueError, match="inconsistent"):
        HeadShard(0, 2, 8, 2, 4, 0, 0, 1)
    with pytest.raises(TypeError, match="HeadShard.rank"):
        HeadShard(0.0, 2, 8, 2, 0, 4, 0, 1)


def test_gather_heads_refuses_empty_mixed_and_mismatched_results():
    out = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match="one result per rank"):
        gather_heads([])
    with pytest.raises(ValueError, match="total_q"):
        gather_heads([out, out[:3]])
    with pytest.raises(TypeError, match="must all be out tensors or all"):
        gather_heads([out, (out, torch.zeros(2, 5))])


def test_gather_heads_refuses_an_lse_that_does_not_match_its_rank_s_out():
    """Pairs whose lse had another head count than their out (rank 0: 2 heads with a 3-head lse, rank 1: 2 heads
    with a 1-head lse) concatenated into an lse of the right total size, every head's lse after rank 0's first
    two shifted to another head, silently."""
    out = torch.zeros(5, 2, 4)
    lse = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    o, l = gather_heads([(out, lse), (out, lse)])
    assert o.shape == (5, 4, 4) and torch.equal(l, torch.cat([lse, lse]))
    for bad in (torch.zeros(3, 5), torch.zeros(2, 4), torch.zeros(5, 2), torch.zeros(2, 5, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"outs\[1\]: lse must be \[H_local=2, total_q=5\] float32"):
            gather_heads([(out, lse), (out, bad)])


@pytest.mark.parametrize("contiguous", ["no", 0, None, 1.0])
def test_shard_heads_refuses_a_contiguous_that_is_not_a_bool(contiguous):
    """contiguous was read for its truth value: "no" returned copies, 0 / None views aliasing the caller's tensors,
    silently; now a TypeError naming contiguous."""
    q, kc, vc, _ = mixed_batch(8, 2)
    with pytest.raises(TypeError, match="contiguous must be True or False"):
        shard_heads(q, kc, vc, head_shard(8, 2, 2, 0), contiguous=contiguous)
    qs, _, _ = shard_heads(q, kc, vc, head_shard(8, 2, 2, 0), contiguous=False)
    assert qs.data_ptr() == q.data_ptr()  # False: views, as documented


def test_gather_heads_refuses_a_single_tensor_and_names_the_rank_that_is_not_3d():
    """gather_heads(out) (one tensor, not a list of the ranks' results) was split by list() along total_q into
    2-D "ranks" and refused with "rank 0 has (2, 4) ..., rank 0 (2, 4)" (rank 0 disagreeing with itself); a 2-D
    rank 0 likewise. Now a TypeError for the single tensor and a ValueError naming the rank that is not 3-D."""
    out = torch.zeros(5, 2, 4)
    with pytest.raises(TypeError, match=r"a single tensor of shape \(5, 2, 4\)"):
        gather_heads(out)
    with pytest.raises(ValueError, match=r"outs\[0\] must be \[total_q, H_local, Dv\], got shape \(5, 4\)"):
        gather_heads([out[:, 0], out])
    with pytest.raises(ValueError, match=r"outs\[1\] must be \[total_q, H_local, Dv\], got shape \(2, 5\)"):
        gather_heads([(out, torch.zeros(2, 5)), (torch.zeros(2, 5), torch.zeros(2, 5))])
