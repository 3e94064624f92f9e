"""ParallelModule: one rank's share of a planned model, usable as a drop-in nn.Module.

Each rank holds only its tile of every parameter and buffer (``plan.params``),
as ``nn.Parameter``s named like the original model's, so
``torch.optim.AdamW(pmodel.parameters())`` updates local tiles.  ``forward``
takes the full inputs on every rank and returns the full outputs on every rank
(the generated program slices inputs and gathers outputs); gradients of
replicated parameters are summed by the program's adjoint collectives, so
``opt.step()`` gives the serial update.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture.core import EXPORT_LOCK, Captured
from ..codegen.lower import gather_now, lower
from ..mesh import Mesh
from ..plan import Plan
from ..precision import policy
from ..runtime.agree import guarded
from ..runtime.comm import Group
from ..runtime.context import use_groups
from ..runtime.gradsync import GradSync
from ..runtime.pending import wait_all
from ..tiling import R, local_shape, local_tile
from . import grad_norm as norms
from .modes import for_eval
from .outputs import lazy_outputs, local_mean


def _attach(root: nn.Module, fqn: str, value: torch.Tensor, kind: str, shared: bool = False,
            trains: bool = True) -> None:
    """Register ``value`` under ``fqn``; ``shared``: a parameter is registered as the very object given;
    ``trains``: whether a parameter requires a gradient (a frozen one keeps the model's ``False``).  A
    ``constant`` (made by forward, ``Captured.constants``) is a buffer outside the state dict."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if kind == "param" and shared and isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif kind == "param":
        mod.register_parameter(leaf, nn.Parameter(value, requires_grad=trains and value.is_floating_point()))
    else:
        mod.register_buffer(leaf, value, persistent=kind == "buffer")


def _skeleton(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory): it keeps the model's
    own state-dict hooks, through which ``full_state_dict`` and ``load_full_state_dict`` convert names and
    layouts exactly as ``model.state_dict()`` and ``model.load_state_dict()`` do.  None when the model cannot
    be copied (then the state dict is keyed by the parameters' own names)."""
    memo: dict[int, Any] = {}
    # Under capture's lock: another thread's torch.export (ranks as threads) patches the dispatcher's state.
    with EXPORT_LOCK:
        for t in itertools.chain(model.parameters(), model.buffers()):
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        try:
            return copy.deepcopy(model, memo)
        except Exception:  # any object deepcopy cannot copy (a lock, a handle): the plain names still work
            return None


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module holding tensor ``fqn`` and the tensor's name in it."""
    path, _, leaf = fqn.rpartition(".")
    return root.get_submodule(path), leaf


@guarded()
def forward_backward(module: nn.Module, inputs: tuple, kwargs: dict[str, Any], loss_fn: Callable[..., torch.Tensor],
                     target: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """``module(*inputs, **kwargs)``, ``loss_fn`` on its output (and ``target``), backward; the loss detached: the
    ``train_step`` of a module whose forward returns the whole batch's output (``ParallelModule``,
    ``placed.PlacedModule``); ``reduction`` is the contract's, checked, and changes nothing here.  An error on any
    rank ends every rank (``runtime.agree.guarded``): that rank's own exception there, ``RankFailedError`` naming
    it on the others."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"unknown reduction {reduction!r}: use mean or sum")
    out = module(*inputs, **kwargs)
    loss = loss_fn(out) if target is None else loss_fn(out, target)
    loss.backward()
    return loss.detach()


def split_weights(parts: Sequence[tuple[Captured, Plan]]) -> list[str]:
    """The trained weights some part's plan stores split (on any mesh axis), sorted: what ``split_weights`` of every
    module kind reads (plans are the same on every rank, so the answer is)."""
    return sorted({fqn for cap, plan in parts for fqn in cap.params.values()
                   if fqn not in cap.frozen and any(pl != R for pl in plan.param_tiling(fqn))})


class KeepsMesh:
    """A module whose tiles lie on one mesh of its plan's shape in its checkpoints (``runtime.checkpoint``): the
    DeviceMesh kept for every save and load (``KeptMesh``), made at the first (the import and the groups wait until
    a checkpoint needs them).  ``ParallelModule`` and ``pieces.PiecesModule`` are such modules."""

    plan: Any  # the ``Plan`` that runs
    _checkpoint_mesh: Any = None  # a ``runtime.checkpoint.KeptMesh``, made at the first save or load

    def _mesh_of(self, fqn: str) -> Any:
        """The DeviceMesh a checkpoint wraps ``fqn``'s tile on: one for every tensor of this module."""
        from ..runtime.checkpoint import KeptMesh

        if self._checkpoint_mesh is None:
            self._checkpoint_mesh = KeptMesh()
        return self._checkpoint_mesh.of(self.plan.mesh)


class ParallelModule(KeepsMesh, nn.Module):
    """The per-rank program plus the local tiles it runs on."""

    program: fx.GraphModule  # set with object.__setattr__ in __init__ (a plain attribute, not a submodule)
    _eval_program: fx.GraphModule | None = None  # ``program`` in evaluation mode (``_program``), made when first run
    _in_shapes: list[tuple[int, ...] | None] | None = None  # each input's shape as planned (``_check_shapes``)

    def __init__(self, model: nn.Module, cap: Captured, plan: Plan, rank: int, groups: Sequence[Group],
                 lazy_outputs: bool = False, share_params: bool = False) -> None:
        super().__init__()
        mesh = Mesh(tuple(plan.mesh))
        if len(groups) != mesh.ndim:
            raise ValueError(f"plan mesh {plan.mesh} has {mesh.ndim} axes but {len(groups)} groups were given")
        self._mesh, self._rank, self._coords = mesh, rank, mesh.coords(rank)
        self._groups = list(groups)
        self.plan = plan
        self._cap = cap
        # Parameters are kept as the policy's masters (the model's own dtype); buffers as it computes them.
        self._policy = pol = policy(plan.precision)
        state: dict[str, torch.Tensor] = dict(model.named_parameters())
        state.update(dict(model.named_buffers()))
        state.update(cap.constants)
        self._order: list[tuple[str, str]] = []  # (kind, fqn) in placeholder order; kind: param, buffer, constant
        self._shapes: dict[str, tuple[int, ...]] = {}  # fqn -> the full shape of its tensor, as the graph reads it
        self._held_whole: set[str] = set()  # shared parameters the graph reads in another shape (``Captured.views``)
        for node in cap.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in cap.params:
                kind, fqn = "param", cap.params[node.name]
            elif node.name in cap.buffers:
                fqn = cap.buffers[node.name]
                kind = "constant" if fqn in cap.constants else "buffer"
            else:
                continue
            tiling = plan.param_tiling(fqn)
            if share_params and kind == "param" and all(p == R for p in tiling) and pol.name == "fp32":
                # The model's own parameter: an optimizer built on the model updates what this module runs (read
                # through ``_tensor``, as the graph reads it).
                _attach(self, fqn, state[fqn], kind, shared=True)
                if fqn in cap.views:
                    self._held_whole.add(fqn)
            else:
                with torch.no_grad():
                    tile = local_tile(cap.stored(fqn, state[fqn].detach()), tiling, mesh, self._coords)
                    _attach(self, fqn, tile if kind == "param" else pol.cast(tile), kind, trains=fqn not in cap.frozen)
            self._order.append((kind, fqn))
            self._shapes[fqn] = tuple(node.meta["val"].shape)
        self._skeleton: nn.Module | None
        object.__setattr__(self, "_skeleton", _skeleton(model))  # not a submodule: its meta tensors are not ours
        # not a submodule: no params of its own
        # A shared parameter's ``grad`` may accumulate what other code adds (another piece of a dynamo capture): its
        # partial gradients are summed per use in the program, not by the bucketed sync of the accumulated total.
        shared = frozenset(f for k, f in self._order if k == "param" and self.get_parameter(f) is state[f])
        object.__setattr__(self, "program", lower(cap, plan, rank, tile_outputs=lazy_outputs, summed_per_use=shared))
        self._out_tilings: list = self.program.meta.get("output_tilings", [])
        self._out_shapes = [tuple(v.shape) if isinstance(v := getattr(a, "meta", {}).get("val"), torch.Tensor) else ()
                            for a in tree_flatten(next(n for n in cap.graph.nodes if n.op == "output").args[0])[0]]
        sync = self.program.meta.get("grad_sync", {})
        # A tied weight is one parameter behind two placeholders: sync it once.
        synced = list(dict.fromkeys(fqn for kind, fqn in self._order if fqn in sync))
        self._grad_sync = (
            GradSync([(self.get_parameter(fqn), sync[fqn]) for fqn in synced], self._groups,
                     reduce_dtype=pol.compute) if sync else None
        )

    def local_slice(self, x: torch.Tensor, input_index: int = 0) -> torch.Tensor:
        """This rank's tile of a full input, under the plan's tiling of input ``input_index``
        (what a data loader feeds each rank under ``local_batch=True``)."""
        return local_tile(x, self.plan.input_tiling(self._cap.inputs[input_index]), self._mesh, self._coords)

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor:
        """This rank's tile of ``fqn`` as the program reads it (a shared parameter held in the model's shape: viewed
        in the graph's, ``Captured.views``)."""
        t = self.get_parameter(fqn) if kind == "param" else self.get_buffer(fqn)
        return self._cap.stored(fqn, t) if fqn in self._held_whole else t

    @guarded()  # an error on one rank is one error on every rank, never a peer waiting in a collective
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The policy's compute copies: a parameter cast from its master (differentiable), inputs cast.
        state = [self._policy.cast(self._tensor(k, f)) if k == "param" else self._tensor(k, f) for k, f in self._order]
        given = self._cap.flatten_inputs(args, kwargs)
        n_user = len(self._cap.inputs)
        if len(given) != n_user:
            raise TypeError(f"this model takes {n_user} tensor inputs, got {len(given)}")
        self._check_shapes(given)
        user = [self._policy.cast(a) if isinstance(a, torch.Tensor) else a for a in given]
        wait_all(self._groups)  # the previous step's loss sum, if nobody read it
        if self._grad_sync is not None and torch.is_grad_enabled() and not self._grad_sync.deferred:
            self._grad_sync.check_complete()
            params = [(t, self.get_parameter(f)) for t, (k, f) in zip(state, self._order) if k == "param"]
            self._grad_sync.watch([t for t, _ in params], [p for _, p in params])
        with use_groups(self._groups):
            out = self._program()(*state, *user)
        if any(t is not None for t in self._out_tilings):
            out = self._returned(out)
        spec = self._cap.out_spec  # the model's own output structure (a ModelOutput stays one)
        if spec is not None and isinstance(out, (tuple, list)) and spec.num_leaves == len(out):
            return tree_unflatten(list(out), spec)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    def _check_shapes(self, given: Sequence[Any]) -> None:
        """A ``ValueError`` naming the input and the fixes when a tensor input's shape is not the example's (this
        rank's rows of it under ``local_batch``): the program is lowered for those shapes, and another (a last batch
        of another size) fails deep in a collective or a view, or runs a plan made for other shapes."""
        if self._in_shapes is None:  # once: the graph's placeholders are read, not walked per call
            vals = {n.name: n.meta.get("val") for n in self._cap.graph.nodes if n.op == "placeholder"}
            shapes: list[tuple[int, ...] | None] = []
            for name in self._cap.inputs:
                val = vals.get(name)
                want = tuple(val.shape) if isinstance(val, torch.Tensor) else None
                if want is not None and self.plan.local_batch:
                    want = local_shape(want, self.plan.input_tiling(name), self._mesh, self._coords)
                shapes.append(want)
            self._in_shapes = shapes
        for name, a, want in zip(self._cap.inputs, given, self._in_shapes):
            if isinstance(a, torch.Tensor) and want is not None and tuple(a.shape) != want:
                rows = " (this rank's rows of it: local_batch)" if self.plan.local_batch else ""
                raise ValueError(
                    f"input {name!r} has shape {tuple(a.shape)}, but this module was planned for {want}, the "
                    f"example's{rows}: every call takes the example's shapes. A last batch of another size: drop it "
                    f"(DataLoader(..., drop_last=True)) or pad it; another batch size or sequence length: "
                    f"parallelize again with an example of that shape")

    def _program(self) -> fx.GraphModule:
        """The program for the module's mode: as lowered in training mode, its evaluation-mode copy after ``eval()``
        (``soybean.run.modes``: dropout off, batch norm on running statistics), made at the first use."""
        if self.training:
            return self.program
        if self._eval_program is None:
            object.__setattr__(self, "_eval_program", for_eval(self.program))
        assert self._eval_program is not None
        return self._eval_program

    def train_step(self, *inputs: Any, loss_fn: Callable[..., torch.Tensor], target: torch.Tensor | None = None,
                   reduction: str = "mean", **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch: ``loss_fn(output)`` (``loss_fn(output, target)`` with ``target``)
        backpropagated, the loss returned detached (the same on every rank), gradients ready for ``opt.step()``.
        The training contract a pipelined plan shares (``pipelined.PipelinedModule.train_step``), so one loop
        serves both; ``reduction`` is that contract's and changes nothing here (the loss is the whole batch's)."""
        return forward_backward(self, inputs, kwargs, loss_fn, target, reduction)

    def _returned(self, out: Any) -> Any:
        """Split outputs as the contract hands them: under ``local_batch`` the tile with DDP's mean gradient,
        else a ``LazyFull`` (``soybean.run.outputs``)."""
        flat, spec = tree_flatten(out)
        if self.plan.local_batch:
            flat = [local_mean(o, t, self._mesh) if t is not None and isinstance(o, torch.Tensor) else o
                    for o, t in zip(flat, self._out_tilings)]
        else:
            flat = lazy_outputs(flat, self._out_tilings, self._out_shapes, self._mesh, self._coords, self._groups)
        return tree_unflatten(flat, spec)

    def _state(self) -> Iterator[tuple[str, str]]:
        """(kind, fqn) of the model's own parameters and buffers (not the constants forward made)."""
        return ((k, f) for k, f in self._order if k != "constant")

    def whole(self, fqn: str, tile: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``tile`` is this rank's tile under the stored tiling of ``fqn`` (a parameter's,
        its gradient's or its optimizer state's), gathered now over this module's groups (every rank of them
        calls it)."""
        with use_groups(self._groups):
            return gather_now(tile, self.plan.param_tiling(fqn), self._full_shape(fqn), self._mesh, self._coords)

    def tile(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's tile of ``full`` under the stored tiling of ``fqn`` (``whole``'s inverse)."""
        return local_tile(full, self.plan.param_tiling(fqn), self._mesh, self._coords)

    @property
    def input_names(self) -> list[str]:
        """The model's tensor inputs in call order (a keyword input by its name): ``local_slice``'s indices."""
        return list(self._cap.inputs)

    def full_of(self, fqn: str, tile: torch.Tensor) -> torch.Tensor:
        """``whole`` in the model's own shape of ``fqn`` (a tensor the graph reads in another shape,
        ``Captured.views``, given back as the model holds it): a parameter's optimizer state as the serial
        optimizer keeps it.  Every rank of this module's groups calls it."""
        return self._cap.unstored(fqn, self.whole(fqn, tile))

    def tile_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """``full_of``'s inverse: this rank's tile of ``full``, given in the model's own shape of ``fqn``."""
        return self.tile(fqn, self._cap.stored(fqn, full))

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter and buffer (non-persistent ones included) by the model's own names,
        tied aliases included, gathered on every rank."""
        out: dict[str, torch.Tensor] = {}
        for kind, fqn in self._state():
            whole = self.whole(fqn, self._tensor(kind, fqn).detach())
            out[fqn] = self._cap.unstored(fqn, whole).clone()
        for alias, fqn in self._cap.aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    @contextmanager
    def _filled_skeleton(self, tensors: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
        """The model's skeleton (``_skeleton``) holding ``tensors`` (by parameter and buffer name, aliases
        included) while the block runs; emptied to the meta device afterwards."""
        sk = self._skeleton
        assert sk is not None
        names = [(n, True) for n, _ in sk.named_parameters(remove_duplicate=False)]
        names += [(n, False) for n, _ in sk.named_buffers(remove_duplicate=False)]
        try:
            for name, is_param in names:
                if name in tensors:
                    mod, leaf = _owner(sk, name)
                    setattr(mod, leaf, nn.Parameter(tensors[name], requires_grad=False) if is_param else tensors[name])
            yield sk
        finally:
            for name, is_param in names:
                mod, leaf = _owner(sk, name)
                t = getattr(mod, leaf)
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    setattr(mod, leaf, nn.Parameter(meta, requires_grad=False) if is_param else meta)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``model.state_dict()`` of the serial model would give for the current values: full tensors,
        gathered on every rank (rank 0 saves), named and laid out by the model's own state-dict hooks (a fused
        ``wqkv`` presented as ``wq``/``wk``/``wv``), non-persistent buffers left out."""
        tensors = self.full_tensors()
        if self._skeleton is None:
            return tensors
        with self._filled_skeleton(tensors) as sk:
            return {k: v.detach() for k, v in sk.state_dict().items()}

    def _full_shape(self, fqn: str) -> tuple[int, ...]:
        return self._shapes[fqn]

    def split_weights(self) -> list[str]:
        """The trained weights the plan stores split on some mesh axis (``soybean.run.optimizers``)."""
        return split_weights([(self._cap, self.plan)])

    # ---- the serial model's gradient norm (``soybean.run.grad_norm``) ----
    def _trained_grads(self, counted: Callable[[str], bool] = lambda fqn: True) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.grad) for n, p in self.named_parameters() if p.grad is not None and counted(n)]

    def grad_share(self, norm_type: float, counted: Callable[[str], bool] = lambda fqn: True) -> torch.Tensor:
        """This rank's share of the serial ``||g||_q^q`` (``soybean.run.grad_norm.share``) over the gradients of the
        parameters ``counted`` accepts; summed over this module's ranks it is theirs."""
        return norms.share(self._trained_grads(counted), list(self.plan.mesh), self.plan.param_tiling, norm_type)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The serial model's gradient norm, what ``torch.nn.utils.clip_grad_norm_`` returns serially, from the
        tiles (``soybean.run.grad_norm``), the same on every rank (every rank calls it).  torch's own function over
        ``parameters()`` sees this rank's tiles only."""
        q = norms.check_norm_type(norm_type)
        total = self.grad_share(q).reshape(1)
        for g in self._groups:  # a sum (or maximum) over each mesh axis in turn is one over the mesh
            total = (g.all_gather(total, 0, g.size).max().reshape(1) if math.isinf(q) else g.all_reduce(total))
        grads = self._trained_grads()
        return norms.norm_of(total[0], q, grads[0][1].dtype if grads else torch.float32)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the serial model: every gradient tile scaled by
        ``min(1, max_norm / (norm + 1e-6))`` with the serial norm (``grad_norm``); returns that norm.  Call it after
        ``backward`` or ``train_step``, on every rank."""
        total = self.grad_norm(norm_type)
        norms.clip(self.parameters(), max_norm, total, error_if_nonfinite)
        return total

    def save_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                     extra: Any = None, keep: int | None = None) -> Path:
        """Save a new checkpoint under directory ``path`` (every rank calls it): this rank's tiles, the state
        ``optimizer`` holds for them, and ``extra`` (anything picklable: the step, a scheduler's and the RNG's
        state; rank 0's is kept).  Written beside the older ones and committed by rename, so a crash mid-save
        leaves the previous checkpoint loadable; ``keep``: how many to leave (the newest), None for all.
        Returns the new checkpoint's directory (``path/ckpt-NNNNNN``)."""
        from ..runtime.checkpoint import save

        return save(self, path, optimizer, extra, keep)

    def load_sharded(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Load the newest checkpoint under ``path`` (or the one checkpoint ``path``), saved under any plan,
        mesh or world size, into this rank's tiles and ``optimizer``'s state; returns its ``extra`` (None if
        none was saved).  ``FileNotFoundError`` when ``path`` holds no complete checkpoint
        (``soybean.latest_checkpoint(path)`` is None); ``CheckpointError`` for a checkpoint of another model or
        one whose files are missing or cut short."""
        from ..runtime.checkpoint import load

        return load(self, path, optimizer)

    def by_own_names(self, sd: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The tensors of ``sd`` (what ``model.state_dict()`` gives) by the model's own parameter and buffer names
        (aliases included), read through the model's load hooks as ``model.load_state_dict`` reads them, and the
        state-dict keys it lacks."""
        if self._skeleton is None:
            return [], dict(sd)
        sk = self._skeleton
        with self._filled_skeleton({}):
            missing, _ = sk.load_state_dict(sd, strict=False, assign=True)
            return missing, {n: t for n, t in itertools.chain(sk.named_parameters(remove_duplicate=False),
                                                               sk.named_buffers(remove_duplicate=False))
                             if not t.is_meta}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load full tensors, as the serial model's ``state_dict()`` gives them (through its own load hooks,
        as ``model.load_state_dict`` reads them): each rank keeps its tile.  Non-persistent buffers keep their
        values."""
        missing, full = self.by_own_names(sd)
        for kind, fqn in self._state():
            if fqn not in full:
                if kind == "buffer" and fqn not in sd and fqn not in missing:
                    continue  # non-persistent: not in any state dict
                raise KeyError(f"state dict has no {fqn}")
            self._tensor(kind, fqn).copy_(self.tile(fqn, self._cap.stored(fqn, full[fqn])))
