"""python -m optpass.demo trains (the loss falls) and prints the explain report."""

import re
import subprocess
import sys


def test_demo_trains_and_explains():
    result = subprocess.run([sys.executable, "-m", "optpass.demo", "--steps", "60", "--lower", "eager"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    first, last = map(float, re.search(r"loss: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", out).groups())
    assert last < 0.8 * first
    assert "[graph 0] step" in out and "backward(): " in out and "optimizer update" in out
    assert "WARNING" not in out
