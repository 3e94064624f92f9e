"""What a sharding rule is, and how one-axis rules become N-D strategies.

A rule looks at one op (its target, its arguments with tensors replaced by
``TensorSpec``) and lists the legal *one-axis* strategies: a placement for every
tensor input and every tensor output, such that running the serial op on every
device's local tiles yields tiles of the serial output.  Rules never list the
all-``R`` strategy (redundant compute): it is always legal and added here.

On an N-D mesh a strategy is one one-axis strategy per axis (the product), kept
when every tiling is valid for its shape and every dim the rule marks ``even``
divides by its total split factor.  Each rule is validated against the serial op
by ``soybean.verify.validate``.
"""
from __future__ import annotations

import contextvars
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..mesh import Mesh
from ..tiling import Partial, Placement, R, Replicate, Shard, chunk_lengths, is_valid, split_factor


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as rules and the cost model see it.  ``dynamic``: the dims whose size depends on values (an
    unbacked ``SymInt`` at capture: ``nonzero``, a boolean mask, ``split`` by ``tolist()`` sizes); ``shape`` holds
    their priced sizes (``priced``).  ``expand`` never splits them: their run-time size is another step's, another
    batch's, and tiles of the priced size would be wrong."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dynamic: tuple[int, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpSpec:
    """One op as a rule sees it.

    ``args``/``kwargs`` are the fx arguments with every tensor replaced by its
    ``TensorSpec``; ``inputs`` lists those specs in ``torch.utils._pytree`` flatten
    order of ``(args, kwargs)``; ``outputs`` the op's tensor outputs, flattened.
    """

    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def name(self) -> str:
        return op_name(self.target)

    def __reduce__(self) -> tuple:
        # A torch op does not pickle; its qualified name does, and names the same op in any process that has it
        # registered (a planner worker sends its tables to the main process: ``mesh_pool``).
        t = self.target
        named = isinstance(t, torch._ops.OpOverload)
        return (_opspec, (str(t) if named else t, named, self.args, self.kwargs, self.inputs, self.outputs))


def _opspec(target: Any, named: bool, args: tuple, kwargs: dict, inputs: tuple, outputs: tuple) -> OpSpec:
    """``OpSpec.__reduce__``'s inverse: a named torch op (``aten.mm.default``) looked up in ``torch.ops``."""
    if named:
        ns, op, overload = target.split(".")
        target = getattr(getattr(getattr(torch.ops, ns), op), overload)
    return OpSpec(target, args, kwargs, inputs, outputs)


@dataclass(frozen=True)
class Strategy1D:
    """Placements on one mesh axis for every tensor input and output.

    ``even`` lists ``(i, dim)`` pairs that must split evenly; ``i`` indexes
    ``inputs + outputs`` (inputs first).  View-like rules need it: a chunked
    dimension is only a chunk of the merged dimension when every chunk is full.
    ``(i, dim, unit)`` asks more: the dim splits into whole units of ``unit``
    elements (``repeat``: every device's chunk is whole copies of the input).

    ``variant`` names a second way to run the same placements (``""``: the plain one), priced and run differently
    by the op's rule (causal attention's ``"zigzag"`` rows).  It owns the dims it shards: an N-D strategy carries
    at most one variant, from one axis, and no other axis shards those dims of those tensors (``expand``).
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    even: frozenset = frozenset()
    variant: str = ""

    @property
    def redundant(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.inputs + self.outputs)


@dataclass(frozen=True)
class Strategy:
    """An N-D strategy: per tensor input and output, a tiling (one placement per mesh axis); ``variant``: that of
    the one-axis strategy it was made with, if any (``Strategy1D``), recorded in the plan."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    variant: str = ""

    def divides_work(self) -> tuple[bool, ...]:
        """Per mesh axis: is the op's work cut (some tensor sharded there)?  A strategy that is only
        ``P``/``R`` on an axis computes full-size products on every device of that axis."""
        n = len(self.outputs[0]) if self.outputs else (len(self.inputs[0]) if self.inputs else 0)
        return tuple(any(isinstance(t[a], Shard) for t in self.inputs + self.outputs) for a in range(n))

    def split_axes(self) -> tuple[bool, ...]:
        """Per mesh axis: is any output non-replicated there?  Then each device computes a part of the
        outputs (a shard, or a summand of ``P``), so a replicated input's gradient is a per-device partial
        sum (Megatron's ``f``).  Where every output is replicated, every device computes all of it from the
        whole replicated inputs (an input split there is one whose values the op ignores, such as
        ``type_as``'s ``other``): each device's gradient is then the whole gradient, and summing it would
        count it once per device.  An op without outputs counts its inputs."""
        n = len(self.outputs[0]) if self.outputs else (len(self.inputs[0]) if self.inputs else 0)
        tensors = self.outputs or self.inputs
        return tuple(any(not isinstance(t[a], Replicate) for t in tensors) for a in range(n))


@dataclass(frozen=True)
class OpCost:
    """What the cost model (``cost.compute``) knows of an op beyond its shapes, declared with its rule.

    * ``view``: the op only re-describes memory (a view or an alias): no arithmetic, no traffic,
      no allocation.
    * ``flops``: forward FLOPs from the op's shapes; ``None``: one per output element.
    * ``operands``: a product's two operands (indices into ``op.inputs``): its backward is one
      product per operand that needs a gradient, so training is 1x to 3x the forward.
    * ``backward``: any other op's backward, in forward-equivalents, when some input needs a
      gradient (an elementwise op's one pass; FlashAttention's backward is about 2.5x its forward).
    * ``conv``: priced at the profile's convolution rate (``Profile.conv_flops``) where it has one.
    * ``skew``: ``skew(op, strategy, mesh, profile)``, the busiest rank's work over an even share of it, where the
      split is uneven in work (routed experts split by expert: ``Profile.expert_imbalance``; causal attention split
      by query rows: the last rows attend to the most keys); ``None``: even.
    """

    view: bool = False
    flops: Callable[[OpSpec], float] | None = None
    skew: Callable[[OpSpec, Strategy, Any, Any], float] | None = None
    operands: tuple[int, int] | None = None
    backward: float = 1.0
    conv: bool = False


ELEMENTWISE = OpCost()       # one FLOP per output element, backward one pass
VIEW = OpCost(view=True)     # free


RuleFn = Callable[[OpSpec], list[Strategy1D]]
# windows(op) -> the op's spatial ``rules.window.Window``s: the dims its rule may split with a halo.
WindowsFn = Callable[[OpSpec], list[Any]]
# window_args(op, args, kwargs, [(window, local input rows), ...]) -> (args, kwargs): the op's call on a
# window of rows along each of those dims (their padding 0, sizes local).
WindowArgsFn = Callable[[OpSpec, tuple, dict, Sequence[tuple[Any, int]]], tuple]
# sync_args(op, strategy) -> {} when the op's tiles run it alone, else the keyword arguments (``axes``: the
# mesh axes its statistics are summed over, ...) with which the program calls the rule's ``sync_call``.
SyncArgsFn = Callable[[OpSpec, "Strategy"], dict[str, Any]]
class OpCall(NamedTuple):
    """One collective an op runs inside itself: its kind, mesh axis, message bytes (as ``cost.collectives`` prices
    that kind) and messages; ``behind``: how much of the op's own compute runs while it is in flight, in multiples
    of the op's forward (``cost.compute.op_seconds`` without gradients), which hides that much of its time (ring
    attention's pass of the next block during this one's compute; 0: it blocks)."""

    kind: str
    axis: int
    bytes: float
    messages: int
    behind: float = 0.0


# comm(op, strategy, grads, mesh, imbalance) -> [OpCall, ...]: the calls the communication inside the op makes in one
# training step, in program order (``cost.collectives.op_comm_calls``); ``imbalance``: the busiest rank's routed
# rows over the balanced share (``Profile.expert_imbalance``).
CommFn = Callable[[OpSpec, "Strategy", list[bool], Any, float], list[OpCall]]
# The names of the arguments an op writes in place although its schema does not mark them (``Tensor(a!)``).
WritesFn = Callable[[OpSpec], tuple[str, ...]]
# localize(op, args, kwargs, local_input_shapes, local_output_shapes) -> (args, kwargs):
# rewrites shape-carrying arguments (view sizes, expand sizes, ...) for one device's tiles.
LocalizeFn = Callable[[OpSpec, tuple, dict, Sequence[tuple[int, ...]], Sequence[tuple[int, ...]]], tuple]


@dataclass
class RuleEntry:
    fn: RuleFn
    localize: LocalizeFn | None = None
    # ``linear_in`` ops may take Partial inputs (their rule lists them); kept for docs.
    family: str = ""
    cost: OpCost | None = None  # every registered op declares one (tests/test_rules.py checks)
    windows: WindowsFn | None = None        # spatial dims split with a halo (``rules.window``)
    window_args: WindowArgsFn | None = None
    sync_args: SyncArgsFn | None = None     # ops whose statistics are summed across tiles (batch norm)
    sync_call: str | None = None            # the synchronised call's name, a key of ``runtime.synced.SYNC_CALLS``
    writes: WritesFn | None = None          # hidden in-place writes (``graph.writes.written_inputs``)
    comm: CommFn | None = None              # collectives inside the op beyond statistics and halos (routed experts)


REGISTRY: dict[str, RuleEntry] = {}
# May windowed dims be split?  Set for a ``with`` block by ``rules.window.spatial_splits`` (a context variable: one
# thread's or task's block changes no other's, and it ends with the block).
SPATIAL_SPLITS: contextvars.ContextVar[bool] = contextvars.ContextVar("soybean_spatial_splits", default=True)


def op_name(target: Any) -> str:
    """``torch.ops.aten.linear.default`` -> ``"aten.linear.default"``; ``operator.getitem`` -> ``"getitem"``."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):  # public alias of OpOverload has no other name
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def register(*names: str, cost: OpCost | None = None, localize: LocalizeFn | None = None,
             family: str = "", windows: WindowsFn | None = None, window_args: WindowArgsFn | None = None,
             sync_args: SyncArgsFn | None = None, sync_call: str | None = None, writes: WritesFn | None = None,
             comm: CommFn | None = None) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule of every op in ``names`` (``"aten.mm.default"`` form), with the
    ops' cost facts ``cost``; for windowed ops their spatial windows (``rules.window``); for ops that sum
    statistics across tiles, the axes that need it and the name of the runtime call that does it; for ops that
    update arguments in place that their schema does not mark, ``writes`` names them; ``comm`` lists the collectives
    an op runs inside itself (``CommFn``)."""

    def deco(fn: RuleFn) -> RuleFn:
        for n in names:
            if n in REGISTRY:
                raise ValueError(f"two rules for {n}")
            REGISTRY[n] = RuleEntry(fn, localize, family, cost, windows, window_args, sync_args, sync_call, writes,
                                    comm)
        return fn

    return deco


def lookup(target: Any) -> RuleEntry | None:
    return REGISTRY.get(op_name(target))


def data_dependent(d: Any) -> bool:
    """Whether a size (an ``int`` or a ``SymInt`` of a capture) depends on values: an unbacked symbol that no guard
    specialised."""
    return isinstance(d, torch.SymInt) and not is_concrete_int(d)


def priced(d: Any) -> int:
    """The one size planning uses for a dim or a scalar: ``d`` itself when static; a data-dependent one at the
    example run's own value, which ``rules.datadep.record_sizes`` gives every unbacked symbol at capture as its
    optimisation hint (its upper bound, ``ShapeEnv.var_to_range``, when the example could not run).  Never
    ``int()`` of an unbacked ``SymInt``: that raises ``GuardOnDataDependentSymNode``."""
    if not data_dependent(d):
        return int(d)
    return symbol_hint(d.node.expr, d.node.shape_env)


UNBOUNDED_HINT = 1 << 62  # a symbol without a recorded value: clamped to its bounds (``record_sizes`` records all)


def recorded_hints(env: Any) -> dict[Any, int]:
    """The values ``rules.datadep.record_sizes`` gives the unbacked symbols of shape environment ``env``: torch's
    own ``ShapeEnv.var_to_hint_override`` (torch 2.12 on), or a dict of that name kept on ``env`` for an older
    torch, which ``symbol_hint`` reads the same way."""
    hints = getattr(env, "var_to_hint_override", None)
    if hints is None:  # torch < 2.12: no optimisation hints of its own
        hints = {}
        env.var_to_hint_override = hints
    return hints


def symbol_hint(expr: Any, env: Any) -> int:
    """The priced value of a size expression of ``env``: torch's optimisation hint where it has one (never
    guards); on an older torch, ``expr`` with its backed symbols at their values and unbacked ones at their
    ``recorded_hints``; ``UNBOUNDED_HINT`` where a symbol has neither."""
    if hasattr(env, "optimization_hint"):
        return int(env.optimization_hint(expr, fallback=UNBOUNDED_HINT))
    value = expr.xreplace({**env.var_to_val, **recorded_hints(env)})
    return int(value) if value.is_number else UNBOUNDED_HINT


def priced_shape(shape: Sequence[Any]) -> tuple[int, ...]:
    """``priced`` of every dim of ``shape``."""
    return tuple(priced(d) for d in shape)


# The attribute a captured value (``meta["val"]``) carries when capture made its sizes concrete
# (``rules.datadep.concretize``): the dims whose size depends on values.
DYNAMIC = "_soybean_dynamic"


def tensor_dynamic(t: torch.Tensor) -> tuple[int, ...]:
    """The data-dependent dims of a captured value: marked at capture (``DYNAMIC``), or still symbolic."""
    marked = getattr(t, DYNAMIC, None)
    return tuple(marked) if marked is not None else dynamic_dims(t.shape)


def dynamic_dims(shape: Sequence[Any]) -> tuple[int, ...]:
    """The dims of ``shape`` whose size depends on values (``data_dependent``)."""
    return tuple(i for i, d in enumerate(shape) if data_dependent(d))


def spec_of(x: Any) -> Any:
    """A ``TensorSpec`` for a tensor (real or fake) or an fx node carrying ``meta['val']`` (data-dependent sizes
    ``priced``, their dims in ``dynamic``)."""
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else x
    if isinstance(v, torch.Tensor):
        return TensorSpec(priced_shape(v.shape), v.dtype, tensor_dynamic(v))
    return None


def make_opspec(target: Any, args: tuple, kwargs: dict, output: Any) -> OpSpec:
    """Build an ``OpSpec``; tensors (or tensor-valued fx nodes) become ``TensorSpec``s, a node computing a number
    (a data-dependent size, ``rules.datadep``) its priced value (another node, its name): specs are data, pickled
    to planner workers (``mesh_pool``)."""
    from torch.utils._pytree import tree_flatten, tree_map

    def conv(x: Any) -> Any:
        s = spec_of(x)
        if s is not None:
            return s
        if isinstance(x, torch.fx.Node):  # a number the graph computes (``item``, a size): as priced at capture
            v = x.meta.get("val")
            return v if isinstance(v, (int, float, bool)) else x.name
        return x

    a, k = tree_map(conv, (tuple(args), dict(kwargs)))
    leaves, _ = tree_flatten((a, k))
    ins = tuple(x for x in leaves if isinstance(x, TensorSpec))
    out_leaves, _ = tree_flatten(output)
    outs = tuple(s for s in (spec_of(o) for o in out_leaves) if s is not None)
    return OpSpec(target, a, k, ins, outs)


# ``node.meta`` keys of what ``node_spec``, ``tensor_args`` and ``tensor_outputs`` work out once per node: kept by the
# node itself, so they go with its graph.  Each entry holds the objects it was made from (fx replaces a node's args
# tuple and kwargs dict on every edit, and a copied node's meta names another node's), and is used only while the
# node's own are those same objects.
_SPEC, _ARGS, _OUTPUTS = "soybean_spec", "soybean_tensor_args", "soybean_tensor_outputs"


def node_spec(node: torch.fx.Node) -> OpSpec:
    """``make_opspec`` of a captured op node, made once per node (kept in its ``meta``): a captured graph does not
    change after capture, and every table of a planner run (each mesh shape, each recomputation choice) reads the
    same specs (flattening the arguments was a fifth of building a Llama-3-8B table at 1,024 devices)."""
    val = node.meta.get("val")
    hit = node.meta.get(_SPEC)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs and hit[2] is val:
        return hit[3]
    spec = make_opspec(node.target, node.args, node.kwargs, val)
    node.meta[_SPEC] = (node.args, node.kwargs, val, spec)
    return spec


def tensor_args(node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
    """``node``'s tensor-valued arguments (fx nodes whose ``meta['val']`` is a tensor) in ``torch.utils._pytree``
    flatten order of ``(args, kwargs)``: the order of ``OpSpec.inputs``.  Every table of a planner run walks every
    node's arguments several times (flattening them was a sixth of building a Llama-3-8B table at 1,024 devices),
    so it is kept per node (in its ``meta``) while the node's arguments are the same objects."""
    hit = node.meta.get(_ARGS)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs:
        return hit[2]
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten((node.args, node.kwargs))
    out = tuple(a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor))
    node.meta[_ARGS] = (node.args, node.kwargs, out)
    return out


def tensor_outputs(node: torch.fx.Node) -> tuple[torch.Tensor, ...]:
    """The tensors of ``node``'s traced value (``meta['val']``) in flatten order, kept per node (in its ``meta``)
    while that value is the same object."""
    val = node.meta.get("val")
    hit = node.meta.get(_OUTPUTS)
    if hit is not None and hit[0] is val:
        return hit[1]
    from torch.utils._pytree import tree_flatten

    out = tuple(t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))
    node.meta[_OUTPUTS] = (val, out)
    return out


def replicate_1d(op: OpSpec) -> Strategy1D:
    return Strategy1D(tuple(R for _ in op.inputs), tuple(R for _ in op.outputs))


def strategies_1d(op: OpSpec) -> list[Strategy1D]:
    """The rule's one-axis strategies plus all-R, de-duplicated, in a fixed order."""
    entry = lookup(op.target)
    found = list(entry.fn(op)) if entry else []
    out: list[Strategy1D] = [replicate_1d(op)]
    seen = {(out[0].inputs, out[0].outputs, "")}
    for s in found:
        if len(s.inputs) != len(op.inputs) or len(s.outputs) != len(op.outputs):
            raise ValueError(f"rule for {op.name} returned a strategy of the wrong arity: {s}")
        key = (s.inputs, s.outputs, s.variant)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


@functools.lru_cache(maxsize=65536)
def has_empty_tile(tiling: tuple[Placement, ...], shape: tuple[int, ...], mesh: Mesh) -> bool:
    """Some device gets an empty tile of a non-empty dim (``n >= p`` does not prevent it: 4 over 3 is 2, 2, 0).

    Many kernels reject empty operands (a conv with 0 input channels, batch norm
    with 0 channels), so such tilings are not offered.
    """
    for d, n in enumerate(shape):
        lengths = {n}
        for axis, pl in enumerate(tiling):
            if pl == Shard(d):
                p = mesh.shape[axis]
                lengths = {x for m in lengths for x in chunk_lengths(m, p)}
        if n > 0 and 0 in lengths:
            return True
    return False


def splits_dynamic(tiling: Sequence[Placement], spec: TensorSpec) -> bool:
    """Whether ``tiling`` splits a dim of ``spec`` whose size depends on values (``TensorSpec.dynamic``): never legal.
    Its run-time size differs from the priced one, so tiles and collectives sized from the plan would be wrong, and
    chunks of a run-time size differ between ranks (gloo's list ``all_gather`` rejects unequal sizes)."""
    return bool(spec.dynamic) and any(isinstance(p, Shard) and p.dim in spec.dynamic for p in tiling)


def expand(op: OpSpec, mesh: Mesh, one_axis: list[Strategy1D] | None = None) -> list[Strategy]:
    """N-D strategies: the product of one-axis strategies, filtered for legality (valid tilings, no
    empty tile, no split of a data-dependent dim: ``splits_dynamic``).  A windowed dim
    (``rules.window``) is split by one mesh axis at most, on its input and on the output.

    Legality of a tensor's tiling is looked up per tensor: each tensor's few distinct placements give at most
    ``(ndim + 2) ** axes`` tilings, each checked once, and every combination's tilings are found by arithmetic
    on their indices (numpy), in ``itertools.product``'s order."""
    one_axis = one_axis if one_axis is not None else strategies_1d(op)
    specs = op.inputs + op.outputs
    nin, n = len(op.inputs), mesh.ndim
    entry = lookup(op.target)
    windowed = [(i, w.dim) for w in (entry.windows(op) if entry and entry.windows else [])
                for i in (w.slot, len(op.inputs))]
    combos = np.indices((len(one_axis),) * n).reshape(n, -1).T  # row k: the k-th combination of itertools.product
    ok = np.ones(len(combos), dtype=bool)
    for i, spec in enumerate(specs):
        placed = [s.inputs[i] if i < nin else s.outputs[i - nin] for s in one_axis]
        distinct = list(dict.fromkeys(placed))
        code = np.array([distinct.index(p) for p in placed])
        shape = tuple(spec.shape)
        legal = np.array([is_valid(t, shape, mesh) and not has_empty_tile(t, shape, mesh)
                          and not splits_dynamic(t, spec) for t in itertools.product(distinct, repeat=n)])
        ok &= legal[(code[combos] * len(distinct) ** np.arange(n - 1, -1, -1)).sum(axis=1)]
    out: list[Strategy] = []
    for row in combos[ok].tolist():
        combo = [one_axis[j] for j in row]
        tilings = [
            tuple(s.inputs[i] if i < nin else s.outputs[i - nin] for s in combo)
            for i in range(len(specs))
        ]
        good = True
        if windowed:
            most = 1 if SPATIAL_SPLITS.get() else 0  # ``window.spatial_splits(False)``: none at all
            good = all(sum(1 for pl in tilings[i] if pl == Shard(d)) <= most for i, d in windowed)
        if good:
            for s in combo:
                for i, d, *unit in s.even:
                    f = split_factor(tilings[i], mesh, d)
                    m, u = specs[i].shape[d], (unit[0] if unit else 1)
                    if m % u or (m // u) % f:
                        good = False
        variant = _variant(combo, nin) if good else None
        if variant is not None:
            out.append(Strategy(tuple(tilings[:nin]), tuple(tilings[nin:]), variant))
    return out


def _variant(combo: Sequence[Strategy1D], nin: int) -> str | None:
    """The variant of the N-D strategy made of ``combo`` (one per axis): ``""`` when none carries one, that one's
    when one axis does and no other axis shards the dims it shards; ``None`` (no such strategy) otherwise."""
    marked = [a for a, s in enumerate(combo) if s.variant]
    if not marked:
        return ""
    if len(marked) > 1:
        return None
    v = combo[marked[0]]
    for i, pl in enumerate(v.inputs + v.outputs):
        if isinstance(pl, Shard) and any(
                (s.inputs + s.outputs)[i] == pl for a, s in enumerate(combo) if a != marked[0]):
            return None
    return v.variant


# ---- small helpers shared by rule files ------------------------------------------------


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def shards_except(ndim: int, exclude: Sequence[int] = ()) -> list[Shard]:
    ex = {norm_dim(d, ndim) for d in exclude}
    return [Shard(d) for d in range(ndim) if d not in ex]


def is_float(spec: TensorSpec) -> bool:
    return spec.dtype.is_floating_point or spec.dtype.is_complex


__all__ = [
    "TensorSpec", "OpSpec", "Strategy1D", "Strategy", "REGISTRY", "register", "lookup", "OpCost", "ELEMENTWISE", "VIEW",
    "strategies_1d", "expand", "make_opspec", "spec_of", "op_name", "priced", "priced_shape",
    "dynamic_dims", "data_dependent", "splits_dynamic", "tensor_dynamic", "DYNAMIC", "norm_dim", "shards_except",
    "is_float",
    "Partial", "Replicate", "Shard", "R",
]
