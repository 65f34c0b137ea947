"""The plugin's log lines reach vLLM's server log (docs/tuning.md 7.50).

vLLM's logging config gives the "vllm" logger its handler (INFO and above) and ``propagate=False``. The plugin's
modules first logged under ``blockdiff.*``, outside it: with no handler of their own their INFO lines (the fused
commits' "fused commits, ... scheduler" and "canvases the step cap commits are fused", the dual-width CUDA graphs'
widths) were dropped, and a server log grep for them (serve_fused.sh) read nothing on the GPU (2026-12-06, H100:
parity_async 6 of 6 with no fused-commit line). Every module of ``blockdiff.integration`` that logs now names its
logger ``vllm.<module>``, as vllm_model.py (``init_logger``) did. Runs without vLLM: the config is imitated.
"""
from __future__ import annotations

import ast
import importlib
import logging
import os

import pytest

import blockdiff.integration as integration

PKG = os.path.dirname(integration.__file__)


def _logger_defs():
    """(module, call source) of every module-level ``_log = ...`` in blockdiff/integration."""
    out = []
    for name in sorted(os.listdir(PKG)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(PKG, name)).read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_log" for t in node.targets):
                out.append((name[:-3], ast.unparse(node.value)))
    return out


def test_every_integration_logger_is_under_vllms_logger():
    defs = _logger_defs()
    assert len(defs) >= 5, defs  # vllm_compat, model_state, vllm_scheduler, vllm_graphs, vllm_model
    bad = [(m, src) for m, src in defs if src not in ("logging.getLogger(f'vllm.{__name__}')",
                                                       "init_logger(f'vllm.{__name__}')")]
    assert not bad, f"loggers outside vLLM's 'vllm' logger (their INFO never reaches the server log): {bad}"


@pytest.mark.parametrize("module", ["vllm_compat", "model_state", "vllm_scheduler", "vllm_graphs"])
def test_plugin_info_lines_reach_vllms_server_log_handler(module):
    """With vLLM's logging set up as vLLM sets it (a handler on "vllm" at INFO, propagate off), an INFO line of the
    module's logger reaches that handler exactly once."""
    mod = importlib.import_module(f"blockdiff.integration.{module}")
    vllm_logger = logging.getLogger("vllm")
    seen: list[logging.LogRecord] = []

    class _Server(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = _Server(logging.INFO)
    saved = (vllm_logger.level, vllm_logger.propagate, vllm_logger.handlers[:], mod._log.level, mod._log.disabled)
    try:
        vllm_logger.handlers[:] = [handler]
        vllm_logger.setLevel(logging.INFO)
        vllm_logger.propagate = False
        mod._log.setLevel(logging.NOTSET)
        mod._log.disabled = False
        mod._log.info("blockdiff: fused commits, probe")
        mod._log.debug("blockdiff: below INFO, dropped")
    finally:
        vllm_logger.setLevel(saved[0])
        vllm_logger.propagate = saved[1]
        vllm_logger.handlers[:] = saved[2]
        mod._log.setLevel(saved[3])
        mod._log.disabled = saved[4]
    assert [r.getMessage() for r in seen] == ["blockdiff: fused commits, probe"]
    assert seen[0].name == f"vllm.blockdiff.integration.{module}"


def test_integration_tests_capture_plugin_logs_with_captured_log():
    """``caplog.at_level`` alone reads nothing from the plugin's loggers once vLLM is imported (its "vllm" logger
    does not propagate to pytest's root handler), so a "no warning" assertion written that way would pass without
    testing anything in the vLLM environment. The integration tests use ``integration_helpers.captured_log``."""
    here = os.path.dirname(__file__)
    needle = "caplog." + "at_level("  # split, so this line does not match itself
    bad = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and name != "integration_helpers.py":
            for i, line in enumerate(open(os.path.join(here, name)), 1):
                if needle in line:
                    bad.append(f"{name}:{i}: {line.strip()}")
    assert not bad, "use integration_helpers.captured_log(caplog, module._log, level):\n" + "\n".join(bad)


@pytest.mark.parametrize("handler_on_parent", [False, True], ids=["pytest<9.2", "pytest>=9.2"])
def test_captured_log_counts_each_record_once_whether_or_not_pytest_put_caplogs_handler_on_the_parent(
        caplog, handler_on_parent):
    """Under a non-propagating parent (vLLM's "vllm" logger), pytest < 9.2 leaves caplog's handler on the root only,
    so captured_log must put it on the logger; pytest >= 9.2 also puts it on every non-propagating logger itself, and
    putting it on the logger as well counted every plugin warning twice (5 CPU conformance tests failed in a fresh
    venv, whose pytest was 9.2.0, with vllm_cpu_env.sh 0.26.0). Both cases: one record per log call."""
    from integration_helpers import captured_log

    parent = logging.getLogger("blockdiff_test_captured_log_parent")
    child = logging.getLogger("blockdiff_test_captured_log_parent.child")
    old = parent.propagate
    parent.propagate = False
    if handler_on_parent:
        parent.addHandler(caplog.handler)
    try:
        with captured_log(caplog, child, logging.INFO):
            child.warning("once")
        assert [r.getMessage() for r in caplog.records if r.name == child.name] == ["once"]
        assert caplog.handler not in child.handlers  # removed (or never added) after the block
    finally:
        parent.removeHandler(caplog.handler)
        parent.propagate = old
