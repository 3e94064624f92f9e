"""Topology: mesh axes whose groups cross nodes are priced at the inter-node link, and the mesh search
uses that to keep the busy axes inside a node."""
from __future__ import annotations

import pytest
import torch

from examples.models import transformer
from soybean.capture.core import capture
from soybean.cost.collectives import reshard_cost
from soybean.cost.profiles import BUILTIN, load_profile
from soybean.graph import build
from soybean.mesh import Mesh
from soybean.plan import Plan
from soybean.planner.core import plan
from soybean.planner.solve import evaluate
from soybean.reshard import Route
from soybean.search import Solution
from soybean.tiling import R, Shard

pytestmark = pytest.mark.unit

IB = BUILTIN["h100-nvlink-ib"]


@pytest.mark.parametrize("shape,gpus,crosses", [
    ((16,), 8, (True,)), ((2, 8), 8, (True, False)), ((8, 2), 8, (True, False)), ((4, 4), 8, (True, False)),
    ((2, 2, 4), 8, (True, False, False)), ((4, 2, 2), 4, (True, False, False)), ((2, 4), 8, ()), ((2, 4), None, ()),
    ((4, 4), 2, (True, True)),
])
def test_axes_crossing_nodes(shape: tuple, gpus: int | None, crosses: tuple) -> None:
    """Ranks fill nodes in order, mesh coordinates are row-major: an axis crosses nodes when one of its
    groups holds ranks of two nodes."""
    assert IB.on_mesh(Mesh(shape), gpus).inter_node == crosses


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 3, 4), (3, 1, 5), (4, 4, 8)])
def test_axis_groups_follow_the_definition(shape: tuple) -> None:
    """``Mesh.axis_groups``: the ranks that agree with a rank on every coordinate but the axis's, by coordinate,
    each group once, in the order increasing ranks first meet them (every rank makes them alike)."""
    mesh = Mesh(shape)
    for axis in range(mesh.ndim):
        want: dict[tuple, list[int]] = {}
        for r in range(mesh.size):
            c = list(mesh.coords(r))
            group = [mesh.rank(tuple(c[:axis] + [k] + c[axis + 1:])) for k in range(shape[axis])]
            want.setdefault(tuple(group), group)
        assert mesh.axis_groups(axis) == list(want.values())


def test_crossing_axes_use_the_inter_node_link() -> None:
    prof = IB.on_mesh(Mesh((2, 8)), 8)
    assert prof.ab(0, "all_reduce") == (IB.node_alpha, IB.node_beta)
    assert prof.ab(1, "all_reduce") == (IB.alpha, IB.beta)
    mesh = Mesh((2, 8))
    route = lambda axis: Route.of(tuple(Shard(0) if a == axis else R for a in range(2)), (R, R))  # noqa: E731
    inter = reshard_cost(route(0), (1024, 1024), 4, mesh, prof)
    intra = reshard_cost(route(1), (1024, 1024), 4, mesh, prof)
    assert inter.seconds > 5 * intra.seconds * (1 / 8) / (1 / 2)  # 8x slower link, 4x fewer bytes per device
    assert load_profile("h100-nvlink-ib") is IB


def _priced(cap: object, p: Plan, gpus: int) -> float:
    """``p``'s modelled step time on nodes of ``gpus`` devices."""
    mesh = Mesh(tuple(p.mesh))
    g = build(cap, mesh, IB.on_mesh(mesh, gpus), objective="time", fixed=p)  # type: ignore[arg-type]
    return evaluate(g, Solution([0] * len(g.vars), 0.0, 0.0, "optimal", 0.0, "fixed")).step_time_s


@pytest.mark.parametrize("mesh,strict", [((2, 8), True), ((8, 2), False)])
def test_the_search_keeps_busy_axes_inside_a_node(mesh: tuple, strict: bool) -> None:
    """On two nodes of 8, the topology-aware plan is never modelled slower on that cluster than the plan
    made as if all 16 devices shared NVLink.  On 2x8 (the 2-way axis crosses nodes) the blind plan loads
    that axis and is strictly slower; on 8x2 it already runs the crossing 8-way axis data parallel, a tie.
    The mesh search tries both shapes."""
    with torch.device("meta"):
        m, inp = transformer(batch=16, seq=256, hidden=512, heads=8, layers=1)
    cap = capture(m, inp)
    aware = plan(None, (), 16, mesh=mesh, profile="h100-nvlink-ib", gpus_per_node=8, captured=cap, baselines=False)
    blind = plan(None, (), 16, mesh=mesh, profile="h100-nvlink-ib", captured=cap, baselines=False)
    assert aware.gpus_per_node == 8 and blind.gpus_per_node is None
    assert _priced(cap, aware, 8) == pytest.approx(aware.cost["step_time_s"], rel=1e-6)
    blind_s = _priced(cap, blind, 8)
    assert aware.cost["step_time_s"] < blind_s if strict else aware.cost["step_time_s"] <= blind_s * (1 + 1e-9)
