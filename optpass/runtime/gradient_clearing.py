"""Whether the user's program clears ``.grad`` between steps, read from its source.

A step whose graph runs the update (``FusedStep``) hands back no gradients: ``p.grad`` is None after
every step, whatever the step does after ``opt.step()``. Eager PyTorch leaves each step's gradients
in ``.grad`` unless something clears them, and the next step's backward adds to them. So a program
that never calls ``zero_grad()`` trains differently under optpass (each update reads its own step's
gradients) than in eager (each update reads the running sum). Nothing at run time tells the two
apart: ``opt.zero_grad()`` on gradients that are already None does nothing, in the step or in the
loop around it. The source does: this module looks, in the step function and in every user function
on the stack that calls it (the training loop), for code that clears gradients: a ``zero_grad``
call, an assignment or ``del`` of ``.grad``, or an in-place ``.grad.zero_()``. Where the source
cannot be read (``exec``, a REPL line), it counts as cleared: no warning on what cannot be seen.
"""

from __future__ import annotations

import ast
import functools
import linecache
import traceback
import warnings

from optpass.errors import SourceLine, is_user_file

_CLEARING_METHODS = {"zero_grad"}
_IN_PLACE_CLEARS = {"zero_", "fill_", "mul_", "detach_"}


class GradientsNeverClearedWarning(UserWarning):
    """optimizer_in_backward (or any step whose graph runs the update) on a program with no
    ``zero_grad()``: eager would add each step's gradients to the last; optpass's update reads each
    step's own (see the module docstring)."""


_WARNED: set[tuple[str, int]] = set()


def warn_if_gradients_never_cleared(step_line: SourceLine | None, feature: str) -> None:
    """Warn once per step function when neither it (the function holding `step_line`, its
    ``backward()``) nor a user function on the stack that calls it clears ``.grad``."""
    if step_line is None or (step_line.file, step_line.line) in _WARNED:
        return
    callers = [(f.filename, f.lineno or 0) for f in traceback.extract_stack() if is_user_file(f.filename)]
    if any(_clears_gradients(file, line) for file, line in [(step_line.file, step_line.line), *callers]):
        return
    _WARNED.add((step_line.file, step_line.line))
    message = (
        f"optpass: {feature}: nothing in the step ({step_line.function} at {step_line.file}:{step_line.line}) "
        "or in the code that calls it clears the gradients (no opt.zero_grad()). Eager PyTorch would keep "
        "each step's gradients in .grad and add the next step's to them, so every update would read the "
        "running sum; optpass's update reads the step's own gradients and leaves .grad None (each gradient "
        "dies at its update). If that is what you want, say so: call opt.zero_grad() after opt.step() "
        "(the supported step shape). To accumulate gradients over K micro-steps, compile a micro-step "
        "without opt.step() and pass options={..., 'accumulation_steps': K}.")
    warnings.warn_explicit(message, GradientsNeverClearedWarning, step_line.file, step_line.line,
                           module=step_line.function)


def _clears_gradients(file: str, line: int) -> bool:
    """Whether the innermost function of `file` holding `line` (the module, outside any function)
    clears gradients in its own body; True when the source cannot be read."""
    tree = _parsed(file)
    if tree is None:
        return True
    scopes = [node for node in ast.walk(tree)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              and node.lineno <= line <= (node.end_lineno or node.lineno)]
    scope = max(scopes, key=lambda node: node.lineno) if scopes else tree
    return any(_is_clearing(node) for node in _own_nodes(scope))


def _own_nodes(scope: ast.AST):
    """The nodes of `scope`'s body, not of the functions and classes it defines (a module's
    other functions say nothing about the loop at its top level)."""
    pending = list(ast.iter_child_nodes(scope))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))


@functools.lru_cache(maxsize=64)
def _parsed(file: str) -> ast.Module | None:
    source = "".join(linecache.getlines(file))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _is_grad(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "grad"


def _is_clearing(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in _CLEARING_METHODS:
        return True                                           # opt.zero_grad(), model.zero_grad, ...
    if isinstance(node, (ast.Assign, ast.Delete)):
        return any(_is_grad(target) for target in node.targets)    # p.grad = None, del p.grad
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return _is_grad(node.target)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in _IN_PLACE_CLEARS and _is_grad(node.func.value)   # p.grad.zero_()
    return False
