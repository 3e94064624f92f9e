"""Pipeline stages of a captured graph: contiguous ranges of its layers, each its own ``Captured``.

A cut gives each layer (``graph.units.node_layer``, graph order) a stage, and stages are contiguous and
ordered: stage ``s`` holds layers ``bounds[s][0] .. bounds[s][1]``.  Every other node goes to the latest stage of
its inputs (a user input or a parameter is of stage 0), so what comes before the first layer (embeddings, masks,
rotary tables) is stage 0's, what comes after the last (the final norm, the head, a loss computed inside) the last
stage's, and a value is never needed before the stage that makes it.  Parameters and buffers are placeholders of
every stage that reads them: a weight two stages read (tied input and output embeddings) is a copy in each, its
gradient the sum of theirs (``shared_params``; ``pipelined`` sums them once per step).

Stage ``s``'s graph takes, after its parameters and buffers (the capture's order: state first, then inputs, as
``module.ParallelModule`` calls it), the *boundary* values it reads but an earlier stage made: for stage 0 the
model's own inputs, for a later one what stage ``s - 1`` returned.  It returns every value made at stage ``<= s``
that a later stage reads (passed through when it came in), in graph order; the last stage returns the model's
outputs.  Running the stages one after the other on those values is the captured graph (``run_stages``, the tests),
forward and backward: each node is copied once, into one stage, with its metadata.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map

from ..capture.core import Captured, structural_keys
from ..graph.units import node_layer
from ..precision import policy


class StageError(ValueError):
    """A cut that cannot make stages (too many stages for the layers, layers out of graph order)."""


@dataclass
class Stage:
    """One stage: its layers (indices into ``layers(cap)``, inclusive), its capture, and which of the whole
    graph's values it takes and returns (node names of the whole capture)."""

    first: int
    last: int
    cap: Captured
    takes: list[str]
    returns: list[str]


def layers(cap: Captured) -> list[str]:
    """The layers of ``cap`` in graph order: a block of a repeated stack (``node_layer``)."""
    out: dict[str, None] = {}
    for n in cap.graph.nodes:
        if n.op == "call_function" and (layer := node_layer(n)):
            out.setdefault(layer, None)
    return list(out)


def even_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous ranges of ``n_layers`` layers, as even as can be (the first ones one longer)."""
    if not 1 <= stages <= n_layers:
        raise StageError(f"{stages} pipeline stages need at least as many layers; the model has {n_layers}: "
                         f"use at most {n_layers} stages")
    q, r = divmod(n_layers, stages)
    out, a = [], 0
    for s in range(stages):
        b = a + q + (s < r)
        out.append((a, b - 1))
        a = b
    return out


def stage_of_nodes(cap: Captured, bounds: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Each node's stage (module docstring); placeholders are stage 0 (a parameter is copied to its readers)."""
    order = layers(cap)
    of_layer = {layer: s for s, (a, b) in enumerate(bounds) for layer in order[a:b + 1]}
    if len(of_layer) != len(order):
        raise StageError(f"the stages {list(bounds)} do not cover the model's {len(order)} layers once each")
    stage: dict[str, int] = {}
    for n in cap.graph.nodes:
        if n.op == "placeholder" or n.op == "get_attr":
            stage[n.name] = 0
            continue
        if n.op == "output":
            stage[n.name] = len(bounds) - 1
            continue
        after = max((stage[a.name] for a in n.all_input_nodes if a.op not in ("placeholder", "get_attr")),
                    default=0)
        layer = node_layer(n) if n.op == "call_function" else ""
        s = of_layer[layer] if layer in of_layer else after
        if s < after:
            raise StageError(f"{n.name} (layer {layer}) reads a value of stage {after} but is in stage {s}: "
                             "the layers are not in graph order")
        stage[n.name] = s
    return stage


def split(cap: Captured, bounds: Sequence[tuple[int, int]]) -> list[Stage]:
    """The stages of ``cap`` for ``bounds`` (each ``(first, last)`` layer index, contiguous, in order)."""
    stage = stage_of_nodes(cap, bounds)
    nodes = list(cap.graph.nodes)
    state = {n.name for n in nodes if n.op == "placeholder" and (n.name in cap.params or n.name in cap.buffers)}
    # The latest stage that reads each value (a placeholder of state is copied, never passed on).
    last_reader: dict[str, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name not in state:
                last_reader[a.name] = max(last_reader.get(a.name, -1), stage[n.name])
    value_nodes = [n for n in nodes if n.op not in ("output",) and n.name not in state]
    made = {n.name: stage[n.name] for n in value_nodes}
    out: list[Stage] = []
    carried: list[str] = []  # what the previous stage returned
    for s, (first, last) in enumerate(bounds):
        takes = [n.name for n in nodes if n.op == "placeholder" and n.name not in state] if s == 0 else carried
        returns = ([] if s == len(bounds) - 1 else
                   [n.name for n in value_nodes if made[n.name] <= s and last_reader.get(n.name, -1) > s])
        members = {n.name for n in nodes if n.op not in ("placeholder", "output") and stage[n.name] == s}
        final = s == len(bounds) - 1
        out.append(Stage(first, last, sub_capture(cap, f"stage {s}", members, takes, returns, final, s == 0), takes,
                         returns))
        carried = returns
    return out


def shared_params(cap: Captured, bounds: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
    """The trained parameters that ops of two or more stages of the cut ``bounds`` read (by FQN, in first-read
    order), and those stages, ascending: the serial gradient of such a weight is the sum of every reader's, so the
    copies stay equal only when each is stepped with that sum."""
    stage = stage_of_nodes(cap, bounds)
    readers: dict[str, set[int]] = {}
    for n in cap.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            fqn = cap.params.get(a.name)
            if fqn is not None and fqn not in cap.frozen:
                readers.setdefault(fqn, set()).add(stage[n.name])
    return {fqn: sorted(ss) for fqn, ss in readers.items() if len(ss) > 1}


def sub_capture(cap: Captured, tag: str, members: set[str], takes: Sequence[str], returns: Sequence[str],
                last: bool, first: bool = False) -> Captured:
    """The capture of a piece of ``cap`` (a pipeline stage, a placed region): the op nodes ``members``, copied
    once each in graph order with their metadata, after the state placeholders they read (the capture's order)
    and one placeholder per value of ``takes``.  It returns the model's outputs when ``last``, else the values
    ``returns``; ``first``: it takes the model's own inputs, so it keeps their structure (``in_spec``)."""
    nodes = list(cap.graph.nodes)
    state = {n.name for n in nodes if n.op == "placeholder" and (n.name in cap.params or n.name in cap.buffers)}
    out_node = next(n for n in nodes if n.op == "output")
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    used_state = {a.name for n in nodes if n.name in members for a in n.all_input_nodes if a.name in state}
    for n in nodes:  # state placeholders first, in the capture's order
        if n.op == "placeholder" and n.name in used_state:
            env[n.name] = g.node_copy(n)
    by_name = {n.name: n for n in nodes}
    for name in takes:
        src = by_name[name]
        p = g.placeholder(name)
        p.meta = dict(src.meta)
        env[name] = p
    for n in nodes:
        if n.name in members and n.op not in ("placeholder", "output"):
            env[n.name] = g.node_copy(n, lambda a: env[a.name])
    if last:
        g.output(fx.map_arg(out_node.args[0], lambda a: env[a.name]))
    else:
        g.output(tuple(env[r] for r in returns))
    gm = fx.GraphModule(cap.graph_module, g)
    params = {k: v for k, v in cap.params.items() if k in used_state}
    buffers = {k: v for k, v in cap.buffers.items() if k in used_state}
    keys = structural_keys(gm, {**params, **buffers})
    return replace(
        cap, graph_module=gm, params=params, buffers=buffers, inputs=list(takes),
        constants={k: v for k, v in cap.constants.items() if k in buffers.values()},
        aliases={k: v for k, v in cap.aliases.items() if v in params.values()},
        fingerprint=hashlib.sha256(f"{cap.fingerprint} {tag} {list(takes)} {list(returns)}".encode()).hexdigest()[:16],
        out_spec=cap.out_spec if last else None, in_spec=cap.in_spec if first else None,
        arg_names=cap.arg_names if first else (), keys=keys,
        # A later piece's inputs are activations: a floating one sends its gradient back, whole (``graph.build``).
        grad_inputs=cap.grad_inputs if first else frozenset(
            t for t in takes if isinstance(v := by_name[t].meta.get("val"), torch.Tensor) and v.is_floating_point()))


def run_stages(cap: Captured, stages: Sequence[Stage], state: dict[str, torch.Tensor], inputs: Sequence[Any]) -> Any:
    """The stages run one after the other (the serial meaning of a pipelined plan): ``state`` by FQN, ``inputs``
    the capture's flat user inputs."""
    values: tuple[Any, ...] = tuple(inputs)
    for st in stages:
        c = st.cap
        args = c.feed(state)
        got = c.graph_module(*args, *values)
        values = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    return values


def boundary_examples(stages: Sequence[Stage], cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                      ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's inputs and outputs as meta tensors (shape, dtype, and whether autograd tracks them: what a
    pipeline schedule sends and receives), found by running the stages one after the other on the meta device
    with the trained parameters tracked; ``cast``: the precision policy's cast of parameters and inputs, as the
    stage's program applies it.  The last stage's outputs are the leaves of the model's output."""
    try:
        return _run_on_meta(stages, cast)
    except (NotImplementedError, RuntimeError):  # an op that reads data (MoE routing): the captures' own shapes
        return _from_captures(stages, cast)


def _from_captures(stages: Sequence[Stage], cast: Callable[[torch.Tensor], torch.Tensor]
                   ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """``boundary_examples`` from each stage's capture (its values' shapes and dtypes, as capture priced them), where
    the stages cannot run on the meta device; a floating value past the first stage's inputs carries a gradient
    (``value_facts``' reading).  Without them torch would infer the metadata by running each stage on uninitialised
    tensors, and a stage that reads a received integer tensor (the labels of a loss inside the model) fails on it."""
    out = []
    for k, st in enumerate(stages):
        c = st.cap
        ins = tuple(cast(_meta_like(n.meta["val"])).requires_grad_(k > 0 and n.meta["val"].is_floating_point())
                    if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
                    for n in c.graph.nodes if n.op == "placeholder" and n.name not in c.params
                    and n.name not in c.buffers)
        result = next(n for n in c.graph.nodes if n.op == "output").args[0]
        outs = tuple(cast(_meta_like(v)).requires_grad_(v.is_floating_point())
                     for a in tree_leaves(result) if isinstance(a, fx.Node)
                     and isinstance(v := a.meta.get("val"), torch.Tensor))
        out.append((ins, outs))
    return out


def _run_on_meta(stages: Sequence[Stage], cast: Callable[[torch.Tensor], torch.Tensor]
                 ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    out = []
    values: tuple[Any, ...] = ()
    for k, st in enumerate(stages):
        c = st.cap
        holders = [n for n in c.graph.nodes if n.op == "placeholder"]
        if k == 0:  # the model's own inputs (fx may have renamed their placeholders: taken in order)
            values = tuple(_meta_like(n.meta["val"]) for n in holders
                           if n.name not in c.params and n.name not in c.buffers)
        args = []
        for n in holders:
            if n.name in c.params or n.name in c.buffers:
                t = _meta_like(n.meta["val"])
                trains = n.name in c.params and c.params[n.name] not in c.frozen and t.is_floating_point()
                args.append(cast(t.requires_grad_(trains)))
        got = _OnMeta(c.graph_module).run(*args, *(cast(v) if isinstance(v, torch.Tensor) else v for v in values))
        got = tuple(x for x in tree_leaves(got) if isinstance(x, torch.Tensor))
        out.append((values, got))
        values = tuple(v.detach().requires_grad_(v.requires_grad) for v in got)
    return out


class _OnMeta(fx.Interpreter):
    """A graph run on the meta device: an op that makes a tensor on another device (``arange(..., device=cpu)``
    for rotary positions) makes it there instead, and a constant tensor is taken as a meta tensor alike.
    ``facts``: each value's bytes and whether autograd tracks it (``value_facts``)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.facts: dict[str, tuple[int, bool]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.facts[n.name] = (out.numel() * out.element_size(), out.requires_grad)
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        def meta(a: Any) -> Any:
            if isinstance(a, torch.device):  # ``aten.to.device(x, cpu, ...)``: the device as an argument
                return torch.device("meta")
            return a.to("meta") if isinstance(a, torch.Tensor) and a.device.type != "meta" else a

        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return super().call_function(target, tuple(tree_map(meta, list(args))), tree_map(meta, kwargs))

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        got = super().get_attr(target, args, kwargs)
        return got.to("meta") if isinstance(got, torch.Tensor) else got


def _meta_like(v: Any) -> Any:
    """A meta tensor of ``v``'s shape and dtype (a non-tensor value as it is)."""
    return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v


def value_facts(cap: Captured) -> dict[str, tuple[int, bool]]:
    """Every tensor value of ``cap``: its bytes as the program makes it (the precision policy's cast of parameters
    and inputs) and whether autograd tracks it (it derives from a trained parameter, so a stage boundary sends its
    gradient back), from one run of the graph on the meta device; where an op cannot run there (it reads data, as
    mixture-of-experts routing does), the capture's own shapes, with a gradient for every floating value.  Kept per
    capture (structure and shapes, precision, frozen parameters): the pipeline's search, its record and its
    baselines read the same facts."""
    key = (cap.fingerprint, cap.precision, cap.frozen)
    if key not in _FACTS:
        if len(_FACTS) >= 8:  # a search meets a few microbatch sizes; older ones are not met again
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[key] = _value_facts(cap, policy(cap.precision).cast)
    return _FACTS[key]


_FACTS: dict[tuple, dict[str, tuple[int, bool]]] = {}


def _value_facts(cap: Captured, cast: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, tuple[int, bool]]:
    facts: dict[str, tuple[int, bool]] = {}
    holders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    args = []
    for n in holders:
        t = _meta_like(n.meta["val"])
        if isinstance(t, torch.Tensor):
            trains = n.name in cap.params and cap.params[n.name] not in cap.frozen and t.is_floating_point()
            t = cast(t.requires_grad_(trains))
        args.append(t)

    try:
        run = _OnMeta(cap.graph_module)
        run.run(*args)
        facts = run.facts
    except (NotImplementedError, RuntimeError):  # an op that reads data (MoE routing's counts): the capture's shapes,
        facts = {}                                # and a gradient for every floating value
        for n in cap.graph.nodes:
            if isinstance(v := n.meta.get("val"), torch.Tensor):
                facts[n.name] = (v.numel() * (cast(_meta_like(v)).element_size()), v.is_floating_point())
    return facts
