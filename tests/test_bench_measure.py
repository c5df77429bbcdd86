"""bench/_measure.py's live-tensor peak counts exactly the bytes of the tensors alive at once."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from _measure import LiveTensorBytes  # noqa: E402


def test_live_tensor_peak_is_exact():
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
