"""The memory phases of a training step on the planning graph: the first backward working set, what recomputed
units' rerun buffers over-count, and each phase's peak (the end of forward or a rerun; after backward)."""
from __future__ import annotations

import math

import numpy as np

from ..cost.memory import output_bytes
from ..tiling import max_local_numel
from .types import PlanGraph, Var

# Gradient tiles of its output size a backward op holds at once: the incoming gradient and the one it makes.
TRANSIENT_COPIES = 2
# An op this share of the largest output's size or more counts as the logits (the loss's shifted logits are one
# position shorter); the last such op in graph order is nearest the loss, whose backward runs first.
NEAR_LOSS_SHARE = 0.5


def backward_transient(g: PlanGraph) -> None:
    """Charge the step's first large backward working set (``Var.transient``, added to the op's memory), met
    while every activation is still kept: a language model's loss backward over its logits.

    Two ops carry it.  The op nearest the loss whose output is at least ``NEAR_LOSS_SHARE`` of the largest
    (the log-softmax of the shifted logits, or the logits themselves when the loss is computed outside) holds
    ``TRANSIENT_COPIES`` tiles of its output, in its own tiling: a loss computed replicated after a
    vocabulary-split head holds whole-logits gradients, not the head's tiles.  The op with the largest output
    (the head's matmul), when it is another, holds one more tile of its output (the gradient resharded into
    its tiling while the loss's is still held) and the gradient of each parameter it reads, as it reads it
    (the vocabulary weight's, made while the logits' gradient is held).  Its sum bounds each of those moments.
    Later ops' gradients meet activations already freed, and are not modelled."""
    size = {i: sum(math.prod(o.shape) * o.dtype.itemsize for o in v.op.outputs)
            for i, v in enumerate(g.vars) if v.kind == "op" and v.op is not None and v.needs_grad}
    if not size:
        return
    top = max(size.values())
    near = max(i for i, b in size.items() if b >= NEAR_LOSS_SHARE * top)
    head = min(i for i, b in size.items() if b == top)
    charge: dict[int, np.ndarray] = {}
    v = g.vars[near]
    assert v.op is not None
    charge[near] = TRANSIENT_COPIES * output_bytes(v.op, v.strategies, g.mesh)
    params = param_reads(g)
    v = g.vars[head]
    assert v.op is not None
    if head != near:  # the loss's input gradient, resharded into the head's tiling while the loss's is held
        charge[head] = (TRANSIENT_COPIES - 1) * output_bytes(v.op, v.strategies, g.mesh)
    for e in g.edges:
        if e.dst != head or not e.needs_grad or e.src not in params:
            continue
        spec = v.op.inputs[e.dst_in]
        charge[head] = charge.get(head, 0.0) + np.array(
            [max_local_numel(spec.shape, st.inputs[e.dst_in], g.mesh) * spec.dtype.itemsize for st in v.strategies],
            dtype=float)
    for vi, bytes_ in charge.items():
        g.vars[vi].transient = bytes_
        g.vars[vi].memory = g.vars[vi].memory + bytes_


def param_reads(g: PlanGraph) -> dict[int, int]:
    """Every variable that carries a parameter's value -> that parameter: the parameter itself and the shared
    uses (reshard points) it feeds, directly or through one another."""
    out = {i: i for i, v in enumerate(g.vars) if v.kind == "param"}
    feeds = [(e.src, e.dst) for e in g.edges if g.vars[e.dst].kind == "reshard"]
    grown = True
    while grown:  # a shared use of a shared use: until nothing more is reached
        grown = False
        for src, dst in feeds:
            if src in out and dst not in out:
                out[dst], grown = out[src], True
    return out


def hold_inflight(g: PlanGraph, n: int) -> None:
    """Price ``n`` microbatches' activations held at once (a pipeline stage's, ``PlanOptions.inflight``): each op's
    kept bytes ``n`` times, its rerun buffer once (units rerun one microbatch at a time).  Called before the
    transient and the rerun credit are charged, which are one microbatch's too (``_kept`` divides by ``n``)."""
    g.inflight = n
    if n == 1:
        return
    for v in g.vars:
        if v.kind == "op":
            buffer = v.rerun_buffer if v.rerun_buffer is not None else 0.0
            v.memory = (v.memory - buffer) * n + buffer


def _kept(g: PlanGraph, v: Var) -> np.ndarray:
    """An op's activations for one microbatch (``g.inflight`` of them are held: ``hold_inflight``), without the
    backward transient it is charged (``backward_transient``).  No rerun
    credit is taken for those bytes: a rerun's backward holds more than the one gradient tile ``working_set``
    charges it (each op's incoming and outgoing gradients, the gradients of the unit's weights), and the
    transient stands for that (measured: Llama's last layer rerun on 2 ranks peaks 14% above the model that
    credits it, 6% without)."""
    own = v.memory - v.transient if v.transient is not None else v.memory
    return own / g.inflight if g.inflight != 1 else own


def rerun_credit(g: PlanGraph) -> float:
    """What the rerun buffers' sum surely over-counts, subtracted from every plan's peak.

    A unit reruns in backward only after backward has passed every op after it, so when the last
    recomputed unit ``J`` reruns, the activations of the ops after it (the head, later layers kept whole)
    are freed and the gradients of the parameters they read exist (``rerun_grads``): ``K`` = those
    activations (``_kept``) less those gradients (``freed_after``).  That peak is the forward's minus ``K`` plus
    ``J``'s activations ``A``: the true extra over the forward's peak is ``max(0, A - K)``; the table charges
    ``A`` (``_Rerun.memory``, as buffers).  With ``K_lo`` the least ``K`` (the ops' least bytes less the
    gradients' most) and ``A_lo``, ``A_hi`` the least and most ``A`` any strategies reach: when ``A_hi <= K_lo``
    no plan's rerun raises the peak, and the buffers are dropped (each recomputed op's memory loses its
    buffer; no credit).  Otherwise ``A - min(K_lo, A_lo) >= max(0, A - K)`` for every plan, so the credit
    ``max(0, min(K_lo, A_lo))`` keeps the modelled peak an upper bound."""
    rec = [i for i, v in enumerate(g.vars) if v.rerun_buffer is not None]
    if not rec:
        return 0.0
    g.rerun_after = max(rec) + 1
    params = param_reads(g)  # read at or after rerun_after, directly or through a shared use
    late = {params[e.src] for e in g.edges if e.src in params and e.dst >= g.rerun_after}
    g.rerun_grads = [i for i in sorted(late) if g.vars[i].grad_phase is not None]
    after = sum(float(_kept(g, v).min()) for v in g.vars[g.rerun_after:] if v.kind == "op") \
        - sum(float(gp.max()) for i in g.rerun_grads if (gp := g.vars[i].grad_phase) is not None)
    buffers = [b for i in rec if (b := g.vars[i].rerun_buffer) is not None]
    if sum(float(b.max()) for b in buffers) <= after:
        for i in rec:
            v = g.vars[i]
            assert v.rerun_buffer is not None
            v.memory, v.rerun_buffer = v.memory - v.rerun_buffer, np.zeros_like(v.rerun_buffer)
        return 0.0
    return max(0.0, min(after, sum(float(b.min()) for b in buffers)))


def freed_after(g: PlanGraph, choice: list[int]) -> float:
    """``K`` of ``rerun_credit`` for one plan: the activations of the ops after the last recomputed unit, less
    the gradients of the parameters they read (live when that unit reruns)."""
    ops = sum(float(_kept(g, v)[c]) for v, c in zip(g.vars[g.rerun_after:], choice[g.rerun_after:]) if v.kind == "op")
    grads = sum(float(gp[choice[i]]) for i in g.rerun_grads if (gp := g.vars[i].grad_phase) is not None)
    return ops - grads


def phase_memory(v: Var, phase: str) -> np.ndarray:
    """A variable's bytes per strategy in one phase of the step: ``activations`` (the end of forward, and
    backward's reruns: everything but the gradients and the step's temporaries), ``gradients`` (after
    backward: everything but what ops keep) or ``sum`` (both at once: an upper bound of the two)."""
    if phase == "activations":
        return v.memory - v.grad_phase if v.grad_phase is not None else v.memory
    if phase == "gradients":
        return np.zeros_like(v.memory) if v.kind == "op" else v.memory
    assert phase == "sum", phase
    return v.memory


def budget_memory(v: Var) -> np.ndarray:
    """A variable's bytes per strategy as the budget's solves hold them: the activations phase less its rerun
    buffer.  A plan's activations peak is ``sum - max(0, min(A, K))`` (``rerun_freed``) >= ``sum - A``, the sum of
    these, so a budget on them is a relaxation: every plan that fits the peak fits it, and a solve's bound under it
    bounds every plan that fits (its plan is checked against the peak: ``K < A`` can break it)."""
    return phase_memory(v, "activations") - v.rerun_buffer if v.rerun_buffer is not None else \
        phase_memory(v, "activations")


def least_peak(g: PlanGraph) -> float:
    """A lower bound of every plan's activations peak ``sum - max(0, min(A, K))``: the larger of the least sum
    less its buffers (``budget_memory``) and the least sum less the most ``K`` (``freed_after``: the ops after
    the last recomputed unit at their most, less the gradients at their least) any plan frees."""
    least = sum(float(budget_memory(v).min()) for v in g.vars)
    if not g.rerun_after:
        return least
    most = sum(float(_kept(g, v).max()) for v in g.vars[g.rerun_after:] if v.kind == "op") \
        - sum(float(gp.min()) for i in g.rerun_grads if (gp := g.vars[i].grad_phase) is not None)
    return max(least, sum(float(phase_memory(v, "activations").min()) for v in g.vars) - max(0.0, most))


def phase_peaks(g: PlanGraph, choice: list[int]) -> tuple[float, float]:
    """A plan's modelled peak in each phase (``phase_memory``): at the end of forward or while a unit reruns
    (less ``rerun_freed``), and after backward.  The step's peak is the larger."""
    act = sum(float(phase_memory(v, "activations")[c]) for v, c in zip(g.vars, choice)) - rerun_freed(g, choice)
    grad = sum(float(phase_memory(v, "gradients")[c]) for v, c in zip(g.vars, choice))
    return act, grad


def rerun_freed(g: PlanGraph, choice: list[int]) -> float:
    """What the sum of one plan's variables' memory over-counts: ``max(0, min(A, K))`` for its own buffers
    ``A`` and ``K = freed_after`` (``rerun_credit``), so that its peak is ``sum - rerun_freed``, the larger of
    the forward's peak and the reruns'.  At least ``g.rerun_credit``: the search's bound holds."""
    if not g.rerun_after:
        return 0.0
    buffers = sum(float(v.rerun_buffer[c]) for v, c in zip(g.vars, choice) if v.rerun_buffer is not None)
    return max(0.0, min(buffers, freed_after(g, choice)))
