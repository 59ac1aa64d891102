"""The layout rules of docs/architecture.md, checked on the package's own imports.

Every ``import`` of a ``lightning_accel`` module (at module level or inside a function) is an edge. The checks:
no cycle among modules; no import from a lower floor to a higher one (a room may import its own modules and any
room on a lower floor); imports inside functions only for the optional heavy dependencies listed with a reason;
modules and functions stay short unless listed with a reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_accel"

# Floors, lowest first: a room imports only from rooms on lower floors (and from within itself).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("_compat", "extras", "logs"),  # every Lightning private name we use; which pip extra each feature needs; logging
    ("phases", "host", "figures", "ranks", "blocks", "storage", "contracts"),  # shared facts, storage, protocols
    ("precision", "compile", "float8", "data", "strategies", "checkpoint", "testing"),  # training is made of
    ("monitor", "demos"),  # observes training, never changes it; demo models and data, built on the floors below
    ("profile",),  # reads what monitor/ recorded
    ("recipe",),  # builds a run from a recipe: Trainer, LightningCLI
    ("tuning", "launch"),  # run recipes: as trials, on torchrun or Ray
    ("cli",),  # the commands
    ("",),  # lightning_accel/__init__.py: the public API, re-exports
)

# Imports inside a function, by the top-level module imported: each one's reason. Anything else imports at the top.
LAZY_IMPORTS = {
    "matplotlib": "slow to import (about 1 s): only when a figure is drawn",
    "deepspeed": "heavy, and it picks its accelerator at import: imported when a ZeRO checkpoint is converted",
    "ray": "the [ray] extra (Ray Train), imported when a Ray run starts",
    "hta": "HolisticTraceAnalysis, the [profile] extra, read only for GPU traces",
    "transformer_engine": "optional, GPU only: probed to offer fp8 in tune",
    "torchao": "float8 training: imported when Float8Training converts a model (its CUDA kernels load at import)",
    "pynvml": "NVML: its import is tried only when a CUDA device is visible (a clear reason logged if it fails)",
    "lightning_accel.tuning": "tune(): its search imports LightningCLI and the trial server, which training never "
    "needs; the top level imports it on first use",
    "lightning_accel.data.dali": "DALI: a heavy import (CUDA libraries), done on first use of a DALI name",
    "lightning_accel.data.dali_loader": "DALI: a heavy import (CUDA libraries), done on first use of a DALI name",
}

# Longer than the limits below, with the reason a reader would accept.
LONG_MODULES = {
    "lightning_accel/checkpoint/preemption.py": "a Callback on 14 of Lightning's hooks, each marked @override; what "
    "they do lives in the modules beside it (signals, retention, save timing, destination, epoch and RNG state)",
    "lightning_accel/tuning/search.py": "the staged search: its stages, budget estimates and final choice share state",
}
LONG_FUNCTIONS: dict[str, str] = {
    "lightning_accel/tuning/__init__.py:tune": "builds the run from a recipe or from objects, then runs the search; "
    "each branch is a few lines of the same sequence",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    edges: dict[str, set[str]] = field(default_factory=dict)  # importer -> imported modules
    lazy: list[tuple[str, str, str]] = field(default_factory=list)  # (module, function, imported module)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_graph(root: Path = PACKAGE) -> Graph:
    graph = Graph({module_name(p, root): p for p in sorted(root.rglob("*.py"))})
    for name, path in graph.modules.items():
        graph.edges[name] = set()
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        local = {id(i): f.name for f in functions for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            for target in imported(node, name, graph.modules):
                if id(node) in local:
                    graph.lazy.append((name, local[id(node)], target))
                if target.startswith("lightning_accel"):
                    graph.edges[name].add(target)
    return graph


def imported(node: ast.AST, importer: str, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement loads: ``from a.b import c`` is ``a.b.c`` where that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom) or node.module is None:
        return []
    base = node.module
    if node.level:  # relative: resolved against the importer's package
        package = importer.split(".")[: len(importer.split(".")) - node.level + (importer in packages(modules))]
        base = ".".join([*package, node.module])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def packages(modules: dict[str, Path]) -> set[str]:
    return {name for name, path in modules.items() if path.name == "__init__.py"}


def room(module: str) -> str:
    """``lightning_accel.checkpoint.atomic`` -> ``checkpoint``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor(module: str) -> int:
    for level, rooms in enumerate(FLOORS):
        if room(module) in rooms:
            return level
    raise AssertionError(f"{module}: its room {room(module)!r} is on no floor; add it to FLOORS and the docs")


def upward_imports(graph: Graph) -> list[str]:
    return [
        f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
        for a, targets in graph.edges.items()
        for b in sorted(targets)
        if room(a) != room(b) and floor(b) >= floor(a)
    ]


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph.edges):
        if node not in index:
            visit(node)
    return found


def unlisted_lazy_imports(graph: Graph) -> list[str]:
    def listed(target: str) -> bool:
        return any(target == name or target.startswith(name + ".") for name in LAZY_IMPORTS)

    return [f"{m}.{fn}() imports {t} inside a function" for m, fn, t in graph.lazy if not listed(t)]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return read_graph()


def test_the_package_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_no_room_imports_from_a_floor_above_its_own(graph):
    assert upward_imports(graph) == []


def test_the_checks_fail_on_an_injected_cycle(graph):
    graph.edges["lightning_accel.checkpoint.durable"].add("lightning_accel.checkpoint.atomic")  # atomic -> durable
    try:
        pair = {"lightning_accel.checkpoint.atomic", "lightning_accel.checkpoint.durable"}
        assert any(pair <= set(cycle) for cycle in cycles(graph))
    finally:
        graph.edges["lightning_accel.checkpoint.durable"].discard("lightning_accel.checkpoint.atomic")


def test_the_checks_fail_on_an_injected_upward_import(graph):
    graph.edges["lightning_accel.strategies.fsdp"].add("lightning_accel.recipe")
    try:
        assert upward_imports(graph) == [
            "lightning_accel.strategies.fsdp (floor 2) imports lightning_accel.recipe (floor 5)"
        ]
    finally:
        graph.edges["lightning_accel.strategies.fsdp"].discard("lightning_accel.recipe")


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "lightning_accel"
    (pkg / "checkpoint").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "checkpoint" / "__init__.py").write_text("from .atomic import save\n")
    (pkg / "checkpoint" / "atomic.py").write_text("def save():\n    from lightning_accel.cli import main\n")
    (pkg / "cli.py").write_text("from lightning_accel.checkpoint import save\n")
    graph = read_graph(pkg)
    assert graph.edges["lightning_accel.checkpoint"] == {"lightning_accel.checkpoint.atomic"}
    assert graph.lazy == [("lightning_accel.checkpoint.atomic", "save", "lightning_accel.cli")]
    assert unlisted_lazy_imports(graph) == [
        "lightning_accel.checkpoint.atomic.save() imports lightning_accel.cli inside a function"
    ]
    assert upward_imports(graph) == [
        "lightning_accel.checkpoint.atomic (floor 2) imports lightning_accel.cli (floor 7)"
    ]
    assert cycles(graph) == [["lightning_accel.checkpoint", "lightning_accel.checkpoint.atomic", "lightning_accel.cli"]]


def test_imports_inside_functions_are_only_the_optional_heavy_ones(graph):
    assert unlisted_lazy_imports(graph) == []


def test_every_room_is_on_a_floor(graph):
    for module in graph.modules:
        floor(module)


def test_modules_and_functions_stay_short_unless_a_reason_is_given(graph):
    long = []
    for path in graph.modules.values():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES and rel not in LONG_MODULES:
            long.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    long.append(f"{rel}:{node.name}: {length} lines")
    assert long == []


def test_every_module_is_named_in_the_architecture_doc(graph):
    """docs/architecture.md names each module file (``name.py``, in its room's row; a package's ``__init__`` is its
    room): a module added without saying where it lives fails here."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(PACKAGE.parent))
        for path in graph.modules.values()
        if path.name != "__init__.py" and path.name not in doc
    ]
    assert unnamed == []


def test_every_test_file_the_code_and_docs_point_to_exists():
    """Comments and guides that send a reader to ``tests/....py``, and the suite's longest-first order, name files
    that are there (tests move)."""
    root = PACKAGE.parent
    pointing = [*PACKAGE.rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md", root / "tests/conftest.py"]
    texts = [p.read_text() for p in pointing]
    named = {
        m for text in [*texts, (root / "pyproject.toml").read_text()] for m in re.findall(r"tests/[\w/]+\.py", text)
    }
    assert named and sorted(n for n in named if not (root / n).is_file()) == []


def test_the_readme_api_table_lists_exactly_the_public_names():
    """The README's API table and ``lightning_accel.__all__`` name the same things (a new export needs its line)."""
    import re

    import lightning_accel

    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme.split("## API", 1)[1].split("\n## ", 1)[0]
    listed = {
        name for row in re.findall(r"^\| (`.+?`(?: / `.+?`)*) \|", table, re.M) for name in re.findall(r"`(\w+)`", row)
    }
    assert listed == set(lightning_accel.__all__), listed ^ set(lightning_accel.__all__)
    for name in lightning_accel.__all__:
        assert getattr(lightning_accel, name) is not None, name


def _our_modules():
    import importlib
    import pkgutil

    import lightning_accel

    for info in pkgutil.walk_packages(lightning_accel.__path__, "lightning_accel."):
        if not info.name.endswith("__main__"):
            yield importlib.import_module(info.name)


def test_every_module_says_what_it_exports_and_every_lightning_hook_we_override_says_so():
    """``__all__`` in every module, naming only what is there; ``@override`` (typing_extensions, as Lightning
    writes it) on every method that overrides a Lightning class's, so a hook renamed upstream is caught by a type
    checker instead of silently never being called."""
    import inspect

    missing_all, bad_all, unmarked = [], [], []
    for module in _our_modules():
        names = getattr(module, "__all__", None)
        if names is None:
            missing_all.append(module.__name__)
        else:
            bad_all += [f"{module.__name__}.{n}" for n in names if not hasattr(module, n)]
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in ("lightning", "lightning_fabric")]
            for attr, value in vars(cls).items():
                if attr.startswith("__") or not any(hasattr(b, attr) for b in bases):
                    continue
                func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if inspect.isfunction(func) and not getattr(func, "__override__", False):
                    unmarked.append(f"{cls.__module__}.{cls.__name__}.{attr}")
    assert missing_all == [] and bad_all == [] and unmarked == [], (missing_all, bad_all, unmarked)


def test_every_png_goes_through_figures_pyplot():
    """matplotlib is imported in figures.py only (headless Agg, lazily), by the package and the benchmarks alike."""
    offenders = [
        str(path.relative_to(PACKAGE.parent))
        for folder in (PACKAGE, PACKAGE.parent / "benchmarks")
        for path in folder.rglob("*.py")
        if path.name != "figures.py" and re.search(r"^\s*(import|from) matplotlib", path.read_text(), re.M)
    ]
    assert offenders == []
