"""The Triton sampler's kernels form token ids, flat positions and split ends in int32 (row products are int64):
a launch whose largest such index would pass 2**31 - 1 is refused on the host, before anything runs or is written
(it wrapped to a negative id that passed the ``< V`` masks: reads before the logits, or a last vocabulary split
whose end ``start + CHUNK`` wrapped negative, its tokens silently left out of the statistics). The state allows
vocab_size < 2**31, so V = 2**31 - 1 is a valid state whose padded splits reach 2**31. Expanded (stride-0) logits
and embeddings keep these shapes free of memory."""
import pytest
import torch

from blockdiff.sampler import SamplerState, SamplingParams
from blockdiff.sampler.triton.config import SamplerConfig
from blockdiff.sampler.triton.soft_embedding import check_soft_indices, soft_embedding_chunked
from blockdiff.sampler.triton.stats import stats_plan
from blockdiff.sampler.triton.step import sampler_step

V_TOP = 2**31 - 1          # the largest vocab_size a SamplerState takes


def test_triton_step_refuses_vocab_whose_padded_splits_pass_int32_before_writing_state():
    st = SamplerState(2, 1, V_TOP, 1)
    st.add_request(0, 7, SamplingParams(canvas_length=1))
    before = {f: getattr(st, f).clone() for f in ("phase", "canvas", "step", "canvas_index", "soft")}
    logits = torch.zeros(1, 1, 1, dtype=torch.bfloat16).expand(1, 1, V_TOP)   # no memory
    E = torch.zeros(1, 1).expand(V_TOP, 1)
    with pytest.raises(ValueError, match=r"vocab_size=2147483647 .*2\*\*31 - 1"):
        sampler_step(st, torch.tensor([0]), logits, torch.ones(1, dtype=torch.bool), E)
    for f, t in before.items():                      # refused at entry: the PREFILL row did not start denoising
        assert torch.equal(getattr(st, f), t), f


def test_stats_plan_refuses_exactly_where_the_last_split_end_passes_int32():
    cfg = SamplerConfig(split_v=1, block_g=64)       # one split of whole 256-token tiles
    with pytest.raises(ValueError, match=r"vocab_size=2147483647 in 1 vocabulary split\(s\) of 2147483648 tokens"):
        stats_plan(1, 1, V_TOP, cfg, torch.device("cpu"))
    _, chunk, split_v = stats_plan(1, 1, 2**31 - 256, cfg, torch.device("cpu"))   # padded to 2**31 - 256: fits
    assert (chunk, split_v) == (2**31 - 256, 1)
    # several splits pad V by up to a tile each: 7 splits of V = 2**31 - 256 end past 2**31
    with pytest.raises(ValueError, match="split_v=7"):
        stats_plan(1, 1, 2**31 - 256, SamplerConfig(split_v=7, block_g=64), torch.device("cpu"))


def test_stats_plan_refuses_positions_past_int32():
    with pytest.raises(ValueError, match=r"N \* canvas_length = 65537 \* 32768 positions"):
        stats_plan(2**16 + 1, 2**15, 8, None, torch.device("cpu"))


def test_soft_embedding_refuses_a_chunk_whose_padded_tiles_pass_int32():
    # soft_chunk = 3: the last chunk starts at 2**31 - 2 and its 4-token tile reaches 2**31 + 1
    with pytest.raises(ValueError, match=r"chunks of 3 tokens"):
        check_soft_indices(1, 1, V_TOP, 1, torch.device("cpu"), torch.float32,
                           SamplerConfig(soft_impl="chunked", soft_chunk=3))
    logits = torch.zeros(1, 1, 1).expand(1, 1, V_TOP)
    E = torch.zeros(1, 1).expand(V_TOP, 1)
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"chunks of 3 tokens"):
        soft_embedding_chunked(logits, E, torch.ones(1), z, z, z.long(), torch.ones(1, dtype=torch.bool), chunk=3)
    check_soft_indices(1, 1, V_TOP, 1, torch.device("cpu"), torch.float32,
                       SamplerConfig(soft_impl="chunked", soft_chunk=4))          # a power of two divides 2**31


def test_triton_gemm_refuses_k_splits_past_int32():
    with pytest.raises(ValueError, match=r"K split\(s\)"):
        check_soft_indices(1, 1, V_TOP, 16, torch.device("cpu"), torch.float32, SamplerConfig(split_k=3))
    check_soft_indices(1, 1, 2**31 - 64, 16, torch.device("cpu"), torch.float32, SamplerConfig(split_k=1))


def test_triton_step_entry_checks_run_once_per_shape_and_config_and_refusals_repeat(monkeypatch):
    """The entry checks are pure functions of the shapes, device, embedding dtype and config, and cost ~70-110 us of
    host time a step uncached (two config resolves, ~26 triton.cdiv calls; vLLM runs the sampler outside its graphs):
    was recomputed on every step; now cached per key. A refusal is never cached: raised again on every call."""
    import blockdiff.sampler.triton.step as step_mod
    calls = []
    real = step_mod.stats_plan
    monkeypatch.setattr(step_mod, "stats_plan", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    if hasattr(step_mod, "_check_int32_indices"):   # (a cached key of another test would count 0 calls)
        step_mod._check_int32_indices.cache_clear()
    st = SamplerState(2, 4, 16, 8)
    st.add_request(0, 7, SamplingParams(canvas_length=4))
    st.add_request(1, 8, SamplingParams(canvas_length=4))
    E = torch.randn(16, 8)
    for i in range(3):
        sampler_step(st, torch.tensor([0, 1]), torch.randn(2, 4, 16), torch.ones(2, dtype=torch.bool), E)
    assert len(calls) == 1, calls                     # one entry check for three steps of one shape
    sampler_step(st, torch.tensor([1]), torch.randn(1, 4, 16), torch.ones(1, dtype=torch.bool), E)
    assert len(calls) == 2                            # another N: checked
    big = SamplerState(2, 1, V_TOP, 1)
    big.add_request(0, 7, SamplingParams(canvas_length=1))
    logits = torch.zeros(1, 1, 1, dtype=torch.bfloat16).expand(1, 1, V_TOP)
    for _ in range(2):                                # refused each time, state untouched
        with pytest.raises(ValueError, match=r"vocab_size=2147483647 .*2\*\*31 - 1"):
            sampler_step(big, torch.tensor([0]), logits, torch.ones(1, dtype=torch.bool),
                         torch.zeros(1, 1).expand(V_TOP, 1))
    assert int(big.phase[0]) == 0 and len(calls) == 4


def test_triton_launcher_plans_are_cached_per_shape_and_refusals_repeat():
    """The launchers' own plans (``row_stats``' :func:`stats_plan`, ``soft_embedding``'s split-K plan, the chunked
    path's and ``row_moments``' index checks) repeated what the step's cached entry check had just computed, at
    ~30-40 us of host time each a step (the config's ``resolve``, ``triton.cdiv``): cached per key now, the result
    equal to the uncached one; a refusal is raised again on every call."""
    import blockdiff.sampler.triton.soft_embedding as soft_mod
    import blockdiff.sampler.triton.stats as stats_mod
    cpu = torch.device("cpu")
    stats_mod._stats_plan.cache_clear()
    first = stats_plan(3, 5, 1000, None, cpu)
    assert stats_plan(3, 5, 1000, SamplerConfig(), "cpu") == first == stats_mod._stats_plan.__wrapped__(
        3, 5, 1000, SamplerConfig(), cpu)
    assert stats_mod._stats_plan.cache_info().hits == 1
    for _ in range(2):
        with pytest.raises(ValueError, match=r"vocab_size=2147483647"):
            stats_plan(1, 1, V_TOP, SamplerConfig(split_v=1, block_g=64), cpu)
    with pytest.raises(TypeError, match="config must be a SamplerConfig or None"):
        stats_plan(1, 1, 8, {}, cpu)                  # the config check runs before the (hashing) cache
    for f in (soft_mod._gemm_plan, soft_mod._check_chunk_indices, stats_mod.check_moments_indices):
        assert f.cache_info().maxsize == 4096, f
    for _ in range(2):
        with pytest.raises(ValueError, match=r"K split\(s\)"):
            soft_mod._gemm_plan(1, 1, V_TOP, 16, cpu, torch.float32, SamplerConfig(split_k=3))


def _two_gpus(monkeypatch, sms):
    """A CPU stand-in for two CUDA devices of ``sms`` SMs each: ``current`` is the device an index-less "cuda"
    means (what ``torch.cuda.get_device_properties`` reads for it)."""
    from types import SimpleNamespace
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def props(device):
        d = torch.device(device)
        return SimpleNamespace(multi_processor_count=sms[current[0] if d.index is None else d.index])
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return current


def test_launch_plans_for_an_index_less_cuda_device_follow_the_current_device_not_the_first_call_s(monkeypatch):
    """``SamplerConfig.resolve`` reads the SM count of the device, and an index-less "cuda" is the current one. The
    plans cached under that key kept the device current at the first call: after ``set_device`` to a GPU with
    another SM count, stats_plan('cuda') returned the first GPU's vocabulary splits (4 instead of 1 here) and
    check_soft_indices the first GPU's K splits (and took no str device: AttributeError from resolve). Now the
    key pins "cuda" to the current index."""
    import blockdiff.sampler.triton.soft_embedding as soft_mod
    import blockdiff.sampler.triton.stats as stats_mod
    current = _two_gpus(monkeypatch, {0: 132, 1: 5})
    stats_mod._stats_plan.cache_clear()
    soft_mod._gemm_plan.cache_clear()
    uncached = stats_mod._stats_plan.__wrapped__
    want = [uncached(1, 64, 4096, SamplerConfig(), torch.device("cuda", i))[2] for i in (0, 1)]
    assert want[0] != want[1]                        # (else the test shows nothing)
    gemm = soft_mod._gemm_plan.__wrapped__
    want_k = [gemm(4, 64, 4096, 64, torch.device("cuda", i), torch.float32, SamplerConfig())[0].split_k
              for i in (0, 1)]
    assert want_k[0] != want_k[1]
    seen = []
    real = soft_mod._gemm_plan
    monkeypatch.setattr(soft_mod, "_gemm_plan", lambda *a: seen.append(real(*a)[0].split_k))
    for i in (0, 1):
        current[0] = i
        for dev in ("cuda", torch.device("cuda")):
            assert stats_plan(1, 64, 4096, None, dev)[2] == want[i]
            check_soft_indices(4, 64, 4096, 64, dev, torch.float32, None, chunked=False)
            assert seen[-1] == want_k[i]
    stats_mod._stats_plan.cache_clear()
    real.cache_clear()                               # (no plan of the stand-in GPUs outlives the test)


def test_a_numpy_shape_caller_leaves_int_plans_for_int_callers():
    """``np.int64(V)`` hashes and compares as ``V``: a stats plan first computed for a numpy vocabulary size was
    handed, numpy CHUNK / SPLIT_V and all, to every later int caller of those shapes (and a numpy N or CL was a
    TypeError from the resolved SamplerConfig). The plan key is Python ints now."""
    import numpy as np
    import blockdiff.sampler.triton.stats as stats_mod
    cpu = torch.device("cpu")
    stats_mod._stats_plan.cache_clear()
    got = stats_plan(np.int64(3), np.int32(5), np.int64(1000), None, cpu)
    again = stats_plan(3, 5, 1000, None, cpu)
    assert again == got == stats_mod._stats_plan.__wrapped__(3, 5, 1000, SamplerConfig(), cpu)
    assert all(type(x) is int for x in (*got[1:], *again[1:]))
    with pytest.raises(TypeError):
        stats_plan(3, 5, 1000.0, None, cpu)
    stats_mod._stats_plan.cache_clear()
