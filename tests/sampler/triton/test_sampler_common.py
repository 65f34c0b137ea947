"""Shared Triton sampler helpers (blockdiff.sampler.triton.common): the per-position random-id streams equal
blockdiff.sampler.rng bit for bit."""
import pytest
import torch

from blockdiff.sampler import rng
from blockdiff.sampler.triton.common import random_ids
from triton_sampler_helpers import DEV, coords


@pytest.mark.parametrize("stream", [rng.RENOISE, rng.INITIAL])
@pytest.mark.parametrize("V", [1, 7, 262144, 2**31 - 1])
def test_random_ids_kernel_equals_torch_rng(stream, V):
    g = torch.Generator().manual_seed(V)
    seed, rid, ci, st = coords(5, g)
    a = rng.random_ids(seed, rid, ci, st, 37, V, stream)
    b = random_ids(seed.to(DEV), rid.to(DEV), ci.to(DEV), st.to(DEV), 37, V, stream)
    assert torch.equal(a, b.cpu())
    with pytest.raises(ValueError, match="stream"):
        random_ids(seed, rid, ci, st, 4, V, rng.GUMBEL)
