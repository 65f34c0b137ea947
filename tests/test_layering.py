"""Layering and import cycles of blockdiff (docs/ARCHITECTURE.md "Packages and data flow"), enforced by
``python3 -m pytest``:

* the import-linter contracts of ``.importlinter`` (layers integration -> model -> attention and integration ->
  sampler; sampler and attention independent; the reference / triton / cute backends independent, in attention,
  sampler and sampler.tp; no cycles between the sibling modules of any package), run through import-linter;
* no import cycle between any two modules of ``blockdiff.*`` (every top-level folder setup.py installs, bench
  included): grimp's import graph has no strongly connected component of more than one module;
* the library (attention, sampler, model, integration) never imports ``blockdiff.bench``;
* every backend of a registry (``_MODULES`` of ``attention/__init__.py`` and ``sampler/__init__.py``, the
  tensor-parallel sampler's ``STATS_BACKENDS``) is a module of the matching backend-independence contract of
  ``.importlinter``, which checks only the modules it names (read from this checkout's source, not imported);
* ``blockdiff`` resolves to this checkout, so the linted code is the code whose ``.importlinter`` is read.

grimp reads every ``import`` statement, function-local ones too; backends loaded by name through ``importlib``
(the registries of ``blockdiff.attention`` / ``blockdiff.sampler``) are not imports and are not edges.
"""
from __future__ import annotations

import ast
import configparser
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


#: (registry source file, name of its table, contract of .importlinter, package of the backends): each registry's
#: backend names map to modules whose first component under the package is what the contract must list.
REGISTRIES = (
    ("attention/__init__.py", "_MODULES", "attention-backends", "blockdiff.attention"),
    ("sampler/__init__.py", "_MODULES", "sampler-backends", "blockdiff.sampler"),
    ("sampler/tp/step.py", "STATS_BACKENDS", "sampler-tp-backends", "blockdiff.sampler.tp"),
)


def _literal(path: str, name: str):
    """The literal value assigned to module-level ``name`` in ``path`` (this checkout's source, not imported)."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no literal {name}")


def registry_backend_modules(path: str, name: str, package: str) -> dict[str, str]:
    """``{backend: the module of `package` a backend-independence contract must list}``: for ``_MODULES`` entries
    ``name: (module, function)`` (attention) or ``name: ".relative"`` (sampler), the module's first component under
    ``package`` (``blockdiff.attention.triton.interface`` -> ``blockdiff.attention.triton``); for a tuple of names
    (``STATS_BACKENDS``), ``package.<name>``."""
    table = _literal(path, name)
    out = {}
    for backend in table:
        mod = table[backend] if isinstance(table, dict) else f".{backend}"
        mod = mod[0] if isinstance(mod, tuple) else mod
        mod = package + mod if mod.startswith(".") else mod
        assert mod.startswith(package + "."), f"{path}: {backend!r} -> {mod!r} is not under {package}"
        out[backend] = package + "." + mod[len(package) + 1:].split(".")[0]
    return out


def contract_modules(contract: str) -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, ".importlinter"))
    section = f"importlinter:contract:{contract}"
    assert cfg.has_section(section), f".importlinter has no contract {contract!r}"
    assert cfg[section]["type"].strip() == "independence", cfg[section]["type"]
    return {m.strip() for m in cfg[section]["modules"].split() if m.strip()}


@pytest.mark.parametrize("path,name,contract,package", REGISTRIES, ids=[r[2] for r in REGISTRIES])
def test_every_registered_backend_is_in_its_independence_contract(path, name, contract, package):
    """Rule 2 (backends never import one another) is checked only for the modules a contract names: a backend
    registered without being added there would be silently unchecked (maint20's report)."""
    listed = contract_modules(contract)
    missing = {b: m for b, m in registry_backend_modules(path, name, package).items() if m not in listed}
    assert not missing, "\n".join(
        f"backend {b!r} ({path} {name}) is not checked for rule 2: add `    {m}` to the modules of "
        f"[importlinter:contract:{contract}] in .importlinter" for b, m in missing.items())


def test_the_registry_reader_finds_every_backend():
    """The source reader against the imported registries (expected values built from them, so a backend added the
    documented way keeps this green; was a hand list of the three backends, red for every correct addition)."""
    from blockdiff.attention import _MODULES as attention_modules
    from blockdiff.sampler import _MODULES as sampler_modules

    assert registry_backend_modules(*REGISTRIES[0][:2], REGISTRIES[0][3]) == {
        name: "blockdiff.attention." + module.removeprefix("blockdiff.attention.").split(".")[0]
        for name, (module, _) in attention_modules.items()}
    assert registry_backend_modules("sampler/__init__.py", "_MODULES", "blockdiff.sampler") == {
        name: "blockdiff.sampler." + module.lstrip(".").split(".")[0] for name, module in sampler_modules.items()}
    assert set(registry_backend_modules(*REGISTRIES[2][:2], REGISTRIES[2][3]).values()) == {
        "blockdiff.sampler.tp.reference", "blockdiff.sampler.tp.triton"}


def test_blockdiff_resolves_to_this_checkout():
    """With the package installed editable from another checkout, ``blockdiff.*`` resolves there: the layering
    check would lint that code against this checkout's .importlinter, and every test would run it (maint20's report;
    docs/ARCHITECTURE.md section 3, 'Adding an attention backend', step 6)."""
    for pkg in LIBRARY:
        spec = importlib.util.find_spec(f"blockdiff.{pkg}")
        assert spec is not None and spec.origin is not None, f"blockdiff.{pkg} is not importable"
        where = os.path.realpath(os.path.dirname(spec.origin))
        assert where == os.path.realpath(os.path.join(REPO, pkg)), (
            f"blockdiff.{pkg} resolves to {where}, not this checkout's {os.path.join(REPO, pkg)}: put this checkout "
            f"first on the path (PYTHONPATH) or pip install -e it")
