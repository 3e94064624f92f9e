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

Then the exported graph goes through ``passes.PASSES``, exact in-place rewrites (``soybean.capture.passes``: one
module each), and the analysis ``passes.mark_returned_sums``; the constants still read become buffers
(``constants_as_buffers``) and data-dependent sizes get the example's values (``_record_sizes``).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx import config as fx_config
from torch.utils._pytree import tree_flatten, tree_map

from ..precision import compute_inputs, compute_model, policy
from .functions import called_functions
from .passes import Pass, run_passes
from .passes.common import CONSTANTS
from .passes.fuse_routed_experts import PARAMETERS, STORED_VIEWS
from .passes.mark_returned_sums import mark_returned_sums


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
    # ``passes.fuse_routed_experts.pack_pairs``).  Whoever feeds the graph the model's tensors or hands tensors back
    # to the model goes through ``stored`` and ``unstored``.
    views: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # User inputs (placeholder names) whose example tensors require a gradient: a graph of a piece of a model (a
    # dynamo piece, ``soybean.run.pieces``; a pipeline stage; a placed region) takes activations whose gradient its
    # backward must return whole (``graph.build``: such an input needs a gradient, so partial sums are summed).
    grad_inputs: frozenset[str] = frozenset()
    # The user-defined ``torch.autograd.Function``s whose forwards the graph's ops came from (qualified names;
    # ``functions.called_functions``): the graph differentiates their forwards, not their own backwards.
    functions: tuple[str, ...] = ()

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


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """While open, fx records no stack trace on the nodes it traces (``torch.fx.config.do_not_emit_stack_traces``):
    nothing soybean reads needs them (the custom Functions are recorded as they are called: ``called_functions``),
    and extracting one per node was 15-40% of an export (a tiny T5 1.36 -> 1.12 s, Llama 0.65 -> 0.56 s).  Under
    ``EXPORT_LOCK``: one capture at a time sets and restores it."""
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _capture(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None,
             passes: Sequence[Pass] | None) -> Captured:
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        with _plain_outputs(model), called_functions() as called, _no_stack_traces():
            ep = torch.export.export(model, example_inputs, example_kwargs or {}, strict=False)
    except Exception as e:  # torch raises many types; all mean "cannot capture"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"could not capture {type(model).__name__} with torch.export (non-strict): {type(e).__name__}: {first}. "
            "Fix: make forward traceable for these example inputs (no data-dependent Python control flow on "
            "tensor values, no .item()/.tolist() on activations) or pass inputs of the shapes you will train with."
        ) from e
    functions = tuple(called)
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
                   keys=keys, views=views, grad_inputs=grad_inputs, functions=functions)
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
