"""The one parser of the boolean ``BLOCKDIFF_*`` switches (attention/env.py) and every switch read through it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blockdiff.attention.env import env_flag

BAD = ("true", "yes", "on", "off", "false", "no", " 1", "1 ", "2", "TRUE")


def test_env_flag_accepts_exactly_1_0_empty_and_unset():
    assert env_flag("BLOCKDIFF_X", {}) is False
    assert env_flag("BLOCKDIFF_X", {"BLOCKDIFF_X": ""}) is False
    assert env_flag("BLOCKDIFF_X", {"BLOCKDIFF_X": "0"}) is False
    assert env_flag("BLOCKDIFF_X", {"BLOCKDIFF_X": "1"}) is True


@pytest.mark.parametrize("bad", BAD)
def test_env_flag_refuses_any_other_value_naming_the_variable(bad):
    with pytest.raises(ValueError, match=r"BLOCKDIFF_X must be 1 .* got"):
        env_flag("BLOCKDIFF_X", {"BLOCKDIFF_X": bad})


def test_env_flag_name_must_be_a_str():
    with pytest.raises(TypeError, match="name"):
        env_flag(1, {})


def test_env_flag_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("BLOCKDIFF_X", "1")
    assert env_flag("BLOCKDIFF_X") is True


def test_check_values_env_refuses_an_unknown_value_at_import():
    """BLOCKDIFF_CHECK_VALUES=true was silently on (and any typo too); now the switch takes env_flag's values."""
    code = "import blockdiff.attention"
    env = dict(os.environ, BLOCKDIFF_CHECK_VALUES="true")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ValueError: BLOCKDIFF_CHECK_VALUES must be 1" in r.stderr, r.stderr


def test_profile_compiles_env_refuses_an_unknown_value(monkeypatch):
    """BLOCKDIFF_PROFILE_COMPILES=yes was silently off; now register() refuses it (before registering anything)."""
    from blockdiff.integration import vllm_plugin

    monkeypatch.setenv(vllm_plugin.PROFILE_COMPILES_ENV, "yes")
    with pytest.raises((ValueError, ImportError), match="BLOCKDIFF_PROFILE_COMPILES must be 1|needs vLLM"):
        vllm_plugin.register()


def test_fuse_commit_env_is_read_by_env_flag():
    from blockdiff.integration import vllm_scheduler as VS

    for v, want in (("1", True), ("0", False), ("", False)):
        assert VS.fuse_commit_from_env({VS.FUSE_COMMIT_ENV: v}) is want
    with pytest.raises(ValueError, match=f"{VS.FUSE_COMMIT_ENV} must be 1 \\(fused commits\\)"):
        VS.fuse_commit_from_env({VS.FUSE_COMMIT_ENV: "on"})


def test_standin_platform_env_refuses_an_unknown_value(monkeypatch):
    from blockdiff.bench.experiments import serve_standin

    monkeypatch.setenv(serve_standin.PLATFORM_ENV, "1")
    assert serve_standin.platform_plugin() == serve_standin.PLATFORM_CLASS
    monkeypatch.setenv(serve_standin.PLATFORM_ENV, "0")
    assert serve_standin.platform_plugin() is None
    monkeypatch.setenv(serve_standin.PLATFORM_ENV, "yes")  # SystemExit: vLLM would swallow a ValueError (dd5a35d)
    with pytest.raises(SystemExit, match="BLOCKDIFF_STANDIN_PLATFORM must be 1"):
        serve_standin.platform_plugin()


def test_a_bad_check_values_switch_stops_vllms_plugin_load_instead_of_skipping_the_plugin():
    """vLLM's plugin loader only logs a plugin module that fails to import ("Failed to load plugin blockdiff") and
    serves without it. The plugin module imported blockdiff.attention at its top, so BLOCKDIFF_CHECK_VALUES=true
    (accepted as on before env_flag) silently dropped blockdiff's model class and attention backend; now the module
    imports, and register() raises the ValueError, which vLLM does not catch."""
    import importlib.util

    env = dict(os.environ, BLOCKDIFF_CHECK_VALUES="true")
    code = "import blockdiff.integration.vllm_plugin"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here: the loader half needs it (tests/integration/vllm_cpu_env.sh)")
    code = "import vllm.plugins as p; p.load_general_plugins()"
    env["VLLM_PLUGINS"] = "blockdiff"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "ValueError: BLOCKDIFF_CHECK_VALUES must be 1" in r.stderr, r.stderr[-3000:]
    assert "Failed to load plugin blockdiff" not in r.stderr


TRITON_VALUES = ("1", "0", "", "true", "TRUE", "True", "yes", "on", "ON", "y", "Y", "false", "no", "off", "2", " 1",
                 "1 ", "t", "enable")


def test_triton_interpret_reads_the_variable_as_triton_does(monkeypatch):
    """``TRITON_INTERPRET`` is Triton's variable: the library read it as "set and not 0", so ``false`` / ``no`` /
    ``off`` (Triton compiles) counted as the interpreter (the triton backend then took the interpreter's tiles and
    kernel paths on a GPU, and let CPU tensors reach a compiled kernel), while the cute tile order refused ``true``
    (Triton interprets) on the CPU. Every reader of it (attention, the sampler's mirror, the demo) now agrees with
    Triton's own reading, value by value."""
    from triton import knobs

    from blockdiff.attention.cute.tile_order_triton import batch_work_order_triton  # noqa: F401 (imports cleanly)
    from blockdiff.attention.env import TRITON_INTERPRET_ON, triton_interpret
    from blockdiff.attention.split_merge import interpreting
    from blockdiff.sampler.triton import common as sampler_common
    assert sampler_common.TRITON_INTERPRET_ON == TRITON_INTERPRET_ON
    for v in TRITON_VALUES:
        monkeypatch.setenv("TRITON_INTERPRET", v)
        want = bool(knobs.runtime.interpret)
        assert triton_interpret() is want and interpreting() is want and sampler_common.interpret_mode() is want, v
        assert triton_interpret({"TRITON_INTERPRET": v}) is want
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_interpret() is False is bool(knobs.runtime.interpret)


def test_cute_tile_order_on_the_cpu_takes_any_value_triton_interprets(monkeypatch):
    """``TRITON_INTERPRET=true`` runs Triton's interpreter; the one-launch tile order refused CPU tensors unless the
    value was exactly ``1``. (Triton decides at import, here ``1`` from tests/conftest.py: the check alone changes.)"""
    import torch

    from blockdiff.attention.cute.tile_order import batch_work_order
    from blockdiff.attention.cute.tile_order_triton import batch_work_order_triton
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    sl, ncq = torch.tensor([20, 10], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert torch.equal(batch_work_order_triton(cu, sl, ncq), batch_work_order(cu, sl, ncq))
    monkeypatch.setenv("TRITON_INTERPRET", "false")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        batch_work_order_triton(cu, sl, ncq)
