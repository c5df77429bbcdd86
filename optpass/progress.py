"""What a long compile is doing: one line per phase, on the ``optpass.progress`` logger.

A graph's compile goes through phases: ``checks`` (optpass names the step's values and proves the
requested rewrites legal on Dynamo's graph), ``aten trace`` (AOTAutograd traces forward and backward
to aten and partitions them), ``passes`` (optpass's pipeline), ``inductor`` (Inductor's scheduling,
code generation and C++/Triton compile; with ``lower="eager"`` nothing). Each phase's time is kept in
the graph's report (``GraphReport.phase_seconds``, shown by ``optpass.explain``). Once a graph's
compile has run ``SHOW_AFTER_S`` seconds, each phase that ends logs a line at INFO level saying
what took how long and what comes next, e.g.::

    optpass: step graph 0/0: aten trace took 9.8 s (12.1 s so far); next: passes
    optpass: step graph 0/0: passes took 2.2 s (14.3 s so far); next: inductor
    optpass: step graph 0/0: inductor took 21.5 s; compiled in 35.8 s

Shown by default, the way a training library shows its progress: where no handler would print the
record (nothing configured with ``logging``), a handler on stderr is added to the logger the first
time it logs. Silenced with the logging module: ``logging.getLogger("optpass").setLevel(logging.WARNING)``
(or the ``optpass.progress`` logger alone); with ``logging`` configured, the records go where the
configuration sends them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator

log = logging.getLogger("optpass.progress")

# A compile that has run this long shows its phases.
SHOW_AFTER_S = 2.0
PHASES = ("checks", "aten trace", "passes", "inductor")


class CompileClock:
    """The phases of one graph's compile: ``phase(name)`` times one, ``report.phase_seconds`` keeps
    each, and the logger says what a long compile is doing."""

    def __init__(self, report, started: float | None = None):
        self.report = report
        self.started = time.perf_counter() if started is None else started
        self.phase_started = self.started
        self.current: str | None = None

    def rename(self, name: str) -> None:
        """Call the phase under way ``name`` (what it turned out to be)."""
        self.current = name

    def begin(self, name: str) -> None:
        """End the phase under way (if any) and begin ``name``."""
        self.end(next_phase=name)
        self.current, self.phase_started = name, time.perf_counter()

    def end(self, next_phase: str | None = None) -> None:
        """End the phase under way: record its time and, in a long compile, log it."""
        if self.current is None:
            return
        now = time.perf_counter()
        took, so_far = now - self.phase_started, now - self.started
        seconds = self.report.phase_seconds
        seconds[self.current] = seconds.get(self.current, 0.0) + took
        if so_far >= SHOW_AFTER_S:
            what = (f"optpass: {self.report.kind.value} graph {self.report.captured.compile_id}: {self.current} "
                    f"took {took:.1f} s")
            tail = f" ({so_far:.1f} s so far); next: {next_phase}" if next_phase else f"; compiled in {so_far:.1f} s"
            _emit(what + tail)
        self.current = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the phase ``name`` (the ``with`` block)."""
        self.begin(name)
        try:
            yield
        finally:
            self.end()


def _emit(message: str) -> None:
    if logging.getLogger("optpass").level > logging.INFO or not log.isEnabledFor(logging.INFO):
        return
    if not log.hasHandlers():            # nothing would print it: show it as a training library does
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.info(message)


def _default_level() -> None:
    """INFO on the progress logger unless the user set a level on it; the ``optpass`` logger's own
    level, when the user sets one above INFO, silences it too (``_emit``)."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


_default_level()
