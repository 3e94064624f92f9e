"""Plan: the chosen tiling of every tensor, as versioned, deterministic JSON.

The JSON is what users read and diff and what the runtime executes:
``params`` (FQN -> one placement string per mesh axis), ``inputs``, ``nodes``
(every op's input and output tilings), the modelled ``cost``, the
``baselines``, and the ``solver`` record.  Keys are sorted and floats rounded,
so the same model, inputs and options give the same bytes; the one wall-clock
field, ``solver.seconds``, is rounded to 0.1 s.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .tiling import Placement, R, parse_placement

SCHEMA_VERSION = 1


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
    nodes: dict[str, dict[str, list[list[Any]]]]  # "in"/"out": placement strings; "grad_partial": mesh axes
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
    # the modelled per-device peak by what holds it (``planner.memory_breakdown``), bytes
    memory: dict[str, float] = field(default_factory=dict)
    precision: str = "fp32"  # the policy it computes under (``soybean.precision``)
    recompute: list[str] = field(default_factory=list)  # layers whose forward reruns in backward
    # the collective algorithms allowed (``auto``: the cheapest of every one; or one forced), and every reshard
    # step's collectives with the algorithm each runs (``planner.reshard_records``)
    collectives: str = "auto"
    reshards: list[dict[str, Any]] = field(default_factory=list)
    # every op node's [name, structural key] (``capture.structural_keys``), in the order of the graph it was planned
    # on: how ``aligned`` finds a node in another process's capture of the same model, whose node names may follow
    # another order, and the order every rank lowers its ops in (``codegen.lower.walk_order``)
    keys: list[list[str]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def aligned(self, keys: dict[str, str]) -> Plan:
        """This plan with its ``nodes`` named as in a graph whose node keys are ``keys`` (``Captured.keys``).

        A process captures a model's independent computations in the order its forward runs them, which Python's
        ``set`` iteration can change from one process to the next; node names follow that order.  Nodes are matched
        by structural key (two nodes with one key compute the same value, matched in order), and a reshard point
        ``name:k`` follows its producer.  Raises ``ValueError`` when the graphs compute different things."""
        if not self.keys or all(keys.get(n) == k for n, k in self.keys):
            return self
        mine: dict[str, list[str]] = {}
        for n, k in self.keys:
            mine.setdefault(k, []).append(n)
        theirs: dict[str, list[str]] = {}
        for n, k in keys.items():
            theirs.setdefault(k, []).append(n)
        rename: dict[str, str] = {}
        for k, names in mine.items():
            there = theirs.get(k, [])
            if len(there) < len(names):
                raise ValueError(f"plan was made for another model: its node {names[0]} computes nothing this graph "
                                 "computes: re-run `soybean plan` for this model and batch")
            rename.update(zip(names, there))

        def local(name: str) -> str:
            src, colon, k = name.rpartition(":")
            return f"{rename.get(src, src)}:{k}" if colon else rename.get(name, name)

        nodes = {local(n): rec for n, rec in self.nodes.items()}
        return replace(self, nodes=nodes, keys=[[rename.get(n, n), k] for n, k in self.keys])

    # ---- placements as objects ----
    def param_tiling(self, fqn: str) -> tuple[Placement, ...]:
        """The stored tiling of a parameter or buffer (replicated when the plan does not list it)."""
        return self._tiling(self.params, fqn)

    def algorithms(self) -> dict[tuple[str, int, int, str], tuple[str, int]]:
        """(collective, mesh axis, message bytes, phase) -> (algorithm, lp chunks), from ``reshards``: what a
        generated program runs for each collective (one a plan does not list runs the backend's call).  The phase
        tells a forward all-reduce (any algorithm) from a backward one of the same size, which is the gradient sync
        and always the backend's."""
        return {(r["collective"], r["axis"], r["bytes"], r["phase"]): (r["algorithm"], r["chunks"])
                for r in self.reshards}

    def input_tiling(self, name: str) -> tuple[Placement, ...]:
        """The tiling of a user input (replicated when the plan does not list it)."""
        return self._tiling(self.inputs, name)

    def _tiling(self, names: dict[str, list[str]], key: str) -> tuple[Placement, ...]:
        return tuple(parse_placement(s) for s in names[key]) if key in names else (R,) * len(self.mesh)

    def grad_partial_axes(self, name: str) -> tuple[int, ...]:
        """The axes over which reshard point ``name`` sums partial gradients (empty if none)."""
        return tuple(int(a) for a in self.nodes[name].get("grad_partial", [[]])[0])

    def node_tilings(self, name: str) -> tuple[list[tuple[Placement, ...]], list[tuple[Placement, ...]]]:
        rec = self.nodes[name]

        def conv(ts: list[list[str]]) -> list[tuple[Placement, ...]]:
            return [tuple(parse_placement(s) for s in t) for t in ts]

        return conv(rec["in"]), conv(rec["out"])

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
    def load(path: str | Path) -> Plan:
        try:
            return Plan.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"cannot read plan {path}: {e}") from e
