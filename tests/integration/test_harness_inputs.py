"""HarnessRunner's arguments: nothing is coerced (a str prompt, float / bool ids, float or str steps, params of
the wrong type are TypeErrors naming the argument), backends / device / kv_dtype are resolved at construction
(not after the first forward pass), and default sampling parameters come from the checkpoint."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from integration_helpers import CL, needs_stack, params, prompt

from blockdiff.integration.harness import HarnessRunner, checkpoint_sampling_params
from blockdiff.model import DiffusionGemma, tiny_config
from blockdiff.sampler import SamplingParams

pytestmark = needs_stack


@pytest.mark.parametrize("bad", ["123", b"12", [1.7, 2.2], [True, False], [5, None], None, 7, {"a": 1},
                                 torch.tensor([5.0, 6.5]), torch.tensor([True]), torch.tensor([[5, 6]]),
                                 np.array([1.5, 2.0]), np.array([[5, 6]])],
                         ids=["str", "bytes", "floats", "bools", "None-id", "None", "int", "dict", "float-tensor",
                              "bool-tensor", "2d-tensor", "float-array", "2d-array"])
def test_prompt_token_ids_are_not_coerced(make_runner, bad):
    """Was: '123' became the ids [1, 2, 3], floats and bools were truncated, None / 7 gave "not iterable"."""
    r = make_runner()
    with pytest.raises(TypeError, match="prompt_token_ids"):
        r.add_request("a", bad)
    assert not r.has_unfinished


def test_prompt_token_ids_as_tuple_tensor_or_array_of_ints_are_the_same_request(make_runner):
    toks = prompt(7, 3)
    outs = []
    for form in (toks, tuple(toks), torch.tensor(toks, dtype=torch.int32), np.array(toks, dtype=np.int64),
                 [np.int64(t) for t in toks]):
        r = make_runner()
        r.add_request("a", form, params(max_tokens=CL))
        outs.append(r.run(max_steps=100)["a"].output_token_ids)
    assert all(o == outs[0] for o in outs)


@pytest.mark.parametrize("bad,err", [("3", TypeError), (2.5, TypeError), (True, TypeError), (-1, ValueError)])
def test_arrival_step_must_be_an_int_at_least_zero(make_runner, bad, err):
    with pytest.raises(err, match="arrival_step"):
        make_runner().add_request("a", [5], arrival_step=bad)


@pytest.mark.parametrize("bad,err", [(0, ValueError), (-3, ValueError), ("10", TypeError), (2.0, TypeError),
                                     (True, TypeError)])
def test_run_max_steps_must_be_an_int_at_least_one(make_runner, bad, err):
    r = make_runner()
    r.add_request("a", [5])
    with pytest.raises(err, match="max_steps"):
        r.run(max_steps=bad)
    with pytest.raises(TypeError, match="on_step"):
        r.run(on_step=5)


def test_params_of_the_wrong_type_are_refused_and_vllm_style_params_are_converted(make_runner):
    """A dict (was: AttributeError 'canvas_length') is a TypeError naming params; a vLLM-style SamplingParams
    overrides only the fields it sets over default_params (its eos ids: vLLM's stop set)."""
    r = make_runner(default_params=params(max_denoising_steps=2, t_min=0.3))
    with pytest.raises(TypeError, match="params"):
        r.add_request("a", [5], {"canvas_length": CL})
    with pytest.raises(TypeError, match="default_params"):
        make_runner(default_params={"canvas_length": CL})
    r.add_request("v", [5, 6], SimpleNamespace(temperature=1.0, seed=3, max_tokens=CL, extra_args={"t_max": 0.9}))
    p = r._waiting[0].params
    assert (p.seed, p.max_tokens, p.t_min, p.t_max, p.max_denoising_steps, p.eos_token_ids) == (3, CL, 0.3, 0.9, 2, ())
    assert len(r.run(max_steps=100)["v"].output_token_ids) == CL


def test_vllm_style_rng_request_id_keys_the_noise_as_under_vllm_and_bad_ones_are_refused(make_runner):
    """A vLLM-style request's extra_args rng_request_id names its RNG identity (integration/README.md: a served
    request with rng_request_id "req-0" draws the noise of the harness's request "req-0"). The harness converted
    the request to a blockdiff SamplingParams and dropped the key: request "a" with rng_request_id "b" drew a's
    noise, silently, and an empty or non-str key was accepted. Now it draws b's noise (also after a preemption),
    and a bad key is refused at add_request naming it."""
    def sp(**extra):
        return SimpleNamespace(temperature=1.0, seed=3, max_tokens=2 * CL, extra_args=extra or None)

    def run(rid, p, preempt=False):
        r = make_runner(default_params=params(max_denoising_steps=2))
        r.add_request(rid, prompt(5, 1), p)
        if preempt:
            for _ in range(4):
                r.step()
            r.preempt(rid)
        return r.run(max_steps=200)[rid].output_token_ids

    ref = run("b", sp())
    assert run("a", sp()) != ref  # another identity draws other noise (else the test shows nothing)
    assert run("a", sp(rng_request_id="b")) == ref
    assert run("a", sp(rng_request_id="b"), preempt=True) == ref
    r = make_runner()
    with pytest.raises(ValueError, match="rng_request_id"):
        r.add_request("e", [5], sp(rng_request_id=""))
    with pytest.raises(TypeError, match="rng_request_id"):
        r.add_request("t", [5], sp(rng_request_id=5))
    assert not r.has_unfinished


@pytest.mark.parametrize("kw,err,name", [
    (dict(attn_backend="bogus"), ValueError, "attn_backend"),
    (dict(attn_backend=3), TypeError, "attn_backend"),
    (dict(sampler_backend="bogus"), ValueError, "sampler_backend"),
    (dict(sampler_backend="Reference"), ValueError, "sampler_backend"),
    (dict(kv_dtype=torch.int32), TypeError, "kv_dtype"),
    (dict(kv_dtype="float32"), TypeError, "kv_dtype"),
    (dict(kv_dtype=torch.float16), ValueError, "kv_dtype"),
    (dict(device="bogus"), ValueError, "device"),
    (dict(device=""), ValueError, "device"),
    (dict(device="meta"), ValueError, "device"),
    (dict(device=1.5), TypeError, "device"),
    (dict(check=1), TypeError, "check"),
])
def test_backends_device_and_kv_dtype_are_checked_at_construction(make_runner, kw, err, name):
    """Was: a bogus sampler backend failed after the first forward pass, a bogus attention backend or an int32 KV
    cache at the first step, a bogus device with torch's RuntimeError."""
    with pytest.raises(err, match=name):
        make_runner(**kw)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_model_in_float8_is_refused_at_construction_naming_its_dtype(dtype):
    """A model moved to float8 (``.to(torch.float8_e5m2)``) was accepted, its KV caches allocated in float8, and
    its requests failed at the first step with torch's NotImplementedError inside the forward pass."""
    torch.manual_seed(0)
    model = DiffusionGemma(tiny_config(canvas_length=CL)).eval().to(dtype)
    with pytest.raises(TypeError, match=rf"model: its parameters are {dtype}; the harness runs a model in one of "
                                        r"torch.bfloat16, torch.float16, torch.float32, torch.float64"):
        HarnessRunner(model, default_params=params(), max_num_batched_tokens=4 * CL, page_size=4, max_model_len=64)


def test_auto_backends_resolve_for_the_device(make_runner):
    r = make_runner(attn_backend="auto", sampler_backend="auto")
    assert (r.attn_backend, r.sampler_backend) == ("reference", "reference")  # CPU


def test_default_params_come_from_the_checkpoint_and_explicit_params_win():
    """Without default_params the served canvas length and every default come from the model's generation_config
    (the checkpoint's generation_config.json and config.json canvas_length; was: SamplingParams() with canvas 256
    whatever the checkpoint said), as transformers' generate does; default_params replaces them whole."""
    torch.manual_seed(0)
    model = DiffusionGemma(tiny_config(canvas_length=4)).eval()
    kw = dict(max_num_reqs=1, max_num_batched_tokens=64, page_size=4, max_model_len=64)
    r = HarnessRunner(model, **kw)
    assert r.canvas_length == 4 and r.default_params == SamplingParams(**model.generation_config)
    model.generation_config = dict(model.generation_config, max_denoising_steps=3, t_min=0.1, t_max=0.2,
                                   entropy_bound=0.3, eos_token_ids=(7,), max_tokens=5)
    r = HarnessRunner(model, **kw)
    p = r.default_params
    assert (p.canvas_length, p.max_denoising_steps, p.t_min, p.t_max, p.entropy_bound, p.eos_token_ids,
            p.max_tokens) == (4, 3, 0.1, 0.2, 0.3, (7,), 5)
    assert checkpoint_sampling_params(model, seed=9) == SamplingParams(**dict(model.generation_config, seed=9))
    explicit = SamplingParams(canvas_length=8, max_denoising_steps=2)
    assert HarnessRunner(model, default_params=explicit, **kw).default_params is explicit
    r.add_request("a", [5, 6])
    assert r._waiting[0].params == p


@pytest.mark.parametrize("ids,bad,pos", [([5, 256], 256, 1), ([-1, 5], -1, 0), ([5, 6, 10 ** 6], 10 ** 6, 2)])
def test_out_of_vocab_prompt_id_is_named_with_its_position(make_runner, ids, bad, pos):
    """Was: "token ids must be in [0, 256)" without the argument, the id or where it is."""
    with pytest.raises(ValueError, match=rf"prompt_token_ids: token ids must be in \[0, vocab_size=256\), got {bad} at position {pos}"):
        make_runner().add_request("a", ids)


def test_max_model_len_past_the_model_s_positions_is_refused(make_runner, tiny_model):
    """Was accepted (a 10**6-token max_model_len over a 4096-position model): positions never trained, which vLLM
    refuses too."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_runner(max_model_len=tiny_model.config.max_position_embeddings + 1, num_blocks=8)
    make_runner(max_model_len=tiny_model.config.max_position_embeddings, num_blocks=8)  # the limit itself is fine


def test_vllm_style_stop_token_ids_that_is_not_a_list_names_it(make_runner):
    """Was "TypeError: 'int' object is not iterable" (stop_token_ids=5)."""
    sp = SimpleNamespace(temperature=1.0, stop_token_ids=5)
    with pytest.raises(TypeError, match="request 'a': params: stop_token_ids must be a list of ints"):
        make_runner().add_request("a", prompt(3), sp)


@pytest.mark.parametrize("n, err", [(2.5, TypeError), (-3, ValueError), (True, TypeError)])
def test_block_allocator_num_tokens_must_be_an_int_at_least_zero(n, err):
    from blockdiff.integration.kv_alloc import BlockAllocator
    a = BlockAllocator(4, 16)
    with pytest.raises(err, match="num_tokens must be an int >= 0"):
        a.ensure("r", n)
    assert a.num_free == 4


def test_block_allocator_page_lists_it_returns_are_copies_so_no_page_is_handed_out_twice():
    """Was: blocks() / ensure() returned the allocator's own list, so a caller appending to it made free() return
    that page twice, and the next two owners shared it (one request's KV written over another's)."""
    from blockdiff.integration.kv_alloc import BlockAllocator, OutOfBlocks
    a = BlockAllocator(4, 16)
    a.ensure("r", 32).append(0)
    a.blocks("r").append(1)
    assert a.free("r") == [3, 2] and a.num_free == 4
    a.free("r")  # a second free is a no-op
    taken = a.ensure("x", 64)
    assert sorted(taken) == [0, 1, 2, 3] and a.num_free == 0
    with pytest.raises(OutOfBlocks, match="'y' needs 1 more page"):
        a.ensure("y", 1)
    assert a.blocks("y") == [] and a.blocks("x") == taken  # a refused ensure allocates nothing


def test_block_allocator_of_a_huge_pool_costs_no_memory_per_page():
    """Was: the free list held every page id from the start: BlockAllocator(2**62, 16) a MemoryError, 2**31 pages
    16 GB (the process was killed before the KV cache's allocation could refuse the size). The order pages come in
    is unchanged: freed pages most recent first, then fresh ones from the highest id down."""
    from blockdiff.integration.kv_alloc import BlockAllocator
    a = BlockAllocator(2 ** 62, 16)
    assert a.ensure("a", 40) == [2 ** 62 - 1, 2 ** 62 - 2, 2 ** 62 - 3] and a.num_free == 2 ** 62 - 3
    a.ensure("b", 16)
    a.free("a")
    assert a.ensure("c", 64) == [2 ** 62 - 1, 2 ** 62 - 2, 2 ** 62 - 3, 2 ** 62 - 5]
    b = BlockAllocator(np.int64(3), np.int32(4))  # numpy ints, as the harness takes them
    assert type(b.num_blocks) is int and b.ensure("a", 12) == [2, 1, 0]


@pytest.mark.parametrize("name, value", [("max_num_reqs", np.int64(2)), ("page_size", np.int32(4)),
                                         ("max_model_len", np.int64(64)), ("max_num_batched_tokens", np.int64(32)),
                                         ("num_blocks", np.int64(40))])
def test_numpy_int_capacities_are_taken_as_ints_not_refused_under_another_name(make_runner, name, value):
    """The harness's own check took numpy ints, then the allocator or the model state refused them naming an
    argument the caller never passed (max_num_reqs=np.int64(2): "num_blocks must be an int >= 1, got
    np.int64(64)"; max_num_batched_tokens: "max_num_tokens must be ...")."""
    r = make_runner(default_params=params(max_tokens=CL), **{name: value})
    held = r.allocator.num_blocks if name == "num_blocks" else getattr(r, name)
    assert type(held) is int and held == value
    r.add_request("a", prompt(5))
    res = r.run(max_steps=200)
    assert res["a"].finish_reason == "length" and len(res["a"].output_token_ids) == CL


@pytest.mark.parametrize("name, bad", [("num_blocks", 0), ("num_blocks", True), ("num_blocks", 2.0),
                                       ("max_num_reqs", np.float64(2.0))])
def test_bad_capacity_is_a_value_error_naming_it(make_runner, name, bad):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        make_runner(**{name: bad})


@pytest.mark.parametrize("bad, err", [(torch.tensor([5, 6]).to_sparse(), TypeError),
                                      (torch.tensor([5, 6], device="meta"), ValueError)], ids=["sparse", "meta"])
def test_prompt_tensor_without_dense_data_is_refused_naming_prompt_token_ids(make_runner, bad, err):
    """Was: torch's "Cannot access data pointer of Tensor that doesn't have storage" (sparse) and NotImplementedError
    "Cannot copy out of meta tensor" (meta), naming no argument."""
    r = make_runner()
    with pytest.raises(err, match="prompt_token_ids"):
        r.add_request("a", bad)
    assert not r.has_unfinished


@pytest.mark.parametrize("bad", [5, None, ["x"], b"a"])
def test_req_id_that_is_not_a_str_is_a_type_error_naming_it(make_runner, bad):
    """Was: add_request(5, ...) a ValueError, abort / preempt(["x"]) "unhashable type: 'list'"."""
    r = make_runner()
    for call in (lambda: r.add_request(bad, prompt(3)), lambda: r.abort(bad), lambda: r.preempt(bad)):
        with pytest.raises(TypeError, match="req_id must be a str"):
            call()
    assert not r.has_unfinished


def test_a_token_budget_above_what_a_step_can_schedule_allocates_only_what_a_step_can_use(make_runner):
    """A step schedules at most max_num_reqs rows of at most max_model_len tokens. The model state's per-token
    buffers were sized by the budget itself: max_num_batched_tokens=2**31 with a tiny model allocated 2**31 x hidden
    floats (the process was killed for memory). Now they hold min(budget, max_num_reqs * max_model_len) tokens and
    such a budget serves as any budget above what the requests need."""
    r = make_runner(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=100_000)
    assert r.model_state.self_cond_buf.shape[0] == r.model_state.input_ids_buf.shape[0] == 2 * 64
    assert r.max_num_batched_tokens == 100_000
    ref = make_runner(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=2 * 64)
    r = make_runner(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=2 ** 40)
    for x in (r, ref):
        x.add_request("a", prompt(40, 3), params(max_tokens=2 * CL))
        x.add_request("b", prompt(9, 4), params(max_tokens=CL))
    out, want = r.run(max_steps=200), ref.run(max_steps=200)
    assert {k: v.output_token_ids for k, v in out.items()} == {k: v.output_token_ids for k, v in want.items()}
