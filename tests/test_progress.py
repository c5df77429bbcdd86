"""What a long compile is doing: one line per phase on the ``optpass.progress`` logger, shown by
default, silenced with the logging module, and the phase times in the report and in explain."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import optpass
from optpass import progress
from test_backend import SUPPORTED_STEP

def tiny_step():
    """A model, its optimizer, the supported step and a batch (test_backend's program)."""
    namespace = {}
    exec(SUPPORTED_STEP, namespace)
    return namespace["opt"], namespace["train_step"], (namespace["x"], namespace["y"])


@pytest.fixture
def every_compile_is_long(monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)


def test_each_phase_is_logged_with_its_time_and_what_comes_next(every_compile_is_long, caplog):
    """Inductor's caches are off here: another test in this process may have compiled the same
    step, and a cache hit is one phase, ``cached compile`` (test_a_cache_hit_is_one_phase)."""
    torch._dynamo.reset()
    opt, step, batch = tiny_step()
    compiled = torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
    optpass.report.clear_reports()
    with caplog.at_level(logging.INFO, logger="optpass.progress"), \
            torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled(*batch)
    lines = [r.getMessage() for r in caplog.records if r.name == "optpass.progress"]
    assert any("step graph" in line and "aten trace took" in line and "next: passes" in line for line in lines), lines
    assert any("passes took" in line and "next: inductor" in line for line in lines), lines
    assert any("inductor took" in line and "compiled in" in line for line in lines), lines
    step_report = next(r for r in optpass.recent_reports() if r.kind.value == "step")
    assert list(step_report.phase_seconds) == ["checks", "aten trace", "passes", "inductor"], step_report.phase_seconds
    assert all(seconds >= 0 for seconds in step_report.phase_seconds.values())
    assert step_report.to_dict()["phase_seconds"] == step_report.phase_seconds


def test_a_cache_hit_is_one_phase(every_compile_is_long, caplog):
    """A step Inductor's cache serves (the same program compiled twice in a process) is logged as
    one ``cached compile`` phase: the passes did not run, their report is read back."""
    for attempt in range(2):
        torch._dynamo.reset()
        opt, step, batch = tiny_step()
        compiled = torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
        optpass.report.clear_reports()
        with caplog.at_level(logging.INFO, logger="optpass.progress"):
            caplog.clear()
            compiled(*batch)
    lines = [r.getMessage() for r in caplog.records if r.name == "optpass.progress"]
    assert any("step graph" in line and "cached compile took" in line for line in lines), lines
    step_report = next(r for r in optpass.recent_reports() if r.kind.value == "step")
    assert "cached compile" in step_report.phase_seconds, step_report.phase_seconds


def test_a_short_compile_says_nothing(caplog):
    """Under SHOW_AFTER_S (2 s) nothing is logged: a model's tiny graph compiles quietly."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.tanh(x) * 2, backend="optpass", options={"lower": "eager"})
    with caplog.at_level(logging.INFO, logger="optpass.progress"):
        compiled(torch.randn(3))
    times = [r.phase_seconds for r in optpass.recent_reports()]
    assert sum(times[-1].values()) < progress.SHOW_AFTER_S or caplog.records
    if sum(times[-1].values()) < progress.SHOW_AFTER_S:
        assert not [r for r in caplog.records if r.name == "optpass.progress"]


def test_the_optpass_logger_silences_it(every_compile_is_long, caplog):
    torch._dynamo.reset()
    opt, step, batch = tiny_step()
    compiled = torch.compile(step, backend="optpass", options={"optimizer": opt, "lower": "eager"})
    optpass_logger = logging.getLogger("optpass")
    old = optpass_logger.level
    optpass_logger.setLevel(logging.WARNING)
    try:
        with caplog.at_level(logging.INFO, logger="optpass.progress"):
            compiled(*batch)
    finally:
        optpass_logger.setLevel(old)
    assert not [r for r in caplog.records if r.name == "optpass.progress"]


def test_shown_on_stderr_where_logging_is_not_configured():
    """A user's script that configures no logging sees the phases on stderr."""
    script = ("import optpass.progress; optpass.progress.SHOW_AFTER_S = 0.0\n" + SUPPORTED_STEP +
              "step = torch.compile(train_step, backend='optpass', options={'optimizer': opt})\n"
              "step(x, y)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optpass: step graph" in result.stderr and "compiled in" in result.stderr, result.stderr[-3000:]


def test_explain_reports_the_phase_times():
    opt, step, batch = tiny_step()
    text = str(optpass.explain(step, *batch, options={"optimizer": opt, "optimizer_in_backward": True}))
    assert "compile phases: checks" in text and "aten trace" in text and "passes" in text, text
