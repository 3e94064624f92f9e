"""``soybean check``: is every rule a model's plans may use exact for that model?

A rule is checked in the unit tests on hand-made arguments; a model brings its own (an index list, a
mask, a view of an odd shape, an op called with arguments no test thought of).  So this runs the
model's own ops, with the model's own values:

1. the model is copied to float64 and captured as ``soybean.parallelize`` captures it;
2. the captured graph is run serially once (``torch.fx.Interpreter``), keeping every op's arguments;
3. every op with a rule (one per distinct op, arguments and shapes; ``every_node`` checks each) is run under
   every strategy its rule offers on each mesh, every rank simulated in this process
   (``validate.check_strategy``): the tiles of its outputs must make the serial op's outputs, and for
   one random output gradient, the ranks' input gradients, combined as the generated program's adjoint
   collectives combine them, must make the serial op's input gradients.

In float64 a right rule agrees to rounding (1e-9 of the values' scale); a wrong one is off by the size of
the values.  Ops without a rule run replicated (nothing to check: they are listed), and ops that draw
random numbers (dropout with p > 0) cannot agree with a serial draw: they are listed as skipped.
"""
from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from .. import rules
from ..capture.core import Captured, CaptureError, capture, split_example
from ..graph import op_key
from ..mesh import Mesh, factorizations
from ..rules.base import expand, make_opspec, op_name
from .validate import Reference, check_strategy, describe

# Tolerances by the least precise dtype an op reads or writes: float64 agrees to rounding; an op the model itself
# runs in float32 (``hidden.to(torch.float32)`` in a norm), or that casts to or from it, agrees to that dtype's
# rounding (a pending sum's summands are rounded one by one).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3,
             torch.complex128: 1e-9, torch.complex64: 2e-5}


@dataclass
class Failure:
    """One strategy of one op that does not give the serial op's values."""

    node: str      # the captured graph's node
    module: str    # the model's module it runs in
    message: str   # the op, the strategy, the mesh and what differs


@dataclass
class CheckReport:
    meshes: list[tuple[int, ...]]
    dtype: str = "float64"        # what the values were computed in
    ops: int = 0                  # distinct ops checked
    nodes: int = 0                # graph nodes those ops cover
    strategies: int = 0           # strategies run (forward and backward)
    failures: list[Failure] = field(default_factory=list)
    unruled: list[str] = field(default_factory=list)       # ops without a rule: run replicated
    forward_only: list[str] = field(default_factory=list)  # ops with no derivative: forward checked only
    random: list[str] = field(default_factory=list)        # ops that draw random numbers or return uninitialised
    #                                                         memory: not checked

    @property
    def ok(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        """The report as ``soybean check`` prints it."""
        meshes = ", ".join("x".join(map(str, m)) for m in self.meshes)
        out = [f"checked {self.strategies} strategies of {self.ops} distinct ops ({self.nodes} op nodes) "
               f"on mesh {meshes}, forward and backward, in {self.dtype}"]
        if self.unruled:
            out.append(f"no rule (run replicated, nothing to check): {', '.join(self.unruled)}")
        if self.forward_only:
            out.append(f"no derivative (forward checked only): {', '.join(self.forward_only)}")
        if self.random:
            out.append(f"random or uninitialised (not checked): {', '.join(self.random)}")
        if self.failures:
            out.append(f"{len(self.failures)} inexact strategies:")
            out += [f"  {f.node} ({f.module or 'top level'}): {f.message}" for f in self.failures]
        else:
            out.append("every strategy is exact")
        return out


def _float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def values(cap: Captured, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[fx.Node, Any]:
    """Every node's value when the captured graph runs ``model`` on the example (parameters, buffers and the
    constants forward made fed in placeholder order)."""
    state: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    state.update(cap.constants)
    feed = [t.detach() for t in cap.feed(state)]
    env: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            env[n] = out = super().run_node(n)
            return out

    with torch.no_grad():
        Recorder(cap.graph_module).run(*feed, *cap.flatten_inputs(args, kwargs))
    return env


# Ops whose output is uninitialised memory: no two runs agree on its values (what reads them overwrites them).
UNINITIALISED = ("aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default",
                 "aten.empty_strided.default", "aten.new_empty_strided.default")


def _random(target: Any, args: tuple, kwargs: dict) -> bool:
    """Does the op draw random numbers (dropout with p == 0 does not) or return uninitialised memory here?"""
    if op_name(target) in UNINITIALISED:
        return True
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    names = [x.name for x in target._schema.arguments]
    given = {**dict(zip(names, args)), **kwargs}
    p = given.get("p", given.get("dropout_p", 0.0 if "dropout_p" in names else None))
    return not (isinstance(p, (int, float)) and (p == 0 or given.get("train", True) is False))


def check_captured(cap: Captured, env: dict[fx.Node, Any], meshes: Sequence[Mesh], every_node: bool = False,
                   progress: Callable[[str], None] | None = None, seed: int = 0,
                   seen: dict[Any, None] | None = None) -> CheckReport:
    """Check every strategy of every op of ``cap`` on ``meshes`` with the values ``env`` (``values``).  ``seen``:
    the ops (``graph.op_key``, with the meshes) already checked, shared across models (a suite of models repeats
    most of its ops); those are skipped and the ones checked here are added."""
    report = CheckReport([m.shape for m in meshes])
    seen = {} if seen is None else seen
    unruled: dict[str, None] = {}
    forward_only: dict[str, None] = {}
    rnd: dict[str, None] = {}
    for n in cap.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        args, kwargs = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (tuple(n.args), dict(n.kwargs)))
        op = make_opspec(n.target, args, kwargs, env[n])
        if not op.inputs:
            continue  # a factory: no input to split, its rule is about its output
        if rules.lookup(n.target) is None:
            unruled[op.name] = None
            continue
        if _random(n.target, args, kwargs):
            rnd[op.name] = None
            continue
        okey = op_key(op) if not every_node else None
        key = (okey, tuple(m.shape for m in meshes)) if okey is not None else None
        report.nodes += 1
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = None
        report.ops += 1
        if progress is not None:
            progress(f"{n.name} ({op.name})")
        # Each op draws from its own seed (its structural key's): the same draws whatever was checked before it.
        gen = torch.Generator().manual_seed(seed + int(cap.keys.get(n.name, "0"), 16) % 2**31)
        ref = Reference(n.target, args, kwargs, gen)
        if ref.grads is None and any(s.dtype.is_floating_point for s in op.inputs) \
                and any(o.is_floating_point() for o in ref.outputs):
            forward_only[op.name] = None
        floats = [t.dtype for t in [*ref.outputs, *tree_flatten((args, kwargs))[0]]
                  if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())] or [torch.float64]
        tol = max(TOLERANCE.get(d, 1e-2) for d in floats)
        module = (list(n.meta.get("nn_module_stack", {}).values()) or [("", None)])[-1][0]
        for mesh in meshes:
            for st in expand(op, mesh):
                report.strategies += 1
                try:
                    bad = check_strategy(op, n.target, args, kwargs, st, mesh, ref, gen, tol, tol)
                except Exception as e:  # a strategy whose local call fails is as wrong as one that computes wrong
                    bad = [f"{describe(op, st, mesh)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
                report.failures += [Failure(n.name, module, b) for b in bad]
    report.unruled, report.forward_only, report.random = list(unruled), list(forward_only), list(rnd)
    return report


def check_model(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict | None = None, *,
                devices: int = 2, meshes: Sequence[tuple[int, ...] | Mesh] | None = None, every_node: bool = False,
                progress: Callable[[str], None] | None = None, seen: dict[Any, None] | None = None) -> CheckReport:
    """Check every rule ``model``'s plans on ``devices`` may use (every mesh shape the planner tries, or
    ``meshes``) with the model's own ops and values, in float64 (see the module docstring); ``seen`` as
    ``check_captured``."""
    if any(t.is_meta for t in model.parameters()):
        raise ValueError("soybean check runs the model's ops on real values: build it on the CPU, not the meta "
                         "device (a small config or batch is enough: the rules are checked, not the size)")
    args, kwargs = split_example(example_inputs, example_kwargs)
    mesh_list = [m if isinstance(m, Mesh) else Mesh(tuple(m)) for m in meshes] if meshes else factorizations(devices)
    model64 = copy.deepcopy(model).double()
    args64, kwargs64 = tree_map(_float64, (args, kwargs))
    try:
        graphs = _graphs(model64, args64, kwargs64)
        dtype = "float64"
    except Exception:  # a model that breaks in float64 (a float32 constant it fills with float64's minimum)
        graphs = _graphs(model, args, kwargs)
        dtype = "the model's own dtypes (it does not run in float64)"
    report = CheckReport([m.shape for m in mesh_list], dtype)
    for cap, env in graphs:
        part = check_captured(cap, env, mesh_list, every_node=every_node, progress=progress, seen=seen)
        report.ops, report.nodes, report.strategies = (report.ops + part.ops, report.nodes + part.nodes,
                                                        report.strategies + part.strategies)
        report.failures += part.failures
        for mine, theirs in ((report.unruled, part.unruled), (report.forward_only, part.forward_only),
                             (report.random, part.random)):
            mine += [x for x in theirs if x not in mine]
    return report


def _graphs(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[Captured, dict[fx.Node, Any]]]:
    """The graphs ``parallelize`` would capture of ``model`` with every node's value: the one ``torch.export``
    graph, or where export fails, each piece dynamo splits forward into (``soybean.run.pieces``) run on its own
    example inputs."""
    try:
        cap = capture(model, args, kwargs)
    except CaptureError:
        from ..run.pieces import collect

        out = []
        for piece, users in collect(model, args, kwargs):
            piece_cap = capture(piece, users)
            out.append((piece_cap, values(piece_cap, piece, users, {})))
        return out
    return [(cap, values(cap, model, args, kwargs))]


__all__ = ["CheckReport", "Failure", "check_captured", "check_model", "values"]
