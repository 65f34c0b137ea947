"""Every list of attention (and sampler) backends outside their packages agrees with the registry
(``blockdiff.attention.BACKENDS``, ``blockdiff.sampler.BACKENDS``), so a backend registered there is reachable from
the command line, the vLLM plugin, training and the benchmark, or left out for a reason stated here
(docs/ARCHITECTURE.md section 3, "Adding an attention backend", step 5).

Where the import is cheap and the layering allows it, the list is the registry, read: ``model/train.py``'s ``attn_backend`` rule and the names ``bench_attention
--backends`` takes. The rest keep a literal this file checks:

- ``integration/cli.py``'s ``ATTENTION_BACKENDS`` / ``SAMPLER_BACKENDS``: the CLI imports only the standard library
  at its top, so that argument errors exit before torch loads (tests/integration/test_cli.py); the registries import
  torch.
- ``vllm_plugin.ATTN_BACKENDS``: the plugin module must import without ``blockdiff.attention``, whose environment
  switches raise at import: vLLM's plugin loader only logs a module that fails to import and serves without it
  (tests/attention/test_env.py), so a bad switch must fail in ``register()`` instead.
- ``integration/vllm_attention.py``'s ``MAX_HEAD_SIZE`` / ``DTYPES``: facts about each backend, one row per served
  backend; read with ``ast`` (the module imports vLLM, absent from the CPU suite).
- ``bench/bench_attention.py``'s ``ALL_BACKENDS``: the default GPU run, a measurement plan; every registered
  backend is in it unless :data:`NOT_IN_THE_DEFAULT_BENCH_RUN` gives the reason. Its ``BASELINES`` (``sdpa``,
  ``flex``, ``fa4``) are the benchmark's own, not backends, and never take a backend's name.
- ``vllm_plugin.SAMPLER_BACKENDS``: the sampler registry's names (a literal; the plugin need not import the sampler).
"""
from __future__ import annotations

import ast
import os

import pytest

from blockdiff.attention import BACKENDS
from blockdiff.integration import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Registered attention backends the benchmark's default GPU run (``ALL_BACKENDS``) leaves out, with the reason.
NOT_IN_THE_DEFAULT_BENCH_RUN = {
    "reference": "the dense oracle: --quick's (QUICK_BACKENDS) and --backends reference; its dense masks are too slow "
                 "and too large at the named workloads' 32k-100k keys",
}


def test_cli_backend_choices_equal_the_registries():
    from blockdiff.sampler import BACKENDS as SAMPLER_BACKENDS

    assert cli.ATTENTION_BACKENDS == BACKENDS, (
        f"integration/cli.py ATTENTION_BACKENDS {cli.ATTENTION_BACKENDS} != blockdiff.attention.BACKENDS {BACKENDS}: "
        "copy the registry's names (the CLI keeps a literal so argument errors need no torch)")
    assert cli.SAMPLER_BACKENDS == SAMPLER_BACKENDS, (cli.SAMPLER_BACKENDS, SAMPLER_BACKENDS)
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and "demo" in a.choices).choices
    assert tuple(next(a for a in sub["demo"]._actions if a.dest == "backend").choices) == BACKENDS
    assert tuple(next(a for a in sub["train"]._actions if a.dest == "attn_backend").choices) == BACKENDS


def test_vllm_plugin_serves_every_registered_backend(monkeypatch):
    from blockdiff.integration import vllm_plugin
    from blockdiff.sampler import BACKENDS as SAMPLER_BACKENDS

    # the plugin's order is its error message's (its default first); the names are the registry's
    assert sorted(vllm_plugin.ATTN_BACKENDS) == sorted(BACKENDS), (vllm_plugin.ATTN_BACKENDS, BACKENDS)
    for name in BACKENDS:
        monkeypatch.setenv(vllm_plugin.ATTN_BACKEND_ENV, name)
        assert vllm_plugin.attn_backend_from_env() == name
    assert set(vllm_plugin.SAMPLER_BACKENDS) == set(SAMPLER_BACKENDS), vllm_plugin.SAMPLER_BACKENDS


def _dict_keys(path: str, name: str) -> set[str]:
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            assert isinstance(node.value, ast.Dict), f"{path} {name} is not a dict literal"
            return {ast.literal_eval(k) for k in node.value.keys}
    raise AssertionError(f"{path} assigns no {name}")


@pytest.mark.parametrize("table", ["MAX_HEAD_SIZE", "DTYPES"])
def test_vllm_attention_tables_have_a_row_per_served_backend(table):
    """``supports_head_size`` / ``supports_dtype`` index these by ``BLOCKDIFF_ATTN_BACKEND``: a served backend
    without a row would be a KeyError inside vLLM's backend selection."""
    keys = _dict_keys("integration/vllm_attention.py", table)
    missing, stale = sorted(set(BACKENDS) - keys), sorted(keys - set(BACKENDS))
    assert not missing, (f"integration/vllm_attention.py {table} has no row for {missing}: add the largest head size "
                         "/ the model dtypes the backend runs")
    assert not stale, f"integration/vllm_attention.py {table} has rows for unregistered backends {stale}"


def test_training_accepts_every_registered_backend_and_auto(tmp_path):
    from blockdiff.model.train import TrainArgs

    for name in BACKENDS + ("auto",):
        assert not [p for p in TrainArgs(out=str(tmp_path), attn_backend=name).problems() if p[1] == "attn_backend"]
    with pytest.raises(ValueError, match="attn_backend must be one of 'reference'"):
        TrainArgs(out=str(tmp_path), attn_backend="sdpa")


def test_bench_baselines_never_take_a_backend_name_and_every_backend_is_benchmarked_or_excused():
    from blockdiff.bench import bench_attention as ba

    clash = sorted(set(ba.BASELINES) & set(BACKENDS))
    assert not clash, (f"{clash}: a benchmark baseline's name is a registered attention backend's; records' "
                       "'backend' field would mix them (rename the backend: sdpa, flex and fa4 are the bench's)")
    assert ba.BACKEND_CHOICES == ba.BASELINES + BACKENDS
    want = set(ba.BASELINES) | (set(BACKENDS) - set(NOT_IN_THE_DEFAULT_BENCH_RUN))
    assert set(ba.ALL_BACKENDS) == want, (
        f"bench/bench_attention.py ALL_BACKENDS {ba.ALL_BACKENDS} should be {sorted(want)}: add a new backend to it, "
        "or to NOT_IN_THE_DEFAULT_BENCH_RUN in tests/test_backend_lists.py with the reason")
    assert set(NOT_IN_THE_DEFAULT_BENCH_RUN) <= set(BACKENDS), NOT_IN_THE_DEFAULT_BENCH_RUN
    assert set(ba.QUICK_BACKENDS) <= set(ba.BACKEND_CHOICES), ba.QUICK_BACKENDS


@pytest.mark.parametrize("name", BACKENDS)
def test_bench_attention_takes_and_dispatches_every_registered_backend(name):
    """``--backends <name>`` parses and yields a measurement of the blockdiff backend (nothing is run)."""
    from blockdiff.bench import bench_attention as ba

    args = ba.parse_args(["--quick", "--backends", name])
    jobs = list(ba.jobs_for(None, [name], args))
    assert jobs and all(be == name for be, _, _ in jobs), jobs
