"""Recomputation: a unit's forward runs again in backward instead of keeping its activations.

A *unit* is a module path: a layer, a block of a repeated stack (``graph.layer_of``: the module path up
to its first numeric part), or a module inside one (selective recomputation's attention,
``graph.attention_units``).  Lowering tags every node it emits with the module of the captured op it
lowers (the collectives that read the op's inputs included), and ``graph.unit_of`` maps it to its unit.
``checkpoint_layers`` cuts the per-rank program into runs of consecutive nodes of one unit
(``torch.fx.passes.split_module``) and calls each run of a unit the plan recomputes through
``torch.utils.checkpoint`` (non-reentrant): its forward keeps only the run's inputs, and backward
runs the forward again (its collectives too, in the same order on every rank, with the same random
state) before differentiating it.  A run that updates stored tensors in place (batch norm's running
statistics) or reads halo windows is not recomputed: running it twice would update twice, and the
windows' saved-tensor packing is its own.  The planner offers only units without such ops.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..graph import unit_of
from ..runtime import context as rt


class _Recomputed(nn.Module):
    """A run of a recomputed layer: checkpointed, re-entering the rank's groups when backward reruns it."""

    def __init__(self, run: nn.Module) -> None:
        super().__init__()
        self.run = run

    def _forward(self, groups: Any, *args: Any) -> Any:
        with rt.use_groups(groups):
            return self.run(*args)

    def forward(self, *args: Any) -> Any:
        # No early stop: the whole run reruns, every collective of it, as the cost model prices it (stopping
        # after the last saved tensor would skip the run's tail, which is what saves nothing).
        with set_checkpoint_early_stop(False):
            return checkpoint(self._forward, rt.current_groups(), *args, use_reentrant=False,
                              preserve_rng_state=True)  # dropout draws the same masks in the rerun


def _stays(node: fx.Node) -> bool:
    """An op whose run must not be recomputed: it writes a stored tensor, or reads halo windows."""
    return node.target in (torch.ops.aten.copy_.default, rt.sb_windowed) or (
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable)


def checkpoint_layers(gm: fx.GraphModule, layers: Collection[str]) -> fx.GraphModule:
    """``gm`` with every run of a unit in ``layers`` checkpointed (module docstring); ``gm`` itself when none."""
    if not layers:
        return gm
    part: dict[fx.Node, int] = {}
    runs: list[str] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        layer = unit_of(n.meta.get("module", ""), layers)
        if not runs or runs[-1] != layer:
            runs.append(layer)
        part[n] = len(runs) - 1
    keep = {i for i, layer in enumerate(runs) if layer in layers}
    keep -= {part[n] for n in part if _stays(n)}
    if not keep:
        return gm
    out = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    for i in keep:
        name = f"submod_{i}"
        setattr(out, name, _Recomputed(getattr(out, name)))
    out.meta.update(gm.meta)
    return out


__all__ = ["checkpoint_layers"]
