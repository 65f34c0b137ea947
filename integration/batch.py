"""Harness stand-ins for the vLLM model runner v2 objects the ModelState hooks read.

:class:`HarnessInputBatch` carries the subset of ``vllm.v1.worker.gpu.input_batch.InputBatch`` (vLLM 0.33.0)
that :class:`~blockdiff.integration.model_state.DiffusionModelState` and
:class:`~blockdiff.integration.sampler.DiffusionSampler` read, under the same field names, so the hooks run
unchanged on vLLM's batch and on the harness's. :class:`NewRequest` mirrors the fields of vLLM's
``NewRequestData`` that ``add_request`` reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class NewRequest:
    """A request as ``ModelState.add_request`` sees it (subset of vLLM's ``NewRequestData``).

    Attributes:
        req_id: unique request id (str).
        prompt_token_ids: prompt token ids (list of int, length >= 1).
        sampling_params: a :class:`blockdiff.sampler.SamplingParams` (or a vLLM ``SamplingParams``).
        prefill_token_ids: the tokens to prefill: the prompt for a new request (the default), the prompt followed
            by the tokens already generated for a request resumed after preemption (model runner v2's
            ``NewRequestData.prefill_token_ids``).
        rng_request_id: the request's RNG identity, a non-empty str, or None (the default: the one
            :func:`~blockdiff.integration.vllm_params.rng_request_id` reads from ``sampling_params``, else ``req_id``).
            Not a field of vLLM's ``NewRequestData``: the harness sets it from a vLLM-style request's ``extra_args``
            ``rng_request_id``, which the blockdiff ``SamplingParams`` it passes as ``sampling_params`` cannot carry.
            Read by the model state in harness mode only (under vLLM, ``extra_args`` alone keys the noise).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    prefill_token_ids: list[int] | None = None
    rng_request_id: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_token_ids is None:
            self.prefill_token_ids = self.prompt_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class HarnessInputBatch:
    """One flat mixed batch (vLLM ``InputBatch`` field names; host arrays end in ``_np``).

    Attributes:
        req_ids: request id per row (list of str, length N).
        num_reqs, num_tokens: N rows, T scheduled tokens (host ints). ``*_after_padding`` equal them here.
        idx_mapping: ``[N]`` int64 device, the state slot of each row; ``idx_mapping_np`` its host copy.
        num_scheduled_tokens: ``[N]`` int32 host, query tokens per row.
        query_start_loc: ``[N+1]`` int32 device (= cu_seqlens_q); ``query_start_loc_np`` host copy.
        seq_lens: ``[N]`` int32 device, keys per row including its query tokens; ``seq_lens_np`` host copy.
        num_computed_tokens_np: ``[N]`` int32 host, KV length before this step (tokens).
        prefill_len_np: ``[N]`` int32 host, prompt length.
        num_computed_prefill_tokens_np: ``[N]`` int32 host, prompt tokens already in the KV cache.
        is_prefilling_np: ``[N]`` bool host, the row is a prompt chunk.
        input_ids: ``[T]`` int64 device; prompt tokens for prefill rows (canvas rows are filled by
            ``prepare_inputs`` from the device state).
        positions: ``[T]`` int64 device, absolute position of each query token.
        slot_mapping: ``[T]`` int64 device, KV cache slot of each query token.
        block_table: ``[N, max_blocks]`` int32 device, each row's pages.
        logits_indices: ``[T]`` int64 device (every token: the harness model returns all logits).
        cu_num_logits_np: ``[N+1]`` int32 host, logits rows per batch row (prefix sums).
        num_draft_tokens: host int, canvas tokens scheduled in denoise/commit rows (vLLM schedules a canvas
            as draft tokens).
        max_query_len, max_seq_len: host ints for grid sizing.
    """

    req_ids: list[str]
    num_reqs: int
    num_tokens: int
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    seq_lens_np: np.ndarray
    num_computed_tokens_np: np.ndarray
    prefill_len_np: np.ndarray
    num_computed_prefill_tokens_np: np.ndarray
    is_prefilling_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    logits_indices: torch.Tensor
    cu_num_logits_np: np.ndarray
    num_draft_tokens: int
    max_query_len: int
    max_seq_len: int
    extra: dict = field(default_factory=dict)

    @property
    def num_reqs_after_padding(self) -> int:
        return self.num_reqs

    @property
    def num_tokens_after_padding(self) -> int:
        return self.num_tokens

    @property
    def seq_lens_cpu_upper_bound(self) -> torch.Tensor:
        return torch.from_numpy(self.seq_lens_np)
