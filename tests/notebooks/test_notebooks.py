"""The notebooks run top to bottom on the CPU (small shapes) and are committed without outputs."""
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = ["attention_patterns.ipynb", "sampler_dynamics.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name}: strip outputs before committing"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_on_cpu(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel process inherits it (no GPU in CI)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the kernel's own IPython profile and history database, not ~/.ipython's shared one: under pytest-xdist the
    # other notebook's kernel may run at the same time
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = nbformat.read(NB_DIR / name, as_version=4)
    t0 = time.perf_counter()
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    assert time.perf_counter() - t0 < 90, f"{name} took too long for CI"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{name} drew no figure"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_uses_the_installed_package_and_is_listed(name):
    """No sys.path edits (blockdiff.bench is a package) and a line in notebooks/README.md."""
    nb = nbformat.read(NB_DIR / name, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "sys.path" not in code
    assert f"`{name}`" in (NB_DIR / "README.md").read_text()
    assert sorted(p.name for p in NB_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)
