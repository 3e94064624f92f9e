"""SoyBean's recursive k-cuts on a captured model (``search.kcuts``): its planning graph on the ``(2,)*k`` mesh,
and what each strategy does on each axis, read for the cuts."""
from __future__ import annotations

import numpy as np

from ..capture.core import Captured
from ..cost.profiles import Profile
from ..graph import PlanGraph, Var, build
from ..mesh import Mesh
from ..search import Solution
from ..search.kcuts import Cuts, greedy_cuts
from ..tiling import Replicate
from .problem import to_problem


def kcuts(cap: Captured, k: int, profile: Profile, objective: str = "comm",
          solver: str = "dp") -> tuple[PlanGraph, Solution]:
    """Greedy cut-by-cut plan on the ``(2,)*k`` mesh; returns ``(graph, Solution)``."""
    g = build(cap, Mesh((2,) * k), profile, objective="time")  # no split-every-axis filter: cuts apply it per axis
    return g, greedy_cuts(to_problem(g, objective), cuts_of(g, k, objective), k, solver)


def cuts_of(g: PlanGraph, k: int, objective: str) -> Cuts:
    """Each strategy's placements, replication and work split on each of the ``k`` axes; under ``comm`` an op
    keeps to work-dividing strategies where it has any (SoyBean's rule, applied cut by cut)."""
    return Cuts([[_placement(v, s, k) for s in range(len(v.strategies))] for v in g.vars],
                [_replicated(v, k) for v in g.vars],
                [np.array([st.divides_work() for st in v.strategies], dtype=bool).reshape(-1, k)
                 if objective == "comm" and v.kind == "op" else None for v in g.vars])


def _placement(v: Var, s: int, k: int) -> tuple:
    st = v.strategies[s]
    flags = v.grad_partial[s] if v.grad_partial else ()
    return tuple((tuple(t[axis] for t in st.inputs), tuple(t[axis] for t in st.outputs), axis in flags)
                 for axis in range(k))


def _replicated(v: Var, k: int) -> np.ndarray:
    return np.array([[all(isinstance(t[a], Replicate) for t in st.inputs + st.outputs)
                      and a not in (v.grad_partial[s] if v.grad_partial else ()) for a in range(k)]
                     for s, st in enumerate(v.strategies)], dtype=bool).reshape(-1, k)
