"""Models that ``torch.export`` cannot capture, captured by dynamo in pieces and run piece by piece.

``torch.export`` needs one graph for the whole forward.  Some models users load have none: Switch Transformers
and LongT5 read ``attention_mask[:, None]`` of a mask they build only when not compiling, LED branches on
``is_global_attn`` (a tensor's value).  Dynamo captures them anyway: it splits forward at each graph break into
FX graphs ("pieces") and runs the Python between them as the user wrote it.  ``parallelize`` falls back to it
when export fails (``capture="auto"``) or when asked (``capture="dynamo"``):

1. ``plan_pieces`` (rank 0): the model is run once on the example under ``torch.compile`` with a backend that only
   collects the pieces (``_Collector``; buffers and the random state are restored afterwards, so the run changes
   nothing), each piece is captured with soybean's own ``capture`` (an FX graph is always exportable) and planned
   on every device, and one ``Plan`` records them all (``Plan.pieces``: why dynamo was used, and per piece its
   fingerprint, its parameters by the model's names and its plan);
2. ``PiecesModule`` (every rank): the model compiled with ``PieceBackend``, which runs each piece dynamo hands it
   with the plan recorded for its fingerprint (or, for a piece first seen later, a plan made then, on rank 0, as
   ``compile_backend`` does), inputs and outputs whole on every rank, so the Python between pieces runs on every
   rank exactly as it runs serially.  Each output is laid out as the serial run lays it out (its strides: dynamo
   guards the next frame on them), and a graph's first program lowers the capture its plan was made from.

Each piece is planned in mode ``replicated``: every parameter **stored** whole on every device (its use may still
be split: a column-split matmul reads its slice, and the gradient's partial sums are all-reduced), so the model's
own ``nn.Parameter`` objects are the ones that train and a parameter read by several pieces is one tensor.  The
values crossing a graph break are whole on every rank on both sides: each piece's plan pays for gathering its
outputs and slicing its inputs (the full-batch contract), and tilings are not chosen across a break.
"""
from __future__ import annotations

import hashlib
import operator
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_flatten

from ..capture.core import Captured, CaptureError, capture
from ..capture.eager import untouched
from ..options import PlanOptions, plan_kind
from ..plan import Plan
from ..runtime.layouts import laid_as
from . import grad_norm as norms
from .module import KeepsMesh, _attach, forward_backward

CAPTURES = ("auto", "export", "dynamo")


_APPLY = torch.ops.higher_order.autograd_function_apply  # dynamo's call of a custom ``autograd.Function``
_DATA = torch._C._autograd._get_data_attr  # type: ignore[attr-defined]  # dynamo's record of ``x.data``


def _data_as_detach(gm: fx.GraphModule) -> None:
    """Each ``x.data`` read in dynamo's graph ``gm`` made ``x.detach()``, in place: the same elements without a
    gradient (the two differ only in the version counter, which a read never bumps), and an op ``torch.export``
    traces, where ``_get_data_attr`` is a fake tensor it refuses (I-BERT's ``QuantAct`` reads ``x.data.min()``
    with quantization off)."""
    found = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _DATA:
            n.target, found = torch.Tensor.detach, True
    if found:
        gm.recompile()


def _split_at_functions(gm: fx.GraphModule, backend: PieceBackend) -> fx.GraphModule | None:
    """``gm`` split at each custom ``autograd.Function`` it calls, or None where it calls none.

    Dynamo hands a Function it can trace over as ``autograd_function_apply(fwd, bwd, *args)``: a forward graph and
    the Function's own backward graph.  Captured into a piece's program, the call would be differentiated through
    its forward, and a Function whose backward is not that derivative (a gradient reversal, a straight-through
    estimator, an approximate backward) would train differently from serial.  So the graph is cut around each call
    (``torch.fx``'s ``split_module``): the runs of ops between calls are ``_Segment``s, each planned and run as a
    piece, and each call runs as dynamo gave it, eagerly (an ``autograd.Function`` of its two graphs: the Function's
    own backward), whole on every rank, as the Python between graph breaks runs."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _APPLY]
    if not calls:
        return None
    part, parts = 0, {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.target is _APPLY:
            parts[n], part = part + 1, part + 2
        elif n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target is _APPLY:
            parts[n] = parts[n.args[0]]  # the call's outputs taken apart beside it
        else:
            parts[n] = part
    funcs = {parts[n] for n in calls}
    top = split_module(gm, gm, lambda n: parts.get(n, 0), keep_original_order=True)
    for name, sub in list(top.named_children()):
        if name.startswith("submod_") and int(name.removeprefix("submod_")) not in funcs:
            assert isinstance(sub, fx.GraphModule)
            setattr(top, name, _Segment(backend, sub))
    return top


class _Segment(nn.Module):
    """The ops of a dynamo graph between two custom Function calls (``_split_at_functions``), run as the backend
    runs a graph dynamo hands it (``PieceBackend.runner``, decided on its first call, when its inputs are known)."""

    def __init__(self, backend: PieceBackend, gm: fx.GraphModule) -> None:
        super().__init__()
        self.backend, self.gm = backend, gm
        self.run: Callable[..., Any] | None = None
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))  # ``split_module`` returns one output bare

    def forward(self, *args: Any) -> Any:
        if self.run is None:
            self.run = self.backend.runner(self.gm, list(args))
        out = self.run(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out


class _Piece(nn.Module):
    """One captured graph as a module: its parameter inputs registered as the user's own objects."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        self.slots: list[str | None] = []  # per graph input: a parameter's name here, or None (a user input)
        for i, x in enumerate(example_inputs):
            if isinstance(x, nn.Parameter):
                self.register_parameter(f"p{i}", x)
                self.slots.append(f"p{i}")
            else:
                self.slots.append(None)

    def forward(self, *inputs: Any) -> Any:
        it = iter(inputs)
        args = [getattr(self, s) if s is not None else next(it) for s in self.slots]
        return self.gm(*args)

    def user_inputs(self, inputs: Sequence[Any]) -> tuple:
        """The inputs of a call that are not parameters, in order."""
        return tuple(x for x, s in zip(inputs, self.slots) if s is None)

    def params_of(self, inputs: Sequence[Any]) -> tuple[nn.Parameter, ...]:
        """The parameters a call passes, in slot order (the objects that call's program must read and train)."""
        return tuple(x for x, s in zip(inputs, self.slots) if s is not None)


Make = Callable[[_Piece, tuple, "Plan | None", "Captured | None"], Any]


class _Bound:
    """One piece's programs by the parameters they run on.  Dynamo reuses one graph for every module instance that
    runs the same code (with nn modules inlined, a module's parameters are graph inputs: T5's encoder and decoder
    share ``T5LayerNorm.forward``'s graph), so a call must run on the parameters it is given.  The plan is made
    once, on the first call's; every other set of parameter objects gets a program of that plan bound to its own
    parameters, so their gradients land on them.  Keyed by the objects' ids; each entry holds its objects, so an id
    is never reused while its entry lives."""

    def __init__(self, piece: _Piece, pm: Any, example_inputs: Sequence[Any], make: Make) -> None:
        self.piece = piece
        self.make = make
        params = piece.params_of(example_inputs)
        self.programs: dict[tuple[int, ...], tuple[tuple[nn.Parameter, ...], Any]] = {
            tuple(map(id, params)): (params, pm)}
        self.plan: Plan = pm.plan
        self.layouts = _output_layouts(piece.gm)

    def __call__(self, *args: Any) -> Any:
        params = self.piece.params_of(args)
        key = tuple(map(id, params))
        hit = self.programs.get(key)
        if hit is None:
            other = _Piece(self.piece.gm, args)
            hit = (params, self.make(other, other.user_inputs(args), self.plan, None))
            self.programs[key] = hit
        out = hit[1](*self.piece.user_inputs(args))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return type(outs)(_laid_out(t, want) for t, want in zip(outs, self.layouts)) \
            if len(outs) == len(self.layouts) else outs


def _output_layouts(gm: fx.GraphModule) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """Per output of dynamo's graph ``gm``: the shape and strides its eager run gives the tensor (dynamo's
    ``example_value``; a view of a larger tensor, as a padded attention mask sliced back, included), where no two
    elements share memory; else None."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    items = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    layouts: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
    for a in items:
        v = a.meta.get("example_value") if isinstance(a, fx.Node) else None
        if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in (*v.shape, *v.stride())):
            layouts.append(None)
            continue
        shape, stride = tuple(v.shape), tuple(v.stride())
        layouts.append((shape, stride) if _apart(shape, stride) else None)
    return layouts


def _apart(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Do the elements of a tensor of ``shape`` and ``stride`` lie at distinct offsets?  Sufficient: taken by
    growing stride, each dim's stride exceeds the last offset the smaller dims reach (``sum (n_d - 1) s_d``)."""
    reach = 0
    for size, step in sorted(((n, s) for n, s in zip(shape, stride) if n > 1), key=lambda d: d[1]):
        if step <= reach:
            return False
        reach += (size - 1) * step
    return True


def _laid_out(t: Any, want: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Any:
    """``t`` with the strides the serial run gives this output (a copy where a program's output, gathered whole,
    is laid out otherwise): dynamo guards the next frame on its inputs' strides, and a program's output laid out
    unlike the captured graph's made it recompile every frame after a graph break, once per program."""
    if want is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != want[0]:
        return t
    return laid_as(t, want[1])


class PieceBackend:
    """A ``torch.compile`` backend that runs every graph dynamo captures as a soybean program on the current process
    group (rank 0 plans, every rank runs the same plan), in mode ``replicated``, inputs and outputs whole.

    Each graph's program is made on its first call (``_Graph``), not when dynamo compiles it, so one compiled model
    serves both: while ``collecting`` the graphs run as captured and are kept (``collected``: each graph's first
    call, its piece and inputs; planning reads them), afterwards as programs.  One compile, so a model planned and
    then run costs dynamo one cache entry per frame, not two (a frame recompiles for each new backend, and dynamo
    stops compiling a frame after ``recompile_limit`` entries).  ``known``: plans by piece fingerprint
    (``Plan.pieces``), used instead of planning; ``plans`` lists every program's plan in the order they were
    made."""

    def __init__(self, opts: PlanOptions, parallelize: Callable[..., Any],
                 known: Mapping[str, Plan] | None = None) -> None:
        if opts.mode not in ("auto", "replicated"):
            raise ValueError(f"pieces captured by dynamo are planned in mode replicated (parameters stored whole, the "
                             f"user's optimizer updates them), not {opts.mode!r}")
        if opts.local_batch:
            raise ValueError("local_batch=True is not offered for a model captured by dynamo in pieces: the Python "
                             "between pieces needs whole tensors; pass the global batch on every rank")
        if plan_kind(opts) != "plain":
            raise ValueError(f"each piece captured by dynamo is one program over every device: pipeline="
                             f"{opts.pipeline!r} and placement={opts.placement!r} are not offered there")
        self.opts = opts.merged(mode="replicated")
        self.parallelize = parallelize  # ``api.parallelize``, given: the front end imports this module, not back
        self.known = dict(known or {})
        self.plans: list[Plan] = []
        self.collecting = False
        self.collected: list[tuple[_Piece, tuple]] = []
        self.dynamic_seen = False  # a graph with dynamic shapes was run unsplit (warned once)
        self.compiled = 0  # graphs dynamo handed this backend: one per frame compiled, recompiles included
        # Captures made while planning (``distinct``), by graph and call: the graph's first program lowers the same
        # capture its plan was made from instead of capturing the graph again (a third of a small model's first
        # call, most of it ``torch.export``).  Each entry is taken once and holds its graph, so no id is reused.
        self.captured: dict[tuple[int, tuple], tuple[fx.GraphModule, Captured]] = {}

    def _make(self, piece: _Piece, users: tuple, plan: Plan | None, cap: Captured | None) -> Any:
        return self.parallelize(piece, users, options=self.opts, plan=plan, captured=cap, outputs="full",
                           share_params=True)

    def remember(self, piece: _Piece, users: tuple) -> Captured:
        """``capture(piece, users)``, kept for the first program of this graph on such inputs (``take``)."""
        cap = capture(piece, users)
        self.captured[(id(piece.gm), _signature(users))] = (piece.gm, cap)
        return cap

    def take(self, piece: _Piece, users: tuple) -> Captured:
        """The capture ``remember`` kept of this graph on such inputs (taken: a graph's first program), else a new
        one."""
        kept = self.captured.pop((id(piece.gm), _signature(users)), None)
        return kept[1] if kept is not None else capture(piece, users)

    def bind(self, gm: fx.GraphModule, args: Sequence[Any]) -> _Bound:
        """The program of graph ``gm`` for a call with ``args``: planned (or the known plan of its fingerprint)."""
        piece = _Piece(gm, args)
        users = piece.user_inputs(args)
        cap = self.take(piece, users)
        pm = self._make(piece, users, self.known.get(cap.fingerprint), cap)
        self.plans.append(pm.plan)
        return _Bound(piece, pm, args, self._make)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.compiled += 1
        _data_as_detach(gm)
        split = _split_at_functions(gm, self)
        return self.runner(gm, example_inputs) if split is None else split.forward

    def runner(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        """What runs graph ``gm`` (no custom Function calls) for calls like ``example_inputs``: its program
        (``_Graph``), or ``gm`` itself where it has nothing to split."""
        piece = _Piece(gm, example_inputs)
        users = piece.user_inputs(example_inputs)
        if not any(isinstance(x, torch.Tensor) for x in users):
            return gm.forward  # nothing to split: a piece of parameter-only work runs as is
        if any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and not all(
                isinstance(d, int) for d in x.shape)) for x in users):
            # Dynamo made a dim dynamic (a recompile of ``torch.compile``'s default ``dynamic=None``): a plan is
            # for static shapes, so this graph runs as captured, whole on every rank (exact, not split).
            if not self.dynamic_seen:
                warnings.warn("soybean: a graph with dynamic shapes runs unsplit on every rank; pass "
                              "torch.compile(..., dynamic=False) to plan every graph", stacklevel=2)
            self.dynamic_seen = True
            return gm.forward
        return _Graph(self, gm)


class _Graph:
    """One graph dynamo compiled with a ``PieceBackend``: run as captured (and kept, on its first call) while the
    backend collects; else as its program, made on the first such call (every rank calls the graphs in the same
    order, so their programs' groups are made in the same order)."""

    def __init__(self, backend: PieceBackend, gm: fx.GraphModule) -> None:
        self.backend, self.gm = backend, gm
        self.kept = False
        self.bound: _Bound | None = None

    def __call__(self, *args: Any) -> Any:
        if self.backend.collecting:
            if not self.kept:
                piece = _Piece(self.gm, args)
                self.backend.collected.append((piece, tuple(piece.user_inputs(args))))
                self.kept = True
            return self.gm(*args)
        if self.bound is None:
            self.bound = self.backend.bind(self.gm, args)
        return self.bound(*args)


def run_collecting(model: nn.Module, compiled: Callable[..., Any], backend: PieceBackend, args: tuple,
                   kwargs: dict) -> list[tuple[_Piece, tuple]]:
    """The graphs ``compiled`` (``model`` compiled with ``backend``) runs on this example, each with the inputs of
    its first call that are not parameters: the model is run once, as captured, and left as it was.  A model or
    example on the meta device is a ``CaptureError`` naming the fix: the pieces are what the model's Python does on
    real values (a branch on a value, ``.item()``), which meta tensors do not have."""
    held = [*model.parameters(), *model.buffers(), *(x for x in tree_flatten((args, kwargs))[0]
                                                    if isinstance(x, torch.Tensor))]
    if any(t.is_meta for t in held):
        raise CaptureError(
            "the model is to be captured by dynamo in pieces (export failed, was not asked for, or a custom Function "
            "must run as written), which runs it on its example, and that is on the meta device (no values to "
            "branch on). Fix: build it on the CPU (drop meta=True), at a size that fits (fewer layers plan the same "
            "per layer), or make its forward traceable")
    backend.collecting, backend.collected = True, []
    try:
        with untouched(model):
            compiled(*args, **kwargs)
        return backend.collected
    finally:
        backend.collecting, backend.collected = False, []


def collect(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[_Piece, tuple]]:
    """The pieces dynamo splits ``model``'s forward into on this example (``run_collecting`` with a backend of its
    own: ``soybean check`` and the sweep's capture; ``parallelize`` collects with the backend it runs)."""
    backend = PieceBackend(PlanOptions(), lambda *a, **k: None)  # collecting only: no program is made
    fresh_caches()
    return run_collecting(model, torch.compile(model, backend=backend, dynamic=False), backend, args, kwargs)


def fresh_caches() -> None:
    """Dynamo's caches emptied (``torch.compiler.reset()``) before a new backend compiles a model: every backend adds
    an entry per frame it compiles (one per layer instance and graph break), and past ``recompile_limit`` entries
    dynamo runs a frame eagerly without a word, so the second ``parallelize`` of one model in a process planned
    half its pieces and the third none (transformers' LongcatFlash).  Other compiled code recompiles at its next
    call, a ``PiecesModule`` made before with the plans it recorded."""
    torch.compiler.reset()


def graphs(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None,
           exported: Captured | CaptureError | None = None) -> list[Captured]:
    """What ``parallelize`` captures of ``model`` (fp32, one program): its one ``torch.export`` graph, or where
    export fails or a custom Function must run as written (``capture.functions.own_backwards``), every distinct
    piece dynamo splits its forward into (``collect``, ``distinct``).  ``exported``: what exporting ``model``
    (fp32) gave already, its capture or the ``CaptureError`` it raised, so that it is not tried again."""
    from ..capture.core import split_example
    from ..capture.functions import own_backwards

    args, kwargs = split_example(example_inputs, example_kwargs)
    if exported is None:
        try:
            exported = capture(model, args, kwargs)
        except CaptureError as e:
            exported = e
    if isinstance(exported, Captured) and (not exported.functions
                                           or not own_backwards(model, args, kwargs, exported.functions)):
        return [exported]
    return [cap for _, cap in distinct(collect(model, args, kwargs))]


def pieces_fingerprint(fingerprints: Sequence[str]) -> str:
    """The fingerprint of a model captured in pieces: of its pieces' fingerprints, in order."""
    return hashlib.sha256("|".join(fingerprints).encode()).hexdigest()[:16]


Distinct = list[tuple[_Piece, Captured]]


def _signature(users: Sequence[Any]) -> tuple:
    """What a graph's capture depends on in its user inputs: each tensor's shape, dtype and whether it needs a
    gradient (``Captured.grad_inputs``), any other value itself."""
    return tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)
                 for x in users)


def distinct(pieces: Sequence[tuple[_Piece, tuple]], backend: PieceBackend | None = None) -> Distinct:
    """Each of ``pieces`` (``collect``, ``PiecesModule.collect``) captured once, in order, a graph another piece
    already computes (same fingerprint) left out: what is planned, and what a saved plan's fingerprint is of.
    ``backend``: the one that collected them, which keeps every capture for the graph's first program."""
    out: dict[str, tuple[_Piece, Captured]] = {}
    for piece, users in pieces:
        cap = capture(piece, users) if backend is None else backend.remember(piece, users)
        out.setdefault(cap.fingerprint, (piece, cap))
    return list(out.values())


def plan_pieces(model: nn.Module, pieces: Distinct, world: int, opts: PlanOptions, why: str,
                plan_one: Callable[[Captured, PlanOptions, int], Plan]) -> Plan:
    """The plan of ``model`` captured by dynamo in ``pieces`` (``distinct``; module docstring): every piece planned
    on ``world`` devices in mode ``replicated`` by ``plan_one``, and one plan recording them (``Plan.pieces``);
    ``why``: why export was not used.  Its ``cost`` is the pieces' summed (they run one after another)."""
    names = {id(p): n for n, p in model.named_parameters()}
    rows: list[dict[str, Any]] = []
    plans: list[Plan] = []
    pieces_opts = opts.merged(mode="replicated")
    for piece, cap in pieces:
        p = plan_one(cap, pieces_opts, world)
        plans.append(p)
        params = {s: names.get(id(piece.get_parameter(s)), s) for s in piece.slots if s is not None}
        rows.append({"fingerprint": cap.fingerprint, "ops": sum(1 for n in cap.graph.nodes if n.op == "call_function"),
                     "params": params, "plan": p.to_dict()})
    if not plans:
        raise ValueError(f"dynamo captured no graph of {type(model).__name__} that computes on tensors: nothing to "
                         "parallelize (or it stopped compiling the model's frames: torch._dynamo's recompile_limit, "
                         "reached when one model's code is compiled many times in a process; "
                         "torch.compiler.reset() clears it)")
    cost: dict[str, float] = {}
    for p in plans:
        for k, v in p.cost.items():
            if isinstance(v, (int, float)):
                cost[k] = cost.get(k, 0.0) + float(v)
    state = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    first = plans[0]
    return Plan(devices=world, mesh=[world], objective=first.objective, profile=first.profile,
                fingerprint=pieces_fingerprint([r["fingerprint"] for r in rows]),
                params={n: ["R"] for n in state}, inputs={}, nodes={}, cost=cost,
                solver={"capture": "dynamo", "pieces": len(rows),
                        "seconds": sum(float(p.solver.get("seconds", 0.0)) for p in plans)},
                fallback_ops=sorted({op for p in plans for op in p.fallback_ops}), precision="fp32",
                collectives=first.collectives, gpus_per_node=first.gpus_per_node,
                pieces={"capture": "dynamo", "why": why, "graphs": rows})


def piece_plans(plan: Plan) -> list[Plan]:
    """The plans of a plan made of pieces, in the order dynamo captured them."""
    assert plan.pieces is not None
    return [Plan.from_dict(r["plan"]) for r in plan.pieces["graphs"]]


class PiecesModule(KeepsMesh, nn.Module):
    """A model captured by dynamo in pieces (module docstring), as one rank runs it: the model compiled with
    ``PieceBackend``; the parameters and buffers are the model's own objects, registered under the model's names,
    so ``torch.optim.AdamW(pm.parameters())`` (or the model's) updates what runs.  The same API as
    ``ParallelModule``: forward, ``train_step``, ``full_state_dict``, ``load_full_state_dict``, ``save_sharded``,
    ``load_sharded``."""

    _model: nn.Module  # set with object.__setattr__ (not submodules: their tensors are registered here by name)
    _compiled: Callable[..., Any]

    def __init__(self, model: nn.Module, opts: PlanOptions, parallelize: Callable[..., Any]) -> None:
        super().__init__()
        self._plan: Plan | None = None  # ``use`` sets it
        for n, p in model.named_parameters():
            _attach(self, n, p, "param", shared=True)
        for n, b in model.named_buffers():
            _attach(self, n, b, "buffer")
        self._shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.backend = PieceBackend(opts, parallelize)
        fresh_caches()
        object.__setattr__(self, "_model", model)  # not a submodule: its tensors are registered here by name
        object.__setattr__(self, "_compiled", torch.compile(model, backend=self.backend, dynamic=False))

    def collect(self, args: tuple, kwargs: dict) -> list[tuple[_Piece, tuple]]:
        """The pieces this module's compiled model runs on the example (``run_collecting``), for planning or for
        checking a given plan's fingerprint."""
        return run_collecting(self._model, self._compiled, self.backend, args, kwargs)

    def use(self, plan: Plan) -> None:
        """Run ``plan`` (made of pieces): its pieces' plans, by fingerprint, for the graphs that have them."""
        if plan.pieces is None:
            raise ValueError("PiecesModule runs a plan made of pieces (Plan.pieces); this plan has none")
        self._plan = plan
        self.backend.known = {r["fingerprint"]: Plan.from_dict(r["plan"]) for r in plan.pieces["graphs"]}

    @property
    def plan(self) -> Plan:
        """The plan it runs (made of pieces: ``Plan.pieces``)."""
        if self._plan is None:
            raise RuntimeError("this PiecesModule has no plan yet: parallelize gives it one (PiecesModule.use)")
        return self._plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def train_step(self, *inputs: Any, loss_fn: Callable[..., torch.Tensor], target: torch.Tensor | None = None,
                   reduction: str = "mean", **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch (``ParallelModule.train_step``'s contract)."""
        return forward_backward(self, inputs, kwargs, loss_fn, target, reduction)

    def split_weights(self) -> list[str]:
        """None: every piece's plan stores every weight whole (``soybean.run.optimizers``)."""
        return []

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The serial model's gradient norm (``soybean.run.grad_norm``): every parameter and its gradient (summed
        over the ranks by the pieces) is whole here, so it is torch's own over the model's parameters, the same on
        every rank."""
        q = norms.check_norm_type(norm_type)
        grads = [(n, p.grad) for n, p in self._model.named_parameters() if p.grad is not None]
        total = norms.share(grads, [1], lambda fqn: (), q)
        return norms.norm_of(total, q, grads[0][1].dtype if grads else torch.float32)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``ParallelModule.clip_grad_norm_`` (here torch's own would give the same)."""
        total = self.grad_norm(norm_type)
        norms.clip(self._model.parameters(), max_norm, total, error_if_nonfinite)
        return total

    # ---- state: whole on every rank ----
    def _state(self) -> Iterator[tuple[str, str]]:
        return ((("param" if n in dict(self.named_parameters()) else "buffer"), n) for n in self._shapes)

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor:
        return self.get_parameter(fqn) if kind == "param" else self.get_buffer(fqn)

    def _full_shape(self, fqn: str) -> tuple[int, ...]:
        return self._shapes[fqn]

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, by the model's own names (copies)."""
        return {n: t.detach().clone() for n, t in [*self._model.named_parameters(), *self._model.named_buffers()]}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` of the current values (copies; the model's own hooks name and lay them out)."""
        return {k: v.detach().clone() for k, v in self._model.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a serial model's ``state_dict()`` (through the model's own ``load_state_dict``)."""
        self._model.load_state_dict(sd)

    def save_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                     extra: Any = None, keep: int | None = None) -> Path:
        """``ParallelModule.save_sharded``: every tensor is whole, so the checkpoint loads under any plan."""
        from ..runtime.checkpoint import save

        return save(self, path, optimizer, extra, keep)

    def load_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Any:
        """``ParallelModule.load_sharded``: a checkpoint saved under any plan, mesh or world size."""
        from ..runtime.checkpoint import load

        return load(self, path, optimizer)
