"""The serving benchmark's random-weight load formats (blockdiff.bench.dummy_weights; docs/tuning.md 7.21). The
full-depth model checks live in tests/model/test_model_forward.py (they need its metadata helpers)."""
from __future__ import annotations

import pytest
import torch

from blockdiff.bench import dummy_weights as dw


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.register_buffer("layer_scalar", torch.ones(1))


class _Model(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(n))


def test_neutral_layer_scalars_resets_every_layer_scalar_and_nothing_else():
    m = dw.emulate_vllm_dummy_init_(_Model(3))
    weights = [l.proj.weight.clone() for l in m.layers]
    assert all(0 < abs(float(l.layer_scalar)) <= 1e-3 for l in m.layers)  # vLLM's dummy draw hits the buffer too
    assert dw.neutral_layer_scalars_(m) == 3
    assert all(float(l.layer_scalar) == 1.0 for l in m.layers)
    assert all(torch.equal(w, l.proj.weight) for w, l in zip(weights, m.layers))
    bf = _Model(1).to(torch.bfloat16)
    bf.layers[0].layer_scalar.fill_(0.5)
    assert dw.neutral_layer_scalars_(bf) == 1 and bf.layers[0].layer_scalar.dtype == torch.bfloat16
    assert float(bf.layers[0].layer_scalar) == 1.0
    with torch.device("meta"):
        meta = _Model(2)
    with pytest.raises(ValueError, match="no floating tensor named"):  # meta tensors hold no values to set
        dw.neutral_layer_scalars_(meta)


def test_neutral_layer_scalars_refuses_a_model_without_them():
    """A renamed buffer must not silently measure the degenerate dummy model again."""
    with pytest.raises(ValueError, match="no floating tensor named \\*layer_scalar"):
        dw.neutral_layer_scalars_(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dw.neutral_layer_scalars_({"layer_scalar": torch.ones(1)})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dw.emulate_vllm_dummy_init_(torch.ones(3))


def test_emulated_dummy_init_draws_each_tensor_from_a_fresh_seed_like_vllm():
    """vLLM's values depend only on a tensor's size (one generator seeded 1234 per tensor): equal-sized tensors
    are equal, every value within [-1e-3, 1e-3]."""
    m = dw.emulate_vllm_dummy_init_(_Model(2))
    a, b = (l.proj.weight for l in m.layers)
    assert torch.equal(a, b) and a.abs().max() <= 1e-3 and a.std() > 1e-4
    assert float(m.layers[0].layer_scalar) == float(m.layers[1].layer_scalar)


def test_vllm_routing_breaks_ties_to_the_lower_expert_id():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.1, 0.3, 0.3, -1.0], [-0.0, 0.0, 1e-30, 0.0],
                           [-2.0, -1.0, -3.0, -1e-30]])
    # the kernel's integer keys rank +0.0 above -0.0 (row 3), negative logits by value (row 4)
    assert dw.vllm_routing_ids(logits, 2).tolist() == [[0, 1], [1, 2], [2, 1], [3, 1]]
    assert dw.vllm_routing_ids(logits, 4)[2].tolist() == [2, 1, 3, 0]
    # non-finite logits as the kernel's keys order them: a positive NaN above +inf, a negative NaN below -inf
    odd = torch.tensor([[1.0, float("inf"), float("nan"), -float("inf"), 0.0]])
    odd[0, 4] = -odd[0, 2]  # torch's negation sets the NaN's sign bit
    assert dw.vllm_routing_ids(odd, 5).tolist() == [[2, 1, 0, 3, 4]]
    assert dw.vllm_routing_ids(logits.to(torch.bfloat16), 4)[0].tolist() == [0, 1, 2, 3]
    for bad, kw, err, match in ((torch.zeros(3), {}, ValueError, "must be \\[T, E\\]"),
                                (torch.zeros(2, 4, dtype=torch.int32), {}, TypeError, "floating"),
                                (torch.zeros(2, 4), {"top_k": 5}, ValueError, "top_k must be an int in \\[1, 4\\]"),
                                (torch.zeros(2, 4), {"top_k": True}, ValueError, "top_k")):
        with pytest.raises(err, match=match):
            dw.vllm_routing_ids(bad, kw.get("top_k", 2))


def test_the_benchmarks_load_formats():
    assert dw.LOAD_FORMATS == ("dummy", "dummy_live") and dw.DUMMY == "dummy"


def test_the_load_format_plugin_entry_point_is_declared():
    """Both servers load it by name (VLLM_PLUGINS=blockdiff_bench; bench_serve.server_command)."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "blockdiff_bench"]
    assert eps and eps[0].value == "blockdiff.bench.dummy_weights:register"


def _vllm_026():
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return None
    return vllm if vllm.__version__.startswith("0.26.") else None


@pytest.mark.skipif(_vllm_026() is None, reason="vLLM 0.26's Python packages are not importable here")
def test_vllm_0_26_loads_dummy_live_as_its_dummy_weights_with_neutral_layer_scalars(monkeypatch):
    """The plugin registers the format with vLLM's own registry; its loader draws vLLM's dummy weights (through
    vLLM's DummyModelLoader) and then sets the layer scalars to 1.0."""
    import vllm.model_executor.model_loader as loaders
    import vllm.platforms
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    # vLLM's registry is a module global: this test's registration is undone afterwards, and one made earlier in the
    # process (AsyncEngineArgs.add_cli_args loads the general plugins: test_bench_serve) is left out of its copy
    monkeypatch.setattr(loaders, "_LOAD_FORMAT_TO_MODEL_LOADER",
                        {k: v for k, v in loaders._LOAD_FORMAT_TO_MODEL_LOADER.items() if k != "dummy_live"})
    with pytest.raises(ValueError, match="not supported"):
        get_model_loader(LoadConfig(load_format="dummy_live"))
    dw.register()
    loader = get_model_loader(LoadConfig(load_format="dummy_live"))
    assert isinstance(loader, DummyModelLoader) and type(loader) is not DummyModelLoader
    m = _Model(2)
    loader.load_weights(m, None)
    assert all(float(l.layer_scalar) == 1.0 for l in m.layers)
    w = m.layers[0].proj.weight
    assert w.abs().max() <= 1e-3 and w.std() > 1e-4  # vLLM's dummy draw
    plain = _Model(2)
    get_model_loader(LoadConfig(load_format="dummy")).load_weights(plain, None)
    assert torch.equal(plain.layers[0].proj.weight, w) and abs(float(plain.layers[0].layer_scalar)) <= 1e-3


_LOAD_BY_PLUGIN = """
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()
from vllm.plugins import load_general_plugins
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
load_general_plugins()
print("LOADER", type(get_model_loader(LoadConfig(load_format="dummy_live"))).__name__)
import sys
from vllm import ModelRegistry
print("MODULES", sorted(m for m in sys.modules if m.startswith("blockdiff")))
print("MODEL", ModelRegistry.models["DiffusionGemmaForBlockDiffusion"].module_name)
"""


@pytest.mark.skipif(_vllm_026() is None, reason="vLLM 0.26's Python packages are not importable here")
def test_vllm_finds_dummy_live_through_the_plugin_the_stock_server_loads():
    """What stock vLLM's server does with VLLM_PLUGINS=blockdiff_bench: the entry point registers the format and
    nothing of blockdiff's model or attention."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _LOAD_BY_PLUGIN], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_PLUGINS="blockdiff_bench"))
    assert p.returncode == 0 and "LOADER DummyLiveModelLoader" in p.stdout, p.stdout[-1500:] + p.stderr[-3000:]
    assert "MODULES ['blockdiff', 'blockdiff.bench', 'blockdiff.bench.dummy_weights']" in p.stdout, p.stdout[-1500:]
    assert "MODEL vllm.model_executor.models.diffusion_gemma" in p.stdout, p.stdout[-1500:]
