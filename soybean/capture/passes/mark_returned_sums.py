"""``mark_returned_sums``: the analysis that runs after the passes, whichever were given, marking the values whose
sum over the devices nothing in the program reads (an asynchronous all-reduce where a plan leaves them partial)."""
from __future__ import annotations

from torch import fx

from .common import aten

# A returned sum may be divided or multiplied by a constant (the mean's ``/ count``) before it is returned.
SCALINGS = (aten.div.Tensor, aten.mul.Tensor)
RETURNED_SUM = "soybean_returned_sum"  # the ``node.meta`` key ``mark_returned_sums`` sets


def mark_returned_sums(gm: fx.GraphModule) -> None:
    """Mark (``node.meta[RETURNED_SUM]``) every value whose sum over the devices, where a plan leaves it partial,
    is a returned sum: the value has no other reader, and its reader is the output, or a scaling by a constant
    whose only reader is the output.  Nothing in the program reads such a sum, so a generated program starts its
    all-reduce asynchronously (the scaling moved before it: ``(sum_k x_k) / c = sum_k (x_k / c)``) and it arrives
    while backward runs.  Decided here once: the planning graph prices these reads with the backend's calls
    (``graph.Edge.lazy``) and lowering makes exactly them asynchronous (``codegen.lower._lazy_output_sums``).
    An analysis, not a rewrite: it runs after ``PASSES``, whichever were given."""
    for n in gm.graph.nodes:
        if len(n.users) != 1:
            continue
        (user,) = n.users
        if user.op == "output" or (
            user.target in SCALINGS and len(user.args) == 2 and not user.kwargs and user.args[0] is n
            and isinstance(user.args[1], (int, float)) and len(user.users) == 1
            and next(iter(user.users)).op == "output"
        ):
            n.meta[RETURNED_SUM] = True
