"""bench/experiments/ptx_snapshot.py on the CPU without compiling: debug-info stripping, the snapshot comparison,
and the configuration list against the offline compile check's own (so the identity check covers every one)."""
import ast
import json
from pathlib import Path

from blockdiff.bench.experiments import ptx_snapshot as ps

COMPILE_CHECK = Path(__file__).resolve().parents[2] / "attention" / "triton" / "test_triton_compile_check.py"


def _parametrized(test_name: str) -> list:
    """The argvalues of ``test_name``'s @pytest.mark.parametrize in the compile-check test file."""
    src = COMPILE_CHECK.read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == test_name:
            call = node.decorator_list[0]
            return eval(compile(ast.Expression(call.args[1]), "params", "eval"), {"dict": dict})  # noqa: S307
    raise AssertionError(f"{test_name} not in {COMPILE_CHECK}")


def test_configs_cover_the_offline_compile_check():
    cfgs = [json.dumps(c, sort_keys=True) for c in ps.gluon_configs()]
    assert len(set(cfgs)) == len(cfgs)
    rows = _parametrized("test_gluon_kernel_compiles_for_sm90_without_spills")
    assert [tuple(r) for r in rows] == [tuple(r) for r in ps._GLUON_ROWS]
    assert [kw for kw, _ in _parametrized("test_roles_kernel_compiles_for_sm90")] == ps._ROLES
    assert ps.SAMPLER_TEST.exists() and "_COMPILE_STREAMING_SM90" in ps.SAMPLER_TEST.read_text()


def test_strip_ptx_keeps_instructions_only():
    ptx = ('.version 8.7\n.file 1 "a.py"\n\t.loc 1 10 3\n\tadd.s32 %r1, %r2, %r3;  \n// comment\n\n'
           '.section\t.debug_abbrev\n{\n.b8 1\n}\n')
    assert ps.strip_ptx(ptx) == ".version 8.7\n\tadd.s32 %r1, %r2, %r3;  \n"


def _snap(d: Path, text: str, extra=None):
    d.mkdir()
    (d / "k.ptx").write_text(text)
    summary = {"gluon {}": {"file": "k.ptx", "kernel": "k", "sha256": ps._sha(text)}, **(extra or {})}
    (d / "summary.json").write_text(json.dumps(summary))


def test_compare_reports_differences_and_missing(tmp_path, capsys):
    _snap(tmp_path / "a", "add;\n")
    _snap(tmp_path / "b", "add;\n")
    assert ps.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    _snap(tmp_path / "c", "sub;\n", {"sampler 00 x": {"file": "k.ptx", "kernel": "x", "sha256": "0"}})
    assert ps.main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS gluon {}" in out and "MISSING on before: sampler 00 x" in out and "+sub;" in out
