"""Semantics of the dense reference sampler step (docs/ARCHITECTURE.md "Sampler semantics")."""
import math

import pytest
import torch

from blockdiff.sampler import COMMIT, DENOISE, FAILED, FINISHED, PREFILL, rng, sampler_step
from blockdiff.sampler.common import accept_by_entropy, overflow_shift, temperature
from blockdiff.sampler.reference import entropy_reference

from sampler_helpers import CL, HID, V, P, make_state, peaked_logits, start_denoise

E = torch.randn(V, HID, generator=torch.Generator().manual_seed(0))


def step(st, slots, logits, prefill_done=None):
    n = slots.shape[0]
    pd = torch.ones(n, dtype=torch.bool) if prefill_done is None else prefill_done
    return sampler_step(st, slots, logits, pd, E, backend="reference")


# ------------------------------------------------------------------------------------------ acceptance
def test_inclusive_entropy_bound():
    h = torch.tensor([[0.0625, 0.0625, 0.0625, 0.5]])
    assert accept_by_entropy(h, torch.tensor([0.125])).tolist() == [[True, True, True, False]]
    assert accept_by_entropy(h, torch.tensor([0.1249])).tolist() == [[True, True, False, False]]


def test_lowest_entropy_position_always_accepted():
    h = torch.tensor([[5.0, 3.0, 4.0], [2.0, 2.0, 9.0]])
    assert accept_by_entropy(h, torch.tensor([0.0, 0.0])).tolist() == [[False, True, False], [True, False, False]]
    # bound 0 with a strictly positive second entropy: only the lowest
    h = torch.tensor([[5.0, 3.0, 4.0]])
    assert accept_by_entropy(h, torch.tensor([2.5])).tolist() == [[False, True, False]]


def test_ties_break_by_position():
    h = torch.tensor([[0.5, 0.25, 0.5, 0.5, 0.25]])
    # sorted: 0.25@1, 0.25@4, 0.5@0, 0.5@2, 0.5@3 ; cum - H: 0, .25, .5, 1.0, 1.5
    assert accept_by_entropy(h, torch.tensor([0.5])).tolist() == [[True, True, False, False, True]]
    assert accept_by_entropy(h, torch.tensor([1.0])).tolist() == [[True, True, True, False, True]]


def test_acceptance_matches_transformers_on_distinct_entropies():
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, 11, generator=g) * 3
    s = hf.EntropyBoundSampler(hf.EntropyBoundSamplerConfig(entropy_bound=0.7), 16, 11, 4)
    cur = torch.zeros(3, 16, dtype=torch.long)
    den = torch.ones(3, 16, dtype=torch.long)
    s.accept_canvas(cur, den, logits, 4)
    ours = accept_by_entropy(entropy_reference(logits), torch.full((3,), 0.7))
    assert torch.equal(ours, s.accepted_token_mask)


def test_temperature_schedule_matches_transformers():
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    st, slots = make_state([P(max_denoising_steps=48)])
    proc = hf.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, 48)
    for s in range(48):
        st.step[0] = s
        ours = temperature(st, slots)[0].item()
        theirs = 1.0 / proc(None, torch.ones(1), 48 - s).item()
        assert ours == pytest.approx(theirs, rel=1e-6)
    st.step[0] = 0
    assert temperature(st, slots)[0].item() == pytest.approx(0.8)


def test_full_step_inclusive_bound_accepts_first_uniform_position():
    st, slots = make_state([P(entropy_bound=0.0)])
    start_denoise(st, slots)
    x, ids = peaked_logits(1)
    x[0, 4:] = 0.0  # positions 4..7 uniform: H = log V; 0..3 one-hot: H = 0 exactly
    out = step(st, slots, x)
    assert out.entropy[0, :4].tolist() == [0.0] * 4
    assert torch.allclose(out.entropy[0, 4:], torch.full((4,), math.log(V)), atol=1e-5)
    # cumsum_j - H_j = 0 <= 0 for the 4 one-hot positions and for the first uniform one (ties by position)
    assert out.accepted[0].tolist() == [True] * 5 + [False] * 3
    assert torch.equal(out.sampled[0, :4], ids[0, :4])
    assert torch.equal(out.next_canvas[0, :5], out.sampled[0, :5])
    seed, rid, ci, s0 = st.seed[slots], st.request_id[slots], st.canvas_index[slots], torch.zeros(1, dtype=torch.int32)
    ren = rng.random_ids(seed, rid, ci, s0, CL, V, rng.RENOISE)
    assert torch.equal(out.next_canvas[0, 5:], ren[0, 5:])
    assert torch.equal(st.canvas[0], out.next_canvas[0])


# ------------------------------------------------------------------------------------------ sampling
def test_sampled_is_gumbel_argmax_of_tempered_logits():
    st, slots = make_state([P(seed=5)])
    start_denoise(st, slots)
    x = torch.randn(1, CL, V) * 2
    out = step(st, slots, x)
    T = 0.8
    g = rng.gumbel_noise(st.seed[slots], st.request_id[slots], st.canvas_index[slots],
                         torch.zeros(1, dtype=torch.int64), CL, V)
    assert torch.equal(out.sampled, (x / T + g).argmax(-1))
    assert torch.equal(out.argmax, x.argmax(-1))
    assert out.temperature.item() == pytest.approx(0.8)
    assert torch.allclose(out.entropy, entropy_reference(x / T), atol=1e-6)


def test_gumbel_max_frequencies_follow_softmax():
    n = 256
    st, slots = make_state([P(seed=i, canvas_length=64) for i in range(n)], cl=64, v=5)
    start_denoise(st, slots)
    x = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5]).expand(n, 64, 5).contiguous()
    out = sampler_step(st, slots, x, torch.ones(n, dtype=torch.bool), torch.zeros(5, HID))
    freq = torch.bincount(out.sampled.flatten(), minlength=5).float() / (n * 64)
    assert torch.allclose(freq, torch.softmax(x[0, 0] / 0.8, -1), atol=0.01)


def test_greedy_t0_has_no_noise_and_zero_entropy():
    st, slots = make_state([P(t_min=0.0, t_max=0.0, entropy_bound=0.0)])
    start_denoise(st, slots)
    x = torch.randn(1, CL, V)
    x[0, 0, :3] = 7.0  # a tie: lowest id wins
    out = step(st, slots, x)
    assert out.temperature.item() == 0.0
    assert torch.equal(out.sampled, x.argmax(-1)) and torch.equal(out.argmax, x.argmax(-1))
    assert out.sampled[0, 0].item() == 0
    assert (out.entropy == 0).all() and out.accepted.all()
    assert torch.equal(st.canvas[slots], out.sampled)
    # self-conditioning: one-hot(argmax) @ E * sqrt(hidden)
    assert torch.allclose(st.soft[0], E[x.argmax(-1)[0]] * math.sqrt(HID), atol=1e-5)


def test_soft_embedding_and_zero_at_canvas_start():
    st, slots = make_state([P()])
    start_denoise(st, slots)
    assert (st.soft[0] == 0).all()
    x = torch.randn(1, CL, V)
    out = step(st, slots, x)
    assert not out.converged.item()
    expected = torch.softmax(x[0] / 0.8, -1) @ E * math.sqrt(HID)
    assert torch.allclose(st.soft[0], expected, atol=1e-4)


# ------------------------------------------------------------------------------------------ convergence
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_stability_k_needs_k_plus_1_identical_argmax_canvases(k):
    st, slots = make_state([P(stability_threshold=k, max_denoising_steps=20)])
    start_denoise(st, slots)
    x, _ = peaked_logits(1, g=torch.Generator().manual_seed(k))
    for s in range(k + 1):
        out = step(st, slots, x)
        assert out.converged.item() == (s == k), (s, k)
    assert st.phase[0].item() == COMMIT
    assert torch.equal(st.commit_canvas[0], x[0].argmax(-1))


def test_earliest_convergence_k1_is_step_1_and_a_change_resets():
    st, slots = make_state([P(stability_threshold=1, max_denoising_steps=20)])
    start_denoise(st, slots)
    x1, _ = peaked_logits(1, g=torch.Generator().manual_seed(1))
    x2, _ = peaked_logits(1, g=torch.Generator().manual_seed(2))
    assert not step(st, slots, x1).converged.item()   # s = 0
    assert not step(st, slots, x2).converged.item()   # s = 1, argmax changed
    assert step(st, slots, x2).converged.item()       # s = 2: two identical argmax canvases


def test_confidence_threshold_is_strict():
    # identical argmax canvases but mean entropy log V > threshold: not converged until the cap
    st, slots = make_state([P(confidence_threshold=0.005, max_denoising_steps=4)])
    start_denoise(st, slots)
    x = torch.zeros(1, CL, V)
    for s in range(4):
        out = step(st, slots, x)
        assert out.converged.item() == (s == 3)
    # greedy with threshold 0: mean entropy 0 is not < 0
    st, slots = make_state([P(t_min=0.0, t_max=0.0, confidence_threshold=0.0, max_denoising_steps=3)])
    start_denoise(st, slots)
    x, _ = peaked_logits(1)
    assert [step(st, slots, x).converged.item() for _ in range(3)] == [False, False, True]


def test_step_cap():
    st, slots = make_state([P(max_denoising_steps=3)])
    start_denoise(st, slots)
    g = torch.Generator().manual_seed(3)
    conv = [step(st, slots, torch.randn(1, CL, V, generator=g)).converged.item() for _ in range(3)]
    assert conv == [False, False, True]
    assert st.phase[0].item() == COMMIT


# ------------------------------------------------------------------------------------------ failure
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_plus_inf_logit_never_accepted_request_failed(bad):
    st, slots = make_state([P(), P()])
    start_denoise(st, slots)
    canvas_before = st.canvas.clone()
    x = torch.randn(2, CL, V)
    x[1, 3, 5] = bad
    out = step(st, slots, x)
    assert out.failed.tolist() == [False, True]
    assert not out.accepted[1].any() and out.accepted[0].any()
    assert st.phase[slots].tolist() == [DENOISE, FAILED]
    assert torch.equal(st.canvas[1], canvas_before[1])
    assert out.argmax[1].eq(-1).all() and out.sampled[1].eq(-1).all()
    assert torch.isnan(out.entropy[1, 3]) and torch.isfinite(out.entropy[1, :3]).all()
    # a failed request stays failed; its logits are ignored afterwards
    out = step(st, slots, torch.randn(2, CL, V))
    assert st.phase[1].item() == FAILED and out.num_rejected[1].item() == 0


def test_minus_inf_logits_mean_probability_zero_and_do_not_fail():
    """docs/ARCHITECTURE.md "Non-finite logits": a -inf logit (vLLM's token mask) is p = 0, not a failure. Half the
    vocabulary -inf, all but one token -inf, -inf beside logits near float32's max (rule 1's shifted form): the
    request denoises, a masked id is never the argmax or the sample, entropies are those of the unmasked logits,
    and every output equals, bit for bit, the same step with finfo(float32).min in place of -inf (at T < 1 that
    logit's z = x / T is -inf too). (Was: the request FAILED on the first -inf logit.)"""
    def logits(neg):
        x = torch.randn(2, CL, V, generator=torch.Generator().manual_seed(5)) * 3
        x[:, 0, : V // 2] = neg                     # half the vocabulary masked
        x[:, 1, :] = neg
        x[:, 1, 11] = 0.5                           # all but one token masked: p one-hot there
        x[:, 2, ::3] = neg
        x[:, 2, 4] = 3e38                           # -inf beside a logit whose z overflows: shifted form
        x[:, 3, 1::2] = neg
        x[:, 3, 2] = -3.3e38                        # huge negative finite logits beside -inf
        x[:, 4, -1] = neg                           # the last id masked
        return x

    outs, states = [], []
    for neg in (-math.inf, torch.finfo(torch.float32).min):
        st, slots = make_state([P(t_min=0.4, t_max=0.8), P(t_min=0.0, t_max=0.0)])
        start_denoise(st, slots)
        outs.append([step(st, slots, logits(neg)) for _ in range(2)])
        states.append(st)
    for oa, ob in zip(*outs):
        for f in ("accepted", "argmax", "sampled", "next_canvas", "converged", "failed", "entropy", "mean_entropy"):
            assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    for f in ("phase", "canvas", "prev_argmax", "stable_count", "step", "soft"):
        assert torch.equal(getattr(states[0], f), getattr(states[1], f)), f
    x = logits(-math.inf)
    for out in outs[0]:
        assert not out.failed.any() and torch.isfinite(out.entropy).all() and torch.isfinite(out.mean_entropy).all()
        masked = x == -math.inf
        for ids in (out.argmax, out.sampled):
            assert not masked.gather(-1, ids[..., None]).any()
        assert out.argmax[:, 1].tolist() == [11, 11] and out.sampled[:, 1].tolist() == [11, 11]
        assert out.argmax[:, 2].tolist() == [4, 4] and out.entropy[0, 1].item() == 0.0
        keep = ~masked[0, 0]
        torch.testing.assert_close(out.entropy[0, 0], entropy_reference(x[0, 0, keep] / out.temperature[0]))
    assert (states[0].phase[:2] != FAILED).all() and torch.isfinite(states[0].soft).all()
    assert states[0].phase[0].item() == DENOISE
    torch.testing.assert_close(states[0].soft[0, 1], E[11] * math.sqrt(HID))    # p one-hot at the only token


def test_minus_inf_masked_tokens_are_never_sampled_and_the_rest_follow_the_softmax():
    n = 256
    st, slots = make_state([P(seed=i, canvas_length=64) for i in range(n)], cl=64, v=5)
    start_denoise(st, slots)
    x = torch.tensor([0.0, -math.inf, 2.0, -math.inf, 0.5]).expand(n, 64, 5).contiguous()
    out = sampler_step(st, slots, x, torch.ones(n, dtype=torch.bool), torch.zeros(5, HID))
    freq = torch.bincount(out.sampled.flatten(), minlength=5).float() / (n * 64)
    assert freq[1].item() == 0.0 and freq[3].item() == 0.0
    assert torch.allclose(freq, torch.softmax(x[0, 0] / 0.8, -1), atol=0.01)


@pytest.mark.parametrize("greedy", [False, True])
def test_position_with_every_logit_minus_inf_fails_the_request(greedy):
    """Every logit of a position -inf: the softmax is undefined, so the request fails (nothing accepted, NaN
    entropy there), greedy rows too (whose entropies are otherwise 0)."""
    t = 0.0 if greedy else 0.8
    st, slots = make_state([P(t_min=t, t_max=t), P(t_min=t, t_max=t)])
    start_denoise(st, slots)
    canvas_before = st.canvas.clone()
    x = torch.randn(2, CL, V)
    x[:, :, : V // 2] = -math.inf
    x[1, 6, :] = -math.inf
    out = step(st, slots, x)
    assert out.failed.tolist() == [False, True]
    assert st.phase[slots].tolist() == [DENOISE, FAILED]
    assert not out.accepted[1].any() and out.accepted[0].any()
    assert torch.equal(st.canvas[1], canvas_before[1])
    assert torch.isnan(out.entropy[1, 6]) and torch.isfinite(out.entropy[1, :6]).all()
    assert torch.isfinite(out.entropy[0]).all()


def test_float32_min_masked_logits_keep_entropy_finite_and_accept_the_lowest():
    """A finite logit at finfo(float32).min (a common vocabulary mask) / T < 1 overflows to z = -inf: p = 0 there
    (p log p -> 0), so entropies stay finite, the lowest-entropy position is accepted, nothing fails. (Was NaN
    entropy everywhere: nothing accepted, mean entropy NaN, the request stuck until the step cap.)"""
    st, slots = make_state([P(t_min=0.4, t_max=0.8)])
    start_denoise(st, slots)
    x = torch.randn(1, CL, V)
    x[..., 5] = torch.finfo(torch.float32).min
    out = step(st, slots, x)
    assert not out.failed.any() and st.phase[0].item() == DENOISE
    assert torch.isfinite(out.entropy).all() and torch.isfinite(out.mean_entropy).all()
    assert out.accepted[0, out.entropy[0].argmin()]
    keep = torch.ones(V, dtype=torch.bool)
    keep[5] = False
    ref = entropy_reference(x[..., keep] / st.t_max[0])
    torch.testing.assert_close(out.entropy, ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(st.soft).all()


def test_logits_whose_z_overflows_take_the_shifted_form_and_do_not_fail():
    """Finite logits near float32's max at T < 1 (z = x / T would be +inf) used to fail the request (NaN entropy).
    Rule 1: such a position takes z = (x - max x) / T: p is one-hot at the largest logit (uniform over exact
    ties), the entropy is log(ties), the Gumbel sample is a tie; the other positions keep z = x / T."""
    st, slots = make_state([P(), P()])
    start_denoise(st, slots)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, CL, V, generator=g)
    x[1, 3, 5] = 3e38                           # unique max: one-hot
    x[1, 4, [9, 2]] = 3.4e38                    # a tie at the max: p = 1/2 on ids 2 and 9
    x[1, 4, 11] = -3.4e38
    out = step(st, slots, x)
    assert out.failed.tolist() == [False, False]
    assert st.phase[slots].tolist() == [DENOISE, DENOISE]
    assert out.argmax[1, 3].item() == 5 and out.sampled[1, 3].item() == 5
    assert out.argmax[1, 4].item() == 2 and out.sampled[1, 4].item() in (2, 9)
    assert out.entropy[1, 3].item() == 0.0
    assert out.entropy[1, 4].item() == pytest.approx(math.log(2), rel=1e-6)
    others = [i for i in range(CL) if i not in (3, 4)]
    T = st.t_max[1]
    assert torch.equal(out.entropy[1, others], entropy_reference(x[1, others] / T))
    assert torch.isfinite(st.soft).all()
    sq = math.sqrt(HID)
    torch.testing.assert_close(st.soft[1, 3], E[5] * sq, rtol=1e-6, atol=1e-6)   # p one-hot at 5 (fp32 E)
    torch.testing.assert_close(st.soft[1, 4], (E[2] + E[9]) / 2 * sq, rtol=1e-5, atol=1e-5)


def test_every_z_overflowing_to_minus_inf_takes_the_shifted_form():
    """Every logit of a position below -T * FLT_MAX (z = x / T all -inf: softmax undefined, the request failed):
    z = (x - max x) / T puts p on the largest logit, as the limit of softmax."""
    st, slots = make_state([P(t_min=0.5, t_max=0.5)])
    start_denoise(st, slots)
    x = torch.randn(1, CL, V)
    x[0, 2] = -3.3e38
    x[0, 2, 17] = -3.0e38
    out = step(st, slots, x)
    assert not out.failed.any()
    assert out.argmax[0, 2].item() == 17 and out.sampled[0, 2].item() == 17 and out.entropy[0, 2].item() == 0.0


def test_ordinary_positions_keep_z_bit_identical_to_x_over_t():
    """The shift is 0 wherever max z is finite, so z = (x - 0) / T is bit for bit the accepted fl(x / T)
    (docs/ARCHITECTURE.md Decisions), including finite logits whose own z overflows to -inf (p = 0)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, CL, V, generator=g) * 30
    x[0, :, 3] = torch.finfo(torch.float32).min                  # z = -inf at T < 1: p = 0, no shift
    x[1, 1, :] = -0.0
    T = torch.tensor([0.4, 1.7, 1e-5])[:, None, None]
    c = overflow_shift(x, T)
    assert (c == 0).all()
    assert torch.equal(((x - c[..., None]) / T).view(torch.int32), (x / T).view(torch.int32))


def test_tiny_temperature_in_the_state_is_the_greedy_limit_not_a_failure():
    """A temperature the params refuse (1e-38, written into the state directly) divides finite logits to +inf: the
    shifted form makes every position's p one-hot at its argmax (no exact ties here), so nothing fails and the
    sample is the argmax."""
    st, slots = make_state([P()])
    start_denoise(st, slots)
    st.t_min[0] = st.t_max[0] = 1e-38
    x = torch.randn(1, CL, V, generator=torch.Generator().manual_seed(2)) * 3
    out = step(st, slots, x)
    assert not out.failed.any()
    assert torch.equal(out.argmax[0], x[0].argmax(-1)) and torch.equal(out.sampled[0], x[0].argmax(-1))
    assert (out.entropy == 0).all()


def test_garbage_logits_of_non_denoise_rows_are_ignored():
    st, slots = make_state([P(), P()])
    x = torch.full((2, CL, V), float("nan"))
    out = step(st, slots, x, torch.tensor([True, False]))
    assert st.phase[slots].tolist() == [DENOISE, PREFILL]
    assert not out.failed.any()
    assert out.num_sampled.tolist() == [0, 0] and out.num_rejected.tolist() == [0, 0]


# ------------------------------------------------------------------------------------------ commit / EOS
def _run_to_commit(st, slots, ids):
    x, _ = peaked_logits(slots.shape[0], ids=ids)
    for _ in range(2):
        step(st, slots, x)
    assert (st.phase[slots] == COMMIT).all()


def test_eos_kept_and_trimmed():
    st, slots = make_state([P(eos_token_ids=(7, 9), t_min=0.0, t_max=0.0)])
    start_denoise(st, slots)
    ids = torch.tensor([[1, 2, 3, 9, 4, 7, 5, 6]])
    _run_to_commit(st, slots, ids)
    out = step(st, slots, torch.full((1, CL, V), float("nan")))
    assert out.num_emitted_now.tolist() == [4] and out.num_sampled.tolist() == [CL]
    assert out.emitted.tolist() == [[1, 2, 3, 9, -1, -1, -1, -1]]
    assert out.finished.tolist() == [True] and st.phase[0].item() == FINISHED


def test_max_tokens_trimming_over_canvases():
    st, slots = make_state([P(max_tokens=20, eos_token_ids=(36,))])
    start_denoise(st, slots)
    emitted = []
    ids = torch.arange(CL)[None] + 1
    for c in range(3):
        assert st.canvas_index[0].item() == c
        _run_to_commit(st, slots, ids)
        out = step(st, slots, torch.zeros(1, CL, V))
        emitted.append(out.num_emitted_now.item())
        assert out.finished.item() == (c == 2)
    assert emitted == [8, 8, 4]
    assert st.phase[0].item() == FINISHED and st.num_emitted[0].item() == 20


def test_eos_after_max_tokens_cut():
    st, slots = make_state([P(max_tokens=3, eos_token_ids=(5,))])
    start_denoise(st, slots)
    _run_to_commit(st, slots, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    out = step(st, slots, torch.zeros(1, CL, V))
    assert out.emitted[0, :4].tolist() == [1, 2, 3, -1] and out.finished.item()


# ------------------------------------------------------------------------------------------ phases
def test_phase_transitions():
    st, slots = make_state([P(seed=1), P(seed=2)])
    pd = torch.tensor([False, True])
    out = step(st, slots, torch.zeros(2, CL, V), pd)
    assert st.phase[slots].tolist() == [PREFILL, DENOISE]
    init = rng.random_ids(st.seed[1:2], st.request_id[1:2], torch.zeros(1, dtype=torch.int64),
                          torch.zeros(1, dtype=torch.int64), CL, V, rng.INITIAL)
    assert torch.equal(st.canvas[1], init[0])
    assert st.step[1].item() == 0 and (st.soft[1] == 0).all() and (st.prev_argmax[1] == -1).all()
    assert out.num_sampled.tolist() == [0, 0] and out.num_rejected.tolist() == [0, 0]
    out = step(st, slots, torch.randn(2, CL, V))
    assert out.num_rejected.tolist() == [0, CL] and st.step[1].item() == 1
    assert (st.soft[1] != 0).any()
    # commit -> fresh canvas with canvas_index 1, soft zero
    st.max_denoising_steps[1] = 2
    out = step(st, slots, torch.randn(2, CL, V), torch.tensor([False, False]))
    assert out.converged.tolist() == [False, True] and st.phase[1].item() == COMMIT
    out = step(st, slots, torch.randn(2, CL, V), torch.tensor([False, False]))
    assert out.num_sampled.tolist() == [0, CL] and st.phase[1].item() == DENOISE
    assert st.canvas_index[1].item() == 1 and st.step[1].item() == 0 and (st.soft[1] == 0).all()
    init = rng.random_ids(st.seed[1:2], st.request_id[1:2], torch.ones(1, dtype=torch.int64),
                          torch.zeros(1, dtype=torch.int64), CL, V, rng.INITIAL)
    assert torch.equal(st.canvas[1], init[0])
    # finished / removed slots are untouched
    st.remove_request(1)
    before = st.canvas[1].clone()
    out = step(st, slots, torch.randn(2, CL, V), torch.tensor([False, False]))
    assert st.phase[1].item() == FINISHED and torch.equal(st.canvas[1], before)
    assert out.num_sampled[1].item() == 0 and out.num_rejected[1].item() == 0


# ------------------------------------------------------------------------------------------ invariance
def test_batch_invariance_reference():
    g = torch.Generator().manual_seed(7)
    pa = P(seed=42, max_denoising_steps=4)
    st1, s1 = make_state([(555, pa)])
    st2, s2 = make_state([(1, P(seed=1)), (555, pa), (2, P(seed=3, t_min=0.0, t_max=0.0))], R=6, slots=[4, 1, 0])
    start_denoise(st1, s1)
    start_denoise(st2, s2)
    assert torch.equal(st1.canvas[0], st2.canvas[1])
    for _ in range(5):
        x = torch.randn(3, CL, V, generator=g) * 3
        o1 = step(st1, s1, x[1:2])
        o2 = step(st2, s2, x)
        for name in ("accepted", "entropy", "argmax", "sampled", "next_canvas", "converged", "emitted",
                     "num_sampled", "num_rejected", "mean_entropy", "temperature"):
            assert torch.equal(getattr(o1, name)[0], getattr(o2, name)[1]), name
        assert torch.equal(st1.canvas[0], st2.canvas[1]) and torch.equal(st1.phase[0], st2.phase[1])
        assert torch.allclose(st1.soft[0], st2.soft[1], atol=1e-6)


def test_bad_arguments():
    st, slots = make_state([P()])
    pd = torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match="logits"):
        sampler_step(st, slots, torch.zeros(1, CL, V + 1), pd, E)
    with pytest.raises(TypeError, match="slots"):
        sampler_step(st, slots.int(), torch.zeros(1, CL, V), pd, E)
    with pytest.raises(TypeError, match="prefill_done"):  # a wrong dtype: TypeError, as check_step_args documents
        sampler_step(st, slots, torch.zeros(1, CL, V), pd.int(), E)
    with pytest.raises(ValueError, match="prefill_done"):
        sampler_step(st, slots, torch.zeros(1, CL, V), pd.repeat(2), E)
    with pytest.raises(ValueError, match="embedding"):
        sampler_step(st, slots, torch.zeros(1, CL, V), pd, E[:, :3])
    with pytest.raises(ValueError, match="backend"):
        sampler_step(st, slots, torch.zeros(1, CL, V), pd, E, backend="cuda")


def test_backend_dispatch_is_explicit():
    from blockdiff.sampler import get_backend, reference, resolve_backend

    assert resolve_backend("auto", "cpu") == "reference" and resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("triton") == "triton"
    assert get_backend("reference") is reference.sampler_step
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("fused")


def test_bad_device_string_in_resolve_backend_is_a_value_error_naming_device():
    """Regression: resolve_backend("auto", "bogus") (sampler and attention alike) was torch's RuntimeError from
    torch.device; now a ValueError naming device, a device of the wrong type a TypeError naming device, and a backend
    name that is not a str a TypeError naming backend (was a ValueError). A CUDA device string still resolves on a
    machine without CUDA (availability is not resolve_backend's rule)."""
    from blockdiff.attention import resolve_backend as attention_resolve
    from blockdiff.sampler import resolve_backend as sampler_resolve

    for resolve in (sampler_resolve, attention_resolve):
        for bad in ("bogus", "", "cuda:x"):
            with pytest.raises(ValueError, match="device"):
                resolve("auto", bad)
        for bad in (3, 1.5, ["cpu"]):
            with pytest.raises(TypeError, match="device"):
                resolve("auto", bad)
        for bad in (None, 3, b"reference"):
            with pytest.raises(TypeError, match="backend"):
                resolve(bad)
        assert resolve("auto", "cuda:3") == "triton" and resolve("auto", torch.device("cpu")) == "reference"
        assert resolve("auto") == "reference" and resolve("reference", "bogus") == "reference"


@pytest.mark.parametrize("k", [1, 2])
def test_convergence_matches_transformers_stable_and_confident_stopping(k):
    """Issue 6 (d): on equal logits, our convergence decision per step equals transformers'
    StableAndConfidentStoppingCriteria (fed the same argmax canvases and temperature-scaled logits)."""
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    g = torch.Generator().manual_seed(7)
    crit = hf.StableAndConfidentStoppingCriteria(stability_threshold=k, confidence_threshold=0.005)
    st, slots = make_state([P(stability_threshold=k, confidence_threshold=0.005, max_denoising_steps=40)])
    start_denoise(st, slots)
    ids_a = torch.randint(0, V, (1, CL), generator=g)
    ids_b = ids_a.clone()
    ids_b[0, 0] = (ids_b[0, 0] + 1) % V
    # argmax sequence a, b, b, b, a, a, a, a with sharp logits (tiny entropy) except a diffuse step 2
    plan = [(ids_a, 1000.0), (ids_b, 1000.0), (ids_b, 0.5), (ids_b, 1000.0), (ids_a, 1000.0), (ids_a, 1000.0),
            (ids_a, 1000.0), (ids_a, 1000.0)]
    for s, (ids, gap) in enumerate(plan):
        x, _ = peaked_logits(1, ids=ids, gap=gap, g=g)
        T = temperature(st, slots)
        z = x.float() / T[:, None, None]
        theirs = bool(crit(ids, z)[0])
        out = step(st, slots, x)
        assert torch.equal(out.argmax, ids), s
        assert bool(out.converged[0]) == theirs, f"step {s}: ours {bool(out.converged[0])} transformers {theirs}"
        if theirs:
            assert s == 3  # a, b, b (diffuse: stable but not confident), b -> converged
            break
    else:
        raise AssertionError("the plan never converged")


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(data=hst.data())
def test_acceptance_property_equals_a_naive_sequential_oracle(data):
    """accept_by_entropy vs a plain loop: sort by (H, position), float32 running (inclusive) sum c_j, accept iff
    ``c_j - H_j <= bound`` evaluated in float32 exactly as docs/ARCHITECTURE.md / transformers write it (NOT the
    exclusive sum: e.g. H = 0.05 x 3, bound 0.1 rejects the third, 0.15f - 0.05f > 0.1f); NaN never accepted;
    with a finite entropy the lowest is always accepted. Entropies from a few values so ties are frequent."""
    import numpy as np

    n, cl = data.draw(hst.integers(1, 3)), data.draw(hst.integers(1, 12))
    pool = data.draw(hst.lists(hst.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3, 1e-8, float("nan")]), min_size=1,
                               max_size=4))
    H = torch.tensor([[data.draw(hst.sampled_from(pool)) for _ in range(cl)] for _ in range(n)], dtype=torch.float32)
    bound = torch.tensor([data.draw(hst.sampled_from([0.0, 0.05, 0.1, 0.11, 1.0])) for _ in range(n)],
                         dtype=torch.float32)
    got = accept_by_entropy(H, bound)
    for i in range(n):
        h = H[i].numpy()
        order = sorted(range(cl), key=lambda j: (math.isnan(h[j]), 0.0 if math.isnan(h[j]) else h[j], j))
        run = np.float32(0.0)
        want = [False] * cl
        for j in order:
            run = np.float32(run + np.float32(h[j]))
            if not math.isnan(h[j]) and np.float32(run - np.float32(h[j])) <= np.float32(bound[i].item()):
                want[j] = True
        assert got[i].tolist() == want, (h, bound[i])
        if not all(math.isnan(x) for x in h):
            assert got[i][int(np.nanargmin(h))]
