"""A float lr that the harvest made a tensor keeps the float's rounding.

Precondition: the harvested aten graph of an update (``optim/harvest.py``), traced with each
group's float ``lr`` replaced by a 0-d float64 tensor, so that the update reads lr as an input (a
scheduler changes it without a recompile).

Why: with a Python-number ``alpha``, ``param.add_(update, alpha=-lr)`` is one ATen op that
computes ``param + alpha * update`` as one fused multiply-add in the op's compute dtype (fp32 for
bf16/fp16 operands). With a tensor ``alpha`` Dynamo traces it as ``prims.fma(update, alpha,
param)`` (``TensorVariable.method_add_``), whose product rounds in ``update``'s dtype first.
Muon's orthogonalised update is bf16 (Newton-Schulz runs in bf16), so ``update * lr`` rounds to
bf16 before the fp32 parameter sees it: 1.1e-4 relative from eager Muon after one step on the
tests' MLP (``lower="eager"``), growing every step. A float lr must not change an update's numerics.

Rewrite: each ``prims.fma(a, alpha, c)`` whose ``alpha`` is computed from float-lr inputs alone
(``-lr``, Muon's ``-lr * sqrt(max(1, A/B))``: what would have been a Python number) and whose
operands are not all in the compute dtype runs as
``fma(a.to(f64), alpha.to(compute).to(f64), c.to(f64)).to(out)``: ``out`` is the fma's own
result dtype, ``compute`` fp32 for bf16/fp16, else ``out``. The product of two fp32 values is
exact in float64, so this rounds once, as ATen's multiply-add does (but for ties that a double
rounding breaks the other way). An alpha that also reads optimizer state (Adam's
``lr / bias_correction``) is a tensor under ``torch.compile`` with a float lr too and is left as
torch traces it; so is a user's tensor lr.

Effect: with a float lr the update rounds as eager torch.optim's and ``torch.compile(opt.step)``'s
float-lr update does (Muon through ``lower="eager"``: bitwise equal to eager Muon); fp32 and fp64
updates of fp32 and fp64 operands are unchanged (nothing to promote).

    before:                                   after:
      alpha = neg(mul(lr, 1.22))                alpha = neg(mul(lr, 1.22))
      new = fma(update_bf16, alpha, p_fp32)     new = fma(update.to(f64), alpha.to(f32).to(f64),
                                                          p.to(f64)).to(f32)
"""

from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def keep_float_lr_rounding(graph: torch.fx.Graph, float_lr_inputs: set[torch.fx.Node]) -> int:
    """Rewrite `graph` in place (see the module docstring); returns how many fma nodes it rewrote.

    Args:
        graph: a harvested aten update graph whose nodes carry ``meta['val']``.
        float_lr_inputs: the placeholders holding the lr of groups whose lr is a Python float.
    """
    if not float_lr_inputs:
        return 0
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.prims.fma.default or not _from_float_lr_only(node.args[1], float_lr_inputs):
            continue
        out = node.meta["val"].dtype
        compute = torch.float32 if out in _LOW_PRECISION else out
        a, alpha, c = node.args
        if a.meta["val"].dtype == compute and c.meta["val"].dtype == compute:
            continue
        wide = torch.float64
        with graph.inserting_before(node):
            alpha_c = _converted(graph, fake_mode, _converted(graph, fake_mode, alpha, compute), wide)
            value = _emit(graph, fake_mode, torch.ops.prims.fma.default,
                          _converted(graph, fake_mode, a, wide), alpha_c, _converted(graph, fake_mode, c, wide))
            value = _converted(graph, fake_mode, value, out)
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _from_float_lr_only(alpha, float_lr_inputs: set[torch.fx.Node]) -> bool:
    """`alpha` is a 0-d value computed from float-lr inputs and constants alone."""
    if not isinstance(alpha, torch.fx.Node) or alpha.meta["val"].dim() != 0:
        return False
    seen, stack, inputs = set(), [alpha], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            inputs.add(node)
        stack.extend(node.all_input_nodes)
    return bool(inputs) and inputs <= float_lr_inputs


def _converted(graph, fake_mode, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if node.meta["val"].dtype == dtype:
        return node
    return _emit(graph, fake_mode, torch.ops.prims.convert_element_type.default, node, dtype)


def _emit(graph, fake_mode, target, *args) -> torch.fx.Node:
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*values)
    return node
