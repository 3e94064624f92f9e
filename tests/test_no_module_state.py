"""No module-level mutable state, read from the source: a dict, list or set made at module level that some function
mutates is state shared by every caller of the process (every planner run, every simulated rank, every test), so
the project keeps such state on an object its caller owns (``planner.solve.PlannerRun``, a module's own device
mesh, a process group's in-flight sums) or in a ``ContextVar`` scoped by a ``with`` block.

Found with ``ast``: a module-level assignment (at the top of a module, or in a module-level ``if``/``try``) of a
container -- a ``{...}``/``[...]``/``{a, b}`` display or comprehension, or a call of ``dict``, ``list``, ``set``,
``OrderedDict``, ``defaultdict``, ``deque``, ``Counter`` or a weak container -- is *mutable state* when a function
anywhere in the package (a method, a nested function, a lambda) mutates it: assigns or deletes an item of it
(``X[k] = v``, ``X[:] = ...``, ``del X[k]``, also of an item of an item), calls a mutating method on it
(``X.append``, ``X.update``, ``X.setdefault``, ``X.pop``, ...), reaching it by its own name, by a name imported
with ``from m import X``, or as ``m.X`` of an imported module.  A ``global`` statement in a function is state too.
A container only read after import (a table, ``__all__``) is not state.  ``ALLOWED`` lists, with why, the few
that must stay; an entry that no longer finds anything fails too, so the list cannot go stale.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "soybean"

CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet", "bytearray"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "popleft", "appendleft", "extendleft", "remove", "clear",
            "update", "setdefault", "add", "discard", "move_to_end", "sort", "reverse", "difference_update",
            "intersection_update", "symmetric_difference_update", "__setitem__", "__delitem__", "rotate"}

# (module, name) -> why it stays.  Only registries filled once, as the package is imported, belong here.
ALLOWED: dict[tuple[str, str], str] = {
    # Every rule module registers its op rules (``rules.base.register``) as ``soybean.rules`` imports it: filled at
    # import, read-only after.
    ("soybean.rules.base", "REGISTRY"): "rules register themselves at import",
}


def _module_name(f: Path, root: Path) -> tuple[str, bool]:
    parts = list(f.relative_to(root.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts.pop()
    return ".".join(parts), is_pkg


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in CONTAINERS
    return False


def _top_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module-level statements of ``body``, those inside module-level ``if``/``try``/``with`` included."""
    out: list[ast.stmt] = []
    for s in body:
        out.append(s)
        if isinstance(s, ast.If):
            out += _top_statements(s.body) + _top_statements(s.orelse)
        elif isinstance(s, ast.Try):
            out += _top_statements(s.body) + _top_statements(s.orelse) + _top_statements(s.finalbody)
            for h in s.handlers:
                out += _top_statements(h.body)
        elif isinstance(s, ast.With):
            out += _top_statements(s.body)
    return out


def containers(tree: ast.Module, module: str) -> set[tuple[str, str]]:
    """The (module, name) of every module-level assignment of a container in ``tree``."""
    found: set[tuple[str, str]] = set()
    for s in _top_statements(tree.body):
        if isinstance(s, ast.Assign) and _is_container(s.value):
            found.update((module, t.id) for t in s.targets if isinstance(t, ast.Name))
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and _is_container(s.value):
            found.add((module, s.target.id))
    return found


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    package = (module if is_pkg else module.rpartition(".")[0]).split(".")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(tree: ast.Module, module: str, is_pkg: bool, modules: set[str]
             ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The names ``tree`` binds to modules of ``modules`` (alias -> module) and to names in them (alias ->
    (module, name)), by its imports at any depth."""
    mods: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    mods[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node.level, node.module)
            for a in node.names:
                bound = a.asname or a.name
                if f"{base}.{a.name}" in modules:
                    mods[bound] = f"{base}.{a.name}"
                else:
                    names[bound] = (base, a.name)
    return mods, names


def _base(e: ast.expr) -> ast.expr:
    """The container an item access or a method call starts from: ``X`` of ``X[a][b]``."""
    while isinstance(e, ast.Subscript):
        e = e.value
    return e


def _locals(fn: ast.AST) -> set[str]:
    """The names a function binds itself (arguments, assignments), which shadow module-level ones."""
    out: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = fn.args
        out.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        out.update(x.arg for x in (a.vararg, a.kwarg) if x is not None)
    declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in declared:
            out.add(node.id)
    return out


def mutations(tree: ast.Module, module: str, is_pkg: bool, state: set[tuple[str, str]], modules: set[str]
              ) -> dict[tuple[str, str], list[str]]:
    """Where the functions of ``tree`` mutate a container of ``state``: (module, name) -> ``file:line`` list;
    a ``global`` statement is reported under (module, ``global <name>``)."""
    mods, names = _imports(tree, module, is_pkg, modules)
    hits: dict[tuple[str, str], list[str]] = {}

    def target(e: ast.expr, shadowed: set[str]) -> tuple[str, str] | None:
        e = _base(e)
        if isinstance(e, ast.Name) and e.id not in shadowed:
            key = (module, e.id) if (module, e.id) in state else names.get(e.id)
            return key if key in state else None
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in mods:
            key = (mods[e.value.id], e.attr)
            return key if key in state else None
        return None

    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for fn in functions:
        shadowed = _locals(fn)
        for node in ast.walk(fn):
            found: list[tuple[str, str] | None] = []
            if isinstance(node, ast.Global):
                found += [(module, f"global {n}") for n in node.names]
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                found += [target(t.value, shadowed) for t in targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                found.append(target(node.func.value, shadowed))
            for key in found:
                if key is not None:
                    hits.setdefault(key, []).append(f"{module}:{node.lineno}")
    return hits


def module_state(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """Every module-level container under ``root`` that some function mutates, with where."""
    trees = {}
    for f in sorted(root.rglob("*.py")):
        name, is_pkg = _module_name(f, root)
        trees[name] = (ast.parse(f.read_text(), str(f)), is_pkg)
    state = set().union(*(containers(t, m) for m, (t, _) in trees.items()))
    out: dict[tuple[str, str], list[str]] = {}
    for m, (t, is_pkg) in trees.items():
        for key, where in mutations(t, m, is_pkg, state, set(trees)).items():
            out.setdefault(key, []).extend(where)
    return out


def test_no_module_level_mutable_state() -> None:
    found = module_state()
    bad = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not bad, "module-level state mutated at run time (keep it on an object the caller owns):\n" + "\n".join(
        f"  {m}.{n}: mutated at {', '.join(w)}" for (m, n), w in sorted(bad.items()))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED lists state that is no longer mutated (remove the entries): {stale}"


def test_the_reader_finds_each_kind_of_mutation(tmp_path: Path) -> None:
    """The reader itself, on a package made here: every way a function mutates module state is found, a table only
    read and a local that shadows a module-level name are not."""
    pkg = tmp_path / "soybean"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from collections import OrderedDict\n"
        "TABLE = {'x': 1}\n"
        "SEEN: list[int] = []\n"
        "HINTS = OrderedDict()\n"
        "FLAG = [True]\n"
        "NESTED = {'k': []}\n"
        "N = 0\n"
        "def read(): return TABLE['x']\n"
        "def shadow(SEEN): SEEN.append(1)\n"
        "def remember(x): SEEN.append(x)\n"
        "def hint(k, h): HINTS[k] = h\n"
        "def nested(v): NESTED['k'].append(v)\n"
        "def count():\n"
        "    global N\n"
        "    N += 1\n")
    (pkg / "b.py").write_text(
        "from . import a\n"
        "from .a import TABLE\n"
        "def flip(): a.FLAG[0] = False\n"
        "def forget(): TABLE.pop('x')\n"
        "f = lambda: a.HINTS.clear()\n")
    found = module_state(pkg)
    assert set(found) == {("soybean.a", "SEEN"), ("soybean.a", "HINTS"), ("soybean.a", "FLAG"),
                          ("soybean.a", "NESTED"), ("soybean.a", "TABLE"), ("soybean.a", "global N")}
    assert found[("soybean.a", "SEEN")] == ["soybean.a:10"]  # not ``shadow``'s own argument
    assert sorted(found[("soybean.a", "HINTS")]) == ["soybean.a:11", "soybean.b:5"]
