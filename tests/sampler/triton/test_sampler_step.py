"""The Triton backend's step kernel (``blockdiff.sampler.triton.step._apply_step``: decisions after the stats pass
+ the phase bookkeeping of ``common.apply_step`` in one launch) against the torch code it replaces, on random and
crafted states.

The oracle is the former torch path: ``accept_by_entropy``, ``rng.random_ids(RENOISE)``, ``convergence`` and
``common.apply_step`` (which the reference backend still runs). Every StepOutput field and every state field must be
equal (torch.equal); ``mean_entropy`` too (both take it from the sorted cumsum, ``common.entropy_mean``; the step
entropies here are multiples of 1/8 besides).
"""
import pytest
import torch

from blockdiff.sampler import (COMMIT, DENOISE, FAILED, FINISHED, NO_MAX_TOKENS, PREFILL, SamplerState,
                               SamplingParams, rng, sampler_step)
from blockdiff.sampler.common import DenoiseResult, apply_step, convergence, entropy_decisions, temperature
from blockdiff.sampler.triton.step import _apply_step

STATE_FIELDS = ("phase", "canvas", "commit_canvas", "prev_argmax", "stable_count", "step", "canvas_index",
                "num_emitted", "soft")
OUT_FIELDS = ("num_sampled", "num_rejected", "emitted", "num_emitted_now", "finished", "failed", "accepted", "entropy",
              "argmax", "sampled", "next_canvas", "converged", "mean_entropy", "temperature")


def _torch_step(state, slots, pd, st):
    """The torch path the step kernel implements (between row_stats and apply_step of the reference)."""
    CL, V = state.canvas_length, state.vocab_size
    phase = state.phase[slots].clone()
    seed, rid = state.seed[slots], state.request_id[slots]
    cidx, step = state.canvas_index[slots], state.step[slots]
    T = temperature(state, slots)
    entropy, argmax, sampled = st["step_entropy"], st["argmax"], st["sampled"]
    row_failed = torch.isnan(entropy).any(-1)
    accepted, mean_entropy = entropy_decisions(entropy, state.entropy_bound[slots])
    accepted = accepted & ~row_failed[:, None]
    renoise = rng.random_ids(seed, rid, cidx, step, CL, V, rng.RENOISE)
    next_canvas = torch.where(accepted, sampled, renoise)
    converged, stable_count = convergence(state, slots, argmax, mean_entropy)
    res = DenoiseResult(accepted=accepted, entropy=entropy, argmax=argmax, sampled=sampled, next_canvas=next_canvas,
                        row_failed=row_failed, converged=converged, stable_count=stable_count,
                        mean_entropy=mean_entropy, temperature=T, soft=None)
    return apply_step(state, slots, pd, res, phase)


def _clone(st: SamplerState) -> SamplerState:
    c = SamplerState(st.max_num_reqs, st.canvas_length, st.vocab_size, st.hidden_size, max_eos=st.max_eos)
    for k, v in vars(st).items():
        setattr(c, k, v.clone() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, list) else v))
    return c


def _compare(st_a, st_b, oa, ob):
    for f in OUT_FIELDS:
        a, b = getattr(oa, f), getattr(ob, f)
        assert a.dtype == b.dtype and a.shape == b.shape, (f, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(torch.isnan(a), torch.isnan(b))
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), f
    for f in STATE_FIELDS:
        assert torch.equal(getattr(st_a, f), getattr(st_b, f)), f


def _random_case(seed, R=7, max_eos=3):
    g = torch.Generator().manual_seed(seed)
    CL = [1, 2, 5, 8, 16, 37][seed % 6]
    V = [1, 3, 50, 262144][(seed // 6) % 4]

    def ri(lo, hi, shape=()):
        return torch.randint(lo, hi, shape, generator=g)

    st = SamplerState(R, CL, V, 4, max_eos=max_eos)
    st.phase = ri(0, 5, (R,)).int()
    st.canvas = ri(0, V, (R, CL))
    st.commit_canvas = ri(0, V, (R, CL))
    st.stable_count = ri(0, 3, (R,)).int()
    st.max_denoising_steps = ri(1, 5, (R,)).int()
    st.step = (torch.rand(R, generator=g) * st.max_denoising_steps).int()
    st.canvas_index = torch.where(ri(0, 4, (R,)) == 0, 2**16 - 1, ri(0, 100, (R,))).int()   # counter wrap too
    st.num_emitted = ri(0, 40, (R,))
    st.max_tokens = torch.where(ri(0, 3, (R,)) == 0, NO_MAX_TOKENS, ri(1, 45, (R,)))
    st.request_id = ri(-2**63, 2**63 - 1, (R,))
    st.seed = ri(-2**63, 2**63 - 1, (R,))
    greedy = ri(0, 3, (R,)) == 0
    st.t_min = torch.where(greedy, 0.0, 0.4)
    st.t_max = torch.where(greedy, 0.0, 0.8)
    st.entropy_bound = torch.tensor([0.0, 0.125, 0.25, 1.0, 50.0])[ri(0, 5, (R,))]
    st.confidence_threshold = torch.tensor([0.0, 0.005, 0.125, 10.0])[ri(0, 4, (R,))]
    st.stability_threshold = ri(0, 3, (R,)).int()
    st.eos_token_ids = torch.where(ri(0, 2, (R, max_eos)) == 0, -1, ri(0, V, (R, max_eos)))
    # EOS in commit canvases at the first / last / a random position
    for s in range(R):
        eid = int(st.eos_token_ids[s].max())
        if eid >= 0 and int(ri(0, 2)):
            st.commit_canvas[s, [0, CL - 1, int(ri(0, CL))][int(ri(0, 3))]] = eid

    N = int(ri(1, R + 1))
    slots = torch.randperm(R, generator=g)[:N]
    argmax = ri(0, V, (N, CL))
    # prev_argmax: equal to this step's argmax (stable), -1 (step 0) or different
    kind = ri(0, 3, (N,))
    st.prev_argmax = ri(0, V, (R, CL))
    st.prev_argmax[slots] = torch.where(kind[:, None] == 0, argmax, torch.where(kind[:, None] == 1, -1,
                                                                                st.prev_argmax[slots]))
    T = temperature(st, slots)
    h = ri(0, 6, (N, CL)).float() / 8
    h = torch.where(torch.rand(N, CL, generator=g) < 0.3, 0.0, h)                   # ties
    h = torch.where(T[:, None] == 0, 0.0, h)
    h = torch.where(torch.rand(N, 1, generator=g) < 0.2, h, h.clone())
    nan_row = torch.rand(N, generator=g) < 0.2
    h[nan_row, int(ri(0, CL))] = float("nan")
    sampled = torch.where(T[:, None] == 0, argmax, ri(0, V, (N, CL)))
    pd = torch.rand(N, generator=g) < 0.6
    return st, slots, pd, dict(step_entropy=h, argmax=argmax, sampled=sampled), T


@pytest.mark.parametrize("seed", range(36))
def test_step_kernel_equals_torch_apply_step_on_random_states(seed):
    """Random phases (FINISHED / FAILED rows in slots too), slots a permuted subset, canvases with EOS at 0 / CL - 1,
    max_tokens below / above num_emitted, canvas_index 2**16 - 1, NaN rows, ties and the inclusive bound, greedy
    rows, k 0..2, stable / unstable argmax canvases, padded eos lists; CL 1..37 (not a power of 2), V 1..2**18."""
    st, slots, pd, stats, T = _random_case(seed)
    a, b = _clone(st), _clone(st)
    oa = _torch_step(a, slots, pd, stats)
    ob, cont, mode = _apply_step(b, slots, pd, T, stats)
    _compare(a, b, oa, ob)
    phase0 = st.phase[slots]
    ok = (phase0 == DENOISE) & ~torch.isnan(stats["step_entropy"]).any(-1)
    assert torch.equal(cont.bool(), ok & ~oa.converged)
    fresh = ((phase0 == PREFILL) & pd) | ((phase0 == COMMIT) & ~oa.finished)
    want = torch.where(cont.bool(), torch.where(T == 0, 3, 1), torch.where(fresh, 2, 0)).int()
    assert torch.equal(mode, want)


@pytest.mark.parametrize("seed", [5, 11, 17, 23])
def test_step_kernel_reads_a_wide_eos_list_in_tiles(seed):
    """20,000 eos-id columns (a SamplerState takes max_eos < 2**31; vLLM's stop ids grow it) at canvas 37: the EOS
    compare read them as one [64, 32768] tile, past Triton's 2**20-element limit (the step failed: "numel exceeds
    triton maximum tensor numel"); now in tiles of <= EOS_TILE elements, equal to the torch path, EOS ids in the
    list's tail included."""
    st, slots, pd, stats, T = _wide_eos_case(seed)
    a, b = _clone(st), _clone(st)
    oa = _torch_step(a, slots, pd, stats)
    ob, _, _ = _apply_step(b, slots, pd, T, stats)
    _compare(a, b, oa, ob)


def _wide_eos_case(seed):
    """A random case with 20,000 eos-id columns: each slot's one EOS id only in the list's last column, and in its
    commit canvas (so the EOS compare's last tile decides the cut)."""
    st, slots, pd, stats, T = _random_case(seed, max_eos=20000)
    g = torch.Generator().manual_seed(seed)
    for s in range(st.max_num_reqs):
        eid = int(torch.randint(0, st.vocab_size, (), generator=g))
        st.eos_token_ids[s] = -1
        st.eos_token_ids[s, -1] = eid
        st.commit_canvas[s, st.canvas_length - 1 - s % 2] = eid
    return st, slots, pd, stats, T


def test_eos_tile_keeps_small_eos_lists_in_one_tile():
    from blockdiff.sampler.triton.step import EOS_TILE, _eos_block
    assert _eos_block(256, 8) == 8 and _eos_block(256, 16) == 16 and _eos_block(256, 1) == 1
    assert _eos_block(256, 8192) == EOS_TILE // 256 and _eos_block(65535, 3) == 1


def test_step_kernel_reaches_every_transition():
    """The random cases above cover each transition of the phase machine at least once (guards the generator)."""
    seen = set()
    for seed in range(36):
        st, slots, pd, stats, T = _random_case(seed)
        before = st.phase[slots].clone()
        o, _, _ = _apply_step(st, slots, pd, T, stats)
        after = st.phase[slots]
        seen |= set(zip(before.tolist(), after.tolist()))
        seen |= {("eos_at_0",)} if bool(((o.num_emitted_now == 1) & o.finished).any()) else set()
        seen |= {("cut",)} if bool(((o.num_emitted_now > 0) & (o.num_emitted_now < st.canvas_length)).any()) else set()
    want = {(PREFILL, PREFILL), (PREFILL, DENOISE), (DENOISE, DENOISE), (DENOISE, COMMIT), (DENOISE, FAILED),
            (COMMIT, DENOISE), (COMMIT, FINISHED), (FINISHED, FINISHED), (FAILED, FAILED), ("eos_at_0",), ("cut",)}
    assert want <= seen, want - seen


def _peaked(ids, V, gap=1000.0):
    x = torch.zeros(*ids.shape, V)
    return x.scatter_(-1, ids[..., None], gap)


def test_sampler_steps_commit_trimming_resumed_requests_and_finished_rows_match_reference():
    """End to end (stats + merge + sort + step kernel) against the reference backend over several steps: one-step
    canvases (max_denoising_steps 1) whose argmax canvas has EOS at position 0 / CL - 1 / none, max_tokens cutting
    the second canvas, a resumed request (add_request's num_emitted / canvas_index kept at prefill_done), one resumed
    past its max_tokens, a request still in prefill; slots a permuted subset of the state's, FINISHED rows kept in
    slots after they finish."""
    CL, V, H = 6, 40, 8
    eos = 7

    def specs():
        p = dict(canvas_length=CL, max_denoising_steps=1, eos_token_ids=(eos, 9))
        return [(5, 11, SamplingParams(seed=1, **p), {}),                                   # EOS at 0
                (0, 12, SamplingParams(seed=2, **p), {}),                                   # EOS at CL - 1
                (2, 13, SamplingParams(seed=3, max_tokens=CL + 2, **p), {}),                # cut at max_tokens
                (6, 14, SamplingParams(seed=4, max_tokens=9, **p), dict(num_emitted=7, canvas_index=5)),
                (3, 15, SamplingParams(seed=5, max_tokens=4, **p), dict(num_emitted=3, canvas_index=2)),
                (1, 16, SamplingParams(seed=6, **p), {})]                                   # stays in prefill
    a, b = SamplerState(8, CL, V, H, max_eos=4), SamplerState(8, CL, V, H, max_eos=4)
    for st in (a, b):
        for slot, rid, p, kw in specs():
            st.add_request(slot, rid, p, **kw)
        # past its max_tokens: add_request refuses it (check_resume), so the state is written directly; the
        # kernels must still agree with the reference there (nothing emitted, finished)
        st.num_emitted[3] = 6
    slots = torch.tensor([5, 0, 2, 6, 3, 1])
    E = torch.randn(V, H)
    ids = torch.randint(10, V, (6, CL), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = eos
    ids[1, CL - 1] = 9
    x = _peaked(ids, V)
    x[:, :, 0] = 990.0           # an entropy > 0 (two candidates at 1000 / 990), not peaked to float32 rounding
    pd = torch.tensor([True, True, True, True, True, False])
    phases = []
    for it in range(5):
        oa = sampler_step(a, slots, x, pd, E, backend="reference")
        ob = sampler_step(b, slots, x, pd, E, backend="triton")
        phases.append(a.phase[slots].tolist())
        for f in OUT_FIELDS:
            if f in ("entropy", "mean_entropy"):
                assert torch.allclose(getattr(oa, f), getattr(ob, f), rtol=1e-4, atol=1e-5, equal_nan=True), f
            else:
                assert torch.equal(getattr(oa, f), getattr(ob, f)), (it, f)
        for f in STATE_FIELDS[:-1]:
            assert torch.equal(getattr(a, f), getattr(b, f)), (it, f)
        if it == 2:   # the commit pass
            assert ob.num_emitted_now.tolist() == [1, CL, CL, 2, 0, 0]
            assert ob.finished.tolist() == [True, True, False, True, True, False]
            assert ob.emitted[0].tolist() == [eos] + [-1] * (CL - 1)
    assert phases[0] == [DENOISE] * 5 + [PREFILL]
    assert phases[2] == [FINISHED, FINISHED, DENOISE, FINISHED, FINISHED, PREFILL]
    assert b.canvas_index[[5, 0, 2, 6, 3]].tolist() == [0, 0, 1, 5, 2]
    assert b.num_emitted[2].item() == CL + 2 and b.phase[2].item() == FINISHED       # cut at the second commit


def _specialization(args, skip_ints=()):
    """What Triton keys a compiled variant on, per argument: a tensor's 16-byte alignment, an int's == 1 / % 16
    (bools and floats as themselves are not keyed beyond their type)."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append(("ptr", a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append(("int", None) if i in skip_ints else ("int", a == 1, a % 16 == 0))
        else:
            out.append((type(a).__name__,))
    return tuple(out)


def test_the_step_and_row_gather_kernels_see_one_specialization_for_every_row_count(monkeypatch):
    """7.11: a Triton compile (44 ms warm, ~1 s cold) stalled a serving step at a batch of 3 canvases: the row
    gather's BLOCK followed the row count's power of two, and output views at offsets of k * N elements changed the
    pointers' 16-byte alignment with N mod 16, each a new compiled variant. Now every row count N = 1..18 launches
    both kernels with the same constexprs and the same alignment / int classes (N itself is not specialized)."""
    import blockdiff.sampler.triton.step as step_mod

    seen = {"gather": set(), "step": set()}

    class Recorder:
        def __init__(self, name, real, skip_ints=()):
            self.name, self.real, self.skip = name, real, skip_ints

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen[self.name].add((_specialization(args, self.skip), tuple(sorted(kw.items()))))
                return self.real[grid](*args, **kw)
            return launch

    gather_n = 11  # the position of N among _gather_rows_kernel's arguments (do_not_specialize)
    monkeypatch.setattr(step_mod, "_gather_rows_kernel", Recorder("gather", step_mod._gather_rows_kernel, (gather_n,)))
    monkeypatch.setattr(step_mod, "_step_kernel", Recorder("step", step_mod._step_kernel))
    R, CL, V = 18, 4, 50  # N = 1..18: every residue of N mod 16, and past 16
    st = SamplerState(R, CL, V, 4)
    for s in range(R):
        st.add_request(s, 1000 + s, SamplingParams(canvas_length=CL, seed=s, max_denoising_steps=4))
    st.phase[:] = DENOISE
    g = torch.Generator().manual_seed(0)
    for N in range(1, R + 1):
        slots = torch.randperm(R, generator=g)[:N]
        stats = dict(step_entropy=torch.zeros(N, CL), argmax=torch.randint(0, V, (N, CL), generator=g),
                     sampled=torch.randint(0, V, (N, CL), generator=g))
        step_mod._gather_rows(st, slots)
        _apply_step(_clone(st), slots, torch.ones(N, dtype=torch.bool), temperature(st, slots), stats)
    assert len(seen["gather"]) == 1 and len(seen["step"]) == 1, {k: len(v) for k, v in seen.items()}
    import inspect
    src = inspect.getsource(step_mod)
    assert '@triton.jit(do_not_specialize=["N"])\ndef _gather_rows_kernel(' in src  # the interpreter drops the flag


def _on(st: SamplerState, device) -> SamplerState:
    """A copy of ``st`` with every tensor on ``device``."""
    c = _clone(st)
    for k, v in vars(c).items():
        if isinstance(v, torch.Tensor):
            setattr(c, k, v.to(device))
    c.device = torch.device(device)
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(36))
def test_gpu_compiled_step_kernel_equals_torch_apply_step_on_random_states(seed):
    """The compiled step kernel on CUDA (the CPU suite runs it through the interpreter only) against the torch path on
    the CPU, on the same random states as the CPU test: every output and state field equal."""
    st, slots, pd, stats, T = _random_case(seed)
    oa, cont, mode = _compiled_equals_torch(st, slots, pd, stats, T)
    phase0 = st.phase[slots]
    ok = (phase0 == DENOISE) & ~torch.isnan(stats["step_entropy"]).any(-1)
    assert torch.equal(cont.bool().cpu(), ok & ~oa.converged)
    fresh = ((phase0 == PREFILL) & pd) | ((phase0 == COMMIT) & ~oa.finished)
    want = torch.where(cont.bool().cpu(), torch.where(T == 0, 3, 1), torch.where(fresh, 2, 0)).int()
    assert torch.equal(mode.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [5, 11])
def test_gpu_compiled_step_kernel_reads_a_wide_eos_list_in_tiles(seed):
    """The tiled EOS compare compiled on CUDA (several tiles: 20,000 eos-id columns at canvas 37), against the torch
    path on the CPU: every output and state field equal, an EOS id only in the list's last column found."""
    _compiled_equals_torch(*_wide_eos_case(seed))


def _compiled_equals_torch(st, slots, pd, stats, T):
    """The step on a CUDA copy of ``st`` (compiled kernel) against the torch path on a CPU copy: every output and
    state field equal. Returns the torch path's output and the kernel's ``cont`` / ``mode`` (on the GPU)."""
    import dataclasses

    a = _clone(st)
    oa = _torch_step(a, slots, pd, stats)
    b = _on(st, "cuda")
    ob, cont, mode = _apply_step(b, slots.cuda(), pd.cuda(), T.cuda(), {k: v.cuda() for k, v in stats.items()})
    ob = dataclasses.replace(ob, **{f.name: getattr(ob, f.name).cpu() for f in dataclasses.fields(ob)
                                    if isinstance(getattr(ob, f.name), torch.Tensor)})
    _compare(a, _on(b, "cpu"), oa, ob)
    return oa, cont, mode
