"""The house rules that can be counted: imports point one way (cli -> tierzero -> storage, and
down the wings of `tierzero` in the order below), no module imports itself back through a
circle, every folder says what it owns, no file outgrows 500 lines, no function 80, no class
holds more than 15 fields, the formatter and linter pass, no part receives the Engine itself,
and the Engine stays a small public face.

Every import counts, including those inside functions and under `TYPE_CHECKING`: a lazy import
that runs back up is still a circle a reader has to hold in mind.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where each installed package's files live
PACKAGE_DIRS = {
    "tierzero": ROOT / "tierzero",
    "tierzero.storage": ROOT / "storage",
    "tierzero.cli": ROOT / "cli",
}
# lower may never import higher; equal ranks may import each other only without a circle
RANKS = {
    "tierzero.storage": 0,
    "tierzero.errors": 1,
    "tierzero.refusals": 1,
    "tierzero.config": 1,
    "tierzero.configfile": 1,
    "tierzero.adamw": 2,
    "tierzero.lr": 2,
    # stored formats of optimizer state and their step: config and storage only
    "tierzero.compact": 2,
    "tierzero.layout": 3,
    "tierzero.models": 4,
    "tierzero.planning": 5,
    "tierzero.precision": 6,
    "tierzero.reference": 6,  # the compute dtype; the oracle every engine path meets
    "tierzero.distributed": 7,
    "tierzero.checkpoint": 8,
    "tierzero.engine": 9,
    "tierzero.hf": 10,
    "tierzero.run": 11,
    "tierzero.bench": 11,  # the benchmarks' logic: drives an Engine as run/ does
    "tierzero": 12,  # the package's own __init__: the public names
    "tierzero.cli": 13,
}
MAX_LINES = 500  # a file: split where a second concept starts, not to meet a count
MAX_FUNCTION_LINES = 80  # a function longer than this is steps that want names
MAX_FIELDS = 15  # annotated fields of a class: more is several records in one
ENGINE_FACE_LINES = 400  # `Engine`: the public face over its parts, not where they meet
ENGINE_TOP_FILES = 8  # the engine's own floor: its face and what wires the rooms, the rest in rooms


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "tierzero" and parts and parts[0] in ("storage", "cli"):
                continue
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _rank(module: str) -> int:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len)
    return RANKS[best]


def _imports(module: str, path: Path) -> set[str]:
    """The tierzero modules `module` imports (a `from pkg import mod` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("tierzero") and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_imports_point_down():
    upward = [f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets if _rank(t) > _rank(m)]
    assert upward == []


def test_no_import_circle():
    graph = GRAPH
    circles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                circles.append(
                    " -> ".join(stack[stack.index(t) :] + [m, t]) if t in stack else f"{m} -> {t}"
                )
            elif t not in state:
                visit(t, stack + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert circles == []


def test_every_folder_says_what_it_owns():
    silent = []
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if not doc or not doc.strip():
                silent.append(module)
    assert silent == []


# every Python file the formatter and these counts cover: the packages, tests and benchmarks
SOURCES = sorted(
    p
    for folder in ("tierzero", "storage", "cli", "tests", "benchmarks")
    for p in (ROOT / folder).rglob("*.py")
)


def test_no_file_outgrows_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_functions_and_records_stay_readable():
    """No function over MAX_FUNCTION_LINES lines, no class with more than MAX_FIELDS annotated
    fields: a long function is named steps, a wide record several records."""
    long, wide = {}, {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[where] = n
            if isinstance(node, ast.ClassDef):
                if (n := sum(isinstance(b, ast.AnnAssign) for b in node.body)) > MAX_FIELDS:
                    wide[where] = n
    assert long == {} and wide == {}


def test_the_formatter_and_the_linter_pass():
    """`ruff format --check` and `ruff check` (line length 100; pyproject.toml) over the tree."""
    for args in (["format", "--check"], ["check"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_no_part_takes_the_engine():
    """A part gets the collaborators it uses, named in its signature: never the Engine as an
    untyped (or `Any`) argument or a back-reference (a loop no import graph would show), and no
    constructor takes the engine's whole record of parts (`EngineParts`)."""
    loose = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    typed = arg.annotation is not None and ast.unparse(arg.annotation) not in (
                        "Any",
                        "object",
                    )
                    if arg.arg in ("engine", "eng") and not typed:
                        loose.append(f"{module}: {arg.arg}")
                    whole = arg.annotation is not None and "EngineParts" in ast.unparse(
                        arg.annotation
                    )
                    if getattr(node, "name", "") == "__init__" and whole:
                        loose.append(f"{module}: __init__({arg.arg}: EngineParts)")
                    if (
                        module.startswith("tierzero.engine.")
                        and module != "tierzero.engine.engine"
                        and arg.annotation is not None
                        and "Engine" in ast.unparse(arg.annotation).split(".")
                    ):
                        loose.append(f"{module}: {arg.arg}: {ast.unparse(arg.annotation)}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "engine"
                and isinstance(node.ctx, ast.Store)
                and module.startswith("tierzero.engine")
            ):
                loose.append(f"{module}: .engine =")
    assert loose == []


def test_the_engine_is_a_small_public_face():
    """`Engine` under ENGINE_FACE_LINES lines, and each public method of it used outside the
    engine wing (by the run, the CLI, benchmarks, tests or the README), none only by its parts."""
    path = ROOT / "tierzero" / "engine" / "engine.py"
    assert len(path.read_text().splitlines()) < ENGINE_FACE_LINES
    engine = next(
        n
        for n in ast.parse(path.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "Engine"
    )
    public = [
        f.name for f in engine.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
    ]
    outside = [
        p
        for folder in ("tierzero", "cli", "benchmarks", "tests")
        for p in (ROOT / folder).rglob("*.py")
        if not p.is_relative_to(ROOT / "tierzero" / "engine")
    ] + [ROOT / "README.md"]
    text = "\n".join(p.read_text() for p in outside)
    assert "train_step" in public and [m for m in public if f".{m}(" not in text] == []


def test_the_graph_is_read():
    """The checks above see the engine's real imports (a broken walk would pass them vacuously)."""
    assert "tierzero.layout.partition" in GRAPH["tierzero.engine.engine"]
    assert "tierzero.storage.base" in GRAPH["tierzero.engine.runtime.tiers"]
    assert (
        _rank("tierzero.cli.app") > _rank("tierzero.engine.engine") > _rank("tierzero.storage.nvme")
    )


def test_engine_lives_in_rooms():
    """The engine wing keeps its parts in rooms (runtime, step, vertical), not one drawer."""
    top = sorted(p.name for p in (ROOT / "tierzero" / "engine").glob("*.py"))
    assert len(top) <= ENGINE_TOP_FILES, top
