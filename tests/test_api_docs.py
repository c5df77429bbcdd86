"""The public API documents itself in one style (Google's): every public function says what it
takes (``Args:``, each parameter by name), what it gives back (``Returns:``, or ``Yields:`` for a
context manager: what ``as`` binds) and, exactly when its code can raise one, ``OptpassError``
under ``Raises:``. Public dataclasses and enums name each field or member under ``Attributes:``.

Whether a function can raise OptpassError is read from the code: it raises it (or a subclass)
itself, or calls a function of optpass that can (matched by name, so it errs on the side of
"can")."""

import ast
import dataclasses
import enum
import inspect
import pathlib
import re

import pytest

import optpass
import optpass.zero1

PACKAGE = pathlib.Path(optpass.__file__).resolve().parent
SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Attributes|Example|Examples|Note|Notes):\s*$", re.M)


def _public() -> list[tuple[str, object]]:
    return [(name, getattr(optpass, name)) for name in optpass.__all__] + [
        ("zero1.sharded_state", optpass.zero1.sharded_state)]


FUNCTIONS = [(name, obj) for name, obj in _public() if inspect.isfunction(obj)]
CLASSES = [(name, obj) for name, obj in _public() if inspect.isclass(obj)]


def _sections(obj) -> dict[str, str]:
    """The docstring's Google-style sections: header -> its text."""
    doc = inspect.getdoc(obj) or ""
    headers = list(SECTION.finditer(doc))
    return {m.group(1): doc[m.end(): headers[i + 1].start() if i + 1 < len(headers) else len(doc)]
            for i, m in enumerate(headers)}


def _can_raise_optpass_error() -> set[str]:
    """Names of the functions and methods in optpass/ that raise OptpassError or call one that does."""
    error_names = {"OptpassError"} | {cls.__name__ for cls in _subclasses(optpass.OptpassError)}
    defs: dict[str, list[ast.AST]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append(node)

    def name_of(expr) -> str | None:
        expr = expr.func if isinstance(expr, ast.Call) else expr
        return expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)

    raising = {name for name, nodes in defs.items() for fn in nodes for n in ast.walk(fn)
               if isinstance(n, ast.Raise) and n.exc is not None and name_of(n.exc) in error_names}
    calls = {name: {name_of(n) for fn in nodes for n in ast.walk(fn) if isinstance(n, ast.Call)}
             for name, nodes in defs.items()}
    while True:                       # callers of raising functions raise too, to a fixed point
        more = {name for name, called in calls.items() if name not in raising and called & raising}
        if not more:
            return raising
        raising |= more


def _subclasses(cls) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub, *_subclasses(sub)}}


RAISING = _can_raise_optpass_error()


def test_the_public_api_has_functions_and_classes_to_check():
    names = {name for name, _ in FUNCTIONS}
    assert {"explain", "optpass_backend", "keep_graphs", "zero1.sharded_state"} <= names
    assert {"sharded_state", "save_sharded_checkpoint", "master_weights"} <= RAISING
    assert "graph_text" not in RAISING


@pytest.mark.parametrize("name, fn", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_public_function_documents_args_returns_and_raises(name, fn):
    sections = _sections(fn)
    summary = (inspect.getdoc(fn) or "").split("\n", 1)[0].strip()
    assert summary, f"{name}: no one-line summary"
    assert "Arguments" not in sections and "Examples" not in sections, f"{name}: say Args: / Example:"

    parameters = list(inspect.signature(fn).parameters.values())
    if parameters:
        assert "Args" in sections, f"{name}: takes {[p.name for p in parameters]} but has no Args: section"
        for p in parameters:
            star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
            assert re.search(rf"^\s*{re.escape(star + p.name)}( \([^)]*\))?:", sections["Args"], re.M), \
                f"{name}: Args: does not describe {star + p.name}"
    else:
        assert "Args" not in sections, f"{name}: takes no parameters but has an Args: section"

    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and inspect.isgeneratorfunction(wrapped):     # a @contextmanager
        assert "Yields" in sections or "Returns" in sections, f"{name}: say what `with ... as` binds"
    elif inspect.signature(fn).return_annotation not in (None, "None"):
        assert sections.get("Returns", "").strip(), f"{name}: returns a value but has no Returns: section"

    raises = fn.__name__ in RAISING
    documented = "OptpassError" in sections.get("Raises", "")
    assert documented == raises, (f"{name}: its code {'can' if raises else 'cannot'} raise OptpassError, "
                                  f"its Raises: section {'names' if documented else 'does not name'} it")


@pytest.mark.parametrize("name, cls", CLASSES, ids=[name for name, _ in CLASSES])
def test_public_class_documents_its_fields_and_what_with_binds(name, cls):
    doc = cls.__dict__.get("__doc__") or ""
    assert doc and not doc.startswith(f"{cls.__name__}("), f"{name}: no docstring of its own"
    if dataclasses.is_dataclass(cls):
        fields = [f.name for f in dataclasses.fields(cls)]
    elif issubclass(cls, enum.Enum):
        fields = [member.name for member in cls]
    else:
        fields = []
    for field in fields:
        assert re.search(rf"^\s*{field}:", _sections(cls).get("Attributes", ""), re.M), \
            f"{name}: Attributes: does not describe {field}"
    if hasattr(cls, "__enter__"):
        assert "Yields" in _sections(cls) or "Returns" in _sections(cls), f"{name}: say what `with ... as` binds"
