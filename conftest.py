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

Under pytest-xdist (``-n 2``, ``--dist load``, the default) two groups of tests each run on one worker
(``GROUPS``), every other test wherever a worker is free: each group shares work that a split would do twice.  The
architectures' rule checks (``tests/test_archs.py``: an op checked for one model is skipped for the next; 107 s on
one worker against 209 s of the two workers' time split) and the Trainer runs (``tests/test_hf_trainer.py``: the
serial runs every test compares with, made once per worker).  xdist's own ``--dist loadgroup`` would say this by a
mark, but it renames the test ids to do it, which pytest 9 no longer honours.

Each xdist worker gets its share of the cores for torch's own threads (``_threads``): by default every process
takes one intra-op thread per core, so two workers on two cores ran four threads, and a rank spawned by a test as
many again.  One thread each made the suite's planning, sim and gloo tests about a fifth faster here (the same four
test files: 121.7 s against 95.6 s, and 138.4 s against 109.1 s).  A test that times or counts threads sets its own.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("SOYBEAN_NO_CACHE", "1")
os.environ.setdefault("SOYBEAN_JOBS", "1")


def _threads() -> None:
    """Under pytest-xdist, this worker's share of the cores as torch's intra-op threads, in this process and (by
    ``OMP_NUM_THREADS``, read when torch is imported) in every process it starts (the module docstring says why)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_threads()


def _bytecode() -> None:
    """The repository's own modules compiled once, by the first process of the run, where Python is told not to
    write bytecode (``PYTHONDONTWRITEBYTECODE``, set on this machine): every rank a test spawns imports soybean, the
    tests and the examples, and each compiled them again (0.26 s of soybean's alone per process, read from
    ``python -X importtime``).  ``compileall`` writes the caches whatever that setting, and a process that may not
    write them still reads them."""
    import sys

    if sys.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
        import compileall
        from pathlib import Path

        root = Path(__file__).resolve().parent
        for name in ("soybean", "tests", "examples", "scripts"):
            compileall.compile_dir(root / name, quiet=1)


_bytecode()

TIERS = ("unit", "sim", "dist")

# (test id prefix, group): the tests of one group run on one xdist worker (the module docstring says why).
GROUPS = (
    ("tests/test_archs.py::test_every_rule_the_architecture_uses_is_exact[", "architecture rule checks"),
    ("tests/test_hf_trainer.py::", "Trainer runs"),
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist there is nothing to schedule
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist load`` with ``GROUPS`` kept together: xdist's scope scheduler, every test its own scope but a group's
    tests one scope (the largest scopes are handed out first).  Any other ``--dist``: xdist's own choice."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in GROUPS if nodeid.startswith(prefix)), nodeid)

    return Grouped(config, log)


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
