"""Slot ids of ``sampler_step``: checked on the host whenever value checks run (the default, except under CUDA-graph
capture), and never an out-of-bounds index in the Triton kernels when they are not.

Before: a negative id stepped slot R - 1 in the reference (torch's negative indexing), ids >= R were IndexErrors
from deep inside or out-of-bounds reads in the Triton kernels (a segfault under the interpreter), and duplicated
ids were silently accepted. CPU: Triton interpreter.
"""
import pytest
import torch

from blockdiff.sampler import FINISHED, SamplerState, SamplingParams, sampler_step
from blockdiff.sampler.common import check_slot_values
from blockdiff.sampler.tp import sampler_step_sharded

CL, V, H, R = 4, 16, 8, 3
FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index", "num_emitted",
          "soft")


def denoising_state():
    """Slots 0 and 2 in DENOISE (one step out of PREFILL), slot 1 free."""
    st = SamplerState(R, CL, V, H)
    st.add_request(0, 10, SamplingParams(canvas_length=CL, seed=1))
    st.add_request(2, 12, SamplingParams(canvas_length=CL, seed=2))
    sl = torch.tensor([0, 2])
    sampler_step(st, sl, torch.zeros(2, CL, V), torch.ones(2, dtype=torch.bool), torch.zeros(V, H))
    return st


def snapshot(st):
    return {f: getattr(st, f).clone() for f in FIELDS}


STEPS = {
    "reference": lambda st, sl, x, pd, E, **kw: sampler_step(st, sl, x, pd, E, backend="reference", **kw),
    "triton": lambda st, sl, x, pd, E, **kw: sampler_step(st, sl, x, pd, E, backend="triton", **kw),
    "tp": lambda st, sl, x, pd, E, **kw: sampler_step_sharded(st, sl, x, pd, E, bounds=(0, 7, V), **kw),
}


@pytest.mark.parametrize("backend", list(STEPS))
@pytest.mark.parametrize("ids,rule", [([-1], "in \\[0, max_num_reqs=3\\), got -1"), ([3], "got 3"),
                                      ([10 ** 6], "got 1000000"), ([-4], "got -4"), ([0, 2, 0], "distinct"),
                                      ([2, 2], "distinct")])
def test_bad_slot_ids_are_a_value_error_naming_slots_and_touch_nothing(backend, ids, rule):
    st = denoising_state()
    before = snapshot(st)
    n = len(ids)
    with pytest.raises(ValueError, match=f"slots must .*{rule}"):
        STEPS[backend](st, torch.tensor(ids), torch.randn(n, CL, V), torch.zeros(n, dtype=torch.bool),
                       torch.randn(V, H))
    for f, t in before.items():
        assert torch.equal(getattr(st, f), t), f


@pytest.mark.parametrize("backend", list(STEPS))
def test_check_values_must_be_a_bool_or_none(backend):
    st = denoising_state()
    with pytest.raises(TypeError, match="check_values"):
        STEPS[backend](st, torch.tensor([0]), torch.randn(1, CL, V), torch.zeros(1, dtype=torch.bool),
                       torch.randn(V, H), check_values=1)


def test_check_slot_values_accepts_distinct_in_range_ids_and_no_rows():
    st = SamplerState(R, CL, V, H)
    check_slot_values(st, torch.tensor([2, 0, 1]))
    check_slot_values(st, torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("bad", [-1, 3, -(2 ** 62), 2 ** 40])
def test_unchecked_out_of_range_ids_are_inert_rows_in_the_triton_kernels(bad):
    """check_values=False (what CUDA-graph capture implies): an id outside [0, R) reaches the kernels, which neither
    read nor write the state there (no out-of-bounds access) and return the row of a FINISHED slot. Bit for bit,
    the batch steps as the same batch with a free slot in that row; against the batch without the row, every
    integer field is equal and the soft embedding (a float GEMM whose summation order may depend on the number of
    rows: numpy's BLAS in the Triton interpreter, e.g. on an AVX2-only CPU) agrees to float32 rounding."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, CL, V, generator=g) * 3
    E = torch.randn(V, H, generator=g)
    pd = torch.ones(3, dtype=torch.bool)
    a, b, c = denoising_state(), denoising_state(), denoising_state()
    oa = sampler_step(a, torch.tensor([0, bad, 2]), x, pd, E, backend="triton", check_values=False)
    ob = sampler_step(b, torch.tensor([0, 2]), x[[0, 2]], pd[:2], E, backend="triton")
    oc = sampler_step(c, torch.tensor([0, 1, 2]), x, pd, E, backend="triton")  # slot 1 is free: steps nothing
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(c, f)), f
        if f != "soft":
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.soft, b.soft, rtol=1e-6, atol=1e-6)
    for f in ("accepted", "argmax", "sampled", "next_canvas", "entropy"):
        assert torch.equal(getattr(oa, f)[[0, 2]], getattr(oc, f)[[0, 2]]), f
    assert oa.num_rejected.tolist() == [CL, 0, CL] and oa.num_sampled[1].item() == 0
    assert oa.num_emitted_now[1].item() == 0 and not oa.finished[1] and not oa.failed[1]
    assert (oa.emitted[1] == -1).all() and (oa.argmax[1] == -1).all() and not oa.accepted[1].any()
    assert oa.temperature[1].item() == 0.0 and oa.entropy[1].eq(0).all()
    for f in ("accepted", "argmax", "sampled", "next_canvas", "entropy"):
        assert torch.equal(getattr(oa, f)[[0, 2]], getattr(ob, f)), f
    assert a.phase[1].item() == FINISHED


@pytest.mark.gpu
def test_cuda_graph_captured_step_with_an_id_out_of_range_reads_nothing_outside_the_state():
    """Under capture the host check is off (no sync): a slots tensor holding an id >= R at replay makes that row
    inert, the others step as in eager mode."""
    dev = "cuda"
    st = SamplerState(R, CL, V, H, device=dev)
    ref = SamplerState(R, CL, V, H, device=dev)
    for s in (st, ref):
        s.add_request(0, 10, SamplingParams(canvas_length=CL, seed=1))
        sampler_step(s, torch.tensor([0], device=dev), torch.zeros(1, CL, V, device=dev),
                     torch.ones(1, dtype=torch.bool, device=dev), torch.zeros(V, H, device=dev), backend="triton")
    x = torch.randn(2, CL, V, device=dev)
    E = torch.randn(V, H, device=dev)
    pd = torch.ones(2, dtype=torch.bool, device=dev)
    slots = torch.tensor([0, 1], device=dev)
    sampler_step(ref, torch.tensor([0], device=dev), x[:1], pd[:1], E, backend="triton")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm-up (compiles) on a copy of the state
        warm = SamplerState(R, CL, V, H, device=dev)
        sampler_step(warm, slots, x, pd, E, backend="triton")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampler_step(st, slots, x, pd, E, backend="triton")
    slots.copy_(torch.tensor([0, 10 ** 6], device=dev))
    graph.replay()
    torch.cuda.synchronize()
    assert out.num_rejected[1].item() == 0
    for f in FIELDS[:-1]:
        assert torch.equal(getattr(st, f)[0], getattr(ref, f)[0]), f
    torch.testing.assert_close(st.soft[0], ref.soft[0], rtol=1e-3, atol=1e-3)   # cuBLAS may tile M = 1 / 2 apart
    assert (st.soft[1:] == 0).all()


@pytest.mark.parametrize("which", ["slots", "logits", "prefill_done", "embedding"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sparse_step_arguments_are_a_type_error_naming_them(which, backend):
    """Were torch's NotImplementedError ("Could not run 'aten::amax' with arguments from the 'SparseCPU' backend") or
    RuntimeError ("unsupported memory format option") from inside the step; now check_step_args refuses a tensor that
    is not dense (strided), before the state is touched."""
    from blockdiff.sampler import SamplerState, SamplingParams, sampler_step
    st = SamplerState(2, 4, 30, 8)
    st.add_request(0, 3, SamplingParams(canvas_length=4))
    args = dict(slots=torch.tensor([0]), logits=torch.zeros(1, 4, 30), prefill_done=torch.tensor([True]),
                embedding=torch.zeros(30, 8))
    args[which] = args[which].to_sparse()
    before = st.phase.clone()
    with pytest.raises(TypeError, match=f"{which} must be a dense"):
        sampler_step(st, args["slots"], args["logits"], args["prefill_done"], args["embedding"], backend=backend)
    assert torch.equal(st.phase, before)
