"""Every example notebook runs top to bottom without an error.

Each ``examples/*.ipynb`` is executed in a fresh ``python3`` kernel (the one
ipykernel provides, running this interpreter), from the examples folder. The
executed copy stays in memory: the notebooks in the repository keep the
outputs ``examples/_build_notebooks.py`` saved.
"""

import importlib.util
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


def _builder():
    spec = importlib.util.spec_from_file_location("_build_notebooks", EXAMPLES / "_build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (EXAMPLES / "_build_notebooks.py").exists(), reason="no notebook generator")
def test_generated_notebooks_match_their_generator():
    """A notebook written by examples/_build_notebooks.py still has the cells written there."""
    builder = _builder()
    for name, cells in builder.NOTEBOOKS.items():
        saved = nbformat.read(EXAMPLES / name, as_version=4)
        expected = builder.build(cells)
        assert [(c.cell_type, c.source) for c in saved.cells] == \
            [(c.cell_type, c.source) for c in expected.cells], (
            f"examples/{name} differs from examples/_build_notebooks.py: edit the generator and "
            "run `python examples/_build_notebooks.py` to regenerate (and re-run) the notebook")
        assert (EXAMPLES / name).stat().st_size < 300_000, f"examples/{name} is over 300 KB"
