"""Import direction, read from the source: who may import whom, and no cycles.

The layers, top to bottom::

    frontend_dsl          the @program DSL: drives the engine, never driven by it
    runtime               the engine, the server; imports kernels and grammars
    kernels | grammars    leaves: they import nothing of ours, not even each other

Every ``import`` in every module counts, at module level or inside a function (a lazy
import is still a dependency). The cycle check skips imports under ``if TYPE_CHECKING:``
(they never run) and does not count a submodule's implicit import of its parent package.
Dynamic imports (``importlib.import_module("x")``, ``__import__("x")``) with a literal
name count as ``import x``.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "frontend_dsl", "kernels", "grammars")
LEAVES = ("kernels", "grammars")

# Modules that must load without torch: the accelerator-free core (STYLE.md principle 3).
# Every submodule of these packages is imported too (the KV tensors live in runtime.model).
TORCH_FREE = ("runtime.scheduler", "runtime.cache", "runtime.request", "runtime.router")
TORCH_FREE_EXCEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Import:
    """One imported module name, as the importing module's source states it."""

    importer: str  # dotted name of the importing module
    target: str  # absolute dotted name imported (a submodule where ``from pkg import sub``)
    path: str  # the importer's file, relative to the repository root
    line: int
    statement: str  # the import statement's source text
    function: str | None  # the enclosing function, None at module level
    type_checking: bool  # under ``if TYPE_CHECKING:``

    def describe(self) -> str:
        where = f" in {self.function}()" if self.function else ""
        return f"{self.path}:{self.line}{where}: {self.statement}"


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import_name(call: ast.Call) -> str | None:
    """``"x"`` for ``importlib.import_module("x")`` or ``__import__("x")``."""
    func = call.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    if named and call.args and isinstance(call.args[0], ast.Constant):
        value = call.args[0].value
        return value if isinstance(value, str) else None
    return None


class _Collector(ast.NodeVisitor):
    """Every import of one module, with relative imports resolved to absolute names."""

    def __init__(self, name: str, is_package: bool, path: str, known: frozenset[str]) -> None:
        self.name, self.path, self.known = name, path, known
        # The package relative imports start from: the module itself for an __init__.
        self.package = name if is_package else name.rpartition(".")[0]
        self.functions: list[str] = []
        self.type_checking = 0
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.stmt | ast.expr) -> None:
        self.found.append(Import(
            importer=self.name, target=target, path=self.path, line=node.lineno,
            statement=ast.unparse(node), function=self.functions[-1] if self.functions else None,
            type_checking=self.type_checking > 0,
        ))

    def _resolve(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.package.split(".") if self.package else []
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, module] if module else base)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.type_checking += 1
        for stmt in node.body:
            self.visit(stmt)
        self.type_checking -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._resolve(node.module, node.level)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.known else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dynamic_import_name(node)
        if name is not None:
            self._add(name, node)
        self.generic_visit(node)


def collect_imports(sources: dict[str, tuple[str, bool, str]]) -> list[Import]:
    """Imports of every module in ``sources``: dotted name -> (path, is_package, source)."""
    known = frozenset(sources)
    found: list[Import] = []
    for name, (path, is_package, source) in sorted(sources.items()):
        collector = _Collector(name, is_package, path, known)
        collector.visit(ast.parse(source, filename=path))
        found.extend(collector.found)
    return found


def _source_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


@functools.cache
def project_sources() -> dict[str, tuple[str, bool, str]]:
    sources = {}
    for path in _source_files():
        name, is_package = module_name(path, ROOT)
        sources[name] = (str(path.relative_to(ROOT)), is_package, path.read_text())
    return sources


@functools.cache
def project_imports() -> tuple[Import, ...]:
    return tuple(collect_imports(project_sources()))


def top(name: str) -> str:
    return name.partition(".")[0]


def import_graph(imports: tuple[Import, ...] | list[Import], known: set[str]) -> dict[str, list[Import]]:
    """Edges between our modules that run: module -> the imports leading to another module."""
    graph: dict[str, list[Import]] = {name: [] for name in known}
    for imp in imports:
        if imp.target in known and imp.target != imp.importer and not imp.type_checking:
            graph[imp.importer].append(imp)
    return graph


def strongly_connected(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for imp in graph[node]:
            if imp.target not in index:
                visit(imp.target)
                low[node] = min(low[node], low[imp.target])
            elif imp.target in on_stack:
                low[node] = min(low[node], index[imp.target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def shortest_cycle(graph: dict[str, list[Import]], component: list[str]) -> list[Import]:
    """The imports of a shortest cycle through the component's first module (BFS)."""
    start, members = component[0], set(component)
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for imp in graph[node]:
                if imp.target not in members or imp.target in came_by:
                    continue
                came_by[imp.target] = imp
                if imp.target == start:
                    cycle = [imp]
                    while cycle[0].importer != start:
                        cycle.insert(0, came_by[cycle[0].importer])
                    return cycle
                following.append(imp.target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def format_cycle(cycle: list[Import]) -> str:
    chain = " -> ".join([cycle[0].importer, *(imp.target for imp in cycle)])
    return chain + "".join(f"\n    {imp.describe()}" for imp in cycle)


def forbidden(imports: tuple[Import, ...], importers: str, banned: set[str]) -> list[str]:
    return [
        f"{imp.importer} imports {imp.target}  ({imp.describe()})"
        for imp in imports
        if top(imp.importer) == importers and top(imp.target) in banned
    ]


# ---- the rules --------------------------------------------------------------------------


def test_runtime_never_imports_the_dsl() -> None:
    offenders = forbidden(project_imports(), "runtime", {"frontend_dsl"})
    assert not offenders, "runtime/ must not import frontend_dsl (the DSL drives the engine):\n" + \
        "\n".join(offenders)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_of_ours(leaf: str) -> None:
    banned = {"runtime", "frontend_dsl", *LEAVES} - {leaf}
    offenders = forbidden(project_imports(), leaf, banned)
    assert not offenders, f"{leaf}/ is a leaf: it must not import {sorted(banned)}:\n" + \
        "\n".join(offenders)


def test_no_import_cycles_between_our_modules() -> None:
    graph = import_graph(project_imports(), set(project_sources()))
    cycles = [format_cycle(shortest_cycle(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


TORCH_PROBE = """
import importlib, json, pkgutil, sys, traceback

root = sys.argv[1]
names, skip = json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))
chains = []

class TorchTracer:
    # Records which of our files were importing when torch was first asked for.
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" and not chains:
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(root)]
            chains.append([f"{f.filename[len(root) + 1:]}:{f.lineno}: {f.line}" for f in frames])
        return None

sys.meta_path.insert(0, TorchTracer())
loaded = []
for name in names:
    module = importlib.import_module(name)
    loaded.append(module.__file__)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        if info.name not in skip:
            importlib.import_module(info.name)
            loaded.append(info.name)
print(json.dumps({"torch": "torch" in sys.modules, "chain": chains[0] if chains else [],
                  "files": loaded}))
"""


def test_core_modules_load_without_torch() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, str(ROOT), json.dumps(TORCH_FREE), json.dumps(TORCH_FREE_EXCEPT)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["files"][0].startswith(str(ROOT)), f"imported another checkout: {report['files'][0]}"
    assert not report["torch"], (
        f"importing {', '.join(TORCH_FREE)} (and their submodules) loads torch, via:\n    "
        + "\n    ".join(report["chain"])
    )


# ---- the checker itself -----------------------------------------------------------------


def test_collector_resolves_relative_lazy_and_type_checking_imports() -> None:
    sources = {
        "pkg": ("pkg/__init__.py", True, "from . import a\nfrom .sub import c\n"),
        "pkg.a": ("pkg/a.py", False, (
            "from typing import TYPE_CHECKING\n"
            "from pkg import b\n"  # b is a submodule: an edge to pkg.b, not pkg
            "if TYPE_CHECKING:\n    from pkg.sub.c import C\n"
            "def f():\n    from .sub import c\n    import importlib\n"
            "    importlib.import_module('pkg.sub')\n"
        )),
        "pkg.b": ("pkg/b.py", False, "from pkg.a import thing\nimport pkg.sub.c as c\n"),
        "pkg.sub": ("pkg/sub/__init__.py", True, "import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n"),
        "pkg.sub.c": ("pkg/sub/c.py", False, "from ..b import x\nfrom .. import a\nimport os\n"),
    }
    imports = collect_imports(sources)
    edges = {(i.importer, i.target, i.function, i.type_checking) for i in imports}
    assert edges == {
        ("pkg", "pkg.a", None, False), ("pkg", "pkg.sub.c", None, False),
        ("pkg.a", "typing", None, False), ("pkg.a", "pkg.b", None, False),
        ("pkg.a", "pkg.sub.c", None, True), ("pkg.a", "pkg.sub.c", "f", False),
        ("pkg.a", "importlib", "f", False), ("pkg.a", "pkg.sub", "f", False),
        ("pkg.b", "pkg.a", None, False), ("pkg.b", "pkg.sub.c", None, False),
        ("pkg.sub", "typing", None, False), ("pkg.sub", "pkg.a", None, True),
        ("pkg.sub.c", "pkg.b", None, False), ("pkg.sub.c", "pkg.a", None, False),
        ("pkg.sub.c", "os", None, False),
    }
    graph = import_graph(imports, set(sources))
    # pkg imports into the cycle but nothing imports pkg back (no implicit parent edges);
    # pkg.sub joins it only through a TYPE_CHECKING import, which does not count.
    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert format_cycle(shortest_cycle(graph, ["pkg.a", "pkg.b", "pkg.sub.c"])) == (
        "pkg.a -> pkg.b -> pkg.a\n"
        "    pkg/a.py:2: from pkg import b\n"
        "    pkg/b.py:1: from pkg.a import thing"
    )
    lazy = next(i for i in imports if i.function == "f" and i.target == "pkg.sub.c")
    assert lazy.describe() == "pkg/a.py:6 in f(): from .sub import c"


def test_the_real_graph_is_read() -> None:
    """Guards against a checker that passes because it saw nothing."""
    graph = import_graph(project_imports(), set(project_sources()))
    assert {"runtime.engine", "frontend_dsl.program", "kernels.dispatch", "grammars.constraints"} <= set(graph)
    assert "runtime.cache.page_pool" in {i.target for i in graph["runtime.scheduler.scheduler"]}
    assert any(i.function for i in project_imports() if i.importer.startswith("runtime."))


# ---- names and rooms --------------------------------------------------------------------
# The engine's own entry points; every other runtime module lives in the subpackage of its
# concept (trace/, distributed/, output/, sampling/, ...).
RUNTIME_ROOT_MODULES = {"__init__", "engine", "engine_core", "engine_setup", "config", "request", "errors",
                        "env", "cli"}


def test_runtime_has_no_loose_modules() -> None:
    loose = {p.stem for p in (ROOT / "runtime").glob("*.py")} - RUNTIME_ROOT_MODULES
    assert loose == set(), f"move into the subpackage of their concept: {sorted(loose)}"


def _entries(folder: Path) -> list[str]:
    return [p.stem for p in folder.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())) and p.stem != "__init__"]


def test_no_two_names_in_a_package_differ_by_a_plural() -> None:
    """``outputs.py`` beside ``output/``, ``tenant.py`` beside ``tenants.py``: one concept, one name."""
    clashes = []
    for package in ("runtime", "frontend_dsl", "kernels", "grammars"):
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if (p / "__init__.py").exists())]:
            names = _entries(folder)
            clashes += [f"{folder.relative_to(ROOT)}: {a} / {a}s" for a in names if f"{a}s" in names]
    assert clashes == []


def test_the_dsl_names_no_module_after_one_of_the_server() -> None:
    """The DSL implements the server's hosting protocol; a module name on both sides of
    that line (``hosting.py``, ``limits.py``) makes a reader open the wrong one."""
    server = set(_entries(ROOT / "runtime" / "server")) - {"errors"}
    assert server & set(_entries(ROOT / "frontend_dsl")) == set()


# ---- the server's API families ----------------------------------------------------------
# runtime/server/api/<family>/ holds one wire API (schema.py + routes.py); common/ and the
# modules of runtime/server/ itself are neutral. A family may import neutral modules only,
# so each translates its own wire shape into the engine's request and back.
API = "runtime.server.api"
API_DIR = ROOT / "runtime" / "server" / "api"
NEUTRAL_API_FOLDERS = {"common"}
# Server modules that may name a family: the app mounts them, the client speaks their wire.
FAMILY_USERS = {"runtime.server.app", "runtime.server.client"}


def api_families() -> list[str]:
    return sorted(p.name for p in API_DIR.iterdir()
                  if (p / "__init__.py").exists() and p.name not in NEUTRAL_API_FOLDERS)


def family_of(module: str, families: list[str]) -> str | None:
    """The API family ``module`` belongs to (None: a neutral or non-server module)."""
    if not module.startswith(API + "."):
        return None
    name = module[len(API) + 1:].partition(".")[0]
    return name if name in families else None


def test_every_api_family_is_a_schema_and_routes_pair_with_a_router() -> None:
    families = api_families()
    assert {"openai", "responses", "anthropic", "sglang", "native", "programs", "embeddings"} <= set(families)
    sources = project_sources()
    incomplete = [f for f in families if {f"{API}.{f}.schema", f"{API}.{f}.routes"} - set(sources)]
    assert incomplete == [], f"each API family needs schema.py and routes.py: {incomplete}"
    no_router = [f for f in families if not any(
        isinstance(node, ast.FunctionDef) and node.name == "build_router"
        for node in ast.parse(sources[f"{API}.{f}.routes"][2]).body)]
    assert no_router == [], f"routes.py must define build_router(ctx): {no_router}"


def test_no_api_family_imports_another_family() -> None:
    families = api_families()
    offenders = [f"{imp.importer} imports {imp.target}  ({imp.describe()})" for imp in project_imports()
                 if (a := family_of(imp.importer, families)) is not None
                 and family_of(imp.target, families) not in (None, a)]
    assert offenders == [], ("an API family may import only neutral modules (api/common/, "
                             "runtime/server/*): move what two families share there:\n" + "\n".join(offenders))


def test_neutral_server_modules_import_no_api_family() -> None:
    families = api_families()
    offenders = [f"{imp.importer} imports {imp.target}  ({imp.describe()})" for imp in project_imports()
                 if imp.importer.startswith("runtime.server.") and imp.importer not in FAMILY_USERS
                 and family_of(imp.importer, families) is None and family_of(imp.target, families) is not None]
    assert offenders == [], "a neutral module must not depend on one API's shapes:\n" + "\n".join(offenders)


def _app_family_list() -> list[str]:
    """The modules named in ``app.API_FAMILIES``, resolved through app.py's imports."""
    tree = ast.parse((ROOT / "runtime" / "server" / "app.py").read_text())
    aliases = {alias.asname or alias.name: f"{node.module}.{alias.name}"
               for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    lists = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "API_FAMILIES" for t in node.targets)]
    assert len(lists) == 1 and isinstance(lists[0], ast.Tuple | ast.List), "app.py must define API_FAMILIES once"
    return [aliases[e.id] if isinstance(e, ast.Name) else ast.unparse(e) for e in lists[0].elts]


def test_the_app_mounts_every_family_from_its_one_list() -> None:
    mounted = _app_family_list()
    assert len(mounted) == len(set(mounted))
    assert sorted(mounted) == sorted(f"{API}.{f}.routes" for f in api_families())
    app_source = (ROOT / "runtime" / "server" / "app.py").read_text()
    assert "for family in API_FAMILIES:\n        app.include_router(family.build_router(ctx))" in app_source


def test_the_family_checks_see_a_cross_import() -> None:
    """Guards against family checks that pass because they match nothing."""
    families = api_families()
    assert family_of(f"{API}.openai.schema", families) == "openai"
    assert family_of(f"{API}.common.messages", families) is None
    assert family_of("runtime.server.serving", families) is None
    users = {imp.target for imp in project_imports() if imp.importer == "runtime.server.app"}
    assert f"{API}.anthropic.routes" in users
