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
