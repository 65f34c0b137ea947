"""``sampler_step``'s tensor arguments may be strided views (check_step_args accepts any layout): the Triton backend
must read them as the reference does. Found in review: the step kernel read ``prefill_done`` at stride 1 (a
strided bool view started the wrong rows) and the soft reduce kernel read ``E[argmax]`` (greedy rows) with a unit
column stride. CPU: Triton interpreter.
"""
import torch

from blockdiff.sampler import sampler_step
from sampler_helpers import P, make_state

CL, V, H = 4, 16, 8
FIELDS = ("num_sampled", "num_rejected", "emitted", "finished", "failed", "argmax", "sampled", "next_canvas",
          "converged")


def test_strided_prefill_done_and_embedding_give_the_reference_step():
    g = torch.Generator().manual_seed(0)
    params = [P(canvas_length=CL, seed=s, t_min=0.0, t_max=0.0 if s % 2 else 0.8) for s in range(4)]  # greedy rows
    pd_full = torch.tensor([True, False, True, False, False, True, True, False])
    pd = pd_full[::2]                                              # strided: [True, True, False, True]
    e_full = torch.randn(H, V, generator=g)
    E = e_full.t()                                                 # [V, H] with strides (1, V)
    x = torch.randn(4, CL, V, generator=g)
    slots_order = torch.tensor([3, 1, 0, 2])
    states = {}
    for backend in ("reference", "triton"):
        st, _ = make_state(params, cl=CL, v=V, hid=H)
        outs = [sampler_step(st, slots_order, x, pd, E, backend=backend)]       # prefill_done: some rows start
        outs.append(sampler_step(st, slots_order, x, pd, E, backend=backend))   # a denoise step (soft written)
        states[backend] = (st, outs)
    (a, oa), (b, ob) = states["reference"], states["triton"]
    assert torch.equal(a.phase, b.phase)
    for x_a, x_b in zip(oa, ob):
        for f in FIELDS:
            assert torch.equal(getattr(x_a, f), getattr(x_b, f)), f
    assert torch.allclose(a.soft, b.soft, rtol=1e-5, atol=1e-5)
