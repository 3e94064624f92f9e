"""The oracle: a plan is right when parallel training equals serial training.

``train_serial`` and ``train_parallel_threads`` run the same few AdamW steps;
``compare`` reports the largest relative difference of the loss, every
parameter gradient and every parameter after the steps.  All ranks run as
threads of this process (the simulated tier), so no process group is needed.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from ..mesh import Mesh
from ..plan import Plan
from ..precision import Policy, compute_model, policy
from ..runtime.comm import Group
from ..runtime.launch import run_threads

if TYPE_CHECKING:
    from ..capture.core import Captured
    from ..run.module import ParallelModule

M = TypeVar("M", bound=torch.nn.Module)
Grads = dict[str, torch.Tensor]


@dataclass
class Trace:
    losses: list[float]
    grads: dict[str, torch.Tensor]      # after the first backward
    params: dict[str, torch.Tensor]     # after the last step
    buffers: dict[str, torch.Tensor]


def loss_of(out: object) -> torch.Tensor:
    """The loss a training loop takes from a model's output: a scalar as it is; a ``ModelOutput`` or dict's
    ``loss`` when it has one; else the mean square of the output (its first tensor)."""
    if isinstance(out, Mapping) and out.get("loss") is not None:
        return out["loss"]
    if not isinstance(out, torch.Tensor):
        leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if not leaves:
            raise TypeError("verify needs a model returning a tensor (its loss, or an output to square)")
        out = leaves[0]
    return out if out.dim() == 0 else out.float().pow(2).mean()


def _call(m: torch.nn.Module, inputs: tuple | dict) -> object:
    """``m`` called on an example: positional arguments, or keywords (a dict)."""
    return m(**inputs) if isinstance(inputs, dict) else m(*inputs)


def _train(m: M, inputs: tuple | dict, steps: int, lr: float,
           grads_of: Callable[[M], Grads]) -> tuple[list[float], Grads]:
    """``steps`` AdamW steps; returns the losses and ``grads_of(m)`` after the first backward."""
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
    losses: list[float] = []
    grads: Grads = {}
    for i in range(steps):
        loss = loss_of(_call(m, inputs))
        loss.backward()
        if i == 0:
            grads = grads_of(m)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


class _UnderPolicy(torch.nn.Module):
    """A model run serially under a precision policy: its parameters are ``model``'s, the masters; each step
    computes with their cast copies and the compute copy's buffers."""

    def __init__(self, model: torch.nn.Module, pol: Policy) -> None:
        super().__init__()
        self.pol, self.model = pol, model
        self.work: torch.nn.Module
        object.__setattr__(self, "work", compute_model(model, pol))  # not a submodule: its params are unused

    def forward(self, *args: object, **kwargs: object) -> object:
        params = {k: self.pol.cast(p) for k, p in self.model.named_parameters()}
        state = {**params, **dict(self.work.named_buffers())}
        return torch.func.functional_call(self.work, state, tuple(
            self.pol.cast(a) if isinstance(a, torch.Tensor) else a for a in args), {
            k: self.pol.cast(a) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()})


def train_serial(model: torch.nn.Module, inputs: tuple | dict, steps: int = 3, lr: float = 1e-3,
                 precision: str | None = None) -> Trace:
    """``steps`` AdamW steps of a copy of ``model``; under ``precision`` (``soybean.precision``) as the policy
    trains it: fp32 masters updated by AdamW, compute in the policy's dtype."""
    pol = policy(precision)
    m = copy.deepcopy(model)
    if pol.compute is None:
        losses, grads = _train(m, inputs, steps, lr, _local_grads)
        return Trace(losses, grads, {k: p.detach().clone() for k, p in m.named_parameters()},
                     {k: b.clone() for k, b in m.named_buffers()})
    run = _UnderPolicy(m, pol)
    losses, grads = _train(run, inputs, steps, lr, lambda r: _local_grads(r.model))
    return Trace(losses, grads, {k: p.detach().clone() for k, p in m.named_parameters()},
                 {k: b.clone() for k, b in run.work.named_buffers()})


def _local_grads(m: torch.nn.Module) -> Grads:
    return {k: p.grad.detach().clone() for k, p in m.named_parameters() if p.grad is not None}


def train_parallel_threads(model: torch.nn.Module, inputs: tuple | dict, plan: Plan | str | None = None, *,
                           devices: int | None = None, mesh: tuple | None = None, mode: str = "auto",
                           objective: str = "time", steps: int = 3, lr: float = 1e-3,
                           precision: str | None = None, collectives: str = "auto",
                           captured: Captured | None = None) -> tuple[Trace, Plan]:
    """Every rank as a thread: parallelize, train ``steps`` steps, gather full grads/params.  ``precision``:
    plan under that policy (a given plan brings its own); ``collectives``: the algorithms' policy
    (``planner.plan``); ``captured``: ``model``'s capture under that policy, made already (a capture of a model
    built alike: its parameters are read from ``model`` by name)."""
    from ..api import parallelize
    from ..capture.core import capture
    from ..planner.core import plan as make_plan

    if isinstance(plan, str):
        plan = Plan.load(plan)
    want = plan.precision if plan is not None else policy(precision).name
    if captured is not None and captured.precision != want:
        raise ValueError(f"captured under {captured.precision!r}, but the run is planned under {want!r}")
    cap = captured if captured is not None else capture(model, inputs, precision=want)
    if plan is None:
        plan = make_plan(None, (), captured=cap, devices=devices or (Mesh(mesh).size if mesh else 1), mesh=mesh,
                         mode=mode, objective=objective, baselines=False, collectives=collectives)
    m_shape = Mesh(tuple(plan.mesh))

    def rank_fn(rank: int, groups: list[Group]) -> Trace:
        return train_parallel(parallelize(model, inputs, plan=plan, rank=rank, groups=groups, captured=cap), model,
                              inputs, steps, lr)

    traces = run_threads(m_shape, rank_fn)
    return traces[0], plan


def train_parallel(pm: ParallelModule, model: torch.nn.Module, inputs: tuple | dict, steps: int, lr: float) -> Trace:
    """This rank's run of ``pm`` (``model`` parallelized): ``steps`` AdamW steps, then the full gradients after the
    first backward and the full parameters and buffers after the last, named as ``model`` names them."""
    losses, grads = _train(pm, inputs, steps, lr, _gather_grads)
    full = pm.full_tensors()
    names = {k for k, _ in model.named_parameters()}
    return Trace(losses, grads, {k: v for k, v in full.items() if k in names},
                 {k: v for k, v in full.items() if k not in names})


def _gather_grads(pm: ParallelModule) -> Grads:
    """Full gradients: swap each local grad in as the tile, gather like a state dict."""
    saved = {k: p.detach().clone() for k, p in pm.named_parameters()}
    got = {k for k, p in pm.named_parameters() if p.grad is not None}  # a frozen or unused one gets none
    with torch.no_grad():
        for _, p in pm.named_parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    full = pm.full_tensors()
    with torch.no_grad():
        for k, p in pm.named_parameters():
            p.copy_(saved[k])
    return {k: v for k, v in full.items() if k in got}


def compare(serial: Trace, parallel: Trace, rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """Mismatches as readable lines (empty when the runs agree to ``rtol``/``atol``)."""
    bad = []
    for i, (a, b) in enumerate(zip(parallel.losses, serial.losses)):
        if abs(a - b) > atol + rtol * abs(b):
            bad.append(f"loss step {i}: {a} != {b}")
    pairs = (("grad", parallel.grads, serial.grads), ("param", parallel.params, serial.params),
             ("buffer", parallel.buffers, serial.buffers))
    for kind, pa, se in pairs:
        for k, v in se.items():
            if k not in pa:
                bad.append(f"{kind} {k} missing")
            elif pa[k].shape != v.shape or not torch.allclose(pa[k].to(v.dtype), v, rtol=rtol, atol=atol):
                diff = (pa[k].double() - v.double()).abs().max().item() if pa[k].shape == v.shape else "shape"
                bad.append(f"{kind} {k}: max diff {diff}")
    return bad
