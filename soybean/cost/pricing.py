"""What one planner run has priced, kept for the rest of the run: ``PricingCache``.

A run builds many candidate tables of one model (every mesh shape, every recomputation choice, every
baseline) that price mostly the same routes: the mesh shapes of one device count offer mostly the same
tilings, and the layers of a stack the same tables.  The cache belongs to the run that made it
(``planner.plan`` makes one and passes it to every ``graph.build``) and goes with it: no process-wide memo
(one once cleared itself on every switch of mesh and cost a 64-device plan 47 s against 31 s).  Only the
routes' walks and the pairs met, functions of the tilings alone, may outlive the run, on disk
(``route_cache``, as ``state`` and ``adopt``): a run adopts them before its first table.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..reshard import Route
from .collectives import StepStore

EdgeTables = tuple[np.ndarray, np.ndarray, np.ndarray]  # bytes, seconds, sync seconds: source key x target key


# Bits of a key's number in a pair's code: (source << KEY_BITS | target) << 2 | flags.
KEY_BITS = 28


class RouteIds:
    """The ``StepStore`` id of every (source key, target key) pair's route met so far.  A table is the cross
    product of its sources' and targets' keys; its pairs are coded as integers in numpy and only the pairs never
    met become ``Route`` objects.  Shape-, mesh- and profile-free: a 64-device search prices ~10 million pairs
    (tables of up to ~1,000 x 1,000) that are ~200 thousand distinct routes.

    The codes met are kept as one sorted array (looked up by ``np.searchsorted``, all of a table's pairs at once)
    and the recent ones in a dict, merged into the array once they reach a quarter of it: a lookup per pair in
    Python was a quarter of a 1,024-device build."""

    MERGE_MIN = 1 << 16  # recent codes kept in the dict at least until this many

    def __init__(self, steps: StepStore) -> None:
        self.steps = steps
        self.ends: dict[tuple, int] = {}   # a (tiling, gradient axes) key -> its number
        self.codes = np.zeros(0, dtype=np.int64)  # sorted pair codes ...
        self.ids = np.zeros(0, dtype=np.int64)    # ... and their route ids
        self.recent: dict[int, int] = {}   # pair code -> route id, not yet in ``codes``

    def __call__(self, us: tuple, ud: tuple, needs_grad: bool, write_back: bool) -> np.ndarray:
        ends = self.ends
        s = np.array([ends.setdefault(k, len(ends)) for k in us], dtype=np.int64)
        d = np.array([ends.setdefault(k, len(ends)) for k in ud], dtype=np.int64)
        codes = (((s[:, None] << KEY_BITS) | d[None, :]) << 2 | (2 * needs_grad + write_back)).ravel()
        at = np.minimum(np.searchsorted(self.codes, codes), max(len(self.codes) - 1, 0))
        found = self.codes[at] == codes if len(self.codes) else np.zeros(len(codes), dtype=bool)
        ids = np.where(found, self.ids[at] if len(self.ids) else 0, -1)
        miss = np.flatnonzero(~found)
        if miss.size:
            get = self.recent.get
            ids[miss] = [get(c, -1) for c in codes[miss].tolist()]
            miss = miss[ids[miss] < 0]
        if miss.size:
            pairs = [(us[i], ud[j]) for i, j in zip(*np.divmod(miss, len(ud)))]
            routes = [Route.of(dst, src) if write_back else Route.of(src, dst, pga, spa, needs_grad)
                      for (src, spa), (dst, pga) in pairs]
            ids[miss] = new = self.steps.lookup(routes)
            self.recent.update(zip(codes[miss].tolist(), new.tolist()))
            if len(self.recent) >= max(self.MERGE_MIN, len(self.codes) // 4):
                self._merge()
        return ids

    def state(self) -> dict[str, object]:
        """Every pair met, as plain data: the keys in number order, the codes (sorted) and their route ids."""
        self._merge()
        return {"ends": list(self.ends), "codes": self.codes.copy(), "ids": self.ids.copy()}

    def adopt(self, state: dict, steps: dict) -> None:
        """The pairs of ``state`` (another run's ``state()``, its routes in ``steps``, that run's
        ``StepStore.state()``) that are not met here yet, added with their routes (``StepStore.adopt``).  A pair's
        code holds its two keys' numbers, renumbered here."""
        self._merge()
        ends = self.ends
        number = np.array([ends.setdefault(k, len(ends)) for k in state["ends"]], dtype=np.int64)
        codes = state["codes"]
        if not codes.size:
            return
        src, dst, flags = codes >> (KEY_BITS + 2), (codes >> 2) & ((1 << KEY_BITS) - 1), codes & 3
        mine = ((number[src] << KEY_BITS) | number[dst]) << 2 | flags
        at = np.minimum(np.searchsorted(self.codes, mine), max(len(self.codes) - 1, 0))
        new = np.flatnonzero(self.codes[at] != mine) if len(self.codes) else np.arange(len(mine))
        if not new.size:
            return
        routes, which = np.unique(state["ids"][new], return_inverse=True)
        ids = self.steps.adopt(steps, routes)[which]
        self.recent.update(zip(mine[new].tolist(), ids.tolist()))
        self._merge()

    def _merge(self) -> None:
        """The recent codes moved into the sorted array."""
        k = np.fromiter(self.recent.keys(), dtype=np.int64, count=len(self.recent))
        v = np.fromiter(self.recent.values(), dtype=np.int64, count=len(self.recent))
        order = np.argsort(k)
        k, v = k[order], v[order]
        at = np.searchsorted(self.codes, k)
        self.codes, self.ids = np.insert(self.codes, at, k), np.insert(self.ids, at, v)
        self.recent = {}


class PricingCache:
    """One planner run's pricing state: the routes' collectives (``steps``), the pairs' route ids
    (``route_ids``) and every edge table priced (``edge_tables``), keyed by what the table depends on."""

    # Tables kept at most: past this the oldest mesh's tables are dropped (a 1,024-device run meets dozens).
    MAX_TABLES = 4096

    def __init__(self) -> None:
        self.steps = StepStore()
        self.route_ids = RouteIds(self.steps)
        self.edges: dict[tuple, EdgeTables] = {}

    def state(self) -> dict[str, object]:
        """What outlives the run (``route_cache``): the routes walked and the pairs met, as plain data; the edge
        tables are the mesh's and profile's and stay."""
        return {"steps": self.steps.state(), "pairs": self.route_ids.state()}

    def adopt(self, state: dict) -> None:
        """Another run's ``state()`` added to this one's (the pairs met there and not here, with their routes)."""
        self.route_ids.adopt(state["pairs"], state["steps"])

    def routes(self) -> int:
        """How many routes this state holds."""
        return len(self.steps.start)

    def edge_tables(self, key: tuple, price: Callable[[], EdgeTables]) -> EdgeTables:
        """The tables of ``key`` (its last two entries the mesh and the run's profile), priced by ``price`` the
        first time.  A new mesh or profile drops the tables of the last: the tables of one mesh are read while
        its candidate table is built, and a later mesh's are other tables."""
        tables = self.edges.get(key)
        if tables is None:
            if self.edges and (next(iter(self.edges))[-2:] != key[-2:] or len(self.edges) > self.MAX_TABLES):
                self.edges.clear()
            tables = self.edges[key] = price()
        return tables
