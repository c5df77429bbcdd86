"""python -m optpass.demo: the same losses with and without optimizer-in-backward, memory, the report, no warnings."""

import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 15


def test_demo_trains_both_variants_alike_and_shows_memory_and_the_fused_step():
    result = subprocess.run([sys.executable, "-m", "optpass.demo", "--size", "small", "--steps", str(STEPS)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out + err

    # the two loss columns: every step (15 steps print every step), equal up to rounding
    rows = [(float(a), float(b)) for a, b in re.findall(r"^ +\d+ +(\d+\.\d+) +(\d+\.\d+)$", out, re.M)]
    assert len(rows) == STEPS, out
    assert all(abs(a - b) < 1e-3 for a, b in rows), rows
    max_diff = float(re.search(r"max \|loss A - loss B\| over \d+ steps: (\S+)\.", out).group(1))
    assert max_diff < 1e-4
    losses = [a for a, _ in rows]
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.3, losses   # the loss falls

    # each variant's whole-run peak and bytes per parameter, and the steady steps' peak
    for key in "AB":
        assert re.search(rf"^  {key} +[\d,]+ MB +\d+\.\d +(call \d|steps \d+-\d+) +[\d,]+ MB +\d+\.\d$", out, re.M), out
    assert re.search(r"^  A-B ", out, re.M)
    assert "fp32 AdamW holds 16 bytes/param" in out

    # optpass.explain of B's step: legal, applied, gradients gone from the estimate
    assert "optpass.explain(train_step" in out and "[graph 0] step" in out
    assert "legality: optimizer_in_backward is legal" in out and "pass optimizer_in_backward: applied" in out
    assert re.search(r"estimated peak memory: .* \(gradients [\d.]+ MB\) before passes -> .* \(gradients 0.00 MB\) after",
                     out), out

    # no warnings: Python's, optpass's, or torch's logging (glog-style "W1122 12:34:56...")
    text = out + err
    assert "Warning" not in text and "WARNING" not in text, text
    lines = re.split(r"[\r\n]+", text)
    assert not [ln for ln in lines if re.match(r"[WE]\d{4} \d\d:\d\d", ln)], text
