"""The plugin against the recorded interface of every vLLM version it supports (0.26.0, 0.33.0): each
:data:`blockdiff.integration.vllm_compat.PROFILES` entry agrees with its version's snapshot
(``vllm_<version>_model_state_interface.json``, written by ``snapshot_vllm_interface.py``), and the plugin's hooks,
imports and calls fit that snapshot. Runs without vLLM (snapshots and ast only); the last tests need an installed
vLLM (``source tests/integration/vllm_cpu_env.sh VERSION``)."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import os

import pytest
import snapshot_vllm_interface as SV
from integration_helpers import captured_log

from blockdiff.integration import model_state as MS
from blockdiff.integration import vllm_compat
from blockdiff.integration.model_state import DiffusionModelState
from blockdiff.integration.sampler import DiffusionSampler

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
VERSIONS = sorted(vllm_compat.PROFILES)
INTEGRATION = os.path.join(SV.ROOT, "integration")

FA = "vllm.v1.attention.backends.flash_attn"
#: InputBatch fields the plugin's vLLM paths read (DiffusionModelState.prepare_inputs / prepare_attn /
#: fill_causal, DiffusionSampler.__call__); ``max_query_len`` / ``max_seq_len`` are read by the harness path only.
VLLM_INPUT_BATCH_FIELDS = ("req_ids", "num_reqs", "num_tokens", "idx_mapping", "query_start_loc", "query_start_loc_np",
                           "input_ids", "seq_lens", "num_scheduled_tokens", "cu_num_logits_np", "prefill_len_np",
                           "num_computed_prefill_tokens_np", "num_reqs_after_padding", "num_tokens_after_padding")


def _snapshot(version):
    with open(os.path.join(SV.HERE, vllm_compat.PROFILES[version].snapshot)) as f:
        return json.load(f)


def _tree(name):
    with open(os.path.join(INTEGRATION, name)) as f:
        return ast.parse(f.read())


def _call_keywords(tree, func_name):
    """Keyword names of every call to ``func_name`` (a name or an attribute) in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called == func_name:
                out.update(k.arg for k in node.keywords if k.arg)
    assert out, f"no call to {func_name}"
    return out


def _compatible(ours, theirs, name):
    """Our hook binds every call vLLM makes: vLLM's positional parameters are a prefix of ours (same names), each
    of theirs with a default has one in ours, our extra parameters have defaults."""
    ps = list(inspect.signature(ours).parameters.values())
    pos = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    want = theirs["params"]
    assert [p.name for p in pos[:len(want)]] == want, f"{name}: ours {[p.name for p in pos]}, vLLM {want}"
    n_req = len(want) - theirs["num_defaults"]
    for p in pos[n_req:]:
        assert p.default is not p.empty, f"{name}: {p.name} needs a default (vLLM may leave it out)"
    for p in ps:
        if p.kind == p.KEYWORD_ONLY:
            assert p.default is not p.empty, f"{name}: extra keyword {p.name} needs a default"


# ------------------------------------------------------------------------------------------- profiles
def test_profile_for_maps_versions_and_refuses_unchecked_ones(caplog):
    assert vllm_compat.profile_for("0.26.0").version == "0.26.0"
    assert vllm_compat.profile_for("0.26.3+cpu").version == "0.26.0"
    assert vllm_compat.profile_for("0.33.1.dev4+gabc").version == "0.33.0"
    with captured_log(caplog, vllm_compat._log, logging.WARNING):
        assert vllm_compat.profile_for("0.35.0").version == "0.33.0"
    assert "newer" in caplog.text
    for bad in ("0.25.2", "0.30.0"):
        with pytest.raises(ValueError, match="0.26.x and >= 0.33"):
            vllm_compat.profile_for(bad)
    with pytest.raises(ValueError, match="major.minor"):
        vllm_compat.profile_for("dev")
    with pytest.raises(TypeError, match="version must be a str"):
        vllm_compat.profile_for(26)


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_profile_agrees_with_its_snapshot(version):
    prof, snap = vllm_compat.PROFILES[version], _snapshot(version)
    assert snap["version"] == version and prof.version == version
    hook = snap["methods"].get(prof.inputs_embeds_hook)
    assert hook is not None and hook.get("abstract"), prof.inputs_embeds_hook
    others = {p.inputs_embeds_hook for p in vllm_compat.PROFILES.values()} - {prof.inputs_embeds_hook}
    assert not others & set(snap["methods"]) and not others & set(snap["other_methods"])
    sampler = snap["classes"]["vllm.v1.worker.gpu.sample.sampler:Sampler"]["methods"]["add_request"]
    assert tuple(sampler["params"][1:]) == prof.sampler_add_request_params
    for q in prof.scheduler_classes:
        module, _, name = q.rpartition(".")
        assert snap["symbols"][f"{module}:{name}"], q
        assert snap["classes"][f"{module}:{name}"] is not None, q
    has_diffusion_scheduler = snap["classes"]["vllm.v1.core.sched.diffusion_scheduler:DiffusionScheduler"] is not None
    assert prof.diffusion_scheduler == has_diffusion_scheduler


# ------------------------------------------------------------------------------------------- model state
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_model_state_implements_every_recorded_hook(version):
    snap = _snapshot(version)
    for name, spec in snap["methods"].items():
        assert hasattr(DiffusionModelState, name), name
        _compatible(getattr(DiffusionModelState, name), spec, name)
        if spec.get("abstract"):
            assert name in vars(DiffusionModelState), f"abstract hook {name} must be implemented here"
    for name, spec in snap["other_methods"].items():
        if name in vars(DiffusionModelState):
            _compatible(getattr(DiffusionModelState, name), spec, name)
    assert DiffusionModelState.num_new_sampled_tokens_per_step == 0
    assert set(snap["attributes"]) <= set(dir(DiffusionModelState))


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_model_state_reads_only_recorded_fields(version):
    snap = _snapshot(version)
    batch = snap["classes"]["vllm.v1.worker.gpu.input_batch:InputBatch"]["fields"]
    assert set(VLLM_INPUT_BATCH_FIELDS) <= set(batch), set(VLLM_INPUT_BATCH_FIELDS) - set(batch)
    base = set(snap["init_attributes"]) | set(snap["properties"])
    assert {"model_config", "max_num_reqs", "max_num_tokens", "dtype", "max_model_len"} <= base
    assert {"canvas_length", "max_denoising_steps"} <= set(snap["classes"]["vllm.config.diffusion:DiffusionConfig"]
                                                           ["fields"])
    build = snap["functions"]["vllm.v1.worker.gpu.attn_utils:build_attn_metadata"]["params"]
    used = _call_keywords(_tree("model_state.py"), "build_attn_metadata")
    assert used <= set(build), used - set(build)
    graph_modes = snap["classes"]["vllm.config.compilation:CUDAGraphMode"]["members"]
    assert graph_modes["FULL"]


def test_vllm_model_state_get_mm_embeddings_is_prepare_inputs_embeds():
    """0.26.0's hook name: no multimodal inputs, the embeddings are built in prepare_inputs."""
    ms = object.__new__(DiffusionModelState)
    assert ms.get_mm_embeddings({}, None, None) is None


# ------------------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_sampler_accepts_the_runners_add_request_and_output_fields(version):
    prof, snap = vllm_compat.PROFILES[version], _snapshot(version)
    sampler = object.__new__(DiffusionSampler)
    args = {"req_idx": 3, "prompt_len": 7, "sampling_params": object()}
    assert sampler.add_request(*[args[p] for p in prof.sampler_add_request_params]) is None
    fields = snap["classes"]["vllm.v1.worker.gpu.sample.output:SamplerOutput"]["fields"]
    used = _call_keywords(_tree("sampler.py"), "SamplerOutput")
    assert used <= set(fields) and {f for f, has_default in fields.items() if not has_default} <= used
    assert snap["classes"]["vllm.v1.worker.gpu.sample.sampler:Sampler"]["init_attributes"]["req_states"]
    assert snap["classes"]["vllm.v1.worker.gpu.states:RequestState"]["init_attributes"]["draft_tokens"]


# ------------------------------------------------------------------------------------------- attention, registry
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_attention_backend_fits_flash_attention(version):
    snap = _snapshot(version)
    classes = snap["classes"]
    impl = next(n for n in _tree("vllm_attention.py").body
                if isinstance(n, ast.ClassDef) and n.name == "BlockdiffAttentionImpl")
    forward = next(m for m in impl.body if isinstance(m, ast.FunctionDef) and m.name == "forward")
    assert SV.signature(forward) == classes[f"{FA}:FlashAttentionImpl"]["methods"]["forward"]
    assert all(classes[f"{FA}:FlashAttentionImpl"]["init_attributes"].values())
    meta = classes[f"{FA}:FlashAttentionMetadata"]["fields"]
    read = {n.attr for n in ast.walk(forward) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "attn_metadata"} - {"_blockdiff_num_causal_q"}
    assert read <= set(meta), read - set(meta)
    assert classes[f"{FA}:FlashAttentionMetadataBuilder"]["init_attributes"]["aot_schedule"]
    for m in ("get_name", "get_impl_cls", "get_builder_cls", "supports_head_size"):
        assert m in classes[f"{FA}:FlashAttentionBackend"]["methods"], m
    assert classes["vllm.v1.attention.backends.registry:AttentionBackendEnum"]["members"]["CUSTOM"]
    reg = snap["functions"]["vllm.v1.attention.backends.registry:register_backend"]
    assert reg["params"][:2] == ["backend", "class_path"]
    models = classes["vllm.model_executor.models.registry:_ModelRegistry"]["methods"]
    assert models["register_model"]["params"] == ["self", "model_arch", "model_cls"]
    assert "DiffusionGemmaForBlockDiffusion" in snap["model_registry"]
    dg = classes["vllm.model_executor.models.diffusion_gemma:DiffusionGemmaForConditionalGeneration"]
    assert dg["init_attributes"]["self_conditioning"] and dg["init_attributes"]["model"]


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_scheduler_pieces_exist(version):
    snap = _snapshot(version)
    classes = snap["classes"]
    sched = classes["vllm.v1.core.sched.scheduler:Scheduler"]
    assert all(sched["init_attributes"].values())
    assert sched["methods"]["update_from_output"]["params"] == ["self", "scheduler_output", "model_runner_output"]
    assert sched["methods"]["finish_requests"]["params"] == ["self", "request_ids", "finished_status"]
    out_fields = classes["vllm.v1.engine:EngineCoreOutput"]["fields"]
    used = _call_keywords(_tree("vllm_scheduler.py"), "EngineCoreOutput")
    # ``error`` (a refused request's RequestError) is passed only where EngineCoreOutput has it (feature-detected:
    # vllm_scheduler._request_error_type); then RequestError takes code and message
    request_error = classes["vllm.outputs:RequestError"]
    assert ("error" in out_fields) == (request_error is not None) == snap["symbols"]["vllm.outputs:RequestError"]
    gated = {"error"} - set(out_fields)
    assert "error" in used and used - gated <= set(out_fields), used - gated - set(out_fields)
    if request_error is not None:
        assert _call_keywords(_tree("vllm_scheduler.py"), "request_type") <= set(request_error["fields"])
        assert {f for f, has_default in request_error["fields"].items() if not has_default} == {"code", "message"}
    assert "outputs" in classes["vllm.v1.engine:EngineCoreOutputs"]["fields"]
    assert all(classes["vllm.v1.request:RequestStatus"]["members"].values())
    assert all(classes["vllm.v1.request:Request"]["init_attributes"].values())
    assert set(classes["vllm.v1.request:Request"]["methods"]) == {"is_finished", "get_finished_reason", "take_events"}
    assert "num_nans_in_logits" in classes["vllm.v1.outputs:ModelRunnerOutput"]["fields"]
    # fused commits: the overrides' signatures (update_draft_token_ids(draft_token_ids), schedule(...)), the
    # scheduler's vllm_config (served_canvas_length) and each request's spec_token_ids (the draft widths)
    assert sched["methods"]["update_draft_token_ids"]["params"] == ["self", "draft_token_ids"]
    assert sched["methods"]["schedule"]["params"][0] == "self"
    assert sched["init_attributes"]["vllm_config"] and classes["vllm.v1.request:Request"]["init_attributes"][
        "spec_token_ids"]
    assert {"canvas_length"} <= set(classes["vllm.config.diffusion:DiffusionConfig"]["fields"])
    # streaming input (StreamingInputRefusals): the add_request override's signature, the flag it reads, and the
    # session continuation it keeps diffusion requests from (both versions have the feature)
    assert sched["methods"]["add_request"]["params"] == ["self", "request"]
    assert classes["vllm.v1.request:Request"]["init_attributes"]["resumable"]
    assert sched["methods"]["_update_request_as_session"]["params"] == ["self", "session", "update"]


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_every_import_of_the_plugin_exists(version):
    """Every ``from vllm... import NAME`` in integration/*.py is recorded, and defined, in each supported version
    (version-dependent classes go through vllm_compat). A new import needs both snapshots regenerated."""
    snap, prof = _snapshot(version), vllm_compat.PROFILES[version]
    gated = {f"{q.rpartition('.')[0]}:{q.rpartition('.')[2]}" for p in vllm_compat.PROFILES.values()
             for q in p.scheduler_classes}
    own = {f"{q.rpartition('.')[0]}:{q.rpartition('.')[2]}" for q in prof.scheduler_classes}
    gated |= set(vllm_compat.OPTIONAL_IMPORTS)  # imported where defined (feature detection): may be absent
    imports = SV.plugin_vllm_imports()
    missing = [q for q in imports if q not in snap["symbols"]]
    assert not missing, f"not in the {version} snapshot (regenerate it with snapshot_vllm_interface.py): {missing}"
    absent = [q for q in imports if not snap["symbols"][q] and (q not in gated or q in own)]
    assert not absent, f"vLLM {version} lacks {absent}"


# ------------------------------------------------------------------------------------------- with vLLM installed
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (source tests/integration/vllm_cpu_env.sh VERSION)")
def test_vllm_snapshot_script_reproduces_the_recorded_snapshot():
    """The recorded snapshot of the installed version is what the script reads from its source now."""
    snap = SV.snapshot(SV.installed_vllm_dir())
    prof = vllm_compat.profile_for(snap["version"])
    assert prof.version == snap["version"], "only checked versions have a recorded snapshot"
    assert SV.dumps(snap) + "\n" == open(os.path.join(SV.HERE, prof.snapshot)).read()


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (source tests/integration/vllm_cpu_env.sh VERSION)")
def test_vllm_installed_version_profile_and_scheduler_bases():
    import vllm

    prof = vllm_compat.current()
    assert vllm.__version__.startswith(prof.version.rsplit(".", 1)[0])
    sync, asyn = vllm_compat.scheduler_base_classes()
    assert [f"{c.__module__}.{c.__name__}" for c in (sync, asyn)] == list(prof.scheduler_classes)
    assert MS.VLLM_AVAILABLE
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    assert issubclass(DiffusionModelState, ModelState)
    assert not getattr(DiffusionModelState, "__abstractmethods__", frozenset())


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (source tests/integration/vllm_cpu_env.sh VERSION)")
def test_vllm_custom_backend_builder_and_head_sizes(monkeypatch):
    """The CUSTOM backend's metadata builder never runs FA3's ahead-of-time schedule (it would get the per-request
    causal tensor where it takes a bool), and its head sizes are blockdiff's (512 for triton, 256 for cute)
    whether or not FA4 is importable."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from blockdiff.integration import vllm_attention as va

    def fake_init(self, *a, **k):
        self.aot_schedule = True

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "__init__", fake_init)
    B = va.BlockdiffAttentionBackend
    assert B.get_builder_cls() is va.BlockdiffAttentionMetadataBuilder
    assert issubclass(B.get_builder_cls(), FlashAttentionMetadataBuilder)
    assert B.get_builder_cls()(None, [], None, None).aot_schedule is False
    monkeypatch.setenv("BLOCKDIFF_ATTN_BACKEND", "triton")
    assert B.supports_head_size(512) and B.supports_head_size(256) and not B.supports_head_size(516)
    assert not B.supports_head_size(1024) and not B.supports_head_size(100)
    monkeypatch.setenv("BLOCKDIFF_ATTN_BACKEND", "cute")
    assert B.supports_head_size(256) and B.supports_head_size(512) and B.supports_head_size(288)
    assert not B.supports_head_size(264) and not B.supports_head_size(520)  # above 256: multiples of 32 to 512
