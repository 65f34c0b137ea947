"""Uniform-decode FULL CUDA graphs at both canvas widths, CL and 2 * CL, when vLLM 0.26 serves the fused layout.

What: :func:`install_dual_width_decode_graphs` wraps vLLM 0.26's private
``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager._init_candidates`` (inherited by ``ModelCudaGraphManager``,
the model runner v2's graph manager). For a manager whose ``decode_query_len`` is ``2 * CL`` of a fused-layout
server (:func:`blockdiff.integration.vllm_scheduler.served_canvas_length`), the wrapper runs vLLM's own builder once
per uniform width (``decode_query_len = CL``, then ``2 * CL``), merges the two builds' ``_candidates`` (token count
-> descriptors in priority order) and ``_capture_descs`` (mode -> descriptors to capture), and restores
``decode_query_len = 2 * CL``. In every merged candidate list the descriptors with a ``uniform_token_count`` (the
uniform-decode FULL graphs) come first, so ``dispatch`` (``_is_compatible``, an exact ``uniform_token_count``
match) replays a FULL graph for a batch of CL-wide rows and for one of ``2 * CL``-wide rows, and the PIECEWISE
graph for anything else. Any other manager (the CL layout, a speculator's, another model's) builds as before.

Why (docs/tuning.md 7.37 (a), "Fix 1"): served with the diffusion config's ``canvas_length = 2 * CL`` (the fused
commit layout, 7.35), vLLM 0.26's ``GPUModelRunner.load_model`` sets ``decode_query_len = num_speculative_tokens +
num_new_sampled_tokens_per_step = 2 * CL + 0`` and the manager captures uniform-decode FULL graphs only
``2 * CL`` wide ("Capturing CUDA graphs (PIECEWISE) 32/32, (FULL) 24/24" in 7.35's log), so every plain CL-wide
denoise step runs PIECEWISE (~61 piece replays plus eager attention a step). vLLM 0.26 has no hook for a second
width (only dynamic speculative decoding builds several, from its ``speculative_config``). With the run's capture
sizes (256..16384, 64 requests, CL 256) the manager then holds 56 FULL descriptors (32 at width 256 + 24 at 512)
and the same 32 PIECEWISE ones. Measured on the CPU only (``tests/integration/test_vllm_graphs.py``): capture and
replay of the extra graphs on a GPU are not measured.

Installed from :class:`~blockdiff.integration.model_state.DiffusionModelState` ``__init__`` (which vLLM's
``load_model`` runs before ``initialize_kv_cache`` builds the manager) when the fused layout is served and the
installed vLLM's profile says so (:attr:`blockdiff.integration.vllm_compat.VllmProfile.dual_width_decode_graphs`:
0.26.x only; 0.33 is left alone). If vLLM lacks the private method or a name the wrapper relies on
(:data:`WRAPPED`), nothing is patched and a warning is logged; a build that fails inside the wrapper logs a
warning and falls back to vLLM's own single-width build. Idempotent.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from typing import Any

from .vllm_scheduler import served_canvas_length

_log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's "vllm" logger: its handler prints INFO to the server log

#: The private names of vLLM 0.26.0's ``vllm/v1/worker/gpu/cudagraph_utils.py`` the wrapper relies on (recorded in
#: the interface snapshots by ``tests/integration/snapshot_vllm_interface.py``).
WRAPPED = {
    "module": "vllm.v1.worker.gpu.cudagraph_utils",
    "method": "CudaGraphManager._init_candidates",
    "init_attributes": ("vllm_config", "decode_query_len", "_candidates", "_capture_descs"),
    "descriptor_fields": ("num_tokens", "uniform_token_count"),
}

_MARK = "_blockdiff_dual_width_decode_graphs"


def _widths(mgr: Any) -> tuple[int, int] | None:
    """``(CL, 2 * CL)`` when ``mgr`` is the fused-layout server's uniform-decode manager, else None."""
    if any(not hasattr(mgr, a) for a in WRAPPED["init_attributes"]):
        return None
    cfg = mgr.vllm_config
    if getattr(cfg, "speculative_config", None) is not None:  # vLLM's own multi-width path (dynamic SD)
        return None
    cl, fused_layout = served_canvas_length(cfg)
    if not fused_layout or mgr.decode_query_len != 2 * cl:
        return None
    return cl, 2 * cl


def _merge_into(merged: dict, built: dict) -> None:
    for k, descs in built.items():
        out = merged.setdefault(k, [])
        for d in descs:
            if d not in out:
                out.append(d)


def _dual_width_build(mgr: Any, orig: Any, widths: tuple[int, int]) -> None:
    full_width = mgr.decode_query_len
    cands: dict = {}
    capture: dict = {}
    try:
        for w in widths:  # vLLM's own builder, once per uniform width
            mgr.decode_query_len, mgr._candidates, mgr._capture_descs = w, {}, {}
            orig(mgr)
            _merge_into(cands, mgr._candidates)
            _merge_into(capture, mgr._capture_descs)
    finally:
        mgr.decode_query_len = full_width
    shared: dict = {}  # vLLM shares one list among the token counts of a range; so do we
    for k, descs in cands.items():
        # uniform FULL first (dispatch picks by exact uniform_token_count), then the least padding
        descs.sort(key=lambda d: (d.uniform_token_count is None, d.num_tokens))
        cands[k] = shared.setdefault(tuple(descs), descs)
    for descs in capture.values():
        descs.sort(key=lambda d: d.num_tokens, reverse=True)  # vLLM's capture order
    mgr._candidates, mgr._capture_descs = cands, capture


def _wrap(orig: Any) -> Any:
    @functools.wraps(orig)
    def _init_candidates(self: Any) -> None:
        try:
            widths = _widths(self)
        except Exception as e:  # never break serving
            _log.warning("blockdiff: reading the served canvas width failed (%s: %s); CUDA graphs as vLLM builds "
                         "them", type(e).__name__, e)
            widths = None
        if widths is None:
            return orig(self)
        try:
            _dual_width_build(self, orig, widths)
        except Exception as e:
            _log.warning("blockdiff: building uniform-decode CUDA graphs at widths %s failed (%s: %s); CUDA "
                         "graphs as vLLM builds them (%d wide only)", widths, type(e).__name__, e, widths[1])
            self._candidates, self._capture_descs = {}, {}
            return orig(self)
        n_full = {w: sum(1 for ds in self._capture_descs.values() for d in ds if d.uniform_token_count == w)
                  for w in widths}
        _log.info("blockdiff: uniform-decode CUDA graphs at widths %s (docs/tuning.md 7.37 Fix 1): %s",
                  widths, ", ".join(f"{n} at {w}" for w, n in n_full.items()))
        return None

    setattr(_init_candidates, _MARK, True)
    return _init_candidates


def _module() -> Any:
    """vLLM's ``cudagraph_utils`` (vLLM is optional: imported only here, when called)."""
    return importlib.import_module(WRAPPED["module"])


def _missing(cu: Any) -> list[str]:
    """What of :data:`WRAPPED` the imported module ``cu`` lacks (instance attributes read from ``__init__``)."""
    cls = getattr(cu, "CudaGraphManager", None)
    if cls is None:
        return ["CudaGraphManager"]
    out = [] if callable(getattr(cls, "_init_candidates", None)) else ["CudaGraphManager._init_candidates"]
    try:
        init_src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        init_src = ""
    out += [f"CudaGraphManager.{a}" for a in WRAPPED["init_attributes"] if f"self.{a} =" not in init_src
            and f"self.{a}:" not in init_src]
    desc = getattr(cu, "BatchExecutionDescriptor", None)
    fields = {f.name for f in dataclasses.fields(desc)} if dataclasses.is_dataclass(desc) else set()
    out += [f"BatchExecutionDescriptor.{f}" for f in WRAPPED["descriptor_fields"] if f not in fields]
    return out


def install_dual_width_decode_graphs() -> bool:
    """Wrap ``CudaGraphManager._init_candidates`` (see the module docstring); idempotent.

    Returns:
        True when the wrapper is in place (now or from an earlier call); False when vLLM could not be imported or
        lacks a name of :data:`WRAPPED` (a warning is logged and vLLM is left as it is).
    """
    try:
        cu = _module()
    except Exception as e:
        _log.warning("blockdiff: cannot import vLLM's cudagraph_utils (%s: %s); CUDA graphs as vLLM builds them",
                     type(e).__name__, e)
        return False
    missing = _missing(cu)
    if missing:
        _log.warning("blockdiff: vLLM's CudaGraphManager lacks %s; uniform-decode CUDA graphs stay 2 * CL wide "
                     "only (docs/tuning.md 7.37 Fix 1 not applied)", ", ".join(missing))
        return False
    orig = cu.CudaGraphManager.__dict__.get("_init_candidates")
    if getattr(orig, _MARK, False):
        return True
    cu.CudaGraphManager._init_candidates = _wrap(cu.CudaGraphManager._init_candidates)
    return True


def is_installed() -> bool:
    """Whether the wrapper is in place (False without vLLM)."""
    try:
        cu = _module()
    except Exception:
        return False
    return bool(getattr(getattr(cu, "CudaGraphManager", None), "_init_candidates", None) and
                getattr(cu.CudaGraphManager._init_candidates, _MARK, False))


def maybe_install_for(fused_layout: bool) -> bool:
    """Install the wrapper when ``fused_layout`` is served and the installed vLLM's profile asks for it (0.26.x);
    True when it is in place. Never raises (a failure logs a warning and leaves vLLM as it is)."""
    if not fused_layout:
        return False
    try:
        from .vllm_compat import current

        if not current().dual_width_decode_graphs:
            return False
        return install_dual_width_decode_graphs()
    except Exception as e:
        _log.warning("blockdiff: uniform-decode CUDA graphs at both widths not installed (%s: %s)",
                     type(e).__name__, e)
        return False
