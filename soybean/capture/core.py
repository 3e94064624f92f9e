"""Capture: a model and an example batch -> an aten-level fx graph with shapes.

``torch.export.export(strict=False)`` traces through Python control flow that
``torch.fx.symbolic_trace`` cannot (Hugging Face models), and records a
``FakeTensor`` in ``node.meta['val']`` of every node.  Parameters and buffers keep
their fully qualified names; a tied weight (one parameter used under two names)
is one placeholder with several users, the alias's placeholder has none.

Tensors that forward makes from Python values (``torch.tensor(sliding_window)``, an index list, a
relative-position table) are lifted by ``torch.export`` into placeholders; their values are kept in
``gm.meta[CONSTANTS]`` while the passes run, and those still read afterwards become buffers of the
captured model (``Captured.constants``: planned like buffers, outside the model's state dict).
Frozen parameters (``requires_grad=False``) are listed in ``Captured.frozen``; forward's inputs may
be positional or keywords (``Captured.in_spec``, ``flatten_inputs``).

Then the exported graph goes through ``PASSES``, exact in-place rewrites run in this order:

1. ``inline_empty_constants``: an empty tensor constant (a KV cache's start) becomes ``aten.empty``.
2. ``inline_grad_regions``: grad-mode regions that ``torch.export`` wraps in a higher-order op
   (a ``torch.no_grad()`` block, such as Llama's rotary embedding) are inlined, with their
   outputs detached, so every remaining node is a plain aten op.
3. ``drop_assertions``: runtime metadata assertions (``_assert_tensor_metadata``: no output,
   no effect on values) are erased.
4. ``functionalize``: in-place updates of values forward made (``shifted[:, 1:] = ids[:, :-1]``,
   ``masked_fill_``) become out-of-place ops, carried to every alias (``soybean.capture.functionalize``):
   a tiled value read through a resharded copy would otherwise miss the update.
5. ``fold_constant_masks``: an attention mask computed from constants only (Hugging Face builds
   its causal or all-true mask from ``arange`` under ``torch.export``, where eager mode passes
   none) is evaluated once; when it is the causal mask it becomes ``is_causal=True``, when it
   masks nothing it is dropped.  The mask subgraph then disappears: it was one value read by
   every layer.
6. ``means_to_sums``: ``mean`` and ``mse_loss(mean)`` become ``sum / n`` and
   ``cross_entropy_loss(reduction='mean')`` becomes ``sum-loss / count`` so that a
   batch-split loss is a pending sum (``Partial``) instead of forcing a gather of
   the logits.
7. ``fuse_routed_experts``: a mixture-of-experts layer's routed experts (transformers' grouped-matmul experts:
   rows sorted by expert, grouped matmuls, weighted and summed back per token) become one op,
   ``soybean::routed_experts`` (``soybean.capture.experts``), whose rule splits the tokens, the experts or both.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import math
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from ..ir.losses import IGNORE_INDEX, class_count
from ..precision import compute_inputs, compute_model, policy
from .experts import PARAMETERS, STORED_VIEWS, fuse_routed_experts
from .functionalize import functionalize
from .masks import CAUSAL, judged, mask_meaning


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
    precision: str = "fp32"           # the policy it was captured under (``soybean.precision``)
    out_spec: Any = None              # the pytree of forward's outputs (a ModelOutput, a tuple, ...)
    in_spec: Any = None               # the pytree of forward's ``(args, kwargs)`` (``flatten_inputs``)
    # Tensors forward makes from constants (``torch.tensor(window)``, an index list), by buffer name: planned and
    # stored like buffers, but no part of the model's state (``constants_as_buffers``).
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()  # parameters (FQNs) whose ``requires_grad`` is False: never trained
    arg_names: tuple[str, ...] = ()   # forward's parameters that take a value by position or by name, in order
    keys: dict[str, str] = field(default_factory=dict)  # node name -> structural key (``structural_keys``)
    # Parameters the graph reads in another shape than the model holds them (FQN -> (the model's shape, the graph's
    # shape)): a view of the same elements in the same order (a routed-experts weight whose packed gate and up rows
    # are stored as ``(experts, 2, ffn, hidden)``, so that splitting its ``ffn`` dim splits both:
    # ``experts.pack_pairs``).  Whoever feeds the graph the model's tensors or hands tensors back to the model goes
    # through ``stored`` and ``unstored``.
    views: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # User inputs (placeholder names) whose example tensors require a gradient: a graph of a piece of a model (a
    # dynamo piece, ``soybean.run.pieces``; a pipeline stage; a placed region) takes activations whose gradient its
    # backward must return whole (``graph.build``: such an input needs a gradient, so partial sums are summed).
    grad_inputs: frozenset[str] = frozenset()

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def stored(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """The model's tensor ``fqn`` as the graph reads it (a view; ``t`` itself for a tensor not in ``views``)."""
        return t if fqn not in self.views else t.view(self.views[fqn][1])

    def unstored(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """``stored``'s inverse: the graph's whole tensor ``fqn`` in the model's shape."""
        return t if fqn not in self.views else t.reshape(self.views[fqn][0])

    def feed(self, state: dict[str, Any]) -> list[Any]:
        """The graph's state placeholders' values, in order, from ``state`` (the model's tensors by FQN, the
        constants forward made by name), each as the graph reads it (``stored``)."""
        out = []
        for n in self.graph.nodes:
            if n.op == "placeholder" and (n.name in self.params or n.name in self.buffers):
                fqn = self.params.get(n.name) or self.buffers[n.name]
                out.append(self.stored(fqn, state[fqn]))
        return out

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The user inputs of a call ``forward(*args, **kwargs)``, in the order of ``inputs``.

        Arguments are matched to forward's parameters by name (``arg_names``), so a tensor passed by position at
        capture may be passed by keyword later, and keywords in any order; the call must otherwise give the
        captured arguments, with the same Python constants."""
        if self.in_spec is None:
            return list(args)
        keys = list(self.in_spec.child(1).context) if self.in_spec.num_children > 1 else []
        n_pos = self.in_spec.child(0).num_children
        if (len(args), set(kwargs)) != (n_pos, set(keys)) and self.arg_names:
            given = dict(zip(self.arg_names, args))
            if len(args) <= len(self.arg_names) and not set(given) & set(kwargs):
                given.update(kwargs)
                want = [*self.arg_names[:n_pos], *keys]
                if set(given) == set(want):
                    args, kwargs = tuple(given[n] for n in self.arg_names[:n_pos]), {k: given[k] for k in keys}
        if set(kwargs) != set(keys):
            raise TypeError(f"this model was captured with keyword arguments {sorted(keys)}, got {sorted(kwargs)}: "
                            "call it as it was called when it was parallelized")
        leaves, spec = tree_flatten((tuple(args), {k: kwargs[k] for k in keys}))
        if spec != self.in_spec:
            raise TypeError(f"this model was captured with inputs structured as {self.in_spec}, got {spec}: "
                            "call it as it was called when it was parallelized")
        return leaves


def structural_keys(gm: fx.GraphModule, names: dict[str, str]) -> dict[str, str]:
    """Every value node's *structural key*: a hash of what it computes, from the graph's inputs up (a placeholder
    by ``names``' FQN, shape and dtype; an op by its target, its constant arguments and its inputs' keys).

    Two captures of one model agree on these keys even when they list independent computations in another order
    (Python ``set`` iteration in a forward differs between processes: ModernBERT computes each layer type's rotary
    table in the order of ``set(layer_types)``), where node names, made in graph order, do not; a plan is matched
    to a graph by them (``plan.Plan.aligned``)."""
    keys: dict[str, str] = {}

    def arg(a: Any) -> Any:
        return ("node", keys[a.name]) if isinstance(a, fx.Node) else a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            desc: Any = ("placeholder", names.get(n.name, n.name), tuple(v.shape) if isinstance(v, torch.Tensor) else v,
                         str(getattr(v, "dtype", "")))
        elif n.op == "call_function":
            desc = (str(n.target), tree_map(arg, (tuple(n.args), dict(n.kwargs))))
        elif n.op == "get_attr":  # a submodule a higher-order op calls (a pass left out keeps it)
            desc = ("get_attr", str(n.target))
        else:
            continue
        keys[n.name] = hashlib.sha1(repr(desc).encode()).hexdigest()[:16]
    return keys


def _fingerprint(keys: dict[str, str]) -> str:
    """The graph's structure as one hash, whatever the order of its independent computations: every node's
    structural key, sorted."""
    return hashlib.sha256("\n".join(sorted(keys.values())).encode()).hexdigest()[:16]


def split_example(example_inputs: Any, example_kwargs: dict[str, Any] | None = None) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of an example call: ``example_inputs`` is a tuple (or list) of positional arguments, one
    tensor, or a dict of keyword arguments; ``example_kwargs`` adds keywords."""
    if isinstance(example_inputs, dict):
        return (), {**example_inputs, **(example_kwargs or {})}
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return args, dict(example_kwargs or {})


EXPORT_LOCK = threading.Lock()  # torch.export patches global state: one capture at a time


def capture(model: torch.nn.Module, example_inputs: tuple | dict | torch.Tensor, example_kwargs: dict | None = None, *,
            passes: Sequence[Pass] | None = None, precision: str = "fp32") -> Captured:
    """Export ``model(*example_inputs, **example_kwargs)`` at aten level (training IR), name its placeholders and
    rewrite the graph with ``passes`` (default ``PASSES``; another list is for inspecting a pass).
    ``example_inputs`` may also be one tensor or a dict of keywords (``split_example``).
    ``precision``: capture the model as that policy computes it (``soybean.precision``)."""
    pol = policy(precision)
    args, kwargs = split_example(example_inputs, example_kwargs)
    model, example_inputs = compute_model(model, pol), compute_inputs(args, pol)
    example_kwargs = dict(zip(kwargs, compute_inputs(tuple(kwargs.values()), pol)))
    with EXPORT_LOCK:
        cap = _capture(model, example_inputs, example_kwargs, passes)
    cap.precision = pol.name
    return cap


def _capture(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None,
             passes: Sequence[Pass] | None) -> Captured:
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        with _plain_outputs(model):
            ep = torch.export.export(model, example_inputs, example_kwargs or {}, strict=False)
    except Exception as e:  # torch raises many types; all mean "cannot capture"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"could not capture {type(model).__name__} with torch.export (non-strict): {type(e).__name__}: {first}. "
            "Fix: make forward traceable for these example inputs (no data-dependent Python control flow on "
            "tensor values, no .item()/.tolist() on activations) or pass inputs of the shapes you will train with."
        ) from e
    sig = ep.graph_signature
    params = _canonical_names(dict(sig.inputs_to_parameters), model.named_parameters(remove_duplicate=False))
    buffers = _canonical_names(dict(sig.inputs_to_buffers), model.named_buffers(remove_duplicate=False))
    inputs = list(sig.user_inputs)
    gm = ep.graph_module
    gm.meta[CONSTANTS] = {ph: ep.constants[name] for ph, name in sig.inputs_to_lifted_tensor_constants.items()}
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
                for q in params.values():
                    if q != fq and named.get(q) is named.get(fq):
                        aliases[fq] = q
    gm.meta[PARAMETERS] = frozenset(params)
    run_passes(gm, passes)
    gm.meta.pop(PARAMETERS)
    mark_returned_sums(gm)
    constants = constants_as_buffers(gm)
    buffers.update({name: name for name in constants})
    frozen = frozenset(fqn for fqn, p in named.items() if not p.requires_grad)
    keys = structural_keys(gm, {**params, **buffers})
    views = {params[ph]: shapes for ph, shapes in gm.meta.pop(STORED_VIEWS, {}).items()}  # (parameters only)
    given, _ = tree_flatten((example_inputs, example_kwargs or {}))
    grad_inputs = frozenset(name for name, x in zip(inputs, given) if isinstance(x, torch.Tensor)
                            and x.requires_grad and x.is_floating_point()) if len(given) == len(inputs) else frozenset()
    cap = Captured(gm, params, buffers, inputs, aliases, _fingerprint(keys), out_spec=ep.call_spec.out_spec,
                   in_spec=ep.call_spec.in_spec, constants=constants, frozen=frozen, arg_names=_arg_names(model),
                   keys=keys, views=views, grad_inputs=grad_inputs)
    _record_sizes(cap, model, example_inputs, example_kwargs or {})
    return cap


def _record_sizes(cap: Captured, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Data-dependent sizes (``nonzero``, a mask, ``tolist()``: unbacked symbols) get the example run's values as
    the sizes planning prices (``rules.datadep.record_sizes``, one run of the graph on copies of the buffers), and
    every value's sizes become those numbers (``rules.datadep.concretize``: its data-dependent dims marked)."""
    from ..rules.datadep import concretize, record_sizes, unbacked_symbols

    if not unbacked_symbols(cap.graph):
        return
    state: dict[str, Any] = {k: p.detach() for k, p in model.named_parameters(remove_duplicate=False)}
    state.update({k: b.detach().clone() for k, b in model.named_buffers(remove_duplicate=False)})
    state.update({k: c.clone() for k, c in cap.constants.items()})
    record_sizes(cap.graph_module, [*cap.feed(state), *cap.flatten_inputs(args, kwargs)])
    concretize(cap.graph_module)


def _arg_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``model.forward``'s parameters that take a value by position or by name (up to a ``*args``)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return ()
    out = []
    for p in sig.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out.append(p.name)
    return tuple(out)


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


@contextmanager
def _plain_outputs(model: torch.nn.Module) -> Iterator[None]:
    """Export ``model`` with every output leaf that is not a tensor or a Python constant dropped (``None``):
    a Hugging Face model as loaded (``use_cache=True``) returns its KV cache, an object no pytree knows and
    nothing a loss reads; the parallel model returns ``None`` in its place.  Tensors, and the containers
    around them (tuples, dicts, ``ModelOutput``), are kept as they are."""
    had = "forward" in model.__dict__
    orig = model.forward

    @functools.wraps(orig)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return tree_map(lambda x: x if isinstance(x, _PLAIN) else None, orig(*args, **kwargs))

    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = orig
        else:
            del model.forward


# ``gm.meta`` key of the tensor constants forward made (``torch.tensor(sliding_window)``, an index list, a table):
# ``torch.export`` lifts each into a placeholder; placeholder name -> its value.  Passes may read the values
# (``fold_constant_masks`` evaluates masks built from them) and drop the ones they leave unused.
CONSTANTS = "soybean_constants"


def inline_empty_constants(gm: fx.GraphModule) -> None:
    """An empty tensor constant (a KV cache starts from empty tensors it concatenates keys onto) holds no values:
    it is created in the graph instead (``aten.empty``, which every rank makes locally)."""
    constants: dict[str, torch.Tensor] = gm.meta.get(CONSTANTS, {})
    values = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in constants
              and not constants[n.name].numel()]
    if not values:
        return
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for n in values:
        c = constants.pop(n.name)
        with gm.graph.inserting_after(last):
            made = gm.graph.call_function(torch.ops.aten.empty.memory_format, (list(c.shape),),
                                          {"dtype": c.dtype, "device": c.device})
        made.meta.update(n.meta)
        n.replace_all_uses_with(made)
        gm.graph.erase_node(n)
    gm.recompile()


def constants_as_buffers(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensor constants still read after the passes, by buffer name: a constant is a value like any other,
    planned like a buffer (replicated, or split as its consumers need it) and kept by every rank as its tile.

    Each is named by its value (``constant_<hash of dtype, shape, bytes>``), not by export's numbering, which
    follows the order forward made them in and may differ between processes; equal constants become one.
    Unread ones are erased."""
    constants: dict[str, torch.Tensor] = gm.meta.pop(CONSTANTS, {})
    out: dict[str, torch.Tensor] = {}
    made: dict[str, fx.Node] = {}
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "placeholder" or n.name not in constants:
            continue
        value = constants[n.name].detach()
        if not n.users:
            g.erase_node(n)
            continue
        raw = value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha1(f"{value.dtype}{tuple(value.shape)}".encode() + raw)
        name = f"constant_{digest.hexdigest()[:12]}"
        if name not in made:
            with g.inserting_before(n):
                made[name] = g.placeholder(name)
            made[name].meta.update(n.meta)
            out[made[name].name] = value.clone()
        n.replace_all_uses_with(made[name])
        g.erase_node(n)
    gm.recompile()
    return out


def _canonical_names(inputs: dict[str, str], named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name each tied tensor by its first FQN, as ``named_parameters()``/``named_buffers()`` do.

    ``torch.export`` may name a tied tensor by any of its FQNs (Hugging Face GPT-2: ``lm_head.weight``
    rather than ``transformer.wte.weight``); the other names become ``aliases``.
    """
    first: dict[int, str] = {}
    by_name: dict[str, int] = {}
    for fqn, t in named:
        first.setdefault(id(t), fqn)
        by_name[fqn] = id(t)
    return {ph: first.get(by_name.get(fqn, -1), fqn) for ph, fqn in inputs.items()}


# ---- exact rewrites ------------------------------------------------------------------------

aten = torch.ops.aten


def _meta(x: Any) -> Any:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def _call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
          like: fx.Node | None = None) -> fx.Node:
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


def inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline every ``wrap_with_set_grad_enabled(enabled, submod, *args)`` region into the graph.

    ``torch.export`` keeps a ``torch.no_grad()`` block as a call of a submodule.  Its nodes are
    copied in place of the call (their ``meta['val']`` included); a no-grad region's floating-point
    outputs go through ``aten.detach``, so values and gradients are exactly those of the model.
    Nested regions are inlined too (the loop runs until none is left).
    """
    g = gm.graph
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    while True:
        calls = [n for n in g.nodes if n.op == "call_function" and n.target is hop]
        if not calls:
            break
        for n in calls:
            enabled, sub, *args = n.args
            body = getattr(gm, sub.target)
            env = dict(zip([p for p in body.graph.nodes if p.op == "placeholder"], args, strict=True))
            with g.inserting_before(n):
                result = g.graph_copy(body.graph, env)
                outs = list(result) if isinstance(result, (tuple, list)) else [result]
                # ``module.to(its own dtype)`` inside ``no_grad`` (Switch Transformers' router casts its classifier on
                # every call): ``p.set_(p.to(dtype))`` changes nothing, and the parameter read after it is the
                # parameter itself, whose gradient must flow (detaching it would lose the classifier's gradient).
                outs = [_unset(g, o) if isinstance(o, fx.Node) else o for o in outs]
                if not enabled:
                    # (a value the region only passes through is not made in it: it keeps its gradient)
                    outs = [_call(g, aten.detach.default, (o,), like=n)
                            if isinstance(o, fx.Node) and _is_float(o) and o not in args else o for o in outs]
            for user in list(n.users):  # getitem(call, i)
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
            g.erase_node(n)
            if not sub.users:
                g.erase_node(sub)
                delattr(gm, sub.target)
    g.lint()
    gm.recompile()


_ALIASING = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.alias.default)


def _aliased(n: Any) -> Any:
    """The tensor ``n`` is the same tensor as: through ``to`` of its own dtype, shape and no copy, and ``alias``."""
    while (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _ALIASING
           and not n.kwargs.get("copy", False) and isinstance(n.args[0], fx.Node)):
        v, w = n.meta.get("val"), n.args[0].meta.get("val")
        if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.dtype == w.dtype
                and v.shape == w.shape and v.device == w.device):
            break
        n = n.args[0]
    return n


def _noop_set(n: fx.Node) -> bool:
    """Is ``n`` a tensor set to itself: ``set_(x, y)`` with ``x`` and ``y`` the same tensor (``_aliased``:
    ``x.set_(x.to(x.dtype))``, what ``module.to(its own dtype)`` does to a parameter)?"""
    return (n.op == "call_function" and n.target is aten.set_.source_Tensor and len(n.args) == 2
            and _aliased(n.args[0]) is _aliased(n.args[1]))


def _unset(g: fx.Graph, n: fx.Node) -> fx.Node:
    """``n``'s value with a no-op ``set_`` (``_noop_set``) erased: the tensor it set (before any alias), else
    ``n``; aliases left unread are erased too."""
    if not _noop_set(n):
        return n
    root = _aliased(n.args[0])
    n.replace_all_uses_with(root)
    dead = [a for a in n.args if isinstance(a, fx.Node)]
    g.erase_node(n)
    while dead:
        d = dead.pop()
        if d is not root and d.op == "call_function" and d.target in _ALIASING and not d.users:
            dead += [a for a in d.args if isinstance(a, fx.Node)]
            g.erase_node(d)
    return root


def _is_float(n: fx.Node) -> bool:
    """Does the node produce a floating-point tensor?"""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()


ASSERTIONS = (aten._assert_tensor_metadata.default,)


def drop_assertions(gm: fx.GraphModule) -> None:
    """Erase runtime metadata assertions: they return nothing and check what capture already fixed.  Also a
    tensor set to itself, ``set_(x, x)``: what ``module.to(its own dtype)`` leaves of ``p.data = p.to(dtype)``
    (Switch Transformers' router casts its classifier on every call); it changes nothing, and run on a parameter
    that requires a gradient it would raise."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in ASSERTIONS and not n.users:
            gm.graph.erase_node(n)
        elif _noop_set(n):
            _unset(gm.graph, n)
    gm.recompile()


MAX_FOLDED_MASK = 1 << 28  # elements: larger constant masks are kept as computed


def _mutates(n: fx.Node) -> bool:
    """Does the node's op write into an argument (``Tensor(a!)`` in its schema)?"""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _constant_nodes(g: fx.Graph, known: Collection[str] = ()) -> set[fx.Node]:
    """Nodes whose value depends on no placeholder but the ``known`` constants (by name) and no random draw
    (so on the shapes and those constants only).

    Empty when an in-place op writes to such a node: its value would then depend on the order (``detach_`` changes
    no value and does not count).
    """
    const: set[fx.Node] = {n for n in g.nodes if n.op == "placeholder" and n.name in known}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        reads = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)]
        if _mutates(n) and n.target is not aten.detach_.default and any(a in const for a in reads):
            return set()
        if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()) and all(a in const for a in reads):
            const.add(n)
    return const


def _evaluate(node: fx.Node, memo: dict[fx.Node, Any]) -> Any:
    """The value of a constant node, computed on the CPU (device arguments are moved there)."""
    cpu = torch.device("cpu")

    def value(a: Any) -> Any:
        return memo[a] if isinstance(a, fx.Node) else cpu if isinstance(a, torch.device) else a

    for n in _cone(node):
        if n not in memo:
            args, kwargs = tree_map(value, (tuple(n.args), dict(n.kwargs)))
            # Every node of a constant cone is a call_function node: its target is callable.
            memo[n] = cast(Callable[..., Any], n.target)(*args, **kwargs)
    return memo[node]


def _cone(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it reads, in topological order."""
    seen: dict[fx.Node, None] = {}

    def visit(n: fx.Node) -> None:
        if n in seen:
            return
        for a in n.all_input_nodes:
            visit(a)
        seen[n] = None

    visit(node)
    return list(seen)


def fold_constant_masks(gm: fx.GraphModule) -> None:
    """Replace a constant boolean ``attn_mask`` of ``scaled_dot_product_attention`` by what it means.

    The mask is evaluated for the captured shapes and broadcast to the scores' ``(..., L, S)``:
    all true -> no mask; ``tril`` (``L == S``) -> ``is_causal=True``.  Both are exact.  A mask whose scores are over
    ``MAX_FOLDED_MASK`` elements is not built: its meaning is read from its small parts (``masks.mask_meaning``:
    the comparison of key and query positions transformers builds).  Other masks and masks that depend on inputs
    stay.  When a mask
    was folded, constant nodes left without users (the mask's subgraph) are erased.
    """
    g = gm.graph
    constants: dict[str, torch.Tensor] = gm.meta.get(CONSTANTS, {})
    const = _constant_nodes(g, constants)
    memo: dict[fx.Node, Any] = {n: constants[n.name] for n in const if n.op == "placeholder"}
    folded = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        args = list(n.args) + [None] * (6 - len(n.args))
        q, k, mask = args[0], args[1], args[3] if args[3] is not None else n.kwargs.get("attn_mask")
        causal = args[5] if args[5] is not None else n.kwargs.get("is_causal", False)
        if mask not in const or causal or mask.meta["val"].dtype != torch.bool:
            continue
        scores = tuple(q.meta["val"].shape[:-1]) + (k.meta["val"].shape[-2],)
        L, S = scores[-2], scores[-1]
        try:
            if math.prod(scores) > MAX_FOLDED_MASK:  # too large to build: read its meaning from its parts
                if torch.broadcast_shapes(tuple(mask.meta["val"].shape), scores) != scores:
                    continue
                meaning = mask_meaning(mask, lambda c: _evaluate(c, memo), MAX_FOLDED_MASK)
            else:  # judged as evaluated, not expanded: a GPT-2 mask expanded to batch x heads x 1024 x 1024 took 0.25 s
                m = _evaluate(mask, memo)
                m.expand(scores)  # a view: checks the mask broadcasts to the scores
                meaning = judged(m, L, S)
        except (RuntimeError, NotImplementedError, TypeError):  # an op that cannot run here: keep the mask
            continue
        if meaning is None:
            continue
        is_causal = meaning == CAUSAL
        kwargs = {key: v for key, v in n.kwargs.items() if key not in ("attn_mask", "dropout_p", "is_causal")}
        dropout_p = args[4] if args[4] is not None else n.kwargs.get("dropout_p", 0.0)
        n.args = (q, k, args[2], None, dropout_p, is_causal)
        n.kwargs = kwargs
        folded += 1
    if not folded:
        return
    for dead in reversed(list(g.nodes)):
        if dead in const and dead.op == "call_function" and not dead.users and not _mutates(dead):
            g.erase_node(dead)
    g.lint()
    gm.recompile()


def means_to_sums(gm: fx.GraphModule) -> None:
    """Rewrite means into sums divided by a count (exact in fp32 up to rounding).

    One walk in node order hands each node to the rewrite of its family.  One walk, not one pass
    per family: the new nodes are then created in graph order, and their names (which plans
    record) stay those of a single walk whatever families a model mixes.
    """
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or _data_dependent(n):
            continue
        if n.target in (aten.mean.default, aten.mean.dim):
            _mean_to_sum(g, n)
        elif n.target is aten.mse_loss.default:
            _mse_mean_to_sum(g, n)
        elif n.target is aten.cross_entropy_loss.default:
            _cross_entropy_mean_to_sum(g, n)
    g.lint()
    gm.recompile()


def _data_dependent(n: fx.Node) -> bool:
    """Whether an argument of ``n`` has a size that depends on values: its count is known only at run time, so a
    mean of it stays a mean."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(a.meta.get("val")) for a in n.all_input_nodes)


def _mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """``mean(x, dims)`` of a floating-point ``x`` (no ``dtype``) -> ``sum(x, dims) / count``."""
    x = n.args[0]
    assert isinstance(x, fx.Node)
    shape = tuple(x.meta["val"].shape)
    dims: Any  # a list of ints, as fx recorded it
    keep: Any
    if n.target is aten.mean.default:
        dims, keep = list(range(len(shape))), False
    else:
        dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else list(range(len(shape)))
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    dtype = n.kwargs.get("dtype")
    if dtype is not None or not x.meta["val"].dtype.is_floating_point:
        return
    count = math.prod(shape[d] for d in dims) if shape else 1
    with g.inserting_before(n):
        s = _call(g, aten.sum.dim_IntList, (x, list(dims), keep), like=n)
        d = _call(g, aten.div.Tensor, (s, float(count)), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)


def _mse_mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """``mse_loss(x, y, reduction=mean)`` -> ``mse_loss(x, y, reduction=sum) / numel(x)``."""
    if (n.args[2] if len(n.args) > 2 else n.kwargs.get("reduction", 1)) != 1:
        return
    x, y = n.args[0], n.args[1]
    assert isinstance(x, fx.Node)
    count = math.prod(x.meta["val"].shape)
    with g.inserting_before(n):
        total = _call(g, aten.mse_loss.default, (x, y, 2), like=n)
        d = _call(g, aten.div.Tensor, (total, float(count)), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)


class _GraphCount:
    """``ir.losses.class_count``'s operations as aten nodes added to ``g`` before the node being rewritten
    (with ``like``'s metadata)."""

    def __init__(self, g: fx.Graph, like: fx.Node) -> None:
        self.g, self.like = g, like

    def ne(self, x: fx.Node, value: int) -> fx.Node:
        return _call(self.g, aten.ne.Scalar, (x, value), like=self.like)

    def sum(self, x: fx.Node) -> fx.Node:
        return _call(self.g, aten.sum.default, (x,), like=self.like)


def _cross_entropy_mean_to_sum(g: fx.Graph, n: fx.Node) -> None:
    """Unweighted, unsmoothed ``cross_entropy_loss(x, labels, reduction=mean)`` ->
    ``cross_entropy_loss(..., reduction=sum) / count of labels != ignore_index``."""
    args = list(n.args) + [None] * (6 - len(n.args))
    x, y, weight, reduction, ignore_index, smoothing = args[:6]
    weight = n.kwargs.get("weight", weight)
    reduction = n.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = n.kwargs.get("ignore_index", IGNORE_INDEX if ignore_index is None else ignore_index)
    smoothing = n.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
    if reduction != 1 or weight is not None or smoothing:
        return
    assert isinstance(y, fx.Node)
    if not isinstance(y.meta["val"], torch.Tensor) or y.meta["val"].dtype.is_floating_point:
        return  # probability targets: leave the mean
    with g.inserting_before(n):
        total = _call(g, aten.cross_entropy_loss.default, (x, y, None, 2, ignore_index), like=n)
        assert isinstance(ignore_index, int)
        cnt = class_count(y, ignore_index, _GraphCount(g, n))
        d = _call(g, aten.div.Tensor, (total, cnt), like=n)
    n.replace_all_uses_with(d)
    g.erase_node(n)


# A returned sum may be divided or multiplied by a constant (the mean's ``/ count``) before it is returned.
SCALINGS = (aten.div.Tensor, aten.mul.Tensor)
RETURNED_SUM = "soybean_returned_sum"  # the ``node.meta`` key ``mark_returned_sums`` sets


def mark_returned_sums(gm: fx.GraphModule) -> None:
    """Mark (``node.meta[RETURNED_SUM]``) every value whose sum over the devices, where a plan leaves it partial,
    is a returned sum: the value has no other reader, and its reader is the output, or a scaling by a constant
    whose only reader is the output.  Nothing in the program reads such a sum, so a generated program starts its
    all-reduce asynchronously (the scaling moved before it: ``(sum_k x_k) / c = sum_k (x_k / c)``) and it arrives
    while backward runs.  Decided here once: the planning graph prices these reads with the backend's calls
    (``graph.Edge.lazy``) and lowering makes exactly them asynchronous (``codegen.lower._lazy_output_sums``).
    An analysis, not a rewrite: it runs after ``PASSES``, whichever were given."""
    for n in gm.graph.nodes:
        if len(n.users) != 1:
            continue
        (user,) = n.users
        if user.op == "output" or (
            user.target in SCALINGS and len(user.args) == 2 and not user.kwargs and user.args[0] is n
            and isinstance(user.args[1], (int, float)) and len(user.users) == 1
            and next(iter(user.users)).op == "output"
        ):
            n.meta[RETURNED_SUM] = True


# ---- the pipeline --------------------------------------------------------------------------


class Pass(NamedTuple):
    """One rewrite of a captured graph: ``run(gm)`` edits ``gm`` in place."""

    name: str
    run: Callable[[fx.GraphModule], None]
    purpose: str  # one line


# Run in this order by ``run_passes`` (the module docstring lists them alike).  The order matters:
# a region's nodes must be inlined before the later passes can see them.
PASSES: tuple[Pass, ...] = (
    Pass("inline_empty_constants", inline_empty_constants, "empty tensor constants -> aten.empty in the graph"),
    Pass("inline_grad_regions", inline_grad_regions, "inline torch.no_grad() regions, their float outputs detached"),
    Pass("drop_assertions", drop_assertions, "erase _assert_tensor_metadata calls and set_(x, x) (no effect)"),
    Pass("functionalize", functionalize, "in-place updates of values forward made -> out-of-place ops"),
    Pass("fold_constant_masks", fold_constant_masks, "constant causal/all-true attention masks -> is_causal or none"),
    Pass("means_to_sums", means_to_sums, "mean, mse_loss(mean), cross_entropy(mean) -> sum / count"),
    Pass("fuse_routed_experts", fuse_routed_experts, "routed experts (sort, grouped matmuls, combine) -> one op"),
)


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass] | None = None) -> None:
    """Run ``passes`` on ``gm`` in order; ``None`` means ``PASSES`` (read at call time)."""
    for p in PASSES if passes is None else passes:
        p.run(gm)
