"""Data-dependent sizes (issue 26, point 3): ``nonzero``, boolean masks, ``masked_select``, ``unique``, ``item`` and
the ``split`` by ``tolist()`` sizes that routers such as JetMoe's make.

* the rules of ``rules/datadep.py`` and ``index.Tensor``'s boolean masks against the serial op, every strategy on
  every simulated rank, on 1, 2 and 4 devices with uneven shapes (``validate.check_op``);
* a dim marked data-dependent is never split, its broadcast never assumed, and a view keeps its run-time size;
* capture prices each size at the example's value, marks the dims, and names the ops (in the capture cache too);
* a small model using them all trains equal to serial, and the planner warns once, naming them; its program runs
  on other sizes than the example's;
* JetMoe (tiny, as loaded) trains equal to serial on 2 ranks under both objectives.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from soybean.capture.core import capture
from soybean.mesh import Mesh
from soybean.rules import REGISTRY, expand, make_opspec
from soybean.rules.base import DYNAMIC, Strategy, TensorSpec, has_empty_tile, spec_of
from soybean.rules.datadep import SIZES, data_dependent
from soybean.tiling import P, R, Shard, shard
from soybean.verify.validate import check_op

pytestmark = pytest.mark.unit

aten = torch.ops.aten
MESHES = [Mesh((1,)), Mesh((2,)), Mesh((4,))]
_gen = torch.Generator().manual_seed(26)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_gen)


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen)


def mask(*shape: int) -> torch.Tensor:
    m = torch.rand(shape, generator=_gen) > 0.5
    m.view(-1)[0] = True  # at least one selected
    return m


X = randn(6, 5, 7)
M6, M65 = mask(6), mask(6, 5)
# (op, args, kwargs, splits): ``splits``: some strategy besides all-R exists on 2 devices.
CASES: list[tuple[Any, tuple, dict, bool]] = [
    (aten.index.Tensor, (X, [M6]), {}, True),                   # (u, 5, 7): dims 1, 2 split
    (aten.index.Tensor, (X, [None, mask(5)]), {}, True),        # (6, u, 7): dims 0, 2 split
    (aten.index.Tensor, (X, [M65]), {}, True),                  # (u, 7): a 2-D mask, dim 2 splits
    (aten.index.Tensor, (X, [torch.tensor([1, 0, 1, 1, 0, 0]).bool(), None,  # masks apart, equal counts:
                             torch.tensor([0, 1, 0, 1, 0, 0, 1]).bool()]), {}, True),  # (u, 5), dim 1 splits
    (aten.index_put.default, (X, [M6], randn(int(M6.sum()), 5, 7)), {}, True),
    (aten.index_put.default, (X, [M6], randn(7), True), {}, True),
    (aten.index_put.default, (X, [M65], randn(int(M65.sum()), 7), True), {}, True),
    (aten.index_put.default, (X, [ints(6, 4)], randn(4, 5, 7), True), {}, True),
    (aten.index_add.default, (randn(6, 5), 0, ints(6, 9), randn(9, 5)), {}, True),
    (aten.index_add.default, (randn(6, 5), 1, ints(5, 3), randn(6, 3)), {"alpha": 2.0}, True),
    (aten.masked_select.default, (X, X > 0.3), {}, False),
    (aten.nonzero.default, (M65,), {}, False),
    (aten.argwhere.default, (M65,), {}, False),
    (aten._unique2.default, (ints(4, 9),), {"return_inverse": True, "return_counts": True}, False),
    (aten.unique_dim.default, (ints(3, 6, 4), 0), {}, False),
    (aten.unique_consecutive.default, (ints(3, 9),), {"return_counts": True}, False),
    (aten.repeat_interleave.Tensor, (ints(4, 5),), {}, False),
    (aten.bincount.default, (ints(5, 9),), {}, False),
    (aten.item.default, (randn(1),), {}, False),
    (aten._local_scalar_dense.default, (ints(9, 1, 1),), {}, False),
]


def _id(c: tuple) -> str:
    return str(c[0]).removeprefix("aten.")


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("c", CASES, ids=[_id(c) for c in CASES])
def test_rule_is_exact(c: tuple, mesh: Mesh) -> None:
    """Every strategy the rule lists is exact on every simulated rank, forward and backward; ops that read
    values to make sizes list none but all-R."""
    target, args, kwargs, splits = c
    checked = check_op(target, args, kwargs, mesh)
    if mesh.size == 1 or not splits:
        assert checked == (1 if not splits else checked)
    else:
        assert checked > 1, f"{_id(c)}: nothing split on {mesh}"


@pytest.mark.parametrize("mesh", MESHES[1:], ids=str)
def test_sym_size_reads_the_size_from_any_tile_that_keeps_its_dim(mesh: Mesh) -> None:
    """``x.size(dim)`` on every rank's tile equals the whole's, for every listed strategy (one per other dim)."""
    x = randn(5, 7, 3)
    for dim in range(3):
        op = make_opspec(aten.sym_size.int, (x, dim), {}, aten.sym_size.int(x, dim))
        strategies = expand(op, mesh)
        splits = {(Shard(d),) for d in range(3) if d != dim and not has_empty_tile((Shard(d),), x.shape, mesh)}
        assert {s.inputs[0] for s in strategies} == {(R,), (P,)} | splits
        for s in strategies:
            if isinstance(s.inputs[0][0], Shard):
                tiles = shard(x, s.inputs[0], mesh)
                assert {aten.sym_size.int(t, dim) for t in tiles.values()} == {x.shape[dim]}


def test_a_data_dependent_dim_is_never_split() -> None:
    """Marked dims (``TensorSpec.dynamic``) are never split by any rule, and a broadcast along one is not
    assumed: its priced size happens to be 1, its run-time size need not be."""
    dyn = TensorSpec((7, 5), torch.float32, (0,))
    op = make_opspec(aten.relu.default, (dyn,), {}, None)
    op = type(op)(op.target, op.args, op.kwargs, op.inputs, (dyn,))
    assert all(s.outputs[0][0] != Shard(0) for s in expand(op, Mesh((2,))))
    assert any(s.outputs[0][0] == Shard(1) for s in expand(op, Mesh((2,))))
    one = TensorSpec((1, 5), torch.float32, (0,))
    out = TensorSpec((6, 5), torch.float32)
    add = type(op)(aten.add.Tensor, (one, out), {}, (one, out), (out,))
    for s in expand(add, Mesh((2,))):
        assert s.outputs[0][0] != Shard(0), s  # the whole output rows with the marked input R would be wrong
    assert any(s.outputs[0][0] == Shard(1) for s in expand(add, Mesh((2,))))


def test_a_view_keeps_the_run_time_size_of_a_data_dependent_dim() -> None:
    """A view's size argument keeps its own entry (``-1``, the node of the run-time size) for a marked dim, and
    takes the local size of a split one."""
    spec = TensorSpec((6, 4), torch.float32, (0,))
    out = TensorSpec((6, 2, 2), torch.float32, (0,))
    view = REGISTRY["aten.view.default"]
    op = type(make_opspec(aten.relu.default, (randn(2),), {}, randn(2)))(aten.view.default, (spec, [-1, 2, 2]), {},
                                                                        (spec,), (out,))
    assert view.localize is not None
    args, _ = view.localize(op, ("x", [-1, 2, 2]), {}, [(6, 2)], [(6, 1, 2)])
    assert args[1] == [-1, 1, 2]
    args, _ = view.localize(op, ("x", ["n", 2, 2]), {}, [(6, 4)], [(6, 2, 2)])
    assert args[1] == ["n", 2, 2]


class Selecting(nn.Module):
    """A boolean mask, ``nonzero``, ``masked_select`` and ``unique`` in one forward, trained end to end."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        keep = h.sum(-1) > 0
        rows = h[keep]                                     # (u, 12)
        idx = torch.nonzero(x[:, 0] > 0).squeeze(-1)       # (v,)
        sel = torch.masked_select(h, h > 0.1)              # (w,)
        u = torch.unique(ids)                              # (z,)
        return (self.b(rows).pow(2).sum() + sel.sum() + h[:, :4].index_select(0, idx).pow(2).sum()
                + h[:, u % 12].sum())


def _selecting() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    m = Selecting()
    x = torch.randn(7, 8)
    return m, (x, torch.tensor([3, 1, 3, 5, 1]))


def test_capture_prices_the_example_sizes_and_marks_the_dims() -> None:
    m, (x, ids) = _selecting()
    cap = capture(m, (x, ids))
    keep = m.a(x).sum(-1) > 0
    sizes = {k: v for found in data_dependent(cap.graph).values() for k, v in found.items()}
    got = data_dependent(cap.graph)
    assert set(got) == {"aten.index.Tensor", "aten.nonzero.default", "aten.masked_select.default",
                        "aten._unique2.default"}
    assert sorted(sizes.values()) == sorted([int(keep.sum()), int((x[:, 0] > 0).sum()),
                                             int((m.a(x) > 0.1).sum()), 3])
    for n in cap.graph.nodes:
        for t in (v for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)):
            assert all(type(d) is int for d in t.shape), n.name  # nothing symbolic after capture
    rows = next(n for n in cap.graph.nodes if n.target is aten.index.Tensor and SIZES in n.meta)
    assert getattr(rows.meta["val"], DYNAMIC) == (0,) and spec_of(rows).dynamic == (0,)
    assert spec_of(rows).shape == (int(keep.sum()), 12)


def test_the_capture_cache_keeps_the_marks() -> None:
    from soybean.capture.cache import dumps, loads

    m, example = _selecting()
    cap = capture(m, example)
    back = loads(dumps(cap))
    assert data_dependent(back.graph) == data_dependent(cap.graph)
    marks = {n.name: spec_of(n).dynamic for n in cap.graph.nodes if spec_of(n) is not None}
    assert marks == {n.name: spec_of(n).dynamic for n in back.graph.nodes if spec_of(n) is not None}
    assert any(marks.values())


@pytest.mark.sim
@pytest.mark.parametrize("devices,objective", [(2, "time"), (2, "comm"), (4, "comm")])
def test_a_model_with_data_dependent_sizes_trains_like_serial(devices: int, objective: str) -> None:
    from soybean.verify.testing import compare, train_parallel_threads, train_serial

    m, example = _selecting()
    serial = train_serial(m, example, steps=3, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par, plan = train_parallel_threads(m, example, devices=devices, objective=objective, steps=3, lr=1e-2)
    assert compare(serial, par) == []
    said = [str(w.message) for w in caught if "depend on values" in str(w.message)]
    assert len(said) == 1, said
    for name in ("aten.index.Tensor", "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default"):
        assert name in said[0]
    if objective == "comm":
        assert any(any(p != "R" for p in t) for t in plan.program.params.values()), "nothing was split"


@pytest.mark.sim
def test_the_program_runs_on_each_steps_own_sizes() -> None:
    """Planned on one batch, run on others whose masks select other counts: the outputs and gradients are the
    serial model's."""
    from soybean.api import parallelize
    from soybean.planner.core import plan as make_plan
    from soybean.runtime.launch import run_threads

    m, example = _selecting()
    cap = capture(m, example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(None, (), captured=cap, devices=2, objective="comm", baselines=False)
    # A generator of this test's own: the module's ``_gen`` is drawn by whichever tests ran before on this worker, so
    # its draws here depended on pytest-xdist's scheduling (with 3 workers all three batches once matched the example).
    gen = torch.Generator().manual_seed(229)
    batches = [(torch.randn(7, 8, generator=gen), torch.tensor([4, 4, 0, 2, 9])) for _ in range(3)]
    counts = {int((m.a(x).sum(-1) > 0).sum()) for x, _ in [example, *batches]}
    assert len(counts) > 1, "the batches select as many rows as the example: draw others"
    assert any(any(p != "R" for p in t) for t in plan.program.params.values()), "nothing was split"

    def rank(r: int, groups: Any) -> list[tuple[float, torch.Tensor]]:
        pm = parallelize(m, example, plan=plan, rank=r, groups=groups, captured=cap)
        out = []
        for b in batches:
            pm.zero_grad()
            y = pm(*b)
            y.backward()
            grads = {k: p.grad for k, p in pm.named_parameters()}
            out.append((float(y.detach()), pm.whole("a.weight", grads["a.weight"])))
        return out

    got = run_threads(Mesh(tuple(plan.mesh)), rank)
    for k, b in enumerate(batches):
        m.zero_grad()
        y = m(*b)
        y.backward()
        for r in got:
            assert r[k][0] == pytest.approx(float(y.detach()), rel=1e-5, abs=1e-5)
            torch.testing.assert_close(r[k][1], m.a.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.sim
def test_jetmoe_trains_like_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    """JetMoe's router reads its expert sizes with ``tolist()`` and splits the tokens by them: both objectives' plans
    (one capture and one serial run for both: the sweep captures a row once, 16.2 -> 8.4 s here, where its ops
    without a rule and each objective's run captured it again)."""
    pytest.importorskip("transformers")
    import soybean.capture.core as core
    from soybean.models import archs
    from soybean.verify import sweep

    made = []
    capture = core.capture

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return capture(*args, **kwargs)

    monkeypatch.setattr(core, "capture", counted)
    row = sweep.sweep_arch(archs.BY_NAME["jetmoe"], ("time", "comm"), devices=2, tier="threads")
    assert row.results == {"time": "ok", "comm": "ok"}, row.results
    assert len(made) == 1, len(made)


class Routed(nn.Module):
    """JetMoe's pattern: sizes read with ``tolist()`` split the rows, one weight per group."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 6))

    def forward(self, x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        order = group.argsort()
        sizes = (group[:, None] == torch.arange(3)).sum(0).tolist()
        parts = x[order].split(sizes)
        return torch.cat([p @ self.w[i] for i, p in enumerate(parts)]).pow(2).sum()


def test_numbers_the_graph_computes_are_priced_in_the_specs_and_pickle() -> None:
    """A size read with ``tolist()`` reaches a split as a node; its spec holds the priced number (specs go to the
    planner's workers pickled), and planning on 4 devices (two meshes, forked workers) succeeds."""
    import pickle

    from soybean.planner.core import plan as make_plan
    from soybean.rules.base import node_spec

    torch.manual_seed(0)
    m, example = Routed(), (torch.randn(9, 4), torch.tensor([0, 2, 2, 1, 0, 2, 2, 1, 2]))
    cap = capture(m, example)
    split = next(n for n in cap.graph.nodes if n.target is aten.split_with_sizes.default)
    assert node_spec(split).args[1] == [2, 2, 5]
    for n in cap.graph.nodes:
        if n.op == "call_function":
            pickle.dumps(node_spec(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(None, (), captured=cap, devices=4, objective="comm", baselines=False)
    assert plan.devices == 4


@pytest.mark.sim
@pytest.mark.parametrize("devices", [2, 4])
def test_rows_split_by_sizes_read_from_values_train_like_serial(devices: int) -> None:
    from soybean.verify.testing import compare, train_parallel_threads, train_serial

    torch.manual_seed(0)
    m, example = Routed(), (torch.randn(9, 4), torch.tensor([0, 2, 2, 1, 0, 2, 2, 1, 2]))
    serial = train_serial(m, example, steps=3, lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par, _ = train_parallel_threads(m, example, devices=devices, objective="comm", steps=3, lr=1e-2)
    assert compare(serial, par) == []


def test_no_strategy_list_changes_for_static_shapes() -> None:
    """Without marks nothing is filtered: the strategies of a plain op are those it always had."""
    x = randn(6, 4)
    op = make_opspec(aten.relu.default, (x,), {}, aten.relu.default(x))
    assert not op.inputs[0].dynamic
    assert Strategy(((Shard(0),),), ((Shard(0),),)) in expand(op, Mesh((2,)))
