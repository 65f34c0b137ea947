"""Tensor-parallel sampler step over a vocabulary-sharded LM head: per-shard local statistics (reference or
Triton), one all-gather of fixed-size records, and the exact combination. Semantics: docs/ARCHITECTURE.md
"Sampler semantics" (the sharded step equals the unsharded one); the algorithm: :mod:`.step`.

Modules: :mod:`.common` (shards and the exchanged records), :mod:`.reference` (dense torch local pass),
:mod:`.triton` (streaming Triton local pass), :mod:`.step` (combine, driver, backend choice).
"""
from .common import LocalStats, NUM_FIELDS, VocabShard, communication_bytes, make_shards, vocab_shard_bounds
from .reference import gumbel_noise_shard, local_statistics, soft_partial
from .step import (STATS_BACKENDS, CombinedStats, check_shards_consistent, combine_statistics, finish_step,
                   local_pass, row_inputs, sampler_step_sharded, sampler_step_tp, set_safe_nccl_env)

__all__ = [
    "VocabShard", "vocab_shard_bounds", "make_shards", "gumbel_noise_shard", "local_statistics",
    "soft_partial", "combine_statistics", "CombinedStats", "finish_step", "sampler_step_tp",
    "sampler_step_sharded", "check_shards_consistent", "set_safe_nccl_env", "NUM_FIELDS", "STATS_BACKENDS",
    "communication_bytes", "LocalStats", "local_pass", "row_inputs",
]
