"""Pipeline stages of a captured graph: contiguous ranges of its layers, each its own ``Captured``.

A cut gives each layer (``graph.units.node_layer``, graph order) a stage, and stages are contiguous and
ordered: stage ``s`` holds layers ``bounds[s][0] .. bounds[s][1]``.  Every other node goes to the latest stage of
its inputs (a user input or a parameter is of stage 0), so what comes before the first layer (embeddings, masks,
rotary tables) is stage 0's, what comes after the last (the final norm, the head, a loss computed inside) the last
stage's, and a value is never needed before the stage that makes it.  A stage is a ``part.Part`` (its capture, what
it takes and returns, the parameters it reads: a weight two stages read, tied input and output embeddings, is a copy
in each, its gradient the sum of theirs, ``part.shared_params``) cut by ``part.split`` with ``relay``: the schedule
hands each stage only what the one before returned.

Stage ``s``'s graph takes, after its parameters and buffers (the capture's order: state first, then inputs, as
``module.ParallelModule`` calls it), the *boundary* values it reads but an earlier stage made: for stage 0 the
model's own inputs, for a later one what stage ``s - 1`` returned.  It returns every value made at stage ``<= s``
that a later stage reads (passed through when it came in), in graph order; the last stage returns the model's
outputs.  Running the stages one after the other on those values is the captured graph (``part.run_parts``, the
tests), forward and backward: each node is copied once, into one stage, with its metadata.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from ..capture.core import Captured
from ..graph.units import node_layer
from .part import OnMeta, Part, as_kind, meta_like, split as split_parts


class StageError(ValueError):
    """A cut that cannot make stages (too many stages for the layers, layers out of graph order)."""


@dataclass
class Stage(Part):
    """One stage: a ``Part`` (its op nodes, capture, and which of the whole graph's values it takes and returns)
    and its place in the layer chain, the layers it holds (indices into ``layers(cap)``, ``first .. last``)."""

    first: int
    last: int


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


def pieces(cap: Captured, bounds: Sequence[tuple[int, int]]) -> list[list[str]]:
    """Each stage's op nodes for the cut ``bounds`` (``stage_of_nodes``), in graph order: ``part.split``'s
    assignment."""
    stage = stage_of_nodes(cap, bounds)
    out: list[list[str]] = [[] for _ in bounds]
    for n in cap.graph.nodes:
        if n.op not in ("placeholder", "output"):
            out[stage[n.name]].append(n.name)
    return out


def split(cap: Captured, bounds: Sequence[tuple[int, int]]) -> list[Stage]:
    """The stages of ``cap`` for ``bounds`` (each ``(first, last)`` layer index, contiguous, in order)."""
    cut = split_parts(cap, pieces(cap, bounds), "stage", relay=True)
    return [as_kind(p, Stage, first=a, last=b) for p, (a, b) in zip(cut, bounds)]


def boundary_examples(stages: Sequence[Part], cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                      ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's inputs and outputs as meta tensors (shape, dtype, and whether autograd tracks them: what a
    pipeline schedule sends and receives), found by running the stages one after the other on the meta device
    with the trained parameters tracked; ``cast``: the precision policy's cast of parameters and inputs, as the
    stage's program applies it.  The last stage's outputs are the leaves of the model's output."""
    try:
        got = _run_on_meta(stages, cast)
    except (NotImplementedError, RuntimeError):  # an op that reads data (MoE routing): the captures' own shapes
        got = _from_captures(stages, cast)
    last = len(got) - 1
    return [(tuple(_dense(t) for t in ins), outs if k == last else tuple(_dense(t) for t in outs))
            for k, (ins, outs) in enumerate(got)]


def _dense(t: Any) -> Any:
    """``t``'s metadata laid out contiguously: what a stage sends and receives.  torch's schedule receives into a
    buffer with the example's strides, and gloo (like NCCL) sends and receives contiguous tensors only; a value a
    stage returns strided (Ministral's sliding-window mask, made by ``expand``: stride 0 along the batch) is sent as
    a contiguous copy (``run.pipelined._StageModule``)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def _from_captures(stages: Sequence[Part], cast: Callable[[torch.Tensor], torch.Tensor]
                   ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """``boundary_examples`` from each stage's capture (its values' shapes and dtypes, as capture priced them), where
    the stages cannot run on the meta device; a floating value past the first stage's inputs carries a gradient
    (``value_facts``' reading).  Without them torch would infer the metadata by running each stage on uninitialised
    tensors, and a stage that reads a received integer tensor (the labels of a loss inside the model) fails on it."""
    out = []
    for k, st in enumerate(stages):
        c = st.cap
        ins = tuple(cast(meta_like(n.meta["val"])).requires_grad_(k > 0 and n.meta["val"].is_floating_point())
                    if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
                    for n in c.graph.nodes if n.op == "placeholder" and n.name not in c.params
                    and n.name not in c.buffers)
        result = next(n for n in c.graph.nodes if n.op == "output").args[0]
        outs = tuple(cast(meta_like(v)).requires_grad_(v.is_floating_point())
                     for a in tree_leaves(result) if isinstance(a, fx.Node)
                     and isinstance(v := a.meta.get("val"), torch.Tensor))
        out.append((ins, outs))
    return out


def _run_on_meta(stages: Sequence[Part], cast: Callable[[torch.Tensor], torch.Tensor]
                 ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    out = []
    values: tuple[Any, ...] = ()
    for k, st in enumerate(stages):
        c = st.cap
        holders = [n for n in c.graph.nodes if n.op == "placeholder"]
        if k == 0:  # the model's own inputs (fx may have renamed their placeholders: taken in order)
            values = tuple(meta_like(n.meta["val"]) for n in holders
                           if n.name not in c.params and n.name not in c.buffers)
        args = []
        for n in holders:
            if n.name in c.params or n.name in c.buffers:
                t = meta_like(n.meta["val"])
                trains = n.name in c.params and c.params[n.name] not in c.frozen and t.is_floating_point()
                args.append(cast(t.requires_grad_(trains)))
        got = OnMeta(c.graph_module).run(*args, *(cast(v) if isinstance(v, torch.Tensor) else v for v in values))
        got = tuple(x for x in tree_leaves(got) if isinstance(x, torch.Tensor))
        out.append((values, got))
        values = tuple(v.detach().requires_grad_(v.requires_grad) for v in got)
    return out
