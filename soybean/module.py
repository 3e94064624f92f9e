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

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .capture import Captured
from .codegen.lower import gather_now, lower
from .mesh import Mesh
from .outputs import lazy_outputs, local_mean
from .plan import Plan
from .precision import policy
from .runtime.comm import Group
from .runtime.context import use_groups
from .runtime.gradsync import GradSync
from .runtime.pending import wait_all
from .tiling import R, local_tile


def _attach(root: nn.Module, fqn: str, value: torch.Tensor, kind: str, shared: bool = False) -> None:
    """Register ``value`` under ``fqn``; ``shared``: a parameter is registered as the very object given."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if kind == "param" and shared and isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif kind == "param":
        mod.register_parameter(leaf, nn.Parameter(value, requires_grad=value.is_floating_point()))
    else:
        mod.register_buffer(leaf, value)


class ParallelModule(nn.Module):
    """The per-rank program plus the local tiles it runs on."""

    program: fx.GraphModule  # set with object.__setattr__ in __init__ (a plain attribute, not a submodule)

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
        self._order: list[tuple[str, str]] = []  # (kind, fqn) in placeholder order
        for node in cap.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in cap.params:
                kind, fqn = "param", cap.params[node.name]
            elif node.name in cap.buffers:
                kind, fqn = "buffer", cap.buffers[node.name]
            else:
                continue
            tiling = plan.param_tiling(fqn)
            if share_params and kind == "param" and all(p == R for p in tiling) and pol.name == "fp32":
                # The model's own parameter: an optimizer built on the model updates what this module runs.
                _attach(self, fqn, state[fqn], kind, shared=True)
            else:
                with torch.no_grad():
                    tile = local_tile(state[fqn].detach(), tiling, mesh, self._coords)
                    _attach(self, fqn, tile if kind == "param" else pol.cast(tile), kind)
            self._order.append((kind, fqn))
        # not a submodule: no params of its own
        object.__setattr__(self, "program", lower(cap, plan, rank, tile_outputs=lazy_outputs))
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
        return self.get_parameter(fqn) if kind == "param" else self.get_buffer(fqn)

    def forward(self, *args: Any) -> Any:
        # The policy's compute copies: a parameter cast from its master (differentiable), inputs cast.
        state = [self._policy.cast(self._tensor(k, f)) if k == "param" else self._tensor(k, f) for k, f in self._order]
        user = [self._policy.cast(a) if isinstance(a, torch.Tensor) else a for a in args]
        n_user = len(self._cap.inputs)
        if len(user) != n_user:
            raise TypeError(f"this model takes {n_user} tensor inputs, got {len(user)}")
        wait_all()  # the previous step's loss sum, if nobody read it
        if self._grad_sync is not None and torch.is_grad_enabled():
            self._grad_sync.check_complete()
        with use_groups(self._groups):
            out = self.program(*state, *user)
        if any(t is not None for t in self._out_tilings):
            out = self._returned(out)
        spec = self._cap.out_spec  # the model's own output structure (a ModelOutput stays one)
        if spec is not None and isinstance(out, (tuple, list)) and spec.num_leaves == len(out):
            return tree_unflatten(list(out), spec)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    def _returned(self, out: Any) -> Any:
        """Split outputs as the contract hands them: under ``local_batch`` the tile with DDP's mean gradient,
        else a ``LazyFull`` (``soybean.outputs``)."""
        flat, spec = tree_flatten(out)
        if self.plan.local_batch:
            flat = [local_mean(o, t, self._mesh) if t is not None and isinstance(o, torch.Tensor) else o
                    for o, t in zip(flat, self._out_tilings)]
        else:
            flat = lazy_outputs(flat, self._out_tilings, self._out_shapes, self._mesh, self._coords, self._groups)
        return tree_unflatten(flat, spec)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter and buffer, gathered (on every rank; rank 0 saves)."""
        out: dict[str, torch.Tensor] = {}
        with use_groups(self._groups):
            for kind, fqn in self._order:
                t = self._tensor(kind, fqn).detach()
                out[fqn] = gather_now(t, self.plan.param_tiling(fqn), self._full_shape(fqn), self._mesh,
                                      self._coords).clone()
        for alias, fqn in self._cap.aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def _full_shape(self, fqn: str) -> tuple[int, ...]:
        cap = self._cap
        for node in cap.graph.nodes:
            if node.op == "placeholder" and (cap.params.get(node.name) == fqn or cap.buffers.get(node.name) == fqn):
                return tuple(node.meta["val"].shape)
        raise KeyError(fqn)

    def save_sharded(self, path: str) -> None:
        """Save this rank's tiles as a ``torch.distributed.checkpoint`` that loads under any plan."""
        from .runtime.checkpoint import save

        save(self, path)

    def load_sharded(self, path: str) -> None:
        """Load a ``torch.distributed.checkpoint`` (written under any plan) into this rank's tiles."""
        from .runtime.checkpoint import load

        load(self, path)

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load full tensors (as from the serial model's ``state_dict()``): each rank keeps its tile."""
        for kind, fqn in self._order:
            if fqn not in sd:
                raise KeyError(f"state dict has no {fqn}")
            tiling = self.plan.param_tiling(fqn)
            self._tensor(kind, fqn).copy_(local_tile(sd[fqn], tiling, self._mesh, self._coords))
