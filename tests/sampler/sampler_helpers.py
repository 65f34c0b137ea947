"""Small builders shared by the sampler tests."""
import torch

from blockdiff.sampler import SamplerState, SamplingParams

CL, V, HID = 8, 37, 16


def make_state(params_list, R=None, cl=CL, v=V, hid=HID, slots=None, device="cpu"):
    """State with one request per entry of params_list (request ids 100, 101, ...) at ``slots`` (default 0..n-1)."""
    n = len(params_list)
    R = R or max(n, 1) + 2
    st = SamplerState(R, cl, v, hid, device=device)
    slots = list(range(n)) if slots is None else list(slots)
    for i, (s, p) in enumerate(zip(slots, params_list)):
        st.add_request(s, 100 + i if not isinstance(p, tuple) else p[0], p if not isinstance(p, tuple) else p[1])
    return st, torch.tensor(slots, dtype=torch.int64, device=device)


def P(**kw):
    kw.setdefault("canvas_length", CL)
    return SamplingParams(**kw)


def peaked_logits(n, cl=CL, v=V, ids=None, gap=1000.0, g=None):
    """Logits whose softmax is one-hot (exactly, in float32) at ``ids`` [n, cl]."""
    if ids is None:
        ids = torch.randint(0, v, (n, cl), generator=g)
    x = torch.zeros(n, cl, v)
    x.scatter_(-1, ids[..., None], gap)
    return x, ids


def start_denoise(st, slots):
    """Move PREFILL rows to DENOISE (prefill_done) with the reference backend."""
    from blockdiff.sampler import sampler_step
    n = slots.shape[0]
    return sampler_step(st, slots, torch.zeros(n, st.canvas_length, st.vocab_size),
                        torch.ones(n, dtype=torch.bool), torch.zeros(st.vocab_size, st.hidden_size))
