"""python -m optpass.demo: optimizer-in-backward, the same training with less memory.

Trains one model twice, from the same initial weights on the same batches, each
run in a fresh process:

* A: ``torch.compile(train_step)`` (Inductor);
* B: ``torch.compile(train_step, backend="optpass",
  options={"optimizer": opt, "optimizer_in_backward": True})``: each parameter's
  AdamW update runs inside backward as soon as its gradient is final, and the
  gradient dies there.

Prints the two loss curves side by side (equal up to rounding); each run's peak
memory over the whole run and bytes per parameter at that peak, and beside it the
peak of the steps after the first three calls (compiles done) alone; and
``optpass.explain`` of B's step. On CPU the peak is
``VmHWM`` (the most RSS the process ever held; the steps' own peak after resetting
it through /proc/self/clear_refs) minus the RSS right after the imports, before the
model is built; with ``--device cuda`` it is ``torch.cuda.max_memory_allocated()``.
Under two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

RESULT = "optpass-demo-result:"
# The model: wide layers, few tokens per step. Tens of millions of parameters make the
# model's tensors dominate what compiling leaves in memory, while a step stays cheap. Four
# layers: with the updates in backward about one layer's gradient is alive at a time.
# Each 3072 x 3072 fp32 tensor (37.7 MB) is above glibc's largest mmap threshold (32 MiB),
# so its memory goes back to the OS when it is freed and RSS follows the live tensors.
SIZES = {"default": dict(width=3072, layers=4, lr=3e-5), "small": dict(width=256, layers=1, lr=1e-3)}
BATCH, SEQ_LEN, VOCAB = 4, 8, 64
WARMUP_CALLS = 3          # compiles are done by then (optpass may compile its fused step at call 2)
VARIANTS = {
    "inductor": "torch.compile(train_step)",
    "optpass": 'torch.compile(train_step, backend="optpass", options={"optimizer": opt, '
               '"optimizer_in_backward": True})',
}


# ====================================================================== one variant (child process)

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class _Memory:
    """What the process holds: VmHWM/VmRSS on CPU, the CUDA caching allocator's counters on GPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch
        self.start = self.current()

    def current(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else _status_bytes("VmRSS")

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else _status_bytes("VmHWM")

    def reset_peak(self) -> bool:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return True
        try:                   # Linux >= 4.0: VmHWM := VmRSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False


def run_variant(args) -> None:
    import torch
    from tqdm import tqdm

    import optpass  # both variants: the same imports, and backward() traced into the step graph
    from optpass.demo.models import MLPLM, batches, synthetic_corpus

    memory = _Memory(args.device)       # after the imports, before the model: the baseline
    size = SIZES[args.size]
    torch.manual_seed(0)
    model = MLPLM(VOCAB, size["width"], size["layers"]).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=size["lr"])
    data = batches(synthetic_corpus(VOCAB, 20_000), BATCH, SEQ_LEN)

    # The supported step shape: take what you return BEFORE opt.step().
    def train_step(tokens, targets):
        loss = model.loss(tokens, targets)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    options = {"optimizer": opt, "optimizer_in_backward": True}
    if args.child == "inductor":
        step = torch.compile(train_step)
    else:
        step = torch.compile(train_step, backend="optpass", options=options)

    losses, times, peak_after_call = [], [], []
    label = {"inductor": "A torch.compile", "optpass": "B optpass"}[args.child]
    for i in tqdm(range(args.steps), desc=f"{label:16s}", unit="step", file=sys.stderr):
        tokens, targets = (t.to(args.device) for t in next(data))
        start = time.perf_counter()
        losses.append(step(tokens, targets).item())
        times.append(time.perf_counter() - start)
        if i < WARMUP_CALLS:
            peak_after_call.append(memory.peak())
        if i == WARMUP_CALLS - 1:
            # compiles are done: from here on, the peak of the steady steps alone
            warmup_peak, reset = memory.peak(), memory.reset_peak()
    end_peak = memory.peak()
    if end_peak > warmup_peak:
        set_in = f"steps {WARMUP_CALLS + 1}-{args.steps}"
    else:
        set_in = f"call {next(i + 1 for i, p in enumerate(peak_after_call) if p >= warmup_peak)}"
    result = {
        "variant": args.child,
        "n_params": sum(p.numel() for p in model.parameters()),
        "losses": losses,
        "peak": max(end_peak, warmup_peak) - memory.start,
        "peak_set_in": set_in,
        "steady_peak": end_peak - memory.start if reset else None,
        "first_calls_s": sum(times[:WARMUP_CALLS]),
        "median_step_s": statistics.median(times[WARMUP_CALLS:]),
    }
    if args.child == "optpass":   # measured above; explaining compiles again but runs nothing
        result["report"] = str(optpass.explain(train_step, *(t.to(args.device) for t in next(data)),
                                               options=options))
    print(RESULT + json.dumps(result), flush=True)


# ====================================================================== the demo (parent process)

def _spawn(args, variant: str) -> dict:
    cmd = [sys.executable, "-m", "optpass.demo", "--child", variant, "--steps", str(args.steps),
           "--size", args.size, "--device", args.device]
    # stderr (the progress bar) goes straight to the terminal; stdout carries the result
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    results = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not results:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"variant {variant!r} failed (exit code {proc.returncode}): {' '.join(cmd)}")
    return results[-1]


def _mb(nbytes: float) -> str:
    """MB of 2**20 bytes, as optpass.explain writes them."""
    mb = nbytes / 2**20
    return f"{mb:,.0f} MB" if abs(mb) >= 10 else f"{mb:.1f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="default",
                        help="default: 4 layers of width 3072 (38M parameters); small: width 256, for tests")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_variant(args)
    if args.steps <= WARMUP_CALLS:
        parser.error(f"--steps must be more than {WARMUP_CALLS}")
    if args.device != "cpu":
        import torch

        if not (args.device.startswith("cuda") and torch.cuda.is_available()):
            parser.error(f"--device {args.device}: not available (cpu, or cuda on a machine with a GPU)")

    started = time.perf_counter()
    size = SIZES[args.size]
    layers = f"{size['layers']} x Linear({size['width']}, {size['width']})" + (" with ReLUs" if size["layers"] > 1
                                                                             else "")
    print(f"optpass demo: optimizer-in-backward.\nAn MLP language model (embedding -> {layers} -> head), "
          f"fp32 AdamW, {BATCH}x{SEQ_LEN} tokens per step,\n{args.steps} steps on {args.device}, trained twice "
          "from the same initial weights on the same batches, each run in a fresh process:")
    for key, variant in zip("AB", VARIANTS):
        print(f"  {key}  {VARIANTS[variant]}")
    sys.stdout.flush()
    a = _spawn(args, "inductor")
    b = _spawn(args, "optpass")
    n = a["n_params"]

    print(f"\n{'step':>5s}  {'loss A':>8s}  {'loss B':>8s}")
    every = max(1, args.steps // 10)
    for i in sorted(set(range(0, args.steps, every)) | {args.steps - 1}):
        print(f"{i + 1:5d}  {a['losses'][i]:8.4f}  {b['losses'][i]:8.4f}")
    diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    window = max(1, args.steps // 5)
    first, last = (statistics.mean(a["losses"][:window]), statistics.mean(a["losses"][-window:]))
    print(f"max |loss A - loss B| over {args.steps} steps: {diff:.2g}. "
          f"Mean loss of the first {window} steps {first:.3f} -> last {window} steps {last:.3f}.")

    what = ("torch.cuda.max_memory_allocated()" if args.device.startswith("cuda")
            else "VmHWM, the most RSS the process held, minus the RSS after the imports")
    grads = 4 * n
    steady = a["steady_peak"] is not None and b["steady_peak"] is not None
    later = f"steps {WARMUP_CALLS + 1}-{args.steps} alone"
    print(f"\nPeak memory ({what}); {n:,} parameters, {_mb(grads)} of fp32 gradients:")
    print(f"       {'whole run':^34s}" + (f"  {later:^24s}" if steady else ""))
    print(f"       {'peak':>10s}  {'bytes/param':>11s}  {'set in':9s}" + (f"  {'peak':>10s}  {'bytes/param':>11s}"
                                                                        if steady else ""))
    for key, r in (("A", a), ("B", b)):
        print(f"  {key}    {_mb(r['peak']):>10s}  {r['peak'] / n:11.1f}  {r['peak_set_in']:9s}"
              + (f"  {_mb(r['steady_peak']):>10s}  {r['steady_peak'] / n:11.1f}" if steady else ""))
    saved = a["peak"] - b["peak"]
    line = f"  A-B  {_mb(saved):>10s}  {saved / n:11.1f}  {'':9s}"
    if steady:
        saved_steady = a["steady_peak"] - b["steady_peak"]
        line += f"  {_mb(saved_steady):>10s}  {saved_steady / n:11.1f}"
        if grads >= 2**26:   # smaller models: compiler and allocator noise, not the model's tensors
            line += f"   {saved_steady / grads:.2f} of the gradient bytes"
    print(line)
    print("  fp32 AdamW holds 16 bytes/param before activations (4 parameter + 8 optimizer state + 4 gradient);")
    print("  with each update inside backward, 12 plus the few gradients alive at a time.")
    if steady:
        print(f"  The rest is compiled code, activations and allocator slack: A's steps hold "
              f"{_mb(a['steady_peak'] - 16 * n)} above 16 bytes/param.")
    print(f"  Time: first {WARMUP_CALLS} calls (with the compiles) A {a['first_calls_s']:.1f} s, "
          f"B {b['first_calls_s']:.1f} s; median step after them A {a['median_step_s'] * 1e3:.0f} ms, "
          f"B {b['median_step_s'] * 1e3:.0f} ms.")

    print("\nWhat optpass does to B's step: optpass.explain(train_step, tokens, targets, options={\"optimizer\": opt, "
          "\"optimizer_in_backward\": True})")
    print(b["report"])
    print("  (The estimate is of the aten graph, where an update is several pointwise ops, each with its own "
          "output;\n  Inductor fuses each update into one kernel that writes the parameter and its state in place.)")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
