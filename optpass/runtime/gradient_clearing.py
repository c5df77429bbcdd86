"""Whether the user's program clears ``.grad`` before every step, read from its source.

A step whose graph runs the update (``FusedStep``) hands back no gradients: ``p.grad`` is None after
every step, whatever the step does after ``opt.step()``. Eager PyTorch leaves each step's gradients
in ``.grad`` unless something clears them, and the next step's backward adds to them. So a program
that does not clear the gradients before every step trains differently under optpass (each update
reads its own step's gradients) than in eager (an update reads the sum since the last clear).
Nothing at run time tells the two apart: ``opt.zero_grad()`` on gradients that are already None does
nothing, in the step or in the loop around it. The source does.

At each new place the compiled step is called from, this module walks the Python frames from the
step outward (the step's own frame runs the compiled code, so it is on the stack) and looks for code
that clears gradients on every step:

* in the step function's body;
* in a caller, in the body of the innermost ``for``/``while`` loop around the line that calls the
  step (the training loop); the first caller whose call is inside a loop decides, since what it
  runs once per iteration is what runs once per step; a caller not in a loop counts its whole body;
* not under an ``if`` of its own (a clear on some steps only is not a clear on every step), unless
  the ``if`` asks whether there are gradients (``if p.grad is not None:``).

Clearing code is a ``zero_grad`` call, an assignment or ``del`` of ``.grad``, ``.grad.zero_()`` (or
``.grad.data.zero_()``, ``fill_(0)``) and ``torch._foreach_zero_``; a call to a function or method
of the user's (resolved from the frame's names) is read too, one call deep. The receiver of
``zero_grad`` is resolved where it is a name, an attribute or a constant index: an optimizer or a
module clears its parameters' gradients, so clearing another optimizer's or a part of the model
leaves the step's other parameters warned about. Where a receiver or the source cannot be read
(``exec`` of a string, a REPL line), it counts as clearing everything: no warning on what cannot be
seen.
"""

from __future__ import annotations

import ast
import functools
import linecache
import sys
import types
import warnings

import torch

from optpass.errors import SourceLine, is_user_file, name_list

_ALL = object()                        # a clear whose targets cannot be read: counts as every parameter
_IN_PLACE_ZEROS = {"zero_"}
_CALL_DEPTH = 1


class GradientsNeverClearedWarning(UserWarning):
    """optimizer_in_backward (or any step whose graph runs the update) on a program that does not
    clear ``.grad`` before every step: eager would add each step's gradients to the ones left in
    ``.grad``; optpass's update reads each step's own (see the module docstring)."""


_WARNED: set[tuple[str, int]] = set()
_CHECKED: set[tuple] = set()


def check_gradients_cleared(step_line: SourceLine | None, feature: str, params: dict[str, torch.Tensor]) -> None:
    """Warn (once per step) when the program around this call of the step does not clear the
    gradients of `params` (name -> parameter) before every step. Checked once per calling place."""
    if step_line is None or (step_line.file, step_line.line) in _WARNED:
        return
    frames = _user_frames(sys._getframe(1))
    key = (step_line.file, step_line.line, tuple((f.f_code, f.f_lineno) for f in frames))
    if key in _CHECKED:
        return
    _CHECKED.add(key)
    missing = _not_cleared(frames, {id(p): name for name, p in params.items()})
    if not missing:
        return
    _WARNED.add((step_line.file, step_line.line))
    which = "" if len(missing) == len(params) else f" of {name_list(missing, 4)}"
    message = (
        f"optpass: {feature}: nothing clears the gradients{which} before every step: not the step "
        f"({step_line.function} at {step_line.file}:{step_line.line}) nor, on every iteration, the loop "
        "that calls it (no opt.zero_grad()). The result differs from eager PyTorch's: eager keeps a step's "
        "gradients in .grad and adds the next step's to them, so its updates read the sum since the last "
        "clear; optpass's update reads each step's own gradients and leaves .grad None (each gradient dies "
        "at its update), and cannot keep the sum. If each step's own gradients are what you want, say so: "
        "call opt.zero_grad() after opt.step() in the step (the supported step shape). To accumulate "
        "gradients over K micro-steps, compile a micro-step without opt.step() and pass "
        "options={..., 'accumulation_steps': K}.")
    warnings.warn_explicit(message, GradientsNeverClearedWarning, step_line.file, step_line.line,
                           module=step_line.function)




def _user_frames(frame) -> list:
    """The user's frames on the stack, innermost (the step's) first."""
    found = []
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            found.append(frame)
        frame = frame.f_back
    return found


def _not_cleared(frames: list, params: dict[int, str]) -> list[str]:
    """Names of `params` (id -> name) whose gradients nothing clears before every step."""
    left = dict(params)
    for index, frame in enumerate(frames):
        scope = _function_of(frame.f_code)
        if scope is None:
            return []                                   # source not readable: counted as cleared
        region, in_loop = (scope, False) if index == 0 else _region_around(scope, frame.f_lineno)
        for cleared in _clears(region, frame, _CALL_DEPTH):
            if cleared is _ALL:
                return []
            for p in cleared:
                left.pop(id(p), None)
        if not left or in_loop:
            break
    return sorted(left.values())


@functools.lru_cache(maxsize=64)
def _parsed(file: str) -> ast.Module | None:
    source = "".join(linecache.getlines(file))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _function_of(code: types.CodeType) -> ast.AST | None:
    """The function (or module) `code` was compiled from, or None when its source cannot be read."""
    tree = _parsed(code.co_filename)
    if tree is None:
        return None
    if code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            name = "<lambda>" if isinstance(node, ast.Lambda) else node.name
            if name == code.co_name and code.co_firstlineno in (first, node.lineno):
                return node
    return None


def _region_around(scope: ast.AST, line: int) -> tuple[ast.AST, bool]:
    """The body of the innermost loop of `scope` (not of a function it defines) holding `line`, or
    `scope` itself when the line is in no loop; and whether it is a loop."""
    loops = [node for node in _own_nodes(scope) if isinstance(node, (ast.For, ast.AsyncFor, ast.While))
             and node.body[0].lineno <= line <= (node.end_lineno or node.lineno)]
    if not loops:
        return scope, False
    loop = max(loops, key=lambda node: node.lineno)
    return ast.Module(body=loop.body, type_ignores=[]), True


def _own_nodes(scope: ast.AST, conditional: bool = True):
    """The nodes of `scope`'s body, not of the functions and classes it defines; without
    `conditional`, not those under an ``if`` (or a conditional expression, a ``try`` handler, a
    ``with`` that may not run) either."""
    pending = list(ast.iter_child_nodes(scope))
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if not conditional and isinstance(node, ast.If) and not _about_gradients(node.test):
            pending.append(node.test)
            continue
        if not conditional and isinstance(node, (ast.IfExp, ast.ExceptHandler, ast.BoolOp)):
            continue
        pending.extend(ast.iter_child_nodes(node))


def _about_gradients(test: ast.AST) -> bool:
    """An ``if`` on whether there are gradients (``if p.grad is not None:``, ``if grads:``) before a
    clear: where there are none there is nothing to clear, so the clear counts as unconditional."""
    return any((isinstance(n, ast.Attribute) and n.attr == "grad") or (isinstance(n, ast.Name) and "grad" in n.id)
               for n in ast.walk(test))


def _clears(region: ast.AST, frame, depth: int):
    """What each unconditional clearing statement of `region` clears: an iterable of parameters, or
    ``_ALL``. Calls to the user's own functions are read `depth` calls deep."""
    for node in _own_nodes(region, conditional=False):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "zero_grad":
                yield _receiver_parameters(func.value, frame)
            elif isinstance(func, ast.Attribute) and func.attr == "_foreach_zero_":
                yield _ALL
            elif isinstance(func, ast.Attribute) and _zeroes_grad(node):
                yield _ALL
            elif depth > 0:
                callee = _resolve(func, frame)
                code = getattr(callee, "__code__", None) or getattr(getattr(callee, "__func__", None), "__code__", None)
                if code is not None and is_user_file(code.co_filename):
                    scope = _function_of(code)
                    if scope is not None:
                        yield from _clears(scope, None, depth - 1)
        elif isinstance(node, (ast.Assign, ast.Delete)) and any(_is_grad(t) for t in node.targets):
            yield _ALL                                    # p.grad = None, del p.grad
        elif isinstance(node, ast.AnnAssign) and _is_grad(node.target):
            yield _ALL


def _is_grad(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and (node.attr == "grad" or (node.attr == "data" and _is_grad(node.value)))


def _zeroes_grad(call: ast.Call) -> bool:
    """``<...>.grad.zero_()``, ``<...>.grad.data.zero_()``, ``<...>.grad.fill_(0)``."""
    func = call.func
    if not _is_grad(func.value):
        return False
    if func.attr in _IN_PLACE_ZEROS:
        return True
    return (func.attr == "fill_" and len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
            and call.args[0].value == 0)


def _receiver_parameters(node: ast.AST, frame):
    """The parameters ``<node>.zero_grad()`` clears: an optimizer's or a module's; ``_ALL`` where
    `node` cannot be read without running code (or no frame is given: a function read, not run)."""
    value = _resolve(node, frame)
    if isinstance(value, torch.optim.Optimizer):
        return [p for group in value.param_groups for p in group["params"]]
    if isinstance(value, torch.nn.Module):
        return list(value.parameters())
    return _ALL


_UNRESOLVED = object()


def _resolve(node: ast.AST, frame):
    """The value of a name, an attribute chain or a constant index into a module (``model[2]``)
    in `frame`, without calling user code; ``_UNRESOLVED`` otherwise."""
    if frame is None:
        return _UNRESOLVED
    if isinstance(node, ast.Name):
        for names in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if node.id in names:
                return names[node.id]
        return _UNRESOLVED
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, frame)
        if base is _UNRESOLVED:
            return _UNRESOLVED
        try:
            return getattr(base, node.attr)
        except Exception:  # noqa: BLE001  (a property that fails: not readable)
            return _UNRESOLVED
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        base = _resolve(node.value, frame)
        if isinstance(base, torch.nn.Module):
            try:
                return base[node.slice.value]
            except Exception:  # noqa: BLE001
                return _UNRESOLVED
    return _UNRESOLVED
