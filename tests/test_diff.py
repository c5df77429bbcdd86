"""Tests for optpass.analysis.diff: stable graph text and small diffs."""

import operator

import expecttest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from optpass.analysis.diff import graph_diff, graph_text

aten = torch.ops.aten


def relu_matmul_sum(x, w):
    return torch.relu(x @ w).sum()


def trace_relu_matmul_sum() -> torch.fx.GraphModule:
    return make_fx(relu_matmul_sum)(torch.randn(2, 3), torch.randn(3, 4))


def insert_mul_after_relu(gm: torch.fx.GraphModule) -> None:
    """Rewrite relu(mm) into relu(mm) * 2, rewiring relu's users to the mul."""
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with gm.graph.inserting_after(relu):
        doubled = gm.graph.call_function(aten.mul.Tensor, (relu, 2.0))
    relu.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    doubled.meta["val"] = relu.meta["val"]
    gm.recompile()


class TinyModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = self.linear(x).relu() * self.scale
        return y.view(-1), self.linear.weight.t()


class TestGraphText(expecttest.TestCase):
    def test_make_fx_graph_prints_normalized_names_and_types(self):
        self.assertExpectedInline(graph_text(trace_relu_matmul_sum()), """\
in0: f32[2, 3] = placeholder
in1: f32[3, 4] = placeholder
mm_0: f32[2, 4] = aten.mm(in0, in1)
relu_0: f32[2, 4] = aten.relu(mm_0)
sum_0: f32[] = aten.sum(relu_0)
return sum_0""")

    def test_shapes_can_be_left_out(self):
        text = graph_text(trace_relu_matmul_sum(), shapes=False)
        self.assertIn("mm_0 = aten.mm(in0, in1)", text)
        self.assertNotIn("f32", text)

    def test_text_is_the_same_for_separate_traces(self):
        first, second = trace_relu_matmul_sum(), trace_relu_matmul_sum()
        self.assertEqual(graph_text(first), graph_text(second))
        self.assertNotIn("0x", graph_text(first))

    def test_text_does_not_depend_on_fx_names(self):
        gm = trace_relu_matmul_sum()
        before = graph_text(gm)
        for node in gm.graph.nodes:
            if node.op != "output":
                node.name = f"renamed_{node.name}_7"
        self.assertEqual(graph_text(gm), before)

    def test_accepts_graph_and_graph_module_without_mutating(self):
        gm = trace_relu_matmul_sum()
        code_before = gm.code
        self.assertEqual(graph_text(gm.graph), graph_text(gm))
        self.assertEqual(gm.code, code_before)

    def test_overload_names_arguments_and_multi_output_types(self):
        def f(x):
            mean, var = torch.var_mean(x, dim=1)
            total = aten.sum.dim_IntList(x, [0])
            return mean + var, total.to(torch.bfloat16), x.new_zeros(2, device="cpu", dtype=torch.int64)

        text = graph_text(make_fx(f)(torch.randn(2, 3)))
        self.assertExpectedInline(text, """\
in0: f32[2, 3] = placeholder
var_mean_0: (f32[2], f32[2]) = aten.var_mean.correction(in0, [1], correction=1)
getitem_0: f32[2] = getitem(var_mean_0, 0)
getitem_1: f32[2] = getitem(var_mean_0, 1)
sum_0: f32[3] = aten.sum.dim_IntList(in0, [0])
add_0: f32[2] = aten.add.Tensor(getitem_0, getitem_1)
_to_copy_0: bf16[3] = aten._to_copy(sum_0, dtype=torch.bfloat16)
new_zeros_0: i64[2] = aten.new_zeros(in0, [2], dtype=torch.int64, device=device('cpu'), pin_memory=False)
return (add_0, _to_copy_0, new_zeros_0)""")

    def test_symbolic_trace_module(self):
        text = graph_text(torch.fx.symbolic_trace(TinyModule()))
        self.assertExpectedInline(text, """\
in0 = placeholder
linear_0 = call_module 'linear'(in0)
relu_0 = .relu(linear_0)
scale_0 = get_attr 'scale'
mul_0 = mul(relu_0, scale_0)
view_0 = .view(mul_0, -1)
linear_weight_0 = get_attr 'linear.weight'
t_0 = .t(linear_weight_0)
return (view_0, t_0)""")


class TestGraphDiff(expecttest.TestCase):
    def test_identical_graphs_have_an_empty_diff(self):
        self.assertEqual(graph_diff(trace_relu_matmul_sum(), trace_relu_matmul_sum()), "")

    def test_inserted_node_shows_only_its_line_and_its_user(self):
        before = trace_relu_matmul_sum()
        after = trace_relu_matmul_sum()
        insert_mul_after_relu(after)
        self.assertExpectedInline(graph_diff(before, after), """\
--- before
+++ after
@@ -2,5 +2,6 @@
 in1: f32[3, 4] = placeholder
 mm_0: f32[2, 4] = aten.mm(in0, in1)
 relu_0: f32[2, 4] = aten.relu(mm_0)
-sum_0: f32[] = aten.sum(relu_0)
+mul_0: f32[2, 4] = aten.mul.Tensor(relu_0, 2.0)
+sum_0: f32[] = aten.sum(mul_0)
 return sum_0""")

    def test_inserting_one_op_does_not_rename_other_ops(self):
        def two_matmuls(x, w):
            return (x @ w) @ w.t()

        before = make_fx(two_matmuls)(torch.randn(2, 3), torch.randn(3, 3))
        after = make_fx(two_matmuls)(torch.randn(2, 3), torch.randn(3, 3))
        first_mm = next(n for n in after.graph.nodes if n.target is aten.mm.default)
        with after.graph.inserting_after(first_mm):
            scaled = after.graph.call_function(aten.mul.Tensor, (first_mm, 0.5))
        first_mm.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)

        changed = [line for line in graph_diff(before, after, context=0, shapes=False).splitlines()
                   if line[:1] in "+-" and not line.startswith(("---", "+++"))]
        # t_0 sits between the two matmuls, so the new mul gets a hunk of its own.
        self.assertEqual(changed, [
            "+mul_0 = aten.mul.Tensor(mm_0, 0.5)",
            "-mm_1 = aten.mm(mm_0, t_0)",
            "+mm_1 = aten.mm(mul_0, t_0)",
        ])

    def test_diff_of_getitem_and_operator_targets(self):
        graph = torch.fx.Graph()
        pair = graph.placeholder("pair")
        first = graph.call_function(operator.getitem, (pair, 0))
        graph.output((first,))
        self.assertIn("getitem_0 = getitem(in0, 0)", graph_text(graph))


if __name__ == "__main__":
    import unittest

    unittest.main()
