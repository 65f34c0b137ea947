"""Rule 6 of docs/ARCHITECTURE.md "Sampler semantics": ``mean(H)`` is the float32 sum of the entropies in the shared
sort's order (the last entry of ``common.entropy_order``'s cumsum) over CL (``common.entropy_mean``), in every backend,
so equal entropies give the same mean bit for bit and the same convergence decision.

Before: the reference and the TP step took ``entropy.mean(-1)`` (torch's summation order, times 1 / CL) and the Triton
step kernel a ``tl.sum`` (a tree) divided by CL. With bit-identical entropies the two means were an ulp apart on about
one row in twelve, and a ``confidence_threshold`` between them converged (COMMIT) the request on one backend while
the other kept denoising it: different tokens from there on.
"""
import math

import numpy as np
import pytest
import torch

from blockdiff.sampler import SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.common import entropy_mean, entropy_order
from blockdiff.sampler.tp import sampler_step_sharded

CL, V, HID = 8, 37, 16
#: ties per position at the max logit: every backend takes rule 1's shifted form there (T = 1e-30, logits +-1e10),
#: H = log(#ties) rounded from float64, the same bits in every backend; a vector whose sorted sum differs from both
#: torch.mean's and a position-order tree sum's (numpy's pairwise sum, as the Triton interpreter's tl.sum): the former
#: vector [29, 11, ...] differed from torch.mean only, so the test passed with the kernel's tl.sum restored
TIES = [31, 23, 14, 33, 9, 19, 9, 7]


def _step(backend, conf, device="cpu"):
    st = SamplerState(2, CL, V, HID, device=device)
    st.add_request(0, 7, SamplingParams(canvas_length=CL, t_min=1e-30, t_max=1e-30, stability_threshold=0,
                                        confidence_threshold=conf, max_denoising_steps=10))
    slots = torch.tensor([0], device=device)
    E = torch.linspace(-1, 1, V * HID).view(V, HID).to(device)
    sampler_step(st, slots, torch.zeros(1, CL, V, device=device), torch.tensor([True], device=device), E)
    x = torch.full((1, CL, V), -1e10)
    for p, c in enumerate(TIES):
        x[0, p, :c] = 1e10
    x = x.to(device)
    pd = torch.tensor([False], device=device)
    if backend.startswith("tp-"):
        return sampler_step_sharded(st, slots, x, pd, E, bounds=(0, 10, 23, V), backend=backend[3:])
    return sampler_step(st, slots, x, pd, E, backend=backend)


BACKENDS = ("reference", "triton", "tp-reference", "tp-triton")


def test_equal_entropies_give_the_same_mean_and_convergence_in_every_backend():
    ref = _step("reference", 0.0)
    h = ref.entropy
    want = torch.tensor([math.log(c) for c in TIES], dtype=torch.float64).to(torch.float32)
    assert torch.equal(h[0], want)                                   # the shifted form's exact entropies
    mean = entropy_mean(entropy_order(h)[2])
    assert torch.equal(ref.mean_entropy, mean)
    # the vector discriminates: the former means (torch's, a tree sum in position order) are other floats
    assert float(h.mean(-1)[0]) != float(mean[0])
    assert np.float32(np.sum(h[0].numpy(), dtype=np.float32) / np.float32(CL)) != np.float32(mean[0])
    m = float(mean[0])
    # thresholds around the mean and around torch.mean's (the former reference's) value: one of them lay between
    # the reference's and the kernel's means
    around = []
    for c in (m, float(h.mean(-1)[0])):
        around += [float(np.nextafter(np.float32(c), np.float32(-1))), c, float(np.nextafter(np.float32(c),
                                                                                          np.float32(10)))]
    for conf in around:
        outs = {b: _step(b, conf) for b in BACKENDS}
        for b, o in outs.items():
            assert torch.equal(o.entropy, h), b
            assert torch.equal(o.mean_entropy, mean), (b, conf, float(o.mean_entropy[0]), m)
            assert bool(o.converged[0]) == (np.float32(m) < np.float32(conf)), (b, conf)


@pytest.mark.gpu
def test_gpu_compiled_step_kernel_gives_the_same_mean_and_convergence_as_the_cpu_reference():
    """The compiled Triton step kernel (its load of the sorted cumsum's last entry, not the interpreter's) and every
    backend on CUDA give the CPU reference's mean bit for bit and its convergence at thresholds one ulp either side."""
    ref = _step("reference", 0.0)
    mean = ref.mean_entropy
    m = float(mean[0])
    for conf in (float(np.nextafter(np.float32(m), np.float32(-1))), m, float(np.nextafter(np.float32(m),
                                                                                           np.float32(10)))):
        for b in BACKENDS:
            o = _step(b, conf, device="cuda")
            assert torch.equal(o.entropy.cpu(), ref.entropy), b
            assert torch.equal(o.mean_entropy.cpu(), mean), (b, conf, float(o.mean_entropy[0]), m)
            assert bool(o.converged[0]) == (np.float32(m) < np.float32(conf)), (b, conf)


@pytest.mark.parametrize("seed", range(4))
def test_entropy_mean_is_the_sorted_cumsums_last_entry_over_cl(seed):
    """entropy_mean: the last entry of entropy_order's cumsum over CL, one IEEE float32 division (not a multiply by
    1 / CL); NaN rows NaN (NaN sorts last), no rows no means."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(5, 37, generator=g) * 4
    h[2, 3] = float("nan")
    _, _, cum = entropy_order(h)
    got = entropy_mean(cum)
    want = cum[:, -1].numpy() / np.float32(37)                      # numpy: float32 / float32, correctly rounded
    assert want.dtype == np.float32 and np.array_equal(got.numpy(), want, equal_nan=True)
    assert torch.isnan(got[2]) and entropy_mean(torch.zeros(0, 37)).shape == (0,)
