"""Finding routed experts (mixture of experts) in a captured graph by their dataflow, and fusing them into one op.

``fuse_routed_experts`` (a capture pass) looks for transformers' grouped-matmul experts
(``integrations.moe.grouped_mm_experts_forward``), whatever the module names::

    ids_g, perm = sort(reshape(idx, [-1]))            idx: (T, k) experts chosen per token
    rows        = x[perm // k]                        x:   (T, H) the tokens
    offs        = cumsum(histc(ids_g, E, 0, E - 1))   rows per expert, running
    out_g       = BODY(rows, offs, ids_g, weights)    grouped matmuls, the gate's activation, biases
    weighted    = out_g * unsqueeze(reshape(w, [-1])[perm], -1)
    inv[perm]   = arange(T k)
    out         = sum(view(weighted[inv], [T, k, H]), [1])

and replaces it by ``ir.experts.OP(x, idx, w, weights, E, body)``: the same values (``ir.experts.routed_experts``
is the serial meaning).  It fuses only when every step of the body is one the fused op computes row by row
(``_ROW_OPS`` and the grouped matmuls on the sorted rows, elementwise ops with scalars, splits of the last dims,
a per-row gather of a bias by ``ids_g``; the weights only transposed or cast, dim 0 kept as the experts) and no
value of the region is read outside it; anything else is left as it was (its ops then run as they are planned).
"""
from __future__ import annotations

import json
import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ...ir.experts import GROUPED_MM, OP
from ...rules.base import lookup

aten = torch.ops.aten

# A pass that changes the shape a parameter placeholder reads (``Captured.views``: ``pack_pairs``) records it in the
# graph module's meta under this key, by placeholder name: (the model's shape, the graph's) (``capture`` reads it).
STORED_VIEWS = "soybean_stored_views"
# The placeholders that are the model's parameters (``capture`` writes them before the passes run): only those may
# be stored in another shape, since only the model's state is fed through ``Captured.feed``.
PARAMETERS = "soybean_parameter_placeholders"
_ROW_VIEWS = ("aten::chunk", "aten::split", "aten::split_with_sizes", "aten::slice", "aten::narrow",
              "aten::unsqueeze")  # on a dim other than the rows'
_WEIGHT_OPS = ("aten::transpose", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::flatten")


@dataclass(frozen=True)
class Region:
    """One routed-experts region: its inputs, its output and every node it replaces."""

    x: fx.Node
    idx: fx.Node
    w: fx.Node
    weights: tuple[fx.Node, ...]
    experts: int
    body: str
    out: fx.Node
    nodes: frozenset[fx.Node]


def _name(n: fx.Node) -> str:
    """``aten::silu.default`` for a torch op; ``getitem``; ``""`` for anything else."""
    t = n.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t._schema.name}.{t._overloadname or 'default'}"
    return ""


def _base(n: fx.Node) -> str:
    return _name(n).split(".")[0]


def _users(n: fx.Node, base: str) -> list[fx.Node]:
    return [u for u in n.users if _base(u) == base]


def _one(nodes: list[fx.Node]) -> fx.Node | None:
    return nodes[0] if len(nodes) == 1 else None


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _args(n: fx.Node) -> list[Any]:
    return list(n.args)


def _flat_of(n: fx.Node) -> fx.Node | None:
    """``a`` when ``n`` is ``reshape(a, [-1])`` or ``view(a, [-1])``."""
    a = _args(n)
    if _base(n) in ("aten::reshape", "aten::view") and list(a[1]) == [-1] and isinstance(a[0], fx.Node):
        return a[0]
    return None


def find(gm: fx.GraphModule) -> list[Region]:
    """Every routed-experts region of ``gm`` (module docstring), in graph order."""
    return [r for s in gm.graph.nodes if _name(s) == "aten::sort.default" and (r := _match(s)) is not None]


def _match(s: fx.Node) -> Region | None:
    if len(s.args) > 1 and _args(s)[1] not in (-1, 0) or len(s.args) > 2 and _args(s)[2] or s.kwargs.get("descending"):
        return None
    flat_ids = _args(s)[0]
    idx = _flat_of(flat_ids) if isinstance(flat_ids, fx.Node) else None
    if idx is None or (ishape := _shape(idx)) is None or len(ishape) != 2:
        return None
    t, k = ishape
    got = {_args(u)[1]: u for u in s.users if u.target is operator.getitem}
    if set(got) != {0, 1} or len(s.users) != 2:
        return None
    ids_g, perm = got[0], got[1]
    tok = _one([u for u in _users(perm, "aten::floor_divide") if _args(u)[0] is perm and _args(u)[1] == k])
    w_g = _one(_users(perm, "aten::index"))
    inv = _one(_users(perm, "aten::index_put"))
    if tok is None or w_g is None or inv is None:  # (every reader of the region's values: checked at the end)
        return None
    rows = _one(_users(tok, "aten::index"))
    if rows is None or len(tok.users) != 1 or list(_args(rows)[1]) != [tok]:
        return None
    x = _args(rows)[0]
    w = _flat_of(_args(w_g)[0]) if isinstance(_args(w_g)[0], fx.Node) else None
    if not isinstance(x, fx.Node) or _shape(x) is None or len(_shape(x) or ()) != 2 or (_shape(x) or (0,))[0] != t:
        return None
    if w is None or _shape(w) != (t, k) or list(_args(w_g)[1]) != [perm]:
        return None
    # offs = cumsum(histc(cast(ids_g), E, 0, E - 1))
    casts = [u for u in ids_g.users if _base(u) in ("aten::to", "aten::_to_copy")
             and _one(_users(u, "aten::histc")) is not None]
    if len(casts) != 1:
        return None
    histc = _users(casts[0], "aten::histc")[0]
    experts = int(_args(histc)[1]) if len(histc.args) > 1 else 100
    if (float(_args(histc)[2]) if len(histc.args) > 2 else 0.0) != 0 or (
            float(_args(histc)[3]) if len(histc.args) > 3 else 0.0) != experts - 1:
        return None
    offs = _one(_users(histc, "aten::cumsum"))
    if offs is None or len(histc.users) != 1 or len(casts[0].users) != 1 or _args(offs)[1] not in (0, -1):
        return None
    # the combine: weighted = out_g * unsqueeze(w_g, -1); out = sum(view(weighted[inv], [T, k, H]), [1])
    unsq = _one(_users(w_g, "aten::unsqueeze"))
    if unsq is None or len(w_g.users) != 1 or _args(unsq)[1] not in (-1, 1) or len(unsq.users) != 1:
        return None
    weighted = _one(_users(unsq, "aten::mul"))
    if weighted is None:
        return None
    out_g = _args(weighted)[0] if _args(weighted)[1] is unsq else _args(weighted)[1]
    unsorted = _one(_users(weighted, "aten::index"))
    if not isinstance(out_g, fx.Node) or unsorted is None or len(weighted.users) != 1:
        return None
    if list(_args(unsorted)[1]) != [inv]:
        return None
    h = (_shape(out_g) or (0, 0))[-1]
    view = _one([u for u in unsorted.users if _base(u) in ("aten::view", "aten::reshape")])
    if view is None or len(unsorted.users) != 1:
        return None
    out = _one(_users(view, "aten::sum"))
    if out is None or list(_args(view)[1]) != [t, k, h] or list(_args(out)[1]) not in ([1], [-2]) or (
            len(out.args) > 2 and _args(out)[2]) or out.kwargs.get("dtype") is not None or len(view.users) != 1:
        return None
    if _shape(out_g) != (t * k, h):
        return None
    body = _body(out_g, rows, offs, ids_g, experts)
    if body is None:
        return None
    text, weights, body_nodes = body
    el, ar = _args(inv)[0], _args(inv)[2]
    if not (isinstance(el, fx.Node) and _base(el) == "aten::empty_like" and _args(el)[0] is perm
            and isinstance(ar, fx.Node) and _name(ar) == "aten::arange.default" and _args(ar)[0] == t * k
            and list(_args(inv)[1]) == [perm] and len(inv.args) < 4 and not inv.kwargs.get("accumulate")):
        return None  # inv must be the inverse permutation: inv[perm] = 0 .. T k - 1
    nodes = {s, ids_g, perm, tok, rows, w_g, inv, el, ar, casts[0], histc, offs, unsq, weighted, unsorted, view, out,
             *body_nodes}
    for flat in (flat_ids, _args(w_g)[0]):
        if isinstance(flat, fx.Node) and all(u in nodes for u in flat.users):
            nodes.add(flat)
    nodes |= {u for n in nodes for u in n.users if u.target is aten._assert_tensor_metadata.default}  # no effect
    if any(u not in nodes for n in nodes - {out} for u in n.users):
        return None  # a value of the region read outside it
    return Region(x, idx, w, weights, experts, text, out, frozenset(nodes))


def _body(out_g: fx.Node, rows: fx.Node, offs: fx.Node, ids_g: fx.Node, experts: int
          ) -> tuple[str, tuple[fx.Node, ...], list[fx.Node]] | None:
    """The body's JSON (``ir.experts``), its weights (placeholders whose dim 0 is the experts) and its nodes, or
    None when a step is not one the fused op computes row by row."""
    kind: dict[fx.Node, str] = {rows: "row", offs: "offs", ids_g: "ids"}
    order: list[fx.Node] = []
    weights: list[fx.Node] = []

    def visit(n: fx.Node) -> bool:
        if n in kind:
            return True
        if n.op == "placeholder":
            if (_shape(n) or (0,))[0] != experts:
                return False
            kind[n] = "weight"
            weights.append(n)
            return True
        if n.op != "call_function" or not all(visit(a) for a in n.all_input_nodes):
            return False
        got = _kind(n, kind, offs, ids_g)
        if got is None:
            return False
        kind[n] = got
        order.append(n)
        return True

    if not visit(out_g) or kind[out_g] != "row":
        return None
    order.sort(key=_position(out_g.graph))
    weights.sort(key=_position(out_g.graph))
    ref = {rows: 0, offs: 1, ids_g: 2, **{wt: 3 + i for i, wt in enumerate(weights)}}
    steps = []
    for n in order:
        ref[n] = len(ref)
        enc = _encode((list(n.args), dict(n.kwargs)), ref)
        if enc is None:
            return None
        steps.append([_name(n), *enc])
    offs_dtype = offs.meta["val"].dtype
    text = json.dumps({"steps": steps, "out": {"ref": ref[out_g]},
                       "offs_dtype": str(offs_dtype).removeprefix("torch.")}, separators=(",", ":"))
    return text, tuple(weights), order


def _position(g: fx.Graph) -> Any:
    at = {n: i for i, n in enumerate(g.nodes)}
    return lambda n: at[n]


def _kind(n: fx.Node, kind: dict[fx.Node, str], offs: fx.Node, ids_g: fx.Node) -> str | None:
    """What a body step makes (``row``: one row per sorted row; ``rows``: a list of them; ``weight``: a tensor
    with the experts along dim 0), or None when it is not computed row by row."""
    name, base = _name(n), _base(n)
    ins = [kind[a] for a in n.all_input_nodes]
    rank = len(_shape(n) or ())
    if base in GROUPED_MM:
        a, b = _args(n)[0], _args(n)[1]
        o = _args(n)[2] if len(n.args) > 2 else n.kwargs.get("offs")
        extra = [v for v in (*n.args[3:], *n.kwargs.values()) if isinstance(v, fx.Node) and v is not o]
        ok = isinstance(a, fx.Node) and isinstance(b, fx.Node) and kind[a] == "row" and kind[b] == "weight"
        return "row" if ok and o is offs and not extra else None
    if set(ins) <= {"weight"}:
        src = len(_shape(n.args[0]) or (0,))
        dims = [d % src for d in _args(n)[1:3]] if base in ("aten::transpose", "aten::flatten") else []
        if base in _WEIGHT_OPS and 0 not in dims:  # dim 0 stays the experts
            return "weight"
        return None
    if base == "aten::index" and ins[0] == "weight" and list(_args(n)[1]) == [ids_g]:
        return "row"  # a per-expert bias, gathered for each row by its expert
    if name == "getitem" and ins == ["rows"]:
        return "row"
    if "offs" in ins or "ids" in ins or "weight" in ins:
        return None
    if base in _ROW_VIEWS:
        dim = int(_arg(n, "dim", 0))
        if base == "aten::unsqueeze":
            return "row" if dim % rank != 0 else None
        src = len(_shape(n.args[0]) or ()) if isinstance(n.args[0], fx.Node) else 0
        if dim % max(src, 1) == 0:
            return None
        return "rows" if base in ("aten::chunk", "aten::split", "aten::split_with_sizes") else "row"
    entry = lookup(n.target)
    if entry is not None and entry.family == "elementwise" and ins and set(ins) == {"row"}:
        shapes = {(_shape(a) or (None,))[0] for a in n.all_input_nodes}
        return "row" if len(shapes) == 1 else None  # every tensor operand one row per sorted row
    return None


def _arg(n: fx.Node, name: str, default: Any) -> Any:
    """Argument ``name`` of a torch op's call, by its schema (``default`` when not given)."""
    schema = n.target._schema  # type: ignore[union-attr]
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return n.args[i] if i < len(n.args) else n.kwargs.get(name, default)
    return default


def _encode(v: Any, ref: dict[fx.Node, int]) -> Any:
    """``v`` as JSON data (``ir.experts``'s references and dtypes); None for a value it cannot hold."""
    if isinstance(v, fx.Node):
        return {"ref": ref[v]} if v in ref else None
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [_encode(x, ref) for x in v]
        return None if any(i is None and x is not None for i, x in zip(items, v)) else items
    if isinstance(v, dict):
        items2 = {k: _encode(x, ref) for k, x in v.items()}
        return None if any(items2[k] is None and v[k] is not None for k in v) else items2
    return None


def _packed_pairs(w: fx.Node, params: Collection[str]) -> tuple[int, ...] | None:
    """The shape ``(experts, 2, ffn, hidden)`` in which to store weight ``w`` when it is a parameter (its placeholder
    among ``params``) holding a gate and an up projection packed along dim 1, ``(experts, 2 ffn, hidden)``: read
    only as ``chunk(grouped_mm(rows, w.transpose(-2, -1)), 2, -1)`` (transformers' ``gate_up_proj``); else None."""
    shape = _shape(w)
    if shape is None or len(shape) != 3 or shape[1] % 2 or len(w.users) != 1 or w.name not in params:
        return None
    t = next(iter(w.users))
    if _base(t) != "aten::transpose" or sorted(d % 3 for d in _args(t)[1:3]) != [1, 2] or len(t.users) != 1:
        return None
    mm = next(iter(t.users))
    if _base(mm) not in GROUPED_MM or len(mm.args) < 2 or _args(mm)[1] is not t or len(mm.users) != 1:
        return None
    ch = next(iter(mm.users))
    if _base(ch) != "aten::chunk" or _args(ch)[0] is not mm or _args(ch)[1:] not in ([2, -1], [2, 1]):
        return None
    return (shape[0], 2, shape[1] // 2, shape[2])


def pack_pairs(gm: fx.GraphModule, w: fx.Node, shape: tuple[int, ...]) -> None:
    """Store weight placeholder ``w`` as ``shape`` (``_packed_pairs``): the graph reads ``flatten(w, 1, 2)``,
    the same elements in the same order.  Splitting the stored ``ffn`` dim then gives each rank the matching rows
    of the gate and of the up projection, which tensor parallelism inside the experts needs (``rules.experts``);
    ``Captured.views`` records it, so the model's tensor is fed and handed back in its own shape."""
    val = w.meta["val"]
    t = next(iter(w.users))
    with gm.graph.inserting_before(t):
        flat = gm.graph.call_function(aten.flatten.using_ints, (w, 1, 2))
    flat.meta = {k: v for k, v in t.meta.items() if k not in ("val", "tensor_meta")}
    flat.meta["val"] = val
    t.replace_input_with(w, flat)
    w.meta["val"] = val.view(shape)
    w.meta.pop("tensor_meta", None)


def fuse_routed_experts(gm: fx.GraphModule) -> None:
    """Replace every routed-experts region (``find``) by one ``ir.experts.OP`` node, of the same value; a packed
    gate and up projection is stored as its pairs first (``pack_pairs``)."""
    regions = find(gm)
    packed = gm.meta.setdefault(STORED_VIEWS, {})
    for r in regions:
        for w in r.weights:
            if (shape := _packed_pairs(w, gm.meta.get(PARAMETERS, ()))) is not None:
                packed[w.name] = (tuple(w.meta["val"].shape), shape)
                pack_pairs(gm, w, shape)
    for r in find(gm) if packed else regions:  # a region's body names its weights' reads: found again after packing
        g = gm.graph
        with g.inserting_before(r.out):
            fused = g.call_function(OP, (r.x, r.idx, r.w, list(r.weights), r.experts, r.body))
        fused.meta = dict(r.out.meta)
        r.out.replace_all_uses_with(fused)
        for n in sorted(r.nodes, key=_position(g), reverse=True):
            g.erase_node(n)
    gm.graph.lint()
