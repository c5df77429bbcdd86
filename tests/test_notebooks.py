"""Every example notebook runs top to bottom without an error, and matches its text source.

Each notebook is written as a jupytext percent-format source, ``examples/<name>.py``
(``# %%`` code cells, ``# %% [markdown]`` cells), paired with ``examples/<name>.ipynb``,
which keeps the outputs that GitHub shows. After editing a source, bring its notebook up to date
with ``jupytext --sync examples/<name>.py`` (it keeps the outputs of unchanged cells), or re-run it
and save the new outputs with ``jupytext --sync --execute examples/<name>.py`` (needs nbconvert).

Each ``examples/*.ipynb`` is executed in a fresh ``python3`` kernel (the one
ipykernel provides, running this interpreter), from the examples folder. The
executed copy stays in memory: the notebooks in the repository keep their saved outputs.
"""

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("jupyter_client.kernelspec")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT_S = 300


def _check_kernel() -> None:
    """The python3 kernel must exist and run this interpreter (where optpass is installed)."""
    try:
        spec = kernelspec.KernelSpecManager().get_kernel_spec(KERNEL)
    except kernelspec.NoSuchKernel:
        pytest.fail(f"no {KERNEL!r} Jupyter kernel: install ipykernel in this environment "
                    f"({sys.executable} -m pip install ipykernel)")
    program = spec.argv[0]
    # jupyter_client runs a spec whose program is plain `python`/`python3` with sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", "python%i.%i" % sys.version_info[:2]}
    if program not in bare and os.path.realpath(program) != os.path.realpath(sys.executable):
        pytest.fail(f"the {KERNEL!r} kernel ({spec.resource_dir}) runs {program}, not this "
                    f"interpreter {sys.executable}; remove that kernelspec or replace it with "
                    f"`{sys.executable} -m ipykernel install --user`")


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path):
    _check_kernel()
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                                     allow_errors=False, record_timing=False,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name}: a cell failed:\n{error}", pytrace=False)
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: error outputs: {[e.get('ename') for e in errors]}"


PAIRING = "ipynb,py:percent"
# A notebook source starts with jupytext's YAML header; examples/zero1_train.py (a plain script
# that the zero1 notebook runs with torchrun) has none and is no notebook.
HEADER = "# ---\n# jupyter:\n"
SOURCES = sorted(p for p in EXAMPLES.glob("*.py") if p.read_text().startswith(HEADER))


def test_every_notebook_is_paired_with_a_percent_source():
    """Each examples/<name>.ipynb has examples/<name>.py, and no source lacks its notebook."""
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS], (
        f"notebook sources {[p.name for p in SOURCES]} vs notebooks {[p.name for p in NOTEBOOKS]}: "
        "create a missing notebook with `jupytext --to ipynb examples/<name>.py`, or a missing source "
        f"with `jupytext --set-formats {PAIRING} examples/<name>.ipynb`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_has_the_cells_of_its_source(path):
    jupytext = pytest.importorskip("jupytext")
    source = path.with_suffix(".py")
    saved = nbformat.read(path, as_version=4)
    text = jupytext.read(source)
    for name, nb in ((path.name, saved), (source.name, text)):
        formats = nb.metadata.get("jupytext", {}).get("formats")
        assert formats == PAIRING, f"examples/{name} pairs {formats!r}, not {PAIRING!r}"
    assert text.metadata["jupytext"]["text_representation"]["format_name"] == "percent", \
        f"examples/{source.name} is not in jupytext's percent format"
    assert [(c.cell_type, c.source) for c in saved.cells] == \
        [(c.cell_type, c.source) for c in text.cells], (
        f"examples/{path.name} differs from examples/{source.name}: edit the .py and run "
        f"`jupytext --sync examples/{source.name}` (add --execute to re-run it and save its outputs)")
    assert path.stat().st_size < 300_000, f"examples/{path.name} is over 300 KB"
