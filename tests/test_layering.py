"""The package's layering, read from the source: the core never imports tooling, and no import cycle, between
modules or between packages.

The import graph has one node per module of ``soybean/`` (a package is its ``__init__``) and an edge
``a -> b`` for every ``import``/``from ... import`` statement in ``a`` naming ``b``, wherever it
stands: at module level, inside a function, or under ``if TYPE_CHECKING:``.  Function-level imports
count because a dependency deferred to call time is still a dependency: the layering is about which
module knows about which, not about what happens to be loaded first.  Relative imports are resolved
against the importing module's package.  ``from pkg import name`` is an import of ``pkg.name`` when
that is a module, else of ``pkg`` itself.  Importing ``a.b.c`` is an edge to ``a.b.c`` only, not to its
parent packages: Python runs the parents' ``__init__`` first, but counting that would make every
package's ``__init__`` part of a cycle with the modules it re-exports.

``soybean/__init__.py`` is the public facade: it imports ``api`` and ``planner`` lazily, inside the
``parallelize``/``plan`` functions, to keep ``import soybean`` light.  Those lazy imports are edges like
any other, so the facade sits at the top of the graph: a module that imports ``soybean`` itself
(``import soybean``, ``from soybean import X``) reaches ``soybean.api`` through it, and does so
from the core it is a layering violation, and from anything ``api`` reaches it is a cycle.

Collapsed to packages (``package_of``: ``soybean.X`` for every module of a subpackage ``X``, a top-level module
and the facade as themselves), the graph is acyclic too: a package's shared vocabulary has one home, in the
lower of two packages that both need it, so each package sits above or below each other one.

Imports done by name at run time (``importlib.import_module``, as ``soybean.rules`` does to register
every rule module) are not statements and are not seen; they stay inside one layer.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "soybean"

# A module is in a layer when its name is the prefix or starts with "prefix.".  Every module is in CORE or TOOLING
# (``test_every_module_is_in_a_layer``).
CORE = ["soybean.capture", "soybean.graph", "soybean.reshard", "soybean.mesh", "soybean.tiling", "soybean.plan",
        "soybean.planner", "soybean.rules", "soybean.cost", "soybean.search", "soybean.ir", "soybean.codegen",
        "soybean.runtime", "soybean.parts", "soybean.run", "soybean.precision", "soybean.options"]
TOOLING = ["soybean.bench", "soybean.verify", "soybean.models", "soybean.report", "soybean.cli", "soybean.api",
           "soybean.compile", "soybean.hf"]
# Planning works on data (a mesh is data): it never reaches the code that runs the plan, not even through a
# module of neither list.  Codegen and the runtime read planning's vocabulary from ``soybean.ir``.  ``parts``
# (stages and regions cut and priced) is planning; the module classes that run them, and their checkpoint view,
# are ``run``'s.
PLANNING = ["soybean.capture", "soybean.graph", "soybean.reshard", "soybean.mesh", "soybean.tiling", "soybean.plan",
            "soybean.planner", "soybean.parts", "soybean.rules", "soybean.cost", "soybean.search", "soybean.ir",
            "soybean.precision", "soybean.options"]
RUNNING = ["soybean.runtime", "soybean.codegen", "soybean.run"]
# ``search`` holds the solvers: a ``Problem`` in, a ``Solution`` out.  It imports no soybean module outside itself
# (the planning graph is read for it by ``planner.problem``, ``planner.repeats`` and ``planner.kcuts``) and, outside
# the standard library, only these.
SEARCH = "soybean.search"
SEARCH_MAY_IMPORT = {"numpy", "scipy", "highspy"}


def in_layer(module: str, prefixes: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``), for every ``.py`` under ``root``."""
    out: dict[str, tuple[Path, bool]] = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (f, is_pkg)
    return out


def imported_modules(tree: ast.AST, module: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the statements of ``tree`` import, at any depth of nesting."""
    package = module if is_pkg else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found & known


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    files = module_files(root)
    known = set(files)
    g = nx.DiGraph()
    g.add_nodes_from(sorted(known))  # node order (so edge order, so the cycle reported) independent of hashing
    for name, (path, is_pkg) in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in sorted(imported_modules(tree, name, is_pkg, known)):
            if target != name:
                g.add_edge(name, target)
    return g


def reaching(g: nx.DiGraph, sources: list[str], targets: list[str]) -> list[list[str]]:
    """One import path from a module of layer ``sources`` to one of ``targets``, for each pair that has one."""
    paths = []
    for src in sorted(n for n in g if in_layer(n, sources)):
        for dst in sorted(nx.descendants(g, src)):
            if in_layer(dst, targets):
                paths.append(nx.shortest_path(g, src, dst))
    return paths


def core_to_tooling(g: nx.DiGraph) -> list[list[str]]:
    return reaching(g, CORE, TOOLING)


def planning_to_running(g: nx.DiGraph) -> list[list[str]]:
    return reaching(g, PLANNING, RUNNING)


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """One cycle in each strongly connected component of more than one module, searched from the
    component's first module in name order (set order varies with string hashing: this keeps reports stable)."""
    out = []
    for comp in nx.strongly_connected_components(g):
        if len(comp) > 1:
            out.append([a for a, _ in nx.find_cycle(g.subgraph(comp), source=min(comp))])
    return sorted(out)


def outside_imports(tree: ast.AST) -> set[str]:
    """The top-level names of the absolute imports of ``tree`` that are not soybean's, at any depth of nesting."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names - {"soybean"}


def search_reaches_out(root: Path = ROOT) -> list[str]:
    """Every import of a module of ``search`` that is neither ``search``'s own nor allowed (``SEARCH_MAY_IMPORT``,
    the standard library)."""
    files = module_files(root)
    bad = []
    for name, (path, is_pkg) in files.items():
        if not in_layer(name, [SEARCH]):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [f"{name} -> {t}" for t in sorted(imported_modules(tree, name, is_pkg, set(files)))
                if not in_layer(t, [SEARCH])]
        bad += [f"{name} -> {t}" for t in sorted(outside_imports(tree))
                if t not in sys.stdlib_module_names and t not in SEARCH_MAY_IMPORT]
    return bad


def package_of(module: str) -> str:
    """The package a module belongs to in the package graph: ``soybean.X`` for ``soybean.X`` and every module
    under it, so a top-level module (``soybean.api``) and the facade (``soybean``) are packages of their own."""
    return ".".join(module.split(".")[:2])


def package_graph(g: nx.DiGraph) -> nx.DiGraph:
    """``g`` collapsed to packages: an edge ``P -> Q`` when a module of ``P`` imports one of ``Q`` (``P != Q``),
    with the module edges that make it in ``imports``."""
    p = nx.DiGraph()
    p.add_nodes_from(package_of(m) for m in g)
    for a, b in g.edges:
        pa, pb = package_of(a), package_of(b)
        if pa != pb:
            if not p.has_edge(pa, pb):
                p.add_edge(pa, pb, imports=[])
            p.edges[pa, pb]["imports"].append(f"{a} -> {b}")
    return p


def fmt(paths: list[list[str]]) -> str:
    return "\n".join(" -> ".join(p) for p in paths)


# ---- self-checks: the graph and the checks see what they must ----

def test_relative_and_nested_imports_are_resolved() -> None:
    known = {"soybean", "soybean.a", "soybean.pkg", "soybean.pkg.b", "soybean.pkg.c"}
    src = (
        "from . import c\n"            # sibling module, via the package
        "from ..a import x\n"          # parent package's module
        "import soybean\n"             # the facade
        "def f():\n"
        "    from .c import y\n"       # function-level
        "    from .. import pkg\n"     # a package is its __init__
        "from .b import z\n"           # itself: dropped by import_graph, kept here
        "import os\n"                  # outside soybean: ignored
    )
    got = imported_modules(ast.parse(src), "soybean.pkg.b", False, known)
    assert got == {"soybean.pkg.c", "soybean.a", "soybean", "soybean.pkg", "soybean.pkg.b"}
    # In a package's __init__, "." is the package itself.
    got = imported_modules(ast.parse("from . import b\nfrom .c import q\n"), "soybean.pkg", True, known)
    assert got == {"soybean.pkg.b", "soybean.pkg.c"}


def test_checks_fail_on_a_synthetic_cycle_and_a_core_to_tooling_path(tmp_path: Path) -> None:
    g = nx.DiGraph([("soybean.graph", "soybean.planner.core"), ("soybean.planner.core", "soybean.search.ilp"),
                    ("soybean.search.ilp", "soybean.graph"), ("soybean.tiling", "soybean.mesh")])
    assert cycles(g) and set(cycles(g)[0]) == {"soybean.graph", "soybean.planner.core", "soybean.search.ilp"}
    assert not cycles(nx.DiGraph([("soybean.a", "soybean.b"), ("soybean.b", "soybean.c")]))
    # Through a module of neither layer and through the facade's lazy import.
    g = nx.DiGraph([("soybean.runtime.comm", "soybean.loose"), ("soybean.loose", "soybean"),
                    ("soybean", "soybean.api"), ("soybean.api", "soybean.planner.core")])
    assert core_to_tooling(g) == [["soybean.runtime.comm", "soybean.loose", "soybean", "soybean.api"]]
    # Planning reaching the runtime through a module of neither layer, and through codegen.
    g = nx.DiGraph([("soybean.cost.collectives", "soybean.ir.kinds"), ("soybean.ir.kinds", "soybean.loose"),
                    ("soybean.loose", "soybean.runtime.context"), ("soybean.rules.norm", "soybean.codegen.lower")])
    assert planning_to_running(g) == [["soybean.cost.collectives", "soybean.ir.kinds", "soybean.loose",
                                       "soybean.runtime.context"],
                                      ["soybean.ir.kinds", "soybean.loose", "soybean.runtime.context"],
                                      ["soybean.rules.norm", "soybean.codegen.lower"]]
    assert not planning_to_running(nx.DiGraph([("soybean.runtime.context", "soybean.ir.kinds"),
                                               ("soybean.codegen.lower", "soybean.planner.core")]))
    # End to end, from source files: a cycle closed by a function-level import is found.
    pkg = tmp_path / "soybean"
    (pkg / "codegen").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "codegen" / "__init__.py").write_text("from .lower import lower\n")
    (pkg / "codegen" / "lower.py").write_text("from ..runtime import context\n")
    (pkg / "runtime").mkdir()
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "context.py").write_text("def f():\n    from soybean.codegen.lower import lower\n")
    assert cycles(import_graph(pkg)) == [["soybean.codegen.lower", "soybean.runtime.context"]]


def test_search_check_fails_on_a_solver_that_reads_the_model(tmp_path: Path) -> None:
    pkg = tmp_path / "soybean"
    (pkg / "search").mkdir(parents=True)
    (pkg / "graph").mkdir()
    for f in ("__init__.py", "search/__init__.py", "graph/__init__.py", "tiling.py"):
        (pkg / f).write_text("")
    (pkg / "search" / "ilp.py").write_text("import time\nimport numpy as np\nimport scipy.sparse\nfrom . import dp\n")
    (pkg / "search" / "dp.py").write_text("from .ilp import x\n")
    assert search_reaches_out(pkg) == []
    (pkg / "search" / "kcuts.py").write_text(
        "from ..graph import build\nimport torch\ndef f():\n    from soybean.tiling import R\n    import soybean\n")
    assert search_reaches_out(pkg) == ["soybean.search.kcuts -> soybean", "soybean.search.kcuts -> soybean.graph",
                                       "soybean.search.kcuts -> soybean.tiling", "soybean.search.kcuts -> torch"]


def test_package_cycles_are_found_where_modules_have_none() -> None:
    """Two packages importing each other through different modules: no module cycle, one package cycle (what
    ``cost.phases`` reading ``graph.types`` while ``graph.build`` read ``cost.memory`` was)."""
    g = nx.DiGraph([("soybean.graph.build", "soybean.cost.memory"), ("soybean.cost.phases", "soybean.graph.types"),
                    ("soybean.graph.build", "soybean.tiling"), ("soybean.api", "soybean.graph"),
                    ("soybean", "soybean.api")])
    assert not cycles(g)
    p = package_graph(g)
    assert set(p) == {"soybean", "soybean.api", "soybean.graph", "soybean.cost", "soybean.tiling"}
    assert cycles(p) == [["soybean.cost", "soybean.graph"]]
    assert p.edges["soybean.graph", "soybean.cost"]["imports"] == ["soybean.graph.build -> soybean.cost.memory"]
    g.remove_edge("soybean.cost.phases", "soybean.graph.types")
    assert not cycles(package_graph(g))


def test_graph_of_the_package_is_read() -> None:
    g = import_graph()
    assert {"soybean", "soybean.planner.core", "soybean.rules.matmul", "soybean.bench.harness"} <= set(g)
    assert g.has_edge("soybean.bench.harness", "soybean.bench.stats")  # module level, relative
    assert g.has_edge("soybean.cli", "soybean.bench.harness")          # function level
    assert g.has_edge("soybean", "soybean.api")                        # lazy, in the facade


# ---- the layering of soybean/ ----

def test_core_never_imports_tooling() -> None:
    bad = core_to_tooling(import_graph())
    assert not bad, "core modules reach tooling:\n" + fmt(bad)


def test_planning_never_reaches_the_runtime() -> None:
    """What planning needs of collectives (kinds, algorithms' costs, statistics bytes) is in ``soybean.ir``."""
    bad = planning_to_running(import_graph())
    assert not bad, "planning modules reach the runtime or codegen:\n" + fmt(bad)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + fmt([c + [c[0]] for c in found])


def test_no_import_cycle_between_packages() -> None:
    """Each package is above or below each other one: shared vocabulary lives in the lower one, never re-exported
    back up (``graph.phases``, ``graph.pinning``, ``parts.pipeline_baselines``, ``run.checkpoint_view``).  No
    deliberate exception: a cycle found here is moved, not listed."""
    p = package_graph(import_graph())
    found = cycles(p)
    lines = []
    for c in found:
        lines.append(" -> ".join(c + [c[0]]))
        for a, b in zip(c, c[1:] + c[:1]):
            lines += [f"    {edge}" for edge in p.edges[a, b]["imports"]]
    assert not found, "import cycles between packages:\n" + "\n".join(lines)


def test_search_holds_solvers_only() -> None:
    """``search/`` works on a ``Problem``: it imports nothing of capture, graph, planner, parts, run, runtime or
    codegen (nor of any other soybean package), and of the world the standard library, numpy, scipy and highspy."""
    bad = search_reaches_out()
    assert not bad, "search/ imports beyond its solvers:\n" + "\n".join(bad)


def test_the_runtime_has_a_call_for_every_kind_and_synchronised_op() -> None:
    """Codegen joins planning's vocabulary to the runtime's calls by name: every name has its call."""
    from soybean import rules
    from soybean.ir.kinds import KINDS
    from soybean.runtime.kinds import CALLS
    from soybean.runtime.synced import SYNC_CALLS

    assert set(CALLS) == set(KINDS)
    named = {e.sync_call for e in rules.REGISTRY.values() if e.sync_call is not None}
    assert named and named <= set(SYNC_CALLS)


def test_every_module_is_in_a_layer() -> None:
    """A new module names its layer: every module of the package but the facade is in CORE or TOOLING."""
    loose = [m for m in module_files() if m != "soybean" and not in_layer(m, CORE) and not in_layer(m, TOOLING)]
    assert not loose, f"modules in no layer of tests/test_layering.py: {loose}"
