"""Capture: a model and an example batch -> an aten-level fx graph with shapes.

``torch.export.export(strict=False)`` traces through Python control flow that
``torch.fx.symbolic_trace`` cannot (Hugging Face models), and records a
``FakeTensor`` in ``node.meta['val']`` of every node.  Parameters and buffers keep
their fully qualified names; a tied weight (one parameter used under two names)
is one placeholder with several users, the alias's placeholder has none.

Then a few exact rewrites make losses splittable: ``mean`` and ``mse_loss(mean)``
become ``sum / n`` and
``cross_entropy_loss(reduction='mean')`` becomes ``sum-loss / count`` so that a
batch-split loss is a pending sum (``Partial``) instead of forcing a gather of
the logits.
"""
from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the construct and a fix."""


@dataclass
class Captured:
    """A captured model: the fx graph plus the names it needs at run time."""

    graph_module: fx.GraphModule
    params: dict[str, str]            # placeholder name -> parameter FQN
    buffers: dict[str, str]           # placeholder name -> buffer FQN
    inputs: list[str]                 # user-input placeholder names, in call order
    aliases: dict[str, str] = field(default_factory=dict)  # tied FQN -> the FQN the graph uses
    fingerprint: str = ""             # identifies model structure + input shapes

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph


def _fingerprint(gm: fx.GraphModule) -> str:
    import hashlib

    h = hashlib.sha256()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        h.update(f"{n.op}|{n.target}|{shape}|{len(n.args)}\n".encode())
    return h.hexdigest()[:16]


_EXPORT_LOCK = threading.Lock()  # torch.export patches global state: one capture at a time


def capture(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None = None) -> Captured:
    """Export ``model(*example_inputs)`` at aten level (training IR) and name its placeholders."""
    with _EXPORT_LOCK:
        return _capture(model, example_inputs, example_kwargs)


def _capture(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None) -> Captured:
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        ep = torch.export.export(model, example_inputs, example_kwargs or {}, strict=False)
    except Exception as e:  # torch raises many types; all mean "cannot capture"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"could not capture {type(model).__name__} with torch.export (non-strict): {type(e).__name__}: {first}. "
            "Fix: make forward traceable for these example inputs (no data-dependent Python control flow on "
            "tensor values, no .item()/.tolist() on activations) or pass inputs of the shapes you will train with."
        ) from e
    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    inputs = list(sig.user_inputs)
    gm = ep.module if False else ep.graph_module
    used = set(params.values()) | set(buffers.values())
    aliases: dict[str, str] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for fqn, p in named.items():
        if fqn not in used:
            for other in used:
                if other in named and named[other] is p:
                    aliases[fqn] = other
    # Drop placeholders of tied aliases from planning: they have no users.
    for n in list(gm.graph.nodes):
        if n.op == "placeholder" and n.name in params and not n.users:
            fq = params[n.name]
            if fq not in aliases:
                for other, q in params.items():
                    if q != fq and named.get(q) is named.get(fq):
                        aliases[fq] = q
    decompose(gm)
    return Captured(gm, params, buffers, inputs, aliases, _fingerprint(gm))


# ---- exact rewrites ------------------------------------------------------------------------

aten = torch.ops.aten


def _meta(x: Any) -> Any:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def _call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None) -> fx.Node:
    """Insert ``target(*args)`` with ``meta['val']`` computed on the meta device."""
    node = graph.call_function(target, args, kwargs or {})
    margs = tuple(_meta(a) for a in args)
    mkw = {k: _meta(v) for k, v in (kwargs or {}).items()}
    node.meta["val"] = target(*margs, **mkw)
    if like is not None:
        for k in ("nn_module_stack", "stack_trace"):
            if k in like.meta:
                node.meta[k] = like.meta[k]
    return node


def decompose(gm: fx.GraphModule) -> None:
    """Rewrite means into sums divided by a count (exact in fp32 up to rounding)."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target in (aten.mean.default, aten.mean.dim):
            x = n.args[0]
            shape = tuple(x.meta["val"].shape)
            if n.target is aten.mean.default:
                dims, keep = list(range(len(shape))), False
            else:
                dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else list(range(len(shape)))
                keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            dtype = n.kwargs.get("dtype")
            if dtype is not None or not x.meta["val"].dtype.is_floating_point:
                continue
            count = math.prod(shape[d] for d in dims) if shape else 1
            with g.inserting_before(n):
                s = _call(g, aten.sum.dim_IntList, (x, list(dims), keep), like=n)
                d = _call(g, aten.div.Tensor, (s, float(count)), like=n)
            n.replace_all_uses_with(d)
            g.erase_node(n)
        elif n.target is aten.mse_loss.default and (n.args[2] if len(n.args) > 2 else n.kwargs.get("reduction", 1)) == 1:
            x, y = n.args[0], n.args[1]
            count = math.prod(x.meta["val"].shape)
            with g.inserting_before(n):
                total = _call(g, aten.mse_loss.default, (x, y, 2), like=n)
                d = _call(g, aten.div.Tensor, (total, float(count)), like=n)
            n.replace_all_uses_with(d)
            g.erase_node(n)
        elif n.target is aten.cross_entropy_loss.default:
            args = list(n.args) + [None] * (6 - len(n.args))
            x, y, weight, reduction, ignore_index, smoothing = args[:6]
            weight = n.kwargs.get("weight", weight)
            reduction = n.kwargs.get("reduction", 1 if reduction is None else reduction)
            ignore_index = n.kwargs.get("ignore_index", -100 if ignore_index is None else ignore_index)
            smoothing = n.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
            if reduction != 1 or weight is not None or smoothing:
                continue
            if not isinstance(y.meta["val"], torch.Tensor) or y.meta["val"].dtype.is_floating_point:
                continue  # probability targets: leave the mean
            with g.inserting_before(n):
                total = _call(g, aten.cross_entropy_loss.default, (x, y, None, 2, ignore_index), like=n)
                valid = _call(g, aten.ne.Scalar, (y, ignore_index), like=n)
                cnt = _call(g, aten.sum.default, (valid,), like=n)
                d = _call(g, aten.div.Tensor, (total, cnt), like=n)
            n.replace_all_uses_with(d)
            g.erase_node(n)
    g.lint()
    gm.recompile()


def tensor_users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def is_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem
