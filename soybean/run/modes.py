"""Evaluation mode: ``pmodel.eval()`` runs the program the model's own ``eval()`` would have been captured as.

The graph is captured in training mode, and the ops whose meaning depends on the mode carry it as an argument:
``aten.dropout(x, p, train)`` (and its native, feature and alpha forms), the attention's ``dropout_p``, and
``aten.batch_norm(..., training, ...)``.  Evaluation mode is the same graph with those arguments as ``eval()``
sets them, so ``for_eval`` rewrites a rank's program node by node, the plan unchanged:

* dropout: ``train=False`` (the identity), the attention's ``dropout_p = 0``;
* batch norm: ``training=False``, the running statistics in place of the batch's, and no update of them (nor of
  its count of training batches, ``num_batches_tracked += 1``, which its Python does in training only).  In
  training a batch (or spatial) split of it runs ``runtime.syncnorm.sb_batch_norm`` (the statistics summed across
  the split); in evaluation it is the local ``aten.batch_norm`` on the tile, which is exact under every tiling the
  rules give it: per channel an affine map of running statistics the tile holds whole (batch split) or as its
  channels' slice (channel split).

Python that branches on ``self.training`` (a router's noise in training, a loss computed only in training) ran
once, in training mode, when the graph was captured: evaluation mode cannot change it (a limit the guide names).
An op whose evaluation form is not one of these (instance norm with running statistics) is an ``EvalModeError``
at the first forward in evaluation mode, never a silent training-mode forward.
"""
from __future__ import annotations

import copy

import torch
from torch import fx, nn

from ..runtime.attention import sb_sdpa_rows
from ..runtime.syncnorm import sb_batch_norm

aten = torch.ops.aten
# The ops that take ``train`` as their third argument (index 2).
DROPOUTS = (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
            aten.alpha_dropout.default, aten.feature_alpha_dropout.default)
# Attention, and its form on split query rows (context parallelism): ``dropout_p`` at position 4 in both.
ATTENTION = (aten.scaled_dot_product_attention.default, sb_sdpa_rows)
ATTENTION_DROPOUT = 4
BATCH_NORM_TRAINING = 5  # ``training``'s position in ``aten.batch_norm`` (and ``sb_batch_norm``)
# Ops whose evaluation mode is not one argument away: refused in evaluation mode where they use batch statistics.
REFUSED = (aten.instance_norm.default,)


class EvalModeError(RuntimeError):
    """The program has an op whose evaluation mode soybean does not make."""


def _set(node: fx.Node, index: int, name: str, value: fx.node.Argument) -> None:
    """Argument ``index`` (keyword ``name``) of ``node`` set to ``value``."""
    if name not in node.kwargs and len(node.args) > index:
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _counts_batches(node: fx.Node) -> bool:
    """``num_batches_tracked += 1``: batch norm's Python in training mode, an in-place add on that buffer, unread."""
    first = node.args[0] if node.args else None
    return (isinstance(first, fx.Node) and first.op == "placeholder" and str(first.target).endswith(
        "num_batches_tracked") and not node.users)


def _rewrite(graph: fx.Graph) -> None:
    """``graph``'s nodes in evaluation mode, in place (module docstring)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPOUTS:
            _set(node, 2, "train", False)
        elif node.target in ATTENTION:
            _set(node, ATTENTION_DROPOUT, "dropout_p", 0.0)
        elif node.target is aten.batch_norm.default:
            _set(node, BATCH_NORM_TRAINING, "training", False)
        elif node.target is sb_batch_norm:  # the synced training form: the local op, in evaluation mode
            args = list(node.args[:9]) + [True] * (9 - len(node.args[:9]))  # ``cudnn_enabled`` when not given
            args[BATCH_NORM_TRAINING] = False
            node.target, node.args, node.kwargs = aten.batch_norm.default, tuple(args), {}
        elif node.target is aten.add_.Tensor and _counts_batches(node):
            graph.erase_node(node)  # batch norm's count of training batches: ``eval()`` counts none
        elif node.target in REFUSED and (node.args[5] if len(node.args) > 5 else node.kwargs.get("use_input_stats")) \
                and (node.args[3] if len(node.args) > 3 else node.kwargs.get("running_mean")) is not None:
            raise EvalModeError(
                f"{node.target} with running statistics: its evaluation mode (those statistics in place of the "
                "input's) is not made by soybean, and the program would run as in training. Evaluate the serial "
                "model with the trained weights (model.load_state_dict(pmodel.full_state_dict()); model.eval())")


def _copy_for_eval(module: nn.Module) -> nn.Module:
    """``module`` with every graph in it (its own when it is a ``GraphModule``, and its submodules', such as the
    recomputed runs ``codegen.recompute`` cuts the program into) copied and rewritten; tensors and other modules
    shared, nothing of ``module`` changed."""
    if isinstance(module, fx.GraphModule):
        graph = copy.deepcopy(module.graph)
        _rewrite(graph)
        new: nn.Module = fx.GraphModule(module, graph)  # the attributes the graph reads, shared
        new.__dict__["meta"] = dict(getattr(module, "meta", {}))
    else:
        new = copy.copy(module)
        # its own table of children, so that the swaps below leave ``module``'s alone
        new.__dict__["_modules"] = dict(module._modules)
    for name, child in list(new.named_children()):
        if any(isinstance(m, fx.GraphModule) for m in child.modules()):
            setattr(new, name, _copy_for_eval(child))
    return new


def for_eval(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``program`` (a rank's lowered program, recomputed runs included) in evaluation mode (module
    docstring); ``program`` unchanged.  ``EvalModeError`` when it has an op whose evaluation form is not made here."""
    out = _copy_for_eval(program)
    assert isinstance(out, fx.GraphModule)
    return out
