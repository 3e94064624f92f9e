"""Why each tiling: a plan's modelled cost split per variable, and each variable's next-best strategy.

A plan ``x`` picks strategy ``x_v`` for every variable ``v`` of the candidate table (``graph.build``).  Its
modelled training step (``planner.evaluate``) is

    T_lin(x) = sum_v c_v[x_v] + sum_e C_e[x_src(e), x_dst(e)]                 (comm_s + compute_s)
    T(x)     = T_lin(x) - H(x),    H(x) = min(o * S(x), b * K(x))              (step_time_s; H is hidden_s)

with ``c_v`` the variable's seconds (an op's forward + backward compute and the communication inside it, a
parameter's optimizer step), ``C_e`` an edge's reshard seconds forward + backward, ``S`` the deferred gradient
syncs' seconds, ``K`` the ops' compute, ``o`` the profile's ``grad_overlap`` and ``b`` ``planner.BACKWARD_SHARE``.

A *row* is one variable with every edge into it (each edge assigned to its consumer):

    row_v = c_v[x_v] + sum_{e: dst(e) = v} C_e[x_src(e), x_v],       so   sum_v row_v = T_lin(x)   exactly,

and ``T = sum_v row_v - H``.  A row's communication is split into its collectives, each ``forward``,
``backward``, ``rerun`` (the forward again while a recomputed layer reruns) or ``write-back``, priced term by
term as ``cost.collectives.reshard_cost`` and ``op_comm_costs`` price them (their sum is the table's figure).

The *next best* of ``v`` is the strategy ``t != x_v`` that minimises the plan's objective with every other
variable held at the plan's choice (``x' = x`` but ``x'_v = t``).  Only ``c_v`` and the edges at ``v`` change,
and ``S``, ``K`` (and the memory's rerun term, ``graph.rerun_freed``) by their terms there, so

    delta(t) = value(x') - value(x)

is exact and computed locally.  ``value`` is ``T`` for objective ``time``; for ``comm`` it is the search's
objective, edge bytes + ``T_lin`` (seconds only break ties; ``planner.problem.to_problem``).  For a plan solved to
optimality, ``delta >= 0`` up to the solver's gap over the plans the search considered (with tied layers
the layers change together, ``search.tying``), while the plan's overlap credit is uncapped (``H = o S``;
otherwise the plan is optimal only within the capped part, ``planner.solve_table_on``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..capture.core import Captured
from ..cost.collectives import choose, op_call_cost, op_comm_calls, route_calls
from ..cost.compute import op_seconds
from ..cost.memory import fmt_memory
from ..cost.profiles import Profile, load_profile
from ..graph import (
    OUTPUT,
    Edge,
    PlanGraph,
    Var,
    build,
    edge_profile,
    freed_after,
    phase_memory,
    phase_peaks,
    rerun_freed,
    value_name,
)
from ..mesh import Mesh
from ..plan import Plan
from ..planner.baselines import batch_split
from ..planner.core import with_collectives
from ..planner.records import own_step
from ..planner.solve import BACKWARD_SHARE, Result, evaluate
from ..reshard import Route
from ..search import Solution
from ..tiling import R, fmt


@dataclass(frozen=True)
class Collective:
    """One collective a row pays for, per device per training step."""

    step: str          # what runs: ``all_gather[axis 0 dim 1]``, ``reduce_scatter[axis 0 dim 1] (for all_gather)``
    collective: str    # all_gather | reduce_scatter | all_reduce | all_to_all | halo
    phase: str         # forward | backward | rerun | write-back
    value: str         # the tensor it moves (its producer), "" for communication inside the op
    bytes: float
    seconds: float
    sync: bool = False  # a deferred gradient sync, which may run hidden behind backward (``H``)
    algorithm: str = "backend"  # how it runs (``runtime.algorithms``; ``cost.collectives.choose``)


@dataclass(frozen=True)
class Alternative:
    """The next-best strategy of a row, every other variable held: its change of the plan's figures."""

    strategy: str
    delta: float         # the change of the plan's objective: seconds (time) or bytes + seconds (comm)
    step_time_s: float   # the change of the modelled step time ``T``
    comm_bytes: float    # the change of the bytes sent per device per step
    memory: float        # the change of the modelled per-device peak


@dataclass
class Row:
    """One variable of the plan with the edges into it: ``total_s = compute_s + comm_s`` is ``row_v``."""

    index: int
    name: str
    kind: str                 # param | buffer | input | op | reshard | output
    label: str                # a parameter's FQN, an op's module path
    module: str               # the module it belongs to (a parameter: its owner)
    op: str                   # the aten op ("" for none)
    strategy: str
    compute_s: float
    comm_s: float
    comm_bytes: float
    memory: float             # bytes per device in the plan's peak phase (``Explanation.memory_phase``)
    collectives: list[Collective] = field(default_factory=list)
    alternative: Alternative | None = None

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class Explanation:
    """A plan's rows and the totals ``planner.evaluate`` gives it on its table."""

    plan: Plan
    graph: PlanGraph
    choice: list[int]
    rows: list[Row]
    result: Result
    # The phase whose peak is the plan's memory (``graph.phase_peaks``), in which the rows' memory is given, and
    # what that phase's sum over-counts (``graph.rerun_freed``): sum of rows' memory - freed = the peak.
    memory_phase: str = "activations"
    memory_freed: float = 0.0

    @property
    def total_s(self) -> float:
        """``T_lin = comm_s + compute_s``: the rows' sum."""
        return self.result.comm_s + self.result.compute_s

    @property
    def step_time_s(self) -> float:
        """``T = T_lin - hidden_s``."""
        return self.result.step_time_s


# ---- the plan's table and its choice in it ----

def plan_table(cap: Captured, plan: Plan, profile: Profile | None = None) -> PlanGraph:
    """The full candidate table of ``cap`` on the plan's mesh, built as ``planner.plan`` builds it in mode
    ``auto`` (the plan's objective, recomputed units, microbatches in flight, input contract and collective
    algorithms; ``profile``: default the plan's)."""
    mesh = Mesh(tuple(plan.mesh))
    prof = with_collectives(profile if profile is not None else _load(plan.profile), plan.collectives)
    if plan.moe:  # routed experts priced at the plan's routing imbalance
        prof = replace(prof, expert_imbalance=float(plan.moe[0].get("imbalance", 1.0)))
    return build(cap, mesh, prof.on_mesh(mesh, plan.gpus_per_node), objective=plan.objective,
                 domains=batch_split(cap, mesh) if plan.local_batch else None, local_outputs=plan.local_batch,
                 lazy_outputs=plan.outputs == "lazy", recompute=frozenset(plan.recompute), inflight=plan.inflight)


def _load(name: str) -> Profile:
    try:
        return load_profile(name)
    except ValueError as e:
        raise ValueError(f"{e} (the plan's profile {name!r}; give it with --profile)") from None


def plan_choice(g: PlanGraph, plan: Plan) -> list[int]:
    """The plan's strategy index for every variable of ``g``, matched by tilings (as ``graph.build(fixed=plan)``
    reads them: a placeholder's stored tiling, an op's input and output tilings, a reshard point's tiling and
    partial-gradient axes); ``ValueError`` when the table has no such strategy."""
    n = g.mesh.ndim
    choice: list[int] = []
    for v in g.vars:
        if v.kind in ("param", "buffer"):
            want: tuple = (((), (plan.param_tiling(v.fqn),), ""), ())
        elif v.kind == "input":
            want = (((), (plan.input_tiling(v.name),), ""), ())
        elif v.kind == "output":  # whole (the first strategy) unless the plan left some output split
            want = ((tuple(plan.node_tilings(OUTPUT)[0]), (), ""), ()) if OUTPUT in plan.nodes else _key(v, 0)
        else:
            full = (R,) * n
            ins, outs = plan.node_tilings(v.name) if v.name in plan.nodes else (
                [full] * len(v.strategies[0].inputs), [full] * len(v.strategies[0].outputs))
            pga = plan.grad_partial_axes(v.name) if v.kind == "reshard" and v.needs_grad and v.name in plan.nodes \
                else ()
            want = ((tuple(ins), tuple(outs), plan.node_variant(v.name)), tuple(pga))
        keys = [_key(v, c) for c in range(len(v.strategies))]
        try:
            choice.append(keys.index(want))
        except ValueError:
            raise ValueError(f"the plan's tiling of {v.name} is not among the table's strategies: was the plan "
                             "made for this model, with this soybean?") from None
    return choice


def _key(v: Var, c: int) -> tuple:
    st = v.strategies[c]
    return (st.inputs, st.outputs, st.variant), tuple(v.grad_partial[c]) if v.kind == "reshard" else ()


# ---- rows ----

def explain(cap: Captured, plan: Plan, profile: Profile | None = None) -> Explanation:
    """Every variable's row and next-best alternative under ``plan`` (module docstring)."""
    plan = plan.aligned(cap.keys)  # named as this capture names its nodes
    g = plan_table(cap, plan, profile)
    return explain_table(g, plan_choice(g, plan), plan)


def explain_table(g: PlanGraph, choice: list[int], plan: Plan) -> Explanation:
    """``explain`` on a table already built and the plan's ``choice`` in it."""
    result = evaluate(g, Solution(list(choice), 0.0, 0.0, "given", 0.0, "plan"))
    ins: list[list[Edge]] = [[] for _ in g.vars]
    outs: list[list[Edge]] = [[] for _ in g.vars]
    for e in g.edges:
        ins[e.dst].append(e)
        outs[e.src].append(e)
    totals = _Totals(g, choice)
    rows = []
    for vi, v in enumerate(g.vars):
        c = choice[vi]
        op_b, op_s = (float(v.op_comm[c, 0]), float(v.op_comm[c, 1])) if v.op_comm is not None else (0.0, 0.0)
        terms = [t for e in ins[vi] for t in edge_collectives(g, e, choice[e.src], c)]
        if v.op_comm is not None and op_b:
            terms += op_collectives(g, v, c, _grads(v, ins[vi]), any(e.rerun for e in ins[vi]))
        rows.append(Row(
            vi, v.name, v.kind, v.fqn if v.kind in ("param", "buffer") else v.module or v.fqn or v.name,
            _module_of(g, vi, ins[vi]), v.op.name if v.op is not None and v.kind == "op" else "",
            strategy_text(v, c), float(v.compute_s[c]) - op_s,
            op_s + sum(float(e.seconds[choice[e.src], c]) for e in ins[vi]),
            op_b + sum(float(e.bytes[choice[e.src], c]) for e in ins[vi]),
            float(phase_memory(v, totals.phase)[c]), terms,
            next_best(g, vi, choice, ins[vi], outs[vi], totals, plan.objective)))
    return Explanation(plan, g, list(choice), rows, result, totals.phase,
                       totals.freed if totals.phase == "activations" else 0.0)


INPUTS, OUTPUTS, MODEL = "(inputs)", "(outputs)", "(model)"


def _module_of(g: PlanGraph, vi: int, ins: list[Edge]) -> str:
    """The module a row belongs to: an op's innermost module (``MODEL`` for the model's own ``forward``), a
    parameter's owner, a reshard point's producer's; the user inputs and the graph output have their own."""
    v = g.vars[vi]
    if v.kind == "input":
        return INPUTS
    if v.kind == "output":
        return OUTPUTS
    if v.kind in ("param", "buffer"):
        return v.fqn.rpartition(".")[0] or MODEL
    if v.kind == "reshard" and ins:
        return _module_of(g, ins[0].src, [])
    return v.module or MODEL


def by_module(rows: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    """Rows grouped by module, the modules in the order their ops run (the inputs first, a module whose only
    rows are parameters before the rest), each group's rows in graph order (its parameters first)."""
    groups: dict[str, list[Row]] = {}
    first: dict[str, float] = {}
    for r in rows:
        groups.setdefault(r.module, []).append(r)
        if r.module == INPUTS:
            first[r.module] = -2.0
        elif r.kind not in ("param", "buffer"):
            first[r.module] = min(first.get(r.module, float(r.index)), float(r.index))
    order = sorted(groups, key=lambda m: (first.get(m, -1.0), groups[m][0].index))
    return [(m, groups[m]) for m in order]


def strategy_text(v: Var, c: int) -> str:
    """A strategy as read: a placeholder's stored tiling; an op's input tilings ``->`` its output tilings
    (one tiling per tensor, its placements per mesh axis joined by commas); a reshard point's tiling and the
    axes over which it sums its consumers' partial gradients."""
    st = v.strategies[c]
    if v.kind in ("param", "buffer", "input"):
        return fmt(st.outputs[0])
    if v.kind == "output":
        return " ".join(fmt(t) for t in st.inputs)
    if v.kind == "reshard":
        axes = v.grad_partial[c]
        return fmt(st.outputs[0]) + (f" (grad summed on axes {','.join(map(str, axes))})" if axes else "")
    return " ".join(fmt(t) for t in st.inputs) + " -> " + " ".join(fmt(t) for t in st.outputs)


def edge_collectives(g: PlanGraph, e: Edge, s: int, t: int) -> list[Collective]:
    """The collectives of edge ``e`` when its source takes strategy ``s`` and its consumer ``t``: each step of
    its route's forward collective and, when the value needs a gradient, its adjoint's (``ir.kinds``); a
    recomputed consumer's read runs its forward steps again (``rerun``).  Their seconds sum to
    ``e.seconds[s, t]`` and their bytes to ``e.bytes[s, t]``."""
    route = e.route(s, t)
    value = value_name(g, e.src)
    out = _route_collectives(g, e, route, value, "write-back" if e.write_back else "forward")
    if e.rerun:
        out += _route_collectives(g, e, Route.of(route.src, route.dst), value, "rerun")
    return out


def _route_collectives(g: PlanGraph, e: Edge, route: Route, value: str, phase: str) -> list[Collective]:
    """``cost.collectives.reshard_cost`` term by term: each collective of the route's steps
    (``cost.collectives.route_calls``) by the algorithm ``choose`` picks for it, plus ``blocking_s`` for all but
    a gradient sync."""
    out = []
    for c in route_calls(route, e.shape, e.itemsize, g.mesh):
        pick = choose(c.collective, c.m, g.mesh.shape[c.step.axis], c.step.axis, edge_profile(g, e), c.sync)
        # A step's backward may run another collective than its name (all_gather's is reduce_scatter).
        text = str(c.step) if c.collective == c.step.kind else \
            f"{c.collective}{str(c.step)[len(c.step.kind):]} (for {c.step.kind})"
        out.append(Collective(text, c.collective, "backward" if c.backward else phase, value, pick.bytes,
                              pick.seconds + (0.0 if c.sync else g.profile.blocking_s), c.sync, pick.algorithm))
    return out


def _grads(v: Var, ins: list[Edge]) -> list[bool]:
    """Which inputs of op ``v`` need a gradient (as ``graph.build`` decided for its edges)."""
    n = len(v.op.inputs) if v.op is not None else 0
    grads = [False] * n
    for e in ins:
        if not e.write_back and e.dst_in < n:
            grads[e.dst_in] = grads[e.dst_in] or e.needs_grad
    return grads


def op_collectives(g: PlanGraph, v: Var, c: int, grads: Sequence[bool], rerun: bool = False) -> list[Collective]:
    """The communication inside op ``v`` under strategy ``c`` (``cost.collectives.op_comm_calls``, priced as
    ``op_comm_costs``: their sums are ``v.op_comm[c]``); the calls a forward-only run makes are ``forward``,
    the rest ``backward`` (``rerun``: a recomputed op's forward calls, once more, among them)."""
    assert v.op is not None
    st, mesh, prof = v.strategies[c], g.mesh, g.profile
    fwd = op_comm_calls(v.op, st, [False] * len(grads), mesh, prof.expert_imbalance)
    own = float(op_seconds(v.op, [st], [False] * len(grads), mesh, prof)[0])  # the forward a call may run behind
    out = []
    k = 0
    for call in op_comm_calls(v.op, st, grads, mesh, prof.expert_imbalance, rerun):
        phase = "forward" if k < len(fwd) and fwd[k] == call else "backward"
        k += phase == "forward"
        cost = op_call_cost(call, mesh, prof, own)
        step = own_step(v.op, call.kind) + f"[axis {call.axis}]"
        out.append(Collective(step, call.kind, phase, "", cost.bytes, cost.seconds))
    return out


# ---- the next-best alternative ----

class _Totals:
    """The plan's sums that a one-variable change moves non-linearly: the gradient syncs ``S`` and op compute
    ``K`` (the overlap credit ``H = min(o S, b K)``), and the rerun buffers and freed activations of
    ``graph.rerun_freed``."""

    def __init__(self, g: PlanGraph, choice: list[int]) -> None:
        self.sync = sum(float(e.sync[choice[e.src], choice[e.dst]]) for e in g.edges if e.sync is not None)
        self.op_compute = sum(float(v.compute_s[c]) - _op_s(v, c) for v, c in zip(g.vars, choice) if v.kind == "op")
        self.hidden = min(g.profile.grad_overlap * self.sync, BACKWARD_SHARE * self.op_compute)
        self.buffers = sum(float(v.rerun_buffer[c]) for v, c in zip(g.vars, choice) if v.rerun_buffer is not None)
        self.after = freed_after(g, choice) if g.rerun_after else 0.0
        self.freed = rerun_freed(g, choice)
        self.act, self.grad = phase_peaks(g, choice)
        # The phase whose peak is the plan's (``planner.evaluate``): a row's memory is its bytes in it.
        self.phase = "activations" if self.act >= self.grad else "gradients"


def _op_s(v: Var, c: int) -> float:
    return float(v.op_comm[c, 1]) if v.op_comm is not None else 0.0


def next_best(g: PlanGraph, vi: int, choice: list[int], ins: list[Edge], outs: list[Edge], totals: _Totals,
              objective: str) -> Alternative | None:
    """The cheapest other strategy of variable ``vi``, every other variable held at ``choice`` (module
    docstring); None when it has no other strategy."""
    v = g.vars[vi]
    n, c = len(v.strategies), choice[vi]
    if n < 2:
        return None
    op_comm = v.op_comm if v.op_comm is not None else np.zeros((n, 2))
    lin = v.compute_s.astype(float) - float(v.compute_s[c])          # change of T_lin
    edge_b = np.zeros(n)                                              # change of the edges' bytes
    sync = np.zeros(n)
    for e in outs:
        j = choice[e.dst]
        lin += e.seconds[:, j] - e.seconds[c, j]
        edge_b += e.bytes[:, j] - e.bytes[c, j]
        if e.sync is not None:
            sync += e.sync[:, j] - e.sync[c, j]
    for e in ins:
        i = choice[e.src]
        lin += e.seconds[i, :] - e.seconds[i, c]
        edge_b += e.bytes[i, :] - e.bytes[i, c]
        if e.sync is not None:
            sync += e.sync[i, :] - e.sync[i, c]
    op_compute = (v.compute_s - op_comm[:, 1]) - (float(v.compute_s[c]) - float(op_comm[c, 1])) \
        if v.kind == "op" else np.zeros(n)
    hidden = np.minimum(g.profile.grad_overlap * (totals.sync + sync),
                        BACKWARD_SHARE * (totals.op_compute + op_compute))
    step = lin - (hidden - totals.hidden)
    comm_b = edge_b + (op_comm[:, 0] - op_comm[c, 0])
    # The peak is the larger phase (``graph.phase_peaks``): each phase moves by this variable's bytes in it.
    act_v, grad_v = phase_memory(v, "activations").astype(float), phase_memory(v, "gradients").astype(float)
    act = act_v - act_v[c]
    if g.rerun_after:  # the rerun term of the peak moves with this variable's buffer and freed activations
        buf = v.rerun_buffer - v.rerun_buffer[c] if v.rerun_buffer is not None else np.zeros(n)
        after = v.memory - float(v.memory[c]) if vi >= g.rerun_after and v.kind == "op" else np.zeros(n)
        if vi in g.rerun_grads and v.grad_phase is not None:  # its gradient is live when the last unit reruns
            after = after - (v.grad_phase - v.grad_phase[c])
        act = act - (np.maximum(0.0, np.minimum(totals.buffers + buf, totals.after + after)) - totals.freed)
    mem = np.maximum(totals.act + act, totals.grad + grad_v - grad_v[c]) - max(totals.act, totals.grad)
    delta = step if objective == "time" else edge_b + lin
    mine = _key(v, c)
    others = [t for t in range(n) if t != c and _key(v, t) != mine and np.isfinite(delta[t])]
    if not others:
        return None
    t = min(others, key=lambda k: (float(delta[k]), k))
    return Alternative(strategy_text(v, t), float(delta[t]), float(step[t]), float(comm_b[t]), float(mem[t]))


# ---- text ----

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _signed_ms(s: float) -> str:
    return f"{s * 1e3:+.3f} ms"


def _bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _signed_bytes(b: float) -> str:
    return ("+" if b >= 0 else "-") + _bytes(abs(b))


def short_op(name: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else name


def select(ex: Explanation, node: str) -> list[Row]:
    """The rows ``--node`` names: a variable's name, a parameter's FQN, or a module path (every row in it)."""
    rows = [r for r in ex.rows if node in (r.name, r.label) or r.module == node or r.module.startswith(node + ".")]
    if not rows:
        import difflib

        names = sorted({r.name for r in ex.rows} | {r.label for r in ex.rows} | {r.module for r in ex.rows} - {""})
        near = difflib.get_close_matches(node, names, n=5)
        raise ValueError(f"no variable, parameter or module {node!r} in the plan"
                         + (f"; did you mean {', '.join(near)}?" if near else ""))
    return rows


def format_text(ex: Explanation, node: str | None = None) -> str:
    """The explanation as text: a header; per module (in the order its ops run) a subtotal, then one block per
    row (its strategy, compute, every collective with its phase, the value it moves, bytes and seconds, its
    memory, and its next best with the change of the plan's figures); a footer that states which total the
    rows sum to."""
    p = ex.plan
    rows = select(ex, node) if node else ex.rows
    unit = "step time" if p.objective == "time" else "comm objective: bytes, then seconds"
    out = [f"soybean explain: {p.devices} devices, mesh {'x'.join(map(str, p.mesh))}, objective {p.objective}, "
           f"profile {p.profile}",
           "per variable, per device per training step: its strategy (a tiling per tensor, one placement per mesh",
           "axis), its compute and each collective into it or inside it (forward, backward), its memory, and its",
           "next best: the cheapest other strategy with every other variable held, and the change it makes to",
           f"the plan's {unit}", ""]
    for module, group in by_module(rows):
        comm = sum(r.comm_s for r in group)
        out.append(f"== {module}: {_ms(sum(r.total_s for r in group))} (compute "
                   f"{_ms(sum(r.compute_s for r in group))}, communication {_ms(comm)})")
        out.append("")
        for r in group:
            out += _block(r, p.objective)
    sel = f"; the {len(rows)} shown: {_ms(sum(r.total_s for r in rows))}" if node else ""
    res = ex.result
    out += [
        f"total of the {len(ex.rows)} variables' rows: compute {_ms(res.compute_s)} + communication "
        f"{_ms(res.comm_s)} = {_ms(ex.total_s)}{sel}",
        "  = the plan's comm_s + compute_s (planner.evaluate), each edge counted in its consumer's row;",
        f"  step time {_ms(ex.step_time_s)} = that total - {_ms(res.hidden_s)} of gradient sync hidden behind "
        "backward (hidden_s)",
        f"  communication {_bytes(res.comm_bytes)}/device/step; memory {fmt_memory(res.memory)}/device "
        "(peak, modelled)",
        f"  = the rows' memory in the {ex.memory_phase} phase, {fmt_memory(sum(r.memory for r in ex.rows))}"
        + (f", less {fmt_memory(ex.memory_freed)} freed before the last recomputed unit reruns" if ex.memory_freed
           else ""),
    ]
    recorded = p.cost.get("step_time_s")
    if recorded is not None and not np.isclose(recorded, ex.step_time_s, rtol=1e-4, atol=1e-12):
        out.append(f"  note: the plan records step time {_ms(recorded)}; this table prices it at "
                   f"{_ms(ex.step_time_s)} (another profile or soybean version?)")
    return "\n".join(out) + "\n"


def _block(r: Row, objective: str) -> list[str]:
    what = {"param": "parameter", "buffer": "buffer", "input": "input", "output": "output",
            "reshard": "shared use", "op": short_op(r.op)}[r.kind]
    head = f"{r.name}  [{what}]" + (f"  {r.label}" if r.label and r.label != r.name else "")
    lines = [head, f"  strategy   {r.strategy}", f"  compute    {_ms(r.compute_s)}"]
    for c in r.collectives:
        of = f" of {c.value}" if c.value else " inside the op"
        sync = " (gradient sync, may overlap backward)" if c.sync else ""
        how = f" by {c.algorithm}" if c.algorithm != "backend" else ""
        lines.append(f"  {c.phase:<10} {c.step}{of}{how}: {_bytes(c.bytes)}, {_ms(c.seconds)}{sync}")
    lines.append(f"  memory     {fmt_memory(r.memory)}")
    lines.append(f"  total      {_ms(r.total_s)}" + (f" (communication {_ms(r.comm_s)})" if r.comm_s else ""))
    a = r.alternative
    if a is None:
        lines.append("  next best  none (no other strategy)")
    else:
        change = _signed_ms(a.step_time_s) + " step time" if objective == "time" else \
            f"{_signed_bytes(a.comm_bytes)} communication, {_signed_ms(a.step_time_s)} step time"
        sign = "+" if a.memory >= 0 else "-"
        lines.append(f"  next best  {a.strategy}: {change}, {sign}{fmt_memory(abs(a.memory))} memory")
    lines.append("")
    return lines
