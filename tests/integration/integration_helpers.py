"""Helpers of the integration tests (imported by conftest.py and the test modules)."""
from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from blockdiff.integration.batch import HarnessInputBatch

try:
    from blockdiff.sampler import SamplerState, SamplingParams, sampler_step  # noqa: F401
    from blockdiff.model import DiffusionGemma, tiny_config  # noqa: F401

    _MISSING = None
except ImportError as e:  # the sampler / model packages land separately
    _MISSING = f"blockdiff.sampler / blockdiff.model API not available yet: {e}"

needs_stack = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

CL = 8  # canvas length used by the harness tests (small: fast on 2 CPU cores)


def params(**kw):
    base = dict(canvas_length=CL, max_denoising_steps=3, seed=7)
    base.update(kw)
    return SamplingParams(**base)


def prompt(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def make_batch(rows):
    """rows: (req_id, slot, q_len, ctx, prompt_len, prompt_tokens or None)."""
    N = len(rows)
    q = np.array([r[2] for r in rows], dtype=np.int32)
    ctx = np.array([r[3] for r in rows], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    T = int(qsl[-1])
    ids = np.zeros(T, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    pf = np.zeros(N, dtype=bool)
    for i, r in enumerate(rows):
        pos[qsl[i]: qsl[i + 1]] = np.arange(ctx[i], ctx[i] + q[i])
        if r[5] is not None:
            ids[qsl[i]: qsl[i + 1]] = r[5]
            pf[i] = True
    slots = np.array([r[1] for r in rows], dtype=np.int64)
    plen = np.array([r[4] for r in rows], dtype=np.int32)
    t = torch.as_tensor
    return HarnessInputBatch(
        req_ids=[r[0] for r in rows], num_reqs=N, num_tokens=T, idx_mapping=t(slots), idx_mapping_np=slots,
        num_scheduled_tokens=q, query_start_loc=t(qsl), query_start_loc_np=qsl, seq_lens=t(ctx + q),
        seq_lens_np=ctx + q, num_computed_tokens_np=ctx, prefill_len_np=plen,
        num_computed_prefill_tokens_np=np.minimum(ctx, plen), is_prefilling_np=pf, input_ids=t(ids),
        positions=t(pos), slot_mapping=t(np.arange(T, dtype=np.int64)),
        block_table=torch.zeros(N, 64, dtype=torch.int32), logits_indices=torch.arange(T),
        cu_num_logits_np=qsl.copy(), num_draft_tokens=int(q[~pf].sum()), max_query_len=int(q.max()),
        max_seq_len=int((ctx + q).max()))


def vllm_sampler_output_class(monkeypatch):
    """vLLM's SamplerOutput class: the real one when vLLM is importable, else a stand-in module with the same
    fields (vllm/v1/worker/gpu/sample/output.py, the same in 0.26.0 and 0.33.0) put in ``sys.modules`` through
    ``monkeypatch``, so the vLLM-mode sampler path runs on CPU CI."""
    import importlib.util
    import sys
    import types
    from dataclasses import dataclass

    stub = sys.modules.get("vllm.v1.worker.gpu.sample.output")
    if stub is not None and getattr(stub, "__spec__", None) is None and hasattr(stub, "SamplerOutput"):
        return stub.SamplerOutput  # installed by an earlier call of this test
    try:
        have_vllm = importlib.util.find_spec("vllm") is not None
    except ValueError:  # a stand-in module (vllm_attn_metadata_stubs), no __spec__
        have_vllm = False
    if have_vllm:
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        return SamplerOutput

    @dataclass
    class SamplerOutput:
        sampled_token_ids: torch.Tensor
        logprobs_tensors: object
        num_nans: object
        num_sampled: torch.Tensor
        num_rejected: torch.Tensor

    names = ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample",
             "vllm.v1.worker.gpu.sample.output"]
    for n in names:
        if n not in sys.modules:
            monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    sys.modules["vllm.v1.worker.gpu.sample.output"].SamplerOutput = SamplerOutput
    return SamplerOutput


def vllm_attn_metadata_stubs(monkeypatch):
    """Stand in for vLLM's ``build_attn_metadata`` (and ``CUDAGraphMode`` without vLLM), so the vLLM-mode
    ``prepare_attn`` runs on the CPU: returns the list of keyword dicts of its calls; each call returns
    ``{"layer.0": m, "layer.1": m, "layer.2": m2}`` (two metadata objects, one shared by two layers, as vLLM's
    attention groups share one)."""
    import importlib.util
    import sys
    import types
    from enum import Enum

    calls = []

    def build_attn_metadata(**kw):
        calls.append(kw)
        m, m2 = NS(causal=kw["causal"]), NS(causal=kw["causal"])
        return {"layer.0": m, "layer.1": m, "layer.2": m2}

    try:
        have_vllm = importlib.util.find_spec("vllm") is not None
    except ValueError:  # a stand-in module of vllm_sampler_output_class (no __spec__)
        have_vllm = False
    if have_vllm:
        import vllm.v1.worker.gpu.attn_utils as au

        monkeypatch.setattr(au, "build_attn_metadata", build_attn_metadata)
        return calls

    class CUDAGraphMode(Enum):
        NONE = 0
        PIECEWISE = 1
        FULL = 2

    for n in ["vllm", "vllm.config", "vllm.config.compilation", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
              "vllm.v1.worker.gpu.attn_utils"]:
        if n not in sys.modules:
            monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setattr(sys.modules["vllm.config.compilation"], "CUDAGraphMode", CUDAGraphMode, raising=False)
    monkeypatch.setattr(sys.modules["vllm.v1.worker.gpu.attn_utils"], "build_attn_metadata", build_attn_metadata,
                        raising=False)
    return calls


# ------------------------------------------------------------------------------------- scheduler stand-ins
class FakeRequest:
    """What finish_stuck_requests reads of vLLM's Request."""

    def __init__(self, rid, num_tokens, width=None):
        self.request_id, self.num_tokens, self.status = rid, num_tokens, "RUNNING"
        self.client_index, self.stop_reason, self.num_nans_in_logits = 0, None, 0
        self.sampling_params = NS(extra_args={"diffusion_canvas_length": width} if width else None)

    def is_finished(self):
        return self.status != "RUNNING"

    def get_finished_reason(self):
        return {"FINISHED_ERROR": "error", "FINISHED_LENGTH_CAPPED": "length"}.get(self.status)

    def take_events(self):
        return None


class FakeScheduler:
    """What finish_stuck_requests reads of vLLM's Scheduler (requests, running, max_model_len, num_spec_tokens,
    finish_requests -> finished_req_ids for the worker)."""

    def __init__(self, reqs, max_model_len, canvas):
        self.requests = {r.request_id: r for r in reqs}
        self.running = list(reqs)
        self.max_model_len, self.num_spec_tokens = max_model_len, canvas
        self.finished_req_ids = set()

    def finish_requests(self, ids, status):
        done = []
        for rid in ids:
            r = self.requests.get(rid)
            if r is None or r.is_finished():
                continue
            r.status = status
            self.running.remove(r)
            self.finished_req_ids.add(rid)
            done.append(r)
        return done


def _fake_types():
    class Outputs:
        def __init__(self, outputs):
            self.outputs = outputs

    return NS(RequestStatus=NS(FINISHED_ERROR="FINISHED_ERROR", FINISHED_LENGTH_CAPPED="FINISHED_LENGTH_CAPPED"),
              EngineCoreOutput=lambda **kw: NS(**kw), EngineCoreOutputs=Outputs)


FAKE_VLLM_TYPES = _fake_types()


def _reaches_handler(logger: logging.Logger, handler: logging.Handler) -> bool:
    """Whether a record of ``logger`` reaches ``handler``: the handler sits on ``logger`` or on a logger above it
    that the record propagates to (up to and including the first one with ``propagate=False``, or the root)."""
    c = logger
    while c is not None:
        if handler in c.handlers:
            return True
        if not c.propagate:
            return False
        c = c.parent
    return False


@contextlib.contextmanager
def captured_log(caplog, logger: logging.Logger, level: int = logging.INFO):
    """caplog's records of ``logger`` at ``level`` and above. The plugin's loggers live under vLLM's "vllm" logger
    (docs/tuning.md 7.50), which vLLM's logging config sets to ``propagate=False`` once vLLM is imported, so
    pytest's root-logger handler alone would read nothing: then caplog's handler goes on ``logger`` itself for the
    block (each record still once; a failing test's report does not show them). Without vLLM, plain
    ``caplog.at_level``. Use this, not ``caplog.at_level``, for the integration's loggers
    (test_plugin_logging checks). pytest >= 9.2 itself puts caplog's handler on every non-propagating logger (vLLM's
    "vllm" once vLLM is imported): a record that already reaches the handler is not given a second way to it (it
    would be counted twice)."""
    attach = not _reaches_handler(logger, caplog.handler)
    old_level = logger.level
    if attach:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger=logger.name):
            yield caplog
    finally:
        if attach:
            logger.removeHandler(caplog.handler)
        logger.setLevel(old_level)
