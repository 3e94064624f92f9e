"""Precision policies: the dtype a plan computes in, and the dtype it keeps its master weights in.

* ``fp32``: everything in float32, as the model is built.
* ``bf16-mixed``: forward and backward compute in bfloat16: every floating parameter is cast from its
  float32 master at each step (the cast's backward turns its gradient back to float32), floating
  inputs are cast, activations and the loss are bfloat16.  The master weights, their gradients and
  AdamW's states stay float32.  Gradients are reduced in bfloat16 (the program's collectives move
  bfloat16 values; the bucketed gradient sync casts to bfloat16 for the all-reduce and back), as FSDP's
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``.  Floating buffers (batch
  norm's running statistics) are kept in bfloat16, like the compute copy that updates them.

The plan is captured from the compute copy (``compute_model``), so the planner prices bfloat16
activations and collectives from the graph's own dtypes; the memory model adds the float32 masters
(``Policy.master``).  The serial run of the same policy is ``soybean.verify.testing.train_serial(...,
precision=...)``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Policy:
    name: str
    compute: torch.dtype | None  # floating tensors are computed in this dtype (None: as built)
    master: torch.dtype | None   # parameters are stored and updated in this dtype (None: as built)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the compute dtype when it is floating (differentiable: the gradient comes back cast)."""
        return t.to(self.compute) if self.compute is not None and t.is_floating_point() else t


POLICIES = {"fp32": Policy("fp32", None, None), "bf16-mixed": Policy("bf16-mixed", torch.bfloat16, torch.float32)}


def policy(name: str | None) -> Policy:
    """The policy called ``name`` (``None``: fp32)."""
    if name is None:
        return POLICIES["fp32"]
    if name not in POLICIES:
        raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def compute_model(model: nn.Module, p: Policy) -> nn.Module:
    """The model as the policy computes it: itself, or a copy with floating parameters and buffers cast."""
    return model if p.compute is None else copy.deepcopy(model).to(p.compute)


def compute_inputs(inputs: tuple, p: Policy) -> tuple:
    """The example inputs as the policy feeds them."""
    return tuple(p.cast(x) if isinstance(x, torch.Tensor) else x for x in inputs)


__all__ = ["POLICIES", "Policy", "compute_inputs", "compute_model", "policy"]
