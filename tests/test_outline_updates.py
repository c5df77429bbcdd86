"""outline_updates: each parameter's update is one call of an update compiled once per kind.

Pinned: the rewrite (graph diff), that a recompile of the step compiles no update again, that a
fresh process served by Inductor's FX graph cache finds the kinds on disk, and that every result
equals eager."""

import os
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from optpass.kernels import outlined_update
from optpass.passes import outline_updates
from parity import make_step as train_step


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def mlp_and_adamw(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)


def outlined_graph_diff(model, opt, *inputs):
    """The fused step graph before and after outline_updates (its kinds named kind0, kind1, ...)."""
    step = torch.compile(train_step(model, opt, mse), backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*inputs)
    report = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1]
    before = report.graph_after
    after = torch.fx.Graph()
    after.output(after.graph_copy(before, {}))
    outline_updates.run(after)
    kinds: dict[str, str] = {}
    for node in after.nodes:
        if node.target is torch.ops.optpass.outlined_update.default:
            node.args = (kinds.setdefault(node.args[0], f"kind{len(kinds)}"), *node.args[1:])
    return optpass.graph_diff(before, after, shapes=False, context=1)


class TestOutlineUpdatesGraph(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_each_update_becomes_one_call_and_alike_parameters_share_a_kind(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        diff = outlined_graph_diff(model, opt, torch.randn(4, 8), torch.randn(4, 16))
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -28,16 +28,6 @@
 alias_0 = aten.alias(view_0)
-clone_0 = aten.clone(alias_0)
-neg_0 = aten.neg(in6)
-fma_0 = prims.fma(clone_0, neg_0, in4)
-copy_0 = aten.copy(in4, fma_0)
-copy__0 = aten.copy_(in10, clone_0)
-copy__1 = aten.copy_(in4, copy_0)
+outlined_update_0 = optpass.outlined_update('kind0', [in10, in4], [alias_0, in6], [])
 t_5 = aten.t(t_4)
 alias_1 = aten.alias(t_5)
-clone_1 = aten.clone(alias_1)
-neg_1 = aten.neg(in6)
-fma_1 = prims.fma(clone_1, neg_1, in3)
-copy_1 = aten.copy(in3, fma_1)
-copy__2 = aten.copy_(in9, clone_1)
-copy__3 = aten.copy_(in3, copy_1)
+outlined_update_1 = optpass.outlined_update('kind1', [in9, in3], [alias_1, in6], [])
 detach_1 = aten.detach(detach_0)
@@ -50,16 +40,6 @@
 alias_2 = aten.alias(view_1)
-clone_2 = aten.clone(alias_2)
-neg_2 = aten.neg(in6)
-fma_2 = prims.fma(clone_2, neg_2, in1)
-copy_2 = aten.copy(in1, fma_2)
-copy__4 = aten.copy_(in8, clone_2)
-copy__5 = aten.copy_(in1, copy_2)
+outlined_update_2 = optpass.outlined_update('kind0', [in8, in1], [alias_2, in6], [])
 t_8 = aten.t(t_7)
 alias_3 = aten.alias(t_8)
-clone_3 = aten.clone(alias_3)
-neg_3 = aten.neg(in6)
-fma_3 = prims.fma(clone_3, neg_3, in0)
-copy_3 = aten.copy(in0, fma_3)
-copy__6 = aten.copy_(in7, clone_3)
-copy__7 = aten.copy_(in0, copy_3)
+outlined_update_3 = optpass.outlined_update('kind2', [in7, in0], [alias_3, in6], [])
 detach_2 = aten.detach(mse_loss_0)""")


class TestOutlinedUpdatesCompileOnce(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_a_recompile_compiles_no_update_again_and_every_step_equals_eager(self):
        eager_model, eager_opt = mlp_and_adamw()
        model, opt = mlp_and_adamw()
        eager = train_step(eager_model, eager_opt, mse)
        step = torch.compile(train_step(model, opt, mse), backend="optpass",
                             options={"optimizer": opt, "optimizer_in_backward": True})
        torch.manual_seed(1)
        optpass.report.clear_reports()
        compiled_after = []
        for batch in (4, 4, 4, 7, 7, 9):   # 7: a recompile (the batch size marked dynamic), 9: none
            x, y = torch.randn(batch, 8), torch.randn(batch, 16)
            torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
            compiled_after.append(outlined_update.kinds_compiled())
        # 3 kinds of update here (16x8, 16x16 weights; 16 biases), compiled by the first step only
        self.assertEqual(compiled_after, [compiled_after[0]] * 6)
        steps = [r for r in optpass.recent_reports() if r.kind.value == "step"]
        self.assertEqual([r.outlined_updates for r in steps], [6, 6])   # first compile, recompile

    def test_option_off_lowers_every_update_inline(self):
        eager_model, eager_opt = mlp_and_adamw()
        model, opt = mlp_and_adamw()
        eager = train_step(eager_model, eager_opt, mse)
        step = torch.compile(train_step(model, opt, mse), backend="optpass",
                             options={"optimizer": opt, "optimizer_in_backward": True, "outline_updates": False})
        optpass.report.clear_reports()
        before = outlined_update.kinds_compiled()
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 16)
            torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
        self.assertEqual(outlined_update.kinds_compiled(), before)
        self.assertEqual([r.outlined_updates for r in optpass.recent_reports() if r.kind.value == "step"], [None])
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt.state[p][key], eager_opt.state[q][key], rtol=1e-5, atol=1e-6)

    def test_a_fresh_process_served_by_inductors_cache_finds_the_updates_on_disk(self):
        program = textwrap.dedent("""
            import torch, torch.nn as nn, torch.nn.functional as F
            import optpass
            from optpass.kernels import outlined_update
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
            def step(x, y):
                loss = F.mse_loss(model(x), y)
                loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out
            step = torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
            x, y = torch.randn(5, 8), torch.randn(5, 4)
            losses = [step(x, y).item() for _ in range(3)]
            cache = torch._dynamo.utils.counters["inductor"]
            print("RESULT", f"{cache['fxgraph_cache_hit']}/{cache['fxgraph_cache_miss']}",
                  outlined_update.graphs_loaded_from_disk(), repr(losses),
                  repr([p.sum().item() for p in model.parameters()]))
        """)
        cache = self.enterContext(_temporary_directory())
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                                 timeout=600)
            self.assertEqual(out.returncode, 0, out.stderr[-3000:])
            runs.append(next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split(" ", 3))
        (_, hits_cold, loaded_cold, _), (_, hits_warm, loaded_warm, _) = runs
        # cold: the step graph and the 4 kinds of update (2 weights, 2 biases) compiled, none cached;
        # warm: all 5 from Inductor's cache, the kinds' graphs read from disk
        self.assertEqual((hits_cold, loaded_cold), ("0/5", "0"))
        self.assertEqual((hits_warm, loaded_warm), ("5/0", "4"))
        self.assertEqual(runs[0][3], runs[1][3])    # the same losses and parameters, to the bit


def _temporary_directory():
    import tempfile
    return tempfile.TemporaryDirectory()
