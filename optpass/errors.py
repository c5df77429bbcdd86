"""Errors that say what, where (the user's source line) and what to do instead.

Graph nodes carry the Python stack that created them (``node.meta["stack_trace"]``);
``user_line`` picks the innermost frame that is the user's code rather than
torch's or optpass's, so a refusal can point at ``clip_grad_norm_(...)`` in the
user's file instead of at a line inside torch.nn.utils.
"""

from __future__ import annotations

import dataclasses
import os
import re
import traceback
import warnings

import torch
from torch._dynamo.exc import ShortenTraceback

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')
_TORCH_DIR = os.path.dirname(torch.__file__)
_OPTPASS_DIR = os.path.dirname(__file__)
# optpass's own runnable examples are user code: their lines are what a reader should see.
_OPTPASS_USER_FILES = {os.path.join(_OPTPASS_DIR, "demo", "__main__.py")}


def name_list(names: list[str], most: int) -> str:
    """The first ``most`` names, comma-separated, and how many more there are: for messages that
    name what they refuse without listing a whole model."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class OptpassError(ShortenTraceback):
    """optpass refused a program or an input; the message says why and what to do.

    A ``RuntimeError``. It derives from Dynamo's ``ShortenTraceback``, the one kind of exception
    that Dynamo and Inductor let through from a backend unwrapped: raised while ``torch.compile``
    compiles the step, it reaches the caller as itself (``except optpass.OptpassError`` catches
    it), not as ``BackendCompilerFailed``. Dynamo appends its stack and bug-report footer to the
    exception's ``args`` on the way out; the message stays optpass's own (``__str__``).

    Args:
        *args: the message first (what was refused, where, and what to do instead).

    Attributes:
        message: the message, as ``str(error)`` gives it ("" when raised without one).
    """

    def __init__(self, *args) -> None:
        super().__init__(*args, first_useful_frame=None)
        self.message = str(args[0]) if args else ""

    def __str__(self) -> str:
        return self.message


# Dynamo names the function it resumes after a graph break torch_dynamo_resume_in_<name>_at_<line>
# (nested after a second break): the user wrote <name>
_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


@dataclasses.dataclass(frozen=True)
class SourceLine:
    file: str
    line: int
    function: str
    code: str

    def __post_init__(self) -> None:
        name = self.function
        while (resumed := _RESUME.match(name)) is not None:
            name = resumed.group(1)
        object.__setattr__(self, "function", name)

    def __str__(self) -> str:
        code = self.code.strip()
        return f'{self.file}:{self.line} in {self.function}' + (f': {code}' if code else '')


def is_user_file(path: str) -> bool:
    path = os.path.abspath(path)
    if path in _OPTPASS_USER_FILES:
        return True
    return not any(path.startswith(d + os.sep) for d in (_TORCH_DIR, _OPTPASS_DIR)) and "<frozen" not in path


def user_line_from_frames(frames: list[traceback.FrameSummary]) -> SourceLine | None:
    """The innermost user frame of a list of frame summaries (outermost first)."""
    for frame in reversed(frames):
        if is_user_file(frame.filename):
            return SourceLine(frame.filename, frame.lineno or 0, frame.name, frame.line or "")
    return None


def stack_frames(stack_trace: str | None) -> list[SourceLine]:
    """Every frame of a node's ``meta['stack_trace']`` string, outermost first."""
    return [SourceLine(m["file"], int(m["line"]), m["func"], m["code"])
            for m in _FRAME.finditer(stack_trace or "")]


def user_line(stack_trace: str | None) -> SourceLine | None:
    """The innermost user frame of a node's ``meta['stack_trace']`` string."""
    frames = [traceback.FrameSummary(f.file, f.line, f.function, line=f.code) for f in stack_frames(stack_trace)]
    return user_line_from_frames(frames)


def node_user_line(node: torch.fx.Node) -> SourceLine | None:
    return user_line(node.meta.get("stack_trace"))


def warn_at_user_line(message: str, category: type[Warning], where: SourceLine | None = None) -> None:
    """A warning attributed to the user's line (``where``, else the innermost user frame calling the
    compiled step), not to the optpass line that raised it."""
    where = where or user_line_from_frames(traceback.extract_stack())
    if where is None:
        warnings.warn(message, category, stacklevel=3)
        return
    warnings.warn_explicit(message, category, where.file, where.line, module=where.function)
