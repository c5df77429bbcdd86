"""bench/_measure.py's live-tensor peak counts exactly the bytes of the tensors alive at once,
frees on other threads included (the counting CPU allocator stays installed for the rest of its
process, so the toy runs in a fresh process)."""

import json
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def test_live_tensor_peak_is_exact():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(BENCH)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == "ok"


def _toy() -> None:
    import threading

    import torch
    from _measure import CPUTensorBytes

    n, m, base = 8 << 20, 5 << 20, 1 << 20
    before = torch.ones(1 << 18)                 # alive before start(): not counted, nor its free
    live = CPUTensorBytes()
    live.start()
    kept = torch.empty(base, dtype=torch.uint8)
    x = torch.ones(4)
    for _ in range(100):                         # many small allocations and frees
        x = x + 1
    del x
    with live.mark("one"):
        a = torch.empty(n, dtype=torch.uint8)
        del a
    with live.mark("two"):
        b, c = torch.empty(m, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)
        del b, c
    del before
    # a tensor that dies on another thread (as gloo's workers free a collective's buffers)
    box = [torch.empty(m, dtype=torch.uint8)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    with live.mark("three"):
        d = torch.empty(m // 2, dtype=torch.uint8)
        del d
    result = live.stop()
    assert result["peak_bytes"] == max(n, 2 * m) + base, result
    # which tensors were alive at the run's peak: those of "two" (`kept` is older than the mark)
    assert result["peak_in"] == "two" and result["alive_at_peak"] == [m, m], result
    assert result["marks"]["one"] == {"peak_bytes": n + base, "end_bytes": base}
    assert result["marks"]["two"] == {"peak_bytes": 2 * m + base, "end_bytes": base}
    assert result["marks"]["three"] == {"peak_bytes": m // 2 + base, "end_bytes": base}, result
    assert result["end_bytes"] == base
    assert kept.numel() == base


if __name__ == "__main__":
    _toy()
    print(json.dumps("ok"))
