"""The Triton sampler backend end to end (blockdiff.sampler.triton, ``sampler_step``) vs the dense reference
(CPU: Triton interpreter on small shapes; GPU: @pytest.mark.gpu), and the offline sm_90a compile of every streaming
kernel of the backend.

Decisions (accepted positions, sampled / argmax / renoised ids, convergence, failure, committed canvases and every
state tensor) must be EXACTLY equal; entropies within float32 rounding; the soft embedding's error against a
float64 ground truth at most 2x the eager same-precision error plus a representation tolerance.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from blockdiff.sampler import FAILED, SamplingParams, sampler_step
from blockdiff.sampler.triton import SamplerConfig
from blockdiff.sampler.triton import sampler_step as triton_sampler_step
from triton_sampler_helpers import DECISIONS, DEV, STATE_FIELDS, big_case, check_same, mk_state, soft_truth


def test_full_steps_match_reference_exactly():
    """T > 0 and T = 0 rows, prefill, NaN -> FAILED, convergence, commit with EOS / max_tokens, fresh canvases."""
    CL, V, H = 16, 100, 32
    def specs():
        return [(3, 11, SamplingParams(canvas_length=CL, seed=1, max_denoising_steps=4, eos_token_ids=(3,))),
                (0, 12, SamplingParams(canvas_length=CL, seed=2, t_min=0.0, t_max=0.0, max_denoising_steps=5,
                                       max_tokens=40)),
                (1, 13, SamplingParams(canvas_length=CL, seed=3, max_denoising_steps=3, entropy_bound=1.0)),
                (5, 14, SamplingParams(canvas_length=CL, seed=4, max_denoising_steps=6, t_min=0.1, t_max=2.0))]
    a, b = mk_state(specs(), CL, V, H), mk_state(specs(), CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.tensor([3, 0, 1, 5], device=DEV)
    g = torch.Generator().manual_seed(0)
    seen_phases = set()
    for it in range(9):
        x = (torch.randn(4, CL, V, generator=g) * 3).to(DEV)
        x[1, :, 7] += 20.0 * (it > 3)  # greedy row becomes stable -> converges before its cap
        if it == 4:
            x[3, 2, 9] = float("nan")
        pd = torch.tensor([True, True, it > 0, True], device=DEV)
        seen_phases.update(a.phase[slots].tolist())
        oa = sampler_step(a, slots, x, pd, E, backend="reference")
        ob = sampler_step(b, slots, x, pd, E, backend="triton")
        check_same(oa, ob, a, b, soft_tol=0.1)
        if it == 4:
            assert ob.failed.tolist() == [False, False, False, True]
    assert b.phase[5].item() == FAILED
    assert seen_phases >= {0, 1, 2}


def test_overflowing_z_matches_reference_masked_min_finite_plus_inf_shifted():
    """z = x / T overflowing: finfo.min logits (-inf z, p = 0) keep entropies finite and decisions equal to the
    reference; a position whose max z is +inf takes rule 1's shifted form in both backends (it failed the row
    before)."""
    CL, V, H = 8, 64, 16
    def specs():
        return [(0, 21, SamplingParams(canvas_length=CL, seed=5)),
                (2, 22, SamplingParams(canvas_length=CL, seed=6)),
                (3, 23, SamplingParams(canvas_length=CL, seed=7, t_min=0.0, t_max=0.0))]
    a, b = mk_state(specs(), CL, V, H), mk_state(specs(), CL, V, H)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.tensor([0, 2, 3], device=DEV)
    g = torch.Generator().manual_seed(3)
    pd = torch.ones(3, dtype=torch.bool, device=DEV)
    for it in range(3):
        x = (torch.randn(3, CL, V, generator=g) * 3)
        x[:, :, 10:13] = torch.finfo(torch.float32).min
        if it == 1:
            x[1, 4, 40] = 3e38
        x = x.to(DEV)
        oa = sampler_step(a, slots, x, pd, E, backend="reference")
        ob = sampler_step(b, slots, x, pd, E, backend="triton")
        check_same(oa, ob, a, b, soft_tol=0.1)
        if it >= 1:
            assert torch.isfinite(ob.entropy[0]).all() and torch.isfinite(ob.entropy[2]).all()
    assert oa.failed.tolist() == [False, False, False] and a.phase[2].item() != FAILED
    assert torch.isfinite(b.soft).all()


def test_soft_state_close_to_truth_after_a_step():
    CL, V, H = 8, 64, 32
    st = mk_state([(0, 1, SamplingParams(canvas_length=CL))], CL, V, H)
    E = torch.randn(V, H, device=DEV)
    slots = torch.tensor([0], device=DEV)
    sampler_step(st, slots, torch.zeros(1, CL, V, device=DEV), torch.ones(1, dtype=torch.bool, device=DEV), E,
                 backend="triton")
    x = torch.randn(1, CL, V, device=DEV)
    sampler_step(st, slots, x, torch.ones(1, dtype=torch.bool, device=DEV), E, backend="triton")
    truth = soft_truth(x.cpu(), torch.tensor([0.8]), E.cpu())
    assert torch.allclose(st.soft[0].cpu().double(), truth[0], atol=1e-4)


@pytest.mark.parametrize("config,steps", [(None, 5), (SamplerConfig(soft_impl="chunked", soft_chunk=24), 3)],
                         ids=["default", "chunked"])
def test_triton_batch_invariance(config, steps):
    """A request's decisions, state and soft embedding do not depend on its slot or on the other rows of the batch
    (the default path and the chunked soft embedding)."""
    CL, V, H = 8, 50, 16
    pa = SamplingParams(canvas_length=CL, seed=9, max_denoising_steps=3)
    a = mk_state([(0, 777, pa)], CL, V, H)
    b = mk_state([(2, 1, SamplingParams(canvas_length=CL, seed=1)), (4, 777, pa),
                  (0, 3, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0))], CL, V, H)
    g = torch.Generator().manual_seed(5)  # every input from it: the test does not depend on what ran before it
    E = torch.randn(V, H, generator=g).bfloat16().to(DEV)
    sa, sb = torch.tensor([0], device=DEV), torch.tensor([2, 4, 0], device=DEV)
    for it in range(steps):
        x = (torch.randn(3, CL, V, generator=g) * 2).to(DEV)
        oa = triton_sampler_step(a, sa, x[1:2], torch.ones(1, dtype=torch.bool, device=DEV), E, config=config)
        ob = triton_sampler_step(b, sb, x, torch.ones(3, dtype=torch.bool, device=DEV), E, config=config)
        for f in DECISIONS + ("entropy", "mean_entropy"):
            assert torch.equal(getattr(oa, f)[0], getattr(ob, f)[1]), f
        for f in STATE_FIELDS:
            assert torch.equal(getattr(a, f)[0], getattr(b, f)[4]), f
        # the soft embedding's fp32 sums may round differently with the batch's other rows (a GEMM's tiling):
        # relative to the value, as tests/sampler/test_slot_ids.py compares them
        assert torch.allclose(a.soft[0], b.soft[4], rtol=1e-6, atol=1e-6)


def test_soft_rows_written_exactly_where_due_poisoned_state():
    """state.soft NaN-poisoned before the step: continuing (T > 0 and T = 0) rows and fresh canvases are fully
    written (and equal the reference); rows that converged, failed or are untouched keep their poison."""
    CL, V, H = 8, 64, 16
    def specs():
        return [(0, 1, SamplingParams(canvas_length=CL, seed=1)),                       # continuing, T > 0
                (1, 2, SamplingParams(canvas_length=CL, t_min=0.0, t_max=0.0)),         # continuing, T = 0
                (2, 3, SamplingParams(canvas_length=CL, max_denoising_steps=1)),        # converges (cap)
                (3, 4, SamplingParams(canvas_length=CL)),                               # fails (NaN)
                (4, 5, SamplingParams(canvas_length=CL))]                               # prefill -> fresh
    a, b = mk_state(specs(), CL, V, H, R=6), mk_state(specs(), CL, V, H, R=6)
    E = torch.randn(V, H, device=DEV).bfloat16()
    slots = torch.arange(5, device=DEV)
    pd = torch.tensor([True, True, True, True, False], device=DEV)
    for st in (a, b):
        sampler_step(st, slots, torch.zeros(5, CL, V, device=DEV), pd, E, backend="reference")
    x = torch.randn(5, CL, V, device=DEV)
    x[3, 0, 0] = float("nan")
    pd = torch.ones(5, dtype=torch.bool, device=DEV)
    for st in (a, b):
        st.soft.fill_(float("nan"))
    oa = sampler_step(a, slots, x, pd, E, backend="reference")
    ob = sampler_step(b, slots, x, pd, E, backend="triton")
    assert ob.converged.tolist() == [False, False, True, False, False] and ob.failed[3].item()
    for s in (0, 1, 4):
        assert torch.isfinite(b.soft[s]).all(), s
    assert (b.soft[4] == 0).all()
    assert torch.equal(b.soft[1], a.soft[1])  # T = 0: E[argmax] * sqrt(hidden), exact
    assert torch.allclose(b.soft[0], a.soft[0], atol=0.05)
    for s in (2, 3, 5):
        assert torch.isnan(b.soft[s]).all(), s


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hst.data())
def test_fuzz_random_batches_match_reference(data):
    """Random batch compositions: sizes 1..3 rows, canvas 1..9, vocab 1..70 (not multiples of the tiles),
    random params (greedy, temperatures 1e-30..50, 1e-38 written into the state, bound 0, k 0..2, tiny caps),
    random phases, NaN rows, logits overflowing z = x / T, -inf masks (p = 0; a position all -inf fails), bf16 or
    fp32 logits; soft rows to fp32 rounding with an fp32 embedding."""
    N = data.draw(hst.integers(1, 3))
    CL = data.draw(hst.integers(1, 9))
    V = data.draw(hst.integers(1, 70))
    H = data.draw(hst.sampled_from([16, 24]))
    slots = data.draw(hst.permutations(list(range(N + 1))))[:N]
    specs = []
    for i, slot in enumerate(slots):
        greedy = data.draw(hst.booleans())
        # temperatures from 1e-30 (z = x / T overflows: rule 1's shifted form; cancellation in the soft embedding's
        # exponent was once an inf at 1e-8) to 50
        t_min = 0.0 if greedy else data.draw(hst.sampled_from([0.05, 0.3, 0.77, 1e-30, 1e-8, 1e-6, 1e-4, 5.0, 50.0]))
        t_max = 0.0 if greedy else t_min * data.draw(hst.sampled_from([1.0, 1.5])) + data.draw(hst.floats(0.0, 1.0))
        p = SamplingParams(canvas_length=CL, seed=data.draw(hst.integers(0, 2**63 - 1)), t_min=t_min, t_max=t_max,
                           max_denoising_steps=data.draw(hst.integers(1, 4)),
                           entropy_bound=data.draw(hst.sampled_from([0.0, 0.1, 1.0, 50.0])),
                           confidence_threshold=data.draw(hst.sampled_from([0.0, 0.005, 10.0])),
                           stability_threshold=data.draw(hst.integers(0, 2)),
                           eos_token_ids=tuple(data.draw(hst.lists(hst.integers(0, V - 1), max_size=2))),
                           max_tokens=data.draw(hst.one_of(hst.none(), hst.integers(1, 20))))
        specs.append((slot, data.draw(hst.integers(-2**63, 2**63 - 1)), p))
    a, b = mk_state(specs, CL, V, H, R=N + 1), mk_state(specs, CL, V, H, R=N + 1)
    if data.draw(hst.booleans()) and not specs[0][2].greedy:   # below the params' floor: the kernels still cope
        for st in (a, b):
            st.t_min[specs[0][0]] = st.t_max[specs[0][0]] = 1e-38
    edtype = data.draw(hst.sampled_from([torch.float32, torch.bfloat16]))
    E = torch.randn(V, H, device=DEV).to(edtype)
    dtype = data.draw(hst.sampled_from([torch.float32, torch.bfloat16]))
    sl = torch.tensor(slots, device=DEV, dtype=torch.int64)
    g = torch.Generator().manual_seed(data.draw(hst.integers(0, 1000)))
    for it in range(4):
        x = (torch.randn(N, CL, V, generator=g) * data.draw(hst.sampled_from([0.5, 3.0, 30.0]))).to(dtype)
        if data.draw(hst.booleans()) and it == 2:
            x[data.draw(hst.integers(0, N - 1)), data.draw(hst.integers(0, CL - 1)), 0] = float("nan")
        if data.draw(hst.booleans()):   # finite logits whose z = x / T overflows (rule 1's shifted form)
            x[data.draw(hst.integers(0, N - 1)), data.draw(hst.integers(0, CL - 1)),
              data.draw(hst.integers(0, V - 1))] = data.draw(hst.sampled_from([3e38, -3.3e38]))
        if data.draw(hst.booleans()):   # -inf masks (p = 0), on one position or a whole row; all -inf: fails
            mask = torch.rand(V, generator=g) < data.draw(hst.sampled_from([0.3, 0.5, 0.9, 1.0]))
            n_ = data.draw(hst.integers(0, N - 1))
            if data.draw(hst.booleans()):
                x[n_, :, mask] = float("-inf")
            else:
                x[n_, data.draw(hst.integers(0, CL - 1)), mask] = float("-inf")
        pd = torch.tensor([data.draw(hst.booleans()) or it > 0 for _ in range(N)], device=DEV)
        x = x.to(DEV)
        oa = sampler_step(a, sl, x, pd, E, backend="reference")
        ob = sampler_step(b, sl, x, pd, E, backend="triton")
        # fp32 E: exact fp32 products, so the soft rows agree to fp32 rounding; bf16 E: p is rounded to bf16
        rel = 1e-4 if edtype == torch.float32 else 0.05
        check_same(oa, ob, a, b, soft_tol=rel * max(1.0, a.soft[torch.isfinite(a.soft)].abs().max().item()
                                                      if torch.isfinite(a.soft).any() else 1.0))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_large_shape_matches_reference():
    torch.manual_seed(0)
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, specs = big_case(N, CL, V, H)
    a, b = mk_state(specs, CL, V, H, R=N), mk_state(specs, CL, V, H, R=N)
    slots = torch.arange(N, device="cuda")
    pd = torch.ones(N, dtype=torch.bool, device="cuda")
    for st, be in ((a, "reference"), (b, "triton")):
        sampler_step(st, slots, x, pd, E, backend=be)
    oa = sampler_step(a, slots, x, pd, E, backend="reference")
    ob = sampler_step(b, slots, x, pd, E, backend="triton")
    torch.cuda.synchronize()
    check_same(oa, ob, a, b, soft_tol=0.05 * a.soft.abs().max().item())


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager_and_memory_is_small():
    N, CL, V, H = 4, 256, 262144, 2816
    x, E, specs = big_case(N, CL, V, H, seed=1)
    a, b = mk_state(specs, CL, V, H, R=N), mk_state(specs, CL, V, H, R=N)
    slots = torch.arange(N, device="cuda")
    pd = torch.ones(N, dtype=torch.bool, device="cuda")
    for st in (a, b):
        sampler_step(st, slots, x, pd, E, backend="triton")  # prefill -> denoise, compiles the kernels
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    oa = sampler_step(a, slots, x, pd, E, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 64 * 2**20, f"extra memory {extra / 2**20:.1f} MiB"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            ob = sampler_step(b, slots, x, pd, E, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    for f in DECISIONS:
        assert torch.equal(getattr(oa, f), getattr(ob, f)), f
    for f in STATE_FIELDS + ("soft",):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


# ---------------------------------------------------------------------------------------------- offline sm_90a compile
_COMPILE_STREAMING_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.sampler.triton import soft_embedding, stats, step


def build(fn, sig, consts, **opts):
    sig = dict(sig)
    sig.update({k: "constexpr" for k in consts})
    assert list(sig) == list(fn.arg_names), ("test signature out of date with the kernel", fn.arg_names)
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert "ptx" in k.asm and len(k.asm["ptx"]) > 1000, fn.__name__
    return k


V = 262144
build(stats._stats_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "seed_ptr": "*i64",
       "rid_ptr": "*i64", "cidx_ptr": "*i64", "step_ptr": "*i64", "active_ptr": "*i32", "stats_f_ptr": "*fp32",
       "stats_i_ptr": "*i32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(CHUNK=V, SPLIT_V=1, BLOCK_P=1, BLOCK_G=256, LOAD_STAGES=3, MASKED=False, FAST_LOG=1),
      num_warps=4, num_stages=3)
build(stats._stats_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "seed_ptr": "*i64",
       "rid_ptr": "*i64", "cidx_ptr": "*i64", "step_ptr": "*i64", "active_ptr": "*i32", "stats_f_ptr": "*fp32",
       "stats_i_ptr": "*i32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(CHUNK=33792, SPLIT_V=3, BLOCK_P=1, BLOCK_G=256, LOAD_STAGES=3, MASKED=True, FAST_LOG=1),
      num_warps=4, num_stages=3)
build(soft_embedding._prob_chunk_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "p_ptr": "*bf16", "t_ptr": "*fp32",
       "active_ptr": "*i32", "m_ptr": "*fp32", "inv_s_ptr": "*fp32", "shift_ptr": "*fp32", "amax_ptr": "*i32",
       "M": "i32", "CL": "i32", "V": "i32", "v0": "i32", "VC": "i32"},
      dict(GREEDY_ONEHOT=False, ROUND_TO=None, BLOCK_R=4, BLOCK_V=1024), num_warps=4)
build(stats._moments_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "t_ptr": "*fp32", "active_ptr": "*i32",
       "m_ptr": "*fp32", "inv_s_ptr": "*fp32", "shift_ptr": "*fp32", "R": "i32", "CL": "i32", "V": "i32"},
      dict(NUM_TILES=V // 2048, BLOCK_V=2048), num_warps=4)
merge_sig = {"stats_f_ptr": "*fp32", "stats_i_ptr": "*i32", "t_ptr": "*fp32", "active_ptr": "*i32", "x_ptr": "*fp32",
             "stride_xn": "i64", "stride_xp": "i64", "seed_ptr": "*i64", "rid_ptr": "*i64", "cidx_ptr": "*i32",
             "step_ptr": "*i32", "m_ptr": "*fp32", "inv_s_ptr": "*fp32", "h_ptr": "*fp32", "hstep_ptr": "*fp32",
             "amax_ptr": "*i64", "gamax_ptr": "*i64", "sampled_ptr": "*i64", "bad_ptr": "*u8", "shift_ptr": "*fp32",
             "R": "i32", "CL": "i32", "V": "i32"}
for split_v in (1, 3, 8):
    build(stats._stats_merge_kernel, merge_sig,
          dict(SPLIT_V=split_v, BLOCK_S=triton.next_power_of_2(split_v), BLOCK_R=128, TIE_TILES=V // 1024,
               TIE_BLOCK=1024), num_warps=4)
step_sig = {"slots_ptr": "*i64", "pd_ptr": "*u8", "t_ptr": "*fp32", "h_ptr": "*fp32", "amax_ptr": "*i64",
            "sampled_ptr": "*i64", "sorted_h_ptr": "*fp32", "order_ptr": "*i64", "cum_ptr": "*fp32",
            "phase_ptr": "*i32", "canvas_ptr": "*i64", "commit_ptr": "*i64", "prev_ptr": "*i64", "stable_ptr": "*i32",
            "step_ptr": "*i32", "cidx_ptr": "*i32", "nemit_ptr": "*i64", "seed_ptr": "*i64", "rid_ptr": "*i64",
            "bound_ptr": "*fp32", "conf_ptr": "*fp32", "max_steps_ptr": "*i32", "k_ptr": "*i32", "eos_ptr": "*i64",
            "stride_eos": "i32", "max_tok_ptr": "*i64", "o_emitted": "*i64", "o_argmax": "*i64", "o_sampled": "*i64",
            "o_next": "*i64", "o_accepted": "*u8", "o_entropy": "*fp32", "o_num_sampled": "*i32",
            "o_num_rejected": "*i32", "o_num_now": "*i32", "o_finished": "*u8", "o_failed": "*u8",
            "o_converged": "*u8", "o_mean": "*fp32", "o_temp": "*fp32", "o_cont": "*i32", "o_mode": "*i32",
            "CL": "i32", "CLF": "fp32", "V": "i32", "E": "i32", "NUM_SLOTS": "i32"}
build(step._step_kernel, step_sig, dict(BLOCK=256, BLOCK_E=8, EOS_TILES=1), num_warps=4)
build(step._gather_rows_kernel,
      {"slots_ptr": "*i64", "phase_ptr": "*i32", "seed_ptr": "*i64", "rid_ptr": "*i64", "cidx_ptr": "*i32",
       "step_ptr": "*i32", "o_active": "*i32", "o_seed": "*i64", "o_rid": "*i64", "o_cidx": "*i32", "o_step": "*i32",
       "N": "i32", "NUM_SLOTS": "i32"}, dict(BLOCK=4), num_warps=1)
# CL = V = E = stride = NUM_SLOTS = 1: Triton specialises int arguments equal to 1 into constants (the kernel must
# compile so)
build(step._step_kernel, step_sig, dict(stride_eos=1, CL=1, V=1, E=1, NUM_SLOTS=1, BLOCK=1, BLOCK_E=1, EOS_TILES=1),
      num_warps=1)
# (appended after the kernels above, whose PTX snapshots are numbered in this order)
build(soft_embedding._soft_reduce_kernel,
      {"ws_ptr": "*fp32", "soft_ptr": "*fp32", "slots_ptr": "*i64", "mode_ptr": "*i32", "amax_ptr": "*i64",
       "e_ptr": "*bf16", "stride_ev": "i32", "stride_eh": "i32", "M": "i32", "CL": "i32", "HID": "i32",
       "SCALE": "fp32", "NUM_SLOTS": "i32"}, dict(SPLIT_K=3, BLOCK_H=1024), num_warps=4)
from blockdiff.sampler.tp import triton as tp_triton
build(tp_triton._shard_ties_kernel,
      {"x_ptr": "*fp32", "stride_xn": "i64", "stride_xp": "i64", "flag_ptr": "*i32", "seed_ptr": "*i64",
       "rid_ptr": "*i64", "cidx_ptr": "*i32", "step_ptr": "*i32", "out_f_ptr": "*fp32", "out_i_ptr": "*i32",
       "CL": "i32", "VS": "i32", "VE": "i32"}, dict(NUM_TILES=V // 2 // 1024, BLOCK=1024), num_warps=4)
# a wide eos list read in tiles (step._eos_block: 8,192 stop-id columns at canvas 256)
build(step._step_kernel, step_sig, dict(BLOCK=256, BLOCK_E=64, EOS_TILES=128), num_warps=4)
print("COMPILED")
"""


def test_streaming_sampler_kernels_compile_for_sm90a_on_the_cpu():
    """The stats kernel (with its greedy branch), its row gather and split merge (with the overflow fallback), the
    step kernel (also with the arguments Triton specialises to constants), the chunked soft embedding's P kernel,
    row_moments' kernel, the soft reduce kernel and the TP shard's overflow kernel compile to PTX for sm_90a with
    the H200 launch parameters (no GPU needed; a subprocess without TRITON_INTERPRET): code the interpreter runs but
    the GPU compiler might reject is caught in CI."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_STREAMING_SM90], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "COMPILED" in r.stdout, r.stderr[-3000:]
