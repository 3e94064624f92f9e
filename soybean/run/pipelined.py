"""A pipelined plan, run by ``torch.distributed.pipelining``: each stage's module is soybean's own program.

The model is captured at the *microbatch* (``batch / microbatches`` rows: the shapes each stage's program runs
on), cut into stages at layer boundaries (``soybean.parts.stages``), and each stage planned on its own submesh by the
planner (``planner.plan`` on the stage's capture).  Rank ``r`` runs stage ``r // per_stage`` on the ranks
``[s * per_stage, (s + 1) * per_stage)``: its ``module.ParallelModule`` (local tiles, generated program,
stage-local process groups from ``runtime.comm.torch_groups``) inside a ``PipelineStage``, driven by one of
torch's schedules (``SCHEDULES``), never a schedule of our own.

``train_step(*inputs, loss_fn=fn, **kwargs)`` runs forward and backward of the whole batch through the schedule
(the model's call as it was parallelized: keywords, ``None`` and constants among its inputs; torch's schedule is
passed its tensors and the first stage rebuilds the call): the schedule splits every input tensor along dim 0 into
the microbatches, the last stage calls ``fn(output)`` (or
``fn(output, target)`` when ``target=`` is given, split alike) per microbatch, and torch scales the gradients by
``1 / microbatches`` (``scale_grads``), so for a loss that is a mean over its microbatch the gradients are those of
the whole batch's mean; the loss returned on every rank is the mean of the microbatches' losses (``reduction=
"sum"``: their sum, gradients unscaled).  That is ``fn`` on the whole batch, exactly as serial training computes
it, for equal microbatches.  ``output`` is the microbatch's output in the model's own structure (a ``ModelOutput``,
so ``fn`` reads ``out.logits``; a tuple, a dict, constants and ``None`` in place): torch's schedule handles the last
stage's output as the tuple of its tensors (``_StageModule``), rebuilt for ``fn``.  ``pmodel(*inputs)`` (forward
only) returns that structure over the whole batch (``_merged``).

A stage tiled over several devices (``per_stage`` > 1) takes and returns whole tensors: each of its ranks sends
the whole boundary value to the rank of the same index in the next stage (``torch.distributed.pipelining``'s
point-to-point group is those ranks), its program slices what it reads and gathers what it returns (the full-batch
contract), and the gradients of its replicated parameters are summed once per step, after the last microbatch's
backward (``GradSync.defer``, ``sync_now``), not per microbatch.

A weight two stages read (tied input and output embeddings) is a copy in each; after the step's backward each copy's
gradient is replaced by the sum of every reader's (``checkpoint_view.PartsModule._sum_tied_grads``, which placed
regions share), so the copies, stepped alike, stay equal to the serial weight.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from ..capture.core import Captured
from ..options import MULTI_STAGE, SCHEDULES  # their one home: PlanOptions checks them
from ..parts.part import Part, shared_params
from ..parts.stages import boundary_examples
from ..plan import Plan
from ..precision import policy
from ..runtime.agree import guarded
from .checkpoint_view import PartsModule, Tie
from .module import ParallelModule

REDUCTIONS = ("mean", "sum")


def schedule_class(name: str) -> type:
    """torch's schedule for ``name`` (``SCHEDULES``)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
               "zero-bubble": ScheduleInterleavedZeroBubble}
    if name not in classes:
        raise ValueError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return classes[name]


def check_microbatches(batch: int, microbatches: int) -> None:
    """A one-line error naming the valid counts when ``batch`` does not split into ``microbatches`` equal parts."""
    if microbatches < 1 or batch % microbatches:
        valid = [m for m in range(1, batch + 1) if batch % m == 0]
        raise ValueError(f"a batch of {batch} does not split into {microbatches} equal microbatches: "
                         f"use microbatches in {valid}")


def batch_loss(losses: Sequence[torch.Tensor], last: bool, src: int, reduction: str = "mean") -> torch.Tensor:
    """The whole batch's loss on every rank: the last stage's microbatch losses (``last``: this rank holds them),
    their mean (``reduction="sum"``: their sum), in float64 (every rank's dtype), broadcast from rank ``src``."""
    if last:
        stacked = torch.stack([t.detach().double() for t in losses])
        loss = stacked.mean() if reduction == "mean" else stacked.sum()
    else:
        loss = torch.zeros((), dtype=torch.float64)
    dist.broadcast(loss, src=src)
    return loss


Template = list[tuple[bool, Any]]


def _template(leaves: Sequence[Any]) -> Template:
    """Per pytree leaf, whether it is a tensor (passed through the schedule) or else its value (``None``, a Python
    constant), which is the same for every microbatch."""
    return [(True, None) if isinstance(x, torch.Tensor) else (False, x) for x in leaves]


def _refill(template: Template, tensors: Sequence[torch.Tensor]) -> list[Any]:
    """The leaves of ``template`` with its tensors taken from ``tensors`` in order: the inverse of keeping the
    tensors of ``leaves`` that ``_template`` described."""
    given = iter(tensors)
    return [next(given) if is_tensor else x for is_tensor, x in template]


class _StageModule(nn.Module):
    """A stage's ``ParallelModule`` as ``PipelineStage`` calls it: boundary tensors in, a tuple of them out.

    The last stage returns the tensors of the model's own output (a ``ModelOutput``, a tuple, a dict: its pytree
    leaves that are tensors, in ``tree_flatten`` order, the order ``stages.boundary_examples`` gives torch), since
    torch's schedule treats a stage's output as a tuple of tensors; ``rebuild`` puts them back in the model's
    structure, with its other leaves (Python constants), for the loss and for forward."""

    def __init__(self, pm: ParallelModule, last: bool) -> None:
        super().__init__()
        self.pm = pm
        self.last = last
        # The last output's structure and, per leaf, whether it is a tensor or else its value (a constant, ``None``:
        # a leaf of torch's pytrees): the same for every microbatch, the captured program's structure and constants.
        self._layout: tuple[TreeSpec, Template] | None = None
        # The first stage's call as the model takes it (``PipelinedModule._feed``): its inputs' structure (None:
        # positional leaves) and, per leaf, whether it is a tensor the schedule passes or else its value.
        self.call: tuple[TreeSpec | None, Template] | None = None

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args: tuple = xs
        kwargs: dict[str, Any] = {}
        if self.call is not None:  # the first stage: the model's own call rebuilt around the microbatch's tensors
            spec, template = self.call
            leaves = _refill(template, xs)
            args, kwargs = tree_unflatten(leaves, spec) if spec is not None else (tuple(leaves), {})
        out = tree_map(self._copied, self.pm(*args, **kwargs))
        if self.last:
            flat, spec = tree_flatten(out)
            self._layout = (spec, _template(flat))
            return tuple(x for x in flat if isinstance(x, torch.Tensor))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _copied(self, t: Any) -> Any:
        """An output as the schedule takes it, copied at most once.  torch's zero-bubble schedules detach a stage's
        outputs in place after the input-gradient pass, so a view (a returned tile, the loss's pending sum) is
        copied out; and what a stage sends to the next is contiguous, as its receive buffer
        (``stages.boundary_examples``) and gloo's and NCCL's sends are (a mask made by ``expand``, Ministral's)."""
        if not isinstance(t, torch.Tensor):
            return t
        if not self.last and not t.is_contiguous():
            return t.contiguous()  # a copy, never a view: detaching it leaves the stage's own tensors alone
        return t.clone() if t._base is not None else t

    def rebuild(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> Any:
        """The model's own output from the tensors the last stage's ``forward`` returned (its structure, a single
        tensor as the tensor itself); one tensor alone stands for the tuple of it (torch's metadata inference
        unpacks a one-tensor output before it calls the loss)."""
        assert self._layout is not None, "rebuild follows the last stage's forward"
        spec, template = self._layout
        return tree_unflatten(_refill(template, (tensors,) if isinstance(tensors, torch.Tensor) else tensors), spec)


class PipelinedModule(PartsModule):
    """This rank's stages of a pipelined plan (module docstring): one, or ``virtual_stages`` of them (stage ``i``
    runs on rank group ``i % groups``, the interleaved schedule's layout).  ``parameters()`` are its stages': build
    the optimizer on them, as with any ``ParallelModule``.  The state API (``full_state_dict``, ``save_sharded``,
    ...) is ``checkpoint_view.PartsModule``'s, over the stages."""

    def __init__(self, model: nn.Module, cap: Captured, stages: Sequence[Part], plans: Sequence[Plan], plan: Plan,
                 rank: int, world: int) -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage

        from ..mesh import Mesh
        from ..runtime.comm import new_groups, torch_groups

        pipe = plan.pipeline
        assert pipe is not None
        self.plan = plan
        self._cap = cap
        n = len(stages)
        v = int(pipe.get("virtual_stages", 1))
        groups = n // v  # rank groups: the pipeline's depth
        per = world // groups
        self.group_index = gi = rank // per
        self.stage_indices = [i for i in range(n) if i % groups == gi]
        self._last_rank = ((n - 1) % groups) * per
        self._n = n
        self._microbatches = int(pipe["microbatches"])
        self._groups, self._virtual = groups, v
        self._schedule_name = str(pipe["schedule"])
        mine: dict[int, list] = {}
        for k, p in enumerate(plans):  # every rank makes every stage's groups, in order (``dist.new_group``)
            got = torch_groups(Mesh(tuple(p.mesh)), ranks=range((k % groups) * per, (k % groups + 1) * per))
            if k % groups == gi:
                mine[k] = got
        # The pipeline's point-to-point groups (the ranks of one in-group index across the groups) and each tied
        # weight's (the same across the groups that hold it), made in one call (one exchange) with the others,
        # before the work one rank may fail in alone (its stages' programs, torch's ``PipelineStage`` checks).
        shared = shared_params(cap, [st.nodes for st in stages])
        tied = [(fqn, holders) for fqn, readers in shared.items()
                if len(holders := sorted({k % groups for k in readers})) > 1]
        made = new_groups([[k * per + j for k in range(groups)] for j in range(per)] +
                          [[h * per + j for h in holders] for _, holders in tied for j in range(per)])
        pp = made[rank % per]
        tie_groups: dict[str, Any] = {fqn: g for i, (fqn, _) in enumerate(tied)
                                      if (g := made[(i + 1) * per + rank % per]) is not None}
        self.stage_modules = nn.ModuleList()
        self._pstages = []
        # Static metadata (shapes, dtypes, which values carry gradients), for every stage (``boundary_examples``: from
        # the captures where the stages cannot run on the meta device): torch would infer it by running each stage
        # on uninitialised tensors, which breaks a stage that indexes with a received integer tensor.
        examples = boundary_examples(stages, policy(plan.precision).cast)
        self._device = device = next(model.parameters(), torch.empty(0)).device  # cpu (gloo); a rank's GPU (NCCL)
        # what each stage receives (shapes and dtypes), for the forward-only pass
        self._receives: list[tuple[torch.Tensor, ...]] = [ins for ins, _ in examples]
        for i in self.stage_indices:
            pm = ParallelModule(model, stages[i].cap, plans[i], rank - gi * per, mine[i])
            if pm._grad_sync is not None:
                pm._grad_sync.defer()  # summed once per step, after every microbatch's backward (``train_step``)
            m = _StageModule(pm, last=i == n - 1)
            self.stage_modules.append(m)
            ins, outs = examples[i]
            if i == 0:  # the schedule passes the first stage the tensors of the call (``_feed``), not ``None``
                ins = tuple(t for t in ins if isinstance(t, torch.Tensor))
            self._pstages.append(PipelineStage(m, i, n, device, input_args=ins, output_args=outs, group=pp))
        self._schedules: dict[tuple[int, bool, str], Any] = {}
        self._hold_parts(model, [st.cap for st in stages],
                         [range((k % groups) * per, (k % groups + 1) * per) for k in range(n)], plans)
        # A weight several stages read: summed over this rank's readers, then over the groups' ranks of one index
        # (one rank per holding group, each counting its own stages' gradients).
        self._ties: list[Tie] = []
        for fqn, readers in shared.items():
            local = [(i, m.pm) for i, m in zip(self.stage_indices, self.stage_modules)
                     if i in readers and isinstance(m, _StageModule)]
            if local:
                self._ties.append(Tie(fqn, [i for i, _ in local], [pm for _, pm in local], [True] * len(local),
                                      tie_groups.get(fqn), (readers[0] % groups) * per + rank % per))

    @property
    def stage_module(self) -> _StageModule:
        """This rank's first stage (its only one without virtual stages)."""
        return self.stage_modules[0]  # type: ignore[return-value]

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self._n - 1 in self.stage_indices

    def _schedule(self, loss_fn: Callable[..., torch.Tensor], with_target: bool, reduction: str) -> Any:
        key = (id(loss_fn), with_target, reduction)
        if key not in self._schedules:
            last = next((m for m in self.stage_modules if isinstance(m, _StageModule) and m.last), None)

            def loss(out: tuple[torch.Tensor, ...] | torch.Tensor, target: Any = None) -> torch.Tensor:
                # torch calls this per microbatch with the last stage's tensors: the model's output is rebuilt
                assert last is not None, "only the last stage computes the loss"
                got = last.rebuild(out)
                value = loss_fn(got, target) if with_target else loss_fn(got)
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise TypeError(f"loss_fn must return a scalar tensor (a microbatch's loss), got {what}: reduce "
                                    "the model's output to one number, e.g. a mean")
                return value

            cls = schedule_class(self._schedule_name)
            stage = self._pstages if self._schedule_name in MULTI_STAGE else self._pstages[0]
            self._schedules = {key: cls(stage, self._microbatches, loss_fn=loss, scale_grads=reduction == "mean")}
        return self._schedules[key]

    def _feed(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The tensors of the call ``model(*inputs, **kwargs)`` that the schedule splits into microbatches and passes
        the first stage, which rebuilds the call around them (``_StageModule.call``: keywords, ``None`` and Python
        constants in place, as torch's ``PipelineStage`` takes tensors only).  Checked against the capture on every
        rank, before any stage runs: a call unlike the one parallelized is the same ``TypeError`` on every rank."""
        leaves = self._cap.flatten_inputs(tuple(inputs), kwargs)
        if self.is_first:
            first = self.stage_modules[self.stage_indices.index(0)]
            assert isinstance(first, _StageModule)
            first.call = (self._cap.in_spec, _template(leaves))
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    @guarded()  # a stage failing on one rank is one error on every rank (``runtime.agree``)
    def train_step(self, *inputs: Any, loss_fn: Callable[..., torch.Tensor], target: torch.Tensor | None = None,
                   reduction: str = "mean", **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch ``inputs`` (and ``kwargs``: the model's call as it was
        parallelized) through the schedule (module docstring); the whole batch's loss on every rank, this stage's
        gradients ready for ``opt.step()``."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}: use one of {', '.join(REDUCTIONS)}")
        inputs = self._feed(inputs, kwargs)
        batch = None
        for x in [*inputs, *([target] if target is not None else [])]:
            if isinstance(x, torch.Tensor):
                check_microbatches(x.shape[0] if x.dim() else 1, self._microbatches)
                batch = batch or (x.shape[0] if x.dim() else 1)
        sched = self._schedule(loss_fn, target is not None, reduction)
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        if self.is_last:
            # torch's last stage always takes a target: a placeholder split alike when the loss needs none
            tgt = target if target is not None else torch.zeros(batch or self._microbatches)
            sched.step(*args, target=tgt, losses=losses, return_outputs=False)
        else:
            sched.step(*args, return_outputs=False)
        for m in self.stage_modules:
            assert isinstance(m, _StageModule)
            if (sync := m.pm._grad_sync) is not None:
                sync.sync_now()
        self._sum_tied_grads()
        return batch_loss(losses, self.is_last, self._last_rank, reduction)

    def local_parts(self) -> list[tuple[int, ParallelModule]]:
        """This rank's stages with their indices (``checkpoint_view.PartsModule``)."""
        return [(i, m.pm) for i, m in zip(self.stage_indices, self.stage_modules) if isinstance(m, _StageModule)]

    @torch.no_grad()
    def _forward_microbatches(self, inputs: Sequence[Any]) -> list[Any] | None:
        """Forward only, microbatch by microbatch, each stage run where it lives and its boundary values sent to
        the next stage's ranks (``dist.send``/``recv`` in one global order, microbatch-major, so every send meets
        its receive); this rank's list of the model's outputs per microbatch when it holds the last stage."""
        m, n = self._microbatches, self._n
        chunks = [torch.tensor_split(x, m) if isinstance(x, torch.Tensor) and x.dim() else [x] * m for x in inputs]
        per = dist.get_world_size() // (n // self._virtual)
        rank = dist.get_rank()
        outs: list[Any] = []
        for mb in range(m):
            values: tuple[Any, ...] = tuple(c[mb] for c in chunks)
            for i in range(n):
                here, prev = i % self._groups, (i - 1) % self._groups
                if i and here != prev:  # the boundary crosses rank groups: sent by the rank of this in-group index
                    if here == self.group_index:
                        values = tuple(self._recv(t, prev * per + rank % per) for t in self._receives[i])
                    elif prev == self.group_index:
                        for t in values:
                            dist.send(t.contiguous(), here * per + rank % per)
                if i in self.stage_indices:
                    k = self.stage_indices.index(i)
                    stage = self.stage_modules[k]
                    assert isinstance(stage, _StageModule)
                    values = stage(*values)
                    if i == n - 1:
                        outs.append(stage.rebuild(values))
        return outs if self.is_last else None

    def _recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=self._device)
        dist.recv(buf, src)
        return buf

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, the whole batch: the model's output on every rank (each tensor output concatenated over
        the microbatches along its batch dimension; a scalar, a loss computed inside, the mean of the
        microbatches', as ``train_step`` reads it); ``args`` and ``kwargs`` as the model was parallelized with
        (``_feed``).  Training goes through ``train_step``: a ``backward()`` through this output is an error saying
        so."""
        outs = self._forward_microbatches(self._feed(args, kwargs))
        box: list[Any] = [None]
        if outs is not None:
            flat = [tree_flatten(o) for o in outs]
            leaves = [_merged(xs) for xs in zip(*(f[0] for f in flat))]
            box = [tree_unflatten([x.cpu() if isinstance(x, torch.Tensor) else x for x in leaves], flat[0][1])]
        dist.broadcast_object_list(box, src=self._last_rank)
        token = torch.zeros((), requires_grad=True)
        return tree_map(lambda x: _NoBackward.apply(x.to(self._device), token) if isinstance(x, torch.Tensor)
                        and x.is_floating_point() else x, box[0])


def _merged(parts: Sequence[Any]) -> Any:
    """One leaf of the model's output over the whole batch from its value per microbatch: a tensor with a batch
    dimension concatenated along it; a floating scalar (a loss computed inside) their mean, as ``train_step``
    reads a loss; another scalar (a count) their sum; a Python constant as it is."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim():
        return torch.cat(list(parts))
    stacked = torch.stack(list(parts))
    return stacked.mean(0) if first.is_floating_point() else stacked.sum(0)


class _NoBackward(torch.autograd.Function):
    """The identity, whose backward is the error a pipelined plan's forward output gives under ``backward()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError("a pipelined plan trains through pmodel.train_step(*inputs, loss_fn=fn) (the schedule "
                           "runs forward and backward of every microbatch); pmodel(x) runs forward only")
