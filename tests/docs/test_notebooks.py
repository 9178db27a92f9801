"""Every notebook in notebooks/ runs top to bottom (its cells assert what they
show), and the outputs saved in it are those of a fresh run.

The saved outputs are what the documentation site shows. `python
notebooks/execute.py` runs the notebooks and saves them with their outputs;
this test runs each the same way and compares the text outputs (standard
output and results, memory addresses aside; numbers with a decimal point
within a relative 1e-3, since a trained model's last digits may differ between
CPUs).
"""

import importlib.util

import places
import pytest

NOTEBOOKS_DIR = places.ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("execute_notebooks", NOTEBOOKS_DIR / "execute.py")
assert _spec is not None and _spec.loader is not None
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_shows_its_outputs(notebook):
    saved = execute_notebooks.nbformat.read(notebook, as_version=4)
    fresh = execute_notebooks.execute(notebook)
    errors = [o for cell in fresh.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    saved_cells = execute_notebooks.text_outputs(saved)
    fresh_cells = execute_notebooks.text_outputs(fresh)
    assert any(saved_cells), f"{notebook.name} was saved without outputs: run `python notebooks/execute.py`"
    assert len(saved_cells) == len(fresh_cells)
    for index, (old, new) in enumerate(zip(saved_cells, fresh_cells)):
        same = len(old) == len(new) and all(map(execute_notebooks.same_outputs, old, new))
        assert same, (
            f"{notebook.name}, code cell {index + 1}: the saved outputs are not a fresh run's; "
            f"run `python notebooks/execute.py {notebook.name}`.\nSaved: {old}\nFresh: {new}"
        )


def test_outputs_are_compared_with_a_tolerance_for_last_digits_only():
    same = execute_notebooks.same_outputs
    assert same("loss 0.0178 at step 15\n", "loss 0.017801 at step 15\n")
    assert not same("loss 0.0178 at step 15\n", "loss 0.0179 at step 15\n")
    assert not same("step 15\n", "step 16\n")  # integers exactly
    assert not same("Checkpoint 'ckpt':\n", "Checkpoint('ckpt', 21 leaves)\n")
