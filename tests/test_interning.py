"""Placements are interned and meshes, profiles and routes cache their hashes (the planner hashes them
millions of times); equality and hashing must still behave as values, in threads and across processes."""
from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import threading

import pytest

from soybean.cost.profiles import BUILTIN
from soybean.mesh import Mesh
from soybean.reshard import Route
from soybean.tiling import Partial, R, Replicate, Shard, parse_placement

pytestmark = pytest.mark.unit


def test_placements_are_values() -> None:
    assert Shard(1) == Shard(1) and Shard(1) is Shard(1) and Shard(1) != Shard(2)
    assert Replicate() is R and Partial() == Partial() and R != Partial() and Shard(0) != R
    assert parse_placement("S(3)") is Shard(3) and str(Shard(3)) == "S(3)" and repr(R) == "Replicate()"
    assert copy.deepcopy((Shard(2), R)) == (Shard(2), R) and pickle.loads(pickle.dumps(Partial())) is Partial()
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]


def test_threads_interning_at_once_agree() -> None:
    """Ranks run as threads: two that intern the same new dim at once must get the same object."""
    got: list[Shard] = []
    barrier = threading.Barrier(8)

    def intern() -> None:
        barrier.wait()
        got.append(Shard(12345))

    threads = [threading.Thread(target=intern) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1


def test_cached_hashes_do_not_travel_between_processes() -> None:
    """A mesh, profile or route pickled in one process is a working dict key in another (string and
    identity hashes differ between processes, so no cached hash may be pickled)."""
    m, p, r = Mesh((2, 4)), BUILTIN["cpu-gloo"], Route.of((Shard(0), R), (R, R))
    _ = hash(m), hash(p), hash(r)
    blob = pickle.dumps((m, p, r)).hex()
    code = (
        "import pickle\n"
        "from soybean.mesh import Mesh\nfrom soybean.cost.profiles import BUILTIN\n"
        "from soybean.reshard import Route\nfrom soybean.tiling import Shard, R\n"
        f"m, p, r = pickle.loads(bytes.fromhex('{blob}'))\n"
        "assert {m: 1}[Mesh((2, 4))] == 1 and {p: 1}[BUILTIN['cpu-gloo']] == 1\n"
        "assert {r: 1}[Route.of((Shard(0), R), (R, R))] == 1\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
