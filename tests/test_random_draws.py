"""The Inductor lowering's randn_like draws as one op (optpass/random_draws.py): the same numbers as
eager PyTorch, one random op where a run of draws was, runs ended where they must be."""

import operator

import torch
import torch.nn.functional as F

import optpass
from optpass.random_draws import draw_randn_like_in_one_op

IN_ORDER = torch.ops.optpass.randn_like_in_order.default


def noisy_update(params, x):
    # DP-SGD's shape: a computation per tensor, then its noise; sizes below 16 and off multiples of
    # 16 (aten's normal_ draws those differently); a dropout between two runs of draws.
    outs = []
    for i, p in enumerate(params):
        outs.append(p * 2 + torch.randn_like(p))
        if i == 2:
            outs.append(F.dropout(x, 0.5))
    return outs


def test_draws_equal_eager_pytorchs_and_run_as_one_op():
    params = [torch.randn(s) for s in [(5,), (33, 7), (16,), (3, 3), (40,)]]
    x = torch.randn(6, 4)
    torch.manual_seed(11)
    expected = noisy_update(params, x)
    torch._dynamo.reset()
    compiled = torch.compile(noisy_update, backend="optpass")
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        torch.manual_seed(11)
        got = compiled(params, x)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(12)       # compiled again: still eager's stream, step after step
    again = compiled(params, x)
    torch.manual_seed(12)
    for a, b in zip(again, noisy_update(params, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    graph = next(r.graph_after for r in optpass.recent_reports() if r.graph_after is not None)
    in_order = [n for n in graph.nodes if n.target is IN_ORDER]
    # three draws before the dropout, two after: two runs, no randn_like left
    assert [len(n.args[0]) for n in in_order] == [3, 2]
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.randn_like.default]


def _graph_of(fn, *shapes):
    gm = torch.fx.symbolic_trace(fn)
    graph = gm.graph
    for node, shape in zip(graph.find_nodes(op="placeholder"), shapes):
        node.meta["val"] = torch.empty(shape)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.randn_like:
            node.target = torch.ops.aten.randn_like.default
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.randn_like.default:
            node.meta["val"] = torch.empty_like(node.args[0].meta.get("val", torch.empty(0)))
    return gm


def test_a_draw_whose_input_comes_after_the_first_reader_starts_a_new_run():
    def fn(a, b):
        noise_a = torch.randn_like(a)
        used = a + noise_a                     # the first reader of the run's draws
        later = b * 2                          # computed after it
        noise_later = torch.randn_like(later)  # cannot move before `used`
        noise_b = torch.randn_like(b)
        return used, noise_later + noise_b

    gm = _graph_of(fn, (4,), (4,))
    assert draw_randn_like_in_one_op(gm.graph) == 2
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    in_order = [n for n in nodes if n.target is IN_ORDER]
    assert [len(n.args[0]) for n in in_order] == [2]
    assert [n.target for n in nodes].count(torch.ops.aten.randn_like.default) == 1
    # the lone first draw stays before the later ones; the run sits before its first reader
    first = next(n for n in nodes if n.target is torch.ops.aten.randn_like.default)
    assert nodes.index(first) < nodes.index(in_order[0])
    readers = [u for g in in_order[0].users for u in g.users]
    assert all(nodes.index(in_order[0]) < nodes.index(r) for r in readers)
    assert all(u.target is operator.getitem for u in in_order[0].users)


def test_a_single_draw_is_left_as_it_is():
    gm = _graph_of(lambda a: a + torch.randn_like(a), (3,))
    assert draw_randn_like_in_one_op(gm.graph) == 0
