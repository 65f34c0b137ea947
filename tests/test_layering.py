"""Layering and import cycles of blockdiff (docs/ARCHITECTURE.md "Packages and data flow"), enforced by
``python3 -m pytest``:

* the import-linter contracts of ``.importlinter`` (layers integration -> model -> attention and integration ->
  sampler; sampler and attention independent; the reference / triton / cute backends independent, in attention,
  sampler and sampler.tp; no cycles between the sibling modules of any package), run through import-linter;
* no import cycle between any two modules of ``blockdiff.*`` (every top-level folder setup.py installs, bench
  included): grimp's import graph has no strongly connected component of more than one module;
* the library (attention, sampler, model, integration) never imports ``blockdiff.bench``.

grimp reads every ``import`` statement, function-local ones too; backends loaded by name through ``importlib``
(the registries of ``blockdiff.attention`` / ``blockdiff.sampler``) are not imports and are not edges.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import logging
import os

import grimp
import pytest
from importlinter.cli import lint_imports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("attention", "sampler", "model", "integration")

#: Cycles known to exist while the redesign (issue 24) lands, each a sorted tuple of module names: the test
#: tolerates exactly these and fails once one of them is gone, so the list only shrinks. Empty: none is known.
EXPECTED_CYCLES: list[tuple[str, ...]] = []


def _top_level_packages() -> list[str]:
    """``blockdiff.<folder>`` for every folder of setup.py's ``TOP`` list that is a package here."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    top = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "TOP" for t in n.targets))
    assert set(LIBRARY) <= set(top), top
    return [f"blockdiff.{p}" for p in top if os.path.isfile(os.path.join(REPO, p, "__init__.py"))
            and importlib.util.find_spec(f"blockdiff.{p}") is not None]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*_top_level_packages(), cache_dir=None)


def strongly_connected_components(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Components of more than one module of the direct-import graph (Tarjan 1972, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(tuple(sorted(comp)))
    return sorted(found)


def _describe(graph: grimp.ImportGraph, comp: tuple[str, ...]) -> str:
    members = set(comp)
    edges = [f"  {a} -> {b} (line {d['line_number']})" for a in comp
             for b in sorted(graph.find_modules_directly_imported_by(a) & members)
             for d in graph.get_import_details(importer=a, imported=b)[:1]]
    return " <-> ".join(comp) + "\n" + "\n".join(edges)


@contextlib.contextmanager
def _logging_restored():
    """lint_imports configures logging through ``logging.config.dictConfig``, whose ``disable_existing_loggers``
    turns off every logger made before it, blockdiff's among them, for the rest of the process (a later test of the
    same pytest-xdist worker then read an empty caplog), and gives its own loggers a handler on the stdout of the
    moment (pytest's capture). Put both back."""
    names = ("importlinter", "grimp", "_rustgrimp")
    loggers = logging.root.manager.loggerDict
    disabled = {n: lg.disabled for n, lg in loggers.items() if isinstance(lg, logging.Logger)}
    own = {n: (lg.level, lg.handlers[:], lg.propagate) for n in names for lg in [logging.getLogger(n)]}
    try:
        yield
    finally:
        for n, lg in list(loggers.items()):
            if isinstance(lg, logging.Logger):
                lg.disabled = disabled.get(n, False)
        for n, (level, handlers, propagate) in own.items():
            lg = logging.getLogger(n)
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate


def test_import_linter_contracts_are_kept(capsys):
    probe = logging.getLogger("vllm.blockdiff.integration.vllm_compat")  # vllm_compat._log (7.50)
    with _logging_restored():
        rc = lint_imports(config_filename=os.path.join(REPO, ".importlinter"), no_cache=True, no_logo=True)
    assert not probe.disabled  # the loggers made before lint_imports still log
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err


def test_no_import_cycle_between_blockdiff_modules(graph):
    assert graph.modules, "grimp found no blockdiff module (is the package installed: pip install -e .?)"
    cycles = strongly_connected_components(graph)
    new = [c for c in cycles if c not in EXPECTED_CYCLES]
    gone = [c for c in EXPECTED_CYCLES if c not in cycles]
    assert not new, "import cycles:\n" + "\n".join(_describe(graph, c) for c in new)
    assert not gone, f"these cycles are gone: delete them from EXPECTED_CYCLES: {gone}"


def test_the_library_never_imports_bench(graph):
    if "blockdiff.bench" not in graph.modules:
        pytest.skip("bench is not a package here")
    bad = [(m, b) for m in sorted(graph.modules) if m.split(".")[1] in LIBRARY
           for b in sorted(graph.find_modules_directly_imported_by(m)) if b.split(".")[1] == "bench"]
    assert not bad, bad


def test_the_cycle_finder_finds_a_cycle():
    g = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.e"), ("p.e", "p.d")):
        g.add_import(importer=a, imported=b)
    assert strongly_connected_components(g) == [("p.a", "p.b", "p.c"), ("p.d", "p.e")]
