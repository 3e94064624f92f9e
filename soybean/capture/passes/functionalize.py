"""Functionalize: in-place updates of values made inside forward become out-of-place ops.

A parallel program holds a value as tiles and may read it through a resharded copy; an in-place
update of one copy would not reach the others.  So every in-place op ``op_(t, ...)`` (its schema
writes its first argument) whose ``t`` is a value forward made (not a parameter, buffer or input:
those keep their write-back edges, ``graph.written_inputs``) is rewritten as the functional op
``t' = op(t, ...)``, and the update is carried to everything that aliases ``t``:

  (``copy_(t, src)`` becomes ``src`` cast to ``t``'s dtype and broadcast to its shape: ``aten.copy`` has
  no derivative);
* ``t`` is a chain of views ``t = v_k(... v_1(b))`` of a base ``b`` (a value that is not a view);
  the new base is the old one with the chain's window replaced, built back up the chain by each
  view's *scatter*: ``slice`` -> ``slice_scatter``, ``select`` -> ``select_scatter``, a reshaping
  view -> ``reshape`` to the parent's shape, ``transpose``/``t``/``permute`` -> their inverse;
* every later reader of ``b`` reads the new base, and every later reader of a view of ``b`` (``t``
  itself, the in-place op's result) reads that view taken again from the new base.

Exact: each later read sees the values eager mode's aliasing gives it.  An update through a view
this pass cannot scatter back (``expand``, ``as_strided``, a multi-output split: ``returns_view``) is left
in place.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# Views whose window a scatter can replace: view op -> (parent's current value, new child value, view node) -> new
# parent value, as (target, args).
_Scatter = Callable[[fx.Node, fx.Node, fx.Node], tuple[Any, tuple]]


def _shape(n: fx.Node) -> list[int]:
    return [int(d) for d in n.meta["val"].shape]


def _reshape_back(p: fx.Node, new: fx.Node, v: fx.Node) -> tuple[Any, tuple]:
    return aten.reshape.default, (new, _shape(p))


def _permute_back(p: fx.Node, new: fx.Node, v: fx.Node) -> tuple[Any, tuple]:
    dims = [int(d) % len(_shape(p)) for d in cast(Sequence[int], v.args[1])]
    inverse = [dims.index(i) for i in range(len(dims))]
    return aten.permute.default, (new, inverse)


SCATTERS: dict[Any, _Scatter] = {
    aten.slice.Tensor: lambda p, new, v: (aten.slice_scatter.default, (p, new, *v.args[1:])),
    aten.select.int: lambda p, new, v: (aten.select_scatter.default, (p, new, *v.args[1:])),
    aten.transpose.int: lambda p, new, v: (aten.transpose.int, (new, *v.args[1:])),
    aten.t.default: lambda p, new, v: (aten.t.default, (new,)),
    aten.permute.default: _permute_back,
    aten.alias.default: lambda p, new, v: (aten.alias.default, (new,)),
    **{op: _reshape_back for op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                                    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
                                    aten.squeeze.dims, aten.flatten.using_ints, aten.unflatten.int,
                                    aten.view_as.default)},
}


def returns_view(target: Any) -> bool:
    """Does the op return a view of (an alias into) an argument without writing it (its schema's ``Tensor(a)``
    return, a list of them for ``split``)?  Views that no ``SCATTERS`` entry undoes (``expand``, ``split``'s
    chunks, ``as_strided``) are opaque: an update through one, or of a value one aliases, stays in place."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _writes_first(target: Any) -> bool:
    """Does the op write into its first argument (``Tensor(a!) self``)?"""
    schema = getattr(target, "_schema", None)
    first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return first is not None and first.is_write


def functional_variant(target: Any) -> Any | None:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor``: the out-of-place overload of an in-place op, or None when
    ``target`` does not write its first argument or has no such overload."""
    if not _writes_first(target):
        return None
    schema = target._schema
    if schema.name.endswith("_out") or not schema.name.endswith("_"):
        return None
    packet = getattr(aten, schema.name.split("::")[-1][:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def _meta(x: Any) -> Any:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v


class _Functionalizer:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.g = gm.graph
        self.parent: dict[fx.Node, fx.Node] = {}     # a view -> the value it views
        self.views: dict[fx.Node, list[fx.Node]] = {}  # a value -> its direct views (scatterable)
        self.opaque: set[fx.Node] = set()            # values some opaque view aliases: updates stay in place
        self.current: dict[fx.Node, fx.Node] = {}    # a value -> what later readers read instead
        self.made: list[fx.Node] = []
        self.changed = False

    def latest(self, a: fx.Node) -> fx.Node:
        """What a reader of ``a`` reads now: the value after every update so far."""
        while a in self.current:
            a = self.current[a]
        return a

    def call(self, target: Any, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
        node = self.g.call_function(target, args, dict(kwargs or {}))
        node.meta["val"] = target(*tree_map(_meta, args), **tree_map(_meta, dict(kwargs or {})))
        for k in ("nn_module_stack", "stack_trace"):
            if k in like.meta:
                node.meta[k] = like.meta[k]
        self.made.append(node)
        return node

    def base(self, t: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
        """``t``'s base and the chain of views from ``t`` up to it; None when an update cannot be carried."""
        chain = [t]
        while chain[-1] in self.parent:
            chain.append(self.parent[chain[-1]])
        b = chain[-1]
        if b.op != "call_function" or any(n in self.opaque for n in chain):
            return None
        return b, chain[:-1]

    def run(self) -> bool:
        for n in list(self.g.nodes):
            if n.op not in ("call_function", "output"):
                continue
            n.args, n.kwargs = tree_map(lambda a: self.latest(a) if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            if n.op != "call_function":
                continue
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if src is not None and n.target in SCATTERS:
                self.parent[n] = src
                self.views.setdefault(src, []).append(n)
            elif src is not None and (returns_view(n.target) or (n.target is operator.getitem and src in self.opaque)):
                self.opaque.update((src, n))  # an alias no scatter undoes: both stay as they are
            fn = functional_variant(n.target)
            if src is not None and not (fn is not None and self.update(n, fn, src)) and _writes_first(n.target):
                self.opaque.update((src, n))  # an update left in place: what it wrote stays aliased
        for n in reversed(self.made):
            if not n.users:
                self.g.erase_node(n)
        return self.changed

    def update(self, m: fx.Node, fn: Any, t: fx.Node) -> bool:
        """Rewrite the in-place ``m`` (updating ``t``) as ``fn`` and carry the update to ``t``'s aliases; False
        (nothing done) when ``t`` is stored (a placeholder) or aliased opaquely."""
        found = self.base(t)
        if found is None:
            return False
        b, chain = found
        with self.g.inserting_before(m):
            if fn is aten.copy.default:  # no derivative: the source, cast and broadcast to the destination
                cast = self.call(aten._to_copy.default, (m.args[1],), m, {"dtype": t.meta["val"].dtype})
                new = self.call(aten.expand.default, (cast, _shape(t)), m)
            else:
                new = self.call(fn, tuple(m.args), m, dict(m.kwargs))
            for v in chain:  # from t up to the base: each view's window replaced in its parent
                target, args = SCATTERS[v.target](self.parent[v], new, v)
                new = self.call(target, args, m)
            self.current[b] = new
            self.rederive(b, new, m)
        m.replace_all_uses_with(self.latest(t))
        self.g.erase_node(m)
        self.changed = True
        return True

    def rederive(self, old: fx.Node, new: fx.Node, like: fx.Node) -> None:
        """Every view of ``old``, taken again from ``new`` (what later readers of those views read)."""
        for v in self.views.get(old, []):
            again = self.call(v.target, (new, *v.args[1:]), like, dict(v.kwargs))
            self.parent[again] = new
            self.views.setdefault(new, []).append(again)
            self.current[v] = again
            self.rederive(v, again, like)


def functionalize(gm: fx.GraphModule) -> None:
    """Rewrite every in-place update of a value forward made as an out-of-place op (see the module docstring)."""
    if _Functionalizer(gm).run():
        gm.graph.lint()
