"""Plan: the chosen tiling of every tensor, as versioned, deterministic JSON.

A plan is two things.  The **program**, what a generated program runs (``Program``, ``Plan.program``): the
devices and mesh, ``params`` (FQN -> one placement string per mesh axis), ``inputs``, ``nodes`` (every op's input
and output tilings), the input contract, precision, the recomputed units and the collective algorithm of every
reshard step, keyed by the edge and step it belongs to.  The **record**, what the planner found out: the modelled
``cost``, ``baselines``, ``solver``, ``meshes``, ``layers``, ``memory``, ``tying`` and the ``reshards`` rows.
Codegen reads only the program.  The JSON keeps both flat (its keys are a contract); keys are sorted and floats
rounded, so the same model, inputs and options give the same bytes; the one wall-clock field,
``solver.seconds``, is rounded to 0.1 s.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .tiling import Placement, R, parse_placement

SCHEMA_VERSION = 1

# (tensor, consumer, step, collective, phase): one collective of one edge's reshard, as ``reshards`` rows name it
AlgoKey = tuple[str, str, str, str, str]
Algo = tuple[str, int]  # (algorithm, lp chunk count): ``ir.algorithms.Algo``
Tiling = tuple[Placement, ...]


def _tiling(names: Mapping[str, list[str]], key: str, ndim: int) -> Tiling:
    """The tiling ``names`` lists for ``key``; replicated when it lists none."""
    return tuple(parse_placement(s) for s in names[key]) if key in names else (R,) * ndim


def _node_tilings(nodes: Mapping[str, Mapping[str, Any]], name: str) -> tuple[list[Tiling], list[Tiling]]:
    """The input and output tilings ``nodes`` records for op or reshard point ``name``."""
    rec = nodes[name]
    return ([tuple(parse_placement(s) for s in t) for t in rec["in"]],
            [tuple(parse_placement(s) for s in t) for t in rec["out"]])


def _node_variant(nodes: Mapping[str, Mapping[str, Any]], name: str) -> str:
    """The strategy variant ``nodes`` records for op ``name`` (``rules.base.Strategy1D.variant``; ``""``: plain)."""
    return str(nodes[name].get("variant", "")) if name in nodes else ""


def _grad_partial(nodes: Mapping[str, Mapping[str, Any]], name: str) -> tuple[int, ...]:
    """The axes over which reshard point ``name`` sums partial gradients (empty if none)."""
    return tuple(int(a) for a in nodes[name].get("grad_partial", [[]])[0])


def _renamer(mine: Sequence[Sequence[str]], keys: Mapping[str, str]) -> Callable[[str], str] | None:
    """How a plan whose nodes have the [name, structural key] pairs ``mine`` names them in a graph whose node keys
    are ``keys`` (``Captured.keys``); None when the names already agree.

    A process captures a model's independent computations in the order its forward runs them, which Python's
    ``set`` iteration can change from one process to the next; node names follow that order.  Nodes are matched
    by structural key (two nodes with one key compute the same value, matched in order), and a reshard point
    ``name:k`` follows its producer.  Raises ``ValueError`` when the graphs compute different things."""
    if not mine or all(keys.get(n) == k for n, k in mine):
        return None
    by_key: dict[str, list[str]] = {}
    for n, k in mine:
        by_key.setdefault(k, []).append(n)
    theirs: dict[str, list[str]] = {}
    for n, k in keys.items():
        theirs.setdefault(k, []).append(n)
    rename: dict[str, str] = {}
    for k, names in by_key.items():
        there = theirs.get(k, [])
        if len(there) < len(names):
            raise ValueError(f"plan was made for another model: its node {names[0]} computes nothing this graph "
                             "computes: re-run `soybean plan` for this model and batch")
        rename.update(zip(names, there))

    def local(name: str) -> str:
        src, colon, k = name.rpartition(":")
        return f"{rename.get(src, src)}:{k}" if colon else rename.get(name, name)

    return local


@dataclass(frozen=True)
class Program:
    """What a generated program runs (``Plan.program``): every placeholder's and op's tiling, the input contract,
    precision, the recomputed units and each reshard collective's algorithm by the edge and step it belongs to.

    ``algorithms``: (tensor, consumer, step, collective, phase) -> (algorithm, lp chunks); a collective it does not
    list runs the backend's call.  Keyed by the edge and step, so two collectives of one size that the plan runs
    differently (a returned sum's on the backend, another by ``ring``) keep their own choices."""

    devices: int
    mesh: tuple[int, ...]
    params: Mapping[str, list[str]]
    inputs: Mapping[str, list[str]]
    nodes: Mapping[str, Mapping[str, Any]]
    keys: tuple[tuple[str, str], ...] = ()
    local_batch: bool = False
    precision: str = "fp32"
    recompute: tuple[str, ...] = ()
    algorithms: Mapping[AlgoKey, Algo] = field(default_factory=dict)

    def aligned(self, keys: Mapping[str, str]) -> Program:
        """This program with its nodes named as in a graph whose node keys are ``keys`` (``_renamer``)."""
        local = _renamer(self.keys, keys)
        if local is None:
            return self
        return replace(self, nodes={local(n): rec for n, rec in self.nodes.items()},
                       keys=tuple((local(n), k) for n, k in self.keys),
                       algorithms={(local(t), local(to), st, c, ph): a
                                   for (t, to, st, c, ph), a in self.algorithms.items()})

    def param_tiling(self, fqn: str) -> Tiling:
        """The stored tiling of a parameter or buffer (replicated when the plan does not list it)."""
        return _tiling(self.params, fqn, len(self.mesh))

    def input_tiling(self, name: str) -> Tiling:
        """The tiling of a user input (replicated when the plan does not list it)."""
        return _tiling(self.inputs, name, len(self.mesh))

    def grad_partial_axes(self, name: str) -> tuple[int, ...]:
        """The axes over which reshard point ``name`` sums partial gradients (empty if none)."""
        return _grad_partial(self.nodes, name)

    def node_tilings(self, name: str) -> tuple[list[Tiling], list[Tiling]]:
        """Op or reshard point ``name``'s input and output tilings."""
        return _node_tilings(self.nodes, name)

    def node_variant(self, name: str) -> str:
        """Op ``name``'s strategy variant (``""``: the plain way to run its tilings)."""
        return _node_variant(self.nodes, name)


def _sig(x: float) -> float:
    """Round to 6 significant digits: stable across platforms, precise enough to compare."""
    return float(f"{x:.6g}")


@dataclass
class Plan:
    devices: int
    mesh: list[int]
    objective: str
    profile: str
    fingerprint: str
    params: dict[str, list[str]]
    inputs: dict[str, list[str]]
    nodes: dict[str, dict[str, Any]]  # "in"/"out": placement strings; "grad_partial": mesh axes; "variant": a name
    cost: dict[str, float]
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # bytes and seconds, or infeasible: why
    solver: dict[str, Any] = field(default_factory=dict)
    meshes: list[dict[str, Any]] = field(default_factory=list)
    fallback_ops: list[str] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    local_batch: bool = False         # inputs arrive as each rank's dim-0 slice; outputs stay tiled
    gpus_per_node: int | None = None  # the topology the plan was priced for (None: one node)
    # repeated layers solved with shared decision variables: used, runs (prefix, [first, last] layer,
    # count), variables [untied, tied]
    tying: dict[str, Any] = field(default_factory=dict)
    # the modelled per-device peak by what holds it (``records.memory_breakdown``), bytes
    memory: dict[str, float] = field(default_factory=dict)
    precision: str = "fp32"  # the policy it computes under (``soybean.precision``)
    recompute: list[str] = field(default_factory=list)  # layers whose forward reruns in backward
    # the collective algorithms allowed (``auto``: the cheapest of every one; or one forced), and every reshard
    # step's collectives with the algorithm each runs (``records.reshard_records``)
    collectives: str = "auto"
    reshards: list[dict[str, Any]] = field(default_factory=list)
    # every op node's [name, structural key] (``capture.structural_keys``), in the order of the graph it was planned
    # on: how ``aligned`` finds a node in another process's capture of the same model, whose node names may follow
    # another order, and the order every rank lowers its ops in (``codegen.lower.walk_order``)
    keys: list[list[str]] = field(default_factory=list)
    # pipeline stages (``soybean.run.pipelined``): schedule, microbatches, virtual stages per rank, and each stage's
    # layers (``units``: first and last), ranks, mesh, modelled seconds per microbatch and its own tiling plan (this
    # class's dict); None, and no ``pipeline`` key in the JSON, for a plan of one SPMD program
    pipeline: dict[str, Any] | None = None
    # branches on their own device groups (``soybean.parts.placement_plan``, ``soybean.run.placed``): every region
    # (its module prefixes ``units``, the graph's (segment, branch) pairs it runs, its ranks and mesh, modelled
    # seconds, what it sends and its own tiling plan), every placed segment's choice and the number of groups; None,
    # and no ``placement`` key in the JSON, for a plan that runs every op on every device
    placement: dict[str, Any] | None = None
    # routed experts (mixture of experts; ``records.moe_records``): per MoE layer its experts, the mesh axes
    # splitting them and their degree, the axes its rows move on (all-to-all) and those left a pending sum, those
    # splitting each expert inside; no ``moe`` key in the JSON for a model without routed experts.  A plan made of
    # parts (``placement``, ``pipeline``) lists its parts' rows, each with its part's index (``part_rows``)
    moe: list[dict[str, Any]] = field(default_factory=list)
    # attention split along the query sequence (``records.context_parallel_records``): per op its method, mesh axes
    # and degree; no ``context_parallel`` key in the JSON when no attention is split so (a plan of parts: as ``moe``)
    context_parallel: list[dict[str, Any]] = field(default_factory=list)
    # a model torch.export could not capture, captured by dynamo in pieces split at graph breaks
    # (``soybean.run.pieces``): how (``capture``: "dynamo"), why (``why``: export's error), and per piece (``graphs``)
    # its fingerprint, op count, parameters (the piece's slot -> the model's name) and its own tiling plan (this
    # class's dict); None, and no ``pieces`` key in the JSON, for a plan of one captured graph
    pieces: dict[str, Any] | None = None
    # how split non-scalar outputs were priced (``options.OUTPUTS``): ``lazy``, left split along dim 0 where cheaper
    # (the tilings under ``nodes["output"]``), or ``full``, gathered whole (a plan saved before the option)
    outputs: str = "full"
    # microbatches whose activations a device holds at once (``PlanOptions.inflight``: a pipeline stage's plan),
    # each op's kept bytes priced that many times in ``memory``; no ``inflight`` key in the JSON for 1
    inflight: int = 1
    schema_version: int = SCHEMA_VERSION

    @property
    def program(self) -> Program:
        """What runs (``Program``), apart from the record; each collective's algorithm from the ``reshards`` rows."""
        return Program(self.devices, tuple(self.mesh), self.params, self.inputs, self.nodes,
                       tuple((n, k) for n, k in self.keys), self.local_batch, self.precision, tuple(self.recompute),
                       {(r["tensor"], r["to"], r["step"], r["collective"], r["phase"]): (r["algorithm"], r["chunks"])
                        for r in self.reshards})

    def aligned(self, keys: Mapping[str, str]) -> Plan:
        """This plan with its nodes (and the ``reshards`` rows naming them) named as in a graph whose node keys are
        ``keys`` (``Captured.keys``; see ``_renamer``)."""
        local = _renamer(self.keys, keys)
        if local is None:
            return self
        return replace(self, nodes={local(n): rec for n, rec in self.nodes.items()},
                       keys=[[local(n), k] for n, k in self.keys],
                       reshards=[{**r, "tensor": local(r["tensor"]), "to": local(r["to"])} for r in self.reshards])

    def param_tiling(self, fqn: str) -> Tiling:
        """The stored tiling of a parameter or buffer (replicated when the plan does not list it)."""
        return _tiling(self.params, fqn, len(self.mesh))

    def input_tiling(self, name: str) -> Tiling:
        """The tiling of a user input (replicated when the plan does not list it)."""
        return _tiling(self.inputs, name, len(self.mesh))

    def node_tilings(self, name: str) -> tuple[list[Tiling], list[Tiling]]:
        """Op or reshard point ``name``'s input and output tilings."""
        return _node_tilings(self.nodes, name)

    def node_variant(self, name: str) -> str:
        """Op ``name``'s strategy variant (``""``: the plain way to run its tilings)."""
        return _node_variant(self.nodes, name)

    def grad_partial_axes(self, name: str) -> tuple[int, ...]:
        """The axes over which reshard point ``name`` sums partial gradients (empty if none)."""
        return _grad_partial(self.nodes, name)

    def algorithms(self) -> dict[tuple[str, int, int, str], Algo]:
        """The record's summary of the ``reshards`` rows: (collective, mesh axis, message bytes, phase) ->
        (algorithm, lp chunks), as reports and comparisons read them.  What a generated program runs is
        ``Program.algorithms`` (by edge and step): the two differ only where one size runs two ways (a returned
        sum on the backend's asynchronous call, another all-reduce of its size by ``ring``)."""
        return {(r["collective"], r["axis"], r["bytes"], r["phase"]): (r["algorithm"], r["chunks"])
                for r in self.reshards}

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = {k: _sig(v) for k, v in self.cost.items()}
        d["memory"] = {k: _sig(v) for k, v in self.memory.items()}
        d["baselines"] = {k: {kk: _sig(vv) if isinstance(vv, float) else vv for kk, vv in v.items()}
                          for k, v in self.baselines.items()}
        d["solver"] = {**self.solver, "seconds": round(float(self.solver.get("seconds", 0.0)), 1)}
        for k in ("objective", "bound", "gap"):
            if k in d["solver"]:
                d["solver"][k] = _sig(d["solver"][k])
        # A mesh solved has its optimum; one pruned unsolved has the lower bound that ruled it out.
        d["meshes"] = [{**m, **{k: _sig(m[k]) for k in ("objective", "bound") if k in m}} for m in self.meshes]
        for key in ("pipeline", "placement", "pieces"):
            if d[key] is None:
                del d[key]
        for key in ("moe", "context_parallel"):
            if not d[key]:
                del d[key]
        if d["inflight"] == 1:
            del d["inflight"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        v = d.get("schema_version")
        if v != SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {v} is not {SCHEMA_VERSION}: "
                             "re-run `soybean plan` with this soybean")
        keys = set(Plan.__dataclass_fields__)
        return Plan(**{k: d[k] for k in d if k in keys})

    @staticmethod
    def part_rows(parts: Sequence[Plan], tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ``moe`` and ``context_parallel`` rows of a plan made of ``parts`` (placed regions, pipeline stages),
        each part's rows in order, each row naming its part by index under ``tag`` (its axes are that part's)."""
        moe, cp = ([{**row, tag: i} for i, part in enumerate(parts) for row in getattr(part, key)]
                   for key in ("moe", "context_parallel"))
        return moe, cp

    @staticmethod
    def load(path: str | Path) -> Plan:
        try:
            return Plan.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"cannot read plan {path}: {e}") from e
