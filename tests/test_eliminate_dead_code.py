"""Pass eliminate_dead_code: the rewrite pinned as a graph diff, and numerics unchanged."""

import torch
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from optpass.capture import GraphKind


class TestEliminateDeadCode(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        torch.manual_seed(0)

    def test_drops_unused_values_of_the_post_grad_step_graph(self):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            out = loss.detach()
            opt.step()
            opt.zero_grad()
            return out

        step = torch.compile(train_step, backend="optpass",
                             options={"passes": ["eliminate_dead_code"]})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(torch.randn(2, 3), torch.randn(2, 2))
        report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.STEP)
        self.assertExpectedInline(optpass.graph_diff(report.graph_before, report.graph_after, context=0), """\
--- before
+++ after
@@ -7,5 +6,0 @@
-full_0: f32[] = aten.full([], 1, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
-empty_0: f32[4, 3] = aten.empty.memory_format([4, 3], dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
-empty_1: f32[4] = aten.empty.memory_format([4], dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
-empty_2: f32[2, 4] = aten.empty.memory_format([2, 4], dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
-empty_3: f32[2] = aten.empty.memory_format([2], dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
@@ -21 +16 @@
-full_1: f32[] = aten.full([], 0.0, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
+full_0: f32[] = aten.full([], 0.0, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
@@ -26 +21 @@
-where_0: f32[2, 4] = aten.where.self(le_0, full_1, mm_0)
+where_0: f32[2, 4] = aten.where.self(le_0, full_0, mm_0)""")
