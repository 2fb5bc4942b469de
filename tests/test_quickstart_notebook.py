"""experiments/quickstart.ipynb runs top to bottom in a fresh Jupyter kernel.

Executes the notebook with nbclient (kernel "python3", the ipykernel of this interpreter) in a
temporary folder and checks that no cell raised and that its figures were rendered as PNG
outputs. The notebook's own cells assert its numbers (chex comparisons with jax.nn, a falling
loss), so an error there fails this test. Also checks that the stored notebook carries no outputs.
Needs nbclient, nbformat and ipykernel (skipped without them).
"""

from __future__ import annotations

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib_inline")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "quickstart.ipynb"
# The notebook draws three figures (sparse pattern, ALiBi/T5, training loss).
MIN_FIGURES = 3


def _code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    cells = _code_cells(notebook)
    assert cells, "the notebook has no code cells"
    for index, cell in enumerate(cells):
        assert cell.outputs == [], f"code cell {index} is stored with outputs; clear them"
        assert cell.execution_count is None, f"code cell {index} has an execution count"


def test_notebook_runs_and_draws_figures(tmp_path, monkeypatch):
    # The inline backend renders figures to PNG without a display. An inherited
    # MPLBACKEND=Agg would make plt.show() a no-op in the kernel and leave no image outputs.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    outputs = [output for cell in _code_cells(notebook) for output in cell.outputs]
    errors = [output for output in outputs if output.output_type == "error"]
    assert not errors, f"cells raised: {[(e.ename, e.evalue) for e in errors]}"
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(figures) >= MIN_FIGURES, (
        f"expected at least {MIN_FIGURES} PNG figures, found {len(figures)}")
    text = "".join(output.get("text", "") for output in outputs)
    assert "jitted functional call agrees" in text
