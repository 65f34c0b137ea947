"""SamplingParams validation and SamplerState slot management."""
import pytest
import torch

from blockdiff.sampler import FINISHED, PREFILL, NO_MAX_TOKENS, SamplerState, SamplingParams
from blockdiff.sampler.params import MIN_TEMPERATURE, schedule_extremes


def test_defaults_match_transformers():
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    d = hf.DiffusionGemmaGenerationConfig._get_default_generation_params()
    p = SamplingParams()
    assert p.max_denoising_steps == d["max_denoising_steps"]
    assert (p.t_min, p.t_max) == (d["t_min"], d["t_max"])
    assert p.entropy_bound == d["sampler_config"].entropy_bound
    assert p.stability_threshold == d["stability_threshold"]
    assert p.confidence_threshold == d["confidence_threshold"]
    assert p.canvas_length == 256


@pytest.mark.parametrize("field,value,exc", [
    ("canvas_length", 0, ValueError), ("canvas_length", 1 << 16, ValueError), ("canvas_length", 2.0, TypeError),
    ("max_denoising_steps", 0, ValueError), ("max_denoising_steps", 1 << 14, ValueError),
    ("t_min", -0.1, ValueError), ("t_max", float("nan"), ValueError), ("t_min", "0.4", TypeError),
    ("entropy_bound", -1.0, ValueError), ("entropy_bound", float("inf"), ValueError),
    ("confidence_threshold", -0.5, ValueError), ("stability_threshold", -1, ValueError),
    ("stability_threshold", True, TypeError), ("seed", -1, ValueError), ("seed", 1 << 63, ValueError),
    ("max_tokens", 0, ValueError), ("max_tokens", 1.5, TypeError), ("eos_token_ids", (-2,), ValueError),
    ("eos_token_ids", ("a",), TypeError), ("eos_token_ids", 3.0, TypeError),
])
def test_bad_params_name_the_field(field, value, exc):
    with pytest.raises(exc, match=field):
        SamplingParams(**{field: value})


def test_t_max_below_t_min_rejected_and_greedy_allowed():
    with pytest.raises(ValueError, match="t_max"):
        SamplingParams(t_min=0.5, t_max=0.4)
    assert SamplingParams(t_min=0.0, t_max=0.0).greedy
    assert SamplingParams(eos_token_ids=[3, 1]).eos_token_ids == (1, 3)
    assert SamplingParams(eos_token_ids=4).eos_token_ids == (4,)


def test_state_add_remove():
    st = SamplerState(3, 8, 50, 4, max_eos=2)
    assert (st.phase == FINISHED).all()
    st.add_request(1, 12345, SamplingParams(canvas_length=8, eos_token_ids=(3, 4), max_tokens=9, seed=7))
    assert st.phase[1].item() == PREFILL and st.request_id[1].item() == 12345 and st.seed[1].item() == 7
    assert st.eos_token_ids[1].tolist() == [3, 4] and st.max_tokens[1].item() == 9
    st.add_request(0, -5, SamplingParams(canvas_length=8))
    assert st.max_tokens[0].item() == NO_MAX_TOKENS and st.eos_token_ids[0].tolist() == [-1, -1]
    st.remove_request(1)
    assert st.phase[1].item() == FINISHED


@pytest.mark.parametrize("kw,exc,match", [
    (dict(slot=3), ValueError, "slot"), (dict(slot=-1), ValueError, "slot"), (dict(slot=1.0), TypeError, "slot"),
    (dict(request_id="x"), TypeError, "request_id"), (dict(request_id=1 << 63), ValueError, "request_id"),
    (dict(params=SamplingParams(canvas_length=9)), ValueError, "canvas_length"),
    (dict(params=SamplingParams(canvas_length=8, eos_token_ids=(1, 2, 3))), ValueError, "max_eos"),
    (dict(params=SamplingParams(canvas_length=8, eos_token_ids=(50,))), ValueError, "vocab_size"),
    (dict(params={}), TypeError, "params"),
])
def test_add_request_rejects_bad_input(kw, exc, match):
    st = SamplerState(3, 8, 50, 4, max_eos=2)
    args = dict(slot=0, request_id=1, params=SamplingParams(canvas_length=8))
    args.update(kw)
    with pytest.raises(exc, match=match):
        st.add_request(args["slot"], args["request_id"], args["params"])


@pytest.mark.parametrize("kw,match", [(dict(max_num_reqs=0), "max_num_reqs"), (dict(canvas_length=0), "canvas_length"),
                                      (dict(vocab_size=0), "vocab_size"), (dict(hidden_size=0), "hidden_size")])
def test_state_rejects_bad_sizes(kw, match):
    args = dict(max_num_reqs=2, canvas_length=8, vocab_size=10, hidden_size=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        SamplerState(**args)


@pytest.mark.parametrize("t_min,t_max,S", [(1e-38, 1e-38, 48), (0.0, 1e-38, 48), (0.0, 1e-36, 16383),
                                           (1e-40, 1e-40, 1), (0.0, 5e-324, 48), (5e-324, 5e-324, 3)])
def test_temperatures_whose_schedule_leaves_the_normal_float32_range_are_refused(t_min, t_max, S):
    """A nonzero schedule reaching a temperature below 2**-126 (a denormal divisor, or 0: silently greedy) is a
    ValueError naming t_min / t_max. t_min = t_max = 1e-38 used to be accepted, and every request failed (z = x / T
    overflowed)."""
    with pytest.raises(ValueError, match="t_min=.* / t_max=.* give the temperature .* below MIN_TEMPERATURE"):
        SamplingParams(t_min=t_min, t_max=t_max, max_denoising_steps=S)


def test_a_schedule_overflowing_float32_is_refused():
    """(t_max - t_min) * S in float32 overflowed: T = inf at step 0."""
    with pytest.raises(ValueError, match="t_max=.* with t_min=0.0 gives the temperature inf at step 0"):
        SamplingParams(t_min=0.0, t_max=3e38, max_denoising_steps=48)


@pytest.mark.parametrize("t_min,t_max,S", [(1e-30, 1e-30, 48), (0.0, 1e-30, 16383), (1e-40, 0.5, 48),
                                           (MIN_TEMPERATURE, MIN_TEMPERATURE, 1), (3.4e38, 3.4e38, 48),
                                           (1e30, 1e30 * 1.5, 16383), (0.0, 0.0, 48)])
def test_every_accepted_schedule_is_zero_or_finite_normal_float32(t_min, t_max, S):
    """Tiny temperatures are valid (z = x / T overflowing takes rule 1's shifted form): the whole float32 schedule
    the sampler computes is finite and normal, or 0 (greedy)."""
    from blockdiff.sampler.common import temperature
    p = SamplingParams(canvas_length=8, t_min=t_min, t_max=t_max, max_denoising_steps=S)
    st = SamplerState(1, 8, 10, 4)
    st.add_request(0, 0, p)
    T = []
    for s in (0, S // 2, S - 1):
        st.step[0] = s
        T.append(temperature(st, torch.tensor([0])).item())
    assert all(t == 0 for t in T) if p.greedy else all(MIN_TEMPERATURE <= t < float("inf") for t in T), T
    lo, hi = schedule_extremes(t_min, t_max, S)
    assert (lo, hi) == (T[-1], T[0])


@pytest.mark.parametrize("field", ["max_num_reqs", "canvas_length", "vocab_size", "hidden_size", "max_eos"])
@pytest.mark.parametrize("value", ["4", 2.7, 4.0, True, None])
def test_state_sizes_must_be_ints_never_coerced(field, value):
    """SamplerState('4', ...) / SamplerState(2.7, ...) were accepted through int(): now a TypeError naming the size."""
    args = dict(max_num_reqs=2, canvas_length=8, vocab_size=10, hidden_size=4)
    args[field] = value
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        SamplerState(**args)


@pytest.mark.parametrize("kw,match", [
    (dict(max_num_reqs=1 << 31), "max_num_reqs"), (dict(max_eos=-1), "max_eos"),
    (dict(hidden_size=1 << 31), "hidden_size"), (dict(vocab_size=1 << 31), "vocab_size"),
    (dict(canvas_length=1 << 16), "canvas_length")])
def test_state_sizes_out_of_range_name_the_size(kw, match):
    args = dict(max_num_reqs=2, canvas_length=8, vocab_size=10, hidden_size=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        SamplerState(**args)


@pytest.mark.parametrize("device,exc", [("bogus", ValueError), ("cuda:bogus", ValueError), ("", ValueError),
                                        (3, TypeError), (None, TypeError)])
def test_state_device_is_parsed_into_an_error_naming_device(device, exc):
    """SamplerState(device='bogus') raised torch's RuntimeError from deep inside."""
    with pytest.raises(exc, match="device"):
        SamplerState(2, 8, 10, 4, device=device)


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "mps", "xpu", "hpu"])
def test_meta_device_state_is_refused_naming_device(device):
    """Regression: SamplerState(device='meta') was accepted: a state of meta tensors holds no values (add_request
    went through, its writes dropped, and the state's reads had nothing to read); another device type this machine
    lacks (mps, xpu, hpu) was torch's RuntimeError / ModuleNotFoundError from the first allocation. Now a ValueError
    naming device."""
    if not isinstance(device, torch.device) and device != "meta":
        try:
            torch.empty(0, device=device)
            pytest.skip(f"this machine has {device}")
        except Exception:
            pass
    with pytest.raises(ValueError, match="device"):
        SamplerState(2, 8, 10, 4, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_state_on_a_missing_cuda_device_is_a_value_error():
    with pytest.raises(ValueError, match="device 'cuda:0' is not available"):
        SamplerState(2, 8, 10, 4, device="cuda:0")


def test_state_accepts_torch_device_objects_and_strings():
    assert SamplerState(2, 8, 10, 4, device=torch.device("cpu")).device == torch.device("cpu")
    assert SamplerState(2, 8, 10, 4, device="cpu").phase.device.type == "cpu"


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1", torch.device("cpu", 0)])
def test_state_on_an_indexed_cpu_device_runs_steps(device):
    """SamplerState(device='cpu:0') kept the index while its tensors report 'cpu': every sampler_step then refused
    the state's own slots ("slots is on cpu, the state on cpu:0")."""
    from blockdiff.sampler import sampler_step
    st = SamplerState(2, 8, 10, 4, device=device)
    assert st.device == torch.device("cpu")
    st.add_request(0, 7, SamplingParams(canvas_length=8))
    slots = torch.tensor([0], device=st.device)
    out = sampler_step(st, slots, torch.zeros(1, 8, 10, device=st.device), torch.ones(1, dtype=torch.bool),
                       torch.zeros(10, 4))
    assert out.failed.tolist() == [False]


def test_check_params_refuses_what_add_request_refuses_without_touching_state():
    """check_params (run by queues at submission) raises exactly where add_request would, and touches no slot."""
    st = SamplerState(2, 8, 37, 4, max_eos=2)
    before = {k: v.clone() for k, v in vars(st).items() if torch.is_tensor(v)}
    for p, match in ((SamplingParams(canvas_length=8, eos_token_ids=(1, 2, 3)), "max_eos"),
                     (SamplingParams(canvas_length=8, eos_token_ids=(37,)), "vocab_size"),
                     (SamplingParams(canvas_length=16), "canvas_length")):
        with pytest.raises(ValueError, match=match):
            st.check_params(p)
        with pytest.raises(ValueError, match=match):
            st.add_request(0, 1, p)
    with pytest.raises(TypeError, match="SamplingParams"):
        st.check_params({"canvas_length": 8})
    st.check_params(SamplingParams(canvas_length=8, eos_token_ids=(1, 36)))
    for k, v in before.items():
        assert torch.equal(getattr(st, k), v), k


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=1 << 63), "max_tokens"), (dict(max_tokens=(1 << 62) + 1), "max_tokens"),
    (dict(stability_threshold=1 << 40), "stability_threshold"),
    (dict(t_min=1e39, t_max=1e39), "t_min"), (dict(t_max=1e39), "t_max"),
    (dict(entropy_bound=1e39), "entropy_bound"), (dict(confidence_threshold=-1e39), "confidence_threshold"),
])
def test_params_that_overflow_the_device_dtypes_are_rejected_naming_the_field(kw, field):
    """Values past the device tensors' dtypes (int64 / int32 / float32) raise a ValueError naming the field at
    construction. (Were accepted, then add_request died mid-write with a torch overflow error, leaving the slot
    in PREFILL; 1e39 in both t_min and t_max would have been inf - inf = NaN temperature.)"""
    with pytest.raises(ValueError, match=field):
        SamplingParams(canvas_length=8, **kw)


def test_params_at_the_device_dtype_limits_fit_the_state():
    st = SamplerState(1, 8, 37, 4)
    p = SamplingParams(canvas_length=8, max_tokens=1 << 62, stability_threshold=(1 << 31) - 1,
                       t_min=3.4e38, t_max=3.4e38, entropy_bound=3.4e38)
    st.add_request(0, 5, p)
    assert st.max_tokens[0].item() == 1 << 62 and st.stability_threshold[0].item() == (1 << 31) - 1
    assert torch.isfinite(st.t_max).all() and torch.isfinite(st.entropy_bound).all()


def test_reserve_eos_grows_the_buffer_and_keeps_every_slot_s_ids():
    st = SamplerState(3, 4, 50, 2, max_eos=2)
    st.add_request(1, 5, SamplingParams(canvas_length=4, eos_token_ids=(7, 9)))
    with pytest.raises(ValueError, match="reserve_eos"):
        st.check_params(SamplingParams(canvas_length=4, eos_token_ids=(1, 2, 3)))
    st.reserve_eos(3)
    assert st.max_eos == 4 and st.eos_token_ids.shape == (3, 4)
    assert st.eos_token_ids[1].tolist() == [7, 9, -1, -1] and st.eos_token_ids[0].tolist() == [-1] * 4
    st.add_request(2, 6, SamplingParams(canvas_length=4, eos_token_ids=(1, 2, 3)))
    assert st.eos_token_ids[2].tolist() == [1, 2, 3, -1]
    st.reserve_eos(2)  # no-op
    assert st.max_eos == 4
    with pytest.raises(ValueError, match="n must be"):
        st.reserve_eos(-1)


@pytest.mark.parametrize("n,error", [("3", TypeError), (True, TypeError), (3.0, TypeError), (1 << 31, ValueError),
                                     (1 << 40, ValueError)])
def test_reserve_eos_with_a_non_int_or_out_of_range_count_is_refused_naming_n(n, error):
    """A count that is not an int is a TypeError (was a ValueError); one past max_eos' range [0, 2**31) a ValueError
    before anything is allocated (2**40 was the allocator's RuntimeError); nothing grows."""
    st = SamplerState(2, 4, 50, 2, max_eos=2)
    with pytest.raises(error, match=r"n must be an int in \[0, 2\*\*31\)"):
        st.reserve_eos(n)
    assert st.max_eos == 2 and st.eos_token_ids.shape == (2, 2)


def test_resumed_request_starts_at_its_canvas_index_and_emitted_count():
    """add_request(num_emitted=, canvas_index=) (a request resumed after preemption): the canvas index survives
    the end of prefill (was reset to 0 there), so the first canvas after resumption is the one an unpreempted
    run denoises at that point; num_emitted counts toward max_tokens."""
    from blockdiff.sampler import DENOISE, sampler_step
    from blockdiff.sampler.common import fresh_canvas

    st = SamplerState(2, 4, 50, 2)
    p = SamplingParams(canvas_length=4, max_tokens=12)
    st.add_request(0, 5, p, num_emitted=8, canvas_index=2)
    slots = torch.tensor([0])
    sampler_step(st, slots, torch.zeros(1, 4, 50), torch.tensor([True]), torch.zeros(50, 2))
    assert st.phase[0].item() == DENOISE and st.canvas_index[0].item() == 2 and st.num_emitted[0].item() == 8
    assert torch.equal(st.canvas[0], fresh_canvas(st, slots, torch.tensor([2], dtype=torch.int32))[0])
    with pytest.raises(ValueError, match="num_emitted"):
        st.add_request(1, 6, p, num_emitted=-1)
    with pytest.raises(TypeError, match="canvas_index"):
        st.add_request(1, 6, p, canvas_index=1.0)


@pytest.mark.parametrize("ids", [{1, "a"}, {1, None}, frozenset({2, 1.5})])
def test_eos_token_ids_set_with_a_non_int_names_the_field(ids):
    """A set is sorted into a tuple: a non-int in it was sorted first (TypeError "'<' not supported between
    instances of 'str' and 'int'", naming nothing)."""
    with pytest.raises(TypeError, match="eos_token_ids must hold ints"):
        SamplingParams(eos_token_ids=ids)


def test_add_request_refuses_num_emitted_at_or_past_max_tokens():
    """Was: a request that had emitted max_tokens was accepted, denoised a whole canvas and emitted nothing."""
    from blockdiff.sampler import SamplerState, SamplingParams

    st = SamplerState(2, 4, 16, 8)
    p = SamplingParams(canvas_length=4, max_tokens=5)
    for n in (5, 6):
        with pytest.raises(ValueError, match=rf"num_emitted \({n}\) must be < params.max_tokens \(5\)"):
            st.add_request(0, 1, p, num_emitted=n, canvas_index=2)
    st.add_request(0, 1, p, num_emitted=4, canvas_index=1)  # one token left: resumed
    assert st.num_emitted[0].item() == 4
    st.add_request(1, 2, SamplingParams(canvas_length=4), num_emitted=10 ** 6)  # no cap: any count


@pytest.mark.parametrize("field", ["t_min", "t_max", "entropy_bound", "confidence_threshold"])
def test_float_param_given_an_int_beyond_float_range_is_a_value_error_naming_it(field):
    """An int beyond float's range (a JSON client's ``1`` and 400 zeros) raised OverflowError from math.isfinite,
    which the vLLM refusal path (TypeError / ValueError) did not catch: the engine's add_request raised."""
    with pytest.raises(ValueError, match=rf"{field} must be finite, got an int of 1329 bits"):
        SamplingParams(**{field: 10 ** 400})
    with pytest.raises(ValueError, match=rf"{field} must be finite, got an int of"):
        SamplingParams(**{field: -(10 ** 5000)})          # digits beyond Python's int-to-str limit too


@pytest.mark.parametrize("steps, exc", [(0, ValueError), (-3, ValueError), (1 << 14, ValueError), (2**31, ValueError),
                                        (True, TypeError), (2.5, TypeError), (48.0, TypeError)])
def test_sampler_schedule_extremes_refuses_a_step_count_outside_its_range(steps, exc):
    """The sampler's public schedule_extremes took any step count, as model.generation's copy did (break32): 0 returned
    (inf, nan), -3 a lowest temperature below t_min, 2.5 was truncated and True read as 1, 2**31 raised torch's int32
    overflow RuntimeError. Now SamplingParams' own range, [1, 2**14), named."""
    with pytest.raises(exc, match="max_denoising_steps must be"):
        schedule_extremes(0.4, 0.8, steps)
