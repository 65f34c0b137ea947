"""DiffusionModelState: the vLLM model runner v2 ``ModelState`` hooks for block-diffusion models.

Interface: ``vllm/v1/worker/gpu/model_states/interface.py`` of vLLM 0.33.0 (``ModelState``; the runner calls
``add_request`` -> ``prepare_inputs_embeds`` / ``prepare_inputs`` -> ``prepare_attn`` -> forward -> sampler ->
``postprocess_state``; ``remove_request`` when a request finishes; ``custom_sampler`` once after loading).
When vLLM is importable :class:`DiffusionModelState` subclasses vLLM's ``ModelState``; otherwise a plain base
class with the same methods (:class:`ModelStateBase`). Semantics: docs/ARCHITECTURE.md "Integration and vLLM
accounting" and "Sampler semantics".

Per-request state lives in a preallocated :class:`blockdiff.sampler.SamplerState` (device tensors indexed by
slot = vLLM's ``req_index``), updated in place by the sampler. Each step:

* ``prepare_inputs`` writes the flat ``input_ids`` (prompt chunk for prefill rows, the current canvas for
  denoise rows, the committed argmax canvas for commit rows) and the self-conditioning input (the previous
  step's soft embedding for denoise tokens, exactly zero elsewhere) into persistent buffers, from the device
  state, with no host sync;
* ``prepare_attn`` fills a persistent per-request ``causal`` buffer from the phase (prefill and commit rows
  causal, denoise rows bidirectional) and returns the attention metadata.

vLLM accounting (spec-decode path, ``num_new_sampled_tokens_per_step = 0``): prefill rows report
``num_sampled = 0``; denoise rows ``num_sampled = 0`` and ``num_rejected = query_len`` (the KV position does not
move); commit rows ``num_sampled = canvas_length``.

Fused commit (opt-in, :attr:`DiffusionModelState.fuse_commit`): a COMMIT row scheduled with ``2 * canvas_length``
query tokens commits its canvas (the first CL rows, causal, writing its KV) and takes the first denoising step of
the next canvas (the last CL rows, bidirectional, a fresh canvas) in the same forward pass; it is accounted as CL
accepted and CL rejected drafts (``num_sampled = num_rejected = canvas_length``). Under vLLM (``--diffusion-config``
canvas_length ``2 * CL``, ``BLOCKDIFF_FUSE_COMMIT=1``) the sampler flags the requests whose next row may be fused
(``num_nans = -1``), the plugin's scheduler (:mod:`blockdiff.integration.vllm_scheduler`) schedules ``2 * CL``
tokens (synchronous: after the flag; asynchronous: the row after a canvas's step-capped last step, predicted from
its step count), and ``prepare_attn`` attaches the causal row counts to the attention metadata (integration/README.md
"Fused commits under vLLM"). A wide row that turns out not to be a COMMIT is stalled (state untouched, all drafts
rejected), one whose commit ends the request commits and its tail is a no-op.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import numbers
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from blockdiff.attention import AttentionMetadata
from blockdiff.sampler import COMMIT, DENOISE, FAILED, FINISHED, PREFILL  # phases of SamplerState.phase
from blockdiff.sampler import SamplerState
from blockdiff.sampler.common import fresh_canvas
from blockdiff.sampler.state import check_resume

from .annotate import annotated
from .sampler import DiffusionSampler, commit_finishes_vec
# the request-parameter rules, shared with the plugin's scheduler (which applies them first, at add_request); the
# names stay importable from here
from .vllm_params import (_VLLM_PARAM_ATTRS, MAX_STOP_TOKEN_IDS, UNSUPPORTED_VLLM_OPTIONS,  # noqa: F401
                          VLLM_EXTRA_ARGS, VLLM_RNG_REQUEST_ID, check_stop_token_count, is_vllm_warmup_request_id,
                          rng_request_id, stop_token_ids_of, to_diffusion_params, unsupported_vllm_options,
                          vllm_request_params)
from .vllm_scheduler import (FUSE_COMMIT_ENV, FUSE_NEXT_FLAG, fuse_commit_from_env, served_canvas_length,
                             served_default_params)
from .vllm_graphs import maybe_install_for as install_decode_graph_widths

_log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's "vllm" logger: its handler prints INFO to the server log

try:  # vLLM is optional: subclass its ModelState when present.
    from vllm.v1.worker.gpu.model_states.interface import ModelState as _VllmModelState  # type: ignore

    VLLM_AVAILABLE = True
    VLLM_IMPORT_ERROR: str | None = None
except Exception as _e:  # ImportError, or a broken install raising something else
    _VllmModelState = None
    VLLM_AVAILABLE = False
    VLLM_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"


class ModelStateBase:
    """Stand-in for vLLM's ``ModelState`` when vLLM is not installed: the same hooks and defaults.

    Method names, parameters and defaults follow vLLM 0.33.0's ``ModelState``
    (tests/integration/vllm_0_33_0_model_state_interface.json records them).
    """

    supports_prompt_embeds: ClassVar[bool] = False
    num_new_sampled_tokens_per_step: int = 1

    def __init__(self, vllm_config: Any, model: torch.nn.Module, encoder_cache: Any, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.device = device

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        return None

    def remove_request(self, req_id: str) -> None:
        return None

    def apply_staged_writes(self) -> None:
        return None

    def postprocess_state(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                          num_computed_tokens: torch.Tensor | None = None) -> None:
        return None

    def prepare_inputs_embeds(self, scheduled_encoder_inputs: dict[str, list[int]], input_batch: Any,
                              req_states: Any) -> torch.Tensor | None:
        raise NotImplementedError

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor | None:
        return None

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        raise NotImplementedError

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def prepare_attn(self, input_batch: Any, cudagraph_mode: Any, block_tables: tuple[torch.Tensor, ...],
                     slot_mappings: torch.Tensor, attn_groups: Any, kv_cache_config: Any,
                     for_capture: bool = False, ubatch_idx: int = 0) -> Any:
        raise NotImplementedError

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any] | None:
        return None


_Base = _VllmModelState if VLLM_AVAILABLE else ModelStateBase

#: Initial per-slot width of the stop-id buffer (``SamplerState.eos_token_ids``); it grows on demand.
DEFAULT_MAX_STOP_TOKEN_IDS = 16


def request_key(req_id: str) -> int:
    """Stable int64 RNG key of a request id (blake2b, 63 bits): the same request draws the same noise in any
    batch and any slot (batch invariance). Any str hashes: one holding a lone surrogate (``"\\ud800"``: Python's
    json module decodes that JSON escape to one) is encoded with ``surrogatepass``, which leaves the UTF-8 bytes,
    and so the key, of every other str unchanged (was: UnicodeEncodeError out of ``add_request``, outside its
    refusal path, taking the engine down)."""
    if not isinstance(req_id, str):
        raise TypeError(f"req_id must be a str, got {type(req_id).__name__}")
    data = req_id.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & (2 ** 63 - 1)


def _rng_id_of(new_req_data: Any, default: str) -> str:
    """``new_req_data.rng_request_id`` (the harness's :class:`~blockdiff.integration.batch.NewRequest`: a vLLM-style
    request's RNG identity) when set, else ``default``. Harness mode only (:meth:`DiffusionModelState.add_request`).

    Raises:
        TypeError: it is not a str. ValueError: it is the empty string.
    """
    v = getattr(new_req_data, "rng_request_id", None)
    if v is None:
        return default
    if not isinstance(v, str):
        raise TypeError(f"rng_request_id must be a str (the request's RNG identity), got {type(v).__name__} ({v!r})")
    if not v:
        raise ValueError("rng_request_id must not be empty")
    return v


def _vllm_raises_on_logit_nans() -> bool:
    """Whether vLLM's ``VLLM_RAISE_ON_LOGIT_NANS`` is on: vLLM 0.33.0's runner then raises on any nonzero
    ``num_nans_in_logits`` value (``raise_if_nan_logits``), the fused-commit flag -1 included. False where vLLM has
    no such variable (0.26.0)."""
    import vllm.envs as envs  # type: ignore  # vLLM mode only

    try:
        return bool(envs.VLLM_RAISE_ON_LOGIT_NANS)
    except AttributeError:
        return False


def _plugin_scheduler(vllm_config: Any) -> bool | None:
    """Whether ``vllm_config.scheduler_config.scheduler_cls`` is one of the plugin's schedulers
    (:mod:`blockdiff.integration.vllm_scheduler`, or a subclass); None when the config names no scheduler class
    at all (not a vLLM ``SchedulerConfig``). Unset (vLLM's own) is False."""
    sc = getattr(vllm_config, "scheduler_config", None)
    if sc is None or not hasattr(sc, "scheduler_cls"):
        return None
    cls = sc.scheduler_cls
    if cls is None:
        return False
    if isinstance(cls, str):  # a qualified name, as vLLM resolves it
        module, _, name = cls.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    from . import vllm_scheduler

    return isinstance(cls, type) and issubclass(cls, (vllm_scheduler.BlockdiffDiffusionScheduler,
                                                     vllm_scheduler.BlockdiffDiffusionAsyncScheduler))


def attach_num_causal_q(attn_metadata: Any, num_causal_q: torch.Tensor) -> None:
    """Set ``_blockdiff_num_causal_q`` = ``num_causal_q`` on every metadata object of ``attn_metadata`` (what
    ``build_attn_metadata`` returns: a dict layer name -> metadata, objects shared between layers; a list of such
    dicts; or one metadata object). The CUSTOM backend reads that attribute instead of the per-request causal flags.

    Raises:
        TypeError: ``num_causal_q`` is not an int32 tensor.
        NotImplementedError: a metadata object takes no new attribute (frozen or slotted class).
    """
    if not torch.is_tensor(num_causal_q) or num_causal_q.dtype != torch.int32:
        raise TypeError(f"num_causal_q must be an int32 tensor, got {getattr(num_causal_q, 'dtype', type(num_causal_q))}")
    seen: set[int] = set()
    stack = [attn_metadata]
    while stack:
        m = stack.pop()
        if isinstance(m, Mapping):
            stack.extend(m.values())
        elif isinstance(m, (list, tuple)):
            stack.extend(m)
        elif m is not None and id(m) not in seen:
            seen.add(id(m))
            try:
                m._blockdiff_num_causal_q = num_causal_q
            except (AttributeError, TypeError) as e:
                raise NotImplementedError(
                    f"fuse_commit under vLLM: attention metadata of type {type(m).__name__} takes no "
                    f"_blockdiff_num_causal_q ({e}); the CUSTOM backend would read causal flags, not row counts") from e


class DiffusionModelState(_Base):
    """ModelState of a block-diffusion LM (DiffusionGemma): encoder (causal, writes KV) and decoder
    (bidirectional over the canvas, KV read-only) passes share one flat batch.

    Two ways to build it:

    * by vLLM: ``DiffusionModelState(vllm_config, model, encoder_cache, device)`` (model runner v2 calls this
      after ``model.get_model_state_cls()``); canvas length from ``vllm_config.diffusion_config``, or the
      checkpoint's when the diffusion config's is twice that (the fused-commit layout,
      :func:`~blockdiff.integration.vllm_scheduler.served_canvas_length`; ``ValueError`` unless ``--scheduler-cls``
      is one of the plugin's schedulers, which cut the rows to CL: vLLM's own would schedule every canvas
      ``2 * CL`` tokens), where ``BLOCKDIFF_FUSE_COMMIT=1`` turns
      :attr:`fuse_commit` on (``ValueError`` for a value other than ``1`` / ``0`` / unset, and for ``1`` together
      with vLLM's ``VLLM_RAISE_ON_LOGIT_NANS=1``, under which vLLM 0.33.0 raises on the -1 flag). In the
      one-canvas layout too a ``--scheduler-cls`` other than the plugin's is a ``ValueError``: vLLM's own never
      finishes a request whose next canvas passes ``max_model_len``, nor a failed one;
    * by the harness: :meth:`for_harness` (no vLLM objects).

    Attributes:
        state: :class:`blockdiff.sampler.SamplerState` over ``max_num_reqs`` slots.
        causal_buf: ``[max_num_reqs]`` bool, persistent per-row causal flags (filled by ``prepare_attn``).
        num_causal_q_buf: ``[max_num_reqs]`` int32, persistent causal row counts (vLLM mode with
            :attr:`fuse_commit`: filled by ``prepare_attn``, :meth:`fill_num_causal_q`).
        input_ids_buf: ``[max_num_tokens]`` int64; self_cond_buf: ``[max_num_tokens, hidden]`` fp32.
        num_computed_tokens: ``[max_num_reqs]`` int32, KV length per slot as of the last
            ``postprocess_state`` (tokens).
        req_id_to_index: host dict req_id -> slot.
    """

    supports_prompt_embeds: ClassVar[bool] = False
    num_new_sampled_tokens_per_step: int = 0

    def __init__(self, vllm_config: Any, model: torch.nn.Module, encoder_cache: Any, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        if not VLLM_AVAILABLE:
            raise TypeError("DiffusionModelState(vllm_config, ...) needs vLLM; without it use "
                            "DiffusionModelState.for_harness(model, ...)")
        dcfg = getattr(vllm_config, "diffusion_config", None)
        # CL: the diffusion config's, or the checkpoint's when the config is twice that (the fused-commit layout)
        canvas_length, fused_layout = served_canvas_length(vllm_config)
        install_decode_graph_widths(fused_layout)  # vLLM 0.26: FULL graphs CL and 2 * CL wide (tuning 7.37)
        text_cfg = self.model_config.hf_text_config
        # the served defaults, built as the plugin's scheduler builds them to refuse requests at add_request
        defaults = served_default_params(vllm_config, self.model_config.try_get_generation_config() or {})
        self._init_diffusion(
            mode="vllm", max_num_reqs=self.max_num_reqs, max_num_tokens=self.max_num_tokens,
            canvas_length=canvas_length, vocab_size=self.model_config.get_vocab_size(),
            hidden_size=text_cfg.hidden_size, default_params=defaults, embed_dtype=self.dtype)
        if _plugin_scheduler(vllm_config) is False:  # in every layout; the fused one gets its own reason
            got = getattr(vllm_config.scheduler_config, 'scheduler_cls', None)
            if fused_layout:
                raise ValueError(
                    f"--diffusion-config canvas_length {2 * canvas_length} is twice the checkpoint's ({canvas_length}: "
                    f"the fused-commit layout), which needs the plugin's scheduler: pass --scheduler-cls "
                    f"blockdiff.integration.vllm_scheduler.BlockdiffDiffusionScheduler (--no-async-scheduling) or "
                    f"BlockdiffDiffusionAsyncScheduler; vLLM's own schedules every canvas {2 * canvas_length} tokens, "
                    f"which no request could progress on (got --scheduler-cls {got!r})")
            raise ValueError(
                f"blockdiff's model state needs the plugin's scheduler: pass --scheduler-cls "
                f"blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler (or BlockdiffDiffusionScheduler "
                f"with --no-async-scheduling). vLLM's own never finishes a request whose next canvas passes "
                f"max_model_len (it schedules a truncated canvas, which cannot be denoised) nor one whose logits "
                f"failed (num_nans): such requests would be scheduled forever (got --scheduler-cls {got!r})")
        if fuse_commit_from_env():
            if not fused_layout:
                _log.warning("blockdiff: %s=1 but the diffusion config's canvas_length (%s) is not twice the "
                             "checkpoint's; fused commits stay off (serve with --diffusion-config "
                             "'{\"canvas_length\": %d}')", FUSE_COMMIT_ENV, getattr(dcfg, "canvas_length", None),
                             2 * canvas_length)
            else:
                if _vllm_raises_on_logit_nans():
                    raise ValueError(f"{FUSE_COMMIT_ENV}=1 cannot run with VLLM_RAISE_ON_LOGIT_NANS=1: vLLM's runner "
                                     f"then raises on any nonzero num_nans_in_logits, and fused commits report "
                                     f"{FUSE_NEXT_FLAG} there (unset one of the two)")
                if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
                    # BlockdiffDiffusionAsyncScheduler counts each request's denoising steps and schedules the row
                    # after a canvas's step-capped last step 2 * CL wide (vllm_scheduler.FusedCommitPredictor)
                    _log.info("blockdiff: fused commits under the asynchronous scheduler: canvases the step cap "
                              "commits are fused, canvases that converge earlier commit plain")
                self.fuse_commit = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_harness(cls, model: torch.nn.Module, *, max_num_reqs: int, max_num_tokens: int, canvas_length: int,
                    device: torch.device | str, default_params: Any = None,
                    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
                    fuse_commit: bool = False) -> "DiffusionModelState":
        """Build the state without vLLM (harness, tests, demo).

        Args:
            model: a :class:`blockdiff.model.DiffusionGemma` (reads ``model.config.vocab_size`` and
                ``hidden_size``).
            max_num_reqs: request slots (>= 1). max_num_tokens: token capacity of one step (>= canvas_length).
            canvas_length: CL, tokens per canvas (>= 1).
            device: where the state lives.
            default_params: :class:`blockdiff.sampler.SamplingParams` used for vLLM-style params.
            max_stop_token_ids: initial width of the per-slot stop-id buffer (>= 1); a request with more stop ids
                grows it (see :meth:`reserve_stop_token_ids`).
            fuse_commit: accept fused commit rows (:attr:`fuse_commit`), a bool; default False.

        Raises:
            ValueError: a capacity < 1, or max_num_tokens < canvas_length.
            TypeError: ``fuse_commit`` is not a bool.
        """
        self = cls.__new__(cls)
        self.vllm_config = None
        self.model = model
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        cfg = model.config
        self._init_diffusion(mode="harness", max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                             canvas_length=canvas_length, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                             default_params=default_params, embed_dtype=torch.float32,
                             max_stop_token_ids=max_stop_token_ids)
        self.fuse_commit = fuse_commit
        return self

    def _init_diffusion(self, *, mode, max_num_reqs, max_num_tokens, canvas_length, vocab_size, hidden_size,
                        default_params, embed_dtype, max_stop_token_ids=DEFAULT_MAX_STOP_TOKEN_IDS) -> None:
        for name, v in (("max_num_reqs", max_num_reqs), ("max_num_tokens", max_num_tokens),
                        ("canvas_length", canvas_length), ("max_stop_token_ids", max_stop_token_ids)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if max_num_tokens < canvas_length:
            raise ValueError(f"max_num_tokens ({max_num_tokens}) must be >= canvas_length ({canvas_length}): "
                             "a denoise row schedules a whole canvas")
        self.mode = mode
        self._fuse_commit = False
        self.canvas_length = canvas_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.default_params = default_params
        dev = self.device
        self.state = SamplerState(max_num_reqs, canvas_length, vocab_size, hidden_size, dev, max_eos=max_stop_token_ids)
        self.req_id_to_index: dict[str, int] = {}
        self.failed_reasons: dict[str, str] = {}  # vLLM mode: requests failed at admission (bad params) -> why
        self.causal_buf = torch.zeros(max_num_reqs, dtype=torch.bool, device=dev)
        # fused commits under vLLM: causal rows per request, filled in place and attached to the attention metadata
        self.num_causal_q_buf = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)
        # one spare element past the slots: postprocess_state writes vLLM's masked (-1) entries there
        self._num_computed_ext = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=dev)
        self.num_computed_tokens = self._num_computed_ext[:max_num_reqs]
        self.input_ids_buf = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.positions_buf = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.self_cond_buf = torch.zeros(max_num_tokens, hidden_size, dtype=torch.float32, device=dev)
        self._arange = torch.arange(max_num_tokens, dtype=torch.int64, device=dev)
        if mode == "vllm":
            # vLLM's FlashAttention metadata builder takes the per-request causal flags as int32, in place.
            self.causal_buf_i32 = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)
            self.inputs_embeds_buf = torch.zeros(max_num_tokens, hidden_size, dtype=embed_dtype, device=dev)

    # ------------------------------------------------------------------ requests
    @annotated("blockdiff:add_request")
    def add_request(self, req_index: int, new_req_data: Any) -> None:
        """Claim slot ``req_index`` for a new or resumed request: phase PREFILL, params stored as device tensors.

        A request vLLM preempted comes back here (model runner v2 removes a preempted request and re-adds it
        through ``scheduled_new_reqs``, with ``prefill_token_ids`` = prompt + the tokens it already generated, and
        re-prefills all of them). The tokens after the prompt count as emitted (toward ``max_tokens``) and the next
        canvas continues the request's RNG stream at canvas index ``ceil(num_generated / canvas_length)`` (every
        commit but a request's last emits a whole canvas), so a resumed request yields what it would have
        without the preemption (the canvas in progress at preemption restarts from its step 0, as it began).

        Args:
            req_index: slot in [0, max_num_reqs).
            new_req_data: has ``req_id`` (str), ``prompt_token_ids`` and ``sampling_params`` (blockdiff or vLLM
                SamplingParams); optional ``prefill_token_ids`` (prompt + generated tokens of a resumed request;
                None or the prompt for a new one). The request's noise is keyed by :func:`request_key` of
                :func:`rng_request_id` (``extra_args["rng_request_id"]`` of a vLLM request, else ``req_id``), or in
                the harness by ``new_req_data.rng_request_id`` where that is set (its
                :class:`~blockdiff.integration.batch.NewRequest`; not read under vLLM, whose ``NewRequestData``
                has no such field: the plugin's scheduler and the worker key a request alike).

        Under vLLM the plugin's scheduler refuses a request whose sampling parameters blockdiff refuses (e.g.
        ``extra_args`` with t_min > t_max) before it is scheduled, by the same checks
        (:func:`~blockdiff.integration.vllm_params.vllm_request_params`) and defaults
        (:func:`~blockdiff.integration.vllm_scheduler.served_default_params`), the reason in the client's output
        under vLLM 0.33.0 (:class:`~blockdiff.integration.vllm_scheduler.ParamsRefusals`). Here they run again as the
        backstop: such a request does not raise (an exception here would take the engine and every request down):
        it gets phase FAILED with the reason in ``failed_reasons[req_id]`` (and the worker's log), so the sampler
        reports it in ``num_nans`` and the plugin's scheduler finishes it with finish reason ``error``.

        Raises:
            ValueError: slot out of range, slot already held by another live request, duplicate req_id, empty
                prompt, ``prefill_token_ids`` not starting with the prompt; in the harness also a canvas length
                other than the served one, a stop id outside the vocabulary, another SamplingParams rule broken, a
                ``new_req_data.rng_request_id`` that is not a non-empty str (a TypeError for a non-str), or
                ``prefill_token_ids`` already holding ``max_tokens`` generated tokens
                (:func:`blockdiff.sampler.state.check_resume`; under vLLM such a request is FAILED, as refused
                parameters are).
        """
        if isinstance(req_index, bool) or not isinstance(req_index, int) or not 0 <= req_index < self.max_num_reqs:
            raise ValueError(f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}")
        req_id = new_req_data.req_id
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in slot {self.req_id_to_index[req_id]}")
        if req_index in self.req_id_to_index.values():
            raise ValueError(f"slot {req_index} is held by another request; remove it first")
        prompt = getattr(new_req_data, "prompt_token_ids", None)
        if prompt is not None and len(prompt) == 0:
            raise ValueError(f"request {req_id!r}: prompt_token_ids must not be empty")
        num_generated = 0
        prefill = getattr(new_req_data, "prefill_token_ids", None)
        if prefill is not None and prompt is not None:
            num_generated = len(prefill) - len(prompt)
            if num_generated < 0 or list(prefill[: len(prompt)]) != list(prompt):
                raise ValueError(f"request {req_id!r}: prefill_token_ids ({len(prefill)} tokens) must be the prompt "
                                 f"({len(prompt)} tokens) followed by the tokens already generated")
        CL = self.canvas_length
        warmup = self.mode == "vllm" and is_vllm_warmup_request_id(req_id)
        try:
            if warmup:  # vLLM's start-up dummy: the served defaults (_VLLM_WARMUP_REQ_ID)
                params, rng_id = self.default_params, req_id
            else:
                # the checks the plugin's scheduler ran at its add_request already (vllm_params): the backstop
                params, rng_id = vllm_request_params(new_req_data.sampling_params, req_id, self.default_params,
                                                     canvas_length=CL, vocab_size=self.vocab_size)
                # the harness's NewRequest carries a vLLM-style request's RNG identity beside the blockdiff
                # SamplingParams it converted the request to; vLLM's NewRequestData has no such field, and an
                # attribute of that name on it (another vLLM) is not ours: under vLLM extra_args alone keys the noise
                if self.mode != "vllm":
                    rng_id = _rng_id_of(new_req_data, rng_id)
            self.reserve_stop_token_ids(len(params.eos_token_ids))
            self.state.check_params(params)
            check_resume(params, num_generated)  # a resumed request with all its tokens: fail it, never lose it
            failed = None
        except (TypeError, ValueError) as e:
            if self.mode != "vllm":
                raise
            params, rng_id = self.default_params, req_id
            failed = f"request {req_id!r} refused: {type(e).__name__}: {e}"
        resumed = num_generated if failed is None else 0  # a FAILED slot never runs: its counters do not matter
        self.state.add_request(req_index, request_key(rng_id), params, num_emitted=resumed,
                               canvas_index=-(-resumed // CL))
        if failed is not None:
            self.state.phase[req_index] = FAILED
            self.failed_reasons[req_id] = failed
            _log.warning("blockdiff: %s; it fails (finish reason 'error')", failed)
        self.num_computed_tokens[req_index] = 0
        self.req_id_to_index[req_id] = req_index

    def reserve_stop_token_ids(self, n: int) -> None:
        """Make room for ``n`` stop ids per request (grows ``state.eos_token_ids``, see
        :meth:`blockdiff.sampler.SamplerState.reserve_eos`: a CUDA graph that captured the sampler step before a
        growth must be recaptured; vLLM runs the sampler outside its graphs).

        Raises:
            ValueError: ``n`` above :data:`MAX_STOP_TOKEN_IDS` (nothing grows), or negative. TypeError: ``n`` not an
                int (:meth:`blockdiff.sampler.SamplerState.reserve_eos`).
        """
        check_stop_token_count(n)
        self.state.reserve_eos(n)

    def check_params(self, params: Any) -> None:
        """Raise unless :meth:`add_request` would accept ``params`` (a blockdiff SamplingParams), making room for its
        stop ids first (:meth:`reserve_stop_token_ids`). For callers that queue requests (the harness).

        Raises:
            TypeError / ValueError: as :meth:`blockdiff.sampler.SamplerState.check_params`.
        """
        n = len(getattr(params, "eos_token_ids", ()) or ())
        self.reserve_stop_token_ids(n)
        self.state.check_params(params)

    @annotated("blockdiff:remove_request")
    def remove_request(self, req_id: str) -> None:
        """Free the slot of ``req_id`` (unknown ids are ignored, as vLLM calls this for any finished id)."""
        idx = self.req_id_to_index.pop(req_id, None)
        self.failed_reasons.pop(req_id, None)
        if idx is not None:
            self.state.remove_request(idx)
            self.num_computed_tokens[idx] = 0

    def get_supported_generation_tasks(self):
        return ("generate",)

    # ------------------------------------------------------------------ fused commit
    @property
    def fuse_commit(self) -> bool:
        """Whether a COMMIT row may be scheduled *fused*: ``2 * canvas_length`` query tokens, the commit's CL
        causal rows (the argmax canvas, writing its KV at ``[ctx, ctx + CL)``) followed by the first denoising step
        of the request's next canvas (CL bidirectional rows: the fresh canvas of ``canvas_index + 1``, no
        self-conditioning input, reading the context and the canvas just committed). The sampler commits the row,
        then runs the next canvas's step 0 on the last CL logits rows; the row reports ``num_sampled = CL``
        (accepted drafts: the committed canvas) and ``num_rejected = CL`` (the next canvas), so the KV position
        moves by CL. A scheduler fuses only a commit that does not finish its request (:meth:`commit_finishes`)
        and whose next canvas fits. Default False: a canvas row must then carry exactly CL tokens. Under vLLM it is
        set at construction (class docstring); the sampler then reports ``num_nans = -1`` for a request whose
        next row may be fused, and ``prepare_attn`` attaches :attr:`num_causal_q_buf` to the metadata.

        Raises (setter):
            TypeError: the value is not a bool.
        """
        return self._fuse_commit

    @fuse_commit.setter
    def fuse_commit(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"fuse_commit must be a bool, got {type(value).__name__} ({value!r})")
        self._fuse_commit = value

    def commit_finishes(self, req_index: int) -> bool:
        """Whether the commit of slot ``req_index``'s converged canvas (``state.commit_canvas``) ends its request
        (a stop id inside the canvas, or ``max_tokens`` reached), exactly as the sampler's commit decides it. A
        scheduler fuses only a commit that does not (:attr:`fuse_commit`): the last canvas of a request is a
        plain commit. Reads the slot's state on the host (a device sync on a GPU).

        Raises:
            ValueError: ``req_index`` is not an int in ``[0, max_num_reqs)`` or its slot is not in phase COMMIT.
        """
        if isinstance(req_index, bool) or not isinstance(req_index, int) or not 0 <= req_index < self.max_num_reqs:
            raise ValueError(f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}")
        st = self.state
        if int(st.phase[req_index]) != COMMIT:
            raise ValueError(f"slot {req_index} is not in phase COMMIT (phase {int(st.phase[req_index])})")
        # the one rule, shared with the vLLM worker's flag (commit_finishes_vec); one host read
        return bool(commit_finishes_vec(st, torch.tensor([req_index], dtype=torch.int64, device=st.phase.device)))

    def fused_rows_np(self, input_batch: Any):
        """``[N]`` bool host array: the rows of ``input_batch`` scheduled as fused commits (:attr:`fuse_commit` on,
        the prompt prefilled before the step, ``2 * canvas_length`` query tokens), from host data only (no sync).
        All False when :attr:`fuse_commit` is off."""
        N = input_batch.num_reqs
        if not self._fuse_commit:
            return np.zeros(N, dtype=bool)
        q = np.asarray(input_batch.num_scheduled_tokens[:N], dtype=np.int64)
        done = np.asarray(input_batch.num_computed_prefill_tokens_np[:N], dtype=np.int64)
        plen = np.asarray(input_batch.prefill_len_np[:N], dtype=np.int64)
        return (done >= plen) & (q == 2 * self.canvas_length)

    # ------------------------------------------------------------------ inputs
    def prepare_inputs_embeds(self, scheduled_encoder_inputs: dict[str, list[int]], input_batch: Any,
                              req_states: Any) -> torch.Tensor | None:
        """No multimodal inputs: the embeddings are built in :meth:`prepare_inputs`. Returns None."""
        return None

    def get_mm_embeddings(self, scheduled_encoder_inputs: dict[str, list[int]], input_batch: Any,
                          req_states: Any) -> torch.Tensor | None:
        """vLLM 0.26.0's name of :meth:`prepare_inputs_embeds` (see :mod:`blockdiff.integration.vllm_compat`)."""
        return self.prepare_inputs_embeds(scheduled_encoder_inputs, input_batch, req_states)

    def _token_views(self, input_batch: Any, *, with_rows: bool = False):
        """Per-token (slot, offset in row clamped to the canvas, phase) on the device, from query_start_loc (no
        host sync); ``with_rows``: also the token's row index and its unclamped offset in the row."""
        T, N = input_batch.num_tokens, input_batch.num_reqs
        CL = self.canvas_length
        ar = self._arange[:T]
        qsl = input_batch.query_start_loc[: N + 1].to(torch.int64)
        row = torch.searchsorted(qsl[1:], ar, right=True).clamp_(max=max(N - 1, 0))
        slots_tok = input_batch.idx_mapping[:N].to(torch.int64)[row]
        raw = ar - qsl[row]
        off = raw.clamp(min=0, max=CL - 1)
        phase_tok = self.state.phase[slots_tok]
        if with_rows:
            return slots_tok, off, phase_tok, row, raw
        return slots_tok, off, phase_tok

    @annotated("blockdiff:prepare_inputs")
    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        """Write this step's model inputs into persistent buffers from the device state.

        Args:
            input_batch: the step's batch (``num_tokens``, ``num_reqs``, ``idx_mapping`` [N] slots,
                ``query_start_loc`` [N+1] int32, ``input_ids`` [T] int64 with prompt chunks, ``positions``).
            req_states: vLLM's ``RequestState`` (unused; None in the harness).

        Returns:
            harness: ``{"input_ids": [T] int64, "positions": [T] int64, "self_cond": [T, hidden] fp32}``;
            vLLM: ``{"inputs_embeds": [T, hidden]}`` (embedding + self-conditioning MLP on denoise tokens).
            Denoise tokens read ``state.canvas``, commit tokens ``state.commit_canvas``, prefill tokens keep
            ``input_batch.input_ids``; ``self_cond`` is ``state.soft`` on denoise tokens and exactly 0 elsewhere.
            With :attr:`fuse_commit`, the tokens after the first CL of a fused commit row (a COMMIT row of ``2 * CL``
            tokens; under vLLM also one the token budget cut to fewer) read the fresh canvas of the request's next canvas (``canvas_index + 1``, the INITIAL stream:
            what the commit's sampler step starts) with ``self_cond`` 0, and count as decoder tokens.
        """
        T = input_batch.num_tokens
        ids = self.input_ids_buf[:T]
        sc = self.self_cond_buf[:T]
        if T == 0:
            return self._inputs_dict(input_batch, ids, sc, None)
        st = self.state
        # a row wider than a canvas (host data): a fused commit row, or under vLLM one whose tail the budget cut
        wide = self._fuse_commit and bool(
            (np.asarray(input_batch.num_scheduled_tokens[: input_batch.num_reqs]) > self.canvas_length).any())
        if wide:
            slots_tok, off, phase_tok, row, raw = self._token_views(input_batch, with_rows=True)
        else:
            slots_tok, off, phase_tok = self._token_views(input_batch)
        is_den = phase_tok == DENOISE
        is_com = phase_tok == COMMIT
        canvas_tok = st.canvas[slots_tok, off]
        commit_tok = st.commit_canvas[slots_tok, off]
        if wide:
            CL = self.canvas_length
            tail = is_com & (raw >= CL)  # the next canvas's first step of a fused commit row
            N = input_batch.num_reqs
            slots = input_batch.idx_mapping[:N].to(torch.int64)
            nxt = fresh_canvas(st, slots, st.canvas_index[slots] + 1)  # [N, CL], what the commit will start
            canvas_tok = torch.where(tail, nxt[row, (raw - CL).clamp(min=0, max=CL - 1)], canvas_tok)
            is_den_in = is_den | tail  # tokens whose input is a canvas being denoised
        else:
            is_den_in = is_den
        ids.copy_(torch.where(is_den_in, canvas_tok,
                              torch.where(is_com, commit_tok, input_batch.input_ids[:T].to(torch.int64))))
        soft = st.soft[slots_tok, off]
        sc.copy_(torch.where(is_den[:, None], soft, torch.zeros((), dtype=soft.dtype, device=soft.device)))
        return self._inputs_dict(input_batch, ids, sc, is_den_in)

    def _inputs_dict(self, input_batch, ids, sc, is_den) -> dict[str, Any]:
        T = ids.shape[0]
        if self.mode == "harness":
            pos = self.positions_buf[:T]
            pos.copy_(input_batch.positions[:T])
            return {"input_ids": ids, "positions": pos, "self_cond": sc}
        # vLLM: the model takes inputs_embeds; self-conditioning MLP applied on denoise tokens only.
        emb = self.inputs_embeds_buf[:T]
        if T:
            e = self.model.embed_input_ids(ids)
            sc_mod = getattr(self.model, "self_conditioning", None)
            if sc_mod is not None:
                e = torch.where(is_den[:, None], sc_mod(e, sc.to(e.dtype)), e)
            emb.copy_(e)
        return {"inputs_embeds": emb}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        """Slices of the same persistent buffers ``prepare_inputs`` writes (CUDA-graph capture path)."""
        if self.mode == "harness":
            return {"input_ids": self.input_ids_buf[:num_tokens], "positions": self.positions_buf[:num_tokens],
                    "self_cond": self.self_cond_buf[:num_tokens]}
        return {"inputs_embeds": self.inputs_embeds_buf[:num_tokens]}

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor | None:
        return self.inputs_embeds_buf[:num_tokens] if self.mode == "vllm" else None

    # ------------------------------------------------------------------ attention
    def num_causal_q(self, input_batch: Any) -> torch.Tensor:
        """``[N]`` int32 device tensor: causal query rows per row of ``input_batch`` from the phase (no host
        sync): prefill rows and FINISHED / FAILED rows all their rows, DENOISE rows 0, COMMIT rows
        ``min(query_len, canvas_length)`` (a fused commit row: its CL commit rows, then CL bidirectional rows).
        The attention metadata carries it when :attr:`fuse_commit` is on (harness: ``num_causal_q``; vLLM:
        :meth:`fill_num_causal_q`)."""
        n = input_batch.num_reqs
        slots = input_batch.idx_mapping[:n].to(torch.int64)
        qsl = input_batch.query_start_loc[: n + 1].to(torch.int64)
        q = qsl[1:] - qsl[:-1]
        ph = self.state.phase[slots]
        ncq = torch.where(ph == DENOISE, torch.zeros_like(q),
                          torch.where(ph == COMMIT, q.clamp(max=self.canvas_length), q))
        return ncq.to(torch.int32)

    def _check_num_reqs(self, n: int, num_reqs: int | None) -> int:
        """``num_reqs`` (None: ``n``), the padded row count of a step of ``n`` rows, checked against the
        persistent per-row buffers (ValueError naming it)."""
        num_reqs = n if num_reqs is None else num_reqs
        cap = self.causal_buf.shape[0]
        if isinstance(num_reqs, bool) or not isinstance(num_reqs, numbers.Integral) or not n <= num_reqs <= cap:
            raise ValueError(f"num_reqs must be in [{n}, {cap}], got {num_reqs!r}")
        return int(num_reqs)

    def fill_causal(self, input_batch: Any, num_reqs: int | None = None) -> torch.Tensor:
        """Fill ``causal_buf[:N]`` in place from the phase of each row's slot (PREFILL/COMMIT -> True,
        DENOISE -> False); padding rows up to ``num_reqs`` get False. Returns ``causal_buf[:num_reqs]``.

        Raises:
            ValueError: ``num_reqs`` below the batch's ``num_reqs`` or above the buffer's capacity.
        """
        n = input_batch.num_reqs
        num_reqs = self._check_num_reqs(n, num_reqs)
        slots = input_batch.idx_mapping[:n].to(torch.int64)
        self.causal_buf[:n].copy_(self.state.phase[slots] != DENOISE)
        if num_reqs > n:
            self.causal_buf[n:num_reqs] = False
        return self.causal_buf[:num_reqs]

    @annotated("blockdiff:prepare_attn")
    def prepare_attn(self, input_batch: Any, cudagraph_mode: Any, block_tables: tuple[torch.Tensor, ...],
                     slot_mappings: torch.Tensor, attn_groups: Any, kv_cache_config: Any,
                     for_capture: bool = False, ubatch_idx: int = 0) -> Any:
        """Attention metadata of the step with per-request causal flags from the phase.

        Args:
            input_batch: the step's batch (``query_start_loc``, ``seq_lens``, ``idx_mapping``, host
                ``max_query_len`` / ``max_seq_len``).
            cudagraph_mode: vLLM's CUDAGraphMode (None in the harness).
            block_tables: tuple per KV-cache group of ``[N, max_blocks]`` int32 (the harness has one group; vLLM
                gathers ``num_reqs_after_padding`` rows, cut here to the metadata's rows).
            slot_mappings: ``[T]`` int64 KV slots of the query tokens.
            attn_groups, kv_cache_config: vLLM objects (None in the harness).
            for_capture: capture with worst-case ``max_seqlen_k`` (harness: ``max_num_tokens`` bound unused).
            ubatch_idx: must be 0 (no dual-batch overlap).

        Returns:
            harness: :class:`blockdiff.attention.AttentionMetadata` (with :attr:`fuse_commit` also
            ``num_causal_q``, :meth:`num_causal_q`, which the model and attention then read instead of
            ``causal``); vLLM: the per-layer metadata dict of ``vllm.v1.worker.gpu.attn_utils.build_attn_metadata``
            with ``causal=`` this buffer; with :attr:`fuse_commit` every metadata object also carries
            ``_blockdiff_num_causal_q`` = ``num_causal_q_buf[:num_reqs]`` (``[num_reqs]`` int32, :meth:`num_causal_q`
            written in place, padding rows 0, also when capturing a CUDA graph), which the CUSTOM backend
            (:class:`~blockdiff.integration.vllm_attention.BlockdiffAttentionImpl`) reads instead of ``causal``.

        Raises:
            ValueError: ubatch_idx != 0.
            NotImplementedError: vLLM mode with :attr:`fuse_commit` on and a metadata object that takes no new
                attribute (the row counts could not reach the attention backend).
        """
        if ubatch_idx != 0:
            raise ValueError(f"ubatch_idx must be 0 (dual-batch overlap is not supported), got {ubatch_idx}")
        n = input_batch.num_reqs
        if self.mode == "harness":
            causal = self.fill_causal(input_batch)
            ncq = self.num_causal_q(input_batch) if self._fuse_commit else None
            return AttentionMetadata(
                cu_seqlens_q=input_batch.query_start_loc[: n + 1], seq_lens=input_batch.seq_lens[:n],
                causal=causal, block_table=block_tables[0][:n], slot_mapping=slot_mappings,
                max_seqlen_q=int(input_batch.max_query_len), max_seqlen_k=int(input_batch.max_seq_len),
                num_causal_q=ncq)
        # vLLM is optional: imported only in vLLM mode
        from vllm.config.compilation import CUDAGraphMode  # type: ignore
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata  # type: ignore

        full = cudagraph_mode == CUDAGraphMode.FULL
        num_reqs = input_batch.num_reqs_after_padding if full else n
        num_tokens = input_batch.num_tokens_after_padding if full else input_batch.num_tokens
        self.fill_causal(input_batch, num_reqs)
        causal = self.causal_buf_i32[:num_reqs]
        causal.copy_(self.causal_buf[:num_reqs])
        ncq = self.fill_num_causal_q(input_batch, num_reqs) if self._fuse_commit else None
        meta = build_attn_metadata(
            attn_groups=attn_groups, num_reqs=num_reqs, num_tokens=num_tokens,
            # the row starts and block tables of the metadata's num_reqs rows: vLLM 0.26 pads a PIECEWISE step's
            # rows too under VLLM_USE_BREAKABLE_CUDAGRAPH=1 (query_start_loc and the gathered block tables have
            # num_reqs_after_padding rows; FlashAttention's builder keeps the block tables whole) while the metadata
            # here is the real rows' (its break-point attention runs eagerly on them); blockdiff's attention wants
            # one block-table row per sequence. A no-op under FULL (padded rows throughout) and without padding.
            query_start_loc_gpu=input_batch.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=torch.from_numpy(input_batch.query_start_loc_np[: num_reqs + 1]),
            max_query_len=int(input_batch.num_scheduled_tokens.max()), seq_lens=input_batch.seq_lens,
            max_seq_len=self.max_model_len, block_tables=tuple(bt[:num_reqs] for bt in block_tables),
            slot_mappings=slot_mappings,
            kv_cache_config=kv_cache_config, causal=causal, for_cudagraph_capture=for_capture)
        if ncq is not None:
            attach_num_causal_q(meta, ncq)
        return meta

    def fill_num_causal_q(self, input_batch: Any, num_reqs: int | None = None) -> torch.Tensor:
        """Fill ``num_causal_q_buf[:N]`` in place with :meth:`num_causal_q` (no host sync; the same storage every
        step, so a CUDA graph captured on it replays with the step's counts); padding rows up to ``num_reqs`` get 0.
        Returns ``num_causal_q_buf[:num_reqs]`` (``[num_reqs]`` int32).

        Raises:
            ValueError: ``num_reqs`` below the batch's ``num_reqs`` or above the buffer's capacity.
        """
        n = input_batch.num_reqs
        num_reqs = self._check_num_reqs(n, num_reqs)
        buf = self.num_causal_q_buf
        if n:
            buf[:n].copy_(self.num_causal_q(input_batch))
        if num_reqs > n:
            buf[n:num_reqs] = 0
        return buf[:num_reqs]

    # ------------------------------------------------------------------ after the sampler
    @annotated("blockdiff:postprocess_state")
    def postprocess_state(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                          num_computed_tokens: torch.Tensor | None = None) -> None:
        """Record each row's KV length after the step (``num_computed_tokens`` [max_num_reqs] int32, indexed
        by slot, as vLLM's runner passes it). The sampler already updated the diffusion state in place."""
        if num_computed_tokens is None or not torch.is_tensor(idx_mapping) or idx_mapping.numel() == 0:
            return None
        slots = idx_mapping.to(torch.int64)
        R = self.num_computed_tokens.shape[0]
        valid = slots >= 0  # vLLM may pass -1 for masked entries
        src = torch.where(valid, slots, torch.zeros_like(slots))
        # masked entries write the spare element R, never a live slot: index_copy_ with a repeated index keeps any
        # one of the writes (was: masked entries rewrote slot 0 with its old value, so a step of idx_mapping
        # [0, -1] could leave slot 0's KV length stale)
        dst = torch.where(valid, slots, torch.full_like(slots, R))
        self._num_computed_ext.index_copy_(0, dst, num_computed_tokens[src].to(torch.int32))
        return None

    def custom_sampler(self, sampler: Any, *, embedding: torch.Tensor | None = None,
                       backend: str | None = None) -> tuple[Any, Any] | None:
        """The diffusion sampler and no rejection sampler: ``(DiffusionSampler, None)``.

        Args:
            sampler: vLLM's base sampler (kept for its per-request states under vLLM; None in the harness).
            embedding: tied embedding E ``[V, hidden]`` for self-conditioning (default: the model's
                ``embedding_weight``, else ``embed_tokens.weight``).
            backend: sampler backend (``"reference"`` or ``"triton"``); default ``"reference"`` in the harness
                and ``$BLOCKDIFF_SAMPLER_BACKEND`` (default ``"triton"``) under vLLM.
        """
        if backend is None:
            backend = os.environ.get("BLOCKDIFF_SAMPLER_BACKEND", "triton") if self.mode == "vllm" else "reference"

        if embedding is None:
            embedding = getattr(self.model, "embedding_weight", None)
            if embedding is None:
                embedding = self.model.model.embed_tokens.weight
        return DiffusionSampler(self, embedding=embedding, backend=backend, base_sampler=sampler), None
