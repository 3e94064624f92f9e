"""Memory: bytes per device that a plan keeps at the training peak, one term per variable and strategy.

The search constrains ``sum_v memory[v, s_v] <= budget`` (``search/problem.py``, ``ilp.py``) and
``planner.least_memory`` sums each variable's least term, so the model is linear: every variable
contributes bytes that depend only on its own strategy.  The terms are what is live at the peak of
a training step (forward, ``loss.backward()``, an AdamW step, gradients set to ``None`` after it):

* A **parameter** tile ``p``: ``PARAM_COPIES`` copies: itself, its gradient and AdamW's two states.
  The largest parameter (by full size) also pays for AdamW's ``OPTIMIZER_TEMPORARIES``: the
  single-tensor AdamW (PyTorch's default on CPU) computes ``denom = sqrt(v) / c + eps`` one parameter
  at a time, two temporaries of that parameter's tile at once.  On a device whose AdamW takes the
  multi-tensor path (CUDA's default; ``Profile.optimizer_foreach``) every parameter pays
  ``FOREACH_TEMPORARIES`` instead: the square roots of all states exist at once.
* Any other stored tensor (an input, a buffer): its tile, once.
* An **op output**: its tile when it is *live at the end of forward*: autograd saved it for backward
  (some consumer's backward reads it, ``saved``) or it is a graph output.  An output that is an
  alias of an input (a view, ``reshape`` of a contiguous tensor, ``detach``, a ``to`` that changes
  nothing) costs 0: it shares its base's storage, and a saved view keeps its base live, so the base
  counts instead.  Outputs nothing saves are freed during forward and cost 0.
* An op's **internal saved tensors** (cross-entropy's log-probabilities, attention's log-sum-exp,
  layer norm's mean and reciprocal deviation): their bytes, scaled from the tile of the input or
  output they follow, under the op's own strategy.

``saved(op, grads)`` is the one place that knows what autograd keeps of each op (read from
PyTorch's ``derivatives.yaml`` and checked with ``torch.autograd.graph.saved_tensors_hooks`` by
``tests/test_memory_model.py``).  Autograd keeps nothing of an op none of whose inputs needs a
gradient.  A saved tensor counts once: in its producer's tiling when the producer saves it or returns
it, else in the tiling the first consumer that saves it reads it in (after a reshard, that copy is
what stays live; a consumer reading it through a view of another size charges the base instead).

The sum holds at once what the backward phase holds (parameters, states, saved activations) and
what the optimizer phase holds (parameters, gradients, states, temporaries).  The true peak is
``3 P + max(A + G_early + t, G + T)``, where ``A`` are the
saved activations, ``G`` the gradients (``G_early`` those made before the activation peak in
backward, ``t`` backward's transient gradient buffers) and ``T`` the optimizer's temporaries;
the model says ``3 P + A + G + T``.  So it is close when one phase dominates: activations in
any realistic training batch, or parameters in a model trained on a tiny batch.  It is over by
about ``min(A, G + T)`` when the two are of a size (``docs/performance.md``, Memory model).
Not counted: backward's transient gradient buffers (an op's output and input gradients at once)
and collective buffers.  A reshard's result is a fresh tensor that replaces the tile it came from
(a consumer that saves it is charged for it, above); the gradient sync's flat bucket buffers (one
more copy of every synchronised gradient) are not modelled, because whether a parameter's gradient is
synchronised depends on its consumers' strategies, a pairwise fact.

``measure_memory.measure_step`` measures the peak that this models.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from ..mesh import Mesh
from ..rules.base import OpSpec, Strategy, lookup, node_spec, op_name, tensor_args, tensor_outputs
from ..tiling import Replicate, max_local_numel

# The share of ``memory_gb`` the modelled peak may not use.  The memory model is not exact: against live-bytes
# measurements of the test suite's models (``tests/test_memory_model.py``, ``tests/test_recompute.py``) it is within
# -8% .. +7% of the measured peak per rank, and a budget is a limit the run must hold, so plans are made to
# ``(1 - MEMORY_HEADROOM) * memory_gb``.
MEMORY_HEADROOM = 0.05


# ``--memory-gb`` / ``memory_gb`` count GiB, 2^30 bytes (device memory is sized in powers of two), and every
# memory figure soybean prints is in binary units (``fmt_memory``): the budget and the peak read alike.
GIB = 2**30


def budget_bytes(memory_gb: float | None) -> float | None:
    """The modelled bytes per device a plan may reach under ``--memory-gb memory_gb`` GiB (``MEMORY_HEADROOM``)."""
    return memory_gb * GIB * (1 - MEMORY_HEADROOM) if memory_gb else None


def fmt_memory(b: float) -> str:
    """Bytes of memory in binary units: ``1.31 GiB``, ``512.00 MiB``."""
    for unit, f in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def budget_needed(modelled: float) -> float:
    """The ``--memory-gb`` (in bytes) a plan whose modelled peak is ``modelled`` needs: ``budget_bytes``'s inverse."""
    return modelled / (1 - MEMORY_HEADROOM)


# Adam/AdamW keep two states per parameter, plus the gradient: 4 copies in all.
PARAM_COPIES = 4
# Single-tensor AdamW's step: sqrt(exp_avg_sq) and its quotient by the bias correction, live at once.
OPTIMIZER_TEMPORARIES = 2
# Multi-tensor (foreach) AdamW's step, torch's default on CUDA: ``_foreach_sqrt`` of every parameter's state at once
# (divided and shifted in place after), one tile of every trainable parameter (measured on an H200: 24 MiB for an
# MLP's 24 MiB of parameters; docs/performance.md, On a GPU).
FOREACH_TEMPORARIES = 1


def optimizer_temporaries(node: fx.Node, foreach: bool) -> int:
    """Copies of a trainable parameter's tile that AdamW's step holds as temporaries: ``FOREACH_TEMPORARIES`` of
    every parameter on the multi-tensor path (``Profile.optimizer_foreach``), else ``OPTIMIZER_TEMPORARIES`` of
    the largest one alone (the single-tensor path steps one parameter at a time)."""
    if foreach:
        return FOREACH_TEMPORARIES
    return OPTIMIZER_TEMPORARIES if node.graph is not None and liveness(node.graph).largest_param == node.name else 0


def stored_bytes(
    shape: tuple[int, ...], itemsize: int, tilings: Sequence[tuple], mesh: Mesh, copies: int
) -> np.ndarray:
    """Bytes per device of a stored tensor under each tiling, ``copies`` times (``PARAM_COPIES`` for a parameter)."""
    return np.array([max_local_numel(shape, t, mesh) * itemsize * copies for t in tilings], dtype=float)


def sync_bucket_bytes(shape: tuple[int, ...], itemsize: int, tilings: Sequence[tuple], mesh: Mesh) -> np.ndarray:
    """Bytes per device of a trainable parameter's share of the gradient-sync buckets under each tiling: its
    gradient tile when the tiling replicates it on some mesh axis of more than one device (its gradient may
    then be a partial sum, reduced through ``runtime.gradsync.GradSync``'s flat buckets, which are kept
    across steps), else nothing.  An upper bound: a replicated parameter used by replicated work needs no sum."""
    return np.array([max_local_numel(shape, t, mesh) * itemsize
                     if any(isinstance(p, Replicate) and n > 1 for p, n in zip(t, mesh.shape)) else 0.0
                     for t in tilings], dtype=float)


def output_bytes(op: OpSpec, strategies: Sequence[Strategy], mesh: Mesh) -> np.ndarray:
    """Bytes per device of all of ``op``'s outputs under each strategy."""
    return np.array([sum(max_local_numel(o.shape, t, mesh) * o.dtype.itemsize for o, t in zip(op.outputs, s.outputs))
                     for s in strategies], dtype=float)


# ---- what autograd saves ------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """What autograd keeps of one op: ``inputs`` and ``outputs`` (indices into ``op.inputs`` and
    ``op.outputs``), and ``extra`` tensors made inside the op, each ``(ref, fraction)``: ``fraction``
    times the bytes of the tile of ``ref`` (``("in", i)`` or ``("out", j)``)."""

    inputs: frozenset[int] = frozenset()
    outputs: frozenset[int] = frozenset()
    extra: tuple[tuple[tuple[str, int], float], ...] = ()


NOTHING = Saved()
SaveRule = Callable[[OpSpec, Sequence[bool]], Saved]


def _keep(inputs: Sequence[int] = (), outputs: Sequence[int] = (),
          extra: Callable[[OpSpec], tuple[tuple[tuple[str, int], float], ...]] | None = None) -> SaveRule:
    """Keep these inputs (those the op has) and outputs whenever some input needs a gradient."""
    def rule(op: OpSpec, grads: Sequence[bool]) -> Saved:
        return Saved(frozenset(i for i in inputs if i < len(op.inputs)), frozenset(outputs),
                     extra(op) if extra is not None else ())
    return rule


def _product(a: int, b: int, keep_others: Sequence[int] = ()) -> SaveRule:
    """A product of inputs ``a`` and ``b`` (mm, linear, conv, mul): each operand is kept when the
    other one needs a gradient (its gradient is the output's gradient times that operand)."""
    def rule(op: OpSpec, grads: Sequence[bool]) -> Saved:
        if b >= len(op.inputs):  # times a Python scalar: nothing to keep
            return NOTHING
        keep = {a} if grads[b] else set()
        keep |= {b} if grads[a] else set()
        return Saved(frozenset(keep | set(keep_others)))
    return rule


def _div(op: OpSpec, grads: Sequence[bool]) -> Saved:
    """``a / b``: ``b`` for both gradients, ``a`` only for ``b``'s."""
    if len(op.inputs) < 2:
        return NOTHING
    return Saved(frozenset({1} | ({0} if grads[1] else set())))


def _dropout(op: OpSpec, grads: Sequence[bool]) -> Saved:
    p = op.args[1] if len(op.args) > 1 else op.kwargs.get("p", 0.5)
    train = op.args[2] if len(op.args) > 2 else op.kwargs.get("train", True)
    if not p or not train:
        return NOTHING
    return Saved(extra=((("out", 0), 1 / op.outputs[0].dtype.itemsize),))  # a bool mask


def _per_row(k: int) -> Callable[[OpSpec], tuple[tuple[tuple[str, int], float], ...]]:
    """``k`` float32 statistics per normalised row (layer norm's mean and 1/std), as a share of the input."""
    def extra(op: OpSpec) -> tuple[tuple[tuple[str, int], float], ...]:
        shape = op.args[1] if len(op.args) > 1 else op.kwargs.get("normalized_shape", ())
        row = math.prod(int(d) for d in shape) if shape else 1
        return ((("in", 0), k * 4 / (row * op.inputs[0].dtype.itemsize)),)
    return extra


def _lse(op: OpSpec) -> tuple[tuple[tuple[str, int], float], ...]:
    """Attention's float32 log-sum-exp per query row, as a share of the output."""
    out = op.outputs[0]
    return ((("out", 0), 4 / (out.shape[-1] * out.dtype.itemsize)),)


def _log_probs(op: OpSpec) -> tuple[tuple[tuple[str, int], float], ...]:
    """Cross-entropy runs log_softmax then nll_loss: the log-probabilities, the size of the logits."""
    return ((("in", 0), 1.0),)


def _indices(op: OpSpec) -> tuple[tuple[tuple[str, int], float], ...]:
    """Max pooling's int64 argmax per output element."""
    return ((("out", 0), 8 / op.outputs[0].dtype.itemsize),)


def _expert_rows(op: OpSpec) -> tuple[tuple[tuple[str, int], float], ...]:
    """Routed experts (``ir.experts``) keep, per (token, choice) row, the gathered row and, per expert weight
    ``(experts, a, b)`` (a packed ``(experts, 2, f, b)`` counts as ``a = 2 f``), about two tensors of its wider dim
    (a matmul's output and the activation that reads it): ``k (H + 2 sum_w max(a, b)) / H`` of the output.  An
    estimate: the exact set depends on the body (a bias keeps nothing); under the pending-sum strategy and inside
    experts split by their FFN dim each rank keeps a share of them but is charged for all."""
    x, idx, _w, *weights = op.inputs
    h = x.shape[1]
    wide = sum(max(math.prod(w.shape[1:-1]), w.shape[-1]) for w in weights if len(w.shape) >= 3)
    return ((("out", 0), idx.shape[1] * (h + 2 * wide) / h),)


_IN = _keep((0,))
_OUT = _keep(outputs=(0,))
# Linear ops (add, sum, cat, pad, copies, casts, views) and ops with no gradient keep nothing; they are not listed.
SAVES: dict[str, SaveRule] = {
    # products: each operand for the other's gradient
    **{f"aten.{n}.default": _product(0, 1) for n in ("mm", "bmm", "matmul", "linear")},
    **{f"aten.{n}.default": _product(1, 2) for n in ("addmm", "baddbmm")},
    **{f"aten.{n}": _product(0, 1) for n in ("mul.Tensor", "mul_.Tensor")},
    **{f"aten.{n}": _product(0, 1) for n in ("conv1d.default", "conv2d.default", "conv3d.default",
                                              "conv1d.padding", "conv2d.padding", "conv3d.padding")},
    "aten.div.Tensor": _div,
    "aten.div_.Tensor": _div,
    # unary ops whose derivative reads the input
    **{f"aten.{n}.default": _IN for n in (
        "gelu", "gelu_", "silu", "silu_", "abs", "sin", "cos", "erf", "log", "log1p", "leaky_relu", "hardtanh",
        "hardtanh_", "relu6", "hardswish", "hardsigmoid", "mish", "softplus", "elu", "clamp", "clamp_min",
        "clamp_max", "square")},
    "aten.pow.Tensor_Scalar": _IN,
    # ... or the output
    **{f"aten.{n}.default": _OUT for n in ("relu", "relu_", "tanh", "sigmoid", "exp", "exp_", "sqrt", "rsqrt",
                                           "reciprocal", "_softmax", "_log_softmax")},
    "aten.softmax.int": _OUT,
    "aten.log_softmax.int": _OUT,
    "aten.maximum.default": _keep((0, 1)),
    "aten.minimum.default": _keep((0, 1)),
    "aten.amax.default": _keep((0,), (0,)),
    "aten.amin.default": _keep((0,), (0,)),
    "aten.max.dim": _keep((0,), (1,)),
    "aten.min.dim": _keep((0,), (1,)),
    "aten.var.correction": _IN,
    "aten.var.dim": _IN,
    "aten.std.correction": _keep((0,), (0,)),
    "aten.std.dim": _keep((0,), (0,)),
    # selections keep their index or mask (the values' gradient is scattered back)
    "aten.embedding.default": _keep((1,)),
    "aten.index_select.default": _keep((1,)),
    "aten.gather.default": _keep((1,)),
    "aten.index.Tensor": _keep((1, 2, 3, 4)),
    "aten.where.self": _keep((0,)),
    "aten.where.ScalarOther": _keep((0,)),
    "aten.where.ScalarSelf": _keep((0,)),
    "aten.masked_fill.Scalar": _keep((1,)),
    "aten.masked_fill.Tensor": _keep((1,)),
    "aten.dropout.default": _dropout,
    # normalisation: input, weight (and bias), per-row statistics
    "aten.layer_norm.default": _keep((0, 1, 2), extra=_per_row(2)),
    "aten.rms_norm.default": _keep((0, 1), extra=_per_row(1)),
    "aten.group_norm.default": _keep((0, 1, 2)),
    "aten.batch_norm.default": _keep((0, 1, 2, 3, 4)),
    # attention (the fused kernels): q, k, v, mask, output, log-sum-exp
    "aten.scaled_dot_product_attention.default": _keep((0, 1, 2, 3), (0,), _lse),
    # losses
    "aten.cross_entropy_loss.default": _keep((1,), extra=_log_probs),
    **{f"aten.{n}.default": _keep((0, 1)) for n in ("nll_loss", "nll_loss_nd", "nll_loss2d_forward",
                                                     "nll_loss_forward")},
    # PyTorch returns mse_loss's scalar inside its elementwise buffer (the storage is the input's size),
    # which lives as long as the loss does
    "aten.mse_loss.default": _keep((0, 1), extra=lambda op: ((("in", 0), 1.0),)),
    # routed experts: the tokens and weights, and the rows inside
    "soybean.routed_experts.default": _keep((0, 1, 2), extra=_expert_rows),
    # pooling
    **{f"aten.{n}.default": _keep((0,), extra=_indices) for n in ("max_pool1d", "max_pool2d", "max_pool3d",
                                                                  "adaptive_max_pool2d")},
    "aten.max_pool2d_with_indices.default": _keep((0,), (1,)),
    **{f"aten.{n}.default": _IN for n in ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                                          "adaptive_avg_pool2d", "_adaptive_avg_pool2d")},
}


def saved(op: OpSpec, grads: Sequence[bool]) -> Saved:
    """What autograd keeps of ``op`` for backward, given which of its inputs need a gradient."""
    rule = SAVES.get(op.name)
    if rule is None or not any(grads):
        return NOTHING
    return rule(op, grads)


# ---- liveness over the captured graph -----------------------------------------------------------

# Views whose output may be a copy: only the traced values say which (their fake storages).
_MAY_COPY = frozenset({"aten.reshape.default", "aten.flatten.using_ints"})


def _source(a: fx.Node) -> tuple[fx.Node, int]:
    if a.op == "call_function" and a.target is operator.getitem:
        src, idx = a.args[0], a.args[1]
        assert isinstance(src, fx.Node) and isinstance(idx, int)
        return src, idx
    return a, 0


def _storage(t: torch.Tensor) -> object:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # a tensor without storage (a subclass): nothing to compare
        return None


def _aliased_input(node: fx.Node, j: int, args: Sequence[fx.Node]) -> int | None:
    """The input whose storage output ``j`` of ``node`` shares, if any."""
    outs = tensor_outputs(node)
    if j < len(outs):
        sid = _storage(outs[j])
        if sid is not None:
            for i, a in enumerate(args):
                if _storage(a.meta["val"]) == sid:
                    return i
    name = op_name(node.target)
    entry = lookup(node.target)
    if args and entry is not None and entry.cost is not None and entry.cost.view and name not in _MAY_COPY:
        # a view by its rule (the traced values lost the link); broadcast_tensors maps output j to input j
        return min(j, len(args) - 1)
    return None


@dataclass
class Liveness:
    """Per graph: what is live at the end of forward, each op's ``Saved``, the largest parameter.

    ``live``: op name -> its outputs counted in its own (producer) tiling; ``read``: op name -> its
    inputs counted in the tiling it reads them in (a value saved only by consumers, the first of them
    counts it: when it reads a resharded copy, that copy is what stays live).
    """

    live: dict[str, frozenset[int]]
    read: dict[str, frozenset[int]]
    saves: dict[str, Saved]
    largest_param: str | None


# ``GraphModule.meta`` key of a graph's ``liveness`` results, by units: (the graph's node count then, the result).
_LIVENESS = "soybean_liveness"


def liveness(graph: fx.Graph, units: Mapping[str, str] | None = None) -> Liveness:
    """What is live at the end of ``graph``'s forward (kept per ``units`` in the ``meta`` of the module that owns
    ``graph``, while its node count holds; worked out anew for a graph no module owns).

    ``units``: op name -> the recomputed unit it lies in (``codegen.recompute``).  Such an op saves nothing:
    its unit's checkpoint keeps instead every value the unit reads from outside it, as produced (lowering
    emits the reads' reshards inside the unit), and backward reruns the unit to save the rest."""
    units = units or {}
    key = frozenset(units.items())
    owner = graph.owning_module
    kept: dict[frozenset, tuple[int, Liveness]] = owner.meta.setdefault(_LIVENESS, {}) if owner is not None else {}
    hit = kept.get(key)
    if hit is not None and hit[0] == len(graph.nodes):
        return hit[1]
    grad: dict[str, bool] = {}
    saves: dict[str, Saved] = {}
    alias: dict[tuple[str, int], tuple[fx.Node, int]] = {}   # (view, output) -> its base's value
    # base value -> its first consumer that saves it (name, input index), or None: its producer counts it
    savers: dict[tuple[str, int], tuple[str, int] | None] = {}
    largest: tuple[int, str] | None = None

    def mark(value: tuple[fx.Node, int], reader: tuple[str, int] | None) -> None:
        node, j = value
        numel = tensor_outputs(node)[j].numel() if j < len(tensor_outputs(node)) else -1
        while (node.name, j) in alias:
            node, j = alias[(node.name, j)]
        if node.op != "call_function":
            return  # parameters, inputs and buffers are counted where they are stored
        base = tensor_outputs(node)
        if reader is not None and (j >= len(base) or base[j].numel() != numel):
            reader = None  # read through a view of another size (a slice, an expand): count the base
        key = (node.name, j)
        if key not in savers:
            savers[key] = reader
        elif reader is None:
            savers[key] = None

    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            grad[node.name] = isinstance(val, torch.Tensor) and val.requires_grad and val.dtype.is_floating_point
            if grad[node.name] and (largest is None or val.numel() > largest[0]):
                largest = (val.numel(), node.name)
        elif node.op == "call_function":
            args = tensor_args(node)
            if node.target is operator.getitem:
                grad[node.name] = grad.get(node.args[0].name, False) if isinstance(node.args[0], fx.Node) else False
                continue
            grads = [grad.get(a.name, False) for a in args]
            outs = tensor_outputs(node)
            grad[node.name] = any(grads) and any(o.dtype.is_floating_point for o in outs)
            for j in range(len(outs)):
                i = _aliased_input(node, j, args)
                if i is not None:
                    alias[(node.name, j)] = _source(args[i])
            s = saved(make_spec(node), grads)
            if node.name in units:  # recomputed: its checkpoint keeps what it reads from outside its unit
                saves[node.name] = NOTHING
                for a in args:
                    src = _source(a)
                    if units.get(src[0].name) != units[node.name]:
                        mark(src, None)
                continue
            saves[node.name] = s
            for i in s.inputs:
                mark(_source(args[i]), (node.name, i))
            for j in s.outputs:
                mark((node, j), None)
        elif node.op == "output":
            leaves, _ = tree_flatten(node.args)
            for a in leaves:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    mark(_source(a), None)
    live: dict[str, set[int]] = {}
    read: dict[str, set[int]] = {}
    for (name, j), reader in savers.items():
        if reader is None:
            live.setdefault(name, set()).add(j)
        else:
            read.setdefault(reader[0], set()).add(reader[1])
    result = Liveness({k: frozenset(v) for k, v in live.items()}, {k: frozenset(v) for k, v in read.items()},
                      saves, largest[1] if largest else None)
    kept[key] = (len(graph.nodes), result)
    return result


def make_spec(node: fx.Node) -> OpSpec:
    return node_spec(node)


def param_bytes(node: fx.Node, shape: tuple[int, ...], itemsize: int, tilings: Sequence[tuple], mesh: Mesh,
                kind: str, master_itemsize: int = 0, foreach: bool = False) -> np.ndarray:
    """Bytes per device of a stored tensor (``kind``: ``param``, ``frozen`` (a parameter that does not train),
    ``buffer`` or ``input``) under each tiling: a parameter's ``PARAM_COPIES``, plus AdamW's temporaries
    (``optimizer_temporaries``); a frozen one's single copy.  Under a mixed precision policy (``master_itemsize``) a
    parameter's copies are of the master, and the compute copy the step casts (``itemsize``) adds one tile."""
    copies = 1
    if kind == "param":
        copies = PARAM_COPIES + optimizer_temporaries(node, foreach)
    if kind in ("param", "frozen") and master_itemsize:
        return stored_bytes(shape, master_itemsize, tilings, mesh, copies) + stored_bytes(shape, itemsize, tilings,
                                                                                          mesh, 1)
    return stored_bytes(shape, itemsize, tilings, mesh, copies)


def grad_phase_bytes(node: fx.Node, shape: tuple[int, ...], itemsize: int, tilings: Sequence[tuple], mesh: Mesh,
                     master_itemsize: int = 0, foreach: bool = False) -> np.ndarray:
    """The part of a trainable parameter's ``param_bytes`` that exists only after its backward: its gradient
    tile (of the master under a mixed policy) and AdamW's step temporaries (``optimizer_temporaries``).  With
    gradients set to ``None`` between steps (``zero_grad``'s default) they are not live at the end of forward,
    when the activations peak, and the activations are freed by the time the step runs (``planner.evaluate``
    takes the larger of the two phases)."""
    return stored_bytes(shape, master_itemsize or itemsize, tilings, mesh, 1 + optimizer_temporaries(node, foreach))


def activation_key(node: fx.Node, units: Mapping[str, str] | None = None, info: Liveness | None = None) -> Hashable:
    """What ``activation_bytes`` reads of ``node`` besides its op and strategies: two ops with equal
    specs and keys keep equal bytes (``graph`` shares repeated layers' tables on this).  ``info``: the graph's
    ``liveness`` with ``units``, when the caller holds it (a build asks once per op)."""
    info = info or liveness(node.graph, units)
    return (info.live.get(node.name, frozenset()), info.read.get(node.name, frozenset()),
            info.saves.get(node.name, NOTHING).extra)


def activation_bytes(node: fx.Node, op: OpSpec, strategies: Sequence[Strategy], mesh: Mesh,
                     units: Mapping[str, str] | None = None, info: Liveness | None = None) -> np.ndarray:
    """Bytes per device that op ``node`` keeps at the end of forward under each strategy: its outputs
    that are live then (saved for backward, kept by a recomputed unit's checkpoint, or returned; not
    aliases) and the tensors it saves internally (``units``: as ``liveness``; ``info``: as ``activation_key``)."""
    info = info or liveness(node.graph, units)
    live = info.live.get(node.name, frozenset())
    read = info.read.get(node.name, frozenset())
    extra = info.saves.get(node.name, NOTHING).extra
    out = np.zeros(len(strategies))
    for k, s in enumerate(strategies):
        b = 0.0
        for j in live:
            o = op.outputs[j]
            b += max_local_numel(o.shape, s.outputs[j], mesh) * o.dtype.itemsize
        for i in read:
            x = op.inputs[i]
            b += max_local_numel(x.shape, s.inputs[i], mesh) * x.dtype.itemsize
        for (where, i), frac in extra:
            spec, tiling = (op.inputs[i], s.inputs[i]) if where == "in" else (op.outputs[i], s.outputs[i])
            b += frac * max_local_numel(spec.shape, tiling, mesh) * spec.dtype.itemsize
        out[k] = b
    return out
