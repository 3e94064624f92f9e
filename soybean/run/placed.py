"""A placed plan run: each rank runs only its regions, each region soybean's own program on its group.

``placement_plan`` cut the graph into regions (``regions.split``) and placed each on a group of ranks with its own
tiling plan.  ``PlacedModule`` holds, on every rank, a ``module.ParallelModule`` for each region whose group it is
in (local tiles, generated program, group-local process groups from ``runtime.comm.torch_groups``), and walks the
regions in order, as every rank does:

* forward: a region's inputs that another group made arrive by point-to-point messages
  (``runtime.transfer.Move``: whole values, replicated on both groups), its outputs leave as soon as it ran; a
  region runs on detached inputs, so each region's autograd graph is its own;
* backward (``loss.backward()`` on every rank reaches ``_Step``, the node standing for the whole step): the
  regions in reverse order, each one's output gradients the sum of its readers' (local, or received from the
  reader's group: the moves' adjoints), backpropagated through the region (``torch.autograd.backward``), its input
  gradients sent to the groups that made them.

Every rank walks the same regions and moves in the same order, sends never block (``Outbox``) and a receive waits
only for a region earlier in that order (forward) or later (backward), so the walk cannot deadlock.  Branches
placed on disjoint groups run at the same time because each rank skips the regions of the others.  Gradients of
a region's replicated parameters are summed within its group only (its ``ParallelModule``'s ``GradSync``); a
trained weight several regions read (``placement_plan.tied_weights``) is a copy in each, and after the regions'
backward every copy's gradient is the sum of every reader's (``checkpoint_view.PartsModule._sum_tied_grads``, as a
pipeline's tied weights): each region's counted once, by its group's first rank, over the union of the readers'
ranks (on each rank alone when they all hold the same ranks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture.core import Captured
from ..mesh import Mesh
from ..parts.part import Part, value_facts
from ..parts.placement_plan import tied_weights
from ..plan import Plan
from ..precision import policy
from ..runtime.agree import guarded
from ..runtime.transfer import Move, Outbox, receive
from .checkpoint_view import PartsModule, Tie
from .module import ParallelModule, forward_backward


def region_moves(regions: Sequence[Part], ranks: Sequence[Sequence[int]], grads: dict[str, bool]
                 ) -> list[list[Move]]:
    """For each region, the moves of the values it reads from a region on other ranks (``grads``: which values
    carry a gradient)."""
    made = {v: k for k, r in enumerate(regions) for v in r.returns}
    out: list[list[Move]] = []
    tag = 0
    for k, r in enumerate(regions):
        mine = []
        for v in r.takes:
            j = made.get(v)
            if j is None or list(ranks[j]) == list(ranks[k]):
                continue  # a user input (every rank has it) or made on these very ranks
            mine.append(Move(v, tuple(ranks[j]), tuple(ranks[k]), tag, grads.get(v, False)))
            tag += 1
        out.append(mine)
    return out


class _Step(torch.autograd.Function):
    """The whole step's node in the caller's graph: forward hands out the last region's outputs, backward runs
    every region's backward in reverse order (``PlacedModule._backward``)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[Sequence[torch.Tensor | None]], None], anchor: torch.Tensor,
                *outs: torch.Tensor) -> Any:
        ctx.run = run
        return tuple(o.detach().clone() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.run(grads)
        return (None, None, *(None for _ in grads))


class PlacedModule(PartsModule):
    """This rank's regions of a placed plan (module docstring).  ``parameters()`` are its regions': build the
    optimizer on them, as with any ``ParallelModule``.  Inputs are the whole batch on every rank, the outputs
    whole on every rank; call ``loss.backward()`` on every rank.  The state API (``full_state_dict``,
    ``save_sharded``, ...) is ``checkpoint_view.PartsModule``'s, over the regions."""

    def __init__(self, model: nn.Module, cap: Captured, regions: Sequence[Part], plans: Sequence[Plan],
                 plan: Plan, rank: int, world: int) -> None:
        super().__init__()
        from ..runtime.comm import new_groups, torch_groups

        assert plan.placement is not None
        self.plan = plan
        self._cap = cap
        self._regions = list(regions)
        self._rank, self._world = rank, world
        self._ranks = [list(r["ranks"]) for r in plan.placement["regions"]]
        final = [k for k, reg in enumerate(self._regions) if reg.final]
        if not final or sorted(self._ranks[final[-1]]) != list(range(world)):
            # ``forward`` hands every rank the output region's result: a plan whose output runs on some ranks only
            # would return None on the others (a plan made by another soybean, or edited)
            where = self._ranks[final[-1]] if final else []
            raise ValueError(f"this placed plan runs its output region on ranks {where}, not on all {world}: plan "
                             "again with this soybean (placement='auto')")
        self.parts = nn.ModuleDict()
        for k, (reg, p, rk) in enumerate(zip(regions, plans, self._ranks)):
            groups = torch_groups(Mesh(tuple(p.mesh)), ranks=rk)  # every rank makes every group, in order
            if rank in rk:
                self.parts[str(k)] = ParallelModule(model, reg.cap, p, rk.index(rank), groups)
        facts = value_facts(cap)
        self._grads = {v: g for v, (_, g) in facts.items()}
        self._moves = region_moves(regions, self._ranks, self._grads)
        self._made_here = {v for k, r in enumerate(regions) if rank in self._ranks[k] for v in r.returns}
        cast = policy(cap.precision).cast
        vals = {n.name: n.meta.get("val") for n in cap.graph.nodes}
        self._like = {m.value: cast(torch.empty(vals[m.value].shape, dtype=vals[m.value].dtype, device="meta"))
                      for ms in self._moves for m in ms}
        self._outbox = Outbox()
        self._hold_parts(model, [r.cap for r in regions], self._ranks, plans)
        self._ties = []
        ties = tied_weights(cap, regions, self._ranks)
        # after this rank built its regions: one that failed there meets the others in ``new_groups``' exchange
        made = iter(new_groups([t["ranks"] for t in ties if t["ranks"]]))
        for t in ties:
            group = next(made) if t["ranks"] else None
            local = [k for k in t["regions"] if rank in self._ranks[k]]
            if local:  # each region's gradient counted by its first rank when summed across ranks
                counted = [group is None or rank == self._ranks[k][0] for k in local]
                self._ties.append(Tie(t["param"], local, [self._part(k) for k in local], counted,
                                      group, self._ranks[t["regions"][0]][0]))
        self._anchor = torch.zeros((), requires_grad=True)  # not a parameter: what makes autograd call ``_Step``

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sent to other groups so far, forward and backward (``runtime.transfer.Outbox``)."""
        return self._outbox.sent_bytes

    @property
    def regions(self) -> list[int]:
        """The indices of the regions this rank runs."""
        return [int(k) for k in self.parts]

    def _part(self, k: int) -> ParallelModule:
        pm = self.parts[str(k)]
        assert isinstance(pm, ParallelModule)
        return pm

    def _like_on(self, value: str, device: torch.device) -> torch.Tensor:
        m = self._like[value]
        return torch.empty(m.shape, dtype=m.dtype, device=device)

    @guarded()  # an error on one rank is one error on every rank (``runtime.agree``)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        given = self._cap.flatten_inputs(args, kwargs)
        if len(given) != len(self._cap.inputs):
            raise TypeError(f"this model takes {len(self._cap.inputs)} tensor inputs, got {len(given)}")
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in given):
            raise ValueError("a placed plan takes inputs that need no gradient (its regions run on other ranks): "
                             "detach them, or plan with placement=None")
        device = next((t.device for t in given if isinstance(t, torch.Tensor)), torch.device("cpu"))
        self._outbox.flush()  # the previous step's sends
        values: dict[str, Any] = dict(zip(self._cap.inputs, given))
        grad_on = torch.is_grad_enabled()
        saved: dict[int, tuple[list[Any], list[Any]]] = {}
        out: Any = None
        for k, reg in enumerate(self._regions):
            for m in self._moves[k]:
                for src, dst in m.forward_pairs():
                    if dst == self._rank:
                        values[m.value] = receive(self._like_on(m.value, device), src, 2 * m.tag)
            if str(k) not in self.parts:
                continue
            ins = [_leaf(values[t], self._grads.get(t, False)) if grad_on else values[t] for t in reg.takes]
            got = self._part(k)(*ins)
            if reg.final:
                out = got
                saved[k] = (ins, [])  # its outputs: the tracked leaves of ``out`` (below)
                continue
            outs = list(got) if isinstance(got, (tuple, list)) else [got]
            saved[k] = (ins, outs)
            for v, o in zip(reg.returns, outs):
                values[v] = o.detach() if isinstance(o, torch.Tensor) else o
            for later in self._moves[k + 1:]:  # send what this region made as soon as it is made
                for m in later:
                    if m.value in reg.returns:
                        for src, dst in m.forward_pairs():
                            if src == self._rank:
                                self._outbox.send(values[m.value], dst, 2 * m.tag)
        # the last region runs on every rank (placement_plan), so ``out`` is this rank's whole output
        leaves, spec = tree_flatten(out)
        tracked = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grad_on or not tracked:
            return out

        def run(grads: Sequence[torch.Tensor | None]) -> None:
            self._backward(saved, list(grads), device)

        saved[len(self._regions) - 1][1].extend(leaves[i] for i in tracked)
        stepped = _Step.apply(run, self._anchor, *(leaves[i].detach() for i in tracked))
        for i, t in zip(tracked, stepped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @guarded()
    def _backward(self, saved: dict[int, tuple[list[Any], list[Any]]], last_grads: Sequence[torch.Tensor | None],
                  device: torch.device) -> None:
        """The regions' backward in reverse order (module docstring)."""
        acc: dict[str, torch.Tensor] = {}  # gradients of values made on this rank, summed over their readers
        n = len(self._regions)
        for k in range(n - 1, -1, -1):
            reg = self._regions[k]
            if k in saved:
                ins, outs = saved[k]
                if reg.final:
                    pairs = list(zip(outs, last_grads))
                else:
                    pairs = [(o, self._grad_of(v, k, acc, device)) for v, o in zip(reg.returns, outs)]
                pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                uses: dict[str, torch.Tensor] = {}  # the gradient of this region's use of each input
                for v, leaf in zip(reg.takes, ins):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        uses[v] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                        if v in self._made_here:
                            acc[v] = acc[v] + uses[v] if v in acc else uses[v]
                for m in self._moves[k]:  # the uses' gradients back to the group that made the value
                    for src, dst in m.backward_pairs():
                        if src == self._rank:
                            self._outbox.send(uses[m.value], dst, 2 * m.tag + 1)
        self._outbox.flush()
        self._sum_tied_grads()  # every region's backward is done: its gradients, its group's sums, are complete

    def _grad_of(self, value: str, k: int, acc: dict[str, torch.Tensor], device: torch.device
                 ) -> torch.Tensor | None:
        """The gradient of ``value`` (made by region ``k`` on this rank): its local readers' sum plus what readers
        on other ranks send (the moves' adjoints)."""
        g = acc.pop(value, None)
        for later in self._moves[k + 1:]:
            for m in later:
                if m.value != value:
                    continue
                for src, dst in m.backward_pairs():
                    if dst == self._rank:
                        got = receive(self._like_on(value, device), src, 2 * m.tag + 1)
                        g = got if g is None else g + got
        return g

    def train_step(self, *inputs: Any, loss_fn: Callable[..., torch.Tensor], target: torch.Tensor | None = None,
                   reduction: str = "mean", **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch, as ``ParallelModule.train_step``: the loss returned detached."""
        return forward_backward(self, inputs, kwargs, loss_fn, target, reduction)

    def local_parts(self) -> list[tuple[int, ParallelModule]]:
        """This rank's regions with their indices (``checkpoint_view.PartsModule``)."""
        return [(k, self._part(k)) for k in self.regions]


def _leaf(v: Any, grad: bool) -> Any:
    """A region's input as a leaf of its own graph, tracked when the value carries a gradient (``grad``)."""
    if isinstance(v, torch.Tensor) and grad and v.is_floating_point():
        return v.detach().requires_grad_(True)
    return v
