"""Parts of a captured graph on device groups: what pipeline stages and placed regions both are.

A *part* is a piece of a capture run as one program on its own group of devices: the op nodes assigned to it, its
own ``Captured`` (``sub_capture``: the planner, codegen and ``ParallelModule`` work on a part as on a model), the
whole-graph values it *takes* (its boundary inputs) and *returns* (what another part reads), and the parameters it
reads (``Part.trained``).  ``split`` cuts a capture by an assignment of op nodes to parts (node lists, in an order
where a part reads only earlier ones' values); ``run_parts`` runs the parts one after the other, the serial
meaning the tests check against the whole graph, forward and backward.

An op node assigned to no part is *copied*: computed inside every part that reads it (a weight's transpose, a mask
made from the inputs; it may read only placeholders and other copied nodes).  Parameters and buffers are
placeholders of every part that reads them: a trained weight several parts read is a copy in each, and the copies
stay equal to the serial weight only when each is stepped with the sum of every reader's gradient
(``shared_params``; the runtime sums them once per step, ``checkpoint_view.PartsModule._sum_tied_grads``).

Two schedules differ in how values reach a part, and nothing else: a pipeline's stages (``stages.py``) run
microbatched, each stage handing the next one every value a later stage reads (``relay``: passed through when it
came in, so the first stage takes the model's own inputs); placed regions (``regions.py``) run at the same time on
disjoint groups, each taking what it reads from whichever region made it.

A value crossing from one group to another is priced once, here: its bytes as the program makes it
(``value_facts``, ``boundary_bytes``) and its messages (``ir.transfers``' pairs, the busiest rank's one after the
other), forward and its gradient back, each ``alpha + bytes * beta`` of a link of the profile (``crossing_s``).  A
shared weight's gradient sum across groups is ``tie_s``.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
from torch import fx
from torch.utils._pytree import tree_map

from ..capture.core import Captured, structural_keys
from ..cost.profiles import Profile
from ..ir.transfers import backward_pairs, busiest, forward_pairs
from ..precision import policy


@dataclass
class Part:
    """A piece of a capture on a device group (module docstring): the op nodes assigned to it (graph order), its
    capture, the whole-graph values it takes (in its capture's input order) and returns, and whether it is the
    last part (it returns the model's outputs)."""

    nodes: tuple[str, ...]
    cap: Captured
    takes: list[str]
    returns: list[str]
    final: bool

    @property
    def trained(self) -> set[str]:
        """The trained parameters (FQNs) this part reads."""
        return {f for f in self.cap.params.values() if f not in self.cap.frozen}


P = TypeVar("P", bound=Part)


def as_kind(part: Part, kind: type[P], **extra: Any) -> P:
    """``part`` as a ``kind`` (a subclass of ``Part``), with that kind's own fields ``extra``."""
    return kind(**{f.name: getattr(part, f.name) for f in fields(Part)}, **extra)


def copied_reads(cap: Captured, nodes: Sequence[str], copied: set[str]) -> set[str]:
    """The ``copied`` nodes that ``nodes`` read, transitively: computed inside their part."""
    by_name = {n.name: n for n in cap.graph.nodes}
    out: set[str] = set()
    stack = list(nodes)
    while stack:
        for a in by_name[stack.pop()].all_input_nodes:
            if a.name in copied and a.name not in out:
                out.add(a.name)
                stack.append(a.name)
    return out


def _assigned(cap: Captured, pieces: Sequence[Sequence[str]]) -> tuple[dict[str, int], set[str]]:
    """Each assigned node's part (the output node the last part's) and the copied nodes (op nodes in no piece)."""
    part_of = {n: k for k, piece in enumerate(pieces) for n in piece}
    out_node = next(n for n in cap.graph.nodes if n.op == "output")
    part_of.setdefault(out_node.name, len(pieces) - 1)
    copied = {n.name for n in cap.graph.nodes if n.op not in ("placeholder", "output") and n.name not in part_of}
    return part_of, copied


def params_read(cap: Captured, nodes: Sequence[str], copied: set[str]) -> dict[str, tuple[int, int]]:
    """The trained parameters (FQNs) that ``nodes`` read, directly or through the ``copied`` nodes computed with
    them, each with where it is first read (its reader's place in the graph, the argument's place among the
    reader's inputs), in that order."""
    mine = {*nodes, *copied_reads(cap, nodes, copied)}
    out: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(cap.graph.nodes):
        if n.name in mine and n.op not in ("placeholder", "output"):
            for j, a in enumerate(n.all_input_nodes):
                fqn = cap.params.get(a.name)
                if fqn is not None and fqn not in cap.frozen:
                    out.setdefault(fqn, (i, j))
    return out


def shared_params(cap: Captured, pieces: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """The trained parameters that two or more of the parts ``pieces`` (``split``'s assignment) read, by FQN in
    first-read order, and those parts, ascending: the serial gradient of such a weight is the sum of every reader's,
    so its copies stay equal only when each is stepped with that sum."""
    _, copied = _assigned(cap, pieces)
    readers: dict[str, list[int]] = {}
    first: dict[str, tuple[int, int]] = {}
    for k, piece in enumerate(pieces):
        for fqn, at in params_read(cap, piece, copied).items():
            readers.setdefault(fqn, []).append(k)
            first[fqn] = min(first.get(fqn, at), at)
    return {fqn: ks for fqn, ks in sorted(readers.items(), key=lambda kv: first[kv[0]]) if len(ks) > 1}


def split(cap: Captured, pieces: Sequence[Sequence[str]], tag: str = "part", relay: bool = False) -> list[Part]:
    """The parts of ``cap`` for ``pieces`` (each part's op nodes; an op node in none is copied into its readers;
    a part reads only earlier parts' values; the last part returns the model's outputs).  ``relay`` (a pipeline's
    stages): the first part takes the model's inputs and each later part exactly what the one before returned,
    which is every value made so far that a later part reads; otherwise a part takes each value it reads from the
    model's inputs or the part that made it, and returns the values of its own that another part reads.  ``tag``
    names the parts in their captures' fingerprints (``"stage"``, ``"region"``)."""
    nodes = list(cap.graph.nodes)
    by_name = {n.name: n for n in nodes}
    state = {n.name for n in nodes if n.op == "placeholder" and (n.name in cap.params or n.name in cap.buffers)}
    inputs = [n.name for n in nodes if n.op == "placeholder" and n.name not in state]
    part_of, copied = _assigned(cap, pieces)
    wrong = [n for n in sorted(copied) if any(a.name in part_of for a in by_name[n].all_input_nodes)]
    if wrong:
        raise ValueError(f"{wrong[:5]} are in no part but read a part's values: give every such node a part")
    last = len(pieces) - 1
    out_name = next(n.name for n in nodes if n.op == "output")
    own = [[*piece, *([out_name] if k == last else [])] for k, piece in enumerate(pieces)]
    members = [{*mine, *copied_reads(cap, mine, copied)} for mine in own]
    readers: dict[str, set[int]] = {}
    for k, mine in enumerate(members):
        for name in mine:
            for a in by_name[name].all_input_nodes:
                if a.name not in state and a.name not in mine:
                    readers.setdefault(a.name, set()).add(k)
    out: list[Part] = []
    carried = inputs  # what the previous stage returned (relay)
    made = {n: 0 for n in inputs} | {n: k for n, k in part_of.items() if n != out_name}  # each value's part
    for k, piece in enumerate(pieces):
        final = k == last
        if relay:
            takes = carried
            returns = [] if final else [n.name for n in nodes if n.name in made and made[n.name] <= k
                                        and max(readers.get(n.name, {-1})) > k]
            carried = returns
        else:
            taken = {a.name for name in members[k] for a in by_name[name].all_input_nodes
                     if a.name not in members[k] and a.name not in state and a.name not in copied}
            takes = [n.name for n in nodes if n.name in taken]
            returns = [] if final else [n for n in piece if any(r != k for r in readers.get(n, ()))]
        sub = sub_capture(cap, f"{tag} {k}", members[k], takes, returns, final, relay and k == 0)
        out.append(Part(tuple(piece), sub, list(takes), list(returns), final))
    return out


def sub_capture(cap: Captured, tag: str, members: set[str], takes: Sequence[str], returns: Sequence[str],
                last: bool, first: bool = False) -> Captured:
    """The capture of a piece of ``cap`` (a part): the op nodes ``members``, copied once each in graph order with
    their metadata, after the state placeholders they read (the capture's order) and one placeholder per value of
    ``takes``.  It returns the model's outputs when ``last``, else the values ``returns``; ``first``: it takes the
    model's own inputs, so it keeps their structure (``in_spec``)."""
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


def run_parts(cap: Captured, parts: Sequence[Part], state: dict[str, torch.Tensor], inputs: Sequence[Any]) -> Any:
    """The parts run one after the other (the serial meaning of a plan in parts, stages or regions): ``state`` by
    FQN, ``inputs`` the capture's flat user inputs; the last part's outputs."""
    values: dict[str, Any] = dict(zip(cap.inputs, inputs))
    got: Any = None
    for p in parts:
        got = p.cap.graph_module(*p.cap.feed(state), *(values[t] for t in p.takes))
        if not p.final:
            values.update(zip(p.returns, got))
    return got


# ---- the facts of a value, and its price across groups ------------------------------------------------------

Facts = Mapping[str, tuple[int, bool]]


def value_facts(cap: Captured) -> dict[str, tuple[int, bool]]:
    """Every tensor value of ``cap``: its bytes as the program makes it (the precision policy's cast of parameters
    and inputs) and whether autograd tracks it (it derives from a trained parameter, so a part boundary sends its
    gradient back), from one run of the graph on the meta device; where an op cannot run there (it reads data, as
    mixture-of-experts routing does), the capture's own shapes, with a gradient for every floating value.  Computed
    once per call: a caller that prices many parts of one capture keeps the result (``StageCosts.facts``)."""
    cast = policy(cap.precision).cast
    holders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    args = []
    for n in holders:
        t = meta_like(n.meta["val"])
        if isinstance(t, torch.Tensor):
            trains = n.name in cap.params and cap.params[n.name] not in cap.frozen and t.is_floating_point()
            t = cast(t.requires_grad_(trains))
        args.append(t)
    try:
        run = OnMeta(cap.graph_module)
        run.run(*args)
        return run.facts
    except (NotImplementedError, RuntimeError):  # an op that reads data (MoE routing's counts): the capture's shapes,
        facts = {}                                # and a gradient for every floating value
        for n in cap.graph.nodes:
            if isinstance(v := n.meta.get("val"), torch.Tensor):
                facts[n.name] = (v.numel() * (cast(meta_like(v)).element_size()), v.is_floating_point())
        return facts


def boundary_bytes(facts: Facts, names: Sequence[str]) -> tuple[int, int]:
    """Bytes of the tensor values ``names`` (``value_facts``) sent once forward, and of those whose gradient comes
    back."""
    fwd = sum(facts[n][0] for n in names if n in facts)
    return fwd, sum(facts[n][0] for n in names if n in facts and facts[n][1])


# How a value crosses groups, by who sends it: ``"schedule"``, torch's pipeline schedule (``PipelineStage``'s
# point-to-point sends, priced at the profile's own alpha-beta); ``"p2p"``, soybean's moves (``runtime.transfer``,
# the profile's calibrated ``p2p`` figure at the message's size).
LINKS = ("schedule", "p2p")


def link_ab(profile: Profile, link: str, nbytes: int) -> tuple[float, float]:
    """``alpha, beta`` of one message of ``nbytes`` on ``link`` (``LINKS``)."""
    if link == "p2p":
        return profile.ab(0, "p2p", m=float(nbytes))
    if link == "schedule":
        return profile.alpha, profile.beta
    raise ValueError(f"unknown link {link!r}: use one of {', '.join(LINKS)}")


def crossing_s(facts: Facts, names: Sequence[str], src: Sequence[int], dst: Sequence[int], profile: Profile,
               link: str) -> float:
    """Seconds the tensor values ``names`` take to cross whole from the ranks ``src`` to the ranks ``dst``, each
    one's gradient back when autograd tracks it (``value_facts``): the pairs ``ir.transfers`` defines (what the
    runtime sends), the busiest rank's messages one after the other, each ``alpha + bytes * beta`` of ``link``.  A
    pipeline stage's group hands the next group of its size one message per rank each way; a placed group hands a
    region on every device one per device outside it, and no gradient comes back (that region computes it whole
    on every device of the group already)."""
    forward, backward = busiest(forward_pairs(src, dst)), busiest(backward_pairs(src, dst))
    # messages and bytes counted exactly (integers) per link figure, each figure's seconds once
    counts: dict[tuple[float, float], list[int]] = {}
    for v in names:
        if v not in facts:
            continue
        nbytes, grad = facts[v]
        messages = forward + (backward if grad else 0)
        mine = counts.setdefault(link_ab(profile, link, nbytes), [0, 0])
        mine[0] += messages
        mine[1] += messages * nbytes
    return sum((alpha * m + sent * beta for (alpha, beta), (m, sent) in counts.items()), 0.0)


def tie_s(nbytes: int, holders: int, profile: Profile) -> float:
    """Seconds of one shared weight's gradient sum over ``holders`` participants: a ring all-reduce of its whole
    gradient (``2 (h - 1)`` messages of ``bytes / h``) on the profile's link."""
    return 2 * (holders - 1) * (profile.alpha + nbytes / holders * profile.beta)


def grad_bytes(cap: Captured) -> dict[str, int]:
    """Each parameter's gradient bytes (FQN), in the precision policy's master dtype: what a shared weight's sum
    moves."""
    master = policy(cap.precision).master
    size = torch.empty((), dtype=master).element_size() if master is not None else None
    return {cap.params[n.name]: n.meta["val"].numel() * (size or n.meta["val"].element_size())
            for n in cap.graph.nodes if n.name in cap.params}


# ---- running a graph on the meta device -----------------------------------------------------------------------


class OnMeta(fx.Interpreter):
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


def meta_like(v: Any) -> Any:
    """A meta tensor of ``v``'s shape and dtype (a non-tensor value as it is)."""
    return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

