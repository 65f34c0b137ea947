"""Reference local pass of the tensor-parallel sampler (blockdiff.sampler.tp.reference): the shard's Gumbel noise
is the global noise's slice, bit for bit."""
import pytest
import torch

from blockdiff.sampler import rng
from blockdiff.sampler.tp.reference import gumbel_noise_shard


@pytest.mark.parametrize("a,b", [(0, 37), (1, 5), (3, 4), (5, 37), (4, 8), (7, 7), (36, 37), (13, 30)])
def test_gumbel_noise_shard_equals_global_noise_slice(a, b):
    args = (torch.tensor([3, 4]), torch.tensor([5, 2**40 + 6]), torch.tensor([0, 9]), torch.tensor([2, 3]))
    full = rng.gumbel_noise(*args, 8, 37)
    assert torch.equal(gumbel_noise_shard(*args, 8, a, b), full[..., a:b])


@pytest.mark.parametrize("name", ["seed", "request_id", "canvas_index", "step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_gumbel_noise_shard_refuses_a_float_coordinate_as_gumbel_noise_does(name, dtype):
    """Regression (review26): break26b made rng.gumbel_noise refuse float / bool coordinates, but the TP shard that
    documents itself equal to it still ran ``.to(torch.int64)`` on the seed: a float seed of 1.9 drew seed 1's noise
    where gumbel_noise raised. Both now raise a TypeError naming the coordinate, the empty shard included."""
    args = dict(seed=torch.tensor([3]), request_id=torch.tensor([5]), canvas_index=torch.tensor([0]),
                step=torch.tensor([2]))
    args[name] = torch.full((1,), 1.9) if dtype.is_floating_point else torch.ones(1, dtype=dtype)
    a = tuple(args.values())
    with pytest.raises(TypeError, match=name):
        rng.gumbel_noise(*a, 4, 10)
    for lo, hi in ((0, 10), (4, 4)):
        with pytest.raises(TypeError, match=name):
            gumbel_noise_shard(*a, 4, lo, hi)


def test_gumbel_noise_shard_refuses_coordinates_of_different_row_counts_and_broadcasts_one_entry():
    """gumbel_noise_shard with a one-entry seed beside three request ids raised torch's RuntimeError from its reshape
    (as rng.gumbel_noise did before break32); now one entry is every row's, as in rng.gumbel_noise, and a mismatch is
    a ValueError naming the counts."""
    rid = torch.tensor([1, 2, 3])
    z = torch.zeros(3, dtype=torch.int64)
    g = gumbel_noise_shard(torch.tensor([7]), rid, z, z, 2, 1, 9)
    assert torch.equal(g, rng.gumbel_noise(torch.full((3,), 7), rid, z, z, 2, 11)[..., 1:9])
    assert gumbel_noise_shard(7, rid, 0, 0, 2, 4, 4).shape == (3, 2, 0)
    with pytest.raises(ValueError, match="one entry per row.*seed 2, request_id 3"):
        gumbel_noise_shard(torch.tensor([7, 8]), rid, z, z, 2, 0, 8)
