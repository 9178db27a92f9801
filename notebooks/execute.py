"""Run the notebooks and save them with their outputs.

    python notebooks/execute.py                   # every notebook of this folder
    python notebooks/execute.py inspect.ipynb     # some of them

Each notebook runs top to bottom in a fresh kernel whose temporary folder
(`TMPDIR`, where the notebooks make their scratch folders) is a new empty
folder, with progress bars off; a notebook whose run raises is not saved. The
outputs are saved with that folder's path written as `<tmp>`, so no path of the
machine that ran them is committed. `tests/docs/test_notebooks.py` checks that the
saved outputs are a fresh run's (`same_outputs`).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import sys
import tempfile

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent
# A number in a text output: compared with a tolerance, since the last digits
# of a trained model's figures may differ between CPUs.
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?|-?\d+")


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    """`path` run top to bottom; raises if a cell raises."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timestamps of an earlier run, which would change at every run
    with tempfile.TemporaryDirectory() as scratch:
        scratch = os.path.realpath(scratch)
        # The folder, and the scratch folder a notebook makes in it (`tempfile.mkdtemp()`).
        scratch_path = re.compile(re.escape(scratch) + "(" + re.escape(os.sep + tempfile.gettempprefix()) + r"\w+)?")
        env = {**os.environ, "TMPDIR": scratch, "TQDM_DISABLE": "1", "JAX_PLATFORMS": "cpu"}
        # (the kernel ended at once when the last cell is done: a graceful end waited seconds for its
        # interpreter to exit, and there is nothing left to run or to read from it)
        client = NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": scratch}},
            shutdown_kernel="immediate",
        )
        client.execute(env=env)
        for cell in notebook.cells:
            if "outputs" in cell:
                cell.outputs = _coalesced(cell.outputs)
            for output in cell.get("outputs", []):
                _replace_text(output, lambda text: scratch_path.sub("<tmp>", text))
    return notebook


def _coalesced(outputs: list) -> list:
    """Consecutive writes to one stream as one output: how many pieces a cell's
    printing arrives in depends on timing."""
    merged: list = []
    for output in outputs:
        previous = merged[-1] if merged else None
        same_stream = previous is not None and previous.get("output_type") == "stream" == output.get("output_type")
        if same_stream and previous.get("name") == output.get("name"):
            previous["text"] += output["text"]
        else:
            merged.append(output)
    return merged


def _replace_text(output: dict, change) -> None:
    if "text" in output:
        output["text"] = change(output["text"])
    if "text/plain" in output.get("data", {}):
        output["data"]["text/plain"] = change(output["data"]["text/plain"])


def text_outputs(notebook: nbformat.NotebookNode) -> list[list[str]]:
    """Per code cell, its standard output and the text of its results, with
    memory addresses normalised."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        texts = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                texts.append(output["text"])
            elif "text/plain" in output.get("data", {}):
                texts.append(output["data"]["text/plain"])
        cells.append([re.sub(r"0x[0-9a-f]{6,}", "0x...", text) for text in texts])
    return cells


def same_outputs(saved: str, fresh: str) -> bool:
    """Whether two text outputs say the same: equal but for numbers with a
    decimal point, which may differ in their last digits (a relative 1e-3)."""
    if NUMBER.sub("#", saved) != NUMBER.sub("#", fresh):
        return False
    for a, b in zip(NUMBER.findall(saved), NUMBER.findall(fresh)):
        if a != b and not ("." in a and "." in b and math.isclose(float(a), float(b), rel_tol=1e-3, abs_tol=1e-6)):
            return False
    return True


def main(argv: list[str]) -> int:
    paths = [HERE / name for name in argv] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        notebook = execute(path)
        nbformat.write(notebook, path)
        print(f"{path.name}: {sum(len(c) for c in text_outputs(notebook))} text outputs saved")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
