"""Test set-up for the whole repository: the repository root on ``sys.path``, and one tier per test.

Root on ``sys.path``: pytest's default ("prepend") import mode puts the directory of this root-most
``conftest.py`` on ``sys.path`` when it loads it, so ``examples.models`` imports in every test without
a hand-made ``sys.path`` edit, however pytest is started.

Tiers (registered in ``pyproject.toml``): ``unit`` (no process group: IR, rules, cost, solvers), ``sim``
(whole plans run with every rank as a thread of one process) and ``dist`` (real gloo processes).  A
module states its tier once, ``pytestmark = pytest.mark.unit``; a test of another tier in that module
carries its own mark, and its own mark replaces the module's rather than adding to it, so that
``-m unit`` never selects a ``dist`` test.  A test with no tier, or with two, fails: CI runs every
tier, and a test nobody can select on its own is a mistake.

The capture cache (``soybean.capture_cache``) is off for the tests (``SOYBEAN_NO_CACHE``): a test never reads a
capture another test or an earlier run stored; ``tests/test_capture_cache.py`` turns it on in a directory of its own.
The planner searches meshes in-process (``SOYBEAN_JOBS=1``, ``soybean.mesh_pool``): the suite already runs on
every core (pytest-xdist), and workers forked beside it would only contend for them; ``tests/test_mesh_pool.py``
asks for workers explicitly.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("SOYBEAN_NO_CACHE", "1")
os.environ.setdefault("SOYBEAN_JOBS", "1")

TIERS = ("unit", "sim", "dist")


def _tier_marks(node: pytest.Item | pytest.Collector) -> list[pytest.Mark]:
    return [m for m in node.own_markers if m.name in TIERS]


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Push each module's (or class's) tier down to the tests without their own, then drop it from the
    # module: the closest tier mark is then the only one a test carries.
    parents: list[pytest.Item | pytest.Collector] = []
    for item in items:
        chain = item.listchain()[-2::-1]  # the item's class, module, packages, session: closest first
        if not _tier_marks(item):
            inherited = next((marks for node in chain if (marks := _tier_marks(node))), [])
            for mark in inherited:
                item.add_marker(mark.name)  # tier marks take no arguments
        parents.extend(chain)
    for node in parents:
        node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]


def pytest_runtest_setup(item: pytest.Item) -> None:
    tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
    if len(tiers) != 1:
        pytest.fail(f"{item.nodeid} has tier marks {tiers}: give it exactly one of {', '.join(TIERS)} "
                    "(pytestmark = pytest.mark.unit after the imports, or a mark on the test)", pytrace=False)
