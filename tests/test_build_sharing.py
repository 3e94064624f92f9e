"""A build shares repeated layers' work (``graph.build._Memo``): the shared table must equal the table
priced variable by variable, on stacks whose layers repeat and on models with uneven shapes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from examples.models import mlp, resnet
from soybean import models
from soybean.capture.core import capture
from soybean.cost.profiles import BUILTIN, Profile
from soybean.graph import PlanGraph, build, edge_profile
from soybean.mesh import Mesh

pytestmark = pytest.mark.unit

CASES = [
    ("hf:llama", {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 48, "vocab_size": 96, "batch": 2, "seq": 8}, (2, 2)),
    ("hf:gpt2", {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 97, "batch": 3, "seq": 6}, (2, 2)),
    ("mlp_uneven", {}, (4,)),
    ("resnet18", {}, (2,)),
]
EXAMPLES = {
    "mlp_uneven": lambda: mlp(batch=6, hidden=10, layers=3),
    "resnet18": lambda: resnet(batch=2, image=32, classes=10, depth=18, width=0.125),
}


def _same(a: PlanGraph, b: PlanGraph) -> None:
    assert [v.name for v in a.vars] == [v.name for v in b.vars]
    for v, w in zip(a.vars, b.vars):
        assert v.strategies == w.strategies, v.name
        assert v.grad_partial == w.grad_partial, v.name
        np.testing.assert_array_equal(v.compute_s, w.compute_s, err_msg=v.name)
        np.testing.assert_array_equal(v.memory, w.memory, err_msg=v.name)
    assert len(a.edges) == len(b.edges)
    for e, f in zip(a.edges, b.edges):
        assert (e.src, e.dst, e.src_out, e.dst_in, e.deferred, e.write_back) == (f.src, f.dst, f.src_out, f.dst_in,
                                                                                  f.deferred, f.write_back)
        np.testing.assert_array_equal(e.bytes, f.bytes)
        np.testing.assert_array_equal(e.seconds, f.seconds)
        assert (e.sync is None) == (f.sync is None)
        if e.sync is not None:
            np.testing.assert_array_equal(e.sync, f.sync)
        # Every (s, t)'s route: a route is a function of the source's and the consumer's route keys, so one
        # strategy of each distinct pair of keys (the two builds' keys side by side) stands for all that share it.
        srcs = {(e.src_key_of[s], f.src_key_of[s]): s for s in range(len(a.vars[e.src].strategies))}
        dsts = {(e.dst_key_of[t], f.dst_key_of[t]): t for t in range(len(a.vars[e.dst].strategies))}
        for s in srcs.values():
            for t in dsts.values():
                assert e.route(s, t) == f.route(s, t)


@pytest.mark.parametrize("ref, args, mesh", CASES, ids=[c[0] for c in CASES])
def test_shared_build_equals_the_build_priced_variable_by_variable(ref: str, args: dict, mesh: tuple) -> None:
    model, inputs = EXAMPLES[ref]() if ref in EXAMPLES else models.load(ref, dict(args))
    cap = capture(model, inputs)
    for objective in ("time", "comm"):
        shared = build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], objective=objective)
        fresh = build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], objective=objective, share=False)
        _same(shared, fresh)


def test_the_layers_of_a_stack_share_their_tables() -> None:
    ref, args, mesh = CASES[0]
    model, inputs = models.load(ref, dict(args))
    g = build(capture(model, inputs), Mesh(mesh), BUILTIN["h100-nvlink"])
    # the same op in layers 1 and 2 holds the very same arrays (layer 0 reads the embedding)
    linear = [v for v in g.vars if v.kind == "op" and v.module.startswith("model.model.layers.")]
    l1 = [v for v in linear if v.module.startswith("model.model.layers.1.")]
    l2 = [v for v in linear if v.module.startswith("model.model.layers.2.")]
    assert len(l1) == len(l2) > 10
    assert all(a.strategies is b.strategies and a.compute_s is b.compute_s for a, b in zip(l1, l2))
    assert not l1[0].compute_s.flags.writeable  # shared arrays cannot be changed through one variable


# A calibrated profile whose bandwidth changes with the message (``Profile.beta_curves``), for the backend's
# calls and for each of soybean's algorithms on the all-gather and all-reduce.
_CURVE = ((1e2, 4e-9), (1e4, 2e-9), (1e6, 6e-9))
CURVED = replace(BUILTIN["cpu-gloo"], name="curved",
                 collectives=(("all_reduce", 3e-4, 1e-9), ("all_gather", 2e-4, 1e-9), ("all_gather:ring", 1e-4, 1e-9),
                              ("all_gather:lp", 1e-4, 1e-9), ("all_reduce:tree", 1e-4, 1e-9), ("p2p", 2e-4, 1e-9)),
                 beta_curves=tuple((k, _CURVE) for k in ("all_reduce", "all_gather", "all_gather:ring",
                                                          "all_gather:lp", "all_reduce:tree")))


@pytest.mark.parametrize("profile", [BUILTIN["h100-nvlink"], CURVED], ids=lambda p: p.name)
def test_tables_built_across_mesh_shapes_price_every_route_as_the_definition(profile: Profile) -> None:
    """One planner run's pricing cache is kept across builds and mesh shapes (``cost.pricing.PricingCache``): after
    builds on other meshes, every entry of every edge table is still ``reshard_cost`` of that entry's route (with a
    profile whose beta depends on the message too), and a second build on a mesh already seen prices no new
    route."""
    from soybean.cost.collectives import reshard_cost
    from soybean.cost.pricing import PricingCache
    from soybean.graph import PINNED
    ref, args, _ = CASES[1]
    model, inputs = models.load(ref, dict(args))
    cap = capture(model, inputs)
    cache = PricingCache()
    for i, shape in enumerate([(4,), (2, 2), (1, 4), (2, 2)]):
        mesh = Mesh(shape)
        known = len(cache.steps.ids)
        g = build(cap, mesh, profile, pricing=cache)
        assert g.pricing is cache
        assert (len(cache.steps.ids) == known) == (i == 3)  # the second 2x2 build meets only routes priced before
        checked = 0
        defined: dict[tuple, tuple[float, float]] = {}  # the definition's price, computed once per distinct entry
        for e in g.edges:
            prof = edge_profile(g, e)
            for s in range(e.bytes.shape[0]):
                for t in range(e.bytes.shape[1]):
                    if e.seconds[s, t] == PINNED:
                        continue
                    route = e.route(s, t)
                    key = (route, e.shape, e.itemsize, prof)
                    if key not in defined:
                        c = reshard_cost(route, e.shape, e.itemsize, mesh, prof)
                        defined[key] = (c.bytes, c.seconds)
                    assert (e.bytes[s, t], e.seconds[s, t]) == defined[key], (shape, e.src, e.dst, s, t)
                    checked += 1
        assert checked > 1000


def test_route_ids_are_the_same_whether_kept_sorted_or_recent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RouteIds`` keeps the pairs it met in a sorted array and the latest in a dict: merged after every batch or
    never, every table's ids are the same, and pairs met again are found without new routes."""
    from soybean.cost.pricing import PricingCache, RouteIds

    ref, args, _ = CASES[1]
    model, inputs = models.load(ref, dict(args))
    cap = capture(model, inputs)
    tables: dict[int, list[np.ndarray]] = {}
    for merge_min in (1, 10**9):
        monkeypatch.setattr(RouteIds, "MERGE_MIN", merge_min)
        cache = PricingCache()
        calls: list[np.ndarray] = []
        real = cache.route_ids.__call__

        def spy(*a: object, real=real, calls=calls) -> np.ndarray:  # type: ignore[no-untyped-def]
            ids = real(*a)
            calls.append(ids.copy())
            return ids

        monkeypatch.setattr(cache, "route_ids", spy)
        for shape in [(4,), (2, 2), (4,)]:
            build(cap, Mesh(shape), BUILTIN["h100-nvlink"], pricing=cache)
        assert (len(real.__self__.codes) > 0) == (merge_min == 1)
        tables[merge_min] = calls
    assert len(tables[1]) == len(tables[10**9]) > 10
    assert all(np.array_equal(a, b) for a, b in zip(tables[1], tables[10**9]))


def test_a_variable_kind_is_one_of_the_six() -> None:
    """``Var.kind`` is a ``VarKind``: the strings the planner compares still match, a misspelt kind is refused."""
    from soybean.graph import Var, VarKind

    v = Var("x", "reshard", [], np.zeros(0), np.zeros(0))
    assert v.kind is VarKind.reshard and v.kind == "reshard" and f"{v.kind}" == "reshard"
    assert {VarKind.op: 1}["op"] == 1  # hashes as its string
    with pytest.raises(ValueError, match="'operation' is not a valid VarKind"):
        Var("y", "operation", [], np.zeros(0), np.zeros(0))


def test_pricing_state_belongs_to_the_run_that_made_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pricing state is kept by the process: a build given no cache starts an empty one; ``planner.plan`` hands
    one cache to every table it builds (each mesh shape and each baseline), and the next ``plan`` a new one."""
    from soybean.planner import baselines, core as planner, solve

    model, inputs = EXAMPLES["mlp_uneven"]()
    cap = capture(model, inputs)
    a, b = (build(cap, Mesh((2,)), BUILTIN["h100-nvlink"]) for _ in range(2))
    assert a.pricing is not b.pricing and len(a.pricing.steps.ids) == len(b.pricing.steps.ids) > 0
    seen: list[list[int]] = []
    real = solve.build

    def spy(*args: object, **kw: object) -> PlanGraph:
        g = real(*args, **kw)  # type: ignore[arg-type]
        seen[-1].append(id(g.pricing))
        return g

    monkeypatch.setattr(solve, "build", spy)  # ``Search.table``'s
    monkeypatch.setattr(baselines, "build", spy)
    for _ in range(2):
        seen.append([])
        planner.plan(None, (), 4, captured=cap)
    assert all(len(run) > 3 and len(set(run)) == 1 for run in seen)  # meshes and baselines: one cache per run


def test_builds_of_other_recomputation_choices_share_work_exactly() -> None:
    """``SharedWork`` carried across the builds of one mesh (as ``planner.solve_recompute`` does) gives every
    recomputation choice the table a build of its own gives."""
    from soybean.graph import SharedWork
    from soybean.planner.recompute import recompute_choices

    ref, args, mesh = CASES[0]
    model, inputs = models.load(ref, dict(args))
    cap = capture(model, inputs)
    work = SharedWork()
    choices = [units for chain in recompute_choices(cap) for units in chain]
    assert len(choices) > 4
    for units in choices[::-1] + choices[:2]:
        shared = build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], recompute=units, work=work)
        _same(shared, build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], recompute=units))


def test_an_unpriced_build_of_a_plan_is_the_priced_one_with_zero_tables() -> None:
    """``build(..., priced=False)`` (what a lowering reads) gives the plan's graph with every variable, edge, route
    and flag of the priced build, only the edges' byte and second tables zero and no deferred sync."""
    from soybean.planner.core import plan

    ref, args, mesh = CASES[0]
    model, inputs = models.load(ref, dict(args))
    cap = capture(model, inputs)
    p = plan(None, (), 4, captured=cap, mesh=mesh, objective="comm", baselines=False)
    priced = build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], fixed=p)
    bare = build(cap, Mesh(mesh), BUILTIN["h100-nvlink"], fixed=p, priced=False)
    assert priced.priced and not bare.priced
    assert any(e.seconds.any() for e in priced.edges)
    assert all(not e.bytes.any() and not e.seconds.any() and e.sync is None for e in bare.edges)
    for e in priced.edges:  # the rest compared with ``_same``: variables, routes, flags
        e.bytes, e.seconds, e.sync = np.zeros_like(e.bytes), np.zeros_like(e.seconds), None
    _same(priced, bare)
