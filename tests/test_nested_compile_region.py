"""Why optpass does not compile a repeated block with ``torch.compiler.nested_compile_region``
(docs/design.md §62): on torch 2.13 Inductor reuses the memory of a region's input while the region's
compiled backward still needs it, so gradients come out wrong.

The smallest program found (from the Llama decoder layer of §62, cut down until nothing else was
needed): a region called twice whose compiled forward saves its own input for backward (``x.sin()``),
then a new buffer of the same size made after it. The region's outputs carry no aliasing information in
Inductor's ``InvokeSubgraph``, so the outer graph takes the input as dead after the call and writes
``y.cos()`` into its memory: the saved activation is overwritten. The xfail is strict: when torch fixes
it, this test fails and the region is worth trying again.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config


def _body(x):
    return x.sin()                          # sin saves its input for backward


_region = torch.compiler.nested_compile_region(_body)


def _model(block, x, w):
    y = block(block(x))                     # two calls: the region is kept (one call is inlined)
    return (y.cos() @ w).sum()              # a new buffer of the region input's size


def _gradient_error(block, backend: str | None, buffer_reuse: bool = True) -> float:
    torch.manual_seed(0)
    x0, w0 = torch.randn(8, 8), torch.randn(8, 8)

    def grads(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with inductor_config.patch(allow_buffer_reuse=buffer_reuse):
            fn(x, w).backward()
        return x.grad, w.grad

    expected = grads(lambda x, w: _model(_body, x, w))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: _model(block, x, w), backend=backend, fullgraph=True)
    return max((a - b).abs().max().item() for a, b in zip(grads(compiled), expected))


@pytest.mark.xfail(strict=True, reason="torch 2.13: Inductor reuses a nested_compile_region input's memory "
                                        "that the region saved for backward (docs/design.md §62)")
def test_a_region_called_twice_gives_eagers_gradients_under_inductor():
    assert _gradient_error(_region, "inductor") <= 1e-5


def test_the_same_program_is_right_without_the_region_under_aot_eager_and_without_buffer_reuse():
    """What isolates the fault: Inductor without the region, the region under aot_eager (no Inductor
    memory planning), and the region under Inductor with buffer reuse off are each right."""
    assert _gradient_error(_body, "inductor") <= 1e-5
    assert _gradient_error(_region, "aot_eager") <= 1e-5
    assert _gradient_error(_region, "inductor", buffer_reuse=False) <= 1e-5
