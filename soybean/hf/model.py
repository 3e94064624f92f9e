"""``SoybeanModel``: a Hugging Face model run by soybean's plan, fed the batches a distributed data loader gives.

A data loader under ``torchrun`` (Trainer's, or one ``accelerator.prepare`` made) gives rank ``r`` of ``p`` its
slice of the global batch: with ``b`` rows per rank, rows ``[r b, (r + 1) b)`` of the batch one process would
read (accelerate deals the base sampler's batches round-robin, so the ranks' batches in rank order are the
serial batch).  ``SoybeanModel`` plans once, from the global batch, and then runs the plan's program on every
step, under the one of soybean's two input contracts the plan can take:

* ``local`` (``parallelize(local_batch=True)``): every batch input is split on dim 0 over the whole mesh, in
  rank order, which is exactly the loader's slicing, so each rank feeds its own slice and nothing moves.
  The default: the planner then knows the data arrive split.
* ``full``: the plan reads the whole batch on every rank; the ranks' slices are all-gathered (in rank order)
  into it first.  Used where the local contract is not offered (a model dynamo captures in pieces, the ``mp``
  baseline), or when asked (``contract="full"``).

Either way the loss the module returns is the whole global batch's, the same on every rank, and its gradients
are the serial model's on that batch: a loop treats the module as one process training on the global batch.

Training state the serial model's way: ``grad_norm`` / ``clip_grad_norm_`` give the serial gradient norm
(``||g||_2`` over every parameter of the serial model) from the tiles; ``rebind`` points an optimizer built on
the serial model at the tiles; ``optimizer_state_full`` / ``load_optimizer_state_full`` convert an optimizer's
state between the tiles and the serial layout (``torch.save``-able, what the serial optimizer would hold);
``full_state_dict`` is the serial ``state_dict()``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Mesh
from ..run.module import ParallelModule
from ..runtime.agree import guarded
from ..tiling import R, local_tile

CONTRACTS = ("auto", "local", "full")


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` (what ``accelerator.prepare`` wraps it in) or a compiled
    module; the model itself otherwise."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@contextmanager
def kept_rng() -> Any:
    """Run the block and put every random generator a data pipeline draws from back as it was (torch's CPU and
    CUDA generators, Python's ``random``, numpy's), so planning leaves the data order and dropout masks of the
    run exactly those of the run without soybean."""
    import random

    import numpy as np

    cpu, py, npy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npy)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _batch_tensors(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inputs of ``batch`` that are split by rows (tensors with a dim 0)."""
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def gather_rows(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The global batch from every rank's slice: each tensor with a dim 0 all-gathered and concatenated in rank
    order (the loader's slicing, module docstring); scalars and other values as they are.  Every rank calls it;
    the slices must have equal shapes on every rank (a ``ValueError`` on every rank otherwise)."""
    rank, size = world()
    rows = _batch_tensors(batch)
    if size == 1 or not rows:
        return dict(batch)
    shapes: list[Any] = [None] * size
    dist.all_gather_object(shapes, {k: tuple(v.shape) for k, v in rows.items()})
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"the ranks' batches differ in shape ({shapes}): soybean plans one global batch shape; pad "
                         "every batch to one length (padding='max_length', or pad_to_multiple_of with fixed lengths) "
                         "and drop the last partial batch (dataloader_drop_last=True)")
    out = dict(batch)
    for k, v in rows.items():
        parts = [torch.empty_like(v) for _ in range(size)]
        dist.all_gather(parts, v.contiguous())
        out[k] = torch.cat(parts, dim=0)
    return out


class SoybeanModel(nn.Module):
    """``model`` (a ``transformers`` model, or any module called with keyword tensors) run by soybean's plan.

    Call it as the model, with the batch this rank's data loader gives (``sb(**batch)``); the first call on a model
    not yet planned plans from the global batch (all-gathered from the ranks' first batches) and, when
    ``optimizer`` was given, points it at the tiles (``rebind``).  ``plan_from(global_batch)`` plans ahead of
    the first call (what ``soybean.hf.Trainer`` does, so that the optimizer is built before the first step).

    ``contract``: ``auto`` (default: ``local`` where the plan takes it, else ``full``), ``local`` or ``full``
    (module docstring).  ``options``: ``soybean.parallelize``'s planning keywords (``objective=``, ``mesh=``,
    ``memory_gb=``, ``precision=``, ...)."""

    serial: nn.Module  # the model itself (set with object.__setattr__: not a submodule)

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None, contract: str = "auto",
                 **options: Any) -> None:
        super().__init__()
        if contract not in CONTRACTS:
            raise ValueError(f"unknown contract {contract!r}: use one of {', '.join(CONTRACTS)}")
        object.__setattr__(self, "serial", unwrap(model))  # not a submodule: its parameters are not trained here
        self.contract = contract
        self.options = options
        self._optimizer = optimizer
        self.pm: ParallelModule | None = None
        self.used = ""  # the contract the plan runs under: "local" or "full"
        self._rows: dict[str, tuple[int, ...]] = {}  # each row input's shape in one rank's slice, as planned
        self._deferred = False  # a backward ran under ``no_sync``: its gradients are not summed yet
        self._no_sync = False  # inside ``no_sync``

    # ---- planning ----------------------------------------------------------------------------------------

    @property
    def planned(self) -> bool:
        return self.pm is not None

    def plan_from(self, global_batch: Mapping[str, Any]) -> ParallelModule:
        """Plan and build the program for ``global_batch`` (the same on every rank: the batch one process would
        read, with its keyword inputs as the model will be called), in the model's training mode, leaving every
        random generator as it was.  ``local`` contract first where allowed; where soybean does not offer it for
        this model (its error names ``local_batch``), ``full``."""
        import soybean

        if self.pm is not None:
            raise RuntimeError("this SoybeanModel is already planned: plan once, from the first batch")
        rank, size = world()
        serial = self.serial
        was_training = serial.training
        serial.train()
        example = {k: v for k, v in global_batch.items() if v is not None}
        batch = {int(v.shape[0]) for v in _batch_tensors(example).values()}
        if len(batch) != 1:
            raise ValueError(f"the batch's inputs disagree on the batch size (dim 0: {sorted(batch)}): give every "
                             "input with a dim 0 the batch's rows")
        rows = batch.pop()
        if rows % size:
            raise ValueError(f"the global batch has {rows} rows, not a multiple of the {size} ranks: each rank's "
                             "data loader gives it an equal slice")
        pm: Any = None
        try:
            with kept_rng():
                if self.contract != "full":
                    try:
                        pm = soybean.parallelize(serial, example, devices=size, local_batch=True, **self.options)
                        self.used = "local"
                    except ValueError as e:
                        if self.contract == "local" or "local_batch" not in str(e):
                            raise
                        pm = None  # this model or mode has no local contract: the whole batch then
                    if pm is not None and not self._aligned(pm, example, rows, size):
                        if self.contract == "local":  # the same answer on every rank: read from the plan
                            raise ValueError(f"the local contract's split of the batch is not the data loader's "
                                             f"(rank {rank} of {size}): use contract='auto' or 'full'")
                        pm = None  # the plan reads other rows than the loader gives: gather the batch instead
                if pm is None:
                    pm = soybean.parallelize(serial, example, devices=size, **self.options)
                    self.used = "full"
        finally:
            serial.train(was_training)
        if not isinstance(pm, ParallelModule):
            raise ValueError(f"soybean.hf runs one program over every device, but the plan made a {type(pm).__name__}"
                             " (pipeline stages, placed regions or a model captured in pieces): drop pipeline= and "
                             "placement=, or make the model exportable")
        self.pm = pm
        self._rows = {k: (rows // size, *v.shape[1:]) for k, v in _batch_tensors(example).items()}
        if self._optimizer is not None:
            self.rebind(self._optimizer)
        return pm

    @staticmethod
    def _aligned(pm: Any, example: Mapping[str, Any], rows: int, size: int) -> bool:
        """Whether, under the local contract, every rank's tile of every row input is the rows its data loader
        gives it, ``[r b, (r + 1) b)``: read from the plan for every rank (no collective), so all ranks agree."""
        if not isinstance(pm, ParallelModule):
            return True  # refused by the caller, by name
        mesh = Mesh(tuple(pm.plan.mesh))
        b = rows // size
        names = pm.input_names
        for k, v in _batch_tensors(example).items():
            if k not in names:
                return False
            tiling = pm.plan.input_tiling(k)
            index = torch.arange(rows).view(rows, *([1] * (v.dim() - 1))).expand(v.shape)  # each element's row
            for r in range(size):
                tile = local_tile(index, tiling, mesh, mesh.coords(r), copy=False)
                want = torch.arange(r * b, (r + 1) * b).view(b, *([1] * (v.dim() - 1))).expand(b, *v.shape[1:])
                if tile.shape != want.shape or not torch.equal(tile, want):
                    return False
        return True

    def describe(self) -> str:
        """One line: the plan's mesh, the contract it runs under and how many parameters it splits."""
        pm = self._module()
        names = [n for n, _ in pm.named_parameters()]
        split = sum(1 for n in names if any(pl != R for pl in pm.plan.param_tiling(n)))
        return (f"soybean: mesh {'x'.join(map(str, pm.plan.mesh))}, {self.used} batch contract, {split} of "
                f"{len(names)} parameters split, modelled step {pm.plan.cost.get('step_time_s', 0.0) * 1e3:.3g} ms")

    # ---- running -----------------------------------------------------------------------------------------

    def _module(self) -> ParallelModule:
        if self.pm is None:
            raise RuntimeError("SoybeanModel is not planned yet: call it on a batch, or plan_from(global_batch)")
        return self.pm

    def forward(self, **batch: Any) -> Any:
        """The model's output on the global batch of which ``batch`` is this rank's slice (``loss`` whole, the same
        on every rank); the first call plans from the global batch."""
        batch = {k: v for k, v in batch.items() if v is not None}
        if self.pm is None:
            self.plan_from(gather_rows(batch))
        return self._run(batch)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``, which Trainer and ``accelerator.no_sync`` / ``accumulate`` call for every micro-batch
        but an optimizer step's last: the backward passes inside leave the gradients the plan sums across ranks
        (``GradSync``: the replicated parameters' of a plan that splits others) unsummed, and the next backward
        outside (or the optimizer's step, or ``grad_norm``) sums them once: one sum per step, not one per micro-batch
        (a backward outside is exact too, ``GradSync`` keeps earlier sums aside)."""
        self._no_sync = True  # read by ``_run``: the module may be planned only by the first call inside
        try:
            yield
        finally:
            self._no_sync = False
            sync = self._grad_sync() if self.pm is not None else None
            if sync is not None:
                sync.deferred = False

    def _grad_sync(self) -> Any:
        return getattr(self._module(), "_grad_sync", None)

    def _sum_pending(self) -> None:
        """Sum the gradients backward passes under ``no_sync`` left unsummed (the step's last backward ran there
        too, or the step follows without one outside): once, before anything reads them."""
        sync = self._grad_sync()
        if sync is not None and self._deferred:
            sync.sync_now()
        self._deferred = False

    def _stepped(self) -> None:
        """After an optimizer step (its hook) or ``zero_grad``: a new accumulation starts."""
        self._deferred = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._stepped()

    @guarded()  # a batch of the wrong shape on one rank is one error on every rank
    def _run(self, batch: dict[str, Any]) -> Any:
        pm = self._module()
        sync = self._grad_sync()
        if sync is not None and self._no_sync:
            sync.defer()
            self._deferred = True
        elif sync is not None and torch.is_grad_enabled():
            self._deferred = False  # this backward sums what was left unsummed (``GradSync``: exact over passes)
        got = {k: tuple(v.shape) for k, v in _batch_tensors(batch).items()}
        want = self._rows
        if got != want:
            raise ValueError(f"this rank's batch has shapes {got}, the plan was made for {want}: soybean runs one "
                             "planned batch shape; pad every batch to one length and drop the last partial batch "
                             "(dataloader_drop_last=True)")
        if self.used == "full":
            batch = gather_rows(batch)
        return pm(**batch)

    # ---- the serial model's training state, from the tiles --------------------------------------------------

    def _tiled(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._module().named_parameters() if p.requires_grad]

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """``||g||_2`` over every gradient of the serial model (what ``torch.nn.utils.clip_grad_norm_`` returns
        serially), from the tiles (``ParallelModule.grad_norm``), pending sums summed first.  Every rank calls it;
        the same value on every rank."""
        self._sum_pending()
        return self._module().grad_norm()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient tile by ``min(1, max_norm / (norm + 1e-6))`` with the serial norm (``grad_norm``),
        as ``torch.nn.utils.clip_grad_norm_`` does serially; returns the norm before clipping."""
        self._sum_pending()
        return self._module().clip_grad_norm_(max_norm)

    def _by_serial_param(self) -> dict[int, tuple[str, nn.Parameter]]:
        """id of each serial parameter -> (its name in the plan, the tile the plan trains for it); a parameter
        the program does not hold (unused by forward) is absent.  Tied names map to the one tile."""
        tiles = dict(self._module().named_parameters())
        out: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in self.serial.named_parameters(remove_duplicate=False):
            if id(p) not in out and name in tiles:
                out[id(p)] = (name, tiles[name])
        return out

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` (built on the serial model's parameters, its groups and settings as the user made
        them) at the tiles: each serial parameter in its groups becomes its tile, in place, so the optimizer's
        parameter order, and so its ``state_dict`` indices, stay the serial optimizer's.  A parameter the program
        does not hold stays (it never gets a gradient, so it is never stepped).  Before its first step only."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
        if inner.state:
            raise RuntimeError("the optimizer has state already: rebind it to soybean's tiles before its first step")
        mine = self._by_serial_param()
        for group in inner.param_groups:
            group["params"] = [mine[id(p)][1] if id(p) in mine else p for p in group["params"]]
        # Gradients left unsummed by ``no_sync`` are summed before the step reads them; a step ends an accumulation.
        inner.register_step_pre_hook(lambda *_: self._sum_pending())
        inner.register_step_post_hook(lambda *_: self._stepped())

    def _names(self, optimizer: torch.optim.Optimizer) -> list[str | None]:
        """The plan's name of each parameter of ``optimizer`` in ``state_dict`` index order (None: not a tile)."""
        tiles = {id(p): n for n, p in self._module().named_parameters()}
        inner = getattr(optimizer, "optimizer", optimizer)
        return [tiles.get(id(p)) for g in inner.param_groups for p in g["params"]]

    @torch.no_grad()
    def optimizer_state_full(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every per-parameter tensor of a tile's shape gathered to the whole
        tensor in the model's own shape: the serial optimizer's state dict (same indices, same groups).  Every
        rank calls it (a collective); every rank gets it."""
        pm = self._module()
        sd = optimizer.state_dict()
        names = self._names(optimizer)
        shapes = {n: tuple(p.shape) for n, p in pm.named_parameters()}
        state: dict[int, dict[str, Any]] = {}
        for i in sorted(sd["state"]):
            name = names[i]
            state[i] = {k: (pm.full_of(name, v) if name is not None and isinstance(v, torch.Tensor) and v.dim() > 0
                            and tuple(v.shape) == shapes[name] else v)
                        for k, v in sd["state"][i].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    @torch.no_grad()
    def load_optimizer_state_full(self, optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
        """Load a serial optimizer state dict (``optimizer_state_full``'s, or a serial run's) into ``optimizer``
        bound to the tiles: each per-parameter tensor of the parameter's whole shape is cut to this rank's
        tile."""
        pm = self._module()
        names = self._names(optimizer)
        shapes = {n: tuple(p.shape) for n, p in self.serial.named_parameters(remove_duplicate=False)}
        state = {}
        for i, entry in full["state"].items():
            name = names[int(i)]
            state[i] = {k: (pm.tile_of(name, v).clone() if name is not None and isinstance(v, torch.Tensor)
                            and v.dim() > 0 and tuple(v.shape) == shapes.get(name) else v)
                        for k, v in entry.items()}
        optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's ``state_dict()`` for the current values (every rank calls it; every rank gets it)."""
        return self._module().full_state_dict()

    @torch.no_grad()
    def sync_serial(self) -> nn.Module:
        """Copy the current values into the serial model (every rank calls it) and return it: what evaluation and
        ``save_pretrained`` read.  A tensor the program does not hold keeps its value (it never changes)."""
        sd = self.full_state_dict()
        own = self.serial.state_dict()
        self.serial.load_state_dict({k: v.to(own[k].device) for k, v in sd.items() if k in own}, strict=False)
        return self.serial

    @torch.no_grad()
    def load_serial(self) -> None:
        """The serial model's current values into the tiles (after it was loaded from a checkpoint)."""
        self._module().load_full_state_dict(self.serial.state_dict())

    def trainable(self) -> Iterable[nn.Parameter]:
        """The tiles an optimizer trains."""
        return (p for _, p in self._tiled())
