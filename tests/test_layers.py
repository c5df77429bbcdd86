"""The package's layers hold: lint-imports (import-linter, its contracts in pyproject.toml) passes.

The contracts: optpass's modules in layers, each importing only from the layers below it; no pass
importing another; no import circle inside a package."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict:
    """This checkout's optpass first on the path (not another one installed in the environment)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_package_is_this_checkouts():
    found = subprocess.run([sys.executable, "-c", "import optpass; print(optpass.__file__)"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    assert pathlib.Path(found).resolve() == ROOT / "optpass" / "__init__.py"


def test_lint_imports_keeps_every_contract():
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert lint, "lint-imports not found: pip install -e '.[test]' (import-linter)"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout, result.stdout[-4000:]
