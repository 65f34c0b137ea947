"""Records of the tensor-parallel sampler (blockdiff.sampler.tp.common): vLLM's vocabulary split, shard
validation, the empty shard's statistics and the communication volume."""
import pytest
import torch

from blockdiff.sampler.tp.common import (F_ARGMAX, F_GID, F_GVAL, F_MAX, NUM_FIELDS, LocalStats, VocabShard,
                                         communication_bytes, make_shards, vocab_shard_bounds)


def test_vocab_shard_bounds_follow_vllm_padding():
    assert vocab_shard_bounds(1000, 2) == (0, 500, 1000)
    assert vocab_shard_bounds(1000, 3) == (0, 334, 668, 1000)
    assert vocab_shard_bounds(1000, 2, pad_to=64) == (0, 512, 1000)           # V_pad 1024
    assert vocab_shard_bounds(100, 4, pad_to=64) == (0, 32, 64, 96, 100)
    assert vocab_shard_bounds(10, 4, pad_to=64) == (0, 10, 10, 10, 10)        # ranks holding padding only
    with pytest.raises(ValueError, match="world_size"):
        vocab_shard_bounds(10, 0)


def test_make_shards_rejects_bad_bounds():
    with pytest.raises(ValueError, match="non-decreasing"):
        make_shards(10, (0, 6, 4, 10))
    with pytest.raises(ValueError, match="non-decreasing"):
        make_shards(10, (0, 5, 9))
    with pytest.raises(ValueError, match="rank"):
        VocabShard(10, 0, 5, rank=2, world_size=2)
    with pytest.raises(TypeError, match="start"):
        VocabShard(10, 0.0, 5)



@pytest.mark.parametrize("bad", [4.9, True, "5"])
def test_make_shards_and_vocab_shard_bounds_refuse_non_int_bounds_naming_them(bad):
    """Were truncated or parsed (``int(x)``): bounds (0, 4.9, 10) split the vocabulary at 4, (0, True, 10) at 1,
    and vocab_shard_bounds(10.5, 2) returned float bounds."""
    with pytest.raises(TypeError, match="bounds must hold ints"):
        make_shards(10, (0, bad, 10))
    for kw, name in ((dict(vocab_size=10.5, world_size=2), "vocab_size"), (dict(vocab_size=10, world_size=True),
                                                                            "world_size"),
                     (dict(vocab_size=10, world_size=2, pad_to=64.0), "pad_to")):
        with pytest.raises(TypeError, match=name):
            vocab_shard_bounds(**kw)

def test_communication_is_independent_of_vocab():
    c = communication_bytes(4, 256, 2816, 2)
    assert c["all_gather_bytes"] == 2 * 4 * 256 * 7 * 8
    assert c["all_reduce_bytes"] == 4 * 256 * 2816 * 4


def test_empty_shard_statistics_are_never_chosen():
    """A shard without tokens: max and Gumbel value -inf, ids = vocab_size (the combine's "no candidate"), zeros."""
    e = LocalStats.empty(2, 3, 50, "cpu")
    assert e.packed.shape == (2, 3, NUM_FIELDS) and e.packed.dtype == torch.float64
    assert (e.packed[..., F_MAX] == float("-inf")).all() and (e.packed[..., F_GVAL] == float("-inf")).all()
    assert (e.packed[..., F_ARGMAX] == 50).all() and (e.packed[..., F_GID] == 50).all()
    assert not e.m.any() and not e.inv_s.any() and e.local_argmax.dtype == torch.int64 and not e.local_argmax.any()
