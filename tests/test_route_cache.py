"""Route walks kept between runs (``soybean.planner.route_cache``, ``PricingCache.state``/``adopt``): a table priced from
adopted walks equals the table priced from its own walks and walks nothing; states of different runs merge; the
file round-trips, grows, and is ignored when unreadable or of other code; a planner's workers each store theirs
(``mesh_pool``'s ``finish``); and the command line's second run walks no route and plans the same plan."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from examples.models import transformer
from soybean.planner import route_cache
from soybean.capture.core import capture
from soybean.cli import main
from soybean.cost.collectives import StepStore
from soybean.cost.profiles import load_profile
from soybean.mesh import Mesh
from soybean.planner.mesh_pool import each_mesh
from soybean.planner.solve import Search

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cap():  # type: ignore[no-untyped-def]
    return capture(*transformer(batch=4, seq=6, hidden=12, layers=2, heads=2))  # uneven: 6 rows over 4


@pytest.fixture()
def walked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many routes each ``StepStore`` lookup walked (a new route's rows are read off its walk)."""
    counts: list[int] = []
    add = StepStore._add

    def counted(self: StepStore, routes: list) -> None:
        counts.append(len(routes))
        add(self, routes)

    monkeypatch.setattr(StepStore, "_add", counted)
    return counts


def _edges(search: Search, cap, mesh: Mesh) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    g = search.table(cap, mesh)
    return [np.stack([e.bytes, e.seconds]) for e in g.edges]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


MESHES = [Mesh((2, 2)), Mesh((4,)), Mesh((2, 1, 2))]


def test_adopted_walks_price_every_table_as_its_own_walks_and_walk_nothing(cap, walked: list[int]) -> None:
    profile = load_profile(None)
    own = Search(profile)
    tables = {m: _edges(own, cap, m) for m in MESHES}
    assert sum(walked) == own.run.pricing.routes() > 0
    state = pickle.loads(pickle.dumps(own.run.pricing.state()))  # as stored: placements interned again
    again = Search(profile)
    again.run.pricing.adopt(state)
    assert again.run.pricing.routes() == own.run.pricing.routes()
    walked.clear()
    for m in MESHES:
        _same(_edges(again, cap, m), tables[m])
    assert sum(walked) == 0


def test_states_of_two_runs_merge(cap, walked: list[int]) -> None:
    """Two runs that met different meshes (different tilings, so different keys and routes) merge into one
    state, adopted into an empty and into a non-empty one, that prices both runs' tables without a walk."""
    profile = load_profile(None)
    a, b = Search(profile), Search(profile)
    ta, tb = _edges(a, cap, MESHES[0]), _edges(b, cap, MESHES[1])
    both = a.run.pricing.routes() + b.run.pricing.routes() - _shared(a, b)
    fresh = Search(profile)
    fresh.run.pricing.adopt(a.run.pricing.state())
    fresh.run.pricing.adopt(b.run.pricing.state())
    fresh.run.pricing.adopt(b.run.pricing.state())  # twice: nothing new the second time
    b.run.pricing.adopt(a.run.pricing.state())  # into a state that has pairs of its own
    assert fresh.run.pricing.routes() == b.run.pricing.routes() == both
    walked.clear()
    for s in (fresh, b):
        _same(_edges(s, cap, MESHES[0]), ta)
        _same(_edges(s, cap, MESHES[1]), tb)
    assert sum(walked) == 0


def _shared(a: Search, b: Search) -> int:
    """Routes both runs met (the pairs of a 1-axis and a 2-axis mesh's tilings: none)."""
    return len(set(a.run.pricing.steps.ids) & set(b.run.pricing.steps.ids))


def test_the_file_round_trips_grows_and_is_ignored_when_unreadable(cap, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOYBEAN_CACHE_DIR", str(tmp_path))
    profile = load_profile(None)
    a = Search(profile)
    _edges(a, cap, MESHES[0])
    assert not route_cache.save(a.run.pricing, a.run.pricing.routes() - route_cache.MIN_NEW + 1)  # too few new routes
    assert not route_cache.path().exists()
    monkeypatch.setattr(route_cache, "MIN_NEW", 1)
    assert route_cache.save(a.run.pricing, 0) and route_cache.path().exists()
    b = Search(profile)
    _edges(b, cap, MESHES[1])
    both = a.run.pricing.routes() + b.run.pricing.routes()  # a 2-axis and a 1-axis mesh share no route
    assert route_cache.save(b.run.pricing, 0)  # merged with a's: the file only grows
    assert b.run.pricing.routes() == route_cache.load(Search(profile).run.pricing) == both
    route_cache.path().write_bytes(b"half a file")
    assert route_cache.load(Search(profile).run.pricing) == 0
    assert route_cache.save(a.run.pricing, 0)
    assert route_cache.load(Search(profile).run.pricing) == a.run.pricing.routes()
    # a file of another code version is not read; old versions beyond KEEP are removed at the next save
    state = pickle.loads(route_cache.path().read_bytes())["state"]
    route_cache.path().write_bytes(pickle.dumps({"key": "another version", "state": state}))
    assert route_cache.load(Search(profile).run.pricing) == 0
    for k in range(route_cache.KEEP + 2):
        old = tmp_path / "routes" / f"{k:032d}.pkl"
        old.write_bytes(b"")
        os.utime(old, (k, k))
    assert route_cache.save(a.run.pricing, 0)
    kept = sorted(f.name for f in (tmp_path / "routes").glob("*.pkl"))
    assert kept == sorted([route_cache.path().name] + [f"{k:032d}.pkl" for k in range(2, route_cache.KEEP + 2)])


def test_the_key_reads_the_package_source() -> None:
    key = route_cache.code_key()
    assert len(key) == 32 and route_cache.path().name == f"{key}.pkl"


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork here")
def test_every_worker_runs_finish_before_it_ends(tmp_path: Path) -> None:
    def solve(m: Mesh, incumbent, say) -> float:  # type: ignore[no-untyped-def]
        return float(m.shape[0])

    def finish() -> None:
        (tmp_path / str(os.getpid())).write_text("done")

    got = list(each_mesh([Mesh((k,)) for k in range(1, 5)], solve, lambda r: r, lambda r: r, 2, lambda s: None,
                         (), None, None, finish))
    assert len(got) == 4 and len(list(tmp_path.iterdir())) == 2  # both workers, after their last mesh


def test_the_command_line_walks_no_route_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture, walked: list[int]) -> None:
    monkeypatch.setenv("SOYBEAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SOYBEAN_NO_CACHE", "0")
    monkeypatch.setattr(route_cache, "MIN_NEW", 1)
    args = ["plan", "examples.models:transformer", "--devices", "4", "--arg", "batch=4", "--arg", "seq=6",
            "--arg", "hidden=12", "--arg", "heads=2", "--format", "json", "--quiet"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert sum(walked) > 0 and route_cache.path().exists()
    walked.clear()
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert sum(walked) == 0
    first["solver"]["seconds"] = second["solver"]["seconds"] = 0.0
    assert first == second
    assert main(args + ["--no-cache"]) == 0 and sum(walked) > 0  # skipped: walked afresh
