"""The README stays true: its test command is what CI runs, its options table is the real one."""

import pathlib

from optpass.options import options_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                  if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci_command) == 1
    assert ci_command[0] in (ROOT / "README.md").read_text()


def test_readme_options_table_is_generated_from_the_options():
    assert options_table() in (ROOT / "README.md").read_text()


def test_readme_pins_torch_in_both_commands():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pip install torch==2.13.0 -e . && python -m optpass.demo" in readme
