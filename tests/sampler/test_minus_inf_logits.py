"""docs/ARCHITECTURE.md "Non-finite logits" (issue 26): a -inf logit is p = 0 for that token (vLLM masks tokens that
way), not a failure; only a NaN or +inf logit, or a position whose every logit is -inf (no softmax), fails the
request. Every backend (reference, triton with each soft path and split, tensor-parallel with either local pass)
decides exactly as the reference on -inf masks: half the vocabulary, all but one token, whole vocabulary splits and
TP shards, -inf beside finite logits near float32's max (rule 1's shifted form), greedy rows, a temperature whose z
overflows everywhere. Decisions and state bit for bit, entropies to float32 rounding, soft rows close; a -inf token
is never the argmax or the sample.

Before: every backend failed the request on the first -inf logit. CPU: Triton interpreter.
"""
import math

import pytest
import torch

from blockdiff.sampler import DENOISE, FAILED, SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.tp import sampler_step_sharded
from blockdiff.sampler.triton import SamplerConfig
from blockdiff.sampler.triton import sampler_step as triton_sampler_step

CL, V, H = 6, 40, 8
DECISIONS = ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "finished", "emitted",
             "num_emitted_now", "num_sampled", "num_rejected", "temperature")
STATE = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index", "num_emitted")
FMAX = torch.finfo(torch.float32).max
NEG = -math.inf
SLOTS = torch.tensor([4, 0, 2, 1])


def masked_logits(step, g, undefined=False):
    """[4, CL, V] logits with -inf masks. Row 0 (T 0.8 -> 0.4): the first half of the vocabulary -inf; all but one
    token -inf (the survivor moves with the step); -inf beside a logit at 3e38 (z = +inf: shifted form) and a tie
    at float32's max on ids 3 and V - 2 (across split and shard boundaries); -inf beside logits below -3.3e38 (every
    finite z = -inf: shifted form); every third token -inf; the last id -inf. Row 1 (T 0.8): ids [0, 20) -inf (whole
    splits and shards). Row 2 greedy: half, all but one, -inf beside 3e38. Row 3 (T = 1e-38 in the state: every
    finite z overflows): odd ids -inf. ``undefined``: one position of rows 1 (sampled) and 2 (greedy) all -inf."""
    x = torch.randn(4, CL, V, generator=g) * 3
    x[0, 0, : V // 2] = NEG
    x[0, 1] = NEG
    x[0, 1, 5 + 7 * step] = 0.25
    x[0, 2, ::4] = NEG
    x[0, 2, 7 + step] = 3e38
    x[0, 2, [3, V - 2]] = FMAX
    x[0, 3] = -3.3e38 + torch.arange(V, dtype=torch.float32).flip(0) * 1.3e31
    x[0, 3, 1::3] = NEG
    x[0, 4, ::3] = NEG
    x[0, 5, -1] = NEG
    x[1, :, :20] = NEG
    x[2, 0, V // 2:] = NEG
    x[2, 1] = NEG
    x[2, 1, 31 - step] = -7.0
    x[2, 2, 1::2] = NEG
    x[2, 2, 8] = 3e38
    x[3, :, 1::2] = NEG
    if undefined:
        x[1, 3] = NEG
        x[2, 4] = NEG
    return x


def states():
    st = SamplerState(5, CL, V, H)
    st.add_request(4, 101, SamplingParams(canvas_length=CL, seed=1, t_min=0.4, t_max=0.8, max_denoising_steps=3))
    st.add_request(0, 102, SamplingParams(canvas_length=CL, seed=2, entropy_bound=1.0))
    st.add_request(2, 103, SamplingParams(canvas_length=CL, seed=3, t_min=0.0, t_max=0.0))
    st.add_request(1, 104, SamplingParams(canvas_length=CL, seed=4, entropy_bound=50.0))
    st.t_min[1] = st.t_max[1] = 1e-38                # below the params' floor: every finite z overflows
    return st


def run(step_fn, e_dtype=torch.float32, steps=3, undefined=False):
    """Prefill then ``steps`` denoising steps of masked_logits: (outputs, state, logits)."""
    st = states()
    E = torch.randn(V, H, generator=torch.Generator().manual_seed(7)).to(e_dtype)
    g = torch.Generator().manual_seed(11)
    pd = torch.ones(4, dtype=torch.bool)
    outs, xs = [step_fn(st, SLOTS, torch.zeros(4, CL, V), pd, E)], [None]
    for s in range(steps):
        xs.append(masked_logits(s, g, undefined))
        outs.append(step_fn(st, SLOTS, xs[-1], pd, E))
    return outs, st, xs


def assert_same(a, b, soft_tol):
    (oa, sa, _), (ob, sb, _) = a, b
    for x, y in zip(oa, ob):
        for f in DECISIONS:
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        torch.testing.assert_close(x.entropy, y.entropy, rtol=1e-5, atol=1e-6, equal_nan=True)
    for f in STATE:
        assert torch.equal(getattr(sa, f), getattr(sb, f)), f
    assert torch.isfinite(sb.soft).all()
    torch.testing.assert_close(sb.soft, sa.soft, rtol=0, atol=soft_tol)


def reference_step(st, sl, x, pd, E):
    return sampler_step(st, sl, x, pd, E, backend="reference")


def triton_step(config=None):
    return lambda st, sl, x, pd, E: triton_sampler_step(st, sl, x, pd, E, config=config)


def test_minus_inf_logits_mean_probability_zero_in_the_reference():
    """The reference on these logits: nothing fails; a -inf token is never the argmax or the sample; all but one
    token -inf is one-hot on the survivor (entropy 0); -inf beside the overflowing logits keeps rule 1's limit."""
    outs, st, xs = run(reference_step)
    for o, x in zip(outs[1:], xs[1:]):
        assert not o.failed.any() and torch.isfinite(o.entropy).all()
        masked = x == NEG
        for ids in (o.argmax, o.sampled):
            assert not masked.gather(-1, ids[..., None]).any()
    o = outs[1]
    assert o.argmax[0, 1].item() == 5 and o.sampled[0, 1].item() == 5 and o.entropy[0, 1].item() == 0.0
    assert o.argmax[0, 2].item() == 3 and o.sampled[0, 2].item() in (3, V - 2)    # the tie at float32's max
    assert o.entropy[0, 2].item() == pytest.approx(math.log(2), rel=1e-6)
    assert o.argmax[0, 3].item() == 0                  # the ramp's top, every finite z = -inf: shifted form
    assert o.argmax[2, 1].item() == 31 and o.argmax[2, 2].item() == 8 and (o.entropy[2] == 0).all()
    assert (st.phase[SLOTS] != FAILED).all() and torch.isfinite(st.soft).all()


@pytest.mark.parametrize("config", [
    None,
    SamplerConfig(block_g=4, split_v=3, block_p=2),      # splits (one all -inf); two positions per stats program
    SamplerConfig(block_g=2, split_v=5, block_p=4, soft_impl="triton_gemm"),
    SamplerConfig(soft_impl="chunked", soft_chunk=16),
    SamplerConfig(soft_impl="chunked", stats_overlap=True),
])
def test_minus_inf_logits_mean_probability_zero_triton_matches_the_reference(config):
    assert_same(run(reference_step), run(triton_step(config)), soft_tol=1e-5)


def test_minus_inf_logits_mean_probability_zero_triton_matches_the_reference_bf16():
    ref = run(reference_step, torch.bfloat16)
    tri = run(lambda st, sl, x, pd, E: sampler_step(st, sl, x, pd, E, backend="triton"), torch.bfloat16)
    assert_same(ref, tri, soft_tol=0.05)


def test_minus_inf_logits_in_bf16_logits_match_the_reference():
    """bf16 logits carry -inf too (vLLM's logits dtype may be bf16): same decisions in both backends."""
    def cast(fn):
        return lambda st, sl, x, pd, E: fn(st, sl, x.bfloat16(), pd, E)
    assert_same(run(cast(reference_step)), run(cast(triton_step())), soft_tol=1e-5)


@pytest.mark.parametrize("backend,bounds", [
    ("reference", (0, V)), ("reference", (0, 20, V)), ("reference", (0, 3, 4, V)),
    ("reference", (0, 0, 17, V, V)), ("triton", (0, 20, V)), ("triton", (0, 0, 17, V - 2, V, V)),
])
def test_minus_inf_logits_mean_probability_zero_tensor_parallel_matches_the_reference(backend, bounds):
    """Shards holding only -inf logits at a position (row 1's ids [0, 20), the greedy row's halves, the survivor
    of all but one) beside shards with finite or overflowing logits: such a shard takes no part, as an empty one."""
    ref = run(reference_step)
    tp = run(lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=bounds, backend=backend,
                                                           config=SamplerConfig(block_g=4, split_v=2)))
    assert_same(ref, tp, soft_tol=1e-5)


@pytest.mark.parametrize("name,step_fn", [
    ("reference", reference_step),
    ("triton", triton_step(SamplerConfig(block_g=4, split_v=3, block_p=2))),
    ("triton_overlap", triton_step(SamplerConfig(soft_impl="chunked", stats_overlap=True))),
    ("tp_reference", lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=(0, 20, V),
                                                                   backend="reference")),
    ("tp_triton", lambda st, sl, x, pd, E: sampler_step_sharded(st, sl, x, pd, E, bounds=(0, 0, 17, V, V),
                                                                backend="triton",
                                                                config=SamplerConfig(block_g=4, split_v=2))),
])
def test_position_with_every_logit_minus_inf_fails_the_request_in_every_backend(name, step_fn):
    """A position whose every logit is -inf has no softmax: its request fails (phase FAILED, nothing accepted, NaN
    entropy there), the greedy row too; the other rows go on, exactly as in the reference."""
    outs, st, _ = run(step_fn, steps=1, undefined=True)
    o = outs[-1]
    assert o.failed.tolist() == [False, True, True, False], name
    assert st.phase[SLOTS].tolist()[1:3] == [FAILED, FAILED] and st.phase[4].item() == DENOISE
    assert not o.accepted[1:3].any() and o.accepted[0].any() and o.accepted[3].any()
    assert torch.isnan(o.entropy[1, 3]) and torch.isnan(o.entropy[2, 4])
    if name != "reference":
        assert_same(run(reference_step, steps=1, undefined=True), (outs, st, None), soft_tol=1e-5)
