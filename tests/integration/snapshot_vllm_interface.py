"""Record the parts of vLLM's Python interface that blockdiff's plugin relies on, read with ast from vLLM's source
(nothing of vLLM is imported), as ``tests/integration/vllm_<version>_model_state_interface.json``.

    source tests/integration/vllm_cpu_env.sh 0.26.0 && python3 tests/integration/snapshot_vllm_interface.py
    python3 tests/integration/snapshot_vllm_interface.py --vllm-dir /tmp/wheel/vllm      # an unpacked wheel
    python3 tests/integration/snapshot_vllm_interface.py --check                         # exit 1 on a difference

What it records (``tests/integration/test_vllm_interface.py`` checks the plugin against it, without vLLM):

* ``methods``: the ModelState hooks the runner calls that ``DiffusionModelState`` implements (:data:`HOOKS`) and
  every abstract one, in source order: positional parameter names, number of defaults, ``abstract``;
  ``attributes``: ModelState's class-level constants; ``other_methods``, ``properties``, ``init_attributes``: the
  rest of ModelState (``vllm/v1/worker/gpu/model_states/interface.py``). The first two keys are the hand-made
  0.33.0 snapshot's, unchanged.
* ``classes`` / ``functions``: the vLLM classes and functions the plugin calls, derives from or fills
  (:data:`CLASSES`, :data:`FUNCTIONS`): method signatures, dataclass fields (True = has a default), enum members,
  attributes set in ``__init__``; a class or function missing from this vLLM is recorded as null.
* ``symbols``: for every ``from vllm... import NAME`` in ``integration/*.py`` and every scheduler class a
  :data:`blockdiff.integration.vllm_compat.PROFILES` entry names: whether this vLLM defines it.
* ``model_registry``: vLLM's own DiffusionGemma architectures -> (module, class).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

MODEL_STATE = "vllm.v1.worker.gpu.model_states.interface:ModelState"

#: ModelState hooks recorded under ``methods`` when vLLM defines them (plus every abstract method).
HOOKS = ("__init__", "add_request", "remove_request", "apply_staged_writes", "postprocess_state",
         "prepare_inputs_embeds", "get_mm_embeddings", "dummy_inputs_embeds", "prepare_inputs",
         "prepare_dummy_inputs", "prepare_attn", "custom_sampler")

#: ``module:Class`` -> what to record: ``methods`` (names, or "*" for every method the class defines), ``fields``
#: (dataclass / struct fields), ``members`` (names looked up among the class-level assignments),
#: ``init_attributes`` (names looked up among ``self.X = ...`` in ``__init__``).
CLASSES: dict[str, dict] = {
    "vllm.v1.worker.gpu.sample.output:SamplerOutput": {"fields": True},
    "vllm.v1.worker.gpu.sample.sampler:Sampler": {"methods": ["add_request", "apply_staged_writes", "__call__"],
                                                  "init_attributes": ["req_states", "sampling_states"]},
    "vllm.v1.worker.gpu.states:RequestState": {"init_attributes": ["draft_tokens"]},
    "vllm.v1.worker.gpu.input_batch:InputBatch": {"fields": True},
    "vllm.v1.attention.backend:AttentionBackend": {"methods": ["supports_dtype"]},
    "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend": {
        "methods": ["get_name", "get_impl_cls", "get_builder_cls", "supports_head_size"]},
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl": {
        "methods": ["__init__", "forward"],
        "init_attributes": ["num_heads", "head_size", "scale", "sliding_window", "num_kv_heads"]},
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata": {"fields": True},
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder": {
        "methods": ["__init__", "build"], "init_attributes": ["aot_schedule"]},
    "vllm.v1.attention.backends.registry:AttentionBackendEnum": {"members": ["CUSTOM", "FLASH_ATTN", "TRITON_ATTN"]},
    "vllm.config.compilation:CUDAGraphMode": {"members": ["NONE", "PIECEWISE", "FULL"]},
    "vllm.config.diffusion:DiffusionConfig": {"fields": True},
    "vllm.v1.core.sched.scheduler:Scheduler": {
        "methods": ["update_from_output", "finish_requests", "update_draft_token_ids", "schedule",
                    "_preempt_request", "add_request", "_update_request_as_session"],
        "init_attributes": ["requests", "running", "max_model_len", "num_spec_tokens", "vllm_config",
                            "current_step", "max_num_scheduled_tokens", "scheduler_config"]},
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler": {"methods": ["_update_after_schedule"]},
    "vllm.v1.core.sched.diffusion_scheduler:DiffusionScheduler": {"methods": "*"},
    "vllm.v1.core.sched.diffusion_scheduler:DiffusionAsyncScheduler": {"methods": "*"},
    "vllm.v1.engine:EngineCoreOutput": {"fields": True},
    "vllm.v1.engine:EngineCoreOutputs": {"fields": True},
    # a refused request's reason in its output (vllm_scheduler._answer; vLLM 0.33.0: EngineCoreOutput.error)
    "vllm.outputs:RequestError": {"fields": True},
    "vllm.v1.request:RequestStatus": {"members": ["RUNNING", "FINISHED_ERROR", "FINISHED_LENGTH_CAPPED"]},
    "vllm.v1.request:Request": {"methods": ["is_finished", "get_finished_reason", "take_events"],
                                "init_attributes": ["request_id", "client_index", "sampling_params", "status",
                                                    "stop_reason", "num_nans_in_logits", "trace_headers",
                                                    "spec_token_ids", "max_tokens", "num_computed_tokens",
                                                    "next_decode_eligible_step", "num_output_placeholders",
                                                    "num_prompt_tokens", "resumable"]},
    "vllm.v1.outputs:ModelRunnerOutput": {"fields": True},
    "vllm.model_executor.models.registry:_ModelRegistry": {"methods": ["register_model", "get_supported_archs"]},
    "vllm.model_executor.models.diffusion_gemma:DiffusionGemmaForConditionalGeneration": {
        "methods": ["__init__", "get_model_state_cls", "compute_self_conditioning", "forward", "compute_logits"],
        "init_attributes": ["model", "self_conditioning", "lm_head"]},
    "vllm.model_executor.models.diffusion_gemma:DiffusionGemmaModelState": {"methods": "*"},
    "vllm.model_executor.models.diffusion_gemma:DiffusionSampler": {"methods": "*"},
    # integration/vllm_graphs.py wraps the private _init_candidates (0.26; docs/tuning.md 7.37 Fix 1)
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager": {
        "methods": ["__init__", "_init_candidates", "dispatch"],
        "init_attributes": ["vllm_config", "decode_query_len", "_candidates", "_capture_descs"]},
    "vllm.v1.worker.gpu.cudagraph_utils:BatchExecutionDescriptor": {"fields": True},
}

#: ``module:function`` whose signatures are recorded.
FUNCTIONS = ("vllm.v1.worker.gpu.attn_utils:build_attn_metadata",
             "vllm.v1.attention.backends.registry:register_backend",
             "vllm.v1.core.sched.diffusion_scheduler:diffusion_canvas_width")


# ------------------------------------------------------------------------------------------------ ast reading
class Source:
    """vLLM's source tree (the folder of the ``vllm`` package), parsed lazily per module."""

    def __init__(self, vllm_dir: str) -> None:
        if not os.path.isfile(os.path.join(vllm_dir, "__init__.py")):
            raise ValueError(f"--vllm-dir {vllm_dir!r} is not a vllm package folder (no __init__.py)")
        self.root = os.path.dirname(os.path.abspath(vllm_dir))
        self._trees: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> str | None:
        base = os.path.join(self.root, *module.split("."))
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(p):
                return p
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            p = self.path(module)
            self._trees[module] = ast.parse(open(p, encoding="utf-8").read(), p) if p else None
        return self._trees[module]

    def version(self) -> str:
        tree = self.tree("vllm._version")
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return node.value.value
        raise ValueError(f"no __version__ in {self.path('vllm._version')}")


def _top_level(body):
    """Statements of a module or class body, descending into if / try / with blocks (not into defs)."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, field, []) or [])
            for h in getattr(node, "handlers", []) or []:
                yield from _top_level(h.body)
        else:
            yield node


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at top level, plus the keys of a lazy ``MODULE_ATTRS`` dict (vllm/__init__.py)."""
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            if (isinstance(node.value, ast.Dict) and any(isinstance(t, ast.Name) and t.id == "MODULE_ATTRS"
                                                         for t in targets)):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return names


def _find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for node in _top_level(tree.body) if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _find_function(tree: ast.Module | None, name: str):
    for node in _top_level(tree.body) if tree else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _decorators(fn) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def signature(fn) -> dict:
    """``{"params": positional names, "num_defaults": n}`` plus ``abstract``, ``kwonly``, ``vararg``, ``varkw``
    where they apply (the hand-made 0.33.0 snapshot's format)."""
    a = fn.args
    out: dict = {"params": [p.arg for p in a.posonlyargs + a.args], "num_defaults": len(a.defaults)}
    if "abstractmethod" in _decorators(fn):
        out["abstract"] = True
    if a.kwonlyargs:
        out["kwonly"] = [p.arg for p in a.kwonlyargs]
    if a.vararg:
        out["vararg"] = True
    if a.kwarg:
        out["varkw"] = True
    return out


def _methods(cls: ast.ClassDef) -> list:
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _init_attributes(cls: ast.ClassDef) -> set[str]:
    init = next((m for m in _methods(cls) if m.name == "__init__"), None)
    out = set()
    for node in ast.walk(init) if init else ():
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def model_state_section(src: Source) -> dict:
    module, name = MODEL_STATE.split(":")
    cls = _find_class(src.tree(module), name)
    if cls is None:
        raise ValueError(f"{MODEL_STATE} not found under {src.root}: not a vLLM with model runner v2")
    methods, other, props = {}, {}, []
    for fn in _methods(cls):
        if {"property", "cached_property"} & _decorators(fn):
            props.append(fn.name)
            continue
        sig = signature(fn)
        (methods if fn.name in HOOKS or sig.get("abstract") else other)[fn.name] = sig
    attrs = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            attrs[node.target.id] = _literal(node.value)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    attrs[t.id] = _literal(node.value)
    return {"methods": methods, "attributes": dict(sorted(attrs.items())), "other_methods": other,
            "properties": sorted(props), "init_attributes": sorted(_init_attributes(cls))}


def class_section(src: Source, qualname: str, spec: dict) -> dict | None:
    module, name = qualname.split(":")
    cls = _find_class(src.tree(module), name)
    if cls is None:
        return None
    out: dict = {"bases": [ast.unparse(b) for b in cls.bases]}
    want = spec.get("methods")
    if want is not None:
        have = {m.name: m for m in _methods(cls)}
        names = list(have) if want == "*" else [n for n in want if n in have]
        out["methods"] = {n: signature(have[n]) for n in names}
    if spec.get("fields"):
        out["fields"] = {n.target.id: n.value is not None for n in cls.body
                         if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                         and not ast.unparse(n.annotation).startswith(("ClassVar", "typing.ClassVar"))}
    if spec.get("members"):
        bound = {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        bound |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        out["members"] = {m: m in bound for m in spec["members"]}
    if spec.get("init_attributes"):
        have = _init_attributes(cls)
        out["init_attributes"] = {a: a in have for a in spec["init_attributes"]}
    return out


def plugin_vllm_imports(root: str = ROOT) -> list[str]:
    """``module:NAME`` for every ``from vllm... import NAME`` in ``integration/*.py`` (sorted), plus the scheduler
    classes of every :data:`blockdiff.integration.vllm_compat.PROFILES` entry (read from vllm_compat.py)."""
    found = set()
    folder = os.path.join(root, "integration")
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, fname), encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                    node.module == "vllm" or node.module.startswith("vllm.")):
                found.update(f"{node.module}:{a.name}" for a in node.names)
    from blockdiff.integration.vllm_compat import PROFILES  # the working tree (pip install -e .)

    for prof in PROFILES.values():
        for q in prof.scheduler_classes:
            module, _, name = q.rpartition(".")
            found.add(f"{module}:{name}")
    return sorted(found)


def symbols_section(src: Source, names: list[str]) -> dict[str, bool]:
    out = {}
    for q in names:
        module, name = q.split(":")
        tree = src.tree(module)
        out[q] = tree is not None and name in _bound_names(tree)
    return out


def model_registry_section(src: Source) -> dict:
    tree = src.tree("vllm.model_executor.models.registry")
    out = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.startswith("DiffusionGemma"):
                    out[k.value] = _literal(v)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(out.items())}


def snapshot(vllm_dir: str) -> dict:
    """The whole snapshot of the vLLM source folder ``vllm_dir`` (see the module docstring)."""
    src = Source(vllm_dir)
    version = src.version()
    ms = model_state_section(src)
    snap = {"_source": f"vllm=={version} wheel, vllm/v1/worker/gpu/model_states/interface.py, class ModelState "
                       "(parameters read with ast)",
            "methods": ms.pop("methods"), "attributes": ms.pop("attributes"),
            "_generated_by": "tests/integration/snapshot_vllm_interface.py (ast over vLLM's source)",
            "version": version}
    snap.update(ms)
    snap["classes"] = {q: class_section(src, q, spec) for q, spec in CLASSES.items()}
    funcs = {}
    for q in FUNCTIONS:
        module, name = q.split(":")
        fn = _find_function(src.tree(module), name)
        funcs[q] = signature(fn) if fn is not None else None
    snap["functions"] = funcs
    snap["symbols"] = symbols_section(src, plugin_vllm_imports())
    snap["model_registry"] = model_registry_section(src)
    return snap


# ------------------------------------------------------------------------------------------------ output
def dumps(obj, indent: int = 0) -> str:
    """JSON with one line per entry of a dict that holds dicts (and one line for any other value), the layout of
    the hand-made 0.33.0 snapshot."""
    if isinstance(obj, dict) and any(isinstance(v, dict) and v for v in obj.values()):
        pad = " " * (indent + 2)
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return json.dumps(obj)


def snapshot_file(version: str) -> str:
    return os.path.join(HERE, f"vllm_{re.sub(r'[^0-9]+', '_', version).strip('_')}_model_state_interface.json")


def installed_vllm_dir() -> str:
    spec = importlib.util.find_spec("vllm")  # locates the package without running vllm/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("snapshot_vllm_interface.py: vLLM is not importable here (source "
                         "tests/integration/vllm_cpu_env.sh VERSION first, or pass --vllm-dir)")
    return list(spec.submodule_search_locations)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-dir", help="folder of the vllm package (default: the importable one)")
    ap.add_argument("--out", help="output file (default: tests/integration/vllm_<version>_model_state_interface"
                                  ".json)")
    ap.add_argument("--check", action="store_true", help="compare with the recorded file instead of writing it")
    args = ap.parse_args(argv)
    snap = snapshot(args.vllm_dir or installed_vllm_dir())
    out = args.out or snapshot_file(snap["version"])
    text = dumps(snap) + "\n"
    if args.check:
        old = open(out, encoding="utf-8").read() if os.path.isfile(out) else None
        if old != text:
            print(f"{out} differs from vLLM {snap['version']}'s interface: regenerate it with "
                  f"python3 {os.path.relpath(__file__, ROOT)}", file=sys.stderr)
            return 1
        print(f"{out}: up to date (vLLM {snap['version']})")
        return 0
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out} (vLLM {snap['version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
