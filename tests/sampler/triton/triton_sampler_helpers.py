"""Builders and comparisons shared by the Triton sampler tests (tests/sampler/triton/)."""
import math

import torch

from blockdiff.sampler import SamplerState, SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted")
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_emitted_now", "num_sampled", "num_rejected", "temperature")


def coords(n, g, rid_low=-2**62, rid_high=2**62):
    """Random RNG coordinates of n rows: seed, request_id (in [rid_low, rid_high)), canvas_index, step."""
    seed = torch.randint(0, 2**62, (n,), generator=g)
    rid = torch.randint(rid_low, rid_high, (n,), generator=g)
    return seed, rid, torch.randint(0, 70000, (n,), generator=g).int(), torch.randint(0, 48, (n,), generator=g).int()


def mk_state(specs, CL, V, H, R=6, device=DEV):
    """A SamplerState of R slots with one request per (slot, request_id, SamplingParams) of ``specs``."""
    st = SamplerState(R, CL, V, H, device=device)
    for slot, rid, p in specs:
        st.add_request(slot, rid, p)
    return st


def check_same(oa, ob, a, b, soft_tol):
    """Decisions and state fields equal, entropies to float32 rounding, soft rows within ``soft_tol``."""
    for f in DECISIONS:
        assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    assert torch.allclose(oa.entropy, ob.entropy, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert torch.allclose(oa.mean_entropy, ob.mean_entropy, rtol=1e-4, atol=1e-5, equal_nan=True)
    for f in STATE_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.allclose(a.soft, b.soft, rtol=0, atol=soft_tol)


def soft_truth(x, T, E, greedy_ids=None):
    """float64 ``softmax(x / T) @ E * sqrt(hidden)`` (one-hot at ``greedy_ids`` if given)."""
    z = x.double() / T[:, None, None]
    p = torch.softmax(z, -1)
    if greedy_ids is not None:
        p = torch.nn.functional.one_hot(greedy_ids, x.shape[-1]).double()
    return p @ E.double() * math.sqrt(E.shape[1])


def big_case(N=4, CL=256, V=262144, H=2816, seed=0):
    """sampler_n4 on the GPU: soft-capped random logits, bf16 E, one greedy request (the last)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, CL, V, device="cuda", generator=g) * 4.0
    x = 30.0 * torch.tanh(x / 30.0)
    E = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    specs = [(i, 1000 + i, SamplingParams(canvas_length=CL, seed=i, t_min=0.0 if i == 3 else 0.4,
                                          t_max=0.0 if i == 3 else 0.8)) for i in range(N)]
    return x, E, specs
