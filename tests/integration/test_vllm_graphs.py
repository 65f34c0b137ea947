"""Uniform-decode FULL CUDA graphs at both canvas widths under vLLM 0.26 (integration/vllm_graphs.py; docs/tuning.md
7.37 (a) and "Fix 1").

A real ``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager`` is built by its own ``__init__`` with stub configs
as the H200 run of 7.35 had them (capture sizes 256..16384, FULL_AND_PIECEWISE, 64 requests, decode_query_len 512 =
the diffusion config's canvas_length, a 256-token checkpoint); only the pipeline-parallel group and the graph pool
(which need a device) are stood in. Nothing is captured: ``dispatch`` reads the candidate lists after
``_graphs_captured`` is set. The tests that build a manager need vLLM 0.26 (``source
tests/integration/vllm_cpu_env.sh 0.26.0``); the rest need any vLLM, and all skip without one.
"""
from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace as NS

import pytest
from integration_helpers import captured_log

from blockdiff.integration import vllm_compat
from blockdiff.integration import vllm_graphs as VG

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (tests/integration/vllm_cpu_env.sh)")

CL = 256
#: vLLM's default capture sizes for --max-num-batched-tokens 16384 as the run logged them (32 sizes)
CAPTURE_SIZES = (list(range(256, 4096 + 1, 256)) + list(range(4608, 8192 + 1, 512))
                 + list(range(9216, 16384 + 1, 1024)))
MAX_REQS = 64


def _is_026():
    return HAVE_VLLM and vllm_compat.current().version == "0.26.0"


needs_026 = pytest.mark.skipif(not _is_026(), reason="needs vLLM 0.26 (source tests/integration/vllm_cpu_env.sh "
                                                     "0.26.0)")


@pytest.fixture
def cu(monkeypatch):
    """vLLM's cudagraph_utils with CudaGraphManager._init_candidates as vLLM ships it (restored afterwards: another
    test of the worker may have installed the wrapper through DiffusionModelState), the PP group and graph pool
    stood in."""
    from vllm.v1.worker.gpu import cudagraph_utils as mod

    orig = mod.CudaGraphManager.__dict__["_init_candidates"]
    monkeypatch.setattr(mod.CudaGraphManager, "_init_candidates", getattr(orig, "__wrapped__", orig)
                        if getattr(orig, VG._MARK, False) else orig)
    monkeypatch.setattr(mod, "get_pp_group", lambda: NS(is_first_rank=True, is_last_rank=True))
    monkeypatch.setattr(mod, "current_platform", NS(get_global_graph_pool=lambda: None))
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    return mod


def _config(served=2 * CL, ckpt=CL):
    return NS(scheduler_config=NS(max_num_seqs=MAX_REQS),
              compilation_config=NS(cudagraph_capture_sizes=list(CAPTURE_SIZES),
                                    max_cudagraph_capture_size=max(CAPTURE_SIZES)),
              parallel_config=NS(data_parallel_size=1, tensor_parallel_size=1),
              speculative_config=None, num_speculative_tokens=served,
              diffusion_config=NS(canvas_length=served, max_denoising_steps=16),
              model_config=NS(hf_config=NS(canvas_length=ckpt)))


def _manager(cu, served=2 * CL, ckpt=CL):
    from vllm.config.compilation import CUDAGraphMode

    # GPUModelRunner.initialize_kv_cache: ModelCudaGraphManager(vllm_config, device, cudagraph_mode,
    # decode_query_len = num_speculative_tokens + num_new_sampled_tokens_per_step (0 for diffusion))
    m = cu.ModelCudaGraphManager(_config(served, ckpt), "cpu", CUDAGraphMode.FULL_AND_PIECEWISE,
                                 decode_query_len=served)
    m._graphs_captured = True  # dispatch only looks once graphs exist
    return m


def _mode(m, num_reqs, num_tokens, uniform):
    return m.dispatch(num_reqs, num_tokens, uniform, 0)


def _full(m, width=None):
    return [d for d in m._capture_descs.get(_modes().FULL, []) if width is None or d.uniform_token_count == width]


def _modes():
    from vllm.config.compilation import CUDAGraphMode

    return CUDAGraphMode


@needs_vllm
@needs_026
def test_unpatched_vllm_runs_a_plain_canvas_step_piecewise(cu):
    """7.37 (a): served with canvas_length 2 * CL, vLLM 0.26 captures uniform FULL graphs 512 wide only (24 of
    them, the run's "(FULL) 24/24"), so a plain 256-wide step dispatches PIECEWISE; the fused 512 row is FULL."""
    M = _modes()
    m = _manager(cu)
    assert len(_full(m)) == 24 and len(_full(m, 2 * CL)) == 24
    assert len(m._capture_descs[M.PIECEWISE]) == len(CAPTURE_SIZES) == 32
    assert _mode(m, 1, CL, CL).cg_mode == M.PIECEWISE
    assert _mode(m, 4, 4 * CL, CL).cg_mode == M.PIECEWISE
    assert _mode(m, 1, 2 * CL, 2 * CL).cg_mode == M.FULL


@needs_vllm
@needs_026
def test_patched_vllm_replays_full_graphs_at_both_widths(cu, caplog):
    M = _modes()
    assert VG.install_dual_width_decode_graphs()
    with captured_log(caplog, VG._log, logging.INFO):
        m = _manager(cu)
    assert m.decode_query_len == 2 * CL  # restored: the runner's dummy runs and warm-up stay 2 * CL wide
    assert len(_full(m, CL)) == 32 and len(_full(m, 2 * CL)) == 24 and len(_full(m)) == 56  # 7.37's prediction
    assert len(m._capture_descs[M.PIECEWISE]) == 32  # unchanged, not doubled
    assert len(set(_full(m))) == 56
    assert [d.num_tokens for d in _full(m)] == sorted((d.num_tokens for d in _full(m)), reverse=True)
    assert "32 at 256, 24 at 512" in caplog.text
    for n in (1, 2, 4, 32, MAX_REQS):  # plain canvas steps of n requests: FULL at width CL, no padding
        d = _mode(m, n, n * CL, CL)
        assert (d.cg_mode, d.uniform_token_count, d.num_tokens, d.num_reqs) == (M.FULL, CL, n * CL, n), n
    for n in (1, 2, 3, 16, 32):  # all-fused steps: FULL at width 2 * CL
        d = _mode(m, n, n * 2 * CL, 2 * CL)
        assert (d.cg_mode, d.uniform_token_count, d.num_tokens, d.num_reqs) == (M.FULL, 2 * CL, n * 2 * CL, n), n
    assert _mode(m, 2, 3 * CL, None).cg_mode == M.PIECEWISE  # one fused row and one plain row
    assert _mode(m, 5, 5 * CL + 7, None).cg_mode == M.PIECEWISE  # a prefill among canvas rows
    assert _mode(m, 3, 3 * CL, CL).cg_mode == M.FULL
    assert _mode(m, 1, 16384 + 1, None).cg_mode == M.NONE  # past the largest capture size: eager, as before
    # every candidate list: the uniform FULL descriptors first, then the PIECEWISE one
    for descs in m._candidates.values():
        kinds = [d.uniform_token_count is None for d in descs]
        assert kinds == sorted(kinds) and len(set(descs)) == len(descs)


@needs_vllm
@needs_026
def test_patch_is_idempotent_and_leaves_other_managers_alone(cu):
    M = _modes()
    assert VG.install_dual_width_decode_graphs()
    first = cu.CudaGraphManager.__dict__["_init_candidates"]
    assert VG.install_dual_width_decode_graphs() and VG.is_installed()
    assert cu.CudaGraphManager.__dict__["_init_candidates"] is first
    assert cu.ModelCudaGraphManager._init_candidates is first  # inherited
    # the CL layout: one width, as vLLM builds it
    m = _manager(cu, served=CL)
    assert len(_full(m)) == 32 and _mode(m, 1, CL, CL).cg_mode == M.FULL and m.decode_query_len == CL
    # 2 * CL served for a checkpoint of another canvas length: not the fused layout
    m = _manager(cu, served=2 * CL, ckpt=3 * CL)
    assert len(_full(m)) == 24 and _mode(m, 1, CL, CL).cg_mode == M.PIECEWISE
    # a manager of another width in a fused-layout server (a speculator's, decode_query_len 4): vLLM's own build
    m = cu.CudaGraphManager(_config(), "cpu", M.FULL_AND_PIECEWISE, decode_query_len=4)
    assert {d.uniform_token_count for d in _full(m)} == {4}
    mine = (m._candidates, m._capture_descs)
    first.__wrapped__(m)
    assert mine == (m._candidates, m._capture_descs)


@needs_vllm
@needs_026
def test_a_failing_build_falls_back_to_vllms_own(cu, monkeypatch, caplog):
    M = _modes()
    assert VG.install_dual_width_decode_graphs()

    def boom(*a, **k):
        raise RuntimeError("merge")

    monkeypatch.setattr(VG, "_merge_into", boom)
    with captured_log(caplog, VG._log, logging.WARNING):
        m = _manager(cu)
    assert "falls back" in caplog.text or "as vLLM builds them" in caplog.text
    assert len(_full(m)) == 24 and m.decode_query_len == 2 * CL and _mode(m, 1, CL, CL).cg_mode == M.PIECEWISE


@needs_vllm
def test_missing_private_names_leave_vllm_alone(monkeypatch, caplog):
    """Another vLLM without the private method (or the attributes it sets): no patch, a warning."""
    from vllm.v1.worker.gpu import cudagraph_utils as mod

    class Other:
        def __init__(self):
            self.decode_query_len = 1

    monkeypatch.setattr(mod, "CudaGraphManager", Other)
    with captured_log(caplog, VG._log, logging.WARNING):
        assert VG.install_dual_width_decode_graphs() is False
    assert "_init_candidates" in caplog.text and "_capture_descs" in caplog.text
    assert not hasattr(Other, "_init_candidates")


@needs_vllm
def test_installed_only_for_the_fused_layout_under_0_26(monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils as mod

    calls = []
    monkeypatch.setattr(VG, "install_dual_width_decode_graphs", lambda: calls.append(1) or True)
    assert VG.maybe_install_for(False) is False and calls == []
    is_026 = vllm_compat.current().version == "0.26.0"
    assert VG.maybe_install_for(True) is is_026 and len(calls) == int(is_026)
    assert vllm_compat.PROFILES["0.26.0"].dual_width_decode_graphs
    assert not vllm_compat.PROFILES["0.33.0"].dual_width_decode_graphs
    for version, expect in (("0.26.0", True), ("0.33.0", False), ("0.34.1", False)):
        monkeypatch.setattr(vllm_compat, "_current", None)
        monkeypatch.setattr("vllm.__version__", version)
        calls.clear()
        assert VG.maybe_install_for(True) is expect and len(calls) == int(expect), version
    assert mod.CudaGraphManager  # untouched by this test


@needs_vllm
@pytest.mark.parametrize("served, installs", [(2 * CL, True), (CL, False)])
def test_model_state_installs_it_for_the_fused_layout(monkeypatch, served, installs):
    """DiffusionModelState.__init__ asks for the wrapper with the layout it serves (the fused one only)."""
    pytest.importorskip("test_vllm_plugin")
    from test_vllm_plugin import _StandInVllmModel

    import torch

    from blockdiff.integration import model_state as MS
    from blockdiff.integration import vllm_scheduler as VS

    asked = []
    monkeypatch.setattr(MS, "install_decode_graph_widths", lambda fused: asked.append(fused))
    monkeypatch.delenv(VS.FUSE_COMMIT_ENV, raising=False)
    H = 8
    mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
            hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: {}, get_vocab_size=lambda: 64,
            max_model_len=4096)
    sc = NS(max_num_seqs=2, max_num_batched_tokens=2048, async_scheduling=False,
            scheduler_cls="blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler")
    cfg = NS(model_config=mc, scheduler_config=sc, diffusion_config=NS(canvas_length=served, max_denoising_steps=2))
    MS.DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))
    assert asked == [installs]


@pytest.mark.parametrize("version", sorted(vllm_compat.PROFILES))
def test_the_wrapped_private_names_are_recorded(version):
    """Without vLLM: each version's interface snapshot records what vllm_graphs wraps; a profile that asks for the
    wrapper has every name of vllm_graphs.WRAPPED."""
    import json
    import os

    import snapshot_vllm_interface as SV

    prof = vllm_compat.PROFILES[version]
    with open(os.path.join(SV.HERE, prof.snapshot)) as f:
        classes = json.load(f)["classes"]
    mod = VG.WRAPPED["module"]
    mgr, desc = classes[f"{mod}:CudaGraphManager"], classes[f"{mod}:BatchExecutionDescriptor"]
    have = mgr is not None and desc is not None and "_init_candidates" in mgr["methods"] and all(
        mgr["init_attributes"].values()) and set(VG.WRAPPED["descriptor_fields"]) <= set(desc["fields"])
    assert set(mgr["init_attributes"]) == set(VG.WRAPPED["init_attributes"])
    assert mgr["methods"]["_init_candidates"]["params"] == ["self"]
    assert have or not prof.dual_width_decode_graphs
