"""bench/_measure.py's live-tensor peak counts exactly the bytes of the tensors alive at once.

The allocator's running total carries over from earlier profiler sessions in the same process
(the bench measures in a fresh process per variant), so the toy runs in a fresh process too."""

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def test_live_tensor_peak_is_exact():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(BENCH)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == "ok"


def _toy() -> None:
    import torch
    from _measure import LiveTensorBytes

    n, m, base = 8 << 20, 5 << 20, 1 << 20
    before = torch.ones(1 << 18)                 # alive before start(): not counted, nor its free
    live = LiveTensorBytes()
    live.start()
    try:
        kept = torch.empty(base, dtype=torch.uint8)
        x = torch.ones(4)
        for _ in range(100):                     # many small allocations and frees
            x = x + 1
        del x
        with live.mark("one"):
            a = torch.empty(n, dtype=torch.uint8)
            del a
        with live.mark("two"):
            b, c = torch.empty(m, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)
            del b, c
        del before
    finally:
        result = live.stop()
    assert result["peak_bytes"] == result["running_sum_peak_bytes"] == max(n, 2 * m) + base
    assert result["marks"]["one"] == {"peak_bytes": n + base, "end_bytes": base}
    assert result["marks"]["two"] == {"peak_bytes": 2 * m + base, "end_bytes": base}
    assert kept.numel() == base


if __name__ == "__main__":
    _toy()
    print(json.dumps("ok"))
