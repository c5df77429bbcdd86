"""Activation checkpointing in a step whose backward is traced: recompute each checkpointed region in backward.

``torch.utils.checkpoint`` (Hugging Face's ``gradient_checkpointing_enable()``, torchtitan's per-block
``checkpoint_wrapper``) tags the ops of each checkpointed region ``recompute``. In the one
forward-loss-backward graph that a traced ``backward()`` gives, torch rematerializes them with its own
pass (``remat_using_tags_for_fwd_loss_bwd_graph``, run by AOTAutograd right after tracing): each
tagged op a backward op needs is copied just before that op, and the forward's copy dies early.
That pass recognises backward by the ``autograd_backward`` mark tracing puts on backward's nodes,
and handles one contiguous backward region. Under ``data_parallel="fsdp"`` the backward of each
parameter's gather (the reduce-scatter of ``optpass/fsdp/gather.py``, an autograd function's
backward) is traced without that mark, which cuts backward into one region per gather: torch's pass
then raises ("Detected N disjoint backward regions that require recomputation").

So optpass turns torch's pass off for its own compiles (``torch_remat_off``) and runs the same
rematerialization itself, first in its pipeline (``rematerialize``): every node after the first
marked backward node that reads a marked one is backward too (the gathers' backward among them);
then, in place, each recomputable op a backward node needs (with what it needs in turn) is copied
just before that node, and the forward copies no longer read are erased. A gather inside a
checkpointed region is recomputed with it: backward gathers the parameter again, as FSDP2 does.

Precondition: an aten graph (AOTAutograd's, before optpass's passes) with ``recompute`` tags.
Effect: the activations of checkpointed regions are not kept from forward to backward.
Refuses: a random op in a recomputed region (dropout): torch can replay random numbers only when it
partitions a forward/backward joint graph, not in a graph whose backward is traced; the
``OptpassError`` names the ops, their lines and the fix.
Unlike torch's pass, scaled-dot-product attention with ``dropout_p=0`` is recomputed: torch tags its
kernels random, but without dropout they draw nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from optpass.errors import OptpassError, user_line


@contextlib.contextmanager
def torch_remat_off():
    """AOTAutograd leaves checkpointed regions to ``rematerialize`` (for the compiles inside it)."""
    with torch._functorch.config.patch(remat_using_tags_for_fwd_loss_bwd_graph=False):
        yield


def _is_backward(node: torch.fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward", False))


def _mark_backward(graph: torch.fx.Graph) -> None:
    """After backward begins, a computation that reads backward's values is backward too."""
    started = False
    for node in graph.nodes:
        if _is_backward(node):
            started = True
        elif started and node.op == "call_function" and any(_is_backward(i) for i in node.all_input_nodes):
            node.meta["autograd_backward"] = True


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """An op whose recomputation would have to replay random numbers. torch tags every
    scaled-dot-product-attention kernel random (``nondeterministic_seeded``), also with
    ``dropout_p=0``, where it draws none: recomputed, it gives the same values."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    index = names.index("dropout_p")
    dropout = node.kwargs.get("dropout_p", node.args[index] if index < len(node.args)
                              else schema.arguments[index].default_value)
    return not (isinstance(dropout, (int, float)) and dropout == 0)


def rematerialize(graph: torch.fx.Graph) -> int:
    """Recompute checkpointed regions in backward, in place; returns how many ops were copied."""
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import \
        is_impure_node_for_dce
    from torch._functorch.partitioners import (cleanup_recompute_tags, force_save_bw_mutation_src,
                                               has_recomputable_ops, must_recompute)

    gm = graph.owning_module
    if gm is None or not has_recomputable_ops(gm) or not any(_is_backward(n) for n in graph.nodes):
        return 0
    random = [n for n in graph.nodes if must_recompute(n) and _draws_random_numbers(n)]
    if random:
        raise OptpassError(_random_ops_message(random))
    cleanup_recompute_tags(gm, is_default_partition=True)
    force_save_bw_mutation_src(gm)
    _mark_backward(graph)
    order = {node: index for index, node in enumerate(graph.nodes)}
    recomputed: dict[torch.fx.Node, torch.fx.Node] = {}

    def needed(node: torch.fx.Node) -> list[torch.fx.Node]:
        found: set[torch.fx.Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in found or n in recomputed or not must_recompute(n) or _is_backward(n):
                continue
            found.add(n)
            stack.extend(n.all_input_nodes)
        return sorted(found, key=order.__getitem__)

    for node in [n for n in graph.nodes if _is_backward(n)]:
        for dependency in needed(node):
            with graph.inserting_before(node):
                copy = graph.node_copy(dependency, lambda x: recomputed.get(x, x))
            copy._rename(f"{dependency.name}_recomputed")     # through the namespace: later copies stay unique
            copy.meta["autograd_backward"] = True
            copy.meta.pop("recompute", None)
            recomputed[dependency] = copy
        node.args = torch.fx.map_arg(node.args, lambda x: recomputed.get(x, x))
        node.kwargs = torch.fx.map_arg(node.kwargs, lambda x: recomputed.get(x, x))
    graph.eliminate_dead_code(is_impure_node=is_impure_node_for_dce)
    return len(recomputed)


def _random_ops_message(nodes: list[torch.fx.Node]) -> str:
    found = []
    for node in nodes:
        where = user_line(node.meta.get("stack_trace"))
        found.append(f"{node.target} at {where}" if where else str(node.target))
    ops = "".join(f"\n  {op}" for op in list(dict.fromkeys(found))[:3])
    return ("activation checkpointing would recompute ops that draw random numbers, which torch "
            "cannot replay in a step whose backward() is traced into the graph (what optpass "
            "compiles). Fix: keep dropout out of the checkpointed function (attention dropout "
            "included: scaled_dot_product_attention with dropout_p=0 is recomputed exactly; for a "
            "Hugging Face model, zero dropout in the checkpointed layers: attention_dropout=0.0, "
            "hidden and residual dropout 0.0), or train without activation checkpointing. "
            f"The random ops:{ops}")

