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
