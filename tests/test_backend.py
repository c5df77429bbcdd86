"""The backend: lookup by name, capture, roles, pass pipeline, options, lowering, cache."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import optpass
from optpass.capture import GraphKind, module_path
from optpass.demo.models import MLP, TinyLM


def run_python(code: str, env: dict | None = None, timeout: int = 600) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


SUPPORTED_STEP = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def train_step(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    out = loss.detach()
    opt.step()
    opt.zero_grad()
    return out

x, y = torch.randn(4, 8), torch.randn(4, 2)
"""


def test_backend_by_name_in_a_fresh_interpreter_without_importing_optpass():
    out = run_python(SUPPORTED_STEP + """
import sys
step = torch.compile(train_step, backend="optpass", options={"lower": "eager"})
losses = [step(x, y).item() for _ in range(3)]
from torch._dynamo.utils import counters
assert losses[2] < losses[0], losses
assert all("backward" not in r for r in counters["graph_break"]), dict(counters["graph_break"])
print("optpass" in sys.modules, torch._dynamo.config.trace_autograd_ops, bool(torch._dynamo.config.trace_autograd_ops))
""")
    # traced backward is on for optpass's compiles only (optpass/dynamo_scope.py): false outside them
    assert out.split() == ["True", "optpass.dynamo_scope.ONLY_FOR_OPTPASS_COMPILES", "False"]


def test_dynamos_note_on_torch_optims_record_function_is_dropped_but_not_on_the_users():
    # Dynamo logs "Profiler record function ... will be ignored" when it traces the
    # record_function that wraps every Optimizer.step; optpass drops that one (capture.py).
    note = "Profiler record function"
    optimizer_only = SUPPORTED_STEP + """
step = torch.compile(train_step, backend="optpass", options={"lower": "eager"})
step(x, y); step(x, y)
"""
    users = optimizer_only.replace("    loss = F.mse_loss(model(x), y)", """\
    with torch.autograd.profiler.record_function("my_forward"):
        loss = F.mse_loss(model(x), y)""")
    assert users != optimizer_only
    for code, expected in ((optimizer_only, False), (users, True)):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        assert (note in result.stderr) is expected, result.stderr


def make_step(model, opt, tail_returns_loss=False):
    if tail_returns_loss:  # the tutorial shape: reads loss after opt.step() (docs/design.md §4)
        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
    else:
        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            out = loss.detach()
            opt.step()
            opt.zero_grad()
            return out
    return train_step


def mlp_and_opt(lr=0.1):
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def data():
    return torch.randn(8, 16), torch.randn(8, 4)


def test_step_graph_holds_forward_backward_and_names_every_gradient():
    model, opt = mlp_and_opt()
    step = torch.compile(make_step(model, opt), backend="optpass", options={"lower": "eager"})
    optpass.report.clear_reports()
    step(*data())
    reports = optpass.recent_reports()
    kinds = [r.kind for r in reports]
    assert kinds[:2] == [GraphKind.STEP, GraphKind.UPDATE]
    step_graph, update_graph = reports[0], reports[1]
    names = [n for n, _ in model.named_parameters()]
    assert [p.name for p in step_graph.captured.params] == names
    assert sorted(step_graph.captured.gradient_outputs) == sorted(names)
    # docs/design.md §3: the update graph's gradient placeholders are the step graph's gradient outputs
    assert sorted(update_graph.captured.gradient_inputs) == sorted(names)
    assert set(step_graph.regions) == {"forward", "backward"}
    assert update_graph.regions == {"update": update_graph.aten_ops_after}


def test_parameter_names_are_module_paths():
    assert module_path("G['model']._modules['0']._parameters['weight']") == "0.weight"
    assert module_path("L['self']._modules['layers']._modules['0']._modules['attn']._modules['wq']"
                       "._parameters['weight']") == "layers.0.attn.wq.weight"
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    def train_step(tokens, targets):
        loss = model.loss(tokens, targets)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    tokens = torch.randint(0, model.cfg.vocab, (2, model.cfg.seq_len + 1))
    report = optpass.explain(train_step, tokens[:, :-1], tokens[:, 1:])
    step_report = report.of_kind(GraphKind.STEP)[0]
    names = {p.name for p in step_report.captured.params}
    assert "layers.0.attn.wq.weight" in names and "embed.weight" in names
    assert "head.weight" not in names  # tied to embed.weight: one parameter, one gradient
    assert names == {n for n, _ in model.named_parameters()}
    update = report.of_kind(GraphKind.UPDATE)[0].to_dict()
    assert update["optimizer_state_tensors"] >= 3 * len(names) - 1  # step, exp_avg, exp_avg_sq
    assert any("['lr']" in h for h in update["hyperparameter_inputs"])  # tensor lr is an input


def test_tutorial_shape_warns_once_with_the_line_and_the_fix():
    model, opt = mlp_and_opt()
    step = torch.compile(make_step(model, opt, tail_returns_loss=True), backend="optpass",
                         options={"lower": "eager"})
    with pytest.warns(optpass.BackwardOutsideGraphWarning) as record:
        for _ in range(3):
            step(*data())
    assert len(record) == 1
    message = str(record[0].message)
    assert "test_backend.py" in message and "loss.backward()" in message
    assert "out = loss.detach(); opt.step(); opt.zero_grad(); return out" in message
    assert "autograd.grad consumed returned tensor's grad_fn" in message


def test_post_accumulate_grad_hooks_are_refused():
    model, opt = mlp_and_opt()
    model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    step = torch.compile(make_step(model, opt), backend="optpass", options={"lower": "eager"})
    with pytest.raises(optpass.OptpassError, match=r"0\.weight have post-accumulate-grad hooks"):
        step(*data())


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_dropout_in_a_checkpointed_region_is_refused_with_the_op_and_the_fix(lower):
    """torch cannot recompute a checkpointed region's random ops when backward() is traced into
    the graph (AOTAutograd raises a RuntimeError that names neither the op nor a fix, under any
    backend); optpass refuses with the op, its line and the fix, in both lowerings."""
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x, y):
        out = torch.utils.checkpoint.checkpoint(lambda h: F.dropout(model(h), 0.1), x, use_reentrant=False)
        loss = F.mse_loss(out, y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    step = torch.compile(train_step, backend="optpass", options={"lower": lower})
    with pytest.raises(optpass.OptpassError, match="activation checkpointing would recompute ops that draw "
                                                   "random numbers") as info:
        step(*data())
    assert "aten.native_dropout.default at " in str(info.value) and "test_backend.py" in str(info.value)
    assert "keep dropout out of the checkpointed function" in str(info.value)


@pytest.mark.parametrize("options,match", [
    ({"lowr": "eager"}, r"unknown optpass option 'lowr'; did you mean 'lower'\? The options are: lower, "),
    ({"optimizer_in_backwards": True}, r"did you mean 'optimizer_in_backward'\?"),
    ({"lower": "tvm"}, r"'lower' must be one of 'inductor', 'eager', got 'tvm'\.$"),
    ({"lower": "inducter"}, r"'lower' must be one of 'inductor', 'eager', got 'inducter'; did you mean 'inductor'\?$"),
    ({"lower": 3}, r"'lower' must be str, got int 3\. lower: how the rewritten graph runs"),
    ({"disable_passes": ["no_such_pass"]}, r"unknown optpass pass 'no_such_pass'\. The passes are: "),
    ({"disable_passes": ["optimizer_in_backwards"]}, r"did you mean 'optimizer_in_backward'\?"),
    ({"warn_on_graph_break": "yes"}, r"must be bool"),
])
def test_bad_options_are_errors_that_say_what_is_valid(options, match):
    """A typo is an OptpassError at the first call, with the closest valid name or value; one bad
    value does not reprint every option."""
    model, opt = mlp_and_opt()
    step = torch.compile(make_step(model, opt), backend="optpass", options=options)
    with pytest.raises(optpass.OptpassError, match=match) as info:
        step(*data())
    assert "Valid optpass options:" not in str(info.value)
    assert "TORCHDYNAMO_VERBOSE" not in str(info.value)


def test_passes_are_selectable_disableable_and_logged(caplog):
    model, opt = mlp_and_opt()
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"lower": "eager", "disable_passes": ["eliminate_dead_code"]})
    optpass.report.clear_reports()
    step(*data())
    ran = {p.name for r in optpass.recent_reports() for p in r.passes}
    # every other pass is on by default (the optimizer ones skip themselves unless asked)
    assert ran == {p.name for p in optpass.PASSES} - {"eliminate_dead_code"}

    torch._dynamo.reset()
    optpass.report.clear_reports()
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"lower": "inductor", "passes": ["eliminate_dead_code"]})
    # keep_graphs bypasses the FX graph cache: a cache hit would skip the passes
    with caplog.at_level(logging.INFO, logger="optpass"), optpass.keep_graphs():
        step(*data())
    outcomes = [p for r in optpass.recent_reports() for p in r.passes]
    assert [p.name for p in outcomes] == ["eliminate_dead_code"] * len(outcomes)
    applied = [p for p in outcomes if p.status == "applied"]
    assert applied and all(p.op_delta < 0 for p in applied)
    assert any("eliminate_dead_code: applied, ops" in m for m in caplog.messages)


def test_torch_trace_gets_before_and_after_graphs(tmp_path):
    run_python(SUPPORTED_STEP + """
step = torch.compile(train_step, backend="optpass", options={"lower": "eager"})
step(x, y)
""", env={"TORCH_TRACE": str(tmp_path)})
    logs = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "optpass_before_eliminate_dead_code" in logs
    assert "optpass_after_eliminate_dead_code" in logs


def test_inductor_fx_graph_cache_hits_on_a_second_compile(tmp_path):
    out = run_python(SUPPORTED_STEP + """
from torch._dynamo.utils import counters
for attempt in range(2):
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(train_step, backend="optpass")
    step(x, y)
    step(x, y)
    print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
""", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    first, second = [tuple(map(int, line.split())) for line in out.strip().splitlines()]
    assert first[0] == 0 and first[1] >= 2       # cold: step graph and update graphs compiled
    assert second[0] >= 2 and second[1] == 0     # warm: every graph came from the cache


def test_a_graph_served_by_inductors_cache_still_reports_its_passes(tmp_path):
    """recent_reports() (and the notebooks' pass-status cells) list the passes a cached graph's code
    carries, in a second process as in the same one, marked from_cache."""
    program = SUPPORTED_STEP + """
import json, optpass
from torch._dynamo.utils import counters
for attempt in range(2):
    torch._dynamo.reset()
    optpass.report.clear_reports()
    step = torch.compile(train_step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
    step(x, y)
    reports = [r for r in optpass.recent_reports() if r.kind.value == "step"]
    print(json.dumps([[r.from_cache, [(p.name, p.status) for p in r.passes], r.aten_ops_after] for r in reports]))
print(counters["inductor"]["fxgraph_cache_hit"])
"""
    runs = [run_python(program, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}).strip().splitlines()
            for _ in range(2)]
    import json
    (cold, *warm), hits = [json.loads(line) for line in runs[0][:2]], [runs[0][2], runs[1][2]]
    warm += [json.loads(line) for line in runs[1][:2]]
    assert len(cold) == 1 and cold[0][0] is False
    assert ["optimizer_in_backward", "applied"] in cold[0][1]
    assert int(hits[0]) >= 1 and int(hits[1]) >= 1, hits
    for report in warm:                          # the same process again, then a new process
        assert report == [[True, cold[0][1], cold[0][2]]], (report, cold)


def test_a_job_moved_to_another_machine_starts_warm_from_saved_cache_artifacts(tmp_path):
    """torch.compiler.save_cache_artifacts() after the first steps, load_cache_artifacts() in a new
    process with an empty cache directory (another machine): every Inductor graph of the step comes
    from the artifacts, none is compiled again, and training goes on as in the first process."""
    program = SUPPORTED_STEP + """
import sys, optpass
from torch._dynamo.utils import counters
path, role = sys.argv[1], sys.argv[2]
if role == "resumed":
    torch.compiler.load_cache_artifacts(open(path, "rb").read())
step = torch.compile(train_step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
losses = [step(x, y).item() for _ in range(3)]
if role == "first":
    artifacts, info = torch.compiler.save_cache_artifacts()
    open(path, "wb").write(artifacts)
step_report = next(r for r in optpass.recent_reports() if r.kind.value == "step")
print(step_report.from_cache, sorted(p.name for p in step_report.passes if p.status == "applied"))
print(repr(losses), counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""
    path = str(tmp_path / "artifacts.bin")
    runs = []
    for role in ("first", "resumed"):
        cache = tmp_path / f"cache_{role}"
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(program), path, role], capture_output=True,
                                text=True, timeout=600, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
        assert result.returncode == 0, result.stdout + result.stderr
        reported, counted = result.stdout.strip().splitlines()[-2:]
        runs.append((reported, *counted.rsplit(" ", 2)))
    (first_report, first_losses, _, first_misses), (report, losses, hits, misses) = runs
    # what the passes did reaches the other machine too (the record of the pipeline travels)
    assert first_report.startswith("False") and "optimizer_in_backward" in first_report, runs
    assert report == "True" + first_report[len("False"):], runs
    assert int(first_misses) >= 1
    assert int(hits) >= 1 and int(misses) == 0, runs
    assert losses == first_losses, runs


def test_a_user_who_sets_inductors_subprocess_compile_mode_still_gets_the_rewrite(tmp_path):
    """TORCHINDUCTOR_FX_COMPILE_MODE=SUBPROCESS compiles a graph in a child process with the portable
    config, which leaves optpass's post-grad pass out: without the guard this fp32 step compiled
    there, torch.optim's update ran after backward, and zero1 failed in the child. optpass compiles
    its graphs in the process, so the pass runs, the numbers are eager's, and the mode is the
    user's again afterwards."""
    out = run_python("""
import torch, torch.nn.functional as F
import optpass
import torch._inductor.compile_fx as compile_fx
from torch._inductor.compile_fx_ext import _OutOfProcessFxCompile
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
reference.load_state_dict(model.state_dict())
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

def train_step(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    out = loss.detach()
    opt.step()
    opt.zero_grad()
    return out

step = torch.compile(train_step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
for i in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    step(x, y)
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
applied = [p.status for r in optpass.recent_reports() for p in r.passes if p.name == "optimizer_in_backward"]
print(compile_fx.fx_compile_mode.name, len(applied) > 0 and set(applied) == {"applied"})
print(sorted(k.__name__ for k, v in _OutOfProcessFxCompile._compile_stats.items() if v.codegen_and_compile))
# Inductor's fused update and eager SGD may round differently (1.5e-8 apart on an AMD EPYC without
# AVX-512): a wrong update is off by far more than a few ulps
print(max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(model.parameters(), reference.parameters())) <= 1e-6)
""", env={"TORCHINDUCTOR_FX_COMPILE_MODE": "SUBPROCESS", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    mode, compiled_by, equal = out.strip().splitlines()
    assert mode == "SUBPROCESS True"                 # the user's mode is back; the pass ran here
    assert compiled_by == "['_InProcessFxCompile']"  # not '_SubprocessFxCompile'
    assert equal == "True"


def test_explain_reports_without_training():
    model, opt = mlp_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    report = optpass.explain(make_step(model, opt), *data(), options={"lower": "eager"})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    d = report.to_dict()
    step_graph = d["graphs"][0]
    assert step_graph["kind"] == "step" and step_graph["backward_line"].endswith("loss.backward()")
    assert step_graph["memory_before"]["peak_bytes"] > 0
    assert step_graph["memory_before"]["bytes_by_tag_at_peak"].get("gradient", 0) > 0
    assert [p["name"] for p in step_graph["passes"]] == [p.name for p in optpass.PASSES]
    assert [p["status"] for p in step_graph["passes"]][:2] == ["skipped", "skipped"]  # not requested
    text = str(report)
    assert "forward + backward + gradient transforms" in text
    assert "estimated peak memory" in text and "optimizer update" in text
    assert d["warnings"] == []


def test_explain_of_a_micro_step_leaves_the_gradients_as_they_were():
    """A micro-step (backward, no opt.step()) keeps its gradients: explain hands back .grad as it was
    (not zeros, which the next step would accumulate into)."""
    model, opt = mlp_and_opt()

    def micro_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    optpass.explain(micro_step, *data(), options={"lower": "eager"})
    assert all(p.grad is None for p in model.parameters())
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    optpass.explain(micro_step, *data(), options={"lower": "eager"})
    assert all(p.grad is g and bool((g == 0.5).all()) for p, g in zip(model.parameters(), grads))


def test_explain_shows_why_the_tutorial_shape_splits():
    model, opt = mlp_and_opt()
    report = optpass.explain(make_step(model, opt, tail_returns_loss=True), *data())
    assert report.graphs[0].kind is GraphKind.FORWARD
    assert "autograd.grad consumed returned tensor's grad_fn" in report.to_dict()["graphs"][0]["split_reason"]
    assert len(report.warnings) == 1 and "WARNING" in str(report)


def test_the_report_log_keeps_no_model_alive():
    import gc
    import weakref

    model, opt = mlp_and_opt()
    step = torch.compile(make_step(model, opt), backend="optpass", options={"lower": "eager"})
    step(*data())
    assert optpass.recent_reports()
    ref = weakref.ref(model[0].weight)
    del model, opt, step
    torch._dynamo.reset()
    gc.collect()
    assert ref() is None


def test_random_ops_on_cpu_draw_eager_pytorchs_stream():
    """On CPU optpass lowers random ops to aten's generator (fallback_random): same numbers as
    eager PyTorch for the same seed (DP-SGD noise included), and ~5x faster than Inductor's
    own CPU random kernels."""
    def noisy(x):
        return x + torch.randn_like(x), torch.nn.functional.dropout(x, 0.5)

    x = torch.randn(64, 32)
    torch.manual_seed(7)
    expected = noisy(x)
    compiled = torch.compile(noisy, backend="optpass")
    torch.manual_seed(7)
    got = compiled(x)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
