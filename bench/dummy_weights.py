"""Random weights for the serving benchmark that keep the residual stream alive: vLLM's ``dummy`` load format with
every layer's ``layer_scalar`` set back to its neutral 1.0 (load format :data:`DUMMY_LIVE`).

Why (docs/tuning.md 7.21). vLLM's dummy loader (``initialize_dummy_weights``, vLLM 0.26) draws every floating tensor
of the state dict from U(-1e-3, 1e-3), persistent buffers included. Gemma 4 multiplies each layer's output (the
whole residual) by its ``layer_scalar`` buffer, so the 26B-A4B geometry's layers scale the residual by ~7e-4 each:
it is exactly 0 after layer index 14 in a CPU emulation (``bench/results/history/dummy_weights_tokens_L30_cpu.json``;
6.9e-44 after index 13, below bf16's smallest subnormal), so at least the last 15 of the 30 layers see a zero input:

- every router logit is 0, and vLLM's Gemma 4 routing kernel (a sort of the logits, ties to the lower expert id)
  sends every token to experts 0..7: those MoE layers read 8 of the 128 experts' weights (an estimate in
  docs/tuning.md 7.21: a lone canvas step's MoE at about half of what spread routing costs);
- every logit is 0, so every committed token is id 0 (``<pad>``), which vLLM's incremental detokenizer handles in
  quadratic time (docs/tuning.md 7.19).

Both sides of the benchmark run the same vLLM Gemma 4 layers, so both are equally affected; the issue's setting is
``--load-format dummy`` and stays the benchmark's default. :data:`DUMMY_LIVE` is the same draw with one change, the
value the module's constructor gives the buffer (as sglang's dummy loader keeps inverse weight scales at a neutral
1.0), so the residual keeps the embedding's scale, no router input is 0 and the logits differ by position. The
routing spreads over the experts across tokens, not as a checkpoint's: vLLM's draw gives every layer the same
router weights, so a token takes nearly the same experts in every layer; a step's expert coverage (what the weight
traffic depends on) is spread, since prompts and fresh canvases are random ids. It is a benchmark setting, not a
model: the outputs are still noise.

vLLM picks the loader up through the ``vllm.general_plugins`` entry point ``blockdiff_bench`` (:func:`register`),
which both servers load (``VLLM_PLUGINS=blockdiff_bench`` for stock vLLM, which then runs none of blockdiff's code
besides this loader; ``blockdiff,blockdiff_bench`` for blockdiff's side; :func:`blockdiff.bench.bench_serve
.server_command`).

Source: vLLM 0.26.0 ``vllm/model_executor/model_loader/dummy_loader.py`` (``DummyModelLoader``),
``weight_utils.py`` (``initialize_dummy_weights``), ``__init__.py`` (``register_model_loader``),
``vllm/model_executor/models/gemma4.py`` (``layer_scalar``, ``_gemma4_routing_kernel``).
"""
from __future__ import annotations

import torch

__all__ = ["DUMMY", "DUMMY_LIVE", "LOAD_FORMATS", "PLUGIN", "LAYER_SCALAR", "neutral_layer_scalars_",
           "emulate_vllm_dummy_init_", "vllm_routing_ids", "register"]

#: vLLM's own random-weight load format (the issue's setting; the benchmark's default).
DUMMY = "dummy"
#: :data:`DUMMY` with every ``layer_scalar`` at 1.0 (the module docstring).
DUMMY_LIVE = "dummy_live"
#: The load formats the serving benchmark runs.
LOAD_FORMATS = (DUMMY, DUMMY_LIVE)
#: Name of the ``vllm.general_plugins`` entry point whose :func:`register` adds :data:`DUMMY_LIVE` (setup.py;
#: ``bench/experiments/device/env.sh`` writes the same entry for the GPU machine's staged install).
PLUGIN = "blockdiff_bench"
#: Name of the per-layer residual scale (vLLM's ``Gemma4DecoderLayer``; blockdiff's model also has
#: ``encoder_layer_scalar``, which vLLM 0.26 does not keep apart).
LAYER_SCALAR = "layer_scalar"


@torch.no_grad()
def neutral_layer_scalars_(model: torch.nn.Module) -> int:
    """Set every buffer or parameter whose name ends in ``layer_scalar`` (``layer_scalar``,
    ``encoder_layer_scalar``) to 1.0 in place, any dtype and device (meta tensors, which hold no values, are neither
    set nor counted).

    Args:
        model: the module whose tensors are reset.

    Returns:
        How many tensors were reset (>= 1).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` has no such tensor with values (the load format would equal ``dummy``; a renamed
            buffer must fail loudly, not measure the degenerate model again).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    n = 0
    for name, t in (*model.named_buffers(), *model.named_parameters()):
        if name.rsplit(".", 1)[-1].endswith(LAYER_SCALAR) and torch.is_floating_point(t) and not t.is_meta:
            t.fill_(1.0)
            n += 1
    if n == 0:
        raise ValueError(f"model ({type(model).__name__}) has no floating tensor named *{LAYER_SCALAR}: the "
                         f"{DUMMY_LIVE!r} load format has nothing to reset (it would measure {DUMMY!r} again)")
    return n


@torch.no_grad()
def emulate_vllm_dummy_init_(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: int = 1234) -> torch.nn.Module:
    """vLLM 0.26's ``initialize_dummy_weights`` on the CPU, in place: every floating tensor of the state dict
    (persistent buffers such as ``layer_scalar`` included) drawn from U(``low``, ``high``) by a CPU generator seeded
    ``seed`` afresh for each tensor. On a GPU vLLM draws from the CUDA generator (other values, same law). For tests
    and CPU probes; returns ``model``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for t in model.state_dict().values():
        if torch.is_floating_point(t):
            t.uniform_(low, high, generator=torch.Generator().manual_seed(seed))
    return model


def vllm_routing_ids(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts vLLM 0.26's Gemma 4 routing kernel picks (``_gemma4_routing_kernel``): the float32 logits
    mapped to its sortable integer keys (larger float, smaller key; so +0.0 ranks above -0.0) and sorted ascending
    with ties to the lower expert id. ``[T, E]`` float router logits -> ``[T, top_k]`` int64 expert ids.

    Raises:
        TypeError: ``router_logits`` is not a floating tensor.
        ValueError: ``router_logits`` is not 2-D, or ``top_k`` is not in [1, E].
    """
    if not isinstance(router_logits, torch.Tensor) or not torch.is_floating_point(router_logits):
        raise TypeError("router_logits must be a floating torch.Tensor")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    e = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, {e}], got {top_k!r}")
    bits = router_logits.float().contiguous().view(torch.int32).to(torch.int64)
    # the kernel's bijection in signed int32: ~bits for a clear sign bit, bits with the sign bit cleared otherwise
    key = torch.where(bits >= 0, -bits - 1, bits + 2**31)
    order = torch.sort(key, dim=-1, stable=True).indices  # stable: equal keys keep ascending expert ids
    return order[:, :top_k]


def register() -> None:
    """vLLM general plugin (entry point ``blockdiff_bench``): registers load format :data:`DUMMY_LIVE`, vLLM's
    ``DummyModelLoader`` followed by :func:`neutral_layer_scalars_`. Needs vLLM (>= 0.26, which has
    ``register_model_loader``; vLLM loads a general plugin once per process, and a second registration
    replaces the first with a warning).

    Raises:
        ImportError: vLLM is not importable, or has no ``register_model_loader``.
    """
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class DummyLiveModelLoader(DummyModelLoader):
        """vLLM's dummy weights, then every ``layer_scalar`` at 1.0 (blockdiff.bench.dummy_weights)."""

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            neutral_layer_scalars_(model)

    register_model_loader(DUMMY_LIVE)(DummyLiveModelLoader)
