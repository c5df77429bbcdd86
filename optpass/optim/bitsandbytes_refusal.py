"""bitsandbytes' optimizers (``bnb.optim.AdamW8bit``, ``Lion8bit``, ``AdamW``, the paged ones, ...):
refused, with the reason and what works instead.

Each of their ``step()`` calls runs, per parameter, ``p.data = p.data.contiguous()`` and then a custom
operator (``torch.ops.bitsandbytes.optimizer_update_8bit_blockwise``, ``optimizer_update_32bit``) that
writes the parameter and its state in place. Dynamo traces that, but AOTAutograd cannot compile a
write into a tensor whose ``.data`` was set in the same graph: "cannot mutate tensors with frozen
storage", under ``backend="inductor"`` and ``"aot_eager"`` alike (measured with bitsandbytes 0.50
on CPU, every one of its optimizers; the operator alone, on plain inputs, compiles). optpass lowers
through AOTAutograd, and fuses or shards only an update it has traced into aten ops, so such a step
cannot be compiled at all, and a fused update cannot be made of it. torchao's low-bit optimizers keep
the same block-wise 8-bit moments in tensors AOTAutograd can trace (docs/low_bit_optimizers.md).
"""

from __future__ import annotations

import traceback

import torch
import torch.fx

from optpass.capture import CapturedGraph
from optpass.errors import OptpassError, SourceLine, stack_frames, user_line_from_frames
from optpass.options import optimizers_of

_PACKAGE = "bitsandbytes"


def is_bitsandbytes(optimizer) -> bool:
    return any(cls.__module__.split(".")[0] == _PACKAGE for cls in type(optimizer).__mro__)


def _update_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes   # an OpOverloadPacket or an OpOverload: bitsandbytes.optimizer_update_...
            if n.op == "call_function" and str(n.target).startswith(f"{_PACKAGE}.optimizer_update")]


def _step_line(node: torch.fx.Node | None) -> SourceLine | None:
    """The user's line that called ``opt.step()`` (a frame outside bitsandbytes that calls ``.step(``),
    else the innermost user frame calling this compile."""
    frames = stack_frames(node.meta.get("stack_trace")) if node is not None else []
    calls = [f for f in frames if ".step(" in f.code and f"{_PACKAGE}/" not in f.file.replace("\\", "/")
             and user_line_from_frames([traceback.FrameSummary(f.file, f.line, f.function, line=f.code)])]
    return calls[-1] if calls else user_line_from_frames(traceback.extract_stack())


def refuse_bitsandbytes(captured: CapturedGraph, options, fused: bool) -> None:
    """A bitsandbytes optimizer's update in the graph (it cannot be compiled), or one in
    ``options['optimizer']`` of a step whose update optpass would fuse or shard (`fused`)."""
    nodes = _update_nodes(captured.gm.graph)
    held = [o for o in optimizers_of(options.optimizer) if is_bitsandbytes(o)] if fused else []
    if not nodes and not held:
        return
    name = type(held[0]).__name__ if held else "optimizer"
    where = _step_line(nodes[0] if nodes else None)
    at = f" (at {where})" if where is not None else ""
    raise OptpassError(
        f"bitsandbytes' {name}{at} cannot be compiled: its step() sets p.data = p.data.contiguous() and then "
        "writes the parameter and its state in place with a custom operator, and torch's AOTAutograd, "
        "which optpass lowers through, refuses that write ('cannot mutate tensors with frozen storage'; "
        "backend='inductor' fails the same way), so optpass can neither compile nor fuse its update. "
        "Use torchao's low-bit optimizers, whose moments are the same block-wise 8-bit codes and scales: "
        "torchao.optim.AdamW8bit(model.parameters(), lr=...) trains with optimizer_in_backward, zero1 and "
        "fsdp (docs/low_bit_optimizers.md). Or call the bitsandbytes opt.step() outside the compiled "
        "function, without optimizer_in_backward or data_parallel.")
