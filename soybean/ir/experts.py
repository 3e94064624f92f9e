"""Routed experts (mixture of experts) as one op, ``soybean::routed_experts``: its serial meaning and its body.

A mixture-of-experts layer routes each token ``t`` to ``k`` experts ``idx[t, j]`` with weights ``w[t, j]``::

    out[t] = sum_j  w[t, j] * FFN_{idx[t, j]}(x[t])

Transformers computes it (``integrations.moe.grouped_mm_experts_forward``) by sorting the ``T k`` (token,
choice) rows by expert, running the experts as grouped matmuls over the sorted rows (``offs``: the running count
of rows per expert), weighting, unsorting and summing over ``j``.  ``capture.passes.fuse_routed_experts`` (a capture
pass) replaces that region of the graph by this op; its ``body`` is the part between the sorted rows and the
weighting (the experts' FFN: grouped matmuls, the gate's activation, optional biases), kept as data so that a
plan, the capture cache and the generated program carry it.  The op is a token-wise map: ``out[t]`` reads only
``x[t]``, ``idx[t]``, ``w[t]`` and the experts' weights, so it runs exactly on any split of the tokens, and on any
split of the experts (dim 0 of every expert weight) where each rank computes the rows routed to its own experts
(``runtime.experts``: the rows moved by all-to-all, or the output left a pending sum).

The body is JSON: ``{"steps": [[target, args, kwargs], ...], "out": ref}``.  A reference ``{"ref": i}`` is value
``i``: ``0`` the sorted rows, ``1`` ``offs``, ``2`` each sorted row's expert (local ids), ``3 ..`` the expert
weights in the op's order, then each step's result.  A target is ``"ns::name.overload"`` (a torch op) or
``"getitem"``; ``{"dtype": name}`` is a dtype.
"""
from __future__ import annotations

import functools
import json
import operator
from collections.abc import Sequence
from typing import Any

import torch

ROUTED_EXPERTS = "routed_experts"  # the synchronised call the op's rule asks for (``runtime.experts``)
GROUPED_MM = ("transformers::grouped_mm_fallback", "aten::_grouped_mm")  # a body's grouped matmuls (their bases)

_lib = torch.library.Library("soybean", "DEF")
_lib.define("routed_experts(Tensor x, Tensor idx, Tensor w, Tensor[] params, int experts, str body) -> Tensor")


def _dtype(name: str) -> torch.dtype:
    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"routed experts' body names dtype {name!r}, which torch does not have")
    return got


@functools.lru_cache(maxsize=64)
def parse_body(body: str) -> tuple[list[tuple[Any, list, dict]], int, torch.dtype]:
    """``body``'s steps with their targets resolved, the output reference and the dtype of ``offs``."""
    spec = json.loads(body)

    def target(name: str) -> Any:
        if name == "getitem":
            return operator.getitem
        ns, rest = name.split("::")
        op, overload = rest.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)

    return ([(target(t), a, k) for t, a, k in spec["steps"]], int(spec["out"]["ref"]),
            _dtype(spec.get("offs_dtype", "int32")))


def run_body(body: str, rows: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor,
             params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts' FFN on ``rows`` sorted by expert (``offs``: running counts; ``ids``: each row's expert,
    local to ``params``, whose dim 0 is the experts)."""
    steps, out, _ = parse_body(body)
    values: list[Any] = [rows, offs, ids, *params]

    def read(a: Any) -> Any:
        if isinstance(a, dict):
            if "ref" in a:
                return values[a["ref"]]
            if "dtype" in a:
                return _dtype(a["dtype"])
            return {k: read(v) for k, v in a.items()}
        if isinstance(a, list):
            return [read(v) for v in a]
        return a

    for fn, args, kwargs in steps:
        values.append(fn(*read(args), **read(kwargs)))
    return values[out]


def expert_rows(rows: torch.Tensor, ids: torch.Tensor, experts: int, params: Sequence[torch.Tensor],
                body: str) -> torch.Tensor:
    """The body on each row for its expert ``ids[i]`` (``0 .. experts - 1``, rows in any order): the rows sorted
    by expert (stably), the grouped body run, the results put back in the rows' order."""
    _, _, offs_dtype = parse_body(body)
    ids_g, perm = torch.sort(ids, stable=True)
    offs = torch.cumsum(torch.bincount(ids_g, minlength=experts), 0).to(offs_dtype)
    got = run_body(body, rows[perm], offs, ids_g, params)
    return got.new_zeros(got.shape).index_copy(0, perm, got)


def combine(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] rows[t k + j]``: the weighted rows of each token summed over its ``k`` choices,
    in choice order (as the serial layer sums them)."""
    t, k = w.shape
    weighted = rows * w.reshape(-1, 1)  # promoted as the serial layer promotes (float32 weights, bf16 rows)
    return weighted.view(t, k, rows.shape[-1]).sum(1)


def routed_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, params: Sequence[torch.Tensor],
                   experts: int, body: str) -> torch.Tensor:
    """The serial op (module docstring): every row through its expert, then ``combine``."""
    k = idx.shape[1]
    rows = x[torch.arange(idx.numel(), device=x.device) // k]
    return combine(expert_rows(rows, idx.reshape(-1), experts, params, body), w)


_lib.impl("routed_experts", routed_experts, "CompositeImplicitAutograd")
OP = torch.ops.soybean.routed_experts.default
