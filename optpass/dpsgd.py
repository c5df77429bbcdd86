"""DP-SGD with Poisson sampling: variable batch sizes padded to a few sizes, with a mask.

Poisson sampling (each example joins a step's batch with probability q, as Opacus's
``DPDataLoader`` does) gives a different batch size B every step, 0 included. A compiled
``vmap(grad(...))`` step recompiles for every new B: functorch's batching rules of
``cross_entropy`` (its ``gather``) and of ``nn.Embedding``'s backward read B as a Python
int, so even ``torch._dynamo.mark_dynamic`` cannot keep it symbolic, and after Dynamo's
recompile limit (8) the step silently runs eagerly.

``pad_batch`` pads a batch to the next multiple of ``multiple`` examples (an empty batch to
``multiple``), so a step compiles once per bucket, and returns a mask of the real examples.
The step zeroes the padded examples' clip coefficients with it, after clipping and before the
sum: a padded example adds nothing, each real one at most the clipping norm, so the
sensitivity is unchanged (jax_privacy's batch selection pads the same way)::

    x, y, mask = optpass.pad_batch(x, y, multiple=16)
    ...
    coef = torch.where(mask, (C / (norms + 1e-6)).clamp(max=1.0), 0)

What the step returns per example (its norms) has rows for the padding too: keep the
real ones with ``norms[mask]`` before logging them.

Padding repeats zeros (token id 0 for integer tensors): inputs whose gradients are finite for
the usual models; the mask then removes them exactly.
"""

from __future__ import annotations

import os
import re
import sys

import torch

__all__ = ["bucket_size", "pad_batch"]


def bucket_size(batch_size: int, multiple: int) -> int:
    """The padded size of a batch of ``batch_size`` examples: the next multiple of ``multiple``,
    and ``multiple`` for an empty batch (so B = 0 needs no compile of its own).

    Args:
        batch_size: the number of real examples, B >= 0.
        multiple: the bucket granularity m >= 1: a step compiles once per multiple of m.

    Returns:
        The smallest multiple of ``multiple`` that is >= ``batch_size`` and >= ``multiple``.

    Raises:
        ValueError: ``batch_size < 0`` or ``multiple < 1``.
    """
    if multiple < 1 or batch_size < 0:
        raise ValueError(f"bucket_size: need batch_size >= 0 and multiple >= 1, got {batch_size} and {multiple}")
    return max(1, -(-batch_size // multiple)) * multiple


def pad_batch(*tensors: torch.Tensor, multiple: int) -> tuple[torch.Tensor, ...]:
    """``(*padded, mask)``: each tensor zero-padded along dimension 0 to ``bucket_size(B, multiple)``,
    and ``mask`` [padded B] bool, True for the B real examples (the first B rows).

    The step zeroes the padded examples' clip coefficients with ``mask``; keep the real rows of
    what it returns per example with ``norms[mask]``.

    Args:
        *tensors: the batch's tensors (inputs, targets, ...), all with the same size B along
            dimension 0.
        multiple: the bucket granularity m >= 1 (keyword only).

    Returns:
        A tuple: each tensor padded with zeros (token id 0 for integer tensors) to
        ``bucket_size(B, multiple)`` rows, then the bool mask, on the first tensor's device.

    Raises:
        ValueError: no tensor is given, the tensors disagree on B, or ``multiple < 1``.
    """
    if not tensors:
        raise ValueError("pad_batch: give at least one tensor (the batch's inputs, targets, ...)")
    batch = tensors[0].shape[0]
    if any(t.shape[0] != batch for t in tensors):
        raise ValueError(f"pad_batch: the tensors disagree on the batch size (dimension 0): "
                         f"{[tuple(t.shape) for t in tensors]}")
    size = bucket_size(batch, multiple)
    padded = tuple(torch.cat([t, t.new_zeros((size - batch, *t.shape[1:]))]) for t in tensors)
    mask = torch.arange(size, device=tensors[0].device) < batch
    return (*padded, mask)


# How Dynamo's fake-tensor error prints a vmapped value: the batch dimension and the sizes under it.
_BATCHED = re.compile(r"BatchedTensor\(lvl=\d+, bdim=(\d+), value=\s*FakeTensor\(\.\.\., size=\(([^)]*)\)")
_VMAP_FILE = f"_functorch{os.sep}vmap.py"
EMPTY_BATCH_NOTE = (
    "optpass: this error comes from torch.func.vmap over an empty batch (0 examples, which Poisson "
    "sampling draws): the batching rules of some ops (an Embedding's backward, a reshape with -1) fail on "
    "0 examples, eager and compiled. Pad each batch with optpass.pad_batch(x, y, multiple=m) and zero the "
    "padded examples' clip coefficients with its mask (docs/dp_sgd.md, 'Poisson sampling'): an empty "
    "batch is padded to m examples, and the step adds the noise alone.")


def note_an_empty_vmap(_args) -> None:
    """A Dynamo compile-end callback: have Dynamo's error for a ``vmap`` over an empty batch point at
    ``pad_batch``.

    Such an error is raised while Dynamo traces the step, before any backend sees a graph; the callback
    (it runs while the error propagates) adds ``EMPTY_BATCH_NOTE`` to it as a note, which Python prints
    after the message. Other errors are left as they are. optpass's backend registers it at import, kept
    across ``torch._dynamo.reset()`` (``dynamo_scope.keep_compile_end_callback``).
    """
    error = sys.exc_info()[1]
    if isinstance(error, RuntimeError) and _vmapped_an_empty_batch(error) \
            and EMPTY_BATCH_NOTE not in getattr(error, "__notes__", ()):
        error.add_note(EMPTY_BATCH_NOTE)


def _vmapped_an_empty_batch(error: RuntimeError) -> bool:
    """Did tracing fail inside a vmap, on a value whose batch dimension has 0 examples?"""
    if not any(_VMAP_FILE in frame.filename for frame in getattr(error, "real_stack", None) or ()):
        return False
    for bdim, sizes in _BATCHED.findall(str(error)):
        sizes = [s.strip() for s in sizes.split(",") if s.strip()]
        if int(bdim) < len(sizes) and sizes[int(bdim)] == "0":
            return True
    return False
