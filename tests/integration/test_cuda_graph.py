"""A denoising step (prepare_inputs -> prepare_attn -> model forward -> sampler step) read entirely from
persistent buffers: captured in a CUDA graph and replayed on the GPU; the same replay protocol runs eagerly on
the CPU in CI (no graph) so the test logic itself is exercised everywhere."""
from __future__ import annotations

import pytest
import torch
from integration_helpers import needs_stack

from blockdiff.integration.harness import HarnessRunner
from blockdiff.model import DiffusionGemma, tiny_config
from blockdiff.sampler import DENOISE, SamplingParams, sampler_step

pytestmark = needs_stack


def _build(device, attn_backend, sampler_backend, dtype, moe_impl, canvas_length):
    torch.manual_seed(0)
    model = DiffusionGemma(tiny_config(canvas_length=canvas_length), device=device, dtype=dtype,
                           moe_impl=moe_impl).eval()
    p = SamplingParams(canvas_length=canvas_length, max_denoising_steps=48, seed=5)
    r = HarnessRunner(model, default_params=p, max_num_reqs=4, max_num_batched_tokens=4 * canvas_length,
                      page_size=16, max_model_len=256, device=device, attn_backend=attn_backend,
                      sampler_backend=sampler_backend)
    g = torch.Generator().manual_seed(3)
    for rid, n in (("a", 20), ("b", 9)):
        r.add_request(rid, torch.randint(3, 256, (n,), generator=g).tolist(), p)
    # run until both requests are denoising with a non-zero self-conditioning input (step >= 1)
    for _ in range(10):
        r.step()
        st = r.model_state.state
        slots = [r.slot_of(x) for x in ("a", "b")]
        if all(st.phase[s].item() == DENOISE and st.step[s].item() >= 1 for s in slots):
            break
    else:
        raise AssertionError("requests did not reach a denoise step >= 1")
    return r


def _replay_protocol(device, *, use_graph, attn_backend, sampler_backend, dtype, moe_impl, canvas_length=16):
    r = _build(device, attn_backend, sampler_backend, dtype, moe_impl, canvas_length)
    ms, model = r.model_state, r.model
    st = ms.state
    batch = r.schedule_batch()
    assert batch is not None and batch.num_reqs == 2 and batch.num_draft_tokens == 2 * canvas_length
    N, CL, V = batch.num_reqs, canvas_length, ms.vocab_size
    slots = batch.idx_mapping
    prefill_done = torch.zeros(N, dtype=torch.bool, device=device)
    gather = (batch.query_start_loc[:N].to(torch.int64)[:, None]
              + torch.arange(CL, device=device)[None, :]).reshape(-1)
    E = model.embedding_weight
    persistent = {k: v for k, v in vars(st).items() if torch.is_tensor(v)}
    caches = [t for pair in r.kv_caches for t in pair]

    def step_fn():
        inputs = ms.prepare_inputs(batch, None)
        meta = ms.prepare_attn(batch, None, (batch.block_table,), batch.slot_mapping, None, None)
        logits = model(inputs["input_ids"], inputs["positions"], meta, r.kv_caches, inputs["self_cond"],
                       attn_backend=attn_backend)
        return sampler_step(st, slots, logits[gather].view(N, CL, V), prefill_done, E, backend=sampler_backend)

    def snapshot():
        return {k: v.clone() for k, v in persistent.items()}, [c.clone() for c in caches]

    def restore(snap):
        for k, v in snap[0].items():
            persistent[k].copy_(v)  # in place: a captured graph holds these addresses
        for c, v in zip(caches, snap[1]):
            c.copy_(v)

    def outputs(out):
        return {k: getattr(out, k).clone() for k in ("argmax", "sampled", "accepted", "converged", "num_rejected",
                                                        "entropy", "mean_entropy")}

    s0 = snapshot()
    with torch.inference_mode():
        # eager: two consecutive denoise steps from s0
        e1 = outputs(step_fn())
        s1 = snapshot()
        e2 = outputs(step_fn())
        s2 = snapshot()
        restore(s0)
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compile kernels, allocate workspaces
                for _ in range(2):
                    step_fn()
                    restore(s0)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = step_fn()
            restore(s0)
            replay = lambda: (graph.replay(), static_out)[1]  # noqa: E731
        else:
            replay = step_fn
        g1 = outputs(replay())
        got1 = snapshot()
        g2 = outputs(replay())  # the second replay starts from the state the first one left
        got2 = snapshot()
    if use_graph:
        torch.cuda.synchronize()

    def same(a, b, what):
        for k in a:
            x, y = a[k], b[k]
            if x.is_floating_point():
                assert torch.allclose(x, y, atol=1e-5, rtol=1e-5, equal_nan=True), f"{what}: {k}"
            else:
                assert torch.equal(x, y), f"{what}: {k}"

    same(e1, g1, "step 1 outputs")
    same(e2, g2, "step 2 outputs")
    for (want, got, what) in ((s1, got1, "after step 1"), (s2, got2, "after step 2")):
        same(want[0], got[0], f"sampler state {what}")
        for i, (x, y) in enumerate(zip(want[1], got[1])):
            assert torch.allclose(x.float(), y.float(), atol=1e-2), f"kv cache {i} {what}"
    # the step really moved the state: canvases renoised, step counters advanced
    assert not torch.equal(s0[0]["canvas"], s1[0]["canvas"])
    assert torch.equal(s1[0]["step"][slots], s0[0]["step"][slots] + 1)


def test_denoise_step_replays_from_persistent_buffers_cpu():
    _replay_protocol("cpu", use_graph=False, attn_backend="reference", sampler_backend="reference",
                     dtype=torch.float32, moe_impl="grouped_mm", canvas_length=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_denoise_step_cuda_graph_capture_and_replay():
    _replay_protocol("cuda", use_graph=True, attn_backend="triton", sampler_backend="triton",
                     dtype=torch.bfloat16, moe_impl="grouped_mm")
