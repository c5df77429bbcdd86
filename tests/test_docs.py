"""The docs stay true: the README's test command is what CI runs, its options table is the real one,
every relative link resolves, every citation of docs/design.md names a fact that is there, and the
code cites nothing outside the repository."""

import pathlib
import re

import pytest

from optpass.options import options_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def _docs() -> list[pathlib.Path]:
    """The Markdown a reader follows links through: the README, docs/, the bench results."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]


def test_ci_runs_exactly_the_readme_test_command():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                  if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci_command) == 1
    assert ci_command[0] in (ROOT / "README.md").read_text()


def test_readme_options_table_is_generated_from_the_options():
    assert options_table() in (ROOT / "README.md").read_text()


def test_readme_pins_torch_in_both_commands():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pip install torch==2.13.0 -e . && python -m optpass.demo" in readme


def test_readme_is_a_newcomers_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


# ------------------------------------------------------------------ links

def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    anchors, seen = set(), {}
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _relative_links(path: pathlib.Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]   # not http:, mailto:, ...


def test_the_docs_have_relative_links_to_check():
    assert _relative_links(ROOT / "README.md")
    assert all(path.exists() for path in _docs())


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_anchor(doc):
    broken = []
    for target in _relative_links(doc):
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists() or ROOT not in (linked, *linked.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and (linked.suffix != ".md" or anchor not in _anchors(linked)):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_carry_no_history():
    """Dates and commits of measurements belong in bench/RESULTS.md; the rest of the docs say what is."""
    for doc in _docs():
        if doc.name == "RESULTS.md":
            continue
        text = doc.read_text()
        dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
        commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
                   if re.search(r"\d", w) and re.search(r"[a-f]", w)]
        assert not dates and not commits, (doc.relative_to(ROOT), dates, commits)


# ------------------------------------------------------------------ citations of docs/design.md

def _facts() -> list[int]:
    return [int(n) for n in re.findall(r"^### §(\d+) ", DESIGN.read_text(), flags=re.M)]


def _cited(text: str, *, bare: bool) -> set[int]:
    """Fact numbers cited as 'docs/design.md §N' (with ranges 'N-M' and lists '§N, §M'), or any '§N'."""
    if bare:
        spans = re.findall(r"§\d+(?:\s*[-–]\s*§?\d+)?", text)
    else:
        spans = [m.group(0) for m in re.finditer(
            r"design\.md\)?,?\s+(?:facts?\s+)?§\d+(?:\s*[-–]\s*§?\d+)?(?:\s*(?:,|and)\s*§\d+(?:\s*[-–]\s*§?\d+)?)*",
            text)]
    numbers = set()
    for span in spans:
        for first, last in re.findall(r"§(\d+)(?:\s*[-–]\s*§?(\d+))?", span):
            numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def _code_files() -> list[pathlib.Path]:
    files = [ROOT / "pyproject.toml"]
    for folder in ("optpass", "tests", "bench", "examples"):
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and p.suffix in (".py", ".md", ".toml", ".ipynb", ".txt", ".sh", ".cfg")
                  and "__pycache__" not in p.parts]
    return files


def test_design_facts_are_numbered_once_in_order():
    facts = _facts()
    assert facts == list(range(1, len(facts) + 1)), facts


def test_every_citation_of_design_md_names_a_fact_that_is_there():
    facts = set(_facts())
    missing = {}
    for doc in _docs():
        # in the docs a bare '§N' is always a fact of docs/design.md
        if unknown := _cited(doc.read_text(), bare=True) - facts:
            missing[str(doc.relative_to(ROOT))] = sorted(unknown)
    for path in _code_files():
        if path == pathlib.Path(__file__).resolve():
            continue
        if unknown := _cited(path.read_text(errors="replace"), bare=False) - facts:
            missing[str(path.relative_to(ROOT))] = sorted(unknown)
    assert not missing, missing


# Design notes, background files and "fact N" lists that live outside this repository.
OUTSIDE = re.compile(r"DESIGN\.md|\bDESIGN\b|\.\./shared|\bshared/|/work/|\bfacts?\s+\d+")


def test_nothing_cites_a_file_outside_the_repository():
    """Code, tests, benches, examples and pyproject cite docs/design.md §N, never a file a clone lacks."""
    hits = []
    for path in _code_files():
        if path == pathlib.Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


# History belongs to git: a date, "until/since <date>" or a tracker number in code or a message.
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:[Uu]ntil|[Ss]ince) 20\d\d|\b[Ii]ssue #?\d+")


def test_code_comments_and_messages_carry_no_history():
    """Docstrings, comments and messages in optpass/, tests/, bench/*.py and examples/*.py say what
    holds; when it changed is in git (bench/RESULTS.md dates its measurements)."""
    hits = []
    for path in _code_files():
        if path == pathlib.Path(__file__).resolve() or path.suffix != ".py":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_a_cpu_install_needs_no_gpu_compiler():
    """The README's first command (`pip install torch==2.13.0 -e .`) installs no triton: it runs only the
    DP-SGD norm kernels on CUDA (whose torch builds bring their own). Only the Triton kernels' module
    imports it, and no module imports that one at load time (the CPU path never does; torch's own
    Dynamo imports triton where it is installed, so the check reads the sources)."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.split(">")[0].split("=")[0].strip() == "triton" for d in project["dependencies"])
    assert "triton" in project["optional-dependencies"]["gpu"]
    at_load = {}
    for path in (ROOT / "optpass").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:      # module level only: a function's import is lazy
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "triton" or n.startswith("triton.") or n.endswith("_triton_per_sample_norm") for n in names):
                at_load.setdefault(path.relative_to(ROOT).as_posix(), []).extend(names)
    assert set(at_load) == {"optpass/kernels/_triton_per_sample_norm.py"}, at_load
